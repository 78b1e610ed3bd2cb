"""Relative error of quantized communication on standard-normal data (docs/quantized.md).

For each ring size N and payload: the reduce-scatter's result against the exact float32
sum, with the accumulator sent in float32, bfloat16 (`reduce_dtype`), or int8/fp8
(`comm_dtype`: requantized at every hop on the ring, quantized once per partial product
on the reference backend); and the all-gathers' (ag_rows, ag_cols) result against
float32 inputs. Relative error: ||got - exact||_F / ||exact||_F, float32 inputs, per
device x (256, 512) and w (512, 256) for the reduce-scatter (K sharded), x (256, 512) and
w (512, 256) travelling blocks for the all-gathers.

    python bench/quantized_error.py
    python bench/quantized_error.py --aot   # transfers compiled for 8 x H100 and v5e
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
if "--aot" not in __import__("sys").argv:
    jax.config.update("jax_platforms", "cpu")

import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fusedpar  # noqa: E402

ROWS, K, COLS = 256, 512, 256


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def reduce_scatter(n, backend, **kw):
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))
    x, w = _normal(0, (ROWS, n * K)), _normal(1, (n * K, COLS))
    f = jax.jit(jax.shard_map(
        lambda x, w: fusedpar.matmul_reduce_scatter(x, w, "x", backend=backend, **kw),
        mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x")))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return _rel(f(x, w), exact)


def gather(n, gather_, dim, **kw):
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))
    if gather_ == "lhs":
        x, w, specs = _normal(0, (n * ROWS, K)), _normal(1, (K, COLS)), (P("x"), P())
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    else:
        x, w, specs = _normal(0, (n * 8, K)), _normal(1, (K, n * COLS)), (P("x"), P(None, "x"))
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    lhs = gather_ == "lhs"  # then every device has the whole product: keep one copy
    f = jax.jit(jax.shard_map(
        lambda x, w: fusedpar.all_gather_matmul(x, w, "x", gather=gather_, dim=dim,
                                                backend="ring", **kw)[None if lhs else ...],
        mesh=mesh, in_specs=specs, out_specs=P("x")))
    y = f(x, w)
    return _rel(y[0] if lhs else y, exact)


def main():
    payloads = [("float32", {}), ("bfloat16", dict(reduce_dtype=jnp.bfloat16)),
                ("int8", dict(comm_dtype=jnp.int8)),
                ("float8_e4m3fn", dict(comm_dtype=jnp.float8_e4m3fn))]
    print("| reduce-scatter accumulator | N=2 | N=4 | N=8 |")
    print("|---|---|---|---|")
    for name, kw in payloads:
        backends = [("ring", "requantized every hop")] if "comm_dtype" in kw else [("ring", "")]
        if "comm_dtype" in kw:
            backends.append(("reference", "each partial quantized once"))
        for backend, how in backends:
            label = f"{name} ({backend}{': ' + how if how else ''})"
            errs = [reduce_scatter(n, backend, **kw) for n in (2, 4, 8)]
            print(f"| {label} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
    print()
    print("| all-gather operand | N | ag_rows (x rows) | ag_cols (w columns) |")
    print("|---|---|---|---|")
    for name, kw in payloads[2:]:
        for n in (2, 8):
            print(f"| {name} | {n} | {gather(n, 'lhs', 0, **kw):.2e} | "
                  f"{gather(n, 'rhs', 1, **kw):.2e} |")




def _transfers(jaxpr):
    """Bytes of each ppermute in `jaxpr`."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            found.append(sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _transfers(sub)
    return found


