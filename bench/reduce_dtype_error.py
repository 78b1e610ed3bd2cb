"""What a reduce-scatter's partial sums in bfloat16 cost in accuracy, beside what XLA does.

    python bench/reduce_dtype_error.py          # 8 simulated CPU devices; prints Markdown

A row-parallel layer's output is `sum_i x_i @ w_i` over the ring, reduce-scattered. The
partial sums that travel the ring are float32 by default (`reduce_dtype=None`); with
`reduce_dtype=jnp.bfloat16` they travel, and are added, in bfloat16: half the bytes on
the links. XLA's own partitioning of the same matmul (a user's `jax.jit` with
shardings) reduce-scatters the bfloat16 products: NCCL and the TPU's ICI add bfloat16
partial sums. This prints, for bfloat16 inputs, the error against the float64 product
(relative Frobenius norm, and the largest element's error relative to the largest
element) of: the ring and the reference with float32 and with bfloat16 partial sums,
the XLA-style program (`psum_scatter` of a bfloat16 `x @ w`; XLA's CPU runtime adds the
parts once), and that program's arithmetic on GPUs, NCCL's ring, emulated in numpy.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fusedpar  # noqa: E402


def _errors(got, want):
    got = np.asarray(got, np.float64)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    top = np.max(np.abs(got - want)) / np.max(np.abs(want))
    return rel, top


def _nccl_style(x, w, n):
    """What XLA's program gives on GPUs: each device's product rounded to bfloat16 (the
    dot's result dtype), then a ring reduce-scatter (NCCL's) that adds the arriving
    bfloat16 sum to the device's bfloat16 part and rounds, hop by hop. Emulated in
    numpy (float32 adds, bfloat16 roundings) in the order a unidirectional ring adds."""
    bf16 = jnp.bfloat16
    xs = np.split(np.asarray(x, np.float32), n, axis=1)
    ws = np.split(np.asarray(w, np.float32), n, axis=0)
    parts = [np.asarray((a @ b).astype(bf16), np.float32) for a, b in zip(xs, ws)]
    blocks = []
    for b in range(n):
        rows = slice(b * x.shape[0] // n, (b + 1) * x.shape[0] // n)
        acc = parts[(b + 1) % n][rows]
        for hop in range(2, n + 1):  # from device b+1 round to b
            acc = np.asarray((acc + parts[(b + hop) % n][rows]).astype(bf16), np.float32)
        blocks.append(acc)
    return np.concatenate(blocks)


def run(n=8, rows=512, k=512, cols=1024, seed=0):
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, n * k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (n * k, cols), jnp.float32).astype(jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    x = jax.device_put(x, jax.NamedSharding(mesh, P(None, "x")))
    w = jax.device_put(w, jax.NamedSharding(mesh, P("x")))
    spec = dict(mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"))

    def op(backend, reduce_dtype):
        return jax.jit(jax.shard_map(lambda x, w: fusedpar.matmul_reduce_scatter(
            x, w, "x", dim=0, backend=backend, reduce_dtype=reduce_dtype), **spec))

    xla = jax.jit(jax.shard_map(lambda x, w: jax.lax.psum_scatter(
        jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), "x",
        scatter_dimension=0, tiled=True), **spec))
    rows_out = [("XLA-style: bf16 products reduce-scattered", xla(x, w)),
                ("NCCL-style ring (emulated): bf16 products, rounded at every hop",
                 _nccl_style(x, w, n))]
    for backend in ("reference", "ring"):
        for rd in (jnp.float32, jnp.bfloat16):
            rows_out.append((f"{backend}, reduce_dtype={jnp.dtype(rd).name}",
                             op(backend, rd)(x, w)))
    return [(name, *_errors(out, want)) for name, out in rows_out]


def main():
    lines = ["| ring | program | rel. error (Frobenius) | largest error / largest |",
             "|---:|---|---:|---:|"]
    for n in (2, 4, 8):
        for name, rel, top in run(n):
            lines.append(f"| {n} | {name} | {rel:.2e} | {top:.2e} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
