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
