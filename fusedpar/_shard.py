"""Placing a model's parameters on a mesh per their specs, or creating them there."""

from __future__ import annotations

import warnings
from typing import Callable

import equinox as eqx
import jax
from jax.sharding import NamedSharding

from . import _specs


def _warn(dropped):
    if dropped:
        warnings.warn("fusedpar relaxed sharding replicated what does not divide: "
                      + "; ".join(str(d) for d in dropped), stacklevel=3)


def _shardings(model, mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), _specs.param_specs(model))


def shard(model, mesh, *, relaxed: bool = False):
    """`model` with every array placed on `mesh` per `fusedpar.param_specs(model)`.

    Validates first (`fusedpar.validate`): an axis missing from the mesh or a dimension
    that does not divide raises a `ValueError` naming the parameter path, dimension,
    size and axes. With `relaxed=True` such layers lose the style that does not fit
    (that dimension is replicated) and a warning lists what was dropped.
    """
    model, dropped = _specs.validate(model, mesh, relaxed=relaxed)
    _warn(dropped)
    params, static = eqx.partition(model, eqx.is_array)
    params = jax.device_put(params, _shardings(params, mesh))
    return eqx.combine(params, static)


def init_sharded(make: Callable, mesh, *args, relaxed: bool = False, **kwargs):
    """`make(*args, **kwargs)` created already sharded on `mesh`.

    The model is built under `jax.jit` with `out_shardings` from its specs, so no
    device ever holds a whole parameter (e.g.
    `init_sharded(lambda key: MLP(..., key=key), mesh, key)`). Validation and
    `relaxed` as in `shard`.
    """
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
