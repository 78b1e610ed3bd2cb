"""A linear layer's per-device arithmetic: `x @ w.T` (quantized weights included), the
bias, and the dtypes the two operands meet in."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._core import _definition, _vma
from .._core._quantized_array import QuantizedArray, qdot


def same_dtype(w, x):
    """`(w, x)` in the dtype they promote to."""
    # The promotion of `jnp.result_type`, without the strict-promotion check: an input
    # of another dtype than the weight is what mixed-precision models pass on purpose.
    # A QuantizedArray takes the dtype as its logical one (its values stay as stored).
    with jax.numpy_dtype_promotion("standard"):
        dt = jnp.result_type(w.dtype, x)
    return w.astype(dt), x.astype(dt)


def array_of(w):
    """The array standing for the weight `w` (a QuantizedArray's `values`, or its spec's)."""
    return w.values if isinstance(w, QuantizedArray) else w


def stationary(w):
    """A weight that stays put in a ring (the x-gathers and reduce-scatters multiply
    each step's block by it): a QuantizedArray's local shard is dequantized here, the
    kernels take no quantized stationary operand."""
    return w.materialise() if isinstance(w, QuantizedArray) else w


def matmul_t(x, w, out_dtype=None):
    """`x @ w.T` for a weight `(out, in)`, accumulating in float32 for 16-bit inputs; a
    `QuantizedArray` weight is multiplied as int8/fp8 values, scales on the product."""
    out_dtype = out_dtype or x.dtype
    if isinstance(w, QuantizedArray):
        acc = _definition.accumulation_dtype(x.dtype)
        dn = (((x.ndim - 1,), (w.ndim - 1,)), ((), ()))
        return qdot(x, w, dn, preferred_element_type=acc).astype(out_dtype)
    return _definition.matmul(x, w.T).astype(out_dtype)


def add_bias(y, b):
    """`y + b` (`b` of shape `(out,)` or None), typed to vary where `y` does, in the
    dtype `eqx.nn.Linear`'s `y + b` has (a float32 bias on a bfloat16 product: float32)."""
    if b is None:
        return y
    with jax.numpy_dtype_promotion("standard"):  # as `same_dtype`: mixed on purpose
        out = y.dtype if b.dtype == y.dtype else jnp.result_type(y, b)
    # Type the bias as varying where `y` varies *before* broadcasting it: the transpose
    # of that implicit `pvary` is the bias gradient's psum, which then sums the
    # (out,) bias, not the broadcast (batch, seq, out) cotangent (on an FSDP x TP block
    # that was a 32 MB and an 8 MB all-reduce per step in place of two 8-32 KB ones).
    # Typed so in the accumulation dtype (float32 for 16-bit floats), that psum sums in
    # float32: more accurate, a few KB, and no bfloat16 all-reduce, which XLA's CPU
    # compiler aborts on in a shard_map that leaves mesh axes to it (its
    # AllReducePromotion pass, "Invalid binary instruction opcode copy"). The add itself
    # stays in `out` (in float32 it cost the 8 x H100 ring MLP 36 us replayed).
    acc = _definition.accumulation_dtype(out)
    b = _vma.as_varying(b.astype(acc), _vma.varying_axes(y)).astype(out)
    # Broadcast explicitly: jax_numpy_rank_promotion="raise" refuses `y + b` on batches.
    return y.astype(out) + jnp.broadcast_to(b, y.shape)
