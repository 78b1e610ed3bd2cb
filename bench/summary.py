"""The summary that ends `pytest bench/ --benchmark-only` (printed by bench/conftest.py).

pytest-benchmark prints one table per group; this condenses the run into what its reader
asks: per op, mode and ring size, how each backend's time compares with `reference` and
with `xla` (the same op under plain `jax.jit` with sharded inputs: what a user without
fusedpar runs); what the compile cost and program size do as the ring grows; and where
the predictions for real accelerators are. `render` is a pure function of pytest-benchmark
records (its JSON's `benchmarks` entries), so the tests check it on made-up records.
"""

from __future__ import annotations

import collections
import textwrap

from report import BACKEND_ORDER, geomean, split

AOT_RESULTS = "bench/RESULTS-aot.md"
WIDTH = 100  # no line of the summary is wider


def render(benchmarks, *, cores: int | None = None, json_path: str | None = None) -> str:
    """The summary of a run's benchmark records; an empty string when none ran.
    `json_path`: the run's --benchmark-json file, if it writes one."""
    ops, compile_rows, other = split(benchmarks)
    if not (ops or compile_rows or other):
        return ""
    timed = [r for r in ops + other if "platform" in r]
    platform = timed[0]["platform"] if timed else "cpu"
    lines = _header(timed, platform, cores)
    measured = [r for r in ops if not r.get("simulated") and "simulated" not in r["group"]]
    simulated = [r for r in ops if r not in measured]
    lines += op_table(measured)
    lines += simulated_lines(simulated)
    lines += compile_lines(compile_rows)
    if other:
        lines += [""] + _para(f"{len(other)} other benchmarks (e.g. GPU step kernels): "
                              "their tables are above.")
    then = (f"`python bench/report.py {json_path} --out REPORT.md`" if json_path else
            "run with --benchmark-json=FILE, then `python bench/report.py FILE --out "
            "REPORT.md`")
    lines += [""] + _para("Every row, and the cost model's prediction beside each ratio: "
                          f"{then} (a plot beside it with matplotlib).")
    return "\n".join(lines)


def _para(text):
    return textwrap.wrap(text, WIDTH)


def _header(timed, platform, cores):
    if platform == "cpu":
        devices = timed[0].get("num_devices") if timed else None
        where = ("CPU" + (f", {devices} simulated devices" if devices else "")
                 + (f" on {cores} cores" if cores else ""))
        text = (f"{where}. CPU times show the cost of each schedule, never a speed-up: the "
                "devices share the cores and a transfer is a memory copy made by them, so "
                "nothing can overlap.")
    else:
        text = f"{timed[0].get('num_devices', '?')} x {timed[0].get('device_kind', platform)}."
    return _para(text + " What the same programs do on real accelerators (8 x H100, TPU "
                 f"v5e, v5p, v6e), from deviceless compiles for each: {AOT_RESULTS}.")


def _backends(rows):
    seen = {r["backend"] for r in rows}
    return [b for b in BACKEND_ORDER if b in seen] + sorted(seen - set(BACKEND_ORDER))


def _short(backend):
    """Column head: the quantized rows by their payload (see the note under the table)."""
    return backend.rsplit("-", 1)[1] if backend.startswith("ring-bidi-") else backend


def _ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.2g}" if ms < 10 else f"{ms:.0f}"


