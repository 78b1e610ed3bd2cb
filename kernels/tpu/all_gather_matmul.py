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
`ROWS` also takes w as its transpose `(n, K)` (`w_transposed`): a layer's `weight.T` of
an `(out, in)` weight is then read in place, each step multiplying by its rows, where
XLA would otherwise copy it into `(K, n)` order before the call.
A bidirectional `COLUMNS` ring first copies this device's two column halves into a
contiguous buffer (`outbox`) with local DMAs, so every remote DMA sends a contiguous
block. Buffers are all in VMEM for small problems (ring slots and the f32 sum as scratch)
and in HBM otherwise, each step's matmul tiled by `emit_pipeline` (`_tile_plan`), with
the stationary operand (w for `ROWS`, x otherwise) and the f32 sum kept in VMEM when they
fit. `return_gathered` also copies every piece into the gathered operand with a local DMA
that runs beside the matmul. A *partner* (`ROWS`, `partner_dtype`) is a second
stationary operand `p` whose rows match the gathered rows: each step also adds
`p[seg rows].T @ piece` (or its transpose, `partner_transposed`) into an f32 sum, kept
in VMEM where it fits, with Mosaic reading `p`'s rows transposed in place. That is an
rs_rows's backward (`fusedpar._core._autodiff`): the cotangent gathered for x's gradient
and the weight gradient `x.T @ gathered` in one kernel, without the gathered cotangent
ever written to HBM whole.

