"""How transfers cross a device's links: their routes on a TPU torus, and the links they
share while in flight at once. Used by the replay (`fusedpar._compile._simulate`).

On a TPU slice each chip has one ICI link to each neighbour along each axis; the ends of
an axis are joined (a wrap-around link) only where the slice is a whole torus (the kind's
rule, `_hardware.Hardware.wraps`). A transfer to a chip several links away is forwarded
by the routers on the way, dimension by dimension, the shorter way around an axis that
wraps (dimension-order routing), and cut-through: the first bytes move on before the
last arrive. So it pays one hop's latency per link and its bytes once, at the rate of
the most loaded link it crosses; transfers in flight at once slow each other only where
they cross the same link in the same direction. On a GPU in an NVSwitch box
every peer is one hop away, and what a device has in flight shares its egress.

`Network` replays the transfers in flight as flows: each moves its bytes at the rate its
most shared resource (a directed link, or a GPU's egress) leaves it, recomputed whenever
one starts or finishes, and is done its latency after its last byte.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

EGRESS = ("egress",)


@dataclasses.dataclass(frozen=True)
class Hop:
    """One link a transfer crosses: along torus `axis`, from chip coordinates `source`
    to `target`; `wrap` when it is the link joining the axis' two ends."""

    axis: int
    source: tuple
    target: tuple
    wrap: bool

    @property
    def link(self) -> tuple:
        return ("link", self.source, self.target)


def wraps_of(coords: list, hardware) -> tuple:
    """Each torus axis' length where the slice of chips at `coords` has wrap-around
    links on it, else 0: `hardware`'s rule (`_hardware.Hardware.wraps`) on the slice's
    extents."""
    if not coords:
        return ()
    extents = [max(c[a] for c in coords) - min(c[a] for c in coords) + 1
               for a in range(len(coords[0]))]
    return hardware.wraps(extents)


class Torus:
    """The chips of a TPU slice (`coords[d]`: device `d`'s coordinates, in the program's
    device order) and the wrap-around length of each axis (0: the axis does not wrap)."""

    def __init__(self, coords: list, wraps: Optional[tuple] = None):
        self.coords = [tuple(c) for c in coords]
        self.wraps = tuple(wraps) if wraps else (0,) * (len(self.coords[0]) if coords else 0)

    def knows(self, device: int) -> bool:
        return 0 <= device < len(self.coords)

    def route(self, source: int, target: int) -> tuple:
        """The `Hop`s from device `source` to device `target`: axis by axis, each the
        shorter way round where the axis wraps (ties go the positive way)."""
        here, goal = list(self.coords[source]), self.coords[target]
        hops = []
        for axis, size in enumerate(self.wraps):
            d = goal[axis] - here[axis]
            step = (d > 0) - (d < 0)
            count = abs(d)
            if size and abs(d) > size / 2:  # the other way round is shorter
                step, count = -step, size - abs(d)
            for _ in range(count):
                nxt = here[axis] + step
                wrap = bool(size) and not 0 <= nxt - self._low(axis) < size
                if wrap:
                    nxt = self._low(axis) + (nxt - self._low(axis)) % size
                before = tuple(here)
                here[axis] = nxt
                hops.append(Hop(axis, before, tuple(here), wrap))
        return tuple(hops)

    def _low(self, axis: int) -> int:
        return min(c[axis] for c in self.coords)

    def describe(self, source: int, target: int) -> str:
        """Which links a transfer from `source` to `target` takes, and why."""
        hops = self.route(source, target)
        a, b = self.coords[source], self.coords[target]
        head = f"device {source} {a} -> device {target} {b}: "
        if not hops:
            return head + "same chip, no link"
        steps = []
        for axis in sorted({h.axis for h in hops}):
            mine = [h for h in hops if h.axis == axis]
            path = " -> ".join([str(mine[0].source[axis])] + [str(h.target[axis]) for h in mine])
            step = f"axis {axis} {path}"
            if self.wraps[axis]:
                step += (" (through the wrap-around link)" if any(h.wrap for h in mine) else
                         f" (the shorter way round the ring of {self.wraps[axis]})")
            steps.append(step)
        text = head + f"{len(hops)} link{'s' if len(hops) > 1 else ''} ({', '.join(steps)})"
        if not any(self.wraps):
            text += "; the slice has no wrap-around links"
        return text


@dataclasses.dataclass
class _Flow:
    remaining: float  # bytes still to move
    usage: dict  # resource -> how many of its messages cross it
    cap: float  # bytes/s it moves at most, alone
    latency: float  # seconds after its last byte until it is done


class Network:
    """Transfers in flight, moving their bytes at shared rates (see the module's doc).

    `capacity(resource)`: bytes/s of a resource (a directed link, or the egress).
    Time only moves forward: `start` and `finish` are called with the compute stream's
    time, which never goes back.
    """

    def __init__(self, capacity):
        self.capacity = capacity
        self.time = 0.0
        self.flows: dict = {}
        self.done: dict = {}  # key -> the time it finished

    def start(self, key, nbytes: float, cap: float, latency: float, usage: dict,
              now: float) -> int:
        """A transfer of `nbytes` (per message) starts at `now`, its messages crossing
        `usage`'s resources. Returns the most messages one of them carries now, its own
        and those of the flows in flight (1 when it uses none)."""
        self.advance(now)
        load = max((n + sum(f.usage.get(r, 0) for f in self.flows.values())
                    for r, n in usage.items()), default=1)
        if nbytes <= 0 or cap <= 0:
            self.done[key] = now + latency
        else:
            self.flows[key] = _Flow(float(nbytes), dict(usage), cap, latency)
        return load

    def finish(self, key) -> float:
        """When transfer `key` is done (moving time on until it is, if need be)."""
        while key in self.flows:
            self._step(math.inf)
        return self.done.pop(key)

    def advance(self, to: float) -> None:
        """Move the flows in flight on to time `to`."""
        while self.flows and self.time < to:
            self._step(to)
        self.time = max(self.time, to)

    def _rates(self) -> dict:
        load: dict = {}
        for f in self.flows.values():
            for r, n in f.usage.items():
                load[r] = load.get(r, 0) + n
        return {k: min([f.cap] + [self.capacity(r) / load[r] for r in f.usage])
                for k, f in self.flows.items()}

    def _step(self, to: float) -> None:
        """Move on to `to` or to the next flow's last byte, whichever comes first."""
        rates = self._rates()
        first = min(f.remaining / rates[k] for k, f in self.flows.items())
        dt = min(first, to - self.time)
        self.time += dt
        for k in list(self.flows):
            f = self.flows[k]
            f.remaining -= rates[k] * dt
            if f.remaining / rates[k] <= 1e-12:  # done, to a picosecond
                self.done[k] = self.time + f.latency
                del self.flows[k]


__all__ = ["EGRESS", "Hop", "Network", "Torus", "wraps_of"]
