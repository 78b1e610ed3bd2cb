"""XLA's own partitioning against fusedpar's backends, per target and layer program.

    python bench/aot_compare.py                      # every target and program
    python bench/aot_compare.py --targets v5e:2x4 --programs mlp
    python bench/aot_compare.py --markdown-only      # the table again from the cache

For each target (8 x H100 with Triton GEMMs and with cuBLAS, TPU v5e, v5p and v6e slices
of 8 devices) and layer program (mlp, block, prefill, decode: `fusedpar._compile._aot_programs.
LAYER_SIZES`) or op (`--programs ag_rows,...`) it runs `python -m fusedpar.aot
--compare`'s comparison (`fusedpar._compile._aot_compare`): the program written without fusedpar
and partitioned by XLA (with the platform's defaults and with XLA's collective matmul),
and fusedpar's
reference (both settings), ring, pallas and auto, each replayed on `jax.make_mesh`'s
mesh. Rows are cached in `results-aot-compare.json` per (target, program) as they finish
(a TPU block takes minutes to compile on 2 cores), and the table is written at the top
of `RESULTS-aot.md`, between the markers below. Needs the aot extra.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fusedpar import aot  # noqa: E402,F401  (sets the environment before JAX starts)
from fusedpar._compile import _aot_compare  # noqa: E402

TARGETS = ("h100x8", "h100x8 cublas", "v5e:2x4", "v5p:2x2x2", "v6e:2x4")
CACHE = HERE / "results-aot-compare.json"
RESULTS = HERE / "RESULTS-aot.md"
BEGIN, END = "<!-- aot-compare: begin -->", "<!-- aot-compare: end -->"


def _load() -> dict:
    return json.loads(CACHE.read_text()) if CACHE.exists() else {}


def run(targets, programs, force=False, only=None) -> dict:
    """Compile what the cache lacks (everything with `force`); `only`, a set of row
    labels ("auto", "xla (collective matmul)", ...), recompiles just those rows of the
    cached programs and keeps the others."""
    cache = _load()
    for name in targets:
        target, _, variant = name.partition(" ")
        for program in programs:
            key = f"{name}|{program}"
            if key in cache and not force and not only:
                continue
            rows = _aot_compare.ROWS
            if only and key in cache:
                rows = tuple(r for r in rows if _label(*r) in only)
            new = [vars(r) | {"unread": list(r.unread)} for r in _aot_compare.compare(
                target, program, cublas=variant == "cublas", rows=rows)]
            if only and key in cache:  # in the table's order, new rows included
                have = {_label(r["backend"], r["settings"]): r for r in cache[key] + new}
                new = [have[_label(*r)] for r in _aot_compare.ROWS if _label(*r) in have]
            cache[key] = _speedups(new)
            CACHE.write_text(json.dumps(cache, indent=1))
            print(f"{name}: {program}: " + ", ".join(
                f"{_label(r['backend'], r['settings'])} {_us(r['seconds'])}"
                for r in cache[key]), flush=True)
    return cache


def _label(backend, settings) -> str:
    return backend + (f" ({settings})" if settings != _aot_compare.DEFAULT else "")


def _speedups(rows) -> list:
    xla = [r["seconds"] for r in rows if r["backend"] == "xla" and not r["error"]]
    best = min(xla) if xla else 0.0
    return [r | {"speedup": best / r["seconds"] if r["seconds"] and best else 0.0}
            for r in rows]


def _us(v) -> str:
    return f"{v * 1e6:,.0f}"


def _order(key):
    """Targets in `TARGETS`' order, then programs in `_aot_compare.PROGRAMS`'."""
    name, program = key.split("|")
    return (TARGETS.index(name) if name in TARGETS else len(TARGETS), name,
            _aot_compare.PROGRAMS.index(program))


def table(cache) -> str:
    """One line per (target, program): each variant's predicted time, and auto's and the
    best fusedpar backend's speed-up over the best xla row."""
    head = ("| target | program | xla | xla (CM) | xla (SC) | xla (CM+SC) | reference | "
            "reference (CM) | ring | pallas | auto | auto vs best xla | bounds | temp MiB: "
            "best xla / ring / auto | auto temp / best xla |")
    lines = [head, "|---|---|" + "---:|" * 10 + "---|---:|---:|"]
    order = [_label(b, s) for b, s in _aot_compare.ROWS]
    for key in sorted(cache, key=_order):
        rows = cache[key]
        name, program = key.split("|")
        by = {_label(r["backend"], r["settings"]): r for r in rows}
        cells = [("-" if k not in by or by[k]["error"] else
                  (">= " if by[k].get("floor") else "")
                  + _us(by[k]["seconds"])) for k in order]
        auto = by.get("auto", {})
        bounds = all(r["bounds"] for r in rows if not r["error"])
        memory, ratio = _memory(rows, by)
        lines.append(f"| {name} | {program} | " + " | ".join(cells)
                     + f" | {auto.get('speedup', 0):.2f}x | "
                     + ("hold" if bounds else "BROKEN") + f" | {memory} | {ratio} |")
    return "\n".join(lines)


