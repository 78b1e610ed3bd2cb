"""Does XLA overlap a GPU ring's transfers with its step kernels? Read the compiled schedule.

Compiles every op x backend x ring direction for 8 mock H100s in one process (compile
only: a mock device cannot execute), once per set of XLA flags, and reads the scheduled
HLO (`compiled.as_text()`, whose instruction order is the schedule). A ring step's
transfer is a `collective-permute-start` ... `collective-permute-done` pair; a step's
compute is a matmul (a cuBLAS/Triton gemm, a Pallas kernel's custom call, or a fusion
that contains a dot). For each program it reports

- `transfers`: collective-permutes, and how many of them enclose some compute (an
  asynchronous start before the compute, its done after it);
- `compute_steps`: matmuls, and `exposed`: how many run while no transfer is in flight.

A ring of N devices has N compute steps and N - 1 transfers per direction; the schedule
overlaps fully when every transfer encloses compute and one step is exposed (an
all-gather's last, a reduce-scatter's first).

Run on a machine with a CUDA GPU and JAX's CUDA plugin (the mock topology needs it):

    python bench/gpu_overlap.py --out bench/overlap-gpu.json   # writes JSON, prints Markdown

Each flag set runs in its own process: XLA reads `XLA_FLAGS` once, when it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

# The flag sets compared: XLA's defaults, and fusedpar.gpu_overlap_flags() (filled in by
# main(), which imports fusedpar only after deciding what to run).
FLAG_SETS = ("default", "fusedpar")
DEVICES = 8
# Per device: x (1024, 4096), w (4096, 4096), float16 (the README's cost-model shape).
ROWS, K, COLS = 1024, 4096, 4096

_COMPUTE_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__gpu$xla.gpu.triton",
                    "mosaic_gpu", "__triton_gemm", "__triton")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\b([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:calls|body|to_apply)=%?([\w.\-]+)")


@dataclasses.dataclass
class Schedule:
    """What one computation's schedule says about transfers and compute."""

    transfers: int = 0
    transfers_overlapping: int = 0
    compute_steps: int = 0
    exposed: int = 0

    def add(self, other: "Schedule"):
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _computations(text: str) -> dict[str, list[str]]:
    """HLO text -> {computation name: its instruction lines, in schedule order}."""
    comps, name = {}, None
    for line in text.splitlines():
        if name is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("{")[0]:
                name = m.group(1)
                comps[name] = []
            continue
        if line.strip() == "}":
            name = None
        elif line.strip():
            comps[name].append(line)
    return comps


def _computing(comps) -> set[str]:
    """Names of the computations that contain a matmul, directly or through calls."""
    direct = {n for n, lines in comps.items()
              if any(" dot(" in l or any(t in l for t in _COMPUTE_TARGETS) for l in lines)}
    changed = True
    while changed:
        changed = False
        for n, lines in comps.items():
            if n not in direct and any(c in direct for l in lines for c in _CALLS.findall(l)
                                       if "fusion(" in l or "call(" in l):
                direct.add(n)
                changed = True
    return direct


def _is_compute(line: str, computing: set[str]) -> bool:
    if " dot(" in line or any(t in line for t in _COMPUTE_TARGETS):
        return True
    if "fusion(" in line or " call(" in line:
        return any(c in computing for c in _CALLS.findall(line))
    return False


def analyse(text: str) -> Schedule:
    """Transfers and compute of a scheduled HLO module (`compiled.as_text()`).

    Each computation is read in its schedule order (while-loop bodies included): a
    synchronous `collective-permute` encloses nothing; a `-start` is in flight until its
    `-done`.
    """
    comps = _computations(text)
    computing = _computing(comps)
    # Fusion bodies run inside their fusion's kernel: only the other computations have a
    # schedule of their own.
    fused = {c for lines in comps.values() for l in lines if "fusion(" in l
             for c in _CALLS.findall(l)}
    total = Schedule()
    for name, lines in comps.items():
        if name in fused:
            continue
        s = Schedule()
        open_starts: dict[str, bool] = {}  # start name -> has enclosed compute
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            name, op = m.groups()
            if op == "collective-permute-start":
                open_starts[name] = False
                s.transfers += 1
            elif op == "collective-permute-done":
                started = re.search(r"collective-permute-done\(\s*%?([\w.\-]+)", line)
                if started and open_starts.pop(started.group(1), False):
                    s.transfers_overlapping += 1
            elif op == "collective-permute":
                s.transfers += 1
            elif _is_compute(line, computing) and op in ("fusion", "custom-call", "dot"):
                s.compute_steps += 1
                if open_starts:
                    for k in open_starts:
                        open_starts[k] = True
                else:
                    s.exposed += 1
        total.add(s)
    return total


