"""A tiny run of the demo: the parallel model trains like the dense one."""

import jax
import numpy as np
import pytest

from fusedpar import demo
from helpers import tolerance

pytestmark = pytest.mark.timeout(120)


def test_demo_matches_dense_training(capsys):
    rows = demo.main(["--steps", "2", "--batch", "4", "--seq", "8", "--dim", "16",
                      "--hidden", "32", "--blocks", "1", "--lr", "0.5", "--quiet"])
    out = capsys.readouterr().out
    assert "| backend" in out and "bytes sent/device/step" in out
    by = {r["backend"]: r for r in rows}
    assert set(by) == {"dense (1 device)", "reference", "ring"}
    dense = by["dense (1 device)"]
    for name in ("reference", "ring"):
        r = by[name]
        # Parameters are O(0.1-1): the f32 matmul tolerance, scaled to that magnitude.
        assert r["max_diff"] <= 4 * tolerance(np.float32), (name, r["max_diff"])
        assert r["final_loss"] == pytest.approx(dense["final_loss"], rel=1e-5)
        assert r["bytes_per_step"] == demo.bytes_per_step(demo._parse(
            ["--batch", "4", "--seq", "8", "--dim", "16", "--hidden", "32", "--blocks", "1"]))


def test_demo_bytes_per_step_formula():
    # mesh 2x4, batch 8, seq 64, dim 64, hidden 256, f32, 2 blocks: per block four
    # sequence-parallel collectives of 3 blocks of (4, 16, 64) f32, plus two layers' FSDP
    # gather and gradient scatter of a (64, 32) f32 shard.
    args = demo._parse([])
    per_block = 4 * 3 * (4 * 16 * 64 * 4) + 2 * 2 * (64 * 32 * 4)
    assert demo.bytes_per_step(args) == 2 * per_block


def test_demo_rejects_a_mesh_that_does_not_divide():
    with pytest.raises(SystemExit):
        demo._parse(["--mesh", "2x3"])  # seq 64 does not divide by 3
    assert len(jax.devices()) >= 8


@pytest.mark.slow
def test_demo_runs_the_pallas_backends_at_the_default_mesh(capsys):
    # The default 2x4 mesh (8 simulated devices: the TPU kernels interpreted, one thread
    # each) at small shapes (per-device blocks of 16 rows, as the Triton steps need); `python -m fusedpar.demo --backends pallas_tpu` is the same
    # program at the default shapes.
    rows = demo.main(["--steps", "2", "--batch", "2", "--seq", "128", "--dim", "16",
                      "--hidden", "64", "--blocks", "1", "--lr", "0.5", "--quiet",
                      "--backends", "pallas_tpu,pallas_gpu"])
    assert "fsdp=2 x tp=4" in capsys.readouterr().out
    by = {r["backend"]: r for r in rows}
    for name in ("pallas_tpu", "pallas_gpu"):
        assert by[name]["max_diff"] <= 4 * tolerance(np.float32), (name, by[name])
        assert by[name]["final_loss"] == pytest.approx(by["dense (1 device)"]["final_loss"],
                                                       rel=1e-5)
