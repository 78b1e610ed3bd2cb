"""The XLA flags a GPU ring needs to overlap its transfers with the step kernels.

On GPU the ring's `ppermute`s run on XLA's collective stream; XLA only schedules them to
run while the previous step's matmul runs when its latency-hiding scheduler is on, and a
bidirectional ring has two transfers in flight at once, which XLA allows only with a
parallel collective overlap limit of 2 or more. Neither is on by default, and XLA reads
its flags once, when the backend starts, so fusedpar never sets them behind your back:

    import fusedpar
    fusedpar.set_gpu_overlap_flags()  # before the first JAX computation

or in the shell, before starting Python (`gpu_overlap_flags()` returns the string):

    export XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_latency_hiding_scheduler=true \
        --xla_gpu_experimental_parallel_collective_overlap_limit=2"
"""

from __future__ import annotations

import os

_FLAGS = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true"),
    ("xla_gpu_experimental_parallel_collective_overlap_limit", "2"),
)


def gpu_overlap_flags(bidirectional: bool = True) -> str:
    """The XLA flags (one string, XLA_FLAGS syntax) that let a GPU ring overlap.

    **Arguments:**

    - `bidirectional`: include the collective overlap limit of 2 that a bidirectional
      ring needs (both directions' transfers in flight at once).
    """
    flags = _FLAGS if bidirectional else _FLAGS[:1]
    return " ".join(f"--{name}={value}" for name, value in flags)


def missing_gpu_overlap_flags(bidirectional: bool = True) -> list[str]:
    """The flags of `gpu_overlap_flags(bidirectional)` that `XLA_FLAGS` does not set."""
    present = {f.split("=")[0].lstrip("-") for f in os.environ.get("XLA_FLAGS", "").split()}
    return [f for f in gpu_overlap_flags(bidirectional).split()
            if f.split("=")[0].lstrip("-") not in present]


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a jax without the module
        return False
    return bool(getattr(xla_bridge, "_backends", None))


def set_gpu_overlap_flags(bidirectional: bool = True) -> str:
    """Append `gpu_overlap_flags()` to the `XLA_FLAGS` environment variable.

    Flags already in `XLA_FLAGS` are kept as they are (yours win). Call it before JAX
    starts its backends (the first computation or `jax.devices()`): XLA reads the flags
    once. Returns the new `XLA_FLAGS`.

    Raises `RuntimeError` if JAX's backends have already started.
    """
    if _backends_started():
        raise RuntimeError(
            "set_gpu_overlap_flags() must run before JAX starts its backends (the first "
            "computation or jax.devices()): XLA has already read XLA_FLAGS. Call it at the "
            "top of your program, or export XLA_FLAGS=\"" + gpu_overlap_flags(bidirectional)
            + "\" in the shell.")
    current = os.environ.get("XLA_FLAGS", "")
    present = {f.split("=")[0].lstrip("-") for f in current.split()}
    wanted = [f for f in gpu_overlap_flags(bidirectional).split()
              if f.split("=")[0].lstrip("-") not in present]
    os.environ["XLA_FLAGS"] = " ".join([current] + wanted).strip()
    return os.environ["XLA_FLAGS"]
