"""TPU interpret mode never hangs for want of threads: fusedpar sets NPROC up before JAX
starts, and an op refuses to trace an interpreted kernel the thread pool cannot run."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from helpers import mesh

pytestmark = pytest.mark.timeout(120)


def test_too_few_threads_is_an_error_naming_nproc(monkeypatch):
    # The pool was sized when JAX started; the variable says what it was started with.
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("NPROC", "4")
    m = mesh((8,), ("x",))
    f = jax.shard_map(lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="pallas_tpu"),
                      mesh=m, in_specs=(P("x"), P()), out_specs=P(), check_vma=False)
    with pytest.raises(RuntimeError, match=r"all_gather_matmul: .*8 simulated devices.*"
                                           r"at least 9 threads \(NPROC=4\).*NPROC=9"):
        jax.jit(f).trace(jnp.ones((64, 128)), jnp.ones((128, 128)))


def test_enough_threads_or_no_interpreter_passes(monkeypatch):
    from fusedpar._core import _interpret
    from fusedpar._hw._target import Target

    cpu = Target("cpu", "cpu")
    monkeypatch.setenv("NPROC", "4")
    _interpret.check_threads("op", "ring", None, cpu)  # no kernel
    _interpret.check_threads("op", "pallas_tpu", {"interpret": False}, cpu)  # Mosaic
    _interpret.check_threads("op", "pallas", None, Target("gpu", "NVIDIA H100"))  # GPU kernels
    _interpret.check_threads("op", "pallas_tpu", None, Target("tpu", "TPU v5 lite"))  # Mosaic
    monkeypatch.setenv("NPROC", "9")
    _interpret.check_threads("op", "pallas_tpu", None, cpu)  # 8 devices, 9 threads


@pytest.mark.parametrize("how", ["config", "xla_flags"])
def test_import_sets_nproc_for_the_configured_devices(how):
    configure = ("jax.config.update('jax_num_cpu_devices', 8); " if how == "config" else "")
    code = ("import os, jax; " + configure + "import fusedpar; print(os.environ['NPROC']); "
            "print(jax.device_count())")
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "PJRT_NPROC",
                                                            "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    if how == "xla_flags":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["9", "8"]
