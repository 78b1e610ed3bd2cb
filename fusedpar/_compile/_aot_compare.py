"""`python -m fusedpar.aot --compare`: one program, compiled as a user without fusedpar
writes it (the `xla` rows, `fusedpar._compile._aot_baseline`) and with each fusedpar backend, every
row replayed on the same target and the same mesh (`jax.make_mesh`'s order, as a user
builds it), side by side."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from . import _aot_baseline as baseline, _hlo_ring_kernel
from .._core import _backends, _primitives as prims

DEFAULT, CM = "default", "collective matmul"
# XLA's collectives offloaded to the SparseCores (`_xla_flags.SPARSECORE_OFFLOAD`), alone
# and with the collective matmul: fusedpar's flags turn it on for v5p and v6e, so the
# plain program gets it too. A target without SparseCores has no such rows.
OFFLOAD, CM_OFFLOAD = "SparseCore offload", "collective matmul + SparseCore offload"
# (backend, settings) of every row, in the table's order: "xla" is XLA's own partitioning
# of the plain program; the others are fusedpar's backends, compiled with the flags
# `fusedpar.set_overlap_flags()` sets, and the reference also with XLA's
# collective-matmul settings (which, on TPU, decompose its all_gather + dot).
# fusedpar's rows are the backends `auto` weighs (`_backends.candidates()`: reference,
# ring, pallas), a "reference"-family one also with the collective-matmul settings.
ROWS = (tuple(("xla", s) for s in (DEFAULT, CM, OFFLOAD, CM_OFFLOAD))
        + tuple((b.name, settings) for b in _backends.candidates()
                for settings in ((DEFAULT, CM) if b.cost == "reference" else (DEFAULT,)))
        + (("auto", DEFAULT),))
# Below this speed-up over the best xla row `markdown` says why auto may be behind.
BEHIND = 0.98
# The layer programs, and each primitive alone (forward and backward, as `--program ops`
# compiles it, on one axis "x").
PROGRAMS = baseline.LAYER_PROGRAMS + tuple(prims.PRIMITIVES)


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled variant of a program and its replayed time (seconds per device).

    `speedup`: the best `xla` row's seconds over this row's (above 1: faster than what
    XLA does alone); `bounds`: whether the replay's compute and communication are at
    least the program's own lower bounds (`Prediction.min_compute_s`, `min_comm_s`);
    `floor`: the program runs a kernel that sends bytes itself whose plan the replay
    could not read (`_hlo_ring_kernel`): its time is a floor, not a prediction;
    `temp_mib`: the compiled program's temporary memory per device
    (`compiled.memory_analysis()`, MiB; None where the compiler does not say); `error`:
    why the row did not compile (its numbers are then 0)."""

    backend: str
    settings: str
    seconds: float = 0.0
    compute: float = 0.0
    communication: float = 0.0
    exposed: float = 0.0
    hidden: int = 0
    transfers: int = 0
    compile_s: float = 0.0
    speedup: float = 0.0
    unread: tuple = ()
    bounds: bool = True
    floor: bool = False
    temp_mib: Optional[float] = None
    error: str = ""

    @property
    def label(self) -> str:
        return self.backend + (f" ({self.settings})" if self.settings != DEFAULT else "")


def platform(target: str) -> str:
    from . import _aot

    return _aot._check_target(target)[0].platform


def options(target: str, backend: str, settings: str, cublas: bool = False) -> dict:
    """The `compiler_options` of a row: none for XLA's defaults (the GEMM backend aside)
    and fusedpar's overlap flags for fusedpar's backends; `CM` adds XLA's
    collective-matmul settings (`_aot_baseline.COLLECTIVE_MATMUL`), `OFFLOAD` the
    SparseCore offload (`compare` asks for it only where there are SparseCores),
    `CM_OFFLOAD` both."""
    from . import _aot
    from .._hw._xla_flags import SPARSECORE_OFFLOAD

    if backend == "xla":
        opts = {"xla_gpu_enable_triton_gemm": False} if cublas else {}
    else:
        opts = _aot.compiler_options(target, cublas)
    if settings in (CM, CM_OFFLOAD):
        opts = {**opts, **_aot._options(baseline.COLLECTIVE_MATMUL[platform(target)])}
    if settings in (OFFLOAD, CM_OFFLOAD):
        opts = {**opts, **_aot._options(SPARSECORE_OFFLOAD)}
    return opts


def has_sparsecores(target: str) -> bool:
    """Whether fusedpar offloads XLA's collectives to the target's SparseCores."""
    from . import _aot
    from .._hw._xla_flags import SPARSECORE_GENERATIONS

    return _aot._check_target(target)[0].generation in SPARSECORE_GENERATIONS


