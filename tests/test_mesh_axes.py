"""Layers on meshes with axes they do not use (a data x tensor-parallel mesh), and ops
inside a shard_map that leaves mesh axes to XLA.

The layers' own shard_map is manual over every mesh axis, so the fused TPU kernels
(interpreted here: host callbacks, which JAX runs only where every axis is manual) run
beside a data or FSDP axis; a user's shard_map that leaves an axis automatic gets a
clear refusal from the kernels, and "auto" never picks them there. The same layers
compiled for TPU slices: tests/test_aot.py.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._sharding import _specs
from fusedpar._hw import _target
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(300)

F32 = jnp.float32
# Features and tokens where every ring step of both Pallas backends is a whole tile (the
# Triton step kernels take multiples of 16: HID / 4 columns, 64 / 4 rows halved).
IN, HID, BATCH, SEQ = 16, 64, 4, 64


def _layers(backend):
    k1, k2 = jax.random.split(jax.random.key(0))
    layers = (fusedpar.ColumnLinear(IN, HID, key=k1, sequence_parallel=True, backend=backend),
              fusedpar.RowLinear(HID, IN, key=k2, sequence_parallel=True, backend=backend))
    dense = (eqx.nn.Linear(IN, HID, key=k1), eqx.nn.Linear(HID, IN, key=k2))
    return layers, dense


def _loss(model, x):
    up, down = model
    return jnp.sum(jnp.sin(down(jnp.tanh(up(x)))))


def _dense_loss(model, x):
    up, down = (jax.vmap(jax.vmap(layer)) for layer in model)
    return jnp.sum(jnp.sin(down(jnp.tanh(up(x)))))


def _equal_dense(got, dense, x):
    """`got`, a (loss, grads) of `_loss`, equals the dense layers' on the same x."""
    want = eqx.filter_value_and_grad(_dense_loss)(dense, x)
    assert_close(got[0], want[0], F32, "loss")
    for g, w, name in zip(got[1], want[1], ("up", "down")):
        assert_close((g.weight, g.bias), (w.weight, w.bias), F32, f"d{name}")


def _compiled_step(loss, layers, x, m):
    """(the compiled program, (loss, grads)) of `loss`'s value and gradient with
    `layers` placed on mesh `m`, x as given."""
    with jax.set_mesh(m):
        model = fusedpar.shard(layers, m)
        step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
        return step.lower(model, x).compile().compiled, step(model, x)


@pytest.mark.parametrize("backend", [pytest.param("pallas_tpu", marks=pytest.mark.slow),
                                     "pallas_gpu"])
def test_tensor_parallel_pallas_layers_beside_an_fsdp_axis(backend):
    """Sequence-parallel Column -> Row over "tp" on a (2, 4) ("fsdp", "tp") mesh, the
    kernels interpreted: loss and every gradient equal dense math (before, pallas_tpu
    raised JAX's "callbacks are only supported ... all mesh axes are partitioned
    manually"). The layers' shard_map is manual over both axes, the batch on "fsdp"."""
    layers, dense = _layers(backend)
    x = normal(0, (BATCH, SEQ, IN), F32)
    m = mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(m):
        model = fusedpar.shard(layers, m)
        step = eqx.filter_jit(eqx.filter_value_and_grad(_loss))
        jaxpr = jax.make_jaxpr(lambda mx: _loss(*mx))((model, x))
        got = step(model, x)
    maps = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert [set(e.params["newly_manual_axes"]) for e in maps] == [{"fsdp", "tp"}] * 2
    assert maps[0].params["in_specs"][-1] == P("fsdp", "tp", None)
    _equal_dense(got, dense, x)


