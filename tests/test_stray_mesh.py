"""A sharded layer called with no mesh set is refused, never run as dense math; one
called under a mesh other than the one its weights are placed on is refused too.

Weights placed by `fusedpar.shard` and a layer called outside `jax.set_mesh` used to give
the right numbers with no fused collective at all (0 ring transfers in the program);
the deprecated `with mesh:` did the same. Weights placed on a (2, 4) mesh and called
under a (4, 2) mesh with the same axis names aborted the interpreter (signal 6 in JAX's
Shardy pass, dedup_meshes.cc).
"""

import os
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedpar
from helpers import mesh

pytestmark = pytest.mark.timeout(120)


def _layer():
    return fusedpar.ColumnLinear(16, 32, key=jax.random.key(0), backend="ring")


@pytest.mark.parametrize("jit", [False, True])
def test_sharded_layer_outside_a_mesh_is_refused(jit):
    layer = fusedpar.shard(_layer(), mesh((2, 4), ("fsdp", "tp")))
    call = eqx.filter_jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    with pytest.raises(ValueError, match=r"ColumnLinear: .*placed on a mesh .*'tp'.*"
                                         r"jax.set_mesh"):
        call(layer, jnp.ones((4, 16)))


def test_sharded_embedding_outside_a_mesh_is_refused():
    m = mesh((4,), ("tp",))
    emb = fusedpar.shard(fusedpar.Embedding(8, 4, key=jax.random.key(0)), m)
    with pytest.raises(ValueError, match=r"Embedding: .*jax.set_mesh"):
        emb(jnp.zeros((4,), jnp.int32))


def test_unplaced_layer_without_a_mesh_stays_dense():
    layer = _layer()
    x = jnp.ones((4, 16))
    lin = eqx.nn.Linear(16, 32, key=jax.random.key(0))
    np.testing.assert_allclose(layer(x), jax.vmap(lin)(x), rtol=1e-6)


def test_sharded_layer_under_set_mesh_runs_the_ring():
    m = mesh((2, 4), ("fsdp", "tp"))
    layer = fusedpar.shard(fusedpar.RowLinear(16, 32, key=jax.random.key(0),
                                              sequence_parallel=True, backend="ring"), m)
    with jax.set_mesh(m):
        hlo = eqx.filter_jit(lambda l, x: l(x)).lower(layer, jnp.ones((2, 8, 16))).as_text()
    assert "collective_permute" in hlo or "collective-permute" in hlo


def test_legacy_with_mesh_is_refused():
    m = mesh((4,), ("tp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with m, pytest.raises(ValueError, match=r"`with mesh:`.*jax.set_mesh\(mesh\)"):
            _layer()(jnp.ones((4, 16)))


def test_shard_map_specs_of_a_placed_model_outside_a_mesh():
    # Reading the layouts traces the model with no mesh: that is no dense run.
    layer = fusedpar.shard(_layer(), mesh((2, 4), ("fsdp", "tp")))
    (_, x_spec), y_spec = fusedpar.shard_map_specs(layer, jnp.ones((4, 16)))
    assert tuple(y_spec) == (None, "tp")


_OTHER_MESH = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import equinox as eqx, jax, jax.numpy as jnp
from jax.sharding import AxisType
import fusedpar

auto = (AxisType.Auto,) * 2
layer = fusedpar.FSDPLinear(64, 64, key=jax.random.key(0))
placed = fusedpar.shard(layer, jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=auto))
with jax.set_mesh(jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=auto)):
    try:
        eqx.filter_jit(lambda l, x: l(x))(placed, jnp.ones((8, 64)))
    except ValueError as e:
        print(e)
"""


def test_layer_placed_on_another_mesh_is_refused_not_aborted():
    """In a subprocess: before the check, JAX aborted the interpreter here."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _OTHER_MESH], env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("FSDPLinear: its weight is placed on a mesh {'fsdp': 2, 'tp': 4}, but it is "
            "called under jax.set_mesh of a mesh {'fsdp': 4, 'tp': 2}") in out.stdout
    assert "fusedpar.shard(model, mesh)" in out.stdout
