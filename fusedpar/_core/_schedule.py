"""Ring schedules: which block a device holds, computes and sends at each step.

This is the one place that knows the ring arithmetic. The lax ring backend, the TPU
kernels and the GPU ring all ask a `Ring` instead of re-deriving it.

Vocabulary. A ring of `size` devices moves data in one or two *directions*: `+1` sends
to the right neighbour `(d + 1) % size`, `-1` to the left one. A bidirectional ring
splits every block into two halves, one per direction, so each link carries half the
bytes and both links of a device are busy at once.

A *segment* names one piece of the full (gathered or reduced) operand: block `b` of the
`size` blocks, half `h` of its `num_directions` halves, as the single index
`b * num_directions + h`. Segments are what a step computes with, so code that writes
"segment s of the output" is the same for uni- and bidirectional rings.

All index functions accept Python ints or traced int32 scalars (`lax.axis_index`,
`fori_loop` counters, `pl.program_id`): they only use `+`, `*` and `%` on non-negative
operands, and `==` with selects for a ring `order`, which lower the same way in lax,
Triton and Mosaic.

The ring order. By default the ring visits the devices of a mesh axis in index order.
On a TPU slice neighbours in that order need not be neighbours on the wires (on a 2x4
v5e slice devices 1 and 2 sit diagonally apart: every block would cross two ICI links).
`ring_order` finds an order whose hops are single links from the devices' physical
coordinates (a Hamiltonian cycle of the slice's grid, e.g. a snake), and `ring_for`
reads those coordinates from the mesh a program is traced under.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

# Re-exported: the kernels need it too, so it lives at the bottom, in fusedpar.kernels.
from ..kernels._ring import mesh_coordinates as mesh_coordinates


# The fewest rows (columns) a folded reduce-scatter's chunk may have, by platform.
# Folding doubles the step matmuls: each reads the whole stationary operand, which
# bounds a thin matmul, and on a GPU pays a launch; thinner chunks replayed slower than
# separate adds (docs/measurements.md). On CPU (simulated devices: overheads, not speed)
# it folds at any size, so that the tests' small shapes run the folded schedule.
FOLD_MIN_CHUNK = {"gpu": 512, "tpu": 256, "cpu": 1}


def folds(chunk: int, platform: str) -> bool:
    """Whether the lax ring folds a reduce-scatter's adds into its step matmuls
    (`ring._folded_reduce_scatter`) with chunks of `chunk` rows (columns) on `platform`."""
    return chunk >= FOLD_MIN_CHUNK.get(platform, FOLD_MIN_CHUNK["tpu"])


@dataclasses.dataclass(frozen=True)
class Ring:
    """A ring schedule over `size` devices.

    **Arguments:**

    - `size`: the number of devices on the ring (the mesh axis size), at least 1.
    - `bidirectional`: whether blocks are split into two halves that travel in opposite
      directions. A ring of size 1 or 2 gains nothing from it but stays correct.
    """

    size: int
    bidirectional: bool = False
    order: Optional[tuple] = None

    def __post_init__(self):
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"Ring size must be a positive int, got {self.size!r}.")
        if self.order is not None:
            order = tuple(int(d) for d in self.order)
            if sorted(order) != list(range(self.size)):
                raise ValueError(f"Ring order must be a permutation of range({self.size}), "
                                 f"got {self.order!r}.")
            # The identity is the plain ring: keep one spelling of it.
            object.__setattr__(self, "order", None if order == tuple(range(self.size))
                               else order)

    @property
    def directions(self) -> tuple[int, ...]:
        """The directions data travels in: `(+1,)` or `(+1, -1)`."""
        return (1, -1) if self.bidirectional else (1,)

    @property
    def num_directions(self) -> int:
        return len(self.directions)

    @property
    def num_steps(self) -> int:
        """Compute steps per direction: every device sees every block once."""
        return self.size

    @property
    def num_transfers(self) -> int:
        """Transfers per direction: there is nothing to send after the last step."""
        return self.size - 1

    @property
    def num_segments(self) -> int:
        """Segments in the full operand: `size` blocks times `num_directions` halves."""
        return self.size * self.num_directions

    # -- positions --------------------------------------------------------------------
    #
    # Devices are named by their index along the mesh axis (`lax.axis_index`), blocks by
    # the index of the device they start on (the order `all_gather` stacks them in). A
    # ring with an `order` visits the devices in that order (position p holds device
    # `order[p]`): the arithmetic below runs on positions, and these two map between
    # positions and devices. Without an order both are the identity.

    def position(self, device):
        """Ring position of `device` (its index along the mesh axis)."""
        if self.order is None:
            return device
        return _lookup(_inverse(self.order), device)

    def device(self, position):
        """Device (index along the mesh axis) at ring `position`."""
        if self.order is None:
            return position
        return _lookup(self.order, position)

    # -- neighbours ---------------------------------------------------------------------

    def send_to(self, device, direction: int):
        """The device that `device` sends to in `direction` (+1 or -1)."""
        return self.device((self.position(device) + direction + self.size) % self.size)

    def recv_from(self, device, direction: int):
        """The device that `device` receives from in `direction` (+1 or -1)."""
        return self.device((self.position(device) - direction + self.size) % self.size)

    def permutation(self, direction: int) -> list[tuple[int, int]]:
        """`(source, destination)` pairs of one transfer step, for `lax.ppermute`."""
        return [(d, self.send_to(d, direction)) for d in range(self.size)]

    # -- all-gather ---------------------------------------------------------------------

    def gather_block(self, device, step, direction: int):
        """Block that `device` holds (and computes with) at `step` of an all-gather.

        At step 0 a device holds its own block; each transfer moves every block one
        device along `direction`, so at step `s` the device at position `p` holds the
        block that started at position `p - direction * s`.
        """
        p = self.position(device)
        return self.device((p - direction * step + self.size * self.size) % self.size)

    def gather_segment(self, device, step, direction: int):
        """Segment of the gathered operand that `device` holds at `step` in `direction`."""
        block = self.gather_block(device, step, direction)
        return block * self.num_directions + self.direction_index(direction)

    # -- reduce-scatter -----------------------------------------------------------------

    def scatter_block(self, device, step, direction: int):
        """Output block whose partial sum `device` adds at `step` of a reduce-scatter.

        The accumulator that the device at position `p` holds at step `s` started at
        position `p - direction * s`; choosing the block of position `p - direction *
        (s + 1)` for it makes the accumulator for block `b` finish on device `b` after the
        last step (`s = size - 1`).
        """
        return self.gather_block(device, step + 1, direction)

    def scatter_segment(self, device, step, direction: int):
        """Segment of the reduced output that `device` adds into at `step`."""
        block = self.scatter_block(device, step, direction)
        return block * self.num_directions + self.direction_index(direction)

    # -- helpers ------------------------------------------------------------------------

    def direction_index(self, direction: int) -> int:
        """Position of `direction` in `directions` (which half of a block it carries)."""
        if direction not in self.directions:
            raise ValueError(f"direction must be one of {self.directions}, got {direction!r}.")
        return self.directions.index(direction)

    def split_size(self, length: int, what: str) -> int:
        """Length of one direction's half of a block of `length`, checking it divides."""
        if length % self.num_directions:
            raise ValueError(
                f"{what} has length {length}, which a bidirectional ring cannot split into "
                f"two equal halves; use an even length or bidirectional=False."
            )
        return length // self.num_directions


