"""Importing fusedpar keeps JAX from starting platforms the host has no device for.

With the aot extra installed (libtpu and JAX's CUDA plugin), `jax.devices()` on a host
with neither a TPU nor a GPU printed a 30-line CUDA plugin traceback ("Unable to load
CUDA") and, once libtpu loaded, its `INVALID_ARGUMENT ... TPU worker hostnames`; so did
the demo, the tests, and compiling for a TPU slice. Each check runs in a fresh process.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from fusedpar._hw import _platforms

pytestmark = pytest.mark.timeout(120)

_START = """
import fusedpar, jax
print(jax.devices()[0].platform, jax.config.jax_platforms)
if {aot}:  # compile-only devices of a TPU slice and of 8 H100s: libtpu and CUDA load
    from fusedpar import aot
    print(len(aot.devices("v5e:2x4")), len(aot.devices("h100x8")))
"""


def _run(code):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_jax_starts_quietly_after_importing_fusedpar():
    aot = all(importlib.util.find_spec(m) for m in ("libtpu", "jax_plugins.xla_cuda12"))
    out = _run(_START.format(aot=aot))
    for word in ("Error", "Traceback", "INVALID_ARGUMENT"):
        assert word not in out.stderr, out.stderr
    if not _platforms._attached():  # nothing but the CPU here: that is what JAX starts
        assert out.stdout.split("\n")[0] == "cpu cpu", out.stdout


def test_a_platform_the_user_chose_is_kept():
    out = _run("import jax; jax.config.update('jax_platforms', 'cpu,tpu')\n"
               "import fusedpar; print(jax.config.jax_platforms)")
    assert out.stdout.strip() == "cpu,tpu"
