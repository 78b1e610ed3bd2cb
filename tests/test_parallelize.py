"""parallelize: an Equinox model's eqx.nn.Linear leaves become fusedpar layers by a plan,
with the same weights; the parallel model trains like the dense one."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

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
    # A parallel model is re-planned: the layer a pattern matches takes its styles.
    again = fusedpar.parallelize(par, {"head": "row"})
    assert isinstance(again.head, fusedpar.RowLinear) and again.head.weight is par.head.weight


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


def test_describe_table():
    """One row per linear layer and embedding: path, class, style, specs, backend and
    collectives; what the plan left alone is replicated."""
    model = {"embed": eqx.nn.Embedding(32, D, key=jax.random.key(0)), "net": Net(
        jax.random.key(1))}
    plan = {"embed": Row(sequence_parallel=True), **{f"net.{p}": s for p, s in PLAN.items()}}
    table = fusedpar.describe(fusedpar.parallelize(model, plan, backend="ring")).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    assert cells[0] == ["path", "layer", "style", "parameters", "backend", "forward",
                        "backward"]
    rows = {c[0]: c[1:] for c in cells[2:]}
    assert list(rows) == ["embed", "net.blocks.0.up", "net.blocks.0.down", "net.blocks.1.up",
                          "net.blocks.1.down", "net.head"]
    assert rows["net.blocks.0.down"] == [
        "RowLinear", "Row('tp', sequence_parallel) + FSDP('fsdp')",
        "weight P('fsdp', 'tp'), bias P()", "ring",
        "all_gather W over fsdp; matmul_reduce_scatter y(seq) over tp",
        "all_gather_matmul dy(seq) over tp; reduce_scatter dW over fsdp; psum db over fsdp, tp"]
    assert rows["embed"][:3] == ["Embedding", "Row('tp', sequence_parallel)",
                                 "weight P('tp', None)"]
    plain = fusedpar.describe(model).splitlines()[2]
    assert [c.strip() for c in plain.strip("|").split("|")][:4] == [
        "embed", "Embedding", "replicated", "weight P()"]


_KINDS = {"all_gather_matmul": "all_gather", "all_gather": "all_gather",
          "matmul_reduce_scatter": "reduce_scatter", "reduce_scatter": "reduce_scatter",
          "psum_scatter": "reduce_scatter", "psum": "psum"}


def _claimed(lines):
    """{(collective, axes)} from describe's cells, e.g. "psum db over fsdp, tp"."""
    out = set()
    for line in lines:
        op, axes = line.split(" ", 1)[0], line.split(" over ")[1]
        out.add((_KINDS[op], frozenset(axes.split(", "))))
    return out


def _traced(jaxpr, out=None):
    """{(collective, axes)} of every collective in a jaxpr and its sub-jaxprs."""
    out = set() if out is None else out
    for e in jaxpr.eqns:
        name = e.primitive.name.replace("_invariant", "")
        if name in ("all_gather", "reduce_scatter", "psum"):
            axes = e.params.get("axes", e.params.get("axis_name"))
            out.add((name, frozenset(axes if isinstance(axes, tuple) else (axes,))))
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    _traced(sub, out)
    return out


def test_describe_names_the_collectives_that_run():
    """Each layer kind's forward collectives are those of its forward jaxpr, and forward
    plus backward those of its gradient's jaxpr (reference backend: plain lax
    collectives), on a 2 x 4 mesh."""
    k = jax.random.key(2)
    kw = dict(key=k, fsdp_axis="fsdp", backend="reference")
    layers = [fusedpar.ColumnLinear(8, 16, **kw),
              fusedpar.ColumnLinear(8, 16, sequence_parallel=True, gather_output=True, **kw),
              fusedpar.RowLinear(16, 8, **kw), fusedpar.RowLinear(16, 8, sequence_parallel=True,
                                                                  **kw),
              fusedpar.FSDPLinear(8, 8, key=k, backend="reference"),
              fusedpar.Embedding(16, 8, key=k, fsdp_axis="fsdp"),
              fusedpar.Embedding(16, 8, key=k, sequence_parallel=True)]
    with jax.set_mesh(mesh((2, 4), ("fsdp", "tp"))):
        for layer in layers:
            x = (jnp.ones((4, 8), jnp.int32) if isinstance(layer, fusedpar.Embedding) else
                 jnp.ones((4, 8, layer.in_features)))

            def loss(layer, x):
                return jnp.sum(jnp.sin(layer(x)))

            fwd, bwd = layer.collectives()
            what = f"{type(layer).__name__} {layer.rule}"
            assert _traced(jax.make_jaxpr(loss)(layer, x).jaxpr) == _claimed(fwd), what
            grads = jax.make_jaxpr(eqx.filter_grad(loss))(layer, x).jaxpr
            # Less the data-parallel sum of the weight's gradient over the mesh's other
            # axis, where the batch lies on it (a layer with no FSDP: the table over "fsdp").
            data = {("psum", frozenset(a for a in ("fsdp", "tp") if a not in layer.rule.axes))}
            assert _traced(grads) - data == _claimed(fwd + bwd), what


