"""fusedpar.cross_entropy against plain jax.nn.log_softmax cross-entropy: values and
gradients with the vocabulary sharded, in the three calling contexts and under vmap;
ignored labels, bf16 logits, a padded vocabulary, bad labels, saved memory."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import fusedpar
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(300)

F32, BF16 = jnp.float32, jnp.bfloat16
VOCAB = 16
LABELS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 8)), jnp.int32)
LABELS = LABELS.at[0, :3].set(-100).at[2, 5].set(-100)  # ignored tokens
PROBE = normal(3, (4, 8), F32)  # weights every token's loss differently


def dense_ce(logits, labels):
    """The oracle: per-token -log_softmax(logits)[label] in float32, 0 where ignored."""
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(labels < 0, 0, labels)[..., None], -1)
    return jnp.where(labels == -100, 0.0, -picked[..., 0])


def weighted(ce):
    return lambda logits, labels: jnp.sum(ce(logits, labels) * PROBE)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_matches_log_softmax_in_every_context(dtype):
    """No mesh, global arrays (Auto and Explicit axes, batched and under vmap(vmap)) and
    inside shard_map with the vocabulary over "tp" and the batch over "fsdp"."""
    logits = normal(1, (4, 8, VOCAB), dtype)
    want = jax.value_and_grad(weighted(dense_ce))(logits, LABELS)
    ce = weighted(fusedpar.cross_entropy)
    per_token = weighted(jax.vmap(jax.vmap(fusedpar.cross_entropy)))
    assert fusedpar.cross_entropy(logits, LABELS).dtype == F32  # f32 loss from bf16 logits

    def check(got, what):
        assert got[1].dtype == dtype, what  # the gradient in the logits' dtype
        assert_close(got, want, dtype, what)

    check(jax.value_and_grad(ce)(logits, LABELS), "no mesh")
    for kind in (AxisType.Auto, AxisType.Explicit):
        m = mesh((2, 4), ("fsdp", "tp"), kind)
        with jax.set_mesh(m):
            check(jax.jit(jax.value_and_grad(ce))(logits, LABELS), f"global {kind}")
            if kind == AxisType.Auto:
                check(jax.jit(jax.value_and_grad(per_token))(logits, LABELS), "vmap(vmap)")
    # Without check_vma (as the fused kernels ask) JAX hands each device the replicated
    # loss's cotangent divided by the axis size: the gradient must still be the whole one.
    for check_vma in (True, False):
        local = jax.shard_map(lambda x, y: fusedpar.cross_entropy(x, y), mesh=mesh((2, 4), (
            "fsdp", "tp")), in_specs=(P("fsdp", None, "tp"), P("fsdp")), out_specs=P("fsdp"),
            check_vma=check_vma)
        check(jax.jit(jax.value_and_grad(weighted(local)))(logits, LABELS),
              f"shard_map check_vma={check_vma}")


def test_padded_vocabulary():
    """A vocabulary of 10 padded to 12 to divide over 4 devices: with vocab_size=10 the
    padding gets no probability and no gradient, and the rest equals the dense loss."""
    logits = normal(4, (4, 8, 10), F32)
    padded = jnp.concatenate([logits, 5 + normal(5, (4, 8, 2), F32)], axis=-1)
    labels = jnp.where(LABELS >= 10, 9, LABELS)
    want = jax.value_and_grad(weighted(dense_ce))(logits, labels)
    with jax.set_mesh(mesh((4,), ("tp",))):
        value, grad = jax.jit(jax.value_and_grad(weighted(
            lambda x, y: fusedpar.cross_entropy(x, y, vocab_size=10))))(padded, labels)
        with pytest.raises(ValueError, match=r"not divisible by 4.*pad the vocabulary to a "
                           r"multiple of 4 \(e\.g\. 12"):
            fusedpar.cross_entropy(logits, labels)
    assert_close((value, grad[..., :10]), want, F32, "padded")
    assert (grad[..., 10:] == 0).all()


def test_bad_labels_give_nan():
    """A label outside [0, vocab) that is not ignore_index gives a NaN loss (JAX cannot
    raise on values), in every context; the other tokens are unaffected."""
    logits = normal(6, (4, 8, VOCAB), F32)
    labels = LABELS.at[1, 1].set(VOCAB).at[3, 2].set(-1)
    bad = np.zeros(labels.shape, bool)
    bad[1, 1] = bad[3, 2] = True
    want = np.asarray(dense_ce(logits, labels))
    with jax.set_mesh(mesh((4,), ("tp",))):
        global_loss = jax.jit(fusedpar.cross_entropy)(logits, labels)
    for what, loss in (("no mesh", fusedpar.cross_entropy(logits, labels)),
                       ("global", global_loss)):
        loss = np.asarray(loss)
        assert np.isnan(loss[bad]).all(), what
        assert_close(loss[~bad], want[~bad], F32, what)


def test_custom_vjp_keeps_no_float32_softmax():
    """The backward recomputes the softmax: for bf16 logits the saved residuals are the
    logits themselves (bf16), the labels and the log-sum-exp, half of what autodiff of
    the plain expression keeps (its float32 softmax)."""
    logits = normal(7, (4, 8, 256), BF16)

    def saved_bytes(f):
        return sum(a.nbytes for a in jax.tree.leaves(jax.vjp(f, logits)[1]))

    ours = saved_bytes(lambda x: fusedpar.cross_entropy(x, LABELS, axis=None))
    assert ours == logits.nbytes + LABELS.nbytes + LABELS.size * 4
    assert saved_bytes(lambda x: dense_ce(x, LABELS)) >= 2 * logits.nbytes


def test_gpt_loss_under_parallelize():
    """Embedding -> column-parallel LM head -> cross_entropy, parallelized by a plan and
    trained on global arrays: the loss and gradients of the dense model."""
    k1, k2 = jax.random.split(jax.random.key(8))
    model = (eqx.nn.Embedding(VOCAB, 8, key=k1), eqx.nn.Linear(8, VOCAB, key=k2))
    tokens = jnp.where(LABELS < 0, 0, LABELS)

    def loss(m, tokens):
        embed, head = m
        logits = jax.vmap(jax.vmap(lambda t: head(embed(t))))(tokens)
        return jnp.sum(fusedpar.cross_entropy(logits, LABELS) * PROBE)

    want = eqx.filter_value_and_grad(loss)(model, tokens)
    plan = {"0": fusedpar.Row(sequence_parallel=True),
            "1": fusedpar.Column(sequence_parallel=True), "*": "fsdp"}
    m = mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(m):
        par = fusedpar.shard(fusedpar.parallelize(model, plan), m)
        got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(par, tokens)
    assert_close(got, want, F32, "embedding + head + loss")


def test_a_tensor_parallel_axis_of_size_one():
    """On an (8, 1) fsdp x tp mesh of Auto axes, with the logits' batch over "fsdp": XLA's
    partitioner refused the sums over the size-1 "tp" beside the automatic "fsdp";
    values and gradients equal log_softmax's."""
    m = mesh((8, 1), ("fsdp", "tp"))
    logits = normal(1, (8, 8, VOCAB), F32)
    labels = jnp.concatenate([LABELS, LABELS])
    probe = jnp.concatenate([PROBE, PROBE])

    def loss(ce):
        return lambda l: jnp.sum(ce(l, labels) * probe)

    want = jax.value_and_grad(loss(dense_ce))(logits)
    with jax.set_mesh(m):
        placed = jax.device_put(logits, jax.sharding.NamedSharding(m, P("fsdp")))
        got = jax.jit(jax.value_and_grad(loss(
            lambda l, y: fusedpar.cross_entropy(l, y, axis="tp"))))(placed)
    assert_close(got[0], want[0], F32, "loss")
    assert_close(got[1], want[1], F32, "gradient")
