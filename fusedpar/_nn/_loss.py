"""Loss-parallel cross-entropy: the loss of logits sharded on the vocabulary, in place.

A column-parallel LM head leaves each device the logits of its slice of the vocabulary.
`cross_entropy` computes the loss from those slices: the maximum, the sum of
exponentials and the target's logit are each reduced over the mesh axis (`pmax`, `psum`,
`psum`), so no device ever holds the full `(..., vocab)` logits. A custom VJP keeps only
the logits (already in memory, in their own dtype) and the log-sum-exp per token, and
recomputes the softmax in the backward pass, instead of JAX's autodiff keeping the
float32 softmax; the gradient needs no collective.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import _context
from .._core import _folding, _validate, _vma
from .._sharding import _specs, _whole_model


def cross_entropy(logits, labels, axis: Optional[str] = "tp", *, ignore_index: int = -100,
                  vocab_size: Optional[int] = None):
    """Per-token cross-entropy `-log_softmax(logits)[label]`, in float32, with the
    vocabulary (the last dimension of `logits`) sharded over the mesh axis `axis`.

    **Arguments:**

    - `logits`: `(..., vocab)` floating point (e.g. bfloat16); inside `shard_map` the
      local `(..., vocab / axis size)` slice of a column-parallel LM head's output.
    - `labels`: integer `(...)`, replicated over `axis`.
    - `axis`: the mesh axis the vocabulary is sharded over; None for whole logits.
    - `ignore_index`: labels equal to it give a loss of 0 and no gradient.
    - `vocab_size`: the real vocabulary when `vocab` was padded to divide by the axis:
      logits at or past it get no probability.

    **Returns:** float32 `(...)`, the shape of `labels`. Average over the tokens that
    count with `loss.sum() / (labels != ignore_index).sum()`. A label outside
    `[0, vocab_size)` other than `ignore_index` gives a NaN loss (JAX cannot raise on
    values). Works inside `shard_map` binding `axis`, on global arrays under
    `jax.set_mesh` (it wraps itself in `shard_map`), with no mesh, and under `jax.vmap`.
    """
    where = "cross_entropy"
    logits = logits if isinstance(logits, jax.Array) else jnp.asarray(logits)
    labels = labels if isinstance(labels, jax.Array) else jnp.asarray(labels)
    if logits.ndim < 1 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"{where}: logits must be a floating array (..., vocab), got "
                        f"{logits.dtype} of shape {logits.shape}.")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{where}: labels must be integer, got {labels.dtype}.")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"{where}: labels must have the shape of logits without its last "
                         f"dimension, {logits.shape[:-1]}; got labels of shape "
                         f"{labels.shape}.")
    if not _validate.is_int(ignore_index):
        raise TypeError(f"{where}: ignore_index must be an int, got {ignore_index!r}.")
    if vocab_size is not None and (not _validate.is_int(vocab_size) or vocab_size < 1):
        raise ValueError(f"{where}: vocab_size must be a positive int, got {vocab_size!r}.")
    ignore_index = int(ignore_index)
    vocab_size = None if vocab_size is None else int(vocab_size)
    if axis is not None and (not isinstance(axis, str) or not axis):
        raise TypeError(f"{where}: axis must be a mesh axis name, a non-empty str such as "
                        f"'tp', or None for whole logits; got axis={axis!r}.")
    run = functools.partial(_apply, axis=axis, ignore_index=ignore_index,
                            vocab_size=vocab_size)
    with _validate.reverse_mode_only(where, "its gradient is a custom VJP (the softmax "
                                            "recomputed in the backward)"):
        return _folding.fold(run, (logits, labels), where=where)


def _apply(logits, labels, *, axis, ignore_index, vocab_size):
    """`cross_entropy` with every vmapped axis folded in."""
    where = "cross_entropy"
    kind, mesh = _context.detect(where, (axis,) if axis is not None else ())
    if kind == _context.LOCAL:
        vocab = logits.shape[-1] * lax.axis_size(axis)
    else:
        vocab = logits.shape[-1]
    if vocab_size is not None and vocab_size > vocab:
        raise ValueError(f"{where}: vocab_size={vocab_size} is larger than the vocabulary "
                         f"of the logits, {vocab}.")
    if kind == _context.GLOBAL:
        loss = _global(logits, labels, axis, mesh, ignore_index, vocab_size)
    else:
        loss = _local(logits, labels, axis if kind == _context.LOCAL else None,
                      ignore_index, vocab_size)
    # Its leading dimensions are laid out as the logits are: as the layer that made them
    # says, else replicated.
    made = _whole_model.spec_of(logits)
    lead = tuple(made)[:logits.ndim - 1] if made is not None else ()
    lead = lead + (None,) * (logits.ndim - 1 - len(lead))
    _whole_model.record(where, None, [(logits, P(*lead, axis)), (labels, P(*lead))],
                        (loss, P(*lead)))
    return loss


def _global(logits, labels, axis, mesh, ignore_index, vocab_size):
    size = _specs.mesh_sizes(mesh)[axis]
    vocab = logits.shape[-1]
    if vocab % size:
        raise ValueError(f"cross_entropy: logits of shape {logits.shape}: the vocabulary "
                         f"(last dim) has {vocab} entries, not divisible by {size}, the "
                         f"size of mesh axis {axis!r}; "
                         + _specs.pad_vocab_hint(vocab_size or vocab, size) + ".")
    n = logits.ndim
    # Lax collectives only: the mesh's other Auto axes go on a batch of logits.
    logits_spec, loss_spec, manual = _context.layouts(
        "cross_entropy", mesh, (axis,), logits, P(*(None,) * (n - 1), axis), P(*(None,) * n),
        every_axis=False, batched=n >= 3)
    loss_spec = P(*tuple(loss_spec)[:n - 1])
    fn = functools.partial(_shard, axis=axis, ignore_index=ignore_index,
                           vocab_size=vocab_size)
    return _context.shard_mapped(fn, mesh, (axis,), manual, (), (), [logits, labels],
                                 [logits_spec, loss_spec], loss_spec, check_vma=True,
                                 where="cross_entropy")


def _shard(params, logits, labels, *, axis, ignore_index, vocab_size):
    del params
    return _local(logits, labels, axis, ignore_index, vocab_size)


def _local(logits, labels, axis, ignore_index, vocab_size):
    if axis is not None:
        lead = (None,) * (logits.ndim - 1)
        why = (f"loss-parallel cross_entropy reduces over the vocabulary sharded across "
               f"{axis!r}: the logits' last dimension is sharded over it (a ColumnLinear "
               f"LM head's output) and the labels are replicated over it; for whole "
               f"logits pass axis=None")
        _vma.check_layout("cross_entropy", "the logits", logits, P(*lead, axis), [axis], why)
        _vma.check_layout("cross_entropy", "the labels", labels, P(*lead), [axis], why)
    return _loss(logits, labels, axis, ignore_index, vocab_size)


def _columns(logits, axis, vocab_size):
    """The logits in float32 (padding at -inf), and the global index of column 0 here."""
    x = logits.astype(jnp.float32)
    start = 0 if axis is None else lax.axis_index(axis) * x.shape[-1]
    if vocab_size is not None:
        index = start + lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        x = jnp.where(index < vocab_size, x, -jnp.inf)
    return x, start


def _target(x, labels, start):
    """Each label's column here, and whether it is here at all."""
    local = labels - start
    hit = (local >= 0) & (local < x.shape[-1])
    return jnp.clip(local, 0, x.shape[-1] - 1), hit


