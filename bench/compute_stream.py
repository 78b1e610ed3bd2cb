"""One device's compute stream of a layer program, run on one GPU and set beside the replay.

The replay (`fusedpar.aot`, `fusedpar._compile._simulate`) costs what a device computes between
transfers from spec-sheet numbers. That part needs no other device to check: take the
8-device program as XLA partitions it for the target, replace every collective by a
parameter of the shape it would deliver (the data it would bring: every ring step then
multiplies a distinct block, so XLA cannot merge steps), keep each collective's operand
alive as an output (what would have been sent is still computed), and compile and run
the result on one GPU with the same flags.

    python bench/compute_stream.py prepare --out DIR      # any machine with the aot extra
    python bench/compute_stream.py measure DIR --out F.json   # on a GPU
    python bench/compute_stream.py table F.json [...]      # Markdown

`prepare` compiles each program for `--target` (default h100x8) with the module dumped
right after SPMD partitioning and call inlining, and writes `<program>-<backend>.hlo`
(the local module) and `replay.json` (the replay of the 8-device program: its compute
for each preset). `measure` compiles each local module on the GPU, times it (median of
`--runs`), profiles one run (what each kernel took, by HLO instruction), and replays the
very module the GPU compiled with the presets: the measured time against that replay is
the like-for-like check of the compute side; against the 8-device replay's compute, what
a user reads in the overlap report.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PROGRAMS = ("mlp", "block", "prefill")
BACKENDS = ("xla", "reference", "ring", "pallas", "auto")
PRESETS = ("h100_sxm", "h200_sxm")
_COLLECTIVES = ("all-gather", "collective-permute", "reduce-scatter", "all-reduce",
                "all-to-all", "collective-broadcast")
_LINE = re.compile(r"^(\s*)(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")


# -- the local module -----------------------------------------------------------------------


def _drop_attribute(text: str, name: str) -> str:
    """`text` without every `, name={...}` (or `name=...` up to the next comma), braces
    balanced."""
    out, i = [], 0
    pattern = re.compile(r",?\s*\b" + re.escape(name) + r"=")
    while True:
        m = pattern.search(text, i)
        if not m:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:m.start()])
        j = m.end()
        if j < len(text) and text[j] == "{":
            depth = 0
            while j < len(text):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
                if depth == 0:
                    break
        else:
            while j < len(text) and text[j] not in ",\n":
                j += 1
        i = j


def _top_level_split(args: str) -> list:
    args = re.sub(r"/\*.*?\*/", "", args)  # XLA's `/*index=5*/` comments
    parts, depth, cur = [], 0, ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def _call_args(rest: str) -> str:
    """The operand list of `opcode(...)...`: `rest` after the opening parenthesis."""
    depth = 1
    for j, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:j]
    raise ValueError(f"unbalanced operands: {rest[:80]}")


def local_module(text: str) -> tuple[str, list]:
    """The module `text` (one partition's program after SPMD partitioning and call
    inlining) for one device: every collective of the entry computation becomes a new
    parameter of its shape, its operands are added to the outputs, `partition-id` is
    device 0's. Returns `(text, replaced)`: `replaced` lists `(name, opcode, shape)`.

    Raises ValueError where a collective sits in another computation (a loop body): a
    parameter cannot stand for it there.
    """
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("ENTRY "))
    end = next(k for k in range(start, len(lines)) if lines[k].startswith("}"))
    for k, line in enumerate(lines):
        m = _LINE.match(line)
        if m and m.group(5) in _COLLECTIVES and not start < k < end:
            raise ValueError(f"a collective outside the entry computation: {line.strip()[:120]}")
    types, body, kept, replaced, inputs = {}, [], [], [], set()
    params = sum(1 for line in lines[start + 1:end] if " parameter(" in line)
    root = None
    for line in lines[start + 1:end]:
        line = _drop_attribute(line, "sharding")
        m = _LINE.match(line)
        if not m:
            body.append(line)
            continue
        indent, is_root, name, shape, opcode, rest = m.groups()
        types[name] = shape
        if opcode == "parameter":
            inputs.add(name)
        if opcode in _COLLECTIVES:
            # What is sent must still be computed: its operands become outputs, unless
            # they are inputs (a block received at the previous step, now a parameter),
            # which would only add copies into the output buffers.
            kept += [a.split()[-1].lstrip("%") for a in _top_level_split(_call_args(rest))
                     if a.split()[-1].lstrip("%") not in inputs]
            inputs.add(name)
            line = f"{indent}%{name} = {shape} parameter({params})"
            replaced.append((name, opcode, shape))
            params += 1
        elif opcode in ("partition-id", "replica-id"):
            line = f"{indent}%{name} = {shape} constant(0)"
        elif opcode == "copy":
            # A copy is the identity on values (it only changes a layout, which StableHLO,
            # the way into the GPU compiler, does not carry; its importer refuses `copy`).
            operand = _top_level_split(_call_args(rest))[0].split()[-1]
            line = f"{indent}%{name} = {shape} reshape({operand})"
        if is_root:
            root = (name, shape, opcode, rest)
            line = line.replace("ROOT ", "", 1)
        body.append(line)
    if root is None:
        raise ValueError("the entry computation has no ROOT")
    name, shape, opcode, rest = root
    outs = ([a.split()[-1].lstrip("%") for a in _top_level_split(_call_args(rest))]
            if opcode == "tuple" else [name])
    outs += kept
    out_types = [types[o] for o in outs]
    body.append(f"  ROOT %fusedpar.local.out = ({', '.join(out_types)}) "
                f"tuple({', '.join('%' + o for o in outs)})")
    plist = []
    for line in body:
        m = _LINE.match(line)
        if m and m.group(5) == "parameter":
            number = int(_call_args(m.group(6)))
            plist.append((number, m.group(3), m.group(4)))
    strip = lambda s: re.sub(r"\{[^{}]*\}", "", s)  # noqa: E731
    signature = ", ".join(f"{n}: {strip(t)}" for _, n, t in sorted(plist))
    entry = lines[start].split(" (")[0]
    header = f"{entry} ({signature}) -> ({', '.join(strip(t) for t in out_types)}) {{"
    module_line = lines[0]
    for attribute in ("entry_computation_layout", "allow_spmd_sharding_propagation_to_parameters",
                      "allow_spmd_sharding_propagation_to_output", "num_partitions",
                      "replica_count"):
        module_line = _drop_attribute(module_line, attribute)
    new = [module_line] + lines[1:start] + [header] + body + lines[end:]
    return "\n".join(new) + "\n", replaced


# -- prepare (any machine with the aot extra) -----------------------------------------------


def _dumped(compile_fn) -> str:
    """The module after SPMD partitioning and call inlining, dumped by `compile_fn(opts)`."""
    with tempfile.TemporaryDirectory() as d:
        compile_fn({"xla_dump_to": d, "xla_dump_hlo_as_text": True,
                    "xla_dump_hlo_pass_re": "call-inliner"})
        # The partitioner's own call inlining: each partition's program, shard_map
        # bodies inlined into the entry computation, before any optimisation.
        pattern = os.path.join(d, "*.spmd-partitioner.after_call-inliner*.txt")
        found = sorted(f for f in glob.glob(pattern)
                       if ".pre-spmd" not in f)
        if not found:
            raise RuntimeError(f"no partitioned dump in {sorted(os.listdir(d))[:10]}")
        with open(found[0]) as fh:
            return fh.read()


def prepare(out: str, target: str, programs=PROGRAMS, backends=BACKENDS) -> dict:
    """Each program of `python -m fusedpar.aot --compare` (its mesh, its compiler options:
    `fusedpar._compile._aot_compare`), `backend` "xla" the program a user writes without
    fusedpar: its local module, its options and the 8-device replay."""
    import jax

    from fusedpar._compile import _aot as aot, _aot_compare as compare
    from fusedpar import cost_model

    os.makedirs(out, exist_ok=True)
    replay = {}
    for program in programs:
        for backend in backends:
            key = f"{program}-{backend}"
            t0 = time.time()
            try:
                mesh = compare.mesh(target, program)
                jitted, args = compare.build(mesh, program, backend)
                options = compare.options(target, backend, compare.DEFAULT)
                with jax.set_mesh(mesh):
                    lowered = jitted.lower(*args)
                compiled = [None]

                def compile_fn(extra):
                    compiled[0] = lowered.compile({**options, **extra})

                text = _dumped(compile_fn)
                local, replaced = local_module(text)
                with open(os.path.join(out, key + ".hlo"), "w") as f:
                    f.write(local)
                row = {"replaced": len(replaced), "seconds_to_prepare": time.time() - t0,
                       "options": options}
                for preset in PRESETS:
                    p = aot.predict(compiled[0], cost_model.get_hardware(preset))
                    row[preset] = {"seconds": p.seconds, "compute": p.compute,
                                   "communication": p.communication,
                                   "min_compute_s": p.min_compute_s}
                replay[key] = row
                print(f"{key}: {len(replaced)} collectives replaced, replay compute "
                      f"{row['h100_sxm']['compute'] * 1e6:.0f} us (H100)", flush=True)
            except Exception as e:  # noqa: BLE001 - reported, the next program still runs
                replay[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(f"{key}: {replay[key]['error']}", flush=True)
    with open(os.path.join(out, "replay.json"), "w") as f:
        json.dump({"target": target, "programs": replay}, f, indent=1)
    return replay


# -- measure (on a GPU) ---------------------------------------------------------------------


def _hlo_module_from_text(text: str):
    for path in ("jaxlib._hlo", "jax._src.lib._hlo", "jaxlib._jax"):
        try:
            module = __import__(path, fromlist=["hlo_module_from_text"])
            return module.hlo_module_from_text(text)
        except (ImportError, AttributeError):
            continue
    from jax._src.lib import xla_client as xc

    return xc._xla.hlo_module_from_text(text)


def _compile_local(text: str, options: dict):
    """A `jax.stages.Compiled` of HLO `text` on the default device, and its argument
    shapes: a stand-in function with the same signature is lowered and its module
    swapped for ours (HLO -> StableHLO through XLA's own importer)."""
    import jax
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    if "mosaic_gpu" in text:
        # The Mosaic GPU runtime (its host symbols: TMA descriptors, kernel launch) is
        # registered when its Python module is imported.
        import jax.experimental.mosaic.gpu  # noqa: F401
    hlo = _hlo_module_from_text(text)
    proto = hlo.as_serialized_hlo_module_proto()
    try:
        stablehlo = xc._xla.mlir.hlo_to_stablehlo(proto)
    except Exception:  # noqa: BLE001 - XLA's other importer (through MHLO)
        stablehlo = xc._xla.mlir.xla_computation_to_mlir_module(xc.XlaComputation(proto))
    header = next(line for line in text.splitlines() if line.startswith("ENTRY "))
    sig, result = header.split(" -> ")
    args = []
    for part in _top_level_split(sig[sig.index("(") + 1:sig.rindex(")")]):
        dtype, dims = re.match(r".*?:\s*(\w+)\[([\d,]*)\]", part).groups()
        args.append(jax.ShapeDtypeStruct(tuple(int(d) for d in dims.split(",") if d),
                                         _DTYPES[dtype]))
    outs = []
    for part in _top_level_split(result.strip()[1:result.strip().rindex(")")]):
        dtype, dims = re.match(r"\s*(\w+)\[([\d,]*)\]", part).groups()
        outs.append(jax.ShapeDtypeStruct(tuple(int(d) for d in dims.split(",") if d),
                                         _DTYPES[dtype]))

    def stand_in(*a):
        return tuple(jax.numpy.zeros(o.shape, o.dtype) for o in outs)

    lowered = jax.jit(stand_in, keep_unused=True).lower(*args)
    with mlir.make_ir_context():
        module = ir.Module.parse(stablehlo)
        lowered._lowering._hlo = module
        compiled = lowered.compile(options)
    return compiled, args


_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "s32": "int32",
           "u32": "uint32", "s8": "int8", "u8": "uint8", "pred": "bool",
           "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def _random(args, seed=0):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), len(args))
    out = []
    for k, a in zip(keys, args):
        if jnp.issubdtype(a.dtype, jnp.floating):
            out.append(jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype))
        else:
            out.append(jnp.zeros(a.shape, a.dtype))
    return out


