"""Threads for the Pallas TPU interpreter on CPU.

In TPU interpret mode every simulated device of a collective kernel blocks a thread of
the CPU client's pool while it waits for the others' DMAs and semaphores. With fewer
threads than devices + 1 the kernel deadlocks (measured on 2 cores: 8 devices hang with 8
threads and run with 9). XLA sizes that pool once, when JAX starts its CPU backend, from
the environment variable `PJRT_NPROC` or `NPROC` (else the number of cores).

- `setup_threads` (run when `fusedpar` is imported, and by the demo) raises `NPROC` to the
  configured number of CPU devices + 1 while the backend has not started yet.
- `check_threads` (run by the ops before an interpreted kernel is traced) raises an error
  naming the variable and its value instead of letting the kernel hang.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re

_VARS = ("PJRT_NPROC", "NPROC")  # XLA's order: the first one set wins


def _threads() -> tuple:
    """`(variable or None, size of the CPU client's thread pool)` read from the environment."""
    for var in _VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return var, int(value)
    try:
        return None, len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None, os.cpu_count() or 1


def _configured_devices() -> int:
    """The CPU devices JAX will simulate (`jax_num_cpu_devices` or XLA_FLAGS), or 1."""
    import jax

    n = getattr(jax.config, "jax_num_cpu_devices", -1) or -1
    flags = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                       os.environ.get("XLA_FLAGS", ""))
    return max([n, 1] + [int(f) for f in flags])


def setup_threads(devices: int | None = None) -> bool:
    """Make the CPU thread pool at least `devices` + 1 (default: the configured CPU
    devices) by raising `NPROC`, if JAX's backends have not started; True if they had not.
    """
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):  # pragma: no cover - then only check_threads
        return False
    devices = _configured_devices() if devices is None else devices
    var, threads = _threads()
    if devices > 1 and threads < devices + 1:
        os.environ[var or "NPROC"] = str(devices + 1)
    return True


def check_threads(op: str, backend: str, options, target) -> None:
    """Raise before tracing an interpreted TPU kernel that the thread pool cannot run.

    `backend`: the backend's name; whether it interprets collective kernels here is its
    own to say (`_backends.Backend.interprets`). `options`: the op's backend options
    (`interpret=False` compiles with Mosaic instead); `target`: the
    `fusedpar._hw._target.Target` of the mesh (interpreted on CPU devices).
    """
    import jax

    if not _interprets(backend, target, options):
        return
    mesh = jax.sharding.get_abstract_mesh()
    devices = mesh.size if not mesh.empty else jax.device_count()
    var, threads = _threads()
    if devices < 2 or threads >= devices + 1:
        return
    have = (f"{var}={os.environ[var]}" if var else
            f"neither PJRT_NPROC nor NPROC is set, so it has {threads} threads (the cores)")
    raise NotImplementedError(
        f"{op}: backend {backend!r} runs the TPU kernels in interpret mode here, where each "
        f"of the {devices} simulated devices blocks a thread of the CPU client's pool, which "
        f"needs at least {devices + 1} threads ({have}); the kernel would hang. Set "
        f"NPROC={devices + 1} (or more) in the environment before JAX starts (importing "
        "fusedpar before configuring the CPU devices sets it only for the devices "
        "configured by then), or use backend='ring'.")


def check_fsdp_beside(where: str, backend: str, fsdp_axis: str, tp_axis: str, target) -> None:
    """Raise before tracing a layer with tensor-parallel and FSDP styles whose ops would
    run interpreted TPU kernels beside XLA collectives (its FSDP weight gather over
    `fsdp_axis`, or its `tp_axis` psum where the kernel is the FSDP gather).

    The interpreter synchronises the simulated devices inside Python callbacks (semaphore
    waits, a barrier over every device after each kernel) that XLA's CPU runtime cannot
    see, and that runtime orders each device's independent work itself: one device can
    enter the FSDP gradient's reduce-scatter while its FSDP partner waits in a kernel for
    it, and both wait until XLA's rendezvous timeout aborts the process (the demo's 2x4
    run: 8 of 22 tries; a TP-only mesh: 27 of 27 finished)."""
    if not _interprets(backend, target):
        return
    raise NotImplementedError(
        f"{where}: backend {backend!r} runs the TPU kernels in interpret mode here "
        f"(simulated CPU devices), and this layer's FSDP axis {fsdp_axis!r} puts XLA "
        f"collectives beside them (the FSDP weight gather, or the {tp_axis!r} psum where "
        "the kernel is the gather): the interpreter's device synchronisation, which XLA's "
        "CPU runtime cannot see, can deadlock with them (the process aborts when XLA's "
        "rendezvous times out). Use backend='ring' (the same ring in lax), or a mesh with "
        f"only {tp_axis!r} (no fsdp_axis), or run on a TPU, where the kernels are "
        "compiled.")


# Whether the layer whose shard_map is being traced was called differentiated through a
# jax.checkpoint: the shard_map body is traced apart (its trace has no parents), so the
# ops inside cannot see it themselves (`remat_seen`).
_LAYER_REMAT = contextvars.ContextVar("fusedpar_layer_under_remat", default=False)


@contextlib.contextmanager
def remat_seen(backend: str, target):
    """Within it, the ops know whether the caller (a layer, outside its `shard_map`,
    whose ops run on `backend`) is differentiated through a `jax.checkpoint`
    (`check_remat`); asked only where the backend interprets kernels here."""
    token = _LAYER_REMAT.set(_LAYER_REMAT.get() or (
        _interprets(backend, target) and _differentiated_through_remat()))
    try:
        yield
    finally:
        _LAYER_REMAT.reset(token)


def check_remat(op: str, backend: str, options, target) -> None:
    """Raise before tracing an interpreted TPU kernel that is differentiated through a
    `jax.checkpoint` around it: the interpreter moves its blocks in Python callbacks
    (effects), and JAX's remat refuses effects when it differentiates ("Effects not
    supported in partial-eval of `checkpoint`/`remat`"), naming neither the op nor what
    to do. Seen where the checkpoint is in the traces the op is called in, or around a
    layer (`remat_seen`); an op inside your own `shard_map` under a checkpoint gets JAX's
    message (the `shard_map` body is traced apart). A checkpointed forward that is not
    differentiated runs."""
    if not _interprets(backend, target, options):
        return
    if not (_LAYER_REMAT.get() or _differentiated_through_remat()):
        return
    raise NotImplementedError(
        f"{op}: backend {backend!r} runs the TPU kernels in interpret mode here (simulated "
        "CPU devices), and it is differentiated through a jax.checkpoint (remat) around "
        "it: the interpreter moves blocks in Python callbacks, whose effects JAX cannot "
        "differentiate inside a checkpoint. Use backend='ring' (the same ring in lax) to "
        "check a rematerialised model on CPU, or differentiate it without the checkpoint, "
        "or run on a TPU, where the kernels are compiled.")


def _interprets(backend: str, target, options=None) -> bool:
    """Whether `backend` runs collective TPU kernels in interpret mode for `target` (with
    the op's `options`): its own to say (`_backends.Backend.interprets`). "auto" (not a
    backend of the table) chooses among those that compile here: never one that does."""
    # Imported here: this module runs when fusedpar is imported, before anything else.
    from . import _backends

    return backend in _backends.TABLE and _backends.get(backend).interprets(target, options)


def _differentiated_through_remat() -> bool:
    """Whether JAX is tracing a `jax.checkpoint`'s function now (in that trace or one it
    holds) with a differentiation (a JVP or linearize trace) around the checkpoint."""
    try:
        from jax._src.core import trace_ctx
    except ImportError:  # pragma: no cover - a JAX without it: JAX's own error stays
        return False
    trace, remat = getattr(trace_ctx, "trace", None), False
    for _ in range(64):
        if trace is None:
            return False
        info = getattr(getattr(trace, "frame", None), "debug_info", None)
        remat = remat or str(getattr(info, "traced_for", "")).startswith("checkpoint")
        if remat and type(trace).__name__ in ("JVPTrace", "LinearizeTrace"):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False
