"""The public ops: validate, choose a backend, canonicalise, run with the shared custom VJP."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from . import (_autodiff, _definition, _dispatch, _folding, _interpret, _quantize, _schedule,
               _validate, _vma)
from .._hw import _target, _xla_flags
from . import _primitives as prims
from ._dispatch import AUTO, Choice
from ._primitives import ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, Config


def _explain_target(target, platform) -> _target.Target:
    """The `Target` `explain` decides for: `target` (a mesh, a device or a `Target`), or
    a platform name, else the mesh in context, else the local default device."""
    if target is not None and platform is not None:
        raise ValueError("explain: pass target= or platform=, not both.")
    if platform is not None:
        valid = _target.PLATFORMS + ("cuda",)
        if platform not in valid:
            raise ValueError(f"explain: platform must be one of "
                             f"{', '.join(map(repr, valid))} (or None: the mesh in "
                             f"context, else the local devices), got {platform!r}.")
        return _target.of_platform(platform)
    if target is None:
        return _target.current()
    if isinstance(target, _target.Target):
        return target
    if isinstance(target, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        found = _target.of_mesh(target)
        if found is None:
            raise ValueError(f"explain: target mesh {target} does not say what its devices "
                             "are (an empty mesh, or an AbstractMesh built without devices).")
        return found
    if hasattr(target, "platform") and hasattr(target, "device_kind"):
        return _target.of_device(target)
    hint = (f" (for hardware that is not here, the mesh of its compile-only devices: "
            f"target=fusedpar.aot.mesh({target!r}))" if isinstance(target, str) else "")
    raise TypeError(f"explain: target must be a jax.sharding.Mesh, an AbstractMesh, a "
                    f"jax.Device or a fusedpar Target, got {type(target).__name__}{hint}.")


def explain(op, x, w, axis_size, *, gather="lhs", dim=0, backend=AUTO,
            bidirectional=None, unroll=None, precision=None, options=None,
            platform=None, target=None, comm_dtype=None, w_invariant=None,
            check_vma=None, reduce_dtype=None, grad_comm_dtype=None, w_transposed=False,
            w_resident=False) -> Choice:
    """Which backend (and ring shape) `op` would use for these local operands, and why.

    `x` and `w` may be arrays or `jax.ShapeDtypeStruct`s with per-device shapes;
    `axis_size` is the size of the mesh axis the op runs over, or, inside `jax.shard_map`,
    the axis name you would pass the op: its size, whether the shard_map checks varying
    axes and whether w is invariant over it (w an array there, not a
    `jax.ShapeDtypeStruct`) are then read as the op reads them. The hardware decided for
    (`Choice.target`) is `target` (a `jax.sharding.Mesh`, its devices say; or a device),
    else the mesh in context (`jax.set_mesh`, or inside `shard_map`), else this process's
    default device; `platform` ("cpu", "gpu", "tpu") instead names only a platform, with
    its default cost preset. The other arguments are the op's (`comm_dtype`: a backend
    that cannot send quantized payloads is not chosen, or is refused if requested).
    `w_invariant=True` (default: read from the context for a named axis, else False)
    says w is replicated over the ring's axis and the op can see it
    (inside `shard_map(check_vma=True)`, JAX's default): `"auto"` may then run a
    `gather="lhs"` call by multiplying first and gathering the product; a
    `matmul_reduce_scatter` over rows it may run by moving x's rows and w instead of the
    partial sums, where w is the op's own (`Choice.rearranged` says which).
    `check_vma=True` (default as `w_invariant`'s) says the op runs inside a
    `jax.shard_map` that checks varying axes (its default): a backend whose kernels need
    `check_vma=False` (the fused TPU kernels) is not chosen there, as the op does.
    `reduce_dtype`: the op's (the reduce-scatter's partial sums, estimated in it);
    `grad_comm_dtype` the op's (gradients that travel quantized rule out multiplying
    first, as in the op). `w_transposed` and `w_resident`: the op's layout hints, which
    the layers pass (a fused TPU kernel reading w in place tiles it otherwise, so whether
    it fits, and is chosen, can differ).

    Called inside a `jax.shard_map` that leaves mesh axes to XLA, it decides as the op
    would there (the fused TPU kernels cannot run: every mesh axis must be manual). On a
    TPU whose devices it does not know (an abstract mesh, a device, a platform), the
    reason says how to get a ring whose hops are single ICI links.
    """
    if op not in prims.OPS:
        got = repr(op) if isinstance(op, str) else f"an object of type {type(op).__name__}"
        raise ValueError(f"explain: op must be {ALL_GATHER_MATMUL!r} or "
                         f"{MATMUL_REDUCE_SCATTER!r}, got {got}; for the collectives a "
                         "model's layers run, fusedpar.describe(model).")
    axis_name = axis_size if _names_an_axis(axis_size) else None
    if axis_name is not None:
        try:
            lax.axis_size(axis_name)
        except NameError:
            raise ValueError(
                f"explain: axis_size={axis_name!r} names a mesh axis, which only an enclosing "
                "jax.shard_map binds (none binds it here); outside shard_map pass the "
                "axis's size, an int.") from None
        axis_size = _validate.axis_size("explain", axis_name)
    axis_size = _validate.ring_size("explain", axis_size)
    where = _explain_target(target, platform)
    _, call, grad_comm_dtype = _validate.op_call(op, x, w, axis_size, gather, dim,
                                                 bidirectional, comm_dtype, grad_comm_dtype,
                                                 unroll=unroll, where="explain")
    _validate.flag("explain", "w_invariant", w_invariant)
    _validate.flag("explain", "check_vma", check_vma)
    if w_invariant and check_vma is False:  # the op never sees w invariant there
        raise ValueError("explain: w_invariant=True needs check_vma=True (or None): in a "
                         "jax.shard_map with check_vma=False JAX types no varying axes, so "
                         "the op cannot see w invariant and never multiplies first there.")
    _layout_hints("explain", w_transposed, w_resident)
    if w_invariant is None:  # as the op reads it (a ShapeDtypeStruct has no type)
        w_invariant = (axis_name is not None and not isinstance(w, jax.ShapeDtypeStruct)
                       and _multiplies_first(w, axis_name, grad_comm_dtype))
    if check_vma is None:
        check_vma = axis_name is not None and _vma.checked(axis_name)
    reduce_dtype = _validate.reduce_dtype("explain", reduce_dtype, x.dtype)
    call = dataclasses.replace(call, automatic_axes=_target.automatic_axes(),
                               w_invariant=bool(w_invariant), vma_typed=bool(check_vma),
                               w_transposed=w_transposed, w_resident=w_resident,
                               explicit_vmap=_folding.explicit_vmap_axes(),
                               reduce_dtype=None if reduce_dtype is None else reduce_dtype.name)
    choice = _choose(call, backend, unroll, precision, options, where)
    # Compile-only devices take their flags from the compile call (aot.compiler_options).
    devices = _target.concrete_mesh() if target is None else target  # a mesh, a device
    missing = "" if _target.compile_only(devices) else _missing_flags(where.platform, choice)
    if missing:  # XLA reads them once: say so, rather than set them behind your back
        choice = dataclasses.replace(choice, reason=f"{choice.reason}; {missing}")
    if (where.platform == "tpu" and axis_size > 2 and choice.runs_ring
            and not _devices_known(target)):
        choice = dataclasses.replace(choice,
                                     reason=f"{choice.reason}; {_schedule.INDEX_ORDER_HINT}")
    return choice


def _multiplies_first(w, axis_name, grad_comm_dtype) -> bool:
    """Whether the op may multiply first and gather the product (`Call.w_invariant`): w
    typed invariant over `axis_name` (never guessed), and gradients that travel in x's
    own dtype (`_product_first` has no quantized backward)."""
    return (grad_comm_dtype is None and not isinstance(w, _quantize.Quantized)
            and _vma.invariant(w, axis_name))


def _layout_hints(where, w_transposed, w_resident) -> None:
    """Check the layout hints `w_transposed` and `w_resident` (the op's and `explain`'s)."""
    for name, flag in (("w_transposed", w_transposed), ("w_resident", w_resident)):
        _validate.boolean(where, name, flag)
    if w_resident and not w_transposed:  # a hint that would silently do nothing
        raise ValueError(f"{where}: w_resident=True describes a w passed with "
                         "w_transposed=True (the transpose of an (n, k) array you hold); "
                         "pass w_transposed=True with it, or leave w_resident False.")


def _names_an_axis(axis_size) -> bool:
    """Whether `explain`'s `axis_size` is a mesh axis name (or a tuple of them)."""
    names = axis_size if isinstance(axis_size, tuple) else (axis_size,)
    return bool(names) and all(isinstance(a, str) for a in names)


