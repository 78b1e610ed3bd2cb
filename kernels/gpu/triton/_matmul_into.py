"""All-gather step kernel (Pallas Triton): multiply the block in hand, write the product into its slice.

`out` is the gathered result being filled in, aliased in place (`input_output_aliases`):
each step writes only its own rows (`ag_rows`) or columns (`ag_cols`) and the rest of
the buffer is left as it is, so no step copies the output. A bidirectional ring hands
both halves of a step to one launch (one grid over the tiles of both). With `kept`, the
launch also copies the pieces into their segments of the gathered operand, each tile a
share of the blocks it multiplies.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..._cost import matmul_cost
from .._kept import check_kept
from .._result_type import result_type
from .._tile_order import tile_of
from . import _tile_config, _tile_loop


def _kernel(segs_ref, *refs, axis, num_pieces, tiles_m, tiles_n, k, tiles, precision,
            widen, keeps):
    # After the pieces and `other`: the aliased buffers going in, then the same coming out.
    if keeps:
        *piece_refs, other_ref, _, _, out_ref, kept_ref = refs
    else:
        (*piece_refs, other_ref, _, out_ref), kept_ref = refs, None
    bm, bn = tiles.block_m, tiles.block_n
    pid = pl.program_id(0)
    per_piece = tiles_m * tiles_n
    tile = tile_of(pid % per_piece, tiles_m=tiles_m, tiles_n=tiles_n, group_m=tiles.group_m)
    i, j = tile.i, tile.j

    def piece(p):
        # Offset of this piece's product in `out`, along `axis`, from its segment index.
        start = segs_ref[p] * (tiles_m * bm if axis == 0 else tiles_n * bn)
        if axis == 0:  # piece (mp, k) @ other (k, n) -> rows of out
            a_ref, b_ref, rows, cols = piece_refs[p], other_ref, start + i * bm, j * bn
        else:  # other (m, k) @ piece (k, np) -> columns of out
            a_ref, b_ref, rows, cols = other_ref, piece_refs[p], i * bm, start + j * bn
        acc = jnp.zeros((bm, bn), jnp.float32)
        acc = _tile_loop.tile_product(acc, a_ref, i * bm, 0, b_ref, 0, j * bn, k=k,
                                      block_k=tiles.block_k, precision=precision, widen=widen)
        out_ref[pl.ds(pl.multiple_of(rows, bm), bm),
                pl.ds(pl.multiple_of(cols, bn), bn)] = acc.astype(out_ref.dtype)
        if keeps:
            keep(piece_refs[p], rows if axis == 0 else cols)

    def keep(piece_ref, at):
        """This tile's share of the piece into `kept` at `at` (its rows or columns
        there): the `block_k` blocks `t` of its rows (columns) with `t % tiles_n == j`
        (`t % tiles_m == i`), so that each block is copied once, by the tiles that load
        it, spread over them. A copy of its own after the product: storing the blocks
        the product loop loads, inside that software-pipelined loop, gave wrong products
        on an H100 (jax 0.11.2), though right in interpret mode."""
        bk = tiles.block_k
        along, mine = (tiles_n, j) if axis == 0 else (tiles_m, i)
        blocks = k // bk

        def body(u, carry):
            t = mine + u * along

            @pl.when(t < blocks)
            def _():
                kk = pl.multiple_of(t * bk, bk)
                if axis == 0:
                    kept_ref[pl.ds(at, bm), pl.ds(kk, bk)] = piece_ref[pl.ds(i * bm, bm),
                                                                       pl.ds(kk, bk)]
                else:
                    kept_ref[pl.ds(kk, bk), pl.ds(at, bn)] = piece_ref[pl.ds(kk, bk),
                                                                       pl.ds(j * bn, bn)]
            return carry

        lax.fori_loop(0, -(-blocks // along), body, 0)

    if num_pieces == 1:
        piece(0)
    else:  # the first half of the launch computes piece 0, the second piece 1
        lax.cond(pid < per_piece, lambda: piece(0), lambda: piece(1))


def can_keep(dtype, axis: int) -> bool:
    """Whether `matmul_into` takes `kept` for these pieces: always (the kernel stores the
    blocks it loads, in any layout)."""
    del dtype, axis
    return True


def matmul_into(out, pieces, other, segs, *, axis, precision=None, config=(),
                interpret=False, kept=None):
    """`out` with each product written at its segment along `axis`, in place.

    **Arguments:**

    - `out`: the `(R, C)` buffer being filled (donated: the result aliases it).
    - `pieces`: one or two blocks of the travelling operand, all the same shape.
      `axis=0`: row blocks `(mp, k)` of the left operand; `axis=1`: column blocks
      `(k, np)` of the right operand.
    - `other`: the resident operand, `(k, C)` for `axis=0`, `(R, k)` for `axis=1`.
    - `segs`: int32 `(len(pieces),)` segment indices (units of a product along `axis`).
    - `precision`: as for `jnp.dot`; `config`: tile overrides (a mapping or pairs of
      `_tile_config.OPTIONS` fields);
      `interpret`: run in Pallas interpret mode (CPU).
    - `kept`: None, or the buffer the pieces are gathered into, `(R, k)` for `axis=0`
      (`(k, C)` for `axis=1`) in the pieces' dtype, aliased in place like `out`: each
      piece is written at its segment, each tile copying a share of the blocks it
      multiplies after its product.

    **Returns:** `out` with rows `[s*mp, (s+1)*mp)` (axis 0) or columns `[s*np, (s+1)*np)`
    (axis 1) replaced by `piece @ other` / `other @ piece`, computed in float32 and cast
    to `out.dtype`; with `kept`, `(out, kept)`.
    """
    pieces = tuple(pieces)
    piece = pieces[0]
    if axis == 0:
        (mp, k), n = piece.shape, other.shape[1]
        m = mp
    else:
        m, (k, n) = other.shape[0], piece.shape
    if kept is not None:
        check_kept(kept, out.shape, k, axis, piece.dtype)
    tiles = _tile_config.choose(m, n, k, piece.dtype, config)
    tiles_m, tiles_n = m // tiles.block_m, n // tiles.block_n
    kernel = functools.partial(
        _kernel, axis=axis, num_pieces=len(pieces), tiles_m=tiles_m, tiles_n=tiles_n, k=k,
        tiles=tiles, precision=_tile_loop.dot_precision(precision, piece.dtype),
        widen=bool(interpret), keeps=kept is not None)
    out_index = 1 + len(pieces) + 1  # segs, pieces..., other, out (, kept)
    segs = jnp.asarray(segs, jnp.int32)
    buffers = (out,) if kept is None else (out, kept)
    out_shapes = tuple(result_type(b.shape, b.dtype, segs, *pieces, other, *buffers)
                       for b in buffers)
    out_shape = out_shapes if kept is not None else out_shapes[0]
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(len(pieces) * tiles_m * tiles_n,),
        input_output_aliases={out_index + j: j for j in range(len(buffers))},
        compiler_params=_tile_loop.compiler_params(tiles),
        interpret=interpret,
        name=f"fusedpar_matmul_into_{'rows' if axis == 0 else 'cols'}",
        cost_estimate=matmul_cost([(m, n, k)] * len(pieces), piece.dtype, out.dtype),
    )
    return _tile_loop.launch(call, out_shape, interpret, segs, *pieces, other, *buffers)