def bytes_per_transfer(n=8, rows=1024, k=4096, cols=4096):
    """Bytes one ring transfer carries, read from the traced program of the `ring`
    backend (unidirectional, unrolled) with per-device x (rows, k) @ w (k, cols)."""
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))
    bf16 = jnp.bfloat16
    problems = {  # name: (op, kwargs, global x, global w, specs)
        "ag_rows (x travels)": (fusedpar.all_gather_matmul, dict(gather="lhs", dim=0),
                                (n * rows, k), (k, cols), (P("x"), P())),
        "ag_cols (w column block)": (fusedpar.all_gather_matmul, dict(gather="rhs", dim=1),
                                     (n * rows, k), (k, n * cols), (P("x"), P(None, "x"))),
        "ag_contract (w row block)": (fusedpar.all_gather_matmul, dict(gather="rhs", dim=0),
                                      (n * rows, n * k), (n * k, cols), (P("x"), P("x"))),
        "rs_rows (accumulator)": (fusedpar.matmul_reduce_scatter, dict(dim=0),
                                  (rows, n * k), (n * k, cols), (P(None, "x"), P("x"))),
    }
    out = {}
    for name, (op, kw, xs, ws, specs) in problems.items():
        row = {}
        for label, extra in (("bf16", {}), ("int8", dict(comm_dtype=jnp.int8)),
                             ("fp8", dict(comm_dtype=jnp.float8_e4m3fn))):
            f = jax.shard_map(
                lambda x, w, extra=extra: op(x, w, "x", backend="ring", bidirectional=False,
                                             unroll=True, **kw, **extra),
                mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=False)
            sent = _transfers(jax.make_jaxpr(f)(jax.ShapeDtypeStruct(xs, bf16),
                                                jax.ShapeDtypeStruct(ws, bf16)).jaxpr)
            # A unidirectional ring makes n - 1 transfers (values and scales are two
            # ppermutes of one transfer).
            assert sum(sent) % (n - 1) == 0, sent
            row[label] = sum(sent) // (n - 1)
        out[name] = row
    return out


def print_bytes():
    print()
    print("| transfer (N=8, per device x 1024x4096 @ w 4096x4096, bf16 inputs) | bf16 "
          "(rs: f32 accumulator) | int8 + scales | fp8 + scales | ratio to bf16 |")
    print("|---|---|---|---|---|")
    for name, row in bytes_per_transfer().items():
        ratio = row["int8"] / row["bf16"]
        print(f"| {name} | {row['bf16']:,} | {row['int8']:,} | {row['fp8']:,} | "
              f"{ratio:.4f} |")


def compiled_transfers(targets=("h100x8", "v5e:2x4"), n=8, rows=1024, k=4096, cols=4096):
    """The operands of every collective-permute in the ring's programs compiled for
    hardware that is not here (`fusedpar.aot`, needs the aot extra): ag_rows and rs_rows,
    unidirectional, per device x (rows, k) @ w (k, cols), bfloat16 inputs."""
    import re

    from jax.sharding import NamedSharding

    from fusedpar import aot

    for target in targets:
        mesh = aot.mesh(target, (n,), ("x",))
        options = aot.compiler_options(target)
        for name, op, kw, xs, ws, specs in [
            ("ag_rows", fusedpar.all_gather_matmul, dict(gather="lhs", dim=0),
             (n * rows, k), (k, cols), (P("x"), P())),
            ("rs_rows", fusedpar.matmul_reduce_scatter, dict(dim=0),
             (rows, n * k), (n * k, cols), (P(None, "x"), P("x")))]:
            for comm in (None, jnp.int8, jnp.float8_e4m3fn):
                f = jax.jit(jax.shard_map(
                    lambda x, w, op=op, kw=kw, comm=comm: op(
                        x, w, "x", backend="ring", bidirectional=False, comm_dtype=comm, **kw),
                    mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=False))
                args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, sp))
                        for s, sp in zip((xs, ws), specs)]
                text = f.lower(*args).compile(compiler_options=options).as_text()
                sent = set(re.findall(r"(?:s8|f8e4m3fn|bf16|f32)\[[0-9,]+\]", " ".join(
                    re.findall(r"= (\(?[^=]*?\)?) collective-permute(?:-start)?\(", text))))
                print(f"| {target} | {name} | {getattr(comm, '__name__', 'None')} | "
                      f"{', '.join(sorted(sent))} |")


if __name__ == "__main__":
    import sys

    if "--aot" in sys.argv:
        compiled_transfers()
    else:
        main()
        print_bytes()