Quantized payloads (`scales` given): the travelling operand is 8-bit values (int8 or
float8_e4m3fn) with float32 scales (`fusedpar._core._quantize`: one per row of x for `ROWS`,
per column of w for `COLUMNS`, per (block, column) for `CONTRACTION`). Both travel, each
by its own remote DMA into its own slots (`_protocol.Link` with two parts); a step widens
the 8-bit piece to the stationary operand's dtype in VMEM (exact), multiplies on the MXU
in f32 and scales the product once (`_step_compute.matmul`). With `return_gathered` the
gathered values and scales are returned (the caller dequantizes).

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
    - `w_transposed` (`ROWS` only): the kernel is given w's transpose, `(n, K)`.
    - `partner_dtype` (`ROWS` only): with a partner operand `p` `(N * m, k2)`, whose rows
      match the gathered rows, the kernel also returns `p.T @ all_gather(x)` `(k2, K)` in
      this dtype (None: no partner): a weight gradient (`x.T @ dy` of an rs_rows whose
      cotangent `dy` this gathers), summed in float32 over the pieces as they arrive, so
      the gathered operand is never written whole. `partner_transposed`: return that
      product transposed, `all_gather(x).T @ p` `(K, k2)` (a weight gradient in the
      layout of a weight held as `(out, in)`).
    """

    gather: str
    out_dtype: Any
    return_gathered: bool
    launch: _launch.RingLaunch
    w_transposed: bool = False
    partner_dtype: Any = None
    partner_transposed: bool = False

    def __post_init__(self):
        _launch.one_of("gather", self.gather, GATHERS)
        if self.w_transposed and self.gather != ROWS:
            raise ValueError(f"w_transposed: only gather={ROWS!r} reads w in place (its w "
                             f"is stationary); gather={self.gather!r} sends w's blocks")
        if self.partner_dtype is not None and self.gather != ROWS:
            raise ValueError(f"partner_dtype: only gather={ROWS!r} multiplies a partner "
                             f"by the pieces it gathers, not gather={self.gather!r}")


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """The geometry of one call: which operand travels and how a step cuts it."""

    travelling: str  # "x" or "w"
    axis: int  # the travelling operand's axis cut into ring blocks
    piece: tuple  # one direction's piece of a block
    out: tuple  # the result
    step: tuple  # (rows, contraction, cols) of one direction's step matmul
    stationary: str  # the operand every step reads whole ("x" or "w")

    @property
    def scale_piece(self) -> tuple:
        """The scales travelling with one piece of quantized values, always a lane-dense
        row: one per row of the piece (`ROWS`: a `(rows, 1)` column would take 128 lanes
        a row in Mosaic's tiles), per column (`COLUMNS`); a `CONTRACTION` block's halves
        share their block's (1, n) scales, which travel whole with each half."""
        rows, cols = self.piece
        return (1, rows) if self.travelling == "x" else (1, cols)

    @property
    def scale_cut(self) -> str:
        """How the kernel's scales are cut into pieces: "leading" (`ROWS`: scales
        `(directions, 1, half)`, a piece per leading index), "lanes" (`COLUMNS`: like the
        values' columns) or "whole" (`CONTRACTION`)."""
        if self.travelling == "x":
            return "leading"
        return "lanes" if self.axis == 1 else "whole"


def shapes(params: AllGatherMatmulParams, x_shape, w_shape) -> _Geometry:
    """The geometry of `params` on local operands of these shapes (ValueError if a
    bidirectional ring cannot halve a block)."""
    ring = params.launch.ring
    (m, k), (kw, n) = x_shape, tuple(w_shape)[::-1] if params.w_transposed else w_shape
    if params.gather == ROWS:
        half = ring.split_size(m, "the travelling block")
        return _Geometry("x", 0, (half, k), (ring.size * m, n), (half, k, n), "w")
    if params.gather == COLUMNS:
        half = ring.split_size(n, "the travelling block")
        return _Geometry("w", 1, (kw, half), (m, ring.size * n), (m, k, half), "x")
    half = ring.split_size(kw, "the travelling block")
    return _Geometry("w", 0, (half, n), (m, n), (m, half, n), "x")


def _kernel(refs, *, params, geometry, layout, quantized):
    launch = params.launch
    ring, n, nd = launch.ring, launch.ring.size, launch.ring.num_directions
    # Built for Mosaic: every window is checked against its tiles, naming the chip.
    enforce, tiles = launch.chip if launch.for_mosaic else None, layout.tiles
    w, out, acc, outbox = (refs.get(k) for k in ("w", "out", "acc", "outbox"))
    partner, partner_out, partner_acc = (refs.get(k) for k in
                                         ("partner", "partner_out", "partner_acc"))
    stationary = _launch.operand(refs, geometry.stationary)
    travelling = refs[geometry.travelling]
    scales = refs.get("scales")
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

    def split(piece):  # (values, scales or None) of a piece, a received slot or a send
        return piece if quantized else (piece, None)

    def compute(piece, seg, first, last):
        piece, scale = split(piece)
        how = dict(precision=launch.precision, cores=layout.cores, enforce=enforce,
                   scale=scale, scale_rows=params.gather == ROWS)
        if params.gather == ROWS:
            _step_compute.matmul(piece, stationary, cut(out, seg, 0, "out"), tiles,
                                 b_transposed=params.w_transposed, **how)
            if partner is not None:  # its f32 sum in `partner_acc`; the last writes out
                rows = cut(partner, seg, 0, "the partner")
                a, b = (piece, rows) if params.partner_transposed else (rows, piece)
                _step_compute.matmul(
                    a, b, partner_out if last else partner_acc, layout.partner_tiles,
                    prev=None if first else partner_acc, a_transposed=True,
                    precision=launch.precision, cores=layout.cores, enforce=enforce)
        elif params.gather == COLUMNS:
            _step_compute.matmul(stationary, piece, cut(out, seg, 1, "out"), tiles, **how)
        else:  # the f32 sum over segments lives in `acc`; the last one writes `out`
            _step_compute.matmul(cut(stationary, seg, 1, "x"), piece, out if last else acc,
                                 tiles, prev=None if first else acc, **how)

    def step(s, first, last):
        if first:
            pieces = [cut(travelling, h, geometry.axis, geometry.travelling) for h in range(nd)]
            outgoing = pieces if outbox is None else [outbox.at[h] for h in range(nd)]
            if quantized:
                own = [{"leading": lambda h: scales.at[h],
                        "lanes": lambda h: cut(scales, h, 1, "the scales"),
                        "whole": lambda h: scales}[geometry.scale_cut](h) for h in range(nd)]
                pieces = list(zip(pieces, own))
                outgoing = list(zip(outgoing, own))
        else:
            pieces = outgoing = [link.received(h, s - 1) for h in range(nd)]

        def gathered_copies(h):  # piece h (and its scales) into the gathered operand
            seg = ring.gather_segment(me, s, ring.directions[h])
            values, scale = split(pieces[h])
            copies = [link.local_copy(h, values, cut(refs["gathered"], seg, geometry.axis,
                                                      "the gathered operand"))]
            if not quantized:
                return copies
            if geometry.scale_cut == "leading":
                dst = refs["gathered_scales"].at[seg]
            elif geometry.scale_cut == "lanes":
                dst = cut(refs["gathered_scales"], seg, 1, "the gathered scales")
            elif h == 0:  # a CONTRACTION block's scales, once (both halves bring them)
                dst = refs["gathered_scales"].at[seg // nd]
            else:
                return copies
            return copies + [link.local_copy(h, scale, dst, part=1)]

        def start():
            if not first and not late:
                for h in range(nd):
                    link.wait_recv(h, s - 1)
            for h in range(nd):
                if not last:  # forward the block in hand before multiplying it
                    link.start_send(h, s, outgoing[h])
                if params.return_gathered:
                    for copy in gathered_copies(h):
                        copy.start()

        def finish():
            for h in range(nd):
                if not first and late:
                    link.wait_recv(h, s - 1)
                if params.return_gathered:
                    for copy in gathered_copies(h):
                        copy.wait()
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


def windows(params: AllGatherMatmulParams, x, w, scales=None, partner=None) -> list:
    """Every ring-segment window the kernel cuts (`_layout.Window`s), for the layout check
    before it is built (its pipeline tiles are chosen aligned, and checked as built).
    `scales`: the travelling operand's, when it is quantized; `partner`: the partner's."""
    geometry = shapes(params, x.shape, w.shape)
    length = geometry.piece[geometry.axis]
    travelling = x if geometry.travelling == "x" else w
    cut = [(geometry.travelling, travelling.shape, travelling.dtype, geometry.axis)]
    if params.gather == CONTRACTION:
        cut.append(("x", x.shape, x.dtype, 1))
    else:
        cut.append(("out", geometry.out, params.out_dtype, geometry.axis))
    outputs = _outputs(params, geometry, travelling, scales, partner)
    if partner is not None:
        cut.append(("the partner", partner.shape, partner.dtype, 0))
    if params.return_gathered:
        g = outputs["gathered"]
        cut.append(("the gathered operand", g.shape, g.dtype, geometry.axis))
    if scales is not None and geometry.scale_cut == "lanes":
        cut.append(("the scales", scales.shape, scales.dtype, 1))
        if params.return_gathered:
            g = outputs["gathered_scales"]
            cut.append(("the gathered scales", g.shape, g.dtype, 1))
    return _layout.segments(cut, length)


def _outputs(params, geometry, travelling, scales=None, partner=None):
    """The kernel's results (the product, and the gathered operand, and its scales when
    quantized, if asked for: `(N * directions, 1, half)` for `ROWS`, a piece's row per
    leading index; `(1, N * n)` for `COLUMNS`; `(N, 1, n)` for `CONTRACTION`, a block's
    scales per leading index; the partner's product `(k2, K)`)."""
    out = {"out": jax.ShapeDtypeStruct(geometry.out, params.out_dtype)}
    if partner is not None:
        out["partner_out"] = jax.ShapeDtypeStruct(_partner_out(params, geometry, partner),
                                                  params.partner_dtype)
    if params.return_gathered:
        n = params.launch.ring.size
        g = list(travelling.shape)
        g[geometry.axis] *= n
        out["gathered"] = jax.ShapeDtypeStruct(tuple(g), travelling.dtype)
        if scales is not None:
            piece = geometry.scale_piece
            g = {"leading": (n * params.launch.ring.num_directions, *piece),
                 "lanes": (1, n * scales.shape[1]),
                 "whole": (n, *scales.shape)}[geometry.scale_cut]
            out["gathered_scales"] = jax.ShapeDtypeStruct(g, scales.dtype)
    return out


def _partner_out(params, geometry, partner) -> tuple:
    """`p.T @ gathered`'s shape, the partner's columns by the travelling piece's (or its
    transpose's)."""
    shape = (partner.shape[1], geometry.piece[1])
    return shape[::-1] if params.partner_transposed else shape


def _partner_step(params, geometry, partner) -> tuple:
    """`(rows, contraction, cols)` of one piece's partner product."""
    rows, cols = _partner_out(params, geometry, partner)
    return (rows, geometry.piece[0], cols)


def _check_partner(params, geometry, partner, scales) -> None:
    """A partner comes with `partner_dtype`, and its rows are the gathered rows."""
    if (partner is None) != (params.partner_dtype is None):
        raise ValueError("a partner operand and partner_dtype come together")
    if partner is None:
        return
    if scales is not None or params.return_gathered:
        raise ValueError("a partner is multiplied by unquantized pieces, with nothing "
                         "gathered returned")
    if len(partner.shape) != 2 or partner.shape[0] != geometry.out[0]:
        raise ValueError(f"the partner must be (gathered rows {geometry.out[0]}, k2), got "
                         f"{tuple(partner.shape)}")


def _ring_buffers(params, geometry, travelling, scales=None, partner=None):
    """Receive slots (and, quantized, slots for the scales); the outbox of a
    bidirectional COLUMNS ring; the f32 running sums (CONTRACTION's, a partner's)."""
    ring = params.launch.ring
    buffers = {"slots": ((ring.num_directions, 2, *geometry.piece), travelling.dtype)}
    if scales is not None:
        buffers["scale_slots"] = ((ring.num_directions, 2, *geometry.scale_piece),
                                  scales.dtype)
    if params.gather == COLUMNS and ring.bidirectional and ring.size > 1:
        buffers["outbox"] = ((ring.num_directions, *geometry.piece), travelling.dtype)
    if params.gather == CONTRACTION and ring.num_segments > 1:
        buffers["acc"] = (geometry.out, jnp.float32)
    if partner is not None and ring.num_segments > 1:
        buffers["partner_acc"] = (_partner_out(params, geometry, partner), jnp.float32)
    return buffers



def _check_scales(geometry, travelling, stationary, scales):
    """A quantized travelling operand: 8-bit values, float32 scales of the right shape, a
    stationary operand of a float dtype the values widen to exactly."""
    if scales is None:
        return
    rows, cols = travelling.shape
    want = (rows, 1) if geometry.travelling == "x" else (1, cols)
    if (jnp.dtype(travelling.dtype).itemsize != 1 or tuple(scales.shape) != want
            or scales.dtype != jnp.float32 or jnp.dtype(stationary.dtype).itemsize < 2):
        raise ValueError(
            f"a quantized {geometry.travelling} must be 8-bit values with float32 scales "
            f"of shape {want}, beside a 16- or 32-bit float {geometry.stationary}; got "
            f"{geometry.travelling} {tuple(travelling.shape)} {travelling.dtype}, scales "
            f"{tuple(scales.shape)} {scales.dtype}, {geometry.stationary} {stationary.dtype}")


def plan(params: AllGatherMatmulParams, x, w, scales=None, partner=None):
    """`(geometry, StepLayout, reason)`: how the kernel would run on `x`, `w` (arrays or
    `ShapeDtypeStruct`s; `scales` those of a quantized travelling operand, `partner` the
    partner's); the layout is None (with the reason) when no tiling fits."""
    geometry = shapes(params, x.shape, w.shape)
    operands = {"x": x, "w": w}
    travelling, stationary = operands[geometry.travelling], operands[geometry.stationary]
    _check_scales(geometry, travelling, stationary, scales)
    _check_partner(params, geometry, partner, scales)
    extra = [a for a in (scales, partner) if a is not None]
    outputs = _outputs(params, geometry, travelling, scales, partner)
    buffers = [(a.shape, a.dtype) for a in (x, w, *extra, *outputs.values())]
    ring_buffers = _ring_buffers(params, geometry, travelling, scales, partner)
    buffers += list(ring_buffers.values())
    candidates = [(geometry.stationary + "_resident", stationary.shape, stationary.dtype)]
    if params.gather == CONTRACTION:
        candidates.append(("acc", geometry.out, jnp.float32))
    if "partner_acc" in ring_buffers:
        candidates.append(("partner_acc",) + ring_buffers["partner_acc"])
    # The steps multiply in the stationary operand's dtype (a quantized piece is widened).
    layout, why = _tile_plan.plan(
        params.launch, geometry.step, stationary.dtype, params.out_dtype, buffers,
        candidates, accumulates=params.gather == CONTRACTION,
        partner=None if partner is None else _partner_step(params, geometry, partner))
    return geometry, layout, why


def all_gather_matmul(x, w, params: AllGatherMatmulParams, scales=None, partner=None):
    """The fused kernel on local operands `x`, `w` (see the module docstring): the product,
    and with `params.return_gathered` also the gathered travelling operand.

    `scales`: the travelling operand is quantized (8-bit values), these are its float32
    scales ((m, 1) for `ROWS`, (1, n) otherwise); the gathered operand is then returned
    as `(values, scales)` (scales (N*m, 1), (1, N*n), or (N, 1, n) for `CONTRACTION`).
    `partner` (`ROWS`, with `params.partner_dtype`): `(N*m, k2)`; the result is then
    `(product, partner.T @ gathered x)` (its transpose with `params.partner_transposed`)."""
    geometry, layout, why = plan(params, x, w, scales, partner)
    if layout is None:
        raise _tile_plan.PlanError(why)
    operands = {"x": x, "w": w}
    travelling = operands[geometry.travelling]
    if scales is not None:
        # Per-row scales travel lane-dense, each direction's half a row of its own.
        operands["scales"] = (scales.reshape(params.launch.ring.num_directions, 1, -1)
                              if geometry.scale_cut == "leading" else scales)
    if partner is not None:
        operands["partner"] = partner
    results, scratch = _launch.place(
        layout, operands, _ring_buffers(params, geometry, travelling, scales, partner),
        params.launch.ring)
    outputs = {**_outputs(params, geometry, travelling, scales, partner), **results}
    ring = params.launch.ring
    (rows, cols), k = geometry.out, x.shape[1]  # x's columns: K, or all k_l blocks of it
    sent = travelling.size * travelling.dtype.itemsize + (0 if scales is None else scales.size * 4)
    products = [(rows, cols, k)]
    if partner is not None:  # (k2, K) summed over the N*m gathered rows
        products.append((partner.shape[1], geometry.piece[1], rows))
    cost = matmul_cost(products, operands[geometry.stationary].dtype,
                       params.out_dtype, remote_bytes=sent * (ring.size - 1))
    results = _launch.call(
        f"all_gather_matmul_{params.gather}",
        functools.partial(_kernel, params=params, geometry=geometry, layout=layout,
                          quantized=scales is not None),
        params.launch, layout, operands, outputs, scratch, cost)
    if partner is not None:
        return results["out"], results["partner_out"]
    if params.return_gathered:
        if scales is not None:
            gathered_scales = results["gathered_scales"]
            if geometry.scale_cut == "leading":  # back to one per row, in order
                gathered_scales = gathered_scales.reshape(-1, 1)
            return results["out"], (results["gathered"], gathered_scales)
        return results["out"], results["gathered"]
    return results["out"]


def reference(x, w, params: AllGatherMatmulParams, scales=None, partner=None):
    """What the kernel computes, in lax (inside `shard_map` over `params.launch.axis_name`).
    With `scales` the travelling operand is dequantized (in the stationary operand's dtype)
    before it is gathered, and the gathered operand returned dequantized; with `partner`,
    `(product, partner.T @ gathered)`."""
    axis = params.launch.axis_name
    if scales is not None:
        if params.gather == ROWS:
            x = (x.astype(jnp.float32) * scales).astype(w.dtype)
        else:
            w = (w.astype(jnp.float32) * scales).astype(x.dtype)
    if params.gather == ROWS:
        gathered = lax.all_gather(x, axis, axis=0, tiled=True)
        out = jnp.dot(gathered, w.T if params.w_transposed else w,
                      preferred_element_type=jnp.float32)
    else:
        gathered = lax.all_gather(w, axis, axis=1 if params.gather == COLUMNS else 0,
                                  tiled=True)
        out = jnp.dot(x, gathered, preferred_element_type=jnp.float32)
    out = out.astype(params.out_dtype)
    if partner is not None:
        a, b = (gathered, partner) if params.partner_transposed else (partner, gathered)
        return out, jnp.dot(a.T, b, preferred_element_type=jnp.float32
                            ).astype(params.partner_dtype)
    return (out, gathered) if params.return_gathered else out
