"""The block program with its input differentiated too, as every block of a deep model
but the first: XLA's own partitioning against `auto`, with q, k and v sharing one gather
(the default) and each gathering its own (`fusedpar/_nn/_shared_gather.py`'s `off()`).

    python bench/aot_input_grad.py                       # h100x8, v5e, v5p, v6e
    python bench/aot_input_grad.py --targets v6e:2x4

A deviceless compile per row (`fusedpar._compile._aot_compare`'s options and mesh),
replayed with `fusedpar.aot.predict`; predicted microseconds per device and the compiled
step's temporary memory, printed as Markdown (docs/measurements.md quotes it). The
`block` program of `bench/RESULTS-aot.md` differentiates the parameters only: there the
input's gradient, and the reduce-scatters that make it, are left out. Needs the aot
extra.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fusedpar import aot  # noqa: E402  (sets the environment before JAX starts)

TARGETS = ("h100x8", "v5e:2x4", "v5p:2x2x2", "v6e:2x4")


def row(target: str, label: str) -> tuple:
    """(predicted seconds, temporary MiB) of one row: "xla", "auto, each its own
    gather" or "auto"."""
    import jax

    from fusedpar._compile import _aot_baseline, _aot_compare, _aot_programs
    from fusedpar._nn import _shared_gather

    mesh = _aot_compare.mesh(target, "block")
    backend = "xla" if label == "xla" else "auto"
    apart = label != "auto" and backend == "auto"
    with _shared_gather.off() if apart else contextlib.nullcontext():
        if backend == "xla":
            fn, args = _aot_baseline.layer_program(mesh, "block", wrt_input=True)
        else:
            fn, args = _aot_programs.block_program(mesh, "auto", wrt_input=True)
        with jax.set_mesh(mesh):
            compiled = fn.lower(*args).compile(compiler_options=_aot_compare.options(
                target, backend, _aot_compare.DEFAULT) or None)
    seconds = aot.predict(compiled.as_text(), mesh).seconds
    return seconds, compiled.memory_analysis().temp_size_in_bytes / 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TARGETS))
    args = p.parse_args(argv)
    labels = ("xla", "auto, each its own gather", "auto")
    print("| target | " + " | ".join(labels) + " |\n|---|" + "---:|" * len(labels))
    for target in args.targets.split(","):
        rows = [row(target, label) for label in labels]
        best = rows[0][0]
        cells = [f"{s * 1e6:,.0f} ({best / s:.2f}x, {mib:,.0f} MiB)" for s, mib in rows]
        print(f"| {target} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
