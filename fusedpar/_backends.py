"""Backend registry and the one dispatch decision: which backend runs a call, and why.

A backend is a name, a function that runs a primitive (`_primitives.py`), a function
that says why it cannot run a given call (or None), and the `options` keys it reads.
`"reference"` runs each primitive as its lax definition (`_reference.py`), `"ring"` as
ppermute rings (`_ring.py`); `_pallas.py` registers the kernels.

`choose(call, requested)` is the only place a backend is picked: an explicit request
that cannot run raises `NotImplementedError` with the reason, and `"auto"` returns its
choice with a reason a person can read (`fusedpar.explain` shows it; it is also logged
at DEBUG level on the `"fusedpar"` logger).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

from . import _primitives as P

logger = logging.getLogger("fusedpar")

REFERENCE, RING, PALLAS, AUTO = "reference", "ring", "pallas", "auto"


@dataclasses.dataclass(frozen=True)
class Call:
    """What a dispatch decision looks at: one primitive call, described statically."""

    op: str  # "all_gather_matmul" or "matmul_reduce_scatter"
    prim: str  # one of _primitives.PRIMITIVES
    x_shape: tuple  # canonical 2-D local shapes
    w_shape: tuple
    dtype: str
    axis_size: int
    platform: str  # "cpu", "gpu", "tpu"
    bidirectional: Optional[bool] = None  # as requested (None: backend's default)

    @property
    def block_length(self) -> int:
        return P.block_length(self.prim, self.x_shape, self.w_shape, self.axis_size)


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    run: Optional[Callable]  # run(prim, cfg, x, w, return_gathered) -> out | (out, gathered)
    unavailable: Callable[[Call], Optional[str]]  # why it cannot run `call`, or None
    description: str = ""
    options: Callable[[], frozenset] = frozenset  # the `options` keys it reads


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend that runs a call, the ring shape it uses, and why."""

    backend: str
    reason: str
    bidirectional: bool = False
    unroll: bool = True

    def __str__(self):
        ring = "bidirectional" if self.bidirectional else "unidirectional"
        loop = "unrolled" if self.unroll else "rolled (fori_loop)"
        extra = "" if self.backend == REFERENCE else f", {ring}, {loop}"
        return f"{self.backend}{extra}: {self.reason}"


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Register (or replace) a backend under `backend.name`."""
    if backend.name == AUTO:
        raise ValueError("'auto' is not a backend name; it chooses among backends.")
    _REGISTRY[backend.name] = backend


def get(name: str) -> Backend:
    return _REGISTRY[name]


def check_options(op: str, options, requested: str, chosen: str) -> None:
    """Reject `options` keys the backend does not read (any backend's, under "auto")."""
    if not options:
        return
    if requested == AUTO:
        known = frozenset().union(*(b.options() for b in _REGISTRY.values()))
        where = "any backend"
    else:
        known, where = _REGISTRY[chosen].options(), f"backend {chosen!r}"
    unknown = sorted(set(options) - known)
    if unknown:
        valid = ", ".join(repr(k) for k in sorted(known)) or "none"
        raise ValueError(f"{op}: options {unknown} are not read by {where}; valid keys: "
                         f"{valid}.")


def names() -> tuple[str, ...]:
    """Registered backend names (what `backend=` accepts, besides "auto")."""
    return tuple(_REGISTRY)


# Largest ring an unrolled schedule is used for by default: beyond it the rolled
# fori_loop keeps trace/compile time flat (see bench/test_compile_cost.py).
UNROLL_UP_TO = 8


def ring_shape(call: Call, unroll: Optional[bool]) -> tuple[bool, bool]:
    """Default ring shape: bidirectional when it can split blocks and has >2 devices."""
    bidirectional = call.bidirectional
    if bidirectional is None:
        bidirectional = call.axis_size > 2 and call.block_length % 2 == 0
    if unroll is None:
        unroll = call.axis_size <= UNROLL_UP_TO
    return bool(bidirectional), bool(unroll)


def auto_choice(call: Call) -> tuple[str, str]:
    """The `"auto"` policy: (backend name, reason), from the cost model (`cost_model.py`).

    A decomposed ring must beat the reference's estimate by `AUTO_MARGIN` (the model is
    rough; a near tie is not worth the extra code path), and the Pallas kernels, when
    they can run the call, must beat the lax ring by `KERNEL_MARGIN`. CPU always stays
    on the reference: its simulated devices share the cores, and Pallas there is an
    interpreter.
    """
    from . import cost_model

    if call.axis_size == 1:
        return REFERENCE, "ring of 1 device: there is no communication to overlap"
    if call.platform == "cpu":
        return REFERENCE, ("on CPU the collectives are memory copies: decomposing the "
                           "matmul into ring steps only adds overhead")
    hw = cost_model.get_hardware(None, call.platform)
    est = cost_model.estimate_call(call, hw)
    candidates, why_not = [RING], ""
    if PALLAS in _REGISTRY:
        try:
            why_not = _REGISTRY[PALLAS].unavailable(call)
        except Exception as e:  # kernels that fail to import cannot be chosen
            why_not = f"{type(e).__name__}: {e}"
        if why_not is None:
            candidates.append(PALLAS)
    # Simplest first: a kernel backend must beat the lax ring by KERNEL_MARGIN too.
    best = RING
    if PALLAS in candidates and est[PALLAS].seconds < KERNEL_MARGIN * est[RING].seconds:
        best = PALLAS
    summary = f"{hw.name}: {cost_model.describe({n: est[n] for n in [REFERENCE] + candidates})}"
    if why_not:
        summary += f"; pallas cannot run it: {why_not}"
    ref, fast = est[REFERENCE].seconds, est[best].seconds
    if fast < AUTO_MARGIN * ref:
        return best, (f"{best} is estimated {ref / fast:.2f}x faster than reference "
                      f"over a ring of {call.axis_size}; {summary}")
    return REFERENCE, (f"decomposing does not pay at this size (best: {best}, estimated "
                       f"at {fast / ref:.2f}x the reference's time); {summary}")


# A ring backend is chosen only when estimated at most this fraction of the reference,
# and the Pallas kernels over the lax ring only when at most this fraction of the ring.
AUTO_MARGIN = 0.9
KERNEL_MARGIN = 0.95


def choose(call: Call, requested: str, unroll: Optional[bool] = None) -> Choice:
    """Pick the backend for `call`: `requested` itself, or the `"auto"` policy's pick."""
    if requested == AUTO:
        name, reason = auto_choice(call)
        reason = "auto: " + reason
    elif requested in _REGISTRY:
        name, reason = requested, "requested explicitly"
    else:
        raise ValueError(
            f"{call.op}: unknown backend={requested!r}; valid backends are "
            f"{', '.join(repr(n) for n in (AUTO,) + names())}.")
    why_not = _REGISTRY[name].unavailable(call)
    if why_not is not None:
        raise NotImplementedError(f"{call.op}: backend {name!r} cannot run this call: {why_not}")
    bidirectional, unroll = ring_shape(call, unroll)
    choice = Choice(name, reason, bidirectional, unroll)
    logger.debug("fusedpar: %s %s x%s w%s %s over %d devices -> %s", call.op, call.prim,
                 call.x_shape, call.w_shape, call.dtype, call.axis_size, choice)
    return choice
