"""The lax ring's quantized transfers in programs compiled for 8 x H100 and TPU v5e:2x4.

Deviceless (`fusedpar.aot`, the `aot` extra): per device x (1024, 4096) @ w (4096, 4096)
bfloat16 (`_aot_programs`' sizes, 256 rows on TPU; the column gather's w block is
(4096, 512)), the
bidirectional ring of 8. In the compiled schedule every transfer of a quantized op
carries 8-bit values (s8, f8e4m3fn) or their float32 scales (a dimension of 1), and the
bytes a device sends per op — values and scales, as `fusedpar.aot.overlap` reads them
from the collectives' operands, and again as laid out in memory (TPU tiles pad; XLA
lays the scales out lane-dense, so nothing is padded) — are at most 0.52 of the same
op's in bfloat16 (reduce-scatters: against a bfloat16 accumulator). The figures are in
bench/RESULTS-aot.md ("Quantized transfers").
"""

import functools
import importlib.util

import jax.numpy as jnp
import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu and the CUDA compiler plugin (pip install 'fusedpar[aot]') compile "
                "these programs for hardware that is not here", allow_module_level=True)

from fusedpar._compile import _aot_programs  # noqa: E402
from fusedpar import aot  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# The column gather sends what ag_contract does with fewer scales (bench/RESULTS-aot.md).
PRIMS = ("ag_rows", "ag_contract", "rs_rows")
NARROW = {"int8": "s8", "float8_e4m3fn": "f8e4m3fn"}
TARGET = 0.52


@functools.cache
def sent(target, comm):
    """{prim: (transfers, bytes, laid-out bytes, {(dtype, has a dimension 1)} sent)} of
    the ring's forward with `comm` ("bfloat16", "int8", "float8_e4m3fn") compiled for
    `target`."""
    mesh = aot.mesh(target, (8,), ("x",))
    options = aot.compiler_options(target)
    # TPU compiles take 2-3x the GPU's on 2 cores: a quarter of the rows there (the
    # ratios are the same: one float32 scale per 4096 values).
    rows = _aot_programs.ROWS // (4 if target.startswith("v") else 1)
    out = {}
    for prim in PRIMS:  # one program each: XLA on GPU merges permutes across ops
        fn, args = _aot_programs.comm_program(
            mesh, (prim,), None if comm == "bfloat16" else getattr(jnp, comm), rows=rows)
        transfers = aot.overlap(fn.lower(*args).compile(compiler_options=options)).transfers
        mine = [t for t in transfers if t.op[0] == prim]
        out[prim] = (len(mine), sum(t.bytes for t in mine), sum(t.laid_out for t in mine),
                     {(d, 1 in dims) for t in mine for d, dims in t.arrays})
    return out


# One case per target and per dtype (float8's TPU compile, ~25 s more on 2 cores, is the
# int8 one's with another narrow dtype).
@pytest.mark.parametrize("target,comm", [
    ("h100x8", "int8"), ("h100x8", "float8_e4m3fn"), ("v5e:2x4", "int8")])
def test_quantized_ring_transfers_carry_narrow_bytes(target, comm):
    base, got = sent(target, "bfloat16"), sent(target, comm)
    for prim in PRIMS:
        n_base, bytes_base, laid_base, arrays_base = base[prim]
        n, nbytes, laid, arrays = got[prim]
        # The unquantized lax ring sends a reduce-scatter's accumulators in two chunks a
        # step (it folds the adds into the matmuls: ring._folded_reduce_scatter); a
        # quantized accumulator travels whole, once a step.
        chunks = 2 if prim.startswith("rs") else 1
        assert n_base > 0 and chunks * n >= n_base, (prim, n_base, n)
        assert {d for d, _ in arrays_base} == {"bf16"}, (prim, arrays_base)
        # Values in the narrow dtype; everything else is a float32 scale (a dimension 1).
        assert (NARROW[comm], False) in arrays, (prim, arrays)
        assert arrays <= {(NARROW[comm], False), ("f32", True)}, (prim, arrays)
        assert nbytes / bytes_base <= TARGET, (prim, nbytes, bytes_base)
        assert laid / laid_base <= TARGET, (prim, laid, laid_base)
