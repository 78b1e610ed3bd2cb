"""Pallas GPU kernels for the per-step compute of a ppermute ring.

The ring itself is driven by `fusedpar._core._backends.pallas_gpu`; the kernels only compute
one step, in two families with the same semantics:

- `mosaic`: Mosaic GPU kernels for Hopper and newer (TMA, wgmma, warp specialisation);
- `triton`: Pallas Triton kernels for GPUs before Hopper, and interpreted on CPU.

Each family has `matmul_into` (an all-gather step: the block's product written in place
into its slice of the output) and `matmul_acc` (a reduce-scatter step: `acc + x_block @
w` in one pass over the float32 accumulator). `matmul_into_reference` and
`matmul_acc_reference` are what both compute, in lax; `Term` is one window product of
`matmul_acc`.
"""

from . import mosaic as mosaic, triton as triton
from ._reference import (
    matmul_acc_reference as matmul_acc_reference,
    matmul_into_reference as matmul_into_reference,
)
from ._term import Term as Term

__all__ = ["mosaic", "triton", "matmul_acc_reference", "matmul_into_reference", "Term"]
