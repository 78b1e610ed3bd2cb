"""fusedpar.QuantizedArray: quax rules against the dense dequantized math, transforms,
sharding, the layers sending stored quantized weights, and bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fusedpar
from fusedpar import QuantizedArray
from helpers import assert_close, equations, mesh, normal

DTYPES = [jnp.int8, jnp.float8_e4m3fn]


def _q(w, dtype=jnp.int8, **kw):
    # allow_materialise=False: any operation without a rule fails instead of quietly
    # forming the full-precision weight.
    return QuantizedArray.quantize(w, dtype, allow_materialise=False, **kw)


def _deq(w, dtype=jnp.int8, **kw):
    return QuantizedArray.quantize(w, dtype, **kw).dequantize()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [None, 8])
def test_quantize_error_and_layout(dtype, block_size):
    w = normal(0, (16, 32), jnp.float32)
    q = QuantizedArray.quantize(w, dtype, block_size=block_size)
    assert q.values.dtype == jnp.dtype(dtype) and q.scales.dtype == jnp.float32
    assert q.scales.shape == (16, 1 if block_size is None else 4)
    assert q.shape == w.shape and q.dtype == w.dtype
    # Symmetric rounding: int8 at most half a step of each row's scale; e4m3 keeps 3
    # mantissa bits, a relative error of at most 2^-4 (subnormals aside).
    rel = float(jnp.max(jnp.abs(q.dequantize() - w)) / jnp.max(jnp.abs(w)))
    assert rel <= (0.5 / 127 if dtype == jnp.int8 else 2.0 ** -4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_non_finite_value_dequantizes_to_nan_in_its_slice(dtype):
    # An int8 value cannot hold a NaN: the scale carries it, so a diverged weight or
    # activation stays visible (it once came back as 0 with scale 1). Other slices keep
    # their values; NumPy integers are taken for axis and block_size.
    w = normal(0, (4, 8), jnp.float32).at[1, 3].set(jnp.nan).at[2, 5].set(jnp.inf)
    q = QuantizedArray.quantize(w, dtype, axis=np.int64(1), block_size=np.int64(4))
    d = np.asarray(q.dequantize())
    assert np.isnan(d[1, :4]).all() and np.isnan(d[2, 4:]).all()
    ok = np.ones_like(d, bool)
    ok[1, :4] = ok[2, 4:] = False
    assert np.isfinite(d[ok]).all()
    top = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(w), w, 0))))
    step = 0.5 / 127 if dtype == jnp.int8 else 2.0 ** -4  # as test_quantize_error_and_layout
    np.testing.assert_allclose(d[ok], np.asarray(w)[ok], rtol=0, atol=step * top)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [None, 8])
def test_matmul_forms_match_dequantized(dtype, block_size):
    w = normal(0, (16, 32), jnp.float32)
    x = normal(1, (2, 5, 32), jnp.float32)
    q, d = _q(w, dtype, block_size=block_size), _deq(w, dtype, block_size=block_size)
    forms = {
        "x @ w.T": (lambda q, x: x @ q.T, x @ d.T),
        "w @ x": (lambda q, x: q @ x[0, 0], d @ x[0, 0]),
        "jnp.dot": (lambda q, x: jnp.dot(x, q.T), jnp.dot(x, d.T)),
        "jnp.matmul": (lambda q, x: jnp.matmul(q, x[0].T), jnp.matmul(d, x[0].T)),
        "lax.dot_general": (
            lambda q, x: lax.dot_general(x, q, (((2,), (1,)), ((), ()))), x @ d.T),
        "einsum": (lambda q, x: jnp.einsum("bsi,oi->bso", x, q), x @ d.T),
    }
    for name, (f, want) in forms.items():
        assert_close(quax.quaxify(f)(q, x), want, jnp.float32, name)


def test_matmul_keeps_values_narrow_in_the_program():
    """The dot reads the int8 values cast to the activation dtype; the scales multiply
    the product: no float32 (out, in) array, no multiply of that shape."""
    q = _q(normal(0, (16, 32), jnp.bfloat16))
    x = jnp.ones((4, 32), jnp.bfloat16)
    text = str(jax.make_jaxpr(quax.quaxify(lambda q, x: x @ q.T))(q, x))
    assert "i8[16,32]" in text
    assert not any(s in text for s in ("f32[16,32]", "f32[32,16]", "f32[32,1,16]",
                                       "f32[1,16,32]"))
    assert not [line for line in text.splitlines() if "mul" in line and "16,32]" in line]
    assert quax.quaxify(lambda q, x: x @ q.T)(q, x).dtype == jnp.bfloat16


def test_eqx_linear_and_transforms():
    """A quantized eqx.nn.Linear under jit, vmap (of the input and of stacked weights),
    scan and shard_map equals the dequantized one."""
    lin = eqx.nn.Linear(32, 16, key=jax.random.key(0))
    qlin = fusedpar.quantize(lin)
    dlin = eqx.tree_at(lambda l: l.weight, lin, qlin.weight.dequantize())
    qlin = eqx.tree_at(lambda l: l.weight, qlin, _q(lin.weight))
    x = normal(1, (6, 32), jnp.float32)
    want = jax.vmap(dlin)(x)
    call = quax.quaxify(lambda m, x: jax.vmap(m)(x))
    assert_close(jax.jit(call)(qlin, x), want, jnp.float32, "jit")
    assert_close(jax.vmap(quax.quaxify(lambda m, x: m(x)), in_axes=(None, 0))(qlin, x),
                 want, jnp.float32, "vmap outside")
    # Stacked layers: vmap over the weights, and a scan over them.
    ws = normal(2, (3, 32, 32), jnp.float32)
    qs = QuantizedArray.quantize(ws, jnp.int8, allow_materialise=False)
    ds = QuantizedArray.quantize(ws, jnp.int8).dequantize()
    got = jax.vmap(quax.quaxify(lambda w, x: x @ w.T), in_axes=(0, None))(qs, x)
    assert_close(got, jnp.einsum("ni,loi->lno", x, ds), jnp.float32, "vmap weights")

    def body(h, w):
        return jnp.tanh(h @ w.T), None

    got = quax.quaxify(lambda qs, x: lax.scan(body, x, qs)[0])(qs, x)
    assert_close(got, lax.scan(body, x, ds)[0], jnp.float32, "scan")
    m = mesh((4,), ("data",))
    f = jax.shard_map(quax.quaxify(lambda q, x: x @ q.T), mesh=m,
                      in_specs=(P(), P("data")), out_specs=P("data"))
    assert_close(jax.jit(f)(_q(lin.weight), x[:4]), x[:4] @ dlin.weight.T, jnp.float32,
                 "shard_map")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients(dtype):
    """x's gradient is that of the dequantized expression; a stored quantized weight gets
    none; with master=True the master gets the straight-through gradient, equal to the
    dequantized expression's gradient with respect to the weight."""
    w = normal(0, (16, 32), jnp.float32)
    x = normal(1, (4, 32), jnp.float32)
    d = _deq(w, dtype)

    def f(q, x):
        return jnp.sum(jnp.tanh(quax.quaxify(lambda q, x: (x @ q.T) @ q)(q, x)))

    def f_dense(w, x):
        return jnp.sum(jnp.tanh((x @ w.T) @ w))

    assert_close(jax.grad(f, 1)(_q(w, dtype), x), jax.grad(f_dense, 1)(d, x), jnp.float32)
    gq = jax.grad(f, allow_int=True)(_q(w, dtype), x)
    # A stored weight serves: no gradient (float8 values are differentiable to JAX).
    assert not np.any(np.asarray(gq.scales))
    if jnp.issubdtype(gq.values.dtype, jnp.floating):
        assert not np.any(np.asarray(gq.values, np.float32))

    def train(master, x):  # quantized inside the loss, straight through to the master
        return f(QuantizedArray.quantize(master, dtype, master=True, allow_materialise=False),
                 x)

    gm, gx = jax.grad(train, (0, 1))(w, x)
    want_m, want_x = jax.grad(f_dense, (0, 1))(d, x)
    assert_close(gm, want_m, jnp.float32, "master")
    assert_close(gx, want_x, jnp.float32, "x")
    model = eqx.nn.Linear(32, 16, key=jax.random.key(3))
    g = eqx.filter_grad(lambda m, x: jnp.sum(quax.quaxify(
        lambda m, x: jax.vmap(m)(x))(fusedpar.quantize(m, dtype=dtype, master=True), x)))(
        model, x)
    dmodel = eqx.tree_at(lambda l: l.weight, model, _deq(model.weight, dtype))
    want = eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x)))(dmodel, x)
    assert_close((g.weight, g.bias), (want.weight, want.bias), jnp.float32, "model")


