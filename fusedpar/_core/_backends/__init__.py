"""The backends: a registry of `Backend` records (`_backend.py`), name -> record.

Each built-in module (`reference`, `ring`, `pallas`, `pallas_tpu`, `pallas_gpu`) defines
its record as `BACKEND`; they are registered here, in the order error messages list them.
A new backend is one module that builds a `Backend` and one `register` call: dispatch,
the cost model, `auto`, the interpreter's thread check, `fusedpar.aot` and the shared
backend-contract test (tests/test_backend_contract.py) read it from the table.

The ring loops that `ring` and `pallas_gpu` share are `_ring_loop.py`, a library both
give their step functions to (`_ring_loop.Steps`); neither imports the other.

Which backend runs a call is decided in `fusedpar._core._dispatch`, never here.
"""

from __future__ import annotations

from ._backend import (AUTO, COST_FAMILIES, TABLE, Backend, candidates, get, names, register,
                       runs_one_collective, unregister)
from . import pallas, pallas_gpu, pallas_tpu, reference, ring

for _module in (reference, ring, pallas, pallas_tpu, pallas_gpu):
    register(_module.BACKEND)

__all__ = ["AUTO", "COST_FAMILIES", "TABLE", "Backend", "candidates", "get", "names",
           "register", "runs_one_collective", "unregister"]
