"""bench/gpu_overlap.py reads a compiled schedule right: which transfers enclose compute.

The GPU schedules themselves come from 8 mock H100s on a GPU machine (bench/RESULTS.md);
here the reader is checked on hand-written GPU-style schedules and on a real CPU program,
whose collective-permutes are synchronous (nothing can overlap).
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import fusedpar
from helpers import mesh

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import gpu_overlap  # noqa: E402

# A 3-step ring as XLA's GPU scheduler writes it: each transfer starts before a step's
# matmul (a cuBLAS gemm, then a fusion with a dot inside) and is done after it.
OVERLAPPED = """\
HloModule ring, is_scheduled=true

%fused_dot (p0: f16[8,8], p1: f16[8,8]) -> f16[8,8] {
  %p0 = f16[8,8]{1,0} parameter(0)
  %p1 = f16[8,8]{1,0} parameter(1)
  ROOT %d = f16[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f16[8,8], w: f16[8,8]) -> f16[8,8] {
  %x = f16[8,8]{1,0} parameter(0)
  %w = f16[8,8]{1,0} parameter(1)
  %cp-start = (f16[8,8]{1,0}, f16[8,8]{1,0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,0}}
  %gemm = (f16[8,8]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm"
  %cp-done = f16[8,8]{1,0} collective-permute-done(%cp-start)
  %cp-start.1 = (f16[8,8]{1,0}, f16[8,8]{1,0}) collective-permute-start(%cp-done), channel_id=2, source_target_pairs={{0,1},{1,2},{2,0}}
  %fusion = f16[8,8]{1,0} fusion(%cp-done, %w), kind=kCustom, calls=%fused_dot
  %cp-done.1 = f16[8,8]{1,0} collective-permute-done(%cp-start.1)
  ROOT %kernel = f16[8,8]{1,0} custom-call(%cp-done.1, %w), custom_call_target="mosaic_gpu"
}
"""


def test_overlapped_schedule():
    s = gpu_overlap.analyse(OVERLAPPED)
    assert (s.transfers, s.transfers_overlapping) == (2, 2)
    assert (s.compute_steps, s.exposed) == (3, 1)  # only the last step has nothing in flight


def test_serialised_schedule():
    # The same program with every transfer done before the matmul that follows it.
    lines = OVERLAPPED.splitlines()
    moved = []
    for line in lines:
        if "collective-permute-done" in line:
            moved.insert(len(moved) - 1, line)  # before the matmul just written
        else:
            moved.append(line)
    s = gpu_overlap.analyse("\n".join(moved))
    assert (s.transfers, s.transfers_overlapping) == (2, 0)
    assert (s.compute_steps, s.exposed) == (3, 3)


def test_cpu_program_has_synchronous_transfers():
    m = mesh((4,), ("x",))
    f = jax.jit(jax.shard_map(
        lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="ring", bidirectional=False),
        mesh=m, in_specs=(P("x"), P()), out_specs=P("x")))
    text = f.lower(jax.ShapeDtypeStruct((64, 32), jnp.float32),
                   jax.ShapeDtypeStruct((32, 16), jnp.float32)).compile().as_text()
    s = gpu_overlap.analyse(text)
    assert (s.transfers, s.transfers_overlapping, s.compute_steps) == (3, 0, 4)
    assert s.exposed == 4
