"""Spec derivation: parameter specs of nested models, composition, validation, relaxed
mode, shard / init_sharded, shard_map specs, and every error message."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fusedpar
from fusedpar import FSDP, Column, Row
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(120)

K = jax.random.key(0)


class Block(eqx.Module):
    up: fusedpar.ColumnLinear
    down: fusedpar.RowLinear
    norm: jax.Array
    act: object  # a non-array leaf

    def __init__(self, d, key, **kw):
        k1, k2 = jax.random.split(key)
        self.up = fusedpar.ColumnLinear(d, 4 * d, key=k1, **kw)
        self.down = fusedpar.RowLinear(4 * d, d, use_bias=False, key=k2, **kw)
        self.norm = jnp.ones(d)
        self.act = jax.nn.relu


class Model(eqx.Module):
    blocks: list
    extra: dict

    def __init__(self, d=8, key=K, **kw):
        keys = jax.random.split(key, 4)
        self.blocks = [Block(d, keys[i], **kw) for i in range(2)]
        self.extra = {"head": eqx.nn.Linear(d, 3, key=keys[2]),
                      "fsdp": fusedpar.FSDPLinear(d, 16, key=keys[3])}


def test_param_specs_nested():
    specs = fusedpar.param_specs(Model())
    for b in specs.blocks:
        assert b.up.weight == P("tp", None) and b.up.bias == P("tp")
        assert b.down.weight == P(None, "tp") and b.down.bias is None
        assert b.norm == P() and b.act is None
    assert specs.extra["head"].weight == P() and specs.extra["head"].bias == P()
    assert specs.extra["fsdp"].weight == P("fsdp", None) and specs.extra["fsdp"].bias == P()
    # It matches the model's arrays, so it is a valid in_specs tree for them.
    params = eqx.filter(Model(), eqx.is_array)
    assert jax.tree.structure(params) == jax.tree.structure(
        specs, is_leaf=lambda x: isinstance(x, P))


def test_param_specs_fsdp_x_tp():
    specs = fusedpar.param_specs(Model(fsdp_axis="fsdp"))
    assert specs.blocks[0].up.weight == P("tp", "fsdp")
    assert specs.blocks[0].down.weight == P("fsdp", "tp")
    assert specs.blocks[0].up.bias == P("tp")  # the bias is not FSDP-sharded


def test_composition_order_independent():
    col, row = Column("tp", sequence_parallel=True), Row("tp")
    for tp, want in ((col, P("tp", "dp")), (row, P("dp", "tp"))):
        assert fusedpar.compose(tp, FSDP("dp")) == fusedpar.compose(FSDP("dp"), tp)
        assert fusedpar.compose(FSDP("dp"), tp).param_specs("l", True)["weight"] == want
    # Both on one dimension: a tuple, tensor-parallel (major) first, in either order.
    for styles in ((col, FSDP("dp", dim=0)), (FSDP("dp", dim=0), col)):
        r = fusedpar.compose(*styles)
        assert r.param_specs("l", True) == {"weight": P(("tp", "dp"), None), "bias": P("tp")}
    for styles in ((row, FSDP("dp", dim=1)), (FSDP("dp", dim=1), row)):
        assert fusedpar.compose(*styles).param_specs("l", False)["weight"] == P(None, ("tp", "dp"))
    # The same style twice is one style; a layer built either way has the same rule.
    assert fusedpar.compose(col, FSDP("dp"), col) == fusedpar.compose(FSDP("dp"), col)
    a = fusedpar.ColumnLinear(8, 16, key=K, sequence_parallel=True, fsdp_axis="dp")
    assert a.rule == fusedpar.compose(FSDP("dp"), col)


def test_error_axis_used_twice():
    with pytest.raises(ValueError, match=r"ColumnLinear\.weight: mesh axis 'x' is used twice "
                       r"\(dim 0 by tp, dim 1 by fsdp\)"):
        fusedpar.ColumnLinear(8, 16, key=K, axis="x", fsdp_axis="x")
    model = {"mlp": {"up": eqx.nn.Linear(8, 16, key=K)}}
    with pytest.raises(ValueError, match=r"mlp\.up\.weight: mesh axis 'tp' is used twice"):
        fusedpar.parallelize(model, {"*": ("column", FSDP("tp"))})


def test_error_two_tp_styles():
    with pytest.raises(ValueError, match=r"blk: two tensor-parallel styles, Column\(.*\) and "
                       r"Row\(.*\); a layer can be column- or row-parallel"):
        fusedpar.compose(Column(), Row(), where="blk")


def test_error_axis_not_in_mesh():
    m = mesh((2, 4), ("fsdp", "model"))
    with pytest.raises(ValueError, match=r"blocks\.0\.up: mesh axis 'tp' \(Column's axis=, "
                       r"default 'tp'\).*not in the mesh, whose axes are \('fsdp', 'model'\)"):
        fusedpar.validate(Model(), m)
    with pytest.raises(ValueError, match=r"ColumnLinear: mesh axis 'tp' \(Column's axis=, "
                       r"default 'tp'\) is not in the current mesh, whose axes are "
                       r"\('fsdp', 'model'\)"):
        with jax.set_mesh(m):
            fusedpar.ColumnLinear(8, 16, key=K)(jnp.ones(8))


def test_error_not_divisible():
    m = mesh((8,), ("tp",))
    model = {"proj": fusedpar.RowLinear(12, 16, key=K)}
    with pytest.raises(ValueError, match=r"proj\.weight: parameter dim 1 has size 12, not "
                       r"divisible by 8, the product of mesh axes \('tp',\) \(tp=8\)"):
        fusedpar.shard(model, m)
    m2 = mesh((2, 4), ("fsdp", "tp"))
    col = {"c": fusedpar.ColumnLinear(8, 12, key=K, fsdp_axis="fsdp", fsdp_dim=0)}
    with pytest.raises(ValueError, match=r"c\.weight: parameter dim 0 has size 12, not "
                       r"divisible by 8, the product of mesh axes \('tp', 'fsdp'\) "
                       r"\(tp=4, fsdp=2\)"):
        fusedpar.validate(col, m2)


def test_error_input_not_divisible():
    layer = fusedpar.ColumnLinear(8, 16, key=K, sequence_parallel=True)
    with jax.set_mesh(mesh((4,), ("tp",))):
        with pytest.raises(ValueError, match=r"ColumnLinear: x of shape \(6, 8\): input dim 0 "
                           r"has size 6, not divisible by 4, the product of mesh axes "
                           r"\('tp',\) \(tp=4\); a sequence that 'tp' does not divide"):
            layer(jnp.ones((6, 8)))
        with pytest.raises(ValueError, match=r"sequence_parallel=True needs an input "
                           r"\(\.\.\., seq, features\).*got x of shape \(8,\)"):
            layer(jnp.ones(8))


def test_error_bad_inputs():
    layer = fusedpar.ColumnLinear(8, 16, key=K)
    with pytest.raises(ValueError, match=r"ColumnLinear: x has shape \(3, 5\); its last "
                       "dimension must be in_features=8"):
        layer(jnp.ones((3, 5)))
    with pytest.raises(ValueError, match="unknown backend='nope'; valid backends are 'auto'"):
        fusedpar.RowLinear(8, 16, key=K, backend="nope")
    with pytest.raises(ValueError, match="FSDPLinear: in_features must be a positive int"):
        fusedpar.FSDPLinear(0, 16, key=K)
    with pytest.raises(ValueError, match="FSDP dim must be None, 0 or 1"):
        fusedpar.compose(FSDP("f", dim=2))


def test_error_local_context():
    m = mesh((4,), ("tp",))
    layer = fusedpar.ColumnLinear(8, 16, key=K, sequence_parallel=True)
    specs = fusedpar.param_specs(layer)
    # Closed over instead of passed in: the weight is global inside shard_map.
    f = jax.shard_map(lambda x: layer(x), mesh=m, in_specs=P("tp"), out_specs=P())
    with pytest.raises(ValueError, match=r"the local weight must have shape \(4, 8\) .* got "
                       r"\(16, 8\) — its global shape: pass the layer through shard_map"):
        f(jnp.ones((8, 8)))
    g = jax.shard_map(lambda l, x: l(x), mesh=m, in_specs=(specs, P()), out_specs=P("tp"))
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs an input \(\.\.\., "
                       r"seq, features\) whose dim -2 is the sequence, got x of shape \(8,\)"):
        g(layer, jnp.ones(8))
    two = mesh((2, 4), ("fsdp", "tp"))
    fl = fusedpar.ColumnLinear(8, 16, key=K, fsdp_axis="fsdp")
    h = jax.shard_map(lambda l, x: l(x), mesh=two, in_specs=(P(), P()), out_specs=P(),
                      axis_names={"tp"})
    with pytest.raises(ValueError, match=r"uses mesh axes \('tp', 'fsdp'\) but the enclosing "
                       r"shard_map binds only \('tp',\)"):
        with jax.set_mesh(two):
            jax.jit(h)(fl, jnp.ones(8))


def test_relaxed_mode():
    m = mesh((2, 4), ("fsdp", "tp"))
    model = {"a": fusedpar.ColumnLinear(6, 16, key=K, fsdp_axis="fsdp"),  # fsdp: 6 % 2 ok
             "b": fusedpar.RowLinear(16, 6, key=K, fsdp_axis="fsdp"),  # fsdp: 6 % 2 ok
             "c": fusedpar.ColumnLinear(6, 10, key=K, fsdp_axis="fsdp"),  # tp: 10 % 4 no
             "d": fusedpar.RowLinear(10, 5, key=K, fsdp_axis="fsdp")}  # both fail
    relaxed, dropped = fusedpar.validate(model, m, relaxed=True)
    assert [str(d) for d in dropped] == [
        "c.weight: dim 0 (size 10) no longer sharded over ('tp',)",
        "d.weight: dim 1 (size 10) no longer sharded over ('tp',)",
        "d.weight: dim 0 (size 5) no longer sharded over ('fsdp',)"]
    assert relaxed["a"] is model["a"] and relaxed["b"] is model["b"]
    assert isinstance(relaxed["c"], fusedpar.FSDPLinear)  # FSDP kept on in_features
    assert fusedpar.param_specs(relaxed["c"]).weight == P(None, "fsdp")
    # No style left: replicated, and called as the layer was (on (..., in_features)).
    assert type(relaxed["d"]) is fusedpar.Linear
    assert (relaxed["d"].weight == model["d"].weight).all()
    with pytest.warns(UserWarning, match=r"replicated what does not divide: c\.weight: dim 0"):
        sharded = fusedpar.shard(model, m, relaxed=True)
    assert sharded["c"].weight.sharding.spec == P(None, "fsdp")
    # The relaxed model computes what the dense one does.
    x = normal(0, (4, 6), jnp.float32)
    with jax.set_mesh(m):
        got = eqx.filter_jit(lambda s, x: s["d"](s["c"](x)))(sharded, x)
        vmapped = eqx.filter_jit(lambda s, x: jax.vmap(s["d"])(s["c"](x)))(sharded, x)
    want = jax.vmap(lambda r: model["d"](model["c"](r)))(x)  # no mesh: dense math
    assert_close(got, want, jnp.float32, "relaxed")
    assert_close(vmapped, want, jnp.float32, "relaxed, vmapped")


def test_shard_and_init_sharded():
    m = mesh((2, 4), ("fsdp", "tp"))

    def make(key):
        return Model(key=key, fsdp_axis="fsdp")

    ref = make(K)
    specs = fusedpar.param_specs(ref)
    for placed in (fusedpar.shard(ref, m), fusedpar.init_sharded(make, m, K)):
        arrays = jax.tree.leaves(eqx.filter(placed, eqx.is_array))
        for a, s, r in zip(arrays, jax.tree.leaves(specs), jax.tree.leaves(
                eqx.filter(ref, eqx.is_array))):
            assert a.sharding.is_equivalent_to(NamedSharding(m, s), a.ndim), (a.sharding, s)
            assert (a == r).all()
        assert placed.blocks[0].act is jax.nn.relu


def test_shard_warns_of_a_model_never_parallelized():
    """A dense model (a checkpoint restored and sharded before `parallelize`) would be
    replicated on every device with no word; a parallelized one, or a tree without
    linear layers (an optimizer's step count), is not warned about."""
    import warnings

    m = mesh((2, 4), ("fsdp", "tp"))
    dense = [eqx.nn.Linear(8, 16, key=K), eqx.nn.Linear(16, 8, key=K)]
    with pytest.warns(UserWarning, match=r"shard: the model has 2 eqx.nn.Linear or "
                      r"eqx.nn.Embedding layers and no fusedpar layer.*replicated on the "
                      r"mesh's 8 devices; parallelize\(model, plan\) first"):
        placed = fusedpar.shard(dense, m)
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(placed))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fusedpar.shard(fusedpar.parallelize(dense, {"*": "fsdp"}), m)
        fusedpar.shard({"count": jnp.zeros((), jnp.int32)}, m)
        fusedpar.shard(dense, mesh((1,), ("tp",)))


