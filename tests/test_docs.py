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


# A number a comment right after a `print(` line quotes: what the print shows ("986 us",
# "1.21x", "0.000849"), checked against the run's output so that a page cannot go stale.
_QUOTED = re.compile(r"(?<![\w.])(\d[\d,]*\.\d+|\d[\d,]*(?= ?(?:us|ms|µs)\b)|\d[\d,]*(?:\.\d+)?x\b)")


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e-?\d+)?")


def shown(quoted: str, printed: list[float]) -> bool:
    """Whether a printed number rounds to `quoted` at the digits it quotes."""
    q = quoted.rstrip("x").replace(",", "")
    half = 0.5 * 10.0 ** -(len(q.partition(".")[2]))
    return any(abs(p - float(q)) <= half * (1 + 1e-9) for p in printed)


def quoted_numbers(program: str) -> list[str]:
    """The numbers quoted by the comments on and right after each `print(` statement."""
    out, after_print, depth = [], False, 0
    for line in program.splitlines():
        code, _, comment = line.partition("#")
        if not code.strip():  # a comment line
            if after_print and depth == 0:
                out += _QUOTED.findall(comment)
            continue
        if depth == 0:
            after_print = "print(" in code
        depth = max(depth + code.count("(") - code.count(")"), 0) if after_print else 0
        if after_print and depth == 0:
            out += _QUOTED.findall(comment)
    return out


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
    printed = [float(n.replace(",", "")) for n in _NUMBER.findall(out.stdout)]
    stale = [n for n in quoted_numbers(_program(page)) if not shown(n, printed)]
    assert not stale, f"{page.name} quotes {stale}, which its code no longer prints"
