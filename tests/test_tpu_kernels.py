"""The fused Pallas TPU kernels (TPU interpret mode on CPU): values and gradients.

Every primitive x ring size {1, 2, 4, 8} x direction x dtype {f32, bf16}, through the
public ops with backend="pallas_tpu" inside jax.jit(jax.shard_map(..., check_vma=False)),
against backend="reference" (the pure-lax definition differentiated by JAX). The five
primitives of one (ring, direction, dtype) run in one jitted function to pay the
interpret-mode compile once. Gradients go through the shared custom VJP, whose backward
runs the dual primitives on the same kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core._backends import pallas_tpu
from fusedpar._core._primitives import Call

from helpers import assert_close, equations, mesh, normal

pytestmark = pytest.mark.timeout(240)

# Per-device shapes (tiny: interpret mode simulates every DMA). R rows, K contraction,
# C output columns; blocks split in two for the bidirectional ring.
R, K, C = 16, 32, 32


def _cases(n):
    """(name, per-device x shape, per-device w shape, op) for the five primitives."""
    agm, mrs = fusedpar.all_gather_matmul, fusedpar.matmul_reduce_scatter
    return [
        ("ag_rows", (R, K), (K, C), lambda x, w, **kw: agm(x, w, "x", **kw)),
        ("ag_cols", (R, K), (K, C), lambda x, w, **kw: agm(x, w, "x", gather="rhs", dim=1, **kw)),
        ("ag_contract", (R, n * K), (K, C),
         lambda x, w, **kw: agm(x, w, "x", gather="rhs", dim=0, **kw)),
        ("rs_rows", (n * R, K), (K, C), lambda x, w, **kw: mrs(x, w, "x", dim=0, **kw)),
        ("rs_cols", (R, K), (K, n * C), lambda x, w, **kw: mrs(x, w, "x", dim=1, **kw)),
    ]


def _values_and_grads(n, backend, bidirectional, dtype, keep_gathered=True):
    """jit(shard_map) returning (outputs, (dx, dw)) of all five primitives."""
    cases = _cases(n)

    def local(*args):
        results = []
        for (_, _, _, op), x, w, ct in zip(cases, args[0::3], args[1::3], args[2::3]):
            kw = {} if backend == "reference" else dict(
                backend=backend, bidirectional=bidirectional, keep_gathered=keep_gathered)

            def loss(x, w):
                y = op(x, w, **kw)
                return jnp.sum(y.astype(jnp.float32) * ct), y

            (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
            results.append((y, grads))
        return results

    # Every operand is sharded (each device has its own w too), so no cotangent is
    # implicitly summed over devices and the comparison is per device.
    specs = (P("x"),) * (3 * len(cases))
    out = [(P("x"), (P("x"), P("x")))] * len(cases)
    return jax.jit(jax.shard_map(local, mesh=mesh((n,), ("x",)), in_specs=specs,
                                 out_specs=out, check_vma=False))


_POOL = []


def _sample(shape, dtype, start, n):
    """Normal values of `shape` from a fixed pool, placed sharded over the ring's mesh.

    One `normal` draw of a fixed size serves every test: drawing per shape (and
    resharding on device) compiled ~20 tiny XLA programs per test, a third of its time.
    """
    if not _POOL:
        _POOL.append(np.asarray(normal(0, (2**19,), jnp.float32)))
    size = int(np.prod(shape))
    a = _POOL[0][start:start + size].reshape(shape).astype(dtype)
    sharding = jax.sharding.NamedSharding(mesh((n,), ("x",)), P("x"))
    return jax.device_put(a, sharding), start + size


def _inputs(n, dtype):
    args, start = [], 0
    for name, xs, ws, _ in _cases(n):
        y_rows = {"ag_rows": n * xs[0], "rs_rows": xs[0] // n}.get(name, xs[0])
        y_cols = {"ag_cols": n * ws[1], "rs_cols": ws[1] // n}.get(name, ws[1])
        for shape, dt in (((n * xs[0], xs[1]), dtype), ((n * ws[0], ws[1]), dtype),
                          ((n * y_rows, y_cols), jnp.float32)):
            a, start = _sample(shape, dt, start, n)
            args.append(a)
    return args


# Every ring size in both directions, each dtype in both directions and at every other
# size: the dtype changes the tiles, not the protocol (an 8-device interpreted ring costs
# 12-20 s on 2 cores, so the full product would be half the suite's TPU time).
F32, BF16 = jnp.float32, jnp.bfloat16
KERNEL_CASES = [(1, False, F32), (1, True, BF16), (2, False, BF16), (2, True, F32),
                (4, False, F32), (4, True, BF16), (8, False, BF16), (8, True, F32)]


@pytest.mark.parametrize("n,bidirectional,dtype", KERNEL_CASES, ids=lambda v: (
    {False: "uni", True: "bi"}[v] if isinstance(v, bool) else
    str(v) if isinstance(v, int) else {F32: "f32", BF16: "bf16"}[v]))
def test_kernels_match_reference(n, bidirectional, dtype):
    args = _inputs(n, dtype)
    got = _values_and_grads(n, "pallas_tpu", bidirectional, dtype)(*args)
    want = _values_and_grads(n, "reference", bidirectional, dtype)(*args)
    for (name, *_), (y, (dx, dw)), (y0, (dx0, dw0)) in zip(_cases(n), got, want):
        assert y.dtype == dtype, name
        assert_close(y, y0, dtype, f"{name} value")
        assert_close(dx, dx0, dtype, f"{name} dx")
        assert_close(dw, dw0, dtype, f"{name} dw")


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_backward_without_keep_gathered(bidirectional):
    """keep_gathered=False: the backward gathers again (ag_contract/ag_cols kernels)."""
    n, dtype = 4, jnp.float32
    args = _inputs(n, dtype)
    got = _values_and_grads(n, "pallas_tpu", bidirectional, dtype, keep_gathered=False)(*args)
    want = _values_and_grads(n, "reference", bidirectional, dtype)(*args)
    assert_close(got, want, dtype, "keep_gathered=False")


def test_mixed_precision_and_tile_options():
    """bf16 in, f32 out, bf16 reduce accumulators; the tiled HBM path (tiles forced small)."""
    n, mm = 4, mesh((4,), ("x",))
    x = normal(0, (n * 32, 256), jnp.bfloat16)
    w = normal(1, (256, n * 256), jnp.bfloat16)
    # vmem=False: operands stay in HBM and every step is an emit_pipeline over 2-8 tiles
    # (16 rows: two of the 8-row tiles bfloat16 has, like float32).
    opts = {"vmem": False, "block_m": 16, "block_k": 128, "block_n": 128}

    def f(x, w, backend):
        kw = {} if backend == "reference" else {"backend": backend, "options": opts}
        a = fusedpar.all_gather_matmul(x, w, "x", gather="rhs", dim=1,
                                       preferred_element_type=jnp.float32, **kw)
        b = fusedpar.matmul_reduce_scatter(x, w, "x", dim=0, preferred_element_type=jnp.float32,
                                           reduce_dtype=jnp.bfloat16, **kw)
        return a, b

    def run(backend):
        return jax.jit(jax.shard_map(lambda x, w: f(x, w, backend), mesh=mm,
                                     in_specs=(P("x"), P(None, "x")), out_specs=P("x"),
                                     check_vma=False))(x, w)

    got, want = run("pallas_tpu"), run("reference")
    assert got[0].dtype == got[1].dtype == jnp.float32
    assert_close(got[0], want[0], jnp.float32, "ag_cols f32 out")
    assert_close(got[1], want[1], jnp.bfloat16, "rs_rows bf16 reduce")  # bf16 sums


def test_check_vma_true_error_names_the_fix():
    mm = mesh((2,), ("x",))
    x, w = normal(0, (32, 128), jnp.float32), normal(1, (128, 128), jnp.float32)
    f = jax.shard_map(lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="pallas_tpu"),
                      mesh=mm, in_specs=(P("x"), P()), out_specs=P("x"))
    # Said by pallas_tpu's `unavailable` before the kernel is traced (JAX's own error,
    # about `manual_axis_type`, came first before).
    with pytest.raises(NotImplementedError, match="called with check_vma=False"):
        jax.jit(f)(x, w)


def _call(**kw):
    base = dict(op="all_gather_matmul", prim="ag_rows", x_shape=(256, 512), w_shape=(512, 256),
                dtype="float32", axis_size=4, target="cpu", bidirectional=False)
    return Call(**{**base, **kw})


def test_unavailable_reasons():
    assert pallas_tpu.unavailable(_call()) is None
    assert pallas_tpu.unavailable(_call(target="tpu", dtype="bfloat16")) is None
    assert "platform 'gpu'" in pallas_tpu.unavailable(_call(target="gpu"))
    assert "float16 is not supported" in pallas_tpu.unavailable(_call(dtype="float16"))
    assert pallas_tpu.unavailable(_call(w_shape=(512, 200))) is None  # fits VMEM: no tiles
    # Too big for VMEM, and 2000 columns (over the v5e preset of 1024) have no tile that
    # is a multiple of 128; 1000 would be one whole-dimension tile.
    assert pallas_tpu.unavailable(_call(x_shape=(4096, 8192), w_shape=(8192, 1000))) is None
    why = pallas_tpu.unavailable(_call(x_shape=(4096, 8192), w_shape=(8192, 2000)))
    assert "length 2000" in why and "block_n=1024" in why
    # On TPU, ring segments start on tile boundaries (the interpreter does not care).
    # bfloat16's tile has 8 rows (as float32's): 24-row windows are whole tiles, 12 not.
    assert pallas_tpu.unavailable(_call(x_shape=(24, 512), dtype="bfloat16", target="tpu")) is None
    assert pallas_tpu.unavailable(_call(x_shape=(12, 512), dtype="bfloat16")) is None
    why = pallas_tpu.unavailable(_call(x_shape=(12, 512), dtype="bfloat16", target="tpu"))
    assert "window of 12 along dimension 0 of out (48, 256) bfloat16" in why
    assert "not a multiple of 8 rows of bfloat16" in why and "TPU v5e" in why
    why = pallas_tpu.unavailable(_call(prim="ag_cols", w_shape=(512, 192), target="tpu",
                                    bidirectional=True))
    assert "window of 96 along dimension 1 of w (512, 192)" in why
    assert "multiple of 128 lanes" in why and "bidirectional halves" in why
    # The direction dispatch resolves is the one checked: 128 columns per block are whole
    # tiles, but a ring of 4 defaults to bidirectional, whose halves of 64 are not.
    cols = dict(prim="ag_cols", w_shape=(512, 128), target="tpu")
    assert pallas_tpu.unavailable(_call(**cols, bidirectional=False)) is None
    why = pallas_tpu.unavailable(_call(**cols, bidirectional=None))
    assert "window of 64 along dimension 1 of w (512, 128)" in why


def test_explicit_request_raises_the_reason():
    mm = mesh((2,), ("x",))
    x, w = normal(0, (32, 128), jnp.float16), normal(1, (128, 128), jnp.float16)
    f = jax.shard_map(lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="pallas_tpu"),
                      mesh=mm, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False)
    with pytest.raises(NotImplementedError, match="float16 is not supported"):
        jax.jit(f)(x, w)


def test_bad_tile_option_is_a_clear_error():
    mm = mesh((2,), ("x",))
    x, w = normal(0, (32, 256), jnp.float32), normal(1, (256, 128), jnp.float32)
    f = jax.shard_map(lambda x, w: fusedpar.all_gather_matmul(
        x, w, "x", backend="pallas_tpu", options={"block_k": 100, "vmem": False}),
        mesh=mm, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False)
    with pytest.raises(NotImplementedError, match="block_k=100"):
        jax.jit(f)(x, w)


def test_pallas_on_cpu_means_the_interpreted_tpu_kernels():
    mm = mesh((2,), ("x",))
    x, w = normal(0, (32, 128), jnp.float32), normal(1, (128, 128), jnp.float32)

    def run(backend):
        return jax.jit(jax.shard_map(
            lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend=backend),
            mesh=mm, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False))(x, w)

    assert_close(run("pallas"), run("reference"), jnp.float32, "pallas on cpu")


def test_explicit_request_on_gpu_says_why():
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match="not on platform 'gpu'"):
        fusedpar.explain("all_gather_matmul", x, w, 4, backend="pallas_tpu", platform="gpu")


def test_ring_over_one_axis_of_a_2d_mesh():
    """Remote DMAs address neighbours by the ring axis only; the other axis stays put."""
    mm = mesh((2, 4), ("d", "x"))
    x, w = normal(0, (8 * 16, 128), jnp.float32), normal(1, (128, 4 * 32), jnp.float32)

    def f(x, w, backend):
        a = fusedpar.all_gather_matmul(x, w, "x", backend=backend, bidirectional=True)
        b = fusedpar.matmul_reduce_scatter(x, w, "x", dim=0, backend=backend)
        return a, b

    def run(backend):
        return jax.jit(jax.shard_map(lambda x, w: f(x, w, backend), mesh=mm,
                                     in_specs=(P(("d", "x")), P()),
                                     out_specs=P(("d", "x")), check_vma=False))(x, w)

    assert_close(run("pallas_tpu"), run("reference"), jnp.float32, "2-d mesh")


def test_ring_over_a_tuple_of_mesh_axes():
    """axis_name=("d", "x"): one ring of 8 over both axes, "d" major."""
    mm = mesh((2, 4), ("d", "x"))
    x, w = normal(0, (8 * 16, 128), jnp.float32), normal(1, (128, 128), jnp.float32)

    def run(backend):
        kw = {} if backend == "reference" else {"backend": backend}
        return jax.jit(jax.shard_map(
            lambda x, w: fusedpar.matmul_reduce_scatter(
                fusedpar.all_gather_matmul(x, w, ("d", "x"), **kw), w, ("d", "x"), **kw),
            mesh=mm, in_specs=(P(("d", "x")), P()), out_specs=P(("d", "x")),
            check_vma=False))(x, w)

    assert_close(run("pallas_tpu"), run("reference"), jnp.float32, "tuple axis name")


def _kernel_w_shapes(f, *args):
    """The right operand's shape of every Pallas kernel in `f`'s jaxpr."""
    return [tuple(e.invars[1].aval.shape) for e in equations(jax.make_jaxpr(f)(*args))
            if e.primitive.name == "pallas_call"]


@pytest.mark.parametrize("n,bidirectional,vmem", [(4, False, True), (2, True, False)],
                         ids=["4-uni-vmem", "2-bi-tiled"])
def test_w_transposed_kernels_read_the_weight_in_place(n, bidirectional, vmem):
    """`w_transposed=True` (a layer's `weight.T`) with `w_resident=True` (a weight not
    gathered this step): both row kernels are given the (n, k) array itself and multiply
    by its transpose, whole in VMEM and tiled; values and gradients as the reference's.
    (Without `w_resident` rs_rows is given a (k, n) copy: `_READS_W_IN_PLACE`.)"""
    mm, dtype = mesh((n,), ("x",)), jnp.bfloat16
    rows, k, cols = 16 * n, 128, 256  # per device; unequal k and cols: a shape tells
    x = normal(0, (n * rows, k), dtype)
    wt = normal(1, (cols, k), dtype)  # the (out, in) weight, replicated
    ct_ag = normal(2, (n * n * rows, cols), jnp.float32)  # ag_rows: (n * rows, cols) each
    ct_rs = normal(3, (rows, cols), jnp.float32)  # rs_rows: (rows / n, cols) each
    opts = None if vmem else {"vmem": False, "block_m": 8, "block_k": 128, "block_n": 128}

    def local(x, wt, ct_ag, ct_rs, backend):
        kw = {} if backend == "reference" else dict(
            backend=backend, bidirectional=bidirectional, options=opts, w_transposed=True,
            w_resident=True)

        def loss(x, wt):
            a = fusedpar.all_gather_matmul(x, wt.T, "x", **kw)
            b = fusedpar.matmul_reduce_scatter(x, wt.T, "x", **kw)
            return (jnp.sum(a.astype(jnp.float32) * ct_ag)
                    + jnp.sum(b.astype(jnp.float32) * ct_rs)), (a, b)

        (_, ys), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, wt)
        return ys, grads

    def run(backend):
        return jax.jit(jax.shard_map(lambda *a: local(*a, backend), mesh=mm,
                                     in_specs=(P("x"), P(), P("x"), P("x")),
                                     out_specs=((P("x"), P("x")), (P("x"), P("x"))),
                                     check_vma=False))

    args = (x, wt, ct_ag, ct_rs)
    got, want = run("pallas_tpu")(*args), run("reference")(*args)
    assert_close(got[0], want[0], dtype, "values")
    assert_close(got[1], want[1], dtype, "gradients")  # dw per device: its own sum
    # Every kernel is given the (cols, k) weight as it lies, none a (k, cols) copy: the
    # forward kernels multiply by its transpose, the backward's duals (rs_rows of ag_rows'
    # cotangent, ag_rows of rs_rows') by `w.T` = the weight itself.
    assert _kernel_w_shapes(run("pallas_tpu"), *args) == [(cols, k)] * 4


@pytest.mark.parametrize("dtype,opts,batch", [
    (F32, None, None), (BF16, {"vmem": False, "block_m": 8}, None), (F32, None, 2)],
    ids=["f32-vmem", "bf16-tiled", "f32-vmapped"])
def test_rs_rows_backward_sums_its_weight_gradient_in_the_gather(dtype, opts, batch):
    """An rs_rows's backward: the kernel that gathers the cotangent for x's gradient also
    returns w's (its partner, `x.T @ gathered dy`), and no gathered cotangent is made
    ((N*16, cols) nowhere among the kernels' results); under jax.vmap the gather stays
    one kernel for the batch, which keeps the gathered cotangent (the partner is per
    example: no per-example loop of rings). Values and gradients as the reference's."""
    n, rows, k, cols = 2, 16, 128, 256  # per device: x (n*rows, k), y (rows, cols)
    mm = mesh((n,), ("x",))
    lead = () if batch is None else (batch,)
    x = normal(0, (*lead, n * n * rows, k), dtype)
    w = normal(1, (n * k, cols), dtype)  # each device its own w
    ct = normal(2, (*lead, n * rows, cols), jnp.float32)
    spec = P("x") if batch is None else P(None, "x")

    def local(x, w, ct, backend):
        kw = {} if backend == "reference" else dict(backend=backend, bidirectional=True,
                                                     options=opts)

        def op(x):
            return fusedpar.matmul_reduce_scatter(x, w, "x", **kw)

        def loss(x, w):
            y = op(x) if batch is None else jax.vmap(op)(x)
            return jnp.sum(y.astype(jnp.float32) * ct)

        return jax.grad(loss, argnums=(0, 1))(x, w)

    def run(backend):
        return jax.jit(jax.shard_map(lambda *a: local(*a, backend), mesh=mm,
                                     in_specs=(spec, P("x"), spec), out_specs=(spec, P("x")),
                                     check_vma=False))

    args = (x, w, ct)
    assert_close(run("pallas_tpu")(*args), run("reference")(*args), dtype, "gradients")
    eqns = list(equations(jax.make_jaxpr(run("pallas_tpu"))(*args)))
    results = [tuple(v.aval.shape) for e in eqns if e.primitive.name == "pallas_call"
               for v in e.outvars]
    assert not any(e.primitive.name in ("scan", "while") for e in eqns)
    if batch is None:
        assert (k, cols) in results, results  # the weight gradient, from the gather kernel
        assert (n * rows, cols) not in results, results  # no gathered cotangent
    else:  # one gather for the batch, its gathered cotangent kept
        assert (batch * n * rows, cols) in results, results


def test_a_row_layer_gives_its_kernel_a_weight_not_gathered_in_place():
    """A sequence-parallel RowLinear with no FSDP axis (its weight is not gathered in
    the step: `w_resident`) gives both kernels of its training step, rs_rows forward
    and ag_rows backward, the (out, in) weight shard as it lies, not a (in, out) copy."""
    m = mesh((4,), ("tp",))
    out, k = 2 * C, 4 * K  # unequal, so that a copy's shape tells
    layer = fusedpar.RowLinear(k, out, key=jax.random.key(0), sequence_parallel=True,
                               backend="pallas_tpu")
    x = normal(0, (1, 4 * R, k), jnp.float32)
    with jax.set_mesh(m):
        layer, x = fusedpar.shard(layer, m), jax.device_put(
            x, jax.NamedSharding(m, P(None, None, "tp")))
        jaxpr = jax.make_jaxpr(jax.grad(lambda lyr, x: jnp.sum(lyr(x) ** 2)))(layer, x)
    shapes = [tuple(e.invars[1].aval.shape) for e in equations(jaxpr)
              if e.primitive.name == "pallas_call"]
    assert shapes == [(out, K)] * 2, shapes
