"""A time predicted from a compiled schedule: one compute stream, transfers beside it.

The scheduled HLO (`compiled.as_text()`) fixes the order of everything a device runs. We
replay it with a target's numbers (`cost_model.Hardware`: peak FLOP/s per dtype and the
fraction a large matmul reaches, HBM bandwidth, link bandwidth per direction and per
device, per-hop latency, launch overhead — each preset cites its spec sheet):

- the compute stream runs the instructions in schedule order; a matmul (a dot or
  convolution, alone or in a fusion, a cuBLAS call, a Pallas kernel) costs its roofline,
  `max(flops / (peak * efficiency), bytes / HBM bandwidth)`, plus a launch; any other
  kernel costs its bytes over HBM bandwidth (an in-place update only its update's; a
  fusion not the buffers it passes through untouched, as the TPU compiler's
  asynchronous collective fusions do); bookkeeping (parameters, tuples, bitcasts, the
  TPU compiler's `ConcatBitcast` of slices it placed side by side) is free;
- an asynchronous collective starts when the compute stream reaches its `-start` and
  runs beside it; its `-done` makes the compute stream wait for it. A transfer costs
  its latency plus its bytes over the bandwidth one device sends with (`hops` times for a
  transfer that crosses several links); transfers in flight at once share the device's
  egress where the links are shared (NVSwitch), and each has its own link where the
  device has one per neighbour (a TPU torus);
- a synchronous collective (and the whole-array collectives of the reference, as a ring
  of `N - 1` hops; the TPU compiler's reduce-scatter wrapped in a fusion too) blocks the
  compute stream for its duration;
- a `while` loop runs its body as many times as XLA knows it iterates.

The lower bound of the same program is `max(compute, communication)`: every matmul and
kernel back to back, or every byte sent over all of the device's links at once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from . import _hlo

_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start",
         "copy-done", "after-all", "partition-id", "replica-id", "opt-barrier",
         "optimization-barrier", "add-dependency", "get-dimension-size"}
# Custom calls that move nothing: the TPU compiler's concatenation of slices it already
# placed side by side in memory (a bitcast of their buffers).
_FREE_TARGETS = {"ConcatBitcast"}
_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
                "s8": "int8", "u8": "uint8", "s32": "int32",
                "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_FLOPS = re.compile(r'"flops":\s*"?(\d+)')
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one program on one device, and where the time goes.

    `seconds`: when the compute stream finishes; `compute`: every compute instruction
    back to back; `communication`: every transfer's time with all of the device's links
    in use; `lower_bound`: `max(compute, communication)`; `exposed`: seconds the compute
    stream waited for transfers.
    """

    seconds: float
    compute: float
    communication: float
    exposed: float

    @property
    def lower_bound(self) -> float:
        return max(self.compute, self.communication)


