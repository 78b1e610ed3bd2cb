# A model's eqx.nn.Linear layers made parallel by a plan, trained on a 2 x 4 mesh.
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # CPU

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType

import fusedpar


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim, hidden, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(dim, hidden, key=k1)
        self.down = eqx.nn.Linear(hidden, dim, key=k2)

    def __call__(self, x):  # x: (batch, seq, dim) once parallel
        return x + self.down(jax.nn.gelu(self.up(x)))


model = [MLP(64, 256, k) for k in jax.random.split(jax.random.key(0), 2)]
plan = {"*.up": fusedpar.Column(sequence_parallel=True),
        "*.down": fusedpar.Row(sequence_parallel=True),
        "*": "fsdp"}                       # every layer is also FSDP-sharded
model = fusedpar.parallelize(model, plan)
print(fusedpar.param_specs(model)[0].up.weight)   # P('tp', 'fsdp')

mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
x = jax.random.normal(jax.random.key(1), (8, 32, 64))   # (batch, seq, dim)


def loss(model, x):
    for block in model:
        x = block(x)
    return jnp.mean(x ** 2)


with jax.set_mesh(mesh):
    model = fusedpar.shard(model, mesh)
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    for _ in range(3):
        value, grads = step(model, x)
        model = jax.tree.map(lambda p, g: p - 0.1 * g, model, grads)
        print(float(value))

# The same model in your own shard_map: local shards in, local shards out.
(params_spec, x_spec), _ = fusedpar.shard_map_specs(model, x, call=loss, outputs=False)
local = jax.jit(jax.shard_map(lambda m, x: loss(m, x)[None], mesh=mesh,
                              in_specs=(params_spec, x_spec), out_specs=jax.P(("fsdp", "tp"))))
print(local(model, x).shape)   # one partial loss per device: (8,)