def _profile(fn, args) -> dict:
    """`{profiler line: [[event name, duration ns, start ns from the line's first]]}` of
    one run's GPU events, in order."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path[0])
    out = {}
    for plane in data.planes:
        if "GPU" not in plane.name:
            continue
        for line in plane.lines:
            events = sorted((int(e.start_ns), int(e.duration_ns), e.name) for e in line.events)
            if events:
                out[line.name] = [[name, dur, start - events[0][0]]
                                  for start, dur, name in events]
    return out


def _time(fn, args, runs: int) -> tuple:
    """`(each call synchronised, seconds per call of `runs` calls queued back to back)`:
    the second leaves the host's dispatch out where the device is the bottleneck."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = [fn(*args) for _ in range(runs)]
    jax.block_until_ready(outs)
    return times, (time.perf_counter() - t) / runs


def _replayed(text: str) -> dict:
    """The replay of the module the GPU compiled: compute for each preset, and each
    instruction's cost on the compute stream (H100 preset)."""
    from fusedpar._compile import _hlo, _simulate
    from fusedpar import cost_model

    out = {}
    module = _hlo.parse(text)
    for preset in PRESETS:
        hw = cost_model.get_hardware(preset)
        out[preset] = _simulate.predict(text, hw).compute
        if preset == "h100_sxm":
            costs = {}
            for i, t, matmul in _kernel_costs(module, hw):
                costs[i.name] = [t, "matmul" if matmul else _category(i)]
            out["instructions"] = costs
    return out


