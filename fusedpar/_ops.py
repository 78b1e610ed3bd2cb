"""The public ops: validate, pick a backend, canonicalise, run with the shared custom VJP."""

from __future__ import annotations

import math
from typing import Optional

import jax
import numpy as np

from . import _autodiff, _backends, _definition, _primitives as P, _validate
from ._backends import AUTO, Call, Choice
from ._primitives import Config

AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"


def _primitive(op, gather, dim, x_ndim) -> str:
    if op == AGM:
        if gather == "rhs":
            return P.AG_CONTRACT if dim == 0 else P.AG_COLS
        return P.AG_ROWS
    return P.RS_COLS if dim == x_ndim - 1 else P.RS_ROWS


def _check(op, x, w, n, gather, dim, bidirectional):
    """Validate a call; return (normalised dim, Call minus platform)."""
    if op not in (AGM, MRS):
        raise ValueError(f"op must be {AGM!r} or {MRS!r}, got {op!r}.")
    _validate.operands(op, x, w)
    _validate.flag(op, "bidirectional", bidirectional)
    xs, ws = tuple(x.shape), tuple(w.shape)
    if op == AGM:
        if gather not in ("lhs", "rhs"):
            raise ValueError(f"{op}: gather must be 'lhs' or 'rhs', got {gather!r}.")
        if gather == "lhs":
            dim = _validate.dim(op, dim, x.ndim, f"gather='lhs' with x of shape {xs} "
                                "(a non-contracting dimension of x)", range(x.ndim - 1))
            _validate.contraction(op, xs[-1], ws[0])
        else:
            dim = _validate.dim(op, dim, 2, "gather='rhs' (0: w's contracting rows, 1: "
                                "w's output columns)", range(2))
            k = ws[0] * n if dim == 0 else ws[0]
            _validate.contraction(op, xs[-1], k, f" (w gathered along dim {dim} over {n} "
                                  f"devices has {k} rows)" if dim == 0 else "")
    else:
        dim = _validate.dim(op, dim, x.ndim, f"the result of shape {xs[:-1] + ws[1:]}",
                            range(x.ndim))
        _validate.contraction(op, xs[-1], ws[0])
        size = (xs[:-1] + ws[1:])[dim]
        _validate.divisible(op, size, n, f"dim {dim} of the result (shape "
                            f"{xs[:-1] + ws[1:]})", f"it is scattered over {n} devices")
    prim = _primitive(op, gather, dim, x.ndim)
    call = Call(op, prim, (math.prod(xs[:-1]), xs[-1]), ws, str(np.dtype(x.dtype)), n,
                platform="", bidirectional=bidirectional)
    if bidirectional and call.block_length % 2:
        raise ValueError(
            f"{op}: bidirectional=True splits each ring block in two, but a block has "
            f"{call.block_length} {'rows' if P.GATHER_AXIS[prim] == 0 else 'columns'} "
            f"(primitive {prim}, x {xs}, w {ws}, {n} devices); use bidirectional=False.")
    return dim, call


def _platform() -> str:
    return jax.default_backend()


def explain(op, x, w, axis_size, *, gather="lhs", dim=0, backend=AUTO,
            bidirectional=None, unroll=None, platform=None) -> Choice:
    """Which backend (and ring shape) `op` would use for these local operands, and why.

    `x` and `w` may be arrays or `jax.ShapeDtypeStruct`s with per-device shapes;
    `axis_size` is the size of the mesh axis the op runs over.
    """
    if op not in (AGM, MRS):
        raise ValueError(f"explain: op must be {AGM!r} or {MRS!r}, got {op!r}.")
    _validate.ring_size("explain", axis_size)
    _validate.flag("explain", "unroll", unroll)
    _, call = _check(op, x, w, axis_size, gather, dim, bidirectional)
    call = _with_platform(call, platform or _platform())
    return _backends.choose(call, backend, unroll)


def _with_platform(call, platform):
    import dataclasses

    return dataclasses.replace(call, platform=platform)