def _memory(rows, by) -> tuple:
    """The temporary memory (MiB) of the fastest xla row, the ring and auto ("-" where the
    cache has none: rows compiled before it was recorded), and auto's over that xla row's."""
    xla = [r for r in rows if r["backend"] == "xla" and not r["error"]]
    best = min(xla, key=lambda r: r["seconds"]) if xla else {}
    cells = [_aot_compare.mib(r.get("temp_mib")) for r in (best, by.get("ring", {}),
                                                           by.get("auto", {}))]
    auto, base = by.get("auto", {}).get("temp_mib"), best.get("temp_mib")
    return " / ".join(cells), f"{auto / base:.2f}" if auto and base else "-"


def summary(cache) -> str:
    """Where auto stands against the best xla row, and where XLA's own collective matmul
    of the reference (the peer `auto` could pick) beats fusedpar's decompositions."""
    behind, behind_keys, peer, floors, n = [], [], [], [], 0
    for key in sorted(cache, key=_order):
        by = {(r["backend"], r["settings"]): r for r in cache[key] if not r["error"]}
        auto = by.get(("auto", _aot_compare.DEFAULT))
        if auto is None:
            continue
        if auto.get("floor"):  # its fused kernels' transfers are not seen: no verdict
            floors.append(key.replace("|", " "))
            continue
        n += 1
        if auto["speedup"] < 0.98:
            behind.append(f"{key.replace('|', ' ')} {auto['speedup']:.2f}x")
            behind_keys.append(key)
        cm = by.get(("reference", _aot_compare.CM))
        ours = [by[(b, _aot_compare.DEFAULT)]["seconds"] for b in ("ring", "pallas")
                if (b, _aot_compare.DEFAULT) in by
                and not by[(b, _aot_compare.DEFAULT)].get("floor")]
        ref = by.get(("reference", _aot_compare.DEFAULT))
        if cm and ref and ours and cm["seconds"] < min(min(ours), 0.99 * ref["seconds"]):
            peer.append(key.replace("|", " "))
    return (f"auto is within 2% of the best xla row (or faster) on {n - len(behind)} of "
            f"{n} programs" + (f"; behind on {', '.join(behind)}" if behind else "") + ". "
            + _level_with_bfloat16_sums(cache, behind_keys)
            + (f"On {', '.join(floors)} auto runs fused TPU kernels: its time is a floor, "
               "so no verdict. " if floors else "")
            + "XLA's collective matmul of the reference (the reference under the "
            "collective-matmul settings, faster than without them) is predicted faster than "
            "fusedpar's ring and (replayable) kernels on "
            + (", ".join(peer) if peer else "none of them") + ".")


def _level_with_bfloat16_sums(cache, keys) -> str:
    """Which of the programs `keys` (auto behind the best xla row) `bench/aot_reduce_dtype.py`
    found within 2% of it with bfloat16 sums, XLA's own: the float32 sums' bytes."""
    import aot_reduce_dtype

    sums = (json.loads(aot_reduce_dtype.CACHE.read_text())
            if aot_reduce_dtype.CACHE.exists() else {})
    level = []
    for key in keys:
        xla = [r["seconds"] for r in cache[key] if r["backend"] == "xla" and not r["error"]]
        bf16 = sums.get(key, {})
        if xla and bf16.get("seconds") and not bf16.get("error") \
                and min(xla) / bf16["seconds"] >= 0.98:
            level.append(key.replace("|", " "))
    if not level:
        return ""
    return (f"With bfloat16 partial sums, as XLA's reduce-scatters sum (the table further "
            f"down), auto is within 2% or faster on {len(level)} of these "
            f"{len(keys)}: {', '.join(level)}: what stands between there is the cost of "
            "fusedpar's default float32 sums (docs/ops.md weighs the error against the "
            "time). ")


