"""What every TPU ring kernel shares: interpret-mode settings and the ring protocol.

The protocol (one `Link` per kernel, both directions of a bidirectional ring):

- *Barrier.* On entry every device signals both neighbours on the barrier semaphore and
  waits for both signals, so no DMA or signal reaches a device that has not entered the
  kernel (its buffers may still belong to the previous op).
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
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fusedpar import _vma
from fusedpar._schedule import Ring, mesh_coordinates

# Private option values that break the protocol on purpose (tests/test_tpu_protocol.py
# proves the race/NaN checks catch them). They share all other code with the real kernel.
BROKEN_READ_BEFORE_WAIT = "read_before_wait"
BROKEN_NO_CREDIT = "no_credit"
BROKEN_STRAY_CREDIT = "stray_credit"  # a credit nobody waits for: non-zero at exit
BROKEN = (None, BROKEN_READ_BEFORE_WAIT, BROKEN_NO_CREDIT, BROKEN_STRAY_CREDIT)

CHECK_VMA_HINT = (
    "The fused TPU kernels are collective Pallas kernels: the enclosing jax.shard_map "
    "must be called with check_vma=False. Tagging the outputs as varying "
    "(manual_axis_type) is not enough: the kernels use lax.axis_index in data.")


def interpret_params(cfg):
    """The `interpret=` argument of pallas_call for `cfg`.

    Options: `interpret` (True/False; default: True on CPU, False on TPU) and
    `interpret_params` (a `pltpu.InterpretParams`, implies interpret mode). Lowering for
    TPU from a CPU host needs `interpret=False`.
    """
    params = cfg.option("interpret_params")
    interpret = cfg.option("interpret")
    if interpret is None:
        interpret = params is not None or jax.default_backend() == "cpu"
    if not interpret:
        return False
    return params if params is not None else pltpu.InterpretParams()


def register_cpu_chip():
    """Let `pltpu.emit_pipeline` run (interpret mode) or lower (for TPU) on a CPU host.

    emit_pipeline asks `get_tpu_info()` for the default device's chip, which fails for
    "cpu". We register a TPU v5p's description for the device kind "cpu" (a private JAX
    registry; it only affects CPU hosts and never replaces an existing entry).
    """
    from jax._src.pallas.mosaic import tpu_info

    if jax.default_backend() == "cpu" and "cpu" not in tpu_info.registry:
        tpu_info.registry["cpu"] = lambda: pltpu.get_tpu_info_for_chip(
            pltpu.ChipVersion.TPU_V5P, 1)


def nbytes(shapes):
    """Total bytes of `jax.ShapeDtypeStruct`s (arrays work too)."""
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in shapes)


def semaphores(ring):
    """Scratch semaphores of a `Link`: (send DMA, recv DMA, local DMA, credit, done)."""
    nd = ring.num_directions
    return [pltpu.SemaphoreType.DMA((nd, 2)), pltpu.SemaphoreType.DMA((nd, 2)),
            pltpu.SemaphoreType.DMA((nd,)), pltpu.SemaphoreType.REGULAR((nd,)),
            pltpu.SemaphoreType.REGULAR((nd,))]


@dataclasses.dataclass
class Link:
    """A device's view of the ring inside a kernel: neighbours, slots and semaphores.

    `slots` is a ref of shape `(num_directions, 2, *piece)`; `send`/`recv` are DMA
    semaphores `(num_directions, 2)`; `local` is one DMA semaphore per direction for
    local copies; `credit` and `done` one REGULAR semaphore per direction each.
    """

    ring: Ring
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

    def _device(self, index):
        """Mesh coordinates of ring position `index`; a tuple of axis names is one ring
        over those axes (the first one major, as `lax.axis_index` counts)."""
        names = _vma.axis_names(self.axis_name)
        return mesh_coordinates(index, {name: lax.axis_size(name) for name in names})

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

    def _copy(self, h, t, src):
        r = self.ring.directions[h]
        return pltpu.make_async_remote_copy(
            src, self.slots.at[h, t % 2], self.send.at[h, t % 2], self.recv.at[h, t % 2],
            device_id=self._device(self.ring.send_to(self.me, r)))

    def start_send(self, h, t, src):
        """Start transfer `t` of direction `h`: `src` into the neighbour's slot `t % 2`."""
        if self.broken != BROKEN_NO_CREDIT:  # wait until the neighbour freed that slot
            when(t >= 2, lambda: pl.semaphore_wait(self.credit.at[h], 1))
        self._copy(h, t, src).start()

    def wait_send(self, h, t, src):
        self._copy(h, t, src).wait_send()

    def wait_recv(self, h, t):
        """Wait until transfer `t` of direction `h` has landed in this device's slot."""
        self._copy(h, t, self.slots.at[h, t % 2]).wait_recv()

    def received(self, h, t):
        """The slot holding transfer `t` of direction `h`."""
        return self.slots.at[h, t % 2]

    def release(self, h, t):
        """Done with the slot of transfer `t`: give the sender a credit if it reuses it."""
        if self.broken == BROKEN_NO_CREDIT:
            return
        r = self.ring.directions[h]
        needed = t + 2 <= self.ring.num_transfers - 1
        when(needed | (self.broken == BROKEN_STRAY_CREDIT), lambda: pl.semaphore_signal(
            self.credit.at[h], 1, device_id=self._device(self.ring.recv_from(self.me, r))))

    def local_copy(self, h, src, dst):
        return pltpu.make_async_copy(src, dst, self.local.at[h])


def when(cond, fn):
    """`fn()` if `cond`: decided now for Python bools, in the kernel for traced ones."""
    if isinstance(cond, bool):
        if cond:
            fn()
    else:
        pl.when(cond)(fn)


def run_ring(link, n, step):
    """The ring of `n` devices around `step`: barrier on entry, handshake on exit."""
    if n > 1:
        link.barrier()
    steps(n, step)
    if n > 1:
        link.finish()


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


def segment(ref, index, length, axis):
    """Segment `index` (in units of `length`) of a ref along `axis` (0 or 1)."""
    window = pl.ds(pl.multiple_of(index * length, length) if not isinstance(index, int)
                   else index * length, length)
    return ref.at[window] if axis == 0 else ref.at[:, window]


def launch(kernel, prim, ring, cfg, dims, out_shapes, x, w, **kernel_args):
    """Plan the tiles of `prim`'s step matmul and run its ring `kernel` on `x`, `w`."""
    from . import _tiling

    vmem, tile = _tiling.plan(cfg, dims, nbytes([x, w, *out_shapes]))
    if vmem is None:
        raise NotImplementedError(f"{prim}: {tile}")
    register_cpu_chip()
    kernel = functools.partial(
        kernel, prim=prim, ring=ring, axis_name=cfg.axis_name, tile=tile,
        precision=cfg.precision, broken=cfg.option("_broken"), **kernel_args)
    return call(kernel, ring, cfg, out_shapes, vmem, x, w)


def call(kernel, ring, cfg, out_shapes, vmem, *args):
    """`pallas_call` of a ring kernel: every buffer whole in VMEM (`vmem`) or in HBM."""
    spec = pl.BlockSpec(memory_space=pltpu.VMEM if vmem else pl.ANY)
    params = pltpu.CompilerParams(collective_id=0) if ring.size > 1 else None
    f = pl.pallas_call(
        kernel, out_shape=out_shapes, in_specs=[spec] * len(args),
        out_specs=[spec] * len(out_shapes),
        scratch_shapes=semaphores(ring), compiler_params=params,
        interpret=interpret_params(cfg))
    return f(*args)