def _kernel_costs(module, hw):
    """`(instruction, seconds, is a matmul)` of every kernel the replay costs on the
    compute stream of `module` (a parsed HLO module) with `hw`'s numbers."""
    from fusedpar._compile import _hlo, _simulate

    replay = _simulate._Replay(module, hw)
    for name in _hlo.scheduled_computations(module):
        instructions = module.computations[name]
        by_name = {i.name: i for i in instructions}
        for i in instructions:
            t = replay._kernel_time(i, by_name)
            if t:
                yield i, t, _hlo.is_matmul(i, replay.multiplying)


def _category(i) -> str:
    for op in ("dynamic-update-slice", "dynamic-slice", "copy", "add", "broadcast",
               "convert", "transpose", "reduce"):
        if op in i.name or i.opcode == op:
            return op
    return "other " + i.opcode


def measure(directory: str, out: str, runs: int, only=None, cublas=False) -> dict:
    """`cublas`: every program with cuBLAS GEMMs (XLA's Triton GEMMs off), as the
    comparison's "h100x8 cublas" rows compile them."""
    import jax

    from fusedpar._compile import _aot as aot

    options = aot.gpu_compiler_options(cublas)
    device = jax.devices()[0]
    results = {"device": device.device_kind, "jax_version": jax.__version__,
               "options": {k: str(v) for k, v in options.items()}, "programs": {}}
    replay = json.load(open(os.path.join(directory, "replay.json")))
    for path in sorted(glob.glob(os.path.join(directory, "*.hlo"))):
        key = os.path.basename(path)[:-4]
        if only and key not in only:
            continue
        row = {"replay_8_devices": replay["programs"].get(key)}
        try:
            t0 = time.time()
            # The options the program was compiled with for the table (older folders
            # carry none: fusedpar's GPU options).
            own = dict((row["replay_8_devices"] or {}).get("options", options))
            if cublas:
                own["xla_gpu_enable_triton_gemm"] = False
            compiled, args = _compile_local(open(path).read(), own)
            row["compile_s"] = time.time() - t0
            fn = compiled
            values = _random(args)
            times, queued = _time(fn, values, runs)
            row["measured_s"] = statistics.median(times)
            row["queued_s"] = queued
            row["measured_min_s"] = min(times)
            text = compiled.as_text()
            with gzip.open(os.path.join(out + ".d", key + ".compiled.hlo.gz"), "wt") as f:
                f.write(text)
            row["replay_local"] = _replayed(text)
            try:
                row["profile"] = _profile(fn, values)
            except Exception as e:  # noqa: BLE001
                row["profile_error"] = f"{type(e).__name__}: {e}"[:300]
            local = row["replay_local"]["h100_sxm"]
            print(f"{key}: measured {row['measured_s'] * 1e6:,.0f} us; replay of this "
                  f"module (H100 preset) {local * 1e6:,.0f} us, H200 "
                  f"{row['replay_local']['h200_sxm'] * 1e6:,.0f} us", flush=True)
        except Exception as e:  # noqa: BLE001 - reported, the next program still runs
            row["error"] = f"{type(e).__name__}: {e}"[:800]
            print(f"{key}: {row['error']}", flush=True)
        results["programs"][key] = row
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return results


