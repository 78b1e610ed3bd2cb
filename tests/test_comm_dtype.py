"""`comm_dtype`: quantized payloads on the ring, every CPU backend against its oracle.

All-gathers: the oracle is "quantize, then the lax expression on the dequantized
operand", written here with `_definition` on the travelling operand fake-quantized by
`_quantize.quantize` (the only code shared with the backends), straight-through under
JAX's autodiff. Reduce-scatters: the backends differ by design (the ring requantizes its
accumulator at every hop, the reference quantizes each partial product once), so each is
checked against the exact float32 sum within an error bound derived from the hops
(`_rs_bound`), not a tolerance. Then the issue's accuracy targets against the bfloat16
lax expression, the narrow bytes in the traced programs, and dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _definition, _quantize
from helpers import RING_CONFIGS as CONFIGS, assert_close, equations, mesh, normal, tolerance

pytestmark = pytest.mark.timeout(300)

AGM, MRS = fusedpar.all_gather_matmul, fusedpar.matmul_reduce_scatter
INT8, FP8 = jnp.int8, jnp.float8_e4m3fn


def _problems(n, b=8, k=16, c=8):
    """name -> (op, kwargs, x global shape, w global shape, x spec, w spec, travelling,
    output identical on every device). Local blocks: b rows/cols, k contraction."""
    return {
        "ag_rows": (AGM, dict(gather="lhs", dim=0), (n * b, k), (k, c), P("x"), P(), "x",
                    True),
        "ag_cols": (AGM, dict(gather="rhs", dim=1), (n * b, k), (k, n * b), P("x"),
                    P(None, "x"), "w", False),
        "ag_contract": (AGM, dict(gather="rhs", dim=0), (n * b, n * k), (n * k, c), P("x"),
                        P("x"), "w", False),
        "rs_rows": (MRS, dict(dim=0), (n * b, n * k), (n * k, c), P(None, "x"), P("x"), None,
                    False),
        "rs_cols": (MRS, dict(dim=1), (b, n * k), (n * k, n * b), P(None, "x"), P("x"), None,
                    False),
    }


def _out_spec(name):
    return P(None, "x") if name == "rs_cols" else P("x")


def fake_quantize(a, dtype, axis):
    """`a` as the receiver sees it, with a straight-through gradient: dequantized
    `quantize(a)` forward, identity backward (`deq + (a - a)` is exactly `deq`)."""
    q = _quantize.quantize(a, dtype, axis)
    deq = (q.values.astype(jnp.float32) * q.scales).astype(a.dtype)
    return lax.stop_gradient(deq) + (a - lax.stop_gradient(a))


def _oracle(name, comm, quantize_gathered=True):
    """Per-device oracle of problem `name`: the lax expression, its travelling operand
    fake-quantized (all-gathers; scales over the contraction axis, per local block)."""
    op, kw, *_, travelling, stack = _problems(1)[name]

    def f(x, w):
        if comm is not None and quantize_gathered and travelling == "x":
            x = fake_quantize(x, comm, -1)
        if comm is not None and quantize_gathered and travelling == "w":
            w = fake_quantize(w, comm, 0)
        if op is AGM:
            y = _definition.all_gather_matmul(x, w, "x", **kw)
        else:
            y = _definition.matmul_reduce_scatter(x, w, "x", **kw)
        return y[None] if stack else y

    return f


def _op(name, comm, backend, options, grad_comm=None):
    op, kw, *_, stack = _problems(1)[name]

    def f(x, w):
        y = op(x, w, "x", backend=backend, comm_dtype=comm, grad_comm_dtype=grad_comm,
               **kw, **options)
        return y[None] if stack else y

    return f


def _inputs(name, n, dtype, **sizes):
    _, _, xs, ws, *_ = _problems(n, **sizes)[name]
    return normal(0, xs, dtype), normal(1, ws, dtype)


def _values_and_grads(fns, name, n, x, w):
    """(y, dx, dw) of each per-device fn of problem `name`, one cotangent, one jit."""
    _, _, _, _, x_spec, w_spec, *_ = _problems(n)[name]
    m = mesh((n,), ("x",))
    smaps = [jax.shard_map(f, mesh=m, in_specs=(x_spec, w_spec), out_specs=_out_spec(name))
             for f in fns]
    ct = normal(2, jax.eval_shape(smaps[0], x, w).shape, jnp.float32)

    @jax.jit
    def everything(x, w):
        out = []
        for g in smaps:
            y, vjp = jax.vjp(g, x, w)
            out.append((y,) + vjp(ct.astype(y.dtype)))
        return out

    return everything(x, w)


# -- all-gathers: equal to the oracle, values and gradients --------------------------------


def _check_gathers(n, comm, configs, names=("ag_rows", "ag_cols", "ag_contract")):
    for name in names:
        travelling = _problems(n)[name][6]
        x, w = _inputs(name, n, jnp.float32)
        fns = [_oracle(name, comm), _oracle(name, None)]
        fns += [_op(name, comm, b, o) for b, o in configs]
        want, plain, *got = _values_and_grads(fns, name, n, x, w)
        for (backend, options), (y, dx, dw) in zip(configs, got):
            what = f"{name} {comm.__name__} n={n} {backend} {options}"
            assert_close(y, want[0], jnp.float32, what + " value")
            # The travelling operand's gradient is the dual reduce-scatter of the
            # cotangent, with or without quantization. The other one multiplies the
            # gathered operand: the forward's (dequantized) with keep_gathered, else
            # gathered again, unquantized (grad_comm_dtype=None).
            keep = options.get("keep_gathered", True)
            i_other = 2 if travelling == "x" else 1
            for i, g in ((1, dx), (2, dw)):
                ref = want if keep or i != i_other else plain
                assert_close(g, ref[i], jnp.float32, f"{what} grad {'xw'[i - 1]}")


@pytest.mark.parametrize("comm", [INT8, FP8], ids=["int8", "fp8"])
def test_gathers_equal_the_oracle(comm):
    _check_gathers(4, comm, CONFIGS)


def test_gathers_other_ring_sizes():
    _check_gathers(2, INT8, CONFIGS[:2])
    _check_gathers(8, FP8, [CONFIGS[2], CONFIGS[4]])


def test_gathered_residual_is_dequantized():
    # keep_gathered's residual is what the forward multiplied: the dequantized operand.
    n, name = 4, "ag_contract"
    x, w = _inputs(name, n, jnp.float32)
    m = mesh((n,), ("x",))
    from fusedpar._core import _autodiff, _primitives as prims

    def per_device(backend, bidirectional):
        def f(x, w):
            cfg = prims.Config(backend, "x", n, bidirectional, True, np.dtype("float32"),
                               np.dtype("float32"), comm_dtype=np.dtype(INT8))
            return _autodiff.run(prims.AG_CONTRACT, cfg, x, w, return_gathered=True)[1][None]
        return jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P("x")),
                                     out_specs=P("x")))

    want = jax.jit(jax.shard_map(
        lambda w: lax.all_gather(fake_quantize(w, INT8, 0), "x", tiled=True)[None],
        mesh=m, in_specs=P("x"), out_specs=P("x")))(w)
    for backend, bi in (("reference", False), ("ring", True), ("ring", False)):
        np.testing.assert_array_equal(per_device(backend, bi)(x, w), want)


# -- reduce-scatters: the exact sum within the derived bound --------------------------------

# Half the largest quantization step, relative to the row's largest magnitude (its scale
# times qmax): int8 rounds to integers of at most 127, so half of 1/127; e4m3 values in
# the top binade [256, 448] are 32 apart, so half of 32/448 (a smaller magnitude is in a
# finer binade: its error is smaller).
HALF_STEP = {INT8: 0.5 / 127, FP8: 16 / 448}


def _rs_bound(name, n, comm, x, w, per_hop):
    """Elementwise bound on |result - exact| for problem `name` (global arrays).

    Each device's partial product P_d = x[:, block d] @ w[block d]; M = max over devices
    of |P_d| over the row of one travelling segment (a segment's rows are the output's;
    its columns are the output block's, or all of them for rs_rows). Once-quantized
    partials (`reference`): N-1 of them travel, each off by at most h*M. Requantized at
    every hop (`ring`): the accumulator sent at hop j holds j partials plus the earlier
    errors, A_j <= j*M + E_{j-1}, and E_j = E_{j-1} + h*A_j.
    """
    k = x.shape[1] // n
    parts = np.stack([np.asarray(x[:, d * k:(d + 1) * k] @ w[d * k:(d + 1) * k])
                      for d in range(n)])
    rows, cols = parts.shape[1:]
    seg = cols // n if name == "rs_cols" else cols
    m = np.abs(parts).reshape(n, rows, cols // seg, seg).max(axis=(0, 3), keepdims=True)
    m = np.broadcast_to(m[0], (rows, cols // seg, seg)).reshape(rows, cols)
    h, e = HALF_STEP[comm], np.zeros_like(m)
    for j in range(1, n):
        e = e + h * ((j * m + e) if per_hop else m)
    return parts.sum(0), e


@pytest.mark.parametrize("n,comm", [(2, INT8), (4, INT8), (4, FP8), (8, FP8)],
                         ids=["2-int8", "4-int8", "4-fp8", "8-fp8"])
def test_reduce_scatters_within_the_derived_bound(n, comm):
    configs = CONFIGS if n == 4 else CONFIGS[:3]
    for name in ("rs_rows", "rs_cols"):
        x, w = _inputs(name, n, jnp.float32)
        fns = [_oracle(name, None)] + [_op(name, comm, b, o) for b, o in configs]
        (want, ox, ow), *got = _values_and_grads(fns, name, n, x, w)
        slack = tolerance(jnp.float32) * float(np.max(np.abs(want)))
        for (backend, options), (y, dx, dw) in zip(configs, got):
            exact, bound = _rs_bound(name, n, comm, x, w, per_hop=backend == "ring")
            err = np.abs(np.asarray(y) - exact)
            worst = float(np.max(err - bound))
            assert worst <= slack, (f"{name} {comm.__name__} n={n} {backend} {options}: "
                                    f"error exceeds the derived bound by {worst:.3g}")
            assert float(np.max(err)) > 0  # it did quantize
        # Straight-through: the gradients are the unquantized expression's (the backward
        # sends in grad_comm_dtype=None), checked against the oracle's.
        for (backend, options), (_, dx, dw) in zip(configs, got):
            assert_close((dx, dw), (ox, ow), jnp.float32, f"{name} {backend} grads")


def test_backward_gathers_in_grad_comm_dtype():
    # A reduce-scatter's backward gathers the cotangent: in grad_comm_dtype, equal to the
    # reference (the oracle of quantized gathers) with the same keep_gathered (which
    # decides the scales: per row of dy for ag_rows/ag_cols, per block column for
    # ag_contract). The forward sends its accumulator unquantized: exact.
    n = 4
    for name in ("rs_rows", "rs_cols"):
        x, w = _inputs(name, n, jnp.float32)
        configs = [(True, "reference", {}), (True, "ring", dict(bidirectional=True)),
                   (False, "reference", {}),
                   (False, "ring", dict(bidirectional=False, unroll=False))]
        configs = [(k, b, dict(o, keep_gathered=k)) for k, b, o in configs]
        fns = [_oracle(name, None)] + [_op(name, None, b, o, grad_comm=FP8)
                                       for _, b, o in configs]
        (want, dx, _), *got = _values_and_grads(fns, name, n, x, w)
        assert float(np.max(np.abs(np.asarray(got[0][1]) - dx))) > 0  # it did quantize
        for (keep, backend, options), g in zip(configs, got):
            ref = got[0] if keep else got[2]
            assert_close(g[0], want, jnp.float32, f"{name} {backend} {options} value")
            assert_close(g[1:], ref[1:], jnp.float32, f"{name} {backend} {options} grads")


# -- the accuracy targets ---------------------------------------------------------

TARGET = {INT8: 0.01, FP8: 0.03}


def _relative_error(got, want):
    got, want = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# (payload, backward payload, primitives): int8 everywhere; fp8 activations (gathers)
# with int8 gradients. fp8 reduce-scatters miss 3% from 4 devices on (docs/quantized.md:
# 3.2% at N=4, 4.9% at N=8 with the accumulator requantized at every hop).
ACCURACY = [(INT8, INT8, ("ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols")),
            (FP8, INT8, ("ag_rows", "ag_cols", "ag_contract"))]


@pytest.mark.parametrize("comm,grad_comm,names", ACCURACY, ids=["int8", "fp8"])
def test_accuracy_against_bfloat16(comm, grad_comm, names):
    # Standard-normal bf16 data on the ring (bidirectional, 4 devices) against the bf16
    # lax expression: values and gradients within 1% (int8) / 3% (fp8) relative error
    # (Frobenius norms).
    n, sizes = 4, dict(b=32, k=64, c=32)
    for name in names:
        x, w = _inputs(name, n, jnp.bfloat16, **sizes)
        fns = [_oracle(name, None), _op(name, comm, "ring", dict(bidirectional=True),
                                        grad_comm=grad_comm)]
        want, got = _values_and_grads(fns, name, n, x, w)
        for i, what in enumerate(("value", "dx", "dw")):
            err = _relative_error(got[i], want[i])
            assert err <= TARGET[comm], f"{name} {what}: relative error {err:.4f}"


# -- what travels ---------------------------------------------------------------------------


def _collective_operands(jaxpr, prims=("ppermute", "all_gather", "all_to_all")):
    """(primitive, dtype, shape) of every collective's operands, in nested jaxprs too."""
    return [(eqn.primitive.name, v.aval.dtype, v.aval.shape) for eqn in equations(jaxpr)
            if eqn.primitive.name in prims for v in eqn.invars]


@pytest.mark.parametrize("backend,options", [("reference", {}),
                                             ("ring", dict(bidirectional=True)),
                                             ("ring", dict(unroll=False))])
def test_narrow_bytes_travel(backend, options):
    n = 4
    for name in _problems(n):
        x, w = _inputs(name, n, jnp.bfloat16)
        _, _, _, _, x_spec, w_spec, *_ = _problems(n)[name]
        f = jax.shard_map(_op(name, FP8, backend, options), mesh=mesh((n,), ("x",)),
                          in_specs=(x_spec, w_spec), out_specs=_out_spec(name))
        sent = _collective_operands(jax.make_jaxpr(f)(x, w).jaxpr)
        assert sent, name
        for prim, dtype, shape in sent:
            # the values in fp8; the scales in f32, one per row or column: a dimension 1
            scales = dtype == jnp.float32 and 1 in shape[-2:]
            assert dtype == FP8 or scales, f"{name} {backend}: {prim} sends {dtype}{shape}"


# -- dispatch and bad input ---------------------------------------------------------------


def test_dispatch_never_picks_a_backend_that_cannot_send_quantized():
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 128), jnp.bfloat16)
    for platform in ("cpu", "tpu"):
        choice = fusedpar.explain("matmul_reduce_scatter", x, w, 4, platform=platform,
                                  comm_dtype=INT8)
        assert choice.backend in ("reference", "ring"), choice
    for backend in ("pallas_tpu", "pallas"):
        # The fused TPU all-gathers send quantized payloads; its reduce-scatters do not.
        assert fusedpar.explain("all_gather_matmul", x, w, 4, platform="cpu",
                                backend=backend, comm_dtype=INT8).backend == backend
        with pytest.raises(NotImplementedError, match="comm_dtype=int8: the fused TPU "
                           "reduce-scatter kernels.*backend='ring'"):
            fusedpar.explain("matmul_reduce_scatter", x, w, 4, platform="cpu",
                             backend=backend, comm_dtype=INT8)
    assert fusedpar.explain("all_gather_matmul", x, w, 4, platform="cpu",
                            backend="pallas_gpu", comm_dtype=FP8).backend == "pallas_gpu"


