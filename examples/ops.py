# Sequence-parallel matmuls on 8 simulated CPU devices, each op against its lax expression.
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import fusedpar

mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Auto,))
x = jax.random.normal(jax.random.key(0), (2, 64, 128))  # (batch, sequence, features)
w_up = jax.random.normal(jax.random.key(1), (128, 256)) / 128**0.5
w_down = jax.random.normal(jax.random.key(2), (256, 128)) / 256**0.5


def mlp(x, w_up, w_down):
    # x arrives sharded on the sequence dim; gather it while multiplying by w_up's columns.
    h = fusedpar.all_gather_matmul(x, w_up, "tp", dim=1, backend="ring")
    # multiply by w_down's rows and reduce-scatter back to sequence shards, overlapped.
    return fusedpar.matmul_reduce_scatter(jax.nn.gelu(h), w_down, "tp", dim=1,
                                          backend="ring")


def mlp_lax(x, w_up, w_down):  # the same thing, collective first and matmul after
    h = jnp.matmul(lax.all_gather(x, "tp", axis=1, tiled=True), w_up)
    y = jnp.matmul(jax.nn.gelu(h), w_down)
    return lax.psum_scatter(y, "tp", scatter_dimension=1, tiled=True)


specs = dict(mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp")),
             out_specs=P(None, "tp"))
fused = jax.jit(jax.shard_map(mlp, **specs))
plain = jax.jit(jax.shard_map(mlp_lax, **specs))
print("max |fused - lax|:", jnp.max(jnp.abs(fused(x, w_up, w_down) - plain(x, w_up, w_down))))

# Gradients flow through the same ring (the backward of a gather is a reduce-scatter).
loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
g_fused = jax.grad(loss(fused), argnums=(1, 2))(x, w_up, w_down)
g_plain = jax.grad(loss(plain), argnums=(1, 2))(x, w_up, w_down)
print("max |grad difference| / max |grad|:",
      max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(g_fused, g_plain)))

# What would "auto" pick for these per-device shapes, and why?
print(fusedpar.explain("all_gather_matmul", jax.ShapeDtypeStruct((2, 8, 128), jnp.float32),
                       jax.ShapeDtypeStruct((128, 32), jnp.float32), 8, dim=1))
