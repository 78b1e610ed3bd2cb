"""The fused TPU all-gather kernels with a quantized payload (`comm_dtype`), interpreted.

The oracle is "quantize, then the lax expression on the dequantized operand": the
travelling operand is quantized on its owner (`_quantize.quantize` along `scale_axis`),
dequantized to the inputs' dtype, gathered with `lax.all_gather` and multiplied. The
kernel sends the 8-bit values and the float32 scales by two remote DMAs per transfer,
widens each piece in VMEM and scales the step's product, so it differs from the oracle
only by the rounding of the dequantized operand (none in float32, bfloat16's otherwise).
The gathered operand it returns (the backward pass's residual) is the dequantized one.

Every case runs with the interpreter's race detection on, NaN for uninitialized memory
(the default) and its report of semaphores left non-zero at exit captured and checked.
Ring sizes 2, 4 and 8, both ring shapes, the three gathers, int8 and float8_e4m3fn, in
VMEM and on the tiled HBM path (`emit_pipeline` with the scales as a pipeline operand).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpret_state
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _primitives as Prim, _quantize
from fusedpar._core._backends import pallas_tpu
from fusedpar._core._primitives import Call
from fusedpar._hw._target import of_platform

from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(240)

I8, F8 = np.dtype(jnp.int8), np.dtype(jnp.float8_e4m3fn)
R, K, C = 32, 64, 128


def _shapes(prim, n, r=R, k=K, c=C):
    return {"ag_rows": ((r, k), (k, c)), "ag_cols": ((r, k), (k, c)),
            "ag_contract": ((r, n * k), (k, c))}[prim]


def _oracle(prim, comm_dtype, x, w):
    """(product, gathered operand): quantize the travelling operand, dequantize it to the
    inputs' dtype, then the lax expression."""
    axis = Prim.of(prim).scale_axis
    if prim == Prim.AG_ROWS:
        g = lax.all_gather(_quantize.fake_quantize(x, comm_dtype, axis), "x", tiled=True)
        y = jnp.dot(g, w, preferred_element_type=jnp.float32)
    else:
        g = lax.all_gather(_quantize.fake_quantize(w, comm_dtype, axis), "x",
                           axis=1 if prim == Prim.AG_COLS else 0, tiled=True)
        y = jnp.dot(x, g, preferred_element_type=jnp.float32)
    return y.astype(x.dtype), g


def _run_checked(prim, n, bidirectional, comm_dtype, dtype, capfd, mode="on_wait",
                 shapes=(R, K, C), **options):
    params = pltpu.InterpretParams(dma_execution_mode=mode, detect_races=True)
    cfg = Prim.Config("pallas_tpu", "x", n, bidirectional, True, np.dtype(dtype),
                      np.dtype(jnp.float32), comm_dtype=comm_dtype,
                      options=tuple(sorted({"interpret_params": params, **options}.items())))
    m = mesh((n,), ("x",))

    def wrap(f):
        return jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P("x")),
                                     out_specs=(P("x"), P("x")), check_vma=False))

    xs, ws = _shapes(prim, n, *shapes)
    x = normal(0, (n * xs[0], xs[1]), dtype)
    w = normal(1, (n * ws[0], ws[1]), dtype)
    kernel = wrap(lambda x, w: pallas_tpu.run(prim, cfg, x, w, return_gathered=True))
    want = wrap(lambda x, w: _oracle(prim, comm_dtype, x, w))(x, w)
    capfd.readouterr()
    got = jax.block_until_ready(kernel(x, w))
    races = interpret_state.races.races_found
    text = "".join(capfd.readouterr())
    what = f"{prim} n={n} bidirectional={bidirectional} {comm_dtype} {np.dtype(dtype)} {mode}"
    assert not races and "RACE DETECTED" not in text, f"{what}: race\n{text[:2000]}"
    assert "non-zero count" not in text, f"{what}: semaphore left non-zero\n{text[:2000]}"
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype, what
    assert_close(got, want, dtype, what)  # also asserts no NaN (uninitialized reads)
    return got


# Each gather at each ring size it adds something at, both ring shapes, both 8-bit dtypes.
@pytest.mark.parametrize("prim,n,bidirectional,comm_dtype", [
    ("ag_rows", 2, True, I8), ("ag_cols", 2, True, F8), ("ag_contract", 2, False, I8),
    ("ag_rows", 4, False, F8), ("ag_cols", 4, False, I8), ("ag_contract", 4, True, F8),
    ("ag_contract", 8, True, I8), ("ag_cols", 8, False, F8),
], ids=str)
def test_quantized_gather_equals_oracle(prim, n, bidirectional, comm_dtype, capfd):
    _run_checked(prim, n, bidirectional, comm_dtype, jnp.float32, capfd)


