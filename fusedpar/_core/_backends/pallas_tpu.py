"""The `"pallas_tpu"` backend: one fused Pallas TPU kernel per primitive, the ring inside.

The kernels (`fusedpar.kernels.tpu`) move blocks with remote DMAs between neighbours
while the MXU multiplies the block in hand. On TPU they compile with Mosaic; on CPU they
run in TPU interpret mode, which simulates every device, DMA and semaphore (a correctness
simulator: slow).

This module is the one place that maps the package's primitives and options to the
kernels' typed parameters (`_params`): which kernel and layout a primitive is, the ring's
direction as dispatch resolved it, the collective id of the (kernel, mesh axes) pair, the
TPU generation it is planned for, tiles and interpret mode.

These are collective kernels: the enclosing `jax.shard_map` must use `check_vma=False`.

`comm_dtype` (int8, float8_e4m3fn): an all-gather's travelling operand is quantized once
on its owner (`_quantize.quantize` along the primitive's `scale_axis`) and the kernel
moves the 8-bit values and their float32 scales, widening each piece in VMEM and scaling
the step's product; the gathered operand kept for the backward pass is dequantized
here. The reduce-scatter kernels do not requantize their travelling accumulator: with a
`comm_dtype` they are unavailable (backend='ring' does it).

Options (`options={...}` of the public ops): `block_m`, `block_n`, `block_k` (tile
targets; default: the chip's presets), `vmem` (force every buffer into VMEM, or force the
tiled HBM path), `chip` (the TPU generation to plan for: "v4", "v5e", "v5p", "v6e", or a
`fusedpar.kernels.tpu.Chip`; default: the generation of the mesh's devices — on a TPU
mesh another generation is an error — and "v5e" on CPU), `cores` (TensorCores per device
to split the tiled steps between; default: the mesh's devices' cores, 2 in megacore mode),
`interpret` (bool: force or forbid interpret mode; default: interpret on a CPU mesh,
Mosaic on a TPU mesh, where asking for the interpreter is an error; False on a CPU mesh
builds for Mosaic, to lower for TPU from there), `interpret_params` (a
`pltpu.InterpretParams`), and `_broken` (a deliberately broken protocol variant, for the
tests that prove the checks can fail).
"""

from __future__ import annotations

import dataclasses

import jax

from .. import _batching, _primitives as prims, _quantize, _vma
from ..._hw import _registry, _target
from ..._hw._hardware import TPU_KERNELS
from .._schedule import Ring, ring_for
from ._backend import Backend

_DTYPES = ("float32", "bfloat16")
_OPTIONS = frozenset({"block_m", "block_n", "block_k", "vmem", "chip", "cores", "interpret",
                      "interpret_params", "_broken"})
# The options that say what the kernels are built for: checked against the target when
# dispatch asks whether the kernels can run a call.
_TARGET_OPTIONS = frozenset({"chip", "cores", "interpret", "interpret_params"})


def _kernels():
    # Imported on first use: importing fusedpar does not import Pallas.
    from ...kernels import tpu

    return tpu


def options(platform: str) -> frozenset:
    return _OPTIONS


def _kernel_of(prim):
    """(kernel module, its name, the layout it runs) of primitive `prim`."""
    tpu = _kernels()
    p = prims.of(prim)
    name = "all_gather_matmul" if p.gathers else "matmul_reduce_scatter"
    module = getattr(tpu, name)
    # The kernel's layout is the matmul dimension the ring cuts.
    layout = {"m": "ROWS", "n": "COLUMNS", "k": "CONTRACTION"}[p.ring_dim]
    return module, name, getattr(module, layout)


