"""Reduce-scatter step kernel (Mosaic GPU): `acc + sum_t a_t[window] @ b_t[window]`.

One pass over the float32 accumulator: every output tile sums its terms' products in
one wgmma accumulator (in registers), then the epilogue adds the tile into `acc` with a
TMA reduce-add store (`cp.reduce.async.bulk.tensor.add`): each accumulator element is
read once and written once, by the TMA unit, without the compute warpgroups waiting for
a load of `acc`. With `acc=None` (a ring's first step) the tile is stored plainly and
nothing is read. The windows serve every accumulating primitive:

- `rs_rows`: the rows of `x` for the output block, times `w` (`a_row` traced);
- `rs_cols`: `x` times the columns of `w` for that block (`b_col` traced);
- `ag_contract`: the columns of `x` matching the block of `w` in hand (`a_col` traced);
  a bidirectional ring passes both halves as two terms of one launch.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..._cost import matmul_cost
from .._result_type import result_type
from . import _gemm, _precision
from ._matmul_into import _config_for


def matmul_acc(acc, terms, out_shape, out_dtype, *, precision=None, config=None,
               interpret=False):
    """`acc + sum(term products)` (or the sum alone when `acc` is None), in one pass.

    **Arguments:**

    - `acc`: the `out_shape` accumulator of `out_dtype`, or None at a ring's first step.
      The result aliases it (donate it, or carry it through a loop).
    - `terms`: one or more `Term`s (window products of shape `out_shape`); all operands
      share one dtype. Offsets are traced int32 scalars; a window must lie inside its
      operand (TMA zero-fills reads past an operand's edge, it does not fail).
    - `out_shape`, `out_dtype`: the accumulator's. With an accumulator of a 16-bit
      `out_dtype` the reduce-add rounds the tile's sum to it before adding (one more
      rounding than the reference); float32 accumulators (the ring's) are exact to
      float32 rounding order.
    - `precision`, `config`, `interpret`: as for `matmul_into`.

    **Returns:** the new accumulator (float32 sums stored as `out_dtype`).
    """
    terms = tuple(terms)
    if not terms:
        raise ValueError("matmul_acc needs at least one term")
    m, n = out_shape
    out_dtype = jnp.dtype(out_dtype)
    if acc is not None and (tuple(acc.shape) != (m, n) or jnp.dtype(acc.dtype) != out_dtype):
        raise ValueError(f"matmul_acc: acc is {acc.dtype}{list(acc.shape)}, but out_shape="
                         f"{(m, n)} and out_dtype={out_dtype} (the result updates acc in "
                         "place).")
    dtype = terms[0].a.dtype
    for t in terms:
        if t.a.dtype != dtype or t.b.dtype != dtype:
            raise ValueError("matmul_acc: all term operands must share one dtype")
        if t.a.shape[0] < m or t.a.shape[1] < t.k or t.b.shape[0] < t.k or t.b.shape[1] < n:
            raise ValueError(f"matmul_acc: a window ({m}, {t.k}) x ({t.k}, {n}) does not "
                             f"fit operands {t.a.shape} x {t.b.shape}")
    if out_dtype.name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"matmul_acc: out_dtype {out_dtype} is not supported")
    k_major = _precision.b_must_be_k_major(dtype, precision)
    ks = tuple(t.k for t in terms)
    cfg = _config_for(config, m, n, ks, dtype, out_dtype)

    offs = jnp.stack([jnp.asarray(o, jnp.int32) for t in terms for o in t.offsets()])
    operands = [offs]
    for t in terms:
        operands += [t.a, t.b.T if k_major else t.b]
    aliases = {}
    if acc is not None:
        operands.append(acc)
        aliases = {len(operands) - 1: 0}
    tiles_m, tiles_n = m // cfg.cta_m, n // cfg.cta_n
    num_ctas = min(cfg.num_sms, tiles_m * tiles_n)
    body = functools.partial(
        _body, cfg=cfg, ks=ks, k_major=k_major, in_dtype=dtype, out_dtype=out_dtype,
        tiles_m=tiles_m, tiles_n=tiles_n, num_ctas=num_ctas, has_acc=acc is not None)
    return _gemm.launch(
        body, cfg, num_ctas=num_ctas, operands=tuple(operands),
        out_type=result_type((m, n), out_dtype, *operands), aliases=aliases,
        interpret=interpret, name="fusedpar_mgpu_matmul_acc",
        cost_estimate=matmul_cost([(m, n, k) for k in ks], dtype, out_dtype,
                                  accumulates=acc is not None))


def _body(offs_ref, *refs, cfg, ks, k_major, in_dtype, out_dtype, tiles_m, tiles_n,
          num_ctas, has_acc):
    operand_refs, out_ref = refs[:2 * len(ks)], refs[-1]
    tk, cta_m, cta_n = cfg.tile_k, cfg.cta_m, cfg.cta_n

    def issue(seg, kk, tile, a_dst, b_dst, barrier):
        a_ref, b_ref = operand_refs[2 * seg], operand_refs[2 * seg + 1]
        # Mosaic addresses the operands in units of the shared-memory tiling (8 rows x
        # one swizzle atom), so it must know the offsets are multiples of it: promise
        # what the ring guarantees (multiples of the CTA tile / tile_k).
        a_row, a_col, b_row, b_col = (
            pl.multiple_of(offs_ref[4 * seg + c], mult)
            for c, mult in enumerate((cta_m, tk, tk, cta_n)))
        kk = kk * tk
        plgpu.copy_gmem_to_smem(
            a_ref.at[pl.ds(a_row + tile.i * cta_m, cta_m), pl.ds(a_col + kk, tk)],
            a_dst, barrier)
        cols = pl.ds(b_col + tile.j * cta_n, cta_n)
        if k_major:  # b_ref holds b.T
            src = b_ref.at[cols, pl.ds(b_row + kk, tk)]
        else:
            src = b_ref.at[pl.ds(b_row + kk, tk), cols]
        plgpu.copy_gmem_to_smem(src, b_dst, barrier)

    def out_origin(tile):
        return tile.i * cta_m, tile.j * cta_n

    _gemm.emit_gemm(cfg, in_dtype=in_dtype, out_dtype=out_dtype, b_k_major=k_major,
                    k_steps=tuple(k // tk for k in ks), num_groups=1, tiles_m=tiles_m,
                    tiles_n=tiles_n, num_ctas=num_ctas, issue=issue,
                    out_origin=out_origin, out_ref=out_ref, reduce_add=has_acc)