def prefers_bidirectional(size: int, block_length: int) -> bool:
    """The default ring shape: bidirectional when the ring has more than 2 devices (with 2,
    both directions reach the same neighbour) and each block splits into equal halves."""
    return size > 2 and block_length % 2 == 0


# -- the ring order on physical links ------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _inverse(order: tuple) -> tuple:
    inverse = [0] * len(order)
    for position, device in enumerate(order):
        inverse[device] = position
    return tuple(inverse)


def _lookup(table: tuple, index):
    """`table[index]` for a Python int, or for a traced int32 scalar a chain of selects
    (a table of constants indexed by a traced scalar lowers the same everywhere this
    way, Mosaic kernels included; the chain is as long as the ring)."""
    if isinstance(index, int):
        return table[index]
    from jax import numpy as jnp  # only traced indices need jax

    value = jnp.asarray(table[0], jnp.int32)
    for i in range(1, len(table)):
        value = jnp.where(index == i, jnp.int32(table[i]), value)
    return value


def _link_distance(a, b, wraps, extent) -> int:
    """ICI links between coordinates `a` and `b` (shortest way, round a wrapped dim)."""
    links = 0
    for i, (u, v) in enumerate(zip(a, b)):
        d = abs(u - v)
        if i < len(wraps) and wraps[i] and extent is not None:
            d = min(d, extent[i] - d)
        links += d
    return links


