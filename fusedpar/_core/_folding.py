"""`jax.vmap` around a layer: the vmapped axes fold into the input's leading dimensions.

Equinox layers take one example and models apply them with `jax.vmap`, e.g.
`jax.vmap(jax.vmap(block))(x)` over batch and sequence. A sharded layer needs to see
those axes: a sequence-parallel layer shards the sequence (dim -2) and an FSDP layer the
batch (dim 0). `fold(fn, args)` runs `fn(*args)`; when the args are batched by the
`jax.vmap` that is the innermost transformation at the call, a `custom_vmap` rule hands
`fn` the batched arrays instead, the mapped axis moved to the front. Nested vmaps fold
one after the other, innermost first, so under `vmap(vmap(layer))` the layer sees
`(outer, inner, ...)`: the outer mapped axis is dim 0 (the batch) and the inner one
dim 1 (the sequence, dim -2 of a `(batch, seq, features)` input).

The fold needs the vmap to be the transformation JAX is tracing at the call. With
another one in between (`jax.grad`, `jax.jit`, `jax.checkpoint` or `lax.scan` inside
the vmap) the layer sees one example, as plain `jax.vmap` gives it; a rule's own
parameters batched by the vmap (a vmap over stacked layers) are not folded either.
Whether an array is batched by the current trace is asked of JAX's tracer classes; if
a JAX version lacks them, nothing is folded.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

try:  # which vmap an array belongs to: JAX has no public API for it
    from jax._src.core import trace_ctx as _trace_ctx
    from jax._src.interpreters.batching import BatchTrace as _BatchTrace
    from jax._src.interpreters.batching import BatchTracer as _BatchTracer
except ImportError:  # pragma: no cover - then nothing is folded
    _trace_ctx = _BatchTrace = _BatchTracer = None


# How many leading dimensions of the arrays a folded `fn` is running on came from vmaps.
_FOLDED: contextvars.ContextVar = contextvars.ContextVar("fusedpar_folded", default=0)
# The Explicit axes of the vmaps around the layer whose shard_map is being traced
# (`explicit_vmap_kept`): JAX traces a shard_map's body in a trace of its own.
_EXPLICIT: contextvars.ContextVar = contextvars.ContextVar("fusedpar_explicit_vmap",
                                                           default=())


def folded_axes() -> int:
    """How many leading dimensions of the current layer's input are folded vmapped axes
    (0 outside a fold). `shard_map_specs` uses it to refuse per-token vmaps over a
    sequence-parallel layer's sequence."""
    return _FOLDED.get()


def _current_vmap():
    """The vmap JAX is tracing right now, or None."""
    if _trace_ctx is None:
        return None
    return getattr(_trace_ctx, "trace", None)


def explicit_vmap_axes() -> tuple:
    """The Explicit mesh axes over which the `jax.vmap`s JAX is tracing inside map a
    batch sharded on them, innermost first (() outside such a vmap, or on a JAX without
    the tracer classes). Inside a fold the vmap it folded is not among them: the layer
    runs on the batched arrays, not under that vmap. Under one that did not fold (a
    `lax.scan`, `jax.jit` or `jax.checkpoint` between it and the layer) JAX batches the
    layer's traced program afterwards, its operations with a dimension sharded on such
    an axis inside the layer's `shard_map`."""
    axes = [a for trace in enclosing_traces() if _BatchTrace is not None
            and isinstance(trace, _BatchTrace)
            for a in getattr(trace.axis_data, "explicit_mesh_axis", None) or ()]
    return tuple(dict.fromkeys(axes + list(_EXPLICIT.get())))


def enclosing_traces():
    """The trace JAX is tracing in now, then the ones it was started in (their
    `parent_trace`), innermost first; none on a JAX without `trace_ctx`."""
    trace = _current_vmap()
    while trace is not None:
        yield trace
        trace = getattr(trace, "parent_trace", None)


@contextlib.contextmanager
def explicit_vmap_kept():
    """Within it, `explicit_vmap_axes` says what it says here: around a `jax.shard_map`
    call, whose body JAX traces in a trace of its own, with no parent to walk to."""
    token = _EXPLICIT.set(explicit_vmap_axes())
    try:
        yield
    finally:
        _EXPLICIT.reset(token)


def batched_here(x) -> bool:
    """Whether `x` is batched by the `jax.vmap` JAX is tracing right now."""
    if _BatchTracer is None or not isinstance(x, _BatchTracer):
        return False
    return x._trace is _current_vmap() and x.batch_dim is not None


def fold(fn: Callable, args: Sequence, params=None, *, where: str, hint: str = ""):
    """`fn(*args)`, with vmapped axes of `args` folded into their leading dimensions.

    `args` are arrays that share their leading dimensions (an unbatched one is
    broadcast along the mapped axis); `fn` returns one array whose leading dimensions
    are theirs. `params` (any pytree `fn` closes over) must not be batched by the vmap
    for the fold to apply. If `fn` changes the length of the mapped axis it is not
    vmappable: a `ValueError` names `where`, the sizes and `hint`.
    """
    if not any(batched_here(a) for a in args):
        return fn(*args)
    if any(batched_here(p) for p in jax.tree.leaves(params)):
        return fn(*args)

    # custom_vmap traces this for one example; it never runs (the rule replaces it
    # under this vmap), so it only has to have the output's structure.
    @custom_vmap
    def call(*args):
        return jnp.zeros((), jnp.float32)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a))
                for a, b in zip(args, in_batched)]
        token = _FOLDED.set(_FOLDED.get() + 1)
        try:
            out = fold(fn, args, params, where=where, hint=hint)
        finally:
            _FOLDED.reset(token)
        if out.ndim == 0 or out.shape[0] != axis_size:
            got = "no such axis" if out.ndim == 0 else f"length {out.shape[0]} there"
            raise ValueError(
                f"{where}: under jax.vmap the mapped axis (size {axis_size}) changes "
                f"length through the layer (its output has {got}), so the layer cannot "
                f"be vmapped over that axis{'; ' + hint if hint else ''}.")
        return out, True

    return call(*args)
