"""Sequence-parallel `ColumnLinear`s called on one input gather it once.

Attention's q, k and v projections (three `eqx.nn.Linear`s in `eqx.nn.MultiheadAttention`,
three `ColumnLinear`s once parallelised) multiply the same sequence-sharded input. XLA's
own partitioning of such a model gathers that input once and feeds the three matmuls;
three fusedpar ops would gather it three times. Instead the first layer's op returns the
gathered input its ring assembles for its backward anyway, remembered here under the
input's identity, and the next layers called on the very same array multiply it with no
transfer (`_ops.all_gather_matmul_given`). In the backward their gradients of the
gathered input (each device's partial products) return to the first layer's op, whose
reduce-scatter of the input's gradient sums them too: one ring (or one `psum_scatter`)
for three layers, where the backend's reduce-scatter takes an addend
(`Backend.run_adding`: the lax ring, the reference), else one more `psum_scatter`.

The memory is per trace (eager calls on concrete arrays share nothing): an entry is
found only for the same array object, in the same JAX trace, with the same gather (axis,
comm dtype, layout) and the same backward settings (grad comm and reduce dtypes,
backend: the first layer's op reduce-scatters the others' input gradients). A layer
called in another trace (inside a `vmap`, `scan` or `checkpoint` that the first was not)
or on an equal but distinct array gathers it again. Entries go when their input array
does.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref

import jax

try:  # the trace JAX is tracing in now, to never hand a value to another trace
    from jax._src.core import trace_ctx as _trace_ctx
except ImportError:  # pragma: no cover - a JAX without it: no sharing
    _trace_ctx = None

# (id of the input, key) -> (weakref to the input, weakref to its trace, gathered)
_ENTRIES: dict = {}
_OFF = contextvars.ContextVar("fusedpar_shared_gather_off", default=False)


@contextlib.contextmanager
def off():
    """Within it, every layer gathers its own input (to measure what sharing saves:
    `bench/aot_input_grad.py`)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def current_trace():
    """The trace JAX is tracing in now (None on a JAX without `trace_ctx`)."""
    return None if _trace_ctx is None else getattr(_trace_ctx, "trace", None)


def lookup(x, key):
    """What `remember(x, key, ...)` stored in this trace, or None."""
    entry = None if _OFF.get() else _ENTRIES.get((id(x), key))
    if entry is None:
        return None
    ref, trace_ref, gathered = entry
    trace = trace_ref()
    if ref() is not x or trace is None or trace is not current_trace() or (
            hasattr(trace, "is_valid") and not trace.is_valid()):
        return None
    return gathered


def remember(x, key, gathered) -> None:
    """Store `gathered` (`x` gathered as `key` says) for the next layer on `x`."""
    trace = current_trace()
    if trace is None or _OFF.get() or not isinstance(x, jax.core.Tracer):
        return  # outside a trace the gathered copy would live as long as `x` does
    try:
        ref, trace_ref = weakref.ref(x), weakref.ref(trace)
    except TypeError:  # an input that cannot be referenced weakly: not shared
        return
    entry = (id(x), key)
    if entry not in _ENTRIES:  # one finalizer per entry, however often it is replaced
        weakref.finalize(x, _ENTRIES.pop, entry, None)
    _ENTRIES[entry] = (ref, trace_ref, gathered)
