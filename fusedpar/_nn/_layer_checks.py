"""The checks a linear layer makes of its arguments and inputs, and the layout hint its
errors give."""

from __future__ import annotations

import jax.numpy as jnp

from .._core import _folding, _validate
from .._sharding import _specs
from .._sharding._spec_checks import length as length
from .._core._quantized_array import QuantizedArray


def features(where, name, v):
    """`v` as a Python int, or "scalar" as `eqx.nn.Linear` takes it (a dimension of 1);
    refused unless a positive int (a NumPy one too) or "scalar"."""
    if isinstance(v, str) and v == "scalar":
        return v
    return _validate.positive_int(where, name, v, " or 'scalar'")


def param_dtype(where, dtype) -> None:
    """None or a floating dtype: what the layer initialises its parameters in."""
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{where}: dtype must be a floating dtype (float32, bfloat16, ...) "
                         f"for the parameters it initialises, got {jnp.dtype(dtype).name}; "
                         "for integer weights, quantize a model (fusedpar.quantize).")


def _is_quax(obj, name) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("quax")
               for c in type(obj).__mro__)


def _quax_trace_active() -> bool:
    """Whether `quax.quaxify`'s trace is JAX's current one or below it (a `jax.vmap`
    inside quaxify), read from JAX's internals (`_folding.enclosing_traces`): a plain
    array quax leaves as it is (an embedding's table, a weight not quantized) is no quax
    tracer."""
    return any(_is_quax(trace, "_QuaxTrace") for trace in _folding.enclosing_traces())


def _refuse_quaxify(where):
    raise TypeError(
        f"{where}: called inside quax.quaxify, which cannot trace the layer's "
        "shard_map; fusedpar layers take a QuantizedArray weight as it is: call them "
        "outside quaxify and quaxify only the plain Equinox layers beside them "
        "(quax.quaxify(layer)(x)).")


def check_not_quaxified(where) -> None:
    """Where a layer's call runs a shard_map (on global arrays under a mesh), it is not
    inside `quax.quaxify`, whose trace has no rule for shard_map (JAX's AttributeError
    says '_QuaxTrace' has no 'process_shard_map')."""
    if _quax_trace_active():
        _refuse_quaxify(where)


def check_quantized_weight(where, w) -> None:
    """A QuantizedArray weight `(out, in)` must be scaled along `in` (per output channel,
    or per block of `in`), the contraction every fusedpar layer applies its scales to;
    and the layer is not called inside `quax.quaxify` (where its weight is quax's
    tracer)."""
    if _is_quax(w, "_QuaxTracer"):
        _refuse_quaxify(where)
    if isinstance(w, QuantizedArray) and w.axis != -1:
        raise ValueError(f"{where}: a QuantizedArray weight (out, in) must be quantized "
                         f"along in_features (axis=-1), got axis={w.axis % w.ndim}.")
    if isinstance(w, QuantizedArray) and w.scales.dtype != jnp.float32:
        # A tree-wide astype casts the scales and leaves the logical dtype: the layer
        # would compute in the old dtype with rounded scales.
        raise ValueError(f"{where}: the QuantizedArray weight's scales are "
                         f"{jnp.dtype(w.scales.dtype).name}, not float32 (a tree-wide astype "
                         "casts them); cast a quantized weight with QuantizedArray.astype, "
                         "which changes its logical dtype only, and skip QuantizedArrays in "
                         "the tree map (is_leaf=lambda a: isinstance(a, "
                         "fusedpar.QuantizedArray)).")


def check_stored_comm(where, w, rule) -> None:
    """A weight stored quantized travels in its FSDP gather as it is: the FSDP style's
    `comm_dtype` is None or the stored values' dtype."""
    f = getattr(rule, "fsdp", None)
    if (isinstance(w, QuantizedArray) and f is not None and f.comm_dtype is not None
            and jnp.dtype(f.comm_dtype) != w.values.dtype):
        raise ValueError(
            f"{where}: the weight is stored quantized as {w.values.dtype}, which its FSDP "
            f"gather over {f.axis!r} sends as it is; FSDP(comm_dtype="
            f"{jnp.dtype(f.comm_dtype).name}) asks for another dtype: leave comm_dtype None "
            f"(or {w.values.dtype}), or quantize the weight to "
            f"{jnp.dtype(f.comm_dtype).name}.")


def layout_hint(rule) -> str:
    """What input layout a layer under `rule` takes, and the style for other layouts."""
    tp, parts = rule.tp, []
    if isinstance(tp, _specs.Column) and tp.sequence_parallel:
        parts.append(f"a sequence-parallel ColumnLinear gathers its input's sequence (dim -2) "
                     f"over {tp.axis!r}; an input replicated over {tp.axis!r} needs "
                     "sequence_parallel=False")
    elif isinstance(tp, _specs.Column):
        parts.append(f"a ColumnLinear takes an input replicated over {tp.axis!r}; one sharded "
                     f"along the sequence (dim -2) over {tp.axis!r} needs "
                     "sequence_parallel=True, one sharded on its features goes into a "
                     "RowLinear")
    elif isinstance(tp, _specs.Row):
        parts.append(f"a RowLinear takes its input's features sharded over {tp.axis!r} (a "
                     "ColumnLinear's output); a replicated input goes into a ColumnLinear")
    if rule.fsdp is not None:
        parts.append(f"FSDP takes the batch (dim 0) sharded over {rule.fsdp.axis!r}")
    return "; ".join(parts)


def check_sequence(where, rule, x):
    """A sequence-parallel layer's input has a sequence dimension (dim -2)."""
    if rule.sequence_parallel and x.ndim < 2:
        raise ValueError(
            f"{where}: sequence_parallel=True needs an input (..., seq, features) whose "
            f"dim -2 is the sequence, got x of shape {x.shape}.")