def test_specs_and_shard():
    """values sharded like the weight, scales along the kept axis only (per channel) or
    along both (blocks), the master like the weight; shard places them so."""
    m = mesh((2, 4), ("fsdp", "tp"), AxisType.Explicit)
    layer = fusedpar.ColumnLinear(32, 16, key=jax.random.key(0), fsdp_axis="fsdp")
    per_row = fusedpar.quantize(layer)
    spec = fusedpar.param_specs(per_row).weight
    assert (spec.values, spec.scales, spec.master) == (P("tp", "fsdp"), P("tp", None), None)
    blocks = fusedpar.quantize(layer, block_size=8, master=True)
    spec = fusedpar.param_specs(blocks).weight
    assert (spec.values, spec.scales, spec.master) == (P("tp", "fsdp"),) * 3
    placed = fusedpar.shard(per_row, m)
    assert placed.weight.values.sharding.spec == P("tp", "fsdp")
    assert placed.weight.scales.sharding.spec == P("tp", None)
    plain = fusedpar.quantize(eqx.nn.Linear(3, 4, key=jax.random.key(1)))
    table = fusedpar.describe([per_row, plain])
    assert "weight int8 (one scale per row) P('tp', 'fsdp'), scales P('tp', None)" in table
    assert "weight int8 (one scale per row) P()" in table
    assert "all_gather_matmul W over fsdp in int8" in table


