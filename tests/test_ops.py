"""Every op variant x ring backend configuration x ring size x dtype, against the definition.

Each case builds one `shard_map` program that evaluates the pure-lax definition (the
oracle, differentiated by JAX's autodiff) and every backend configuration side by side,
values and gradients, so one compile covers a whole row of the matrix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _definition
from helpers import RING_CONFIGS as CONFIGS, assert_close, mesh, normal

pytestmark = pytest.mark.timeout(300)


@dataclasses.dataclass(frozen=True)
class Case:
    """One op call: global shapes, how they are sharded over axis "x", and the op's kwargs."""

    name: str
    op: str
    kwargs: dict
    x_shape: tuple  # global shapes; the axis size multiplies the "x"-sharded dimension
    w_shape: tuple
    x_spec: P
    w_spec: P
    out_spec: P
    stack_output: bool = False  # output identical on every device: stack copies


def _scaled(shape, spec, n):
    return tuple(s * n if name == "x" else s for s, name in
                 zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))))


CASES = [
    # all-gather along a non-contracting dim of x (sequence-parallel ColumnLinear)
    Case("lhs_dim0", "all_gather_matmul", dict(gather="lhs", dim=0),
         (4, 16), (16, 8), P("x"), P(), P("x"), stack_output=True),
    Case("lhs_dim1_batch", "all_gather_matmul", dict(gather="lhs", dim=1),
         (3, 2, 16), (16, 8), P(None, "x"), P(), P("x"), stack_output=True),
    Case("lhs_dim0_batch", "all_gather_matmul", dict(gather="lhs", dim=-3),
         (2, 3, 16), (16, 8), P("x"), P(), P("x"), stack_output=True),
    # FSDP: gather w's contracting rows, or its output columns
    Case("rhs_dim0", "all_gather_matmul", dict(gather="rhs", dim=0),
         (2, 3, None), (2, 8), P("x"), P("x"), P("x")),
    Case("rhs_dim1", "all_gather_matmul", dict(gather="rhs", dim=1),
         (2, 3, 16), (16, 2), P("x"), P(None, "x"), P("x")),
    # reduce-scatter of a K-sharded product along rows, a middle dim, or the last dim
    Case("rs_dim0", "matmul_reduce_scatter", dict(dim=0),
         (16, 2), (2, 8), P(None, "x"), P("x"), P("x")),
    Case("rs_dim1_batch", "matmul_reduce_scatter", dict(dim=1),
         (3, 16, 2), (2, 8), P(None, None, "x"), P("x"), P(None, "x")),
    Case("rs_last", "matmul_reduce_scatter", dict(dim=-1),
         (3, 2, 2), (2, 16), P(None, None, "x"), P("x"), P(None, None, "x")),
]


def _op(case, backend, options, axis="x"):
    """The per-device call of `case` over `axis`: the oracle if `backend` is None."""
    def f(x, w):
        if backend is None:
            y = getattr(_definition, case.op)(x, w, axis, **case.kwargs)
        else:
            y = getattr(fusedpar, case.op)(x, w, axis, backend=backend, **case.kwargs,
                                           **options)
        return y[None] if case.stack_output else y

    return f


def run_case(case, n, dtype, configs):
    """Oracle and every config, values and gradients, in one jit; [(label, (y, dx, dw))]."""
    m = mesh((n,), ("x",))
    xs, ws = _scaled(case.x_shape, case.x_spec, n), _scaled(case.w_shape, case.w_spec, n)
    if case.kwargs.get("gather") == "rhs" and case.kwargs["dim"] == 0:
        xs = xs[:-1] + ws[:1]  # x contracts with all of w's gathered rows
    x, w = normal(0, xs, dtype), normal(1, ws, dtype)
    fns = [_op(case, None, {})] + [_op(case, b, o) for b, o in configs]
    return evaluate(fns, m, x, w, (case.x_spec, case.w_spec), case.out_spec,
                    ["oracle"] + [f"{b} {o}" for b, o in configs])


