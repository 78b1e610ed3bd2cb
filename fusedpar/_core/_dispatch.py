"""The one dispatch decision: which backend runs a call, with which ring shape, and why.

`choose(call, requested)` is the only place a backend is picked: an explicit request
that cannot run raises `NotImplementedError` with the reason, and `"auto"` returns its
choice with a reason a person can read (`fusedpar.explain` shows it; it is also logged
at DEBUG level on the `"fusedpar"` logger). The `"auto"` policy asks the cost model
(`cost_model.py`) about the backends that declare themselves candidates; the backends
themselves are a registry of `Backend` records (`_backends`), which this module reads
for what a backend declares (its ring, its kernels, its `check_vma`) instead of naming it.

What the layers need to know about a backend (`check_vma`, `check_backend_name`) is
asked here too, so that no layer reads the table or a backend's name.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from .. import cost_model
from . import _backends, _primitives as prims
from ._primitives import Call

logger = logging.getLogger("fusedpar")

REFERENCE, RING = "reference", "ring"
AUTO = _backends.AUTO

# Largest ring an unrolled schedule is used for by default: beyond it the rolled
# fori_loop keeps trace/compile time flat (see bench/test_compile_cost.py).
UNROLL_UP_TO = 8
# A ring backend is chosen only when estimated at most this fraction of the reference,
# and the Pallas kernels over the lax ring only when at most this fraction of the ring.
# 0.95, not 0.9: in the replayed layer programs the near ties 0.9 left on the reference
# were the ring's (docs/measurements.md).
AUTO_MARGIN = 0.95
# How much faster a bidirectional ring must be estimated to be chosen over a
# unidirectional one.
BIDIRECTIONAL_MARGIN = 0.02
# The Pallas kernels over the lax ring need only be estimated faster: the fused TPU
# kernels are timed from their plan (`cost_model._kernel_step`), and every near tie 0.95
# left to the lax ring replayed faster on the kernel (v5p mlp 2,454 -> 2,271 us, v5e
# block 12,964 -> 12,681, v5e prefill 11,246 -> 11,038), none slower; the GPU step
# kernels write each product in place, which the model gives them since an H100
# measured their compute streams below the lax ring's (docs/measurements.md).
KERNEL_MARGIN = 1.0

# How `Choice` describes a call `auto` runs in another arrangement.
_ARRANGEMENTS = {
    prims.PRODUCT_FIRST: ", product first (multiply, then gather the product)",
    prims.OPERANDS_FIRST: ", operands first (exchange x's rows, gather w, then multiply)",
}

__all__ = ["Call", "Choice", "choose", "auto_choice", "auto_ring_shape", "ring_shape", "names",
           "check_backend_name", "check_options", "check_vma", "product_first",
           "operands_first"]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend that runs a call, the ring shape it uses, why, and the target (the
    hardware, read from the mesh's devices) the decision was made for."""

    backend: str
    reason: str
    bidirectional: bool = False
    unroll: bool = True
    target: object = None
    kernels: str = ""  # a kernel backend's: which kernels, compiled for what or interpreted
    rearranged: str = ""  # run on lax collectives in another arrangement (`Config`'s)

    @property
    def product_first(self) -> bool:
        """An ag_rows run as `all_gather(x @ w)` (`_product_first`)."""
        return self.rearranged == prims.PRODUCT_FIRST

    @property
    def runs_ring(self) -> bool:
        """Whether the backend runs ring steps (its ring shape and device order apply)."""
        return not _backends.runs_one_collective(self.backend)

    def __str__(self):
        ring = "bidirectional" if self.bidirectional else "unidirectional"
        loop = "unrolled" if self.unroll else "rolled (fori_loop)"
        extra = f", {ring}, {loop}" if self.runs_ring else ""
        extra += _ARRANGEMENTS.get(self.rearranged, "")
        extra += f" ({self.kernels})" if self.kernels else ""
        where = "" if self.target is None else f" [target: {self.target}]"
        return f"{self.backend}{extra}: {self.reason}{where}"


def names() -> tuple[str, ...]:
    """The backend names `backend=` accepts, besides "auto"."""
    return _backends.names()


def check_backend_name(where: str, backend) -> None:
    """Raise unless `backend` is "auto" or a backend name (`where` names the caller)."""
    valid = (AUTO,) + names()
    if backend not in valid:
        raise ValueError(f"{where}: unknown backend={backend!r}; valid backends are "
                         f"{', '.join(repr(n) for n in valid)}.")


