"""Sequence parallelism in the user's own shard_map takes whole sequences: a model that
applies a sequence-parallel layer per token under jax.vmap is refused by shard_map_specs
(with the reason and the fix), and one that applies it to the (batch, seq) array runs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedpar
from helpers import mesh

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