def _sum(v, axis):
    return v if axis is None else lax.psum(v, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _loss(logits, labels, axis, ignore_index, vocab_size):
    return _forward(logits, labels, axis, ignore_index, vocab_size)[0]


def _forward(logits, labels, axis, ignore_index, vocab_size):
    x, start = _columns(logits, axis, vocab_size)
    peak = jnp.max(x, axis=-1)
    if axis is not None:
        peak = lax.pmax(peak, axis)
    lse = peak + jnp.log(_sum(jnp.sum(jnp.exp(x - peak[..., None]), axis=-1), axis))
    col, hit = _target(x, labels, start)
    target = _sum(jnp.where(hit, jnp.take_along_axis(x, col[..., None], -1)[..., 0], 0.0),
                  axis)
    vocab = vocab_size or x.shape[-1] * (1 if axis is None else lax.axis_size(axis))
    valid = (labels >= 0) & (labels < vocab)
    loss = jnp.where(valid, lse - target, jnp.nan)
    loss = jnp.where(labels == ignore_index, 0.0, loss)
    return loss, (logits, labels, lse)


def _backward(axis, ignore_index, vocab_size, res, g):
    logits, labels, lse = res
    x, start = _columns(logits, axis, vocab_size)
    col, hit = _target(x, labels, start)
    if axis is not None and not _vma.checked(axis):
        # In a shard_map(check_vma=False) JAX hands each device the replicated loss's
        # cotangent divided by the axis size and transposes the forward's psum into a
        # psum, which sums it back: so does this backward (the logits' gradient is
        # otherwise 1/n of the right one).
        g = lax.psum(g, axis)
    g = jnp.where(labels == ignore_index, 0.0, g)
    onehot = (lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == col[..., None]) & \
        hit[..., None]
    d = (jnp.exp(x - lse[..., None]) - onehot) * g[..., None]
    return _vma.cotangent_like(d.astype(logits.dtype), logits), None


_loss.defvjp(_forward, _backward)
