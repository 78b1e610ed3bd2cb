"""JAX starts no platform whose devices the host lacks, once fusedpar is imported.

The `aot` extra installs libtpu and JAX's CUDA plugin: the compilers `fusedpar.aot` uses
for TPU slices and H100s that are not here. When a program first asks for devices, JAX
starts every platform it finds installed, and on a host with neither a TPU nor a GPU
both announce that they found none: the CUDA plugin with a 30-line traceback ("Unable
to load CUDA. Is it installed?") and libtpu with `INVALID_ARGUMENT ... TPU worker
hostnames`. Then JAX runs on the CPU, as it would have without them.

`setup_platforms` (run when `fusedpar` is imported) sets `jax_platforms` to "cpu" where
that is all JAX could end up with, so it cannot change what runs: nobody chose the
platforms (`JAX_PLATFORMS` or `jax.config.update("jax_platforms", ...)`), JAX has not
started its backends, no TPU chip, NVIDIA GPU or AMD GPU is attached (JAX's own checks of
the host), and the only JAX plugins installed are CUDA and ROCm ones. Compiling for
absent hardware needs none of those platforms started: `jax.experimental.topologies`
asks the compilers for a topology, which works under "cpu".

What stays: importing JAX loads the CUDA plugin's kernel libraries, which log "Could not
find cuda drivers on your machine, GPU will not be used" (absl INFO lines, before any
Python code could silence them). libtpu, loaded to compile for a TPU slice, is kept
quiet by `fusedpar.aot` (`_aot.py`).
"""

from __future__ import annotations

import os

_QUIET_PLUGINS = ("xla_cuda", "xla_rocm")  # plugins for GPUs the host checks show absent


def _installed_plugins() -> set:
    """The JAX plugin modules JAX would import when it starts (without importing them)."""
    import pkgutil
    from importlib.metadata import entry_points

    names = set()
    try:
        import jax_plugins

        names |= {n for _, n, _ in pkgutil.iter_modules(jax_plugins.__path__)}
    except ImportError:
        pass
    names |= {e.value.split(":")[0].rsplit(".", 1)[-1]
              for e in entry_points(group="jax_plugins")}
    return names


def _attached(tpu: bool = True, gpu: bool = True) -> bool:
    """Whether a TPU chip (`tpu`) or a GPU (`gpu`) is attached, by JAX's own checks of the
    host; True if unsure."""
    try:
        from jax._src import hardware_utils as hw

        return bool(tpu and hw.num_available_tpu_chips_and_device_id()[0]
                    or gpu and (hw.has_visible_nvidia_gpu()
                                or hw.num_available_amd_gpus(stop_at=1)))
    except Exception:  # noqa: BLE001 - a JAX without these checks: assume one is
        return True


def tpu_attached() -> bool:
    """Whether a TPU chip is attached to this host (True if unsure)."""
    return _attached(gpu=False)


def setup_platforms() -> bool:
    """Set `jax_platforms` to "cpu" where JAX could start nothing else; True if it did."""
    import jax

    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):  # pragma: no cover - then leave JAX alone
        return False
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return False
    if _attached():
        return False
    if any(not p.startswith(_QUIET_PLUGINS) for p in _installed_plugins()):
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
