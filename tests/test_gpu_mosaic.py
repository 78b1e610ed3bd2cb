"""The Mosaic GPU step kernels (`fusedpar.kernels.gpu.mosaic`), checked without a GPU.

1. Mosaic GPU interpret mode (jax's GPU interpreter: warpgroups as threads, simulated
   shared memory, TMA copies, mbarriers with phase checking, wgmma as a float32 matmul,
   a race detector on ordinary loads and stores) runs the real kernels — warp
   specialisation and the barrier protocol included — at small shapes, with configs that
   make one CTA walk several tiles (the shared-memory ring wraps across tiles), against
   the lax references, with the outputs to be written poisoned with NaN. Two things the
   interpreter lacks are taught by `mosaic_interpret.py` (the TMA reduce-add store, and a
   transposed wgmma operand on jax 0.10).
2. The kernels through `backend="pallas_gpu"` with `kernels="mosaic"`: the op on a ring
   of 1 (values and gradients against the reference backend) and the backend's step
   functions over rings of 2, 3 and 4, interpreted.
3. CUDA lowering (Pallas -> Mosaic GPU dialect -> layout inference -> lowering ->
   verification, and Mosaic's shared-memory limit) at real sizes, in place.
4. The tile heuristic, its overrides and the refusals.

Not covered without a GPU: ptxas/LLVM, register allocation, real asynchrony (the
interpreter completes TMA copies and wgmma at once, so the placement of `wgmma_wait`,
`wait_smem_to_gmem` and `commit_smem` is not exercised), TF32 rounding (the interpreter
multiplies float32 exactly), whether the TMA reduce-add adds on hardware, and speed.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import fusedpar
import mosaic_interpret
from fusedpar.kernels import gpu
from fusedpar.kernels.gpu import Term, mosaic
from fusedpar.kernels.gpu.mosaic import GemmConfig, _config
from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    mosaic_interpret.install()


def _interpret():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(detect_races=True)


def _no_races():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    assert not gpu_callbacks.get_races().races_found


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), "unwritten (poisoned) elements left"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < (1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2), err


def _small(dtype, **changes):
    """64 x 64 warpgroup tiles and one CTA, so that it walks several output tiles."""
    base = dict(tile_m=64, tile_n=64, tile_k=128 // jnp.dtype(dtype).itemsize, stages=3,
                num_compute_wgs=2, wg_dim="m", epi_m=64, epi_n=64, epi_slots=1, num_sms=1)
    return GemmConfig(**{**base, **changes})


# -- 1. interpret mode ---------------------------------------------------------------------

# (dtype, axis, segments written, config changes)
INTO_CASES = [
    ("bfloat16", 0, [1, 3], dict(stages=4, num_sms=2)),  # both halves of a step, one launch
    ("float16", 1, [3, 0], dict(wg_dim="n", stages=2)),
    ("bfloat16", 1, [2], dict(tile_n=128, epi_slots=2, stages=2)),
    ("float32", 0, [0, 2], dict(wg_dim="n", stages=2)),  # TF32: B read K-major
]


@pytest.mark.parametrize("dtype,axis,segs,changes", INTO_CASES)
def test_matmul_into_interpret(dtype, axis, segs, changes):
    block, k, segments = 128, 128, 4
    pieces = [normal(10 + i, (block, k) if axis == 0 else (k, block), dtype)
              for i in range(len(segs))]
    other = normal(1, (k, 128) if axis == 0 else (128, k), dtype)
    out = np.array(normal(2, (segments * block, 128) if axis == 0 else
                          (128, segments * block), dtype))
    for s in segs:  # poison what must be written
        window = np.s_[s * block:(s + 1) * block]
        out[(window, slice(None)) if axis == 0 else (slice(None), window)] = np.nan
    out, segs = jnp.asarray(out), jnp.asarray(segs, jnp.int32)
    got = mosaic.matmul_into(out, pieces, other, segs, axis=axis, config=_small(dtype, **changes),
                             interpret=_interpret())
    _no_races()
    _close(got, gpu.matmul_into_reference(out, pieces, other, segs, axis=axis), dtype)
    # The segments no piece was written to are left bit for bit as they were.
    kept = np.ones(segments, bool)
    kept[np.asarray(segs)] = False
    shape = (segments, block, -1) if axis == 0 else (-1, segments, block)
    g, o = (np.asarray(a, np.float32).reshape(shape) for a in (got, out))
    np.testing.assert_array_equal(*((g[kept], o[kept]) if axis == 0 else
                                    (g[:, kept], o[:, kept])))


# (dtype, axis, config changes): every way the warpgroups split the kept block.
KEPT_CASES = [
    ("bfloat16", 0, dict(stages=4, num_sms=2)),  # A rows split between warpgroups
    ("float16", 0, dict(wg_dim="n", stages=2)),  # one warpgroup stores the A block
    ("bfloat16", 1, dict(wg_dim="n", stages=2)),  # B columns split
    ("float32", 0, dict(wg_dim="n", stages=2)),  # TF32: B read K-major, A kept as is
    ("bfloat16", 0, dict(tile_n=128, stages=2)),  # one tile per row: it stores every step
]


@pytest.mark.parametrize("dtype,axis,changes", KEPT_CASES)
def test_matmul_into_keeps_the_pieces(dtype, axis, changes):
    """`kept`: the launch also writes each piece at its segment of the gathered buffer
    (both pieces of a step), bit for bit, and leaves the other segments as they were."""
    block, k, segments, segs = 128, 128, 4, [3, 0]
    pieces = [normal(10 + i, (block, k) if axis == 0 else (k, block), dtype)
              for i in range(len(segs))]
    other = normal(1, (k, 128) if axis == 0 else (128, k), dtype)
    out = jnp.zeros((segments * block, 128) if axis == 0 else (128, segments * block), dtype)
    kept = np.array(normal(3, (segments * block, k) if axis == 0 else
                           (k, segments * block), dtype))
    for s in segs:  # poison what must be written
        window = np.s_[s * block:(s + 1) * block]
        kept[(window, slice(None)) if axis == 0 else (slice(None), window)] = np.nan
    kept, segs = jnp.asarray(kept), jnp.asarray(segs, jnp.int32)
    got_out, got_kept = mosaic.matmul_into(out, pieces, other, segs, axis=axis,
                                           config=_small(dtype, **changes),
                                           interpret=_interpret(), kept=kept)
    _no_races()
    want_out, want_kept = gpu.matmul_into_reference(out, pieces, other, segs, axis=axis,
                                                    kept=kept)
    _close(got_out, want_out, dtype)
    np.testing.assert_array_equal(np.asarray(got_kept, np.float32),
                                  np.asarray(want_kept, np.float32))


def test_matmul_into_kept_must_fit():
    x = jnp.zeros((128, 128), jnp.bfloat16)
    segs = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"kept is bfloat16\[256, 128\], the pieces gather "
                                         r"into bfloat16\[512, 128\]"):
        mosaic.matmul_into(jnp.zeros((512, 128), jnp.bfloat16), [x], x, segs, axis=0,
                           kept=jnp.zeros((256, 128), jnp.bfloat16))
    f = jnp.zeros((128, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match="K-major"):
        mosaic.matmul_into(jnp.zeros((128, 512), jnp.float32), [f], f, segs, axis=1,
                           kept=jnp.zeros((128, 512), jnp.float32))


def _terms(kind, dtype, m, n, k):
    """The terms of one ring primitive's step, with int32 offsets as the ring passes them."""
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    if kind == "rs_rows":  # the rows of block 2 of 4 of x, times w
        return [Term(normal(3, (4 * m, k), dtype), normal(4, (k, n), dtype), k,
                     a_row=i32(2 * m))]
    if kind == "rs_cols":  # x times the columns of block 1 of 3 of w
        return [Term(normal(3, (m, k), dtype), normal(4, (k, 3 * n), dtype), k,
                     b_col=i32(n))]
    # ag_contract, both halves of a bidirectional step: x's matching columns @ each piece
    x = normal(3, (m, 4 * k), dtype)
    return [Term(x, normal(4, (k, n), dtype), k, a_col=i32(3 * k)),
            Term(x, normal(5, (k, n), dtype), k, a_col=i32(0))]