def check_vma(backend: str, platform: str) -> bool:
    """The `check_vma` of a `shard_map` whose body runs ops on `backend` on `platform`.

    Collective Pallas kernels need `check_vma=False`, so a backend that is one, or that
    may become one (`"auto"` off CPU, where it may pick any candidate), gets it.
    """
    if backend == AUTO:
        return platform == "cpu" or all(b.check_vma for b in _backends.candidates())
    return _backends.get(backend).check_vma


def check_options(op: str, options, requested: str, chosen: str, platform: str) -> None:
    """Reject `options` keys the backend does not read (any backend's, under "auto")."""
    if not options:
        return
    if requested == AUTO:
        known = frozenset().union(*(_backends.get(n).options(platform) for n in names()))
        where = "any backend"
    else:
        known, where = _backends.get(chosen).options(platform), f"backend {chosen!r}"
    unknown = sorted(set(options) - known)
    if unknown:
        # Keys starting with "_" are for the tests (deliberately broken kernels).
        valid = ", ".join(repr(k) for k in sorted(known) if not k.startswith("_")) or "none"
        raise ValueError(f"{op}: options {unknown} are not read by {where}; valid keys: "
                         f"{valid}.")


def ring_shape(call: Call, unroll: Optional[bool]) -> tuple[bool, bool]:
    """`(bidirectional, unroll)`: as requested, else bidirectional when the ring has more
    than 2 devices and blocks split evenly, unrolled up to `UNROLL_UP_TO` devices."""
    if unroll is None:
        unroll = call.axis_size <= UNROLL_UP_TO
    return bool(call.runs_bidirectional), bool(unroll)


def _unavailable(backend: str, call: Call) -> Optional[str]:
    """Why `backend` cannot run `call` (None: it can); kernels that fail to import
    cannot run anything."""
    try:
        return _refused(_backends.get(backend), call)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _refused(backend, call: Call) -> Optional[str]:
    """Why `backend` (a `_backends.Backend`) cannot run `call`: its own reasons, and
    what no ring can do."""
    if backend.ring and call.explicit_vmap:
        # JAX batches the ring's traced steps afterwards, its buffers unbatched beside
        # pieces sharded on the vmap's axis (jax 0.10: "Mapped away dimension of inputs
        # passed to vmap should be sharded the same").
        return (f"the call is under a jax.vmap over a batch sharded on Explicit mesh "
                f"axes {call.explicit_vmap} with a transformation between them (a "
                f"lax.scan, jax.jit or jax.checkpoint), which JAX cannot batch ring steps "
                f"through; backend='reference' runs there, as does calling the layers "
                f"on the batched array (no per-example vmap)")
    return backend.unavailable(call)


def _why_not(backend, call: Call) -> Optional[str]:
    """Why `backend` (a `_backends.Backend`) cannot run `call`, or None, for `auto`."""
    if call.vma_typed and not backend.check_vma:
        # Chosen there, its kernels would fail to trace (jax.shard_map's default is
        # check_vma=True): auto must pick among the backends that can run.
        return ("the enclosing jax.shard_map checks varying axes (check_vma=True, its "
                "default) and these collective kernels need check_vma=False")
    return _unavailable(backend.name, call)


def auto_ring_shape(call: Call, backend: str = RING) -> tuple[bool, str]:
    """`(bidirectional, why)`: the ring shape `backend` runs a call with when none was
    requested, for the call's target, by `backend`'s own estimate.

    Where a bidirectional ring is possible (more than 2 devices, even blocks) it is used
    only if the cost model estimates it faster than the unidirectional one: on hardware
    with one link per neighbour and direction (TPU ICI) it halves each step's transfer;
    through a shared switch (NVSwitch) it does not, and only adds a launch per step. The
    answer differs by backend: the lax ring runs a half-size matmul per direction (on a
    memory-bound step, two reads of the stationary operand), while a fused TPU kernel
    multiplies both halves of a step at once, so only the halved transfer is left (on
    v5p:2x2x2 the fused rs_rows replays at 321 us bidirectional against 396 us).
    """
    default = call.runs_bidirectional
    if (call.bidirectional is not None or not default or call.platform in ("cpu", "")
            or _backends.runs_one_collective(backend)):
        return default, ""
    hw = cost_model.get_hardware(None, call.target)
    estimate = {}
    for b in (False, True):
        estimate[b] = cost_model.estimate_call(dataclasses.replace(call, bidirectional=b), hw,
                                               backends=(backend,)).get(backend)
    if estimate[True] is None:  # a backend the model does not time (or no ring)
        return default, ""
    uni, bi = estimate[False], estimate[True]
    # A near tie keeps the unidirectional ring: half the transfers and whole-block matmuls
    # (a 0.15% modelled lead replayed 5% behind: docs/measurements.md).
    if bi.seconds < (1 - BIDIRECTIONAL_MARGIN) * uni.seconds:
        return True, ""
    return False, (f"unidirectional ring: on {hw.name} a bidirectional one is no faster "
                   f"({cost_model.describe({'bidirectional': bi})})")


