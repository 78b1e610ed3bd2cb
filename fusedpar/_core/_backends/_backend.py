"""What a backend is (`Backend`), and the registry every other module reads backends from.

A backend is one record: how it runs a primitive, whether it can, which options it
reads, and what the rest of the package needs to know of it without naming it — how the
cost model estimates it (`cost`), whether `"auto"` considers it (`candidate`), whether
it runs the op as ring steps (`ring`), whether it interprets collective kernels on a
target (`interprets`), which fused kernels stand for it in a compiled program
(`fused_kernels`). `_dispatch`, `cost_model`, `_interpret`, `_aot` and the tests iterate
`TABLE` instead of listing names, so a new backend is one module and one `register`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

# How the cost model (`cost_model.breakdown`) estimates a backend:
# "reference": the whole collective, then the whole matmul (nothing overlaps);
# "ring": lax ring steps, each step's matmul beside one transfer (XLA's step latency,
#   a reduce-scatter's adds folded into its matmuls);
# "kernel": ring steps inside or between Pallas kernels (the kernels' step latency).
COST_FAMILIES = ("reference", "ring", "kernel")
AUTO = "auto"  # not a backend: the policy that picks one (`_dispatch.auto_choice`)


def _runs_everywhere(call) -> None:
    return None


def _reads_no_options(platform: str) -> frozenset:
    return frozenset()


def _interprets_nothing(target, options) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend.

    - `name`: what `backend=` says; `description`: one line for people.
    - `run(prim, cfg, x, w, return_gathered=False)`: run primitive `prim`
      (`_primitives.py`: 2-D local `x` (m, k) and `w` (k, n), shapes per primitive
      there) inside `shard_map`, `cfg` a `_primitives.Config`; with `return_gathered`,
      an all-gather also returns the gathered operand.
    - `unavailable(call)`: why it cannot run a `_primitives.Call`, or None.
    - `options(platform)`: the `options` keys it reads on that platform.
    - `check_vma`: the `check_vma` a `jax.shard_map` running it may use (False for
      collective Pallas kernels, which JAX's varying-axes check cannot type).
    - `kernels(call)`: a kernel backend's "which kernels run the call, compiled for what
      or interpreted" (`Choice.kernels`, what `fusedpar.explain` says), or None.
    - `cost`: its family in the cost model (`COST_FAMILIES`), or None if not modelled.
    - `candidate`: whether `"auto"` weighs it (it must then have a `cost`); exactly one
      candidate of family "reference" is the baseline `auto` falls back to.
    - `ring`: whether it runs the op as ring steps, so the ring's shape (directions,
      unrolled or rolled) and device order apply to it; False for one collective and
      one matmul.
    - `interprets(target, options)`: whether on `target` (a `_target.Target`) with the
      op's `options` it runs collective kernels in Pallas TPU interpret mode, where each
      simulated device blocks a thread of the CPU client's pool (`_interpret`).
    - `fused_kernels()`: `{a fused kernel's name in a compiled program: its primitive}`
      for kernels whose transfers XLA cannot see (`fusedpar.aot`'s report), or None.
    - `run_adding(prim, cfg, x, w, addend)`: a reduce-scatter primitive with `addend`
      (each device's partial sums, the product's shape) summed in its own reduce-scatter,
      or None (`_autodiff.run` then reduce-scatters it apart).
    - `run_partnered(prim, cfg, x, w, partner, dtype, transposed)`: an ag_rows returning
      `(its product, partner.T @ the gathered x)` (in `dtype`; `transposed`: written in
      memory as its transpose) without the gathered x written whole, or None where it
      cannot run that call; the attribute None where the backend has no such run
      (`_autodiff` then keeps the gathered x and multiplies it).
    """

    name: str
    description: str
    run: Callable
    unavailable: Callable = _runs_everywhere
    options: Callable = _reads_no_options
    check_vma: bool = True
    kernels: Optional[Callable] = None
    cost: Optional[str] = None
    candidate: bool = False
    ring: bool = True
    interprets: Callable = _interprets_nothing
    fused_kernels: Optional[Callable] = None
    run_adding: Optional[Callable] = None
    run_partnered: Optional[Callable] = None


# Name -> Backend, in the order error messages list them (registration order).
TABLE: dict = {}


def register(backend: Backend) -> Backend:
    """Add `backend` to the table (after the others); returns it."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register: backend must be a fusedpar._core._backends.Backend, got "
                        f"{type(backend).__name__}.")
    if not isinstance(backend.name, str) or not backend.name or backend.name == AUTO:
        raise ValueError(f"register: a backend's name must be a non-empty string other "
                         f"than {AUTO!r}, got {backend.name!r}.")
    if backend.name in TABLE:
        raise ValueError(f"register: backend {backend.name!r} is registered already; "
                         f"unregister it first.")
    if backend.cost not in COST_FAMILIES + (None,):
        raise ValueError(f"register: backend {backend.name!r} has cost={backend.cost!r}; "
                         f"valid: {', '.join(map(repr, COST_FAMILIES))} or None.")
    if backend.candidate and backend.cost is None:
        raise ValueError(f"register: backend {backend.name!r} is an auto candidate but "
                         f"has no cost family for the cost model to estimate it with.")
    TABLE[backend.name] = backend
    return backend


def unregister(name: str) -> Backend:
    """Remove backend `name` from the table (a test's made-up backend); returns it."""
    if name not in TABLE:
        raise KeyError(f"unregister: no backend {name!r}; registered: {', '.join(TABLE)}.")
    return TABLE.pop(name)


def get(name: str) -> Backend:
    """The backend called `name` (a key of `TABLE`)."""
    return TABLE[name]


def names() -> tuple[str, ...]:
    """The backend names (what `backend=` accepts, besides "auto")."""
    return tuple(TABLE)


def candidates() -> tuple[Backend, ...]:
    """The backends `"auto"` weighs, in table order (simplest first)."""
    return tuple(b for b in TABLE.values() if b.candidate)


def runs_one_collective(name: str) -> bool:
    """Whether backend `name` is registered and runs one collective and one matmul (no
    ring); False for names the table does not hold ("" for XLA's own)."""
    backend = TABLE.get(name)
    return backend is not None and not backend.ring