def _devices_known(target) -> bool:
    """Whether the ring `explain` describes is ordered by its devices' coordinates: the
    target is a concrete mesh, or none is given and the context has one
    (`_target.concrete_mesh`)."""
    if target is None:
        return _target.concrete_mesh() is not None
    return isinstance(target, jax.sharding.Mesh)


def _missing_flags(platform: str, choice: Choice) -> str:
    """What `explain` says of the overlap flags (`fusedpar.set_overlap_flags`) this
    process's environment lacks on `platform`, or ""."""
    if platform == "gpu" and choice.runs_ring:
        missing = _xla_flags.missing_overlap_flags("gpu", choice.bidirectional)
        why = ("which a GPU ring needs for its transfers, and XLA's own collectives "
               "beside it (an FSDP weight gather), to overlap the matmuls")
    elif platform == "tpu":
        missing = _xla_flags.missing_overlap_flags("tpu")
        why = ("which XLA's own all-gathers beside this op (an FSDP weight gather) need to "
               "run beside matmuls")
    else:
        return ""
    if not missing:
        return ""
    return (f"{_xla_flags.VARIABLES[platform]} lacks {' '.join(missing)}, {why}: call "
            "fusedpar.set_overlap_flags() before JAX starts")


def _choose(call, backend, unroll, precision, options, target) -> Choice:
    """The backend for `call` on `target`, its `options` checked against it."""
    _validate.options(call.op, options)
    choice = _dispatch.choose(dataclasses.replace(
        call, target=target, precision=precision, options=_pairs(options)),
        backend, unroll)
    _dispatch.check_options(call.op, options, backend, choice.backend, target.platform)
    return choice