def _shaped(call: Call, backend: str) -> tuple[Call, str]:
    """`(call, why)`: `call` with the ring shape `backend` runs it with: the shape its
    estimate prefers (`auto_ring_shape`), or the other one where only that one can run
    (a kernel whose tiles a halved block does not fit, say)."""
    bidirectional, why = auto_ring_shape(call, backend)
    shaped = dataclasses.replace(call, bidirectional=bidirectional)
    if call.bidirectional is None and call.runs_bidirectional:  # both shapes possible
        other = dataclasses.replace(call, bidirectional=not bidirectional)
        refused = _unavailable(backend, shaped)
        if refused is not None and _unavailable(backend, other) is None:
            way = "bidirectional" if bidirectional else "unidirectional"
            return other, f"a {way} ring cannot run it: {refused}"
    return shaped, why


def _estimated(call: Call, hw, name: str) -> cost_model.Breakdown:
    """`name`'s estimate for `call`. The reference's collective hides behind `call.beside`
    of other work, where XLA runs it beside that work (`Hardware.hidden_beside`)."""
    est = cost_model.estimate_call(call, hw, backends=(name,))[name]
    hidden = hw.hidden_beside(call.beside, est.transfer_step) if name == REFERENCE else 0.0
    if hidden > 0:
        est = dataclasses.replace(est, seconds=est.compute_step + est.transfer_step - hidden)
    return est


def auto_choice(call: Call) -> tuple[str, str]:
    """The `"auto"` policy: (backend name, reason), from the cost model.

    A decomposed ring must beat the reference's estimate by `AUTO_MARGIN` (the model is
    rough; a near tie is not worth the extra code path), and the Pallas kernels, when
    they can run the call, must beat the lax ring by `KERNEL_MARGIN`. Each is estimated,
    and checked to run, at the ring shape it would run (`_shaped`). CPU always stays on
    the reference: its simulated devices share the cores, and Pallas there is an
    interpreter.
    """
    if call.axis_size == 1:
        return REFERENCE, "ring of 1 device: there is no communication to overlap"
    if call.platform == "cpu":
        return REFERENCE, ("on CPU the collectives are memory copies: decomposing the "
                           "matmul into ring steps only adds overhead")
    hw = cost_model.get_hardware(None, call.target)
    # Each backend estimated, and checked, at the ring shape it would run (`_shaped`).
    shaped = {b.name: _shaped(call, b.name)[0] for b in _backends.candidates()}
    est = {name: _estimated(c, hw, name) for name, c in shaped.items()}
    hidden = hw.hidden_beside(call.beside, est[REFERENCE].transfer_step)
    candidates, why_not = [], {}
    for backend in _backends.candidates():
        if backend.name == REFERENCE:
            continue
        why = _why_not(backend, shaped[backend.name])
        if why is None:
            candidates.append(backend)
        else:
            why_not[backend.name] = why
    # Simplest first (table order): a kernel backend must beat the best before it (the
    # lax ring) by its margin too.
    best = None
    for backend in candidates:
        margin = KERNEL_MARGIN if backend.cost == "kernel" else 1.0
        if best is None or est[backend.name].seconds < margin * est[best].seconds:
            best = backend.name
    names_ = [REFERENCE] + [b.name for b in candidates]
    summary = f"{hw.name}: {cost_model.describe({n: est[n] for n in names_})}"
    for name, why in why_not.items():
        summary += f"; {name} cannot run it: {why}"
    if best is None:
        return REFERENCE, f"no ring backend can run it; {summary}"
    if hidden > 0:
        summary += (f"; the reference's collective can hide behind "
                    f"{call.beside * 1e6:.3g} us of other matmuls")
    elif call.beside > 0 and hw.collective_beside_matmul:
        summary += (f"; {call.beside * 1e6:.3g} us of other matmuls would hide part of "
                    f"the reference's collective, which XLA on {hw.name} keeps "
                    f"synchronous unless it is hidden whole")
    ref, fast = est[REFERENCE].seconds, est[best].seconds
    if fast < AUTO_MARGIN * ref:
        return best, (f"{best} is estimated {ref / fast:.2f}x faster than reference "
                      f"over a ring of {call.axis_size}; {summary}")
    return REFERENCE, (f"decomposing does not pay at this size (best: {best}, estimated "
                       f"at {fast / ref:.2f}x the reference's time); {summary}")


