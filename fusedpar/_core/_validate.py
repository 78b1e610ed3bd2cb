"""Argument checks shared by the ops: each error names the argument, shapes and what is valid."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _primitives as prims, _quantize
from ._quantized_array import QuantizedArray


def operands(op, x, w):
    """Check x (..., k) and w (k, n) are floating or integer arrays of one dtype."""
    for name, a in (("x", x), ("w", w)):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}.")
    if w.ndim != 2:
        raise ValueError(f"{op}: w must be 2-D (k, n), got w.shape={tuple(w.shape)}.")
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least 1 dimension (..., k), got a scalar.")
    if x.dtype != w.dtype:
        raise TypeError(f"{op}: x and w must have the same dtype, got x {x.dtype} and "
                        f"w {w.dtype}; cast one of them (e.g. w.astype(x.dtype)).")
    # Integers too: the lax expression is defined for them (products accumulate in
    # int32 and wrap as the narrow type would); a kernel that cannot take them says so.
    if not (jnp.issubdtype(x.dtype, jnp.inexact) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"{op}: x and w must be floating point or integer, got {x.dtype}.")


def axis_size(op, axis_name) -> int:
    """Size of mesh axis `axis_name`, which must be bound by an enclosing shard_map."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(a, str) for a in names):
        # lax.axis_size reads a non-string name as a positional axis of nothing.
        raise TypeError(f"{op}: axis_name must be a mesh axis name (a str) or a tuple of "
                        f"them, got {axis_name!r}.")
    if len(set(names)) < len(names):
        raise ValueError(f"{op}: axis_name={axis_name!r} names an axis twice; name each "
                         "mesh axis of the ring once.")
    try:
        size = lax.axis_size(axis_name)
    except NameError:
        mesh = jax.sharding.get_abstract_mesh()
        bound = tuple(getattr(mesh, "manual_axes", ()) or ())
        where = (f"the enclosing shard_map binds {bound}" if bound
                 else "no shard_map is active")
        raise ValueError(
            f"{op}: axis_name={axis_name!r} is not a bound mesh axis ({where}). Call {op} "
            "inside jax.shard_map over a mesh that has this axis, or use the fusedpar "
            "layers, which wrap themselves in shard_map.") from None
    unmeshed = _unmeshed_axes(names)
    if unmeshed:
        # jax.vmap(axis_name=...) or pmap binds it: the rings type their carries by the
        # mesh's varying axes and the backward re-reads the axis where vmap no longer
        # binds it, so no backend runs there end to end.
        raise ValueError(
            f"{op}: axis {unmeshed[0]!r} is not an axis of the mesh in context (jax.vmap or "
            "pmap binds it); the ops run over a jax.shard_map's mesh axes. Call it inside "
            "jax.shard_map, or write lax.all_gather / lax.psum_scatter and the dot "
            "yourself over a vmap axis.")
    return size


def _unmeshed_axes(names) -> tuple:
    """The bound axis `names` that are not axes of the mesh in context: bound by
    `jax.vmap(axis_name=...)` or `pmap`, not by shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in names if a not in (getattr(mesh, "axis_names", ()) or ()))


# What JAX raises when a custom VJP meets forward mode: under jit, and (JAX 0.10, 0.11) in
# an eager shard_map, where its jvp of the custom_vjp call fails on the static config.
_FORWARD_MODE = ("forward-mode autodiff", "unhashable type: 'Unhashable'")


@contextlib.contextmanager
def reverse_mode_only(where: str, why: str):
    """Name the function (`where`) and the fix when forward-mode autodiff meets its custom
    VJP inside (`why`), where JAX's message named neither. Eager calls only: under
    `jax.jit` JAX raises while tracing its own jvp of the program, outside this frame."""
    try:
        yield
    except TypeError as e:
        if not any(s in str(e) for s in _FORWARD_MODE):
            raise
        raise TypeError(
            f"{where}: forward-mode differentiation (jax.jvp, jax.linearize, jax.jacfwd) is "
            f"not supported: {why}, which JAX runs in reverse mode only. Use jax.grad, "
            "jax.vjp or jax.jacrev.") from e


def is_int(v) -> bool:
    """An integer that is not a bool: a Python int or a NumPy one (`np.int64(8)`, what
    arithmetic on NumPy shapes gives, and what `eqx.nn.Linear` accepts)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def normalize_dim(op, dim, ndim, what, valid):
    """Normalise a possibly negative `dim` of a rank-`ndim` array; `valid` lists allowed."""
    if not is_int(dim):
        raise TypeError(f"{op}: dim must be an int, got {dim!r}.")
    dim = int(dim)
    d = dim + ndim if dim < 0 else dim
    if d not in valid:
        allowed = ", ".join(str(v) for v in valid) or "none"
        raise ValueError(f"{op}: dim={dim} is not valid for {what}; valid dims: {allowed}.")
    return d