def test_shard_map_specs():
    """The specs come from a trace of the model: the layers its input goes into as it is,
    and the one that returns its output."""
    m = Model(fsdp_axis="fsdp", sequence_parallel=True)

    def call(m, x):
        for b in m.blocks:
            x = b.down(b.up(x))
        return m.extra["fsdp"](x)

    x = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)
    (pspecs, x_spec), y_spec = fusedpar.shard_map_specs(m, x, call=call)
    assert pspecs == fusedpar.param_specs(m)
    assert x_spec == P("fsdp", "tp", None)  # blocks[0].up takes x
    # extra["fsdp"] (an FSDPLinear) returns it, the sequence still sharded as the last
    # sequence-parallel RowLinear left it
    assert y_spec == P("fsdp", "tp", None)
    up = m.blocks[0].up
    assert up.rule.activation_specs(2) == (P("tp", None), P(None, "tp"))
    down = m.blocks[0].down.rule
    assert down.activation_specs(3, data=True) == (P("fsdp", None, "tp"), P("fsdp", "tp", None))
    # By default as the layer lays out x of that rank: its batch over FSDP where it has one.
    assert down.activation_specs(3) == down.activation_specs(3, data=True)
    assert down.activation_specs(2) == down.activation_specs(2, data=False)
    with pytest.raises(ValueError, match="data=True shards the batch over the FSDP axis"):
        fusedpar.compose(fusedpar.Column()).activation_specs(2, data=True)
    with pytest.raises(ValueError, match="shard_map_specs: the model has no fusedpar layers"):
        fusedpar.shard_map_specs(eqx.nn.Linear(2, 2, key=K), x)


