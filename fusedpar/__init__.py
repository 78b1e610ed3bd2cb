"""fusedpar: tensor-parallel and FSDP linear layers whose collectives overlap the matmul."""

from ._core import _interpret
from ._hw import _platforms
from . import cost_model as cost_model
from ._sharding._checkpoint import deserialise_filter_spec as deserialise_filter_spec
from ._nn._context import local_size as local_size
from ._nn._describe import describe as describe
from ._core._dispatch import Choice as Choice, names as backend_names
from ._nn._embedding import Embedding as Embedding
from ._nn._layers import (
    ColumnLinear as ColumnLinear,
    FSDPLinear as FSDPLinear,
    Linear as Linear,
    ParallelLinear as ParallelLinear,
    RowLinear as RowLinear,
)
from ._core._ops import (
    all_gather_matmul as all_gather_matmul,
    explain as explain,
    matmul_reduce_scatter as matmul_reduce_scatter,
)
from ._nn._loss import cross_entropy as cross_entropy
from ._nn._quantize_model import quantize as quantize
from ._core._quantized_array import QuantizedArray as QuantizedArray
from ._nn._parallelize import parallelize as parallelize
from ._core._schedule import Ring as Ring
from ._sharding._shard import init_sharded as init_sharded, shard as shard
from ._sharding._specs import (
    FSDP as FSDP,
    Column as Column,
    Drop as Drop,
    Row as Row,
    Rule as Rule,
    compose as compose,
    param_specs as param_specs,
    validate as validate,
)
from ._sharding._whole_model import shard_map_specs as shard_map_specs
from ._hw._xla_flags import (
    gpu_overlap_flags as gpu_overlap_flags,
    set_gpu_overlap_flags as set_gpu_overlap_flags,
    set_overlap_flags as set_overlap_flags,
    tpu_overlap_flags as tpu_overlap_flags,
)

__all__ = [
    # ops
    "all_gather_matmul", "matmul_reduce_scatter", "explain", "backend_names", "Choice",
    "Ring", "cost_model",
    # layers
    "ColumnLinear", "RowLinear", "FSDPLinear", "Linear", "ParallelLinear", "Embedding",
    "cross_entropy", "parallelize", "describe", "local_size",
    # specs
    "param_specs", "shard_map_specs", "validate", "shard", "init_sharded", "compose",
    "Column", "Row", "FSDP", "Rule", "Drop",
    # checkpoints
    "deserialise_filter_spec",
    # quantized weights
    "QuantizedArray", "quantize",
    # XLA flags (GPU and TPU)
    "gpu_overlap_flags", "set_gpu_overlap_flags", "set_overlap_flags", "tpu_overlap_flags",
]

# Before JAX starts its backends: threads enough for the TPU interpreter's simulated
# devices (fusedpar._core._interpret), and no platform the host has no device for
# (fusedpar._hw._platforms: the aot extra's compilers would announce that they found none);
# no-ops once the backends run.
_interpret.setup_threads()
_platforms.setup_platforms()


def __getattr__(name):
    # `fusedpar.aot` (compiling for absent hardware) on first use after a plain
    # `import fusedpar`, as the docs write it; not imported eagerly, since it sets the
    # environment libtpu and the CUDA compiler read and imports their compile paths.
    if name == "aot":
        import importlib

        return importlib.import_module(".aot", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
