"""The ring protocol every TPU ring kernel follows, and the split of a step between cores.

The protocol (one `Link` per kernel, both directions of a bidirectional ring):

- *Barrier.* On entry every device signals both neighbours on the barrier semaphore and
  waits for both signals, so no DMA or signal reaches a device that has not entered the
  kernel (its buffers may still belong to the previous op). The barrier semaphore is the
  kernel's own: each (kernel, mesh axes) pair has its own collective id
  (`_collective_ids`), so a kernel in flight on another axis cannot signal it.
- *Slots.* Each direction has two receive slots. Transfer `t` lands in slot `t % 2` of
  the receiving neighbour and signals that slot's own DMA semaphore (one semaphore per
  slot: two DMAs in flight on one semaphore let a wait complete on the wrong one).
- *Credits.* Transfer `t + 2` reuses the slot transfer `t` used. The receiver signals one
  credit (a REGULAR semaphore per direction) to its sender once it is done with that slot
  (computed with it and, for all-gathers, forwarded it); the sender waits for a credit
  before every transfer `t >= 2`. Credits are only signalled when a later transfer will
  wait for them, so every semaphore is back to zero at exit.
- *Finish.* On exit every device tells its senders it is done and waits for its
  receivers (`Link.finish`), so consecutive collective kernels cannot mix up their
  barrier signals.

Megacore (`Cores`): only TensorCore 0 talks to the ring (every DMA, signal and wait of
`Link`), as the Pallas distributed guide recommends; every core computes its share of a
step's tiles. Core 0 hands a step over to the other cores once the step's data has
landed (`hand_over`), and waits for them before it forwards, sends or frees anything they
computed with or into (`join`).
"""

from __future__ import annotations

import dataclasses

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import _ring
from . import _layout

# Private option values that break the protocol on purpose (tests/test_tpu_protocol.py
# proves the race/NaN checks catch them). They share all other code with the real kernel.
BROKEN_READ_BEFORE_WAIT = "read_before_wait"
BROKEN_NO_CREDIT = "no_credit"
BROKEN_STRAY_CREDIT = "stray_credit"  # a credit nobody waits for: non-zero at exit
BROKEN_NO_HAND_OVER = "no_hand_over"  # megacore: cores compute before the data landed
BROKEN_SHARED_COLLECTIVE_ID = "shared_collective_id"  # every kernel uses barrier 0
BROKEN = (None, BROKEN_READ_BEFORE_WAIT, BROKEN_NO_CREDIT, BROKEN_STRAY_CREDIT,
          BROKEN_NO_HAND_OVER, BROKEN_SHARED_COLLECTIVE_ID)


def semaphores(ring, parts=1):
    """Scratch semaphores of a `Link` whose transfers have `parts` buffers each: (send
    DMA, recv DMA, local DMA, credit, done). Each part of each slot has its own send and
    recv semaphore (index `2 * part + slot`)."""
    nd = ring.num_directions
    return [pltpu.SemaphoreType.DMA((nd, 2 * parts)), pltpu.SemaphoreType.DMA((nd, 2 * parts)),
            pltpu.SemaphoreType.DMA((nd * parts,)), pltpu.SemaphoreType.REGULAR((nd,)),
            pltpu.SemaphoreType.REGULAR((nd,))]


def _axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


