"""Pallas GPU kernels for the per-step compute of the ring (the `"pallas_gpu"` backend).

The ring itself is the lax ppermute ring (`fusedpar._ring`), so XLA runs the transfers
on its collective stream and overlaps them with these kernels (given the XLA flags of
`fusedpar.gpu_overlap_flags`):

- `matmul_into`: an all-gather step, the product of the block in hand written in place
  into its slice of the output (both halves of a bidirectional step in one launch);
- `matmul_acc`: a reduce-scatter step, `acc + x_block @ w` in one pass over the float32
  accumulator (also the FSDP gather along the contraction).

Tiles come from `_tiles.choose` (per shape and dtype; override with the op's `options`).
"""

from ._accumulate import (
    matmul_acc as matmul_acc,
    matmul_acc_reference as matmul_acc_reference,
    Term as Term,
)
from ._matmul_into import (
    matmul_into as matmul_into,
    matmul_into_reference as matmul_into_reference,
)
from ._steps import run as run, unavailable as unavailable
from ._tiles import choose as choose_tiles, OPTIONS as _TILE_OPTIONS, Tiles as Tiles

# The `options` keys these kernels read (the dispatcher rejects others): tile overrides,
# `interpret`, and the ring's bench-only `no_transfers`.
OPTIONS = frozenset(_TILE_OPTIONS) | {"interpret", "no_transfers"}
