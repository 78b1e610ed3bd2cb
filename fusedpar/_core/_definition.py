"""What the two ops compute: their pure-lax expressions.

These functions are the definition every backend must match, the `"reference"` backend's
forward (`_backends/reference.py`), and the test oracle, which the tests differentiate with JAX's
own autodiff so that it shares no code with the custom VJP rules it checks.

Mixed precision follows `jnp.matmul` users' expectations: products accumulate in
`accumulation_dtype(dtype)` (float32 for bfloat16/float16 inputs) and the result is cast to
`out_dtype`. The cross-device sum of `matmul_reduce_scatter` runs in `reduce_dtype`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._hw import _target
from . import _folding


def accumulation_dtype(dtype) -> np.dtype:
    """Dtype a matmul of `dtype` inputs accumulates in: at least float32 (floats), at
    least int32 (integers, whose sums wrap as the narrow type's would)."""
    # Not jnp.promote_types: it raises under jax_numpy_dtype_promotion="strict".
    d = np.dtype(dtype)
    if d.itemsize >= 4:
        return d
    if jnp.issubdtype(d, jnp.floating):
        return np.dtype(np.float32)
    return np.dtype(np.int32) if jnp.issubdtype(d, jnp.integer) else d


def matmul(x, w, *, precision=None, out_dtype=None):
    """`jnp.matmul(x, w)` accumulating in `accumulation_dtype`; the result stays in it, or
    is rounded to `out_dtype`.

    Off CPU, a result in the inputs' own 16-bit dtype is what the dot itself writes (its
    products still accumulate in float32: the GPU's GEMMs and the TPU's MXU do), as XLA
    compiles `jnp.matmul` of 16-bit inputs: a float32 result, then a convert, writes the
    product twice over and reads it back (with cuBLAS GEMMs on 8 H100s, 30% of rs_rows'
    compute: bench/RESULTS-aot.md).
    """
    acc = accumulation_dtype(x.dtype)
    platform = _target.current(x, w).platform
    out = acc if out_dtype is None else np.dtype(out_dtype)
    if out == x.dtype and out != acc and platform not in ("cpu", "") and \
            jnp.issubdtype(out, jnp.floating):
        return jnp.matmul(x, w, precision=precision, preferred_element_type=out)
    if x.dtype != acc and platform == "cpu":
        # XLA's CPU runtime fails on some bf16 x bf16 -> f32 dots once several share a
        # program ("Unsupported element type for DotThunk::Execute"). Widening to f32 is
        # exact, so multiplying the widened operands gives the same result. Only for a
        # CPU target: a program compiled here for a GPU or TPU keeps its 16-bit dots.
        x, w = x.astype(acc), w.astype(acc)
    return jnp.matmul(x, w, precision=precision, preferred_element_type=acc).astype(out)


def all_gather_matmul(x, w, axis_name, *, gather="lhs", dim=0, out_dtype=None, precision=None):
    """`jnp.matmul(all_gather(x), w)` (gather="lhs") or `jnp.matmul(x, all_gather(w))` ("rhs")."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if gather == "lhs":
        x = lax.all_gather(x, axis_name, axis=dim % x.ndim, tiled=True)
    else:
        w = lax.all_gather(w, axis_name, axis=dim % w.ndim, tiled=True)
    return matmul(x, w, precision=precision, out_dtype=out_dtype)


def matmul_reduce_scatter(x, w, axis_name, *, dim=0, out_dtype=None, reduce_dtype=None,
                          precision=None, addend=None, explicit_vmap=None):
    """`psum_scatter(jnp.matmul(x, w), scatter_dimension=dim, tiled=True)`; `addend` (the
    product's shape), when given, is summed with the product before the scatter;
    `explicit_vmap`: `psum_scatter`'s."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = partial_products(x, w, reduce_dtype=reduce_dtype, precision=precision, addend=addend)
    return psum_scatter(y, axis_name, dim % y.ndim, explicit_vmap).astype(out_dtype)


def psum_scatter(y, axis_name, dim, explicit_vmap=None):
    """`lax.psum_scatter(y, axis_name, scatter_dimension=dim, tiled=True)`, the
    reduce-scatter of the package's lax expressions (the reference, its backward, the
    rearranged forms, the layers' own).

    Under a `jax.vmap` over a batch sharded on an Explicit mesh axis that did not fold
    into the layer (a `lax.scan`, `jax.jit` or `jax.checkpoint` between them:
    `_folding.explicit_vmap_axes`), JAX batches the traced reduce-scatter with that
    dimension sharded, and its lowering then fails (jax 0.10: an AssertionError naming
    the spec; the reduce-scatter's scalar reducer keeps the operand's sharding, where
    the all-reduce's drops it). There it is the sum over the ring and this device's
    block of it: the same values, which XLA's reduce-scatter creator turns back into a
    reduce-scatter on GPU and TPU. `explicit_vmap`: those axes as the op's forward found
    them (`Config.explicit_vmap`: a backward pass is traced after it, outside the
    layer), None to look now."""
    if explicit_vmap is None:
        explicit_vmap = _folding.explicit_vmap_axes()
    if not explicit_vmap:
        return lax.psum_scatter(y, axis_name, scatter_dimension=dim, tiled=True)
    n = lax.psum(1, axis_name)
    if y.shape[dim] % n:  # as lax.psum_scatter refuses it
        raise ValueError(f"psum_scatter: dimension {dim} of {y.shape} must be divisible "
                         f"by the {n} devices of axis {axis_name!r}.")
    block = y.shape[dim] // n
    return lax.dynamic_slice_in_dim(lax.psum(y, axis_name),
                                    lax.axis_index(axis_name) * block, block, dim)


def partial_products(x, w, *, reduce_dtype=None, precision=None, addend=None):
    """What `matmul_reduce_scatter` scatters: this device's `x @ w` (plus `addend`) in
    `reduce_dtype` (None: float32 for 16-bit inputs)."""
    reduce_dtype = accumulation_dtype(x.dtype) if reduce_dtype is None else reduce_dtype
    # Sums in the inputs' own 16-bit dtype are what the dot writes (`matmul`): with
    # cuBLAS GEMMs a float32 product and a convert cost a bfloat16 rs_rows 4% on 8 H100s.
    y = matmul(x, w, precision=precision, out_dtype=reduce_dtype)
    if addend is not None:
        y = y + addend.astype(reduce_dtype)
    return y