def test_quantized_gather_bfloat16_eager(capfd):
    """bfloat16 operands (the 8-bit piece widens to bfloat16 before the MXU), DMAs run
    eagerly: a different interleaving of the two parts of each transfer."""
    _run_checked("ag_rows", 4, True, I8, jnp.bfloat16, capfd, mode="eager")


# The tiled HBM path: several row, contraction and column tiles per step (8-bit rows in
# tiles of 32), the scales a pipeline operand.
@pytest.mark.parametrize("prim,comm_dtype", [("ag_rows", I8), ("ag_cols", F8),
                                             ("ag_contract", I8)], ids=str)
def test_quantized_gather_tiled_path(prim, comm_dtype, capfd):
    _run_checked(prim, 2, False, comm_dtype, jnp.float32, capfd, shapes=(64, 256, 256),
                 vmem=False, block_m=32, block_k=128, block_n=128)


def test_quantized_gather_megacore(capfd):
    """Two TensorCores per device (v5p's megacore, interpreted as two cores): core 0 runs
    the ring (both parts of every transfer), both compute their tiles of each step."""
    options = dict(vmem=False, chip="v5p", block_m=8, block_k=128, block_n=128)
    module, params = pallas_tpu._params(
        "ag_rows", axis_name=None, axis_size=2, bidirectional=True, out_dtype="float32",
        reduce_dtype="float32", return_gathered=True, target=of_platform("cpu"),
        get=options.get)
    layout = module.plan(params, jax.ShapeDtypeStruct((64, 256), I8),
                         jax.ShapeDtypeStruct((256, 256), jnp.float32),
                         jax.ShapeDtypeStruct((64, 1), jnp.float32))[1]
    assert layout.cores == 2 and layout.tiles[0] == 8, layout
    _run_checked("ag_rows", 2, True, I8, jnp.float32, capfd, shapes=(64, 256, 256),
                 vmem=False, chip="v5p", block_m=8, block_k=128, block_n=128)


def test_public_op_sends_comm_dtype_through_the_kernel():
    """`all_gather_matmul(..., backend="pallas_tpu", comm_dtype=...)` runs the quantized
    kernel (the product matches the oracle, and differs from the unquantized one)."""
    n = 2
    m = mesh((n,), ("x",))
    x, w = normal(0, (n * R, K), jnp.float32), normal(1, (K, C), jnp.float32)

    def f(x, w):
        y = fusedpar.all_gather_matmul(x, w, "x", backend="pallas_tpu", comm_dtype=jnp.int8)
        return y, _oracle(Prim.AG_ROWS, I8, x, w)[0], jnp.dot(lax.all_gather(x, "x", tiled=True), w)

    got, want, exact = jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P()),
                                             out_specs=(P(), P(), P()), check_vma=False))(x, w)
    assert_close(got, want, jnp.float32, "ag_rows int8 through the public op")
    assert float(jnp.max(jnp.abs(got - exact))) > 1e-3  # quantization did happen


def _straight_through(a, dtype, axis):
    """`a` as the receiver sees it, identity gradient: the oracle's straight-through."""
    deq = _quantize.fake_quantize(a, dtype, axis)
    return lax.stop_gradient(deq) + (a - lax.stop_gradient(a))


