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
  TPU compiler's `ConcatBitcast` of slices it placed side by side and its
  `AllocateBuffer`) is free; an asynchronous computation that is not a collective (an
  `async-start` around a fusion) runs on the compute stream where it starts;
- an asynchronous collective starts when the compute stream reaches its `-start` (or a
  `send`) and runs beside it; its `-done` makes the compute stream wait for it. Transfers
  are replayed as flows over the device's links (`fusedpar._compile._links`): a transfer between
  chips several ICI links apart pays a hop's latency per link and its bytes once, at the
  rate of the most loaded link it crosses (cut-through); transfers in flight at once
  share a link where they cross it in the same direction (a TPU torus), or the device's
  egress (NVSwitch);
- a synchronous collective (and the whole-array collectives of the reference, as a ring
  of `N - 1` hops over the device's links, both directions; the TPU compiler's
  reduce-scatter wrapped in a fusion too; a GPU collective XLA marks `is_sync`) blocks
  the compute stream for its duration;
- a fused ring kernel (a Pallas TPU call that sends with remote DMAs itself) runs its
  ring inside the compute stream, step matmuls beside step DMAs, from the plan its call
  carries (`fusedpar._compile._hlo_ring_kernel`);
- asynchronous copies and slices (`copy-start` / `slice-start`: the TPU's DMAs between
  HBM and its on-chip memories) run beside the compute stream at HBM bandwidth; those to
  or from host memory (`S(5)`: offloaded activations) over the host link, each
  direction its own (`Hardware.host_bandwidth`);
- a `while` loop runs its body as many times as XLA knows it iterates, or as its
  condition says (`_hlo.trip_count`). A transfer a loop body starts and a later
  iteration (or the code after the loop) finishes, carried in the loop's tuple, stays in
  flight across the iteration boundary and overlaps the next iteration's compute;
- a conditional runs its costliest branch (the predicate is not known before it runs),
  and says so in `Prediction.unread`.

What it cannot read it lists (`Prediction.unread`) with what it assumed instead. Two
bounds come from the program alone, loops counted with their trip counts: the compute
its matmuls need at the preset's matmul rate (`min_compute_s`, from `dot_flops`), and
the time every collective's bytes need with all of the device's links sending
(`min_comm_s`). The replay's `compute` and `communication` are never below them.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Optional

from . import _flops, _hlo, _hlo_ring_kernel, _links
from .._hw._hardware import ASSUMED_HOST_BANDWIDTH

_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
         "after-all", "partition-id", "replica-id", "opt-barrier",
         "optimization-barrier", "add-dependency", "get-dimension-size", "recv"}
# Custom calls that move nothing: the TPU compiler's concatenation of slices it already
# placed side by side in memory (a bitcast of their buffers), its allocation of an
# uninitialised buffer, and the handshake before a collective offloaded to the
# SparseCores starts (`call-start` on the "sparsecore" execution thread, whose transfer
# is the collective the call runs).
_FREE_TARGETS = {"ConcatBitcast", "AllocateBuffer", "PrepareAsyncCallStart",
                 "PrepareAsyncCallDone"}
_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
                "s4": "int4", "u4": "uint4", "s8": "int8", "u8": "uint8", "s32": "int32",
                "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
                "f8e4m3": "float8_e4m3", "f8e4m3fnuz": "float8_e4m3fnuz",
                "f8e5m2fnuz": "float8_e5m2fnuz", "f8e4m3b11fnuz": "float8_e4m3b11fnuz"}
_SYNC = re.compile(r'"is_sync":\s*true')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
# An instruction's name without the number XLA appends ("wrapped_add.12").
_NUMBERED = re.compile(r"[.\d]+$")
_DMAS = ("copy-start", "slice-start")


@dataclasses.dataclass(frozen=True)
class TransferCost:
    """One collective of the program as the replay moved it.

    `bytes`: what one message carries (per device); `runs`: how many times it ran (loop
    trips); `seconds`: its time in flight, start to done, over all runs; `links`: which
    links it takes and why (for a collective-permute on a TPU slice: the devices of its
    most loaded route, the torus axes, wrap-around or not); `shared`: the most messages
    one of its links carried at once when it started (its own and those in flight);
    `waited`: the seconds the compute stream waited for it, over all runs.
    """

    name: str
    kind: str
    bytes: int
    runs: int
    seconds: float
    links: str
    shared: int
    waited: float = 0.0


