"""Sequence parallelism in the user's own shard_map takes whole sequences: a model that
applies a sequence-parallel layer per token under jax.vmap is refused by shard_map_specs
(with the reason and the fix), and one that applies it to the (batch, seq) array runs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import fusedpar
from helpers import assert_close, mesh

pytestmark = pytest.mark.timeout(120)

K1, K2 = jax.random.split(jax.random.key(0))
TOKENS = jax.random.randint(jax.random.key(1), (4, 16), 0, 32)


def _model():
    return {"embed": fusedpar.Embedding(32, 16, key=K1, sequence_parallel=True),
            "head": fusedpar.ColumnLinear(16, 32, key=K2, sequence_parallel=True)}


def per_token(m, t):
    return jax.vmap(jax.vmap(lambda i: m["head"](m["embed"](i))))(t)


def per_example(m, t):  # vmapped over the batch only: the layers see the sequence
    return jax.vmap(lambda s: m["head"](m["embed"](s)))(t)


def test_per_token_sequence_parallel_code_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"embed \(Embedding\) is sequence parallel.*"
                                         r"vmap over the sequence.*jax.set_mesh"):
        fusedpar.shard_map_specs(_model(), TOKENS, call=per_token)


def test_per_token_code_runs_on_global_arrays():
    m = mesh((4,), ("tp",))
    model = _model()
    with jax.set_mesh(m):
        got = eqx.filter_jit(per_token)(fusedpar.shard(model, m), TOKENS)
    np.testing.assert_allclose(got, per_token(model, TOKENS), rtol=1e-5, atol=1e-5)


def test_per_example_code_runs_in_your_own_shard_map():
    m = mesh((4,), ("tp",))
    model = _model()
    (pspec, x_spec), out_spec = fusedpar.shard_map_specs(model, TOKENS, call=per_example)
    assert tuple(out_spec) == (None, None, "tp")
    local = jax.jit(jax.shard_map(per_example, mesh=m, in_specs=(pspec, x_spec),
                                  out_specs=out_spec))
    got = local(fusedpar.shard(eqx.filter(model, eqx.is_array), m), TOKENS)
    np.testing.assert_allclose(got, per_example(model, TOKENS), rtol=1e-5, atol=1e-5)


# --- the specs of every plan the docs show, used in a real shard_map -----------------

class Net(eqx.Module):
    """Token ids -> embedding -> MLP -> head, written on whole (batch, seq) arrays."""

    embed: eqx.Module
    up: eqx.Module
    down: eqx.Module
    head: eqx.Module

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(32, 16, key=k[0])
        self.up = eqx.nn.Linear(16, 32, key=k[1])
        self.down = eqx.nn.Linear(32, 16, key=k[2])
        self.head = eqx.nn.Linear(16, 32, key=k[3])

    def __call__(self, ids):
        return self.head(self.down(jax.nn.gelu(self.up(self.embed(ids)))))


C, R, F = fusedpar.Column, fusedpar.Row, fusedpar.FSDP
# README (and the FSDP head after a sequence-parallel RowLinear); docs/layers.md's
# vocabulary plan; examples/gpt.py's TP, TP+SP and FSDP x TP plans. (Its int8/fp8 plan
# has FSDP x TP's layouts: comm_dtype changes what is sent, never a layout.)
DOC_PLANS = {
    "readme": ({"up": C(sequence_parallel=True), "down": R(sequence_parallel=True),
                "*": "fsdp"}, "mlp"),
    "vocab": ({"embed": R(sequence_parallel=True), "head": C(sequence_parallel=True),
               "*": "fsdp"}, "net"),
    "tp": ({"embed": "row", "up": "column", "down": "row", "head": "column"}, "net"),
    "tp+sp": ({"embed": R(sequence_parallel=True), "up": C(sequence_parallel=True),
               "down": R(sequence_parallel=True), "head": C(sequence_parallel=True)}, "net"),
    "fsdp x tp": ({"embed": R(sequence_parallel=True), "up": C(sequence_parallel=True),
                   "down": R(sequence_parallel=True), "head": C(sequence_parallel=True),
                   "*": F()}, "net"),
}


def _mlp(m, x):  # the README's block without its residual, then a head
    return m.head(m.down(jax.nn.gelu(m.up(x))))


@pytest.mark.parametrize("name", DOC_PLANS)
def test_shard_map_specs_of_every_documented_plan_run_in_shard_map(name):
    """The derived specs pass JAX's replication check (check_vma=True) and give the dense
    values and gradients. The README plan's FSDP-only head keeps the sequence sharded
    as the RowLinear before it left it: its out_spec is P('fsdp', 'tp', None)."""
    plan, kind = DOC_PLANS[name]
    dense = Net(K1)
    if kind == "mlp":  # float activations straight into the MLP
        dense = eqx.tree_at(lambda n: n.embed, dense, eqx.nn.Identity())
        x, call = jax.random.normal(K2, (4, 8, 16)), _mlp
    else:
        x, call = TOKENS[:, :8], (lambda m, t: m(t))
    model = fusedpar.parallelize(dense, plan)
    (pspec, x_spec), out_spec = fusedpar.shard_map_specs(model, x, call=call)
    if name == "readme":
        assert tuple(out_spec) == ("fsdp", "tp", None)
    m = mesh((2, 4), ("fsdp", "tp"))
    local = jax.shard_map(call, mesh=m, in_specs=(pspec, x_spec), out_specs=out_spec,
                          check_vma=True)
    # The dense math: the eqx.nn layers applied to one token at a time.
    params, static = eqx.partition(model, eqx.is_array)
    dparams, dstatic = eqx.partition(dense, eqx.is_array)

    def want_fn(p):
        return jax.vmap(jax.vmap(lambda t: call(eqx.combine(p, dstatic), t)))(x)

    ct = jax.random.normal(jax.random.key(2), jax.eval_shape(want_fn, dparams).shape)
    got = jax.jit(jax.value_and_grad(
        lambda p: jnp.sum(local(eqx.combine(p, static), x) * ct)))(params)
    want = jax.value_and_grad(lambda p: jnp.sum(want_fn(p) * ct))(dparams)
    assert_close(jax.tree.leaves(got), jax.tree.leaves(want), jnp.float32, name)


def test_shard_map_specs_refuses_an_axis_it_cannot_place():
    """Between the RowLinear and the FSDP head an activation carries "tp" on a dimension
    no fusedpar call names: the spec is refused, never guessed; and a layer given a
    layout its own axes do not take is refused with both layers named."""
    model = fusedpar.parallelize(Net(K1), DOC_PLANS["readme"][0])
    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"varies over mesh axes \('fsdp', 'tp'\).*'tp' came "
                       r"through code between fusedpar layers \(first into head "
                       r"\(FSDPLinear\)"):
        fusedpar.shard_map_specs(model, x, call=lambda m, x: m.head(jax.nn.gelu(
            m.down(jax.nn.gelu(m.up(x))))))
    model = fusedpar.parallelize(Net(K1), {"up": C(sequence_parallel=True),
                                           "down": R(sequence_parallel=True), "head": "column"})
    with pytest.raises(ValueError, match=r"head \(ColumnLinear\) takes its input laid out as "
                       r"P\(None, None, None\), but it is the output of down \(RowLinear\), "
                       r"laid out as P\(None, 'tp', None\)"):
        fusedpar.shard_map_specs(model, x, call=lambda m, x: m.head(m.down(m.up(x))))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_shard_map_specs_under_a_mesh(kind):
    """Called under jax.set_mesh (a placed model, say) the specs are the same: the check
    traces inside a shard_map over the mesh that is set."""
    model = fusedpar.parallelize(Net(K1), DOC_PLANS["readme"][0])
    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    want = fusedpar.shard_map_specs(model, x, call=_mlp)
    m = mesh((2, 4), ("fsdp", "tp"), kind)
    with jax.set_mesh(m):
        assert fusedpar.shard_map_specs(fusedpar.shard(model, m), x, call=_mlp) == want


@pytest.mark.parametrize("backend", ["reference", "ring"])
def test_a_batch_an_explicit_axis_shards_inside_a_shard_map_over_tp_only(backend):
    """Explicit axes, a shard_map manual over "tp" alone, x's batch sharded over "data":
    each op runs per block of "data" (their 2-D form would merge a sharded batch into
    rows) and gives the lax expression's values (JAX 0.10 differentiates neither there);
    with check_vma=True (where JAX cannot nest that shard_map) an error says what to
    change."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    m = mesh((2, 4), ("data", "tp"), AxisType.Explicit)
    x = jax.random.normal(jax.random.key(2), (4, 8, 16))
    w = jax.random.normal(jax.random.key(3), (16, 32))

    def fused(x, w):  # every device gathers the same y: the reduce-scatter sums 4 copies
        y = fusedpar.all_gather_matmul(x, w, "tp", dim=1, backend=backend)
        return fusedpar.matmul_reduce_scatter(y, w.T, "tp", dim=1, backend=backend)

    def run(check_vma):
        return jax.jit(jax.shard_map(fused, in_specs=(P(None, "tp"), P()),
                                     out_specs=P(None, "tp"), axis_names={"tp"},
                                     check_vma=check_vma))

    with jax.set_mesh(m):
        xs = jax.device_put(x, NamedSharding(m, P("data")))
        assert_close(run(False)(xs, w), 4 * (x @ w) @ w.T, jnp.float32)
        with pytest.raises(ValueError, match="make the shard_map manual over"):
            run(True)(xs, w)
