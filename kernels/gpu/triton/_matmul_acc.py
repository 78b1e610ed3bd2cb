"""Reduce-scatter step kernel (Pallas Triton): `acc_out = acc_in + sum_t a_t[window] @ b_t[window]`.

One pass over the accumulator: each program loads its float32 tile of `acc_in` once,
adds the products into it in registers and stores it once, in place (the result aliases
`acc_in`). The windows let one kernel serve every primitive that accumulates:

- `rs_rows`: the rows of `x` for the output block the accumulator is bound for, times `w`;
- `rs_cols`: `x` times the columns of `w` for that block;
- `ag_contract` (FSDP gather along the contraction): the columns of `x` matching the
  block of `w` in hand, times that block; a bidirectional ring passes both halves as two
  terms of one launch.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..._cost import matmul_cost
from .._result_type import result_type
from .._tile_order import tile_of
from . import _tile_config, _tile_loop


def _kernel(offs_ref, *refs, ks, has_acc, tiles_m, tiles_n, tiles, precision, widen):
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    operand_refs, out_ref = refs[:2 * len(ks)], refs[-1]
    tile = tile_of(pl.program_id(0), tiles_m=tiles_m, tiles_n=tiles_n, group_m=tiles.group_m)
    i, j = tile.i, tile.j
    tile = (pl.ds(pl.multiple_of(i * bm, bm), bm), pl.ds(pl.multiple_of(j * bn, bn), bn))
    if has_acc:  # refs[-2] is acc_in, the same buffer as out_ref
        acc = refs[-2][tile].astype(jnp.float32)
    else:
        acc = jnp.zeros((bm, bn), jnp.float32)
    for t, k in enumerate(ks):
        # Every window offset is a multiple of the block along its axis (the window
        # lengths are), which lets Triton vectorise the loads.
        a_row, a_col, b_row, b_col = (offs_ref[4 * t + c] for c in range(4))
        acc = _tile_loop.tile_product(
            acc, operand_refs[2 * t], pl.multiple_of(a_row + i * bm, bm),
            pl.multiple_of(a_col, bk), operand_refs[2 * t + 1], pl.multiple_of(b_row, bk),
            pl.multiple_of(b_col + j * bn, bn), k=k, block_k=bk, precision=precision,
            widen=widen)
    out_ref[tile] = acc.astype(out_ref.dtype)


def matmul_acc(acc, terms, out_shape, out_dtype, *, precision=None, config=(),
               interpret=False):
    """`acc + sum(term products)` (or the sum alone when `acc` is None), in one pass.

    **Arguments:**

    - `acc`: the `out_shape` accumulator, or None at a ring's first step. It is donated:
      the result aliases it.
    - `terms`: `Term`s, each a window product of shape `out_shape`; all operands share a
      dtype. Window offsets must be multiples of the block along their axis (they are
      multiples of the window length in the ring).
    - `out_shape`, `out_dtype`: the accumulator's shape and dtype (e.g. float32).
    - `precision`, `config`, `interpret`: as for `matmul_into`.

    **Returns:** the new accumulator, summed in float32 and stored as `out_dtype`.
    """
    m, n = out_shape
    if acc is not None and (tuple(acc.shape) != tuple(out_shape)
                            or jnp.dtype(acc.dtype) != jnp.dtype(out_dtype)):
        raise ValueError(f"matmul_acc: acc is {acc.dtype}{list(acc.shape)}, but out_shape="
                         f"{tuple(out_shape)} and out_dtype={jnp.dtype(out_dtype)} (the "
                         "result updates acc in place).")
    dtype = terms[0].a.dtype
    ks = tuple(t.k for t in terms)
    tiles = _tile_config.choose(m, n, min(ks), dtype, config)
    tiles_m, tiles_n = m // tiles.block_m, n // tiles.block_n
    for k in ks:  # the block chosen for the shortest window must divide the others too
        _tile_config.choose(m, n, k, dtype, {**dict(config), "block_k": tiles.block_k})
    kernel = functools.partial(
        _kernel, ks=ks, has_acc=acc is not None, tiles_m=tiles_m, tiles_n=tiles_n,
        tiles=tiles, precision=_tile_loop.dot_precision(precision, dtype),
        widen=bool(interpret))
    offs = jnp.stack([jnp.asarray(o, jnp.int32) for t in terms for o in t.offsets()])
    operands = [x for t in terms for x in (t.a, t.b)]
    extra = {}
    if acc is not None:
        operands.append(acc)
        extra["input_output_aliases"] = {len(operands): 0}  # offs is input 0
    out_struct = result_type(out_shape, out_dtype, offs, *operands)
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct,
        grid=(tiles_m * tiles_n,),
        compiler_params=_tile_loop.compiler_params(tiles),
        interpret=interpret,
        name="fusedpar_matmul_acc",
        cost_estimate=matmul_cost([(m, n, k) for k in ks], dtype, out_dtype,
                                  accumulates=acc is not None),
        **extra,
    )
    return _tile_loop.launch(call, out_struct, interpret, offs, *operands)
