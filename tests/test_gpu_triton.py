"""The Triton GPU step kernels (`fusedpar.kernels.gpu.triton`), in Pallas interpret mode.

Two levels: each kernel against its lax reference (`fusedpar.kernels.gpu.*_reference`),
and every primitive through `backend="pallas_gpu"` with `kernels="triton"` inside
`jit(shard_map)` against the reference backend, values and gradients, for rings of 1, 2,
4, 8 devices, one or two directions, float32 and bfloat16. Shapes are small (interpret
mode is slow) and blocks of 16 keep several tiles per step, so tiling and offsets are
exercised. (The Mosaic GPU kernels: tests/test_gpu_mosaic.py.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar.kernels import gpu
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(120)

SMALL = {"block_m": 16, "block_n": 16, "block_k": 16}
TRITON = {"kernels": "triton", **SMALL}  # the backend's options: this family, small tiles
# Interpret mode on CPU; on a GPU (bench/test_gpu_steps.py's GPU command) the real kernels.
INTERPRET = jax.default_backend() == "cpu"
# float32 through the MXU/tensor cores would be TF32 on a GPU; ask for full precision so
# the same tolerances hold there as in interpret mode on CPU.
PRECISION = {jnp.float32: lax.Precision.HIGHEST, jnp.bfloat16: None}


# -- the kernels against their references ----------------------------------------------


@pytest.mark.parametrize("axis,num_pieces,dtype", [
    (0, 1, jnp.float32), (0, 2, jnp.bfloat16), (1, 1, jnp.bfloat16), (1, 2, jnp.float32)])
def test_matmul_into(axis, num_pieces, dtype):
    # A product of 48 x 32 in tiles of 16: 3 x 2 tiles in groups of 2 rows (one partial
    # group); a contraction of 48 (not a power of 2) looped over in blocks of 16.
    m, n, k, segments = 48, 32, 48, 4
    if axis == 0:
        pieces = [normal(i, (m, k), dtype) for i in range(num_pieces)]
        other, out = normal(9, (k, n), dtype), normal(8, (segments * m, n), dtype)
    else:
        pieces = [normal(i, (k, n), dtype) for i in range(num_pieces)]
        other, out = normal(9, (m, k), dtype), normal(8, (m, segments * n), dtype)
    segs = jnp.array([3, 0][:num_pieces], jnp.int32)
    prec = PRECISION[dtype]
    # Two pieces: also keep them (a training step's gather), into a buffer whose segments
    # to be written are poisoned.
    kept = None
    if num_pieces == 2:
        kept = np.array(normal(7, (segments * m, k) if axis == 0 else (k, segments * n), dtype))
        for s in segs.tolist():
            window = slice(s * (m if axis == 0 else n), (s + 1) * (m if axis == 0 else n))
            kept[(window, slice(None)) if axis == 0 else (slice(None), window)] = np.nan
        kept = jnp.asarray(kept)
    got = jax.jit(functools.partial(gpu.triton.matmul_into, axis=axis, precision=prec,
                                    config=dict(SMALL, group_m=2), interpret=INTERPRET))(
        out, pieces, other, segs, kept=kept)
    want = gpu.matmul_into_reference(out, pieces, other, segs, axis=axis, precision=prec,
                                     kept=kept)
    if kept is not None:
        (got, got_kept), (want, want_kept) = got, want
        np.testing.assert_array_equal(np.asarray(got_kept, np.float32),
                                      np.asarray(want_kept, np.float32))
    assert_close(got, want, dtype, "matmul_into")
    # The segments no piece was written to are left as they were (in place, not zeroed).
    length = m if axis == 0 else n
    for s in set(range(segments)) - set(segs.tolist()):
        sl = [slice(None), slice(None)]
        sl[axis] = slice(length * s, length * (s + 1))
        assert (got[tuple(sl)] == out[tuple(sl)]).all()


@pytest.mark.parametrize("tiles_m,tiles_n,group_m", [(5, 3, 2), (16, 4, 8), (3, 7, 8),
                                                     (9, 9, 4), (1, 5, 8), (12, 1, 8)])
def test_tile_order_visits_every_tile_once(tiles_m, tiles_n, group_m):
    from fusedpar.kernels.gpu._tile_order import tile_of

    for groups in (1, 2):
        t = tile_of(np.arange(groups * tiles_m * tiles_n, dtype=np.int32), tiles_m=tiles_m,
                    tiles_n=tiles_n, group_m=group_m, num_groups=groups)
        visited = zip(*(np.broadcast_to(np.asarray(v), (groups * tiles_m * tiles_n,)).tolist()
                        for v in (t.group, t.i, t.j)))
        assert sorted(visited) == [(g, a, b) for g in range(groups) for a in range(tiles_m)
                                   for b in range(tiles_n)]


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
        return gpu.triton.matmul_acc(acc, terms, (32, 32), jnp.float32, precision=prec,
                                     config=SMALL, interpret=INTERPRET)

    got = jax.jit(f)(acc, terms)
    want = gpu.matmul_acc_reference(acc, terms, (32, 32), jnp.float32, precision=prec)
    assert_close(got, want, dtype, "matmul_acc")


def test_tiles_heuristic_and_overrides():
    t = gpu.triton.choose_tiles(4096, 4096, 8192, jnp.bfloat16)
    assert (t.block_m, t.block_n, t.block_k, t.num_warps) == (128, 256, 64, 8)
    t = gpu.triton.choose_tiles(4096, 4096, 8192, jnp.float32)
    assert (t.block_m, t.block_n, t.block_k) == (128, 128, 32)
    t = gpu.triton.choose_tiles(512, 512, 512, jnp.bfloat16)  # 16 tiles of 128x128: shrink
    assert t.block_m * t.block_n < 128 * 256
    t = gpu.triton.choose_tiles(96, 48, 80, jnp.float32)  # largest power-of-2 divisors
    assert (t.block_m, t.block_n, t.block_k) == (32, 16, 16)
    t = gpu.triton.choose_tiles(4096, 4096, 4096, jnp.bfloat16,
                         (("block_n", 64), ("num_stages", 4), ("num_warps", 2)))
    assert (t.block_n, t.num_stages, t.num_warps) == (64, 4, 2)
    with pytest.raises(ValueError, match=r"options\['block_k'\]=48 must be a power of 2"):
        gpu.triton.choose_tiles(64, 64, 96, jnp.float32, (("block_k", 48),))
    with pytest.raises(ValueError, match=r"options\['block_m'\]=64 does not divide m=32"):
        gpu.triton.choose_tiles(32, 64, 64, jnp.float32, (("block_m", 64),))
    with pytest.raises(ValueError, match="n=40 is not a multiple of 16"):
        gpu.triton.choose_tiles(32, 40, 64, jnp.float32)


def test_unavailable_says_why():
    # On CPU (where these tests run) pallas_gpu's kernels are the Triton ones.
    x = jax.ShapeDtypeStruct((40, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    with pytest.raises(NotImplementedError, match="m=40 is not a multiple of 16"):
        fusedpar.explain("all_gather_matmul", x, w, 4, backend="pallas_gpu",
                         bidirectional=False, platform="cpu")
    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="not on 'tpu'"):
        fusedpar.explain("all_gather_matmul", x, w, 4, backend="pallas_gpu", platform="tpu")
    choice = fusedpar.explain("all_gather_matmul", x, w, 4, backend="pallas_gpu",
                              platform="cpu")
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


def _apply(n, backend, bidirectional, dtypes):
    """The five ops for each dtype, all in one shard_map (one compilation)."""

    def ops(dtype, x0, w0, x1, w1, x2, w2, x3, x4, w4):
        kw = dict(backend=backend, precision=PRECISION[dtype])
        if backend != "reference":
            # Unrolled rings for 1 and 2 devices, rolled (fori_loop) for 4 and 8.
            kw.update(bidirectional=bidirectional, unroll=n <= 2, options=TRITON)
        agm, mrs = fusedpar.all_gather_matmul, fusedpar.matmul_reduce_scatter
        return (agm(x0, w0, "x", **kw), agm(x1, w1, "x", gather="rhs", dim=1, **kw),
                agm(x2, w2, "x", gather="rhs", dim=0, **kw), mrs(x3, w0, "x", dim=0, **kw),
                mrs(x4, w4, "x", dim=1, **kw))

    def body(*per_dtype):
        return tuple(ops(dtype, *args) for dtype, args in zip(dtypes, per_dtype))

    _, in_specs = _five_ops(n, 1, jnp.float32)
    return jax.shard_map(body, mesh=mesh((n,), ("x",)), in_specs=(in_specs,) * len(dtypes),
                         out_specs=((P("x"),) * 5,) * len(dtypes))


def _value_and_vjp(f, args):
    @jax.jit
    def run(args):
        out, vjp = jax.vjp(f, *args)
        cts = jax.tree.map(lambda o: normal(o.shape[0] + o.shape[1], o.shape, o.dtype), out)
        return out, vjp(cts)

    return run(args)


# Each case compiles 10 interpreted rings per dtype (5 primitives, forward and backward):
# 5-20 s per dtype on 2 busy CPU cores (bfloat16 is the slower: CPU dots upcast it).
# Unmarked: 1 device, and a rolled (fori_loop) bidirectional ring of 8 in float32; the rest
# of the grid is marked slow.
# Every ring size, both directions and both dtypes appear; not their full product.
BOTH = (jnp.float32, jnp.bfloat16)
RINGS = [(1, False, BOTH), (8, True, (jnp.float32,))]
SLOW_RINGS = [(2, True, (jnp.bfloat16,)), (4, False, (jnp.bfloat16,)),
              (8, False, (jnp.float32,))]


def _ring_id(case):
    n, bidirectional, dtypes = case
    kind = "bidi" if bidirectional else "uni"
    return f"{n}-{kind}-" + "-".join(jnp.dtype(d).name for d in dtypes)


@pytest.mark.parametrize("case", [pytest.param(c, id=_ring_id(c)) for c in RINGS] + [
    pytest.param(c, id=_ring_id(c), marks=pytest.mark.slow) for c in SLOW_RINGS])
def test_five_primitives_match_reference(case):
    n, bidirectional, dtypes = case
    if len(jax.devices()) < n:
        pytest.skip(f"a ring of {n} needs {n} devices")
    d = 2 if bidirectional else 1
    args = tuple(_five_ops(n, d, dtype)[0] for dtype in dtypes)
    got = _value_and_vjp(_apply(n, "pallas_gpu", bidirectional, dtypes), args)
    want = _value_and_vjp(_apply(n, "reference", bidirectional, dtypes), args)
    names = ("ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols")
    for dtype, g_out, w_out, g_grad, w_grad in zip(dtypes, got[0], want[0], got[1], want[1]):
        for name, g, w in zip(names, g_out, w_out):
            assert_close(g, w, dtype, f"{name} value ({jnp.dtype(dtype).name})")
        for i, (g, w) in enumerate(zip(g_grad, w_grad)):
            assert_close(g, w, dtype, f"gradient of argument {i} ({jnp.dtype(dtype).name})")


def test_ring_over_one_axis_of_a_2d_mesh():
    # x varies over both axes, the ring runs over "x" only: results and carries must be
    # typed as varying over "dp" too (check_vma).
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    kw = dict(unroll=False, bidirectional=True, options=TRITON,
              precision=lax.Precision.HIGHEST)

    def body(backend):
        kws = kw if backend == "pallas_gpu" else dict(precision=kw["precision"])

        def f(x, w, w2):
            agm, mrs = fusedpar.all_gather_matmul, fusedpar.matmul_reduce_scatter
            return (agm(x, w, "x", backend=backend, **kws),
                    agm(x, w2, "x", gather="rhs", dim=1, backend=backend, **kws),
                    mrs(x, w, "x", dim=0, backend=backend, **kws))

        return jax.shard_map(f, mesh=mesh((2, 4), ("dp", "x")),
                             in_specs=(P(("dp", "x")), P(), P(None, "x")),
                             out_specs=(P(("dp", "x")),) * 3)

    args = (normal(0, (8 * 128, 32), jnp.float32), normal(1, (32, 32), jnp.float32),
            normal(2, (32, 4 * 32), jnp.float32))
    got = _value_and_vjp(body("pallas_gpu"), args)
    want = _value_and_vjp(body("reference"), args)
    assert_close(got, want, jnp.float32, "2-D mesh values and gradients")
