"""Run the benchmarks on a TPU host and write its results, in one command.

    python bench/run_tpu.py    # -> bench/results-tpu.json, RESULTS-tpu.md, results-tpu.png

Runs `pytest bench/test_op_speed.py bench/test_tpu_speed.py --benchmark-only` with
`FUSEDPAR_BENCH_SIZES=accelerator` (bfloat16, 4096^3 and 8192^3, rings up to the host's
devices) in a child process, then bench/report.py on its JSON. This process does not
start JAX: a TPU host's chips belong to one process at a time. Nothing is written unless
the fused TPU kernels ran, i.e. on a TPU host. Extra arguments go to pytest (e.g.
`-k agm_lhs`).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    env = dict(os.environ, FUSEDPAR_BENCH_SIZES="accelerator")
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(tmp, "results-tpu.json")
        subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                        str(HERE / "test_op_speed.py"), str(HERE / "test_tpu_speed.py"),
                        "--benchmark-only", f"--benchmark-json={raw}", *argv],
                       cwd=HERE.parent, env=env, check=False)
        rows = json.loads(raw.read_text())["benchmarks"] if raw.exists() else []
        kernels = [r for r in rows if str((r.get("extra_info") or {}).get("backend", ""))
                   .startswith("pallas_tpu")]
        if not kernels:
            raise SystemExit("bench/run_tpu.py: no fused TPU kernel was timed (is this a TPU "
                             "host? JAX's default backend must be 'tpu'); nothing written.")
        out = HERE / "results-tpu.json"
        out.write_text(raw.read_text())
    sys.path.insert(0, str(HERE))
    import report

    report.main([str(out), "--out", str(HERE / "RESULTS-tpu.md"),
                 "--plot", str(HERE / "results-tpu.png"),
                 "--note", "TPU run: `python bench/run_tpu.py` (FUSEDPAR_BENCH_SIZES="
                           "accelerator). `pallas_tpu`: the fused kernels; the `step` groups "
                           "set one step kernel beside `jnp.dot`."])


if __name__ == "__main__":
    main()