def _pairs(options) -> tuple:
    return tuple(sorted((options or {}).items()))


class _PerBlock(Exception):
    """`_run_here` cannot run on operands that these Explicit mesh axes shard."""

    def __init__(self, axes, out_dtype):
        super().__init__(axes)
        self.axes, self.out_dtype = axes, out_dtype


def _run(op, x, w, axis_name, gather, dim, **kwargs):
    """`_run_here`, or, where Explicit mesh axes shard the operands in a way the ops' 2-D
    form cannot carry, `_run_here` on each device's block of those axes (`_manual_over`)."""
    try:
        return _run_here(op, x, w, axis_name, gather, dim, **kwargs)
    except _PerBlock as e:
        gathered = kwargs.get("gathered")
        return _manual_over(
            e.axes, _expression(op, x, w, axis_name, gather, dim, e.out_dtype, gathered),
            lambda x, w, g: _run_here(op, x, w, axis_name, gather, dim,
                                      **dict(kwargs, gathered=g)), x, w, gathered)


def _run_here(op, x, w, axis_name, gather, dim, *, backend, bidirectional, unroll,
              keep_gathered, preferred_element_type, reduce_dtype, precision, options,
              comm_dtype, grad_comm_dtype, w_transposed=False, w_resident=False,
              gathered=None):
    """Validate the call (once: `_validate.op_call`), choose its backend, run it.

    `gathered` (`all_gather_matmul_keeping`, `all_gather_matmul_given`): `KEEP` returns
    the gathered operand too; an array is that operand, gathered by an earlier call."""
    n = _validate.axis_size(op, axis_name)
    dim, call, grad_comm_dtype = _validate.op_call(op, x, w, n, gather, dim, bidirectional,
                                                   comm_dtype, grad_comm_dtype, unroll)
    _validate.boolean(op, "keep_gathered", keep_gathered)
    _layout_hints(op, w_transposed, w_resident)
    out_dtype = _validate.result_dtype(op, preferred_element_type, x.dtype)
    reduce_dtype = _validate.reduce_dtype(op, reduce_dtype, x.dtype)
    if (0 in x.shape or 0 in w.shape) and (gathered is None or gathered is KEEP):
        return _empty(op, x, w, axis_name, gather, dim, out_dtype, gathered)
    target = _target.current(x, *jax.tree.leaves(w))
    automatic = _target.automatic_axes()
    invariant = _multiplies_first(w, axis_name, grad_comm_dtype)
    explicit_vmap = _folding.explicit_vmap_axes()
    call = dataclasses.replace(call, automatic_axes=automatic, w_invariant=invariant,
                               vma_typed=_vma.checked(axis_name), w_transposed=w_transposed,
                               w_resident=w_resident, explicit_vmap=explicit_vmap,
                               reduce_dtype=None if reduce_dtype is None else reduce_dtype.name)
    choice = _choose(call, backend, unroll, precision, options, target)
    _interpret.check_threads(op, choice.backend, options, target)  # before a hang
    _interpret.check_remat(op, choice.backend, options, target)
    cfg = Config(
        backend=choice.backend, axis_name=axis_name, axis_size=n,
        bidirectional=choice.bidirectional, unroll=choice.unroll,
        out_dtype=np.dtype(x.dtype if out_dtype is None else out_dtype),
        reduce_dtype=np.dtype(_definition.accumulation_dtype(x.dtype)
                              if reduce_dtype is None else reduce_dtype),
        precision=precision, keep_gathered=keep_gathered, options=_pairs(options),
        target=target, comm_dtype=call.comm_dtype, grad_comm_dtype=grad_comm_dtype,
        auto=backend == AUTO, automatic_axes=automatic, rearranged=choice.rearranged,
        shape_requested=bidirectional is not None, w_transposed=w_transposed,
        w_resident=w_resident, explicit_vmap=explicit_vmap)
    try:
        c = prims.canonicalize(op, gather, dim, x, w, n)
    except Exception as e:  # noqa: BLE001 - JAX's ShardingTypeError is not public
        explicit = _explicit_axes(x, w, gathered)
        if type(e).__name__ != "ShardingTypeError" or not explicit:
            raise
        # The 2-D form merges a batch that an Explicit axis shards into rows, which
        # sharding in types refuses: run the op per block of those axes instead (`_run`).
        if _vma.checked(axis_name):
            raise ValueError(
                f"{op}: x or w is sharded over the Explicit mesh axes {explicit} inside a "
                f"shard_map manual over {axis_name!r} but not over them, with "
                f"check_vma=True (local x{tuple(x.shape)}): make the shard_map manual over "
                f"{explicit} too (axis_names), or pass it check_vma=False, or use Auto "
                "axes.") from e
        raise _PerBlock(explicit, out_dtype) from e
    with _validate.reverse_mode_only(op, "the op's gradient is a custom VJP (its dual "
                                         "ring)"):
        if gathered is None:
            return c.restore(_autodiff.apply(c.prim, cfg, c.x, c.w))
        assert c.prim == prims.AG_ROWS, c.prim  # a gather of x's rows (`_autodiff`)
        if gathered is KEEP:
            y, g = _keeping(c.prim, cfg, c.x, c.w)
            return c.restore(y), c.restore(g)
        return c.restore(_autodiff.apply_given(c.prim, cfg, c.x, c.w,
                                               prims.rows_first(gathered, dim)))


