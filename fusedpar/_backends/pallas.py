"""The `"pallas"` backend: the Pallas kernels of the platform at hand.

`pallas_gpu` on GPU; `pallas_tpu` on TPU and on CPU (where the TPU kernels run in TPU
interpret mode, which simulates every device, DMA and semaphore).
"""

from __future__ import annotations

import jax

from . import pallas_gpu, pallas_tpu

DESCRIPTION = ("the Pallas kernels for the platform at hand: pallas_gpu on GPU, pallas_tpu on "
               "TPU and CPU")
CHECK_VMA = pallas_gpu.CHECK_VMA and pallas_tpu.CHECK_VMA


def for_platform(platform: str):
    """The backend module `"pallas"` stands for on `platform`."""
    return pallas_gpu if platform in ("gpu", "cuda", "rocm") else pallas_tpu


def options(platform: str) -> frozenset:
    return for_platform(platform).options(platform)


def unavailable(call):
    return for_platform(call.platform).unavailable(call)


def run(prim, cfg, x, w, return_gathered=False):
    return for_platform(jax.default_backend()).run(prim, cfg, x, w, return_gathered)
