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


def matmul(a, b, o, t, *, prev=None, precision=None):
    """`o = a @ b (+ prev)` over HBM refs, tiled by `t = (bm, bk, bn)`, f32 accumulation."""
    (rows, contraction), cols = a.shape, b.shape[1]
    bm, bk, bn = t
    nk = contraction // bk

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


def add(a, b, o, t):
    """`o = a + b` (in f32, cast to o's dtype) over HBM refs in (bm, bn) tiles."""
    bm, bn = t
    rows, cols = o.shape

    def body(a_t, b_t, o_t):
        o_t[...] = (a_t[...].astype(jnp.float32) + b_t[...].astype(jnp.float32)).astype(o_t.dtype)

    spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    pltpu.emit_pipeline(body, grid=(rows // bm, cols // bn), in_specs=[spec, spec],
                        out_specs=[spec])(a, b, o)
