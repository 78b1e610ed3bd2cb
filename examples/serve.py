# Serving a small GPT on 8 simulated devices: a batch of prompts prefilled into a KV cache
# whose heads are split over "tp" (and batch over "data"), then greedy decoding, one token
# per step, the cache donated and updated in place; the tokens are checked against the
# dense model recomputing every prefix from scratch.
import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # CPU

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fusedpar

VOCAB, DIM, HEADS, DEPTH, SLOTS = 64, 32, 4, 2, 16  # SLOTS: the cache's positions
HEAD = DIM // HEADS


class Block(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    out: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 6)
        self.q, self.k, self.v, self.out = (eqx.nn.Linear(DIM, DIM, key=k) for k in ks[:4])
        self.up = eqx.nn.Linear(DIM, 4 * DIM, key=ks[4])
        self.down = eqx.nn.Linear(4 * DIM, DIM, key=ks[5])

    def __call__(self, x, cache, start):
        # One example: x (t, DIM), the new positions start .. start + t - 1; cache
        # (2, HEADS, SLOTS, HEAD), the keys and values of the positions before.
        t = x.shape[0]
        q, k, v = (jax.vmap(p)(x).reshape(t, HEADS, HEAD).transpose(1, 0, 2)
                   for p in (self.q, self.k, self.v))
        cache = jnp.stack([jax.lax.dynamic_update_slice_in_dim(c, new, start, axis=1)
                           for c, new in zip(cache, (k, v))])
        seen = jnp.arange(SLOTS)[None, :] <= start + jnp.arange(t)[:, None]  # causal
        scores = jnp.einsum("hqd,hkd->hqk", q, cache[0]) / HEAD ** 0.5
        weights = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("hqk,hkd->qhd", weights, cache[1]).reshape(t, DIM)
        x = x + jax.vmap(self.out)(o)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x))), cache


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    positions: jax.Array
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, *ks = jax.random.split(key, 3 + DEPTH)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.positions = 0.1 * jax.random.normal(k2, (SLOTS, DIM))
        self.blocks = [Block(k) for k in ks]
        self.head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k3)

    def __call__(self, tokens, cache, start):  # tokens (t,); cache (DEPTH, 2, HEADS, ...)
        x = jax.vmap(self.embed)(tokens) + jax.lax.dynamic_slice_in_dim(
            self.positions, start, tokens.shape[0])
        caches = []
        for block, c in zip(self.blocks, cache):
            x, c = block(x, c, start)
            caches.append(c)
        return jax.vmap(self.head)(x), jnp.stack(caches)


def generate(model, prompts, steps, cache):
    """Greedy tokens after `prompts` (batch, t): one prefill, then a step per token. The
    model's arrays are arguments (not constants of the program); the cache is donated."""
    params, static = eqx.partition(model, eqx.is_array)
    traced = []

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params, tokens, cache, start):  # start: a traced int, so one trace per t
        traced.append(tokens.shape)
        run = jax.vmap(eqx.combine(params, static), in_axes=(0, 0, None))
        logits, cache = run(tokens, cache, start)
        return jnp.argmax(logits[:, -1], axis=-1), cache  # vocabulary-sharded: still fine

    token, cache = step(params, prompts, cache, jnp.int32(0))
    out = [token]
    for i in range(steps - 1):
        token, cache = step(params, token[:, None], cache, jnp.int32(prompts.shape[1] + i))
        out.append(token)
    return jnp.stack(out, axis=1), cache, traced


def empty_cache(batch, sharding=None):
    cache = jnp.zeros((batch, DEPTH, 2, HEADS, SLOTS, HEAD))
    return cache if sharding is None else jax.device_put(cache, sharding)


dense = GPT(jax.random.key(0))
plan = {"embed": "row", "blocks.*.[qkv]": "column", "blocks.*.out": "row",
        "blocks.*.up": "column", "blocks.*.down": "row", "head": "column"}
mesh = jax.make_mesh((2, 4), ("data", "tp"), axis_types=(AxisType.Auto,) * 2)
prompts = jax.random.randint(jax.random.key(1), (4, 6), 0, VOCAB)  # (batch, t)
steps = 8

with jax.set_mesh(mesh):
    model = fusedpar.shard(fusedpar.parallelize(dense, plan), mesh)
    # The cache as q, k and v leave their column layers: heads over "tp"; batch over "data".
    cache = empty_cache(4, NamedSharding(mesh, P("data", None, None, "tp")))
    tokens, cache, traced = generate(model, prompts, steps, cache)
print("tokens:", tokens.tolist())
print("traced:", traced)  # once for the prompts, once for one token: no retrace per step
print("cache:", cache.sharding.spec)

# The dense model, no mesh, no cache reuse: the whole sequence from position 0 at once.
# Attention is causal, so each position's logits see only its prefix: their greedy
# choices must be the tokens generated.
sequence = jnp.concatenate([prompts, tokens[:, :-1]], axis=1)
logits, _ = jax.vmap(dense, in_axes=(0, 0, None))(sequence, empty_cache(4), 0)
chosen = jnp.argmax(logits[:, prompts.shape[1] - 1:], axis=-1)
print("equal to the dense model's:", bool((chosen == tokens).all()))
