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


@pytest.mark.parametrize("name", ["ops.py", "parallelize.py"])
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


@pytest.mark.timeout(300)
def test_parallelize_example_runs():
    lines = _run("parallelize.py").split("\n")
    assert lines[0].endswith("('tp', 'fsdp')"), lines  # the up weight's PartitionSpec
    losses = [float(v) for v in lines[1:4]]
    assert losses[2] < losses[1] < losses[0], losses  # three SGD steps lower the loss
    assert lines[4] == "(8,)", lines
