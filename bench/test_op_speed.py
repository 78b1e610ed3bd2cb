"""The ops side by side: every backend for each op, direction, ring size, shape and mode.

One pytest-benchmark group per (op, mode, shape, ring size), so each table row reads as a
ratio to `reference` (`python bench/report.py` writes those ratios to bench/RESULTS.md).
Each group also has `xla`: the same product as a user without fusedpar writes it, `x @ w`
under plain `jax.jit` over the same sharded inputs with the result's sharding constrained,
partitioned by XLA (its own collectives; on TPU its collective matmul where it fires) —
the baseline fusedpar has to beat.
Shapes are GLOBAL (M, K, N_out); each device holds its shard:

- `agm_lhs`: sequence-parallel gather of activations, x (M/N, K) @ w (K, N_out)
  -> all_gather_matmul(gather="lhs"), primitive ag_rows.
- `agm_rhs`: FSDP weight gather, x (M/N, K) @ w (K, N_out/N) -> all_gather_matmul(
  gather="rhs", dim=1), primitive ag_cols.
- `mrs`: row-parallel output, x (M, K/N) @ w (K/N, N_out) -> matmul_reduce_scatter(dim=0),
  primitive rs_rows.

Quantized rows (`comm_dtype`, issue 21): `ring-bidi-int8` and `ring-bidi-fp8` send the
travelling operand (all-gathers) or the accumulator (reduce-scatter) as int8 or
float8_e4m3fn values plus float32 scales, in the same groups as the rows above, at the
largest shape and ring.

On the CPU the "devices" share 2 cores and transfers are memory copies: these numbers
show the overhead of decomposing, never a speed-up. `pallas_tpu` runs in TPU interpret
mode there (a simulator of every DMA and semaphore), so it only runs at a tiny size and
its group says "simulated".
"""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fusedpar

SIZES = os.environ.get("FUSEDPAR_BENCH_SIZES", "cpu")  # validated in bench/conftest.py

pytestmark = pytest.mark.timeout(300)

if SIZES == "cpu":
    DTYPE = jnp.float32
    SHAPES = [(256, 256, 256), (1024, 512, 1024)]
    RINGS = [2, 4, 8]
else:
    DTYPE = jnp.bfloat16
    SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)]
    RINGS = [1, 2, 4, 8]
SIM_SHAPE, SIM_RINGS = (256, 128, 128), [2, 4]

# (backend, bidirectional): the label in the tables. "xla" is not a fusedpar backend
# (see _xla_program).
BACKENDS = {"reference": ("reference", None), "xla": ("xla", None), "ring": ("ring", False),
            "ring-bidi": ("ring", True)}

# `out`: the layout of the product x @ w that the op leaves (agm_lhs: every device holds
# all of it; the shard_map programs stack those copies along rows).
OPS = {
    "agm_lhs": dict(fn=fusedpar.all_gather_matmul, kw=dict(gather="lhs", dim=0),
                    specs=(P("x", None), P()), out=P()),
    "agm_rhs": dict(fn=fusedpar.all_gather_matmul, kw=dict(gather="rhs", dim=1),
                    specs=(P("x", None), P(None, "x")), out=P("x", None)),
    "mrs": dict(fn=fusedpar.matmul_reduce_scatter, kw=dict(dim=0),
                specs=(P(None, "x"), P("x", None)), out=P("x", None)),
}


# label -> comm_dtype of the quantized rows.
COMM = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _xla_program(op, mesh, mode):
    """`x @ w` under plain jax.jit: XLA partitions it from the inputs' shardings and the
    constraint on the result (the op's output layout), with no shard_map."""
    out = NamedSharding(mesh, OPS[op]["out"])

    def f(x, w):
        return jax.lax.with_sharding_constraint(jnp.matmul(x, w), out)

    if mode == "fwd":
        return jax.jit(f)
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1)))


def _program(op, mesh, backend, bidirectional, mode, check_vma=True, comm_dtype=None):
    if backend == "xla":
        return _xla_program(op, mesh, mode)
    spec = OPS[op]

    def local(x, w):
        return spec["fn"](x, w, "x", backend=backend, bidirectional=bidirectional,
                          comm_dtype=comm_dtype, **spec["kw"])

    # Every op's result is row-sharded (agm_lhs stacks the identical copies).
    f = jax.shard_map(local, mesh=mesh, in_specs=spec["specs"], out_specs=P("x", None),
                      check_vma=check_vma)
    if mode == "fwd":
        return jax.jit(f)
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1)))


def _inputs(op, mesh, shape):
    m, k, n_out = shape
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(DTYPE)
    w = (jax.random.normal(kw, (k, n_out), jnp.float32) / k ** 0.5).astype(DTYPE)
    xs, ws = OPS[op]["specs"]
    return (jax.device_put(x, NamedSharding(mesh, xs)),
            jax.device_put(w, NamedSharding(mesh, ws)))