def test_integer_inputs_are_refused():
    x = jax.ShapeDtypeStruct((8, 16), jnp.int8)
    with pytest.raises(TypeError, match="comm_dtype=int8 quantizes .* x and w are int8"):
        fusedpar.explain("all_gather_matmul", x, jax.ShapeDtypeStruct((16, 8), jnp.int8), 4,
                         platform="cpu", comm_dtype=INT8)


# -- pallas_gpu: the same loops, its step kernels interpreted -------------------------------


def test_pallas_gpu_interpreted():
    n, configs = 4, [("pallas_gpu", dict(bidirectional=True, unroll=False,
                                         options={"kernels": "triton"}))]
    sizes = dict(b=32, k=32, c=16)  # every step's matmul at least 16 x 16 x 16
    for name in ("ag_rows", "ag_contract", "rs_cols"):
        x, w = _inputs(name, n, jnp.float32, **sizes)
        fns = [_oracle(name, INT8), _op(name, INT8, "ring", configs[0][1] | dict(
            options=None))] + [_op(name, INT8, b, o) for b, o in configs]
        want, ring, got = _values_and_grads(fns, name, n, x, w)
        # The ring's loop with other step kernels: equal to the lax ring, whose
        # reduce-scatter the bound test covers, and to the oracle for the all-gathers.
        assert_close(got, ring, jnp.float32, f"{name} pallas_gpu vs ring")
        if name.startswith("ag"):
            assert_close(got, want, jnp.float32, f"{name} pallas_gpu vs oracle")


def test_cost_model_counts_the_narrow_bytes():
    # The bytes one transfer carries, as the traced program sends them (docs/quantized.md:
    # per device x 1024x4096 @ w 4096x4096, 8 devices): values and a scale per row.
    from fusedpar import cost_model

    def ring(prim, x_shape, w_shape, comm):
        return cost_model.breakdown(prim, x_shape, w_shape, 8, "bfloat16", "h100_sxm",
                                    comm_dtype=comm)["ring"]

    big = (4096, 4096)
    assert ring("ag_rows", (1024, 4096), big, None).bytes_step == 8_388_608
    for comm in ("int8", "float8_e4m3fn"):
        assert ring("ag_rows", (1024, 4096), big, comm).bytes_step == 4_198_400
        assert ring("ag_cols", (1024, 4096), big, comm).bytes_step == 16_793_600
        assert ring("rs_rows", (1024, 4096), big, comm).bytes_step == 524_800
    assert (ring("ag_cols", (1024, 4096), big, "int8").seconds
            < ring("ag_cols", (1024, 4096), big, None).seconds)
