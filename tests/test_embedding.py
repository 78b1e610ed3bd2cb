"""fusedpar.Embedding against eqx.nn.Embedding with the same table: values and gradients,
vocabulary-parallel with and without sequence parallelism and FSDP, in the three calling
contexts and under vmap; bad ids, plans and layouts."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import fusedpar
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(300)

F32 = jnp.float32
VOCAB, DIM = 16, 8
KEY = jax.random.key(0)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 8)), jnp.int32)  # (b, s)


def dense_grads(table, ids, probe):
    """Loss and table gradient of eqx.nn.Embedding applied per id (as Equinox users do)."""
    return jax.value_and_grad(
        lambda t: jnp.sum(jax.vmap(jax.vmap(eqx.nn.Embedding(weight=t)))(ids) * probe))(table)


def test_drop_in_for_eqx_embedding():
    emb = fusedpar.Embedding(VOCAB, DIM, key=KEY)
    ref = eqx.nn.Embedding(VOCAB, DIM, key=KEY)
    assert (emb.weight == ref.weight).all()  # one key, one table
    assert emb(jnp.int32(3)).shape == (DIM,)
    sp = fusedpar.Embedding(VOCAB, DIM, key=KEY, sequence_parallel=True)
    assert (sp(jnp.int32(3)) == ref(jnp.int32(3))).all()  # no mesh: one id is fine
    assert_close(jax.vmap(emb)(IDS[0]), jax.vmap(ref)(IDS[0]), F32, "per id")
    assert_close(emb(IDS), jax.vmap(jax.vmap(ref))(IDS), F32, "batched ids")
    bf16 = fusedpar.Embedding(weight=ref.weight.astype(jnp.bfloat16))
    assert bf16(IDS).dtype == jnp.bfloat16
    assert fusedpar.param_specs(emb).weight == P("tp", None)
    assert fusedpar.param_specs(fusedpar.Embedding(VOCAB, DIM, key=KEY, fsdp_axis="fsdp")
                                ).weight == P("tp", "fsdp")
    assert fusedpar.param_specs(fusedpar.Embedding(
        VOCAB, DIM, key=KEY, fsdp_axis="fsdp", fsdp_dim=0)).weight == P(("tp", "fsdp"), None)


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sp"])
def test_matches_dense_in_every_context(sp):
    """vmap(vmap(embedding)) over (batch, seq) ids, FSDP x vocabulary-parallel on a 2 x 4
    mesh: global arrays (Auto and Explicit axes) and inside shard_map, values and
    gradients equal eqx.nn.Embedding's."""
    emb = fusedpar.Embedding(VOCAB, DIM, key=KEY, sequence_parallel=sp, fsdp_axis="fsdp")
    probe = normal(1, (4, 8, DIM), F32)
    want = dense_grads(emb.weight, IDS, probe)

    def loss(e, ids):
        return jnp.sum(jax.vmap(jax.vmap(e))(ids) * probe)

    assert_close(jax.value_and_grad(loss)(emb, IDS)[1].weight, want[1], F32, "no mesh")
    for kind in (AxisType.Auto, AxisType.Explicit):
        m = mesh((2, 4), ("fsdp", "tp"), kind)
        with jax.set_mesh(m):
            value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(
                fusedpar.shard(emb, m), IDS)
        assert_close((value, grads.weight), want, F32, str(kind))
    (pspecs, ids_spec), out_spec = fusedpar.shard_map_specs(emb, IDS)
    assert ids_spec == P("fsdp", None)
    assert out_spec == P("fsdp", "tp" if sp else None, None)
    local = jax.shard_map(lambda e, i, p: jax.vmap(e)(i) * p, mesh=mesh((2, 4), ("fsdp", "tp")),
                          in_specs=(pspecs, ids_spec, out_spec), out_specs=out_spec)
    value, grads = jax.jit(jax.value_and_grad(
        lambda e: jnp.sum(local(e, IDS, probe))))(emb)
    assert_close((value, grads.weight), want, F32, "shard_map")


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sp"])
def test_out_of_range_ids_as_eqx_embedding_in_every_context(sp):
    """Negative ids count from the end and ids still out of range are clamped, as
    `eqx.nn.Embedding` (`table[id]`) does, in every context, on any device's shard."""
    emb = fusedpar.Embedding(VOCAB, DIM, key=KEY, sequence_parallel=sp)
    ids = (IDS.at[0, 0].set(-1).at[0, 1].set(-VOCAB).at[1, 3].set(VOCAB)
           .at[1, 2].set(-VOCAB - 5).at[1, 0].set(10 * VOCAB))
    want = jax.vmap(jax.vmap(eqx.nn.Embedding(weight=emb.weight)))(ids)
    np.testing.assert_array_equal(want[0, 0], emb.weight[-1])  # what eqx.nn.Embedding does
    m = mesh((4,), ("tp",))
    with jax.set_mesh(m):
        global_out = eqx.filter_jit(lambda e, i: e(i))(fusedpar.shard(emb, m), ids)
    for what, out in (("no mesh", emb(ids)), ("vmap", jax.vmap(jax.vmap(emb))(ids)),
                      ("global", global_out)):
        assert_close(out, want, F32, what)