# -- the table ------------------------------------------------------------------------------

_GEMM_KERNELS = re.compile(r"gemm|nvjet|mgpu|xmma|cutlass|sm90_", re.IGNORECASE)


def _measured_parts(row) -> dict:
    """`{"matmul": (kernels, seconds), "other": (...)}` of one profiled run."""
    events = [e for line in (row.get("profile") or {}).values() for e in line]
    gemm = [e[1] for e in events if _GEMM_KERNELS.search(e[0])]
    other = [e[1] for e in events if not _GEMM_KERNELS.search(e[0])]
    return {"matmul": (len(gemm), sum(gemm) * 1e-9), "other": (len(other), sum(other) * 1e-9)}


def _replayed_parts(text: str, preset: str) -> tuple:
    """`(compute, {"matmul": (n, s), "other": (n, s)})` of the replay of compiled `text`."""
    from fusedpar._compile import _hlo, _simulate
    from fusedpar import cost_model

    hw = cost_model.get_hardware(preset)
    parts = {"matmul": [0, 0.0], "other": [0, 0.0]}
    for _, t, matmul in _kernel_costs(_hlo.parse(text), hw):
        part = parts["matmul" if matmul else "other"]
        part[0] += 1
        part[1] += t
    return _simulate.predict(text, hw).compute, {k: tuple(v) for k, v in parts.items()}