# (kind, dtype, accumulator dtype, with an accumulator, config changes)
ACC_CASES = [
    ("rs_rows", "bfloat16", "float32", True, dict(stages=3)),
    ("rs_cols", "float16", "float32", True, dict(epi_slots=2, tile_n=128, stages=2)),
    ("ag_contract", "bfloat16", "float32", False, dict(stages=3, num_sms=2, wg_dim="n")),
    ("rs_rows", "float32", "float32", True, dict(stages=2)),
]


@pytest.mark.parametrize("kind,dtype,acc_dtype,with_acc,changes", ACC_CASES)
def test_matmul_acc_interpret(kind, dtype, acc_dtype, with_acc, changes):
    m = n = k = 128
    terms = _terms(kind, dtype, m, n, k)
    acc = normal(6, (m, n), acc_dtype) if with_acc else None
    got = mosaic.matmul_acc(acc, terms, (m, n), acc_dtype, config=_small(dtype, **changes),
                            interpret=_interpret())
    _no_races()
    assert got.dtype == jnp.dtype(acc_dtype) and got.shape == (m, n)
    _close(got, gpu.matmul_acc_reference(acc, terms, (m, n), acc_dtype), dtype)


def test_default_config_interpret():
    """The heuristic's own config (2 x 128x128 accumulators, a deep ring), one CTA."""
    m, n, k = 256, 128, 256
    terms = _terms("rs_rows", "bfloat16", m, n, k)
    acc = normal(6, (m, n), jnp.float32)
    cfg = mosaic.choose_config(m, n, (k,), "bfloat16", jnp.float32, {"num_sms": 1})
    assert (cfg.tile_m, cfg.tile_n, cfg.cta_m) == (128, 128, 256)
    got = mosaic.matmul_acc(acc, terms, (m, n), jnp.float32, config=cfg,
                            interpret=_interpret())
    _no_races()
    _close(got, gpu.matmul_acc_reference(acc, terms, (m, n), jnp.float32), "bfloat16")


