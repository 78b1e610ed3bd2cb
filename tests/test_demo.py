"""A tiny run of the demo: the parallel model trains like the dense one."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from fusedpar import demo
from helpers import tolerance

pytestmark = pytest.mark.timeout(120)
ROOT = pathlib.Path(__file__).resolve().parents[1]


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


def test_demo_fits_interpreted_tpu_kernels_to_a_mesh_without_fsdp(capsys):
    # Not given: the FSDP axis goes (it can deadlock the interpreter, see
    # demo._fit_the_interpreter) and the work shrinks; given --blocks/--steps are kept.
    args = demo._parse(["--backends", "ring,pallas_tpu", "--steps", "3"])
    note = demo._fit_the_interpreter(args, "cpu")
    assert (args.fsdp, args.tp, args.mesh, args.blocks, args.steps) == (1, 4, "1x4", 1, 3)
    assert "pallas_tpu" in note and "fsdp=1 x tp=4" in note
    for backends, platform in (("ring,pallas_gpu", "cpu"), ("pallas_tpu", "tpu")):
        args = demo._parse(["--backends", backends])
        assert demo._fit_the_interpreter(args, platform) is None
        assert (args.fsdp, args.blocks, args.steps) == (2, 2, 8)
    # An FSDP axis asked for: refused at once, saying why and what to run instead.
    with pytest.raises(SystemExit) as e:
        demo._fit_the_interpreter(demo._parse(["--backends", "pallas", "--mesh", "2x2"]), "cpu")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--mesh 2x2" in err and "deadlock" in err and "--mesh 1x2" in err, err


def _demo(*argv):
    """`python -m fusedpar.demo ARGV` as a user runs it (no XLA_FLAGS or NPROC of ours)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC", "PJRT_NPROC")}
    out = subprocess.run([sys.executable, "-m", "fusedpar.demo", "--quiet", *argv], env=env,
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = {}
    for line in out.stdout.splitlines():  # | backend | step time | loss | max diff | bytes |
        cells = [c.strip() for c in line.strip("| ").split("|")]
        if len(cells) == 5 and cells[0] != "backend" and not cells[0].startswith("-"):
            rows[cells[0]] = dict(final_loss=float(cells[2]), max_diff=float(cells[3]))
    return out.stdout, rows


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_the_documented_pallas_demo_commands_finish(backend):
    # README: `python -m fusedpar.demo --backends pallas_tpu,pallas_gpu`, here one at a time
    # at the defaults: the TPU kernels interpreted (a TP-only mesh, small work, said in the
    # output), the GPU step kernels interpreted on the default 2x4 mesh.
    stdout, rows = _demo("--backends", backend)
    assert set(rows) == {"dense (1 device)", backend}, stdout
    if backend == "pallas_tpu":
        assert "interpret mode" in stdout and "fsdp=1 x tp=4" in stdout, stdout
    else:
        assert "fsdp=2 x tp=4" in stdout, stdout
    # Parameters are O(0.1-1): the f32 matmul tolerance, scaled to that magnitude.
    assert rows[backend]["max_diff"] <= 4 * tolerance(np.float32), rows
    assert rows[backend]["final_loss"] == pytest.approx(rows["dense (1 device)"]["final_loss"],
                                                        rel=1e-5)


def test_a_stopped_step_ends_the_demo_with_a_message():
    code = ("import time; from fusedpar import demo; demo._watchdog('pallas_tpu', 3, 0.2); "
            "time.sleep(30)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "step 3 of pallas_tpu has not finished after 0.2 s" in out.stderr, out.stderr[-2000:]