def _compiled_texts(compiled) -> dict:
    """`{program: compiled HLO text}` from a folder of `*.compiled.hlo.gz` or the
    `.tgz` of one (what `bench/gpu_session.sh` brings back)."""
    import tarfile

    if not compiled or not os.path.exists(compiled):
        return {}
    if os.path.isdir(compiled):
        files = {os.path.basename(f): open(f, "rb").read()
                 for f in glob.glob(os.path.join(compiled, "*.compiled.hlo.gz"))}
    else:
        with tarfile.open(compiled) as tar:
            files = {os.path.basename(m.name): tar.extractfile(m).read()
                     for m in tar.getmembers() if m.name.endswith(".compiled.hlo.gz")}
    return {name[:-len(".compiled.hlo.gz")]: gzip.decompress(raw).decode()
            for name, raw in files.items()}


def table(path: str, compiled: str = None, preset: str = "h200_sxm") -> str:
    """Markdown: each program's measured compute stream (calls queued back to back, and
    the profiled kernels: matmuls, everything else) against the replay, with today's
    presets, of the module the GPU compiled (from `compiled`: a folder of
    `*.compiled.hlo.gz` or its `.tgz`; else the replay recorded at measuring time)."""
    data = json.load(open(path))
    texts = _compiled_texts(compiled)
    us = lambda s: f"{s * 1e6:,.0f}"  # noqa: E731
    lines = [f"One {data['device']}, JAX {data['jax_version']}; replay with the "
             f"`{preset}` preset. Times per step in us (kernels: count).", "",
             "| program | measured | replay | replay / measured | matmul kernels: measured "
             "| replay | other kernels: measured | replay |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, row in data["programs"].items():
        if "queued_s" not in row:
            lines.append(f"| {key} | {row.get('error', '?')[:60]} |||||||")
            continue
        measured = row["queued_s"]
        if key in texts:
            compute, parts = _replayed_parts(texts[key], preset)
        else:
            compute, parts = row["replay_local"][preset], None
        got = _measured_parts(row)
        cells = [key, us(measured), us(compute), f"{compute / measured:.3f}"]
        for part in ("matmul", "other"):
            n, s = got[part]
            cells.append(f"{us(s)} ({n})")
            cells.append(f"{us(parts[part][1])} ({parts[part][0]})" if parts else "?")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def gemms_by_shape(path: str, compiled: str, preset: str = "h200_sxm") -> str:
    """Markdown: the matmul kernels of every program, matched in schedule order to the
    profiled GPU kernels (the stream runs them in that order), grouped by output shape,
    FLOPs and dtype: measured rate against the preset's peak (the efficiency a per-shape
    model would use), and how many ran."""
    from fusedpar._compile import _flops, _hlo
    from fusedpar import cost_model

    hw = cost_model.get_hardware(preset)
    data = json.load(open(path))
    texts = _compiled_texts(compiled)
    groups: dict = {}
    for key, row in data["programs"].items():
        if key not in texts or not row.get("profile"):
            continue
        module = _hlo.parse(texts[key])
        multiplying = _hlo.matmul_computations(module)
        gemms = []
        for name in _hlo.scheduled_computations(module):
            instructions = module.computations[name]
            by_name = {i.name: i for i in instructions}
            for i in instructions:
                if _hlo.is_matmul(i, multiplying):
                    flops, dtype = _flops.matmul_flops(module, i, by_name)
                    gemms.append((_hlo.array_shapes(i.shape)[0][1], flops, dtype))
        events = [e for line in row["profile"].values() for e in line
                  if _GEMM_KERNELS.search(e[0])]
        if len(events) != len(gemms):
            continue  # the order cannot be matched
        for (shape, flops, dtype), (_, ns, _) in zip(gemms, events):
            g = groups.setdefault((tuple(shape), round(flops / 1e9, 1), dtype), [0, 0.0, set()])
            g[0] += 1
            g[1] += ns * 1e-9
            g[2].add(key.split("-")[0])
    lines = ["| output shape | GFLOP | dtype | kernels | mean time (us) | TFLOP/s | of peak |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for (shape, gflop, dtype), (n, seconds, _) in sorted(groups.items(), key=lambda kv: -kv[0][1]):
        rate = gflop * 1e9 * n / seconds
        peak = hw.flops.get(_DTYPES.get(dtype, "float32"), hw.flops["float32"])
        lines.append(f"| {'x'.join(map(str, shape))} | {gflop:g} | {dtype} | {n} | "
                     f"{seconds / n * 1e6:,.1f} | {rate / 1e12:,.0f} | {rate / peak:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="h100x8")
    p.add_argument("--programs", default=",".join(PROGRAMS))
    p.add_argument("--backends", default=",".join(BACKENDS))
    m = sub.add_parser("measure")
    m.add_argument("directory")
    m.add_argument("--out", required=True)
    m.add_argument("--runs", type=int, default=20)
    m.add_argument("--only", default=None)
    m.add_argument("--cublas", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("json")
    t.add_argument("--compiled", default=None,
                   help="the *.compiled.hlo.gz the GPU compiled, a folder or its .tgz "
                        "(replayed anew with today's presets)")
    t.add_argument("--preset", default="h200_sxm")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.out, args.target, args.programs.split(","), args.backends.split(","))
    elif args.command == "measure":
        os.makedirs(args.out + ".d", exist_ok=True)
        measure(args.directory, args.out, args.runs, args.only and args.only.split(","),
                args.cublas)
    else:
        print(table(args.json, args.compiled, args.preset))
        if args.compiled:
            print(gemms_by_shape(args.json, args.compiled, args.preset))


if __name__ == "__main__":
    main()
