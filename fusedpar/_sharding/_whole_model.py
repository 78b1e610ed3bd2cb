"""The `shard_map` specs of a whole model, read from an abstract trace of it.

A model's input layout is the layout its first parallel layer wants, but only the
model's code says which layer that is and whether the input reaches it unchanged (token
ids go into an embedding; a transformer block may normalise first). `shard_map_specs`
therefore traces the model with `jax.eval_shape` (nothing is compiled or run) while every
fusedpar layer and `fusedpar.cross_entropy` records the arrays it was given and returned
with their layouts. An input that goes straight into fusedpar calls gets their layout;
an output that a fusedpar call returned gets that call's. A layer given what another
layer returned keeps the axes that layout has beyond its own (an FSDP head after a
sequence-parallel `RowLinear` returns the sequence still sharded over "tp"), and one
given a layout its own axes do not take is refused. Anything else raises: a spec is
never guessed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from typing import Callable, Optional

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from .._core import _folding, _vma
from . import _specs

_TRACE: contextvars.ContextVar = contextvars.ContextVar("fusedpar_trace", default=None)


@dataclasses.dataclass
class _Trace:
    """What one trace of `call(model, x)` records: the model's input arrays, the calls."""

    inputs: tuple
    calls: list = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def _tracing(x):
    """Record the fusedpar calls made inside, on the model input `x`; yields the calls."""
    trace = _Trace(tuple(jax.tree.leaves(x)))
    token = _TRACE.set(trace)
    try:
        yield trace.calls
    finally:
        _TRACE.reset(token)


@dataclasses.dataclass
class Call:
    """One fusedpar call seen in the trace: its inputs and output, each with its spec."""

    where: str
    owner: object  # the layer's weight (to name its path), or None
    inputs: tuple  # ((array, PartitionSpec), ...)
    output: tuple  # (array, PartitionSpec)
    seq_dim: Optional[int] = None  # a sequence-parallel call's sequence dim of inputs[0]
    folded: int = 0  # leading dims of the inputs that are folded vmapped axes
    clash: Optional[tuple] = None  # (the call that made inputs[0], its layout) if refused
    exact: bool = False  # inputs[0] is the model's input or an exact call's output


def record(where: str, owner, inputs, output, seq_dim: Optional[int] = None,
           axes: tuple = ()) -> None:
    """Note a fusedpar call while `shard_map_specs` traces a model (else do nothing).

    `inputs`: `((array, the layout the call takes it in), ...)`; `output`: `(array, the
    layout the call gives it)` for an input laid out as it takes it. `seq_dim`: for a
    sequence-parallel call, the dimension of its first input that is the sequence it
    gathers or scatters. `axes`: the mesh axes whose layout of the first input the call
    relies on (`_specs.layout_axes`). When another fusedpar call made that input, the
    output keeps the other axes of its layout (`_specs.with_other_axes`); when that
    layout is exact (the call's own input was the model's input, or exact) and differs
    on `axes`, it is noted, to be refused.
    """
    trace = _TRACE.get()
    if trace is None:
        return
    (x, want), y = inputs[0], output
    made = _made(trace.calls, x)
    exact = any(x is a for a in trace.inputs) if made is None else made.exact
    clash = None
    if made is not None and axes:
        given = made.output[1]
        if _specs.axis_dims(given, axes) != _specs.axis_dims(want, axes):
            clash = (made, given) if exact else None
            exact = False
        else:
            y = (y[0], _specs.with_other_axes(given, want, y[1], axes)[1])
    trace.calls.append(Call(where, owner, tuple(inputs), y, seq_dim,
                            _folding.folded_axes(), clash, exact))


def _made(calls, array) -> Optional[Call]:
    """The last recorded call that returned `array`, or None."""
    made = [c for c in calls if c.output[0] is array]
    return made[-1] if made else None


def tracing() -> bool:
    """Whether `shard_map_specs` is tracing a model right now."""
    return _TRACE.get() is not None