class _Replay:
    def __init__(self, module, hw, coords=None, wraps=None):
        self.module, self.hw = module, hw
        self.multiplying = _hlo.matmul_computations(module)
        self.coords, self.wraps = coords, wraps
        self.compute = self.communication = self.exposed = 0.0

    # -- costs ---------------------------------------------------------------------------

    def _peak(self, dtype: str) -> float:
        return self.hw.matmul_flops(_DTYPE_NAMES.get(dtype, "float32"))

    def _matmul_flops(self, i: _hlo.Instruction, by_name) -> tuple[float, str]:
        """`(flops, operand dtype)` of a matmul instruction (or of the one inside it)."""
        found = _FLOPS.search(i.line)
        if i.opcode in ("dot", "convolution"):
            return self._dot_flops(i, by_name)
        if i.opcode in ("fusion", "call"):
            total, dtype = 0.0, "f32"
            for c in i.calls:
                inner = {j.name: j for j in self.module.computations.get(c, ())}
                for j in self.module.computations.get(c, ()):
                    if j.opcode in ("dot", "convolution"):
                        f, dtype = self._dot_flops(j, inner)
                        total += f
            return total, dtype
        contracting = _GEMM_CONTRACT.search(i.line)
        if contracting and i.operands and i.operands[0] in by_name:  # a cuBLAS GEMM
            (dtype, lhs), = _hlo.array_shapes(by_name[i.operands[0]].shape)[:1]
            out = _hlo.array_shapes(i.shape)[0][1]
            k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", contracting.group(1)))
            return 2.0 * math.prod(out) * k, dtype
        if found:  # a Pallas kernel's cost estimate
            arrays = [_hlo.array_shapes(by_name[o].shape) for o in i.operands if o in by_name]
            dtype = arrays[0][0][0] if arrays and arrays[0] else "bf16"
            return float(found.group(1)), dtype
        # A Pallas kernel whose estimate the lowering dropped (jax 0.10's Mosaic GPU and
        # Triton lowerings do): guess from shapes. The step multiplies the smallest
        # product its operands chain into (a window of the left one's columns allowed),
        # once per operand of that shape (a bidirectional step's two pieces), and no more
        # than its result's rows x columns x a matching contraction (a kernel writing
        # into a slice of an aliased buffer has the whole buffer as its result).
        shapes = [s for o in i.operands if o in by_name
                  for s in _hlo.array_shapes(by_name[o].shape) if len(s[1]) == 2]
        dtype = shapes[0][0] if shapes else "bf16"
        pairs = [(2.0 * a[1][0] * b[1][0] * b[1][1], a) for a in shapes for b in shapes
                 if a is not b and b[1][0] and a[1][1] % b[1][0] == 0]
        if not pairs:
            return 0.0, dtype
        flops, piece = min(pairs, key=lambda p: p[0])
        flops *= sum(s[1] == piece[1] for s in shapes)
        out = [s for s in _hlo.array_shapes(i.shape) if len(s[1]) == 2]
        if out:
            m, n = out[0][1]
            bounds = [2.0 * m * n * b[1][0] for b in shapes if b[1][1] == n]
            flops = min([flops] + bounds)
        return flops, dtype

    def _dot_flops(self, i, by_name) -> tuple[float, str]:
        out = _hlo.array_shapes(i.shape)
        lhs = by_name.get(i.operands[0]) if i.operands else None
        if not out or lhs is None:
            return 0.0, "f32"
        (ldtype, ldims), = _hlo.array_shapes(lhs.shape)[:1]
        if i.opcode == "dot":
            m = _CONTRACT.search(i.line)
            dims = [int(d) for d in m.group(1).split(",") if d] if m else [len(ldims) - 1]
            k = math.prod(ldims[d] for d in dims)
        else:  # convolution: the lhs feature dimension ('f') is contracted
            m = _LABELS.search(i.line)
            k = ldims[m.group(1).index("f")] if m and "f" in m.group(1) else ldims[-1]
        return 2.0 * math.prod(out[0][1]) * k, ldtype

    def _kernel_time(self, i, by_name) -> float:
        if (i.opcode in _FREE or i.opcode.endswith("-done") or _hlo.is_async_start(i)
                or i.name.startswith("async-collective-done") or i.target in _FREE_TARGETS):
            return 0.0
        operand_bytes = _hlo.read_bytes(self.module, i, by_name)
        update = _hlo.in_place_bytes(self.module, i, by_name)
        if update is not None:  # reads and writes the update, not the buffer
            memory = 2 * update / self.hw.hbm_bandwidth
        else:
            written = _hlo.written_bytes(self.module, i)
            memory = (operand_bytes + written) / self.hw.hbm_bandwidth
        if _hlo.is_matmul(i, self.multiplying):
            flops, dtype = self._matmul_flops(i, by_name)
            return max(flops / self._peak(dtype), memory) + self.hw.launch_overhead
        return memory

    def _hops(self, source: int, target: int) -> int:
        if self.coords is None or source >= len(self.coords) or target >= len(self.coords):
            return 1
        a, b = self.coords[source], self.coords[target]
        hops = 0
        for axis, (x, y) in enumerate(zip(a, b)):
            d = abs(x - y)
            size = self.wraps[axis] if self.wraps else 0
            hops += min(d, size - d) if size else d
        return max(hops, 1)

    def transfer_time(self, i, kind, nbytes, in_flight: int) -> float:
        """Seconds one collective takes with `in_flight` transfers sharing the links."""
        hw = self.hw
        i = _hlo.collective_inside(self.module, i) or i  # an async wrapper's collective
        if kind == "collective-permute":
            m = _PAIRS.search(i.line)
            pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(1)) if m else []
            hops = max((self._hops(int(s), int(t)) for s, t in pairs), default=1)
            return hw.hop_latency * hops + hops * nbytes / hw.send_bandwidth(max(in_flight, 1))
        n = self._group_size(i)
        if n <= 1:
            return 0.0
        # A ring of n devices over the device's links (both directions where separate).
        bw = max(hw.send_bandwidth(1), 2 * hw.send_bandwidth(2))
        if kind == "all-gather":
            step = nbytes
        elif kind == "reduce-scatter":
            step = nbytes / n
        elif kind == "all-reduce":
            return 2 * ((n - 1) * hw.hop_latency + (n - 1) * (nbytes / n) / bw)
        else:  # all-to-all and the rest: every block once
            step = nbytes / n
        return hw.launch_overhead + (n - 1) * hw.hop_latency + (n - 1) * step / bw

    def _group_size(self, i) -> int:
        m = _GROUPS.search(i.line)
        if m:
            return len([g for g in m.group(1).split(",") if g])
        m = _GROUPS_IOTA.search(i.line)
        return int(m.group(2)) if m else 1

    # -- the replay ----------------------------------------------------------------------

    def run(self, computation: str, now: float) -> float:
        instructions = self.module.computations.get(computation, ())
        by_name = {i.name: i for i in instructions}
        in_flight: dict = {}  # start name -> finish time
        for i in instructions:
            kind = _hlo.collective_kind(self.module, i)
            done = _hlo.started_by(i, by_name)
            if kind is not None and _hlo.is_async_start(i):
                nbytes = _operand_bytes(i, by_name)
                live = 1 + sum(end > now for end in in_flight.values())
                t = self.transfer_time(i, kind, nbytes, live)
                self.communication += self._alone(i, kind, nbytes)
                in_flight[i.name] = now + t
            elif done in in_flight:
                end = in_flight.pop(done)
                if end > now:
                    self.exposed += end - now
                    now = end
            elif kind is not None:  # synchronous: the compute stream waits for it
                nbytes = _operand_bytes(i, by_name)
                t = self.transfer_time(i, kind, nbytes, 1)
                self.communication += self._alone(i, kind, nbytes)
                self.exposed += t
                now += t
            elif i.opcode == "while":
                trips = _TRIP.search(i.line)
                body = [c for c in i.calls if "cond" not in c] or list(i.calls)
                for _ in range(int(trips.group(1)) if trips else 1):
                    now = self.run(body[-1], now)
            elif i.opcode in ("call", "conditional"):
                for c in i.calls[:1]:
                    now = self.run(c, now)
            else:
                t = self._kernel_time(i, by_name)
                self.compute += t
                now += t
        for end in in_flight.values():  # done in another computation
            now = max(now, end)
        return now

    def _alone(self, i, kind, nbytes) -> float:
        """A transfer's time with every one of the device's links sending (the bound)."""
        hw = self.hw
        i = _hlo.collective_inside(self.module, i) or i
        egress = hw.egress_bandwidth
        if kind == "collective-permute":
            return nbytes / egress
        n = self._group_size(i)
        factor = {"all-gather": n - 1, "reduce-scatter": (n - 1) / n,
                  "all-reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)
        return nbytes * factor / egress


def _operand_bytes(i, by_name) -> int:
    operand = by_name.get(i.operands[0]) if i.operands else None
    if operand is not None:
        return operand.bytes
    arrays = _hlo.array_shapes(i.shape)
    if not arrays:
        return 0
    dtype, dims = arrays[0]
    return _hlo.shape_bytes(f"{dtype}[{','.join(map(str, dims))}]")


def predict(text: str, hardware, coords: Optional[list] = None,
            wraps: Optional[tuple] = None) -> Prediction:
    """Replay the scheduled HLO `text` on `hardware` (a `cost_model.Hardware`).

    `coords`: each device's physical coordinates, in the program's device order (a TPU
    slice's `device.coords`), and `wraps`: the torus size of each coordinate axis (0
    where it does not wrap): a transfer between devices `h` links apart costs `h` times
    one link's. Without them every transfer is one hop.
    """
    module = _hlo.parse(text)
    replay = _Replay(module, hardware, coords, wraps)
    seconds = replay.run(module.entry, 0.0)
    return Prediction(seconds, replay.compute, replay.communication, replay.exposed)


__all__ = ["Prediction", "predict"]
