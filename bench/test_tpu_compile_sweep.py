"""Mosaic compile time of every fused TPU kernel, per generation and ring direction.

Per device x (1024, 4096) @ w (4096, 4096) bf16 (the `fusedpar.aot` sizes), forward and
backward, compiled deviceless for v4, v5e, v5p and v6e slices of 8 (libtpu, the `aot`
extra), uni- and bidirectional: the whole grid, which it times (each compile is one
round: seconds, 2-18 s on 2 shared cores). tests/test_tpu_mosaic.py keeps one kernel
per generation at this size (v5e's bidirectional rs_rows, v6e's ag_contract, v5p's
unidirectional rs_cols) and small sizes of the rest. Every compile must still produce the fused kernel,
one forward and one or two backward: a failure here is a kernel Mosaic refuses.

    pytest bench/test_tpu_compile_sweep.py --benchmark-only
"""

import importlib.util
import time

import jax.numpy as jnp
import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu (the TPU compiler) is not installed: pip install 'fusedpar[aot]'",
                allow_module_level=True)

from fusedpar._compile import _aot_programs  # noqa: E402
from fusedpar import aot  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PRIMS = ["ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols"]
TARGETS = {"v4": "v4:2x2x2", "v5e": "v5e:2x4", "v5p": "v5p:2x2x2", "v6e": "v6e:2x4"}


@pytest.mark.parametrize("bidirectional", (False, True), ids=("uni", "bi"))
@pytest.mark.parametrize("prim", PRIMS)
@pytest.mark.parametrize("generation", list(TARGETS))
def test_kernel_compile(benchmark, generation, prim, bidirectional):
    mesh = aot.mesh(TARGETS[generation], (8,), ("x",))
    fn, args = _aot_programs.op_program(mesh, prim, "pallas_tpu",
                                        bidirectional=bidirectional, dtype=jnp.bfloat16)
    lowered = fn.lower(*args)
    texts = []

    def compile_once():
        start = time.perf_counter()
        texts.append(lowered.compile().as_text())
        return time.perf_counter() - start

    benchmark.group = "pallas_tpu compile, x (1024, 4096) @ w (4096, 4096) bf16"
    benchmark.extra_info.update(generation=generation, prim=prim,
                                bidirectional=bidirectional)
    benchmark.pedantic(compile_once, rounds=1, iterations=1)
    assert texts[-1].count("tpu_custom_call") >= 2, prim