def chip(generation: str, cores=None):
    """The kernels' `Chip` for TPU `generation` ("v5e", ...), from its registry entry
    (`fusedpar._hw._registry`), with `cores` TensorCores per device (default: megacore
    where the entry plans for it)."""
    kind = _registry.tpu_kind(generation)
    if kind is None:
        known = ", ".join(k.generation for k in _registry.kinds() if k.platform == "tpu")
        raise ValueError(f"unknown TPU generation {generation!r}; the hardware registry "
                         f"knows {known}")
    if cores is not None and not 1 <= cores <= kind.cores:
        # A grid axis of 2 "parallel" programs on one TensorCore runs them one after the
        # other: the first would wait forever for the second at its first hand-over.
        raise ValueError(f"a TPU {generation} device has {kind.cores} TensorCore(s) to "
                         f"split a step between, not {cores}")
    return _kernels().Chip(kind.generation, kind.vmem_bytes, kind.default_scoped_vmem_bytes,
                           kind.cores if cores is None else cores, tuple(kind.tiles))


def _chip(target, name=None, cores=None):
    """The `Chip` to plan for: on a TPU mesh its devices' generation and cores (`name`,
    if given, must agree); elsewhere `name` (a generation, or a `Chip` for another or a
    made-up generation), else the default TPU's generation."""
    tpu = _kernels()
    if isinstance(name, tpu.Chip):
        return name if cores is None else dataclasses.replace(name, cores=cores)
    if target.platform == "tpu" and target.device_kind:  # not a platform name alone
        generation = target.tpu_generation
        if generation is None:
            raise ValueError(f"no TPU generation is known for the mesh's devices, {target}; "
                             "pass options={'chip': tpu.Chip(...)} to describe it")
        if name is not None and name != generation:
            raise ValueError(f"the mesh's devices are {target}, not TPU {name}: leave "
                             "options['chip'] out (it is read from the mesh)")
        if cores is None and target.num_cores in (1, 2):
            cores = target.num_cores
        return chip(generation, cores)
    return chip(name or _registry.default("tpu").generation, cores)


def _interpret(option, params, target):
    """The `interpret` of the kernels: False (compile with Mosaic) or InterpretParams.

    Default: interpret on a CPU mesh, compile on a TPU mesh; `interpret_params` implies
    interpret mode, which only a CPU mesh runs.
    """
    from jax.experimental.pallas import tpu as pltpu

    interpret = option
    if interpret is None:
        interpret = params is not None or target.interpret
    if not interpret:
        return False
    if not target.interpret:
        raise ValueError(f"options['interpret']=True (or interpret_params) runs the kernels "
                         f"in TPU interpret mode on CPU devices, but {target.devices_are()}: "
                         "leave it out, and Mosaic compiles them for that TPU")
    return params if params is not None else pltpu.InterpretParams()


def _collective_id(kernel_name, axis_name, broken):
    """The (kernel, mesh axes) pair's collective id, from the mesh of the shard_map."""
    tpu = _kernels()
    if broken == tpu.BROKEN_SHARED_COLLECTIVE_ID:
        return 0
    ring_axes = _vma.axis_names(axis_name)
    mesh_axes = tuple(jax.sharding.get_abstract_mesh().axis_names) or ring_axes
    return tpu.collective_id(kernel_name, ring_axes, mesh_axes)


def _params(prim, *, axis_name, axis_size, bidirectional, out_dtype, reduce_dtype,
            return_gathered, target, get=lambda name, default=None: default,
            w_transposed=False, partner_dtype=None, partner_transposed=False):
    """The kernel parameters of primitive `prim`; `get(name, default)` reads an option;
    `w_transposed`: the kernel is given w's transpose (`_in_place`); `partner_dtype`,
    `partner_transposed`: an ag_rows's partner product's (`_run_partnered`). Without
    `axis_name` (a dispatch check, outside any shard_map) there is no collective id."""
    tpu = _kernels()
    module, kernel_name, layout = _kernel_of(prim)
    # The ring follows the slice's wires when the mesh's devices are known (`ring_for`).
    ring = (Ring(axis_size, bidirectional) if axis_name is None
            else ring_for(axis_name, axis_size, bidirectional))
    if get("cores") not in (None, 1, 2):
        raise ValueError(f"{prim}: options['cores']={get('cores')!r} must be 1 or 2 (the "
                         "TensorCores a TPU device splits a step between; 2 on megacore "
                         "chips, v4 and v5p)")
    try:
        chip = _chip(target, get("chip"), get("cores"))
    except ValueError as e:
        raise ValueError(f"{prim}: options['chip']={get('chip')!r}, "
                         f"options['cores']={get('cores')!r}: {e}") from None
    broken = get("_broken")
    targets = tuple(int(get(f"block_{name}", preset)) for name, preset in zip("mkn", chip.tiles))
    launch = tpu.RingLaunch(
        axis_name=axis_name, ring=ring,
        collective_id=(_collective_id(kernel_name, axis_name, broken)
                       if ring.size > 1 and axis_name is not None else None),
        chip=chip, interpret=_interpret(get("interpret"), get("interpret_params"), target),
        vmem=get("vmem"), tile_targets=targets, precision=get("precision"), broken=broken)
    if module is tpu.all_gather_matmul:
        return module, module.AllGatherMatmulParams(layout, out_dtype, return_gathered, launch,
                                                    w_transposed, partner_dtype,
                                                    partner_transposed)
    return module, module.MatmulReduceScatterParams(layout, out_dtype, reduce_dtype, launch,
                                                    w_transposed)


