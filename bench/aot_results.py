"""Compile every op and layer program for each target without the hardware, and tabulate.

    python bench/aot_results.py                  # all targets -> results-aot.json, RESULTS-aot.md
    python bench/aot_results.py --targets v5e:2x4 --markdown-only

For each target (8 x H100 with Triton GEMMs and with cuBLAS, TPU v5e, v5p and v6e slices of
8 devices) it compiles, per device x (1024, 4096) @ w (4096, 4096) bfloat16:

- every op (the five primitives) x backend (reference, ring, pallas, auto) x ring
  direction, forward and backward (a vjp against the cotangent `ct * y` of the output
  `y`: as in a training step, the backward waits for the forward), each program on
  its own (so no op's transfers hide behind another's matmuls);
- the two layer programs of `fusedpar._compile._aot_programs`: a sequence-parallel MLP and an
  FSDP x TP transformer block, training steps on global arrays under `jax.set_mesh`;
- the reference all-gather-matmul forward in float16 on 2, 4 and 8 H100s, the case JAX's
  Mosaic GPU collective matmul docs publish (all-gather + cuBLAS: 147 / 290 / 565 us).

and records whether it compiled, the transfers with a matmul in flight (forward and
backward), the compile time, and the time predicted from the schedule
(`fusedpar.aot.predict`) with its lower bound. Needs the aot extra; runs on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fusedpar import aot  # noqa: E402  (sets the environment before JAX starts)
from fusedpar._compile import _hlo_ring_kernel  # noqa: E402

TARGETS = ("h100x8", "h100x8 cublas", "v5e:2x4", "v5p:2x2x2", "v6e:2x4")
VARIANTS = (("reference", None), ("ring", False), ("ring", True), ("pallas", False),
            ("pallas", True), ("auto", None))
LAYER_BACKENDS = ("reference", "ring", "pallas", "auto")
PUBLISHED_US = {2: 147, 4: 290, 8: 565}
_IN_KERNEL = "fused kernel"  # the report's pass for a fused TPU kernel: no XLA transfers


def _passes(row) -> dict:
    return {k: v for k, v in row.get("passes", {}).items() if k != _IN_KERNEL}


def _compile(name, program, args):
    target, _, variant = name.partition(" ")
    options = aot.compiler_options(target, variant == "cublas")
    start = time.perf_counter()
    compiled = program.lower(*args).compile(compiler_options=options)
    return compiled, time.perf_counter() - start


def _row(name, mesh, build, **fields):
    row = dict(target=name, **fields)
    try:
        program, args = build()
        compiled, seconds = _compile(name, program, args)
    except Exception as e:  # noqa: BLE001 - one failing program must not hide the rest
        row.update(compiled=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:240]}")
        return row
    report = aot.overlap(compiled)
    predicted = aot.predict(compiled, mesh)
    passes = {}
    for s in report.ops:
        if s.op[0] == "other" or s.op[2] == _IN_KERNEL:
            continue
        p = passes.setdefault(s.op[2], [0, 0, s.op[1]])
        p[0] += s.hidden
        p[1] += s.transfers
    row.update(compiled=True, compile_s=round(seconds, 1), passes=passes,
               hidden=report.hidden, hideable=report.hideable, transfers=report.total,
               predicted_us=round(predicted.seconds * 1e6, 1),
               lower_bound_us=round(predicted.lower_bound * 1e6, 1),
               # The replay timed every fused kernel from its plan (no floor).
               kernels_read=not any(_hlo_ring_kernel.UNREAD in u for u in predicted.unread))
    return row


def run(targets, out):
    import jax.numpy as jnp

    from fusedpar._compile import _aot_programs as progs
    from fusedpar._core import _primitives as prims

    rows = json.loads(out.read_text()) if out.exists() else []
    done = {(r["target"], r["program"], r.get("backend"), r.get("bidirectional"))
            for r in rows}

    def add(row):
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1))
        print(json.dumps(row), flush=True)

    for name in targets:
        target = name.split(" ")[0]
        mesh = aot.mesh(target)
        for prim in prims.PRIMITIVES:
            for backend, bidi in VARIANTS:
                if (name, prim, backend, bidi) in done:
                    continue
                add(_row(name, mesh, lambda: progs.op_program(mesh, prim, backend,
                                                              bidirectional=bidi),
                         program=prim, backend=backend, bidirectional=bidi))
        for layers, build, shape, axes in (("mlp", progs.mlp_program, (8,), ("tp",)),
                                           ("block", progs.block_program, (2, 4),
                                            ("fsdp", "tp"))):
            lmesh = aot.mesh(target, shape, axes)
            for backend in LAYER_BACKENDS:
                if (name, layers, backend, None) in done:
                    continue
                add(_row(name, lmesh, lambda: build(lmesh, backend), program=layers,
                         backend=backend, bidirectional=None))
    if "h100x8" in targets:
        for n in PUBLISHED_US:
            if ("h100", "published", n, None) in done:
                continue
            mesh = aot.mesh(f"h100x{n}")
            row = _row(f"h100x{n}", mesh, lambda: progs.op_program(
                mesh, prims.AG_ROWS, "reference", backward=False, dtype=jnp.float16),
                program="published", backend=n, bidirectional=None)
            row["target"] = "h100"
            add(row)
    return rows


def _ring_ranges(ops) -> str:
    """"0.67-0.95x on h100x8, ...": the best ring direction's speed-up over the reference,
    lowest to highest over the five ops, per target (computed, so it never goes stale)."""
    parts = []
    for target in dict.fromkeys(r["target"] for r in ops):
        ratios = []
        for prim in dict.fromkeys(r["program"] for r in ops if r["target"] == target):
            mine = {(r["backend"], r["bidirectional"]): r.get("predicted_us") for r in ops
                    if r["target"] == target and r["program"] == prim and r["compiled"]}
            ref = mine.get(("reference", None))
            rings = [v for (b, _), v in mine.items() if b == "ring" and v]
            if ref and rings:
                ratios.append(ref / min(rings))
        if ratios:
            parts.append(f"{min(ratios):.2f}-{max(ratios):.2f}x on {target}")
    return ", ".join(parts)


def markdown(rows) -> str:
    ops = [r for r in rows if r["program"] not in ("mlp", "block", "published")]
    layers = [r for r in rows if r["program"] in ("mlp", "block")]
    out = ["# Compiled for the targets, without them (deviceless AOT)", "",
           "Made by `python bench/aot_results.py` (JAX's real TPU and GPU compilers on a "
           "2-core CPU machine; compile-only devices: nothing here ran on a GPU or TPU). "
           "Per device x (1024, 4096) @ w (4096, 4096) bfloat16, rings of 8 devices; each "
           "program is the op's forward and its backward (a vjp against the cotangent "
           "`ct * y` of its output `y`, the loss `sum(ct * y**2) / 2`'s: as in a training "
           "step, the backward waits for the forward). *Hidden*: transfers (collective starts) with a matmul scheduled "
           "before their done, forward / backward. *Predicted*: the schedule replayed with "
           "the target's spec-sheet numbers (`fusedpar.aot.predict`); *bound*: "
           "max(compute, communication) of the same program; *reference / predicted*: the "
           "speed-up over the same op's reference (above 1: faster). *in kernel*: the fused "
           "TPU kernels run the ring inside one Mosaic kernel, so XLA sees no transfer; the "
           "replay times each kernel from the plan its call carries ('floor': a row "
           "compiled before the replay could, its kernels' matmuls alone). Compile times "
           "are on the 2-core machine, often sharing it.", ""]
    totals = {}
    for r in ops:
        if r["compiled"] and r["backend"] in ("ring", "pallas") and _passes(r):
            t = totals.setdefault((r["target"], r["backend"]), [0, 0])
            for hidden, total, _ in _passes(r).values():
                t[0] += hidden
                t[1] += total
    if totals:
        out += ["## Summary", "", "Ring transfers with a matmul in flight, all five ops, both "
                "directions, forward and backward:", "", "| target | ring | pallas |",
                "|---|---:|---:|"]
        for name in dict.fromkeys(t for t, _ in totals):
            cells = ["{}/{}".format(*totals[(name, b)]) if (name, b) in totals else
                     "in kernel" for b in ("ring", "pallas")]
            out.append(f"| {name} | {cells[0]} | {cells[1]} |")
        out += ["", "Overlap is not yet speed. At this size, forward and backward together, "
                "the replay predicts the lax ring (with the better direction) at "
                f"{_ring_ranges(ops)} the reference's speed: its steps are thin matmuls "
                "with a launch each, and a gather's ring copies each product into its slot "
                "of the output; the reference's backward hides its collective behind the other "
                "gradient's matmul. `auto` decides each pass (the backward's dual primitive "
                "for its own shapes, counting that matmul): it is never predicted slower "
                "than the reference here, and is faster where a ring or a fused TPU kernel "
                "pays (the tables below, each row as of the run that compiled it). TPU programs "
                "are compiled with `fusedpar.tpu_overlap_flags(generation)`, GPU ones with "
                "`gpu_overlap_flags()` (what `fusedpar.set_overlap_flags()` sets for a "
                "program that runs). Forward "
                "passes alone are in [RESULTS-aot-forward.md](RESULTS-aot-forward.md) (8 x "
                "H100).",
                ""]
    for name in dict.fromkeys(r["target"] for r in ops):
        out += [f"## {name}", "", "| op | backend | ring | compiled (s) | hidden fwd | "
                "hidden bwd | predicted (us) | bound (us) | predicted / bound | reference / "
                "predicted |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        reference = {r["program"]: r["predicted_us"] for r in ops
                     if r["target"] == name and r["backend"] == "reference" and r["compiled"]}
        for r in (r for r in ops if r["target"] == name):
            ring = {None: "default", False: "uni", True: "bi"}[r["bidirectional"]]
            if not r["compiled"]:
                out.append(f"| {r['program']} | {r['backend']} | {ring} | no: "
                           f"{r['error'][:90]} | | | | | |")
                continue
            p = _passes(r)
            # The fused TPU kernels move their blocks inside one Mosaic kernel: XLA (and
            # this table) sees no transfer, and the replay costs their matmul alone (a
            # pass `auto` gave to them, too).
            inside = "in kernel" if name.startswith("v") else "-"
            fwd = "{}/{}".format(*p["forward"][:2]) if "forward" in p else inside
            bwd = "{}/{}".format(*p["backward"][:2]) if "backward" in p else inside
            ratio = r["predicted_us"] / r["lower_bound_us"] if r["lower_bound_us"] else 0
            chosen = p.get("forward", [0, 0, "pallas" if inside != "-" else r["backend"]])[2]
            backend = r["backend"] + (f" → {chosen}" if r["backend"] == "auto" else "")
            speedup = reference.get(r["program"], 0) / r["predicted_us"]
            # A fused kernel's time is a floor where the replay could not read its plan
            # (rows compiled before it could): no speed-up then.
            floor = inside != "-" and not p and not r.get("kernels_read")
            speedup = "floor" if floor else f"{speedup:.2f}"
            out.append(f"| {r['program']} | {backend} | {ring} | {r['compile_s']} | {fwd} | "
                       f"{bwd} | {r['predicted_us']:,.0f} | {r['lower_bound_us']:,.0f} | "
                       f"{ratio:.2f} | {speedup} |")
        out.append("")
    if layers:
        out += ["## Layer programs", "", "Training steps on global arrays under "
                "`jax.set_mesh`: `mlp` a sequence-parallel MLP (dim 4096, hidden 16384, 1024 "
                "tokens per device, tp=8), `block` an FSDP x TP transformer block (2 x 4 "
                "mesh, 32 heads). Every collective of the step counts, the layers' rings "
                "and XLA's own (FSDP weight gathers, gradient reduce-scatters, bias "
                "gradient sums, the loss). *Hidden / hideable / transfers*: transfers with a "
                "matmul in flight / those the program has a matmul for that neither feeds "
                "them nor waits for them (`Transfer.hideable`: a schedule could hide them) / "
                "all. On TPU the flags make XLA run its FSDP weight gathers in steps inside "
                "the matmuls beside them, or on the SparseCores (docs/measurements.md). The "
                "replay reads the TPU compiler's fused reduce-scatter (an all-reduce and the "
                "kept slice, in one fusion) as the transfer it is. " + _auto_over_reference(
                    layers), "",
                "| target | program | backend | compiled (s) | hidden / hideable / transfers | "
                "predicted (us) | bound (us) |", "|---|---|---|---:|---:|---:|---:|"]
        for r in layers:
            if not r["compiled"]:
                out.append(f"| {r['target']} | {r['program']} | {r['backend']} | no: "
                           f"{r['error'][:90]} | | | |")
                continue
            out.append(f"| {r['target']} | {r['program']} | {r['backend']} | "
                       f"{r['compile_s']} | {r['hidden']} / {r.get('hideable', '?')} / "
                       f"{r['transfers']} | "
                       f"{r['predicted_us']:,.0f} | {r['lower_bound_us']:,.0f} |")
        out.append("")
    published = [r for r in rows if r["program"] == "published" and r["compiled"]]
    if published:
        out += ["## The reference against published numbers", "",
                "all_gather + matmul, float16, per device x (1024, 4096) @ w (4096, 4096), "
                "forward, with Triton GEMMs (JAX's Mosaic GPU collective matmul docs, all-gather + "
                "cuBLAS; `tests/test_aot.py` checks the cuBLAS program too):", "",
                "| H100s | predicted (us) | published (us) | predicted / published |",
                "|---:|---:|---:|---:|"]
        for r in published:
            n = r["backend"]
            out.append(f"| {n} | {r['predicted_us']:,.0f} | {PUBLISHED_US[n]} | "
                       f"{r['predicted_us'] / PUBLISHED_US[n]:.2f} |")
        out.append("")
    return "\n".join(out)


def _auto_over_reference(layers) -> str:
    """One sentence: the reference's predicted time over auto's, per program and target."""
    by = {(r["target"], r["program"], r["backend"]): r["predicted_us"]
          for r in layers if r["compiled"]}
    parts = []
    for program in ("mlp", "block"):
        ratios = [f"{by[t, program, 'reference'] / by[t, program, 'auto']:.2f}x ({t})"
                  for t in dict.fromkeys(r["target"] for r in layers)
                  if (t, program, "reference") in by and (t, program, "auto") in by]
        if ratios:
            parts.append(f"the {program} {', '.join(ratios)}")
    return ("The reference's predicted time over `auto`'s: " + "; ".join(parts) + "."
            if parts else "")


COMM_SECTION = "## Quantized transfers"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--json", default=str(HERE / "results-aot.json"))
    parser.add_argument("--markdown", default=str(HERE / "RESULTS-aot.md"))
    parser.add_argument("--markdown-only", action="store_true")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.json)
    if args.markdown_only:
        rows = json.loads(out.read_text())
    else:
        rows = run([t.strip() for t in args.targets.split(",")], out)
    path = pathlib.Path(args.markdown)
    # bench/comm_bytes.py's section (its own programs, its own command) is kept as it is.
    old = path.read_text() if path.exists() else ""
    kept = old[old.index(COMM_SECTION):] if COMM_SECTION in old else ""
    # bench/aot_compare.py's comparison (between its markers, after the title) too.
    begin, end = "<!-- aot-compare: begin -->", "<!-- aot-compare: end -->"
    compare = old[old.index(begin):old.index(end) + len(end)] if end in old else ""
    new = markdown(rows)
    if compare:
        title, _, rest = new.partition("\n\n## ")
        new = f"{title}\n\n{compare}\n\n## {rest}"
    path.write_text(new + "\n" + ("\n" + kept if kept else ""))
    print(markdown(rows))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