@pytest.mark.parametrize("kind,backend", [
    ("fsdp", "reference"), ("fsdp", "ring"), ("row+fsdp", "ring"), ("column+fsdp", "ring"),
    ("column_sp+fsdp", "ring")])
def test_layer_sends_the_stored_payload(kind, backend):
    """A fusedpar layer with a QuantizedArray weight equals the dequantized dense layer,
    values and x's gradient, on global arrays under a mesh and with no mesh; its FSDP
    ring moves int8 (the program has no float transfer of the weight)."""
    k = jax.random.key(0)
    x = normal(1, (4, 8, 32), jnp.float32)
    layer = {
        "fsdp": lambda: fusedpar.FSDPLinear(32, 16, key=k, backend=backend),
        "row+fsdp": lambda: fusedpar.RowLinear(32, 16, key=k, fsdp_axis="fsdp",
                                               backend=backend),
        "column+fsdp": lambda: fusedpar.ColumnLinear(32, 16, key=k, fsdp_axis="fsdp",
                                                     backend=backend),
        "column_sp+fsdp": lambda: fusedpar.ColumnLinear(
            32, 16, key=k, fsdp_axis="fsdp", sequence_parallel=True, backend=backend),
    }[kind]()
    q = fusedpar.quantize(layer)
    q = eqx.tree_at(lambda l: l.weight, q, QuantizedArray.quantize(
        layer.weight, jnp.int8, allow_materialise=kind == "column_sp+fsdp"))
    d = eqx.tree_at(lambda l: l.weight, layer, q.weight.dequantize())

    def loss(x, m):
        return jnp.sum(jnp.tanh(m(x)))

    want, want_dx = d(x), jax.grad(loss)(x, d)
    assert_close(q(x), want, jnp.float32, "no mesh")
    m = mesh((2, 4), ("fsdp", "tp"), AxisType.Explicit)
    x_spec = P("fsdp", "tp" if kind == "column_sp+fsdp" else None,
               "tp" if kind == "row+fsdp" else None)
    with jax.set_mesh(m):
        qs, xs = fusedpar.shard(q, m), jax.device_put(x, NamedSharding(m, x_spec))
        got = eqx.filter_jit(lambda m, x: m(x))(qs, xs)
        dx = eqx.filter_jit(jax.grad(loss))(xs, qs)
        text = jax.jit(lambda m, x: m(x)).lower(qs, xs).as_text()
    assert_close(got, want, jnp.float32, "sharded")
    assert_close(dx, want_dx, jnp.float32, "dx")
    # The sequence-parallel layer gathers its FSDP weight with lax.all_gather (its ring
    # moves x); the others' FSDP gather is the op's ring (or the reference's all_gather).
    ring = backend == "ring" and kind != "column_sp+fsdp"
    moved = "collective_permute" if ring else "all_gather"
    assert any(moved in line and "xi8>" in line for line in text.splitlines()), text[:2000]


