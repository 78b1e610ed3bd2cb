"""Placing a model's parameters on a mesh per their specs, or creating them there."""

from __future__ import annotations

import warnings
from typing import Callable

import equinox as eqx
import jax
from jax.sharding import NamedSharding

from .._core import _validate
from . import _specs
from ._spec_checks import check_mesh
from .._hw import _target


def _warn(dropped):
    if dropped:
        warnings.warn("fusedpar relaxed sharding replicated what does not divide: "
                      + "; ".join(str(d) for d in dropped), stacklevel=3)


def _warn_unplanned(model, mesh):
    """Warn where `model` has `eqx.nn.Linear`/`eqx.nn.Embedding` layers and no fusedpar
    ones on a mesh of several devices: every array is then replicated (what the specs
    say of a model that was not parallelized), and a forgotten `parallelize` (a dense
    checkpoint restored and sharded as it is) would otherwise train with no FSDP or
    tensor parallelism and no word."""
    def is_linear(x):
        return isinstance(x, (eqx.nn.Linear, eqx.nn.Embedding)) or _specs.is_layer(x)

    leaves = jax.tree.leaves(model, is_leaf=is_linear)
    if (mesh.size > 1 and any(is_linear(x) for x in leaves)
            and not any(_specs.is_layer(x) for x in leaves)):
        dense = sum(is_linear(x) for x in leaves)
        warnings.warn(f"shard: the model has {dense} eqx.nn.Linear or eqx.nn.Embedding "
                      f"layer{'s' if dense > 1 else ''} and no fusedpar layer, so every "
                      f"array is replicated on the mesh's {mesh.size} devices; "
                      "parallelize(model, plan) first to shard them.", stacklevel=3)


def _shardings(model, mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), _specs.param_specs(model))


def shard(model, mesh, *, relaxed: bool = False):
    """`model` with every array placed on `mesh` per `fusedpar.param_specs(model)`.

    A model of shapes (`jax.ShapeDtypeStruct` leaves, from `eqx.filter_eval_shape`)
    becomes a skeleton of the sharded model: each leaf a `jax.ShapeDtypeStruct` with its
    `NamedSharding`, nothing allocated — what a checkpoint is restored into sharded
    (`fusedpar.deserialise_filter_spec`, orbax's `restore`; docs/checkpoints.md).

    Validates first (`fusedpar.validate`): an axis missing from the mesh or a dimension
    that does not divide raises a `ValueError` naming the parameter path, dimension,
    size and axes. With `relaxed=True` such layers lose the style that does not fit
    (that dimension is replicated) and a warning lists what was dropped. A model with
    `eqx.nn.Linear` or `eqx.nn.Embedding` layers and no fusedpar layer (never
    `parallelize`d) is replicated, with a warning, on a mesh of several devices.

    As `jax.device_put`, it may hand back `model`'s own buffers where they are laid out
    already (a replicated bias on the devices it lies on): donating the sharded model
    (`eqx.filter_jit(donate="all")`) then deletes those arrays of `model` too. Keep
    using the sharded model, or copy what you still need.
    """
    check_mesh("shard", mesh)
    _validate.boolean("shard", "relaxed", relaxed)
    _warn_unplanned(model, mesh)
    model, dropped = _specs.validate(model, mesh, relaxed=relaxed)
    _warn(dropped)
    params, static = eqx.partition(model, _specs.is_param)
    leaves, treedef = jax.tree.flatten(params)
    holds_arrays = any(eqx.is_array(x) for x in leaves)
    if holds_arrays:
        check_mesh("shard", mesh, concrete=True)
    if _target.compile_only(mesh) and holds_arrays:
        # JAX's own error is "MakeArraysFromHostBufferShards not available with
        # compile-only client".
        raise ValueError(
            "shard: the mesh's devices are compile-only (fusedpar.aot.mesh), which hold no "
            "arrays; shard the model's shapes instead: fusedpar.shard("
            "eqx.filter_eval_shape(make_model, ...), mesh) gives the skeleton to lower with.")
    shardings = treedef.flatten_up_to(_shardings(params, mesh))
    arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]  # one transfer for all
    placed = jax.device_put([leaves[i] for i in arrays], [shardings[i] for i in arrays])
    for i, x in zip(arrays, placed):
        leaves[i] = x
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
              if isinstance(x, jax.ShapeDtypeStruct) else x for x, s in zip(leaves, shardings)]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


def _is_model(make) -> bool:
    """Whether `make` is a model holding arrays rather than a function that builds one.
    Equinox makes some functions Modules too, bound methods of a Module and
    `eqx.Partial`s, which may hold arrays: those are builders."""
    return (isinstance(make, eqx.Module) and not isinstance(make, eqx.Partial)
            and not hasattr(make, "__func__")  # a bound method
            and bool(jax.tree.leaves(eqx.filter(make, eqx.is_array))))


def init_sharded(make: Callable, mesh, *args, relaxed: bool = False, **kwargs):
    """`make(*args, **kwargs)` created already sharded on `mesh`.

    The model is built under `jax.jit` with `out_shardings` from its specs, so no
    device ever holds a whole parameter (e.g.
    `init_sharded(lambda key: MLP(..., key=key), mesh, key)`). Validation and
    `relaxed` as in `shard`.
    """
    check_mesh("init_sharded", mesh, concrete=True, first="make")
    _validate.boolean("init_sharded", "relaxed", relaxed)
    if _is_model(make):  # called as make(*args), a layer asked for its input x
        raise TypeError(f"init_sharded: make must be a function that builds the model "
                        f"(e.g. lambda key: MLP(..., key=key)), got a {type(make).__name__} "
                        "holding arrays; to place a model you have, use "
                        "fusedpar.shard(model, mesh).")
    if _target.compile_only(mesh):
        # JAX's own error is "'Executable' object has no attribute 'local_devices'".
        raise ValueError(
            "init_sharded: the mesh's devices are compile-only (fusedpar.aot.mesh), which "
            "hold no arrays; shard the model's shapes instead: fusedpar.shard("
            "eqx.filter_eval_shape(make, *args), mesh) gives the skeleton to lower with.")
    abstract = eqx.filter_eval_shape(make, *args, **kwargs)
    abstract, dropped = _specs.validate(abstract, mesh, relaxed=relaxed)
    _warn(dropped)
    params, static = eqx.partition(abstract, _specs.is_param)

    def build(*args, **kwargs):
        model = make(*args, **kwargs)
        if relaxed:
            model, _ = _specs.validate(model, mesh, relaxed=True)
        return eqx.filter(model, eqx.is_array)

    dyn, stat = eqx.partition((args, kwargs), eqx.is_array)

    def run(dyn):
        a, k = eqx.combine(dyn, stat)
        return build(*a, **k)

    params = jax.jit(run, out_shardings=_shardings(params, mesh))(dyn)
    return eqx.combine(params, static)