def test_parallelize_and_relaxed():
    """A plan's Row shards an eqx.nn.Embedding's vocabulary, FSDP its embedding dim;
    Column is rejected; relaxed validation replicates a vocabulary that does not divide."""
    model = {"embed": eqx.nn.Embedding(VOCAB, DIM, key=KEY),
             "head": eqx.nn.Linear(DIM, VOCAB, key=KEY)}
    par = fusedpar.parallelize(model, {"embed": fusedpar.Row(sequence_parallel=True),
                                       "head": "column", "*": "fsdp"})
    assert isinstance(par["embed"], fusedpar.Embedding)
    assert par["embed"].weight is model["embed"].weight
    assert par["embed"].rule.sequence_parallel
    assert fusedpar.param_specs(par)["embed"].weight == P("tp", "fsdp")
    with pytest.raises(ValueError, match=r"embed: an embedding takes Row .* not Column"):
        fusedpar.parallelize(model, {"*": "column"})
    odd = {"embed": fusedpar.Embedding(10, DIM, key=KEY)}
    relaxed, dropped = fusedpar.validate(odd, mesh((4,), ("tp",)), relaxed=True)
    assert [str(d) for d in dropped] == [
        "embed.weight: dim 0 (size 10) no longer sharded over ('tp',)"]
    # No style left: replicated, and still called on ids of any shape.
    assert type(relaxed["embed"]) is fusedpar.Embedding and relaxed["embed"].rule.axes == ()
    ids = jnp.array([[1, 9], [3, 4]])
    assert (relaxed["embed"](ids) == odd["embed"].weight[ids]).all()


class TiedLM(eqx.Module):
    """Embedding table tied to the LM head with `eqx.nn.Shared`, as Equinox documents it:
    ids (seq,) -> logits (seq, vocab)."""

    shared: eqx.nn.Shared

    def __init__(self, embed, head):
        self.shared = eqx.nn.Shared((embed, head), lambda p: p[1].weight,
                                    lambda p: p[0].weight)

    def __call__(self, ids):
        embed, head = self.shared()
        return jax.vmap(head)(jnp.tanh(jax.vmap(embed)(ids)))


def _tied_model():
    k1, k2 = jax.random.split(KEY)
    return TiedLM(eqx.nn.Embedding(VOCAB, DIM, key=k1),
                  eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k2))


def _tied_loss(axis):
    def loss(model, ids, labels):
        logits = jax.vmap(model)(ids)
        return fusedpar.cross_entropy(logits, labels, axis=axis).mean()
    return loss