# The row kernels keep w whole and stationary, so both can read it transposed; ag_rows
# is always given it so, rs_rows only a resident w (`Config.w_resident`). An rs_rows
# weight is as a rule the FSDP gather of the layer after an ag_rows one (an MLP's down
# projection): on TPU, XLA's asynchronous collective fusion hides that gather inside the
# copy that puts it in (k, n) order, and without the copy the gather runs synchronously
# before the kernel. Replayed on an FSDP x TP block: v5e:2x4 12,432 -> 12,475 us with both
# read in place, 12,422 with ag_rows alone; v6e:2x4 4,645 -> 4,630, and 4,601. A weight
# no collective produces (tensor parallel alone, or FSDP moving the activations) has no
# gather to hide, and its copy is a whole weight's HBM traffic every step.
_READS_W_IN_PLACE = (prims.AG_ROWS,)
_READS_RESIDENT_W_IN_PLACE = (prims.AG_ROWS, prims.RS_ROWS)


def _in_place(prim, w_transposed: bool, w_resident: bool = False) -> bool:
    """Whether the kernel is given w as it lies in memory, the transpose of the call's w
    (`Config.w_transposed`: a layer's `weight.T`), and multiplies by its rows: without
    it XLA copies the weight into (k, n) order before every such call."""
    return w_transposed and prim in (_READS_RESIDENT_W_IN_PLACE if w_resident
                                     else _READS_W_IN_PLACE)


def _misaligned(module, params, x, w, scales=None, partner=None):
    """Why Mosaic would refuse a window the kernel cuts (None if every one is aligned)."""
    extra = {} if partner is None else {"partner": partner}
    for window in (module.windows(params, x, w, scales, **extra) if scales is not None
                   else module.windows(params, x, w, **extra)):
        why = window.problem(params.launch.chip)
        if why is not None:
            ring = params.launch.ring
            return (f"{why} (x {tuple(x.shape)}, w {tuple(w.shape)} over "
                    f"{ring.size} devices{', bidirectional halves' if ring.bidirectional else ''}"
                    f"); pad the operands, or use backend='ring'")
    return None


def unavailable(call):
    """Why the TPU kernels cannot run `call` (a `_primitives.Call`), or None."""
    why = _unfit(call)
    if why is None and call.vma_typed:
        # Said before the kernel is traced, where JAX's own error would come first.
        return ("the enclosing jax.shard_map checks varying axes (check_vma=True, its "
                "default) and these collective kernels need it called with "
                "check_vma=False; or use backend='ring' or 'auto', which run under either")
    return why


