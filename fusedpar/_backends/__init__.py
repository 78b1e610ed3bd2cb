"""The backends: a static table from a backend's name to the module that runs it.

Every module in the table provides

- `DESCRIPTION`: one line for people;
- `CHECK_VMA`: the `check_vma` a `jax.shard_map` running this backend may use (False for
  collective Pallas kernels, which JAX's varying-axes check cannot type);
- `options(platform)`: the `options` keys it reads on that platform;
- `unavailable(call)`: why it cannot run a `_primitives.Call`, or None;
- `run(prim, cfg, x, w, return_gathered=False)`: run primitive `prim`
  (`_primitives.py`) on local operands inside `shard_map`, with `cfg` a
  `_primitives.Config`; with `return_gathered`, all-gathers also return the gathered
  operand.

A kernel backend also provides `kernels(call)`: which kernels run the call, compiled for
what or interpreted (`Choice.kernels`, what `fusedpar.explain` says).

Which backend runs a call is decided in `fusedpar._dispatch`, never here.
"""

from __future__ import annotations

from . import pallas, pallas_gpu, pallas_tpu, reference, ring

# Name -> module, in the order error messages list them.
TABLE = {
    "reference": reference,
    "ring": ring,
    "pallas": pallas,
    "pallas_tpu": pallas_tpu,
    "pallas_gpu": pallas_gpu,
}


def get(name: str):
    """The module of backend `name` (a key of `TABLE`)."""
    return TABLE[name]


def names() -> tuple[str, ...]:
    """The backend names (what `backend=` accepts, besides "auto")."""
    return tuple(TABLE)