# What fusedpar aims for in each layer program, per target: auto at least this much faster
# than the best xla row (H100 with Triton and with cuBLAS GEMMs; the TPU slices), the
# ring's compute at most GOAL_COMPUTE times the reference's, auto's temporary memory at
# most GOAL_MEMORY times the best xla row's.
GOAL_SPEEDUP = {"h100x8": {"mlp": 1.25, "block": 1.15, "prefill": 1.25},
                "tpu": {"mlp": 1.10, "block": 1.10, "prefill": 1.10}}
GOAL_COMPUTE, GOAL_MEMORY = 1.10, 1.05


def goals(cache) -> str:
    """One line per target and layer program: auto's speed-up over the best xla row, the
    ring's compute over the reference's and auto's temporary memory over the best xla
    row's, each beside its goal ("met" or how far)."""
    lines = ["| target | program | auto vs best xla (goal) | best xla / auto's compute "
             "| best xla / least xla compute | ring compute / reference "
             f"(goal <= {GOAL_COMPUTE:.2f}) | auto temp / best xla (goal <= "
             f"{GOAL_MEMORY:.2f}) |", "|---|---|---:|---:|---:|---:|---:|"]
    for key in sorted(cache, key=_order):
        name, program = key.split("|")
        wanted = GOAL_SPEEDUP["h100x8" if name.startswith("h100") else "tpu"].get(program)
        if wanted is None:
            continue
        by = {_label(r["backend"], r["settings"]): r for r in cache[key] if not r["error"]}
        auto, ring, ref = by.get("auto"), by.get("ring"), by.get("reference")
        speed = (f"{auto['speedup']:.2f}x ({wanted:.2f}x"
                 + (", met)" if auto["speedup"] >= wanted else ")")) if auto else "-"
        compute = "-"
        if ring and ref and ref["compute"]:
            c = ring["compute"] / ref["compute"]
            compute = f"{c:.2f}" + (" (met)" if c <= GOAL_COMPUTE else "")
        ratio = _memory(cache[key], by)[1]
        memory = ratio + (" (met)" if ratio != "-" and float(ratio) <= GOAL_MEMORY else "")
        hidden, xla_compute = _headroom(cache[key], auto)
        lines.append(f"| {name} | {program} | {speed} | {hidden} | {xla_compute} | "
                     f"{compute} | {memory} |")
    return "\n".join(lines)


def _headroom(rows, auto) -> tuple:
    """The best xla row's time over auto's compute stream (auto with no transfer exposed)
    and over the least compute stream of the xla rows (a program that computes no more
    than XLA's, every transfer hidden): a speed-up goal above the second needs a compute
    stream shorter than any of XLA's."""
    xla = [r for r in rows if r["backend"] == "xla" and not r["error"]]
    if not xla:
        return "-", "-"
    best = min(r["seconds"] for r in xla)
    least = min(r["compute"] for r in xla)
    return (f"{best / auto['compute']:.2f}x" if auto and auto["compute"] else "-",
            f"{best / least:.2f}x" if least else "-")


