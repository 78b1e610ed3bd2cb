"""Which windows of a ref Mosaic accepts: whole (8, 128) tiles, for every TPU generation.

Mosaic (and XLA, for a kernel's operands and results) lays out the last two dimensions
of an array in tiles of `(8 rows, 128 lanes)`: `T(8,128)` for float32 and
`T(8,128)(2,1)` for bfloat16 — the bfloat16 tile is 8 rows of 128 lanes too, each 32-bit
word holding two values of neighbouring rows (HLO layouts and Mosaic memrefs say so). A
window of one of those two dimensions — a ring segment `ref.at[pl.ds(i * length,
length)]`, or a block of `emit_pipeline` — must start on a tile boundary unless it spans
the whole dimension; leading dimensions are free. Ring segments and pipeline blocks
start at multiples of their length, so a window is aligned exactly when its length is a
multiple of the tile: 8 rows or 128 lanes (`ROWS`, `LANES`).

What this rests on: compiling the five primitives' kernels with Mosaic itself, deviceless
(`fusedpar.aot.mesh`, libtpu 0.0.42 with jax 0.10.2), for TPU v4, v5e, v5p and v6e, in
float32 and bfloat16, whole-in-VMEM and tiled from HBM, uni- and bidirectional, with
this check switched off (`tests/test_tpu_mosaic.py` keeps the proof):

- rows: windows of 8, 16, 24 and 32 rows compile in both dtypes on every generation (a
  bfloat16 window of 8 or 24 rows is *not* refused: the tile of a bfloat16 layout has 8
  rows, not 16). In VMEM windows of 4 or 12 rows are refused: "E2003:
  CompileTimeMosaicUnprovenMemoryAccessAlignment: cannot statically prove that index in
  dimension 0 is a multiple of 8" (vector loads and stores); as DMA windows (the tiled
  path) 12 or 3 rows are refused: "Offsets along tiled dimensions must be aligned to
  tiles ... divisible by the tile dimension 8" (`tpu.memref_slice`).
- lanes: windows of 128 and 256 lanes compile; 64 and 192 are refused ("... multiple of
  128", "Offsets/Slice sizes along tiled dimensions must be aligned to tiles ... 128").
- The same on all four generations: the rule has no per-generation number.

Stricter than Mosaic, by choice: on the tiled path a ring window is only DMA'd, and
there Mosaic also accepted windows of 4 rows on every generation (and 2 rows on v5e;
not 1 row of bfloat16, half a packed word), even in arrays laid out `T(8,128)`; whole-in-VMEM kernels load and store the same windows with vector ops, which
need 8 (a single float32 row aside). The check runs before the path is chosen, so it asks
8 rows on both paths (`tests/test_tpu_mosaic.py` records the 4-row DMA measurement).
8-bit values (the quantized payloads of `comm_dtype`: int8, float8_e4m3fn) are laid out
`T(8,128)(4,1)` in the kernels' operands (the compiled HLO says so: 8 rows of 128 lanes,
four neighbouring rows per 32-bit word), and with this check switched off the fused
all-gather compiled for v4, v5e, v5p and v6e with 8-bit ring windows and pipeline blocks
of 8 rows, int8 and float8_e4m3fn, in VMEM and from HBM, at static and dynamic offsets
(`tests/test_tpu_mosaic.py`); a window of 4 rows in VMEM is refused (as for 32-bit
values). So their rule is 8 rows too, not the 32 of the packed `(32, 128)` tile it was
taken to be before it was measured.

The interpreter on CPU does not care, and the Pallas lowering does not check it either
(Mosaic does, when it compiles). So the kernels check every window they cut with `check`
when they are built for Mosaic, and raise `LayoutError` before lowering; the
`pallas_tpu` backend refuses a misaligned call before building it. `recording()`
collects every window checked, for the tests that replay these rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import numpy as np

LANES = 128
ROWS = 8  # rows per tile of 32-, 16- and 8-bit values, measured on v4, v5e, v5p and v6e
SUBLANES = ROWS  # the former name


class LayoutError(NotImplementedError):
    """A window a kernel would cut is not on Mosaic's tile boundaries."""


def sublane_tile(dtype) -> int:
    """Rows per tile for `dtype`: 8 for 32-, 16- and 8-bit values (measured)."""
    return ROWS


def tile(dtype) -> tuple[int, int]:
    """The `(rows, lanes)` tile of the last two dimensions of an array of `dtype`."""
    return sublane_tile(dtype), LANES


def _chip_name(chip) -> str:
    name = getattr(chip, "name", None)
    return f"TPU {name}" if name else "TPU"


@dataclasses.dataclass(frozen=True)
class Window:
    """A window of `length` along `axis` of the ref `name` (shape `shape`, `dtype`)."""

    name: str
    shape: tuple
    dtype: str
    axis: int
    length: int

    def problem(self, chip=None) -> Optional[str]:
        """Why Mosaic would refuse this window, or None. `chip` (a `_chips.Chip`, or
        None) is named in the message; the rule is the same on every generation."""
        axis = self.axis % len(self.shape)
        dim = self.shape[axis]
        if self.length == dim or axis < len(self.shape) - 2:
            return None
        lanes = axis == len(self.shape) - 1
        unit = LANES if lanes else sublane_tile(self.dtype)
        if self.length % unit == 0:
            return None
        what = "lanes (columns)" if lanes else f"rows of {self.dtype}"
        return (f"a window of {self.length} along dimension {axis} of {self.name} "
                f"{tuple(self.shape)} {self.dtype} is not a multiple of {unit} {what}: "
                f"Mosaic for {_chip_name(chip)} lays {self.dtype} out in "
                f"{tile(self.dtype)} tiles, and a window must be whole tiles or the whole "
                f"dimension (make that dimension's blocks multiples of {unit})")


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


def check(window: Window, enforce) -> None:
    """Record `window`; with `enforce` (building for Mosaic: the `Chip` it is built for,
    or True) raise `LayoutError` if Mosaic refuses it."""
    if _recorded:
        _recorded[-1].append(window)
    if enforce is not None and enforce is not False:
        why = window.problem(None if enforce is True else enforce)
        if why is not None:
            raise LayoutError(why)


def check_block(name, shape, dtype, block, enforce) -> None:
    """Check a 2-D block `(rows, cols)` of the ref `name` (an emit_pipeline tile)."""
    for axis, length in enumerate(block):
        check(Window(name, tuple(shape), str(np.dtype(dtype)), axis - 2, length), enforce)