def _unfit(call):
    """Why the TPU kernels cannot run `call` at its platform, axes, dtype and shapes."""
    if call.platform not in ("tpu", "cpu"):
        return (f"the fused TPU kernels run on TPU (or interpreted on CPU), not on "
                f"platform {call.platform!r}")
    kind = call.target.kind if call.target is not None else None
    if call.platform == "tpu" and kind is not None and kind.why_not(TPU_KERNELS):
        return kind.why_not(TPU_KERNELS)
    if call.automatic_axes:
        return (f"the enclosing jax.shard_map leaves mesh axes {dict(call.automatic_axes)} "
                f"to XLA (they are not in its axis_names), and a fused TPU kernel runs only "
                f"where every mesh axis is manual (it addresses its neighbours by their "
                f"coordinates on every axis; XLA cannot partition a Mosaic kernel, nor run "
                f"interpret mode's callbacks, over an automatic axis): make the shard_map "
                f"manual over every mesh axis (leave axis_names out), or use backend='ring'")
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} is not supported (supported: {', '.join(_DTYPES)})"
    in_place = _in_place(call.prim, call.w_transposed, call.w_resident)
    x = jax.ShapeDtypeStruct(call.x_shape, call.dtype)
    w = jax.ShapeDtypeStruct(call.w_shape[::-1] if in_place else call.w_shape, call.dtype)
    scales = None
    if call.comm_dtype is not None:
        if call.prim not in prims.GATHERS:
            return (f"comm_dtype={call.comm_dtype}: the fused TPU reduce-scatter kernels "
                    f"send their accumulator unquantized; backend='ring' requantizes it "
                    f"at every hop")
        x, w, scales = _quantized_structs(call.prim, x, w, call.comm_dtype)
    # Results in the inputs' dtype (the strictest tiles), f32 accumulators, the gathered
    # operand returned: every buffer and window a call of the op can have.
    # Bad option values and options that contradict the target raise (ValueError).
    module, params = _params(
        call.prim, axis_name=None, axis_size=call.axis_size,
        bidirectional=call.runs_bidirectional, out_dtype=call.dtype, reduce_dtype="float32",
        return_gathered=True, target=call.target or _target.current(),
        get=lambda name, default=None: (dict(call.options).get(name, default)
                                        if name in _TARGET_OPTIONS else default),
        w_transposed=in_place)
    try:
        _, layout, why = (module.plan(params, x, w, scales) if scales is not None
                          else module.plan(params, x, w))
    except ValueError as e:
        return str(e)
    if layout is None:
        return why
    if call.platform == "tpu":  # the interpreter does not need Mosaic's tiles
        why = _misaligned(module, params, x, w, scales)
        return None if why is None else f"on TPU {why}"
    return None


def _quantized_structs(prim, x, w, comm_dtype):
    """`(x, w, scales)` as the kernel sees a quantized call: the travelling operand's
    8-bit values and its float32 scales (shapes only)."""
    p = prims.of(prim)
    which, t = p.traveller, p.travelling(x, w)
    scale_shape = list(t.shape)
    scale_shape[p.scale_axis] = 1
    values = jax.ShapeDtypeStruct(t.shape, comm_dtype)
    scales = jax.ShapeDtypeStruct(tuple(scale_shape), "float32")
    return (values, w, scales) if which == "x" else (x, values, scales)


def _gathered(prim, gathered, dtype):
    """The kernel's gathered `(values, scales)` dequantized to `dtype` (the backward
    pass's residual: what the forward multiplied with)."""
    values, scales = gathered
    if prims.of(prim).ring_dim == "k":  # ag_contract: scales (N, 1, n), a row per block
        scales = scales.reshape(scales.shape[0], scales.shape[-1])
    return _quantize.dequantize(_quantize.Quantized(values, scales), dtype)


def _built(prim, cfg, w, **extra):
    """`(kernel module, its parameters, w as the kernel is given it)` for running `prim`
    with `cfg`; `extra`: more of `_params`' arguments."""
    if cfg.option("_broken") not in _kernels().BROKEN:
        raise ValueError(f"unknown _broken option {cfg.option('_broken')!r}")
    in_place = _in_place(prim, cfg.w_transposed, cfg.w_resident)
    if in_place:  # the array in memory: XLA folds the two transposes away
        w = w.T
    module, params = _params(
        prim, axis_name=cfg.axis_name, axis_size=cfg.axis_size,
        bidirectional=cfg.bidirectional, out_dtype=cfg.out_dtype,
        reduce_dtype=cfg.reduce_dtype, target=cfg.on,
        get=dict(cfg.options, precision=cfg.precision).get, w_transposed=in_place, **extra)
    return module, params, w


