"""What the two Triton step kernels share: the tile loop, precision, launch.

Both kernels take whole (un-blocked) refs and address them with dynamic offsets read
inside the kernel: where a step's block lies in the output (or in a resident operand)
depends on `lax.axis_index`, which Triton BlockSpec index maps cannot see (the Triton
backend has no scalar prefetch).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .._precision import is_highest


def dot_precision(precision, dtype):
    """The `pl.dot` precision matching `jnp.dot(..., precision=precision)` on GPU.

    XLA multiplies float32 on tensor cores in TF32 unless asked for HIGHEST; Triton's
    default is full float32 (IEEE), 3-8x slower, so map everything else to TF32.
    """
    if jnp.dtype(dtype) != jnp.float32:
        return None
    return lax.Precision.HIGHEST if is_highest(precision) else lax.Precision.DEFAULT


def tile_product(acc, a_ref, a_rows, a_cols, b_ref, b_rows, b_cols, *, k, block_k,
                 precision, widen=False):
    """`acc + a[a_rows:+bm, a_cols:+k] @ b[b_rows:+k, b_cols:+bn]` in float32.

    `acc` is the `(bm, bn)` float32 tile; the contraction runs `block_k` at a time in a
    loop that Triton software-pipelines (`num_stages` loads in flight). `widen` (interpret
    mode on CPU only) multiplies tiles widened to float32: XLA's CPU runtime cannot run a
    bf16 x bf16 -> f32 dot, and widening is exact.
    """
    bm, bn = acc.shape

    def body(t, acc):
        kk = t * block_k if isinstance(t, int) else pl.multiple_of(t * block_k, block_k)
        a = a_ref[pl.ds(a_rows, bm), pl.ds(a_cols + kk, block_k)]
        b = b_ref[pl.ds(b_rows + kk, block_k), pl.ds(b_cols, bn)]
        if widen:
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return acc + pltriton.dot(a, b, precision=precision)

    if k == block_k:  # no loop to pipeline (and a cheaper program in interpret mode)
        return body(0, acc)
    return lax.fori_loop(0, k // block_k, body, acc)


def compiler_params(tiles):
    return pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def launch(call, out_shape, interpret, *operands):
    """`call(*operands)`; in interpret mode through `_interpret` (shard_map-safe)."""
    if interpret:
        from . import _interpret

        return _interpret.interpreted(call, out_shape, *operands)
    return call(*operands)
