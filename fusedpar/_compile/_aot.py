"""Compiling for hardware that is not here: compile-only devices, the overlap report, the
predicted time. The public face is `fusedpar.aot` (which also runs the CLI)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Optional

from . import _hlo
from .._core import _backends, _primitives as prims
from .._hw import _platforms, _registry

# Two processes may load libtpu at once (a test run beside a compile): libtpu refuses
# unless told it may. And JAX's CUDA plugin registers itself only after checking the
# CUDA runtime, which a compile-only host has no need for. Both are read when JAX starts
# its backends: importing this module first sets them.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# libtpu, compiling for a slice on a host with no TPU, finds no TPU worker and logs an
# error ("unexpected worker hostname") and a warning about host bounds. Naming this host
# the only worker silences both; the topologies and compiled programs are the same.
if not _platforms.tpu_attached():
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")

# The targets the package is compiled and tested for (one per registry entry naming one,
# `fusedpar._hw._registry`); other slices ("v5e:4x4", ...), "h100xN" (N of 1 to 8) and
# every entry's AOT name work too ("h200x8").
TARGETS = tuple(k.aot.example for k in _registry.kinds() if k.aot and k.aot.example)
TPU_GENERATIONS = tuple(sorted(k.generation for k in _registry.kinds()
                               if k.platform == "tpu" and k.aot and k.aot.example))
_GPU = re.compile(r"^([a-z]\w*?)x(\d+)$")
_TPU = re.compile(r"^(\w+):(\d+(?:x\d+){1,2})$")
_EXTRA = 'pip install "fusedpar[aot]"'


def _check_target(target: str):
    """`(kind, n)` (the registry entry, and N devices of a GPU target or the slice of a
    TPU target) for a target name; a clear error otherwise."""
    if not isinstance(target, str):
        raise TypeError(f"target must be a name like {TARGETS[0]!r}, got "
                        f"{type(target).__name__}.")
    m = _TPU.match(target)
    kind = m and _registry.aot_kind(m.group(1))
    if kind and kind.platform == "tpu":
        sides = m.group(2).split("x")
        axes = kind.hardware.torus_axes if kind.hardware is not None else 0
        if 0 < axes < len(sides):  # libtpu lays a 3-D shape of a 2-D chip out as 2-D anyway
            raise ValueError(f"target {target!r}: a {m.group(1)} slice is {axes}-D (like "
                             f"{kind.aot.example or kind.aot.name + ':2x4'!r}), got "
                             f"{len(sides)} sides.")
        return kind, m.group(2)
    m = _GPU.match(target)
    kind = m and _registry.aot_kind(m.group(1))
    if kind and kind.platform == "gpu" and 1 <= int(m.group(2)) <= kind.aot.max_devices:
        return kind, int(m.group(2))
    tpus = [k.aot.name for k in _registry.kinds() if k.aot and k.platform == "tpu"]
    gpus = [f"'{k.aot.name}xN' with N from 1 to {k.aot.max_devices}"
            for k in _registry.kinds() if k.aot and k.platform == "gpu"]
    raise ValueError(f"unknown target {target!r}; valid: {', '.join(TARGETS)} (or another "
                     f"slice of {', '.join(tpus)} like 'v5e:4x4', or {', '.join(gpus)}).")


def _find(name: str):
    """`importlib.util.find_spec(name)`, None also where a parent package is missing
    (find_spec raises there: `jax_plugins.xla_cuda12` without any JAX plugin)."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _need(module, what: str, target: str):
    """`module`: a module name, or a tuple of names any one of which will do."""
    names = (module,) if isinstance(module, str) else module
    if all(_find(name) is None for name in names):
        raise ImportError(f"compiling for {target!r} needs {what}, which the 'aot' extra "
                          f"installs: {_EXTRA}")


