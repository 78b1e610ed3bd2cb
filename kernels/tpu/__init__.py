"""Fused Pallas TPU ring kernels: one kernel per collective matmul, the ring inside it.

Remote DMAs between neighbours overlap the matmul of the block in hand. On TPU they
compile with Mosaic; on CPU they run in TPU interpret mode, which simulates every
device, DMA and semaphore.

- `all_gather_matmul.py`, `matmul_reduce_scatter.py`: the kernels, each with its typed
  parameters (`AllGatherMatmulParams`, `MatmulReduceScatterParams`) and a lax
  `reference` beside it;
- `_launch.py`: `RingLaunch` (ring, collective id, chip, interpret mode) and the
  `pallas_call`; `_protocol.py`: the ring protocol and the megacore split;
  `_step_compute.py`: a step's matmul and add, whole or tiled; `_tile_plan.py`: VMEM or
  tiled, which tiles, which buffers stay resident; `_chips.py`: `Chip`, the VMEM,
  TensorCores and tile presets a kernel is built for (plain values: the package fills
  them from its hardware registry); `_layout.py`: Mosaic's (sublane, lane) tiles and the
  window checks; `_collective_ids.py`: one collective id per (kernel, mesh axes).

The backend that maps the package's primitives and options to these parameters is
`fusedpar._core._backends.pallas_tpu`. These are collective kernels: the enclosing
`jax.shard_map` must use `check_vma=False`.
"""

from . import all_gather_matmul as all_gather_matmul
from . import matmul_reduce_scatter as matmul_reduce_scatter
from ._chips import Chip as Chip
from ._collective_ids import collective_id as collective_id
from ._launch import CHECK_VMA_HINT as CHECK_VMA_HINT, RingLaunch as RingLaunch
from ._layout import LayoutError as LayoutError
from ._protocol import BROKEN as BROKEN
from ._protocol import BROKEN_SHARED_COLLECTIVE_ID as BROKEN_SHARED_COLLECTIVE_ID
from ._tile_plan import PlanError as PlanError