def _run(prim, cfg, x, w, return_gathered=False):
    """Run primitive `prim` as a fused TPU kernel; see `_primitives.py` for shapes."""
    tpu = _kernels()
    scales = None
    if cfg.comm_dtype is not None:
        if prim not in prims.GATHERS:
            raise NotImplementedError(
                f"{prim}: backend 'pallas_tpu' cannot send the accumulator in "
                f"comm_dtype={cfg.comm_dtype} (its reduce-scatter kernels do not requantize "
                f"it); backend='ring' does")
        dtype, p = x.dtype, prims.of(prim)
        if p.traveller == "x":
            x, scales = _quantize.quantize(x, cfg.comm_dtype, p.scale_axis)
        else:  # a weight stored quantized travels as it is (scales (1, n): scale_axis 0)
            w, scales = _quantize.quantized(w, cfg.comm_dtype, p.scale_axis)
    module, params, w = _built(prim, cfg, w, return_gathered=return_gathered)
    if params.launch.for_mosaic:  # forward and backward calls alike, before lowering
        why = _misaligned(module, params, x, w, scales)
        if why is not None:
            raise NotImplementedError(f"{prim}: backend 'pallas_tpu' cannot build this "
                                      f"call for TPU: {why}")
    try:
        if scales is not None:
            result = module.all_gather_matmul(x, w, params, scales)
            if return_gathered:
                return result[0], _gathered(prim, result[1], dtype)
            return result
        if prim in prims.GATHERS:
            return module.all_gather_matmul(x, w, params)
        return module.matmul_reduce_scatter(x, w, params)
    except tpu.PlanError as e:
        raise NotImplementedError(f"{prim}: {e}") from None
    except ValueError as e:  # JAX's vma message suggests a fix that is not enough
        if "vma" in str(e):
            raise type(e)(f"{e}\n\n{tpu.CHECK_VMA_HINT}") from e
        raise


