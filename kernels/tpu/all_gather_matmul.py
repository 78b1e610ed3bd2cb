"""Fused all-gather + matmul as one Pallas TPU kernel.

One operand travels round the ring inside the kernel (`pltpu.make_async_remote_copy`);
at each step a device starts sending the block in hand to its neighbour, then multiplies
that block while the DMA is in flight (and the neighbour's block arrives in its slot).
Which block a device holds at each step comes from `Ring.gather_segment`; the protocol
(barrier, two slots per direction, one DMA semaphore per slot, credits) is
`_protocol.Link`.

| `gather`      | travels              | each step                                  |
|---------------|----------------------|--------------------------------------------|
| `ROWS`        | x row blocks (m, K)  | out[seg rows] = piece @ w                  |
| `COLUMNS`     | w col blocks (K, n)  | out[:, seg cols] = x @ piece               |
| `CONTRACTION` | w row blocks (k, n)  | out += x[:, seg cols] @ piece (f32 sum)    |

All three run natively (no transposes): column segments are strided windows of the refs.
A bidirectional `COLUMNS` ring first copies this device's two column halves into a
contiguous buffer (`outbox`) with local DMAs, so every remote DMA sends a contiguous
block. Buffers are all in VMEM for small problems (ring slots and the f32 sum as scratch)
and in HBM otherwise, each step's matmul tiled by `emit_pipeline` (`_tile_plan`), with
the stationary operand (w for `ROWS`, x otherwise) and the f32 sum kept in VMEM when they
fit. `return_gathered` also copies every piece into the gathered operand with a local DMA
that runs beside the matmul.

`reference` is the same computation in lax. Collective kernel: call it inside
`jax.shard_map(..., check_vma=False)`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._cost import matmul_cost
from . import _launch, _layout, _protocol, _step_compute, _tile_plan
from ._protocol import segment

ROWS, COLUMNS, CONTRACTION = "rows", "columns", "contraction"
GATHERS = (ROWS, COLUMNS, CONTRACTION)


@dataclasses.dataclass(frozen=True)
class AllGatherMatmulParams:
    """Parameters of one fused all-gather + matmul.

    - `gather`: `ROWS` (x's row blocks travel, `out = all_gather(x) @ w`), `COLUMNS`
      (w's column blocks, `out = x @ all_gather(w, axis=1)`) or `CONTRACTION` (w's row
      blocks, `out = x @ all_gather(w, axis=0)`).
    - `out_dtype`: the result's dtype (products accumulate in float32).
    - `return_gathered`: also return the gathered travelling operand.
    - `launch`: the ring, chip and compilation settings (`_launch.RingLaunch`).
    """

    gather: str
    out_dtype: Any
    return_gathered: bool
    launch: _launch.RingLaunch

    def __post_init__(self):
        _launch.one_of("gather", self.gather, GATHERS)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """The geometry of one call: which operand travels and how a step cuts it."""

    travelling: str  # "x" or "w"
    axis: int  # the travelling operand's axis cut into ring blocks
    piece: tuple  # one direction's piece of a block
    out: tuple  # the result
    step: tuple  # (rows, contraction, cols) of one direction's step matmul
    stationary: str  # the operand every step reads whole ("x" or "w")


def shapes(params: AllGatherMatmulParams, x_shape, w_shape) -> _Geometry:
    """The geometry of `params` on local operands of these shapes (ValueError if a
    bidirectional ring cannot halve a block)."""
    ring = params.launch.ring
    (m, k), (kw, n) = x_shape, w_shape
    if params.gather == ROWS:
        half = ring.split_size(m, "the travelling block")
        return _Geometry("x", 0, (half, k), (ring.size * m, n), (half, k, n), "w")
    if params.gather == COLUMNS:
        half = ring.split_size(n, "the travelling block")
        return _Geometry("w", 1, (kw, half), (m, ring.size * n), (m, k, half), "x")
    half = ring.split_size(kw, "the travelling block")
    return _Geometry("w", 0, (half, n), (m, n), (m, half, n), "x")


def _kernel(refs, *, params, geometry, layout):
    launch = params.launch
    ring, n, nd = launch.ring, launch.ring.size, launch.ring.num_directions
    # Built for Mosaic: every window is checked against its tiles, naming the chip.
    enforce, tiles = launch.chip if launch.for_mosaic else None, layout.tiles
    w, out, acc, outbox = (refs.get(k) for k in ("w", "out", "acc", "outbox"))
    stationary = _launch.operand(refs, geometry.stationary)
    travelling = refs[geometry.travelling]
    length = geometry.piece[geometry.axis]
    link, cores = _launch.ring_of(refs, launch, layout)
    me = link.me
    late = launch.broken == _protocol.BROKEN_READ_BEFORE_WAIT

    def cut(ref, index, axis, name):
        return segment(ref, index, length, axis, name, enforce)

    if outbox is not None:  # contiguous copies of this device's column halves, to send
        def fill_outbox():
            for h in range(nd):
                copy = link.local_copy(h, cut(w, h, 1, "w"), outbox.at[h])
                copy.start()
                copy.wait()

        cores.ring(fill_outbox)

    def compute(piece, seg, first, last):
        how = dict(precision=launch.precision, cores=layout.cores, enforce=enforce)
        if params.gather == ROWS:
            _step_compute.matmul(piece, stationary, cut(out, seg, 0, "out"), tiles, **how)
        elif params.gather == COLUMNS:
            _step_compute.matmul(stationary, piece, cut(out, seg, 1, "out"), tiles, **how)
        else:  # the f32 sum over segments lives in `acc`; the last one writes `out`
            _step_compute.matmul(cut(stationary, seg, 1, "x"), piece, out if last else acc,
                                 tiles, prev=None if first else acc, **how)

    def step(s, first, last):
        if first:
            pieces = [cut(travelling, h, geometry.axis, geometry.travelling) for h in range(nd)]
            outgoing = pieces if outbox is None else [outbox.at[h] for h in range(nd)]
        else:
            pieces = outgoing = [link.received(h, s - 1) for h in range(nd)]

        def gathered_copy(h):  # piece h into its place in the gathered operand
            seg = ring.gather_segment(me, s, ring.directions[h])
            return link.local_copy(h, pieces[h], cut(refs["gathered"], seg, geometry.axis,
                                                      "the gathered operand"))

        def start():
            if not first and not late:
                for h in range(nd):
                    link.wait_recv(h, s - 1)
            for h in range(nd):
                if not last:  # forward the block in hand before multiplying it
                    link.start_send(h, s, outgoing[h])
                if params.return_gathered:
                    gathered_copy(h).start()

        def finish():
            for h in range(nd):
                if not first and late:
                    link.wait_recv(h, s - 1)
                if params.return_gathered:
                    gathered_copy(h).wait()
                if not last:
                    link.wait_send(h, s, outgoing[h])
                if not first:  # the slot has been multiplied and forwarded
                    link.release(h, s - 1)

        cores.ring(start)
        if not first:
            cores.hand_over()
        for h, r in enumerate(ring.directions):
            compute(pieces[h], ring.gather_segment(me, s, r), first and h == 0,
                    last and h == nd - 1)
        cores.join()
        cores.ring(finish)

    _protocol.run_ring(link, cores, n, step)


def windows(params: AllGatherMatmulParams, x, w) -> list:
    """Every ring-segment window the kernel cuts (`_layout.Window`s), for the layout check
    before it is built (its pipeline tiles are chosen aligned, and checked as built)."""
    geometry = shapes(params, x.shape, w.shape)
    length = geometry.piece[geometry.axis]
    travelling = x if geometry.travelling == "x" else w
    cut = [(geometry.travelling, travelling.shape, travelling.dtype, geometry.axis)]
    if params.gather == CONTRACTION:
        cut.append(("x", x.shape, x.dtype, 1))
    else:
        cut.append(("out", geometry.out, params.out_dtype, geometry.axis))
    if params.return_gathered:
        g = _outputs(params, geometry, travelling)["gathered"]
        cut.append(("the gathered operand", g.shape, g.dtype, geometry.axis))
    return _layout.segments(cut, length)


def _outputs(params, geometry, travelling):
    """The kernel's results (the product, and the gathered operand if asked for)."""
    out = {"out": jax.ShapeDtypeStruct(geometry.out, params.out_dtype)}
    if params.return_gathered:
        g = list(travelling.shape)
        g[geometry.axis] *= params.launch.ring.size
        out["gathered"] = jax.ShapeDtypeStruct(tuple(g), travelling.dtype)
    return out


def _ring_buffers(params, geometry, travelling):
    """Receive slots; the outbox of a bidirectional COLUMNS ring; the f32 running sum."""
    ring = params.launch.ring
    buffers = {"slots": ((ring.num_directions, 2, *geometry.piece), travelling.dtype)}
    if params.gather == COLUMNS and ring.bidirectional and ring.size > 1:
        buffers["outbox"] = ((ring.num_directions, *geometry.piece), travelling.dtype)
    if params.gather == CONTRACTION and ring.num_segments > 1:
        buffers["acc"] = (geometry.out, jnp.float32)
    return buffers



def plan(params: AllGatherMatmulParams, x, w):
    """`(geometry, StepLayout, reason)`: how the kernel would run on `x`, `w` (arrays or
    `ShapeDtypeStruct`s); the layout is None (with the reason) when no tiling fits."""
    geometry = shapes(params, x.shape, w.shape)
    operands = {"x": x, "w": w}
    travelling, stationary = operands[geometry.travelling], operands[geometry.stationary]
    buffers = [(a.shape, a.dtype) for a in (x, w, *_outputs(params, geometry, travelling).values())]
    buffers += list(_ring_buffers(params, geometry, travelling).values())
    candidates = [(geometry.stationary + "_resident", stationary.shape, stationary.dtype)]
    if params.gather == CONTRACTION:
        candidates.append(("acc", geometry.out, jnp.float32))
    layout, why = _tile_plan.plan(params.launch, geometry.step, x.dtype, params.out_dtype, buffers,
                                  candidates, accumulates=params.gather == CONTRACTION)
    return geometry, layout, why


def all_gather_matmul(x, w, params: AllGatherMatmulParams):
    """The fused kernel on local operands `x`, `w` (see the module docstring): the product,
    and with `params.return_gathered` also the gathered travelling operand."""
    geometry, layout, why = plan(params, x, w)
    if layout is None:
        raise _tile_plan.PlanError(why)
    operands = {"x": x, "w": w}
    travelling = operands[geometry.travelling]
    results, scratch = _launch.place(layout, operands,
                                     _ring_buffers(params, geometry, travelling),
                                     params.launch.ring)
    outputs = {**_outputs(params, geometry, travelling), **results}
    ring = params.launch.ring
    (rows, cols), k = geometry.out, x.shape[1]  # x's columns: K, or all k_l blocks of it
    cost = matmul_cost([(rows, cols, k)], x.dtype, params.out_dtype,
                       remote_bytes=travelling.size * travelling.dtype.itemsize
                       * (ring.size - 1))
    results = _launch.call(
        f"all_gather_matmul_{params.gather}",
        functools.partial(_kernel, params=params, geometry=geometry, layout=layout), params.launch,
        layout, operands, outputs, scratch, cost)
    if params.return_gathered:
        return results["out"], results["gathered"]
    return results["out"]


def reference(x, w, params: AllGatherMatmulParams):
    """What the kernel computes, in lax (inside `shard_map` over `params.launch.axis_name`)."""
    axis = params.launch.axis_name
    if params.gather == ROWS:
        gathered = lax.all_gather(x, axis, axis=0, tiled=True)
        out = jnp.dot(gathered, w, preferred_element_type=jnp.float32)
    else:
        gathered = lax.all_gather(w, axis, axis=1 if params.gather == COLUMNS else 0,
                                  tiled=True)
        out = jnp.dot(x, gathered, preferred_element_type=jnp.float32)
    out = out.astype(params.out_dtype)
    return (out, gathered) if params.return_gathered else out
