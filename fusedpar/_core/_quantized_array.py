"""`QuantizedArray`: a stored weight kept as int8/fp8 values and float32 scales (quax).

```python
import equinox as eqx, jax, jax.numpy as jnp, quax
import fusedpar

mlp = eqx.nn.MLP(64, 64, 256, depth=2, key=jax.random.key(0))
qmlp = fusedpar.quantize(mlp, dtype=jnp.int8)      # every Linear weight -> QuantizedArray
y = quax.quaxify(qmlp)(jnp.ones(64))               # int8 weights reach each matmul as int8
```

A `QuantizedArray` of logical shape `S` and dtype `dtype` holds `values` (shape `S`,
int8 or float8_e4m3fn) and `scales` (float32, shape `S` with the reduced axis `axis`
cut into blocks: one scale per `block_size` elements, by default one per whole axis), so
that the array is `values * scales` (each scale repeated over its block). An eqx weight
`(out, in)` quantized by `QuantizedArray.quantize(w, jnp.int8)` has one scale per output
channel: `scales` of shape `(out, 1)`, the layout of `fusedpar._core._quantize.Quantized`
(that is what a fusedpar layer sends round a ring as is).

Under `quax.quaxify` the primitives a linear layer runs have rules that never form the
full-precision array: `dot_general` (so `x @ w`, `w @ x`, `jnp.dot`, `jnp.matmul`,
`lax.dot_general`) casts `values` to the other operand's dtype inside the dot and
applies the scales to the product (per block, then summed, for `block_size`);
`transpose` (`w.T`) transposes values and scales; `convert_element_type` (the dtype
promotion `jnp.matmul` does) changes the logical dtype only. Anything else materialises
(`values * scales`) as quax does for types without a rule, unless the array was built
with `allow_materialise=False`, which makes that an error (the tests use it to prove
the rules above never materialise).

Gradients. `values` are integers or fp8 codes: no gradient reaches them, nor the
`scales` (a stored quantized weight serves). To train through quantization, quantize
inside the loss with `master=True` (`fusedpar.quantize(model, ..., master=True)`): the
`QuantizedArray` then carries its full-precision `master` and each rule's backward is
the straight-through estimator, the gradient of the dequantized expression with respect
to `master` (it forms the dequantized array in the backward pass only). Keeping the
master in the array, rather than a differentiable `quantize` whose cotangent would have
to travel back through integer `values`, is what makes that gradient expressible at all,
and it costs nothing more than the master copy training keeps anyway.
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import quax
from jax import lax

from . import _quantize

_WHERE = "QuantizedArray"


def _block_count(where, shape, axis, block_size) -> int:
    n = shape[axis]
    if block_size is None:
        return 1
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"{where}: block_size must be None (one scale per whole axis) or a "
                         f"positive int, got {block_size!r}.")
    if n % block_size:
        raise ValueError(f"{where}: dimension {axis % len(shape)} of shape {shape} (size {n}) "
                         f"does not split into blocks of block_size={block_size}; pass a "
                         f"block_size that divides {n}, or None for one scale per row.")
    return n // int(block_size)


# An eqx.nn.Linear holding a QuantizedArray, called plainly, gets Python's "unsupported
# operand type(s) for @" otherwise.
_OUTSIDE_QUAX = (f"{_WHERE}: multiplied outside quax.quaxify; a plain Equinox layer or your "
                 "own code holding one runs under quax.quaxify (quax.quaxify(layer)(x)), "
                 "while fusedpar layers take it as it is, outside quaxify.")


class QuantizedArray(quax.ArrayValue):
    """A quantized array: `values` (int8 / float8_e4m3fn), float32 `scales`, optional
    full-precision `master` (straight-through training). See the module docstring.

    Fields: `values` of the logical shape; `scales` of that shape with `axis` (the
    reduced axis, stored negative) of size `shape[axis] // block_size`; `dtype_name`
    the logical dtype; `master` None or the full-precision array.
    """

    values: jax.Array
    scales: jax.Array
    master: Optional[jax.Array]
    axis: int = eqx.field(static=True)
    logical_dtype: str = eqx.field(static=True)
    allow_materialise: bool = eqx.field(static=True)

    def __init__(self, values, scales, *, axis: int = -1, dtype=jnp.float32, master=None,
                 allow_materialise: bool = True):
        """**Arguments:** `values` (int8 or float8_e4m3fn), `scales` (float32, `values`'
        shape with `axis` cut to its number of blocks), `axis` the reduced axis, `dtype`
        the logical (materialised) dtype, `master` an optional full-precision copy of
        `values`' shape. Most code builds one with `QuantizedArray.quantize`."""
        vshape, sshape = tuple(np.shape(values)), tuple(np.shape(scales))
        if not vshape:
            raise ValueError(f"{_WHERE}: values must have at least one dimension, got a "
                             "scalar.")
        _narrow(_WHERE, "values.dtype", jnp.result_type(values))
        if jnp.result_type(scales) != jnp.float32:
            raise ValueError(f"{_WHERE}: scales must be float32, got "
                             f"{jnp.result_type(scales)}.")
        axis = _negative_axis(_WHERE, axis, len(vshape))
        want = list(vshape)
        if len(sshape) == len(vshape) and sshape[axis] >= 1:
            want[axis] = sshape[axis]
        if (len(sshape) != len(vshape) or tuple(want) != sshape
                or vshape[axis] % sshape[axis]):
            raise ValueError(f"{_WHERE}: scales of shape {sshape} do not fit values of shape "
                             f"{vshape}: they need values' shape with dimension "
                             f"{axis % len(vshape)} cut into blocks (a size dividing "
                             f"{vshape[axis]}).")
        if master is not None and tuple(np.shape(master)) != vshape:
            raise ValueError(f"{_WHERE}: master of shape {np.shape(master)} must have values' "
                             f"shape {vshape}.")
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{_WHERE}: dtype (the logical dtype) must be floating, got "
                             f"{dtype}.")
        self.values, self.scales, self.master = values, scales, master
        self.axis, self.logical_dtype = axis, dtype.name
        self.allow_materialise = allow_materialise

    @classmethod
    def quantize(cls, a, dtype=jnp.int8, *, axis: int = -1,
                 block_size: Optional[int] = None, master: bool = False,
                 allow_materialise: bool = True) -> "QuantizedArray":
        """`a` (floating) quantized to `dtype` (int8 or float8_e4m3fn) with one symmetric
        scale per `block_size` elements along `axis` (default: the whole axis; for an eqx
        weight `(out, in)`, one scale per output channel). `master=True` keeps `a` for
        straight-through gradients."""
        a = jnp.asarray(a)
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{_WHERE}.quantize: a must be floating, got {a.dtype}.")
        dtype = _narrow(f"{_WHERE}.quantize", "dtype", dtype)
        if a.ndim == 0:
            raise ValueError(f"{_WHERE}.quantize: a must have at least one dimension.")
        axis = _negative_axis(f"{_WHERE}.quantize", axis, a.ndim)
        g = _block_count(f"{_WHERE}.quantize", a.shape, axis, block_size)
        blocks = _split_axis(a, axis, g)  # (..., g, b, ...): the block axis after `axis`
        q = _quantize.quantize(blocks, dtype, axis=axis)
        values = q.values.reshape(a.shape)
        scales = jnp.squeeze(q.scales, axis=axis)  # (..., g, ...)
        return cls(values, scales, axis=axis, dtype=a.dtype,
                   master=a if master else None, allow_materialise=allow_materialise)

    def __matmul__(self, other):
        raise TypeError(_OUTSIDE_QUAX)

    def __rmatmul__(self, other):
        raise TypeError(_OUTSIDE_QUAX)

    def astype(self, dtype) -> "QuantizedArray":
        """The same values and scales with logical dtype `dtype` (nothing is converted)."""
        if np.dtype(dtype) == np.dtype(self.logical_dtype):
            return self
        return QuantizedArray(self.values, self.scales, axis=self.axis, dtype=dtype,
                              master=self.master, allow_materialise=self.allow_materialise)

    @property
    def block_size(self) -> int:
        return self.values.shape[self.axis] // self.scales.shape[self.axis]

    @property
    def blocked(self) -> bool:
        """Whether the scales are per block of the axis (more than one along it)."""
        return self.scales.shape[self.axis] != 1

    def aval(self):
        return jax.core.ShapedArray(self.values.shape, np.dtype(self.logical_dtype))

    def dequantize(self):
        """`values * scales` in the logical dtype (what `materialise` returns)."""
        g = self.scales.shape[self.axis]
        v = _split_axis(self.values.astype(jnp.float32), self.axis, g)
        s = jnp.expand_dims(self.scales, self.axis % self.values.ndim + 1)
        return (v * s).reshape(self.values.shape).astype(self.logical_dtype)

    def materialise(self):
        if not self.allow_materialise:
            raise RuntimeError(f"{_WHERE} built with allow_materialise=False was asked to "
                               "materialise: an operation without a QuantizedArray rule "
                               "(only dot_general, transpose and convert_element_type "
                               "have one).")
        # Straight-through: the value of the dequantized array, the gradient of master
        # (none without one: a stored quantized array serves).
        return _with_master_grad(lax.stop_gradient(self.dequantize()), self.master)

    def as_payload(self) -> _quantize.Quantized:
        """`Quantized(values, scales)` as `fusedpar._core._quantize` sends it (per-channel only)."""
        if self.blocked:
            raise ValueError(f"{_WHERE}: a block-quantized array (block_size "
                             f"{self.block_size}) cannot travel a ring as one payload; "
                             "quantize with block_size=None (one scale per channel).")
        return _quantize.Quantized(self.values, self.scales)

    def transpose(self, perm=None):
        """The transposed array (values, scales, master alike), never materialised."""
        perm = tuple(range(self.values.ndim))[::-1] if perm is None else tuple(perm)
        t = functools.partial(jnp.transpose, axes=perm)
        return QuantizedArray(
            t(self.values), t(self.scales), axis=perm.index(self.axis % len(perm)),
            dtype=self.logical_dtype, master=None if self.master is None else t(self.master),
            allow_materialise=self.allow_materialise)

    @property
    def T(self):  # noqa: N802 - numpy's name
        return self.transpose()