def evaluate(fns, m, x, w, in_specs, out_spec, labels, check_vma=True):
    """(y, dx, dw) of each per-device fn under shard_map; one cotangent shared by all."""
    smaps = [jax.shard_map(f, mesh=m, in_specs=in_specs, out_specs=out_spec,
                           check_vma=check_vma) for f in fns]
    y_shape = jax.eval_shape(smaps[0], x, w)
    ct = normal(2, y_shape.shape, jnp.float32)

    @jax.jit
    def everything(x, w):
        return [jax.value_and_grad(
            lambda x, w, g=g: jnp.vdot(g(x, w).astype(jnp.float32), ct),
            argnums=(0, 1), has_aux=False)(x, w)[1] + (g(x, w),) for g in smaps]

    return [(label, (r[2], r[0], r[1])) for label, r in zip(labels, everything(x, w))]


def check(results, dtype, what):
    (_, want), *rest = results
    for label, got in rest:
        for name, g, w in zip(("y", "dx", "dw"), got, want):
            assert_close(g, w, dtype, f"{what} {label} {name}")


# Ring sizes: 1 (no ring), 2 (both directions of a bidirectional ring reach the same
# neighbour; one transfer, unrolled even when asked to roll) and 8 (the slices' size;
# rolled loops, both directions apart). Rings of 4 run in the tests below (2 x 4 meshes,
# check_vma=False, reduce_dtype, vector inputs, the TPU kernels out of order).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_definition(case, n, dtype):
    check(run_case(case, n, dtype, CONFIGS), dtype, f"{case.name} N={n}")


# On a 2x4 mesh ("a", "b") the op runs over one axis while data is also sharded on the
# other: (case, ring axis, global x, global w, x spec, w spec, out spec).
MESH_2D_CASES = [
    (CASES[1], "b", (4, 8, 16), (16, 8), P("a", "b"), P(), P(("a", "b"))),
    (CASES[3], "b", (8, 3, 16), (16, 8), P(("a", "b")), P("b"), P(("a", "b"))),
    (CASES[6], "a", (8, 16, 4), (4, 8), P("b", None, "a"), P("a"), P("b", "a")),
    (CASES[7], "b", (2, 3, 8), (8, 16), P("a", None, "b"), P("b"), P("a", None, "b")),
]


@pytest.mark.parametrize("case, axis, xs, ws, x_spec, w_spec, out_spec", MESH_2D_CASES,
                         ids=[f"{c[0].name}_over_{c[1]}" for c in MESH_2D_CASES])
def test_two_dimensional_mesh(case, axis, xs, ws, x_spec, w_spec, out_spec):
    compare_on_2x4(case, axis, xs, ws, x_spec, w_spec, out_spec)


def compare_on_2x4(case, axis, xs, ws, x_spec, w_spec, out_spec):
    """The oracle and two ring configs over `axis` of a 2x4 ("a", "b") mesh, f32."""
    configs = [(None, {})] + CONFIGS[1:3]
    results = evaluate([_op(case, b, o, axis) for b, o in configs], mesh((2, 4), ("a", "b")),
                       normal(0, xs, jnp.float32), normal(1, ws, jnp.float32),
                       (x_spec, w_spec), out_spec, [f"{b} {o}" for b, o in configs])
    check(results, jnp.float32, f"{case.name} over {axis} of 2x4")


