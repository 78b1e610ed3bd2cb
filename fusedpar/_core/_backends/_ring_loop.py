"""The ring loops, as a library: a backend gives the steps, these loops move the blocks.

Two loops do all the work. `ring_gather` moves a block round the ring and hands each
piece a device holds to a step function; `ring_reduce_scatter` moves accumulators round
the ring and lets each device add its partial product for the block the accumulator is
for. Which block is where comes from `Ring` (`fusedpar/_core/_schedule.py`, the one source of
the ring arithmetic). `run_steps` runs the five primitives (`_primitives.py`) on these
loops with a backend's step provider (`Steps`): `gather` (what a step of an all-gather
does with the pieces in hand) and `scatter` (what a step of a reduce-scatter adds). The
`ring` backend's steps are lax dots; `pallas_gpu`'s are Pallas GPU kernels. Neither
backend imports the other: both import this module.

A step sends the block it multiplies, so the transfer runs while the matmul does; the
steps are chained through optimization barriers (`_after`) so that XLA can neither merge
the step matmuls into one GEMM after the last transfer nor run the transfers ahead of
them. A reduce-scatter must not make a step's matmul wait for the accumulator in flight:
with `Steps.fold_adds` (the lax ring's) two chunks of each block run half a step apart
and each add folds into the matmul beside the other chunk's transfer
(`_folded_reduce_scatter`); other step providers (and quantized accumulators) compute the
partial product apart from the add of the accumulator that arrives. The compiled
8 x H100 and TPU schedules this gives are checked in tests/test_overlap.py. The ring
visits the devices in the order of the wires when the mesh's devices are known
(`_schedule.ring_for`). `unroll=False` rolls the steps into a `fori_loop` so trace and
compile time stay flat as the ring grows.

With a `comm_dtype` (`_quantize.py`) the loops move `Quantized` payloads, values and
scales. `run_steps` quantizes an all-gather's travelling operand once on its owner; the
pieces travel quantized and are dequantized to the input dtype where a step multiplies
them (int8 and float8_e4m3fn values are exact in bfloat16, so the step dots are the
reference's), which is also what the gathered residual keeps. `ring_reduce_scatter`
requantizes the accumulator at every hop: the sender quantizes its running sum (one
scale per row of the segment), the receiver dequantizes it into `reduce_dtype` and adds
its partial product; the last add is not quantized.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from .. import _definition, _primitives as prims, _quantize
from .._schedule import folds, mesh_coordinates, ring_for
from .._vma import as_varying, axis_names, varying_axes


@dataclasses.dataclass(frozen=True)
class Steps:
    """A backend's step provider: what one ring step computes, for `run_steps`.

    `gather(prim, cfg, x, w)` returns `step(out, pieces, segs) -> out`: one all-gather
    step, every direction's piece with its segment index (one launch for a
    bidirectional step, if the backend likes). `scatter(prim, cfg, x, w)` returns
    `accumulate(acc, seg, length) -> acc` (see `ring_reduce_scatter`).
    `first_product_starts_sum`: an ag_contract step is given `out=None` at step 0 and
    returns its product alone (in the accumulation dtype), rather than adding it to zeros.
    `fold_adds`: a reduce-scatter's `accumulate` is asked for `acc + part` in one call
    (`_folded_reduce_scatter`; its windows are half a direction's block).
    `gather_keeping(prim, cfg, x, w)`: None, or `step(out, gathered, pieces, segs) ->
    (out, gathered)`, a gather step that also writes its pieces into the gathered
    operand (`run_steps(return_gathered=True)`) in the same launch, where the provider
    can (it returns None where it cannot); else each piece is copied in apart (`put`).
    """

    gather: Callable
    scatter: Callable
    first_product_starts_sum: bool = False
    fold_adds: bool = False
    gather_keeping: Optional[Callable] = None


def _loop(cfg, start, stop, body, state):
    """`state = body(i, state)` for i in [start, stop): unrolled, or rolled in fori_loop."""
    if cfg.unroll or stop - start <= 1:
        for i in range(start, stop):
            state = body(i, state)
        return state
    return lax.fori_loop(start, stop, body, state)


def segment(a, index, length, axis):
    """The `length` elements of segment `index` (in units of `length`) along `axis`."""
    return lax.dynamic_slice_in_dim(a, index * length, length, axis)


def put(buf, piece, index, axis):
    """`buf` with `piece` written at segment `index` (units of the piece) along `axis`."""
    return lax.dynamic_update_slice_in_dim(
        buf, piece.astype(buf.dtype), index * piece.shape[axis], axis)


def _ppermute_index(axis_name):
    """Map a ring position to the device number `lax.ppermute` uses, for `axis_name`.

    Ring positions follow `lax.axis_index(axis_name)`, which (like `all_gather` and
    `psum_scatter`) counts a tuple of axes in the tuple's order, first axis major. But
    `ppermute` numbers devices in the mesh's axis order: for a tuple in another order
    (e.g. ("b", "a") on an ("a", "b") mesh) the two differ.
    """
    names = axis_names(axis_name)
    mesh_order = [n for n in jax.sharding.get_abstract_mesh().axis_names if n in names]
    if len(names) == 1 or list(names) == mesh_order:
        return lambda position: position
    sizes = {n: lax.axis_size(n) for n in names}

    def index(position):
        coords = mesh_coordinates(position, sizes)
        number = 0
        for n in mesh_order:
            number = number * sizes[n] + coords[n]
        return number

    return index


def _send(cfg, ring, pieces):
    index = _ppermute_index(cfg.axis_name)
    return tuple(lax.ppermute(p, cfg.axis_name,
                              [(index(s), index(d)) for s, d in ring.permutation(r)])
                 for r, p in zip(ring.directions, pieces))


def _after(values, previous):
    """`(values, previous)`, the values made to depend on `previous` (the last step's
    result) for the compiler. Use both results: XLA may drop a barrier operand whose
    result nobody reads (it did, in an FSDP x TP block's backward, and the chain broke).

    A ring step's matmul reads the piece that arrived (all-gathers) or a window of a
    resident operand (reduce-scatters), never the previous step's product, so nothing
    orders the step matmuls. XLA then treats them as independent dots that share an
    operand and its dot merger (on GPU: every dot of at most
    `--xla_gpu_dot_merger_threshold_mb`, 32 MB of operands and result, by default) fuses
    them into one GEMM on the concatenated pieces, which runs after the last transfer:
    nothing overlaps. Passing a step's inputs through an optimization barrier together
    with the previous step's result makes each step's matmul depend on the one before;
    dots that depend on one another cannot be merged.

    The transfers go through the barrier too (a step sends what it multiplies). A block
    could travel on as soon as it arrived, but then XLA's latency-hiding scheduler, which
    knows no better than "a transfer is long", lets the first transfers run back to back
    and piles every matmul into the last ones: on 8 x H100 an all-gather's first three
    transfers hid nothing. Tied to the previous step, transfer `i` can only overlap the
    matmul of step `i`: the ring runs in lock step, one transfer per direction in
    flight, which is all a ring has anyway. The barrier is an identity: it changes no
    value.
    """
    if previous is None:
        return values, previous
    return lax.optimization_barrier((values, previous))


def _split(ring, a, axis, what):
    """`a` cut into one piece per direction along `axis`. A `Quantized` block's scales are
    cut with its values where they run along `axis`; where one scale row covers the
    whole block along it (`ag_contract`: the gather axis is the scale axis) every half
    carries that row."""
    values = _quantize.values_of(a)
    half = ring.split_size(values.shape[axis], what)

    def piece(h):
        return jax.tree.map(lambda b: b if b.shape[axis] != values.shape[axis]
                            else segment(b, h, half, axis), a)

    return tuple(piece(h) for h in range(ring.num_directions))


def ring_gather(cfg, travelling, axis, step_fn, carry, inputs=(), first_outside=False):
    """All-gather `travelling` along `axis` round the ring, folding each piece into `carry`.

    `travelling`: an array, or a `_quantize.Quantized` (values and scales both travel).

    `step_fn(carry, pieces, segs)` is called once per step with the pieces of the
    gathered operand this device holds, one per direction, and their segment indices
    (`Ring.gather_segment`), so a backend can handle a bidirectional step in one launch.
    `inputs`: the other arrays `step_fn` reads, so a rolled loop's carry is typed as
    varying over every mesh axis its result will vary over. `first_outside`: run step 0
    before a rolled loop, for a carry whose step 0 changes its structure (a sum that
    starts as None and becomes step 0's product).
    """
    ring = ring_for(cfg.axis_name, cfg.axis_size, cfg.bidirectional)
    me = lax.axis_index(cfg.axis_name)

    def compute(i, carry, pieces):
        return step_fn(carry, pieces, tuple(ring.gather_segment(me, i, r)
                                            for r in ring.directions))

    def step(i, state):
        carry, pieces = state
        # The pieces in hand wait for the previous step's product (see `_after`), then
        # go on to the next device while this step multiplies them.
        pieces, carry = _after(pieces, carry)
        return compute(i, carry, pieces), _send(cfg, ring, pieces)

    ring_axes = set(axis_names(cfg.axis_name))
    arrays = jax.tree.leaves(travelling) + list(inputs)
    axes = ring_axes.union(*(varying_axes(a) for a in arrays))
    carry = jax.tree.map(lambda a: as_varying(a, axes), carry)
    pieces = _split(ring, travelling, axis, "the travelling block")
    # After one ppermute a piece varies over the ring axis even if `travelling` did not,
    # and after the barrier that ties it to the carry (`_after`) over the carry's axes.
    pieces = jax.tree.map(lambda p: as_varying(p, axes), pieces)
    state, start = (carry, pieces), 0
    if first_outside and ring.num_transfers:
        state, start = step(0, state), 1
    carry, pieces = _loop(cfg, start, ring.num_transfers, step, state)
    pieces, carry = _after(pieces, carry)
    return compute(ring.num_steps - 1, carry, pieces)


def ring_reduce_scatter(cfg, accumulate, out_len, axis, fold_adds=False):
    """Reduce-scatter along `axis` round the ring: accumulators travel, devices add in.

    `accumulate(acc, seg, length)` returns `acc` plus this device's contribution to output
    segment `seg` (`length` rows or columns along `axis`), in `cfg.reduce_dtype`, or the
    contribution alone when `acc` is None. Each device adds into the accumulator it
    holds, for the segment that accumulator is bound for. Without `fold_adds` the ring
    only asks for the contribution alone and adds it to the accumulator that arrived
    itself (see `step`); with it (and an even block, no `comm_dtype`) it runs
    `_folded_reduce_scatter`, whose steps add in the matmul.
    """
    ring = ring_for(cfg.axis_name, cfg.axis_size, cfg.bidirectional)
    me = lax.axis_index(cfg.axis_name)
    length = ring.split_size(out_len, "each output block")
    if (fold_adds and cfg.comm_dtype is None and length % 2 == 0 and ring.num_steps > 1
            and folds(length // 2, cfg.on.platform)):
        return _folded_reduce_scatter(cfg, ring, me, accumulate, length, axis)

    def send(accs):
        if cfg.comm_dtype is None:
            return _send(cfg, ring, accs)
        # Requantized at every hop: each sender scales its running sum afresh.
        scale_axis = prims.of(prims.RS_ROWS).scale_axis  # == RS_COLS's: along a row
        sent = _send(cfg, ring, tuple(_quantize.quantize(a, cfg.comm_dtype, scale_axis)
                                      for a in accs))
        return tuple(_quantize.dequantize(q, cfg.reduce_dtype) for q in sent)

    def products(i, segs):
        return tuple(accumulate(None, seg, length) for seg in segs)

    def segments(i):
        return tuple(ring.scatter_segment(me, i, r) for r in ring.directions)

    def step(i, accs):
        # The segment index (which all of a step's operand windows are cut with) comes
        # through a barrier with the accumulators the previous step made: see `_after`.
        segs, accs = _after(segments(i), accs)
        incoming = send(accs)
        # This device's partial products need nothing that is in flight: computing them
        # apart from the add keeps the transfer free to overlap them. Fused with the add
        # (a kernel that reads the accumulator, or XLA folding the add into the GEMM's
        # epilogue, as cuBLAS and Triton GEMMs do) the matmul would wait for the
        # transfer. The barrier keeps XLA from folding the add back in.
        parts = lax.optimization_barrier(products(i, segs))
        return tuple(acc + part for acc, part in zip(incoming, parts))

    accs = _loop(cfg, 1, ring.num_steps, step, products(0, segments(0)))
    return jnp.concatenate(accs, axis=axis).astype(cfg.out_dtype)


def _folded_reduce_scatter(cfg, ring, me, accumulate, length, axis):
    """`ring_reduce_scatter` with each step's add in its matmul (`dot + acc`, one fusion
    where the compiler folds it: a cuBLAS GEMM's epilogue, the TPU's output fusion), not
    a separate f32 pass that reads the product and the accumulator and writes the sum
    (what it saves: docs/measurements.md).

    A matmul that adds the accumulator in must wait for it to arrive, so one stream of
    accumulators could not overlap anything. Each direction's block is cut into two
    chunks (a, b) whose rings run half a step apart: while chunk a's accumulator
    travels, chunk b's step multiplies and adds the one that arrived while a's step ran,
    and the other way round. Per step that is two transfers of half the bytes and two
    matmuls of half the rows, each transfer beside a matmul; the first and last half
    steps are the exposed ones (chunk a's first product, chunk b's last). Every slot's
    inputs pass through one barrier with the previous slot's results (`_after`), so the
    slots run in order and the matmuls stay apart.
    """
    half = length // 2

    def chunk(i, c, incoming, segs):
        """Chunk `c` of each direction's accumulator after step `i`: `incoming` (None at
        step 0) plus this device's part, in one `accumulate`."""
        incoming = (None,) * len(segs) if incoming is None else incoming
        return tuple(accumulate(acc, 2 * seg + c, half) for acc, seg in zip(incoming, segs))

    def segments(i):
        return tuple(ring.scatter_segment(me, i, r) for r in ring.directions)

    def slot(i, c, done, arrived, send=True):
        """Send the chunk the previous slot finished (`done`) while this one adds the
        accumulator that `arrived` for chunk `c` at step `i`."""
        segs, (done, arrived) = lax.optimization_barrier((segments(i), (done, arrived)))
        sent = _send(cfg, ring, done) if send else None
        return chunk(i, c, arrived, segs), sent

    def step(i, state):  # state: chunk b after step i - 1, chunk a's after i - 1 in flight
        b, a_in = state
        a, b_in = slot(i, 0, b, a_in)
        return slot(i, 1, a, b_in)

    segs = segments(0)
    a = chunk(0, 0, None, segs)
    state = slot(0, 1, a, None)
    last = ring.num_steps - 1
    state = _loop(cfg, 1, last, step, state)
    b, a_in = state
    a, b_in = slot(last, 0, b, a_in)
    b, _ = slot(last, 1, a, b_in, send=False)
    out = [part for pair in zip(a, b) for part in pair]  # each direction's a, then b
    return jnp.concatenate(out, axis=axis).astype(cfg.out_dtype)


# -- the five primitives on the loops, given a backend's step provider -------------------


def _adding(accumulate, addend, axis, dtype):
    """`accumulate` with segment `seg` of `addend` in this device's contribution (it is
    there from the start, so the add can join the step's matmul without waiting)."""
    def with_addend(acc, seg, length):
        return accumulate(acc, seg, length) + segment(addend, seg, length, axis).astype(dtype)

    return with_addend


def gathered_buffer(cfg, own, axis, dtype):
    """The `dtype` buffer the pieces of `own` (an array, or a weight stored `Quantized`)
    fill in, the gathered residual: uninitialised (`lax.empty`), since the steps write
    every segment of it (on CPU, `lax.empty` is zeros).

    Before, it was zero-filled (a write of the whole buffer); a constant zero broadcast
    besides was merged by XLA with the output's, and two gathers updating one broadcast
    in place cost a copy of the whole buffer (`test_ring_gather_buffers_are_not_copied`).
    """
    values = _quantize.values_of(own)
    shape = list(values.shape)
    shape[axis] *= cfg.axis_size
    return lax.empty(tuple(shape), dtype)


def gather_out(prim, cfg, x, w, first_product_starts_sum=False):
    """The output an all-gather's steps fill in: uninitialised (`lax.empty`) for ag_rows
    and ag_cols, whose steps write every segment of it (a zero fill was one more write
    of the whole output per op); zeros for the `ag_contract` sum (in f32), or None where the step's
    function starts the sum with step 0's product (`first_product_starts_sum`)."""
    p = prims.of(prim)
    shape = p.out_shape(x.shape, w.shape, cfg.axis_size)
    if not p.sums_steps:
        return lax.empty(shape, cfg.out_dtype)
    if first_product_starts_sum:
        return None
    # Summed over the steps: keep it in f32 until the end.
    return jnp.zeros(shape, _definition.accumulation_dtype(x.dtype))


def run_steps(steps: Steps, prim, cfg, x, w, return_gathered=False, addend=None):
    """Run primitive `prim` (`_primitives.py`: local x (m, k), w (k, n)) on the ring with
    a backend's step provider `steps`; with `return_gathered`, an all-gather also returns
    the gathered operand (in x's dtype). `addend` (a reduce-scatter's, the product's
    shape): each step adds its segment to this device's contribution."""
    p = prims.of(prim)
    axis = p.gather_axis
    if not p.gathers:
        out_len = p.out_shape(x.shape, w.shape, cfg.axis_size)[axis]
        accumulate = steps.scatter(prim, cfg, x, w)
        if addend is not None:
            accumulate = _adding(accumulate, addend, axis, cfg.reduce_dtype)
        return ring_reduce_scatter(cfg, accumulate, out_len, axis, steps.fold_adds)
    own = p.travelling(x, w)
    step = steps.gather(prim, cfg, x, w)
    travelling = own
    if cfg.comm_dtype is not None:  # quantized once, here on its owner (or stored so)
        travelling = _quantize.quantized(own, cfg.comm_dtype, p.scale_axis)

    keeping = (steps.gather_keeping(prim, cfg, x, w)
               if return_gathered and steps.gather_keeping is not None else None)

    def step_fn(carry, pieces, segs):
        out, gathered = carry
        if cfg.comm_dtype is not None:
            # No step provider takes a `Quantized`: dequantize on arrival (a step
            # that multiplied narrow values, e.g. fp8 wgmma, would take them here).
            pieces = tuple(_quantize.dequantize(p, x.dtype) for p in pieces)
        if keeping is not None:  # the step's own launch writes the pieces in
            return keeping(out, gathered, pieces, segs)
        if return_gathered:
            for piece, seg in zip(pieces, segs):
                gathered = put(gathered, piece, seg, axis)
        return step(out, pieces, segs), gathered

    gathered = gathered_buffer(cfg, own, axis, x.dtype) if return_gathered else None
    out = gather_out(prim, cfg, x, w, steps.first_product_starts_sum)
    out, gathered = ring_gather(cfg, travelling, axis, step_fn, (out, gathered),
                                inputs=(x, w), first_outside=out is None)
    out = out.astype(cfg.out_dtype)
    return (out, gathered) if return_gathered else out
