"""The XLA flags that let the compiler overlap transfers with matmuls, per platform.

XLA reads its flags once, when JAX starts its backends, so fusedpar never sets them behind
your back: call, at the top of your program, before the first JAX computation,

    import fusedpar
    fusedpar.set_overlap_flags()

which appends what is missing to `XLA_FLAGS` (GPU) and `LIBTPU_INIT_ARGS` (TPU, read by
libtpu); flags you set yourself win. Or export the strings `gpu_overlap_flags()` and
`tpu_overlap_flags()` return in the shell.

- GPU: the ring's `ppermute`s run on XLA's collective stream; XLA only schedules them to
  run while the previous step's matmul runs when its latency-hiding scheduler is on, and
  a bidirectional ring has two transfers in flight at once, which XLA allows only with a
  parallel collective overlap limit of 2 or more. XLA's own collectives between the
  rings (an FSDP layer's weight gather) are started as early as the program allows.
- TPU: the ring's `ppermute`s overlap without flags. XLA's own all-gathers, all-reduces
  and reduce-scatters (an FSDP layer's weight gather, a bias gradient's psum) run
  synchronously; with the asynchronous collective fusion on, the compiler splits an
  all-gather into steps fused into the matmuls that run beside it.
"""

from __future__ import annotations

import os
from typing import Optional