def test_check_vma_false_gives_the_same_gradients():
    """Kernels need shard_map(check_vma=False); the ring's custom VJP must agree there too."""
    case = CASES[0]
    m = mesh((4,), ("x",))
    x = normal(0, _scaled(case.x_shape, case.x_spec, 4), jnp.float32)
    w = normal(1, case.w_shape, jnp.float32)
    specs = ((case.x_spec, case.w_spec), case.out_spec)
    want = evaluate([_op(case, None, {})], m, x, w, *specs, ["oracle"])
    got = evaluate([_op(case, b, {}) for b in ("ring", "reference")], m, x, w, *specs,
                   ["ring check_vma=False", "reference check_vma=False"], check_vma=False)
    check(want + got, jnp.float32, "check_vma=False")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_preferred_element_type_and_reduce_dtype(dtype):
    """Result dtype follows preferred_element_type; reduce_dtype sets the ring's sum dtype."""
    case = CASES[5]
    m = mesh((4,), ("x",))
    x = normal(0, _scaled(case.x_shape, case.x_spec, 4), dtype)
    w = normal(1, _scaled(case.w_shape, case.w_spec, 4), dtype)

    def run(backend, **kw):
        f = lambda x, w: fusedpar.matmul_reduce_scatter(x, w, "x", backend=backend, **kw)
        return jax.jit(jax.shard_map(f, mesh=m, in_specs=(case.x_spec, case.w_spec),
                                     out_specs=case.out_spec))(x, w)

    exact = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32))
    for backend in ("reference", "ring"):
        y32 = run(backend, preferred_element_type=jnp.float32)
        assert y32.dtype == jnp.float32
        assert_close(y32, exact, jnp.float32, f"{backend} f32 result")
        y = run(backend, reduce_dtype=dtype)
        assert y.dtype == dtype
        assert_close(y, exact, dtype, f"{backend} reduce_dtype={dtype}")


def test_float64_result_and_numpy_dim_as_jax_reads_them():
    """Without jax_enable_x64, `preferred_element_type=jnp.float64` is float32, as
    jnp.matmul's (the ring's all-gather crashed writing float64 products into a float32
    buffer), and `dim` may be a numpy integer, as lax's axis arguments may."""
    m = mesh((4,), ("x",))
    x, w = normal(0, (16, 8), jnp.float32), normal(1, (8, 4), jnp.float32)

    def run(**kw):
        f = lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="ring", **kw)
        return jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P()), out_specs=P("x"),
                                     check_vma=False))(x, w)

    want = run()
    got = run(preferred_element_type=jnp.float64)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(run(dim=np.int64(0)), want)


def test_explain_and_auto_choice():
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    one = fusedpar.explain("all_gather_matmul", x, w, 1)
    assert one.backend == "reference" and "1 device" in one.reason
    cpu = fusedpar.explain("all_gather_matmul", x, w, 8, platform="cpu")
    assert cpu.backend == "reference" and cpu.reason.startswith("auto:")
    ring = fusedpar.explain("matmul_reduce_scatter", x, w, 8, backend="ring")
    assert ring.backend == "ring" and ring.bidirectional and ring.unroll
    rolled = fusedpar.explain("matmul_reduce_scatter", x, w, 16, backend="ring")
    assert not rolled.unroll
    odd = fusedpar.explain("all_gather_matmul", jax.ShapeDtypeStruct((3, 32), jnp.float32),
                           w, 8, backend="ring")
    assert not odd.bidirectional  # blocks of 3 rows cannot split in halves
    assert "ring" in str(ring) and "bidirectional" in str(ring)


def test_explicit_backend_that_cannot_run_raises(monkeypatch):
    from fusedpar._core import _backends

    monkeypatch.setitem(_backends.TABLE, "never", _backends.Backend(
        "never", "a test double", run=None, unavailable=lambda call: "it is a test double"))
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    with pytest.raises(NotImplementedError, match="'never' cannot run.*test double"):
        fusedpar.explain("all_gather_matmul", x, w, 2, backend="never")


def test_choice_is_logged(caplog):
    m = mesh((2,), ("x",))
    x = normal(0, (4, 8), jnp.float32)
    w = normal(1, (8, 4), jnp.float32)
    f = lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="ring")[None]
    with caplog.at_level("DEBUG", logger="fusedpar"):
        jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P()), out_specs=P("x")))(x, w)
    assert any("ring" in r.getMessage() and "ag_rows" in r.getMessage() for r in caplog.records)


