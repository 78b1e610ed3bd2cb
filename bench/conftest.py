"""Shared set-up for the benchmarks (`pytest bench/ --benchmark-only`).

- 8 simulated CPU devices (and NPROC >= 9, which TPU interpret mode needs; see
  tests/conftest.py), set before JAX starts. On a GPU/TPU host the real devices are used
  and the flag only affects the (unused) CPU platform.
- `FUSEDPAR_BENCH_SIZES=cpu` (default) or `accelerator` picks the problem sizes: CPU
  sizes finish the whole suite in about 4 minutes on 2 cores; accelerator sizes are
  the shapes where overlap matters (they are far too slow for a CPU).

What a run prints (set here, so `pytest bench/ --benchmark-only` reads well as it is):
pytest-benchmark's per-group tables narrowed to min, median and rounds with short names
(unless `--benchmark-columns` / `--benchmark-name` are given), the reason of every skip
(`-rs`), and at the end one summary of the whole run (bench/summary.py).

Fixtures: `bench_sizes` ("cpu" or "accelerator"), `make_mesh(n, name="x")` (a 1-D mesh of
the first `n` devices, skipping when there are fewer), `timed(benchmark, fn, *args,
group=..., **extra_info)` (compiles `fn` once outside the timing, then times it with
`block_until_ready`, recording the compile time and `extra_info`).
"""

import os
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["NPROC"] = str(max(int(os.environ.get("NPROC", "0") or 0), 9))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

SIZES = os.environ.get("FUSEDPAR_BENCH_SIZES", "cpu")
if SIZES not in ("cpu", "accelerator"):
    raise ValueError(f"FUSEDPAR_BENCH_SIZES must be 'cpu' or 'accelerator', got {SIZES!r}.")


COLUMNS = ["min", "median", "rounds"]


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark and the terminal read them
def pytest_configure(config):
    opt = config.option
    if getattr(opt, "benchmark_columns", "") is None:  # None: not given
        opt.benchmark_columns = COLUMNS
    if hasattr(opt, "benchmark_name") and not any(
            a.startswith("--benchmark-name") for a in config.invocation_params.args):
        opt.benchmark_name = "short"
    chars = opt.reportchars or ""
    if not any(c in chars for c in "saAN"):  # a, A: all outcomes; N: none
        opt.reportchars = chars + "s"


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables
def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    import summary  # bench/ is on sys.path (pytest puts a conftest's directory there)

    records = [b.as_dict(include_data=False) for b in session.benchmarks
               if not b.has_error and b.stats]
    json_path = config.getoption("benchmark_json", None)
    text = summary.render(records, cores=len(os.sched_getaffinity(0))
                          if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                          json_path=str(json_path) if json_path else None)
    if text:
        terminalreporter.write_sep("=", "fusedpar benchmark summary")
        for line in text.splitlines():
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def bench_sizes():
    return SIZES


@pytest.fixture(scope="session")
def make_mesh():
    def make(n, name="x"):
        if len(jax.devices()) < n:
            pytest.skip(f"a ring of {n} needs {n} devices; this host has {len(jax.devices())}")
        return jax.make_mesh((n,), (name,), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:n])

    return make


def _rounds(seconds_per_call, budget):
    return int(max(5, min(50, budget / max(seconds_per_call, 1e-6))))


@pytest.fixture
def timed():
    """Time `fn(*args)` (a jitted function) for pytest-benchmark, compile excluded."""

    def run(benchmark, fn, *args, group, budget=0.5, **extra_info):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))  # compile, and one warm call's worth of work
        first = time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        once = time.perf_counter() - start
        benchmark.group = group
        benchmark.extra_info.update(extra_info, first_call_s=first, platform=jax.default_backend(),
                                    device_kind=jax.devices()[0].device_kind,
                                    num_devices=len(jax.devices()), jax_version=jax.__version__,
                                    sizes=SIZES)
        return benchmark.pedantic(lambda: jax.block_until_ready(fn(*args)),
                                  rounds=_rounds(once, budget), iterations=1, warmup_rounds=0)

    return run