@dataclasses.dataclass(frozen=True)
class ComputeCost:
    """One kind of instruction on the compute stream: `kind` is "matmul", "ring kernel"
    (a fused TPU kernel, its DMA waits included), or the instruction's name without its
    number (XLA names fusions by what they do: "wrapped_add", "dynamic-update-slice",
    "loop_convert_multiply_fusion"); `count` how many ran (loop trips counted) and
    `seconds` their time together."""

    kind: str
    count: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one program on one device, and where the time goes.

    `seconds`: when the compute stream finishes; `compute`: every compute instruction
    back to back; `communication`: every transfer's time in flight as replayed (loops
    counted); `exposed`: seconds the compute stream waited for transfers; `copies`:
    seconds it waited for asynchronous copies and slices.

    Bounds from the program alone: `dot_flops`, the FLOPs of its matmuls (loops counted
    with their trip counts), and `min_compute_s`, those FLOPs at the preset's matmul rate
    (`Hardware.matmul_flops`); `min_comm_s`, every collective's bytes with all of the
    device's links sending at once. `lower_bound`: `max(compute, min_comm_s)`.

    `unread`: what the replay did not understand, each with what it assumed instead;
    `transfers`: each collective's `TransferCost`; `kernels`: the compute stream's time
    by kind of instruction (`ComputeCost`), longest first.
    """

    seconds: float
    compute: float
    communication: float
    exposed: float
    copies: float = 0.0
    dot_flops: float = 0.0
    min_compute_s: float = 0.0
    min_comm_s: float = 0.0
    unread: tuple = ()
    transfers: tuple = ()
    kernels: tuple = ()

    @property
    def lower_bound(self) -> float:
        return max(self.compute, self.min_comm_s)

    def __str__(self) -> str:
        """The line a person reads (`print(prediction)`); `repr` has every field."""
        unread = f" Not read: {'; '.join(self.unread)}." if self.unread else ""
        return (f"Predicted per device: {self.seconds * 1e6:,.0f} us (lower bound "
                f"{self.lower_bound * 1e6:,.0f} us: compute {self.compute * 1e6:,.0f} us, "
                f"communication over all links {self.min_comm_s * 1e6:,.0f} us; waiting "
                f"on transfers {self.exposed * 1e6:,.0f} us).{unread}")


class _Replay:
    def __init__(self, module, hw, coords=None, wraps=None):
        self.module, self.hw = module, hw
        self.multiplying = _hlo.matmul_computations(module)
        self.torus = _links.Torus(coords, wraps) if coords else None
        self.network = _links.Network(self._capacity)
        self.compute = self.communication = self.exposed = self.copies = 0.0
        self.kinds: dict = {}  # kind of compute instruction -> [count, seconds]
        self.unread: dict = {}  # what -> assumed (insertion-ordered, each once)
        self.quiet = 0  # > 0 while weighing a conditional's branches (`_branch`)
        self.branches: dict = {}  # conditional -> the branch it runs
        self.costs: dict = {}  # collective name -> [kind, bytes, runs, seconds, links, shared]
        self.started: dict = {}  # flow key -> (start time, instruction name or None: a DMA)
        self.sends: dict = {}  # channel -> the flow of the send on it (its recv-done waits)
        self.serial = 0

    def note(self, what: str, assumed: str) -> None:
        if not self.quiet:  # (a conditional's branches weighed, not run)
            self.unread.setdefault(what, assumed)

    # -- costs ---------------------------------------------------------------------------

    def _capacity(self, resource) -> float:
        if resource == _links.EGRESS:
            return self.hw.egress_bandwidth
        if resource == ("hbm",):
            return self.hw.hbm_bandwidth
        return self.hw.link_bandwidth

    def peak(self, dtype: str) -> float:
        """A matmul's rate: its operands' dtype (`_flops.matmul_flops`'s, with a float32
        precision above the default after an "@"); one the preset gives no rate for runs
        at another's (`Hardware.rate_key`), which is listed."""
        base, _, precision = dtype.partition("@")
        name = _DTYPE_NAMES.get(base, base) + (f"_{precision}" if precision else "")
        key = self.hw.rate_key(name)
        if key != name:
            self.note(f"{name} matmuls: no {name} rate in the preset", f"{key}'s")
        return self.hw.matmul_flops(key)

    def _kernel_time(self, i, by_name) -> float:
        if (i.opcode in _FREE or i.opcode.endswith("-done")
                or (_hlo.is_async_start(i) and i.opcode != "fusion-start")
                or i.name.startswith("async-collective-done") or i.target in _FREE_TARGETS):
            return 0.0
        operand_bytes = _hlo.read_bytes(self.module, i, by_name)
        update = _hlo.in_place_bytes(self.module, i, by_name)
        # A kernel writing into a slice of a buffer its result aliases moves the slice.
        in_kernel = _flops.aliased_kernel_bytes(i, by_name)
        if update is not None:  # reads and writes the update, not the buffer
            memory = 2 * update / self.hw.hbm_bandwidth
        elif in_kernel is not None:
            memory = in_kernel / self.hw.hbm_bandwidth
        else:
            written = _hlo.written_bytes(self.module, i)
            memory = (operand_bytes + written) / self.hw.hbm_bandwidth
        if _hlo.is_matmul(i, self.multiplying):
            flops, dtype = _flops.matmul_flops(self.module, i, by_name)
            return self._count("matmul",
                               max(flops / self.peak(dtype), memory) + self.hw.launch_overhead)
        if i.opcode == "custom-call":
            self.note(f"custom-call {i.name} ({i.target})",
                      "a kernel costing its bytes over HBM bandwidth")
        return self._count(_NUMBERED.sub("", i.name), memory) if memory else 0.0

    def _pairs(self, i) -> list:
        pairs = _hlo.source_target_pairs(i)
        if pairs is None:
            self.note(f"{i.opcode} {i.name}: no source_target_pairs",
                      "one message to a neighbour")
            pairs = [(0, 1)]
        return [(s, t) for s, t in pairs if s != t]

    def group_size(self, i) -> int:
        """Devices in the largest replica group of collective `i`."""
        n = _hlo.group_size(i, self.module.devices)
        if n is None:
            self.note(f"{i.opcode} {i.name}: replica groups not read",
                      f"all {self.module.devices} devices in one group")
            return self.module.devices
        return n

    def flow(self, i, kind: str, nbytes: float) -> tuple:
        """`(bytes per message, rate alone, latency, {resource: messages}, links)` of
        collective `i` moving `nbytes` per device."""
        hw = self.hw
        i = _hlo.collective_inside(self.module, i) or i  # an async wrapper's collective
        if kind == "collective-permute":
            pairs = self._pairs(i)
            if not pairs:
                return 0, hw.link_bandwidth, 0.0, {}, "to itself: no link"
            if self._on_torus(pairs):
                return self._routed(pairs, nbytes, "")
            sends = max(collections.Counter(s for s, _ in pairs).values())
            return (nbytes, hw.link_bandwidth, hw.hop_latency, {_links.EGRESS: sends},
                    "one hop to each peer, sharing the device's egress")
        n = self.group_size(i)
        if n <= 1:
            return 0, hw.link_bandwidth, 0.0, {}, "a group of one: no link"
        if kind == "all-to-all" and self.torus is not None:
            # Every device sends each other one of the group a block of its own, routed
            # over the torus like a permute's (a ring's n - 1 blocks per device would
            # hide how far the others are: 2.3x less time on 8 chips in a row).
            groups = _hlo.replica_groups(i, self.module.devices) or []
            pairs = [(s, t) for g in groups for s in g for t in g if s != t]
            if pairs and self._on_torus(pairs):
                return self._routed(pairs, nbytes / n, f"an all-to-all over {n} devices; ")
        # A ring of n devices over the device's links (both directions where separate).
        rate = max(hw.send_bandwidth(1), 2 * hw.send_bandwidth(2))
        usage = {} if self.torus is not None else {_links.EGRESS: 1}
        why = f"a ring over {n} devices, both directions"
        sent = _hlo.ring_factor(kind, n) * nbytes
        if kind == "all-reduce":
            return sent, rate, 2 * (n - 1) * hw.hop_latency, usage, why
        return sent, rate, hw.launch_overhead + (n - 1) * hw.hop_latency, usage, why

    def _on_torus(self, pairs) -> bool:
        return self.torus is not None and all(self.torus.knows(d) for p in pairs for d in p)

    def _routed(self, pairs, size: float, why: str) -> tuple:
        """`flow`'s answer for messages of `size` bytes between `pairs` of devices in
        flight at once, each routed over the torus (`_links.Torus.route`): the links
        they share, and the most shared message's route."""
        routes = {p: self.torus.route(*p) for p in pairs}
        usage = collections.Counter(h.link for r in routes.values() for h in r)
        worst = max(pairs, key=lambda p: (max((usage[h.link] for h in routes[p]),
                                              default=0), len(routes[p])))
        hops = max(len(r) for r in routes.values())
        return (size, self.hw.link_bandwidth, self.hw.hop_latency * max(hops, 1), dict(usage),
                why + self.torus.describe(*worst))

    def alone(self, i, kind: str, nbytes: float) -> float:
        """A collective's time with every one of the device's links sending (the bound)."""
        egress = self.hw.egress_bandwidth
        i = _hlo.collective_inside(self.module, i) or i
        if kind == "collective-permute":
            return nbytes / egress if self._pairs(i) else 0.0
        return nbytes * _hlo.ring_factor(kind, self.group_size(i)) / egress

    # -- the replay ----------------------------------------------------------------------

    def _start(self, i, kind, nbytes, now) -> tuple:
        """Start collective `i` at `now`; its flow's key."""
        size, rate, latency, usage, why = self.flow(i, kind, nbytes)
        key = (i.name, self.serial)
        self.serial += 1
        shared = self.network.start(key, size, rate, latency, usage, now)
        self.started[key] = (now, i.name)
        cost = self.costs.setdefault(i.name, [kind, int(nbytes), 0, 0.0, why, 0, 0.0])
        cost[5] = max(cost[5], shared)
        return key

    def _dma(self, i, by_name, now) -> tuple:
        key = (i.name, self.serial)
        self.serial += 1
        self.network.start(key, _hlo.dma_bytes(i, by_name), self.hw.hbm_bandwidth, 0.0,
                           {("hbm",): 1}, now)
        self.started[key] = (now, None)
        return key

    def _host(self, i, nbytes, direction, now) -> tuple:
        """An offloaded array's transfer to or from host memory, beside the compute stream
        over the device's host link (each direction its own); a `copies` wait at its
        done."""
        rate = self.hw.host_bandwidth
        if not rate:
            rate = ASSUMED_HOST_BANDWIDTH
            self.note(f"host link ({direction})",
                      f"{rate / 1e9:.0f} GB/s each way (PCIe 4.0 x16): no published figure")
        key = (i.name, self.serial)
        self.serial += 1
        self.network.start(key, nbytes, rate, 0.0, {("host", direction): 1}, now)
        self.started[key] = (now, None)
        return key

    def _finish(self, key, now) -> float:
        """Wait for flow `key` from `now`; the time the compute stream goes on."""
        if key not in self.started:  # already waited for (a send, by its recv-done)
            return now
        end = self.network.finish(key)
        began, name = self.started.pop(key)
        if name is not None:
            cost = self.costs[name]
            cost[2] += 1
            cost[3] += end - began
            self.communication += end - began
            if end > now:
                self.exposed += end - now
                cost[6] += end - now
        elif end > now:
            self.copies += end - now
        return max(now, end)

    def run(self, computation: str, now: float, carried: Optional[dict] = None) -> tuple:
        """Replay `computation` from time `now`. `carried`: flows in flight in elements of
        its parameter tuple (a loop body's), by element index. Returns the time it ends
        and the flows still in flight in elements of its root tuple."""
        instructions = self.module.computations.get(computation, ())
        by_name = {i.name: i for i in instructions}
        carried = dict(carried or {})
        in_flight: dict = {}  # value name -> flow key
        after_loop: dict = {}  # (while name, element) -> flow key
        for i in instructions:
            if i.opcode == "get-tuple-element":
                key = self._element(i, by_name, carried, after_loop)
                if key is not None:
                    in_flight[i.name] = key
                continue
            waited = self._waited(i, by_name, in_flight)
            if waited is not None:
                now = self._finish(in_flight.pop(waited), now)
                continue
            kind = _hlo.collective_kind(self.module, i)
            channel = _CHANNEL.search(i.line)
            channel = channel.group(1) if channel else ""
            if i.opcode == "send":
                key = self._start(i, "collective-permute", _hlo.operand_bytes(i, by_name), now)
                in_flight[i.name] = self.sends[channel] = key
            elif i.opcode == "recv-done":  # the data arrives when the send on its channel does
                now = self._finish(self.sends.pop(channel, None), now)
            elif kind is not None and _hlo.is_async_start(i) and not _SYNC.search(i.line):
                in_flight[i.name] = self._start(i, kind, _hlo.operand_bytes(i, by_name), now)
            elif kind is not None:  # synchronous: the compute stream waits for it
                now = self._finish(self._start(i, kind, _hlo.operand_bytes(i, by_name), now), now)
            elif (host := _hlo.host_transfer(i, by_name)) is not None:
                in_flight[i.name] = self._host(i, *host, now)
            elif i.opcode in _DMAS:
                in_flight[i.name] = self._dma(i, by_name, now)
            elif i.opcode == "while":
                now = self._loop(i, by_name, now, in_flight, after_loop)
            elif i.opcode in ("call", "conditional") or (i.opcode == "async-start" and i.calls):
                branch = self._branch(i)
                if i.opcode == "conditional" and len(i.calls) > 1:
                    self.note(f"conditional {i.name}: which branch runs",
                              f"{branch}, the costliest of its {len(i.calls)} branches")
                now, _ = self.run(branch, now)
            elif (i.opcode.endswith("-start") and i.opcode != "async-start" and not (
                    i.opcode == "fusion-start" and _hlo.in_place_bytes(self.module, i, by_name))):
                self.note(f"{i.opcode} {i.name}", "nothing: it costs no time")
            else:  # a kernel (newer XLA starts an in-place update as an async fusion-start)
                kernel, why = _hlo_ring_kernel.read(self.module, i, by_name)
                if kernel is not None:
                    now = self._ring_kernel(i, kernel, now)
                    continue
                if why:
                    self.note(f"custom-call {i.name}: {_hlo_ring_kernel.UNREAD} ({why})",
                              "its matmul's time, its transfers hidden")
                t = self._kernel_time(i, by_name)
                self.compute += t
                now += t
        root = self.module.roots.get(computation)
        out = {}
        if root is not None and root.opcode == "tuple":
            for j, name in enumerate(root.operands):
                if name in in_flight:
                    out[j] = in_flight.pop(name)
        # Flows finished nowhere in sight (done in another computation, or dropped).
        for key in list(in_flight.values()) + list(carried.values()) + list(after_loop.values()):
            now = self._finish(key, now)
        return now, out

    def _ring_kernel(self, i, kernel, now) -> float:
        """A fused ring kernel (`_hlo_ring_kernel`) from `now`: the compute stream is busy
        for all of it; what its matmuls do not cover is waiting on its DMAs."""
        total, compute, comm = kernel.seconds(self.hw, self.peak(kernel.dtype))
        self.compute, self.communication = self.compute + compute, self.communication + comm
        self.exposed += total - compute
        cost = self.costs.setdefault(i.name, ["ring kernel", kernel.dma_bytes, 0, 0.0,
                                              kernel.links, 1, 0.0])
        cost[2], cost[3] = cost[2] + kernel.dmas, cost[3] + comm
        cost[6] += total - compute  # the DMA waits its matmuls do not cover
        self._count("ring kernel", total)
        return now + total

    def _count(self, kind: str, seconds: float) -> float:
        """Add one instruction of `kind` taking `seconds` to the compute stream's tally;
        returns `seconds`."""
        tally = self.kinds.setdefault(kind, [0, 0.0])
        tally[0] += 1
        tally[1] += seconds
        return seconds

    def _element(self, i, by_name, carried, after_loop):
        """The flow in flight in the tuple element `i` reads, if any: an element of the
        body's parameter a previous iteration left in flight, or of a loop's result."""
        source = by_name.get(i.operands[0]) if i.operands else None
        index = _hlo.element_index(i)
        if source is None or index is None:
            return None
        if source.opcode == "parameter" and index in carried:
            return carried.pop(index)
        return after_loop.pop((source.name, index), None)

    def _waited(self, i, by_name, in_flight) -> Optional[str]:
        """The value in flight that `i` (a `-done`, or a TPU `async-collective-done`
        fusion) finishes, if any."""
        collective_done = i.opcode == "fusion" and i.name.startswith("async-collective-done")
        if not (i.opcode.endswith("-done") or collective_done):
            return None
        # In flight under a name a tuple element leads to: the start itself, or the
        # element of a loop's tuple that carries it (`_element`).
        for name in i.operands:
            while name is not None:
                if name in in_flight:
                    return name
                source = by_name.get(name)
                name = source.operands[0] if source is not None and \
                    source.opcode == "get-tuple-element" and source.operands else None
        if collective_done:  # through the continuation fusions that carry its state
            start = _hlo.started_by(i, by_name, self.module)
            return start if start in in_flight else None
        return None

    def _loop(self, i, by_name, now, in_flight, after_loop) -> float:
        _, body = _hlo.loop_parts(i)
        trips = _hlo.trip_count(self.module, i, by_name)
        if trips is None:
            self.note(f"while {i.name}: trip count not read", "one iteration")
            trips = 1
        start = by_name.get(i.operands[0]) if i.operands else None
        carried = {}
        if start is not None and start.opcode == "tuple":
            carried = {j: in_flight.pop(name) for j, name in enumerate(start.operands)
                       if name in in_flight}
        for _ in range(trips):
            now, carried = self.run(body, now, carried)
        for j, key in carried.items():
            after_loop[(i.name, j)] = key
        return now

    # -- what the program needs, whatever the schedule -----------------------------------

    def _branch(self, i, seen: tuple = ()) -> str:
        """The computation a call runs: a conditional's costliest branch (its matmuls at
        the matmul rate and its collectives at full egress), which the replay assumes
        runs (it cannot know the predicate); any other call's one computation."""
        if i.opcode != "conditional" or len(i.calls) < 2:
            return i.calls[0]
        if i.name not in self.branches:
            self.quiet += 1
            try:
                self.branches[i.name] = max(
                    i.calls, key=lambda c: sum(self.census(c, 1, seen + (c,))[1:]))
            finally:
                self.quiet -= 1
        return self.branches[i.name]

    def census(self, computation: str, times: int = 1, seen: tuple = ()) -> tuple:
        """`(dot flops, seconds at the matmul rate, seconds of collectives at full
        egress)` of `computation`, run `times` times, with what it calls."""
        flops = compute = comm = 0.0
        instructions = self.module.computations.get(computation, ())
        by_name = {i.name: i for i in instructions}
        for i in instructions:
            kind = _hlo.collective_kind(self.module, i)
            inner: list = []
            if i.opcode == "while":
                trips = _hlo.trip_count(self.module, i, by_name)
                inner = [(_hlo.loop_parts(i)[1], trips if trips is not None else 1)]
            elif i.opcode in ("call", "conditional") or (i.opcode == "async-start" and
                                                         kind is None and i.calls):
                inner = [(self._branch(i, seen), 1)]
            elif i.opcode == "send":
                comm += times * self.alone(i, "collective-permute", _hlo.operand_bytes(i, by_name))
            elif kind is not None:
                comm += times * self.alone(i, kind, _hlo.operand_bytes(i, by_name))
            elif _hlo.is_matmul(i, self.multiplying):
                f, dtype = _flops.matmul_flops(self.module, i, by_name)
                flops += times * f
                compute += times * f / self.peak(dtype)
                kernel, _ = _hlo_ring_kernel.read(self.module, i, by_name)
                if kernel is not None:
                    comm += times * kernel.remote_bytes / self.hw.egress_bandwidth
            for c, trips in inner:
                if c and c not in seen:
                    f, t, m = self.census(c, times * trips, seen + (c,))
                    flops, compute, comm = flops + f, compute + t, comm + m
        return flops, compute, comm


