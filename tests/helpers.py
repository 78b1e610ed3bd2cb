"""Shared test helpers: meshes, inputs, and tolerance-checked comparisons."""

from __future__ import annotations

import importlib.util

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

# Largest error allowed, relative to the largest magnitude in the expected result. f32:
# a few ulps of accumulation-order differences over the contraction; bf16/f16: a couple of
# output roundings (eps 2^-8 / 2^-11) plus the bf16 cast of the cotangent in backward.
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def tolerance(dtype) -> float:
    return RTOL[jnp.dtype(dtype).type]


def assert_close(got, want, dtype, what=""):
    """max|got - want| <= tolerance(dtype) * max|want|, per leaf of a pytree."""
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l), what
    for i, (g, w) in enumerate(zip(got_l, want_l)):
        g = np.asarray(jnp.asarray(g, jnp.float32))
        w = np.asarray(jnp.asarray(w, jnp.float32))
        assert g.shape == w.shape, f"{what} leaf {i}: shape {g.shape} != {w.shape}"
        assert np.all(np.isfinite(g)), f"{what} leaf {i}: non-finite values"
        scale = max(float(np.max(np.abs(w))), 1e-30)
        err = float(np.max(np.abs(g - w))) if g.size else 0.0
        assert err <= tolerance(dtype) * scale, (
            f"{what} leaf {i}: max error {err:.3g} > {tolerance(dtype):.1g} x scale {scale:.3g}")


def mesh(shape, names, axis_type=AxisType.Auto):
    """A mesh of the first prod(shape) devices, its axes all of `axis_type` (Auto by
    default); skips the test if there are fewer devices."""
    n = int(np.prod(shape))
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, {jax.default_backend()} has {len(jax.devices())}")
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                         devices=jax.devices()[:n])


def normal(seed, shape, dtype):
    """Standard normal values of `shape` in `dtype`, reproducible from `seed`.

    Drawn with numpy: a `jax.random` draw compiles once per shape (~0.5-0.8 s here).
    """
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return jnp.asarray(values).astype(dtype)


# Tests that compile for hardware that is not here need the compilers of the aot extra.
needs_aot = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None
    or importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
    reason='the compilers for absent hardware come with the aot extra: '
           'pip install -e ".[test,aot]"')


# (backend, ring options): directions x loop shapes x residual policy, covering each
# option value at least twice; reference is the dispatch path of the definition itself.
RING_CONFIGS = [
    ("reference", {}),
    ("ring", dict(bidirectional=False, unroll=True, keep_gathered=True)),
    ("ring", dict(bidirectional=True, unroll=False, keep_gathered=True)),
    ("ring", dict(bidirectional=True, unroll=True, keep_gathered=False)),
    ("ring", dict(bidirectional=False, unroll=False, keep_gathered=False)),
]


def same_kernels_as(backend, op, x, w, axis_size, **kwargs):
    """The backend after `backend` in the registry that runs the very kernels `backend`
    runs for this call (`fusedpar.explain` names them; on CPU "pallas" is pallas_tpu's
    interpreted kernels), or None: a test over the registry tests those once. `x`, `w`:
    local `jax.ShapeDtypeStruct`s. Raises NotImplementedError where `backend` cannot run
    the call (with its reason)."""
    import fusedpar
    from fusedpar._core import _backends

    def kernels(name):
        return fusedpar.explain(op, x, w, axis_size, backend=name, **kwargs).kernels

    mine = kernels(backend)
    names = _backends.names()
    for other in names[names.index(backend) + 1:] if mine else ():
        try:
            if kernels(other) == mine:
                return other
        except NotImplementedError:
            continue
    return None


def equations(jaxpr):
    """Every equation of `jaxpr` (a `Jaxpr` or `ClosedJaxpr`) and of the jaxprs nested in
    its equations' parameters (shard_map, pjit, custom_vjp, pallas_call bodies...), each
    before those nested in it."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)
