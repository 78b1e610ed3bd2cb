"""Quantized payloads: what travels the ring when an op is given a `comm_dtype`.

A floating array `a` is sent as `Quantized(values, scales)`: `values` in the narrow dtype
(int8, or float8_e4m3fn), `scales` in float32 with the shape of `a` except for a 1 along
the reduced `axis`, so that `a ~= values * scales`. The scale of a row (or column) is its
largest magnitude over `axis` divided by the dtype's largest value (127, 448): symmetric,
no zero point, a row of zeros gets scale 1.

For an all-gather the reduced axis is the travelling operand's contraction axis, so a
scale belongs to a row of the product (`ag_rows`: the rows of x) or to one of its columns
(`ag_cols`, `ag_contract`: the columns of w) and can be applied to a step's product as
well as to its operand. Each owner quantizes its local block once; where the contraction
itself is split over the ring (`ag_contract`), each block brings its own scales
(`_primitives.Primitive.scale_axis`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np


# The narrow dtypes a ring can carry, by name, and the largest value each represents.
COMM_DTYPES = {
    "int8": np.dtype(jnp.int8),
    "float8_e4m3fn": np.dtype(jnp.float8_e4m3fn),
}
_QMAX = {np.dtype(jnp.int8): 127.0, np.dtype(jnp.float8_e4m3fn): 448.0}

class Quantized(NamedTuple):
    """`values` (narrow dtype) and float32 `scales` (size 1 along the reduced axis).

    A pytree: `ppermute`, `all_gather`, slicing by `jax.tree.map` apply to both parts.
    """

    values: object
    scales: object

    @property
    def shape(self):
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype


def comm_dtype(where: str, name: str, value) -> Optional[np.dtype]:
    """`value` as a supported narrow dtype, or None; an error names the supported ones."""
    if value is None:
        return None
    try:
        d = np.dtype(value)
    except TypeError:
        d = None
    if d not in _QMAX:
        valid = ", ".join(f"jnp.{k}" for k in COMM_DTYPES)
        raise ValueError(f"{where}: {name} must be None (send the input dtype) or one of "
                         f"{valid}, got {repr(value) if d is None else d.name}.")
    return d


def qmax(dtype) -> float:
    """The largest magnitude `dtype` holds: what a row's largest element is scaled to."""
    return _QMAX[np.dtype(dtype)]


def quantize(a, dtype, axis: int) -> Quantized:
    """`a` as `dtype` values with one float32 scale per slice along `axis` (reduced)."""
    dtype = np.dtype(dtype)
    a32 = a.astype(jnp.float32)
    amax = jnp.max(jnp.abs(a32), axis=axis, keepdims=True)
    # An all-zero slice gets scale 1; a NaN or inf in the slice makes its scale NaN or
    # inf, so the slice dequantizes to NaN (an int8 value cannot hold one): a diverged
    # run stays visible instead of its NaN becoming 0.
    scales = jnp.where(amax == 0, 1.0, amax / qmax(dtype)).astype(jnp.float32)
    scaled = a32 / scales
    if jnp.issubdtype(dtype, jnp.integer):
        values = jnp.clip(jnp.round(scaled), -qmax(dtype), qmax(dtype)).astype(dtype)
    else:  # float8: round to nearest on the cast; the clip only guards rounding at amax
        values = jnp.clip(scaled, -qmax(dtype), qmax(dtype)).astype(dtype)
    return Quantized(values, scales)


def quantized(a, dtype, axis: int) -> Quantized:
    """`quantize(a, dtype, axis)`, or `a` itself when it is already a `Quantized` (a
    weight stored quantized, sent as it is)."""
    return a if isinstance(a, Quantized) else quantize(a, dtype, axis)


def values_of(a):
    """`a`'s array: `a` itself, or a `Quantized`'s narrow values (its shape and layout)."""
    return a.values if isinstance(a, Quantized) else a


def dequantize(q: Quantized, dtype):
    """`values * scales`, in `dtype`.

    Scales may also cover equal blocks along an axis: gathered `ag_contract` blocks
    (N*k, n) carry (N, n) scales, one row per block of k rows.
    """
    scales = q.scales
    for axis, (v, c) in enumerate(zip(q.values.shape, scales.shape)):
        if c not in (1, v):
            scales = jnp.repeat(scales, v // c, axis=axis)
    return (q.values.astype(jnp.float32) * scales).astype(dtype)


def fake_quantize(a, dtype, axis: int):
    """`dequantize(quantize(a))` in `a`'s dtype: what the receiver of `a` computes with."""
    return dequantize(quantize(a, dtype, axis), a.dtype)
