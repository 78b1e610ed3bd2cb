"""Fused all-gather + matmul as one Pallas TPU kernel (primitives ag_rows, ag_cols, ag_contract).

One operand travels round the ring inside the kernel (`pltpu.make_async_remote_copy`);
at each step a device starts sending the block in hand to its neighbour, then multiplies
that block while the DMA is in flight (and the neighbour's block arrives in its slot).
Which block a device holds at each step comes from `Ring.gather_segment`; the protocol
(barrier, two slots per direction, one DMA semaphore per slot, credits) is `_common.Link`.

| primitive     | travels              | each step                                  |
|---------------|----------------------|--------------------------------------------|
| `ag_rows`     | x row blocks (m, K)  | out[seg rows] = piece @ w                  |
| `ag_cols`     | w col blocks (K, n)  | out[:, seg cols] = x @ piece               |
| `ag_contract` | w row blocks (k, n)  | out += x[:, seg cols] @ piece (f32 buffer) |

All three run natively (no transposes): column segments are strided windows of the refs.
Buffers are all in VMEM for small problems and in HBM, with each step's matmul tiled by
`emit_pipeline`, otherwise (`_tiling.plan`). `return_gathered` also copies every piece
into the gathered operand with a local DMA that runs beside the matmul.

Collective kernel: call it inside `jax.shard_map(..., check_vma=False)`.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from fusedpar import _primitives as P
from fusedpar._schedule import Ring

from . import _common, _tiling


def shapes(prim, n, bidirectional, x_shape, w_shape):
    """(piece shape, travelling axis, matmul dims (rows, contraction, cols)) of one step."""
    ring = Ring(n, bidirectional)
    axis = P.GATHER_AXIS[prim]
    piece = list(x_shape if P.TRAVELLER[prim] == "x" else w_shape)
    piece[axis] = ring.split_size(piece[axis], "the travelling block")
    return tuple(piece), axis, P.step_matmul(prim, x_shape, w_shape, n,
                                             ring.num_directions)


def _kernel(x, w, out, *rest, prim, ring, axis_name, tile, return_gathered, precision,
            broken):
    rest = list(rest)
    gathered = rest.pop(0) if return_gathered else None
    slots = rest.pop(0)
    acc = rest.pop(0) if prim == P.AG_CONTRACT and ring.num_segments > 1 else None
    send, recv, local, credit, done = rest
    travelling = x if P.TRAVELLER[prim] == "x" else w
    axis = P.GATHER_AXIS[prim]
    length = slots.shape[2 + axis]
    link = _common.Link(ring, axis_name, slots, send, recv, local, credit, done, broken)
    me, nd, n = link.me, ring.num_directions, ring.size
    late = broken == _common.BROKEN_READ_BEFORE_WAIT

    def compute(piece, seg, first, last):
        if prim == P.AG_ROWS:
            _tiling.matmul(piece, w, _common.segment(out, seg, length, 0), tile,
                           precision=precision)
        elif prim == P.AG_COLS:
            _tiling.matmul(x, piece, _common.segment(out, seg, length, 1), tile,
                           precision=precision)
        else:  # the f32 sum over segments lives in `acc`; the last one writes `out`
            _tiling.matmul(_common.segment(x, seg, length, 1), piece,
                           out if last else acc, tile,
                           prev=None if first else acc, precision=precision)

    def step(s, first, last):
        pieces = [_common.segment(travelling, h, length, axis) if first
                  else link.received(h, s - 1) for h in range(nd)]
        if not first and not late:
            for h in range(nd):
                link.wait_recv(h, s - 1)
        if not last:  # forward the block in hand before multiplying it
            for h in range(nd):
                link.start_send(h, s, pieces[h])
        copies = []
        for h, r in enumerate(ring.directions):
            seg = ring.gather_segment(me, s, r)
            if return_gathered:
                copies.append(link.local_copy(h, pieces[h],
                                              _common.segment(gathered, seg, length, axis)))
                copies[-1].start()
            compute(pieces[h], seg, first and h == 0, last and h == nd - 1)
        if not first and late:
            for h in range(nd):
                link.wait_recv(h, s - 1)
        for c in copies:
            c.wait()
        if not last:
            for h in range(nd):
                link.wait_send(h, s, pieces[h])
        if not first:  # the slot has been multiplied and forwarded
            for h in range(nd):
                link.release(h, s - 1)

    _common.run_ring(link, n, step)


def buffers(prim, ring, x, w, out_dtype, return_gathered):
    """Result shapes of the pallas_call: out, [gathered], slots, [f32 sum for ag_contract]."""
    piece, axis, _ = shapes(prim, ring.size, ring.bidirectional, x.shape, w.shape)
    travelling = x if P.TRAVELLER[prim] == "x" else w
    out_shape = P.out_shape(prim, x.shape, w.shape, ring.size)
    result = [jax.ShapeDtypeStruct(out_shape, out_dtype)]
    if return_gathered:
        g = list(travelling.shape)
        g[axis] *= ring.size
        result.append(jax.ShapeDtypeStruct(tuple(g), travelling.dtype))
    result.append(jax.ShapeDtypeStruct((ring.num_directions, 2, *piece), travelling.dtype))
    if prim == P.AG_CONTRACT and ring.num_segments > 1:
        result.append(jax.ShapeDtypeStruct(out_shape, jnp.float32))
    return result


def all_gather_matmul(prim, cfg, x, w, return_gathered=False):
    """Run `prim` (ag_rows, ag_cols or ag_contract) as one fused kernel; see module doc."""
    ring = Ring(cfg.axis_size, cfg.bidirectional)
    _, _, dims = shapes(prim, ring.size, ring.bidirectional, x.shape, w.shape)
    out_shapes = buffers(prim, ring, x, w, cfg.out_dtype, return_gathered)
    results = _common.launch(_kernel, prim, ring, cfg, dims, out_shapes, x, w,
                             return_gathered=return_gathered)
    return (results[0], results[1]) if return_gathered else results[0]