@pytest.mark.parametrize("kind,master", [("fsdp", False), ("row+fsdp", False),
                                         ("column+fsdp", True)])
def test_block_quantized_weight_is_gathered_whole_over_fsdp(kind, master):
    """A weight quantized in blocks of its input features has a scale per block of a row,
    which no ring payload carries (the forward raised ValueError; with a master, the ring
    quantized the master again per channel): the FSDP gather beside the matmul gathers
    its int8 values and scales first and multiplies. Values and x's gradient equal the
    dequantized layer's, the master's gradient is the dequantized weight's (straight
    through); `describe` says so."""
    k = jax.random.key(0)
    layer = {"fsdp": lambda: fusedpar.FSDPLinear(32, 16, key=k, backend="ring"),
             "row+fsdp": lambda: fusedpar.RowLinear(32, 16, key=k, fsdp_axis="fsdp",
                                                    fsdp_gather="weights", backend="ring"),
             "column+fsdp": lambda: fusedpar.ColumnLinear(32, 16, key=k, fsdp_axis="fsdp",
                                                          backend="ring")}[kind]()
    q = fusedpar.quantize(layer, block_size=8, master=master)
    d = eqx.tree_at(lambda l: l.weight, layer, q.weight.dequantize())
    x = normal(1, (4, 8, 32), jnp.float32)

    def loss(x, m):
        return jnp.sum(jnp.tanh(m(x)))

    m = mesh((2, 4), ("fsdp", "tp"), AxisType.Explicit)
    x_spec = P("fsdp", None, "tp" if kind == "row+fsdp" else None)
    with jax.set_mesh(m):
        qs, xs = fusedpar.shard(q, m), jax.device_put(x, NamedSharding(m, x_spec))
        got = eqx.filter_jit(lambda m, x: m(x))(qs, xs)
        dx, dm = eqx.filter_jit(eqx.filter_grad(lambda xm: loss(*xm)))((xs, qs))
        text = jax.jit(lambda m, x: m(x)).lower(qs, xs).as_text()
    want_dx, want_dm = eqx.filter_grad(lambda xm: loss(*xm))((x, d))
    assert_close(got, d(x), jnp.float32, "sharded")
    assert_close(dx, want_dx, jnp.float32, "dx")
    if master:
        assert_close(dm.weight.master, want_dm.weight, jnp.float32, "the master's gradient")
    # int8 travels (over an FSDP axis of 2 XLA's gather may be one permute)
    assert any(("all_gather" in line or "collective_permute" in line) and "xi8>" in line
               for line in text.splitlines())
    table = fusedpar.describe(q)
    assert "all_gather W over fsdp in int8" in table
    assert ("reduce_scatter dW over fsdp" in table) == master


