"""Every Python code block of README.md and docs/*.md runs.

A block that quotes a file of examples/ verbatim is that example, which
tests/test_examples.py runs. The other blocks of one page run in order in one fresh
process with 8 simulated CPU devices, like the cells of a notebook, so a page can build
on its earlier blocks.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
EXAMPLES = [p.read_text().strip() for p in sorted((ROOT / "examples").glob("*.py"))]


def python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def _program(page):
    blocks = [b for b in python_blocks(page) if b.strip() not in EXAMPLES]
    return "\n\n".join(blocks)


def test_every_page_is_found():
    assert {p.name for p in PAGES} >= {"README.md", "architecture.md", "layers.md", "ops.md",
                                       "tpu.md", "gpu.md", "cost_model.md", "testing.md",
                                       "errors.md"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", [p for p in PAGES if _program(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", NPROC="9",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _program(page)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, f"{page.name}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
