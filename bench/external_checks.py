"""The replay against numbers nobody here tuned to: published times and speed-ups of
other projects' all-gather matmuls, set beside what `fusedpar.aot.predict` says of the
same shapes compiled here (deviceless).

    python bench/external_checks.py          # -> results-external.json, RESULTS-external.md
    python bench/external_checks.py --markdown-only

- JAX's Mosaic GPU collective matmul docs: all-gather matmul in float16, per device
  x (1024, 4096) gathered along its rows @ w (4096, 4096) (the local shard of a
  column-sharded weight), forward, on 2, 4 and 8 H100s: their fused Pallas kernel
  102 / 212 / 436 us, all-gather + cuBLAS 147 / 290 / 565 us. Here: fusedpar's `pallas`
  (`pallas_gpu`: a ring whose steps are Mosaic GPU kernels) and `ring` beside the first,
  XLA's own program (`xla`: `x @ w` under `jax.jit`, x sharded on rows, w on columns,
  cuBLAS GEMMs) and fusedpar's `reference` (all_gather + dot in `shard_map`) beside the
  second.
- vLLM's TPU Pallas all-gather matmul PR: its kernel against XLA's all-gather + matmul on
  v6e at TP=8, bfloat16, x (m/8, k) gathered @ w (k, n/8): 1.53x at m=2048, n=51200,
  k=5120; 1.19x at 2048/57344/8192; 1.09x at 4096/51200/5120. Here: XLA's program (with
  its defaults and with its collective matmul) over fusedpar's fused TPU kernel (`pallas`:
  its transfers are remote DMAs inside one Mosaic kernel, which the replay times from the
  plan the kernel's call carries) and over the `ring`.

Every row also records the compiled program's temporary memory
(`compiled.memory_analysis().temp_size_in_bytes`). Needs the aot extra.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fusedpar import aot  # noqa: E402  (sets the environment before JAX starts)
from fusedpar._compile import _hlo_ring_kernel  # noqa: E402

CACHE = HERE / "results-external.json"
RESULTS = HERE / "RESULTS-external.md"
# JAX's Mosaic GPU collective matmul docs (H100s -> us).
MOSAIC_GPU_US = {2: 102, 4: 212, 8: 436}
ALL_GATHER_CUBLAS_US = {2: 147, 4: 290, 8: 565}
# vLLM's TPU all-gather matmul PR, v6e TP=8: (m, n, k) -> XLA's time over the kernel's.
VLLM_RATIO = {(2048, 51200, 5120): 1.53, (2048, 57344, 8192): 1.19,
              (4096, 51200, 5120): 1.09}
GPU_ROWS = ("xla", "reference", "ring", "pallas")
TPU_ROWS = ("xla", "xla (collective matmul)", "reference", "ring", "pallas")


def gather_matmul_program(mesh, rows, k, cols, dtype):
    """`(jitted, args)`: `x @ w` under `jax.jit` as a user writes the all-gather matmul
    without fusedpar: global x (n * rows, k) sharded on rows, w (k, n * cols) on columns,
    the product (n * rows, n * cols) constrained to columns; XLA's partitioner gathers x
    and multiplies each device's (rows * n, k) @ (k, cols)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.shape["x"]
    out = NamedSharding(mesh, P(None, "x"))
    x = jax.ShapeDtypeStruct((n * rows, k), dtype, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((k, n * cols), dtype, sharding=NamedSharding(mesh, P(None, "x")))
    return jax.jit(lambda x, w: jax.lax.with_sharding_constraint(jnp.matmul(x, w), out)), (x, w)


def _row(target, mesh, label, rows, k, cols, dtype, cublas) -> dict:
    """One variant compiled and replayed: predicted, compute and communication (us),
    whether the time is a floor (fused TPU kernels), temporary memory (MiB)."""
    import jax

    from fusedpar._compile import _aot_compare, _aot_programs as progs
    from fusedpar._core import _primitives as prims

    backend, _, settings = label.partition(" (")
    settings = settings.rstrip(")") or _aot_compare.DEFAULT
    start = time.perf_counter()
    try:
        if backend == "xla":
            fn, args = gather_matmul_program(mesh, rows, k, cols, dtype)
        else:
            fn, args = progs.op_program(mesh, prims.AG_ROWS, backend, backward=False,
                                        rows=rows, k=k, cols=cols, dtype=dtype)
        with jax.set_mesh(mesh):
            compiled = fn.lower(*args).compile(compiler_options=_aot_compare.options(
                target, backend, settings, cublas) or None)
    except Exception as e:  # noqa: BLE001 - one failing row must not hide the rest
        return dict(variant=label, error=f"{type(e).__name__}: {str(e)[:200]}")
    seconds = time.perf_counter() - start
    p = aot.predict(compiled, mesh)
    return dict(variant=label, predicted_us=round(p.seconds * 1e6, 1),
                compute_us=round(p.compute * 1e6, 1),
                communication_us=round(p.communication * 1e6, 1),
                dot_gflops=round(p.dot_flops / 1e9, 1),
                floor=any(_hlo_ring_kernel.UNREAD in u for u in p.unread),  # plan unread
                temp_mib=round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
                compile_s=round(seconds, 1), unread=list(p.unread))


def run(force=False) -> dict:
    import jax.numpy as jnp

    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}

    def case(key, target, rows, k, cols, dtype, labels, cublas=False):
        if key in cache and not force:
            return
        mesh = aot.mesh(target, None, ("x",), make_mesh=True)
        cache[key] = [_row(target, mesh, label, rows, k, cols, dtype, cublas)
                      for label in labels]
        CACHE.write_text(json.dumps(cache, indent=1))
        print(key, [(r["variant"], r.get("predicted_us", r.get("error")))
                    for r in cache[key]], flush=True)

    for n in MOSAIC_GPU_US:
        case(f"mosaic_gpu|{n}", f"h100x{n}", 1024, 4096, 4096, jnp.float16, GPU_ROWS,
             cublas=True)
    for (m, n, k) in VLLM_RATIO:
        case(f"vllm|{m}x{n}x{k}", "v6e:2x4", m // 8, k, n // 8, jnp.bfloat16, TPU_ROWS)
    return cache


def _by(rows) -> dict:
    return {r["variant"]: r for r in rows if "error" not in r}


def _us(r) -> str:
    return ("-" if r is None else (">= " if r["floor"] else "") + f"{r['predicted_us']:,.0f}")


def markdown(cache) -> str:
    """Two tables: the H100 times against JAX's, the v6e ratios against vLLM's."""
    lines = ["| H100s | pallas (us) | JAX's Mosaic GPU kernel (us) | pallas / JAX's | "
             "xla (us) | reference (us) | all-gather + cuBLAS (us) | xla / published | "
             "ring (us) | temp memory xla / pallas (MiB) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in MOSAIC_GPU_US:
        by = _by(cache.get(f"mosaic_gpu|{n}", []))
        if not by:
            continue
        get = by.get
        pallas, xla = get("pallas"), get("xla")
        lines.append(
            f"| {n} | {_us(pallas)} | {MOSAIC_GPU_US[n]} | "
            f"{pallas['predicted_us'] / MOSAIC_GPU_US[n]:.2f} | {_us(xla)} | "
            f"{_us(get('reference'))} | {ALL_GATHER_CUBLAS_US[n]} | "
            f"{xla['predicted_us'] / ALL_GATHER_CUBLAS_US[n]:.2f} | {_us(get('ring'))} | "
            f"{xla['temp_mib']:,.0f} / {pallas['temp_mib']:,.0f} |")
    lines += ["", "| m, n, k | xla (us) | xla, collective matmul (us) | pallas (us) | "
              "ring (us) | xla / pallas | xla / ring | vLLM's kernel: xla / kernel |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (m, n, k), published in VLLM_RATIO.items():
        by = _by(cache.get(f"vllm|{m}x{n}x{k}", []))
        if not by:
            continue
        xla = min((by[v]["predicted_us"] for v in ("xla", "xla (collective matmul)")
                   if v in by), default=0)
        pallas, ring = by.get("pallas"), by.get("ring")
        over = (f"<= {xla / pallas['predicted_us']:.2f}" if pallas and pallas["floor"] else
                f"{xla / pallas['predicted_us']:.2f}" if pallas else "-")
        lines.append(f"| {m}, {n}, {k} | {_us(by.get('xla'))} | "
                     f"{_us(by.get('xla (collective matmul)'))} | {_us(pallas)} | "
                     f"{_us(ring)} | {over} | "
                     f"{xla / ring['predicted_us'] if ring else 0:.2f} | {published:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="recompile cached cases")
    p.add_argument("--markdown-only", action="store_true")
    args = p.parse_args(argv)
    cache = json.loads(CACHE.read_text()) if args.markdown_only else run(args.force)
    text = markdown(cache)
    RESULTS.write_text("# The replay against published all-gather matmuls\n\nMade by "
                       "`python bench/external_checks.py` (its docstring says what each "
                       "row is); `docs/aot.md` says how close and why they differ.\n\n"
                       + text + "\n")
    print(text)


if __name__ == "__main__":
    main()
