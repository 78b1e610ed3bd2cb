"""The Triton GPU step kernels lower for CUDA at real sizes, without a GPU.

`jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the Pallas Triton lowering:
it checks block shapes (powers of 2), the kernels' indexing and the Triton IR they emit.
Compiling that IR to a GPU binary still needs a GPU (bench/test_gpu_steps.py does it).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar.kernels import gpu
from helpers import mesh

pytestmark = pytest.mark.timeout(120)

S = jax.ShapeDtypeStruct
TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas Triton kernel lowers to
M, K, N = 4096, 8192, 4096  # per-device problem of a ring step (bf16: 64 + 64 MiB)


def _cuda(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("axis,num_pieces", [(0, 1), (0, 2), (1, 1), (1, 2)])
def test_matmul_into_lowers_for_cuda(axis, num_pieces, dtype):
    if axis == 0:  # ag_rows: row blocks of x times w, into a 4-device output
        pieces, other = [S((M // num_pieces, K), dtype)] * num_pieces, S((K, N), dtype)
        out = S((4 * M, N), dtype)
    else:  # ag_cols: x times column blocks of w
        pieces, other = [S((K, N // num_pieces), dtype)] * num_pieces, S((M, K), dtype)
        out = S((M, 4 * N), dtype)
    f = functools.partial(gpu.triton.matmul_into, axis=axis, interpret=False)
    text = _cuda(f, out, pieces, other, S((num_pieces,), jnp.int32))
    assert text.count(TRITON) == 1  # both halves of a bidirectional step: one launch


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", ["rs_rows", "rs_cols", "ag_contract", "first_step"])
def test_matmul_acc_lowers_for_cuda(case, dtype):
    i = S((), jnp.int32)
    acc = S((M, N), jnp.float32)
    x = S((4 * M, K), dtype) if case == "rs_rows" else S((M, K), dtype)
    w = S((K, 4 * N), dtype) if case == "rs_cols" else S((K, N), dtype)

    def f(acc, x, w, i):
        if case == "ag_contract":  # both halves of a step as two terms of one launch
            x2 = jnp.concatenate([x, x], axis=1)
            half = gpu.Term(x2, w[: K // 2], K // 2, a_col=i * (K // 2))
            terms = [half, gpu.Term(x2, w[K // 2:], K // 2, a_col=(i + 1) * (K // 2))]
        else:
            terms = [gpu.Term(x, w, K, a_row=i * M if case == "rs_rows" else 0,
                              b_col=i * N if case == "rs_cols" else 0)]
        return gpu.triton.matmul_acc(None if case == "first_step" else acc, terms, (M, N),
                                     jnp.float32, interpret=False)

    assert _cuda(f, acc, x, w, i).count(TRITON) == 1


def test_lowering_catches_what_triton_cannot_run(monkeypatch):
    # Without fusedpar's own check, Triton's lowering rejects a block of 48 columns.
    from fusedpar.kernels.gpu.triton import _tile_config

    monkeypatch.setattr(_tile_config, "_check_block", lambda *a: None)
    f = functools.partial(gpu.triton.matmul_into, axis=0, interpret=False,
                          config={"block_n": 48})
    with pytest.raises(ValueError, match="power of 2"):
        _cuda(f, S((128, 96), jnp.bfloat16), [S((32, 64), jnp.bfloat16)],
              S((64, 96), jnp.bfloat16), S((1,), jnp.int32))


# The ops through backend="pallas_gpu" over 4 devices, forward and backward, lowered for
# CUDA with the Triton kernels (options={"kernels": "triton", "interpret": False}) and the
# ring's ppermutes.
# Per device: x (1024, 2048) bf16; the number of Triton launches per op shows one launch
# per ring step (both directions of a bidirectional all-gather step in one).
OPS = {
    "ag_rows": (lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", **kw),
                (P("x"), P()), (4 * 1024, 2048), (2048, 1024)),
    "ag_cols": (lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", gather="rhs",
                                                              dim=1, **kw),
                (P("x"), P(None, "x")), (4 * 1024, 2048), (2048, 4 * 256)),
    "ag_contract": (lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", gather="rhs",
                                                                  dim=0, **kw),
                    (P("x"), P("x")), (4 * 1024, 4 * 512), (4 * 512, 1024)),
    "rs_rows": (lambda x, w, **kw: fusedpar.matmul_reduce_scatter(x, w, "x", dim=0, **kw),
                (P("x"), P()), (4 * 1024, 2048), (2048, 1024)),
    "rs_cols": (lambda x, w, **kw: fusedpar.matmul_reduce_scatter(x, w, "x", dim=1, **kw),
                (P("x"), P()), (4 * 1024, 2048), (2048, 1024)),
}
# Forward launches on a ring of 4: one per step, and per direction for a reduce-scatter
# (its two accumulators travel separately).
FWD_LAUNCHES = {("ag_rows", False): 4, ("ag_rows", True): 4, ("ag_cols", False): 4,
                ("ag_cols", True): 4, ("ag_contract", False): 4, ("ag_contract", True): 4,
                ("rs_rows", False): 4, ("rs_rows", True): 8, ("rs_cols", False): 4,
                ("rs_cols", True): 8}


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("prim", list(OPS))
def test_ops_lower_for_cuda_with_triton_steps(prim, bidirectional):
    if len(jax.devices()) < 4:
        pytest.skip("a ring of 4 needs 4 devices (run with tests/conftest.py's 8 CPU devices)")
    op, specs, xs, ws = OPS[prim]
    kw = dict(backend="pallas_gpu", bidirectional=bidirectional,
              options={"kernels": "triton", "interpret": False})
    f = jax.shard_map(functools.partial(op, **kw), mesh=mesh((4,), ("x",)),
                      in_specs=specs, out_specs=P("x"))
    args = (S(xs, jnp.bfloat16), S(ws, jnp.bfloat16))
    fwd = _cuda(f, *args)
    assert fwd.count(TRITON) == FWD_LAUNCHES[prim, bidirectional]
    assert fwd.count("collective_permute") == 3 * (2 if bidirectional else 1)
    grad = _cuda(jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(), (0, 1)), *args)
    assert grad.count(TRITON) >= 4  # the backward's rings run on the kernels too


# -- the XLA flags the GPU ring needs to overlap -----------------------------------------


def test_gpu_overlap_flags():
    flags = fusedpar.gpu_overlap_flags()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags.split()
    assert "--xla_gpu_experimental_parallel_collective_overlap_limit=2" in flags.split()
    assert ("--xla_gpu_experimental_collective_start_as_early_as_possible=true"
            in flags.split())
    one_way = fusedpar.gpu_overlap_flags(bidirectional=False).split()
    assert one_way == [f for f in flags.split() if "overlap_limit" not in f]


def test_the_early_start_flag_needs_a_jaxlib_that_knows_it(monkeypatch):
    """XLA aborts the process on a flag it does not know: jaxlib 0.10.0 and 0.10.1 lack
    the early start, so neither the environment nor the AOT compile options get it."""
    from fusedpar._compile import _aot
    from fusedpar._hw import _xla_flags

    early = "xla_gpu_experimental_collective_start_as_early_as_possible"
    for version, present in (((0, 10, 1), False), ((0, 10, 2), True), ((0, 11, 0), True)):
        monkeypatch.setattr(_xla_flags, "_jaxlib_version", lambda v=version: v)
        assert (early in fusedpar.gpu_overlap_flags()) is present, version
        assert (early in _aot.gpu_compiler_options()) is present, version
        assert "overlap_limit=2" in fusedpar.gpu_overlap_flags(), version


def test_set_gpu_overlap_flags_keeps_the_users_flags(monkeypatch):
    from fusedpar._hw import _xla_flags

    monkeypatch.setattr(_xla_flags, "_backends_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false --foo=1")
    flags = fusedpar.set_gpu_overlap_flags()
    assert flags.split() == ["--xla_gpu_enable_latency_hiding_scheduler=false", "--foo=1",
                             "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
                             "--xla_gpu_experimental_collective_start_as_early_as_possible"
                             "=true"]
    assert fusedpar.set_gpu_overlap_flags() == flags  # idempotent


def test_set_overlap_flags_sets_both_platforms(monkeypatch):
    from fusedpar._hw import _xla_flags

    monkeypatch.setattr(_xla_flags, "_backends_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_collective_fusion=false")
    env = fusedpar.set_overlap_flags()
    assert env["XLA_FLAGS"].split() == ["--foo=1"] + fusedpar.gpu_overlap_flags().split()
    tpu = fusedpar.tpu_overlap_flags().split()
    assert env["LIBTPU_INIT_ARGS"].split() == (
        ["--xla_tpu_enable_async_collective_fusion=false"] + tpu[1:])  # yours win
    assert tpu[0] == "--xla_tpu_enable_async_collective_fusion=true"
    assert fusedpar.set_overlap_flags() == env  # idempotent
    import os

    assert os.environ["LIBTPU_INIT_ARGS"] == env["LIBTPU_INIT_ARGS"]


def test_tpu_overlap_flags_per_generation(monkeypatch):
    from fusedpar._hw import _xla_flags

    common = fusedpar.tpu_overlap_flags().split()
    v5e = fusedpar.tpu_overlap_flags("v5e").split()
    assert v5e[:len(common)] == common
    assert v5e[len(common):] == [
        "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=true",
        "--xla_enable_async_reduce_scatter_fusion=true",
        "--xla_tpu_scoped_vmem_limit_kib=32768"]
    for generation in ("v5p", "v6e"):  # the SparseCores instead of the fusion
        assert fusedpar.tpu_overlap_flags(generation).split() == common + [
            "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
            "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
            "--xla_tpu_scoped_vmem_limit_kib=32768"]
    assert fusedpar.tpu_overlap_flags("v4").split() == common  # v4 runs out of VMEM
    with pytest.raises(ValueError, match="v5e, v5p, v6e or None, got 'v5E'"):
        fusedpar.tpu_overlap_flags("v5E")
    monkeypatch.setattr(_xla_flags, "_backends_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "")  # restored after the test, as both are
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536")
    env = fusedpar.set_overlap_flags(tpu_generation="v5e")
    assert env["LIBTPU_INIT_ARGS"].split() == (
        ["--xla_tpu_scoped_vmem_limit_kib=65536"] + v5e[:-1])  # yours win
    with pytest.raises(ValueError, match="generation must be one of"):
        fusedpar.set_overlap_flags(tpu_generation="v9")
    # `fusedpar.aot` compiles a slice with its own generation's flags.
    from fusedpar._compile import _aot

    names = {"v5e:2x4": v5e, "v6e:2x4": fusedpar.tpu_overlap_flags("v6e").split(),
             "v4:2x2x2": common}
    for target, flags in names.items():
        assert ["--" + f"{k}={str(v).lower()}" for k, v in _aot.compiler_options(
            target).items()] == flags, target


def test_set_gpu_overlap_flags_too_late():
    jax.devices()  # the test session's backends are up: XLA has read its flags
    with pytest.raises(RuntimeError, match="before JAX starts its backends"):
        fusedpar.set_gpu_overlap_flags()
    with pytest.raises(RuntimeError, match="XLA has already read XLA_FLAGS"):
        fusedpar.set_overlap_flags()


def test_set_gpu_overlap_flags_before_jax_starts():
    # `import fusedpar` must not start JAX's backends, or the helper could never work.
    import os
    import subprocess
    import sys

    code = ("import fusedpar, os; fusedpar.set_gpu_overlap_flags(); import jax; "
            "jax.devices(); print(os.environ['XLA_FLAGS'])")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == fusedpar.gpu_overlap_flags().split()
