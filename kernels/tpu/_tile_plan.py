"""How a ring kernel lays out its steps: every buffer in VMEM, or tiled from HBM.

Small problems (every buffer of the call within `WHOLE_IN_VMEM_BYTES`) keep everything
in VMEM and multiply whole blocks: no tiling and no HBM<->VMEM copies inside the ring.
Otherwise operands stay in HBM and each step's matmul is an `emit_pipeline` over
`(bm, bk) x (bk, bn)` tiles (`_step_compute`). Tile targets come from the chip
(`_chips.Chip.tiles`) or the caller; each tile is the whole dimension if it is at most
its target, else the largest divisor that is a multiple of Mosaic's tile for every dtype
it cuts (`_layout.tile`: 8 rows for 32- and 16-bit values, 128 lanes) and at most the
target.

On the tiled path the plan also keeps some buffers *resident* in VMEM for the whole
kernel, in the order the kernel lists them (most reused first), as long as they fit the
chip's budget next to the pipeline tiles: the stationary operand, read by every step (in
HBM the pipeline would read it again for every row of tiles of every step), the
reduce-scatter's per-step partial product (in HBM it costs a write and a read per step),
the all-gather-contract's f32 running sum. Megacore chips give each TensorCore its own
VMEM, so each core holds its own copy of a resident buffer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from ._layout import LANES, sublane_tile

# Kernels whose every buffer (operands, results, ring slots) fits in this many bytes keep
# them all in VMEM: half of the smallest default scoped VMEM limit (16 MiB).
WHOLE_IN_VMEM_BYTES = 8 * 2**20


class PlanError(NotImplementedError):
    """No layout of the kernel's steps fits (no aligned tile, or not enough VMEM)."""


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a kernel's steps run.

    - `in_vmem`: every buffer whole in VMEM, whole-block matmuls (one TensorCore).
    - `tiles`: `(bm, bk, bn)` of the tiled HBM path (None in VMEM).
    - `resident`: names of the buffers kept in VMEM on the tiled path.
    - `cores`: TensorCores that share each step's tiles (megacore: 2).
    - `partner_tiles`: `(bm, bk, bn)` of a gather's partner product on the tiled path
      (its left operand read transposed, `(bk, bm)` tiles).
    """

    in_vmem: bool
    tiles: Optional[tuple] = None
    resident: frozenset = frozenset()
    cores: int = 1
    partner_tiles: Optional[tuple] = None


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def pick(dim: int, target: int, align: int) -> Optional[int]:
    """The tile length for a dimension of `dim`, or None if no aligned divisor exists."""
    if dim <= target:
        return dim
    for t in range(target - target % align, 0, -align):
        if dim % t == 0:
            return t
    return None


def tiles(dims, in_dtype, out_dtype, targets, a_transposed=False):
    """`(bm, bk, bn)` for a `(rows, contraction) x (contraction, cols)` step, or a reason.

    Rows are cut in the left operand, the result and the f32 accumulator, so `bm` follows
    the largest of their sublane tiles (a quantized operand's 8-bit rows have the same 8);
    `bk` and `bn` cut lanes (and the right operand's rows, whose tile divides 128). A left
    operand held transposed (`a_transposed`, `(bk, bm)` tiles) has its rows on lanes:
    `bm` is then a multiple of 128 too.
    """
    rows_dtype = max((in_dtype, out_dtype, np.float32),
                     key=sublane_tile)  # the dtype with the tallest tile
    rows_align = LANES if a_transposed else sublane_tile(rows_dtype)
    aligns = (rows_align, LANES, LANES)
    got = tuple(pick(d, t, a) for d, t, a in zip(dims, targets, aligns))
    for t, name, dim, target, align in zip(got, "mkn", dims, targets, aligns):
        if t is None:
            why = (f"its rows are the lanes of its transposed left operand: multiples of "
                   f"{LANES}" if a_transposed and name == "m" else
                   f"Mosaic's tile for {np.dtype(rows_dtype)} is "
                   f"({sublane_tile(rows_dtype)}, {LANES})")
            return None, (
                f"no tile of at most block_{name}={target} divides the dimension of "
                f"length {dim} in steps of {align} ({why}); pass options={{'block_{name}': "
                f"...}} with a divisor of {dim}, or pad the operands")
    return got, None


def tile_bytes(t, in_dtype, out_dtype, accumulates=False) -> int:
    """VMEM of one step's pipeline: the a, b and out tiles double-buffered (and the prior
    f32 sum's, when the step `accumulates`), plus the f32 accumulator."""
    bm, bk, bn = t
    in_size, out_size = np.dtype(in_dtype).itemsize, np.dtype(out_dtype).itemsize
    prior = 2 * bm * bn * 4 if accumulates else 0
    return 2 * (bm * bk + bk * bn) * in_size + 2 * bm * bn * out_size + prior + bm * bn * 4


def plan(launch, dims, in_dtype, out_dtype, buffers, candidates, accumulates=False,
         partner=None):
    """A `(StepLayout, None)`, or `(None, reason)` when no tiling fits.

    - `launch`: the kernel's `_launch.RingLaunch` (its chip, and the `vmem` and
      `tile_targets` settings: force all-in-VMEM or the tiled path, override the chip's
      tile presets).
    - `dims`: the step matmul's `(rows, contraction, cols)`; `in_dtype`, `out_dtype`: its
      operands' and result's.
    - `buffers`: `(shape, dtype)` of every buffer of the call (the all-in-VMEM decision).
    - `candidates`: `(name, shape, dtype)` of buffers that may stay resident, most reused
      first.
    - `accumulates`: each step adds the prior f32 sum (all-gather-contract).
    - `partner`: the `(rows, contraction, cols)` of a second product each step runs after
      the first, its left operand transposed, adding to its own f32 sum (a gather's
      partner); its pipeline runs after the step's, so the larger of the two counts.
    A quantized (8-bit) operand's tiles are counted at `in_dtype`'s size, which also
    covers its widened copy.
    """
    chip, vmem = launch.chip, launch.vmem
    if vmem is None:
        vmem = sum(nbytes(*b) for b in buffers) <= WHOLE_IN_VMEM_BYTES
    if vmem:
        return StepLayout(True), None
    targets = tuple(launch.tile_targets or chip.tiles)
    t, why = tiles(dims, in_dtype, out_dtype, targets)
    if t is None:
        return None, why
    need = tile_bytes(t, in_dtype, out_dtype, accumulates)
    partner_tiles = None
    if partner is not None:
        # Its rows are lanes of its transposed left operand: at least one lane tile.
        bm, bk, bn = targets
        partner_tiles, why = tiles(partner, in_dtype, np.float32, (max(bm, LANES), bk, bn),
                                   a_transposed=True)
        if partner_tiles is None:
            return None, f"the partner product: {why}"
        need = max(need, tile_bytes(partner_tiles, in_dtype, np.float32, True))
    free = chip.budget_bytes - need
    if free < 0:
        return None, (f"tiles {t} need {need / 2**20:.1f} MiB "
                      f"of VMEM, more than the {chip.budget_bytes / 2**20:.0f} MiB a "
                      f"TPU {chip.name} kernel plans with; pass smaller block_m/block_k/"
                      f"block_n options")
    resident = set()
    for name, shape, dtype in candidates:
        if nbytes(shape, dtype) <= free:
            resident.add(name)
            free -= nbytes(shape, dtype)
    return StepLayout(False, t, frozenset(resident), chip.cores, partner_tiles), None