def test_other_auto_axes_go_on_the_batch_where_it_divides():
    """With Auto axes the input's layout is not in its type: the layer's shard_map carries
    the mesh's other axes on dim 0 when the layer keeps it and it divides, as many as
    divide (in mesh order), else replicates the input over them."""
    sizes = {"data": 2, "pod": 4, "tp": 4, "one": 1}
    x_spec, y_spec = P(None, "tp", None), P(None, None, "tp")  # a sequence-parallel Column
    got = _specs.with_unknown_axes((8, 64, 16), x_spec, y_spec, ("data", "pod", "one"), sizes)
    assert got == (P(("data", "pod"), "tp", None), P(("data", "pod"), None, "tp"))
    got = _specs.with_unknown_axes((6, 64, 16), x_spec, y_spec, ("data", "pod"), sizes)
    assert got == (P("data", "tp", None), P("data", None, "tp"))  # 6: "pod" does not divide
    assert _specs.with_unknown_axes((3, 64, 16), x_spec, y_spec, ("data",), sizes) == (
        x_spec, y_spec)
    # An FSDP batch: the other axes go before the FSDP axis (and must divide with it).
    fsdp = P("fsdp", "tp", None), P("fsdp", None, "tp")
    assert _specs.with_unknown_axes((8, 64, 16), *fsdp, ("data",), {**sizes, "fsdp": 2}) == (
        P(("data", "fsdp"), "tp", None), P(("data", "fsdp"), None, "tp"))
    # Given the mesh's order, dim 0's axes follow it: an FSDP-only layer on an
    # ("fsdp", "tp") mesh tiles the batch in the mesh's device order, not transposed.
    only = P("fsdp", None, None), P("fsdp", None, None)
    assert _specs.with_unknown_axes((8, 64, 16), *only, ("tp",), {**sizes, "fsdp": 2},
                                    order=("fsdp", "tp")) == (P(("fsdp", "tp"), None, None),) * 2
    assert _specs.with_unknown_axes((8, 64, 16), *fsdp, ("data",), {**sizes, "fsdp": 2},
                                    order=("data", "fsdp", "tp")) == (
        P(("data", "fsdp"), "tp", None), P(("data", "fsdp"), None, "tp"))
    # A (seq, features) input of a sequence-parallel Column: dim 0 changes layout.
    assert _specs.with_unknown_axes((64, 16), P("tp", None), P(None, "tp"), ("data",),
                                    sizes) == (P("tp", None), P(None, "tp"))


@pytest.mark.parametrize("backend", ["reference", "ring"])
def test_lax_backends_multiply_only_their_share_of_a_data_parallel_batch(backend):
    """On a (2, 4) ("data", "tp") mesh with Auto axes, the lax backends' shard_map is
    manual over "data" too, with the batch on it: each device multiplies BATCH / 2
    sequences. Left to XLA, the ops' 2-D form (sequence before batch) made it gather the
    whole batch onto every device: twice the matmuls, no error. Values equal dense."""
    layers, dense = _layers(backend)
    x = normal(0, (BATCH, SEQ, IN), F32)
    compiled, got = _compiled_step(_loss, layers, x, mesh((2, 4), ("data", "tp")))
    # Each device's share of the three matmuls per layer (XLA counts 1.74x it before).
    share = 2 * 3 * 2 * BATCH * SEQ * IN * HID / 8
    assert compiled.cost_analysis()["flops"] < 1.25 * share
    text = compiled.as_text()
    over_data = [line for line in text.splitlines() if re.search(r"all-gather(-start)?\(", line)
                 and ("{{0,4}" in line or "[4,2]<=[2,4]T(1,0)" in line)]
    assert not over_data, over_data  # (the weight gradients' all-reduce is over "data")
    _equal_dense(got, dense, x)


def test_one_example_under_vmap_and_checkpoint_keeps_the_batch_where_it_is():
    """The same mesh, the layers called on one example (seq, features) under
    jax.vmap(jax.checkpoint(...)), the batch sharded over "data" outside their view:
    they leave "data" to XLA rather than put it on the example's sequence (which cost
    two all-to-alls over "data"). Values equal dense."""
    k1, k2 = jax.random.split(jax.random.key(0))
    layers = (fusedpar.ColumnLinear(IN, HID, key=k1, backend="ring"),
              fusedpar.RowLinear(HID, IN, key=k2, backend="ring"))
    dense = (eqx.nn.Linear(IN, HID, key=k1), eqx.nn.Linear(HID, IN, key=k2))

    def loss(model, x):
        up, down = model
        per_example = jax.checkpoint(lambda x: jnp.sum(jnp.sin(down(jnp.tanh(up(x))))))
        return jnp.sum(jax.vmap(per_example)(x))

    m = mesh((2, 4), ("data", "tp"))
    x = normal(0, (BATCH, SEQ, IN), F32)
    xs = jax.device_put(x, jax.sharding.NamedSharding(m, P("data")))
    compiled, got = _compiled_step(loss, layers, xs, m)
    assert not re.search(r"all-to-all(-start)?\(", compiled.as_text())
    _equal_dense(got, dense, x)


def test_an_fsdp_embedding_keeps_a_data_parallel_batch():
    """A vocabulary-parallel FSDP Embedding on a (2, 2, 2) ("data", "fsdp", "tp") mesh of
    Auto axes, ids laid out over ("data", "fsdp"): each device looks up its quarter of the
    batch (left to XLA, the ids were gathered over "data": every data replica looked up
    the same half, and every layer after it multiplied twice its share). Values equal
    the dense lookup."""
    table = eqx.nn.Embedding(64, 32, key=jax.random.key(0))
    emb = fusedpar.parallelize({"e": table}, {"e": fusedpar.Row(sequence_parallel=True),
                                              "*": "fsdp"})
    ids = jax.random.randint(jax.random.key(1), (16, 16), 0, 64)
    m = mesh((2, 2, 2), ("data", "fsdp", "tp"))
    with jax.set_mesh(m):
        emb = fusedpar.shard(emb, m)
        out = jax.jit(lambda e, t: e["e"](t))(
            emb, jax.device_put(ids, jax.sharding.NamedSharding(m, P(("data", "fsdp")))))
    assert out.addressable_shards[0].data.shape == (4, 8, 32)
    assert_close(out, jax.vmap(jax.vmap(table))(ids), F32, "lookup")


