"""The layers, ops, embedding and loss under Equinox's own test settings.

Equinox runs its tests with `jax_numpy_rank_promotion="raise"` (no implicit broadcasting
of a lower-rank operand, e.g. `y + bias` on a batch) and `jax_numpy_dtype_promotion=
"strict"` (no implicit bfloat16 -> float32 promotion). Every case here runs under both;
the expected values are computed outside them, with plain Equinox / lax.
"""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _definition
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(300)

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@contextlib.contextmanager
def strict():
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        yield


def _mlp(dtype, **kw):
    k1, k2 = jax.random.split(jax.random.key(0))
    up = fusedpar.ColumnLinear(16, 32, key=k1, dtype=dtype, backend="ring", **kw)
    down = fusedpar.RowLinear(32, 16, key=k2, dtype=dtype, backend="ring", **kw)
    return up, down


def _dense_mlp(model, x):
    up, down = (eqx.nn.Linear(16, 32, key=k, dtype=m.weight.dtype) for k, m in zip(
        jax.random.split(jax.random.key(0)), model))
    up = eqx.tree_at(lambda l: l.weight, up, model[0].weight)
    down = eqx.tree_at(lambda l: l.weight, down, model[1].weight)
    up = eqx.tree_at(lambda l: l.bias, up, model[0].bias)
    down = eqx.tree_at(lambda l: (l.weight, l.bias), down, (model[1].weight, model[1].bias))
    f = lambda v: down(jnp.tanh(up(v)))  # noqa: E731
    return jax.vmap(jax.vmap(f))(x)


def _loss(model, x):
    up, down = model
    return jnp.sum(jnp.sin(down(jnp.tanh(up(x))).astype(jnp.float32)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_layers_with_no_mesh(dtype):
    model = _mlp(dtype)
    x = normal(0, (2, 8, 16), dtype)
    want = _dense_mlp(model, x)
    with strict():
        got = model[1](jnp.tanh(model[0](x)))
        got_vmapped = jax.vmap(jax.vmap(lambda v: model[1](jnp.tanh(model[0](v)))))(x)
        grads = eqx.filter_grad(_loss)(model, x)
    assert_close(got, want, dtype)
    assert_close(got_vmapped, want, dtype)
    assert all(jnp.all(jnp.isfinite(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_layers_on_a_mesh(dtype):
    m = mesh((2, 4), ("fsdp", "tp"))
    model = _mlp(dtype, sequence_parallel=True, fsdp_axis="fsdp")
    x = normal(1, (2, 8, 16), dtype)
    want = _dense_mlp(model, x)
    want_grads = eqx.filter_grad(_loss)(model, x)  # no mesh: the dense math
    with jax.set_mesh(m):
        placed = fusedpar.shard(model, m)
        with strict():
            got = eqx.filter_jit(lambda mo, v: mo[1](jnp.tanh(mo[0](v))))(placed, x)
            grads = eqx.filter_jit(eqx.filter_grad(_loss))(placed, x)
    assert_close(got, want, dtype)
    assert_close(grads, want_grads, dtype, "grads")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend", ["reference", "ring"])
def test_ops(dtype, backend):
    m = mesh((4,), ("x",))
    x, w = normal(2, (8, 16), dtype), normal(3, (16, 8), dtype)

    def run(op):
        return jax.jit(jax.shard_map(op, mesh=m, in_specs=(P("x"), P()), out_specs=P("x")))(x, w)

    def ag(a, b):
        return fusedpar.all_gather_matmul(a, b, "x", backend=backend)[: a.shape[0]]

    def rs(a, b):
        return fusedpar.matmul_reduce_scatter(a, b, "x", dim=1, backend=backend)

    def ag_ref(a, b):
        return _definition.all_gather_matmul(a, b, "x")[: a.shape[0]]

    def rs_ref(a, b):
        return _definition.matmul_reduce_scatter(a, b, "x", dim=1)

    want = run(ag_ref), run(rs_ref)
    with strict():
        got = run(ag), run(rs)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_embedding_and_loss(dtype):
    emb = fusedpar.Embedding(16, 8, key=jax.random.key(0), dtype=dtype)
    ids = jnp.array([[0, 3, 15, 7], [1, 2, 3, 4]], jnp.int32)
    logits = normal(4, (2, 4, 16), dtype)
    want_emb = emb.weight[ids]
    want_loss = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                                     ids[..., None], -1)[..., 0]
    m = mesh((4,), ("tp",))
    with strict():
        got = [emb(ids), jax.vmap(emb)(ids), fusedpar.cross_entropy(logits, ids, None)]
        with jax.set_mesh(m):
            placed = fusedpar.shard(emb, m)
            got.append(eqx.filter_jit(lambda e, i: e(i))(placed, ids))
            got.append(jax.jit(lambda lo, la: fusedpar.cross_entropy(lo, la, "tp"))(
                logits, ids))
    for g in got[:2] + got[3:4]:
        assert_close(g, want_emb, dtype)
    assert_close(got[2], want_loss, dtype)
    assert_close(got[4], want_loss, dtype)


def test_mixed_input_dtype_with_a_bias():
    # docs/layers.md: under "strict" an input of another dtype than the weight is
    # promoted with the standard rules (a bfloat16 layer given float32 computes in
    # float32), the bias included; the product's float32 met a bfloat16 bias in
    # `jnp.result_type` and raised TypePromotionError.
    m = mesh((2, 4), ("fsdp", "tp"))
    model = _mlp(jnp.bfloat16, sequence_parallel=True, fsdp_axis="fsdp")
    x = normal(5, (2, 8, 16), jnp.float32)
    dense = jax.tree.map(lambda a: a.astype(jnp.float32), model)
    want = _dense_mlp(dense, x)
    with strict():
        got = [model[1](jnp.tanh(model[0](x)))]
        with jax.set_mesh(m):
            placed = fusedpar.shard(model, m)
            got.append(eqx.filter_jit(lambda mo, v: mo[1](jnp.tanh(mo[0](v))))(placed, x))
    for g in got:
        assert g.dtype == jnp.float32
        assert_close(g, want, jnp.float32)
