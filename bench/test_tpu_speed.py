"""The fused TPU kernels on a TPU host, beside the reference and the lax ring.

Every case here runs only where JAX's default backend is a TPU; elsewhere they are
skipped (on CPU the kernels run in interpret mode, in bench/test_op_speed.py's
"simulated TPU" groups). Two sections:

- `ops`: `pallas_tpu` (unidirectional, and bidirectional above 2 devices) in the same
  pytest-benchmark groups as bench/test_op_speed.py (op, mode, global shape, ring size),
  so the report sets it beside `reference`, `ring` and `ring-bidi` in one table row;
- `step`: the kernel on a ring of ONE device (its tiled step matmul, nothing to send)
  against `jnp.dot` of the same problem: how close the step kernels come to XLA's own
  matmul, which is what the cost model's TPU `efficiency` stands for (with TFLOP/s).

On a TPU host `python bench/run_tpu.py` runs both files at `FUSEDPAR_BENCH_SIZES=
accelerator` and writes bench/results-tpu.json, bench/RESULTS-tpu.md, bench/results-tpu.png.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from test_op_speed import COMM, DTYPE, _cases, _inputs, _program, _quantized_cases

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(jax.default_backend() != "tpu",
                                 reason="the fused TPU kernels are timed on a TPU only")]

# (backend, bidirectional): the label in the tables.
KERNELS = {"pallas_tpu": ("pallas_tpu", False), "pallas_tpu-bidi": ("pallas_tpu", True)}
STEP_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 8192, 1024)]


@pytest.mark.parametrize("op,mode,shape,n,label", list(_cases(KERNELS)))
def test_op(benchmark, timed, make_mesh, op, mode, shape, n, label):
    mesh = make_mesh(n)
    fn = _program(op, mesh, *KERNELS[label], mode, check_vma=False)
    x, w = _inputs(op, mesh, shape)
    m, k, n_out = shape
    timed(benchmark, fn, x, w, group=f"{op} {mode} {m}x{k}x{n_out} N={n}", op=op, mode=mode,
          shape=list(shape), ring=n, backend=label, dtype=jnp.dtype(DTYPE).name,
          simulated=False)


@pytest.mark.parametrize("op,mode,shape,n,label", list(_quantized_cases(
    "pallas_tpu", ops=("agm_lhs", "agm_rhs"))))
def test_op_quantized(benchmark, timed, make_mesh, op, mode, shape, n, label):
    """The fused all-gathers sending int8 / float8_e4m3fn values and f32 scales (the
    reduce-scatter kernels do not take a comm_dtype); the backward's collectives send
    bfloat16 (grad_comm_dtype None)."""
    mesh = make_mesh(n)
    comm = label.rsplit("-", 1)[1]
    fn = _program(op, mesh, "pallas_tpu", True, mode, check_vma=False, comm_dtype=COMM[comm])
    x, w = _inputs(op, mesh, shape)
    m, k, n_out = shape
    timed(benchmark, fn, x, w, group=f"{op} {mode} {m}x{k}x{n_out} N={n}", op=op, mode=mode,
          shape=list(shape), ring=n, backend=label, dtype=jnp.dtype(DTYPE).name,
          simulated=False, comm_dtype=comm)


@pytest.mark.parametrize("label", ["pallas_tpu", "jnp.dot"])
@pytest.mark.parametrize("shape", STEP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_step(benchmark, timed, make_mesh, shape, label):
    m, k, n = shape
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(jnp.bfloat16)
    if label == "jnp.dot":
        fn = jax.jit(jnp.dot)
    else:
        fn = jax.jit(jax.shard_map(
            lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="pallas_tpu"),
            mesh=make_mesh(1), in_specs=(P(), P()), out_specs=P(), check_vma=False))
    timed(benchmark, fn, x, w, group=f"step {m}x{k}x{n} bfloat16", backend=label,
          shape=list(shape))
    stats = getattr(benchmark, "stats", None)  # None with --benchmark-disable
    if stats is not None:
        benchmark.extra_info["tflops"] = 2 * m * k * n / stats.stats.min / 1e12
