"""Everything a GPU host measures, in one command (one NVIDIA GPU is enough).

    python bench/run_gpu.py [--out DIR]   # default: bench/

1. the GPU tests on the real device (`tests/test_gpu_triton.py`, `tests/test_gpu_mosaic.py`,
   `tests/test_gpu_lowering.py`; rings of more than one device skip) -> `gpu-tests.log`;
2. `bench/test_gpu_steps.py` with `FUSEDPAR_BENCH_SIZES=accelerator` (step kernels vs
   `jnp.dot`, the ops on a ring of one device, the decomposition into N ring steps),
   with `fusedpar.gpu_overlap_flags()` set -> `results-gpu.json`, `RESULTS-gpu.md`;
3. the cost model fitted to step 2 (`bench/calibrate_gpu.py`), appended too.

What overlaps on 8 H100s needs no GPU: `python -m fusedpar.aot --target h100x8 ...` compiles
for them on any machine (`bench/aot_results.py` writes `RESULTS-aot.md`).

Each step runs in a child process (XLA reads its flags once per process); a step that
fails is reported and the next one still runs. Nothing is written off a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ["tests/test_gpu_triton.py", "tests/test_gpu_mosaic.py", "tests/test_gpu_lowering.py"]


def _run(cmd, log, **kw):
    print("$", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, **kw)
    print(f"  exit {done.returncode} (log: {log})", flush=True)
    return done.returncode


def _platform():
    code = "import jax; print(jax.default_backend(), jax.devices()[0].device_kind)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return done.stdout.strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE), help="where the results go")
    args = parser.parse_args(argv)
    device = _platform()
    if not device.startswith("gpu"):
        raise SystemExit(f"bench/run_gpu.py: JAX's default backend is not a GPU here "
                         f"({device or 'no JAX'}); nothing written.")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu-tests.log"
    # conftest.py sets up 8 simulated CPU devices for the CPU suite: not wanted here.
    _run([sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q",
          "-rs", *TESTS], log)

    sys.path.insert(0, str(ROOT))
    import fusedpar

    results = out / "results-gpu.json"
    env = dict(os.environ, FUSEDPAR_BENCH_SIZES="accelerator",
               XLA_FLAGS=fusedpar.gpu_overlap_flags())
    _run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
          str(HERE / "test_gpu_steps.py"), "--benchmark-only",
          f"--benchmark-json={results}"], out / "bench-gpu.log", env=env)

    sys.path.insert(0, str(HERE))
    import calibrate_gpu
    import test_gpu_steps

    lines = []
    if results.exists():
        lines += test_gpu_steps.markdown([str(results)]).splitlines()
        try:
            fitted = calibrate_gpu.fit(json.loads(results.read_text()))
            lines += ["", "### Cost model fitted to these numbers (`bench/calibrate_gpu.py`)",
                      "", "```", json.dumps(fitted, indent=1), "```"]
        except ValueError as e:
            lines += ["", f"Calibration: {e}"]
    (out / "RESULTS-gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
