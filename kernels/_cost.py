"""What a kernel tells XLA it costs (`pl.CostEstimate`).

XLA cannot look inside a Pallas kernel: without an estimate its scheduler treats the
custom call as (nearly) free and has no reason to keep a ring's transfer in flight
across it. Every kernel states its matmul flops and the bytes it moves, so a schedule
that overlaps the ring's transfers with the kernels is also the one the scheduler's
cost model prefers. (The TPU compiler reads the estimate; jax 0.10's Mosaic GPU and
Triton lowerings drop it, and there the ring's data dependencies alone place the
transfers: see `fusedpar._core._backends._ring_loop._after`.)
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def matmul_cost(products, in_dtype, out_dtype, *, accumulates=False, remote_bytes=0):
    """The `pl.CostEstimate` of a kernel computing `products`, `(m, n, k)` each.

    Bytes: each product's operand windows read once, its `(m, n)` result written (and
    read first when the kernel `accumulates` onto it); `remote_bytes`: what the kernel
    sends to other devices itself (the TPU ring kernels).
    """
    from jax.experimental import pallas as pl

    flops = sum(2 * m * n * k for m, n, k in products)
    moved = sum(_nbytes((m, k), in_dtype) + _nbytes((k, n), in_dtype)
                + _nbytes((m, n), out_dtype) * (2 if accumulates else 1)
                for m, n, k in products)
    return pl.CostEstimate(flops=int(flops), transcendentals=0, bytes_accessed=int(moved),
                           remote_bytes_transferred=int(remote_bytes))
