"""The GPU ring-step kernels (`fusedpar.kernels.gpu`), run in Pallas interpret mode on CPU.

Two levels: each kernel against its lax reference (`*_reference`, beside it), and every
primitive through `backend="pallas_gpu"` inside `jit(shard_map)` against the reference
backend, values and gradients, for rings of 1, 2, 4, 8 devices, one or two directions,
float32 and bfloat16. Shapes are small (interpret mode is slow) and blocks of 16 keep
several tiles per step, so tiling and offsets are exercised.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar.kernels import gpu
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(120)

SMALL = {"block_m": 16, "block_n": 16, "block_k": 16}
# Interpret mode on CPU; on a GPU (bench/test_gpu_steps.py's GPU command) the real kernels.
INTERPRET = jax.default_backend() == "cpu"
# float32 through the MXU/tensor cores would be TF32 on a GPU; ask for full precision so
# the same tolerances hold there as in interpret mode on CPU.
PRECISION = {jnp.float32: lax.Precision.HIGHEST, jnp.bfloat16: None}


# -- the kernels against their references ----------------------------------------------


@pytest.mark.parametrize("axis,num_pieces,dtype", [
    (0, 1, jnp.float32), (0, 2, jnp.bfloat16), (1, 1, jnp.bfloat16), (1, 2, jnp.float32)])
def test_matmul_into(axis, num_pieces, dtype):
    k = 48  # not a power of 2: the contraction is looped over in blocks of 16
    if axis == 0:
        pieces = [normal(i, (32, k), dtype) for i in range(num_pieces)]
        other, out = normal(9, (k, 32), dtype), normal(8, (32 * 4, 32), dtype)
    else:
        pieces = [normal(i, (k, 32), dtype) for i in range(num_pieces)]
        other, out = normal(9, (32, k), dtype), normal(8, (32, 32 * 4), dtype)
    segs = jnp.array([3, 0][:num_pieces], jnp.int32)
    prec = PRECISION[dtype]
    got = jax.jit(functools.partial(gpu.matmul_into, axis=axis, precision=prec, options=SMALL,
                                    interpret=INTERPRET))(out, pieces, other, segs)
    want = gpu.matmul_into_reference(out, pieces, other, segs, axis=axis, precision=prec)
    assert_close(got, want, dtype, "matmul_into")
    # The slices no piece was written to are left as they were (in place, not zeroed).
    keep = [1, 2] if num_pieces == 2 else [0, 1, 2]
    for s in keep:
        sl = (slice(32 * s, 32 * (s + 1)), slice(None))[::1 if axis == 0 else -1]
        assert (got[sl] == out[sl]).all()


@pytest.mark.parametrize("with_acc,dtype", [(False, jnp.bfloat16), (True, jnp.float32)])
def test_matmul_acc(with_acc, dtype):
    # Two terms with offsets in every position the ring uses: rows of a (rs_rows),
    # columns of a (ag_contract), columns of b (rs_cols), rows of b.
    a0, b0 = normal(0, (64, 64), dtype), normal(1, (64, 32), dtype)
    a1, b1 = normal(2, (32, 96), dtype), normal(3, (64, 64), dtype)
    terms = [gpu.Term(a0, b0, 32, a_row=jnp.int32(32), a_col=jnp.int32(16), b_row=16),
             gpu.Term(a1, b1, 32, a_col=jnp.int32(64), b_row=32, b_col=jnp.int32(32))]
    acc = normal(4, (32, 32), jnp.float32) if with_acc else None
    prec = PRECISION[dtype]

    def f(acc, terms):
        return gpu.matmul_acc(acc, terms, (32, 32), jnp.float32, precision=prec,
                              options=SMALL, interpret=INTERPRET)

    got = jax.jit(f)(acc, terms)
    want = gpu.matmul_acc_reference(acc, terms, (32, 32), jnp.float32, precision=prec)
    assert_close(got, want, dtype, "matmul_acc")


def test_tiles_heuristic_and_overrides():
    t = gpu.choose_tiles(4096, 4096, 8192, jnp.bfloat16)
    assert (t.block_m, t.block_n, t.block_k, t.num_warps) == (128, 256, 64, 8)
    t = gpu.choose_tiles(4096, 4096, 8192, jnp.float32)
    assert (t.block_m, t.block_n, t.block_k) == (128, 128, 32)
    t = gpu.choose_tiles(512, 512, 512, jnp.bfloat16)  # 16 tiles of 128x128: shrink
    assert t.block_m * t.block_n < 128 * 256
    t = gpu.choose_tiles(96, 48, 80, jnp.float32)  # largest power-of-2 divisors
    assert (t.block_m, t.block_n, t.block_k) == (32, 16, 16)
    t = gpu.choose_tiles(4096, 4096, 4096, jnp.bfloat16,
                         (("block_n", 64), ("num_stages", 4), ("num_warps", 2)))
    assert (t.block_n, t.num_stages, t.num_warps) == (64, 4, 2)
    with pytest.raises(ValueError, match=r"options\['block_k'\]=48 must be a power of 2"):
        gpu.choose_tiles(64, 64, 96, jnp.float32, (("block_k", 48),))
    with pytest.raises(ValueError, match=r"options\['block_m'\]=64 does not divide m=32"):
        gpu.choose_tiles(32, 64, 64, jnp.float32, (("block_m", 64),))
    with pytest.raises(ValueError, match="n=40 is not a multiple of 16"):
        gpu.choose_tiles(32, 40, 64, jnp.float32)


def test_unavailable_says_why():
    x = jax.ShapeDtypeStruct((40, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    with pytest.raises(NotImplementedError, match="m=40 is not a multiple of 16"):
        fusedpar.explain("all_gather_matmul", x, w, 4, backend="pallas_gpu",
                         bidirectional=False)
    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="not on 'tpu'"):
        fusedpar.explain("all_gather_matmul", x, w, 4, backend="pallas_gpu", platform="tpu")
    choice = fusedpar.explain("all_gather_matmul", x, w, 4, backend="pallas_gpu")
    assert choice.backend == "pallas_gpu" and choice.bidirectional


# -- every primitive through the backend, values and gradients -------------------------


def _five_ops(n, d, dtype):
    """Inputs and shard_map specs for the five primitives over a ring of `n`, `d` ways.

    Local shapes: every ring step multiplies blocks of 16 x 16 x 16 or more.
    """
    b = 16 * d  # one ring block: both halves of a bidirectional ring get 16 rows/cols
    args = (
        normal(0, (n * b, 32), dtype),  # ag_rows: x (b, 32) travels
        normal(1, (32, 32), dtype),  # ... w replicated
        normal(2, (n * 16, 32), dtype),  # ag_cols: x (16, 32)
        normal(3, (32, n * b), dtype),  # ... w (32, b) column blocks travel
        normal(4, (n * 16, n * b), dtype),  # ag_contract: x (16, n*b)
        normal(5, (n * b, 32), dtype),  # ... w (b, 32) row blocks travel
        normal(6, (n * n * b, 32), dtype),  # rs_rows: x (n*b, 32) -> (b, 32)
        normal(7, (n * 16, 32), dtype),  # rs_cols: x (16, 32), w (32, n*b) -> (16, b)
        normal(8, (32, n * b), dtype),
    )
    in_specs = (P("x"), P(), P("x"), P(None, "x"), P("x"), P("x"), P("x"), P("x"), P())
    return args, in_specs


def _apply(n, backend, bidirectional):
    """Both dtypes' five ops in one shard_map (one compilation per ring shape)."""

    def ops(dtype, x0, w0, x1, w1, x2, w2, x3, x4, w4):
        kw = dict(backend=backend, precision=PRECISION[dtype])
        if backend != "reference":
            # Unrolled rings for 1 and 2 devices, rolled (fori_loop) for 4 and 8.
            kw.update(bidirectional=bidirectional, unroll=n <= 2, options=SMALL)
        agm, mrs = fusedpar.all_gather_matmul, fusedpar.matmul_reduce_scatter
        return (agm(x0, w0, "x", **kw), agm(x1, w1, "x", gather="rhs", dim=1, **kw),
                agm(x2, w2, "x", gather="rhs", dim=0, **kw), mrs(x3, w0, "x", dim=0, **kw),
                mrs(x4, w4, "x", dim=1, **kw))

    def body(f32_args, bf16_args):
        return ops(jnp.float32, *f32_args), ops(jnp.bfloat16, *bf16_args)

    _, in_specs = _five_ops(n, 1, jnp.float32)
    return jax.shard_map(body, mesh=mesh((n,), ("x",)), in_specs=(in_specs, in_specs),
                         out_specs=((P("x"),) * 5,) * 2)


