"""`lax.scan` over stacked layers inside a per-example `jax.vmap` works (the docs say so):
the layers see one example each (the scan stops the vmap's fold) and give the dense
numbers, values and gradients, on global arrays under jax.set_mesh."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import fusedpar
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(300)


class Block(eqx.Module):
    up: fusedpar.ColumnLinear
    down: fusedpar.RowLinear

    def __init__(self, key, backend="ring"):
        k1, k2 = jax.random.split(key)
        self.up = fusedpar.ColumnLinear(16, 32, key=k1, sequence_parallel=True,
                                        fsdp_axis="fsdp", backend=backend)
        self.down = fusedpar.RowLinear(32, 16, key=k2, sequence_parallel=True,
                                       fsdp_axis="fsdp", backend=backend)

    def __call__(self, x):  # x: (seq, features), one example
        return x + self.down(jnp.tanh(self.up(x)))


def loss(blocks, x):
    params, static = eqx.partition(blocks, eqx.is_array)

    def one(example):
        def step(h, p):
            return eqx.combine(p, static)(h), None
        return lax.scan(step, example, params)[0]

    return jnp.sum(jnp.sin(jax.vmap(one)(x)))


def test_scan_inside_vmap_matches_dense():
    blocks = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 3))
    x = normal(0, (2, 8, 16), jnp.float32)
    want = eqx.filter_value_and_grad(loss)(blocks, x)  # no mesh: dense math
    m = mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(m):
        got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(fusedpar.shard(blocks, m), x)
    assert_close(got, want, jnp.float32)


def test_scan_inside_vmap_over_an_explicitly_sharded_batch():
    """Explicit axes and the batch placed on "fsdp" (as the carry of sequence-parallel
    blocks must be): JAX batches the scanned layers' traced program over "fsdp" after
    the layers ran, and cannot lower a reduce-scatter batched so (jax 0.10 asserts) nor
    batch the ring's steps. The reference sums over the ring and slices there
    (`_definition.psum_scatter`), with the dense numbers and gradients, as `auto` does;
    the ring is refused, naming the vmap's axis."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    keys = jax.random.split(jax.random.key(0), 2)
    x = normal(0, (2, 8, 16), jnp.float32)
    want = eqx.filter_value_and_grad(loss)(eqx.filter_vmap(Block)(keys), x)
    m = mesh((2, 4), ("fsdp", "tp"), AxisType.Explicit)
    with jax.set_mesh(m):
        xs = jax.device_put(x, NamedSharding(m, P("fsdp", "tp")))
        blocks = eqx.filter_vmap(lambda k: Block(k, "auto"))(keys)
        got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(fusedpar.shard(blocks, m), xs)
        assert_close(got, want, jnp.float32)
        rings = fusedpar.shard(eqx.filter_vmap(Block)(keys), m)
        with pytest.raises(NotImplementedError,
                           match=r"batch sharded on Explicit mesh axes \('fsdp',\)"):
            eqx.filter_jit(loss)(rings, xs)


class Shared(eqx.Module):
    """Two sequence-parallel columns on one input (one gather, its backward's two partial
    sums added in one reduce-scatter) with gradients sent as int8."""
    a: fusedpar.ColumnLinear
    b: fusedpar.ColumnLinear
    down: fusedpar.RowLinear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        kw = dict(sequence_parallel=True, fsdp_axis="fsdp", grad_comm_dtype=jnp.int8)
        self.a = fusedpar.ColumnLinear(16, 32, key=k1, **kw)
        self.b = fusedpar.ColumnLinear(16, 32, key=k2, **kw)
        self.down = fusedpar.RowLinear(32, 16, key=k3, sequence_parallel=True,
                                       fsdp_axis="fsdp")

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.a(x)) * self.b(x))


def test_scan_of_shared_gathers_inside_vmap_over_an_explicitly_sharded_batch():
    """The same with the backward's other reduce-scatter (`_autodiff.scattered`, the
    siblings' partial sums with quantized gradients): the scan gives the numbers a
    Python loop over the layers gives (a vmap there folds into each layer)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    def looped(blocks, x):
        params, static = eqx.partition(blocks, eqx.is_array)

        def one(h):
            for i in range(2):
                h = eqx.combine(jax.tree.map(lambda a: a[i], params), static)(h)
            return h
        return jnp.sum(jnp.sin(jax.vmap(one)(x)))

    x = normal(0, (2, 8, 16), jnp.float32)
    m = mesh((2, 4), ("fsdp", "tp"), AxisType.Explicit)
    with jax.set_mesh(m):
        xs = jax.device_put(x, NamedSharding(m, P("fsdp", "tp")))
        blocks = fusedpar.shard(eqx.filter_vmap(Shared)(jax.random.split(
            jax.random.key(0), 2)), m)
        got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(blocks, xs)
        want = eqx.filter_jit(eqx.filter_value_and_grad(looped))(blocks, xs)
    assert_close(got, want, jnp.float32)


def test_vmap_over_an_explicitly_sharded_batch_around_jit_scan_and_checkpoint():
    """Under Explicit axes, a per-example jax.vmap over a batch sharded on "data" takes
    that axis from whatever runs under a jit, scan or checkpoint inside it: the layer
    (tensor parallel over "tp" alone) runs there, with the dense numbers."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    k = jax.random.key(0)
    layer = fusedpar.ColumnLinear(16, 32, key=k)
    x = normal(1, (4, 8, 16), jnp.float32)
    want = jax.vmap(jax.vmap(eqx.nn.Linear(16, 32, key=k)))(x)
    m = mesh((2, 4), ("data", "tp"), AxisType.Explicit)
    inner = {"jit": lambda l: jax.jit(lambda e: l(e)),
             "checkpoint": lambda l: jax.checkpoint(lambda e: l(e)),
             "scan": lambda l: lambda e: lax.scan(lambda h, _: (h, l(h)), e, None,
                                                  length=1)[1][0]}
    with jax.set_mesh(m):
        xs = jax.device_put(x, NamedSharding(m, P("data")))
        sharded = fusedpar.shard(layer, m)
        for name, wrap in inner.items():
            got = eqx.filter_jit(lambda l, x: jax.vmap(wrap(l))(x))(sharded, xs)
            assert_close(got, want, jnp.float32, name)
