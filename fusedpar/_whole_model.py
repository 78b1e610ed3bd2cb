"""The `shard_map` specs of a whole model, read from an abstract trace of it.

A model's input layout is the layout its first parallel layer wants, but only the
model's code says which layer that is and whether the input reaches it unchanged (token
ids go into an embedding; a transformer block may normalise first). `shard_map_specs`
therefore traces the model with `jax.eval_shape` (nothing is compiled or run) while every
fusedpar layer and `fusedpar.cross_entropy` records the arrays it was given and returned
with their layouts. An input that goes straight into fusedpar calls gets their layout;
an output that a fusedpar call returned gets that call's. Anything else raises: a spec
is never guessed.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
from typing import Callable, Optional

import jax

from . import _folding, _specs

_CALLS: contextvars.ContextVar = contextvars.ContextVar("fusedpar_calls", default=None)


@dataclasses.dataclass
class Call:
    """One fusedpar call seen in the trace: its inputs and output, each with its spec."""

    where: str
    owner: object  # the layer's weight (to name its path), or None
    inputs: tuple  # ((array, PartitionSpec), ...)
    output: tuple  # (array, PartitionSpec)
    seq_dim: Optional[int] = None  # a sequence-parallel call's sequence dim of inputs[0]
    folded: int = 0  # leading dims of the inputs that are folded vmapped axes


def record(where: str, owner, inputs, output, seq_dim: Optional[int] = None) -> None:
    """Note a fusedpar call while `shard_map_specs` traces a model (else do nothing).

    `seq_dim`: for a sequence-parallel call, the dimension of its first input that is
    the sequence it gathers or scatters.
    """
    calls = _CALLS.get()
    if calls is not None:
        calls.append(Call(where, owner, tuple(inputs), output, seq_dim,
                          _folding.folded_axes()))


def tracing() -> bool:
    """Whether `shard_map_specs` is tracing a model right now."""
    return _CALLS.get() is not None


def spec_of(array):
    """While `shard_map_specs` traces: the spec of `array` if a fusedpar call returned it."""
    calls = _CALLS.get() or ()
    made = [c.output[1] for c in calls if c.output[0] is array]
    return made[-1] if made else None


def _names(model, calls):
    """`where` of each call, with the path of its layer in `model` where known."""
    paths = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=_specs.is_layer)[0]:
        if _specs.is_layer(leaf) and path:  # a bare layer is named by its class alone
            paths[id(leaf.weight)] = _specs.path_str(path)
    return [f"{paths[id(c.owner)]} ({c.where})" if id(c.owner) in paths else c.where
            for c in calls]


def _leaf_name(path, kind):
    return kind + (_specs.path_str(path).join("[]") if path else "")


def shard_map_specs(model, x, *, call: Optional[Callable] = None,
                    outputs: bool = True) -> tuple:
    """`(in_specs, out_specs)` to run `call(model, x)` inside `jax.shard_map`.

    **Arguments:**

    - `model`: a model with fusedpar layers.
    - `x`: the model's input as global arrays: an array or a `jax.ShapeDtypeStruct` (or
      a pytree of them). Only its shapes and dtypes are used.
    - `call`: how the model is applied, `call(model, x)`; default `model(x)` (e.g.
      `lambda m, x: jax.vmap(m)(x)` for a model written for one example).
    - `outputs`: derive the out_specs; with False, `out_spec` is None (when you write
      the out_specs yourself, e.g. for a loss or a residual stream).

    **Returns:** `((param_specs(model), x_spec), out_spec)`: the in_specs for the
    arguments `(eqx.filter(model, eqx.is_array), x)` and the out_specs. `x_spec` is the
    layout of the fusedpar layers `x` goes into as it is; `out_spec` the layout of the
    fusedpar call that returns the output. Each is read from a trace of `call(model, x)`
    with `jax.eval_shape`; an input that does not go straight into a fusedpar layer, an
    output that no fusedpar call returns, or an input two layers want in different
    layouts raises a `ValueError` — then write that spec yourself.
    """
    if not any(_specs.is_layer(leaf) for leaf in
               jax.tree_util.tree_leaves(model, is_leaf=_specs.is_layer)):
        raise ValueError("shard_map_specs: the model has no fusedpar layers; every array is "
                         "replicated, use in_specs=P() and out_specs=P().")
    if isinstance(x, int) and not isinstance(x, bool):
        raise TypeError(
            f"shard_map_specs: x must be the model's input (an array or "
            f"jax.ShapeDtypeStruct of its global shape), got the int {x}; the specs are "
            "read from a trace of the model on it.")
    if call is not None:
        _check_call(call)
    call = call or (lambda m, x: m(x))
    result = {}

    def traced(x):
        calls = []
        token = _CALLS.set(calls)
        try:
            out = call(model, x)
        finally:
            _CALLS.reset(token)
        result["specs"] = _resolve(model, calls, x, out if outputs else None)
        return out

    jax.eval_shape(traced, x)
    x_spec, out_spec = result["specs"]
    return (_specs.param_specs(model), x_spec), out_spec


def _check_call(call) -> None:
    """`call` must take `(model, x)`: several inputs travel as one pytree `x`."""
    if not callable(call):
        raise TypeError(f"shard_map_specs: call must be a function call(model, x), got "
                        f"{type(call).__name__}.")
    try:
        inspect.signature(call).bind(None, None)
    except TypeError as e:
        raise TypeError(
            f"shard_map_specs: call is called as call(model, x), with the model and x, "
            f"but its signature {inspect.signature(call)} does not take that ({e}). For "
            "several inputs pass them as one pytree, x=(tokens, labels), with "
            "call=lambda m, xs: f(m, *xs).") from None
    except ValueError:  # no signature to read (a builtin): let the call itself say
        pass


def _resolve(model, calls, x, out):
    if not calls:
        raise ValueError("shard_map_specs: call(model, x) called no fusedpar layer; every "
                         "array it uses is replicated, use in_specs=P() and out_specs=P().")
    names = _names(model, calls)
    for name, c in zip(names, calls):
        if c.seq_dim is not None and c.seq_dim < c.folded:
            raise ValueError(
                f"shard_map_specs: {name} is sequence parallel, and call(model, x) applies "
                f"it under a jax.vmap over the sequence (per-token code, e.g. "
                f"jax.vmap(embed)(tokens)): its input's dim {c.seq_dim}, the sequence, is "
                "a vmapped axis. Inside your own shard_map the layer gathers or scatters "
                "the sequence, which would change the length of that vmapped axis, so "
                "this model cannot run there. Apply the layer to the whole (..., seq, "
                "features) array (vmap over the batch only), or run the model on global "
                "arrays under jax.set_mesh (the layers wrap themselves in shard_map, and "
                "per-token vmaps work), or use sequence_parallel=False.")

    def input_spec(path, leaf):
        uses = [(names[i], s) for i, c in enumerate(calls) for a, s in c.inputs if a is leaf]
        what = _leaf_name(path, "the input x")
        if not uses:
            raise ValueError(
                f"shard_map_specs: {what} (shape {leaf.shape}) does not go into a fusedpar "
                f"layer as it is (the first fusedpar call is {names[0]}, on a value "
                "computed from it), so its layout cannot be derived; write the in_spec "
                "of x yourself, with fusedpar.param_specs(model) for the parameters.")
        specs = {s for _, s in uses}
        if len(specs) > 1:
            raise ValueError(
                f"shard_map_specs: {what} goes into fusedpar layers that want different "
                f"layouts: " + "; ".join(f"{n} wants {s}" for n, s in uses) + ".")
        return uses[0][1]

    def output_spec(path, leaf):
        made = [(names[i], c.output[1]) for i, c in enumerate(calls) if c.output[0] is leaf]
        if not made:
            raise ValueError(
                f"shard_map_specs: {_leaf_name(path, 'the output')} (shape "
                f"{getattr(leaf, 'shape', ())}) is not what a fusedpar call returned (the "
                f"last fusedpar call is {names[-1]}), so its layout cannot be derived; "
                "write the out_specs yourself (outputs=False derives the in_specs only).")
        return made[-1][1]

    return (jax.tree_util.tree_map_with_path(input_spec, x),
            None if out is None else jax.tree_util.tree_map_with_path(output_spec, out))
