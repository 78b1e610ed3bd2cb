"""fusedpar across processes: 2 processes x 4 CPU devices equal 1 process x 8 devices.

`examples/multihost.py` runs in two child processes joined by `jax.distributed` on the
loopback address (gloo CPU collectives), over one 8-device mesh whose rings cross the
process boundary. Its results are compared with the same computation run here, in the
test process, on its 8 simulated devices.

Bounded: the children are polled; the first one that exits non-zero, or the time limit,
kills the others and fails the test with their output (a dead peer would otherwise leave
the survivor waiting in a collective).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest

from helpers import assert_close

pytestmark = pytest.mark.timeout(240)

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multihost.py"
PROCESSES, LOCAL_DEVICES = 2, 4


def _example():
    spec = importlib.util.spec_from_file_location("fusedpar_multihost_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env():
    env = dict(os.environ)
    # conftest asked for 8 devices in this process; each child simulates its own 4.
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env["NPROC"] = str(max(int(env.get("NPROC", "0") or 0), LOCAL_DEVICES + 1))
    return env


def _tail(path, n=3000):
    text = pathlib.Path(path).read_text(errors="replace")
    # Drop gloo's per-rank connection chatter; keep what explains a failure.
    lines = [ln for ln in text.splitlines() if not ln.startswith("[Gloo]")]
    return "\n".join(lines)[-n:]


@contextlib.contextmanager
def processes(commands, logdir):
    """Start `commands`; on leaving the block, kill whichever are still running."""
    procs, logs = [], []
    try:
        for i, cmd in enumerate(commands):
            logs.append(os.path.join(logdir, f"process{i}.log"))
            with open(logs[-1], "wb") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                              env=_child_env(), cwd=ROOT))
        yield procs, logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait(procs, logs, timeout):
    """Return every process's output once all exit 0; raise as soon as one does not.

    Raises `RuntimeError` naming the failed process (or the timeout) with the tail of
    every process's output (the caller's `processes` block then kills the rest).
    """
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            why = f"process {failed[0]} exited with code {codes[failed[0]]}"
            break
        if all(c == 0 for c in codes):
            return [_tail(log) for log in logs]
        if time.monotonic() > deadline:
            why = f"timed out after {timeout} s (exit codes so far: {codes})"
            break
        time.sleep(0.1)
    outputs = "\n".join(f"--- process {i} ---\n{_tail(log)}" for i, log in enumerate(logs))
    raise RuntimeError(f"multi-process run failed: {why}\n{outputs}")


def run_processes(commands, timeout, logdir):
    with processes(commands, logdir) as (procs, logs):
        return wait(procs, logs, timeout)


def _commands(port, out):
    return [[sys.executable, str(EXAMPLE), "--process-id", str(i),
             "--num-processes", str(PROCESSES), "--coordinator", f"127.0.0.1:{port}",
             "--local-devices", str(LOCAL_DEVICES), "--init-timeout", "60"]
            + (["--out", out] if i == 0 else []) for i in range(PROCESSES)]


def test_two_processes_equal_one():
    example = _example()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.npz")
        with processes(_commands(_free_port(), out), tmp) as (procs, logs):
            # The single-process run, here on the 8 simulated CPU devices (also on a host
            # whose default devices are an accelerator's), while the children run.
            cpu = jax.devices("cpu")
            want = example.results(example.build_mesh(cpu))
            want.update(example.model_results(example.build_model_mesh(cpu)))
            outputs = wait(procs, logs, 180)
        assert any(f"process 1/{PROCESSES}: {LOCAL_DEVICES} local of 8 devices" in o
                   for o in outputs), outputs
        with np.load(out) as f:
            got = {k: f[k] for k in f.files}

    assert sorted(got) == sorted(want)
    # ops: cases x backends x (y, dx, dw); model: 2 backends x (y, dx, 3 x (dw, db))
    assert len(got) == 5 * len(example.BACKENDS) * 3 + len(example.BACKENDS) * 8
    identical = [k for k in sorted(want) if np.array_equal(got[k], want[k])]
    print(f"{len(identical)} of {len(want)} arrays bitwise equal to the 1-process run; "
          f"the others: {sorted(set(want) - set(identical))}")
    for key in sorted(want):
        assert_close(got[key], want[key], np.float32, f"2 processes vs 1: {key}")
        # And every backend equals the reference, within the multi-process run itself.
        case, backend, output = key.split("/")
        assert_close(got[key], got[f"{case}/reference/{output}"], np.float32,
                     f"2 processes, {key} vs reference")


def test_dead_process_fails_fast():
    """A peer that dies before connecting ends the run with an error, not a wait."""
    with tempfile.TemporaryDirectory() as tmp:
        commands = _commands(_free_port(), os.path.join(tmp, "unused.npz"))
        commands[1] = [sys.executable, "-c", "import sys; sys.exit(3)"]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="process 1 exited with code 3"):
            run_processes(commands, 60, tmp)
        assert time.monotonic() - start < 30


def test_hung_process_times_out():
    with tempfile.TemporaryDirectory() as tmp:
        commands = [[sys.executable, "-c", "import time; time.sleep(600)"]]
        with pytest.raises(RuntimeError, match="timed out after 1 s"):
            run_processes(commands, 1, tmp)