def mesh(target: str, program: str):
    """`jax.make_mesh`'s mesh of the target's devices: ("tp",) for the MLP, ("x",) for
    an op, ("fsdp", "tp") of 2 x n/2 for the blocks."""
    from . import _aot

    n = len(_aot.devices(target))
    if program == "mlp" or program in prims.PRIMITIVES:
        axis = "tp" if program == "mlp" else "x"
        return _aot.mesh(target, (n,), (axis,), make_mesh=True)
    return _aot.mesh(target, (2, n // 2), ("fsdp", "tp"), make_mesh=True)


def build(mesh_, program: str, backend: str, **sizes):
    """`(jitted, args)` of a row's program (`xla`: `_aot_baseline`'s)."""
    from . import _aot_programs as progs

    if program in prims.PRIMITIVES:
        if backend == "xla":
            return baseline.op_program(mesh_, program, **sizes)
        return progs.op_program(mesh_, program, backend, **sizes)
    if backend == "xla":
        return baseline.layer_program(mesh_, program, **sizes)
    if program == "mlp":
        return progs.mlp_program(mesh_, backend, **sizes)
    return progs.block_program(mesh_, backend, program=program, **sizes)


def _row(target, mesh_, program, backend, settings, cublas, sizes, texts) -> Row:
    import jax

    from . import _aot

    start = time.perf_counter()
    try:
        fn, args = build(mesh_, program, backend, **sizes)
        with jax.set_mesh(mesh_):
            compiled = fn.lower(*args).compile(
                compiler_options=options(target, backend, settings, cublas) or None)
    except Exception as e:  # a backend that cannot run here, a compiler that refuses
        return Row(backend, settings, error=f"{type(e).__name__}: {str(e)[:200]}")
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    if texts is not None:
        texts[(backend, settings)] = text
    report = _aot.overlap(text)
    p = _aot.predict(text, mesh_)
    memory = compiled.memory_analysis()
    bounds = (p.compute >= p.min_compute_s * (1 - 1e-9)
              and p.communication >= p.min_comm_s * (1 - 1e-9))
    return Row(backend, settings, p.seconds, p.compute, p.communication, p.exposed,
               report.hidden, report.total, seconds, unread=tuple(p.unread), bounds=bounds,
               floor=any(_hlo_ring_kernel.UNREAD in u for u in p.unread),
               temp_mib=None if memory is None else memory.temp_size_in_bytes / 2**20)


def compare(target: str, program: str, *, cublas: bool = False, rows=ROWS,
            texts: Optional[dict] = None, **sizes) -> list:
    """`Row`s of `program` (one of `PROGRAMS`) on `target`, one per `(backend,
    settings)` of `rows` (but the SparseCore offload's on a target without
    SparseCores), each with its speed-up over the best `xla` row; `texts`
    (a dict), when given, receives each row's compiled HLO text by `(backend,
    settings)`. `sizes` override `_aot_programs.LAYER_SIZES[program]`."""
    if program not in PROGRAMS:
        raise ValueError(f"compare: program must be one of {PROGRAMS}, got {program!r}.")
    mesh_ = mesh(target, program)
    if not has_sparsecores(target):
        rows = [r for r in rows if r[1] not in (OFFLOAD, CM_OFFLOAD)]
    out = [_row(target, mesh_, program, b, s, cublas, sizes, texts) for b, s in rows]
    xla = [r.seconds for r in out if r.backend == "xla" and not r.error]
    best = min(xla) if xla else 0.0
    return [dataclasses.replace(r, speedup=best / r.seconds if r.seconds and best else 0.0)
            for r in out]


def mib(value) -> str:
    """Temporary memory in MiB for a table ("-" where unknown)."""
    return "-" if value is None else f"{value:,.0f}"


def markdown(rows, title: str = "") -> str:
    """The comparison as a markdown table (times in microseconds per device)."""
    lines = [f"### {title}", ""] if title else []
    lines += ["| variant | predicted (us) | compute (us) | communication (us) | waiting (us) "
              "| transfers hidden | vs best xla | bounds | temp memory (MiB) | compiled (s) |",
              "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.label} | - | - | - | - | - | - | - | - | {r.error} |")
            continue
        lines.append(f"| {r.label} | {'>= ' if r.floor else ''}{r.seconds * 1e6:,.0f} | "
                     f"{r.compute * 1e6:,.0f} | "
                     f"{r.communication * 1e6:,.0f} | {r.exposed * 1e6:,.0f} | "
                     f"{r.hidden} / {r.transfers} | {r.speedup:.2f}x | "
                     f"{'hold' if r.bounds else 'BROKEN'} | {mib(r.temp_mib)} | "
                     f"{r.compile_s:.1f} |")
    lines += ["", "transfers hidden: XLA's collectives with a matmul in flight; a fused "
                  "TPU kernel's DMAs run inside it and are not counted there (the replay "
                  "times them from the kernel's plan, in predicted and waiting)."]
    if any(r.floor for r in rows):
        lines += ["", ">= : a kernel sends blocks itself and the replay could not read its "
                      "plan: a floor, not a prediction."]
    auto = next((r for r in rows if r.backend == "auto" and not r.error), None)
    if auto is not None and 0 < auto.speedup < BEHIND:
        lines += ["", f"auto is {auto.speedup:.2f}x the best xla row here. fusedpar's "
                      "reduce-scatters sum in float32 by default (`reduce_dtype`, for "
                      "accuracy), XLA's in the inputs' dtype: twice the bytes where a "
                      "reduce-scatter cannot hide. `reduce_dtype=jnp.bfloat16` on the ops, "
                      "layers or styles sums as XLA does (docs/ops.md weighs the error "
                      "against the time)."]
    unread = sorted({u for r in rows for u in r.unread})
    if unread:
        lines += ["", "Not read by the replay: " + "; ".join(unread)]
    return "\n".join(lines)
