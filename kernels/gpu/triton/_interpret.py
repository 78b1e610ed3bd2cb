"""Interpret mode inside `shard_map(check_vma=True)`.

Pallas's plain interpreter (jax 0.10) evaluates the kernel's jaxpr, which is typed
without varying axes, on the shard_map body's varying values, and JAX's varying-axes
check then rejects the mix (e.g. a dynamic slice of a varying block at an invariant grid
index). The kernels' results are typed correctly at trace time (`kernels/gpu/_result_type.py`);
only their CPU lowering needs the check off. `interpreted(fn)` wraps a function of
arrays that calls `pallas_call(..., interpret=True)` in a primitive whose lowering
runs it with the check off. Only used on CPU; on GPU the Triton lowering is not
affected.
"""

from __future__ import annotations

from jax._src import config, core
from jax._src.pallas import core as pallas_core
from jax.interpreters import mlir

_interpret_p = core.Primitive("fusedpar_gpu_interpret")
_interpret_p.multiple_results = True


def _strip(aval):
    if getattr(aval, "manual_axis_type", None) is None:
        return aval
    return aval.update(manual_axis_type=core.empty_mat)


@_interpret_p.def_abstract_eval
def _abstract(*avals, fn, out_avals):
    del avals, fn
    return out_avals


@_interpret_p.def_impl
def _impl(*args, fn, out_avals):
    del out_avals
    return fn(*args)


def _lowering(ctx, *args, fn, out_avals):
    del out_avals
    ctx = ctx.replace(avals_in=[_strip(a) for a in ctx.avals_in],
                      avals_out=[_strip(a) for a in ctx.avals_out])
    with config._check_vma(False):
        return mlir.lower_fun(lambda *a: list(fn(*a)), multiple_results=True)(ctx, *args)


mlir.register_lowering(_interpret_p, _lowering)


def interpreted(fn, out_shape, *args):
    """`fn(*args)`, whose result is described by `out_shape` (a tuple of them for a tuple
    of results), lowered without the check."""
    several = isinstance(out_shape, tuple)
    shapes = out_shape if several else (out_shape,)
    avals = tuple(pallas_core._convert_out_shape_to_aval(s) for s in shapes)
    results = _interpret_p.bind(*args, fn=lambda *a: tuple(fn(*a)) if several else (fn(*a),),
                                out_avals=avals)
    return tuple(results) if several else results[0]