# -- the programs (only in the worker process, after the mock topology is set) -----------


def _programs():
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, PartitionSpec as P

    import fusedpar

    mesh = jax.make_mesh((DEVICES,), ("x",), axis_types=(AxisType.Auto,))
    S = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float16)
    n = DEVICES
    # op name -> (call, global x shape, global w shape, x spec, w spec, out spec)
    ops = {
        "ag_rows": (lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", **kw),
                    (n * ROWS, K), (K, COLS), P("x"), P(), P()),
        "ag_cols": (lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", gather="rhs",
                                                                  dim=1, **kw),
                    (n * ROWS, K), (K, COLS), P("x"), P(None, "x"), P("x")),
        "ag_contract": (lambda x, w, **kw: fusedpar.all_gather_matmul(
            x, w, "x", gather="rhs", dim=0, **kw),
            (n * ROWS, K), (K, COLS), P("x"), P("x"), P("x")),
        "rs_rows": (lambda x, w, **kw: fusedpar.matmul_reduce_scatter(x, w, "x", dim=0, **kw),
                    (ROWS, n * K), (n * K, COLS), P(None, "x"), P("x"), P("x")),
        "rs_cols": (lambda x, w, **kw: fusedpar.matmul_reduce_scatter(x, w, "x", dim=1, **kw),
                    (ROWS, n * K), (n * K, COLS), P(None, "x"), P("x"), P(None, "x")),
    }
    for op, (call, xs, ws, xspec, wspec, ospec) in ops.items():
        for backend in ("ring", "pallas_gpu"):
            for bidirectional in (False, True):
                fn = functools.partial(call, backend=backend, bidirectional=bidirectional)
                program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(xspec, wspec),
                                                out_specs=ospec, check_vma=False))
                yield (op, backend, bidirectional), program, (S(xs), S(ws))


def worker(flag_set: str) -> list[dict]:
    import jax

    # 8 mock H100s in one process: compile only (executing on them hangs).
    jax.config.update("jax_mock_gpu_topology", f"1x{DEVICES}x1")
    jax.config.update("jax_cuda_visible_devices", "0")
    rows = []
    for (op, backend, bidi), program, args in _programs():
        row = dict(flags=flag_set, op=op, backend=backend, bidirectional=bidi)
        try:
            text = program.lower(*args).compile().as_text()
            row.update(dataclasses.asdict(analyse(text)))
        except Exception as e:  # noqa: BLE001 - one failing program must not hide the rest
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows, device="8 mock H100 (compile only)") -> str:
    out = [f"### Overlap in the compiled schedule — {device}", "",
           f"Per device x ({ROWS}, {K}), w ({K}, {COLS}) float16, ring of {DEVICES}. "
           "*transfers*: collective-permutes enclosing compute / all; *exposed*: matmul "
           "steps with no transfer in flight / all matmul steps.", "",
           "| op | backend | ring | flags | transfers overlapping compute | exposed steps |",
           "|---|---|---|---|---:|---:|"]
    for r in rows:
        ring = "bidirectional" if r["bidirectional"] else "unidirectional"
        if "error" in r:
            cells = f"error: {r['error'][:80]} | —"
        else:
            cells = (f"{r['transfers_overlapping']} / {r['transfers']} | "
                     f"{r['exposed']} / {r['compute_steps']}")
        out.append(f"| {r['op']} | {r['backend']} | {ring} | {r['flags']} | {cells} |")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--worker", choices=FLAG_SETS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fusedpar

    flags = {"default": "", "fusedpar": fusedpar.gpu_overlap_flags()}
    rows = []
    for name in FLAG_SETS:
        env = dict(os.environ, XLA_FLAGS=flags[name])
        done = subprocess.run([sys.executable, __file__, "--worker", name], env=env,
                              capture_output=True, text=True)
        rows += [json.loads(l) for l in done.stdout.splitlines() if l.startswith("{")]
        if done.returncode:
            print(f"worker {name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"flags": flags, "rows": rows}, f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
