"""What a ring kernel asks of its ring, and where a ring position sits on the mesh.

The kernels import nothing of the package that drives them: the ring schedule they run
is given to them as a value (`RingLaunch.ring`). `RingSchedule` names what they read of
it; the package's `fusedpar.Ring` (`fusedpar._core._schedule`, the one place that knows the
ring arithmetic) is such a value. `mesh_coordinates` lives here, at the bottom, because
the kernels and the package both need it: the package imports it from here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class RingSchedule(Protocol):
    """The ring schedule of a kernel: the attributes and methods of `fusedpar.Ring` the
    kernels call (device and step indices may be Python ints or traced int32 scalars)."""

    size: int
    bidirectional: bool

    @property
    def directions(self) -> tuple: ...

    @property
    def num_directions(self) -> int: ...

    @property
    def num_transfers(self) -> int: ...

    @property
    def num_segments(self) -> int: ...

    def send_to(self, device, direction: int): ...

    def recv_from(self, device, direction: int): ...

    def gather_segment(self, device, step, direction: int): ...

    def scatter_segment(self, device, step, direction: int): ...

    def split_size(self, length: int, what: str) -> int: ...


def mesh_coordinates(position, sizes: dict) -> dict:
    """Per-axis coordinates of ring `position` on a ring over several mesh axes.

    `sizes` maps each axis name to its size, in the order of the axis tuple the ring runs
    over: the first axis is major, as `lax.axis_index(tuple)` counts. Works on traced ints.
    """
    coords = {}
    for name in reversed(list(sizes)):
        coords[name] = position % sizes[name]
        position = position // sizes[name]
    return coords
