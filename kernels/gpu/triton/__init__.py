"""Pallas Triton step kernels: the GPU kernels before Hopper (and interpreted on CPU).

The Pallas Triton backend is deprecated from jax 0.11 in favour of Mosaic GPU (it warns
on every launch there); these kernels serve GPUs without wgmma/TMA (before sm90), and
CPU tests, where Pallas interpret mode runs them at any small shape.

- `matmul_into`: an all-gather step, the block's product written in place into its slice
  of the output (both halves of a bidirectional step in one launch), and with `kept` the
  block itself into the gathered operand;
- `matmul_acc`: a reduce-scatter step, `acc + sum of window products` in one pass.

Tiles come from `choose_tiles` (a heuristic per shape and dtype); `TILE_OPTIONS` name the
fields a caller may override.
"""

from ._matmul_acc import matmul_acc as matmul_acc
from ._matmul_into import can_keep as can_keep, matmul_into as matmul_into
from ._tile_config import OPTIONS as TILE_OPTIONS, Tiles as Tiles, choose as choose_tiles

__all__ = ["matmul_acc", "matmul_into", "can_keep", "TILE_OPTIONS", "Tiles", "choose_tiles"]
