"""Whole models: every array's PartitionSpec, tied weights, and validation on a mesh.

`param_specs` and `validate` walk a model of any depth and apply each fusedpar layer's
`Rule`; non-parallel arrays are replicated (`PartitionSpec()`), quantized weights get
specs for their values and scales, and stacked layers (`eqx.filter_vmap` over a
constructor) keep their leading dimensions unsharded.
"""

from __future__ import annotations

from typing import Any, Optional

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P

from .._core import _validate
from .._core._quantized_array import QuantizedArray
from ._rules import Rule, TableRule
from ._spec_checks import (check_mesh, check_param_shapes, check_scalar, check_spec,
                           mesh_sizes)


def is_param(x) -> bool:
    """An array, or the shape of one (`jax.eval_shape` / `eqx.filter_eval_shape` output)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_layer(x) -> bool:
    """A fusedpar layer: a module with a sharding `Rule`."""
    return isinstance(x, eqx.Module) and isinstance(getattr(x, "rule", None), Rule)


def check_patterns(where: str, name: str, patterns) -> None:
    """Refuse a plan (or `where=` dict) keyed by something other than `fnmatch` patterns
    on dotted layer paths: fnmatch said only "object of type 'int' has no len()"."""
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{where}: {name}'s keys must be str patterns on layer paths "
                        f"(e.g. 'blocks.*.up', 'blocks.0.up'), got {bad[0]!r}.")


def path_str(path) -> str:
    """A pytree path as a dotted string (`"blocks.0.mlp.up"`), as plans and errors name it."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        else:
            parts.append(str(getattr(k, "key", getattr(k, "name", k))))
    return ".".join(parts) or "model"


def layer_name(path, layer) -> str:
    """How errors name `layer` at `path`: the path, or its class when it is the model."""
    return path_str(path) if path else type(layer).__name__


def layer_param_specs(layer, where: str, rule: Optional[Rule] = None) -> Any:
    """`layer` with each array replaced by its PartitionSpec (under `rule`, default its own)."""
    rule = layer.rule if rule is None else rule
    specs = rule.param_specs(where, getattr(layer, "bias", None) is not None)

    def spec(path, leaf):
        name = path[-1].name if path and hasattr(path[-1], "name") else None
        # A weight tied by `eqx.nn.Shared` is a placeholder here: it is stored once, with
        # the spec of the array it is tied to (`check_ties` makes sure the two agree).
        if name in specs and specs[name] is not None and (is_param(leaf) or is_quantized(leaf)):
            one = stacked(specs[name], leaf.shape, PARAM_RANK[name])
            return quantized_specs(leaf, one) if is_quantized(leaf) else one
        if is_quantized(leaf):
            return quantized_specs(leaf, P())
        return P() if is_param(leaf) else None

    return jax.tree_util.tree_map_with_path(spec, layer, is_leaf=is_quantized)


def is_quantized(x) -> bool:
    """A `QuantizedArray` (a weight stored as values and scales)."""
    return isinstance(x, QuantizedArray)


def quantized_specs(q, spec: P):
    """The specs of a QuantizedArray sharded like an array of spec `spec`: its `values`
    (and `master`) by `spec`; its `scales` by `spec` too, except along the reduced axis
    where one scale covers the whole axis (scales of size 1 there are replicated). A
    QuantizedArray of those specs, so it matches `eqx.filter(model, eqx.is_array)`."""
    full = tuple(spec) + (None,) * (q.ndim - len(spec))
    ax = q.axis % q.ndim
    whole = q.scales.shape[ax] == 1
    scales = P(*(None if i == ax and whole else e for i, e in enumerate(full)))
    leaves = [spec, scales] + ([spec] if q.master is not None else [])
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(q), leaves)


# The rank of each parameter of one layer; more leading dimensions are a stack of layers.
PARAM_RANK = {"weight": 2, "bias": 1}


def stacked(spec: P, shape, rank: int) -> P:
    """`spec` (of one layer's rank-`rank` parameter) for a parameter of `shape`, whose
    leading dimensions beyond `rank` stack layers (`eqx.filter_vmap` over their
    constructor, run with `lax.scan`): those stay unsharded, each layer sharded as one."""
    lead = len(shape) - rank
    return P(*((None,) * lead + tuple(spec))) if lead > 0 and len(spec) else spec


def param_specs(model) -> Any:
    """A PartitionSpec for every array of `model` (a pytree of any depth).

    Arrays of fusedpar layers get their rule's specs; every other array is replicated,
    `PartitionSpec()`; non-array leaves become None. The result matches
    `eqx.filter(model, eqx.is_array)`, so it serves as `shard_map` in_specs for it.
    Raises if a layer uses one mesh axis twice on an array (naming its path).
    """

    specs = _specs_of(model)
    check_ties(model)
    return specs


def _specs_of(model) -> Any:
    def one(path, x):
        if is_layer(x):
            return layer_param_specs(x, layer_name(path, x))
        if is_quantized(x):
            return quantized_specs(x, P())
        return P() if is_param(x) else None

    return jax.tree_util.tree_map_with_path(
        one, model, is_leaf=lambda x: is_layer(x) or is_quantized(x))