def predict(text: str, hardware, coords: Optional[list] = None,
            wraps: Optional[tuple] = None) -> Prediction:
    """Replay the scheduled HLO `text` on `hardware` (a `cost_model.Hardware`).

    `coords`: each device's physical coordinates, in the program's device order (a TPU
    slice's `device.coords`), and `wraps`: the torus length of each coordinate axis (0
    where it has no wrap-around link; by default `hardware.wraps` of the slice's
    extents): transfers are routed over the torus's links
    (`fusedpar._compile._links`). Without coordinates every peer is one hop away and the transfers
    in flight share the device's egress (a GPU's NVSwitch).
    """
    if coords and wraps is None:
        wraps = _links.wraps_of(coords, hardware)
    module = _hlo.parse(text)
    replay = _Replay(module, hardware, coords, wraps)
    seconds, _ = replay.run(module.entry, 0.0)
    flops, min_compute, min_comm = replay.census(module.entry)
    transfers = tuple(TransferCost(name, *cost) for name, cost in replay.costs.items())
    unread = tuple(f"{what}: assumed {assumed}" for what, assumed in replay.unread.items())
    kernels = tuple(sorted((ComputeCost(kind, n, t) for kind, (n, t) in replay.kinds.items()),
                           key=lambda k: -k.seconds))
    return Prediction(seconds, replay.compute, replay.communication, replay.exposed,
                      replay.copies, flops, min_compute, min_comm, unread, transfers,
                      kernels)


__all__ = ["ComputeCost", "Prediction", "TransferCost", "predict"]