class Tokens(eqx.Module):
    """Token ids -> embedding -> sequence-parallel block -> vocabulary-parallel head."""

    embed: fusedpar.Embedding
    up: fusedpar.ColumnLinear
    head: fusedpar.ColumnLinear

    def __init__(self, norm_first=False):
        k1, k2, k3 = jax.random.split(K, 3)
        self.embed = fusedpar.Embedding(16, 8, key=k1, sequence_parallel=True,
                                        fsdp_axis="fsdp")
        self.up = fusedpar.ColumnLinear(8, 8, key=k2, sequence_parallel=True,
                                        gather_output=True)
        self.head = fusedpar.ColumnLinear(8, 16, key=k3, fsdp_axis="fsdp")

    def __call__(self, tokens):  # one example: (seq,) -> (seq, vocab)
        # The sequence-parallel layers take the whole sequence (in a user's shard_map
        # they change its length, so they cannot run per token under vmap).
        return jax.vmap(self.head)(self.up(self.embed(tokens)))


def test_shard_map_specs_of_a_model_that_starts_with_an_embedding():
    """Token ids get the embedding's layout (batch over "fsdp", the sequence whole), not
    the sequence spec of the first linear layer; the logits get the head's."""
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    (_, x_spec), y_spec = fusedpar.shard_map_specs(Tokens(), tokens,
                                                   call=lambda m, t: jax.vmap(m)(t))
    assert x_spec == P("fsdp", None)
    assert y_spec == P("fsdp", None, "tp")
    # Labels straight into the loss get the leading dims of the logits' layout.
    (_, (t_spec, l_spec)), loss_spec = fusedpar.shard_map_specs(
        Tokens(), (tokens, tokens), call=lambda m, tl: fusedpar.cross_entropy(
            jax.vmap(m)(tl[0]), tl[1]))
    assert (t_spec, l_spec, loss_spec) == (P("fsdp", None), P("fsdp", None), P("fsdp", None))