def devices(target: str) -> list:
    """Compile-only devices of `target` (see `TARGETS`), in the topology's order.

    They compile programs but cannot run them. Raises ImportError when the `aot` extra
    (the compiler for that platform) is not installed.
    """
    kind, what = _check_target(target)
    from jax.experimental import topologies

    if kind.platform == "gpu":
        # CUDA 12's plugin is the aot extra's; a GPU host may have CUDA 13's instead.
        _need(("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"),
              "JAX's CUDA compiler plugin", target)
        config = os.path.join(os.path.dirname(__file__), "..", "targets", kind.aot.target_config)
        with open(config) as f:
            try:
                topology = topologies.get_topology_desc(
                    platform="cuda", target_config=f.read(), topology=f"1x1x{what}")
            except NotImplementedError:
                raise RuntimeError(
                    f"compiling for {target!r}: JAX started its backends before "
                    "fusedpar.aot was imported, and its CUDA plugin, finding no CUDA "
                    "runtime here, did not register. Import fusedpar.aot before the first "
                    "JAX computation, or set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (or "
                    "JAX_PLATFORMS=cpu) in the environment.") from None
        return list(topology.devices)
    _need("libtpu", "libtpu (the TPU compiler)", target)
    # A chip's two TensorCores as one device where the kind plans for both (megacore).
    options = {"chip_config_name": "megacore"} if kind.cores == 2 else {}
    name = f"{kind.aot.topology or kind.aot.name}:{what}"
    try:
        return list(topologies.get_topology_desc(name, "tpu", **options).devices)
    except RuntimeError as e:  # jax.errors.JaxRuntimeError
        if "Topology" not in str(e):
            raise
        reason = str(e).splitlines()[0].split("INVALID_ARGUMENT: ")[-1]
        raise ValueError(f"{target!r} is not a slice the TPU compiler lays out ({reason}); "
                         f"e.g. {', '.join(t for t in TARGETS if ':' in t)}.") from None


def mesh(target: str, shape: Optional[tuple] = None, axis_names: tuple = ("x",), *,
         make_mesh: bool = False):
    """A `jax.sharding.Mesh` of `target`'s compile-only devices (Auto axes).

    `shape` defaults to all devices on one axis. Devices are taken in the topology's
    order, or with `make_mesh` in `jax.make_mesh`'s (the mesh a user without fusedpar
    builds: on a TPU slice it lays the mesh's axes along the torus). Where an axis is no
    product of the slice's own axes (8 devices of a 4x4 slice), `jax.make_mesh` refuses
    it and names JAX's way round, which a user takes: `mesh_utils.create_device_mesh`
    with `allow_split_physical_axes=True`."""
    import jax
    import numpy as np
    from jax.sharding import AxisType

    axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if len(set(axis_names)) < len(axis_names):
        raise ValueError(f"mesh: axis_names {axis_names} must be distinct.")
    devs = devices(target)
    shape = (len(devs),) if shape is None else (
        (shape,) if isinstance(shape, int) else tuple(shape))
    if int(np.prod(shape)) != len(devs) or len(shape) != len(axis_names):
        raise ValueError(f"mesh: target {target!r} has {len(devs)} devices; shape {shape} "
                         f"with axis_names {tuple(axis_names)} must use all of them, one "
                         "name per axis.")
    types = (AxisType.Auto,) * len(shape)
    if make_mesh:
        try:
            return jax.make_mesh(shape, tuple(axis_names), devices=devs, axis_types=types)
        except NotImplementedError:  # an axis across the slice's own axes
            from jax.experimental import mesh_utils

            grid = mesh_utils.create_device_mesh(shape, devs, allow_split_physical_axes=True)
            return jax.sharding.Mesh(grid, tuple(axis_names), axis_types=types)
    return jax.sharding.Mesh(np.array(devs).reshape(shape), tuple(axis_names),
                             axis_types=types)


def gpu_compiler_options(cublas: bool = False) -> dict:
    """The `compiler_options` this package compiles GPU programs with: the XLA flags a
    ring needs to overlap (`fusedpar.gpu_overlap_flags`), and cuBLAS instead of Triton
    GEMMs with `cublas=True` (a real H100 may pick either)."""
    from .._hw._xla_flags import gpu_flag_pairs

    options = _options(gpu_flag_pairs())
    if cublas:
        options["xla_gpu_enable_triton_gemm"] = False
    return options