def _scan_blocks(stack, x):
    """Run a stack of MLP blocks (parameters with a leading layer dimension) with scan."""
    params, static = eqx.partition(stack, eqx.is_array)
    return jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, params)[0]


def test_stacked_layers_shard_each_layer():
    """Blocks stacked with eqx.filter_vmap and run with lax.scan: the layer dimension stays
    unsharded and each layer is sharded as one (it was the layer dimension that got the
    tensor-parallel axis); values and gradients equal the dense stack's, FSDP x TP with
    sequence parallelism on a 2 x 4 mesh."""
    stack = eqx.filter_vmap(MLP)(jax.random.split(jax.random.key(0), 3))
    x = normal(1, (4, 8, D), jnp.float32)

    def loss(stack, x):
        return jnp.sum(_scan_blocks(stack, x) ** 2)

    want = eqx.filter_value_and_grad(loss)(stack, x)
    par = fusedpar.parallelize(stack, {"up": Column(sequence_parallel=True),
                                       "down": Row(sequence_parallel=True), "*": "fsdp"})
    specs = fusedpar.param_specs(par)
    assert (specs.up.weight, specs.up.bias) == (P(None, "tp", "fsdp"), P(None, "tp"))
    assert (specs.down.weight, specs.down.bias) == (P(None, "fsdp", "tp"), P())
    assert "weight P(None, 'tp', 'fsdp'), bias P(None, 'tp')" in fusedpar.describe(par)
    m = mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(m):
        sharded = fusedpar.shard(par, m)
        assert sharded.up.weight.sharding.spec == P(None, "tp", "fsdp")
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(sharded, x)
    flat = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_array))  # noqa: E731
    assert_close((value, flat(grads)), (want[0], flat(want[1])), jnp.float32, "stack")
    # A feature dimension that does not divide is named as the stack's dimension.
    odd = eqx.filter_vmap(lambda k: fusedpar.ColumnLinear(D, 30, key=k))(
        jax.random.split(jax.random.key(0), 4))
    with pytest.raises(ValueError, match=r"ColumnLinear.weight: parameter dim 1 has size "
                                         r"30, not divisible by 4"):
        fusedpar.shard(odd, mesh((4,), ("tp",)))


def test_a_parallel_model_is_re_planned():
    """`parallelize` on a model of fusedpar layers re-plans it: decoding a few tokens
    of one sequence needs neither the sequence parallelism nor the FSDP batch it trained
    with. The layers a pattern matches take its styles, the others keep their own; the
    values are the dense model's."""
    k = jax.random.split(jax.random.key(0), 3)
    dense = {"emb": eqx.nn.Embedding(32, 16, key=k[0]), "up": eqx.nn.Linear(16, 64, key=k[1]),
             "down": eqx.nn.Linear(64, 16, key=k[2])}
    train = fusedpar.parallelize(dense, {
        "emb": fusedpar.Row(), "up": fusedpar.Column(sequence_parallel=True),
        "down": fusedpar.Row(sequence_parallel=True), "*": "fsdp"})
    decode = fusedpar.parallelize(train, {"up": "column", "down": "row", "emb": "row"})
    assert decode["up"].rule.fsdp is None and not decode["down"].rule.sequence_parallel
    kept = fusedpar.parallelize(train, {"up": "column"})
    assert kept["down"] is train["down"] and kept["up"].rule.fsdp is None

    def run(m, ids):
        return m["down"](jax.nn.gelu(m["up"](m["emb"](ids))))

    ids = jnp.array([[3, 5, 7]])  # one sequence, 3 tokens: tp (4) divides neither
    want = jax.vmap(jax.vmap(lambda i: dense["down"](jax.nn.gelu(dense["up"](dense["emb"](
        i))))))(ids)
    m = mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(m):
        got = eqx.filter_jit(run)(fusedpar.shard(decode, m), ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
