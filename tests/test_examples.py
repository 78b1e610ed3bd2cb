"""The README's ops example is examples/ops.py verbatim, and it runs and agrees with lax."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_quotes_the_example_verbatim():
    example = (ROOT / "examples" / "ops.py").read_text().strip()
    assert example in (ROOT / "README.md").read_text()


@pytest.mark.timeout(300)
def test_ops_example_runs():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ops.py")], env=env,
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    values = re.search(r"max \|fused - lax\|: ([0-9.e+-]+)", out.stdout)
    grads = re.search(r"max \|grad difference\| / max \|grad\|: ([0-9.e+-]+)", out.stdout)
    assert values and float(values.group(1)) < 1e-4, out.stdout
    assert grads and float(grads.group(1)) < 2e-5, out.stdout  # f32: a few ulps
    assert "reference: auto:" in out.stdout
