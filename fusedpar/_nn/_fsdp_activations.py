"""FSDP by moving the activations instead of the weight, for steps with few tokens.

A layer with an FSDP weight gathers each weight shard over the FSDP axis before its
product (and tensor-parallel op): `(fsdp - 1)` shards per device, every step. A decode
step multiplies a handful of tokens by that weight, so the gather is nearly all its time.
The weight can stay where it is instead ("weight-stationary", as in Pope et al.,
"Efficiently Scaling Transformer Inference"): each device brings in the tokens of its FSDP
peers, multiplies them by its own shard (inside the tensor-parallel op, if the layer has
one), and hands each peer back its rows:

- the FSDP split on the contracting features: each device receives every peer's slice of
  those features (`all_to_all`), forms partial products over its slice, and the partial
  sums are reduce-scattered back over the batch (`psum_scatter`, in `reduce_dtype`);
- the FSDP split on the output features: each device gathers every peer's tokens
  (`all_gather`) and returns each peer its rows of its output columns (`all_to_all`).

Autodiff gives the backward from the lax collectives; the weight gradient stays on its
shard (no reduce-scatter). `FSDP(gather=)` chooses: "weights", "activations", or "auto"
(`moves_activations`), which times the two with the target's cost numbers
(`fusedpar.cost_model`): two collectives of the activations' bytes against one of the
weight's, each paying its launch and hop latency. A decode step's layers move their
activations on TPUs (a few microseconds per collective, 50-112 GB/s links) and on H100s
(~7.5 us per collective, 450 GB/s) alike; a training step or a prefill gathers weights.
That counts the weight gather's latency although XLA may start it early: on H100s a
decode step with every weight gathered replayed faster with Triton GEMMs (151 us against
169) and slower with cuBLAS (202 against 164), and with the attention projections
gathering their weights (the gather's latency left out) 171 and 179.
"""

from __future__ import annotations

import math

import numpy as np
from jax import lax

from .._core import _definition
from .._sharding._layouts import has_data_dim
from .._sharding._styles import Column
from ._layer_math import stationary

def _reduce_dtype(rule, dtype) -> np.dtype:
    """What the FSDP partial sums are summed and sent in."""
    f = rule.fsdp.reduce_dtype
    return np.dtype(_definition.accumulation_dtype(dtype) if f is None else f)


def activation_bytes(rule, x_shape, in_features, out_features, sizes, dtype) -> int:
    """Bytes per device the activations route sends, forward: `x_shape` the local input."""
    f = sizes[rule.fsdp.axis]
    t = 1 if rule.tp is None else sizes[rule.tp.axis]
    item, acc = np.dtype(dtype).itemsize, _reduce_dtype(rule, dtype).itemsize
    rows = math.prod(x_shape[:-1])
    # The product's rows: gathered over tp (a sequence-parallel Column), scattered over
    # it (a sequence-parallel Row), or x's own; its columns: the output features, those
    # of a Column's tp shard.
    y_rows = (rows if not rule.sequence_parallel else rows * t
              if isinstance(rule.tp, Column) else rows // t)
    y_cols = out_features // t if isinstance(rule.tp, Column) else out_features
    x_elems = rows * (in_features // t if rule.tp is not None and rule.tp_dim == 1
                      else in_features)
    if _contracting(rule):
        # all_to_all of x (each peer its slice), psum_scatter of the partial sums.
        return (f - 1) * (x_elems // f * item + y_rows * y_cols * acc)
    # all_gather of x, all_to_all of the product (each peer its rows).
    return (f - 1) * (x_elems * item + y_rows * y_cols // f * item)


def _contracting(rule) -> bool:
    """Whether FSDP splits the weight's input (contracting) features: dim 1 of (out, in)."""
    return rule.fsdp_dim == 1


def moves_activations(where, rule, x_shape, dtype, in_features, out_features, sizes,
                      weight_bytes, hardware) -> bool:
    """Whether the layer `where` takes the activations route: `FSDP(gather=)`, and for
    "auto" whether its two collectives take less time than the one weight gather (the
    local shard's `weight_bytes`, as stored, received `fsdp - 1` times), each timed with
    `hardware`'s launch and hop latency and its bytes over one link. `x_shape`, `dtype`:
    the local input's. Only a layer whose input has a batch dimension (dim 0, sharded
    over the FSDP axis) and no narrow FSDP comm dtype can move them; "activations"
    anywhere else is an error."""
    f = rule.fsdp
    if f is None or f.gather == "weights":
        return False
    batch = ("(batch, seq, features)" if rule.sequence_parallel
             else "(batch, ..., features)")
    why = (f"its input of rank {len(x_shape)} has no batch dimension (dim 0 of {batch}; "
           "under a jax.vmap with a jit, scan or checkpoint inside it, the layer sees one "
           "example)"
           if not has_data_dim(rule, len(x_shape)) else
           "FSDP's comm_dtype / grad_comm_dtype quantize the weight gather"
           if f.comm_dtype is not None or f.grad_comm_dtype is not None else
           # XLA lowers no all-gather of a zero-size dimension.
           f"its input's batch is empty (local shape {tuple(x_shape)}): no tokens to move"
           if x_shape[0] == 0 else None)
    if f.gather == "activations":
        if why is not None:
            raise ValueError(
                f"{where}: FSDP(gather='activations') moves the tokens of the FSDP peers "
                f"instead of the weight, but {why}; use gather='weights' (or 'auto').")
        return True
    if why is not None:
        return False
    n, link = sizes[f.axis], hardware.link_bandwidth
    collective = hardware.launch_overhead + (n - 1) * hardware.hop_latency
    weight = (n - 1) * weight_bytes / link
    moved = activation_bytes(rule, x_shape, in_features, out_features, sizes, dtype) / link
    return 2 * collective + moved < collective + weight


def local(x, w, rule, tp_op):
    """The layer on the local `x` (batch dim 0 sharded over the FSDP axis) with its
    local weight shard `w` (out, in; a stored `QuantizedArray` is dequantized here, where
    it stays, its gradient straight through to its master): `tp_op(x, w, out_dtype)` is
    the layer's product (with its tensor-parallel collective, if any) on the FSDP peers'
    tokens; returns the output in `x.dtype`."""
    w = stationary(w)
    axis = rule.fsdp.axis
    last = x.ndim - 1
    if _contracting(rule):
        xs = lax.all_to_all(x, axis, last, 0, tiled=True)
        acc = _reduce_dtype(rule, x.dtype)
        y = tp_op(xs, w, acc)
        return _definition.psum_scatter(y, axis, 0).astype(x.dtype)
    xg = lax.all_gather(x, axis, axis=0, tiled=True)
    y = tp_op(xg, w, x.dtype)
    return lax.all_to_all(y, axis, 0, last, tiled=True)
