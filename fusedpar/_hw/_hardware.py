"""What the package knows about one kind of device: the record every hardware decision
reads (the entries themselves are in `fusedpar._hw._registry`).

- `Hardware`: the numbers the cost model and the replay use (peak FLOP/s per dtype, HBM
  and link bandwidths, latencies, the torus the links form);
- `Aot`: how `fusedpar.aot` makes compile-only devices of the kind;
- `Kind`: one registry entry: which devices it is (`device_kind` matchers), platform,
  TPU generation or GPU compute capability, cores, chip limits (VMEM and tile presets on
  a TPU, SMs and shared memory on a GPU), the kernel families it runs and why not the
  others, its `Hardware` and its `Aot`.

Nothing here imports JAX or another fusedpar module: everything else imports it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional

import numpy as np

CPU, GPU, TPU = "cpu", "gpu", "tpu"
# Kernel families (`Kind.families`): the fused Pallas TPU kernels, and the two families
# of GPU step kernels (`options={"kernels": ...}` of backend "pallas_gpu").
TPU_KERNELS, MOSAIC, TRITON = "tpu", "mosaic", "triton"


# PCIe 4.0 x16 one way: what the replay assumes for a host link with no published figure.
ASSUMED_HOST_BANDWIDTH = 32e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the model needs to know about one device and its ring links.

    - `name`: a label.
    - `flops`: peak matmul FLOP/s per device by input dtype name (`"bfloat16"`, ...), and
      for float32 at a precision above the default (`"float32_high"`,
      `"float32_highest"`); what is not listed runs at another entry's rate
      (`rate_key`).
    - `efficiency`: fraction of peak a large matmul reaches.
    - `hbm_bandwidth`: device memory bytes/s (the roofline's memory side).
    - `link_bandwidth`: bytes/s one way to one ring neighbour.
    - `egress_bandwidth`: bytes/s a device can send in total, over all its links.
    - `step_latency`: seconds of fixed cost per ring step of the lax ring (a ppermute
      launch and synchronisation, plus the step's small ops).
    - `kernel_step_latency`: the same for the "pallas" backend (on TPU a DMA start and a
      semaphore wait inside the fused kernel).
    - `hop_latency`: seconds per ring hop inside the reference's collective (the
      collective library's own per-step cost).
    - `launch_overhead`: seconds of fixed cost per matmul kernel / collective launch.
    - `overlap`: fraction of the shorter of (compute, transfer) that hides behind the
      longer one: 1 on accelerators with DMA engines, 0 where "transfers" are copies made
      by the same cores that compute (the simulated CPU devices).
    - `collective_beside_matmul`: whether XLA runs a reference collective of the
      backward (a plain reduce-scatter or all-gather) beside the backward's other,
      independent gradient matmul. On 8 H100s it does (1 of the 2 collectives of each
      ag op's training step hidden); on v5p none did (XLA makes them synchronous), so
      `auto` must not count on it there: v5p ag_cols 972 -> 609 us predicted once it
      did not. v6e does, its collectives offloaded to the SparseCores. v5e keeps it:
      there the async collective fusion flags (`set_overlap_flags`) run a block's
      weight-gradient reduce-scatter beside its matmuls, and the v5e block was 0.7%
      slower without it.
    - `beside_hides_part`: whether a collective that the other matmul covers only in
      part still hides that part. False on v5e: there the op programs' backward
      reduce-scatter, which a 218 us matmul could half hide, stayed synchronous (the
      replay waited its whole 596 us), while the block's, which other work covers
      whole, ran beside it; counting only whole cover took ag_cols and ag_contract
      1,405 -> 1,262 us and left the block at 12,422.
    - `torus_period`: on a TPU, the chips along each axis of a slice that is a whole
      torus (wrap-around links joining each axis' ends) when its extents are multiples
      of it; 0 where the links form no torus (a GPU's NVSwitch). The ring order and the
      replay route transfers over these links (`wraps`).
    - `host_bandwidth`: bytes/s one way between the device and its host's memory (a
      program's offloaded activations), 0 where no figure is published (the replay then
      assumes `ASSUMED_HOST_BANDWIDTH` and says so).
    - `torus_axes`: how many of the slice's axes must be whole multiples of
      `torus_period` (3 on v4 and v5p: whole 4x4x4 cubes; 2 on v5e and v6e: whole 16x16
      pods); 0: every axis longer than one chip.
    """

    name: str
    flops: Mapping[str, float]
    efficiency: float
    hbm_bandwidth: float
    link_bandwidth: float
    egress_bandwidth: float
    step_latency: float
    kernel_step_latency: float
    hop_latency: float
    launch_overhead: float
    overlap: float = 1.0
    torus_period: int = 0
    torus_axes: int = 0
    collective_beside_matmul: bool = True
    beside_hides_part: bool = True
    host_bandwidth: float = 0.0

    def matmul_flops(self, dtype) -> float:
        """The FLOP/s a large matmul of `dtype` (a dtype, or a `flops` key) reaches."""
        return self.flops[self.rate_key(dtype)] * self.efficiency

    def rate_key(self, dtype) -> str:
        """The `flops` entry a matmul of `dtype` runs at: its own; an unsigned or 4-bit
        integer's, int8's; for a float32 precision without one, float32's; for a
        narrower type without one (a chip without such units widens it), bfloat16's;
        else float32's."""
        try:
            name = np.dtype(dtype).name
        except TypeError:  # a precision key ("float32_highest"), or a type NumPy lacks
            name = str(dtype)
        if name in self.flops:
            return name
        if name in ("uint8", "int4", "uint4") and "int8" in self.flops:
            return "int8"
        narrow = name in ("int8", "uint8", "int4", "uint4", "float16") or name.startswith(
            "float8")
        return "bfloat16" if narrow and "bfloat16" in self.flops else "float32"

    def overlapped(self, compute: float, transfer: float) -> float:
        """One ring step's time when its matmul and its transfer run at once: the longer
        of the two, plus the part of the shorter that `overlap` says does not hide."""
        return max(compute, transfer) + (1.0 - self.overlap) * min(compute, transfer)

    def ring_kernel_seconds(self, steps: int, compute: float, transfer: float) -> float:
        """A ring run inside one kernel (the fused TPU kernels): one launch, the first
        step's matmul with nothing in flight, then `steps - 1` steps whose matmul and
        transfer overlap."""
        return self.launch_overhead + compute + (steps - 1) * self.overlapped(compute, transfer)

    def hidden_beside(self, beside: float, transfer: float) -> float:
        """Seconds of a reference collective's `transfer` that hide behind `beside`
        seconds of other, independent matmul work (`collective_beside_matmul`,
        `beside_hides_part`)."""
        if not self.collective_beside_matmul or beside <= 0:
            return 0.0
        if not self.beside_hides_part and beside < transfer:
            return 0.0
        return min(beside, transfer)

    def send_bandwidth(self, directions: int) -> float:
        """Bytes/s per direction when sending to `directions` neighbours at once."""
        return min(self.link_bandwidth, self.egress_bandwidth / directions)

    def wraps(self, extent) -> tuple:
        """The torus wrap rule: for a slice of `extent` chips along each axis, each axis'
        length where it has wrap-around links, else 0 (an axis of 2 chips gains nothing
        from one: its wrap-around link joins the neighbours its one link joins)."""
        extent = tuple(int(e) for e in extent)
        whole = extent[:self.torus_axes] if self.torus_axes else [e for e in extent if e > 1]
        torus = (self.torus_period > 0 and len(whole) > 0
                 and all(e % self.torus_period == 0 for e in whole))
        return tuple(e if torus and e > 2 else 0 for e in extent)


