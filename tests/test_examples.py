"""The examples run, and each one is quoted verbatim in the README or a page of docs/."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _run(name):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name)], env=env,
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("name", ["ops.py", "parallelize.py", "gpt.py", "aot_program.py",
                                  "checkpoint_orbax.py", "serve.py"])
def test_docs_quote_the_example_verbatim(name):
    example = (ROOT / "examples" / name).read_text().strip()
    assert any(example in page.read_text() for page in DOCS), name


@pytest.mark.timeout(300)
def test_ops_example_runs():
    stdout = _run("ops.py")
    values = re.search(r"max \|fused - lax\|: ([0-9.e+-]+)", stdout)
    grads = re.search(r"max \|grad difference\| / max \|grad\|: ([0-9.e+-]+)", stdout)
    assert values and float(values.group(1)) < 1e-4, stdout
    assert grads and float(grads.group(1)) < 2e-5, stdout  # f32: a few ulps
    assert "reference: auto:" in stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_orbax_example_runs():
    """A sharded model saved with orbax restores sharded into a skeleton from
    fusedpar.shard (skipped where orbax-checkpoint, not a fusedpar dependency, is absent)."""
    pytest.importorskip("orbax.checkpoint")
    assert _run("checkpoint_orbax.py").strip().endswith("P('tp', 'fsdp')")


@pytest.mark.timeout(300)
def test_parallelize_example_runs():
    lines = _run("parallelize.py").split("\n")
    assert lines[0].endswith("('tp', 'fsdp')"), lines  # the up weight's PartitionSpec
    losses = [float(v) for v in lines[1:4]]
    assert losses[2] < losses[1] < losses[0], losses  # three SGD steps lower the loss
    assert lines[4] == "(8,)", lines


@pytest.mark.timeout(300)
def test_gpt_example_runs():
    """Every plan's training losses equal the dense model's (f32: a few ulps of the
    loss), the loss goes down, the plan table and the shard_map run are printed."""
    stdout = _run("gpt.py")
    runs = dict(re.findall(r"^(\S+) +losses (\[[^]]*\])", stdout, re.M))
    assert list(runs) == ["dense", "TP", "TP+SP", "FSDPxTP", "FSDPxTP-q8"], stdout
    dense = [float(v) for v in runs["dense"].strip("[]").split(",")]
    assert dense[2] < dense[1] < dense[0], dense
    for plan in ("TP", "TP+SP", "FSDPxTP"):
        losses = [float(v) for v in runs[plan].strip("[]").split(",")]
        diff = float(re.search(rf"^{re.escape(plan)} .*max \|loss - dense\| (\S+) ", stdout,
                               re.M).group(1))
        assert diff <= 2e-5 * max(dense), (plan, diff)  # printed losses are rounded
        assert max(abs(a - b) for a, b in zip(losses, dense)) <= 1e-5 + 2e-5 * max(dense)
    # int8 FSDP weight gathers and fp8 sequence-parallel gathers: the target is a
    # final loss within 2% of the unquantized run's; the losses differ (it did quantize).
    q8 = [float(v) for v in runs["FSDPxTP-q8"].strip("[]").split(",")]
    assert abs(q8[-1] / dense[-1] - 1) <= 0.02, (q8, dense)
    assert q8 != dense and q8[2] < q8[1] < q8[0], (q8, dense)
    assert "| embed             | Embedding    | Row('tp', sequence_parallel) + FSDP('fsdp')" in stdout
    assert "shard_map specs: tokens P(None, None), logits P(None, None, 'tp')" in stdout
    local = float(re.search(r"max \|local - dense\| (\S+)", stdout).group(1))
    assert local <= 2e-5 * 10, local  # logits of magnitude ~10 at most


@pytest.mark.timeout(300)
def test_serve_example_runs():
    """Prefill and greedy decode with a tensor-parallel KV cache give the dense model's
    tokens, with two traces (prompts, one token) and the cache still laid out by heads."""
    stdout = _run("serve.py")
    assert "traced: [(4, 6), (4, 1)]" in stdout, stdout
    assert "cache: P('data', None, None, 'tp')" in stdout, stdout
    assert "equal to the dense model's: True" in stdout, stdout
