# Your own training step, compiled for hardware that is not here:
#   python -m fusedpar.aot --target h100x8 --program examples/aot_program.py:train_step
# The CLI builds the mesh (--mesh/--axes; here the default 2 x 4 "fsdp" x "tp"), calls
# train_step(mesh, backend) and lowers what it returns under jax.set_mesh(mesh): the
# layers run on global arrays, as in the README's example.
import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import fusedpar

DIM, HIDDEN, BATCH, SEQ = 1024, 4096, 8, 512  # small, so it compiles in seconds


def make_model(key):
    k1, k2 = jax.random.split(key)
    return [eqx.nn.Linear(DIM, HIDDEN, key=k1, dtype=jnp.bfloat16),
            eqx.nn.Linear(HIDDEN, DIM, key=k2, dtype=jnp.bfloat16)]


def train_step(mesh, backend):
    """(mesh, backend) -> (jitted, args): `jitted.lower(*args)` is what gets compiled."""
    plan = {"0": fusedpar.Column(sequence_parallel=True),
            "1": fusedpar.Row(sequence_parallel=True), "*": "fsdp"}
    # Shapes only: nothing is allocated, and the devices could not run anything anyway.
    model = fusedpar.parallelize(eqx.filter_eval_shape(make_model, jax.random.key(0)),
                                 plan, backend=backend)

    def on_mesh(shape, spec):  # an argument: its global shape, laid out on the mesh
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                    sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(on_mesh, model, fusedpar.param_specs(model))
    x = on_mesh(jax.ShapeDtypeStruct((BATCH, SEQ, DIM), jnp.bfloat16),
                jax.P("fsdp", "tp", None))

    @jax.jit
    def step(params, x):
        def loss(params):
            y = x
            for layer in params:
                y = jax.nn.gelu(layer(y))
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step, (params, x)
