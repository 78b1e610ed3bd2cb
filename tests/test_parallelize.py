"""parallelize: an Equinox model's eqx.nn.Linear leaves become fusedpar layers by a plan,
with the same weights; the parallel model trains like the dense one."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fusedpar
from fusedpar import FSDP, Column, Row
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(300)

D, H = 16, 64


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(D, H, key=k1)
        self.down = eqx.nn.Linear(H, D, key=k2)

    def __call__(self, x):  # x: (..., seq, D); written for both kinds of layer
        return x + apply(self.down, jax.nn.gelu(apply(self.up, x)))


def apply(layer, x):
    """eqx.nn.Linear wants one vector; fusedpar layers take (..., features)."""
    if isinstance(layer, fusedpar.ParallelLinear):
        return layer(x)
    return jnp.vectorize(layer, signature="(i)->(o)")(x)


class Net(eqx.Module):
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.blocks = [MLP(k) for k in keys[:2]]
        self.head = eqx.nn.Linear(D, D, key=keys[2])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return apply(self.head, x)


PLAN = {"blocks.*.up": Column(sequence_parallel=True),
        "blocks.*.down": Row(sequence_parallel=True),
        "*": "fsdp"}


def test_parallelize_rewrites_and_keeps_weights():
    net = Net(jax.random.key(0))
    par = fusedpar.parallelize(net, PLAN, backend="ring")
    for b, pb in zip(net.blocks, par.blocks):
        assert isinstance(pb.up, fusedpar.ColumnLinear) and isinstance(pb.down, fusedpar.RowLinear)
        assert pb.up.rule == fusedpar.compose(Column(sequence_parallel=True), FSDP())
        assert pb.down.rule == fusedpar.compose(Row(sequence_parallel=True), FSDP())
        assert pb.up.backend == "ring"
        assert pb.up.weight is b.up.weight and pb.down.bias is b.down.bias
    assert isinstance(par.head, fusedpar.FSDPLinear) and par.head.weight is net.head.weight
    # Composition does not depend on the plan's order.
    reordered = fusedpar.parallelize(net, dict(reversed(list(PLAN.items()))), backend="ring")
    assert jax.tree.structure(reordered) == jax.tree.structure(par)
    # Layers that are already parallel are not eqx.nn.Linear leaves any more.
    with pytest.raises(ValueError, match=r"\['head'\] matched no eqx\.nn\.Linear; the "
                       r"model's linear layers are \[\]"):
        fusedpar.parallelize(par, {"head": "row"})


def test_parallelize_errors():
    net = Net(jax.random.key(0))
    with pytest.raises(ValueError, match=r"blocks\.0\.up: two tensor-parallel styles"):
        fusedpar.parallelize(net, {"blocks.*": "column", "*.up": "row"})
    with pytest.raises(ValueError, match=r"plan pattern\(s\) \['mlp\.\*'\] matched no "
                       r"eqx\.nn\.Linear; the model's linear layers are \['blocks\.0\.up', "):
        fusedpar.parallelize(net, {"mlp.*": "column"})
    with pytest.raises(ValueError, match=r"plan\['head'\] = 'diagonal' is not a style"):
        fusedpar.parallelize(net, {"head": "diagonal"})


def _sgd(loss, model, x, steps, lr=0.1):
    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    losses = []
    for _ in range(steps):
        value, g = grad(model, x)
        losses.append(value)
        model = jax.tree.map(lambda p, d: p - lr * d, model, g)
    return model, jnp.stack(losses)


def test_training_matches_dense():
    """A few SGD steps on an fsdp=2 x tp=4 mesh reach the dense model's losses."""
    net = Net(jax.random.key(1))
    x = normal(2, (4, 8, D), jnp.float32)  # (batch, seq, features)

    def loss(model, x):
        return jnp.mean((model(x) - jnp.sin(x)) ** 2)

    dense, want = _sgd(loss, net, x, 3)
    m = mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(m):
        par = fusedpar.shard(fusedpar.parallelize(net, PLAN, backend="ring"), m)
        par, got = _sgd(loss, par, x, 3)
        assert par.blocks[0].up.weight.sharding.spec == jax.P("tp", "fsdp")
    assert_close(got, want, jnp.float32, "losses")
    assert float(got[-1]) < float(got[0])
    assert_close(par.blocks[1].down.weight, dense.blocks[1].down.weight, jnp.float32,
                 "trained weight")
