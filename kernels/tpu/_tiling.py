"""Tiled per-step compute over HBM refs, and the tile-size heuristic.

Every ring step multiplies whole blocks that may not fit in VMEM (per-device 4096 x 8192
bf16 is 64 MiB; a TPU core has 16-128 MiB of VMEM, a default scoped limit of 16-32 MiB).
So the kernels keep all operands in HBM (`memory_space=pl.ANY`) and run each step's
matmul as a `pltpu.emit_pipeline` over (bm, bk) x (bk, bn) tiles: the pipeline
double-buffers the HBM->VMEM copies of the next tiles behind the current tile's MXU work
and accumulates in an f32 VMEM scratch.

Heuristic (`tiles`): each tile dimension is the whole dimension if it is at most the
target, otherwise the largest divisor of the dimension that is a multiple of the TPU
alignment (8 rows of sublanes, 128 lanes) and at most the target. Targets default to
bm = bn = bk = 512: three bf16 tiles double-buffered plus the f32 accumulator are ~4 MiB
(f32: ~7 MiB), inside every TPU generation's default scoped VMEM, and 512 is a multiple
of both the 128-wide (v5e) and 256-wide (v6e) MXU. Override with the backend options
`block_m`, `block_n`, `block_k` (e.g. `options={"block_m": 256}`).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

DEFAULT_BLOCK = 512
SUBLANES, LANES = 8, 128
# Kernels whose every buffer (operands, result, ring slots) fits in this many bytes keep
# them all in VMEM and multiply whole blocks (no tiling, no HBM<->VMEM copies). Half of
# the smallest default scoped VMEM limit (16 MiB on v5e). Option `vmem`: force True/False.
VMEM_BUDGET = 8 * 2**20


def pick(dim: int, target: int, align: int) -> Optional[int]:
    """The tile length for a dimension of `dim`, or None if no aligned divisor exists."""
    if dim <= target:
        return dim
    for t in range(target - target % align, 0, -align):
        if dim % t == 0:
            return t
    return None


def tiles(cfg, rows: int, contraction: int, cols: int):
    """(bm, bk, bn) for a (rows, contraction) x (contraction, cols) matmul, or a reason."""
    want = {name: int(cfg.option(f"block_{name}", DEFAULT_BLOCK)) for name in "mkn"}
    got = (pick(rows, want["m"], SUBLANES), pick(contraction, want["k"], LANES),
           pick(cols, want["n"], LANES))
    for t, name, dim, align in zip(got, "mkn", (rows, contraction, cols),
                                   (SUBLANES, LANES, LANES)):
        if t is None:
            return None, (
                f"no tile of at most block_{name}={want[name]} divides the dimension of "
                f"length {dim} in steps of {align} (TPU tiles are multiples of (8, 128) "
                f"or whole dimensions); pass options={{'block_{name}': ...}} with a "
                f"divisor of {dim}, or pad the operands")
    return got, None


def plan(cfg, dims, nbytes):
    """How a kernel computes: (True, None) all in VMEM, (False, tiles) tiled from HBM,
    or (None, reason) when no tiling fits. `nbytes`: total bytes of its buffers."""
    vmem = cfg.option("vmem")
    if vmem is None:
        vmem = nbytes <= VMEM_BUDGET
    if vmem:
        return True, None
    t, why = tiles(cfg, *dims)
    return (None, why) if t is None else (False, t)


def matmul(a, b, o, t, *, prev=None, precision=None):
    """`o = a @ b (+ prev)` with f32 accumulation: whole VMEM refs (`t` None), or HBM
    refs tiled by `t = (bm, bk, bn)`."""
    if t is None:
        y = jnp.dot(a[...], b[...], preferred_element_type=jnp.float32, precision=precision)
        if prev is not None:
            y = y + prev[...].astype(jnp.float32)
        o[...] = y.astype(o.dtype)
        return
    (rows, contraction), cols = a.shape, b.shape[1]
    bm, bk, bn = t
    nk = contraction // bk
    if (bm, bk, bn) == (rows, contraction, cols):
        return _whole(a, b, o, prev, precision)

    def body(acc, a_t, b_t, *rest):
        o_t = rest[-1]
        k = pl.program_id(2)

        @pl.when(k == 0)
        def _():
            if prev is None:
                acc[...] = jnp.zeros_like(acc)
            else:
                acc[...] = rest[0][...].astype(jnp.float32)

        acc[...] += jnp.dot(a_t[...], b_t[...], preferred_element_type=jnp.float32,
                            precision=precision)

        @pl.when(k == nk - 1)
        def _():
            o_t[...] = acc[...].astype(o_t.dtype)

    in_specs = [pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))]
    args = [a, b]
    if prev is not None:
        in_specs.append(pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)))
        args.append(prev)

    def scoped(acc):
        pltpu.emit_pipeline(
            functools.partial(body, acc), grid=(rows // bm, cols // bn, nk),
            in_specs=in_specs, out_specs=[pl.BlockSpec((bm, bn), lambda i, j, k: (i, j))],
        )(*args, o)

    pl.run_scoped(scoped, pltpu.VMEM((bm, bn), jnp.float32))


def _whole(a, b, o, prev, precision):
    """One tile: copy the operands into VMEM, multiply, copy the result out."""
    refs = [a, b] + ([] if prev is None else [prev])

    def scoped(*vmem):
        *ins, o_v = vmem
        for src, dst in zip(refs, ins):
            pltpu.sync_copy(src, dst)
        y = jnp.dot(ins[0][...], ins[1][...], preferred_element_type=jnp.float32,
                    precision=precision)
        if prev is not None:
            y = y + ins[2][...].astype(jnp.float32)
        o_v[...] = y.astype(o_v.dtype)
        pltpu.sync_copy(o_v, o)

    pl.run_scoped(scoped, *[pltpu.VMEM(r.shape, r.dtype) for r in refs + [o]])


def add(a, b, o, t):
    """`o = a + b` (in f32, cast to o's dtype): VMEM refs (`t` None) or HBM refs in
    `t = (bm, bn)` tiles."""

    def body(a_t, b_t, o_t):
        o_t[...] = (a_t[...].astype(jnp.float32) + b_t[...].astype(jnp.float32)).astype(o_t.dtype)

    if t is None:
        return body(a, b, o)
    bm, bn = t
    rows, cols = o.shape

    if (bm, bn) == (rows, cols):
        def scoped(a_v, b_v, o_v):
            pltpu.sync_copy(a, a_v)
            pltpu.sync_copy(b, b_v)
            body(a_v, b_v, o_v)
            pltpu.sync_copy(o_v, o)

        pl.run_scoped(scoped, *[pltpu.VMEM(r.shape, r.dtype) for r in (a, b, o)])
        return

    spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    pltpu.emit_pipeline(body, grid=(rows // bm, cols // bn), in_specs=[spec, spec],
                        out_specs=[spec])(a, b, o)
