"""The FSDP weight gathers of the block program: which transfers are exposed, and for how
long, per target and backend (a deviceless compile; the replay of `fusedpar.aot.predict`).

    python bench/fsdp_gathers.py --targets h100x8 v5e:2x4 --backends ring auto reference
    python bench/fsdp_gathers.py --targets v5e:2x4 --without-generation-flags   # before

Prints per program: the predicted time, the seconds the compute stream waited on
transfers, the compiled step's temporary memory (`memory_analysis().temp_size_in_bytes`)
and every collective outside the fusedpar ops' rings ("other": the FSDP gathers and their
gradients' reduce-scatters) with its bytes, its replayed time in flight and whether a
matmul runs while it is in flight. TPU slices are compiled with the flags
`fusedpar.tpu_overlap_flags(generation)` gives their generation (`fusedpar.aot`'s
`compiler_options` has those of every generation only). Needs the aot extra.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fusedpar import aot  # noqa: E402  (sets the environment before JAX starts)


def _waits() -> dict:
    """Record, per collective, the seconds the replay's compute stream waits for it at its
    done: `Prediction` has the total only. (Wraps the replay's private `_finish`; a
    bench, not the package, so a change there shows up here as a KeyError, not silently.)"""
    from fusedpar._compile import _simulate

    waits: dict = {}
    finish = _simulate._Replay._finish

    def recording(self, key, now):
        name = self.started[key][1] if key in self.started else None
        end = finish(self, key, now)
        if name is not None:
            waits[name] = waits.get(name, 0.0) + end - now
        return end

    _simulate._Replay._finish = recording
    return waits


_WAITS = None


def options(target: str, mesh, generation_flags: bool = True) -> dict:
    """The compiler options: `aot.compiler_options(target)` and, with `generation_flags`,
    the flags `fusedpar.tpu_overlap_flags(generation)` adds for the slice's generation."""
    from fusedpar._hw import _target, _xla_flags

    options = aot.compiler_options(target)  # the generation's flags included
    found = _target.of_mesh(mesh)
    generation = found.tpu_generation if found.platform == "tpu" else None
    extra = {n for n, _ in _xla_flags._TPU_GENERATION_FLAGS.get(generation, ())}
    return {k: v for k, v in options.items() if generation_flags or k not in extra}


def measure(target: str, backend: str, program: str = "block",
            generation_flags: bool = True) -> dict:
    """Compile `program` ("block" or "block-qkv") for `target` with `backend`; the row."""
    import functools

    import jax

    from fusedpar._compile import _aot_programs as progs

    n = len(aot.devices(target))
    mesh = aot.mesh(target, (2, n // 2), ("fsdp", "tp"))
    build = functools.partial(progs.block_program, fused_qkv=program == "block-qkv")
    fn, args = build(mesh, backend)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile(
            compiler_options=options(target, mesh, generation_flags) or None)
    seconds = time.perf_counter() - start
    global _WAITS
    _WAITS = _waits() if _WAITS is None else _WAITS
    _WAITS.clear()
    report, predicted = aot.overlap(compiled), aot.predict(compiled, mesh)
    costs = {c.name: c for c in predicted.transfers}
    others = []
    for t in report.transfers:
        if t.op[0] != "other":
            continue
        c = costs.get(t.name)
        others.append(dict(name=t.name, kind=t.kind, pass_=t.op[2], bytes=t.bytes,
                           hidden=t.hidden, hideable=t.hideable,
                           in_flight_us=round(c.seconds * 1e6, 1) if c else None,
                           waited_us=round(_WAITS.get(t.name, 0.0) * 1e6, 1)))
    return dict(target=target, program=program, backend=backend,
                generation_flags=generation_flags, compile_s=round(seconds, 1),
                predicted_us=round(predicted.seconds * 1e6, 1),
                compute_us=round(predicted.compute * 1e6, 1),
                exposed_us=round(predicted.exposed * 1e6, 1),
                other_waited_us=round(sum(o["waited_us"] for o in others), 1),
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                hidden=report.hidden, transfers=report.total, others=others)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["h100x8", "v5e:2x4"])
    p.add_argument("--backends", nargs="+", default=["ring", "auto", "reference"])
    p.add_argument("--program", default="block", choices=("block", "block-qkv"))
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--without-generation-flags", action="store_true",
                   help="compile with the flags every TPU generation takes only (before "
                        "fusedpar.tpu_overlap_flags(generation))")
    args = p.parse_args(argv)
    rows = []
    for target in args.targets:
        for backend in args.backends:
            row = measure(target, backend, args.program,
                          generation_flags=not args.without_generation_flags)
            rows.append(row)
            before = "" if row["generation_flags"] else " (without generation flags)"
            print(f"{target} {args.program} {backend}{before}: {row['predicted_us']:,.0f} us "
                  f"(compute {row['compute_us']:,.0f}, waiting {row['exposed_us']:,.0f}, on the "
                  f"FSDP and other collectives {row['other_waited_us']:,.0f}), "
                  f"temp {row['temp_bytes'] / 2**20:,.0f} MiB, {row['hidden']}/"
                  f"{row['transfers']} hidden, compiled in {row['compile_s']} s")
            for o in row["others"]:
                print(f"    {o['pass_']:8} {o['kind']:22} {o['bytes']:>12,} B "
                      f"{o['in_flight_us'] or 0:>8,.1f} us in flight, waited "
                      f"{o['waited_us']:>6,.1f} us "
                      f"{'hidden' if o['hidden'] else 'EXPOSED'}"
                      f"{'' if o['hideable'] else ' (unhideable)'}  {o['name']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
