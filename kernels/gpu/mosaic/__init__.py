"""Mosaic GPU step kernels (Hopper and newer: TMA, wgmma, warp specialisation).

- `matmul_into`: an all-gather step, the product of the block(s) in hand written in
  place into their segment(s) of the output (both halves of a bidirectional step in
  one launch), and, with `kept` (where `can_keep`), the blocks themselves into the
  gathered operand;
- `matmul_acc`: a reduce-scatter step, `acc + sum_t a_t[window] @ b_t[window]` in one
  pass over the float32 accumulator (a TMA reduce-add store).

Both run one warp-specialised persistent GEMM (`_gemm.py`). Tiles come from
`choose_config` (per shape and dtype), overridable by a `GemmConfig` or a dict of its
fields (`CONFIG_OPTIONS`). `unsupported_reason(dtype, precision)` says why a dot cannot
run here (float32 at `Precision.HIGHEST`).
"""

from ._config import (
    OPTIONS as CONFIG_OPTIONS,
    GemmConfig as GemmConfig,
    choose as choose_config,
)
from ._matmul_acc import matmul_acc as matmul_acc
from ._matmul_into import can_keep as can_keep, matmul_into as matmul_into
from ._precision import unsupported_reason as unsupported_reason

__all__ = ["matmul_acc", "matmul_into", "can_keep", "CONFIG_OPTIONS", "GemmConfig",
           "choose_config", "unsupported_reason"]