def _run_partnered(prim, cfg, x, w, partner, partner_dtype, transposed=False):
    """An ag_rows that also returns `partner.T @ all_gather(x)` (`partner` `(N*m, k2)`,
    rows matching the gathered rows) from the same kernel, each piece multiplied into an
    f32 sum as it arrives: the backward of an rs_rows (`_autodiff`), whose cotangent this
    gathers for x's gradient and whose weight gradient is `x.T @ gathered dy`, without
    the gathered cotangent ever written whole (a sequence-parallel MLP's is 64 MiB a
    device at 8,192 tokens of width 4,096 in bfloat16). None where the kernel cannot run
    it (a quantized or reduce-scatter call, a partner whose tiles do not fit or align):
    the caller keeps the gathered operand and multiplies it apart. `transposed`: the
    product is wanted transposed in memory (a weight held `(out, in)`): the kernel
    writes it so, and the transpose returned here is one XLA folds away."""
    if prim != prims.AG_ROWS or cfg.comm_dtype is not None:
        return None
    module, params, w_kernel = _built(prim, cfg, w, return_gathered=False,
                                      partner_dtype=partner_dtype,
                                      partner_transposed=transposed)
    try:  # a block the ring cannot halve: the caller's run says so
        module.shapes(params, x.shape, w_kernel.shape)
    except ValueError:
        return None
    layout = module.plan(params, x, w_kernel, partner=partner)[1]
    if layout is None or (params.launch.for_mosaic
                          and _misaligned(module, params, x, w_kernel, partner=partner)):
        return None
    # Its f32 sum is in VMEM, or else in HBM but smaller than the gathered x it replaces
    # (an FSDP x TP block's MLP on v6e: a 64 MiB sum in HBM against 32 MiB of gathered
    # cotangent, and 1,005 -> 1,411 MiB of temporaries for the step).
    sums = partner.shape[1] * x.shape[1] * 4
    gathered = cfg.axis_size * x.shape[0] * x.shape[1] * x.dtype.itemsize
    if not (layout.in_vmem or "partner_acc" in layout.resident or sums < gathered):
        return None
    # A small problem stays whole in VMEM without the partner: it is not moved to HBM
    # tiles for it (nothing there is big enough to save).
    plain = dataclasses.replace(params, partner_dtype=None, partner_transposed=False,
                                return_gathered=True)
    if not layout.in_vmem and (module.plan(plain, x, w_kernel)[1] or layout).in_vmem:
        return None

    from jax.custom_batching import custom_vmap

    @custom_vmap
    def call(x, w, partner):
        return module.all_gather_matmul(x, w.T if params.w_transposed else w, params,
                                        partner=partner)

    @call.def_vmap
    def batched(axis_size, in_batched, x, w, partner):
        """Under `jax.vmap`: the gather folded into one kernel for the batch (`run`, as
        without a partner) and the partner's product a batched matmul beside it; a
        kernel per example would run the batch's rings one after another. With w
        batched too (a weight per example) `run` cannot fold either and loops: then
        the partnered kernel per example, which keeps no gathered cotangent."""
        if in_batched[0] and in_batched[1]:
            args = [a if b else jax.numpy.broadcast_to(a, (axis_size, *a.shape))
                    for a, b in zip((x, w, partner), in_batched)]
            return jax.lax.map(lambda a: call(*a), args), (True, True)
        axes = tuple(0 if b else None for b in in_batched)
        out, g = jax.vmap(lambda x, w: run(prim, cfg, x, w, True), in_axes=axes[:2])(x, w)
        product = jax.vmap(lambda p, g: jax.numpy.dot(
            g.T if transposed else p.T, p if transposed else g,
            preferred_element_type=jax.numpy.float32), in_axes=(axes[2], 0))(partner, g)
        return (out, product.astype(partner_dtype)), (True, True)

    out, product = call(x, w, partner)
    return out, (product.T if transposed else product)


def kernels(call) -> str:
    """Which kernel runs `call` and how (what `fusedpar.explain` says of it)."""
    interpret = call.option("interpret")
    if interpret is None:
        interpret = call.option("interpret_params") is not None or call.target.interpret
    if interpret:
        mode = "in TPU interpret mode (every device, DMA and semaphore simulated on CPU)"
    else:
        chip = _chip(call.target, call.option("chip"), call.option("cores")).name
        if call.target.tpu_generation or call.option("chip"):
            mode = f"compiled by Mosaic for TPU {chip}"
        else:
            mode = f"compiled by Mosaic for TPU {chip}, the default (no generation named)"
    return f"pallas_tpu: one fused TPU kernel for {call.prim}, the ring inside it, {mode}"


def kernel_names() -> dict:
    """`{the name a fused kernel has in a compiled program: its primitive}` (the kernels
    name their `pallas_call` `<kernel>_<layout>`; the rest of the package says `ag_rows`)."""
    return {f"{name}_{layout}": p for p in prims.PRIMITIVES
            for _, name, layout in [_kernel_of(p)]}


# pallas_call cannot be batched by jax.vmap on these 2-D layouts: fold the mapped
# dimension into the problem instead (see _batching.py).
run = _batching.vmappable(_run)


def interprets(target, options) -> bool:
    """Whether the kernels run in TPU interpret mode on `target` with the op's `options`:
    as `interpret` says, else with `interpret_params`, else on a CPU mesh."""
    options = dict(options or {})
    if options.get("interpret") is False:
        return False
    return bool(options.get("interpret") or options.get("interpret_params") is not None
                or target.interpret)


# check_vma: collective kernels, which JAX's varying-axes check cannot type.
BACKEND = Backend(
    name="pallas_tpu",
    description="one fused Pallas TPU kernel per op: the ring runs inside it with remote DMAs",
    run=run, unavailable=unavailable, options=options, check_vma=False, kernels=kernels,
    cost="kernel", interprets=interprets, fused_kernels=kernel_names,
    run_partnered=_run_partnered)
