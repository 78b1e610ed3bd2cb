"""fusedpar: tensor-parallel and FSDP linear layers whose collectives overlap the matmul."""

from . import _register as _register
from ._backends import Choice as Choice, names as backend_names
from ._ops import (
    all_gather_matmul as all_gather_matmul,
    explain as explain,
    matmul_reduce_scatter as matmul_reduce_scatter,
)
from ._schedule import Ring as Ring

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "explain", "backend_names", "Ring",
           "Choice"]

# cost model (issue 6)
from . import cost_model as cost_model

# layers and specs (issue 3)
from ._column import ColumnLinear as ColumnLinear
from ._fsdp import FSDPLinear as FSDPLinear
from ._layer import ParallelLinear as ParallelLinear
from ._parallelize import parallelize as parallelize
from ._row import RowLinear as RowLinear
from ._shard import init_sharded as init_sharded, shard as shard
from ._specs import (
    FSDP as FSDP,
    Column as Column,
    Drop as Drop,
    Row as Row,
    Rule as Rule,
    compose as compose,
    param_specs as param_specs,
    shard_map_specs as shard_map_specs,
    validate as validate,
)

__all__ += ["ColumnLinear", "RowLinear", "FSDPLinear", "ParallelLinear", "parallelize",
            "shard", "init_sharded", "param_specs", "shard_map_specs", "validate",
            "compose", "Column", "Row", "FSDP", "Rule", "Drop"]

# GPU XLA flags (issue 5)
from ._xla_flags import (
    gpu_overlap_flags as gpu_overlap_flags,
    set_gpu_overlap_flags as set_gpu_overlap_flags,
)

__all__ += ["gpu_overlap_flags", "set_gpu_overlap_flags"]
