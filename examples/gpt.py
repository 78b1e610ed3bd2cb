# A small Equinox GPT trained on 8 simulated devices: dense, TP, TP+SP and FSDP x TP plans,
# and FSDP x TP with int8 weight gathers and fp8 sequence-parallel activation gathers.
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # CPU

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType

import fusedpar
from fusedpar import FSDP, Column, Row

VOCAB, DIM, HEADS, SEQ, BATCH, DEPTH = 64, 32, 4, 16, 8, 2


class Attention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.q, self.k, self.v, self.out = (eqx.nn.Linear(DIM, DIM, key=k) for k in keys)

    def __call__(self, x):  # x: (seq, dim), one example, as Equinox layers take it
        # The heads this device computes: all of them on global arrays, HEADS / tp inside
        # shard_map, where q, k and v hold this device's columns.
        heads = fusedpar.local_size(HEADS, "tp")
        q, k, v = (jax.vmap(p)(x).reshape(SEQ, heads, -1) for p in (self.q, self.k, self.v))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return jax.vmap(self.out)(jnp.einsum("hqk,khd->qhd", weights, v).reshape(SEQ, -1))


class Block(eqx.Module):
    norm1: eqx.nn.RMSNorm
    attn: Attention
    norm2: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.RMSNorm(DIM), eqx.nn.RMSNorm(DIM)
        self.attn = Attention(k1)
        self.up, self.down = eqx.nn.Linear(DIM, 4 * DIM, key=k2), eqx.nn.Linear(4 * DIM, DIM, key=k3)

    def __call__(self, x):
        x = x + self.attn(jax.vmap(self.norm1)(x))
        h = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x)))
        return x + jax.vmap(self.down)(h)


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, *keys = jax.random.split(key, 3 + DEPTH)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.pos = eqx.nn.Embedding(SEQ, DIM, key=k2)
        self.blocks = [Block(k) for k in keys]
        self.norm = eqx.nn.RMSNorm(DIM)
        self.head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k3)

    def __call__(self, tokens):  # (seq,) -> logits (seq, vocab)
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos)(jnp.arange(SEQ))
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss(model, tokens, labels):
    logits = jax.vmap(model)(tokens)  # (batch, seq, vocab): vocab sharded over "tp"
    per_token = fusedpar.cross_entropy(logits, labels, axis="tp")  # label -100: ignored
    return per_token.sum() / (labels != -100).sum()


LAYERS = {"blocks.*.attn.[qkv]": "column", "blocks.*.attn.out": "row",
          "blocks.*.up": "column", "blocks.*.down": "row", "head": "column"}
SP = {p: (Column if s == "column" else Row)(sequence_parallel=True) for p, s in LAYERS.items()}
PLANS = {
    "TP": {"embed": "row", **LAYERS},
    "TP+SP": {"embed": Row(sequence_parallel=True), **SP},
    "FSDPxTP": {"embed": Row(sequence_parallel=True), **SP, "*": FSDP()},
    # The same, sending less: each FSDP weight gather in int8 (one scale per row of each
    # shard), each sequence-parallel Column's input gather in fp8 (one scale per token).
    # Each layer's two styles in one tuple: a dict keeps one value per key, so a second
    # "head" entry would replace the head's Column (an FSDP-only head, whose logits
    # cross_entropy must then reshard).
    "FSDPxTP-q8": {"embed": (Row(sequence_parallel=True), FSDP()),
                   **{p: (Column(sequence_parallel=True, comm_dtype=jnp.float8_e4m3fn)
                          if s == "column" else Row(sequence_parallel=True),
                          FSDP(comm_dtype=jnp.int8))
                      for p, s in LAYERS.items()}},
}


def train(model, tokens, labels, steps=3, lr=0.5):
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    losses = []
    for _ in range(steps):
        value, grads = step(model, tokens, labels)
        # eqx.apply_updates skips leaves without a gradient (a MultiheadAttention's
        # dropout rate, say), where a tree map of p - lr * g would meet None.
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -lr * g, grads))
        losses.append(float(value))
    return model, losses


model = GPT(jax.random.key(0))
data = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)
tokens, labels = data[:, :-1], data[:, 1:].at[:, :2].set(-100)  # the first two ignored

mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
_, dense = train(model, tokens, labels)
print(f"dense    losses {[round(v, 5) for v in dense]}")
for name, plan in PLANS.items():
    parallel = fusedpar.parallelize(model, plan)
    with jax.set_mesh(mesh):
        _, losses = train(fusedpar.shard(parallel, mesh), tokens, labels)
    diff = max(abs(a - b) for a, b in zip(losses, dense))
    print(f"{name:8s} losses {[round(v, 5) for v in losses]}  max |loss - dense| {diff:.1e}"
          f"  final loss {losses[-1] / dense[-1] - 1:+.3%} of dense")

print(fusedpar.describe(fusedpar.parallelize(model, PLANS["FSDPxTP"])))

# The TP model in your own shard_map: specs derived from a trace of the model.
parallel = fusedpar.parallelize(model, PLANS["TP"])
(params_spec, x_spec), out_spec = fusedpar.shard_map_specs(
    parallel, tokens, call=lambda m, t: jax.vmap(m)(t))
print(f"shard_map specs: tokens {x_spec}, logits {out_spec}")
local = jax.jit(jax.shard_map(lambda m, t: jax.vmap(m)(t), mesh=mesh,
                              in_specs=(params_spec, x_spec), out_specs=out_spec))
dense_logits = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(model, tokens)
diff = jnp.max(jnp.abs(local(parallel, tokens) - dense_logits))
print(f"shard_map logits: max |local - dense| {float(diff):.1e}")
