"""Pieces shared by the two step kernels: the program-to-tile map and the tile loop.

Both kernels take whole (un-blocked) refs and address them with dynamic offsets read
inside the kernel: where a step's block lies in the output (or in a resident operand)
depends on `lax.axis_index`, which Triton BlockSpec index maps cannot see (the Triton
backend has no scalar prefetch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fusedpar._vma import varying_axes


def tile_of(pid, tiles_m: int, tiles_n: int, group_m: int):
    """`(i, j)` output tile of program `pid` of a 1-D launch, in groups of `group_m` rows.

    Consecutive programs walk down `group_m` tile rows before moving one tile column
    right, so the programs running at once share the columns of the right operand (and
    rows of the left) in L2 instead of each streaming its own.
    """
    group_m = min(group_m, tiles_m)
    per_group = group_m * tiles_n
    first_m = (pid // per_group) * group_m
    rows = jnp.minimum(tiles_m - first_m, group_m)
    local = pid % per_group
    return first_m + local % rows, local // rows


_FROM_CONFIG = {"highest": lax.Precision.HIGHEST, "float32": lax.Precision.HIGHEST}


def dot_precision(precision, dtype):
    """The `pl.dot` precision matching `jnp.dot(..., precision=precision)` on GPU.

    XLA multiplies float32 on tensor cores in TF32 unless asked for HIGHEST; Triton's
    default is full float32 (IEEE), 3-8x slower, so map None/DEFAULT/HIGH to TF32.
    """
    if jnp.dtype(dtype) != jnp.float32:
        return None
    if isinstance(precision, (tuple, list)):
        precision = max(precision, key=lambda p: lax.Precision(p).value)
    if precision is None:  # what jnp.dot would use: the global default, if one is set
        default = getattr(jax.config, "jax_default_matmul_precision", None)
        precision = _FROM_CONFIG.get(str(default).lower())
    if precision is not None and lax.Precision(precision) == lax.Precision.HIGHEST:
        return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT


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


def out_struct(shape, dtype, *operands):
    """`ShapeDtypeStruct` of a kernel result, varying over every mesh axis its operands do.

    Inside `shard_map(check_vma=True)` pallas_call needs to be told how its result varies.
    """
    varying = frozenset().union(*(varying_axes(o) for o in operands))
    mat = getattr(jax.sharding, "ManualAxisType", None)
    if mat is None:  # earlier JAX spelling
        return jax.ShapeDtypeStruct(shape, dtype, vma=varying)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat(varying=varying))


def compiler_params(tiles):
    return pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def launch(call, out_shape, interpret, *operands):
    """`call(*operands)`; in interpret mode through `_interpret` (shard_map-safe)."""
    if interpret:
        from . import _interpret

        return _interpret.interpreted(call, out_shape, *operands)
    return call(*operands)
