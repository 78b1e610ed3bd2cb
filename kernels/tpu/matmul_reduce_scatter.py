"""Fused matmul + reduce-scatter as one Pallas TPU kernel.

Accumulators travel round the ring inside the kernel (`pltpu.make_async_remote_copy`).
At step `s` a device multiplies its partial product for output segment
`Ring.scatter_segment(me, s, r)` into a staging buffer *while the accumulator from its
neighbour is in flight*, then waits for it, adds, and sends the sum on. After the last
step each device holds the fully reduced segment it owns. The protocol (barrier, two
receive slots per direction, one DMA semaphore per slot, credits) is `_protocol.Link`.

| `scatter` | partial product for segment `seg` | result      |
|-----------|-----------------------------------|-------------|
| `ROWS`    | x[seg rows] @ w          (L, n)   | (M / N, n)  |
| `COLUMNS` | x @ w[:, seg cols]       (M, L)   | (M, n / N)  |

Accumulators (staging buffer, two send buffers and two receive slots per direction) are
in `reduce_dtype`; products accumulate in f32 and each add runs in f32. Both layouts run
natively (column segments are strided windows of the refs). Buffers are all in VMEM for
small problems (ring buffers as scratch) and in HBM otherwise, each step's matmul and add
tiled by `emit_pipeline` (`_tile_plan`). On the tiled path the stationary operand (w for
`ROWS`, x for `COLUMNS`) and the staging buffer stay in VMEM when they fit: the partial
product then never goes to HBM, and the add reads only the received accumulator from it.

`ROWS` also takes w as its transpose `(n, k)` (`w_transposed`), read in place: a layer's
`weight.T` of an `(out, in)` weight needs no copy into `(k, n)` order before the call.

`reference` is the same computation in lax. Collective kernel: call it inside
`jax.shard_map(..., check_vma=False)`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._cost import matmul_cost
from . import _launch, _layout, _protocol, _step_compute, _tile_plan
from ._protocol import segment

ROWS, COLUMNS = "rows", "columns"
SCATTERS = (ROWS, COLUMNS)


@dataclasses.dataclass(frozen=True)
class MatmulReduceScatterParams:
    """Parameters of one fused matmul + reduce-scatter.

    - `scatter`: `ROWS` (the product's rows are scattered) or `COLUMNS` (its columns).
    - `out_dtype`: the result's dtype; `reduce_dtype`: the travelling accumulators'.
    - `launch`: the ring, chip and compilation settings (`_launch.RingLaunch`).
    - `w_transposed` (`ROWS` only): the kernel is given w's transpose, `(n, k)`.
    """

    scatter: str
    out_dtype: Any
    reduce_dtype: Any
    launch: _launch.RingLaunch
    w_transposed: bool = False

    def __post_init__(self):
        _launch.one_of("scatter", self.scatter, SCATTERS)
        if self.w_transposed and self.scatter != ROWS:
            raise ValueError(f"w_transposed: only scatter={ROWS!r} reads w whole; "
                             f"scatter={self.scatter!r} cuts w's columns")


@dataclasses.dataclass(frozen=True)
class _Geometry:
    axis: int  # the output axis cut into segments
    segment: tuple  # one direction's output segment
    out: tuple  # this device's result
    step: tuple  # (rows, contraction, cols) of one direction's step matmul
    stationary: str  # the operand every step reads whole ("x" or "w")


def shapes(params: MatmulReduceScatterParams, x_shape, w_shape) -> _Geometry:
    """The geometry of `params` on local operands of these shapes (ValueError if the
    result does not split into equal segments)."""
    ring = params.launch.ring
    (m, k), (_, n) = x_shape, tuple(w_shape)[::-1] if params.w_transposed else w_shape
    if params.scatter == ROWS:
        rows = ring.split_size(m // ring.size, "each output block")
        return _Geometry(0, (rows, n), (m // ring.size, n), (rows, k, n), "w")
    cols = ring.split_size(n // ring.size, "each output block")
    return _Geometry(1, (m, cols), (m, n // ring.size), (m, k, cols), "x")


def _kernel(refs, *, params, geometry, layout):
    launch = params.launch
    ring, n, nd = launch.ring, launch.ring.size, launch.ring.num_directions
    x, w, out, sendbuf, stage = (refs[k] for k in ("x", "w", "out", "sendbuf", "stage"))
    stationary = _launch.operand(refs, geometry.stationary)
    length = geometry.segment[geometry.axis]
    link, cores = _launch.ring_of(refs, launch, layout)
    # Built for Mosaic: every window is checked against its tiles, naming the chip.
    enforce = launch.chip if launch.for_mosaic else None
    tiles, me = layout.tiles, link.me
    late = launch.broken == _protocol.BROKEN_READ_BEFORE_WAIT
    add_tiles = None if tiles is None else (tiles[0], tiles[2])
    how = dict(cores=layout.cores, enforce=enforce)

    def cut(ref, index, name):
        return segment(ref, index, length, geometry.axis, name, enforce)

    def partial(s, h, dst):
        seg = ring.scatter_segment(me, s, ring.directions[h])
        if params.scatter == ROWS:
            a, b = cut(x, seg, "x"), stationary
        else:
            a, b = stationary, cut(w, seg, "w")
        _step_compute.matmul(a, b, dst, tiles, precision=launch.precision,
                             b_transposed=params.w_transposed, **how)

    def mine(h):  # this device's output: segment me * nd + h, i.e. half h of `out`
        return cut(out, h, "out")

    def step(s, first, last):
        if first:  # the first partial product is the accumulator itself
            for h in range(nd):
                partial(s, h, mine(h) if last else sendbuf.at[h, 0])
            cores.join()

            def send_first():
                for h in range(nd):
                    link.start_send(h, 0, sendbuf.at[h, 0])

            if not last:
                cores.ring(send_first)
            return
        for h in range(nd):  # overlaps the accumulators in flight
            partial(s, h, stage.at[h])

        def wait_accumulators():
            for h in range(nd):
                link.wait_recv(h, s - 1)

        if not late:
            cores.ring(wait_accumulators)
        cores.hand_over()
        for h in range(nd):
            _step_compute.add(stage.at[h], link.received(h, s - 1),
                              mine(h) if last else sendbuf.at[h, s % 2], add_tiles, **how)
        cores.join()

        def finish():
            for h in range(nd):
                if late:
                    link.wait_recv(h, s - 1)
                link.wait_send(h, s - 1, sendbuf.at[h, (s - 1) % 2])
                link.release(h, s - 1)
                if not last:
                    link.start_send(h, s, sendbuf.at[h, s % 2])

        cores.ring(finish)

    _protocol.run_ring(link, cores, n, step)


def windows(params: MatmulReduceScatterParams, x, w) -> list:
    """Every ring-segment window the kernel cuts (`_layout.Window`s), for the layout check
    before it is built (its pipeline tiles are chosen aligned, and checked as built)."""
    geometry = shapes(params, x.shape, w.shape)
    length = geometry.segment[geometry.axis]
    operand = ("x", x.shape, x.dtype) if params.scatter == ROWS else ("w", w.shape, w.dtype)
    cut = [(*operand, geometry.axis), ("out", geometry.out, params.out_dtype, geometry.axis)]
    return _layout.segments(cut, length)


def _ring_buffers(params, geometry):
    nd = params.launch.ring.num_directions
    return {"slots": ((nd, 2, *geometry.segment), params.reduce_dtype),
            "sendbuf": ((nd, 2, *geometry.segment), params.reduce_dtype),
            "stage": ((nd, *geometry.segment), params.reduce_dtype)}


def plan(params: MatmulReduceScatterParams, x, w):
    """`(geometry, StepLayout, reason)`: how the kernel would run on `x`, `w` (arrays or
    `ShapeDtypeStruct`s); the layout is None (with the reason) when no tiling fits."""
    geometry = shapes(params, x.shape, w.shape)
    ring_buffers = _ring_buffers(params, geometry)
    buffers = [(x.shape, x.dtype), (w.shape, w.dtype), (geometry.out, params.out_dtype),
               *ring_buffers.values()]
    stationary = {"x": x, "w": w}[geometry.stationary]
    candidates = [(geometry.stationary + "_resident", stationary.shape, stationary.dtype),
                  ("stage", *ring_buffers["stage"])]
    layout, why = _tile_plan.plan(params.launch, geometry.step, x.dtype, params.reduce_dtype,
                                  buffers, candidates)
    return geometry, layout, why


def matmul_reduce_scatter(x, w, params: MatmulReduceScatterParams):
    """The fused kernel on local operands `x`, `w`: this device's reduced block."""
    geometry, layout, why = plan(params, x, w)
    if layout is None:
        raise _tile_plan.PlanError(why)
    operands = {"x": x, "w": w}
    results, scratch = _launch.place(layout, operands, _ring_buffers(params, geometry),
                                     params.launch.ring)
    outputs = {"out": jax.ShapeDtypeStruct(geometry.out, params.out_dtype), **results}
    # Every step's partial product; the accumulators of all but the last step sent on.
    ring = params.launch.ring
    n = w.shape[0 if params.w_transposed else 1]
    cost = matmul_cost([(x.shape[0], n, x.shape[1])], x.dtype, params.out_dtype,
                       remote_bytes=math.prod(geometry.out)
                       * jnp.dtype(params.reduce_dtype).itemsize * (ring.size - 1))
    return _launch.call(
        f"matmul_reduce_scatter_{params.scatter}",
        functools.partial(_kernel, params=params, geometry=geometry, layout=layout), params.launch,
        layout, operands, outputs, scratch, cost)["out"]


def reference(x, w, params: MatmulReduceScatterParams):
    """What the kernel computes, in lax (inside `shard_map` over `params.launch.axis_name`):
    partial products summed in `reduce_dtype`."""
    w = w.T if params.w_transposed else w
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(params.reduce_dtype)
    axis = 0 if params.scatter == ROWS else 1
    return lax.psum_scatter(y, params.launch.axis_name, scatter_dimension=axis,
                            tiled=True).astype(params.out_dtype)
