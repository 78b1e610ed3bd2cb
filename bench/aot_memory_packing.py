"""How much of a TPU program's temporary memory is the buffer packer's luck.

    python bench/aot_memory_packing.py --targets v5p:2x2x2 --programs block --salts 1,2,3

`compiled.memory_analysis().temp_size_in_bytes`, the memory column of
`bench/aot_compare.py`, is where the TPU compiler's buffer assignment puts the end of
its heap: the live buffers at the step's peak plus the gaps its packing leaves. The
TPU compiler's packer takes a seed, `xla_tpu_buffer_assignment_randomization_salt`;
this compiles each program (auto, and the best xla row of `bench/aot_compare.py`'s
cache, with that row's settings) with the default and with each salt, and prints the
temporary MiB of each, the same program and the same schedule (the replayed time is
printed to show it did not move). A spread wider than a goal's margin means the goal
is read against the packer, not only the program. Needs the aot extra and
`bench/results-aot-compare.json` (made by `bench/aot_compare.py`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fusedpar import aot  # noqa: E402,F401  (sets the environment before JAX starts)
from fusedpar._compile import _aot, _aot_compare  # noqa: E402

SALT = "xla_tpu_buffer_assignment_randomization_salt"


def best_xla(target: str, program: str) -> str:
    """The settings of the fastest xla row in `bench/aot_compare.py`'s cache."""
    rows = json.loads((HERE / "results-aot-compare.json").read_text())[f"{target}|{program}"]
    return min((r for r in rows if r["backend"] == "xla" and not r["error"]),
               key=lambda r: r["seconds"])["settings"]


def spread(target: str, program: str, backend: str, settings: str, salts) -> list:
    """`[(salt or None, temp MiB, replayed us)]` of one row compiled with each salt."""
    import jax

    mesh = _aot_compare.mesh(target, program)
    fn, args = _aot_compare.build(mesh, program, backend)
    base = _aot_compare.options(target, backend, settings) or {}
    out = []
    with jax.set_mesh(mesh):
        lowered = fn.lower(*args)
        for salt in (None, *salts):
            opts = dict(base) if salt is None else {**base, SALT: str(salt)}
            compiled = lowered.compile(compiler_options=opts or None)
            us = _aot.predict(compiled.as_text(), mesh).seconds * 1e6
            out.append((salt, compiled.memory_analysis().temp_size_in_bytes / 2**20, us))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="v5p:2x2x2,v6e:2x4")
    parser.add_argument("--programs", default="block,prefill")
    parser.add_argument("--salts", default="1,2,3")
    a = parser.parse_args(argv)
    salts = [int(s) for s in a.salts.split(",") if s]
    print(f"| target | program | row | temp MiB: default salt | salts {', '.join(map(str, salts))}"
          " | min / max |")
    print("|---|---|---|---:|---:|---:|")
    for target in a.targets.split(","):
        for program in a.programs.split(","):
            for backend, settings in (("xla", best_xla(target, program)), ("auto", "default")):
                rows = spread(target, program, backend, settings, salts)
                mib = [m for _, m, _ in rows]
                times = {round(us) for _, _, us in rows}
                label = backend if backend == "auto" else f"xla ({settings})"
                print(f"| {target} | {program} | {label} | {mib[0]:,.0f} | "
                      f"{', '.join(f'{m:,.0f}' for m in mib[1:])} | {min(mib):,.0f} / "
                      f"{max(mib):,.0f} |" + ("" if len(times) == 1 else
                                                f" (replayed us moved: {sorted(times)})"))


if __name__ == "__main__":
    main()
