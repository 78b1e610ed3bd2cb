"""Gradients of the primitives: one custom_vjp whose backward runs the dual primitive.

The gradient of an all-gather-matmul with respect to its non-gathered operand is a
matmul-reduce-scatter and vice versa, so the backward pass overlaps its collectives the
same way the forward does, on the same backend — or, when the forward's backend was
picked by `backend="auto"`, on the one the same policy picks for each dual primitive's
own shapes: a forward all-gather whose ring pays can have a gradient reduce-scatter
whose ring does not (on 8 x H100 with per device x (2048, 8192) @ w (8192, 2048),
ag_rows forward on the ring, its rs_rows gradient on the reference).

With `keep_gathered` the forward of an all-gather returns the gathered operand as a
residual and the other gradient is a local matmul; without it, that gradient gathers
again (a second ring, less memory). A reduce-scatter's backward gathers the cotangent
once and, with `keep_gathered`, reuses it; an rs_rows's weight gradient `x.T @ gathered
dy` is computed inside that gather where its backend can (`Backend.run_partnered`: the
fused TPU kernel adds each arriving piece's product into an f32 sum), so the gathered
cotangent is never written whole (a sequence-parallel MLP's step on v5e:2x4: 240 -> 217
MiB of temporaries).

An ag_rows that `auto` runs product first (a w JAX proves replicated: `_product_first`)
has that module's backward: the cotangent reduce-scattered, both gradients local. An
rs_rows it runs operands first (`_operands_first`) has rs_rows' own backward.

Which dual runs, on which operands, is data: each primitive's `backward` and
`backward_keep` (`_primitives.Grad`); `_grads` computes them, the dual runs first.

Quantized communication (`comm_dtype`) is straight-through: the backward differentiates
the lax expression on the operand the forward multiplied (the dequantized one, which is
the residual `keep_gathered` keeps), with no gradient through rounding or clipping. The
backward's own collectives send in `grad_comm_dtype` (None: the inputs' dtype). Without
`keep_gathered` the backward gathers the operand again, in `grad_comm_dtype`: its other
gradient then multiplies that operand (unquantized by default), not the forward's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from . import (_backends, _definition, _dispatch, _operands_first, _primitives as prims,
               _product_first, _quantize, _vma)
from .. import cost_model
from ._backends import reference
from ._vma import cotangent_like


def scope(prim: str, cfg) -> str:
    """The name scope every run of `prim` with `cfg` is traced in, e.g.
    `fusedpar.ag_rows.ring.bidirectional`: compiled programs carry it in each
    instruction's `op_name`, so `fusedpar.aot` can say which op a transfer belongs to
    (a backward pass's runs sit under `transpose(...)`)."""
    if cfg.rearranged:  # on lax collectives: `_aot` reads the backend as "reference"
        return f"fusedpar.{prim}.reference.{cfg.rearranged}"
    if _backends.runs_one_collective(cfg.backend):  # no ring: no direction to name
        return f"fusedpar.{prim}.{cfg.backend}"
    ring = "bidirectional" if cfg.bidirectional else "unidirectional"
    return f"fusedpar.{prim}.{cfg.backend}.{ring}"


def run(prim, cfg, x, w, return_gathered=False, addend=None):
    """Run `prim` on the configured backend, without custom differentiation.

    `addend` (a reduce-scatter's: each device's partial sums of the product's shape) is
    summed with the products: in the backend's own reduce-scatter where it takes one
    (`Backend.run_adding`), else by one more `psum_scatter` beside it."""
    with jax.named_scope(scope(prim, cfg)):
        if addend is not None:
            adding = _backends.get(cfg.backend).run_adding
            if cfg.rearranged or cfg.comm_dtype is not None or adding is None:
                return plus_scattered(run(prim, cfg, x, w), addend, prim, cfg)
            return adding(prim, cfg, x, w, addend)
        if cfg.product_first:
            return _product_first.forward(cfg, x, w, return_gathered)
        if cfg.rearranged == prims.OPERANDS_FIRST:
            return _operands_first.forward(cfg, x, w)
        backend = _backends.get(cfg.backend)
        if backend.cost == "kernel":  # its kernels have no derivative (`_first_order`)
            return _first_order(cfg.backend, lambda x, w: backend.run(
                prim, cfg, x, w, return_gathered), x, w)
        return backend.run(prim, cfg, x, w, return_gathered)


def scattered(addend, prim, cfg):
    """`addend` (each device's partial sums) reduce-scattered in `cfg.reduce_dtype` like
    primitive `prim`'s result (`_primitives.RS_ROWS`'s rows)."""
    return _definition.psum_scatter(addend.astype(cfg.reduce_dtype), cfg.axis_name,
                                    prims.of(prim).gather_axis, cfg.explicit_vmap)


def plus_scattered(out, addend, prim, cfg):
    """`out` plus `scattered(addend, prim, cfg)`, in `out`'s dtype."""
    return out + scattered(addend, prim, cfg).astype(out.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def apply(prim, cfg, x, w):
    """Run `prim` with the backward pass described above."""
    return run(prim, cfg, x, w)


def _fwd(prim, cfg, x, w):
    # A pre-quantized w keeps its gathered (dequantized) self: it has no transpose to
    # gather again with, and x's gradient needs it.
    # Run product first, the backward needs no gathered operand (`_product_first`).
    if (prim in prims.GATHERS and not cfg.product_first
            and (cfg.keep_gathered or _is_quantized(w))):
        out, gathered = run(prim, cfg, x, w, return_gathered=True)
    else:
        out, gathered = run(prim, cfg, x, w), None
    return out, (x, w, gathered)


def _run_dual(fwd_prim, prim, cfg, x, w, return_gathered=False, beside=None, addend=None,
              w_ahead=False, sibling=None, again=None, partner=None):
    """`run` for the backward pass, checked first like the forward call was.

    The forward's dispatch checked only the forward primitive's shapes; a dual step can
    have other ones (its contraction is the forward's output width, say), which a kernel
    backend may not tile: that is an error here, before any kernel is traced.
    `beside`: the operands (shapes) of the backward's other gradient matmul, which needs
    nothing this one computes (under "auto" the reference's collective can hide behind
    it). `w_ahead`: this run's w is the forward's w (`Call.w_ahead`). `sibling`: that
    matmul, `(fn, operands)`; the result is then `(run's, fn(*operands))`, the sibling
    placed beside the collective where `auto` counted on it (`reference.run_beside`).
    `again`: in a backward without the kept operand (`keep_gathered=False`), whose
    gathers gather again what the forward or the other dual gathers, `(the product of
    the dual run before this one, or None)` (`_regathering`). `partner`: `(array, dtype,
    transposed)` of an ag_rows that keeps its gathered operand only for `partner.T @
    gathered` (wanted `transposed` in memory, or not): where the backend it runs on
    computes that in its own run (`Backend.run_partnered`), the result is `(product,
    that, True)` instead of `(product, gathered)` (`_partnered`).
    """
    op = prims.of(fwd_prim).op
    call = cfg.call(op, prim, x, w, gathered=return_gathered, adding=addend is not None,
                    w_ahead=w_ahead)
    cfg = dataclasses.replace(cfg, rearranged="")  # the forward's, not this run's
    if cfg.auto:  # this primitive's own pick, and its ring shape unless one was asked for
        if not cfg.shape_requested:
            call = dataclasses.replace(call, bidirectional=None)
        if beside is not None and call.platform not in ("", "cpu"):
            (m, k), (_, n) = beside[0].shape, beside[1].shape
            hw = cost_model.get_hardware(None, call.target)
            # The matmul's work, not its launch: only the work can hide a transfer.
            seconds = cost_model.matmul_seconds(m, k, n, call.dtype, hw) - hw.launch_overhead
            call = dataclasses.replace(call, beside=max(seconds, 0.0))
        # `choose` picks only a backend that can run the call.
        choice = _dispatch.choose(call, _dispatch.AUTO, cfg.unroll)
        cfg = dataclasses.replace(cfg, backend=choice.backend,
                                  bidirectional=choice.bidirectional, unroll=choice.unroll,
                                  rearranged=choice.rearranged)
        if sibling is not None and _counts_on_sibling(call, cfg, return_gathered):
            return reference.run_beside(prim, cfg, x, w, sibling, addend,
                                        lambda: jax.named_scope(scope(prim, cfg)))
        x, w = _regathering(prim, cfg, x, w, again)
        return _dual(prim, cfg, x, w, return_gathered, addend, partner, sibling)
    x, w = _regathering(prim, cfg, x, w, again)
    why = _backends.get(cfg.backend).unavailable(call)
    if why is not None:
        raise NotImplementedError(
            f"{op}: the backward pass of {fwd_prim} runs {prim} on local x{call.x_shape} "
            f"w{call.w_shape} ({call.dtype}), which backend {cfg.backend!r} cannot run: "
            f"{why} (the forward pass alone runs on it; backend='ring' runs both).")
    return _dual(prim, cfg, x, w, return_gathered, addend, partner, sibling)


def _dual(prim, cfg, x, w, return_gathered, addend, partner, sibling):
    """The dual's run on `cfg.backend`: partnered where that backend takes the partner
    (`_partnered`: the result then ends in True), else `run` and the sibling matmul."""
    done = _partnered(prim, cfg, x, w, partner)
    if done is not None:
        return (*done, True)
    return _with_sibling(run(prim, cfg, x, w, return_gathered, addend), sibling)


def _first_order(backend, fn, *args):
    """`fn(*args)` (a kernel backend's run), refusing to be differentiated: a fused kernel
    has no derivative, and second-order differentiation (a gradient of a gradient,
    `jax.hessian`) differentiates the custom VJP's forward and backward passes, kernels
    and all. JAX's own error there is a bare AssertionError from `pallas_call`'s JVP
    rule."""
    @jax.custom_jvp
    def first(*args):
        return fn(*args)

    @first.defjvp
    def _(primals, tangents):
        raise NotImplementedError(
            f"backend {backend!r}: second-order differentiation (a gradient of a gradient, "
            "jax.hessian) differentiates the backward pass, whose fused kernels have no "
            "derivative; run it on backend='ring' (grad of grad, jax.jacrev(jax.jacrev(f))) "
            "or 'reference' (also jax.hessian).")

    return first(*args)


def _partnered(prim, cfg, x, w, partner):
    """`(product, partner.T @ gathered)` from the backend's own run
    (`Backend.run_partnered`, a kernel: first-order only), or None where it has none or
    cannot run this call."""
    if partner is None or cfg.rearranged or cfg.product_first:
        return None
    fn = _backends.get(cfg.backend).run_partnered
    if fn is None:
        return None
    def partnered(x, w, p):  # () where the backend does not take it
        return fn(prim, cfg, x, w, p, *partner[1:]) or ()

    with jax.named_scope(scope(prim, cfg)):
        done = _first_order(cfg.backend, partnered, x, w, partner[0])
    return done or None


def _regathering(prim, cfg, x, w, again):
    """`(x, w)` of a dual run that gathers `again` (`_run_dual`) on the reference: passed
    through a barrier together, and with the dual run's product before it. Its
    `all_gather` of the same operand as the forward's, or as the other dual's (a
    reduce-scatter's cotangent), is otherwise one XLA merges with that one, keeping the
    gathered array after all (`keep_gathered=False` on 8 x H100, an MLP's step: 2
    all-gathers and 288 MiB of temporaries, as with True; 4 and 224 MiB with the
    barrier). Tied to the cotangent, the operand is not gathered before the backward;
    tied to the other dual's product, not while that one's gathered array is live (the
    MLP's Row alone: 320 MiB without that tie, 288 with it). A ring's or a kernel's
    gather is no such twin; there the barrier only costs (a TPU MLP's step held 33 MiB
    more)."""
    if again is not None and prims.of(prim).gathers and cfg.backend == _dispatch.REFERENCE \
            and not (cfg.rearranged or cfg.product_first):
        x, w, _ = lax.optimization_barrier((x, w, again))
    return x, w


def _counts_on_sibling(call, cfg, return_gathered) -> bool:
    """Whether `auto` gave `call` the plain reference counting on its collective hiding
    behind the sibling matmul (`_dispatch._estimated`): a reduce-scatter in its own dtype,
    on hardware where XLA runs such a collective beside other work, and on a GPU.

    Only there do the barriers of `reference.run_beside` help: a GPU runs the collective
    as an asynchronous start and done around whatever the scheduler puts between (the
    8 x H100 block: 3,387 -> 3,260 us replayed). v5e's compiler splits a reduce-scatter
    into steps it fuses into neighbouring XLA fusions, which the barriers wall off:
    there the block replayed 12,422 -> 12,499 us with them, ag_cols 1,405 -> 1,436.
    And only where the sibling's work (`Call.beside`: its estimate less the launch)
    covers at least a tenth of the collective's estimated transfer. The block's
    siblings cover 1.4x and 0.35x of theirs (0.13x in tests/test_aot.py's smaller
    block, where the barriers are neutral: 396 against 397 us). A width-256 step's
    matmul covers 0.007x and hides nothing: there the barriers only constrain XLA's
    schedule (a 2-block MLP of width 256 on 8 H100s replayed at 243 us with them, 208
    without)."""
    if not (call.platform == "gpu" and bool(call.beside)
            and cfg.backend == _dispatch.REFERENCE and not cfg.rearranged
            and cfg.comm_dtype is None and not prims.of(call.prim).gathers
            and not return_gathered):
        return False
    hw = cost_model.get_hardware(None, call.target)
    if not hw.collective_beside_matmul:
        return False
    transfer = cost_model.estimate_call(call, hw, backends=(_dispatch.REFERENCE,))
    return call.beside >= transfer[_dispatch.REFERENCE].transfer_step / 10


def _with_sibling(result, sibling):
    """`result`, and the sibling matmul's after it when there is one."""
    if sibling is None:
        return result
    fn, operands = sibling
    return result, fn(*operands)


def _local(cfg, a, b, dtype):
    return _definition.matmul(a, b, precision=cfg.precision, out_dtype=dtype)


def _is_quantized(w) -> bool:
    return isinstance(w, _quantize.Quantized)


def _operand(env, name):
    """`env`'s operand `name`, transposed for a `.T` suffix (`_primitives.Grad`)."""
    base, _, t = name.partition(".")
    return env[base].T if t else env[base]


def _shape(env, name):
    """The shape `_operand(env, name)` has, without transposing anything."""
    shape = tuple(env[name.partition(".")[0]].shape)
    return shape[::-1] if name.endswith(".T") else shape


def _transposed_in_memory(cfg, name) -> bool:
    """Whether operand `name` is the transpose of an array as it lies in memory: a `.T`
    of one the program computed (row-major), or the op's w, which the caller may have
    passed as one (`cfg.w_transposed`): the dual run's `Config.w_transposed`."""
    base, _, t = name.partition(".")
    return bool(t) != (base == "w" and cfg.w_transposed)


def _grads(prim, c, env, grads, dtypes, addend=None):
    """Compute `grads` (`_primitives.Grad`, dual runs first) from the operands in `env`.

    A dual run whose sibling gradient is a local matmul on operands it does not produce
    is told their shapes (`beside`): that matmul can hide its collective, and runs inside
    the dual's run (`sibling`), which places it beside the collective where `auto`
    counted on that (`_counts_on_sibling`). `addend`: what
    x's reduce-scatter also sums (`apply_keeping`'s siblings' partial sums).
    """
    out = {}

    def local(g, operands=env):
        r = _local(c, _operand(operands, g.lhs), _operand(operands, g.rhs), dtypes[g.of])
        return r.T if g.transposed else r

    def as_sibling(g):
        """`g` as a dual run's sibling: its operands as they lie (a barrier they pass
        must not materialize a transpose), and the matmul on them."""
        names = tuple({n.partition(".")[0]: None for n in (g.lhs, g.rhs)})
        return (lambda *arrays: local(g, dict(zip(names, arrays))),
                tuple(env[n] for n in names))

    # The dual runs first: a local gradient reads what a keeping dual gathers (`g`), or
    # runs inside a dual's run, beside its collective (`sibling`).
    r_prev = None  # the last dual's product
    for g in sorted(grads, key=lambda g: g.prim is None):
        if g.of in out:  # computed beside its dual
            continue
        if g.prim is None:
            out[g.of] = local(g)
            continue
        lhs, rhs = _operand(env, g.lhs), _operand(env, g.rhs)
        other = next((o for o in grads if o is not g), None)
        beside = sibling = None
        if other is not None and other.prim is None and not g.keeps:
            beside = tuple(jax.ShapeDtypeStruct(_shape(env, n), env["dy"].dtype)
                           for n in (other.lhs, other.rhs))
            sibling = as_sibling(other)
        dual = dataclasses.replace(c, w_transposed=_transposed_in_memory(c, g.rhs),
                                   w_resident=c.w_resident and g.rhs.startswith("w"))
        # An ag_rows that keeps its gathered operand only for the other gradient
        # `x.T @ g` (an rs_rows's backward) can have its backend compute that instead.
        partner = None
        if (g.keeps and g.prim == prims.AG_ROWS and other is not None
                and other.prim is None and (other.lhs, other.rhs) == ("x.T", "g")
                and not other.transposed):
            # Wanted transposed in memory where the op's w is a weight's transpose.
            partner = (env["x"], dtypes[other.of], c.w_transposed)
        r = _run_dual(prim, g.prim, dual, lhs, rhs, return_gathered=g.keeps, beside=beside,
                      addend=addend if g.of == "x" else None,
                      w_ahead=g.rhs.partition(".")[0] == "w", sibling=sibling,
                      again=None if c.keep_gathered else (r_prev,), partner=partner)
        if sibling is not None:
            r, out[other.of] = r
        if g.keeps and len(r) == 3:  # the partner's product is the other gradient
            r, out[other.of], _ = r
        elif g.keeps:
            r, env["g"] = r
        out[g.of] = r.T if g.transposed else r
        r_prev = r
    return out


def _bwd(prim, cfg, res, dy, addend=None):
    """The gradients of `x` and `w`; `addend`, for an all-gather of x's rows: partial
    sums of x's gathered gradient that x's reduce-scatter sums too (`apply_keeping`)."""
    if addend is not None and (_is_quantized(res[1]) or cfg.product_first):
        dx, dw = _bwd(prim, cfg, res, dy)  # no reduce-scatter of their own to join
        return cotangent_like(plus_scattered(dx, addend, prims.RS_ROWS, cfg), res[0]), dw
    x, w, gathered = res
    p = prims.of(prim)
    dtypes = {"x": x.dtype, "w": w.dtype}
    if _is_quantized(w):  # a stored quantized weight: x's gradient only (a local matmul)
        c = dataclasses.replace(cfg, out_dtype=x.dtype)
        env = dict(x=x, w=w, dy=dy.astype(x.dtype), g=gathered)
        grads = tuple(g for g in p.backward_keep if g.of == "x")
        return cotangent_like(_grads(prim, c, env, grads, dtypes)["x"], x), None
    # Gradients are computed in the inputs' dtype, accumulating in f32 as the forward does.
    dy = dy.astype(x.dtype)
    # The dual runs send in the backward's comm dtype (and have no backward of their own).
    c = dataclasses.replace(cfg, out_dtype=x.dtype, comm_dtype=cfg.grad_comm_dtype,
                            grad_comm_dtype=None)
    if cfg.product_first:  # y = AG_rows(x @ w), w invariant: both gradients local
        dx, dw = _product_first.backward(c, x, w, dy)
        return cotangent_like(dx.astype(x.dtype), x), cotangent_like(dw.astype(w.dtype), w)
    grads = p.backward_keep if cfg.keep_gathered else p.backward
    d = _grads(prim, c, dict(x=x, w=w, dy=dy, g=gathered), grads, dtypes, addend)
    return (cotangent_like(d["x"].astype(x.dtype), x),
            cotangent_like(d["w"].astype(w.dtype), w))


apply.defvjp(_fwd, _bwd)


# Sibling layers on one input (`fusedpar._nn._shared_gather`): the first one's op returns
# the gathered operand it keeps anyway, the others multiply it (no transfer). In the
# backward each sibling's gradient of the gathered operand (its partial products, unsummed
# over the ring) comes back to the first op, whose reduce-scatter of x's gradient sums it
# too (`run`'s `addend`): one reduce-scatter for all of them. Only `ag_rows` (a
# sequence-parallel input gather).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def apply_keeping(prim, cfg, x, w):
    """`apply` of `ag_rows`, also returning its gathered operand."""
    return _keeping(prim, cfg, x, w)


def _keeping(prim, cfg, x, w):
    out, gathered = run(prim, cfg, x, w, return_gathered=True)
    if _vma.checked(cfg.axis_name):  # varying: a sibling's cotangent arrives unsummed
        gathered = _vma.as_varying(gathered, _vma.axis_names(cfg.axis_name))
    return out, _batched_like_w(gathered, w)


def _batched_like_w(gathered, w):
    """`gathered`, made to depend on `w` so that under `jax.vmap` it is batched wherever
    the output is. A sibling's gradient of it comes back to this op's backward as an
    addend of its reduce-scatter (`_bwd_keeping`); of an unbatched `gathered` (x not
    batched, w batched: stacked layers vmapped over one input) JAX sums that cotangent
    over the batch before handing it to every batch element of the backward, which then
    added it once per element (x's gradient off by the stack's size, on the reference,
    whose all_gather does not depend on w; the lax ring's pieces pass barriers with its
    products). A select of the array with itself: the same values, NaN or not, which
    XLA folds away where nothing is batched."""
    leaf = jax.tree.leaves(w)[0]
    first = lax.reshape(lax.slice(leaf, (0,) * leaf.ndim, (1,) * leaf.ndim), ())
    return lax.select(first == first, gathered, gathered)


def _primal(arg):
    return jax.tree.map(lambda p: p.value, arg, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


def _fwd_keeping(prim, cfg, x, w):
    x, w = _primal(x), _primal(w)
    out, gathered = _keeping(prim, cfg, x, w)
    return (out, gathered), (x, w, gathered)


def _bwd_keeping(prim, cfg, res, cts):
    x, w, gathered = res
    dy, dg = cts
    dg = None if isinstance(dg, SymbolicZero) else dg  # the siblings' partial products
    if not isinstance(dy, SymbolicZero):
        return _bwd(prim, dataclasses.replace(cfg, keep_gathered=True), res, dy, addend=dg)
    if dg is None:
        return None, None
    # Only the siblings use the output: x's gradient is their sum alone.
    return cotangent_like(scattered(dg, prims.RS_ROWS, cfg).astype(x.dtype), x), None


apply_keeping.defvjp(_fwd_keeping, _bwd_keeping, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def apply_given(prim, cfg, x, w, gathered):
    """`ag_rows` on `gathered`, `x` gathered by an `apply_keeping`: a local matmul. Its
    backward: the gradient of `w` on `gathered`, and that of `gathered` (this device's
    partial products) for `apply_keeping`'s backward to reduce-scatter; none for `x`."""
    return _local(cfg, gathered, w, cfg.out_dtype)


def _fwd_given(prim, cfg, x, w, gathered):
    return apply_given(prim, cfg, x, w, gathered), (w, gathered)


def _bwd_given(prim, cfg, res, dy):
    w, gathered = res
    dy = dy.astype(gathered.dtype)
    dw = _local(cfg, gathered.T, dy, w.dtype)
    dg = _local(cfg, dy, w.T, gathered.dtype)
    return None, cotangent_like(dw, w), cotangent_like(dg, gathered)


apply_given.defvjp(_fwd_given, _bwd_given)
