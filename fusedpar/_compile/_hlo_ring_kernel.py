"""A fused ring kernel in a compiled program, read as the plan it was built from.

The fused TPU kernels (`fusedpar.kernels.tpu`) run a whole ring inside one Pallas
custom call: XLA, and so the program's text, shows no transfer. What the replay needs is
still in the call:

- which primitive and ring shape: the name scope fusedpar traces every run in,
  `fusedpar.<primitive>.<backend>.<bi|uni>directional` (`_autodiff.scope`), in the
  call's `op_name`;
- the ring's size: the ratio of the gathered (or scattered) dimension between the
  call's operands and its first result (`ring_size`);
- each step's work: the kernel's cost estimate (`pl.CostEstimate`, which XLA keeps in the
  call's backend config) gives its matmul flops and HBM bytes for the whole ring, and
  the bytes its remote DMAs send (`remote_bytes_transferred`). The kernel runs `N` equal
  steps and `N - 1` DMA rounds, each round split over the directions it sends in.

`RingKernel.seconds` times it the way the kernel runs: one step's matmul with nothing in
flight, then `N - 1` steps whose matmul and DMA overlap (`Hardware.overlapped`), each DMA
paying the kernel's per-step latency (`Hardware.kernel_step_latency`: a DMA start and a
semaphore wait) and going to a ring neighbour at one link's rate (the ring is laid along
the torus: `fusedpar._core._schedule.ring_for`); plus one launch. It is the analytic model's
"pallas" estimate (`cost_model.breakdown`) made from what the compiler kept rather than
from the call's arguments, so the two agree where the kernel's plan is what the model
assumes (checked in the tests).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from . import _hlo
from .._core._primitives import PRIMITIVES, SCOPE
_ESTIMATE = {name: re.compile(rf'"{name}":\s*"?(\d+)')
             for name in ("flops", "bytes_accessed", "remote_bytes_transferred")}


@dataclasses.dataclass(frozen=True)
class RingKernel:
    """The plan of one fused ring kernel, as its custom call carries it.

    `prim`: the primitive (`_primitives.PRIMITIVES`); `ring`: the ring's size;
    `directions`: 1 or 2; `flops`, `hbm_bytes`: the whole kernel's matmul flops and HBM
    traffic; `remote_bytes`: what its DMAs send in all; `dtype`: its operands' HLO dtype.
    """

    prim: str
    ring: int
    directions: int
    flops: float
    hbm_bytes: float
    remote_bytes: float
    dtype: str

    @property
    def dmas(self) -> int:
        """The remote DMAs a device starts: one per direction per step but the last."""
        return (self.ring - 1) * self.directions

    @property
    def dma_bytes(self) -> int:
        """The bytes of one DMA (one direction's piece of a step's block)."""
        return int(self.remote_bytes / self.dmas)

    @property
    def links(self) -> str:
        """Which links its DMAs take, and why (what the replay reports)."""
        ways = "both ways" if self.directions == 2 else "one way"
        return (f"remote DMAs inside one kernel: {self.ring - 1} steps {ways}, each to a "
                "ring neighbour over one link (the ring is laid along the torus)")

    def step_seconds(self, hw, peak: float) -> tuple[float, float]:
        """`(compute, transfer)` of one step on `hw`: its matmul's roofline at `peak`
        FLOP/s, and one direction's DMA with its latency."""
        n = self.ring
        compute = max(self.flops / n / peak, self.hbm_bytes / n / hw.hbm_bandwidth)
        return compute, (self.dma_bytes / hw.send_bandwidth(self.directions)
                         + hw.kernel_step_latency)

    def seconds(self, hw, peak: float) -> tuple[float, float, float]:
        """`(time, compute, communication)` of the kernel on `hw`: its time start to end,
        the part its matmuls take, and its DMAs' time in flight."""
        compute, transfer = self.step_seconds(hw, peak)
        n = self.ring
        return (hw.ring_kernel_seconds(n, compute, transfer),
                hw.launch_overhead + n * compute, (n - 1) * transfer)


# What the replay lists (`Prediction.unread`) for a kernel that sends bytes but whose
# plan it cannot read: its time is then a floor (`_aot_compare.Row.floor`).
UNREAD = "a kernel that sends bytes itself"


def _estimate(line: str, name: str) -> Optional[float]:
    found = _ESTIMATE[name].search(line)
    return float(found.group(1)) if found else None


def ring_size(prim: str, x: tuple, w: tuple, out: tuple) -> Optional[int]:
    """The ring size a primitive's local 2-D shapes imply (None if they imply none):
    a gather's result is `N` times its travelling block, a reduce-scatter's `1 / N` of
    the product."""
    (mx, kx), (kw, nw), (mo, no) = x, w, out
    p = PRIMITIVES[prim]
    # The extent of the dimension the ring cuts, (whole, one device's part).
    whole, part = {"m": (mo, mx), "n": (no, nw), "k": (kx, kw)}[p.ring_dim]
    if not p.gathers:
        whole, part = part, whole
    if part <= 0 or whole % part:
        return None
    return whole // part


def read(module, i, by_name) -> tuple[Optional[RingKernel], str]:
    """`(plan, why not)` of instruction `i`: the plan of a fused ring kernel fusedpar
    launched; None with "" for anything that sends nothing itself; None with the reason
    for a kernel that sends bytes but whose plan cannot be read.

    `i` may also be a fusion around the kernel's call (`_hlo.tpu_kernel`).
    """
    inner = _hlo.tpu_kernel(module, i)
    if inner is not None and inner is not i:
        by_name = {c.name: c for c in module.computations[i.calls[0]]}
        i = inner
    if i.opcode != "custom-call":
        return None, ""
    remote = _estimate(i.line, "remote_bytes_transferred")
    if not remote:
        return None, ""
    scopes = [s for s in SCOPE.findall(i.op_name) if s[0] in PRIMITIVES]
    if not scopes:
        return None, "no fusedpar primitive in its op_name"
    prim, _, direction = scopes[-1]
    operands = [by_name[o] for o in i.operands if o in by_name]
    shapes = [dims for o in operands for _, dims in _hlo.array_shapes(o.shape)
              if len(dims) == 2]
    results = [dims for _, dims in _hlo.array_shapes(i.shape)]
    n = (ring_size(prim, tuple(shapes[0]), tuple(shapes[1]), tuple(results[0]))
         if len(shapes) >= 2 and results and len(results[0]) == 2 else None)
    if n is None or n < 2:
        return None, f"its {prim} operand and result shapes give no ring size"
    dtype = _hlo.array_shapes(operands[0].shape)[0][0]
    plan = RingKernel(prim, n, 2 if direction == "bi" else 1,
                      _estimate(i.line, "flops") or 0.0,
                      _estimate(i.line, "bytes_accessed") or 0.0, remote, dtype)
    return plan, ""