@pytest.mark.parametrize("plan", ["tp", "sp+fsdp"])
def test_tied_embedding_and_lm_head(plan):
    """One table, used by the embedding and the LM head, sharded on the vocabulary:
    loss and its gradient (both uses summed into the one table) equal the dense tied
    model's, on global arrays and inside shard_map."""
    model = _tied_model()
    labels = jnp.roll(IDS, -1, axis=1)
    want = eqx.filter_value_and_grad(_tied_loss(None))(model, IDS, labels)
    want = (want[0], want[1].shared.pytree[0].weight)
    styles = ({"shared.pytree.0": "row", "shared.pytree.1": "column"} if plan == "tp" else
              {"shared.pytree.0": fusedpar.Row(sequence_parallel=True),
               "shared.pytree.1": fusedpar.Column(sequence_parallel=True), "*": "fsdp"})
    par = fusedpar.parallelize(model, styles)
    assert isinstance(par.shared.pytree[1], fusedpar.ColumnLinear)
    table_spec = P("tp", None if plan == "tp" else "fsdp")
    assert fusedpar.param_specs(par).shared.pytree[0].weight == table_spec
    assert fusedpar.param_specs(par).shared.pytree[1].weight is None  # stored once
    head_row = next(r for r in fusedpar.describe(par).splitlines() if "shared.pytree.1" in r)
    assert f"weight tied (eqx.nn.Shared) {table_spec}" in head_row, head_row

    m = mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(m):
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(_tied_loss("tp")))(
            fusedpar.shard(par, m), IDS, labels)
    assert_close((value, grads.shared.pytree[0].weight), want, F32, "global arrays")
    made = fusedpar.init_sharded(lambda: fusedpar.parallelize(_tied_model(), styles), m)
    assert made.shared.pytree[0].weight.sharding.spec == table_spec
    assert_close(made.shared.pytree[0].weight, par.shared.pytree[0].weight, F32, "init")

    if plan != "tp":  # sequence parallel inside shard_map needs whole sequences per call,
        return        # not the one id per call this model makes (docs/layers.md, vmap)
    # Inside shard_map: the arrays go in (the tie's placeholder is not one).
    params, static = eqx.partition(par, eqx.is_array)
    (pspecs, ids_spec), _ = fusedpar.shard_map_specs(
        par, IDS, call=lambda mdl, i: jax.vmap(mdl)(i), outputs=False)

    def local(params, ids, labels):
        return _tied_loss("tp")(eqx.combine(params, static), ids, labels)

    run = jax.shard_map(local, mesh=m, in_specs=(pspecs, ids_spec, ids_spec), out_specs=P())
    value, grads = jax.jit(jax.value_and_grad(run))(params, IDS, labels)
    assert_close((value, grads.shared.pytree[0].weight), want, F32, "shard_map")


def test_tied_weights_need_one_layout():
    """A head whose style shards the tied table another way is an error up front, not a
    reshard at every call (or a wrong local shape inside shard_map)."""
    par = fusedpar.parallelize(_tied_model(), {"shared.pytree.0": "row",
                                               "shared.pytree.1": "row"})
    match = (r"shared: eqx.nn.Shared ties a weight its layer shards P\(None, 'tp'\) to an "
             r"array sharded P\('tp', None\); tied weights need one layout")
    with pytest.raises(ValueError, match=match):
        fusedpar.param_specs(par)
    with pytest.raises(ValueError, match=match):
        fusedpar.shard(par, mesh((4,), ("tp",)))


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sp"])
def test_bfloat16_on_a_data_x_tp_mesh(sp):
    """A bfloat16 table on a 2 x 4 data x tp mesh (the data axis left to XLA): on CPU XLA
    aborted the process on the bfloat16 sum of the rows; the rows, each nonzero on one
    device, are the table's bit for bit, and so is the gradient."""
    m = mesh((2, 4), ("data", "tp"))
    table = normal(3, (VOCAB, DIM), jnp.bfloat16)
    emb = fusedpar.Embedding(weight=table, sequence_parallel=sp)
    probe = normal(1, (4, 8, DIM), F32)

    def loss(e, ids):
        return jnp.sum(e(ids).astype(F32) * probe)

    with jax.set_mesh(m):
        out, grad = eqx.filter_jit(lambda e, ids: (e(ids), eqx.filter_grad(loss)(e, ids)))(
            emb, IDS)
    np.testing.assert_array_equal(np.asarray(out, F32), np.asarray(table[IDS], F32))
    want = jnp.zeros((VOCAB, DIM), F32).at[IDS].add(probe)
    assert_close(grad.weight, want.astype(jnp.bfloat16), jnp.bfloat16, "table gradient")


def test_a_vocabulary_axis_of_size_one():
    """On an (8, 1) data x tp mesh of Auto axes, ids batched over "data": XLA's
    partitioner refused the sum over the size-1 "tp" beside the automatic "data"."""
    m = mesh((8, 1), ("data", "tp"))
    emb = fusedpar.Embedding(VOCAB, DIM, key=KEY)
    ids = jnp.concatenate([IDS, IDS])
    probe = normal(1, (8, 8, DIM), F32)
    want = dense_grads(emb.weight, ids, probe)
    with jax.set_mesh(m):
        placed = jax.device_put(ids, jax.sharding.NamedSharding(m, P("data")))
        got = eqx.filter_jit(eqx.filter_value_and_grad(
            lambda e, i: jnp.sum(e(i) * probe)))(emb, placed)
    assert_close(got[0], want[0], F32, "value")
    assert_close(got[1].weight, want[1], F32, "table gradient")