def _narrow(where, name, dtype):
    """`dtype` as one of the narrow dtypes a QuantizedArray stores, or an error naming them."""
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d not in _quantize.COMM_DTYPES.values():
        valid = ", ".join(f"jnp.{k}" for k in _quantize.COMM_DTYPES)
        raise ValueError(f"{where}: {name} must be one of {valid} (the narrow dtypes a "
                         f"QuantizedArray stores), got {d.name if d is not None else repr(dtype)}.")
    return d


def _negative_axis(where, axis, ndim) -> int:
    if not _is_int(axis) or not -ndim <= axis < ndim:
        raise ValueError(f"{where}: axis must be an int in [{-ndim}, {ndim}), got {axis!r}.")
    axis = int(axis)
    return axis - ndim if axis >= 0 else axis


def _is_int(v) -> bool:
    """A Python or NumPy integer (what `a.ndim - 1` or `np.argmax` hand you), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _split_axis(a, axis, g):
    """`a` with its dimension `axis` reshaped to `(g, size // g)`."""
    axis = axis % a.ndim
    return a.reshape(a.shape[:axis] + (g, a.shape[axis] // g) + a.shape[axis + 1:])


@jax.custom_vjp
def _straight_through(value, master):
    """`value`, with the gradient going to `master` unchanged (and none to `value`)."""
    return value


def _st_fwd(value, master):
    return value, None


def _st_bwd(_, g):
    return None, g


_straight_through.defvjp(_st_fwd, _st_bwd)


def _with_master_grad(value, master):
    return value if master is None else _straight_through(value, master.astype(value.dtype))


def fake_quantize(a, dtype, axis: int = -1):
    """`a` quantized to `dtype` along `axis` and back (one scale per slice), with a
    straight-through gradient: what a receiver of `a` sent in `dtype` computes with."""
    return _straight_through(_quantize.fake_quantize(a, dtype, axis), a)


# --- the dot ------------------------------------------------------------------------


def qdot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`lax.dot_general(lhs, rhs, ...)` with either operand a `QuantizedArray`, without
    forming its full-precision array when its reduced axis is its only contracting one
    and it has no batch dimension (else it materialises). The other operand may be a
    `QuantizedArray` too (then it is materialised)."""
    (lc, rc), (lb, rb) = dimension_numbers
    q_left = isinstance(lhs, QuantizedArray)
    q, other = (lhs, rhs) if q_left else (rhs, lhs)
    # A stored quantized array serves: no gradient reaches its values (float8 values are
    # differentiable to JAX) or its scales; with a master, the straight-through one
    # reaches the master.
    q = eqx.tree_at(lambda a: (a.values, a.scales), q,
                    (lax.stop_gradient(q.values), lax.stop_gradient(q.scales)))
    qc, oc, qb = (lc, rc, lb) if q_left else (rc, lc, rb)
    if isinstance(other, QuantizedArray):
        other = other.materialise()
    ax = q.axis % q.ndim
    if (not qb and q.ndim == 2 and len(qc) == 1 and qc[0] % 2 != ax
            and q.scales.shape[ax] == 1):
        # A per-row scale on a contracted row (`dy @ w` for w (out, in)): it scales the
        # other operand's matching elements before the dot instead.
        s = q.scales[:, 0] if ax == 1 else q.scales[0]
        oax = oc[0] % other.ndim
        s = s.reshape((-1,) + (1,) * (other.ndim - 1 - oax))
        scaled = (other.astype(jnp.float32) * s).astype(other.dtype)
        return qdot_scaled(q, scaled, other, dimension_numbers, q_left, precision,
                           preferred_element_type)
    if qb or tuple(c % q.ndim for c in qc) != (ax,):
        dense = q.materialise()
        return lax.dot_general(*((dense, other) if q_left else (other, dense)),
                               dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
    out_dtype = preferred_element_type or jnp.result_type(other.dtype, q.logical_dtype)
    oax = oc[0] % other.ndim
    y = _qdot(other, q.values, q.scales, q.axis, oax, q_left, precision, out_dtype)
    if q.master is None:
        return y
    dn = ((ax,), (oax,)) if q_left else ((oax,), (ax,))

    def dense(o, w):
        return lax.dot_general(*((w, o) if q_left else (o, w)), (dn, ((), ())),
                               precision=precision, preferred_element_type=out_dtype)

    return _ste_dot(dense, q.axis, y, other, q.values, q.scales, q.master)


def qdot_scaled(q, scaled, other, dimension_numbers, q_left, precision,
                preferred_element_type):
    """The dot of the values with `scaled` (the other operand, already scaled), with a
    straight-through gradient to `q.master` when there is one."""
    out_dtype = preferred_element_type or jnp.result_type(other.dtype, q.logical_dtype)
    acc = jnp.float32 if jnp.issubdtype(other.dtype, jnp.floating) else None
    values = q.values.astype(other.dtype)
    y = lax.dot_general(*((values, scaled) if q_left else (scaled, values)),
                        dimension_numbers, precision=precision,
                        preferred_element_type=acc).astype(out_dtype)
    if q.master is None:
        return y

    def dense(o, w):
        return lax.dot_general(*((w, o) if q_left else (o, w)), dimension_numbers,
                               precision=precision, preferred_element_type=out_dtype)

    return _ste_dot(dense, q.axis, y, other, q.values, q.scales, q.master)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ste_dot(dense, axis, y, other, values, scales, master):
    """`y` (the quantized dot of `other` with the array), differentiated as
    `dense(other, dequantized array)` with the array's cotangent going to `master`: the
    straight-through estimator (the dequantized array is formed in the backward pass
    of training only)."""
    return y


def _ste_dot_fwd(dense, axis, y, other, values, scales, master):
    return y, (other, values, scales, master)


def _ste_dot_bwd(dense, axis, res, g):
    other, values, scales, master = res
    deq = QuantizedArray(values, scales, axis=axis, dtype=master.dtype).dequantize()
    _, vjp = jax.vjp(dense, other, deq)
    d_other, d_w = vjp(g)
    return None, d_other, None, None, d_w.astype(master.dtype)


_ste_dot.defvjp(_ste_dot_fwd, _ste_dot_bwd)


def _qdot(other, values, scales, qax, oax, q_left, precision, out_dtype):
    """The quantized dot: values cast to `other`'s dtype in the dot (accumulating in
    float32), scales applied to the product per block, blocks summed."""
    qax = qax % values.ndim
    g = scales.shape[qax]
    acc = jnp.float32 if jnp.issubdtype(other.dtype, jnp.floating) else None
    ov = _split_axis(other, oax, g)        # (..., g, b, ...)
    qv = _split_axis(values.astype(other.dtype), qax, g)
    # Contract the block elements, batch over the blocks: (g, *free_of_lhs, *free_of_rhs).
    if q_left:
        dn = (((qax + 1,), (oax + 1,)), ((qax,), (oax,)))
        y = lax.dot_general(qv, ov, dn, precision=precision, preferred_element_type=acc)
        # scales (..., g, ...) without the contracted axis: q's free dims, then g first.
        s = jnp.moveaxis(scales, qax, 0)
        s = s.reshape(s.shape + (1,) * (other.ndim - 1))
    else:
        dn = (((oax + 1,), (qax + 1,)), ((oax,), (qax,)))
        y = lax.dot_general(ov, qv, dn, precision=precision, preferred_element_type=acc)
        s = jnp.moveaxis(scales, qax, 0)
        s = s.reshape((g,) + (1,) * (other.ndim - 1) + s.shape[1:])
    return jnp.sum(y.astype(jnp.float32) * s, axis=0).astype(out_dtype)


# --- quax rules -----------------------------------------------------------------------


@quax.register(lax.dot_general_p)
def _(lhs: QuantizedArray, rhs: quax.ArrayValue | jax.Array | np.ndarray, *,
      dimension_numbers, precision, preferred_element_type, **kwargs):
    rhs = rhs.materialise() if isinstance(rhs, quax.ArrayValue) and not isinstance(
        rhs, QuantizedArray) else rhs
    return qdot(lhs, rhs, dimension_numbers, precision, preferred_element_type)


@quax.register(lax.dot_general_p)
def _(lhs: quax.ArrayValue | jax.Array | np.ndarray, rhs: QuantizedArray, *,
      dimension_numbers, precision, preferred_element_type, **kwargs):
    lhs = lhs.materialise() if isinstance(lhs, quax.ArrayValue) and not isinstance(
        lhs, QuantizedArray) else lhs
    return qdot(lhs, rhs, dimension_numbers, precision, preferred_element_type)


@quax.register(lax.dot_general_p)
def _(lhs: QuantizedArray, rhs: QuantizedArray, *, dimension_numbers, precision,
      preferred_element_type, **kwargs):
    return qdot(lhs, rhs, dimension_numbers, precision, preferred_element_type)


@quax.register(lax.transpose_p)
def _(operand: QuantizedArray, *, permutation):
    return operand.transpose(permutation)


@quax.register(lax.convert_element_type_p)
def _(operand: QuantizedArray, *, new_dtype, **kwargs):
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return lax.convert_element_type(operand.materialise(), new_dtype)
    return operand.astype(new_dtype)


def _leafwise(prim, q: QuantizedArray, **params) -> QuantizedArray:
    """`prim` applied to each array of `q`: for primitives that only retype an array."""
    return jax.tree.map(lambda a: prim.bind(a, **params), q)


# `shard_map(check_vma=True)` marks an array that does not vary over an axis as varying
# (`pvary`) before it meets one that does: the same mark on values, scales and master.
# JAX has no public handle on the primitive; its private home is the only one.
from jax._src import core as _jax_core  # noqa: E402

if hasattr(_jax_core, "pvary_p"):
    @quax.register(_jax_core.pvary_p)
    def _(operand: QuantizedArray, *, axes):
        return _leafwise(_jax_core.pvary_p, operand, axes=axes)