# -- 2. through the backend ----------------------------------------------------------------
#
# jax's Mosaic GPU interpreter treats a kernel called inside a multi-device shard_map as
# one collective launch over every device (and fails on these per-device kernels), so a
# ring of N devices cannot be interpreted end to end. Instead: the op on a ring of ONE
# device (the real shard_map path, values and gradients), and the backend's own step
# functions driven through every step of rings of 2, 3 and 4 on the host, fed what each
# device holds at each step (`fusedpar.Ring`), against the lax expression.

_MOSAIC = {"kernels": "mosaic"}


def test_op_on_a_ring_of_one():
    m = mesh((1,), ("x",))
    x, w = normal(0, (128, 64), jnp.bfloat16), normal(1, (64, 128), jnp.bfloat16)

    def body(backend):
        kw = dict(backend=backend, options=_MOSAIC) if backend == "pallas_gpu" else {}

        def f(x, w):
            return (fusedpar.all_gather_matmul(x, w, "x", **kw),
                    fusedpar.matmul_reduce_scatter(x, w, "x", dim=1, **kw))

        def loss(x, w):
            a, b = jax.shard_map(f, mesh=m, in_specs=(P("x"), P()), out_specs=(P("x"),) * 2,
                                 check_vma=False)(x, w)
            return jnp.sum(a.astype(jnp.float32) ** 2) + jnp.sum(b.astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

    assert_close(body("pallas_gpu"), body("reference"), jnp.bfloat16, "ring of 1")


def _backend_config(prim, n, bidirectional):
    from fusedpar._core._primitives import Config

    return Config(backend="pallas_gpu", axis_name="x", axis_size=n,
                  bidirectional=bidirectional, unroll=True, out_dtype=np.dtype(jnp.bfloat16),
                  reduce_dtype=np.dtype(jnp.float32), options=tuple(_MOSAIC.items()))


# ag_rows: the ring of one. One ring size each: the kernels see a ring only through the
# segment offsets they are given (the interpreter is slow).
@pytest.mark.parametrize("prim,n", [("ag_cols", 2), ("ag_contract", 4)])
def test_gather_steps_of_a_ring(prim, n):
    """Device 0's steps of a bidirectional ring: the pieces it holds at each step (both
    directions' in one launch), into one output."""
    from fusedpar._core._backends import _ring_loop, pallas_gpu

    dt, bidirectional = jnp.bfloat16, True
    ring = fusedpar.Ring(n, bidirectional)
    cfg = _backend_config(prim, n, bidirectional)
    # Gathered operands: the travelling one whole, the resident one local.
    if prim == "ag_cols":
        x, w = normal(0, (128, 64), dt), normal(1, (64, n * 128), dt)
        travelling, local_x, axis, want = w, x, 1, x @ w
    else:  # ag_contract: w's row blocks travel; x holds every matching column
        x, w = normal(0, (128, n * 128), dt), normal(1, (n * 128, 128), dt)
        travelling, local_x, axis, want = w, x, 0, x @ w
    local_w = w if prim != "ag_cols" else w[:, :128]
    length = travelling.shape[axis] // ring.num_segments

    @jax.jit
    def steps(travelling, local_x, local_w):
        step = pallas_gpu.gather_step(prim, cfg, local_x, local_w)
        out = _ring_loop.gather_out(prim, cfg, local_x, local_w)
        for s in range(n):
            segs = [ring.gather_segment(0, s, r) for r in ring.directions]
            pieces = tuple(lax.slice_in_dim(travelling, g * length, (g + 1) * length,
                                            axis=axis) for g in segs)
            out = step(out, pieces, tuple(jnp.int32(g) for g in segs))
        return out

    out = steps(travelling, local_x, local_w)
    assert_close(out.astype(jnp.float32), want.astype(jnp.float32), dt, prim)


def test_gather_steps_keep_the_gathered_operand():
    """ag_rows with its gathered x kept (a training step's forward): device 0's steps of
    a bidirectional ring of 3 through the backend's keeping step write the products and
    the pieces, each at its segment, in the same launches."""
    from fusedpar._core._backends import _ring_loop, pallas_gpu

    dt, n = jnp.bfloat16, 3
    ring = fusedpar.Ring(n, True)
    cfg = _backend_config("ag_rows", n, True)
    x, w = normal(0, (n * 128, 64), dt), normal(1, (64, 128), dt)
    length = x.shape[0] // ring.num_segments

    @jax.jit
    def steps(x, w):
        local_x = x[:n * 128 // n]
        step = pallas_gpu.gather_keeping_step("ag_rows", cfg, local_x, w)
        out = _ring_loop.gather_out("ag_rows", cfg, local_x, w)
        gathered = jnp.full(x.shape, jnp.nan, dt)  # poisoned: every row must be written
        for s in range(n):
            segs = [ring.gather_segment(0, s, r) for r in ring.directions]
            pieces = tuple(lax.slice_in_dim(x, g * length, (g + 1) * length) for g in segs)
            out, gathered = step(out, gathered, pieces, tuple(jnp.int32(g) for g in segs))
        return out, gathered

    out, gathered = steps(x, w)
    assert_close(out.astype(jnp.float32), (x @ w).astype(jnp.float32), dt, "ag_rows")
    np.testing.assert_array_equal(np.asarray(gathered, np.float32), np.asarray(x, np.float32))
    # No such step where the kernel cannot keep: the ring loop copies the pieces in itself.
    assert pallas_gpu.gather_keeping_step("ag_contract", cfg, x, w) is None  # a sum
    f = jnp.zeros((64, 128), jnp.float32)
    assert pallas_gpu.gather_keeping_step("ag_cols", cfg, f, f) is None  # TF32 reads B K-major
    assert pallas_gpu.gather_keeping_step("ag_cols", cfg, x, normal(2, (64, 128), dt))


def test_scatter_steps_of_a_ring_of_three():
    """rs_rows, every device's steps, the accumulators passed between them by hand: each
    device ends with its block of the sum of the partial products (the reduce-add)."""
    from fusedpar._core._backends import pallas_gpu

    n, dt, prim = 3, jnp.bfloat16, "rs_rows"
    ring = fusedpar.Ring(n)
    cfg = _backend_config(prim, n, False)
    xs = [normal(d, (n * 128, 64), dt) for d in range(n)]
    ws = [normal(10 + d, (64, 128), dt) for d in range(n)]

    @jax.jit
    def steps(xs, ws):
        accumulate = [pallas_gpu.scatter_step(prim, cfg, x, w) for x, w in zip(xs, ws)]
        accs = [None] * n
        for s in range(n):
            if s:  # each accumulator moves one device along the ring
                accs = [accs[ring.recv_from(d, 1)] for d in range(n)]
            accs = [accumulate[d](accs[d], jnp.int32(ring.scatter_segment(d, s, 1)), 128)
                    for d in range(n)]
        return accs

    accs = steps(xs, ws)
    total = sum(x.astype(jnp.float32) @ w.astype(jnp.float32) for x, w in zip(xs, ws))
    for d in range(n):
        assert_close(accs[d], total[d * 128:(d + 1) * 128], dt, f"device {d}")


# -- 3. CUDA lowering at real sizes --------------------------------------------------------

S = 4096
_S = jax.ShapeDtypeStruct


def _lower_cuda(f, *args, **kw):
    return jax.jit(f, **kw).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text):
    return [l for l in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in l]


# The last: B columns split between the warpgroups, whose column share of a swizzled B
# block is no contiguous TMA source (compiled on an H100: refused; one stores it whole).
@pytest.mark.parametrize("dtype,axis,num_pieces,keeps,config", [
    ("bfloat16", 0, 1, False, None), ("float16", 1, 2, False, None),
    ("float32", 0, 2, False, None), ("float32", 1, 1, False, None),
    ("bfloat16", 0, 2, True, None), ("bfloat16", 1, 2, True, None),
    ("bfloat16", 1, 1, True, {"wg_dim": "n"})])
def test_matmul_into_lowers_for_cuda(dtype, axis, num_pieces, keeps, config):
    piece = _S((S // 8, S) if axis == 0 else (S, S // 8), dtype)

    def f(out, kept, other, segs, *pieces):
        return mosaic.matmul_into(out, pieces, other, segs, axis=axis, config=config,
                                  kept=kept if keeps else None)

    text = _lower_cuda(f, _S((S, S), dtype), _S((S, S), dtype), _S((S, S), dtype),
                       _S((num_pieces,), jnp.int32), *[piece] * num_pieces,
                       donate_argnums=(0, 1) if keeps else 0)
    (call,) = _custom_calls(text)  # both halves of a bidirectional step: one launch
    assert call.count("operand_index =") == (2 if keeps else 1)  # in place
    assert "tf.aliasing_output = 0" in text  # the donated `out` is the result
    assert ("tf.aliasing_output = 1" in text) == keeps  # and `kept`


@pytest.mark.parametrize("kind,dtype,with_acc", [
    ("rs_rows", "bfloat16", True), ("rs_cols", "float16", True),
    ("ag_contract", "bfloat16", False), ("rs_rows", "float32", True)])
def test_matmul_acc_lowers_for_cuda(kind, dtype, with_acc):
    m, n, k = {"rs_rows": (S // 8, S, S), "rs_cols": (S, S // 8, S)}.get(kind, (S, S, S // 8))

    def f(acc, seg):
        terms = _terms(kind, dtype, m, n, k)
        if kind == "rs_rows":
            terms = [dataclasses.replace(terms[0], a_row=seg * m)]
        elif kind == "rs_cols":
            terms = [dataclasses.replace(terms[0], b_col=seg * n)]
        else:
            terms = [dataclasses.replace(terms[0], a_col=seg * k),
                     dataclasses.replace(terms[1], a_col=(seg + 1) % 4 * k)]
        return mosaic.matmul_acc(acc if with_acc else None, terms, (m, n), jnp.float32)

    (call,) = _custom_calls(_lower_cuda(f, _S((m, n), jnp.float32), _S((), jnp.int32)))
    assert ("output_operand_alias" in call) == with_acc


@pytest.mark.parametrize("bidirectional", [False, True])
def test_ops_lower_for_cuda_with_mosaic_steps(bidirectional):
    """The ring with Mosaic steps inside shard_map over 4 devices, forward and backward:
    one launch per all-gather step (both directions in one), per direction for a
    reduce-scatter (its two accumulators travel separately)."""
    kw = dict(backend="pallas_gpu", bidirectional=bidirectional,
              options={"kernels": "mosaic", "interpret": False})

    def f(x, w):
        return (fusedpar.all_gather_matmul(x, w, "x", **kw),
                fusedpar.matmul_reduce_scatter(x, w, "x", dim=0, **kw))

    g = jax.shard_map(f, mesh=mesh((4,), ("x",)), in_specs=(P("x"), P()),
                      out_specs=(P("x"), P("x")), check_vma=False)
    args = (_S((4 * 1024, 2048), jnp.bfloat16), _S((2048, 1024), jnp.bfloat16))
    fwd = _lower_cuda(g, *args)
    assert len(_custom_calls(fwd)) == 4 + 4 * (2 if bidirectional else 1)
    loss = lambda x, w: sum(o.astype(jnp.float32).sum() for o in g(x, w))  # noqa: E731
    assert len(_custom_calls(_lower_cuda(jax.grad(loss, (0, 1)), *args))) >= 8


def test_lowers_in_shard_map_with_check_vma():
    """A ring-like step in shard_map(check_vma=True): segments from axis_index, in place,
    results typed as varying over the ring axis."""
    n = 1024

    def body(x, w):
        i = lax.axis_index("x")
        out = lax.pcast(jnp.zeros((n, n), x.dtype), ("x",), to="varying")
        out = mosaic.matmul_into(out, [x], w, i[None], axis=0)
        acc = mosaic.matmul_acc(None, [Term(out, w, n, a_row=i * (n // 2))], (n // 2, n),
                                jnp.float32)
        return out, mosaic.matmul_acc(acc, [Term(x, w, n)], (n // 2, n), jnp.float32)

    f = jax.shard_map(body, mesh=mesh((2,), ("x",)), in_specs=(P("x"), P()),
                      out_specs=(P("x"), P("x")))
    assert len(_custom_calls(_lower_cuda(f, _S((2 * n, n), jnp.bfloat16),
                                         _S((n, n), jnp.bfloat16)))) == 3


# -- 4. tiles, overrides, refusals ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (512, 4096, 4096), (4096, 512, 4096),
                                   (1024, 8192, 8192), (256, 256, 64), (192, 320, 48)])
def test_choose_config(dtype, shape):
    m, n, k = shape
    cfg = mosaic.choose_config(m, n, (k,), dtype, "float32")
    cfg.check(m, n, (k,), dtype, "float32")
    assert cfg.smem_bytes(dtype, "float32") <= _config.SMEM_LIMIT and cfg.stages >= 3
    if m * n >= 4096 * 4096:
        assert cfg.tiles(m, n) >= _config.NUM_SMS  # every SM has a tile


def test_config_overrides_and_errors():
    cfg = mosaic.choose_config(4096, 4096, (4096,), "bfloat16", "bfloat16",
                               {"stages": 3, "group_m": 4})
    assert (cfg.stages, cfg.group_m) == (3, 4)
    with pytest.raises(ValueError, match="unknown"):
        mosaic.choose_config(4096, 4096, (4096,), "bfloat16", "bfloat16", {"block_m": 64})
    with pytest.raises(ValueError, match="m and n must be multiples of 64"):
        mosaic.choose_config(200, 320, (64,), "bfloat16", "float32")
    with pytest.raises(ValueError, match="multiple of 16"):
        mosaic.choose_config(4096, 4096, (4100,), "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="shared memory"):
        GemmConfig(stages=8).check(4096, 4096, (4096,), "bfloat16", "float32")
    with pytest.raises(ValueError, match="tile_n"):
        GemmConfig(tile_n=512).check(4096, 4096, (4096,), "bfloat16", "bfloat16")


def test_float32_at_highest_is_refused():
    x = jnp.ones((128, 128), jnp.float32)
    assert mosaic.unsupported_reason("float32") is None
    assert mosaic.unsupported_reason("bfloat16", lax.Precision.HIGHEST) is None
    assert "HIGHEST" in mosaic.unsupported_reason("float32", lax.Precision.HIGHEST)
    with pytest.raises(NotImplementedError, match="HIGHEST"):
        mosaic.matmul_into(x, [x], x, jnp.zeros((1,), jnp.int32), axis=0,
                           precision=lax.Precision.HIGHEST)
    with jax.default_matmul_precision("float32"):
        assert mosaic.unsupported_reason("float32") is not None


def test_the_backend_names_the_family_an_option_belongs_to():
    f = functools.partial(fusedpar.all_gather_matmul, axis_name="x", backend="pallas_gpu",
                          options={"kernels": "mosaic", "block_m": 64})
    g = jax.shard_map(lambda x, w: f(x, w), mesh=mesh((2,), ("x",)), in_specs=(P("x"), P()),
                      out_specs=P("x"), check_vma=False)
    with pytest.raises(ValueError, match=r"\['block_m'\] set the triton kernels' tiles"):
        jax.eval_shape(g, _S((256, 64), jnp.bfloat16), _S((64, 128), jnp.bfloat16))


def test_a_backward_step_no_tile_fits_is_refused_before_tracing_it():
    """wgmma needs 64-multiples for a step's rows and columns but only 16 for its
    contraction: ag_rows with k=32 runs forward, while its backward's rs_rows has k as
    its columns. The gradient says so up front instead of failing inside the kernel."""
    f = functools.partial(fusedpar.all_gather_matmul, axis_name="x", backend="pallas_gpu",
                          options={"kernels": "mosaic"})
    g = jax.shard_map(lambda x, w: f(x, w), mesh=mesh((2,), ("x",)), in_specs=(P("x"), P()),
                      out_specs=P("x"), check_vma=False)
    x, w = _S((128, 32), jnp.bfloat16), _S((32, 64), jnp.bfloat16)
    assert jax.eval_shape(g, x, w).shape == (256, 64)
    loss = lambda x, w: g(x, w).astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(NotImplementedError,
                       match=r"backward pass of ag_rows runs rs_rows on local x\(128, 64\) "
                             r"w\(64, 32\).*backend 'pallas_gpu' cannot run.*multiples of 64"):
        jax.eval_shape(jax.grad(loss, (0, 1)), x, w)
