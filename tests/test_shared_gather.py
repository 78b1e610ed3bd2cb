"""Sequence-parallel ColumnLinears called on one input gather it once
(`fusedpar/_nn/_shared_gather.py`): the same values and gradients as dense layers, two
gathers fewer for three siblings, and no sharing across traces or distinct arrays."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from helpers import assert_close, mesh, normal

DIM, OUT = 64, 128


def _siblings(backend, fsdp_axis="fsdp"):
    keys = jax.random.split(jax.random.key(0), 3)
    layers = [fusedpar.ColumnLinear(DIM, OUT, key=k, sequence_parallel=True,
                                    fsdp_axis=fsdp_axis, backend=backend) for k in keys]
    dense = [eqx.nn.Linear(DIM, OUT, key=k) for k in keys]
    return layers, dense


def _loss(layers, x, distinct=False):
    # `x * 1` is an equal array but another object: each layer gathers its own.
    return sum(jnp.sum(jnp.sin(layer(x * 1 if distinct else x))) for layer in layers)


def _dense_loss(layers, x):
    return sum(jnp.sum(jnp.sin(jax.vmap(jax.vmap(layer))(x))) for layer in layers)


def _gathers(fn, *args) -> int:
    """All-gathers (reference) and ring steps in `fn`'s jaxpr: of a forward without
    FSDP, those of the layers' input gathers alone."""
    text = str(jax.make_jaxpr(fn)(*args))
    return text.count("all_gather[") + text.count("ppermute[")


@pytest.mark.parametrize("backend", ["reference", "ring"])
def test_siblings_on_global_arrays_gather_their_input_once(backend):
    m = mesh((2, 4), ("fsdp", "tp"))
    layers, dense = _siblings(backend)
    x = normal(0, (4, 32, DIM), jnp.float32)
    grad = jax.value_and_grad(_loss, argnums=(0, 1))
    with jax.set_mesh(m):
        got = jax.jit(grad)(fusedpar.shard(layers, m), x)
        plain = fusedpar.shard(_siblings(backend, None)[0], m)
        shared = _gathers(_loss, plain, x)
        apart = _gathers(lambda m, x: _loss(m, x, True), plain, x)
    want = jax.value_and_grad(_dense_loss, argnums=(0, 1))(dense, x)
    assert_close(got, want, jnp.float32, "value, weight and input gradients")
    assert shared > 0 and apart == 3 * shared, (apart, shared)  # one gather, not three


@pytest.mark.parametrize("stacked", ["both", "first"])
def test_stacked_siblings_vmapped_over_one_input(stacked):
    """Siblings built with `eqx.filter_vmap` (3 stacked), vmapped over their weights on
    one unbatched input, on the reference (its all_gather does not depend on w): x's
    gradient equals the dense layers'. The siblings' gradient of the gathered input
    (unbatched) was added in every batch element's reduce-scatter: the sibling's share 3
    times. `first`: a stacked layer first, then one of a single set of weights."""
    keys = jax.random.split(jax.random.key(1), 3)

    def pair(k):
        k1, k2 = jax.random.split(k)
        return tuple(fusedpar.ColumnLinear(16, 16, key=kk, sequence_parallel=True,
                                           backend="reference") for kk in (k1, k2))

    stack = eqx.filter_vmap(pair)(keys)
    single = pair(keys[0])[1]
    params, static = eqx.partition(stack, eqx.is_array)
    x = normal(2, (4, 8, 16), jnp.float32)

    def loss(params, single, x):
        def layers(p):
            a, b = eqx.combine(p, static)
            return a(x) + (b if stacked == "both" else single)(x)

        return jnp.sum(jnp.sin(jax.vmap(layers)(params)))

    def dense(layer):
        return lambda v: v @ layer.weight.T + layer.bias

    def dense_loss(params, single, x):
        def layers(p):
            a, b = eqx.combine(p, static)
            return dense(a)(x) + dense(b if stacked == "both" else single)(x)

        return jnp.sum(jnp.sin(jax.vmap(layers)(params)))

    m = mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(m):
        got = jax.jit(jax.grad(loss, argnums=2))(fusedpar.shard(params, m),
                                                 fusedpar.shard(single, m), x)
    assert_close(got, jax.grad(dense_loss, argnums=2)(params, single, x), jnp.float32,
                 "input gradient")


@pytest.mark.parametrize("check_vma", [True, False])
def test_siblings_inside_shard_map_gather_their_input_once(check_vma):
    m = mesh((2, 4), ("fsdp", "tp"))
    layers, dense = _siblings("ring")
    x = normal(1, (4, 32, DIM), jnp.float32)

    def step(layers, distinct, train=True):
        params, static = eqx.partition(layers, eqx.is_array)
        specs = fusedpar.param_specs(layers)

        def local(p, x):
            loss = lambda p, x: _loss(eqx.combine(p, static), x, distinct)
            if not train:
                return jax.lax.psum(loss(p, x), ("fsdp", "tp"))
            v, g = jax.value_and_grad(loss, argnums=(0, 1))(p, x)
            return jax.lax.psum(v, ("fsdp", "tp")), g

        out = (P(), (specs, P("fsdp", "tp", None))) if train else P()
        return jax.shard_map(local, mesh=m, in_specs=(specs, P("fsdp", "tp", None)),
                             out_specs=out, check_vma=check_vma), params

    sm, params = step(layers, False)
    (v, (gp, gx)) = jax.jit(sm)(params, x)
    want_v, (want_p, want_x) = jax.value_and_grad(_dense_loss, argnums=(0, 1))(dense, x)
    assert_close((v, gx), (want_v, want_x), jnp.float32, "value and input gradient")
    assert_close([g.weight for g in gp], [g.weight for g in want_p], jnp.float32, "weights")
    plain = _siblings("ring", None)[0]
    shared, apart = (_gathers(*step(plain, distinct, False), x) for distinct in (False, True))
    assert shared > 0 and apart == 3 * shared, (apart, shared)