def _table(head, body, right_from=1):
    """Plain aligned columns (left-aligned up to `right_from`, right-aligned after)."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i < right_from else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(head)] + [line(r) for r in body]


def op_table(rows):
    """Per (op, mode, ring): each backend's time / reference's (geometric mean over the
    shapes both ran), the reference's time range, and the best fusedpar backend against
    `xla`."""
    if not rows:
        return []
    by_group = collections.defaultdict(dict)
    for r in rows:
        by_group[r["group"]][r["backend"]] = r
    backends = [b for b in _backends(rows) if b != "reference"]
    ratios = collections.defaultdict(list)  # (op, mode, ring, backend) -> ratios to ref
    vs_xla = collections.defaultdict(list)  # (op, mode, ring, backend) -> ratios to xla
    ref_times = collections.defaultdict(list)
    shapes = collections.defaultdict(set)
    for group in by_group.values():
        ref = group.get("reference")
        if ref is None:
            continue
        key = (ref["op"], ref["mode"], ref["ring"])
        ref_times[key].append(ref["seconds"])
        for b, r in group.items():
            if b == "reference":
                continue
            ratios[key + (b,)].append(r["seconds"] / ref["seconds"])
            shapes[key + (b,)].add(tuple(r["shape"]))
            if "xla" in group and b != "xla":
                vs_xla[key + (b,)].append(r["seconds"] / group["xla"]["seconds"])
    partial = False
    body = []
    for key in sorted(ref_times, key=lambda k: (_order(k[0]), k[1], k[2])):
        op, mode, ring = key
        times = ref_times[key]
        row = [op, mode, str(ring), f"{_ms(min(times))}-{_ms(max(times))}" if len(times) > 1
               else _ms(times[0])]
        for b in backends:
            rs = ratios.get(key + (b,))
            if not rs:
                row.append("-")
                continue
            star = "*" if len(shapes[key + (b,)]) < len(times) else ""
            partial |= bool(star)
            row.append(f"{geomean(rs):.2f}x{star}")
        best = min(((geomean(v), b) for (o, m, n, b), v in vs_xla.items() if (o, m, n) == key),
                   default=None)
        row.append(f"{best[0]:.2f}x {_short(best[1])}" if best else "-")
        body.append(row)
    lines = [""] + _para("Ops: time / reference's time (all_gather + dot, dot + psum_scatter) "
                         "in the same run, geometric mean over the shapes; below 1.00x is "
                         "faster. xla: x @ w under plain jax.jit over the sharded inputs (what "
                         "a user without fusedpar runs). N: ring size.") + [""]
    lines += _table(["op", "mode", "N", "ref ms"] + [_short(b) for b in backends]
                    + ["best vs xla"], body, right_from=2)
    overall = [f"{_short(b)} {geomean(sum((v for k, v in ratios.items() if k[3] == b), [])):.2f}x"
               for b in backends]
    lines += ["", "All ops and sizes, vs reference: " + ", ".join(overall) + "."]
    quantized = [_short(b) for b in backends if _short(b) != b]
    if quantized:
        lines += _para(f"{', '.join(quantized)}: ring-bidi sending its payload as those "
                       "values (int8, float8_e4m3fn) and float32 scales (comm_dtype).")
    if partial:
        lines += _para("*: measured at fewer shapes than the row's reference (the largest "
                       "only).")
    return lines


def _order(op):
    return ["agm_lhs", "agm_rhs", "mrs"].index(op) if op in ("agm_lhs", "agm_rhs", "mrs") else 9


def simulated_lines(rows):
    """The fused TPU kernels in TPU interpret mode: a simulator's cost, one line per op."""
    kernel = [r for r in rows if r["backend"] != "reference"]
    if not kernel:
        return []
    ref = {(r["op"], r["ring"]): r["seconds"] for r in rows if r["backend"] == "reference"}
    lines = [""] + _para("pallas_tpu in TPU interpret mode (a simulator of every DMA and "
                         "semaphore: its cost, not a speed):")
    by_op = collections.defaultdict(list)
    for r in sorted(kernel, key=lambda r: (r["op"], r["ring"])):
        cell = f"N={r['ring']} {r['seconds']:.2g} s"
        if (r["op"], r["ring"]) in ref:
            cell += f" ({r['seconds'] / ref[(r['op'], r['ring'])]:,.0f}x reference)"
        by_op[r["op"], tuple(r["shape"])].append(cell)
    for (op, shape), cells in by_op.items():
        lines.append(f"  {op} {'x'.join(map(str, shape))}: " + ", ".join(cells))
    return lines


def compile_lines(rows):
    """Program size (StableHLO lines) and trace+lower time by ring size, unrolled vs rolled;
    lower+compile time where the devices exist."""
    if not rows:
        return []
    lines = [""] + _para("Compile cost by ring size N: the unrolled ring's program grows with "
                         "N, the rolled one's (a fori_loop) stays flat.")
    titles = {"trace+lower": "trace+lower on an AbstractMesh: program size in StableHLO lines "
                             "/ time in ms",
              "lower+compile": "lower+compile on the simulated devices: time in ms"}
    for kind in ("trace+lower", "lower+compile"):
        sel = [r for r in rows if r["kind"] == kind]
        rings = sorted({r["ring"] for r in sel})
        body = []
        for op in sorted({r["op"] for r in sel}, key=_order):
            for unroll in (True, False):
                cells = []
                for n in rings:
                    r = next((r for r in sel if r["op"] == op and r["ring"] == n
                              and r["unroll"] == unroll), None)
                    if r is None:
                        cells.append("-")
                    elif kind == "trace+lower":
                        cells.append(f"{r['hlo_lines']}/{_ms(r['seconds'])}")
                    else:
                        cells.append(_ms(r["seconds"]))
                body.append([op, "unrolled" if unroll else "rolled"] + cells)
        if body:  # one table per kind: trace+lower reaches rings the devices do not
            lines += ["", titles[kind]]
            lines += _table(["op", "ring"] + [f"N={n}" for n in rings], body, right_from=2)
    return lines