@dataclasses.dataclass(frozen=True)
class Aot:
    """How `fusedpar.aot` makes compile-only devices of a kind.

    - `name`: what a target name starts with: `"<name>:<slice>"` for a TPU slice
      (`"v5e:2x4"`), `"<name>x<N>"` for N GPUs in one NVLink box (`"h100x8"`).
    - `example`: the target of this kind the package is compiled and tested for
      (`fusedpar.aot.TARGETS`), or "" if none is.
    - `topology`: TPU: libtpu's name of the generation, when it is not `name`.
    - `target_config`: GPU: the `GpuTargetConfig` text proto (in `fusedpar/targets/`)
      that describes one device to XLA's compiler.
    - `max_devices`: GPU: the most devices of one target (one NVLink box).
    """

    name: str
    example: str = ""
    topology: str = ""
    target_config: str = ""
    max_devices: int = 8


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of device, as the registry (`fusedpar._hw._registry`) holds it.

    - `name`: the registry's key, and the `cost_model.PRESETS` key of its `hardware`.
    - `platform`: "cpu", "gpu" or "tpu".
    - `device_kinds`: `jax.Device.device_kind` strings that are exactly this kind
      ("TPU v5 lite"); `words`: words or phrases of a device kind that name it ("H100"
      matches "NVIDIA H100 80GB HBM3"), checked when no kind matches exactly.
    - `aliases`: other names `cost_model.get_hardware` accepts ("h100", "v5e").
    - `hardware`: its cost-model numbers; None: the platform default's (`default`).
    - `generation`: a TPU's generation as `pltpu.ChipVersion` spells it ("v5e", "7x").
    - `compute_capability`: an NVIDIA GPU's `(major, minor)`.
    - `cores`: TensorCores one JAX device drives (2 where libtpu's "megacore" mode joins
      a chip's two; `fusedpar.aot` makes such devices); GPU: streaming multiprocessors.
    - `devices_per_chip`: TPU devices sharing one chip's `coords` (told apart by
      `core_on_chip`): 2 on TPU7x, whose two TensorCores are two devices.
    - `vmem_bytes`, `default_scoped_vmem_bytes`, `tiles`: TPU: VMEM per TensorCore, the
      compiler's scoped VMEM limit when a kernel names none, and the `(bm, bk, bn)`
      tile presets of the fused kernels' tiled path (`fusedpar.kernels.tpu.Chip`).
    - `smem_bytes`: GPU: shared memory one thread block may use (opt-in).
    - `families`: the kernel families it runs, preferred first (`TPU_KERNELS`, `MOSAIC`,
      `TRITON`); `refused`: family -> why it cannot run here (the error a request gets).
    - `aot`: how `fusedpar.aot` compiles for it, None where it cannot.
    - `default`: the kind a platform named alone stands for (one per platform).
    """

    name: str
    platform: str
    device_kinds: tuple = ()
    words: tuple = ()
    aliases: tuple = ()
    hardware: Optional[Hardware] = None
    generation: Optional[str] = None
    compute_capability: Optional[tuple] = None
    cores: int = 1
    devices_per_chip: int = 1
    vmem_bytes: int = 0
    default_scoped_vmem_bytes: int = 0
    tiles: tuple = ()
    smem_bytes: int = 0
    families: tuple = ()
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    aot: Optional[Aot] = None
    default: bool = False

    def __post_init__(self):
        if self.platform not in (CPU, GPU, TPU):
            raise ValueError(f"Kind {self.name!r}: platform must be one of cpu, gpu, tpu, "
                             f"got {self.platform!r}.")
        both = set(self.families) & set(self.refused)
        if both:
            raise ValueError(f"Kind {self.name!r}: families {sorted(both)} are both run "
                             "and refused.")

    def matches(self, device_kind: str) -> bool:
        """Whether `device_kind` names this kind: exactly, or by one of its `words`."""
        if device_kind in self.device_kinds:
            return True
        return any(_has_word(device_kind, w) for w in self.words)

    def why_not(self, family: str) -> Optional[str]:
        """Why kernel family `family` cannot run on this kind, or None if it can."""
        if family in self.families:
            return None
        return self.refused.get(family, f"the {family} kernels do not run on {self.name} "
                                        f"devices (they run {', '.join(self.families) or 'none'})")


def _has_word(device_kind: str, word: str) -> bool:
    """`word` is one of the words of `device_kind` (split at spaces, hyphens and
    underscores, case-insensitively), or a phrase of several of them."""
    kind = device_kind.upper()
    word = word.upper()
    if " " in word:
        return re.search(rf"(^|[\s\-_]){re.escape(word)}($|[\s\-_])", kind) is not None
    return word in re.split(r"[\s\-_]+", kind)
