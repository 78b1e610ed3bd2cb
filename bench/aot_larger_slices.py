"""`auto` against XLA's own program on a slice of 16 TPU chips.

    python bench/aot_larger_slices.py                      # v5e:4x4, v6e:4x4: mlp, block, prefill
    python bench/aot_larger_slices.py --markdown-only

The comparison of `bench/aot_compare.py` (`python -m fusedpar.aot --compare`) at twice
the ring: the program written without fusedpar, compiled with XLA's defaults and with its
collective-matmul settings (and with the SparseCore offload where the chips have
SparseCores), against `auto`, each replayed on `jax.make_mesh`'s mesh (the layer
programs' sizes; the MLP over tp=16, the block's FSDP x TP mesh 2 x 8). Its rings are
twice as long and its weights' copies twice as many: the cost model's choices are checked
where the 8-chip tables do not reach (on 16 v5e chips `auto` once moved an MLP's row
layer's operands, 120 MiB of w a device, and replayed behind XLA's own program:
docs/measurements.md). Rows are cached in `results-aot-larger-slices.json`. Needs the
aot extra; a block takes minutes to compile on 2 cores.
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

CACHE = HERE / "results-aot-larger-slices.json"
TARGETS = ("v5e:4x4", "v6e:4x4")
PROGRAMS = ("mlp", "block", "prefill")
ROWS = tuple(r for r in _aot_compare.ROWS if r[0] in ("xla", "auto"))


def run(targets, programs) -> dict:
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    for target in targets:
        for program in programs:
            rows = _aot_compare.compare(target, program, rows=ROWS)
            cache[f"{target}|{program}"] = [
                {"label": r.label, "seconds": r.seconds, "error": r.error,
                 "floor": r.floor, "temp_mib": r.temp_mib, "bounds": r.bounds}
                for r in rows]
            CACHE.write_text(json.dumps(cache, indent=1))
            print(f"{target}: {program}: " + ", ".join(
                f"{r.label} {r.seconds * 1e6:,.0f} us" for r in rows), flush=True)
    return cache


def markdown(cache) -> str:
    lines = ["| target | program | best xla (us) | auto (us) | auto vs best xla | "
             "bounds | temp MiB: best xla / auto |", "|---|---|---:|---:|---:|---|---:|"]
    for key in sorted(cache, key=aot_compare._order):
        target, program = key.split("|")
        rows = [r for r in cache[key] if not r["error"]]
        xla = min((r for r in rows if r["label"].startswith("xla")),
                  key=lambda r: r["seconds"], default=None)
        auto = next((r for r in rows if r["label"] == "auto"), None)
        if xla is None or auto is None:
            continue
        floor = ">= " if auto["floor"] else ""
        # The replay's compute and communication at least the program's own bounds, on
        # every row compiled ("-": cached before they were recorded).
        held = [r.get("bounds") for r in rows]
        bounds = "-" if None in held else "hold" if all(held) else "BROKEN"
        lines.append(f"| {target} | {program} | {aot_compare._us(xla['seconds'])} "
                     f"({xla['label']}) | {floor}{aot_compare._us(auto['seconds'])} | "
                     f"{xla['seconds'] / auto['seconds']:.2f}x | {bounds} | "
                     f"{_aot_compare.mib(xla['temp_mib'])} / "
                     f"{_aot_compare.mib(auto['temp_mib'])} |")
    return "\n".join(lines)


def main(argv=None):
    aot_compare.variant_main(argv, __doc__, CACHE, run, markdown, PROGRAMS, TARGETS)


if __name__ == "__main__":
    main()