def spec_of(array):
    """While `shard_map_specs` traces: the spec of `array` if a fusedpar call returned it."""
    trace = _TRACE.get()
    made = None if trace is None else _made(trace.calls, array)
    return None if made is None else made.output[1]


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
    layout of the fusedpar layers `x` goes into as it is (their axes only: a
    data-parallel mesh axis that no layer uses goes on the batch dimension by hand,
    e.g. `P(("data", "fsdp"), None)`, in in_specs and out_specs alike); `out_spec`
    the layout of the fusedpar call that returns the output, with the axes its input
    had beyond the call's own. Each is read from a trace of `call(model, x)` with
    `jax.eval_shape`; the out_specs are checked against JAX's varying-axes types in a
    second trace inside a `shard_map` over the same axes (all of size 1). An input that
    does not go straight into a fusedpar layer, an output that no fusedpar call returns
    or that varies over axes its spec does not name, a layer given another's output in a
    layout it does not take, or an input two layers want in different layouts raises a
    `ValueError` — then write that spec yourself.
    """
    if not any(_specs.is_layer(leaf) for leaf in
               jax.tree_util.tree_leaves(model, is_leaf=_specs.is_layer)):
        raise ValueError("shard_map_specs: the model has no fusedpar layers; every array is "
                         "replicated, use in_specs=P() and out_specs=P().")
    _check_split_heads(model)
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
        with _tracing(x) as calls:
            out = call(model, x)
        result["specs"] = _resolve(model, calls, x, out if outputs else None)
        return out

    jax.eval_shape(traced, x)
    x_spec, out_spec = result["specs"]
    pspecs = _specs.param_specs(model)
    if outputs:
        _check_varying(model, x, call, pspecs, x_spec, out_spec)
    return (pspecs, x_spec), out_spec


def _check_split_heads(model) -> None:
    """Refuse an `eqx.nn.MultiheadAttention` with column-parallel projections: it splits
    each projection into its `num_heads` heads (`reshape(seq, num_heads, -1)`), which on
    a device's own columns inside `shard_map` makes `num_heads` heads of a tp-th of the
    width, not `num_heads / tp` whole ones: wrong numbers, and nothing else fails. On
    global arrays (`jax.set_mesh`) the projection is whole and the heads are right, as
    they are over an axis of one device of the mesh set."""
    def is_mha(x):
        return isinstance(x, eqx.nn.MultiheadAttention)

    for path, m in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_mha)[0]:
        if not is_mha(m):
            continue
        split = [n for n in ("query_proj", "key_proj", "value_proj")
                 if _specs.is_layer(p := getattr(m, n))
                 and isinstance(p.rule.tp, _specs.Column)]
        mesh = jax.sharding.get_abstract_mesh()
        axis = getattr(m, split[0]).rule.tp.axis if split else None
        if split and not (not mesh.empty and dict(mesh.shape).get(axis) == 1):
            # (an axis of one device, in the mesh set, leaves every projection whole)
            raise ValueError(
                f"shard_map_specs: {_specs.path_str(path)} is an eqx.nn.MultiheadAttention "
                f"whose {', '.join(split)} are column-parallel over {axis!r}: inside "
                f"jax.shard_map a device's projection holds {m.num_heads} / size of "
                f"{axis!r} heads, but the module splits it into num_heads={m.num_heads} "
                "heads of a fraction of the width (wrong numbers, no error). Call the "
                "model on global arrays under jax.set_mesh (the fusedpar layers run their "
                "collectives there), or write the attention with "
                f"fusedpar.local_size(num_heads, {axis!r}) heads per device.")


def _check_varying(model, x, call, pspecs, x_spec, out_spec) -> None:
    """Raise unless inside `shard_map` each output varies over exactly the mesh axes its
    derived spec names, as JAX's replication check (`check_vma=True`) will ask.

    A layer's output layout is known exactly when its input is the model's input or
    another fusedpar call's output. Between layers other code (a norm, an activation, a
    residual sum) may carry an axis the next layer does not use, on a dimension no
    trace names: JAX's varying-axes types say that it happened, so `call` is traced once
    more inside a `shard_map` (over the mesh set, else over every axis at size 1: only the
    types matter) to ask them.
    """
    axes = sorted({a for s in jax.tree.leaves((pspecs, x_spec, out_spec),
                                              is_leaf=lambda s: isinstance(s, P))
                   if isinstance(s, P) for e in s for a in _vma.axis_names(e)
                   if e is not None})
    params, static = eqx.partition(model, _specs.is_param)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = AbstractMesh((1,) * len(axes), tuple(axes),
                            axis_types=(AxisType.Auto,) * len(axes))
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
    else:  # the mesh set (shard_map must use it), the arrays laid out on it as the specs say
        shapes = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
            (params, x), (pspecs, x_spec), is_leaf=lambda s: isinstance(s, P))
    seen = {}

    def body(params, x):
        model = eqx.combine(params, static)
        with _tracing(x) as calls:
            out = call(model, x)
        seen["out"] = jax.tree.map(_vma.varying_axes, out)
        # Where an axis came in unseen: a layer whose input is not exactly known varies
        # over axes beyond those of the layout the layer takes.
        seen["lost"] = [n for n, c in zip(_names(model, calls), calls)
                        if not c.exact and _vma.varying_axes(c.inputs[0][0])
                        - set(_specs.axis_dims(c.inputs[0][1], axes))]
        return ()

    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(pspecs, x_spec), out_specs=(),
                                 check_vma=True), *shapes)

    def check(path, spec, varying):
        named = set(_specs.axis_dims(spec, axes))
        if named == set(varying):
            return
        extra, lost = sorted(set(varying) - named), seen["lost"]
        raise ValueError(
            f"shard_map_specs: {_leaf_name(path, 'the output')} would be laid out as {spec} "
            f"(derived from the fusedpar calls), but inside shard_map it varies over mesh "
            f"axes {tuple(sorted(varying))}"
            + (f": {', '.join(map(repr, extra))} came through code between fusedpar layers "
               f"(first into {lost[0]}, which does not use it), so its dimension is not known"
               if extra and lost else "")
            + "; write the out_specs yourself (outputs=False derives the in_specs only).")

    jax.tree_util.tree_map_with_path(check, out_spec, seen["out"],
                                     is_leaf=lambda s: isinstance(s, P))


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


# Layers traced under another transformation inside `call` receive that
# transformation's values, not x (and a jit or checkpoint traced before may not run the
# layers again at all), so the derivation sees neither.
_HIDDEN = ("(If call applies the layers under jax.checkpoint, eqx.filter_checkpoint, "
           "jax.jit or lax.scan, that hides x and the layers from this derivation: derive "
           "the specs from a call without it, e.g. one block of a scanned stack, or write "
           "them.)")


def _resolve(model, calls, x, out):
    if not calls:
        raise ValueError("shard_map_specs: call(model, x) called no fusedpar layer; every "
                         "array it uses is replicated, use in_specs=P() and out_specs=P(). "
                         + _HIDDEN)
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
        if c.clash is not None:
            made, given = c.clash
            maker = next(n for n, m in zip(names, calls) if m is made)
            wanted = c.inputs[0][1]
            fix = ("Change one of the two layers' styles (a Column output, sharded on its "
                   "features, goes into a Row; a sequence-parallel Row output into a "
                   "sequence-parallel Column).")
            if (len(wanted) == len(given) and len(wanted) > 1 and wanted[0] != given[0]
                    and tuple(wanted)[1:] == tuple(given)[1:]):
                # Only the batch differs: one layer splits it over its FSDP axis.
                fix = (f"Only the batch (dim 0) differs: {wanted[0] or given[0]!r}, an FSDP "
                       "axis, splits it for one of them; give both layers the same FSDP "
                       "style (an embedding takes FSDP too), or neither.")
            raise ValueError(
                f"shard_map_specs: {name} takes its input laid out as {wanted}, but "
                f"it is the output of {maker}, laid out as {given}; "
                f"inside shard_map the layer would refuse it. {fix}")

    def input_spec(path, leaf):
        uses = [(names[i], s) for i, c in enumerate(calls) for a, s in c.inputs if a is leaf]
        what = _leaf_name(path, "the input x")
        seen = list(dict.fromkeys(names))  # a layer called twice is named once
        if not uses:
            raise ValueError(
                f"shard_map_specs: {what} (shape {leaf.shape}) does not go into a fusedpar "
                f"layer as it is (none of the fusedpar calls, "
                f"{', '.join(seen[:3]) + (', ...' if len(seen) > 3 else '')}, takes it "
                "unchanged), so its layout cannot be derived; write the in_spec "
                "of x yourself, with fusedpar.param_specs(model) for the parameters. "
                + _HIDDEN)
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