def test_shard_map_specs_never_guesses():
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    model = Tokens()
    with pytest.raises(ValueError, match=r"the input x \(shape \(4, 8\)\) does not go into a "
                       r"fusedpar layer as it is \(none of the fusedpar calls, embed "
                       r"\(Embedding\), up \(ColumnLinear\), head \(ColumnLinear\), takes it "
                       r"unchanged\)"):
        fusedpar.shard_map_specs(model, tokens, call=lambda m, t: jax.vmap(m)(t % 16))
    with pytest.raises(ValueError, match=r"the output \(shape \(4, 8, 16\)\) is not what a "
                       r"fusedpar call returned \(the last fusedpar call is head"):
        fusedpar.shard_map_specs(model, tokens, call=lambda m, t: 2 * jax.vmap(m)(t))
    (_, x_spec), out_spec = fusedpar.shard_map_specs(
        model, tokens, call=lambda m, t: 2 * jax.vmap(m)(t), outputs=False)
    assert (x_spec, out_spec) == (P("fsdp", None), None)
    x = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"goes into fusedpar layers that want different "
                       r"layouts: up \(ColumnLinear\) wants P\(None, 'tp', None\); head "):
        fusedpar.shard_map_specs(model, x, call=lambda m, x: m.up(x) + m.head(x)[..., :8])
    with pytest.raises(TypeError, match=r"x must be the model's input .* got the int 3"):
        fusedpar.shard_map_specs(model, 3)


