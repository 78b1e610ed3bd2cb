"""Integer operands: the ops equal their lax expressions (JAX's own collective-matmul test
cases use int32); the kernels, which multiply floating blocks only, refuse them by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import fusedpar
from helpers import mesh

pytestmark = pytest.mark.timeout(300)

CONFIGS = [("reference", {}), ("auto", {}),
           ("ring", dict(bidirectional=False, unroll=True)),
           ("ring", dict(bidirectional=True, unroll=False))]


def _operands(dtype):
    rng = np.random.default_rng(0)
    # int8 products overflow: the ops must wrap exactly as the lax expression does.
    return (jnp.asarray(rng.integers(-100, 100, (16, 32)), dtype),
            jnp.asarray(rng.integers(-100, 100, (32, 8)), dtype))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8], ids=lambda d: jnp.dtype(d).name)
def test_integer_ops_equal_the_lax_expression(dtype):
    m = mesh((4,), ("x",))
    x, w = _operands(dtype)

    def run(f, out):
        return jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P()), out_specs=out,
                                     check_vma=False))(x, w)

    want = {
        "lhs": run(lambda a, b: jnp.matmul(lax.all_gather(a, "x", tiled=True), b), P()),
        "rhs": run(lambda a, b: jnp.matmul(a, lax.all_gather(b, "x", axis=1, tiled=True)),
                   P("x")),
        "rs": run(lambda a, b: lax.psum_scatter(jnp.matmul(a, b), "x", scatter_dimension=1,
                                                tiled=True), P("x")),
    }
    for backend, kw in CONFIGS:
        got = {
            "lhs": run(lambda a, b: fusedpar.all_gather_matmul(
                a, b, "x", backend=backend, **kw), P()),
            "rhs": run(lambda a, b: fusedpar.all_gather_matmul(
                a, b, "x", gather="rhs", dim=1, backend=backend, **kw), P("x")),
            "rs": run(lambda a, b: fusedpar.matmul_reduce_scatter(
                a, b, "x", dim=1, backend=backend, **kw), P("x")),
        }
        for k in want:
            assert got[k].dtype == want[k].dtype, (backend, kw, k)
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{backend} {kw} {k}")


def test_integer_sums_in_the_integer_reduce_dtype_given():
    """`reduce_dtype=jnp.int32`, the integers' default, may be given: the same exact sums
    (a floating one, which would round them, is refused: tests/test_errors.py)."""
    m = mesh((4,), ("x",))
    x, w = _operands(jnp.int32)
    run = lambda **kw: jax.jit(jax.shard_map(  # noqa: E731
        lambda a, b: fusedpar.matmul_reduce_scatter(a, b, "x", dim=1, backend="ring", **kw),
        mesh=m, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False))(x, w)
    np.testing.assert_array_equal(run(reduce_dtype=jnp.int32), run())


def test_int8_operands_give_an_int32_result_when_asked():
    """`preferred_element_type=jnp.int32` on int8 operands: the unwrapped sums, equal to
    lax.dot_general's with the same preferred type (int8's own result wraps)."""
    m = mesh((4,), ("x",))
    x, w = _operands(jnp.int8)
    dot = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),  # noqa: E731
                                       preferred_element_type=jnp.int32)

    def run(f, out):
        return jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P()), out_specs=out,
                                     check_vma=False))(x, w)

    want = {"lhs": run(lambda a, b: dot(lax.all_gather(a, "x", tiled=True), b), P()),
            "rs": run(lambda a, b: lax.psum_scatter(dot(a, b), "x", scatter_dimension=1,
                                                    tiled=True), P("x"))}
    assert int(jnp.abs(want["rs"]).max()) > 127  # the sums an int8 result would wrap
    for backend, kw in CONFIGS[::3]:
        got = {"lhs": run(lambda a, b: fusedpar.all_gather_matmul(
                   a, b, "x", backend=backend, preferred_element_type=jnp.int32, **kw), P()),
               "rs": run(lambda a, b: fusedpar.matmul_reduce_scatter(
                   a, b, "x", dim=1, backend=backend, preferred_element_type=jnp.int32,
                   **kw), P("x"))}
        for k in want:
            assert got[k].dtype == jnp.int32, (backend, k)
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{backend} {kw} {k}")


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_kernels_refuse_integers_with_the_reason(backend):
    x, w = jax.ShapeDtypeStruct((64, 128), jnp.int32), jax.ShapeDtypeStruct((128, 128), jnp.int32)
    with pytest.raises(NotImplementedError, match=rf"backend '{backend}' cannot run this "
                                                  r"call \(.*int32.*\): dtype int32 is not "
                                                  r"supported"):
        fusedpar.explain("all_gather_matmul", x, w, 4, backend=backend,
                         platform="tpu" if backend == "pallas_tpu" else None)