def ring_hops(coords: Sequence[tuple], order: Optional[Sequence[int]] = None,
              wraps: Sequence[bool] = (), extent: Optional[Sequence[int]] = None) -> list:
    """ICI links each hop of the ring crosses: hop `p` goes from position `p` to `p + 1`
    (the last one back to position 0). `coords[d]` are device `d`'s coordinates;
    `order` the ring order (None: index order); `wraps[i]` whether dimension `i` has
    wrap-around links over the slice's `extent[i]` devices."""
    order = list(range(len(coords))) if order is None else list(order)
    n = len(order)
    if n < 2:
        return []
    return [_link_distance(coords[order[p]], coords[order[(p + 1) % n]], wraps, extent)
            for p in range(n)]


def _snake(sizes: Sequence[int]) -> list:
    """Grid points of `sizes` in boustrophedon order: consecutive points are neighbours
    (a Hamiltonian path; the first dimension is the slowest)."""
    if not sizes:
        return [()]
    rest = _snake(sizes[1:])
    out = []
    for i in range(sizes[0]):
        out += [(i,) + r for r in (rest if i % 2 == 0 else reversed(rest))]
    return out


def _grid_cycle(sizes: Sequence[int], wraps: Sequence[bool]) -> list:
    """Grid points of `sizes` (each > 1) in a cycle of single links where one exists.

    Two or more dimensions with an even one (`a`): walk the other dimensions' snake `P`
    up and down at each `a` (leaving out `P`'s first point), then return along `P`'s
    first point: every step is one link. A single dimension is a cycle if it wraps; else
    the best a line allows, out on even points and back on odd ones (hops of 2 links).
    With every dimension odd no cycle of single links exists (the grid is bipartite with
    an odd count): the snake, closed by one longer hop.
    """
    if len(sizes) == 1:
        n = sizes[0]
        if (wraps and wraps[0]) or n <= 2:
            return [(i,) for i in range(n)]
        return [(i,) for i in _zigzag(n)]
    even = [i for i, s in enumerate(sizes) if s % 2 == 0]
    if not even:
        return _snake(sizes)
    a = even[0]
    others = [s for i, s in enumerate(sizes) if i != a]
    path = _snake(others)

    def point(i, p):
        return path[p][:a] + (i,) + path[p][a:]

    cycle = [point(0, 0)]
    for i in range(sizes[a]):
        steps = range(1, len(path)) if i % 2 == 0 else range(len(path) - 1, 0, -1)
        cycle += [point(i, p) for p in steps]
    cycle += [point(i, 0) for i in range(sizes[a] - 1, 0, -1)]
    return cycle


def _zigzag(n: int) -> list:
    """0, 2, 4, ... then back on the odd ones: a ring on a line with hops of <= 2 links."""
    return list(range(0, n, 2)) + list(range(n - 1 if n % 2 == 0 else n - 2, 0, -2))