def test_arguments_equinox_and_numpy_users_pass():
    """Builders Equinox makes Modules (a bound method, an eqx.Partial holding an array),
    NumPy bools, a tuple of axes to local_size: taken as they were before the checks
    that refuse a model passed as `make`, a non-bool `relaxed`, a non-int count."""
    m = mesh((2, 4), ("fsdp", "tp"))

    class Builder(eqx.Module):
        scale: jax.Array

        def build(self, key):
            return fusedpar.ColumnLinear(8, 16, key=key)

    builder = Builder(jnp.ones(()))
    for make in (builder.build, eqx.Partial(lambda s, key: builder.build(key), jnp.ones(()))):
        made = fusedpar.init_sharded(make, m, jax.random.key(0))
        assert made.weight.sharding.spec == P("tp", None)
    placed = fusedpar.shard(fusedpar.ColumnLinear(8, 16, key=jax.random.key(0)), m,
                            relaxed=np.True_)
    assert placed.weight.sharding.spec == P("tp", None)
    sizes = jax.jit(jax.shard_map(
        lambda x: x * fusedpar.local_size(16, ("fsdp", "tp")), mesh=m, in_specs=P(),
        out_specs=P()))(jnp.ones(()))
    assert float(sizes) == 2.0  # 16 over 2 x 4 devices


def test_shard_map_specs_names_no_wrong_layer_for_a_second_input():
    """Two inputs, tokens into the embedding and positions through a plain table into
    the head: the positions' error lists the calls, it does not blame the embedding
    (as computed from them), which never sees them."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    model = fusedpar.parallelize({"embed": eqx.nn.Embedding(64, 16, key=k1),
                                  "pos": eqx.nn.Embedding(32, 16, key=k2),
                                  "head": eqx.nn.Linear(16, 64, key=k3)},
                                 {"embed": "row", "head": "column"})
    tokens = jnp.zeros((4, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), (4, 8))
    with pytest.raises(ValueError, match=r"the input x\[1\] \(shape \(4, 8\)\) does not go "
                       r"into a fusedpar layer as it is \(none of the fusedpar calls, embed "
                       r"\(Embedding\), head \(ColumnLinear\), takes it unchanged\)"):
        fusedpar.shard_map_specs(model, (tokens, positions), call=lambda m, a: m["head"](
            m["embed"](a[0]) + m["pos"].weight[a[1]]))
