"""The layers against eqx.nn.Linear with the same weights: values and gradients, on meshes
8, 2x4 and 4x2, in the three calling contexts, under vmap, for every available backend."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import fusedpar
from helpers import assert_close, mesh, needs_aot, normal

pytestmark = pytest.mark.timeout(300)

F32 = jnp.float32
IN, HID = 16, 32  # features: divisible by every mesh axis used (8, 4, 2)


def _pallas_unavailable():
    try:
        x, w = jax.ShapeDtypeStruct((8, 16), F32), jax.ShapeDtypeStruct((16, 8), F32)
        fusedpar.explain("all_gather_matmul", x, w, 4, backend="pallas_tpu")
    except Exception as e:  # noqa: BLE001 - any reason it cannot run is a skip reason
        return f"pallas_tpu unavailable: {type(e).__name__}: {e}"[:300]
    return None


# The TPU kernels run in interpret mode here (seconds per call), on a TP-only mesh: beside
# an FSDP axis the layers refuse the interpreter (it can deadlock with XLA's collectives
# on CPU). Their FSDP composition (gather="rhs") is compiled for TPU in test_aot.py.
_WHY = _pallas_unavailable()
PALLAS = pytest.param("pallas_tpu", marks=[pytest.mark.slow] + (
    [pytest.mark.skip(reason=_WHY)] if _WHY else []))
BACKENDS = ["reference", "ring"]


def dense_apply(lin, x):
    """eqx.nn.Linear applied over every leading dimension of x."""
    f = lin
    for _ in range(x.ndim - 1):
        f = jax.vmap(f)
    return f(x)


def mlp(up, down, x):
    return down(jnp.tanh(up(x)))


def loss(model, x):
    return jnp.sum(jnp.sin(mlp(*model, x)))


def dense_loss(model, x):
    up, down = model
    return jnp.sum(jnp.sin(dense_apply(down, jnp.tanh(dense_apply(up, x)))))


def make(kind, backend, sp=False, fsdp=None, tp="tp", bias=True):
    k1, k2 = jax.random.split(jax.random.key(0))
    if kind == "fsdp":
        layers = (fusedpar.FSDPLinear(IN, HID, bias, key=k1, axis=fsdp, backend=backend),
                  fusedpar.FSDPLinear(HID, IN, bias, key=k2, axis=fsdp, backend=backend))
    else:
        layers = (fusedpar.ColumnLinear(IN, HID, bias, key=k1, axis=tp, sequence_parallel=sp,
                                        fsdp_axis=fsdp, backend=backend),
                  fusedpar.RowLinear(HID, IN, bias, key=k2, axis=tp, sequence_parallel=sp,
                                     fsdp_axis=fsdp, backend=backend))
    dense = (eqx.nn.Linear(IN, HID, bias, key=k1), eqx.nn.Linear(HID, IN, bias, key=k2))
    return layers, dense


def check_grads(got, want, what):
    (gv, gg), (wv, wg) = got, want
    assert_close(gv, wv, F32, f"{what} loss")
    for name, a, b in (("up", gg[0][0], wg[0][0]), ("down", gg[0][1], wg[0][1])):
        assert_close(a.weight, b.weight, F32, f"{what} d{name}.weight")
        if b.bias is not None:
            assert_close(a.bias, b.bias, F32, f"{what} d{name}.bias")
    assert_close(gg[1], wg[1], F32, f"{what} dx")


def run_global(m, layers, x):
    with jax.set_mesh(m):
        model = fusedpar.shard(layers, m)
        return eqx.filter_jit(eqx.filter_value_and_grad(
            lambda mx: loss(*mx)))((model, x))


def dense_grads(dense, x):
    return eqx.filter_value_and_grad(lambda mx: dense_loss(*mx))((dense, x))


CASES = [  # (mesh shape, axis names, layer kind, fsdp axis)
    ((8,), ("tp",), "tp", None),
    ((2, 4), ("fsdp", "tp"), "tp", "fsdp"),
    ((4, 2), ("fsdp", "tp"), "tp", "fsdp"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("shape,names,kind,fsdp", CASES, ids=["tp8", "fsdp2xtp4", "fsdp4xtp2"])
def test_mlp_matches_dense(shape, names, kind, fsdp, sp, backend):
    """Column -> Row (with FSDP on the 2-D meshes): loss and every gradient."""
    _mlp_matches_dense(shape, names, kind, fsdp, sp, backend)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("backend", [PALLAS])
def test_mlp_matches_dense_pallas(sp, backend):
    """The TPU kernels on a TP-only mesh, and composed with FSDP on (2, 4) where they
    are compiled (a TPU host). Interpreted, on CPU, the layers refuse them beside an
    FSDP style before tracing: the interpreter can deadlock with the FSDP collectives
    there (a user's 8-step training run aborted 2 times in 10)."""
    from fusedpar._core import _backends
    from fusedpar._hw import _target

    _mlp_matches_dense((4,), ("tp",), "tp", None, sp, backend)
    if not _backends.get(backend).interprets(_target.current(), {}):  # a TPU host
        _mlp_matches_dense((2, 4), ("fsdp", "tp"), "tp", "fsdp", sp, backend)
        return
    layers, _ = make("tp", backend, sp=sp, fsdp="fsdp")
    with pytest.raises(RuntimeError, match="runs the TPU kernels in interpret mode here"):
        run_global(mesh((2, 4), ("fsdp", "tp")), layers, normal(1, (4, 8, IN), F32))


def _mlp_matches_dense(shape, names, kind, fsdp, sp, backend):
    layers, dense = make(kind, backend, sp=sp, fsdp=fsdp)
    x = normal(1, (4, 8, IN), F32)  # (batch, seq, features)
    want = dense_grads(dense, x)
    check_grads(run_global(mesh(shape, names), layers, x), want, f"{shape} sp={sp}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_gradient_is_summed_on_the_bias(backend):
    """A bias added to an output sharded along the batch (FSDP) or the sequence (a
    sequence-parallel RowLinear) has its gradient summed over those axes on its own
    (out,) values, not on the broadcast (batch, seq, out) cotangent: in an FSDP x TP
    block the latter was a 32 MB and an 8 MB all-reduce per training step."""
    from fusedpar._compile import _hlo

    layers, _ = make("tp", backend, sp=True, fsdp="fsdp")
    m = mesh((2, 4), ("fsdp", "tp"))
    x = normal(1, (4, 8, IN), F32)
    with jax.set_mesh(m):
        params, static = eqx.partition((fusedpar.shard(layers, m), x), eqx.is_array)
        grad = jax.jit(lambda p: eqx.filter_grad(lambda mx: loss(*mx))(eqx.combine(p, static)))
        text = grad.lower(params).compile().as_text()
    module = _hlo.parse(text)
    reduced = [_hlo.array_shapes(i.shape) for c in module.computations.values()
               for i in c if i.opcode in ("all-reduce", "all-reduce-start")]
    dims = sorted(tuple(d) for shapes in reduced for _, d in shapes)
    # The two biases' gradients, (HID / 4,) and (IN,) (a scalar loss may add a ()).
    assert dims and all(len(d) <= 1 for d in dims), dims
    assert {(HID // 4,), (IN,)} <= set(dims), dims


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp_mlp_matches_dense(backend):
    layers, dense = make("fsdp", backend, fsdp="fsdp")
    x = normal(2, (16, IN), F32)
    check_grads(run_global(mesh((8,), ("fsdp",)), layers, x), dense_grads(dense, x), "fsdp8")


def test_fsdp_on_the_tp_dimension():
    """FSDP sharing the tensor-parallel dimension: weight specs (tp, fsdp) tuples."""
    k1, k2 = jax.random.split(jax.random.key(0))
    layers = (fusedpar.ColumnLinear(IN, HID, key=k1, fsdp_axis="fsdp", fsdp_dim=0,
                                    backend="ring"),
              fusedpar.RowLinear(HID, IN, key=k2, fsdp_axis="fsdp", fsdp_dim=1, backend="ring"))
    specs = fusedpar.param_specs(layers)
    assert specs[0].weight == P(("tp", "fsdp"), None)
    assert specs[1].weight == P(None, ("tp", "fsdp"))
    dense = (eqx.nn.Linear(IN, HID, key=k1), eqx.nn.Linear(HID, IN, key=k2))
    x = normal(3, (4, 8, IN), F32)
    check_grads(run_global(mesh((2, 4), ("fsdp", "tp")), layers, x), dense_grads(dense, x),
                "fsdp on tp dim")


def test_three_contexts_agree():
    """shard_map (local shards), global arrays (Auto and Explicit axes), no mesh."""
    m = mesh((2, 4), ("fsdp", "tp"))
    layers, dense = make("tp", "ring", sp=True, fsdp="fsdp")
    x = normal(4, (4, 8, IN), F32)
    want = mlp(*(jax.vmap(jax.vmap(d)) for d in dense), x)

    assert_close(mlp(*layers, x), want, F32, "no mesh")
    (pspecs, x_spec), y_spec = fusedpar.shard_map_specs(layers, x, call=lambda ls, x: mlp(*ls, x))
    assert x_spec == P("fsdp", "tp", None) and y_spec == P("fsdp", "tp", None)
    local = jax.jit(jax.shard_map(lambda ls, x: mlp(*ls, x), mesh=m,
                                  in_specs=(pspecs, x_spec), out_specs=y_spec))
    assert_close(local(layers, x), want, F32, "shard_map")
    with jax.set_mesh(m):
        assert_close(eqx.filter_jit(mlp)(*layers, x), want, F32, "global, Auto axes")
    em = mesh((2, 4), ("fsdp", "tp"), AxisType.Explicit)
    with jax.set_mesh(em):
        ls = fusedpar.shard(layers, em)
        y = eqx.filter_jit(mlp)(*ls, x)
        assert y.sharding.spec == P("fsdp", "tp", None)
    assert_close(y, want, F32, "global, Explicit axes")


def test_a_sequence_parallel_column_runs_op_by_op():
    """Outside `jit` (on global arrays, and in an eager `shard_map`), as under it: the
    op that keeps its gathered input for sibling layers has a gradient with symbolic
    zeros, which JAX cannot run op by op in a `shard_map` (it raised NotImplementedError)."""
    m = mesh((4,), ("tp",))
    k = jax.random.key(7)
    layer = fusedpar.ColumnLinear(IN, HID, key=k, sequence_parallel=True, backend="reference")
    x = normal(8, (8, IN), F32)
    want = dense_apply(eqx.nn.Linear(IN, HID, key=k), x)
    with jax.set_mesh(m):
        assert_close(layer(x), want, F32, "global, eager")
    local = jax.shard_map(lambda l, x: l(x), mesh=m, in_specs=(fusedpar.param_specs(layer),
                                                               P("tp")),
                          out_specs=P(None, "tp"))
    assert_close(local(layer, x), want, F32, "shard_map, eager")


def test_explicit_mesh_keeps_other_axes():
    """Tensor-parallel layers on an Explicit (data, tp) mesh keep "data" on the batch."""
    m = mesh((2, 4), ("data", "tp"), AxisType.Explicit)
    layers, dense = make("tp", "ring", sp=True)
    x = normal(11, (4, 8, IN), F32)
    with jax.set_mesh(m):
        ls = fusedpar.shard(layers, m)
        xs = jax.sharding.reshard(x, P("data", None, None))
        assert eqx.filter_jit(mlp)(*ls, xs).sharding.spec == P("data", "tp", None)
        got = eqx.filter_jit(eqx.filter_value_and_grad(lambda mx: loss(*mx)))((ls, xs))
    check_grads(got, dense_grads(dense, x), "explicit data x tp")


def test_gather_output():
    """Values and gradients, global and in a shard_map with and without check_vma (the
    replicated output's cotangent arrives whole, or divided by the axis size)."""
    m = mesh((4,), ("tp",))
    k = jax.random.key(5)
    layer = fusedpar.ColumnLinear(IN, HID, key=k, gather_output=True, backend="ring")
    x = normal(6, (3, IN), F32)
    dense = eqx.nn.Linear(IN, HID, key=k)
    want = dense_apply(dense, x)

    def grads(f, model):
        return eqx.filter_jit(eqx.filter_grad(lambda mx: jnp.sum(jnp.sin(f(*mx)))))((model, x))

    want_grads = grads(dense_apply, dense)
    with jax.set_mesh(m):
        assert_close(eqx.filter_jit(layer.__call__)(x), want, F32, "global")
    # Inside shard_map the gathered output is invariant, so it may leave replicated.
    for check_vma in (True, False):
        local = jax.shard_map(lambda l, x: l(x), mesh=m, check_vma=check_vma,
                              in_specs=(fusedpar.param_specs(layer), P()), out_specs=P())
        what = f"shard_map check_vma={check_vma}"
        assert_close(jax.jit(local)(layer, x), want, F32, what)
        got = grads(local, layer)
        assert_close(got[0].weight, want_grads[0].weight, F32, f"{what} dW")
        assert_close(got[1], want_grads[1], F32, f"{what} dx")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_equals_batched(backend):
    """jax.vmap(layer)(x) == layer(x), values and input gradients, global and local."""
    m = mesh((2, 4), ("fsdp", "tp"))
    layers, _ = make("tp", backend, sp=True, fsdp="fsdp")
    x = normal(7, (4, 8, IN), F32)
    with jax.set_mesh(m):
        ls = fusedpar.shard(layers, m)
        want = eqx.filter_jit(eqx.filter_value_and_grad(_sum_mlp))(ls, x)
        got = eqx.filter_jit(eqx.filter_value_and_grad(_sum_vmapped_mlp))(ls, x)
    assert_close(got, want, F32, "global vmap")
    if backend != "reference":  # pure lax, no custom_vjp: the global check covers it
        _check_vmap_in_shard_map(m, layers, x, check_vma=True)


def _vmap_unsupported():
    from fusedpar._core import _backends

    assert getattr(_backends.get("pallas_tpu").run, "_fusedpar_vmappable", False), \
        "the Pallas backends must fold vmap into their 2-D calls (_batching.vmappable)"
    return _WHY


@pytest.mark.parametrize("backend", [PALLAS])
def test_vmap_pallas_in_shard_map(backend):
    """The kernels under vmap inside shard_map (the global context is not checked: in
    interpret mode the kernels are io_callbacks, which JAX refuses inside a vmapped
    shard_map, "callbacks are only supported ... no partial automatic sharding")."""
    why = _vmap_unsupported()
    if why:
        pytest.skip(why)
    # On a TP-only mesh: beside an FSDP style the layers refuse interpreted kernels.
    layers, _ = make("tp", backend, sp=True)
    _check_vmap_in_shard_map(mesh((4,), ("tp",)), layers, normal(7, (4, 8, IN), F32),
                             check_vma=False)


def _sum_mlp(ls, x):
    return jnp.sum(jnp.sin(mlp(*ls, x)))


def _sum_vmapped_mlp(ls, x):
    return jnp.sum(jnp.sin(jax.vmap(lambda r: mlp(*ls, r))(x)))


def _check_vmap_in_shard_map(m, layers, x, check_vma):
    """Inside shard_map: the ops' custom_vjp and collectives under vmap over the batch."""
    (pspecs, x_spec), _ = fusedpar.shard_map_specs(layers, x, call=lambda ls, x: mlp(*ls, x))

    def grads(g):
        return jax.jit(jax.grad(jax.shard_map(
            lambda ls, x: jax.lax.psum(g(ls, x), tuple(m.axis_names)), mesh=m,
            in_specs=(pspecs, x_spec), out_specs=P(), check_vma=check_vma), argnums=(0, 1)))

    assert_close(grads(_sum_vmapped_mlp)(layers, x), grads(_sum_mlp)(layers, x), F32,
                 "shard_map vmap")


def test_vmap_vmap_matches_dense():
    """Under vmap(vmap(layer)) the outer mapped axis is the batch and the inner one the
    sequence: sequence-parallel FSDP x TP layers equal eqx.nn.Linear, values and
    gradients, with no mesh and on global arrays (Auto and Explicit axes)."""
    layers, dense = make("tp", "reference", sp=True, fsdp="fsdp")
    x = normal(12, (4, 8, IN), F32)
    want = dense_grads(dense, x)

    def per_token(mx):
        (up, down), x = mx
        return jnp.sum(jnp.sin(jax.vmap(jax.vmap(lambda r: down(jnp.tanh(up(r)))))(x)))

    grad = eqx.filter_jit(eqx.filter_value_and_grad(per_token))
    check_grads(grad((layers, x)), want, "no mesh")
    for kind in (AxisType.Auto, AxisType.Explicit):
        m = mesh((2, 4), ("fsdp", "tp"), kind)
        with jax.set_mesh(m):
            check_grads(grad((fusedpar.shard(layers, m), x)), want, str(kind))


def _shard_map_specs_in(f, *args):
    """The in_specs of every shard_map in the jaxpr of `f(*args)`."""
    eqns = jax.make_jaxpr(f)(*args).eqns
    return [e.params["in_specs"] for e in eqns if e.primitive.name == "shard_map"]


def test_vmap_fsdp_keeps_the_weight_sharded():
    """FSDP under vmap sees the batch as dim 0: its weight enters shard_map sharded (no
    gather on entry) and values and gradients equal the dense layers'."""
    m = mesh((8,), ("fsdp",))
    layers, dense = make("fsdp", "reference", fsdp="fsdp")
    x = normal(8, (16, IN), F32)

    def vmapped(ls, x):
        return jnp.sum(jax.vmap(lambda r: mlp(*ls, r))(x) ** 2)

    with jax.set_mesh(m):
        ls = fusedpar.shard(layers, m)
        specs = _shard_map_specs_in(vmapped, ls, x)
        got = eqx.filter_jit(eqx.filter_grad(vmapped))(ls, x)
    assert [s[0] for s in specs] == [P("fsdp", None)] * 2, specs  # the weights
    assert [s[-1] for s in specs] == [P("fsdp", None)] * 2, specs  # the batch
    want = eqx.filter_grad(lambda d, x: jnp.sum(dense_apply(
        d[1], jnp.tanh(dense_apply(d[0], x))) ** 2))(dense, x)
    assert_close(got, want, F32, "fsdp vmap grads")


def test_vmap_without_folding():
    """What is not folded runs as plain jax.vmap does: per-example gradients (grad inside
    vmap) and a vmap over stacked layers, against eqx.nn.Linear."""
    layer = fusedpar.ColumnLinear(IN, HID, key=jax.random.key(13), sequence_parallel=True)
    lin = eqx.nn.Linear(IN, HID, key=jax.random.key(13))
    x = normal(14, (3, 8, IN), F32)

    def per_example(apply, m):
        loss = eqx.filter_grad(lambda m, r: jnp.sum(jnp.sin(apply(m, r))))
        return jax.vmap(loss, (None, 0))(m, x).weight

    assert_close(per_example(lambda m, r: m(r), layer), per_example(dense_apply, lin), F32,
                 "per-example grads")
    stacked = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), (layer, lin))
    got = jax.vmap(lambda ls, r: ls[0](r), (0, None))(stacked, x)
    want = jax.vmap(lambda ls, r: dense_apply(ls[1], r), (0, None))(stacked, x)
    assert_close(got, want, F32, "stacked layers")


def test_input_dtype_and_unbatched():
    """(in,) inputs in every context; bfloat16 layer."""
    k = jax.random.key(9)
    layer = fusedpar.ColumnLinear(IN, HID, dtype=jnp.bfloat16, key=k, backend="ring")
    lin = eqx.nn.Linear(IN, HID, dtype=jnp.bfloat16, key=k)
    x = normal(10, (IN,), jnp.bfloat16)
    want = lin(x)
    assert_close(layer(x), want, jnp.bfloat16, "dense")
    with jax.set_mesh(mesh((4,), ("tp",))):
        y = eqx.filter_jit(layer.__call__)(x)
    assert y.dtype == jnp.bfloat16 and y.shape == (HID,)
    assert_close(y, want, jnp.bfloat16, "global")


@pytest.mark.parametrize("backend", ["auto", "ring"])
def test_empty_sequence_and_batch(backend):
    """A sequence or batch of length 0 on a mesh: the sequence-parallel layers and the
    embedding return empty outputs and zero gradients, as with no mesh (XLA refuses a
    collective over a dimension of size 0)."""
    k = jax.random.key(11)
    layers = [fusedpar.ColumnLinear(IN, HID, key=k, sequence_parallel=True, backend=backend),
              fusedpar.RowLinear(HID, IN, key=k, sequence_parallel=True, backend=backend,
                                 fsdp_axis="fsdp"),
              fusedpar.Embedding(64, IN, key=k, sequence_parallel=True)]
    m = mesh((2, 4), ("fsdp", "tp"))
    for layer in layers:
        for shape in [(2, 0), (0, 8)]:
            emb = isinstance(layer, fusedpar.Embedding)
            x = jnp.zeros(shape, jnp.int32) if emb else jnp.zeros(shape + (layer.in_features,))
            with jax.set_mesh(m):
                placed = fusedpar.shard(layer, m)
                y = eqx.filter_jit(lambda l, x: l(x))(placed, x)
                g = eqx.filter_jit(eqx.filter_grad(lambda l, x: jnp.sum(l(x) ** 2)))(placed, x)
            assert y.shape == layer(x).shape, (type(layer).__name__, shape, y.shape)
            for leaf in jax.tree.leaves(g):
                assert not np.any(np.asarray(leaf)), (type(layer).__name__, shape)


def test_vmap_fold_rule():
    """fusedpar._core._batching: vmap of a primitive folded into one 2-D call (x mapped, w
    mapped) or run once per example (both), equals the lax ring's own vmap."""
    from jax import lax

    from fusedpar._core import _autodiff, _batching, _primitives as Pr

    n, b = 2, 3
    cfg = Pr.Config(backend="ring", axis_name="x", axis_size=n, bidirectional=False,
                    unroll=True, out_dtype=F32, reduce_dtype=F32)
    shapes = {Pr.AG_ROWS: ((2, 8), (8, 4)), Pr.AG_COLS: ((4, 8), (8, 2)),
              Pr.AG_CONTRACT: ((4, 4), (2, 4)), Pr.RS_ROWS: ((8, 4), (4, 3)),
              Pr.RS_COLS: ((3, 4), (4, 8))}
    run = _batching.vmappable(_autodiff.run)
    cases, inputs = [], []
    for i, (prim, (xs, ws)) in enumerate(shapes.items()):
        # Both mapped runs the backend once per example: checked once, for its structure.
        modes = (("x", (0, None)), ("w", (None, 0))) + (
            (("both", (0, 0)),) if prim == Pr.AG_COLS else ())
        for mode, axes in modes:
            # numpy draws: jax.random would compile once per shape
            rng = np.random.default_rng(len(inputs))
            x = rng.standard_normal(((b,) if axes[0] == 0 else ()) + xs, np.float32)
            w = rng.standard_normal(((b,) if axes[1] == 0 else ()) + ws, np.float32)
            cases.append((prim, mode, axes))
            inputs.append((x, w))

    def body(inputs):
        k = (1.0 + lax.axis_index("x")).astype(F32)  # different operands per device
        got, want = [], []
        for (prim, _, axes), (x, w) in zip(cases, inputs):
            rg = prim in Pr.GATHERS
            x, w = x * k, w / k
            got.append(jax.vmap(lambda x, w: run(prim, cfg, x, w, rg), axes)(x, w))
            # The lax ring batches natively: its plain vmap is the oracle for the fold.
            want.append(jax.vmap(lambda x, w: _autodiff.run(prim, cfg, x, w, rg), axes)(x, w))
        return jax.tree.map(lambda a: a[None], (got, want))

    f = jax.jit(jax.shard_map(body, mesh=mesh((n,), ("x",)), in_specs=P(), out_specs=P("x"),
                              check_vma=False))
    got, want = f(inputs)
    for (prim, mode, _), g, w in zip(cases, got, want):
        assert_close(g, w, F32, f"{prim} {mode}-mapped")


def test_comm_dtype_matches_dense_fake_quantized(backend="ring"):
    """Sequence-parallel gathers in fp8 and FSDP weight gathers in int8 (lax.all_gather
    in the sequence-parallel Column, the op's ring in FSDPLinear): on a mesh the values
    and gradients equal the layers with no mesh, which fake-quantize what would travel
    (whole weight rows here: FSDP splits the output features)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    fp8, i8 = jnp.float8_e4m3fn, jnp.int8
    layers = (
        fusedpar.ColumnLinear(IN, HID, key=k1, sequence_parallel=True, comm_dtype=fp8,
                              gather_output=True, fsdp_axis="fsdp", fsdp_dim=0,
                              fsdp_comm_dtype=i8, backend=backend),
        fusedpar.FSDPLinear(HID, IN, key=k2, comm_dtype=i8, backend=backend))
    x = normal(1, (4, 8, IN), F32)

    def f(model, x):
        a, b = model
        return jnp.sum(jnp.sin(b(jnp.tanh(a(x)))))

    want = eqx.filter_value_and_grad(lambda mx: f(*mx))((layers, x))
    m = mesh((2, 4), ("fsdp", "tp"), AxisType.Explicit)
    with jax.set_mesh(m):
        sharded = fusedpar.shard(layers, m)
        xs = jax.device_put(x, jax.sharding.NamedSharding(m, P("fsdp", "tp")))
        got = eqx.filter_jit(eqx.filter_value_and_grad(lambda mx: f(*mx)))((sharded, xs))
    assert_close(got[0], want[0], F32, "loss")
    for i in range(2):
        assert_close(got[1][0][i].weight, want[1][0][i].weight, F32, f"d{i}.weight")
    assert_close(got[1][1], want[1][1], F32, "dx")
    table = fusedpar.describe(layers)
    assert "Column('tp', sequence_parallel, gather_output, comm_dtype=float8_e4m3fn)" in table
    assert "all_gather_matmul x(seq) over tp in float8_e4m3fn" in table
    assert "all_gather_matmul W over fsdp in int8" in table


def test_comm_dtype_split_contraction_scales_each_shard():
    """A RowLinear's weight is split along its input features over tp, so its FSDP
    gather scales each device's part of a row on its own: the layer equals the dense
    math on the weight fake-quantized in blocks of in/tp (the dense layer, not knowing
    tp, uses whole rows: it agrees within the quantization error)."""
    layer = fusedpar.RowLinear(HID, IN, key=jax.random.key(0), fsdp_axis="fsdp",
                               fsdp_comm_dtype=jnp.int8, backend="ring")
    x = normal(2, (4, 8, HID), F32)
    blocks = fusedpar.QuantizedArray.quantize(layer.weight, jnp.int8, block_size=HID // 4)
    want = x @ blocks.dequantize().T + layer.bias
    m = mesh((2, 4), ("fsdp", "tp"), AxisType.Explicit)
    with jax.set_mesh(m):
        xs = jax.device_put(x, jax.sharding.NamedSharding(m, P("fsdp", None, "tp")))
        got = eqx.filter_jit(lambda l, x: l(x))(fusedpar.shard(layer, m), xs)
    assert_close(got, want, F32, "blocks of in/tp")
    assert_close(layer(x), x @ fusedpar.QuantizedArray.quantize(
        layer.weight, jnp.int8).dequantize().T + layer.bias, F32, "dense: whole rows")


def test_comm_dtype_plan_and_bad_input():
    """A plan's styles carry the dtypes to the layers; bad dtypes name the valid ones."""
    model = [eqx.nn.Linear(IN, HID, key=jax.random.key(0)),
             eqx.nn.Linear(HID, IN, key=jax.random.key(1))]
    plan = {"0": fusedpar.Column(sequence_parallel=True, comm_dtype=jnp.float8_e4m3fn),
            "1": fusedpar.Row(sequence_parallel=True),
            "*": fusedpar.FSDP(comm_dtype="int8")}
    up, down = fusedpar.parallelize(model, plan)
    assert up.rule.tp.comm_dtype == np.dtype(jnp.float8_e4m3fn)
    assert up.rule.fsdp.comm_dtype == down.rule.fsdp.comm_dtype == np.dtype(jnp.int8)
    with pytest.raises(ValueError, match=r"FSDP: comm_dtype must be None .* jnp.int8, "
                                         r"jnp.float8_e4m3fn, got float16"):
        fusedpar.FSDP(comm_dtype="float16")
    with pytest.raises(ValueError, match="need sequence_parallel=True"):
        fusedpar.ColumnLinear(IN, HID, key=jax.random.key(0), comm_dtype=jnp.int8)
    with pytest.raises(ValueError, match="pass fsdp_axis"):
        fusedpar.RowLinear(IN, HID, key=jax.random.key(0), fsdp_comm_dtype=jnp.int8)


def test_keep_gathered_false_gathers_again_with_the_same_gradients():
    """`keep_gathered=False` on the styles (FSDP x TP, sequence parallel): the same loss
    and gradients as the dense layers, and errors where there is nothing to keep. (That
    it gathers again, the CPU compiler cannot show: it merges the gathers whatever
    the program says. `test_keep_gathered_false_gathers_again_when_compiled` does.)"""
    model = [eqx.nn.Linear(IN, HID, key=jax.random.key(0)),
             eqx.nn.Linear(HID, IN, key=jax.random.key(1))]
    x = normal(1, (4, 8, IN), F32)
    m = mesh((2, 4), ("fsdp", "tp"))

    def plan(keep):
        return {"0": (fusedpar.Column(sequence_parallel=True, keep_gathered=keep),
                      fusedpar.FSDP()),
                "1": (fusedpar.Row(sequence_parallel=True, keep_gathered=keep),
                      fusedpar.FSDP())}

    grad = eqx.filter_value_and_grad(lambda mx: loss(*mx))
    for backend in BACKENDS:
        layers = fusedpar.parallelize(model, plan(False), backend=backend)
        assert layers[0].rule.tp.keep_gathered is False
        with jax.set_mesh(m):
            got = eqx.filter_jit(grad)((fusedpar.shard(layers, m), x))
        check_grads(got, dense_grads(model, x), f"keep_gathered=False {backend}")
    assert "keep_gathered=False" in fusedpar.describe(fusedpar.parallelize(model, plan(False)))
    assert repr(fusedpar.Row(sequence_parallel=True, keep_gathered=False)) == (
        "Row(axis='tp', sequence_parallel=True, keep_gathered=False)")
    with pytest.raises(ValueError, match="keep_gathered=False needs sequence_parallel=True"):
        fusedpar.RowLinear(IN, HID, key=jax.random.key(0), keep_gathered=False)
    with pytest.raises(TypeError, match="Column: keep_gathered must be True or False"):
        fusedpar.Column(sequence_parallel=True, keep_gathered=None)
    table = eqx.nn.Embedding(HID, IN, key=jax.random.key(2))
    with pytest.raises(ValueError, match="an embedding runs no collective matmul"):
        fusedpar.parallelize([table], {"0": fusedpar.Row(sequence_parallel=True,
                                                         keep_gathered=False)})


@pytest.mark.aot
@needs_aot
def test_keep_gathered_false_gathers_again_when_compiled():
    """Compiled for 8 H100s, a sequence-parallel MLP step with `keep_gathered=False` on
    both styles runs two more all-gathers on the reference (the Column's input and the
    Row's cotangent, each gathered again for its weight gradient, which XLA would merge
    with the first were they the same array) and holds less temporary memory."""
    from fusedpar._compile import _aot_compare as compare, _aot_programs as programs

    m = compare.mesh("h100x8", "mlp")
    # The aot programs' MLP size: XLA combines the all-gathers of much smaller arrays.
    dim, hidden, tokens = (programs.LAYER_SIZES["mlp"][k] for k in ("dim", "hidden", "tokens"))
    model = eqx.filter_eval_shape(programs._MLP, dim, hidden, jnp.bfloat16, jax.random.key(0))
    out = {}
    for keep in (True, False):
        sp = dict(sequence_parallel=True, keep_gathered=keep)
        fn, args = programs._layer_program(
            m, model, {"up": fusedpar.Column(**sp), "down": fusedpar.Row(**sp)}, "reference",
            (1, 8 * tokens, dim), P(None, "tp", None), jnp.bfloat16)
        with jax.set_mesh(m):
            compiled = fn.lower(*args).compile()
        out[keep] = (compiled.as_text().count("all-gather-start("),
                     compiled.memory_analysis().temp_size_in_bytes)
    assert out[False][0] == out[True][0] + 2, out
    assert out[False][1] < out[True][1], out