def _value_and_vjp(f, args):
    @jax.jit
    def run(args):
        out, vjp = jax.vjp(f, *args)
        cts = jax.tree.map(lambda o: normal(o.shape[0] + o.shape[1], o.shape, o.dtype), out)
        return out, vjp(cts)

    return run(args)


# Each case compiles 20 interpreted rings (5 primitives x 2 dtypes, forward and backward):
# 10-30 s on 2 CPU cores. Unmarked: 1 device, an unrolled (2) and a rolled (8) bidirectional
# ring; the rest of the grid (every primitive, ring size, direction, dtype) is marked slow.
RINGS = [(1, False), (2, True), (8, True)]
SLOW_RINGS = [(1, True), (2, False), (4, False), (4, True), (8, False)]


@pytest.mark.parametrize("n,bidirectional", RINGS + [
    pytest.param(*r, marks=pytest.mark.slow) for r in SLOW_RINGS])
def test_five_primitives_match_reference(n, bidirectional):
    if len(jax.devices()) < n:
        pytest.skip(f"a ring of {n} needs {n} devices")
    d = 2 if bidirectional else 1
    args = (_five_ops(n, d, jnp.float32)[0], _five_ops(n, d, jnp.bfloat16)[0])
    got = _value_and_vjp(_apply(n, "pallas_gpu", bidirectional), args)
    want = _value_and_vjp(_apply(n, "reference", bidirectional), args)
    names = ("ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols")
    for dtype, g_out, w_out, g_grad, w_grad in zip(
            (jnp.float32, jnp.bfloat16), got[0], want[0], got[1], want[1]):
        for name, g, w in zip(names, g_out, w_out):
            assert_close(g, w, dtype, f"{name} value ({dtype.__name__})")
        for i, (g, w) in enumerate(zip(g_grad, w_grad)):
            assert_close(g, w, dtype, f"gradient of argument {i} ({dtype.__name__})")
