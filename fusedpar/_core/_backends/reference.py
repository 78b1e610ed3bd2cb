"""The `"reference"` backend: each primitive as its lax expression (`_definition.py`).

Forward, a primitive is literally `all_gather` then `dot`, or `dot` then `psum_scatter`.

With a `comm_dtype` (`_quantize.py`) it is the oracle of the quantized ops: an all-gather
quantizes its travelling operand on its owner, gathers the values and the scales (so the
compiled program moves the narrow bytes too), dequantizes to the input dtype and
multiplies. A reduce-scatter quantizes each device's partial product once, per row of
each output segment, sends every segment to its owner with `all_to_all` and sums the
dequantized parts (its own part unquantized) in `reduce_dtype`: the lax expression of
`psum_scatter` on quantized partial sums. The ring requantizes its accumulator at every
hop instead, an order-dependent result this backend does not emulate (docs/quantized.md
says why and bounds both errors).
Its gradient comes from the shared custom VJP (`_autodiff.py`) like every backend's, so the
backward's reduce-scatter also sums in `reduce_dtype` (float32 by default): JAX's own
autodiff of a bfloat16 `all_gather` would reduce-scatter the cotangent in bfloat16,
rounding each device's partial sum before adding. The tests' oracle is `_definition`
under JAX's autodiff, which shares no code with the VJP rules.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

from .. import _definition, _primitives as prims, _quantize
from ._backend import Backend

def run(prim, cfg, x, w, return_gathered=False, addend=None):
    """Run `prim` (see `_primitives.py`) as the lax expression it is defined by; a
    reduce-scatter's `addend` is summed in the same `psum_scatter` (`run_adding`)."""
    p = prims.of(prim)
    if cfg.comm_dtype is not None:
        if p.gathers:
            return _quantized_gather(p, cfg, x, w, return_gathered)
        return _quantized_reduce_scatter(p, cfg, x, w)
    if not p.gathers:
        return _definition.matmul_reduce_scatter(
            x, w, cfg.axis_name, dim=p.gather_axis, out_dtype=cfg.out_dtype,
            reduce_dtype=cfg.reduce_dtype, precision=cfg.precision, addend=addend,
            explicit_vmap=cfg.explicit_vmap)
    out = _definition.all_gather_matmul(x, w, cfg.axis_name, gather=p.side,
                                        dim=p.gather_axis, out_dtype=cfg.out_dtype,
                                        precision=cfg.precision)
    if not return_gathered:
        return out
    # The same all_gather as inside the expression: XLA computes it once.
    return out, lax.all_gather(p.travelling(x, w), cfg.axis_name, axis=p.gather_axis,
                               tiled=True)


def run_beside(prim, cfg, x, w, sibling, addend=None, scope=contextlib.nullcontext):
    """`run` of a reduce-scatter `prim`, with its collective beside `sibling`: `(fn,
    operands)`, another matmul of the backward that needs nothing this one computes.
    Returns `(out, fn(*operands))`. `scope()`: the context the op's own work is traced
    in (a name scope), not the sibling's.

    `"auto"` picks the reference for such a call where the reduce-scatter can hide behind
    the sibling (`Call.beside`), but nothing in the program says so, and XLA's scheduler
    may wait for the reduce-scatter with nothing to do and run the sibling after it: in
    an 8 x H100 FSDP x TP block it did with the MLP's input gradient (64 MiB of float32
    partial sums), 125 us exposed. Two optimization barriers (identities) order the three:
    the sibling's operands wait for the partial products, and what reads the scattered
    result waits for the sibling, so the sibling runs while the collective is in flight.
    """
    p = prims.of(prim)
    if p.gathers or cfg.comm_dtype is not None:
        raise ValueError(f"run_beside runs a reduce-scatter in its own dtype, not {prim} "
                         f"with comm_dtype={cfg.comm_dtype}")
    fn, operands = sibling
    with scope():
        y = _definition.partial_products(x, w, reduce_dtype=cfg.reduce_dtype,
                                         precision=cfg.precision, addend=addend)
        y, operands = lax.optimization_barrier((y, operands))
    other = fn(*operands)
    with scope():
        out = _definition.psum_scatter(y, cfg.axis_name, p.gather_axis, cfg.explicit_vmap)
        out, other = lax.optimization_barrier((out, other))
        return out.astype(x.dtype if cfg.out_dtype is None else cfg.out_dtype), other


def _quantized_gather(p, cfg, x, w, return_gathered):
    """Quantize the travelling operand, gather values and scales, dequantize, multiply."""
    axis = p.gather_axis
    q = _quantize.quantized(p.travelling(x, w), cfg.comm_dtype, p.scale_axis)
    q = jax.tree.map(lambda a: lax.all_gather(a, cfg.axis_name, axis=axis, tiled=True), q)
    gathered = _quantize.dequantize(q, x.dtype)
    if p.traveller == "x":
        x = gathered
    else:
        w = gathered
    out = _definition.matmul(x, w, precision=cfg.precision).astype(cfg.out_dtype)
    return (out, gathered) if return_gathered else out


def _quantized_reduce_scatter(p, cfg, x, w):
    """`psum_scatter` of the partial products, each quantized once where it is sent."""
    n, axis = cfg.axis_size, p.gather_axis
    y = _definition.matmul(x, w, precision=cfg.precision).astype(cfg.reduce_dtype)
    # (n, rows, cols): the segment bound for each device, stacked.
    parts = jnp.stack(jnp.split(y, n, axis=axis))
    q = _quantize.quantize(parts, cfg.comm_dtype, 1 + p.scale_axis)
    q = jax.tree.map(lambda a: lax.all_to_all(a, cfg.axis_name, 0, 0, tiled=True), q)
    received = _quantize.dequantize(q, cfg.reduce_dtype)  # [j]: device j's part of mine
    # This device's own part never travels: it is added as computed.
    me = lax.axis_index(cfg.axis_name)
    own = lax.dynamic_index_in_dim(parts, me, 0, keepdims=True)
    mine = jnp.arange(n).reshape(n, 1, 1) == me
    return jnp.sum(jnp.where(mine, own, received), axis=0).astype(cfg.out_dtype)


# The lax expression runs everywhere and reads no options (the record's defaults).
BACKEND = Backend(
    name="reference",
    description="the pure-lax expression: all_gather then dot; dot then psum_scatter",
    run=run, check_vma=True, cost="reference", candidate=True, ring=False,
    run_adding=lambda prim, cfg, x, w, addend: run(prim, cfg, x, w, addend=addend))
