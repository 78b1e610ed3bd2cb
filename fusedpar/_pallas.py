"""The Pallas backends: the fused TPU ring kernels and the GPU ring-step kernels.

Three names are registered:

- `"pallas_tpu"`: fused TPU kernels (`fusedpar.kernels.tpu`); on CPU they run in TPU
  interpret mode, which simulates every device, DMA and semaphore (a correctness
  simulator, slow).
- `"pallas_gpu"`: a lax ppermute ring whose per-step compute is Pallas Triton kernels
  (`fusedpar.kernels.gpu`); on CPU they run with `interpret=True`.
- `"pallas"`: the kernels for the platform at hand: GPU kernels on GPU, TPU kernels on
  TPU and (interpreted) on CPU.

Each kernel package exposes `run(prim, cfg, x, w, return_gathered)` and
`unavailable(call) -> str | None`. They are imported on first use so that importing
fusedpar does not import Pallas.
"""

from __future__ import annotations

import importlib

from . import _backends, _batching

_FAMILY = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


def _family(name, platform):
    if name in _FAMILY:
        return _FAMILY[name]
    return "gpu" if platform in ("gpu", "cuda", "rocm") else "tpu"


def _kernels(family):
    return importlib.import_module(f"fusedpar.kernels.{family}")


def _backend(name):
    def unavailable(call):
        module = _kernels(_family(name, call.platform))
        check = getattr(module, "unavailable", None)
        if check is None:
            return f"the {_family(name, call.platform)} kernels are not built yet"
        return check(call)

    def run(prim, cfg, x, w, return_gathered=False):
        import jax

        return _kernels(_family(name, jax.default_backend())).run(
            prim, cfg, x, w, return_gathered)

    # pallas_call cannot be batched by jax.vmap on these 2-D layouts: fold the mapped
    # dimension into the problem instead (see _batching.py).
    def options():
        import jax

        return _kernels(_family(name, jax.default_backend())).OPTIONS

    return _backends.Backend(name, run=_batching.vmappable(run), unavailable=unavailable,
                             description=__doc__.split("\n\n")[0], options=options)


for _name in ("pallas", "pallas_tpu", "pallas_gpu"):
    _backends.register(_backend(_name))
