"""`python -m fusedpar.aot`: compile a program for a target and print what overlaps."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import time

from .._core import _backends  # imported with fusedpar already

PROGRAMS = ("ops", "mlp", "block", "block-qkv", "prefill", "decode", "demo")
# What `--backend` takes: the backends `auto` weighs (reference, ring, pallas), and auto.
BACKENDS = tuple(b.name for b in _backends.candidates()) + (_backends.AUTO,)
# The mesh axes a program gets without --axes: the built-in ones are written for these;
# the blocks, the demo and your own program (FILE.py:FUNCTION) get ("fsdp", "tp").
AXES = {"ops": ("x",), "mlp": ("tp",)}
TWO_AXES = ("fsdp", "tp")
_MESH = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*)*$")


def _parser():
    from . import _aot as aot

    p = argparse.ArgumentParser(
        prog="python -m fusedpar.aot",
        description="Compile a program for hardware that is not here and print, per op, "
                    "which transfers have a matmul in flight.")
    p.add_argument("--target", required=True,
                   help=f"what to compile for: {', '.join(aot.TARGETS)} (or another TPU "
                        "slice, tpu7x:<slice> among them, or h100xN, h200xN)")
    p.add_argument("--program", default="mlp",
                   help="ops (the five primitives, forward and backward), mlp (a "
                        "sequence-parallel MLP), block (an FSDP x TP transformer block), "
                        "block-qkv (the block with one q, k, v projection), "
                        "prefill and decode (the block's forward at a longer sequence "
                        "and at a few tokens per device), "
                        "demo (the demo's model), or your own: FILE.py:FUNCTION or "
                        "module:FUNCTION, a function (mesh, backend) -> (jitted, args), "
                        "lowered under jax.set_mesh(mesh) (docs/aot.md)")
    p.add_argument("--backend", default="auto", help=f"one of {', '.join(BACKENDS)}")
    p.add_argument("--mesh", default=None,
                   help="mesh shape, one size per axis name, e.g. 2x4; the sizes multiply "
                        "to the target's device count (default: all devices on one axis "
                        "for one axis name, 2 x n/2 for two)")
    p.add_argument("--axes", default=None,
                   help="mesh axis names, comma-separated (default: x for ops, tp for "
                        "mlp, fsdp,tp for block, block-qkv, prefill, decode, demo and your "
                        "own program)")
    p.add_argument("--cublas", action="store_true",
                   help="GPU: cuBLAS GEMMs instead of Triton ones")
    p.add_argument("--compare", action="store_true",
                   help="compile the program (mlp, block, prefill, decode, or each op of "
                        "ops) as XLA "
                        "partitions it without fusedpar (with the platform's defaults and "
                        "with XLA's collective matmul) and with each fusedpar backend, and "
                        "print the predicted times side by side, on jax.make_mesh's mesh")
    p.add_argument("--breakdown", action="store_true",
                   help="also print where the replayed time goes: the compute stream by "
                        "kind of instruction, and the transfers it waited for")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    return p


def breakdown(predicted, top: int = 12) -> str:
    """Markdown: the compute stream's time by kind of instruction, and the transfers the
    stream waited for, longest first (`top` rows each) — where a replayed program's time
    goes."""
    lines = ["| compute stream: kind | count | us |", "|---|---:|---:|"]
    lines += [f"| {k.kind} | {k.count} | {k.seconds * 1e6:,.1f} |"
              for k in predicted.kernels[:top]]
    rest = predicted.kernels[top:]
    if rest:
        lines.append(f"| {len(rest)} other kinds | {sum(k.count for k in rest)} | "
                     f"{sum(k.seconds for k in rest) * 1e6:,.1f} |")
    waited = sorted((t for t in predicted.transfers if t.waited > 0),
                    key=lambda t: -t.waited)
    lines += ["", "| waited for: transfer | kind | bytes | us waited |", "|---|---|---:|---:|"]
    lines += [f"| {t.name} | {t.kind} | {t.bytes:,} | {t.waited * 1e6:,.1f} |"
              for t in waited[:top]]
    if waited[top:]:
        lines.append(f"| {len(waited) - top} others | | "
                     f"{sum(t.bytes for t in waited[top:]):,} | "
                     f"{sum(t.waited for t in waited[top:]) * 1e6:,.1f} |")
    if not waited:
        lines.append("| (none) | | | |")
    return "\n".join(lines)


def _parse(argv):
    from . import _aot as aot

    p = _parser()
    args = p.parse_args(argv)
    try:
        aot._check_target(args.target)
    except ValueError as e:
        p.error(f"--target: {e}")
    _check_slice(p, args.target)
    if args.backend not in BACKENDS:
        p.error(f"--backend: unknown {args.backend!r}; valid: {', '.join(BACKENDS)}")
    if args.program not in PROGRAMS and ":" not in args.program:
        p.error(f"--program: {args.program!r} is neither one of {', '.join(PROGRAMS)} nor "
                "FILE.py:FUNCTION / module:FUNCTION")
    _check_mesh(p, args)
    if args.compare:
        from ._aot_compare import PROGRAMS as COMPARED

        compared = ("ops",) + tuple(c for c in COMPARED if c in PROGRAMS)
        if args.program not in compared:
            p.error(f"--compare: --program must be one of {', '.join(compared)}, "
                    f"got {args.program!r}")
        if args.mesh or args.axes:
            p.error("--compare builds jax.make_mesh's mesh of the program's axes: leave "
                    "out --mesh and --axes")
        if args.backend != "auto" or args.breakdown:
            p.error("--compare compiles every backend and prints one table: leave out "
                    f"{'--backend' if args.backend != 'auto' else '--breakdown'} (run "
                    "without --compare for one backend's report and --breakdown)")
    if args.json:  # before the compiles, which take minutes
        folder = os.path.dirname(os.path.abspath(args.json))
        if (os.path.isdir(args.json) or not os.path.isdir(folder)
                or not os.access(folder, os.W_OK)):
            p.error(f"--json: cannot write {args.json!r} (a file's path in a writable "
                    f"folder; {folder!r} is not one)" if not os.path.isdir(args.json) else
                    f"--json: {args.json!r} is a folder; give a file's path in it")
    return args


def _check_slice(p, target) -> None:
    """A TPU slice the topology cannot be laid out as (e.g. v5e:3x3: its sides must be
    multiples of a host's chips) exits as a bad argument does, with the compiler's
    reason, instead of its traceback."""
    from . import _aot as aot

    if aot._check_target(target)[0].platform != "tpu":
        return
    try:
        aot.devices(target)
    except ValueError as e:  # a slice the compiler cannot lay out: its reason
        p.error(f"--target: {e}")


def _axes(args) -> tuple:
    """The mesh axis names: --axes, or the program's default."""
    if args.axes is not None:
        return tuple(args.axes.split(","))
    return AXES.get(args.program, TWO_AXES)


def _check_mesh(p, args) -> None:
    """--mesh and --axes as written (the device count is the target's: see `_mesh`)."""
    axes = _axes(args)
    if args.axes is not None and (not all(a.isidentifier() for a in axes)
                                  or len(set(axes)) < len(axes)):
        p.error(f"--axes: {args.axes!r} must be distinct names separated by commas, e.g. "
                "fsdp,tp")
    if args.mesh is not None:
        if not _MESH.match(args.mesh.lower()):
            p.error(f"--mesh: {args.mesh!r} must be positive sizes separated by x, one per "
                    f"axis name, e.g. 2x4")
        sizes = args.mesh.lower().split("x")
        if len(sizes) != len(axes):
            p.error(f"--mesh: {args.mesh!r} has {len(sizes)} size"
                    f"{'s' if len(sizes) > 1 else ''} but the mesh's axis "
                    f"names are {axes} ("
                    + ("--axes" if args.axes is not None else
                       f"the default of --program {args.program}")
                    + "); give one size per name, or --axes with one name per size")
    elif len(axes) > 2:
        p.error(f"--axes: {len(axes)} names {axes} need --mesh (e.g. "
                f"{'x'.join(['2'] * len(axes))}): the default mesh is for one or two axes")
    if args.axes is not None and args.program in PROGRAMS:
        needed = AXES.get(args.program, TWO_AXES)
        missing = [a for a in needed if a not in axes]
        if missing:  # the built-in programs shard over these names (a KeyError inside)
            p.error(f"--axes: --program {args.program} shards over the mesh axes "
                    f"{','.join(needed)}; --axes {args.axes} lacks {','.join(missing)} "
                    f"(name them, e.g. --axes {','.join(needed)}, or leave --axes out)")


_CONTRACT = ("a function (mesh, backend) -> (jitted, args): the args "
             "jax.ShapeDtypeStructs, the model built with eqx.filter_eval_shape (the "
             "target's devices compile but hold no arrays; docs/aot.md)")


def _user_program(spec):
    where, name = spec.rsplit(":", 1)
    how = "give FILE.py:FUNCTION or MODULE:FUNCTION (an importable module)"
    if not where or not name:
        missing = "file or module" if not where else "function"
        _parser().error(f"--program: {spec!r} names no {missing}; {how}.")
    try:
        if where.endswith(".py"):
            loader = importlib.util.spec_from_file_location("aot_user_program", where)
            if loader is None or not os.path.isfile(where):
                _parser().error(f"--program: no file {where!r}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        elif os.path.exists(where):
            _parser().error(f"--program: {where!r} is not a .py file; {how}.")
        else:
            module = importlib.import_module(where)
    except (ImportError, SyntaxError) as e:
        _parser().error(f"--program: cannot import {where!r}: {type(e).__name__}: {e}; {how}.")
    fn = getattr(module, name, None)
    if not callable(fn):
        what = (f"has no function {name!r}" if fn is None else
                f"has {name!r}, which is not callable (a {type(fn).__name__})")
        _parser().error(f"--program: {where} {what}; it must be {_CONTRACT}.")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as e:
        _parser().error(f"--program: {spec} cannot be called as fn(mesh, backend) ({e}); "
                        f"it must be {_CONTRACT}.")
    except ValueError:  # no signature to read (a builtin): call it and see
        pass
    return fn


def _built(spec, fn, mesh, backend):
    """`fn(mesh, backend)`, a program of your own, checked against the contract."""
    try:
        built = fn(mesh, backend)
    except Exception as e:
        _missing_axis(spec, mesh, e)
        # Computing on the mesh (jax.random under jax.set_mesh, say) runs an executable
        # on compile-only devices, which jax 0.10 fails with an AttributeError.
        ran = isinstance(e, AttributeError) and "'local_devices'" in str(e)
        if "compile-only" not in str(e) and not ran:
            raise
        _parser().error(f"--program: {spec} made arrays on the target's compile-only "
                        f"devices, which hold none; it must be {_CONTRACT}.")
    if (isinstance(built, tuple) and len(built) == 2 and hasattr(built[0], "lower")
            and not isinstance(built[1], (tuple, list))):
        _parser().error(f"--program: {spec} returned (jitted, {type(built[1]).__name__}): "
                        "the arguments must be a tuple or list of them, (jitted, (x,)) for "
                        f"one; it must be {_CONTRACT}.")
    if not (isinstance(built, tuple) and len(built) == 2 and hasattr(built[0], "lower")):
        _parser().error(f"--program: {spec} returned {type(built).__name__} "
                        f"{str(built)[:80]!r}; it must be {_CONTRACT}.")
    return built


_PARTITIONS = re.compile(r"\b(?:num_partitions|replica_count)=(\d+)")


def _missing_axis(label, mesh, error):
    """A bad-argument exit if `error` is JAX's for a PartitionSpec naming an axis the mesh
    lacks (the program's names against --axes)."""
    if isinstance(error, ValueError) and "not found in mesh" in str(error):
        _parser().error(f"--axes/--mesh: {label} uses a mesh axis that the mesh "
                        f"{dict(mesh.shape)} lacks ({error}); give --mesh and --axes as "
                        "the program names them.")


def _raised_by_fusedpar(error) -> bool:
    """Whether `error` was raised by the checks of fusedpar's layers, ops and specs,
    whose messages say what to change: not in the program's code, JAX's, or this
    compiling package's (a bug there keeps its traceback)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checks = tuple(os.path.join(package, d) + os.sep for d in ("_nn", "_core", "_sharding"))
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(
        checks)


def _compiled(args, label, mesh, fn, arguments, options):
    """`fn` compiled for --target, or a bad-argument exit where a program of your own
    does not fit the mesh: an axis the mesh lacks, or arguments that leave it on one
    device (arrays or shapes without a sharding: the program then compiles for one
    device and its report would not be the mesh's)."""
    _arguments_on(label, mesh, arguments)
    try:
        compiled = fn.lower(*arguments).compile(compiler_options=options or None)
    except NotImplementedError as e:
        if not _raised_by_fusedpar(e):
            raise
        # A backend asked for by name that cannot run one of the program's calls.
        _parser().error(f"--backend: {label} cannot run with backend {args.backend!r}: {e}")
    except RuntimeError as e:  # after NotImplementedError, one of them
        if "cuDNN not found" not in str(e):
            raise
        # JAX asks the cuDNN library for its version while lowering a cuDNN kernel.
        _parser().error(f"--program: {label} calls a cuDNN kernel (e.g. "
                        "jax.nn.dot_product_attention(implementation='cudnn')), which JAX "
                        "lowers only where cuDNN is installed, with a GPU: compile it "
                        "deviceless with implementation='xla' (or None), or on the GPU "
                        f"itself ({e}).")
    except ValueError as e:
        _missing_axis(label, mesh, e)
        if _raised_by_fusedpar(e):  # a layer's or op's check: what the program must change
            _parser().error(f"--program: {label} cannot run on the mesh "
                            f"{dict(mesh.shape)}: {e}")
        raise
    header = compiled.as_text()[:2000]
    if mesh.size > 1 and not any(int(n) > 1 for n in _PARTITIONS.findall(header)):
        _parser().error(f"--program: {label} compiled for one device, not the mesh's "
                        f"{mesh.size}: its arguments must be jax.ShapeDtypeStructs with a "
                        "NamedSharding on the mesh it is given (or the jitted function "
                        "in_shardings on it), not arrays or unsharded shapes.")
    return compiled


def _arguments_on(label, mesh, arguments):
    """A bad-argument exit where an argument of the program is laid out on other devices
    than `mesh`'s (a mesh of another target or shape, or one device), before JAX says it
    in its own words."""
    import jax

    want = {(d.platform, d.device_kind, d.id) for d in mesh.devices.flat}
    for path, leaf in jax.tree_util.tree_flatten_with_path(list(arguments))[0]:
        sharding = getattr(leaf, "sharding", None)
        try:
            have = {(d.platform, d.device_kind, d.id) for d in sharding.device_set}
        except Exception:  # noqa: BLE001 - no sharding, or one of an abstract mesh
            continue
        where = f"{label}'s argument {jax.tree_util.keystr(path)}"
        other = getattr(sharding, "mesh", None)
        if not have <= want:
            kinds = sorted({kind for _, kind, _ in have})
            _parser().error(f"--program: {where} is laid out on devices that are not the "
                            f"mesh's ({len(have)} x {', '.join(kinds)}, against "
                            f"{mesh.size} x {next(iter(want))[1]}): build the arguments on "
                            "the mesh fn(mesh, backend) is given.")
        if len(have) == 1 and mesh.size > 1:
            _parser().error(f"--program: {where} is on one device: the program would "
                            f"compile for one device, not the mesh's {mesh.size}; give it a "
                            "NamedSharding on the mesh it is given.")
        if hasattr(other, "devices") and dict(other.shape) != dict(mesh.shape):
            _parser().error(f"--program: {where} is laid out on the mesh "
                            f"{dict(other.shape)}, not the one it is given "
                            f"{dict(mesh.shape)}: build the arguments on the mesh "
                            "fn(mesh, backend) is given.")


def _mesh(args):
    """The mesh --mesh and --axes (or the program's defaults) ask for, of every device of
    --target; one that does not use them all exits as a bad argument does (status 2)."""
    from . import _aot as aot

    axes = _axes(args)
    n = len(aot.devices(args.target))
    if args.mesh:
        shape = tuple(int(v) for v in args.mesh.lower().split("x"))
    elif len(axes) == 2:
        shape = (2, n // 2) if n % 2 == 0 else (1, n)
    else:
        shape = (n,)
    try:
        return aot.mesh(args.target, shape, axes)
    except ValueError as e:
        _parser().error(f"--mesh: {e} Give --mesh with sizes that multiply to {n}.")


def _programs(args):
    """`(label, mesh, jitted, arguments)` of everything `args` asks to compile."""
    from . import _aot_programs as progs
    from .._core import _primitives as prims

    backend = args.backend
    mesh = _mesh(args)
    if args.program == "ops":
        for prim in prims.PRIMITIVES:
            for bidirectional in (False, True):
                ring = "bidirectional" if bidirectional else "unidirectional"
                fn, a = progs.op_program(mesh, prim, backend, bidirectional=bidirectional)
                yield f"{prim} {ring}", mesh, fn, a
        return
    build = {"mlp": progs.mlp_program, "block": progs.block_program,
             "demo": progs.demo_program,
             "block-qkv": functools.partial(progs.block_program, fused_qkv=True),
             "prefill": functools.partial(progs.block_program, program="prefill"),
             "decode": functools.partial(progs.block_program, program="decode"),
             }.get(args.program)
    if build is None:
        fn, a = _built(args.program, _user_program(args.program), mesh, backend)
    else:
        fn, a = build(mesh, backend)
    yield args.program, mesh, fn, a


def _compare(args):
    """--compare: the table of `fusedpar._compile._aot_compare`, and its rows as JSON."""
    from . import _aot_compare

    from .._core import _primitives as prims

    out = []
    for program in prims.PRIMITIVES if args.program == "ops" else (args.program,):
        rows = _aot_compare.compare(args.target, program, cublas=args.cublas)
        gemm = " (cuBLAS GEMMs)" if args.cublas else ""
        print(_aot_compare.markdown(rows, f"{args.target}{gemm}: {program}, XLA and "
                                          "fusedpar (per device, replayed)"))
        print()
        out += [dict(target=args.target, program=program, cublas=args.cublas, **vars(r))
                for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main(argv=None):
    args = _parse(argv)
    import jax

    from . import _aot as aot

    if args.compare:
        return _compare(args)

    options = aot.compiler_options(args.target, args.cublas)
    rows = []
    for label, mesh, fn, arguments in _programs(args):
        start = time.perf_counter()
        # Under the mesh, as the program runs: layers on global arrays need it set (a
        # program of your own is lowered so too, docs/aot.md).
        with jax.set_mesh(mesh):
            compiled = _compiled(args, label, mesh, fn, arguments, options)
        seconds = time.perf_counter() - start
        report = aot.overlap(compiled)
        predicted = aot.predict(compiled, mesh)
        print(report.markdown(f"{args.target}: {label}, backend={args.backend} "
                              f"(compiled in {seconds:.1f} s)"))
        print(dataclasses.replace(predicted, unread=()))
        for what in predicted.unread:
            print(f"Not read by the replay: {what}")
        if args.breakdown:
            print()
            print(breakdown(predicted))
        print()
        rows.append(dict(target=args.target, program=label, backend=args.backend,
                         compile_s=round(seconds, 2), hidden=report.hidden,
                         predicted_us=round(predicted.seconds * 1e6, 1),
                         lower_bound_us=round(predicted.lower_bound * 1e6, 1),
                         transfers=report.total,
                         ops=[dict(op=s.op[0], backend=s.op[1], direction=s.op[2],
                                   transfers=s.transfers, hidden=s.hidden, bytes=s.bytes,
                                   sent=s.sent,
                                   matmuls=s.matmuls, exposed=s.exposed, verdict=s.verdict)
                              for s in report.ops]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