def ring_order(coords: Sequence[tuple], wraps: Sequence[bool] = (),
               extent: Optional[Sequence[int]] = None) -> tuple:
    """The order a ring over devices at `coords` should visit them in (device indices,
    starting with device 0), each hop one ICI link where the devices allow it.

    `coords[d]` are device `d`'s physical coordinates (TPU `device.coords`); `wraps[i]`
    whether dimension `i` has wrap-around links over the slice's `extent[i]` devices.
    Devices that fill a box of the grid (a slice, or a row or plane of one) get a
    Hamiltonian cycle of it (`_grid_cycle`); others, and devices sharing a coordinate
    (two cores of one chip), keep index order. Pure: no devices, no JAX.
    """
    n = len(coords)
    if n <= 2:
        return tuple(range(n))
    coords = [tuple(int(v) for v in c) for c in coords]
    if len(set(coords)) != n:
        return tuple(range(n))
    ndim = len(coords[0])
    lows = [min(c[i] for c in coords) for i in range(ndim)]
    sizes = [max(c[i] for c in coords) - lows[i] + 1 for i in range(ndim)]
    dims = [i for i in range(ndim) if sizes[i] > 1]
    if _prod(sizes[i] for i in dims) != n:  # not a full box: nothing to route round
        return tuple(range(n))
    # A dimension's wrap-around links join this ring only if it spans the whole slice.
    wrapped = [bool(i < len(wraps) and wraps[i] and extent is not None
                    and sizes[i] == extent[i]) for i in dims]
    index = {c: d for d, c in enumerate(coords)}
    cycle = []
    for point in _grid_cycle([sizes[i] for i in dims], wrapped):
        full = list(lows)
        for i, v in zip(dims, point):
            full[i] += v
        cycle.append(index[tuple(full)])
    start = cycle.index(0)
    return tuple(cycle[start:] + cycle[:start])


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def tpu_wraps(device_kind: str, extent: Sequence[int]) -> tuple:
    """Which dimensions of a TPU slice of `extent` chips have wrap-around links: the
    registry's rule for the kind (`_hardware.Hardware.wraps`; no wrap-around for a kind
    it does not know). A guess either way costs little: `ring_order` needs no
    wrap-around on a grid with an even side, only on a line.
    """
    from .._hw import _registry

    kind = _registry.find("tpu", device_kind)
    if kind is None or kind.hardware is None:
        return tuple(False for _ in extent)
    return tuple(bool(n) for n in kind.hardware.wraps(extent))


def group_order(groups: Sequence[Sequence[tuple]], wraps=(), extent=None) -> tuple:
    """One ring order for several rings that share it (one `ppermute` for all groups
    of a mesh axis): the candidate (index order, or one group's `ring_order`) whose
    hops cross the fewest links summed over the groups."""
    n = len(groups[0])
    candidates = [tuple(range(n))]
    for coords in groups:
        order = ring_order(coords, wraps, extent)
        if order not in candidates:
            candidates.append(order)
    return min(candidates, key=lambda o: sum(sum(ring_hops(c, o, wraps, extent))
                                             for c in groups))


