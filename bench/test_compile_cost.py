"""Compile cost of the ring: trace+lower time, compile time and program size vs ring size.

An unrolled ring emits one matmul and one ppermute per step, so its program grows with
the ring; the rolled ring (`unroll=False`, a `fori_loop`) must stay flat. Rings up to 64
are lowered on an `AbstractMesh` (no devices needed); compilation needs real devices, so
it is timed up to the 8 this machine simulates. Per-device shapes are fixed, so only the
ring size changes. The program size (StableHLO text, bytes and lines) is recorded in each
benchmark's `extra_info`.
"""

import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

import fusedpar

pytestmark = pytest.mark.timeout(300)

LOCAL_X, LOCAL_W = (16, 64), (64, 64)  # per-device x and w
RINGS = [2, 4, 8, 16, 32, 64]
OPS = {
    "agm_lhs": (lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", **kw),
                (P("x", None), P())),
    "mrs": (lambda x, w, **kw: fusedpar.matmul_reduce_scatter(x, w, "x", **kw),
            (P(None, "x"), P("x", None))),
}


def _jitted(op, mesh, unroll):
    fn, specs = OPS[op]

    def local(x, w):
        return fn(x, w, backend="ring", unroll=unroll, bidirectional=False)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("x", None)))


def _global_shapes(op, n):
    (m, k), (_, cols) = LOCAL_X, LOCAL_W
    if op == "agm_lhs":
        return (jax.ShapeDtypeStruct((n * m, k), jnp.float32),
                jax.ShapeDtypeStruct((k, cols), jnp.float32))
    # mrs contracts over the ring: x (M, N*k), w (N*k, cols); M must divide by N.
    return (jax.ShapeDtypeStruct((n * m, n * k), jnp.float32),
            jax.ShapeDtypeStruct((n * k, cols), jnp.float32))


def _lower(op, n, unroll):
    mesh = AbstractMesh((n,), ("x",), axis_types=(AxisType.Auto,))
    return _jitted(op, mesh, unroll).trace(*_global_shapes(op, n)).lower(
        lowering_platforms=("cpu",))


def _size(lowered):
    text = lowered.as_text()
    return len(text), text.count("\n")


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "rolled"])
@pytest.mark.parametrize("n", RINGS)
@pytest.mark.parametrize("op", list(OPS))
def test_trace_and_lower(benchmark, op, n, unroll):
    benchmark.group = f"compile cost: trace+lower {op}"
    nbytes, lines = _size(_lower(op, n, unroll))
    benchmark.extra_info.update(op=op, ring=n, unroll=unroll, hlo_bytes=nbytes,
                                hlo_lines=lines, kind="trace+lower", jax_version=jax.__version__)
    benchmark.pedantic(_lower, (op, n, unroll), rounds=5, iterations=1)
    if not unroll and n == RINGS[-1]:
        # The rolled ring's program does not grow with the ring: the same operations (lines)
        # from 4 devices up (a ring of 2 has one transfer, which is never rolled); only the
        # ppermute's list of device pairs gets longer.
        _, small_lines = _size(_lower(op, 4, False))
        assert lines <= small_lines + 2, (small_lines, lines)


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "rolled"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("op", list(OPS))
def test_compile(benchmark, make_mesh, op, n, unroll):
    mesh = make_mesh(n)
    benchmark.group = f"compile cost: lower+compile {op}"

    def compile_once():
        return _jitted(op, mesh, unroll).trace(*_global_shapes(op, n)).lower().compile()

    start = time.perf_counter()
    compiled = compile_once()
    benchmark.extra_info.update(op=op, ring=n, unroll=unroll, kind="lower+compile",
                                first_s=time.perf_counter() - start,
                                hlo_bytes=len(compiled.as_text() or ""),
                                jax_version=jax.__version__)
    benchmark.pedantic(compile_once, rounds=3, iterations=1)
