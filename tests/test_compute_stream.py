"""One device's compute stream (bench/compute_stream.py): the module that stands for it,
and the calibration of the GPU presets against what one GPU measured.

The transform is checked on hand-written HLO (every collective of the entry becomes a
parameter of its shape, what it sends stays computed as an output, the partition id is
device 0's) and by compiling its result here; the calibration by replaying the modules
an H200 compiled and ran (bench/compute-stream-compiled.tgz, bench/results-compute-
stream.json) with today's presets: the replay's compute within 15% of the measured
stream for every program.
"""

import json
import pathlib
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import compute_stream  # noqa: E402

PARTITIONED = """\
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0}, f32[8,8]{1,0})->(f32[16,8]{1,0}, f32[4,8]{1,0})}, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main.0_spmd (param: f32[4,8], param.1: f32[8,8]) -> (f32[16,8], f32[4,8]) {
  %param = f32[4,8]{1,0} parameter(0), sharding={devices=[4,1]<=[4]}
  %param.1 = f32[8,8]{1,0} parameter(1), sharding={replicated}
  %id = u32[] partition-id()
  %dot = f32[4,8]{1,0} dot(%param, %param.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag = f32[16,8]{1,0} all-gather(%dot), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %cp = f32[4,8]{1,0} collective-permute(%param), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %c = f32[4,8]{0,1} copy(%cp)
  %ar = f32[4,8]{1,0} all-reduce(%c), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (f32[16,8]{1,0}, f32[4,8]{1,0}) tuple(%ag, /*index=1*/%ar)
}
"""


def test_every_collective_becomes_a_parameter_and_what_it_sends_an_output():
    text, replaced = compute_stream.local_module(PARTITIONED)
    assert [(name, op) for name, op, _ in replaced] == [
        ("ag", "all-gather"), ("cp", "collective-permute"), ("ar", "all-reduce")]
    entry = text[text.index("ENTRY"):]
    assert "all-gather(" not in entry and "collective-permute(" not in entry
    assert "%ag = f32[16,8]{1,0} parameter(2)" in entry
    assert "%cp = f32[4,8]{1,0} parameter(3)" in entry
    assert "%id = u32[] constant(0)" in entry and "sharding=" not in entry
    # The dot the all-gather would send and the copy the all-reduce would reduce stay
    # computed; the permuted parameter needs no output (it is an input already).
    root = next(line for line in entry.splitlines() if "ROOT" in line)
    assert root.endswith("tuple(%ag, %ar, %dot, %c)"), root
    assert "num_partitions" not in text.splitlines()[0]


def test_the_local_module_compiles_and_computes_what_the_program_did():
    text, _ = compute_stream.local_module(PARTITIONED)
    compiled, args = compute_stream._compile_local(text, {})
    assert [a.shape for a in args] == [(4, 8), (8, 8), (16, 8), (4, 8), (4, 8)]
    values = compute_stream._random(args)
    ag, ar, dot, c = compiled(*values)
    np.testing.assert_allclose(dot, values[0] @ values[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(c, values[3])  # the copy of the permuted block
    np.testing.assert_array_equal(ag, values[2])


def test_a_collective_in_a_loop_body_is_refused():
    looped = PARTITIONED.replace("%add (a: f32[], b: f32[]) -> f32[] {", (
        "%body (a: f32[], b: f32[]) -> f32[] {\n"
        "  %x = f32[4] all-reduce(%a), replica_groups={{0,1}}, to_apply=%add\n}\n\n"
        "%add (a: f32[], b: f32[]) -> f32[] {"))
    with pytest.raises(ValueError, match="outside the entry computation"):
        compute_stream.local_module(looped)


@pytest.mark.parametrize("measured, compiled, preset, programs", [
    ("results-compute-stream.json", "compute-stream-compiled.tgz", "h200_sxm", 6),
    ("results-compute-stream-h100.json", "compute-stream-h100-compiled.tgz", "h100_sxm", 15),
])
def test_the_calibrated_replay_is_within_5_percent_of_the_measured_stream(
        measured, compiled, preset, programs):
    # Each GPU's own compute stream (bench/RESULTS.md): the replay of the very module the
    # GPU ran, with that GPU's calibrated preset, against the measured time per step.
    measured = json.loads((BENCH / measured).read_text())
    texts = compute_stream._compiled_texts(str(BENCH / compiled))
    assert set(texts) == set(measured["programs"]) and len(texts) == programs
    for key, row in measured["programs"].items():
        compute, parts = compute_stream._replayed_parts(texts[key], preset)
        ratio = compute / row["queued_s"]
        assert 0.95 < ratio < 1.05, f"{key}: replay {compute:.6f} s, measured {row['queued_s']}"
        assert parts["matmul"][0] == compute_stream._measured_parts(row)["matmul"][0], key