KEEP = object()  # `_run(gathered=KEEP)`: return the gathered operand too


def _expression(op, x, w, axis_name, gather, dim, out_dtype, gathered):
    """The lax expression's result (`jax.ShapeDtypeStruct`s: shape, dtype, sharding,
    varying axes): the op's, and with `gathered=KEEP` the gathered operand's too."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    dense_w = jax.ShapeDtypeStruct(w.shape, x.dtype, vma=_vma.varying_axes(w)) \
        if isinstance(w, _quantize.Quantized) else w
    if gathered is not None and gathered is not KEEP:  # gathered by an earlier call
        return jax.eval_shape(lambda g, w: _definition.matmul(g, w, out_dtype=out_dtype),
                              gathered, dense_w)
    if op == MATMUL_REDUCE_SCATTER:
        return jax.eval_shape(lambda x, w: _definition.matmul_reduce_scatter(
            x, w, axis_name, dim=dim, out_dtype=out_dtype), x, dense_w)
    y = jax.eval_shape(lambda x, w: _definition.all_gather_matmul(
        x, w, axis_name, gather=gather, dim=dim, out_dtype=out_dtype), x, dense_w)
    if gathered is KEEP:
        return y, jax.eval_shape(
            lambda x: lax.all_gather(x, axis_name, axis=dim, tiled=True), x)
    return y


def _empty(op, x, w, axis_name, gather, dim, out_dtype, gathered):
    """The result of a call with an empty operand (a sequence or batch of length 0, say):
    zeros of the lax expression's shape and type, nothing sent. XLA refuses a collective
    over a dimension of size 0, and there is nothing to send or sum. Their gradients are
    zeros too, as the expression's are."""
    return jax.tree.map(
        lambda s: _vma.as_varying(jnp.zeros(s.shape, s.dtype), _vma.varying_axes(s)),
        _expression(op, x, w, axis_name, gather, dim, out_dtype, gathered))


