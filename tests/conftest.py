"""8 simulated CPU devices for every test, set up before JAX starts.

NPROC: TPU interpret mode runs each simulated device on a thread of the CPU client's
pool; with fewer threads than devices + 1 a collective kernel deadlocks (measured on a
2-core machine: NPROC=8 hangs with 8 devices, NPROC=9 works). Importing fusedpar after
the devices are configured raises NPROC to match (fusedpar._core._interpret).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The deviceless compile tests (tests/test_aot*.py) load libtpu and JAX's CUDA plugin on a
# host with neither: see fusedpar/aot.py, which sets the same before JAX starts.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import fusedpar  # noqa: E402,F401 - sets NPROC for the 8 devices before JAX starts

import pytest  # noqa: E402


def pytest_configure(config):
    # On a host with an accelerator the default devices are the accelerator's (a lent GPU
    # machine has one): only the CPU platform must have the 8 simulated devices.
    assert len(jax.devices("cpu")) >= 8, "tests need 8 simulated CPU devices; JAX started too early"


@pytest.fixture(autouse=True)
def _reset_interpret_state():
    """After a Pallas TPU kernel raises in interpret mode its state must be reset."""
    yield
    try:
        from jax.experimental.pallas import tpu as pltpu

        pltpu.reset_tpu_interpret_mode_state()
    except Exception:
        pass