def _run(op, x, w, axis_name, gather, dim, backend, bidirectional, unroll, keep_gathered,
         preferred_element_type, reduce_dtype, precision, options):
    n = _validate.axis_size(op, axis_name)
    dim, call = _check(op, x, w, n, gather, dim, bidirectional)
    _validate.flag(op, "unroll", unroll)
    if not isinstance(keep_gathered, bool):
        raise TypeError(f"{op}: keep_gathered must be True or False, got {keep_gathered!r}.")
    preferred_element_type = _validate.float_dtype(op, "preferred_element_type",
                                                   preferred_element_type)
    reduce_dtype = _validate.float_dtype(op, "reduce_dtype", reduce_dtype)
    choice = _backends.choose(_with_platform(call, _platform()), backend, unroll)
    _backends.check_options(op, options, backend, choice.backend)
    out_dtype = np.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
    cfg = Config(
        backend=choice.backend, axis_name=axis_name, axis_size=n,
        bidirectional=choice.bidirectional, unroll=choice.unroll, out_dtype=out_dtype,
        reduce_dtype=np.dtype(_definition.accumulation_dtype(x.dtype)
                              if reduce_dtype is None else reduce_dtype),
        precision=precision, keep_gathered=keep_gathered,
        options=tuple(sorted((options or {}).items())))
    c = P.canonicalize(op, gather, dim, x, w, n)
    return c.restore(_autodiff.apply(c.prim, cfg, c.x, c.w))


def all_gather_matmul(x, w, axis_name, *, gather="lhs", dim=0, backend=AUTO,
                      bidirectional: Optional[bool] = None, unroll: Optional[bool] = None,
                      keep_gathered: bool = True, preferred_element_type=None,
                      reduce_dtype=None, precision=None, options: Optional[dict] = None):
    """All-gather one operand over `axis_name` and multiply, overlapping the two.

    Call inside `jax.shard_map` with `axis_name` bound. Equal to

    - `gather="lhs"`: `jnp.matmul(lax.all_gather(x, axis_name, axis=dim, tiled=True), w)`,
      `dim` any non-contracting dimension of `x`;
    - `gather="rhs"`: `jnp.matmul(x, lax.all_gather(w, axis_name, axis=dim, tiled=True))`,
      `dim=0` the contracting rows of `w`, `dim=1` its output columns (the FSDP gather).

    **Arguments:**

    - `x`: local `(..., k)` array; `w`: local `(k, n)` array of the same floating dtype.
    - `backend`: `"auto"`, `"reference"`, `"ring"`, or a registered one (`"pallas"`).
    - `bidirectional`: split each block in halves sent both ways (default: when the ring has
      more than 2 devices and blocks split evenly). `unroll`: unrolled steps, or a
      `fori_loop` (default: unrolled up to 8 devices).
    - `keep_gathered`: the forward keeps the gathered operand for the backward pass
      (default, more memory) instead of gathering it again (more communication).
    - `preferred_element_type`: result dtype (default: the inputs'); products accumulate in
      float32 for bfloat16/float16 inputs. `reduce_dtype`: dtype of the accumulator the
      backward's reduce-scatter sends round the ring (default float32, see
      `matmul_reduce_scatter`). `precision`: passed to every matmul.
    - `options`: backend-specific settings (e.g. kernel tile sizes).

    **Returns:** the product, with `x`'s dim `dim` (lhs) or `w`'s (rhs) `N` times larger.
    """
    return _run(AGM, x, w, axis_name, gather, dim, backend, bidirectional, unroll,
                keep_gathered, preferred_element_type, reduce_dtype, precision, options)


def matmul_reduce_scatter(x, w, axis_name, *, dim=0, backend=AUTO,
                          bidirectional: Optional[bool] = None, unroll: Optional[bool] = None,
                          keep_gathered: bool = True, preferred_element_type=None,
                          reduce_dtype=None, precision=None, options: Optional[dict] = None):
    """Multiply and reduce-scatter the product over `axis_name`, overlapping the two.

    Call inside `jax.shard_map` with `axis_name` bound. Equal to
    `lax.psum_scatter(jnp.matmul(x, w), axis_name, scatter_dimension=dim, tiled=True)`,
    `dim` any dimension of the product, which must divide by the axis size.

    The partial sums travel the ring in `reduce_dtype`: float32 by default, more accurate
    than summing in bfloat16 but twice the bytes per step for bfloat16 inputs; pass
    `reduce_dtype=jnp.bfloat16` to halve the traffic. The other arguments are those of
    `all_gather_matmul`; `keep_gathered` here makes the backward gather the cotangent
    once and reuse it for both gradients.
    """
    return _run(MRS, x, w, axis_name, "lhs", dim, backend, bidirectional, unroll,
                keep_gathered, preferred_element_type, reduce_dtype, precision, options)