def _explicit_axes(x, w, gathered) -> tuple:
    """The context mesh's Explicit axes (not manual) that shard `x`, `w` or `gathered`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    explicit = {name for name, t in zip(mesh.axis_names, mesh.axis_types)
                if t == AxisType.Explicit}
    arrays = jax.tree.leaves((x, w, None if gathered is KEEP else gathered))
    found = [a for array in arrays for entry in _spec(array) if entry is not None
             for a in _vma.axis_names(entry) if a in explicit]
    return tuple(dict.fromkeys(found))


def _spec(array) -> tuple:
    """`array`'s PartitionSpec as its type carries it (sharding in types), or ()."""
    return tuple(getattr(getattr(jax.typeof(array), "sharding", None), "spec", None) or ())


def _along(spec, axes) -> P:
    """`spec` with only the mesh axes in `axes`."""
    def keep(entry):
        kept = tuple(a for a in _vma.axis_names(entry) if a in axes) if entry else ()
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(keep(e) for e in spec))


def _manual_over(axes, expression, run, x, w, gathered):
    """`run(x, w, gathered)` inside a shard_map manual over `axes` as well: the Explicit
    mesh axes that shard the operands (a batch sharded over "data" in a shard_map manual
    over "tp" only), whose sharding in types the ring's reshapes cannot carry (merging a
    sharded batch into the rows it gathers). Each device runs the op on its block; the
    layouts along `axes` are the operands' and, for the result, the lax expression's.
    Only where the enclosing shard_map does not check varying axes (JAX 0.10 can neither
    lower a nested shard_map over operands varying along its parent's axes, nor type a
    custom VJP's gradients across an unchecked one)."""
    given = gathered is not None and gathered is not KEEP

    def spec(a):
        return _along(_spec(a), axes)

    args = (x, w) + ((gathered,) if given else ())
    in_specs = (spec(x), jax.tree.map(spec, w)) + ((spec(gathered),) if given else ())
    out_specs = jax.tree.map(lambda s: _along(s.sharding.spec, axes), expression)
    f = (lambda x, w, g: run(x, w, g)) if given else (lambda x, w: run(x, w, gathered))
    return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes),
                         check_vma=False)(*args)


def _keeping(prim, cfg, x, w):
    """`_autodiff.apply_keeping`, staged out where JAX cannot run it op by op: its
    gradient takes symbolic zeros (a sibling that does not use the gathered operand costs
    nothing), and JAX (0.10, 0.11) raises NotImplementedError for a custom_vjp with
    symbolic zeros in an eager `shard_map` (a sequence-parallel `ColumnLinear` called
    outside `jit`); under `jit` it runs, and the error comes before any work is done."""
    try:
        return _autodiff.apply_keeping(prim, cfg, x, w)
    except NotImplementedError as e:
        if "symbolic_zeros" not in str(e):
            raise
    return jax.jit(_autodiff.apply_keeping, static_argnums=(0, 1))(prim, cfg, x, w)


def all_gather_matmul_keeping(x, w, axis_name, *, dim=0, **kwargs):
    """`all_gather_matmul(x, w, axis_name, gather="lhs", dim=dim, **kwargs)` and
    `lax.all_gather(x, axis_name, axis=dim, tiled=True)`, which its ring assembles for
    its backward anyway: for `all_gather_matmul_given`. The gathered array's gradient
    (the siblings' products, per device) is reduce-scattered into `x`'s in one
    collective beside the op's own."""
    return _run(ALL_GATHER_MATMUL, x, w, axis_name, "lhs", dim, gathered=KEEP,
                **_op_defaults(kwargs))


