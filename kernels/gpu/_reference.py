"""What the two step kernels compute, in lax: the oracle both kernel families are tested
against."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def matmul_into_reference(out, pieces, other, segs, *, axis, precision=None, kept=None):
    """`out` with each piece's product (f32 accumulation) written at its segment; with
    `kept`, `(out, kept)`, each piece also written at its segment of `kept`."""
    for p, s in zip(pieces, segs):
        prod = (jnp.matmul(p, other, precision=precision, preferred_element_type=jnp.float32)
                if axis == 0 else
                jnp.matmul(other, p, precision=precision, preferred_element_type=jnp.float32))
        out = lax.dynamic_update_slice_in_dim(out, prod.astype(out.dtype),
                                              s * prod.shape[axis], axis)
        if kept is not None:
            kept = lax.dynamic_update_slice_in_dim(kept, p, s * p.shape[axis], axis)
    return out if kept is None else (out, kept)


def matmul_acc_reference(acc, terms, out_shape, out_dtype, *, precision=None):
    """`acc + sum(term products)` (or the sum alone when `acc` is None), in f32."""
    m, n = out_shape
    total = jnp.zeros(out_shape, jnp.float32) if acc is None else acc.astype(jnp.float32)
    for t in terms:
        a = lax.dynamic_slice(t.a, (t.a_row, t.a_col), (m, t.k))
        b = lax.dynamic_slice(t.b, (t.b_row, t.b_col), (t.k, n))
        total = total + jnp.matmul(a, b, precision=precision,
                                   preferred_element_type=jnp.float32)
    return total.astype(out_dtype)
