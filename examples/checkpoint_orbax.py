# A sharded model saved and restored with orbax: each process writes and reads only its
# shards. (The orbax-checkpoint package; fusedpar does not need it.)
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # CPU

import tempfile

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType

import fusedpar


def make_model(key):  # the model as written for one device
    k1, k2 = jax.random.split(key)
    return [eqx.nn.Linear(64, 256, key=k1), eqx.nn.Linear(256, 64, key=k2)]


plan = {"0": fusedpar.Column(sequence_parallel=True),
        "1": fusedpar.Row(sequence_parallel=True), "*": "fsdp"}
mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
model = fusedpar.shard(fusedpar.parallelize(make_model(jax.random.key(0)), plan), mesh)

path = os.path.join(tempfile.mkdtemp(), "step_100")
checkpointer = ocp.StandardCheckpointer()
checkpointer.save(path, eqx.filter(model, eqx.is_array))  # the arrays; the rest is code
checkpointer.wait_until_finished()

# Restore into a skeleton: shapes and shardings, nothing allocated until the read.
skeleton = fusedpar.shard(eqx.filter_eval_shape(
    lambda k: fusedpar.parallelize(make_model(k), plan), jax.random.key(1)), mesh)
shapes, static = eqx.partition(skeleton, lambda x: isinstance(x, jax.ShapeDtypeStruct))
restored = eqx.combine(checkpointer.restore(path, shapes), static)
print(restored[0].weight.sharding.spec)   # P('tp', 'fsdp'): sharded as it was saved
for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(model)):
    np.testing.assert_array_equal(a, b)

# Or into the dense model's skeleton on one device: the saved arrays have its shapes.
dense = eqx.filter_eval_shape(make_model, jax.random.key(1))
shapes, static = eqx.partition(dense, lambda x: isinstance(x, jax.ShapeDtypeStruct))
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), shapes)
dense = eqx.combine(checkpointer.restore(path, shapes), static)  # eqx.nn.Linear layers
for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(model)):
    np.testing.assert_array_equal(a, b)
