"""`fusedpar.deserialise_filter_spec`: a checkpoint restored into a sharded skeleton, in
the dtypes NumPy does not know (bfloat16, float8), which `jnp.save` writes as raw bytes.
The float32 round trip is docs/checkpoints.md's, run by tests/test_docs.py."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fusedpar
from helpers import mesh

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_a_leaf_in_a_dtype_numpy_lacks_is_restored_bit_for_bit(dtype):
    m = mesh((2, 4), ("fsdp", "tp"))
    value = jax.random.normal(jax.random.key(0), (8, 16)).astype(dtype)
    f = io.BytesIO()
    jnp.save(f, value)
    f.seek(0)
    like = jax.ShapeDtypeStruct(value.shape, dtype, sharding=NamedSharding(m, P("tp", "fsdp")))
    got = fusedpar.deserialise_filter_spec(f, like)
    assert got.dtype == dtype and got.sharding.spec == P("tp", "fsdp")
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                  np.asarray(value).view(np.uint8))


def test_a_bfloat16_model_round_trips_sharded(tmp_path):
    m = mesh((2, 4), ("fsdp", "tp"))

    def make(k):
        return fusedpar.parallelize([eqx.nn.Linear(16, 32, key=k, dtype=jnp.bfloat16)],
                                    {"0": "column"})

    model = fusedpar.shard(make(jax.random.key(0)), m)
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, model)
    skeleton = fusedpar.shard(eqx.filter_eval_shape(make, jax.random.key(1)), m)
    restored = eqx.tree_deserialise_leaves(path, skeleton,
                                           filter_spec=fusedpar.deserialise_filter_spec)
    assert restored[0].weight.sharding == model[0].weight.sharding
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(model)):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
