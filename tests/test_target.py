"""The hardware a program is for comes from its mesh's devices, not from the machine
tracing it: compile-only meshes of H100s and TPU slices (fusedpar.aot) decide like the
hardware would, and the simulated CPU devices stay "cpu"."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fusedpar
from fusedpar._hw import _target
from fusedpar import cost_model
from fusedpar._hw._target import Target
from helpers import mesh as cpu_mesh, needs_aot


AGM = "all_gather_matmul"
# target name -> (platform, device kind, TPU generation, compute capability, cost preset)
EXPECTED = {
    "h100x8": ("gpu", "NVIDIA H100 80GB HBM3", None, (9, 0), "h100_sxm"),
    "v5e:2x4": ("tpu", "TPU v5 lite", "v5e", None, "tpu_v5e"),
    "v5p:2x2x2": ("tpu", "TPU v5", "v5p", None, "tpu_v5p"),
    "v6e:2x4": ("tpu", "TPU v6 lite", "v6e", None, "tpu_v6e"),
    "v4:2x2x2": ("tpu", "TPU v4", "v4", None, "tpu_v4"),
}


def _aot_mesh(name, shape=(8,), axes=("x",)):
    from fusedpar import aot

    return aot.mesh(name, shape, axes)


def test_target_table():
    assert Target("gpu", "NVIDIA A100-SXM4-80GB").compute_capability == (8, 0)
    assert Target("gpu", "NVIDIA GeForce RTX 4090").compute_capability == (8, 9)
    assert Target("gpu", "NVIDIA H200").cost_preset == "h200"
    assert Target("gpu", "Some Future GPU").compute_capability is None
    assert Target("cuda", "NVIDIA H100 80GB HBM3").platform == "gpu"
    assert Target("tpu", "TPU v6 lite").tpu_generation == "v6e"
    assert Target("tpu", "TPU v5").cost_preset == "tpu_v5p"
    assert Target("tpu").cost_preset == "tpu_v5e"  # a platform name alone: the default
    assert Target("cpu", "cpu").interpret and not Target("tpu", "TPU v5 lite").interpret
    assert "TPU v5e" in str(Target("tpu", "TPU v5 lite", 1))
    with pytest.raises(ValueError, match="target platform must be one of cpu, gpu, tpu"):
        Target("metal")


def test_cpu_mesh_is_the_cpu_target():
    m = cpu_mesh((4,), ("x",))
    seen = []

    def body(x):
        seen.append(_target.current())
        return x

    jax.jit(jax.shard_map(body, mesh=m, in_specs=P("x"), out_specs=P("x"))).trace(
        jnp.zeros((8, 4)))
    assert seen[0].platform == "cpu" and seen[0].interpret


@needs_aot
@pytest.mark.parametrize("name", list(EXPECTED))
def test_target_from_the_mesh(name):
    platform, kind, generation, cc, preset = EXPECTED[name]
    m = _aot_mesh(name)
    t = _target.of_mesh(m)
    assert (t.platform, t.device_kind, t.tpu_generation, t.compute_capability,
            t.cost_preset) == (platform, kind, generation, cc, preset)
    if generation in ("v4", "v5p"):
        assert t.num_cores == 2  # megacore: one device per chip
    # The same target inside shard_map (the abstract mesh), on global arrays under
    # jax.set_mesh, and from an array's sharding with no mesh in context.
    seen = []

    def body(x):
        seen.append(_target.current())
        return x

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(m, P("x")))
    jax.jit(jax.shard_map(body, mesh=m, in_specs=P("x"), out_specs=P("x"))).trace(x)
    with jax.set_mesh(m):
        jax.jit(lambda a: (seen.append(_target.current()), a)[1]).trace(x)
    jax.jit(lambda a: (seen.append(_target.current(a)), a)[1]).trace(x)
    assert seen == [t, t, t]


@needs_aot
def test_explain_decides_for_the_mesh():
    # A size whose ring pays on both targets (communication a large share of the work).
    x = jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
    for name in ("h100x8", "v5e:2x4"):
        m = _aot_mesh(name)
        t = _target.of_mesh(m)
        with jax.set_mesh(m):
            in_context = fusedpar.explain(AGM, x, w, 8)
        choice = fusedpar.explain(AGM, x, w, 8, target=m)
        assert choice == in_context and choice.target == t
        assert str(t) in str(choice)
        # auto asks the cost model for this target, not for the CPU it runs on: the ring
        # (or the kernels) beat the reference at this size, by the target's own estimate.
        hw = cost_model.get_hardware(t.cost_preset)
        assert hw.name in choice.reason and choice.backend != "reference"
        est = cost_model.estimate(AGM, x.shape, w.shape, 8, "bfloat16", hw,
                                  bidirectional=choice.bidirectional)
        assert est[choice.backend if choice.backend != "pallas" else "pallas"] < \
            est["reference"]
        # "pallas" stands for the target's kernels.
        pallas = fusedpar.explain(AGM, x, w, 8, backend="pallas", target=m,
                                  bidirectional=False)
        assert pallas.backend == "pallas"
    cpu = fusedpar.explain(AGM, x, w, 8, target=cpu_mesh((8,), ("x",)))
    assert cpu.backend == "reference" and cpu.target.platform == "cpu"


def test_explain_says_which_kernels_pallas_became():
    """"pallas" names its kernel family and whether it is compiled (for which chip) or
    interpreted; a platform named alone is not spoken of as a mesh."""
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    cpu = fusedpar.explain(AGM, x, w, 8, backend="pallas", target=cpu_mesh((8,), ("x",)))
    assert cpu.kernels == ("pallas_tpu: one fused TPU kernel for ag_rows, the ring inside "
                           "it, in TPU interpret mode (every device, DMA and semaphore "
                           "simulated on CPU)")
    assert cpu.kernels in str(cpu)
    tpu = fusedpar.explain(AGM, x, w, 8, backend="pallas", platform="tpu")
    assert tpu.kernels.endswith("compiled by Mosaic for TPU v5e, the default (no generation "
                                "named)"), tpu.kernels
    assert fusedpar.explain(AGM, x, w, 8, backend="ring", platform="tpu").kernels == ""
    with pytest.raises(NotImplementedError) as e:
        fusedpar.explain(AGM, x, w, 8, backend="pallas", platform="gpu")
    assert "mesh's devices" not in str(e.value)
    assert "only the platform 'gpu' was named, no device kind (pass target=" in str(e.value)


@needs_aot
def test_explain_says_which_kernels_pallas_became_on_the_targets():
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    h100, v5e = _aot_mesh("h100x8"), _aot_mesh("v5e:2x4")
    assert fusedpar.explain(AGM, x, w, 8, backend="pallas", target=v5e).kernels == (
        "pallas_tpu: one fused TPU kernel for ag_rows, the ring inside it, compiled by "
        "Mosaic for TPU v5e")
    assert fusedpar.explain(AGM, x, w, 8, backend="pallas", target=h100).kernels == (
        "pallas_gpu: a lax ring with Mosaic GPU (TMA, wgmma) step kernels, compiled for "
        "compute capability 9.0")
    triton = fusedpar.explain(AGM, x, w, 8, backend="pallas", target=h100,
                              options={"kernels": "triton"})
    assert "Pallas Triton step kernels" in triton.kernels


@needs_aot
def test_requests_that_contradict_the_target():
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    h100, v5e = _aot_mesh("h100x8"), _aot_mesh("v5e:2x4")
    with pytest.raises(NotImplementedError, match="not on platform 'gpu'"):
        fusedpar.explain(AGM, x, w, 8, backend="pallas_tpu", target=h100)
    with pytest.raises(NotImplementedError, match="not on 'tpu'"):
        fusedpar.explain(AGM, x, w, 8, backend="pallas_gpu", target=v5e)
    with pytest.raises(ValueError, match=r"interpret.*TPU v5 lite"):
        fusedpar.explain(AGM, x, w, 8, backend="pallas_tpu", target=v5e,
                         options={"interpret": True})
    with pytest.raises(ValueError, match=r"TPU v5 lite.*not TPU v6e"):
        fusedpar.explain(AGM, x, w, 8, backend="pallas_tpu", target=v5e,
                         options={"chip": "v6e"})
    with pytest.raises(NotImplementedError, match=r"interpret.*NVIDIA H100"):
        fusedpar.explain(AGM, x, w, 8, backend="pallas_gpu", target=h100,
                         options={"interpret": True})
    with pytest.raises(ValueError, match="pass target= or platform=, not both"):
        fusedpar.explain(AGM, x, w, 8, target=h100, platform="gpu")


@needs_aot
def test_explain_reports_missing_overlap_flags(monkeypatch):
    """On real hardware (a platform named here: this machine has none) the flags this
    process's environment lacks; not for compile-only devices, which take theirs from
    the compile call (`aot.compiler_options`)."""
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    gpu = dict(backend="ring", bidirectional=True, platform="gpu")
    choice = fusedpar.explain(AGM, x, w, 8, **gpu)
    assert ("XLA_FLAGS lacks --xla_gpu_enable_latency_hiding_scheduler=true "
            "--xla_gpu_experimental_parallel_collective_overlap_limit=2") in choice.reason
    assert "fusedpar.set_overlap_flags()" in choice.reason
    for compile_only in (_aot_mesh("h100x8"), _aot_mesh("h100x8").devices.flat[0]):
        assert "lacks" not in fusedpar.explain(AGM, x, w, 8, backend="ring",
                                               bidirectional=True, target=compile_only).reason
    monkeypatch.setenv("XLA_FLAGS", fusedpar.gpu_overlap_flags())
    assert "lacks" not in fusedpar.explain(AGM, x, w, 8, **gpu).reason
    # TPU: the flags of XLA's own collectives, read from LIBTPU_INIT_ARGS.
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=false")
    choice = fusedpar.explain(AGM, x, w, 8, backend="ring", platform="tpu")
    assert "XLA_FLAGS" not in choice.reason
    missing = [f for f in fusedpar.tpu_overlap_flags().split()
               if not f.startswith("--xla_enable_async_all_gather=")]  # the user's wins
    assert f"LIBTPU_INIT_ARGS lacks {' '.join(missing)}, which XLA's own" in choice.reason
    assert "lacks" not in fusedpar.explain(AGM, x, w, 8, backend="ring",
                                           target=_aot_mesh("v5e:2x4")).reason
    monkeypatch.setenv("LIBTPU_INIT_ARGS", fusedpar.tpu_overlap_flags())
    assert "lacks" not in fusedpar.explain(AGM, x, w, 8, backend="ring", platform="tpu").reason