def contraction(op, x_k, w_k, note=""):
    if x_k != w_k:
        raise ValueError(f"{op}: contracting dimensions differ: x has {x_k}, w has {w_k}{note}.")


def divisible(op, length, by, what, fix):
    if length % by:
        raise ValueError(f"{op}: {what} is {length}, not divisible by {by}; {fix}.")


def boolean(where, name, value):
    """A True/False option."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}.")


def flag(op, name, value):
    """Tri-state options: True, False, or None (the backend's default)."""
    if not (value is None or isinstance(value, bool)):
        raise TypeError(f"{op}: {name} must be True, False or None, got {value!r}.")


def options(op, value):
    """`options`: a dict of the chosen backend's settings, or None."""
    if not (value is None or isinstance(value, Mapping)):
        raise TypeError(f"{op}: options must be a dict of settings such as "
                        f"{{'block_m': 256}}, or None; got {value!r}.")


def float_dtype(op, name, dtype):
    """An optional dtype argument that must be floating (None: the default)."""
    if dtype is None:
        return None
    d = _computed(op, name, dtype, "a floating dtype")
    if not jnp.issubdtype(d, jnp.inexact):
        raise TypeError(f"{op}: {name} must be a floating dtype such as jnp.float32 or "
                        f"jnp.bfloat16, got {d}.")
    return d


def result_dtype(op, dtype, x_dtype):
    """`preferred_element_type` (None: the default): floating, or for integer operands an
    integer at least as wide as theirs too (int8 products summed into int32, as
    `lax.dot_general` allows)."""
    if dtype is None or not jnp.issubdtype(x_dtype, jnp.integer):
        return float_dtype(op, "preferred_element_type", dtype)
    d = _computed(op, "preferred_element_type", dtype, "a floating or integer dtype")
    if jnp.issubdtype(d, jnp.inexact):
        return d
    if not jnp.issubdtype(d, jnp.integer) or jnp.iinfo(d).bits < jnp.iinfo(x_dtype).bits:
        raise TypeError(
            f"{op}: preferred_element_type must be a floating dtype or, for "
            f"{jnp.dtype(x_dtype)} operands, an integer dtype at least as wide (such as "
            f"jnp.int32), got {d}.")
    return d


def _computed(op, name, dtype, what):
    """`dtype` as JAX computes in it: float64 is float32 unless jax_enable_x64 is on
    (jnp.matmul's preferred_element_type does the same)."""
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{op}: {name} must be {what}, got {dtype!r}.") from None
    return np.dtype(jax.dtypes.canonicalize_dtype(d))


def reduce_dtype(op, dtype, x_dtype):
    """`reduce_dtype` (`float_dtype`'s checks), refused where its exponent range is
    narrower than the operands' (`x_dtype`): float16 partial sums of bfloat16 or float32
    operands would overflow to inf where the operands' own products do not."""
    if jnp.issubdtype(x_dtype, jnp.integer):
        return _integer_sums(op, dtype, x_dtype)
    d = float_dtype(op, "reduce_dtype", dtype)
    if d is None or not jnp.issubdtype(x_dtype, jnp.floating):
        return d
    if jnp.finfo(d).maxexp < jnp.finfo(x_dtype).maxexp:  # bfloat16 sums of float32: same range
        raise ValueError(
            f"{op}: reduce_dtype {d} has a narrower range than the operands' {jnp.dtype(x_dtype)} "
            f"(largest value {float(jnp.finfo(d).max):.4g} < "
            f"{float(jnp.finfo(x_dtype).max):.4g}): partial sums could overflow to inf. "
            f"Use jnp.float32, or a dtype of at least {jnp.dtype(x_dtype)}'s range "
            "(jnp.bfloat16 halves the traffic).")
    return d


def _integer_sums(op, dtype, x_dtype):
    """`reduce_dtype` of integer operands: an integer dtype (None: int32, or the
    operands' where wider), whose sums are exact where a float's would round."""
    if dtype is None:
        return None
    d = _computed(op, "reduce_dtype", dtype, "an integer dtype")
    if not jnp.issubdtype(d, jnp.integer):
        raise TypeError(
            f"{op}: reduce_dtype {d} would round the sums of {jnp.dtype(x_dtype)} operands; "
            "integer operands sum in an integer dtype: leave reduce_dtype None (int32) or "
            "pass jnp.int32.")
    return d


def positive_int(where: str, name: str, value, what: str = "") -> int:
    """`value` as a Python int, refused unless a positive integer (a NumPy one too);
    `what` says what it counts, in the message."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int{what}, got {value!r}.")
    return int(value)


def ring_size(op, axis_size, name: str = "axis_size") -> int:
    return positive_int(op, name, axis_size,
                        " (the size of the mesh axis the op runs over)")


def comm_dtypes(op, dtype, **comm) -> None:
    """Refuse a `comm_dtype`/`grad_comm_dtype` (already checked to be a supported narrow
    dtype, or None) for operands of `dtype` that are not real floating point."""
    asked = {name: d for name, d in comm.items() if d is not None}
    if asked and not jnp.issubdtype(dtype, jnp.floating):
        name, d = next(iter(asked.items()))
        raise TypeError(
            f"{op}: {name}={np.dtype(d).name} quantizes the operands it sends (narrow values "
            f"times float32 scales), which is only defined for real floating point inputs; x and "
            f"w are {np.dtype(dtype).name}. Pass {name}=None to send them as they are.")


def _prequantized(op, x, w, gather, comm_dtype):
    """`(w's stand-in for validation, comm_dtype)` for a `w` already quantized.

    A `_quantize.Quantized` w (a stored quantized weight, `fusedpar.QuantizedArray`)
    travels as it is: it must be the gathered operand, `(k, n)` int8/fp8 values with one
    float32 scale per column (scales `(1, n)`), and stands for an array of x's dtype.
    """
    if op != prims.ALL_GATHER_MATMUL or gather != "rhs":
        raise ValueError(f"{op}: a pre-quantized w (values and scales) can only be the "
                         "operand that travels, all_gather_matmul(gather='rhs'); got "
                         f"{op}" + (f"(gather={gather!r})." if op == prims.ALL_GATHER_MATMUL
                                    else "."))
    values, scales = w
    dtype = _quantize.comm_dtype(op, "w.values.dtype", values.dtype)
    if getattr(values, "ndim", None) != 2 or tuple(scales.shape) != (1, values.shape[1]) \
            or scales.dtype != np.float32:
        raise ValueError(f"{op}: a pre-quantized w needs values (k, n) and float32 scales "
                         f"(1, n), one per column; got values {tuple(values.shape)} and "
                         f"scales {tuple(scales.shape)} {scales.dtype}.")
    if comm_dtype is not None and comm_dtype != dtype:
        raise ValueError(f"{op}: w is already quantized to {dtype.name}; comm_dtype must be "
                         f"None or that dtype, got {comm_dtype.name}.")
    return jax.ShapeDtypeStruct(values.shape, x.dtype), dtype


def op_call(op, x, w, n, gather, dim, bidirectional, comm_dtype=None, grad_comm_dtype=None,
            unroll=None, where=None) -> tuple[int, prims.Call, object]:
    """Validate one call of a public op on local operands over a ring of `n` devices:
    the one place its arguments are checked and converted (`explain`, the ops and
    `cost_model.estimate` all come here).

    `w` may be a pre-quantized `_quantize.Quantized`; `comm_dtype`, `grad_comm_dtype` are
    as the caller passed them (converted here to numpy dtypes, or None). Returns the
    normalised `dim`, the `Call` (platform left empty) it becomes, and `grad_comm_dtype`.
    `where`: what errors about the ring's settings name (default: `op`).
    """
    if op not in prims.OPS:
        raise ValueError(f"op must be {prims.ALL_GATHER_MATMUL!r} or "
                         f"{prims.MATMUL_REDUCE_SCATTER!r}, got {op!r}.")
    where = where or op
    flag(where, "unroll", unroll)
    comm_dtype = _quantize.comm_dtype(where, "comm_dtype", comm_dtype)
    grad_comm_dtype = _quantize.comm_dtype(where, "grad_comm_dtype", grad_comm_dtype)
    if isinstance(w, QuantizedArray):  # the layers' weight type, not the ops' payload
        raise TypeError(
            f"{where}: w is a fusedpar.QuantizedArray; the ops take its payload: pass "
            "w.as_payload(), or use the layers, which unwrap their quantized weights.")
    if isinstance(w, _quantize.Quantized):
        w, comm_dtype = _prequantized(op, x, w, gather, comm_dtype)
    operands(op, x, w)
    comm_dtypes(op, x.dtype, comm_dtype=comm_dtype, grad_comm_dtype=grad_comm_dtype)
    flag(op, "bidirectional", bidirectional)
    xs, ws = tuple(x.shape), tuple(w.shape)
    if op == prims.ALL_GATHER_MATMUL:
        if gather not in ("lhs", "rhs"):
            raise ValueError(f"{op}: gather must be 'lhs' or 'rhs', got {gather!r}.")
        if gather == "lhs":
            if x.ndim < 2:
                raise ValueError(f"{op}: gather='lhs' gathers a dimension of x besides the "
                                 f"contracting one, so x needs at least 2 dims (..., rows, k), got "
                                 f"x of shape {xs}; reshape it to (1, {xs[-1]}), or gather "
                                 "w with gather='rhs'.")
            dim = normalize_dim(op, dim, x.ndim, f"gather='lhs' with x of shape {xs} "
                                "(a non-contracting dimension of x)", range(x.ndim - 1))
            contraction(op, xs[-1], ws[0])
        else:
            dim = normalize_dim(op, dim, 2, "gather='rhs' (0: w's contracting rows, 1: "
                                "w's output columns)", range(2))
            k = ws[0] * n if dim == 0 else ws[0]
            contraction(op, xs[-1], k, f" (w gathered along dim {dim} over {n} devices "
                        f"has {k} rows)" if dim == 0 else "")
    else:
        dim = normalize_dim(op, dim, x.ndim, f"the result of shape {xs[:-1] + ws[1:]}",
                            range(x.ndim))
        contraction(op, xs[-1], ws[0])
        size = (xs[:-1] + ws[1:])[dim]
        divisible(op, size, n, f"dim {dim} of the result (shape {xs[:-1] + ws[1:]})",
                  f"it is scattered over {n} devices")
    prim = prims.primitive_of(op, gather, dim, x.ndim)
    call = prims.Call(op, prim, (math.prod(xs[:-1]), xs[-1]), ws, str(np.dtype(x.dtype)), n,
                      target=None, bidirectional=bidirectional, comm_dtype=comm_dtype)
    if bidirectional and call.block_length % 2:
        what = "rows" if prims.of(prim).gather_axis == 0 else "columns"
        raise ValueError(
            f"{op}: bidirectional=True splits each ring block in two, but a block has "
            f"{call.block_length} {what} (primitive {prim}, x {xs}, w {ws}, {n} devices); "
            "use bidirectional=False.")
    return dim, call, grad_comm_dtype
