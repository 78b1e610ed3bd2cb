"""Pallas GPU kernels for the per-step compute of a ppermute ring.

The ring itself is driven by `fusedpar._backends.pallas_gpu`; these kernels only compute:

- `matmul_into`: an all-gather step, the product of the block in hand written in place
  into its slice of the output (both halves of a bidirectional step in one launch);
- `matmul_acc`: a reduce-scatter step, `acc + x_block @ w` in one pass over the float32
  accumulator (also the FSDP gather along the contraction).

Tiles come from `choose_tiles` (per shape and dtype; `TILE_OPTIONS` name the overrides).
"""

from ._accumulate import (
    Term as Term,
    matmul_acc as matmul_acc,
    matmul_acc_reference as matmul_acc_reference,
)
from ._matmul_into import (
    matmul_into as matmul_into,
    matmul_into_reference as matmul_into_reference,
)
from ._tiles import OPTIONS as TILE_OPTIONS, Tiles as Tiles, choose as choose_tiles