def test_public_op_values_and_gradients():
    """The three gathers through the public op on the fused kernels (ring of 2,
    bidirectional), values and gradients against the straight-through oracle; the
    backward's collectives send the inputs' dtype (grad_comm_dtype None). The other
    gradient multiplies the kernel's gathered operand (`keep_gathered`), which it
    returns dequantized: the operand the forward multiplied. (Without `keep_gathered`
    the backward gathers the operand again, unquantized: docs/quantized.md.)"""
    n, agm, keep_gathered = 2, fusedpar.all_gather_matmul, True
    cases = [("ag_rows", dict(), (R, K), (K, C), P("x"), P()),
             ("ag_cols", dict(gather="rhs", dim=1), (R, K), (K, n * C), P("x"), P(None, "x")),
             ("ag_contract", dict(gather="rhs", dim=0), (R, n * K), (n * K, C), P("x"), P("x"))]
    m = mesh((n,), ("x",))
    params = pltpu.InterpretParams(detect_races=True)

    def kernel(kw, comm):
        return lambda x, w: agm(x, w, "x", backend="pallas_tpu", bidirectional=True,
                                comm_dtype=comm, keep_gathered=keep_gathered,
                                options={"interpret_params": params}, **kw)

    def oracle(kw, comm, prim):
        axis = Prim.of(prim).scale_axis

        def f(x, w):
            if prim == "ag_rows":
                x = _straight_through(x, comm, axis)
            else:
                w = _straight_through(w, comm, axis)
            return agm(x, w, "x", backend="reference", **kw)
        return f

    for (prim, kw, xs, ws, xspec, wspec), comm in zip(cases, (I8, F8, I8)):
        x, w = normal(0, (n * xs[0], xs[1]), jnp.float32), normal(1, ws, jnp.float32)
        outs = []
        for f in (kernel(kw, comm), oracle(kw, comm, prim)):
            g = jax.shard_map(f, mesh=m, in_specs=(xspec, wspec), out_specs=P("x"),
                              check_vma=False)
            ct = normal(2, jax.eval_shape(g, x, w).shape, jnp.float32)

            def vg(x, w, g=g, ct=ct):
                y, vjp = jax.vjp(g, x, w)
                return (y,) + vjp(ct)
            outs.append(jax.jit(vg)(x, w))
        assert not interpret_state.races.races_found
        assert_close(outs[0], outs[1], jnp.float32, f"{prim} {comm} keep={keep_gathered}")


def _call(**kw):
    base = dict(op="all_gather_matmul", prim="ag_rows", x_shape=(64, 512), w_shape=(512, 256),
                dtype="bfloat16", axis_size=4, target="tpu", bidirectional=True,
                comm_dtype=I8)
    return Call(**{**base, **kw})


def test_unavailable_with_comm_dtype():
    assert pallas_tpu.unavailable(_call()) is None
    assert pallas_tpu.unavailable(_call(prim="ag_cols", comm_dtype=F8)) is None
    # The reduce-scatter kernels do not requantize their accumulator: the ring does.
    why = pallas_tpu.unavailable(_call(op="matmul_reduce_scatter", prim="rs_rows",
                                       x_shape=(256, 512)))
    assert "backend='ring'" in why and "int8" in why
    # 8-bit rows have Mosaic's 8-row tiles (measured): halves of 8 rows are fine, of 4
    # refused for Mosaic, naming the 8-bit operand; the interpreter takes them.
    assert pallas_tpu.unavailable(_call(x_shape=(16, 512))) is None
    why = pallas_tpu.unavailable(_call(x_shape=(8, 512)))
    assert why is not None and "multiple of 8 rows of int8" in why
    assert pallas_tpu.unavailable(_call(x_shape=(8, 512), target="cpu")) is None


def test_reduce_scatter_kernel_refuses_comm_dtype():
    n = 2
    m = mesh((n,), ("x",))
    x, w = normal(0, (n * R, K), jnp.float32), normal(1, (K, C), jnp.float32)
    f = jax.shard_map(lambda x, w: fusedpar.matmul_reduce_scatter(
        x, w, "x", backend="pallas_tpu", comm_dtype=jnp.int8), mesh=m,
        in_specs=(P(), P()), out_specs=P("x"), check_vma=False)
    with pytest.raises(NotImplementedError, match="backend='ring'"):
        jax.jit(f)(x, w)


def test_a_weight_stored_quantized_travels_through_the_kernel_as_stored():
    """`fusedpar.quantize`'s stored int8 weight in an FSDP layer on the fused kernel:
    the payload (values, one scale per column) is sent as it is, not quantized again
    (an AttributeError before, whenever `auto` picked the kernel on a TPU); the same
    values and input gradient as the lax ring's."""
    import equinox as eqx

    m = mesh((4,), ("tp",))
    x = normal(1, (4, 16, 16), jnp.float32)
    got = {}
    for backend in ("ring", "pallas_tpu"):
        layer = fusedpar.quantize(fusedpar.FSDPLinear(16, 32, key=jax.random.key(0),
                                                      axis="tp", backend=backend),
                                  dtype=jnp.int8)
        with jax.set_mesh(m):
            placed = fusedpar.shard(layer, m)
            got[backend] = eqx.filter_jit(eqx.filter_value_and_grad(
                lambda x, l: jnp.sum(jnp.sin(l(x)))))(x, placed)
    assert_close(got["pallas_tpu"], got["ring"], jnp.float32, "stored int8 weight")