def product_first(call: Call, chosen: str) -> str:
    """Why `"auto"` runs `call` as `all_gather(x @ w)` (`_product_first`) rather than on
    `chosen`, or "" where it does not: only an ag_rows whose w JAX proves invariant over
    the ring (`Call.w_invariant`), sending its own dtype, and only where the cost model
    estimates it faster than `chosen`."""
    # The gather whose travelling operand is x (ag_rows): w is the stationary one.
    if not (prims.of(call.prim).traveller == "x" and call.w_invariant
            and call.comm_dtype is None and call.axis_size > 1):
        return ""
    hw = cost_model.get_hardware(None, call.target)
    first = cost_model.product_first(call, hw)
    other = _estimated(call, hw, chosen)
    if first.seconds >= other.seconds:
        return ""
    gathered = ", and x gathered for the backward" if call.gathered else ""
    return (f"w is invariant over the ring's axis, so each device multiplies only its own "
            f"rows (1/{call.axis_size} of the FLOPs) and all-gathers the product{gathered}: "
            f"{hw.name}: estimated {first.seconds * 1e6:.3g} us against {chosen}'s "
            f"{other.seconds * 1e6:.3g} us")


def operands_first(call: Call, chosen: str) -> str:
    """Why `"auto"` runs `call` as x's rows exchanged times w gathered (`_operands_first`)
    rather than on `chosen`, or "" where it does not: only an rs_rows in its own dtype
    that sums nothing else (`Call.adding`), off CPU (whose collectives are memory
    copies), where the cost model estimates it faster and it moves fewer bytes; not under
    a vmap JAX batches its steps through afterwards (`Call.explicit_vmap`: a ring's)."""
    if not (call.prim == prims.RS_ROWS and call.comm_dtype is None and not call.adding
            and not call.explicit_vmap
            and call.platform not in ("", "cpu") and call.axis_size > 1
            and call.x_shape[0] % call.axis_size == 0):
        return ""
    hw = cost_model.get_hardware(None, call.target)
    first = cost_model.operands_first(call, hw)
    other = _estimated(call, hw, chosen)
    # Fewer bytes too: w's transfer, hidden from the compute stream, still holds the
    # links other transfers need (on v5e:2x4 an FSDP x TP block's MLP gradient moving
    # 120 MiB of operands for 48 of partial sums replayed 10% slower).
    if first.seconds >= other.seconds or first.bytes_sent >= other.bytes_sent:
        return ""
    ahead = "; w, there before the work around the call, ahead of it" if call.w_ahead else ""
    return (f"x's rows and w travel ({first.bytes_sent / 2**20:.3g} MiB a device{ahead}) "
            f"instead of the partial sums ({other.bytes_sent / 2**20:.3g} MiB): each device "
            f"exchanges x's rows, gathers w and multiplies once: {hw.name}: estimated "
            f"{first.seconds * 1e6:.3g} us against {chosen}'s {other.seconds * 1e6:.3g} us")


def choose(call: Call, requested: str, unroll: Optional[bool] = None) -> Choice:
    """Pick the backend for `call`: `requested` itself, or the `"auto"` policy's pick
    (which may run an ag_rows product first, `product_first`, or an rs_rows operands
    first, `operands_first`)."""
    rearranged = ""
    if requested == AUTO:
        name, reason = auto_choice(call)
        call, why = _shaped(call, name)
        for form, arranged in ((prims.PRODUCT_FIRST, product_first),
                               (prims.OPERANDS_FIRST, operands_first)):
            why_form = arranged(call, name)
            if why_form:
                name, reason, rearranged = REFERENCE, why_form, form
                break
        reason = "auto: " + reason + (f"; {why}" if why and name != REFERENCE else "")
    else:  # ("auto" picks only the reference or a backend whose `unavailable` it asked)
        check_backend_name(call.op, requested)
        name, reason = requested, "requested explicitly"
        call = _shaped(call, name)[0]
        why_not = _refused(_backends.get(name), call)
        if why_not is not None:
            ring = ("a bidirectional" if call.bidirectional else "a") + \
                f" ring of {call.axis_size}"
            raise NotImplementedError(
                f"{call.op}: backend {name!r} cannot run this call ({call.prim}, local x"
                f"{call.x_shape} w{call.w_shape} {call.dtype}, {ring}): {why_not}")
    bidirectional, unroll = ring_shape(call, unroll)
    describe = _backends.get(name).kernels
    choice = Choice(name, reason, bidirectional, unroll, call.target,
                    describe(call) if describe else "", rearranged)
    logger.debug("fusedpar: %s %s x%s w%s %s over %d devices -> %s", call.op, call.prim,
                 call.x_shape, call.w_shape, call.dtype, call.axis_size, choice)
    return choice