def markdown(cache) -> str:
    return "\n".join([
        BEGIN, "## fusedpar against XLA's own partitioning",
        "",
        "Made by `python bench/aot_compare.py` (what `python -m fusedpar.aot --target T "
        "--program P --compare` prints, for every target, layer program and op). Predicted "
        "microseconds per device, replayed from each compiled program "
        "(`fusedpar.aot.predict`), all on the mesh `jax.make_mesh` builds. *xla*: the "
        "program written with `eqx.nn.Linear` under `jax.jit`, `NamedSharding`s and "
        "`with_sharding_constraint` (Megatron-style sequence parallelism), no fusedpar, "
        "compiled with the platform's defaults; *(CM)*: with XLA's collective-matmul "
        "settings (TPU: `xla_tpu_all_gather_collective_matmul_mode` and "
        "`xla_tpu_reduce_scatter_collective_matmul_mode` = `post_spmd_conservative`; GPU: "
        "`xla_gpu_threshold_for_windowed_einsum_mib=0`, "
        "`xla_gpu_multi_streamed_windowed_einsum`, the latency-hiding scheduler). On GPU "
        "the windowed einsum cannot fire in a deviceless compile (`fusedpar/"
        "_aot_baseline.py` says why), so both xla rows are the same program there. "
        "*(SC)*, *(CM+SC)*: the same with XLA's all-gathers, reduce-scatters and "
        "all-reduces offloaded to the SparseCores (`xla_tpu_enable_sparse_core_collective_"
        "offload_*`), on v5p and v6e, where `fusedpar.set_overlap_flags(tpu_generation=...)` "
        "turns it on for that generation ('-' on targets without SparseCores). "
        "fusedpar's rows are compiled with the flags `fusedpar.set_overlap_flags()` sets "
        "for the target's generation. "
        "*auto vs best xla*: the best xla row's time over auto's (above 1: auto is "
        "faster). *bounds*: the replay's compute and communication are at least the "
        "program's dot FLOPs at the peak rate and its collectives' bytes over all links, "
        "on every row. *temp MiB*: each compiled program's temporary memory per device "
        "(`compiled.memory_analysis()`) for the fastest xla row, the ring and auto, and "
        "auto's over that xla row's ('-': compiled before it was recorded). "
        "The fused TPU kernels move their blocks inside one Mosaic kernel; the replay "
        "times each from the plan its call carries (`fusedpar/_compile/_hlo_ring_kernel.py`: its "
        "step matmuls beside its DMAs to ring neighbours). *>=*: a kernel whose plan the "
        "replay could not read (a floor, not a prediction). mlp and block "
        "are training steps; prefill and decode the block's "
        "forward (2048 and 4 positions per tensor-parallel device); an op is its forward "
        "and backward at the sizes of the tables below (xla: `x @ w` under `jax.jit` with "
        "the op's layouts; for ag_rows, whose w is replicated, XLA multiplies each "
        "device's rows and gathers the product, an eighth of the reference's FLOPs; so "
        "does auto, whose program is the one op program compiled with `check_vma=True`, "
        "which lets JAX prove w replicated: `fusedpar/_core/_product_first.py`). fusedpar's "
        "reduce-scatters sum in float32 (`reduce_dtype`'s default), XLA's in bfloat16: "
        "`bench/aot_reduce_dtype.py` puts auto with bfloat16 sums beside these rows "
        "(docs/ops.md).",
        "",
        table(cache), "", summary(cache), "",
        "### Against fusedpar's goals", "",
        "The layer programs above against what fusedpar aims for: auto faster than the "
        "best xla row by the goal's factor, the lax ring's compute (the replay's compute "
        "stream) at most 1.10x the reference's, auto's temporary memory at most 1.05x the "
        "best xla row's ('-': not recorded for that row). *best xla / auto's compute*: "
        "the best xla row's time over auto's compute stream (what auto would reach with "
        "no transfer exposed); *best xla / least xla compute*: over the least compute "
        "stream of the xla rows (what a program computing no more than XLA's, every "
        "transfer hidden, would reach): a goal above the latter needs fusedpar to compute "
        "less than XLA does, which no schedule gives (on 8 H100s the prefill's 1.25x: "
        "XLA's step computes 2,779 of its 3,327 us, the attention's softmax fusion 782 of "
        "them). On TPU the temporary bytes are "
        "where the compiler's buffer packer ends its heap, and its seed alone moves them: "
        "XLA's own block on v5p from 786 to 1,282 MiB, auto's from 842 to 1,274 "
        "(`bench/aot_memory_packing.py`, docs/measurements.md); the column is the "
        "default seed's.", "",
        goals(cache), "", _bfloat16_sums(), _kept_nothing(), _larger_slices(), END, ""])


