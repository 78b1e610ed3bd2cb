"""Fused matmul + reduce-scatter as one Pallas TPU kernel (primitives rs_rows, rs_cols).

Accumulators travel round the ring inside the kernel (`pltpu.make_async_remote_copy`).
At step `s` a device multiplies its partial product for output segment
`Ring.scatter_segment(me, s, r)` into a staging buffer *while the accumulator from its
neighbour is in flight*, then waits for it, adds, and sends the sum on. After the last
step each device holds the fully reduced segment it owns. The protocol (barrier, two
receive slots per direction, one DMA semaphore per slot, credits) is `_common.Link`.

| primitive | partial product for segment `seg`     | result        |
|-----------|---------------------------------------|---------------|
| `rs_rows` | x[seg rows] @ w          (L, n)       | (M / N, n)    |
| `rs_cols` | x @ w[:, seg cols]       (M, L)       | (M, n / N)    |

Accumulators (staging buffer, two send buffers and two receive slots per direction) are
in `cfg.reduce_dtype`; products accumulate in f32 and each add runs in f32. Both
primitives run natively (column segments are strided windows of the refs). Buffers are
all in VMEM for small problems and in HBM, with each step's matmul and add tiled by
`emit_pipeline`, otherwise (`_tiling.plan`); the HBM path costs one extra pass over each
accumulator segment (partial product written, then read back for the add), small next to
the matmul's K-fold reuse.

Collective kernel: call it inside `jax.shard_map(..., check_vma=False)`.
"""

from __future__ import annotations


import jax

from fusedpar import _primitives as P
from fusedpar._schedule import Ring

from . import _common, _tiling


def shapes(prim, n, bidirectional, x_shape, w_shape):
    """(segment shape, output axis, matmul dims (rows, contraction, cols)) of one step."""
    ring = Ring(n, bidirectional)
    axis = P.GATHER_AXIS[prim]
    ring.split_size(P.out_shape(prim, x_shape, w_shape, n)[axis], "each output block")
    rows, k, cols = P.step_matmul(prim, x_shape, w_shape, n, ring.num_directions)
    return (rows, cols), axis, (rows, k, cols)


def _kernel(x, w, out, slots, sendbuf, stage, send, recv, local, credit, done, *, prim,
            ring, axis_name, tile, precision, broken):
    axis = P.GATHER_AXIS[prim]
    length = slots.shape[2 + axis]
    link = _common.Link(ring, axis_name, slots, send, recv, local, credit, done, broken)
    me, nd, n = link.me, ring.num_directions, ring.size
    late = broken == _common.BROKEN_READ_BEFORE_WAIT
    add_tile = None if tile is None else (tile[0], tile[2])

    def partial(step, h, dst):
        seg = ring.scatter_segment(me, step, ring.directions[h])
        if prim == P.RS_ROWS:
            _tiling.matmul(_common.segment(x, seg, length, 0), w, dst, tile,
                           precision=precision)
        else:
            _tiling.matmul(x, _common.segment(w, seg, length, 1), dst, tile,
                           precision=precision)

    def mine(h):  # this device's output: segment me * nd + h, i.e. half h of `out`
        return _common.segment(out, h, length, axis)

    def step(s, first, last):
        if first:  # the first partial product is the accumulator itself
            for h in range(nd):
                partial(s, h, mine(h) if last else sendbuf.at[h, 0])
                if not last:
                    link.start_send(h, 0, sendbuf.at[h, 0])
            return
        for h in range(nd):  # overlaps the accumulators in flight
            partial(s, h, stage.at[h])
        if not late:
            for h in range(nd):
                link.wait_recv(h, s - 1)
        for h in range(nd):
            _tiling.add(stage.at[h], link.received(h, s - 1),
                        mine(h) if last else sendbuf.at[h, s % 2], add_tile)
        for h in range(nd):
            if late:
                link.wait_recv(h, s - 1)
            link.wait_send(h, s - 1, sendbuf.at[h, (s - 1) % 2])
            link.release(h, s - 1)
            if not last:
                link.start_send(h, s, sendbuf.at[h, s % 2])

    _common.run_ring(link, n, step)


def buffers(prim, ring, x, w, out_dtype, reduce_dtype):
    """Result shapes of the pallas_call: out, receive slots, send buffers, staging."""
    seg, _, _ = shapes(prim, ring.size, ring.bidirectional, x.shape, w.shape)
    nd = ring.num_directions
    return [jax.ShapeDtypeStruct(P.out_shape(prim, x.shape, w.shape, ring.size), out_dtype),
            jax.ShapeDtypeStruct((nd, 2, *seg), reduce_dtype),
            jax.ShapeDtypeStruct((nd, 2, *seg), reduce_dtype),
            jax.ShapeDtypeStruct((nd, *seg), reduce_dtype)]


def matmul_reduce_scatter(prim, cfg, x, w):
    """Run `prim` (rs_rows or rs_cols) as one fused kernel; see the module docstring."""
    ring = Ring(cfg.axis_size, cfg.bidirectional)
    _, _, dims = shapes(prim, ring.size, ring.bidirectional, x.shape, w.shape)
    out_shapes = buffers(prim, ring, x, w, cfg.out_dtype, cfg.reduce_dtype)
    return _common.launch(_kernel, prim, ring, cfg, dims, out_shapes, x, w)[0]