def _cases(backends=BACKENDS):
    for op in OPS:
        for mode in ("fwd", "fwd+bwd"):
            for shape in SHAPES:
                for n in RINGS:
                    for label, (backend, bi) in backends.items():
                        if bi and n <= 2:
                            continue  # a bidirectional ring of 2 is the same ring twice
                        yield pytest.param(op, mode, shape, n, label,
                                           id=f"{op}-{mode}-{'x'.join(map(str, shape))}"
                                              f"-N{n}-{label}")


@pytest.mark.parametrize("op,mode,shape,n,label", list(_cases()))
def test_op(benchmark, timed, make_mesh, op, mode, shape, n, label):
    mesh = make_mesh(n)
    backend, bi = BACKENDS[label]
    fn = _program(op, mesh, backend, bi, mode)
    x, w = _inputs(op, mesh, shape)
    if backend == "xla" and mode == "fwd":  # a baseline computing something else is no baseline
        got, want = fn(x, w), jnp.matmul(x, w, precision="highest")
        rel = 1e-5 if jnp.dtype(DTYPE) == jnp.float32 else 1e-2  # per element of K summed
        bound = rel * float(jnp.max(jnp.abs(want))) * shape[1] ** 0.5
        assert float(jnp.max(jnp.abs(got - want))) <= bound, (op, shape, n)
    m, k, n_out = shape
    timed(benchmark, fn, x, w, group=f"{op} {mode} {m}x{k}x{n_out} N={n}", op=op, mode=mode,
          shape=list(shape), ring=n, backend=label, dtype=jnp.dtype(DTYPE).name,
          simulated=False)


def _quantized_cases(backend, ops=tuple(OPS)):
    """`<backend>-bidi-<int8|fp8>` rows at the largest shape and ring, both modes."""
    for op in ops:
        for mode in ("fwd", "fwd+bwd"):
            shape, n = SHAPES[-1], RINGS[-1]
            for comm in COMM:
                label = f"{backend}-bidi-{comm}"
                yield pytest.param(op, mode, shape, n, label,
                                   id=f"{op}-{mode}-{'x'.join(map(str, shape))}-N{n}-{label}")


@pytest.mark.parametrize("op,mode,shape,n,label", list(_quantized_cases("ring")))
def test_op_quantized(benchmark, timed, make_mesh, op, mode, shape, n, label):
    mesh = make_mesh(n)
    comm = label.rsplit("-", 1)[1]
    fn = _program(op, mesh, "ring", True, mode, comm_dtype=COMM[comm])
    x, w = _inputs(op, mesh, shape)
    m, k, n_out = shape
    timed(benchmark, fn, x, w, group=f"{op} {mode} {m}x{k}x{n_out} N={n}", op=op, mode=mode,
          shape=list(shape), ring=n, backend=label, dtype=jnp.dtype(DTYPE).name,
          simulated=False, comm_dtype=comm)


def _simulated_cases():
    for op in ("agm_lhs", "mrs"):
        for n in SIM_RINGS:
            for label in ("reference", "pallas_tpu"):
                yield pytest.param(op, n, label, id=f"{op}-fwd-sim-N{n}-{label}")


@pytest.mark.skipif(SIZES != "cpu", reason="TPU interpret mode is a CPU simulator")
@pytest.mark.parametrize("op,n,label", list(_simulated_cases()))
def test_op_pallas_tpu_simulated(benchmark, timed, make_mesh, op, n, label):
    """The fused TPU kernels in interpret mode: a simulator, timed only to track its cost."""
    mesh = make_mesh(n)
    m, k, n_out = SIM_SHAPE
    if label == "pallas_tpu":
        spec = OPS[op]
        x_local = jax.ShapeDtypeStruct((m // n, k) if op == "agm_lhs" else (m, k // n), DTYPE)
        w_local = jax.ShapeDtypeStruct((k, n_out) if op == "agm_lhs" else (k // n, n_out),
                                       DTYPE)
        name = "all_gather_matmul" if op == "agm_lhs" else "matmul_reduce_scatter"
        try:
            fusedpar.explain(name, x_local, w_local, n, backend="pallas_tpu",
                             **({"gather": "lhs"} if op == "agm_lhs" else {}),
                             dim=spec["kw"]["dim"])
        except NotImplementedError as e:
            pytest.skip(f"pallas_tpu cannot run this yet: {e}")
    fn = _program(op, mesh, label, None, "fwd", check_vma=label != "pallas_tpu")
    x, w = _inputs(op, mesh, SIM_SHAPE)
    timed(benchmark, fn, x, w, group=f"{op} fwd {m}x{k}x{n_out} N={n} (simulated TPU)",
          budget=0.5, op=op, mode="fwd", shape=list(SIM_SHAPE), ring=n, backend=label,
          dtype=jnp.dtype(DTYPE).name, simulated=label == "pallas_tpu")