@dataclasses.dataclass
class Link:
    """A device's view of the ring inside a kernel: neighbours, slots and semaphores.

    `slots` is a ref of shape `(num_directions, 2, *piece)`, or a tuple of such refs
    when a transfer has several parts (quantized values and their scales): each part
    travels by its own DMA on its own semaphores, and a slot is received when every part
    has landed. `send`/`recv` are DMA semaphores `(num_directions, 2 * parts)`; `local`
    is one DMA semaphore per direction and part for local copies; `credit` and `done` one REGULAR
    semaphore per direction each. Where a transfer's source or a received slot is named,
    it is a ref (one part) or a tuple of refs (one per part).
    """

    ring: _ring.RingSchedule
    axis_name: object
    slots: object
    send: object
    recv: object
    local: object
    credit: object
    done: object
    broken: object = None

    def __post_init__(self):
        self.me = lax.axis_index(self.axis_name)
        self._multi = isinstance(self.slots, tuple)
        self._slots = self.slots if self._multi else (self.slots,)

    def _parts(self, refs) -> tuple:
        return refs if self._multi else (refs,)

    def _device(self, index):
        """Mesh coordinates of ring position `index`; a tuple of axis names is one ring
        over those axes (the first one major, as `lax.axis_index` counts). On the mesh's
        other axes the neighbour shares this device's coordinates, which Pallas fills in
        with `lax.axis_index`: the enclosing `shard_map` must be manual over every mesh
        axis (Mosaic cannot partition a kernel over an automatic one either)."""
        names = _axis_names(self.axis_name)
        return _ring.mesh_coordinates(index, {name: lax.axis_size(name) for name in names})

    def barrier(self):
        """Wait until both neighbours have entered the kernel."""
        sem = pltpu.get_barrier_semaphore()
        for r in (1, -1):
            pl.semaphore_signal(sem, 1, device_id=self._device(self.ring.send_to(self.me, r)))
        pl.semaphore_wait(sem, 2)

    def finish(self):
        """Wait until the devices this one sends to have finished too.

        Without it a device could leave, enter the next collective kernel and signal
        that kernel's barrier to a neighbour still waiting in this kernel's barrier
        (in a unidirectional ring of <= 3 devices nothing else orders them), which would
        count it as this kernel's signal. Each device tells its senders it is done and
        waits for its receivers, so a device leaves only when both neighbours are past
        this kernel's barrier.
        """
        for h, r in enumerate(self.ring.directions):
            pl.semaphore_signal(self.done.at[h], 1,
                                device_id=self._device(self.ring.recv_from(self.me, r)))
        for h in range(self.ring.num_directions):
            pl.semaphore_wait(self.done.at[h], 1)

    def _copies(self, h, t, src):
        r = self.ring.directions[h]
        device = self._device(self.ring.send_to(self.me, r))
        return [pltpu.make_async_remote_copy(
            part, slots.at[h, t % 2], self.send.at[h, 2 * p + t % 2],
            self.recv.at[h, 2 * p + t % 2], device_id=device)
            for p, (part, slots) in enumerate(zip(self._parts(src), self._slots))]

    def start_send(self, h, t, src):
        """Start transfer `t` of direction `h`: `src` into the neighbour's slot `t % 2`."""
        if self.broken != BROKEN_NO_CREDIT:  # wait until the neighbour freed that slot
            when(t >= 2, lambda: pl.semaphore_wait(self.credit.at[h], 1))
        for copy in self._copies(h, t, src):
            copy.start()

    def wait_send(self, h, t, src):
        for copy in self._copies(h, t, src):
            copy.wait_send()

    def wait_recv(self, h, t):
        """Wait until transfer `t` of direction `h` has landed in this device's slot."""
        for copy in self._copies(h, t, self.received(h, t)):
            copy.wait_recv()

    def received(self, h, t):
        """The slot holding transfer `t` of direction `h` (a tuple of parts, if several)."""
        got = tuple(slots.at[h, t % 2] for slots in self._slots)
        return got if self._multi else got[0]

    def release(self, h, t):
        """Done with the slot of transfer `t`: give the sender a credit if it reuses it."""
        if self.broken == BROKEN_NO_CREDIT:
            return
        r = self.ring.directions[h]
        needed = t + 2 <= self.ring.num_transfers - 1
        when(needed | (self.broken == BROKEN_STRAY_CREDIT), lambda: pl.semaphore_signal(
            self.credit.at[h], 1, device_id=self._device(self.ring.recv_from(self.me, r))))

    def local_copy(self, h, src, dst, part=0):
        """A local DMA of direction `h`; copies in flight together need distinct `part`s
        (each part has its own semaphore)."""
        return pltpu.make_async_copy(src, dst, self.local.at[part * self.ring.num_directions + h])


def core_semaphores(count):
    """Scratch semaphores of `Cores`: (ready, computed), or none on one core."""
    return [] if count == 1 else [pltpu.SemaphoreType.REGULAR, pltpu.SemaphoreType.REGULAR]


class Cores:
    """The TensorCores of one device sharing a kernel (grid axis 0, one program each).

    `ring(fn)` runs ring work on core 0 only; `hand_over()` makes the other cores wait
    until core 0 signals that a step's data has landed; `join()` makes core 0 wait until
    the other cores have finished their tiles of a step. On one core all three are plain.
    """

    def __init__(self, count, ready=None, computed=None, broken=None):
        self.count, self.ready, self.computed = count, ready, computed
        self.broken = broken
        self.index = pl.program_id(0) if count > 1 else 0

    def ring(self, fn):
        if self.count == 1:
            fn()
        else:
            pl.when(self.index == 0)(fn)

    def hand_over(self):
        if self.count == 1 or self.broken == BROKEN_NO_HAND_OVER:
            return

        @pl.when(self.index == 0)
        def _():
            for c in range(1, self.count):
                pl.semaphore_signal(self.ready, 1, core_index=c)

        @pl.when(self.index != 0)
        def _():
            pl.semaphore_wait(self.ready, 1)

    def join(self):
        if self.count == 1:
            return

        @pl.when(self.index != 0)
        def _():
            pl.semaphore_signal(self.computed, 1, core_index=0)

        @pl.when(self.index == 0)
        def _():
            pl.semaphore_wait(self.computed, self.count - 1)


def when(cond, fn):
    """`fn()` if `cond`: decided now for Python bools, in the kernel for traced ones."""
    if isinstance(cond, bool):
        if cond:
            fn()
    else:
        pl.when(cond)(fn)


def run_ring(link, cores, n, step):
    """The ring of `n` devices around `step`: barrier on entry, handshake on exit (both on
    core 0)."""
    if n > 1:
        cores.ring(link.barrier)
    steps(n, step)
    if n > 1:
        cores.ring(link.finish)


def steps(n, step):
    """Run `step(s, first, last)` for s in [0, n): the first and last step peeled (static),
    the middle ones in a `fori_loop` so the kernel's size does not grow with the ring."""
    step(0, True, n == 1)
    if n > 2:
        def body(s, carry):
            step(s, False, False)
            return carry
        lax.fori_loop(1, n - 1, body, 0)
    if n > 1:
        step(n - 1, False, True)


def segment(ref, index, length, axis, name, enforce):
    """Segment `index` (in units of `length`) of `ref` along `axis` (0 or 1).

    Ring segments start at `index * length`, so the window is on Mosaic's tiles exactly
    when `length` is (checked, and raised with `enforce`; see `_layout`)."""
    _layout.check(_layout.Window(name, tuple(ref.shape), str(ref.dtype), axis - ref.ndim,
                                 length), enforce)
    window = pl.ds(pl.multiple_of(index * length, length) if not isinstance(index, int)
                   else index * length, length)
    return ref.at[window] if axis == 0 else ref.at[:, window]
