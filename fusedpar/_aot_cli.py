"""`python -m fusedpar.aot`: compile a program for a target and print what overlaps."""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import os
import time

PROGRAMS = ("ops", "mlp", "block", "block-qkv", "demo")
BACKENDS = ("reference", "ring", "pallas", "auto")


def _parse(argv):
    from . import _aot as aot

    p = argparse.ArgumentParser(
        prog="python -m fusedpar.aot",
        description="Compile a program for hardware that is not here and print, per op, "
                    "which transfers have a matmul in flight.")
    p.add_argument("--target", required=True,
                   help=f"what to compile for: {', '.join(aot.TARGETS)} (or another TPU "
                        "slice, or h100xN)")
    p.add_argument("--program", default="mlp",
                   help="ops (the five primitives, forward and backward), mlp (a "
                        "sequence-parallel MLP), block (an FSDP x TP transformer block), "
                        "block-qkv (the block with one q, k, v projection), "
                        "demo (the demo's model), or your own: FILE.py:FUNCTION or "
                        "module:FUNCTION, a function (mesh, backend) -> (jitted, args)")
    p.add_argument("--backend", default="auto", help=f"one of {', '.join(BACKENDS)}")
    p.add_argument("--mesh", default=None,
                   help="mesh shape, e.g. 2x4 (default: all devices on one axis; 2 x n/2 "
                        "for the blocks and demo)")
    p.add_argument("--axes", default=None,
                   help="mesh axis names, comma-separated (default: x for ops, tp for "
                        "mlp, fsdp,tp for the blocks and demo)")
    p.add_argument("--cublas", action="store_true",
                   help="GPU: cuBLAS GEMMs instead of Triton ones")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        aot._check_target(args.target)
    except ValueError as e:
        p.error(f"--target: {e}")
    if args.backend not in BACKENDS:
        p.error(f"--backend: unknown {args.backend!r}; valid: {', '.join(BACKENDS)}")
    if args.program not in PROGRAMS and ":" not in args.program:
        p.error(f"--program: {args.program!r} is neither one of {', '.join(PROGRAMS)} nor "
                "FILE.py:FUNCTION / module:FUNCTION")
    return args


def _user_program(spec):
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        loader = importlib.util.spec_from_file_location("aot_user_program", where)
        if loader is None or not os.path.exists(where):
            raise SystemExit(f"--program: no file {where!r}")
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise SystemExit(f"--program: {where} has no function {name!r}")
    return getattr(module, name)


def _mesh(args, n_default_axes):
    from . import _aot as aot

    axes = tuple(args.axes.split(",")) if args.axes else n_default_axes
    devices = len(aot.devices(args.target))
    if args.mesh:
        shape = tuple(int(v) for v in args.mesh.lower().split("x"))
    elif len(axes) == 2:
        shape = (2, devices // 2)
    else:
        shape = (devices,)
    return aot.mesh(args.target, shape, axes)


def _programs(args):
    """`(label, mesh, jitted, arguments)` of everything `args` asks to compile."""
    from . import _aot_programs as progs, _primitives as prims

    backend = args.backend
    if args.program == "ops":
        mesh = _mesh(args, ("x",))
        for prim in prims.PRIMITIVES:
            for bidirectional in (False, True):
                ring = "bidirectional" if bidirectional else "unidirectional"
                fn, a = progs.op_program(mesh, prim, backend, bidirectional=bidirectional)
                yield f"{prim} {ring}", mesh, fn, a
        return
    if args.program == "mlp":
        mesh = _mesh(args, ("tp",))
        build = progs.mlp_program
    else:
        mesh = _mesh(args, ("fsdp", "tp"))
        build = {"block": progs.block_program, "demo": progs.demo_program,
                 "block-qkv": functools.partial(progs.block_program, fused_qkv=True),
                 }.get(args.program)
        build = build or _user_program(args.program)
    fn, a = build(mesh, backend)
    yield args.program, mesh, fn, a


def main(argv=None):
    args = _parse(argv)
    from . import _aot as aot

    options = aot.compiler_options(args.target, args.cublas)
    rows = []
    for label, mesh, fn, arguments in _programs(args):
        start = time.perf_counter()
        compiled = fn.lower(*arguments).compile(compiler_options=options or None)
        seconds = time.perf_counter() - start
        report = aot.overlap(compiled)
        predicted = aot.predict(compiled, mesh)
        print(report.markdown(f"{args.target}: {label}, backend={args.backend} "
                              f"(compiled in {seconds:.1f} s)"))
        print(f"Predicted per device: {predicted.seconds * 1e6:,.0f} us (lower bound "
              f"{predicted.lower_bound * 1e6:,.0f} us: compute "
              f"{predicted.compute * 1e6:,.0f} us, communication over all links "
              f"{predicted.min_comm_s * 1e6:,.0f} us; waiting on transfers "
              f"{predicted.exposed * 1e6:,.0f} us).")
        for what in predicted.unread:
            print(f"Not read by the replay: {what}")
        print()
        rows.append(dict(target=args.target, program=label, backend=args.backend,
                         compile_s=round(seconds, 2), hidden=report.hidden,
                         predicted_us=round(predicted.seconds * 1e6, 1),
                         lower_bound_us=round(predicted.lower_bound * 1e6, 1),
                         transfers=report.total,
                         ops=[dict(op=s.op[0], backend=s.op[1], direction=s.op[2],
                                   transfers=s.transfers, hidden=s.hidden, bytes=s.bytes,
                                   matmuls=s.matmuls, exposed=s.exposed, verdict=s.verdict)
                              for s in report.ops]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
