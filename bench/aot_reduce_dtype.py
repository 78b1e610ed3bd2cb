"""What `auto` would be with bfloat16 partial sums, beside XLA's own program.

    python bench/aot_reduce_dtype.py --targets h100x8 --programs rs_rows,block
    python bench/aot_reduce_dtype.py --markdown-only

fusedpar's reduce-scatters (and its RowLinear psum) sum and send their partial sums in
float32 by default (`reduce_dtype=None`); XLA's own partitioning of the same program (and
Megatron) sums in the result dtype, bfloat16 here: half the bytes. For each target and
program this compiles `auto` with `reduce_dtype=jnp.bfloat16` (the ops' argument, the
layers' and styles' `reduce_dtype=`), replays it (`fusedpar.aot.predict`) and puts it
beside the cached rows of `bench/aot_compare.py` (`results-aot-compare.json`: the best
xla row and auto with float32 sums). Rows are cached in `results-aot-reduce-dtype.json`;
the table is printed as Markdown. Needs the aot extra. The accuracy side is
`bench/reduce_dtype_error.py`'s.
"""

from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fusedpar import aot  # noqa: E402,F401  (sets the environment before JAX starts)
from fusedpar._compile import _aot_compare  # noqa: E402

import aot_compare  # noqa: E402

CACHE = HERE / "results-aot-reduce-dtype.json"


def run(targets, programs) -> dict:
    import jax.numpy as jnp

    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    for name in targets:
        target, _, variant = name.partition(" ")
        for program in programs:
            (row,) = _aot_compare.compare(target, program, cublas=variant == "cublas",
                                          rows=(("auto", _aot_compare.DEFAULT),),
                                          reduce_dtype=jnp.bfloat16)
            cache[f"{name}|{program}"] = {"seconds": row.seconds, "error": row.error,
                                          "floor": row.floor}
            CACHE.write_text(json.dumps(cache, indent=1))
            print(f"{name}: {program}: auto, bfloat16 sums {row.seconds * 1e6:,.0f} us "
                  f"{row.error}", flush=True)
    return cache


def markdown(cache) -> str:
    compared = aot_compare._load()
    lines = ["| target | program | best xla | auto, float32 sums | auto, bfloat16 sums | "
             "vs best xla: float32 | bfloat16 |", "|---|---|" + "---:|" * 5]
    for key in sorted(cache, key=aot_compare._order):
        name, program = key.split("|")
        rows = {aot_compare._label(r["backend"], r["settings"]): r
                for r in compared.get(key, []) if not r["error"]}
        xla = min((r["seconds"] for k, r in rows.items() if k.startswith("xla")),
                  default=0.0)
        f32, bf16 = rows.get("auto", {}).get("seconds", 0.0), cache[key]["seconds"]
        # ">=": fused TPU kernels, whose transfers the replay cannot see (a floor).
        floors = [">= " if r.get("floor") else "" for r in (rows.get("auto", {}), cache[key])]
        ratio = [f"{xla / s:.2f}x" if s and xla else "-" for s in (f32, bf16)]
        lines.append(f"| {name} | {program} | {aot_compare._us(xla)} | "
                     f"{floors[0]}{aot_compare._us(f32)} | {floors[1]}{aot_compare._us(bf16)} | "
                     f"{ratio[0]} | {ratio[1]} |")
    return "\n".join(lines)


def main(argv=None):
    aot_compare.variant_main(argv, __doc__, CACHE, run, markdown, _aot_compare.PROGRAMS)


if __name__ == "__main__":
    main()