def compiler_options(target: str, cublas: bool = False) -> dict:
    """The `compiler_options` this package compiles `target`'s programs with, what
    `fusedpar.set_overlap_flags()` sets for a program run on it: the GPU flags
    (`gpu_compiler_options(cublas)`) for a GPU target, the TPU flags
    (`fusedpar.tpu_overlap_flags(generation)`, with the slice's generation) for a TPU
    slice."""
    from .._hw._xla_flags import tpu_flag_pairs

    kind = _check_target(target)[0]
    if kind.platform == "gpu":
        return gpu_compiler_options(cublas)
    return _options(tpu_flag_pairs(kind.generation))


def _options(flags) -> dict:
    """`compiler_options` from `(name, value)` flag pairs, values typed."""
    typed = {"true": True, "false": False}
    return {name: typed.get(value, int(value) if value.isdigit() else value)
            for name, value in flags}


# -- what overlaps ------------------------------------------------------------------------


def _op_of(op_name: str) -> tuple[str, str, str]:
    """`(primitive, backend, pass)` of an instruction from its `op_name` scope (the
    backend with " bidirectional" for a bidirectional ring)."""
    scopes = prims.SCOPE.findall(op_name)
    pass_ = "backward" if "transpose(" in op_name else "forward"
    if not scopes:
        return "other", "", pass_
    prim, backend, ring = scopes[-1]
    return prim, backend + (" bidirectional" if ring == "bi" else ""), pass_


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective in the schedule and what runs while it is in flight.

    `bytes`: what one device contributes (the collective's operands); `sent`: what one
    device sends for it over its links, as a ring moves it — a collective-permute its
    operands, an all-gather the n - 1 blocks of the others, a reduce-scatter or an
    all-to-all (n - 1) / n of its operands, an all-reduce twice that — so an XLA
    collective and fusedpar's ring of permutes compare; `matmuls`: the
    matmuls scheduled between its start and done (none for a synchronous collective);
    `laid_out`: the same bytes as laid out in memory (TPU tiles pad a thin array: an
    f32[512,1] in `T(8,128)` tiles takes 128 lanes a row); `arrays`: `(dtype, dims)` of
    each array sent; `hideable`: whether the program has a matmul that neither feeds the
    transfer nor waits for it, one that some schedule could run while it is in flight (a
    model's first weight gather has none: every matmul needs it; nor has the gradient
    reduce-scatter of the last matmul of the backward).
    """

    name: str
    kind: str
    op: tuple
    bytes: int
    computation: str
    matmuls: tuple
    laid_out: int = 0
    arrays: tuple = ()
    hideable: bool = True
    runs: int = 1  # times its computation runs in one step (a loop body: its trip count)
    sent: int = 0

    @property
    def hidden(self) -> bool:
        return bool(self.matmuls)


@dataclasses.dataclass(frozen=True)
class OpSummary:
    """One op's (primitive, backend, forward/backward) transfers and matmuls."""

    op: tuple
    transfers: int
    hidden: int
    bytes: int
    matmuls: int
    exposed: int
    kernels: int
    hideable: int  # transfers some schedule could hide (`Transfer.hideable`)
    sent: int = 0  # `Transfer.sent`, summed

    @property
    def verdict(self) -> str:
        prim, backend, _ = self.op
        if self.transfers == 0:
            if self.kernels:
                return ("fused kernel: the ring runs inside one Pallas kernel (remote DMAs, "
                        "not visible to XLA)")
            return "no communication"
        if self.hidden == self.transfers:
            return "overlapped: every transfer has a matmul in flight"
        unhideable = self.transfers - self.hideable
        if self.hideable == 0:
            return "nothing to overlap: every matmul feeds or waits for these transfers"
        one_collective = backend == "" or _backends.runs_one_collective(backend)
        if self.hidden == self.hideable and not one_collective:
            return (f"overlapped: every transfer that can be hidden has a matmul in flight "
                    f"({unhideable} have no matmul independent of them)")
        if one_collective:
            kind = "collective" if backend else "transfer"
            return (f"not overlapped: {self.transfers - self.hidden} of {self.transfers} "
                    f"{kind}s run with no matmul in flight")
        if self.hidden == 0:
            return "NOT overlapped: no transfer has a matmul in flight"
        return f"partly overlapped: {self.transfers - self.hidden} transfers exposed"


@dataclasses.dataclass(frozen=True)
class Report:
    """What overlaps in one compiled program (see `overlap`)."""

    transfers: tuple
    ops: tuple
    ring_kernels: int = 0  # fusedpar's fused kernels: their rings' DMAs are not transfers

    @property
    def total(self) -> int:
        """Transfers a step makes (each as often as its loop runs it)."""
        return sum(t.runs for t in self.transfers)

    @property
    def hidden(self) -> int:
        return sum(t.runs for t in self.transfers if t.hidden)

    @property
    def hideable(self) -> int:
        """Transfers that some schedule could hide (`Transfer.hideable`)."""
        return sum(t.runs for t in self.transfers if t.hideable)

    def op(self, prim: str, backend: str, pass_: str = "forward") -> Optional[OpSummary]:
        for s in self.ops:
            if s.op == (prim, backend, pass_):
                return s
        return None

    def markdown(self, title: str = "") -> str:
        """The per-op table a person reads, with the program's totals."""
        lines = [f"### {title}", ""] if title else []
        lines += ["| op | backend | pass | transfers hidden | bytes sent / device | matmuls "
                  "exposed | verdict |", "|---|---|---|---:|---:|---:|---|"]
        for s in self.ops:
            prim, backend, pass_ = s.op
            lines.append(f"| {prim} | {backend or '-'} | {pass_} | {s.hidden} / "
                         f"{s.transfers} | {s.sent:,} | {s.exposed} / {s.matmuls} | "
                         f"{s.verdict} |")
        lines += ["", f"{self.hidden} of {self.total} transfers have a matmul in flight"
                  + (f"; {self.total - self.hideable} have no matmul independent of them."
                     if self.hideable < self.total else ".")]
        if self.ring_kernels:  # else a program of fused kernels reads as if nothing overlapped
            lines[-1] += (f" Not counted: the blocks {self.ring_kernels} fused kernel(s) move "
                          "with remote DMAs beside their own matmuls (`aot.predict` times "
                          "them).")
        return "\n".join(lines)


def _platform_of(program, text: str) -> Optional[str]:
    """The platform `program` was compiled for: that of the devices its shardings name (a
    compiled program), else what its HLO dialect says (TPU layouts carry tiles,
    `{1,0:T(8,128)}`; GPU instructions a stream in their backend config); None for a
    text that says neither (a CPU program's, a hand-written one)."""
    import jax

    platforms = set()
    for tree in (getattr(program, "input_shardings", ()),
                 getattr(program, "output_shardings", ())):
        for sharding in jax.tree.leaves(tree):
            platforms |= {d.platform for d in getattr(sharding, "device_set", ())}
    if len(platforms) == 1:
        found = platforms.pop()
        return "gpu" if found in ("cuda", "rocm") else found
    if ":T(" in text:
        return "tpu"
    if '"operation_queue_id"' in text or "__cublas$" in text:
        return "gpu"
    return None


def _text(program, where: str = "overlap") -> str:
    """`program`'s compiled HLO text; a `Lowered` (not compiled yet) is refused: its
    StableHLO has no schedule, and read as HLO it showed nothing to overlap or time."""
    import jax

    if isinstance(program, jax.stages.Lowered):
        raise TypeError(f"{where}: program is a jax.stages.Lowered, not compiled yet; pass "
                        "lowered.compile() (the schedule read is the compiler's).")
    if hasattr(program, "as_text") and not isinstance(program, str):
        program = program.as_text()
    if not isinstance(program, str):
        raise TypeError(f"{where}: program must be a compiled program (jax.jit(f).lower(...)"
                        f".compile()) or its as_text(), got {type(program).__name__}.")
    if re.search(r"^module\b", program, re.M) and "HloModule" not in program:
        raise ValueError(f"{where}: program is StableHLO text (a Lowered's as_text()), not "
                         "a compiled program's HLO; pass lowered.compile() or its as_text().")
    if "HloModule" not in program[:4096]:
        raise ValueError(f"{where}: program must be a compiled program or its as_text() "
                         "(HLO text, which starts with 'HloModule'); got a str of "
                         f"{len(program)} characters starting {program[:60]!r} (a file's "
                         "path? pass its contents).")
    return program


def overlap(program) -> Report:
    """What overlaps in `program` (a `jax.stages.Compiled`, or its `as_text()`).

    A transfer is hidden when a matmul (a dot or convolution, a fusion or loop that
    runs one, a cuBLAS or Pallas kernel) is scheduled between its start and its done; a
    synchronous collective hides nothing. A matmul is exposed when no transfer is in
    flight while it runs. Transfers and matmuls are attributed to the fusedpar op whose
    name scope they were traced in ("other" for the rest of the program). Those of a
    loop body count as often as the loop runs it (`Transfer.runs`).
    """
    module = _hlo.parse(_text(program))
    multiplying = _hlo.matmul_computations(module)
    fused = _fused_kernel_names()
    runs = _runs(module)
    transfers, matmuls, kernels, ring_kernels = [], [], [], 0
    for comp in _hlo.scheduled_computations(module):
        instructions = module.computations[comp]
        by_name = {i.name: i for i in instructions}
        hideable = _hideable(instructions, multiplying)
        open_: dict = {}  # start name -> (instruction, kind, matmuls so far)
        for i in instructions:
            kind = _hlo.collective_kind(module, i)
            done = _hlo.started_by(i, by_name, module)
            if kind is not None and _hlo.is_async_start(i):
                open_[i.name] = (i, kind, [])
            elif done in open_:
                start, kind, seen = open_.pop(done)
                transfers.append(_transfer(module, start, kind, by_name, comp, tuple(seen),
                                           hideable(start.name, i.name)))
            elif kind is not None:  # synchronous
                transfers.append(_transfer(module, i, kind, by_name, comp, (),
                                           hideable(i.name, i.name)))
            elif _hlo.is_matmul(i, multiplying):
                for _, _, seen in open_.values():
                    seen.append(i.name)
                kernel = _hlo.tpu_kernel(module, i)
                # A kernel XLA moved into a continuation fusion has the op's name scope.
                key = _op_of((kernel or i).op_name)
                if kernel is not None:
                    # A Pallas TPU kernel: its backend from its kernel name, its
                    # primitive from its name scope if it has one, else from that name.
                    name = re.sub(r"\.\d+$", "", kernel.name)
                    prim, backend = fused.get(name, (name, "pallas_tpu"))
                    key = (prim if key[0] == "other" else key[0], backend, "fused kernel")
                    kernels.append(key)
                    ring_kernels += name in fused
                matmuls.append((key, not open_, runs.get(comp, 1)))
        for start, kind, seen in open_.values():  # done in another computation
            transfers.append(_transfer(module, start, kind, by_name, comp, tuple(seen),
                                       hideable(start.name, start.name)))
    transfers = [dataclasses.replace(t, runs=runs.get(t.computation, 1)) for t in transfers]
    keys = list(dict.fromkeys([t.op for t in transfers] + [m[0] for m in matmuls]))
    ops = []
    for key in keys:
        mine = [t for t in transfers if t.op == key]
        mm = [(exposed, n) for k, exposed, n in matmuls if k == key]
        ops.append(OpSummary(key, sum(t.runs for t in mine),
                             sum(t.runs for t in mine if t.hidden),
                             sum(t.bytes * t.runs for t in mine), sum(n for _, n in mm),
                             sum(n for exposed, n in mm if exposed),
                             kernels.count(key), sum(t.runs for t in mine if t.hideable),
                             sum(t.sent * t.runs for t in mine)))
    return Report(tuple(transfers), tuple(ops), ring_kernels)


def _runs(module) -> dict:
    """`{computation: times it runs in one call of the entry}`: a loop's body its trip
    count times (once where the replay cannot read the count: `predict` lists it), and
    whatever a computation calls as often as it runs."""
    runs, stack = {module.entry: 1}, [module.entry]
    while stack:
        comp = stack.pop()
        instructions = module.computations.get(comp, ())
        by_name = {i.name: i for i in instructions}
        for i in instructions:
            if i.opcode == "while":
                condition, body = _hlo.loop_parts(i)
                trips = _hlo.trip_count(module, i, by_name) or 1
                called = [(body, trips), (condition, trips + 1)]
            elif i.opcode in ("call", "conditional") or (
                    i.opcode == "async-start" and i.calls):
                called = [(c, 1) for c in i.calls]
            else:
                continue
            for c, k in called:
                if c and c not in runs:
                    runs[c] = runs[comp] * k
                    stack.append(c)
    return runs


def _fused_kernel_names() -> dict:
    """`{a fused kernel's name in a program: (its primitive, its backend)}` of every
    backend that has fused kernels (`_backends.Backend.fused_kernels`), so the report
    names it `ag_rows` as it names every other op (without a backend's whose kernels do
    not import)."""
    names = {}
    for backend in _backends.TABLE.values():
        if backend.fused_kernels is None:
            continue
        try:
            names.update((kernel, (prim, backend.name))
                         for kernel, prim in backend.fused_kernels().items())
        except ImportError:  # pragma: no cover - a JAX without Pallas TPU
            pass
    return names


def _hideable(instructions, multiplying):
    """`hideable(start, done)`: whether a matmul of the computation is independent of the
    transfer from `start` to `done` (neither an ancestor of the start nor a descendant of
    the done, in the dataflow), so that a schedule could run it in flight."""
    ancestors, descendants = _hlo.dataflow(instructions)
    index = {i.name: k for k, i in enumerate(instructions)}
    matmuls = 0
    for k, i in enumerate(instructions):
        if _hlo.is_matmul(i, multiplying):
            matmuls |= 1 << k

    def hideable(start: str, done: str) -> bool:
        s, d = index[start], index[done]
        return bool(matmuls & ~(ancestors[s] | descendants[d] | (1 << s) | (1 << d)))

    return hideable


def _transfer(module, i, kind, by_name, computation, matmuls, hideable=True) -> Transfer:
    operands = _hlo.sent_operands(i, by_name) if i.operands else []
    if operands and all(o is not None for o in operands):
        shapes = [o.shape for o in operands]
    else:  # a parameter of another computation: the start's first result is the operand
        shapes = [_first_array(i.shape)]
    nbytes = sum(_hlo.shape_bytes(s) for s in shapes)
    laid_out = sum(_hlo.laid_out_bytes(s) for s in shapes)
    arrays = tuple(a for s in shapes for a in _hlo.array_shapes(s))
    # A collective the compiler wrapped or merged without a name (a TPU reduce-scatter
    # fusion; the all-reduce XLA makes of a step's gradient all-reduces, fed by a
    # concatenate without one either) belongs to the op whose result it sends. One XLA
    # merged from several keeps the name of one of them (the loss's 4-byte all-reduce,
    # merged with the gradients'): it belongs to the op of its largest operand.
    # (Not the names inside a reduction's to_apply region: those are the first merged
    # all-reduce's.)
    reducing = i.opcode.replace("-start", "") in ("all-reduce", "reduce-scatter")
    name = i.op_name if reducing else _hlo.op_name(module, i)
    parts = _merged_parts(module, operands, by_name)
    if len(parts) > 1:
        named = [(_hlo.shape_bytes(p.shape), _producer_op_name(module, [p], by_name))
                 for p in parts]
        name = max(((b, n) for b, n in named if n), default=(0, name))[1]
    name = name or _producer_op_name(module, operands, by_name)
    return Transfer(i.name, kind, _op_of(name), nbytes, computation,
                    matmuls, laid_out, arrays, hideable or bool(matmuls),
                    sent=_sent(module, i, kind, nbytes))


def _sent(module, i, kind: str, nbytes: int) -> int:
    """`Transfer.sent`: the bytes one device sends for collective `i` whose operands are
    `nbytes`, over a ring of its largest replica group (all devices where the groups
    cannot be read, as the replay assumes; a permute's are its operands whatever)."""
    n = _hlo.group_size(_hlo.collective_inside(module, i) or i, module.devices)
    return round(nbytes * _hlo.ring_factor(kind, module.devices if n is None else n))


def _merged_parts(module, operands, by_name) -> list:
    """What XLA merged into one collective: its operands, or the operands of the
    concatenation (bare, or as a fusion) that is its one operand; [] where unknown."""
    if any(o is None for o in operands):
        return []
    if len(operands) == 1:
        (o,) = operands
        root = next((module.roots.get(c) for c in o.calls if c in module.roots), None)
        if o.opcode == "concatenate" or (o.opcode == "fusion" and root is not None
                                         and root.opcode == "concatenate"):
            return [by_name[n] for n in o.operands if n in by_name]
    return list(operands)


def _producer_op_name(module, operands, by_name, depth: int = 4) -> str:
    """The op_name of the nearest producer of `operands` that has one, searching `depth`
    levels up the computation's dataflow; "" if none does."""
    frontier = [o for o in operands if o is not None]
    for _ in range(depth):
        name = next((n for n in (_hlo.op_name(module, o) for o in frontier) if n), "")
        if name:
            return name
        frontier = [by_name[n] for o in frontier for n in o.operands if n in by_name]
    return ""


def _first_array(shape: str) -> str:
    """The first array of an HLO (tuple) shape, with its layout."""
    match = re.search(r"[a-z]+\d*[a-z0-9]*\[[\d,]*\](\{[^{}]*\})?", shape)
    return match.group(0) if match else ""


def predict(program, target):
    """The time `program` (a compiled program or its `as_text()`) is predicted to take
    per device on `target`, replaying its schedule (`fusedpar._compile._simulate`).

    `target`: a target name (`TARGETS`), a `jax.sharding.Mesh` (its devices say which
    hardware, and on a TPU slice their coordinates give each transfer's hop count), or a
    `cost_model.Hardware`. Returns a `Prediction` (seconds, compute, communication,
    exposed waits, and the lower bound max(compute, min_comm_s): the compute stream, or
    the program's collective bytes over every link of the device, whichever is longer).

    A program compiled for another platform than a named or mesh target's is refused: a
    compiled program by its devices, a text by its dialect (TPU tiles, GPU streams; a CPU
    program's text says neither). A `Hardware` target is taken as given.
    """
    from . import _simulate
    from .._hw import _target
    from .. import cost_model

    coords = None
    if isinstance(target, cost_model.Hardware):
        hardware = target
    else:
        import jax

        if isinstance(target, str):
            target = mesh(target)
        if not isinstance(target, jax.sharding.Mesh):
            raise TypeError(f"predict: target must be a target name, a Mesh of devices or "
                            f"a cost_model.Hardware, got {type(target).__name__} {target!r}.")
        found = _target.of_mesh(target)
        if found is None:
            raise ValueError(f"predict: target must be a target name, a Mesh of devices or "
                             f"a cost_model.Hardware, got {target!r}.")
        text = _text(program, "predict")  # once: as_text() of a large program is slow
        compiled_for = _platform_of(program, text)
        program = text
        if compiled_for not in (None, found.platform):
            raise ValueError(
                f"predict: the program was compiled for a {compiled_for.upper()} (its "
                f"devices or its HLO say so), but the target is a {found.platform.upper()} ("
                f"{found.device_kind or found.platform}): "
                "replay it with the target it was compiled for.")
        hardware = cost_model.get_hardware(found.cost_preset)
        devices = list(target.devices.flat)
        partitions = re.search(r"\bnum_partitions=(\d+)", text[:4096])
        if partitions and int(partitions.group(1)) not in (1, len(devices)):
            raise ValueError(
                f"predict: the program was compiled for {partitions.group(1)} devices, but "
                f"the target has {len(devices)}: replay it with the target it was "
                "compiled for.")
        # Hops count on a TPU torus; GPUs reach every peer in one hop through NVSwitch
        # (their topology coordinates are not a wiring).
        if found.platform == "tpu" and all(getattr(d, "coords", None) is not None
                                           for d in devices):
            coords = [_registry.position(d, found.kind) for d in devices]
    return _simulate.predict(_text(program, "predict"), hardware, coords)

