"""The FSDP weight gather as an op: a gather of weight shards, sent as they are or
quantized, with its backward.

A layer whose ring moves its activations (the sequence-parallel layers) needs its whole
weight before the matmul: `gather` all-gathers the FSDP shards, overlapping nothing (XLA
schedules it beside other work). The gather of a weight whose matmul can overlap it is
`all_gather_matmul(gather="rhs")` instead, with the ops' own backward.

- No `comm_dtype`: `lax.all_gather(w, axis_name, axis=dim, tiled=True)`, whose gradient
  JAX derives (a `psum_scatter` in the weight's dtype).
- With one: each device quantizes its shard with one float32 scale per row (of the shard:
  where FSDP splits the rows' own axis a gathered row has one scale per shard), the gather
  moves values and scales, and the result is dequantized to the weight's dtype, with a
  straight-through gradient (`straight_through`: reduce-scattered to the shard).
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from . import _definition, _quantize


def gather(w, axis_name, dim: int, comm_dtype=None):
    """`w` (a local shard) all-gathered along `dim` over `axis_name`, sent in `comm_dtype`
    (None: `w`'s dtype; else a numpy dtype of `_quantize.COMM_DTYPES`, as the FSDP style
    validated it). Shape: `w`'s with dim `dim` N times longer."""
    if comm_dtype is None:
        return lax.all_gather(w, axis_name, axis=dim, tiled=True)
    q = _quantize.quantize(w, comm_dtype, axis=1)
    g = gather_payload(q, axis_name, dim)
    return straight_through(_quantize.dequantize(g, w.dtype), w, axis_name, dim)


def gather_payload(q, axis_name, dim: int):
    """Every part of a payload (a `Quantized`, or any pytree of arrays) gathered along
    `dim`: what the gather sends."""
    return jax.tree.map(lambda a: lax.all_gather(a, axis_name, axis=dim, tiled=True), q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def straight_through(full, own, axis_name, dim):
    """`full` (a gathered weight, dequantized), differentiated as the gather of `own`
    (this device's shard, or the master a stored QuantizedArray carries): the gradient
    is reduce-scattered to it, straight through the quantization."""
    return full


def _straight_through_fwd(full, own, axis_name, dim):
    return full, None


def _straight_through_bwd(axis_name, dim, _, g):
    return None, _definition.psum_scatter(g, axis_name, dim)


straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)
