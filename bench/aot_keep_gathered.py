"""Time against memory: `auto` with `keep_gathered=False` on the tensor-parallel styles.

    python bench/aot_keep_gathered.py --targets v5e:2x4 --programs mlp
    python bench/aot_keep_gathered.py --markdown-only

A sequence-parallel layer keeps what its ring gathers for the backward by default: a
`Column` its gathered input (for the weight gradient), a `Row` the gathered cotangent
(for both gradients). `Column(keep_gathered=False)` / `Row(keep_gathered=False)` keep
nothing and gather again in the backward: less temporary memory, one more ring per
layer. For each target and training program (mlp, block) this compiles `auto` with
`keep_gathered=False` on the Column styles, the Row styles, and both, replays each
(`fusedpar.aot.predict`) and records its temporary memory
(`compiled.memory_analysis()`), beside the cached rows of `bench/aot_compare.py`
(`results-aot-compare.json`: the best xla row and auto as it is by default). Rows are
cached in `results-aot-keep-gathered.json`; the table is printed as Markdown. Needs the
aot extra.
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

CACHE = HERE / "results-aot-keep-gathered.json"
PROGRAMS = ("mlp", "block")  # the training steps: a forward alone keeps nothing
# What keeps nothing: the label, and (Column's keep_gathered, Row's).
VARIANTS = (("Column", (False, True)), ("Row", (True, False)), ("both", (False, False)))


def run(targets, programs) -> dict:
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    for name in targets:
        target, _, variant = name.partition(" ")
        for program in programs:
            for label, keep in VARIANTS:
                (row,) = _aot_compare.compare(target, program, cublas=variant == "cublas",
                                              rows=(("auto", _aot_compare.DEFAULT),),
                                              keep_gathered=keep)
                cache[f"{name}|{program}|{label}"] = {
                    "seconds": row.seconds, "temp_mib": row.temp_mib, "error": row.error,
                    "floor": row.floor}
                CACHE.write_text(json.dumps(cache, indent=1))
                print(f"{name}: {program}: keep_gathered=False on {label}: "
                      f"{row.seconds * 1e6:,.0f} us, {row.temp_mib or 0:,.0f} MiB "
                      f"{row.error}", flush=True)
    return cache


def _cell(seconds, temp, xla_s, xla_temp) -> str:
    """'us (x vs xla) / MiB (x of xla)'."""
    if not seconds:
        return "-"
    speed = f" ({xla_s / seconds:.2f}x)" if xla_s else ""
    mem = f" ({temp / xla_temp:.2f})" if temp is not None and xla_temp else ""
    return f"{aot_compare._us(seconds)}{speed} / {temp or 0:,.0f}{mem}"


def markdown(cache) -> str:
    compared = aot_compare._load()
    lines = ["| target | program | best xla: us / MiB | auto | keep_gathered=False on "
             "Column | on Row | on both |", "|---|---|" + "---:|" * 5]
    keys = sorted({k.rsplit("|", 1)[0] for k in cache}, key=aot_compare._order)
    for key in keys:
        name, program = key.split("|")
        rows = [r for r in compared.get(key, []) if not r["error"]]
        xla = min((r for r in rows if r["backend"] == "xla"), key=lambda r: r["seconds"],
                  default=None)
        auto = next((r for r in rows if r["backend"] == "auto"), None)
        xs, xm = (xla["seconds"], xla.get("temp_mib")) if xla else (0.0, None)
        cells = [_cell(auto["seconds"], auto.get("temp_mib"), xs, xm) if auto else "-"]
        for label, _ in VARIANTS:
            r = cache.get(f"{key}|{label}", {})
            cells.append(_cell(r.get("seconds", 0.0), r.get("temp_mib"), xs, xm))
        lines.append(f"| {name} | {program} | {aot_compare._us(xs)} / {xm or 0:,.0f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    aot_compare.variant_main(argv, __doc__, CACHE, run, markdown, PROGRAMS)


if __name__ == "__main__":
    main()
