"""The layers as drop-ins for `eqx.nn.Linear`: "scalar" features, as Equinox's own
`test_linear` uses them, with no mesh; refused only where a sharding rule splits them."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedpar
from helpers import mesh

pytestmark = pytest.mark.timeout(120)

KEY = jax.random.key(0)
LAYERS = [fusedpar.ColumnLinear, fusedpar.RowLinear, fusedpar.FSDPLinear]
FEATURES = [("scalar", 3), (3, "scalar"), ("scalar", "scalar")]


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("features", FEATURES, ids=str)
def test_scalar_features_with_no_mesh_are_eqx_linear(cls, features):
    a, b = features
    lin = eqx.nn.Linear(a, b, key=KEY)
    layer = cls(a, b, key=KEY)
    x = jnp.array(2.0) if a == "scalar" else jnp.arange(3.0)
    assert layer.weight.shape == lin.weight.shape
    np.testing.assert_allclose(layer(x), lin(x), rtol=1e-6)
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(jax.vmap(layer)(xs), jax.vmap(lin)(xs), rtol=1e-6)
    g = jax.grad(lambda l: jnp.sum(l(x)))(layer)
    want = jax.grad(lambda l: jnp.sum(l(x)))(lin)
    np.testing.assert_allclose(g.weight, want.weight, rtol=1e-6)


def test_scalar_dimension_that_a_rule_shards_is_refused_on_a_mesh():
    m = mesh((4,), ("tp",))
    head = fusedpar.ColumnLinear(8, "scalar", key=KEY)
    with pytest.raises(ValueError, match=r"ColumnLinear.*out_features='scalar'.*Column "
                                         r"style shards over mesh axis 'tp'.*eqx.nn.Linear"):
        fusedpar.shard(head, m)
    with jax.set_mesh(m), pytest.raises(ValueError, match=r"out_features='scalar'"):
        head(jnp.ones((4, 8)))
    # A rule that shards the other dimension is fine.
    up = fusedpar.shard(fusedpar.ColumnLinear("scalar", 8, key=KEY), m)
    with jax.set_mesh(m):
        y = eqx.filter_jit(lambda l, x: l(x))(up, jnp.arange(4.0))
    want = jax.vmap(eqx.nn.Linear("scalar", 8, key=KEY))(jnp.arange(4.0))
    np.testing.assert_allclose(y, want, rtol=1e-6)


class _Critic(eqx.Module):
    body: eqx.nn.Linear
    value: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.body = eqx.nn.Linear(8, 16, key=k1)
        self.value = eqx.nn.Linear(16, "scalar", key=k2)


def test_a_catch_all_plan_leaves_scalar_layers_with_a_warning():
    with pytest.warns(UserWarning, match=r"left \['value'\] as eqx.nn.Linear.*'scalar'"):
        model = fusedpar.parallelize(_Critic(KEY), {"*": "column"})
    assert isinstance(model.body, fusedpar.ColumnLinear)
    assert type(model.value) is eqx.nn.Linear
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fusedpar.shard(model, mesh((4,), ("tp",)))


def test_a_plan_that_names_a_scalar_layer_is_an_error():
    with pytest.raises(ValueError, match=r"parallelize: value: out_features='scalar'.*"
                                         r"leave it out of the parallelize plan"):
        fusedpar.parallelize(_Critic(KEY), {"body": "column", "value": "column"})


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_a_float32_bias_on_a_bfloat16_weight_gives_what_eqx_linear_gives(cls):
    """`eqx.nn.Linear`'s `y + b` promotes: a float32 bias on a bfloat16 weight gives a
    float32 output (the layers used to cast the bias to the product's bfloat16: 7e-3
    apart)."""
    lin = eqx.nn.Linear(8, 8, key=KEY)
    lin = eqx.tree_at(lambda l: l.weight, lin, lin.weight.astype(jnp.bfloat16))
    layer = eqx.tree_at(lambda l: (l.weight, l.bias), cls(8, 8, key=KEY),
                        (lin.weight, lin.bias))
    x = jax.random.normal(jax.random.key(1), (8,), jnp.bfloat16)
    want = lin(x)
    assert want.dtype == jnp.float32
    got = layer(x)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)


def test_bfloat16_bias_gradients_of_a_2d_mesh_compile_on_cpu():
    """A bfloat16 layer's bias gradient is summed over the devices in float32: a bfloat16
    all-reduce in a shard_map that leaves mesh axes to XLA aborts XLA's CPU compiler (its
    AllReducePromotion pass), which every bfloat16 sequence-parallel Row and FSDP layer
    with a bias hit on a (2, 4) mesh. Gradients as the dense layer's in float32, within
    a few bfloat16 roundings of their largest magnitude."""
    m = mesh((2, 4), ("fsdp", "tp"))
    cast = lambda t, d: jax.tree.map(  # noqa: E731
        lambda a: a.astype(d) if eqx.is_inexact_array(a) else a, t)
    layer = cast(fusedpar.RowLinear(64, 64, key=KEY, sequence_parallel=True), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (8, 32, 64), jnp.bfloat16)
    loss = lambda l, x: jnp.sum(l(x).astype(jnp.float32) ** 2)  # noqa: E731
    want = eqx.filter_grad(loss)(cast(layer, jnp.float32), x.astype(jnp.float32))
    with jax.set_mesh(m):
        got = eqx.filter_jit(eqx.filter_grad(loss))(fusedpar.shard(layer, m), x)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for g, w in ((got.bias, want.bias), (got.weight, want.weight)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=4 * eps * np.abs(w).max())


def test_numpy_integer_sizes_as_eqx_linear_takes_them():
    # A size from NumPy arithmetic (np.prod of a shape) is what eqx.nn.Linear accepts;
    # the layers, parallelize and cross_entropy refused np.int64 as "not a positive int".
    dim = np.prod((2, 4))
    with warnings.catch_warnings():  # Equinox's own: "A JAX array is being set as static"
        warnings.simplefilter("ignore", UserWarning)
        lin = eqx.nn.Linear(dim, np.int32(6), key=KEY)
    layer = fusedpar.ColumnLinear(dim, np.int32(6), key=KEY)
    assert (type(layer.in_features), type(layer.out_features)) == (int, int)
    x = jnp.arange(8.0)
    np.testing.assert_allclose(layer(x), lin(x), rtol=1e-6)
    planned = fusedpar.parallelize({"up": lin}, {"up": "column"})["up"]
    assert planned.in_features == 8 and type(planned.in_features) is int
    logits, labels = jnp.zeros((2, 8)), jnp.array([3, -1])
    got = fusedpar.cross_entropy(logits, labels, None, ignore_index=np.int64(-1),
                                 vocab_size=np.int64(8))
    np.testing.assert_allclose(got, [np.log(8.0), 0.0], rtol=1e-6)