def all_gather_matmul_given(x, gathered, w, axis_name, *, dim=0, **kwargs):
    """`all_gather_matmul(x, w, axis_name, gather="lhs", dim=dim, **kwargs)` where
    `gathered` is `x` gathered already (`all_gather_matmul_keeping`'s): the forward
    multiplies it, with no transfer. In the backward the gradient of `w` is a local
    matmul on `gathered`, and `x`'s reaches it through `gathered`'s: the keeping op
    reduce-scatters it (`x` itself gets none here)."""
    n = _validate.axis_size(ALL_GATHER_MATMUL, axis_name)
    d = dim + x.ndim if dim < 0 else dim  # out of range: `_run` says so
    want = x.shape[:d] + (x.shape[d] * n,) + x.shape[d + 1:]
    if 0 <= d < x.ndim and (gathered.shape != want or gathered.dtype != x.dtype):
        raise ValueError(f"all_gather_matmul_given: gathered must be x{x.shape} gathered "
                         f"along dim {dim} over {axis_name!r} ({n} devices): shape {want}, "
                         f"dtype {x.dtype}; got {gathered.shape}, {gathered.dtype}.")
    return _run(ALL_GATHER_MATMUL, x, w, axis_name, "lhs", dim, gathered=gathered,
                **_op_defaults(kwargs))


def _op_defaults(kwargs) -> dict:
    """`kwargs` with `all_gather_matmul`'s defaults for the keyword arguments it leaves
    out (its signature's, but `gather` and `dim`, which the callers fix)."""
    defaults = {name: p.default
                for name, p in inspect.signature(all_gather_matmul).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name not in ("gather", "dim")}
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"all_gather_matmul: unexpected arguments {sorted(unknown)}.")
    return {**defaults, **kwargs}


def all_gather_matmul(x, w, axis_name, *, gather="lhs", dim=0, backend=AUTO,
                      bidirectional: Optional[bool] = None, unroll: Optional[bool] = None,
                      keep_gathered: bool = True, preferred_element_type=None,
                      reduce_dtype=None, precision=None, options: Optional[dict] = None,
                      comm_dtype=None, grad_comm_dtype=None, w_transposed: bool = False,
                      w_resident: bool = False):
    """All-gather one operand over `axis_name` and multiply, overlapping the two.

    Call inside `jax.shard_map` with `axis_name` bound. Equal to

    - `gather="lhs"`: `jnp.matmul(lax.all_gather(x, axis_name, axis=dim, tiled=True), w)`,
      `dim` any non-contracting dimension of `x`;
    - `gather="rhs"`: `jnp.matmul(x, lax.all_gather(w, axis_name, axis=dim, tiled=True))`,
      `dim=0` the contracting rows of `w`, `dim=1` its output columns (the FSDP gather).

    **Arguments:**

    - `x`: local `(..., k)` array; `w`: local `(k, n)` array of the same floating dtype.
    - `backend`: `"auto"`, `"reference"`, `"ring"`, `"pallas"`, `"pallas_tpu"`,
      `"pallas_gpu"`.
    - `bidirectional`: split each block in halves sent both ways (default: when the ring has
      more than 2 devices and blocks split evenly). `unroll`: unrolled steps, or a
      `fori_loop` (default: unrolled up to 8 devices).
    - `keep_gathered`: the forward keeps the gathered operand for the backward pass
      (default, more memory) instead of gathering it again (more communication).
    - `preferred_element_type`: result dtype (default: the inputs'); products accumulate in
      float32 for bfloat16/float16 inputs. `reduce_dtype`: dtype of the accumulator the
      backward's reduce-scatter sends round the ring (default float32, see
      `matmul_reduce_scatter`). `precision`: passed to every matmul.
    - `options`: backend-specific settings (e.g. kernel tile sizes).
    - `comm_dtype`: `None` (send the operand as it is), `jnp.int8` or
      `jnp.float8_e4m3fn`: the travelling operand is quantized once on its owner, one
      float32 scale per row of x (`gather="lhs"`) or per column of w (`"rhs"`; with
      `dim=0` per column of each device's block), sent as values and scales, and
      dequantized to the input dtype where a step multiplies it: the result is the lax
      expression on the dequantized operand (docs/quantized.md). `pallas_tpu` sends it
      inside its fused kernels (values and scales by remote DMA).
    - `grad_comm_dtype`: the same for the backward pass's collectives (default `None`:
      the input dtype). Gradients are straight-through: those of the lax expression on
      the operand the forward multiplied (with `keep_gathered=False` the backward gathers
      the operand again, in `grad_comm_dtype`).
    - `w` may also be a `_quantize.Quantized(values, scales)` with `gather="rhs"`: a
      weight stored quantized (`fusedpar.QuantizedArray.as_payload()`), sent as it is
      (`comm_dtype` is its values' dtype); it gets no gradient, `x` does.
    - `w_transposed`: a layout hint; the values are the same either way. `w` is the
      transpose of the array you hold (`weight.T` of an `(out, in)` weight, as the
      layers pass theirs): where w stays put (`gather="lhs"`) the fused TPU kernels read
      that array in place, their matmuls taking a transposed right operand, instead of
      XLA copying it into `(k, n)` order before the call. Other backends leave layouts to
      XLA, which folds the transpose into its own matmuls.
    - `w_resident`: a layout hint with `w_transposed`: the array is one you hold (a
      weight not gathered in this step), so the fused TPU reduce-scatter kernels (this
      op's backward, `matmul_reduce_scatter`'s forward) read it in place too. Leave it
      False for a weight gathered just before the call: XLA hides that gather in the
      copy into `(k, n)` order (docs/tpu.md).

    **Returns:** the product, with `x`'s dim `dim` (lhs) or `w`'s (rhs) `N` times larger.
    """
    return _run(ALL_GATHER_MATMUL, x, w, axis_name, gather, dim, backend=backend,
                bidirectional=bidirectional, unroll=unroll, keep_gathered=keep_gathered,
                preferred_element_type=preferred_element_type, reduce_dtype=reduce_dtype,
                precision=precision, options=options, comm_dtype=comm_dtype,
                grad_comm_dtype=grad_comm_dtype, w_transposed=w_transposed,
                w_resident=w_resident)