def test_bad_input():
    w = jnp.ones((6, 10))
    with pytest.raises(ValueError, match=r"dimension 1 of shape \(6, 10\) \(size 10\).*"
                                         r"block_size=4"):
        QuantizedArray.quantize(w, jnp.int8, block_size=4)
    with pytest.raises(ValueError, match="jnp.int8, jnp.float8_e4m3fn.*bfloat16"):
        QuantizedArray.quantize(w, jnp.bfloat16)
    with pytest.raises(ValueError, match="floating"):
        QuantizedArray.quantize(jnp.ones((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="scales of shape"):
        QuantizedArray(jnp.ones((6, 10), jnp.int8), jnp.ones((6, 3), jnp.float32))
    with pytest.raises(RuntimeError, match="allow_materialise=False"):
        quax.quaxify(lambda q: q + 1.0)(_q(w))
    lin = fusedpar.FSDPLinear(10, 6, key=jax.random.key(0))
    bad = eqx.tree_at(lambda l: l.weight, lin, QuantizedArray.quantize(w, axis=0))
    with pytest.raises(ValueError, match="along in_features"):
        bad(jnp.ones((2, 10)))
    with pytest.raises(ValueError, match="matched no linear layer"):
        fusedpar.quantize(lin, {"nope": "fsdp"})
    with pytest.raises(ValueError, match="already quantized"):
        fusedpar.quantize(fusedpar.quantize(lin))
    # A tree-wide astype casts the scales: refused, not computed in float32 with
    # bfloat16-rounded scales.
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
                        fusedpar.quantize(lin))
    with pytest.raises(ValueError, match="scales are bfloat16, not float32.*"
                                         "QuantizedArray.astype"):
        cast(jnp.ones((2, 10), jnp.bfloat16))
    with pytest.raises(TypeError, match="multiplied outside quax.quaxify"):
        fusedpar.quantize(eqx.nn.Linear(10, 6, key=jax.random.key(0)))(jnp.ones(10))
    with pytest.raises(TypeError, match="FSDPLinear: called inside quax.quaxify"):
        quax.quaxify(lambda l, x: l(x))(fusedpar.quantize(lin), jnp.ones((2, 10)))
    # An embedding's table is a plain array quax leaves alone, in a model whose head is
    # quantized: the trace says where it is (under a mesh its shard_map raised
    # AttributeError: '_QuaxTrace' object has no attribute 'process_shard_map'), under a
    # vmap inside quaxify too.
    emb = fusedpar.Embedding(6, 10, key=jax.random.key(0), axis="x")
    with jax.set_mesh(mesh((2,), ("x",))):
        for call in (lambda e, i: e(i), lambda e, i: jax.vmap(e)(i[None])[0]):
            with pytest.raises(TypeError, match="Embedding: called inside quax.quaxify"):
                quax.quaxify(lambda e, i, q: call(e, i) @ q.T)(emb, jnp.arange(4), _q(w))
    with pytest.raises(TypeError, match="Embedding: weight is a QuantizedArray.*dequantize"):
        emb = fusedpar.Embedding(6, 10, key=jax.random.key(0))
        eqx.tree_at(lambda e: e.weight, emb, QuantizedArray.quantize(emb.weight))(
            jnp.arange(3))


def test_describe_leaves_out_the_gradient_a_stored_weight_does_not_get():
    """A weight stored quantized (no master) gets no gradient: neither its FSDP
    reduce-scatter runs nor does `collectives()` (what `describe` prints) list it."""
    layer = fusedpar.quantize(fusedpar.ColumnLinear(8, 16, key=jax.random.key(0),
                                                    fsdp_axis="fsdp", backend="reference"))
    fwd, bwd = layer.collectives()
    assert bwd == ["psum dx over tp", "psum db over fsdp"], bwd  # the bias still trains
    with jax.set_mesh(mesh((2, 4), ("fsdp", "tp"))):
        jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jnp.sin(layer(x)))))(
            jnp.ones((4, 8, 8)))
    names = {e.primitive.name for e in equations(jaxpr)}
    assert "psum_invariant" in names and "reduce_scatter" not in names, names  # dx: psum


def test_quantize_takes_the_parallelizing_plan_and_refuses_a_tie():
    """The plan that parallelizes a model names its embeddings too: their tables stay
    as they are; a weight tied by eqx.nn.Shared is a placeholder, refused by its path."""
    k1, k2 = jax.random.split(jax.random.key(0))
    model = {"embed": eqx.nn.Embedding(64, 16, key=k1), "head": eqx.nn.Linear(16, 64, key=k2)}
    plan = {"embed": "row", "head": "column"}
    q = fusedpar.quantize(fusedpar.parallelize(model, plan), plan)
    assert isinstance(q["head"].weight, QuantizedArray)
    assert q["embed"].weight is model["embed"].weight
    tied = eqx.nn.Shared((model["embed"], model["head"]), lambda p: p[1].weight,
                         lambda p: p[0].weight)
    with pytest.raises(ValueError, match=r"pytree.1.weight is a SharedNode.*tied.*where="):
        fusedpar.quantize(tied)
    # A stored int8 weight travels as int8: an FSDP style asking for fp8 is refused.
    fsdp = fusedpar.parallelize({"l": eqx.nn.Linear(64, 32, key=k2)},
                                {"l": fusedpar.FSDP(comm_dtype=jnp.float8_e4m3fn)})
    with pytest.raises(ValueError, match="quantize: l: the weight is stored quantized as "
                                         "int8.*FSDP.comm_dtype=float8_e4m3fn"):
        fusedpar.quantize(fsdp)
    # Block scales that do not split over the ring say which block_size would.
    rows = fusedpar.parallelize(fusedpar.quantize({"l": eqx.nn.Linear(64, 32, key=k2)},
                                                  block_size=16), {"l": "row"})
    with pytest.raises(ValueError, match="block_size=16 makes 4 blocks of in_features=64"):
        fusedpar.shard(rows, mesh((8,), ("tp",)), relaxed=True)


