"""All-gather step kernel (Mosaic GPU): multiply the block in hand into its slice of `out`.

`out` is the gathered result being filled in, aliased in place: each launch writes only
the rows (`axis=0`) or columns (`axis=1`) of its pieces' segments, tile by tile, with TMA
stores at offsets computed from the traced segment indices; nothing else of `out` is
read or written. Two pieces (both halves of a bidirectional ring step) are one launch:
the tile space is pieces x tile rows x tile columns, and the memory warpgroup picks the
piece's operand per tile. With `kept`, the same launch writes the pieces themselves into
their segments of a second buffer (a gather's gathered operand, kept for the backward),
from the shared-memory blocks it loaded to multiply them (`_gemm.emit_gemm`'s `keep`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._kept import check_kept
from .._result_type import result_type
from ..._cost import matmul_cost
from . import _config, _gemm, _precision


def matmul_into(out, pieces, other, segs, *, axis, precision=None, config=None,
                interpret=False, kept=None):
    """`out` with each piece's product written at its segment along `axis`, in place.

    **Arguments:**

    - `out`: the `(R, C)` buffer being filled; the result aliases it (donate it, or
      call inside a loop that carries it, to avoid XLA's defensive copy).
    - `pieces`: one or two blocks of the travelling operand, all the same shape and
      dtype. `axis=0`: row blocks `(mp, k)` of the left operand; `axis=1`: column
      blocks `(k, np)` of the right operand.
    - `other`: the resident operand, `(k, C)` for `axis=0`, `(R, k)` for `axis=1`.
    - `segs`: int32 `(len(pieces),)` segment indices, traced (e.g. from
      `lax.axis_index`): piece `p`'s product goes to rows `[segs[p]*mp, +mp)` (axis 0)
      or columns `[segs[p]*np, +np)` (axis 1). Out-of-range segments are not checked
      (TMA clips the stores at the edge of `out`).
    - `precision`: as for `jnp.dot`; float32 runs as TF32 (XLA's GPU default); float32
      at `Precision.HIGHEST` raises `NotImplementedError` (see `_precision`).
    - `config`: a `GemmConfig`, a dict of overrides of the heuristic's choice, or None.
    - `interpret`: True (Mosaic GPU's interpreter with its default parameters), or an
      `InterpretGPUParams`, to run in interpret mode (CPU).
    - `kept`: None, or the buffer the pieces are gathered into, `(R, k)` for `axis=0`
      (`(k, C)` for `axis=1`) in the pieces' dtype, aliased in place like `out`: piece
      `p` is written at the same segment as its product. Not for float32 column pieces
      (`axis=1`), which TF32 reads transposed.

    **Returns:** the new `out`: products accumulated in float32, stored as `out.dtype`;
    with `kept`, `(out, kept)`.
    """
    pieces = tuple(pieces)
    piece = pieces[0]
    dtype = piece.dtype
    if len(pieces) not in (1, 2):
        raise ValueError(f"matmul_into takes 1 or 2 pieces, got {len(pieces)}")
    if any(p.shape != piece.shape or p.dtype != dtype for p in pieces):
        raise ValueError("matmul_into: all pieces must have one shape and dtype")
    if other.dtype != dtype:
        raise ValueError(f"matmul_into: pieces are {dtype}, other is {other.dtype}")
    if axis == 0:
        (m, k), (k2, n) = piece.shape, other.shape
        if k2 != k or n != out.shape[1] or out.shape[0] % m:
            raise ValueError(f"matmul_into(axis=0): pieces {piece.shape}, other "
                             f"{other.shape}, out {out.shape} do not fit")
    elif axis == 1:
        (m, k), (k2, n) = other.shape, piece.shape
        if k2 != k or m != out.shape[0] or out.shape[1] % n:
            raise ValueError(f"matmul_into(axis=1): pieces {piece.shape}, other "
                             f"{other.shape}, out {out.shape} do not fit")
    else:
        raise ValueError(f"axis must be 0 or 1, got {axis}")
    k_major = _precision.b_must_be_k_major(dtype, precision)
    if kept is not None:
        check_kept(kept, out.shape, k, axis, dtype)
        if not can_keep(dtype, axis):
            raise NotImplementedError(f"matmul_into(axis=1): kept with {dtype} pieces at "
                                      "this precision (read K-major, transposed)")
    cfg = _config_for(config, m, n, (k,), dtype, out.dtype)
    segs = jnp.asarray(segs, jnp.int32).reshape(len(pieces))

    # The B operand(s): K-major (transposed here) for TF32, whose wgmma cannot read an
    # N-major B from shared memory.
    if axis == 0:
        a_ops, b_ops = pieces, (other,)
    else:
        a_ops, b_ops = (other,), pieces
    if k_major:
        b_ops = tuple(b.T for b in b_ops)

    tiles_m, tiles_n = m // cfg.cta_m, n // cfg.cta_n
    num_groups = len(pieces)
    num_ctas = min(cfg.num_sms, num_groups * tiles_m * tiles_n)
    buffers = (out,) if kept is None else (out, kept)
    operands = (segs, *a_ops, *b_ops, *buffers)
    body = functools.partial(
        _body, cfg=cfg, axis=axis, num_a=len(a_ops), num_b=len(b_ops), m=m, n=n,
        k=k, k_major=k_major, in_dtype=dtype, out_dtype=out.dtype, tiles_m=tiles_m,
        tiles_n=tiles_n, num_groups=num_groups, num_ctas=num_ctas, keeps=kept is not None)
    out_types = tuple(result_type(b.shape, b.dtype, *operands) for b in buffers)
    first = len(operands) - len(buffers)
    return _gemm.launch(
        body, cfg, num_ctas=num_ctas, operands=operands,
        out_type=out_types if kept is not None else out_types[0],
        aliases={first + j: j for j in range(len(buffers))}, interpret=interpret,
        name=f"fusedpar_mgpu_matmul_into_{'rows' if axis == 0 else 'cols'}",
        cost_estimate=matmul_cost([(m, n, k)] * len(pieces), dtype, out.dtype))


def can_keep(dtype, axis: int) -> bool:
    """Whether `matmul_into` takes `kept` for pieces of `dtype` along `axis`: row pieces
    (the left operand) always, column pieces in 16-bit dtypes (float32 ones are read
    K-major, transposed, for TF32)."""
    return axis == 0 or jnp.dtype(dtype).itemsize == 2


def _config_for(config, m, n, ks, dtype, out_dtype):
    if isinstance(config, _config.GemmConfig):
        config.check(m, n, ks, dtype, out_dtype)
        return config
    return _config.choose(m, n, ks, dtype, out_dtype, config or ())


def _body(segs_ref, *refs, cfg, axis, num_a, num_b, m, n, k, k_major, in_dtype,
          out_dtype, tiles_m, tiles_n, num_groups, num_ctas, keeps):
    a_refs, b_refs = refs[:num_a], refs[num_a:num_a + num_b]
    # The outputs come last, after the same buffers going in: out (and kept).
    out_ref, kept_ref = (refs[-2], refs[-1]) if keeps else (refs[-1], None)
    tk, cta_m, cta_n = cfg.tile_k, cfg.cta_m, cfg.cta_n

    def pick(refs_, group, fn):
        """`fn(ref)` for the ref of piece `group` (a branch per piece when two)."""
        if len(refs_) == 1:
            fn(refs_[0])
            return
        for q, ref in enumerate(refs_):
            pl.when(group == q)(functools.partial(fn, ref))

    def issue(seg, kk, tile, a_dst, b_dst, barrier):
        del seg
        kk = kk * tk
        rows, cols = pl.ds(tile.i * cta_m, cta_m), pl.ds(tile.j * cta_n, cta_n)
        pick(a_refs, tile.group, lambda r: plgpu.copy_gmem_to_smem(
            r.at[rows, pl.ds(kk, tk)], a_dst, barrier))
        if k_major:
            b_copy = lambda r: plgpu.copy_gmem_to_smem(r.at[cols, pl.ds(kk, tk)], b_dst,
                                                       barrier)
        else:
            b_copy = lambda r: plgpu.copy_gmem_to_smem(r.at[pl.ds(kk, tk), cols], b_dst,
                                                       barrier)
        pick(b_refs, tile.group, b_copy)

    def segment(tile):
        seg = segs_ref[0]
        if num_groups == 2:  # the segment of this tile's piece
            seg = seg + (segs_ref[1] - seg) * tile.group
        return seg

    def out_origin(tile):
        if axis == 0:
            return segment(tile) * m + tile.i * cta_m, tile.j * cta_n
        return tile.i * cta_m, segment(tile) * n + tile.j * cta_n

    def kept_origin(tile, kk):
        """Where step `kk`'s block of the piece goes in `kept`: its segment."""
        if axis == 0:  # A block (cta_m, tk) of rows of the piece
            return segment(tile) * m + tile.i * cta_m, kk * tk
        return kk * tk, segment(tile) * n + tile.j * cta_n  # B block (tk, cta_n)

    _gemm.emit_gemm(cfg, in_dtype=in_dtype, out_dtype=out_dtype, b_k_major=k_major,
                    k_steps=(k // tk,), num_groups=num_groups, tiles_m=tiles_m,
                    tiles_n=tiles_n, num_ctas=num_ctas, issue=issue,
                    out_origin=out_origin, out_ref=out_ref, reduce_add=False,
                    keep=(("a" if axis == 0 else "b"), kept_ref, kept_origin) if keeps else None)