@pytest.mark.parametrize("backend", ["reference", "ring"])
def test_siblings_reduce_scatter_their_input_gradient_once(backend):
    """In the backward the siblings' gradients of the shared gathered input come back to
    the first layer's op, whose own reduce-scatter sums them too: a third of the
    collectives of three separate layers, backward included (one ring and no other
    reduce-scatter; one all-gather and one reduce-scatter)."""
    m = mesh((2, 4), ("fsdp", "tp"))
    x = normal(3, (4, 32, DIM), jnp.float32)
    counts = {}
    with jax.set_mesh(m):
        plain = fusedpar.shard(_siblings(backend, None)[0], m)
        for distinct in (False, True):
            grad = jax.grad(lambda m, x: _loss(m, x, distinct), argnums=(0, 1))
            text = str(jax.make_jaxpr(grad)(plain, x))
            counts[distinct] = sum(text.count(f"{c}[") for c in
                                   ("all_gather", "ppermute", "reduce_scatter"))
    assert counts[False] > 0 and counts[True] == 3 * counts[False], counts


def test_siblings_without_a_joint_reduce_scatter_add_their_own(monkeypatch):
    """A backend whose reduce-scatter takes no addend (`Backend.run_adding` None: the
    kernels) gets the siblings' sum by one more reduce-scatter: the same gradients."""
    from fusedpar._core._backends import _backend

    monkeypatch.setitem(_backend.TABLE, "ring", dataclasses.replace(
        _backend.TABLE["ring"], run_adding=None))
    m = mesh((2, 4), ("fsdp", "tp"))
    layers, dense = _siblings("ring")
    x = normal(4, (4, 32, DIM), jnp.float32)
    grad = jax.value_and_grad(_loss, argnums=(0, 1))
    with jax.set_mesh(m):
        model = fusedpar.shard(layers, m)
        got = jax.jit(grad)(model, x)
        assert "reduce_scatter[" in str(jax.make_jaxpr(grad)(model, x))
    want = jax.value_and_grad(_dense_loss, argnums=(0, 1))(dense, x)
    assert_close(got, want, jnp.float32, "value, weight and input gradients")


def test_layers_that_differ_in_their_backward_gather_apart():
    """The first layer's op runs the others' input-gradient reduce-scatter: a layer that
    asks for another `reduce_dtype` (or backend, grad comm dtype) gathers its own."""
    m = mesh((2, 4), ("fsdp", "tp"))
    keys = jax.random.split(jax.random.key(0), 2)
    layers = [fusedpar.ColumnLinear(DIM, OUT, key=k, sequence_parallel=True,
                                    backend="reference", reduce_dtype=r)
              for k, r in zip(keys, (None, jnp.bfloat16))]
    x = normal(5, (4, 32, DIM), jnp.float32)
    with jax.set_mesh(m):
        plain = fusedpar.shard(layers, m)
        both = _gathers(_loss, plain, x)
        one = _gathers(_loss, plain[:1], x)
    assert one > 0 and both == 2 * one, (both, one)


def test_off_makes_every_layer_gather_its_own():
    """`_shared_gather.off()` (what bench/aot_input_grad.py compares against)."""
    from fusedpar._nn import _shared_gather

    m = mesh((2, 4), ("fsdp", "tp"))
    x = normal(6, (4, 32, DIM), jnp.float32)
    with jax.set_mesh(m):
        plain = fusedpar.shard(_siblings("reference", None)[0], m)
        shared = _gathers(_loss, plain, x)
        with _shared_gather.off():  # a new function: JAX would reuse `_loss`'s trace
            apart = _gathers(lambda m, x: _loss(m, x), plain, x)
    assert shared > 0 and apart == 3 * shared, (apart, shared)


def test_a_layer_in_another_trace_gathers_again():
    """The first layer's gathered input belongs to its trace: a sibling inside a
    `jax.checkpoint` (another trace, closing over the same array) gathers its own, and
    the one after it does not pick up the checkpoint's (a tracer of a finished trace)."""
    m = mesh((2, 4), ("fsdp", "tp"))
    layers, dense = _siblings("reference")

    def loss(layers, x):
        a, b, c = layers
        inner = jax.checkpoint(lambda: jnp.sum(jnp.sin(b(x))))()
        return jnp.sum(jnp.sin(a(x))) + inner + jnp.sum(jnp.sin(c(x)))

    x = normal(2, (4, 32, DIM), jnp.float32)
    grad = jax.value_and_grad(loss, argnums=(0, 1))
    with jax.set_mesh(m):
        got = jax.jit(grad)(fusedpar.shard(layers, m), x)
    want = jax.value_and_grad(_dense_loss, argnums=(0, 1))(dense, x)
    assert_close(got, want, jnp.float32, "value, weight and input gradients")