@pytest.mark.parametrize("kind", ["fsdp", "column_sp+fsdp"])
def test_layer_trains_straight_through_to_the_master(kind):
    """A layer quantized with master=True inside the loss: FSDPLinear's op sends the
    master quantized to the values' dtype, the sequence-parallel layer gathers values
    and scales; the master's gradient is that of the dequantized layer (straight
    through)."""
    k = jax.random.key(0)
    layer = (fusedpar.FSDPLinear(32, 16, key=k, backend="ring") if kind == "fsdp" else
             fusedpar.ColumnLinear(32, 16, key=k, sequence_parallel=True, fsdp_axis="fsdp",
                                   gather_output=True, backend="ring"))
    x = normal(1, (4, 8, 32), jnp.float32)

    def loss(layer, x):
        return jnp.sum(jnp.tanh(fusedpar.quantize(layer, master=True)(x)))

    d = eqx.tree_at(lambda l: l.weight, layer, _deq(layer.weight))
    want = eqx.filter_grad(lambda l, x: jnp.sum(jnp.tanh(l(x))))(d, x)
    assert_close(eqx.filter_grad(loss)(layer, x).weight, want.weight, jnp.float32, "dense")
    m = mesh((2, 2), ("fsdp", "tp"), AxisType.Explicit)
    with jax.set_mesh(m):
        xs = jax.device_put(x, NamedSharding(m, P("fsdp", None if kind == "fsdp" else "tp")))
        got = eqx.filter_jit(eqx.filter_grad(loss))(fusedpar.shard(layer, m), xs)
    assert_close(got.weight, want.weight, jnp.float32, "sharded")
    assert_close(got.bias, want.bias, jnp.float32, "bias")


def test_quantized_inside_shard_map_keeps_each_shards_scales():
    """`fusedpar.quantize` inside the user's shard_map quantizes each FSDP shard of a row
    on its own (a sequence-parallel Column's FSDP splits the input features): the gather
    moves those scales with the values, with check_vma on or off. Before, each device
    dequantized the other shard with its own scale (the halves here differ 10x: 0.9 of
    the output wrong); now the output is the weight quantized per shard of a row."""
    layer = fusedpar.ColumnLinear(32, 64, key=jax.random.key(1), sequence_parallel=True,
                                  fsdp_axis="fsdp", backend="ring", use_bias=False)
    layer = eqx.tree_at(lambda l: l.weight, layer, layer.weight.at[:, 16:].multiply(10.0))
    x = normal(2, (4, 16, 32), jnp.float32)
    per_shard = fusedpar.quantize(layer, dtype=jnp.int8, block_size=16).weight.dequantize()
    want = jnp.einsum("bsi,oi->bso", x, per_shard)

    def call(m, x):
        return fusedpar.quantize(m, dtype=jnp.int8)(x)  # on this device's shards

    (pspecs, xspec), ospec = fusedpar.shard_map_specs(layer, x, call=call)
    params, static = eqx.partition(layer, eqx.is_array)
    for check_vma in (True, False):
        f = jax.jit(jax.shard_map(lambda p, x: call(eqx.combine(p, static), x),
                                  mesh=mesh((2, 4), ("fsdp", "tp")), in_specs=(pspecs, xspec),
                                  out_specs=ospec, check_vma=check_vma))
        assert_close(f(params, x), want, jnp.float32, f"check_vma={check_vma}")