# The parallel collective overlap limit, which a bidirectional ring needs (two transfers
# in flight at once): `gpu_overlap_flags(bidirectional=False)` leaves it out.
_GPU_OVERLAP_LIMIT = ("xla_gpu_experimental_parallel_collective_overlap_limit", "2")
# XLA's own collectives started at the earliest point the program allows: the FSDP x TP
# block's weight gathers, which the scheduler left synchronous between the rings'
# transfers (8 x H100, replayed: block 3,298 -> 3,241 us, prefill 3,160 -> 3,094; XLA's
# own programs do not move; docs/measurements.md). XLA aborts the process on a flag it
# does not know, and jaxlib 0.10.0 and 0.10.1 do not know this one: it is set from
# jaxlib 0.10.2 on (`_EARLY_START_SINCE`).
_GPU_EARLY_START = ("xla_gpu_experimental_collective_start_as_early_as_possible", "true")
_EARLY_START_SINCE = (0, 10, 2)
_GPU_FLAGS = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true"),
    _GPU_OVERLAP_LIMIT,
    _GPU_EARLY_START,
)
# The "continuation fusion" of XLA's all-gathers, as MaxText sets it for TPU training: it
# hides the forward FSDP weight gathers (not on v5e, whose compiler ignores it). The same
# fusion for reduce-scatters and all-reduces runs out of scoped VMEM on v5e, v5p and v4
# (docs/measurements.md has the replayed numbers).
_TPU_FLAGS = (
    ("xla_tpu_enable_async_collective_fusion", "true"),
    ("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "true"),
    ("xla_tpu_enable_async_collective_fusion_multiple_steps", "true"),
    ("xla_tpu_overlap_compute_collective_tc", "true"),
    ("xla_enable_async_all_gather", "true"),
)
# Added on v5e: the same asynchronous fusion for XLA's reduce-scatters (an FSDP layer's
# weight-gradient reduce-scatter, otherwise synchronous), which needs a 32 MiB scoped
# VMEM limit. v4 runs out of VMEM with it (docs/measurements.md).
_REDUCE_SCATTER_FUSION = (
    ("xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter", "true"),
    ("xla_enable_async_reduce_scatter_fusion", "true"),
)
# v5p's default is 16 MiB: at 32 its ring MLP replays at 2,610 us instead of 2,815 (the
# block 5,239 instead of 5,322); v6e's default is 32 MiB already.
_SCOPED_VMEM = (("xla_tpu_scoped_vmem_limit_kib", "32768"),)
# On the TPUs with SparseCores that were measured (v5p, v6e), XLA's all-gathers,
# reduce-scatters and all-reduces run on the SparseCores, beside whatever the TensorCore
# runs, as MaxText's v5p and v6e recipes set it. Without it the TPU compiler turns an FSDP
# weight gather or weight-gradient reduce-scatter that has no XLA matmul to fuse into
# (the block's, between fused Pallas ring kernels) back into a synchronous collective
# (v6e block, replayed: 4,567 -> 4,343 us; docs/measurements.md). It replaces the
# reduce-scatter fusion there: with both, libtpu crashes (a segfault in its scheduler)
# compiling the reference all_gather_matmul for v6e. v5e has no SparseCore.
SPARSECORE_OFFLOAD = (
    ("xla_tpu_enable_sparse_core_collective_offload_all_gather", "true"),
    ("xla_tpu_enable_sparse_core_collective_offload_reduce_scatter", "true"),
    ("xla_tpu_enable_sparse_core_collective_offload_all_reduce", "true"),
)
SPARSECORE_GENERATIONS = ("v5p", "v6e")
_TPU_GENERATION_FLAGS = {"v5e": _REDUCE_SCATTER_FUSION + _SCOPED_VMEM,
                         **{g: SPARSECORE_OFFLOAD + _SCOPED_VMEM
                            for g in SPARSECORE_GENERATIONS}}
VARIABLES = {"gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}


def gpu_overlap_flags(bidirectional: bool = True) -> str:
    """The XLA flags (one string, XLA_FLAGS syntax) that let a GPU ring overlap.

    **Arguments:**

    - `bidirectional`: include the collective overlap limit of 2 that a bidirectional
      ring needs (both directions' transfers in flight at once).
    """
    return _join(gpu_flag_pairs(bidirectional))


def gpu_flag_pairs(bidirectional: bool = True) -> tuple:
    """`gpu_overlap_flags(bidirectional)` as `(name, value)` pairs (compiler options):
    those the installed jaxlib knows."""
    early = _jaxlib_version() >= _EARLY_START_SINCE
    return tuple(f for f in _GPU_FLAGS
                 if (bidirectional or f != _GPU_OVERLAP_LIMIT)
                 and (early or f != _GPU_EARLY_START))


def _jaxlib_version() -> tuple:
    """The installed jaxlib's (major, minor, patch), read without importing it (this
    module runs before JAX starts); a version it cannot read counts as new."""
    from importlib import metadata

    try:
        parts = metadata.version("jaxlib").split(".")[:3]
        return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)
    except (metadata.PackageNotFoundError, ValueError):  # pragma: no cover
        return (1 << 30,)


def tpu_overlap_flags(generation: Optional[str] = None) -> str:
    """The libtpu flags (one string, `LIBTPU_INIT_ARGS` syntax) that let XLA run its own
    all-gathers on a TPU (an FSDP weight gather) beside the matmuls.

    **Arguments:**

    - `generation`: the TPU generation the program will run on (`"v4"`, `"v5e"`,
      `"v5p"`, `"v6e"`, ...), or None for the flags every generation takes. On v5e the
      weight gradients' reduce-scatters run beside the matmuls too; on v5p and v6e
      XLA's collectives run on the SparseCores.
    """
    return _join(tpu_flag_pairs(generation))


def tpu_flag_pairs(generation: Optional[str] = None) -> tuple:
    """`tpu_overlap_flags(generation)` as `(name, value)` pairs (compiler options)."""
    if generation is not None:
        from . import _registry  # here: this module is imported before JAX starts

        known = sorted({k.generation for k in _registry.kinds() if k.generation})
        if generation not in known:
            raise ValueError(f"tpu_overlap_flags: generation must be one of "
                             f"{', '.join(known)} or None, got {generation!r}.")
    return _TPU_FLAGS + _TPU_GENERATION_FLAGS.get(generation, ())


def _join(flags) -> str:
    return " ".join(f"--{name}={value}" for name, value in flags)


def _flags(platform: str, bidirectional: bool = True, generation=None) -> str:
    return (gpu_overlap_flags(bidirectional) if platform == "gpu"
            else tpu_overlap_flags(generation))


def _name(flag: str) -> str:
    return flag.split("=")[0].lstrip("-")


def missing_overlap_flags(platform: str, bidirectional: bool = True,
                          generation: Optional[str] = None) -> list[str]:
    """The flags of `platform`'s overlap flags ("gpu" or "tpu"; on a TPU, those of
    `generation`) that its environment variable (`XLA_FLAGS`, `LIBTPU_INIT_ARGS`) does
    not set."""
    present = {_name(f) for f in os.environ.get(VARIABLES[platform], "").split()}
    return [f for f in _flags(platform, bidirectional, generation).split()
            if _name(f) not in present]


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a jax without the module
        return False
    return bool(getattr(xla_bridge, "_backends", None))


def _set(where: str, platform: str, bidirectional: bool = True, generation=None) -> str:
    variable = VARIABLES[platform]
    if _backends_started():
        raise RuntimeError(
            f"{where}() must run before JAX starts its backends (the first computation or "
            f"jax.devices()): XLA has already read {variable}. Call it at the top of your "
            f"program, or export {variable}=\"{_flags(platform, bidirectional, generation)}\" "
            "in the shell.")
    current = os.environ.get(variable, "")
    wanted = missing_overlap_flags(platform, bidirectional, generation)
    os.environ[variable] = " ".join([current] + wanted).strip()
    return os.environ[variable]


def set_gpu_overlap_flags(bidirectional: bool = True) -> str:
    """Append `gpu_overlap_flags()` to the `XLA_FLAGS` environment variable.

    Flags already in `XLA_FLAGS` are kept as they are (yours win). Call it before JAX
    starts its backends (the first computation or `jax.devices()`): XLA reads the flags
    once. Returns the new `XLA_FLAGS`.

    Raises `RuntimeError` if JAX's backends have already started.
    """
    return _set("set_gpu_overlap_flags", "gpu", bidirectional)


def set_overlap_flags(tpu_generation: Optional[str] = None) -> dict:
    """Append the GPU flags (`gpu_overlap_flags()`) to `XLA_FLAGS` and the TPU flags
    (`tpu_overlap_flags(tpu_generation)`) to `LIBTPU_INIT_ARGS`: one call, whichever
    platform the program runs on (each platform reads only its own variable).
    `tpu_generation` (`"v5e"`, ...): the TPU the program will run on, for the flags
    measured to help that generation alone (none: those every generation takes).

    Flags already set are kept as they are (yours win). Call it before JAX starts its
    backends (the first computation or `jax.devices()`): XLA reads the flags once.
    Returns the two variables' new values, by name.

    Raises `RuntimeError` if JAX's backends have already started.
    """
    tpu_flag_pairs(tpu_generation)  # a bad generation fails before anything is set
    return {VARIABLES[p]: _set("set_overlap_flags", p, generation=tpu_generation)
            for p in ("gpu", "tpu")}
