"""Bytes per ring transfer with a quantized payload, read from programs compiled for
hardware that is not here (`fusedpar.aot`, the `aot` extra): the table of
bench/RESULTS-aot.md's "Quantized transfers" section.

    python bench/comm_bytes.py        # about 3 minutes on 2 cores

- The lax ring (`backend="ring"`, bidirectional, 8 devices) on 8 x H100 and TPU
  v5e:2x4: every collective of each op's forward, as `fusedpar.aot.overlap` reads it
  (`Transfer.bytes`: the operands, values and scales; `laid_out`: as tiled in memory),
  per device, against the same op sending bfloat16 (reduce-scatters: a bfloat16
  accumulator).
- The fused TPU all-gathers (`backend="pallas_tpu"`, v5e:2x4): their remote DMAs are
  inside the Mosaic kernel, invisible to the schedule; one transfer moves one slot of
  the receive buffers the kernel's custom call returns (values and scales), sized from
  their compiled layouts.

Per device x (1024, 4096) @ w (4096, 4096) bfloat16 (`_aot_programs`' sizes).
"""

import re

import jax.numpy as jnp

from fusedpar._compile import _aot_programs, _hlo
from fusedpar import aot

PRIMS = ("ag_rows", "ag_cols", "ag_contract", "rs_rows")
COMMS = {"bfloat16": None, "int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}


def ring_rows(target):
    mesh = aot.mesh(target, (8,), ("x",))
    options = aot.compiler_options(target)
    base = {}
    for name, comm in COMMS.items():
        for prim in PRIMS:  # one program each: XLA on GPU merges permutes across ops
            fn, args = _aot_programs.comm_program(mesh, (prim,), comm)
            transfers = aot.overlap(fn.lower(*args).compile(
                compiler_options=options)).transfers
            mine = [t for t in transfers if t.op[0] == prim]
            nbytes, laid = sum(t.bytes for t in mine), sum(t.laid_out for t in mine)
            if comm is None:
                base[prim] = (nbytes, laid)
            arrays = sorted({f"{d}[{','.join(map(str, dims))}]" for t in mine
                             for d, dims in t.arrays})
            yield (target, prim, name, len(mine), nbytes, nbytes / base[prim][0],
                   laid / base[prim][1], ", ".join(arrays))


def kernel_rows(target="v5e:2x4"):
    mesh = aot.mesh(target, (8,), ("x",))
    for prim in PRIMS[:3]:
        per = {}
        for name, comm in COMMS.items():
            fn, args = _aot_programs.op_program(mesh, prim, "pallas_tpu", bidirectional=True,
                                                backward=False, comm_dtype=comm)
            text = fn.lower(*args).compile().as_text()
            call = next(line for line in text.splitlines() if "tpu_custom_call" in line)
            shape = call.split(" custom-call(")[0].split(" = ", 1)[1]
            # Receive slots: (directions, 2 slots, *piece) arrays (values, then scales).
            slots = [m.group(0) for m in re.finditer(
                r"[a-z0-9]+\[2,2,[\d,]+\](\{[^{}]*\})?", shape)]
            per[name] = (sum(_hlo.shape_bytes(s) for s in slots) // 4,
                         sum(_hlo.laid_out_bytes(s) for s in slots) // 4, slots)
        for name, (nbytes, laid, slots) in per.items():
            yield (target, prim, name, nbytes, laid, nbytes / per["bfloat16"][0],
                   laid / per["bfloat16"][1], ", ".join(slots))


SECTION = "## Quantized transfers"  # bench/aot_results.py keeps this section


def markdown() -> str:
    lines = [f"{SECTION} (comm_dtype)", "",
             "Made by `python bench/comm_bytes.py` (it rewrites this section; "
             "`tests/test_comm_bytes.py` checks the <= 0.52 target on 8 x H100 and v5e). "
             "Per device x (1024, 4096) @ w (4096, 4096) bfloat16, 8 devices, bidirectional, "
             "forward. Bytes are per device over the op's whole ring, values and scales; "
             "\"laid out\" counts them as tiled in memory (TPU tiles pad thin arrays); "
             "reduce-scatters are compared with a bfloat16 accumulator.", "",
             "The lax ring (`backend=\"ring\"`): every collective of the op in the compiled "
             "schedule (on H100 XLA sends values and scales in one collective-permute, on "
             "v5e in two).", "",
             "| target | op | comm | transfers | bytes / device | / bf16 | laid out / bf16 "
             "| arrays sent |", "|---|---|---|---|---|---|---|---|"]
    for target in ("h100x8", "v5e:2x4"):
        for t, prim, name, n, nbytes, ratio, laid, arrays in ring_rows(target):
            lines.append(f"| {t} | {prim} | {name} | {n} | {nbytes:,} | {ratio:.4f} | "
                         f"{laid:.4f} | {arrays} |")
    lines += ["", "The fused TPU all-gathers (`backend=\"pallas_tpu\"`): one remote DMA of "
              "values and one of scales per transfer, into the receive slots the kernel's "
              "custom call returns; their compiled layouts size a transfer. The row "
              "kernel's per-row scales travel as lane-dense rows (as an f32[512,1] column "
              "they would be laid out 128 lanes a row: 0.5625 of bfloat16).", "",
              "| target | kernel | comm | bytes / transfer | laid out | / bf16 | "
              "laid out / bf16 | receive slots (values, scales) |",
              "|---|---|---|---|---|---|---|---|"]
    for t, prim, name, nbytes, laid, ratio, lratio, slots in kernel_rows():
        lines.append(f"| {t} | {prim} pallas_tpu | {name} | {nbytes:,} | {laid:,} | "
                     f"{ratio:.4f} | {lratio:.4f} | {slots} |")
    return "\n".join(lines)


def main():
    import pathlib

    text = markdown()
    path = pathlib.Path(__file__).with_name("RESULTS-aot.md")
    old = path.read_text()
    head = old[:old.index(SECTION)].rstrip("\n") if SECTION in old else old.rstrip("\n")
    path.write_text(head + "\n\n" + text + "\n")
    print(text)


if __name__ == "__main__":
    main()
