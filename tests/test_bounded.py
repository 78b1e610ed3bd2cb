"""A hung kernel ends its test with an error, and the kernels after it still run.

A Pallas TPU kernel interpreted on CPU that waits on a semaphore nobody signals would
block forever. pytest-timeout (every kernel test carries a timeout) interrupts it: the
interpreter's callback raises and the test fails. The interpreter's shared state is then
left half-initialised; `tests/conftest.py` resets it after every test, without which the
next kernel call fails (measured: an AssertionError in the interpreter's
`_initialize_shared_memory`). This runs such a pair of tests in a child pytest with the
project's own conftest and checks both outcomes.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TESTS = pathlib.Path(__file__).resolve().parent

CHILD = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np, pytest
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import PartitionSpec as P
    import fusedpar
    from fusedpar._core import _definition
    from helpers import assert_close, mesh

    def _wait_forever(x_ref, o_ref, sem):
        pltpu.semaphore_wait(sem, 1)  # nobody signals it
        o_ref[...] = x_ref[...]

    @pytest.mark.timeout(5)
    def test_1_hung_kernel():
        f = pl.pallas_call(_wait_forever, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                           scratch_shapes=[pltpu.SemaphoreType.REGULAR],
                           interpret=pltpu.InterpretParams())
        jax.block_until_ready(f(jnp.ones((8, 128))))

    @pytest.mark.timeout(60)
    def test_2_kernels_still_run():
        m = mesh((2,), ("x",))
        x = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)
        w = np.random.default_rng(1).standard_normal((128, 128)).astype(np.float32)
        def run(f):
            return jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P()), out_specs=P("x"),
                                         check_vma=False))(x, w)
        got = run(lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="pallas_tpu"))
        want = run(lambda x, w: _definition.all_gather_matmul(x, w, "x"))
        assert_close(got, want, jnp.float32)
''')


def test_hung_kernel_fails_and_the_next_kernel_runs():
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("conftest.py", "helpers.py"):
            shutil.copy(TESTS / name, tmp)
        pathlib.Path(tmp, "test_child.py").write_text(CHILD)
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
             "test_child.py"], cwd=tmp, env=env, capture_output=True, text=True, timeout=150)
    text = out.stdout + out.stderr
    assert "1 failed, 1 passed" in text, text[-3000:]
    assert "FAILED test_child.py::test_1_hung_kernel" in text, text[-3000:]
    assert "Timeout (>5.0s) from pytest-timeout" in text, text[-3000:]
