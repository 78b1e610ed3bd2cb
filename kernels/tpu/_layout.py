"""Which windows of a ref Mosaic accepts: the (sublane, lane) tile of each dtype.

Mosaic stores the last two dimensions of every VMEM and HBM array in tiles of
`(sublanes, 128 lanes)`. A 32-bit word holds one float32, two bfloat16 or four int8/fp8
values, packed along the sublanes, so the tile is (8, 128) for 32-bit dtypes, (16, 128)
for 16-bit ones and (32, 128) for 8-bit ones. A window of one of those two dimensions —
a ring segment `ref.at[pl.ds(i * length, length)]`, or a block of `emit_pipeline` — must
start and end on a tile boundary unless it spans the whole dimension; leading dimensions
are free. Ring segments start at `i * length`, so a segment is aligned exactly when its
length is a multiple of the tile.

The interpreter on CPU does not care, and the Pallas lowering does not check it either
(Mosaic does, when it compiles on a TPU). So the kernels check every window they cut
with `check` when they are built for a TPU, and raise `LayoutError` before lowering.
`recording()` collects every window checked, for the tests that replay these rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import numpy as np

LANES = 128
SUBLANES = 8  # rows of 32-bit words per tile


class LayoutError(NotImplementedError):
    """A window a kernel would cut is not on Mosaic's tile boundaries."""


def sublane_tile(dtype) -> int:
    """Rows per tile for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit values."""
    bits = np.dtype(dtype).itemsize * 8
    return SUBLANES * max(1, 32 // bits)


def tile(dtype) -> tuple[int, int]:
    """The `(rows, lanes)` tile of the last two dimensions of an array of `dtype`."""
    return sublane_tile(dtype), LANES


@dataclasses.dataclass(frozen=True)
class Window:
    """A window of `length` along `axis` of the ref `name` (shape `shape`, `dtype`)."""

    name: str
    shape: tuple
    dtype: str
    axis: int
    length: int

    def problem(self) -> Optional[str]:
        """Why Mosaic would refuse this window, or None."""
        axis = self.axis % len(self.shape)
        dim = self.shape[axis]
        if self.length == dim or axis < len(self.shape) - 2:
            return None
        lanes = axis == len(self.shape) - 1
        unit = LANES if lanes else sublane_tile(self.dtype)
        if self.length % unit == 0:
            return None
        what = "lanes (columns)" if lanes else f"sublanes (rows of {self.dtype})"
        return (f"a window of {self.length} along dimension {axis} of {self.name} "
                f"{tuple(self.shape)} {self.dtype} is not a multiple of {unit} {what}: "
                f"Mosaic's tile for {self.dtype} is {tile(self.dtype)}, and windows must "
                f"be whole tiles or the whole dimension")


def segments(cuts, length) -> list:
    """The `Window`s of ring segments of `length`: `cuts` lists `(name, shape, dtype,
    axis)` of each 2-D ref cut along `axis` (0: rows, 1: columns)."""
    return [Window(name, tuple(shape), str(np.dtype(dtype)), axis - 2, length)
            for name, shape, dtype, axis in cuts]


_recorded: list = []  # one list per active `recording()` block


@contextlib.contextmanager
def recording():
    """Collect every `Window` checked while tracing inside this block (a list)."""
    windows: list = []
    _recorded.append(windows)
    try:
        yield windows
    finally:
        _recorded.pop()


def check(window: Window, enforce: bool) -> None:
    """Record `window`; with `enforce` (building for a TPU) raise if Mosaic refuses it."""
    if _recorded:
        _recorded[-1].append(window)
    if enforce:
        why = window.problem()
        if why is not None:
            raise LayoutError(why)


def check_block(name, shape, dtype, block, enforce: bool) -> None:
    """Check a 2-D block `(rows, cols)` of the ref `name` (an emit_pipeline tile)."""
    for axis, length in enumerate(block):
        check(Window(name, tuple(shape), str(np.dtype(dtype)), axis - 2, length), enforce)
