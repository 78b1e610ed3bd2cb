"""The `"pallas"` backend: the Pallas kernels of the target's platform.

`pallas_gpu` on a GPU mesh; `pallas_tpu` on a TPU mesh and on CPU (where the TPU kernels
run in TPU interpret mode, which simulates every device, DMA and semaphore). The platform
is the target's (`fusedpar._hw._target`: the mesh's devices), not the tracing machine's.
"""

from __future__ import annotations

from . import pallas_gpu, pallas_tpu
from ._backend import Backend


def for_platform(platform: str) -> Backend:
    """The backend `"pallas"` stands for on `platform`."""
    return pallas_gpu.BACKEND if platform == "gpu" else pallas_tpu.BACKEND


def options(platform: str) -> frozenset:
    return for_platform(platform).options(platform)


def unavailable(call):
    return for_platform(call.platform).unavailable(call)


def kernels(call) -> str:
    return for_platform(call.platform).kernels(call)


def run(prim, cfg, x, w, return_gathered=False):
    return for_platform(cfg.on.platform).run(prim, cfg, x, w, return_gathered)


def interprets(target, options) -> bool:
    return for_platform(target.platform).interprets(target, options)


def run_partnered(prim, cfg, x, w, partner, dtype, transposed=False):
    fn = for_platform(cfg.on.platform).run_partnered
    return None if fn is None else fn(prim, cfg, x, w, partner, dtype, transposed)


BACKEND = Backend(
    name="pallas",
    description=("the Pallas kernels for the target's platform: pallas_gpu on GPU, "
                 "pallas_tpu on TPU and CPU"),
    run=run, unavailable=unavailable, options=options, kernels=kernels,
    check_vma=pallas_gpu.BACKEND.check_vma and pallas_tpu.BACKEND.check_vma,
    cost="kernel", candidate=True, interprets=interprets, run_partnered=run_partnered)