def _is_shared(x) -> bool:
    return isinstance(x, eqx.nn.Shared)


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) and not isinstance(x, P) else [x]


def check_ties(model) -> None:
    """Raise unless every weight tied by an `eqx.nn.Shared` in `model` (a language model's
    embedding table and LM head, say) is sharded by its layer as the array it is tied to.

    A tied weight is stored once, with its source's spec. Were the layer it is restored
    into to shard it otherwise, it would be resharded at every call on global arrays and
    have the wrong local shape inside `shard_map`. Ties whose `get` transforms the source
    (`jnp.transpose`, say) are not checked: the layout of the result is not a spec here.
    """
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_shared)[0]
    for path, node in found:
        if not (_is_shared(node) and callable(node.where) and callable(node.get)):
            continue  # not a tie, or one filtered (`eqx.partition`) to its arrays
        # The spec each tied position gets from its layer: the specs of the pytree with
        # the ties restored (shapes only), read at the positions `where` names.
        restored = eqx.filter_eval_shape(lambda n: n(), node)
        wanted = _as_list(node.where(_specs_of(restored)))
        try:
            given = _as_list(node.get(_specs_of(node.pytree)))
        except Exception:  # noqa: BLE001 - a transforming `get`: nothing to compare
            continue
        for dest, source in zip(wanted, given):
            if isinstance(source, P) and isinstance(dest, P) and dest != source:
                raise ValueError(
                    f"{path_str(path)}: eqx.nn.Shared ties a weight its layer shards "
                    f"{dest} to an array sharded {source}; tied weights need one layout "
                    "(a vocabulary-parallel table, Row(), ties to a Column() LM head).")


def check_axes(model, sizes: dict) -> None:
    """Every mesh axis `model`'s layers use is in the mesh (`sizes`: axis -> size); else
    one `ValueError` that names every layer with an axis the mesh lacks, and the style
    (so the argument) that asked for it."""
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer)[0]
    bad = [f"{layer_name(path, x)}: mesh axis {', '.join(missing)}" for path, x in leaves
           if is_layer(x) and (missing := x.rule.missing_axes(sizes))]
    if bad:
        raise ValueError(f"{'; '.join(bad)}: not in the mesh, whose axes are "
                         f"{tuple(sizes)}. Name one of them in the style (the layer's "
                         "argument above, or the plan's), or build the mesh with that axis.")


def validate(model, mesh, *, relaxed: bool = False) -> tuple[Any, list]:
    """Check `model`'s specs against `mesh`; return `(model, dropped)`.

    Every axis a layer uses must be in the mesh, and every sharded dimension must divide
    by the product of its axes' sizes; otherwise a `ValueError` names the parameter path,
    dimension, size and axes. With `relaxed=True` a layer whose dimension does not divide
    loses that style instead (its dimension is replicated; a layer left with no style
    becomes a `fusedpar.Linear`, or an `Embedding` with no axis, with the same weights,
    called as before), and `dropped` lists each `Drop`.
    """
    check_mesh("validate", mesh)
    _validate.boolean("validate", "relaxed", relaxed)
    sizes = mesh_sizes(mesh)
    dropped: list = []
    check_ties(model)
    check_axes(model, sizes)

    def one(path, x):
        if not is_layer(x):
            return x
        where = layer_name(path, x)
        check_param_shapes(where, x)
        if relaxed and (is_param(x.weight) or is_quantized(x.weight)):  # tied: its source's
            rule, drops = x.rule.relax(where, x.weight.shape[-2:], sizes)
            if drops:
                dropped.extend(drops)
                x = x.with_rule(rule)
                if not is_layer(x):
                    return x
        if hasattr(x, "in_features"):
            check_scalar(where, x.rule, x.in_features, x.out_features)
        specs = layer_param_specs(x, where)
        if is_quantized(x.weight):
            check_spec(f"{where}.weight", x.weight.shape, specs.weight.values, sizes)
            q, last = x.weight, x.weight.ndim - 1
            check_spec(f"{where}.weight.scales", q.scales.shape, specs.weight.scales, sizes,
                       fixes={last: (
                           f"its block_size={q.block_size} makes {q.scales.shape[last]} "
                           f"blocks of in_features={q.shape[last]}, which must split "
                           "evenly over the same axes as the weight: quantize with a "
                           "block_size dividing each device's share of in_features, or "
                           "with one scale per output channel (block_size=None)")})
        elif is_param(x.weight):  # else tied: checked where its array is stored
            shape = x.weight.shape
            check_spec(f"{where}.weight", shape, specs.weight, sizes,
                       vocab_dim=len(shape) - 2 if isinstance(x.rule, TableRule) else None)
        if getattr(x, "bias", None) is not None:
            check_spec(f"{where}.bias", x.bias.shape, specs.bias, sizes)
        return x

    model = jax.tree_util.tree_map_with_path(one, model, is_leaf=is_layer)
    return model, dropped