def test_cross_entropy_keeps_a_data_parallel_batch():
    """Logits (batch, seq, vocab) on a (2, 2, 2) ("data", "fsdp", "tp") mesh of Auto axes:
    the loss's shard_map is manual over every axis, the batch on ("data", "fsdp") as the
    layers that make the logits put it (left to XLA, a small GPT's step exchanged "data"
    and "fsdp" around the loss: 10 collective-permutes, 2 with this). Values equal the
    dense loss."""
    logits = normal(0, (8, 16, 64), F32)
    labels = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    m = mesh((2, 2, 2), ("data", "fsdp", "tp"))
    loss = lambda l, y: fusedpar.cross_entropy(l, y, "tp")  # noqa: E731
    with jax.set_mesh(m):
        jaxpr = jax.make_jaxpr(loss)(logits, labels)
        got = jax.jit(loss)(logits, labels)
    (sm,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert set(sm.params["newly_manual_axes"]) == {"data", "fsdp", "tp"}
    assert sm.params["in_specs"][0] == P(("data", "fsdp"), None, "tp")
    want = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
    assert_close(got, want, F32, "loss")


def test_fused_tpu_kernels_refused_where_an_axis_is_left_to_xla():
    """Inside a shard_map manual over "tp" only, on a ("data", "tp") mesh, the TPU
    kernels cannot run (they address devices by every mesh coordinate; interpret mode's
    callbacks need every axis manual): asked for by name they raise, naming the op, the
    automatic axis and the fix; "auto" and explain choose among the others."""
    m = mesh((2, 4), ("data", "tp"))
    x, w = normal(1, (4 * 32, IN), F32), normal(2, (IN, HID), F32)

    def run(backend):
        def body(x, w):
            if backend == "auto":
                choice = fusedpar.explain("all_gather_matmul", x, w, 4)
                seen.append((choice.backend, _target.automatic_axes()))
            return fusedpar.all_gather_matmul(x, w, "tp", backend=backend)

        return jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("tp"), P()), out_specs=P(),
                                     axis_names={"tp"}, check_vma=False))(x, w)

    seen = []
    for backend in ("pallas_tpu", "pallas"):
        with pytest.raises(NotImplementedError) as e:
            run(backend)
        message = str(e.value)
        assert message.startswith(f"all_gather_matmul: backend {backend!r} cannot run"), message
        for part in ("{'data': 2}", "axis_names", "backend='ring'"):
            assert part in message, message
    assert_close(run("auto"), x @ w, F32, "auto in a partially manual shard_map")
    assert seen == [("reference", (("data", 2),))]


def test_auto_never_picks_kernels_that_need_check_vma_off_in_a_checked_shard_map():
    """`jax.shard_map` checks varying axes by default (check_vma=True), where the fused
    TPU kernels cannot trace. Compiled for a v6e slice at a size where auto picks them
    in a shard_map with check_vma=False, the same op and its backward in a checked
    shard_map lower with backends that can run there (it used to pick the kernels, and
    fail)."""
    from fusedpar import aot

    m = aot.mesh("v6e:2x4", (8,), ("x",))
    x = jax.ShapeDtypeStruct((1024, 8 * 2048), jnp.bfloat16,
                             sharding=jax.NamedSharding(m, P(None, "x")))
    w = jax.ShapeDtypeStruct((8 * 2048, 8 * 2048), jnp.bfloat16,
                             sharding=jax.NamedSharding(m, P("x")))

    def lowered(check_vma):
        def loss(x, w):  # forward and backward: each dual picks its own backend
            y = fusedpar.matmul_reduce_scatter(x, w, "x", dim=1)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        f = jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=m,
                          in_specs=(P(None, "x"), P("x")), out_specs=(P(None, "x"), P("x")),
                          check_vma=check_vma)
        return jax.jit(f).lower(x, w).as_text()

    assert "tpu_custom_call" in lowered(False)  # auto's pick where it may
    assert "tpu_custom_call" not in lowered(True)
    local = (jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16),
             jax.ShapeDtypeStruct((2048, 8 * 2048), jnp.bfloat16))
    picks = [fusedpar.explain("matmul_reduce_scatter", *local, 8, dim=1, target=m,
                              check_vma=c).backend for c in (False, True)]
    kernels = ("pallas", "pallas_tpu")  # "pallas" is pallas_tpu on a TPU
    assert picks[0] in kernels and picks[1] not in kernels, picks
