"""Turn pytest-benchmark JSON into a Markdown report and a plot.

    pytest bench/ --benchmark-only --benchmark-json=my-bench.json
    python bench/report.py my-bench.json --out my-bench.md   # and results.png beside it

Without --out it writes the project's committed bench/RESULTS.md (and bench/results.png),
with the one-GPU runs committed in bench/ appended (--gpu / --no-gpu say otherwise).

Times are the minimum over the rounds: load from other processes only adds time, so the
minimum is the estimate least disturbed by it (pytest-benchmark's JSON has the rest). Ratios are to
`reference` in the same group: above 1.00x is slower than all_gather+dot / dot+psum_scatter,
below is faster. The plot needs matplotlib (the `bench` extra); without it only the
Markdown is written.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

BACKEND_ORDER = ["reference", "xla", "ring", "ring-bidi", "pallas", "pallas_gpu", "pallas_tpu"]
OP_TITLES = {
    "agm_lhs": "all_gather_matmul, gather='lhs' (sequence-parallel activations; ag_rows)",
    "agm_rhs": "all_gather_matmul, gather='rhs', dim=1 (FSDP weight gather; ag_cols)",
    "mrs": "matmul_reduce_scatter, dim=0 (row-parallel output; rs_rows)",
}


def _ms(seconds):
    return f"{seconds * 1e3:.3g} ms"


def _backends_in(rows):
    seen = {r["backend"] for r in rows}
    return [b for b in BACKEND_ORDER if b in seen] + sorted(seen - set(BACKEND_ORDER))


def load(path):
    try:
        with open(path) as f:
            data = json.load(f)
        data["benchmarks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a pytest-benchmark JSON file (make one with `pytest "
                         f"bench/ --benchmark-only --benchmark-json={path}`): {e!r}") from None
    return (data, *split(data["benchmarks"]))


def split(benchmarks):
    """pytest-benchmark records (its JSON's `benchmarks` entries) -> op, compile-cost and
    other rows: each the record's extra_info with `seconds` (the minimum over rounds),
    `rounds`, `group` and `name` added."""
    ops, compile_rows, other = [], [], []
    for b in benchmarks:
        info = dict(b.get("extra_info") or {})
        row = dict(info, seconds=b["stats"]["min"], rounds=b["stats"]["rounds"],
                   group=b["group"] or "", name=b["name"])
        if "kind" in info and "ring" in info:
            compile_rows.append(row)
        elif all(k in info for k in ("op", "mode", "shape", "ring", "backend")):
            ops.append(row)
        else:  # other benchmark files (e.g. bench/test_gpu_steps.py): listed as they are
            other.append(row)
    return ops, compile_rows, other


def other_tables(rows):
    """Benchmarks this report does not know: one table per group, times as measured."""
    if not rows:
        return []
    lines = ["## Other benchmarks", ""]
    groups = collections.defaultdict(list)
    for r in rows:
        groups[r["group"]].append(r)
    for group, rs in sorted(groups.items()):
        fastest = min(r["seconds"] for r in rs)
        lines += [f"### {group or '(no group)'}", "", "| benchmark | time | vs fastest |",
                  "|---|---:|---:|"]
        for r in sorted(rs, key=lambda r: r["seconds"]):
            lines.append(f"| {r['name']} | {_ms(r['seconds'])} | {r['seconds'] / fastest:.2f}x |")
        lines.append("")
    return lines


def machine(data, ops):
    info = data["machine_info"]
    cpu = info.get("cpu", {})
    sample = next(iter(ops), {})
    platform = sample.get("platform", "cpu")
    if platform == "cpu":
        devices = sample.get("num_devices", 8)
        return (f"CPU, {cpu.get('count', '?')} cores, {devices} simulated devices "
                f"({cpu.get('brand_raw', info.get('processor', '?'))}, {info.get('machine')})")
    return f"{sample.get('num_devices', '?')} x {sample.get('device_kind', platform)}"


def ratio_tables(ops):
    lines = []
    by_op = collections.defaultdict(list)
    for r in ops:
        by_op[(r["op"], r["mode"], bool(r.get("simulated_group")))].append(r)
    for (op, mode, _), rows in sorted(by_op.items()):
        backends = _backends_in(rows)
        lines += [f"### {OP_TITLES.get(op, op)} — {mode}", ""]
        lines.append("| shape M x K x N_out | devices | " + " | ".join(backends) + " |")
        lines.append("|---|---:|" + "---:|" * len(backends))
        cells = collections.defaultdict(dict)
        for r in rows:
            cells[(tuple(r["shape"]), r["ring"])][r["backend"]] = r["seconds"]
        for (shape, n), times in sorted(cells.items()):
            ref = times.get("reference")
            out = []
            for b in backends:
                t = times.get(b)
                if t is None:
                    out.append("—")
                elif b == "reference" or ref is None:
                    out.append(_ms(t))
                else:
                    out.append(f"{_ms(t)} (**{t / ref:.2f}x**)")
            lines.append(f"| {'x'.join(map(str, shape))} | {n} | " + " | ".join(out) + " |")
        lines.append("")
    return lines


def compile_tables(rows):
    if not rows:
        return []
    lines = ["## Compile cost", "",
             "Trace+lower on an `AbstractMesh` (no devices needed) for rings up to 64, and "
             "lower+compile on the simulated devices up to 8; fixed per-device shapes "
             "(x 16x64, w 64x64, float32), backend='ring', unidirectional. `lines`: StableHLO "
             "lines (operations) of the lowered program.", ""]
    for kind in ("trace+lower", "lower+compile"):
        for op in sorted({r["op"] for r in rows if r["kind"] == kind}):
            sel = [r for r in rows if r["kind"] == kind and r["op"] == op]
            rings = sorted({r["ring"] for r in sel})
            lines += [f"### {kind}: {op}", "",
                      "| devices | unrolled time | unrolled size | rolled time | rolled size |",
                      "|---:|---:|---:|---:|---:|"]
            for n in rings:
                cell = []
                for unroll in (True, False):
                    r = next((r for r in sel if r["ring"] == n and r["unroll"] == unroll), None)
                    if r is None:
                        cell += ["—", "—"]
                        continue
                    size = (f"{r['hlo_lines']} lines" if "hlo_lines" in r
                            else f"{r.get('hlo_bytes', 0) / 1024:.0f} KiB HLO")
                    cell += [_ms(r["seconds"]), size]
                lines.append(f"| {n} | " + " | ".join(cell) + " |")
            lines.append("")
    return lines


# How each bench op maps to a public op call on per-device shapes (see bench/test_op_speed.py).
_LOCAL = {
    "agm_lhs": ("all_gather_matmul", dict(gather="lhs", dim=0),
                lambda m, k, o, n: ((m // n, k), (k, o))),
    "agm_rhs": ("all_gather_matmul", dict(gather="rhs", dim=1),
                lambda m, k, o, n: ((m // n, k), (k, o // n))),
    "mrs": ("matmul_reduce_scatter", dict(dim=0),
            lambda m, k, o, n: ((m, k // n), (k // n, o))),
}


def model_ratio(r, hardware):
    """The cost model's time ratio to reference for a forward bench row, or None."""
    if r["mode"] != "fwd" or r["op"] not in _LOCAL or r["backend"] not in ("ring", "ring-bidi"):
        return None
    from fusedpar import cost_model

    op, kw, local = _LOCAL[r["op"]]
    xs, ws = local(*r["shape"], r["ring"])
    est = cost_model.estimate(op, xs, ws, r["ring"], r.get("dtype", "float32"), hardware,
                              bidirectional=r["backend"] == "ring-bidi", **kw)
    return est["ring"] / est["reference"]


def geomean(xs):
    import math

    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def headline(ops, hardware):
    """Geometric-mean ratio to reference per backend, op and mode (the summary table)."""
    acc = collections.defaultdict(list)
    model = collections.defaultdict(list)
    refs = {(r["group"]): r["seconds"] for r in ops if r["backend"] == "reference"}
    for r in ops:
        if r["backend"] != "reference" and r["group"] in refs:
            key = (r["op"], r["mode"], r["backend"])
            acc[key].append(r["seconds"] / refs[r["group"]])
            predicted = model_ratio(r, hardware) if hardware else None
            if predicted is not None:
                model[key].append(predicted)
    if not acc:
        return []
    lines = ["## Summary: time relative to reference (geometric mean over shapes and rings)",
             "", f"`model`: the same ratio predicted by `fusedpar.cost_model` with the "
             f"`{hardware}` preset (forward only).", "",
             "| op | mode | backend | measured | min | max | cases | model |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for key, rs in sorted(acc.items()):
        op, mode, b = key
        m = f"{geomean(model[key]):.2f}x" if model.get(key) else "—"
        lines.append(f"| {op} | {mode} | {b} | **{geomean(rs):.2f}x** | {min(rs):.2f}x | "
                     f"{max(rs):.2f}x | {len(rs)} | {m} |")
    return lines + [""]


def _ring_ticks(ax, rows):
    rings = sorted({r["ring"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(rings, [str(n) for n in rings])
    ax.minorticks_off()


def plot(ops, compile_rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'fusedpar[bench]'): no plot written",
              file=sys.stderr)
        return False
    panels = sorted({(r["op"], r["mode"]) for r in ops if not r.get("simulated")
                     and r["backend"] != "pallas_tpu"})
    extra = 2 if compile_rows else 0
    cols = 2
    rows_n = (len(panels) + extra + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(6 * cols, 3.6 * rows_n), squeeze=False)
    styles = ["-", "--", ":", "-."]
    colors = {b: f"C{i}" for i, b in enumerate(BACKEND_ORDER)}
    for ax, (op, mode) in zip(axes.flat, panels):
        sel = [r for r in ops if r["op"] == op and r["mode"] == mode
               and r["backend"] != "pallas_tpu"]
        shapes = sorted({tuple(r["shape"]) for r in sel})
        for b in _backends_in(sel):
            for i, shape in enumerate(shapes):
                pts = sorted((r["ring"], r["seconds"] * 1e3) for r in sel
                             if r["backend"] == b and tuple(r["shape"]) == shape)
                if pts:
                    ax.plot(*zip(*pts), styles[i % 4], marker="o", color=colors.get(b),
                            label=f"{b} {'x'.join(map(str, shape))}")
        ax.set_title(f"{op} {mode}", fontsize=10)
        ax.set_xlabel("ring size (devices)")
        ax.set_ylabel("time (ms, min over rounds)")
        ax.set_yscale("log")
        _ring_ticks(ax, sel)
        ax.legend(fontsize=7)
    if compile_rows:
        _compile_panel(axes.flat[len(panels)], compile_rows, lambda r: r["seconds"] * 1e3,
                       "trace+lower time vs ring size", "time (ms)")
        _compile_panel(axes.flat[len(panels) + 1], compile_rows, lambda r: r["hlo_lines"],
                       "program size vs ring size", "StableHLO lines")
    for ax in list(axes.flat)[len(panels) + extra:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def _compile_panel(ax, compile_rows, value, title, ylabel):
    """One trace+lower measure vs ring size, unrolled (solid) and rolled (dashed) per op."""
    for op in sorted({r["op"] for r in compile_rows}):
        for unroll, style in ((True, "-"), (False, "--")):
            pts = sorted((r["ring"], value(r)) for r in compile_rows
                         if r["kind"] == "trace+lower" and r["op"] == op
                         and r["unroll"] == unroll)
            if pts:
                ax.plot(*zip(*pts), style, marker="o",
                        label=f"{op} {'unrolled' if unroll else 'rolled'}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("ring size (devices)")
    ax.set_ylabel(ylabel)
    _ring_ticks(ax, compile_rows)
    ax.legend(fontsize=7)


def gpu_section() -> list:
    """The one-GPU results committed beside this file (bench/gpu_session.sh made them):
    the step kernels against cuBLAS and JAX's Hopper matmul, the ops on a ring of one,
    and the compute stream of the layer programs against the replay."""
    here = os.path.dirname(os.path.abspath(__file__))
    kernel_runs = ("results-gpu-h100.json", "results-gpu.json")  # newest first
    # (measured, compiled modules, preset, what it is), newest first.
    streams = [("results-compute-stream-h100.json", "compute-stream-h100-compiled.tgz",
                "h100_sxm", "XLA's default GEMMs (autotuned: cuBLAS or Triton per GEMM), "
                "every program of the comparison: `xla` is the program a user writes without "
                "fusedpar (`python -m fusedpar.aot --compare`)"),
               ("results-compute-stream-h100-cublas.json",
                "compute-stream-h100-cublas-compiled.tgz", "h100_sxm",
                "cuBLAS GEMMs (`--cublas`; the `mlp-reference` row's queued time is 254 us "
                "over the sum of its kernels, where every other row's gap is under 100: a "
                "disturbed measurement)"),
               ("results-compute-stream.json", "compute-stream-compiled.tgz", "h200_sxm",
                "the first GPU run, six programs")]
    lines = []
    if any(os.path.exists(os.path.join(here, m)) for m, *_ in streams):
        import compute_stream

        lines += ["## One GPU: the compute stream of the layer programs against the replay", "",
                  "Each program of `python -m fusedpar.aot --compare` (h100x8: `mlp` on 8 "
                  "devices, `block` and `prefill` on 2 x 4) as XLA partitions it, every "
                  "collective replaced by a parameter of its shape and its operands kept as "
                  "outputs, compiled and run on one GPU (`bench/compute_stream.py`): what one "
                  "device computes between transfers. Measured: 20 calls queued back to back, "
                  "per call. The replay is of the module the GPU compiled, with that GPU's "
                  "calibrated preset (`fusedpar/_hw/_registry.py`). Commands: `python "
                  "bench/compute_stream.py prepare --out DIR`, then on the GPU `python "
                  "bench/compute_stream.py measure DIR --out F.json [--cublas]` (or `bash "
                  "bench/gpu_session.sh`).", ""]
        for measured, compiled, preset, what in streams:
            measured, compiled = (os.path.join(here, f) for f in (measured, compiled))
            if not os.path.exists(measured):
                continue
            lines += [f"### {json.load(open(measured))['device']}: {what}", ""]
            lines += compute_stream.table(measured, compiled, preset).splitlines()
            lines += ["", "The matmul kernels by shape (matched in schedule order to the "
                      "profiled kernels): the rate each reached, against the dense bf16 "
                      "peak of the sheet.", ""]
            lines += compute_stream.gemms_by_shape(measured, compiled, preset).splitlines()
            lines += [""]
    for run in kernel_runs:
        if os.path.exists(os.path.join(here, run)):
            import test_gpu_steps

            lines += test_gpu_steps.markdown([os.path.join(here, run)]).splitlines() + [""]
    notes = os.path.join(here, "RESULTS-gpu-notes.md")  # how steady, written by hand
    if os.path.exists(notes):
        lines += open(notes).read().splitlines() + [""]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="pytest-benchmark --benchmark-json file(s)")
    project = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
    parser.add_argument("--out", default=project,
                        help="the report (default: bench/RESULTS.md, the project's committed "
                             "one; give your own path to keep it)")
    parser.add_argument("--plot", default=None,
                        help="the plot (default: results.png beside --out)")
    parser.add_argument("--note", default="", help="a paragraph to add (e.g. machine load)")
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="append the one-GPU runs committed in bench/ (default: only "
                             "when writing bench/RESULTS.md itself)")
    args = parser.parse_args(argv)
    if args.plot is None:
        args.plot = os.path.join(os.path.dirname(os.path.abspath(args.out)), "results.png")
    if args.gpu is None:  # a user's own report is of their run only
        args.gpu = os.path.abspath(args.out) == project
    data, ops, compile_rows, other = None, [], [], []
    for path in args.json:
        d, o, c, x = load(path)
        data = data or d
        ops += o
        compile_rows += c
        other += x
    ops_main = [r for r in ops if not r.get("simulated") and "simulated" not in r["group"]]
    ops_sim = [r for r in ops if "simulated" in r["group"]]
    for r in ops_sim:
        r["simulated_group"] = True
    import jax

    jax_version = next((r.get("jax_version") for r in ops + compile_rows + other
                        if r.get("jax_version")), jax.__version__)
    timed_rows = ops + other
    on_cpu = next(iter(timed_rows), {}).get("platform", "cpu") == "cpu"
    lines = ["# fusedpar benchmark results", "",
             f"- Machine: **{machine(data, timed_rows)}**",
             f"- JAX {jax_version}, Python {data['machine_info']['python_version']}, "
             f"pytest-benchmark {data['version']}",
             f"- Date: {data['datetime'][:19].replace('T', ' ')} UTC",
             f"- Commit: {(data.get('commit_info') or {}).get('id', 'unknown')[:12]}"
             f"{' (dirty)' if (data.get('commit_info') or {}).get('dirty') else ''}",
             "- Produced by: `pytest bench/ --benchmark-only --benchmark-json=...` then "
             "`python bench/report.py ...`; times are the minimum over rounds (other load "
             "only adds time).", ""]
    if on_cpu:
        lines += ["> **CPU numbers show overheads, never speed-ups.** The simulated devices "
                  "share the same cores, and a \"transfer\" is a memory copy made by those "
                  "cores, so there is nothing for a ring to overlap: a ratio above 1.00x is "
                  "the cost of decomposing the matmul into ring steps. Speed-ups need real "
                  "interconnects (GPU/TPU); see docs/cost_model.md for what to "
                  "expect there.", ""]
    if args.note:
        lines += [args.note, ""]
    wrote_plot = plot(ops_main, compile_rows, args.plot) if ops_main or compile_rows else False
    if wrote_plot:
        where = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))
        lines += [f"![time vs ring size]({where})", ""]
    lines += headline(ops_main, "cpu" if on_cpu else None)
    if ops_main:
        lines += ["## Ops: time per call, and ratio to reference in the same row", "",
                  "`ring`: unidirectional lax ring; `ring-bidi`: bidirectional (halves per "
                  "step). Forward: the op alone; fwd+bwd: `jax.grad` of the sum of the output "
                  "with respect to both operands.", ""]
        lines += ratio_tables(ops_main)
    if ops_sim:
        lines += ["## Pallas TPU kernels in interpret mode (a simulation, not a speed)", "",
                  "TPU interpret mode simulates every device, DMA and semaphore on the CPU; "
                  "these numbers track the simulator's cost only.", ""]
        lines += ratio_tables(ops_sim)
    lines += compile_tables(compile_rows)
    lines += other_tables(other)
    if args.gpu:
        lines += gpu_section()
    with open(args.out, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.out}" + (f" and {args.plot}" if wrote_plot else ""))


if __name__ == "__main__":
    main()
