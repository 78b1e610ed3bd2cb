"""Forward passes alone, compiled for 8 x H100 without them: the predicted speed-up of the
overlapped backends over the reference where nothing else can hide the reference's
collective (in a forward+backward program of one op XLA overlaps it with the other
pass's matmuls, which a training step of several layers also offers but a forward pass
of one layer does not).

    python bench/aot_forward.py     # -> bench/RESULTS-aot-forward.md (needs the aot extra)
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fusedpar import aot  # noqa: E402  (sets the environment before JAX starts)


def main():
    from fusedpar._compile import _aot_programs as progs
    from fusedpar._core import _primitives as prims

    mesh = aot.mesh("h100x8")
    lines = [
        "# Forward passes alone, compiled for 8 x H100 (deviceless)", "",
        "Made by `python bench/aot_forward.py` (see its docstring for why forward alone). Per "
        "device x (1024, 4096) @ w (4096, 4096) bfloat16, a ring of 8, unidirectional "
        "(the H100 default), Triton GEMMs. *Predicted*: the compiled schedule replayed "
        "(`fusedpar.aot.predict`); *bound*: max(compute, communication) of the reference's "
        "program, the op's own floor; *ref / best*: the reference's predicted time over "
        "the faster of ring and pallas (above 1: faster than the reference).", "",
        "| op | reference (us) | ring (us) | pallas (us) | bound (us) | ref / best | best / bound |",
        "|---|---:|---:|---:|---:|---:|---:|"]
    for prim in prims.PRIMITIVES:
        times, bound = {}, 0.0
        for backend in ("reference", "ring", "pallas"):
            program, args = progs.op_program(mesh, prim, backend, bidirectional=None
                                             if backend == "reference" else False,
                                             backward=False)
            compiled = program.lower(*args).compile(compiler_options=aot.gpu_compiler_options())
            p = aot.predict(compiled, mesh)
            times[backend] = p.seconds * 1e6
            if backend == "reference":  # the op's own floor: its matmul or its transfer
                bound = p.lower_bound * 1e6
        best = min(times["ring"], times["pallas"])
        lines.append(f"| {prim} | {times['reference']:,.0f} | {times['ring']:,.0f} | "
                     f"{times['pallas']:,.0f} | {bound:,.0f} | "
                     f"{times['reference'] / best:.2f} | {best / bound:.2f} |")
        print(lines[-1], flush=True)
    out = pathlib.Path(__file__).resolve().parent / "RESULTS-aot-forward.md"
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
