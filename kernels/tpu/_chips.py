"""What a kernel needs to know about the TPU it is built for: VMEM, TensorCores, tiles.

The values are plain: the package fills a `Chip` from its hardware registry
(`fusedpar._hw._registry`: one entry per TPU generation, with the arithmetic behind each
preset in docs/tpu.md), and a caller may build one for any chip.

Every kernel passes `vmem_limit_bytes`: three quarters of the chip's VMEM (the last
quarter stays for Mosaic's internal scratch), never below the compiler's default scoped
limit, which is far below the capacity on the big-VMEM chips. Buffers the kernels place
in VMEM themselves (pipeline tiles, resident operands) are planned against
`budget_bytes`, 7/8 of that limit. Tile presets `(bm, bk, bn)` for the tiled HBM path
make a step's matmul compute-bound from HBM.

Megacore: a v4 or v5p JAX device drives two TensorCores (`TpuInfo.num_cores == 2`); the
kernels then split each step's tiles between them (see `_protocol.Cores`).
"""

from __future__ import annotations

import dataclasses

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Chip:
    """What a kernel needs to know about one TPU generation.

    - `name`: "v4", "v5e", "v5p", "v6e" (or another generation's name; what error
      messages call the chip).
    - `vmem_bytes`: VMEM per TensorCore.
    - `default_scoped_vmem_bytes`: the compiler's scoped VMEM limit without
      `vmem_limit_bytes`.
    - `cores`: TensorCores one JAX device drives (2 in megacore mode).
    - `tiles`: the `(bm, bk, bn)` tile targets of the tiled HBM path.
    """

    name: str
    vmem_bytes: int
    default_scoped_vmem_bytes: int
    cores: int
    tiles: tuple

    @property
    def vmem_limit_bytes(self) -> int:
        """The scoped VMEM limit the kernels ask for (`CompilerParams.vmem_limit_bytes`)."""
        return max(self.default_scoped_vmem_bytes, self.vmem_bytes * 3 // 4)

    @property
    def budget_bytes(self) -> int:
        """VMEM the kernels plan their own buffers in: 7/8 of the limit."""
        return self.vmem_limit_bytes * 7 // 8
