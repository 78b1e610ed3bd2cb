"""Which dot the kernels compute for a dtype and `precision`, and what they refuse.

- bfloat16 / float16 inputs: wgmma on the inputs, float32 accumulation (as
  `jnp.dot(..., preferred_element_type=float32)`).
- float32 inputs at default precision (None, DEFAULT, HIGH, or the global
  `jax_default_matmul_precision` unset/"default"/"high"/"tensorfloat32"/"bfloat16_3x"):
  XLA on a Hopper GPU multiplies in TF32 on the tensor cores; so do these kernels, since
  Mosaic GPU's wgmma takes float32 operands as TF32 (`wgmma...tf32`). TF32 wgmma reads
  both operands K-major from shared memory (only 16-bit wgmma can transpose), so the
  right operand is transposed in XLA before the kernel (one extra pass over B).
- float32 at `Precision.HIGHEST` (or the global default "highest"/"float32"): XLA runs
  full IEEE float32 (cuBLAS without TF32). Hopper's tensor cores have no float32 MMA and
  Mosaic GPU offers no CUDA-core matmul (its only matmul is wgmma), so the kernels cannot
  match it: `check` raises `NotImplementedError`, and `unsupported_reason` returns the
  sentence for a dispatcher to fall back to the lax ring (`jnp.dot` per step). A 3xTF32
  split (a = hi + lo, a@b ~ hi@hi + hi@lo + lo@hi) would come within ~1e-6 of float32 at
  3x the TF32 cost, but it is not IEEE float32 and is not implemented here.
"""

from __future__ import annotations

import jax.numpy as jnp

from .._precision import is_highest

DTYPES = ("bfloat16", "float16", "float32")


def unsupported_reason(dtype, precision=None) -> str | None:
    """Why the Mosaic GPU kernels cannot compute this dot as `jnp.dot` would, or None."""
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        return f"dtype {name} is not supported by the Mosaic GPU kernels ({', '.join(DTYPES)})"
    if name == "float32" and is_highest(precision):
        return ("float32 at Precision.HIGHEST is full IEEE float32 in XLA; Hopper wgmma "
                "multiplies float32 only as TF32 and Mosaic GPU has no CUDA-core matmul, "
                "so the Mosaic GPU kernels refuse it (use the lax ring)")
    return None


def check(dtype, precision=None) -> None:
    reason = unsupported_reason(dtype, precision)
    if reason is not None:
        raise NotImplementedError(reason)


def b_must_be_k_major(dtype, precision=None) -> bool:
    """Checks `dtype`/`precision`; True when B must be K-major in shared memory (TF32)."""
    check(dtype, precision)
    return jnp.dtype(dtype).itemsize == 4
