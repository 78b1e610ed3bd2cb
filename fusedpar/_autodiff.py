"""Gradients of the primitives: one custom_vjp whose backward runs the dual primitive.

The gradient of an all-gather-matmul with respect to its non-gathered operand is a
matmul-reduce-scatter and vice versa, so the backward pass overlaps its collectives the
same way the forward does, on the same backend — or, when the forward's backend was
picked by `backend="auto"`, on the one the same policy picks for each dual primitive's
own shapes: a forward all-gather whose ring pays can have a gradient reduce-scatter
whose ring does not (on 8 x H100 with per device x (2048, 8192) @ w (8192, 2048),
ag_rows forward on the ring, its rs_rows gradient on the reference).

With `keep_gathered` the forward of an all-gather returns the gathered operand as a
residual and the other gradient is a local matmul; without it, that gradient gathers
again (a second ring, less memory). A reduce-scatter's backward gathers the cotangent
once and, with `keep_gathered`, reuses it.

An ag_rows that `auto` runs product first (a w JAX proves replicated: `_product_first`)
has that module's backward: the cotangent reduce-scattered, both gradients local.

Quantized communication (`comm_dtype`) is straight-through: the backward differentiates
the lax expression on the operand the forward multiplied (the dequantized one, which is
the residual `keep_gathered` keeps), with no gradient through rounding or clipping. The
backward's own collectives send in `grad_comm_dtype` (None: the inputs' dtype). Without
`keep_gathered` the backward gathers the operand again, in `grad_comm_dtype`: its other
gradient then multiplies that operand (unquantized by default), not the forward's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from . import (_backends, _definition, _dispatch, _primitives as prims, _product_first,
               _quantize, cost_model)
from ._vma import cotangent_like


def scope(prim: str, cfg) -> str:
    """The name scope every run of `prim` with `cfg` is traced in, e.g.
    `fusedpar.ag_rows.ring.bidirectional`: compiled programs carry it in each
    instruction's `op_name`, so `fusedpar.aot` can say which op a transfer belongs to
    (a backward pass's runs sit under `transpose(...)`)."""
    if cfg.product_first:  # `_aot` reads the backend as "reference"
        return f"fusedpar.{prim}.reference.product_first"
    if _backends.runs_one_collective(cfg.backend):  # no ring: no direction to name
        return f"fusedpar.{prim}.{cfg.backend}"
    ring = "bidirectional" if cfg.bidirectional else "unidirectional"
    return f"fusedpar.{prim}.{cfg.backend}.{ring}"


def run(prim, cfg, x, w, return_gathered=False):
    """Run `prim` on the configured backend, without custom differentiation."""
    with jax.named_scope(scope(prim, cfg)):
        if cfg.product_first:
            return _product_first.forward(cfg, x, w, return_gathered)
        return _backends.get(cfg.backend).run(prim, cfg, x, w, return_gathered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def apply(prim, cfg, x, w):
    """Run `prim` with the backward pass described above."""
    return run(prim, cfg, x, w)


def _fwd(prim, cfg, x, w):
    # A pre-quantized w keeps its gathered (dequantized) self: it has no transpose to
    # gather again with, and x's gradient needs it.
    # Run product first, the backward needs no gathered operand (`_product_first`).
    if (prim in prims.GATHERS and not cfg.product_first
            and (cfg.keep_gathered or _is_quantized(w))):
        out, gathered = run(prim, cfg, x, w, return_gathered=True)
    else:
        out, gathered = run(prim, cfg, x, w), None
    return out, (x, w, gathered)


def _run_dual(fwd_prim, prim, cfg, x, w, return_gathered=False, beside=None):
    """`run` for the backward pass, checked first like the forward call was.

    The forward's dispatch checked only the forward primitive's shapes; a dual step can
    have other ones (its contraction is the forward's output width, say), which a kernel
    backend may not tile: that is an error here, before any kernel is traced.
    `beside`: the operands of the backward's other gradient matmul, which needs nothing
    this one computes (under "auto" the reference's collective can hide behind it).
    """
    op = prims.ALL_GATHER_MATMUL if fwd_prim in prims.GATHERS else prims.MATMUL_REDUCE_SCATTER
    call = cfg.call(op, prim, x, w, gathered=return_gathered)
    cfg = dataclasses.replace(cfg, product_first=False)  # the forward's, not this run's
    if cfg.auto:  # this primitive's own pick (the ring shape stays the forward's)
        if beside is not None and call.platform not in ("", "cpu"):
            (m, k), (_, n) = beside[0].shape, beside[1].shape
            seconds = cost_model.matmul_seconds(
                m, k, n, call.dtype, cost_model.get_hardware(None, call.target))
            call = dataclasses.replace(call, beside=seconds)
        # `choose` picks only a backend that can run the call.
        choice = _dispatch.choose(call, _dispatch.AUTO, cfg.unroll)
        cfg = dataclasses.replace(cfg, backend=choice.backend,
                                  bidirectional=choice.bidirectional, unroll=choice.unroll,
                                  product_first=choice.product_first)
        return run(prim, cfg, x, w, return_gathered)
    why = _backends.get(cfg.backend).unavailable(call)
    if why is not None:
        raise NotImplementedError(
            f"{op}: the backward pass of {fwd_prim} runs {prim} on local x{call.x_shape} "
            f"w{call.w_shape} ({call.dtype}), which backend {cfg.backend!r} cannot run: "
            f"{why} (the forward pass alone runs on it; backend='ring' runs both).")
    return run(prim, cfg, x, w, return_gathered)


def _local(cfg, a, b, dtype):
    return _definition.matmul(a, b, precision=cfg.precision, out_dtype=dtype)


def _is_quantized(w) -> bool:
    return isinstance(w, _quantize.Quantized)


def _bwd(prim, cfg, res, dy):
    x, w, gathered = res
    if _is_quantized(w):  # a stored quantized weight: x's gradient only
        dx = _local(dataclasses.replace(cfg, out_dtype=x.dtype), dy.astype(x.dtype),
                    gathered.T, x.dtype)
        return cotangent_like(dx, x), None
    # Gradients are computed in the inputs' dtype, accumulating in f32 as the forward does.
    dy = dy.astype(x.dtype)
    # The dual runs send in the backward's comm dtype (and have no backward of their own).
    c = dataclasses.replace(cfg, out_dtype=x.dtype, comm_dtype=cfg.grad_comm_dtype,
                            grad_comm_dtype=None)
    keep = cfg.keep_gathered
    dual = functools.partial(_run_dual, prim)
    # With `keep`, an all-gather's backward is a reduce-scatter and a local matmul that
    # needs nothing the reduce-scatter computes (`beside`).
    if cfg.product_first:  # y = AG_rows(x @ w), w invariant
        dx, dw = _product_first.backward(c, x, w, dy)
    elif prim == prims.AG_ROWS:  # y = AG_rows(x) @ w
        dx = dual(prims.RS_ROWS, c, dy, w.T, beside=(gathered.T, dy) if keep else None)
        dw = _local(c, gathered.T, dy, w.dtype) if keep else dual(prims.AG_CONTRACT, c, dy.T, x).T
    elif prim == prims.AG_COLS:  # y = x @ AG_cols(w)
        dx = _local(c, dy, gathered.T, x.dtype) if keep else dual(prims.AG_CONTRACT, c, dy, w.T)
        dw = dual(prims.RS_COLS, c, x.T, dy, beside=(dy, gathered.T) if keep else None)
    elif prim == prims.AG_CONTRACT:  # y = x @ AG_rows(w)
        dx = _local(c, dy, gathered.T, x.dtype) if keep else dual(prims.AG_COLS, c, dy, w.T)
        dw = dual(prims.RS_ROWS, c, x.T, dy, beside=(dy, gathered.T) if keep else None)
    elif prim == prims.RS_ROWS:  # y = RS_rows(x @ w): dy gathers along rows
        if keep:
            dx, dyg = dual(prims.AG_ROWS, c, dy, w.T, return_gathered=True)
            dw = _local(c, x.T, dyg, w.dtype)
        else:
            dx = dual(prims.AG_ROWS, c, dy, w.T)
            dw = dual(prims.AG_CONTRACT, c, x.T, dy)
    else:  # RS_COLS, y = RS_cols(x @ w): dy gathers along columns
        if keep:
            dw, dyg = dual(prims.AG_COLS, c, x.T, dy, return_gathered=True)
            dx = _local(c, dyg, w.T, x.dtype)
        else:
            dw = dual(prims.AG_COLS, c, x.T, dy)
            dx = dual(prims.AG_CONTRACT, c, w, dy.T).T
    return cotangent_like(dx.astype(x.dtype), x), cotangent_like(dw.astype(w.dtype), w)


apply.defvjp(_fwd, _bwd)
