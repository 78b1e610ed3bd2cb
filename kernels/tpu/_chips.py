"""What the kernels plan for on each TPU generation: VMEM, TensorCores, tile presets.

VMEM capacities come from JAX's own TPU table (`pltpu.get_tpu_info_for_chip`, the TPU
Hardware Reference of the Pallas docs), per TensorCore: v4 16 MiB, v5e 128 MiB, v5p
64 MiB, v6e 128 MiB. The compiler's *default* scoped VMEM limit is far below that on the
big-VMEM chips (16 MiB on v4, v5e and v5p, 32 MiB on v6e, as XLA's "exceeded scoped vmem
limit" messages print it), so every kernel passes `vmem_limit_bytes`: three quarters of
the capacity (the last quarter stays for Mosaic's internal scratch), never below the
default. Buffers the kernels place in VMEM themselves (pipeline tiles, resident
operands) are planned against `budget_bytes`, 7/8 of that limit.

Tile presets `(bm, bk, bn)` for the tiled HBM path make a step's matmul compute-bound
from HBM. Per k-step a tile loads `bm*bk + bk*bn` elements and does `2*bm*bk*bn` flops,
so its intensity in bfloat16 is `bm*bn / (bm + bn)` flop/byte; it must exceed the chip's
peak / HBM bandwidth: v4 275 TFLOP/s / 1.23 TB/s = 224, v5e 197 / 0.82 = 240, v5p
459 / 2.77 = 166, v6e 918 / 1.64 = 560. 512 x 512 gives 256 (enough on v4),
512 x 1024 gives 341 (v5e, v5p), 1024 x 2048 gives 683 (v6e). Every preset is a multiple
of the MXU width (128 up to v5p, 256 on v6e). Their VMEM in bfloat16 (a, b and out tiles
double-buffered, plus the f32 accumulator): v4 4 MiB, v5e/v5p 10 MiB, v6e 28 MiB — the
last one does not fit v6e's default 32 MiB scoped limit next to anything else, which is
why `vmem_limit_bytes` is set.

Megacore: a v4 or v5p JAX device drives two TensorCores (`TpuInfo.num_cores == 2`); the
kernels then split each step's tiles between them (see `_protocol.Cores`).
"""

from __future__ import annotations

import dataclasses

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Chip:
    """What a kernel needs to know about one TPU generation.

    - `name`: "v4", "v5e", "v5p", "v6e" (or another generation's name).
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


# name -> (default scoped VMEM, cores per JAX device in megacore mode, tile targets)
_PRESETS = {
    "v4": (16 * MiB, 2, (512, 512, 512)),
    "v5e": (16 * MiB, 1, (512, 1024, 1024)),
    "v5p": (16 * MiB, 2, (512, 1024, 1024)),
    "v6e": (32 * MiB, 1, (1024, 1024, 2048)),
}
# Generations without a preset: the smallest default limit and 512 tiles, one core.
_OTHER = (16 * MiB, 1, (512, 512, 512))
NAMES = tuple(_PRESETS)
# What the kernels plan for where there is no TPU to ask (interpret mode on CPU).
DEFAULT = "v5e"


def chip(name: str, cores: int | None = None) -> Chip:
    """The `Chip` for generation `name` ("v4", "v5e", "v5p", "v6e", or another that JAX
    knows), with `cores` TensorCores per device (default: megacore where the chip has it)."""
    from jax.experimental.pallas import tpu as pltpu

    try:
        version = pltpu.ChipVersion(name)
    except ValueError:
        valid = ", ".join(v.value for v in pltpu.ChipVersion)
        raise ValueError(f"unknown TPU generation {name!r}; JAX knows {valid}") from None
    default_scoped, megacore, tiles = _PRESETS.get(name, _OTHER)
    if cores is not None and not 1 <= cores <= megacore:
        # A grid axis of 2 "parallel" programs on one TensorCore runs them one after the
        # other: the first would wait forever for the second at its first hand-over.
        raise ValueError(f"a TPU {name} device has {megacore} TensorCore(s) to split a "
                         f"step between, not {cores}")
    cores = megacore if cores is None else cores
    info = pltpu.get_tpu_info_for_chip(version, 1)
    return Chip(name, info.vmem_capacity_bytes, default_scoped, cores, tiles)


def local_chip() -> Chip:
    """The `Chip` of the default TPU device (its generation and megacore mode)."""
    from jax.experimental.pallas import tpu as pltpu

    info = pltpu.get_tpu_info()
    return chip(str(info.chip_version), info.num_cores)