def _variant_table(module, title: str, intro: str) -> str:
    """A variant script's table (`module.markdown` of its cached rows), if it was run:
    under `### title`, after `intro`."""
    if not module.CACHE.exists():
        return ""
    return "\n".join([f"### {title}", "", intro, "",
                      module.markdown(json.loads(module.CACHE.read_text())), ""])


def _bfloat16_sums() -> str:
    """`bench/aot_reduce_dtype.py`'s table (auto with bfloat16 partial sums)."""
    import aot_reduce_dtype

    return _variant_table(
        aot_reduce_dtype, "auto with bfloat16 partial sums",
        "Made by `python bench/aot_reduce_dtype.py`: auto compiled with "
        "`reduce_dtype=jnp.bfloat16` (the layers' and ops' argument; float32 is the "
        "default), beside the best xla row and auto above (docs/ops.md weighs the "
        "error against the time).")


def _kept_nothing() -> str:
    """`bench/aot_keep_gathered.py`'s table (auto keeping no gathered array)."""
    import aot_keep_gathered

    return _variant_table(
        aot_keep_gathered, "auto keeping nothing it gathers: time against memory",
        "Made by `python bench/aot_keep_gathered.py`: auto compiled with "
        "`keep_gathered=False` on the sequence-parallel Column styles, the Row styles, or "
        "both (the backward gathers again what the forward kept: one more ring per layer, "
        "less temporary memory), beside the best xla row and auto above; each cell is "
        "us (speed-up over the best xla row) / temporary MiB (over the best xla row's). "
        "docs/layers.md says when to use it.")


def _larger_slices() -> str:
    """`bench/aot_larger_slices.py`'s table (auto against XLA on 16 chips)."""
    import aot_larger_slices

    return _variant_table(
        aot_larger_slices, "16 chips",
        "Made by `python bench/aot_larger_slices.py`: the best xla row (defaults, "
        "collective matmul, SparseCore offload where there are SparseCores) and auto on "
        "a slice of 16 chips, the MLP over tp=16 and the blocks over FSDP 2 x TP 8, at "
        "the sizes above; *bounds*: the replay's compute and communication at least "
        "the program's dot FLOPs at the peak rate and its collectives' bytes over all "
        "links, on every row compiled (each xla variant and auto).")


def variant_main(argv, doc: str, cache_path, run, markdown, programs,
                 targets=TARGETS) -> None:
    """The command line of a script that compiles variants of `auto` beside these rows
    (`aot_reduce_dtype.py`, `aot_keep_gathered.py`, `aot_larger_slices.py`):
    `run(targets, programs)` fills and returns its cache, `markdown(cache)` prints it."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--targets", default=",".join(targets))
    p.add_argument("--programs", default=",".join(programs))
    p.add_argument("--markdown-only", action="store_true")
    args = p.parse_args(argv)
    cache = (json.loads(cache_path.read_text()) if args.markdown_only else
             run(args.targets.split(","), args.programs.split(",")))
    print(markdown(cache))


def write(cache) -> None:
    text = RESULTS.read_text()
    block = markdown(cache)
    if BEGIN in text:
        start, end = text.index(BEGIN), text.index(END) + len(END) + 1
        text = text[:start] + block + text[end:]
    else:  # after the title and the paragraph that follows it
        head, _, rest = text.partition("\n\n")
        intro, _, rest = rest.partition("\n\n")
        text = f"{head}\n\n{intro}\n\n{block}\n{rest}"
    RESULTS.write_text(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="comma-separated; 'h100x8 cublas' for cuBLAS GEMMs")
    p.add_argument("--programs", default=",".join(_aot_compare.PROGRAMS))
    p.add_argument("--force", action="store_true", help="recompile cached rows")
    p.add_argument("--rows", default=None,
                   help="recompile only these rows of cached programs, comma-separated "
                        "labels: " + ", ".join(_label(*r) for r in _aot_compare.ROWS))
    p.add_argument("--markdown-only", action="store_true")
    args = p.parse_args(argv)
    cache = _load() if args.markdown_only else run(
        args.targets.split(","), args.programs.split(","), args.force,
        set(args.rows.split(",")) if args.rows else None)
    write(cache)


if __name__ == "__main__":
    main()