def matmul_reduce_scatter(x, w, axis_name, *, dim=0, backend=AUTO,
                          bidirectional: Optional[bool] = None, unroll: Optional[bool] = None,
                          keep_gathered: bool = True, preferred_element_type=None,
                          reduce_dtype=None, precision=None, options: Optional[dict] = None,
                          comm_dtype=None, grad_comm_dtype=None, w_transposed: bool = False,
                          w_resident: bool = False):
    """Multiply and reduce-scatter the product over `axis_name`, overlapping the two.

    Call inside `jax.shard_map` with `axis_name` bound. Equal to
    `lax.psum_scatter(jnp.matmul(x, w), axis_name, scatter_dimension=dim, tiled=True)`,
    `dim` any dimension of the product, which must divide by the axis size.

    The partial sums travel the ring in `reduce_dtype`: float32 by default, more accurate
    than summing in bfloat16 but twice the bytes per step for bfloat16 inputs; pass
    `reduce_dtype=jnp.bfloat16` to halve the traffic. With `comm_dtype` (`jnp.int8`,
    `jnp.float8_e4m3fn`) they travel quantized, one float32 scale per row of the segment,
    requantized at every hop (the `reference` backend instead sends each device's
    partial product quantized once); the error grows with the ring size
    (docs/quantized.md has the figures). The other arguments are those of
    `all_gather_matmul`; `keep_gathered` here makes the backward gather the cotangent
    once and reuse it for both gradients. `w_transposed` is as there, but the fused TPU
    reduce-scatter itself is given w in `(k, n)` order unless `w_resident` says the
    array is one you hold, not a weight gathered just before (docs/tpu.md says why);
    the backward's gather of the cotangent, which multiplies by w's transpose, reads the
    array as it lies either way.
    """
    return _run(MATMUL_REDUCE_SCATTER, x, w, axis_name, "lhs", dim, backend=backend,
                bidirectional=bidirectional, unroll=unroll, keep_gathered=keep_gathered,
                preferred_element_type=preferred_element_type, reduce_dtype=reduce_dtype,
                precision=precision, options=options, comm_dtype=comm_dtype,
                grad_comm_dtype=grad_comm_dtype, w_transposed=w_transposed,
                w_resident=w_resident)
