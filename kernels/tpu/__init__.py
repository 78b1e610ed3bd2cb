"""Fused Pallas TPU ring kernels: one kernel per primitive, the ring runs inside it.

Remote DMAs between neighbours overlap the matmul of the block in hand. On TPU they
compile with Mosaic; on CPU they run in TPU interpret mode, which simulates every
device, DMA and semaphore. See `all_gather_matmul.py`, `matmul_reduce_scatter.py`
(kernels), `_common.py` (the ring protocol) and `_tiling.py` (tile sizes). The backend
that drives them is `fusedpar._backends.pallas_tpu`.

These are collective kernels: the enclosing `jax.shard_map` must use `check_vma=False`.
"""

from . import all_gather_matmul as all_gather_matmul
from . import matmul_reduce_scatter as matmul_reduce_scatter
from ._common import BROKEN as BROKEN, CHECK_VMA_HINT as CHECK_VMA_HINT, nbytes as nbytes
from ._tiling import plan as plan
