"""Which dot `jnp.dot(..., precision=precision)` computes for float32 on a GPU."""

from __future__ import annotations

import jax
from jax import lax

_HIGHEST_NAMES = ("highest", "float32")


def is_highest(precision) -> bool:
    """Whether float32 operands are multiplied in full IEEE float32, not TF32.

    XLA on a GPU multiplies float32 on the tensor cores in TF32 unless asked for
    `Precision.HIGHEST` (per call, or through the global `jax_default_matmul_precision`).
    """
    if isinstance(precision, (tuple, list)):
        return any(is_highest(p) for p in precision)
    if precision is None:
        default = getattr(jax.config, "jax_default_matmul_precision", None)
        return str(default).lower() in _HIGHEST_NAMES
    if isinstance(precision, str):
        return precision.lower() in _HIGHEST_NAMES
    return lax.Precision(precision) == lax.Precision.HIGHEST