def mesh_groups(mesh, axis_name) -> Optional[tuple]:
    """`(coords, wraps, extent)` of the device groups over `axis_name` (a name or a tuple,
    first axis major, as `lax.axis_index` counts) of a concrete `mesh` of TPU devices:
    `coords[g][i]` is the place of device `i` of group `g` (its chip's coordinates, and
    which of the chip's devices it is where a chip holds several: TPU7x); None when the
    devices have no coordinates (GPU, CPU)."""
    import numpy as np

    from .._hw import _registry

    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    devices = np.asarray(mesh.devices)
    flat = devices.reshape(-1)
    if not len(flat) or getattr(flat[0], "platform", None) != "tpu" or not all(
            hasattr(d, "coords") for d in flat):
        return None
    axes = list(mesh.axis_names)
    others = [axes.index(a) for a in axes if a not in names]
    ring_axes = [axes.index(a) for a in names]
    size = _prod(devices.shape[i] for i in ring_axes)
    groups = devices.transpose(others + ring_axes).reshape(-1, size)
    kind = _registry.find("tpu", flat[0].device_kind)
    coords = [[_registry.position(d, kind) for d in group] for group in groups]
    all_coords = [_registry.position(d, kind) for d in flat]
    extent = tuple(max(c[i] for c in all_coords) + 1 for i in range(len(all_coords[0])))
    return coords, tpu_wraps(flat[0].device_kind, extent), extent


def mesh_ring_order(mesh, axis_name) -> Optional[tuple]:
    """The ring order over `axis_name` of a concrete `mesh` of TPU devices (`mesh_groups`),
    or None (index order) when its devices have no coordinates (GPU, CPU)."""
    found = mesh_groups(mesh, axis_name)
    if found is None:
        return None
    coords, wraps, extent = found
    order = group_order(coords, wraps, extent)
    return None if order == tuple(range(len(coords[0]))) else order


def all_to_all_load(coords: Sequence[tuple], wraps: Sequence[bool] = (),
                    extent: Optional[Sequence[int]] = None) -> float:
    """The blocks an all-to-all among devices at `coords` puts on each link of its most
    loaded device, over a one-hop ring collective's `n - 1`: each device sends every
    other one a block, which crosses as many ICI links as they are apart, spread over
    the device's links to its neighbours among them. 0.57 on a 2x2x2 cube (12 link-hops
    over 3 links), 1.14 on a 2x4 grid's corner (16 over 2), 4 on 8 chips in a row."""
    n = len(coords)
    if n < 2:
        return 0.0
    worst = 0.0
    for a in coords:
        distances = [_link_distance(a, b, wraps, extent) for b in coords if b != a]
        neighbours = max(1, sum(d == 1 for d in distances))
        worst = max(worst, sum(distances) / neighbours)
    return worst / (n - 1)


# What a ring traced where its devices are unknown runs like, and how to get the one-hop
# ring: `ring_for` warns with it (once per process), `fusedpar.explain` appends it.
INDEX_ORDER_HINT = (
    "the ring follows the slice's wires (one ICI hop per transfer) only where its devices "
    "are known: under `with jax.set_mesh(mesh):`, or inside jax.shard_map(mesh=<a "
    "jax.sharding.Mesh>); traced with only an abstract mesh it runs in index order, whose "
    "hops may cross several ICI links: trace it under `with jax.set_mesh(mesh):`")
_warned = set()


def ring_for(axis_name, size: int, bidirectional: bool = False) -> Ring:
    """The `Ring` a collective over `axis_name` runs, in the order of the wires when the
    devices of the mesh it is traced over are known (`_target.concrete_mesh`: the mesh
    `jax.set_mesh` set, or the one the enclosing `jax.shard_map` was given).

    There the ring follows `mesh_ring_order`; elsewhere it runs in index order, which is
    the same schedule with hops that may cross more than one link: on a TPU that warns
    once (`INDEX_ORDER_HINT`).
    """
    order = None
    if size > 2:
        from .._hw import _target

        names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        mesh = _target.concrete_mesh()
        if mesh is not None and all(n in mesh.shape for n in names):
            order = mesh_ring_order(mesh, axis_name)
        elif _target.current().platform == "tpu" and names not in _warned:
            import warnings

            _warned.add(names)
            warnings.warn(f"fusedpar: a ring over mesh axis {axis_name!r} ({size} TPU "
                          f"devices) is traced where its devices are unknown: "
                          f"{INDEX_ORDER_HINT}.", stacklevel=2)
    return Ring(size, bidirectional, order)