def test_rolled_ring_trace_stays_flat():
    """The fori_loop ring's program does not grow with the ring; the unrolled one does."""
    def size(n, unroll):
        m = mesh((n,), ("x",))
        f = lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="ring", unroll=unroll,
                                                    bidirectional=False)[None]
        g = jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P()), out_specs=P("x")))
        x = jax.ShapeDtypeStruct((4 * n, 8), jnp.float32)
        w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
        return g.trace(x, w).jaxpr.pretty_print().count("ppermute")

    assert size(4, False) == size(8, False)
    assert size(8, True) > size(4, True)


@pytest.mark.parametrize("case", [
    Case("vector_rhs_dim1", "all_gather_matmul", dict(gather="rhs", dim=1),
         (16,), (16, 2), P(), P(None, "x"), P("x"), stack_output=True),
    Case("vector_rs", "matmul_reduce_scatter", dict(dim=0),
         (2,), (2, 8), P("x"), P("x"), P("x")),
], ids=lambda c: c.name)
def test_vector_input(case):
    """x of shape (k,) works where the op has a dimension to gather or scatter."""
    check(run_case(case, 4, jnp.float32, CONFIGS[:3]), jnp.float32, case.name)


@pytest.mark.parametrize("case", [
    Case("gather", "all_gather_matmul", dict(gather="lhs", dim=0), (16, 4), (4, 3),
         P(("a", "b")), P(), P(("a", "b")), stack_output=True),
    Case("reduce_scatter", "matmul_reduce_scatter", dict(dim=0), (16, 16), (16, 4),
         P(None, ("a", "b")), P(("a", "b")), P(("b", "a"))),
], ids=lambda c: c.name)
def test_axis_tuple_in_reverse_mesh_order(case):
    """A ring over ("b", "a") on an ("a", "b") mesh follows the tuple's order, as
    all_gather and psum_scatter do, although ppermute numbers devices in mesh order."""
    compare_on_2x4(case, ("b", "a"), case.x_shape, case.w_shape, case.x_spec, case.w_spec,
                   case.out_spec)


# A ring that visits the devices out of index order (as on a TPU slice, where it follows
# the wires): the same values, the blocks stacked in index order.
ORDER_8 = (0, 2, 4, 6, 7, 5, 3, 1)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ring_in_physical_order(case, monkeypatch):
    from fusedpar._core._backends import _ring_loop
    from fusedpar._core._schedule import Ring

    def ordered(axis_name, size, bidirectional=False):
        return Ring(size, bidirectional, ORDER_8 if size == 8 else None)

    monkeypatch.setattr(_ring_loop, "ring_for", ordered)
    check(run_case(case, 8, jnp.float32, CONFIGS[1:]), jnp.float32,
          f"{case.name} ring order {ORDER_8}")


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("lhs_dim0", "rs_dim0")],
                         ids=lambda c: c.name)
def test_tpu_kernels_in_physical_order(case, monkeypatch):
    """The fused TPU kernels address their neighbours through the same `Ring`: out of
    index order (interpret mode, 4 devices), the same values."""
    from fusedpar._core._backends import pallas_tpu
    from fusedpar._core._schedule import Ring

    def ordered(axis_name, size, bidirectional=False):
        return Ring(size, bidirectional, (0, 2, 3, 1) if size == 4 else None)

    monkeypatch.setattr(pallas_tpu, "ring_for", ordered)
    n, m = 4, mesh((4,), ("x",))
    xs, ws = _scaled(case.x_shape, case.x_spec, n), _scaled(case.w_shape, case.w_spec, n)
    x, w = normal(0, xs, jnp.float32), normal(1, ws, jnp.float32)
    configs = [("pallas_tpu", dict(bidirectional=b)) for b in (False, True)]
    fns = [_op(case, None, {})] + [_op(case, b, o) for b, o in configs]
    check(evaluate(fns, m, x, w, (case.x_spec, case.w_spec), case.out_spec,
                   ["oracle", "uni", "bidi"], check_vma=False), jnp.float32,
          f"{case.name} (0, 2, 3, 1)")
