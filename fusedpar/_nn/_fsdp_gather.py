"""The FSDP weight gather of the tensor-parallel layers, and the FSDP matmul.

`fsdp_matmul` overlaps the gather with the matmul (`all_gather_matmul(gather="rhs")`,
the ops and their backends). `gather_fsdp` gathers the whole weight first, for the
sequence-parallel layers whose ring moves the activations, with the ops layer's
`_gather` (plain, or quantized with a straight-through gradient); a stored
`QuantizedArray` is gathered as its values and scales. So is one quantized in blocks
beside a matmul (`gathered_whole`): a ring payload has one scale per channel.
"""

from __future__ import annotations

import functools

from .._core import _gather, _vma
from ._layer_math import matmul_t
from .._core._ops import all_gather_matmul
from .._core._quantized_array import QuantizedArray
from .._sharding._rules import Rule


def gather_fsdp(w, rule: Rule):
    """Gather the FSDP shards of the local weight (its transpose reduce-scatters the grad).

    With the FSDP style's `comm_dtype` each device quantizes its shard (one scale per
    output channel of the shard) and the gather moves values and scales; the result is
    dequantized, with a straight-through gradient. A `QuantizedArray` weight is
    gathered as values and scales (where FSDP splits the input features, the scales only
    where they may differ between the shards: below) and stays quantized; one with a
    `master` is gathered the same way (the master stays home) and dequantized, its
    gradient reduce-scattered to the master.
    """
    f = rule.fsdp
    if f is None:
        return w
    d = rule.fsdp_dim
    if isinstance(w, QuantizedArray):
        # One scale per row covers the whole row where the weight was quantized whole
        # (on global arrays, or before shard_map): nothing to gather, where JAX's types
        # prove the scales the same on every FSDP device. Quantized inside shard_map on
        # its shards, each shard's scales are its own (they vary over the axis), and
        # with check_vma=False nothing says which: then they travel too (a scale per
        # shard of a row: the same numbers for a weight quantized whole).
        one = not w.blocked and d == 1 and _vma.invariant(w.scales, f.axis)
        gather = functools.partial(_gather.gather_payload, axis_name=f.axis, dim=d)
        g = QuantizedArray(gather(w.values), w.scales if one else gather(w.scales),
                           axis=w.axis, dtype=w.dtype,
                           allow_materialise=w.allow_materialise)
        if w.master is None:
            return g
        # Training: the master stays home; its gradient is the gathered weight's,
        # reduce-scattered (straight through the quantization).
        full = g.dequantize()
        return _gather.straight_through(full, w.master.astype(full.dtype), f.axis, d)
    # `_rules.compose` refuses an FSDP grad_comm_dtype on a sequence-parallel layer: none
    # reaches this all_gather, whose transpose is JAX's psum_scatter.
    return _gather.gather(w, f.axis, d, f.comm_dtype)


def gathered_whole(w) -> bool:
    """Whether `fsdp_matmul` gathers `w` whole before multiplying: a `QuantizedArray`
    quantized in blocks (`QuantizedArray.blocked`), whose scales no ring payload carries
    (`QuantizedArray.as_payload`); with a master, the op's ring would quantize the master
    again, one scale per channel, which is not the weight's blocks."""
    return isinstance(w, QuantizedArray) and w.blocked


def fsdp_matmul(x, w, rule: Rule, backend, out_dtype=None):
    """`x @ w.T` with the full weight: the FSDP gather overlapped with the matmul.

    The weight's FSDP dimension `d` is `w.T`'s dimension `1 - d`: the contracting rows
    (gather="rhs", dim=0) or the output columns (dim=1). The op's backward
    reduce-scatters the weight gradient over the FSDP axis. The gather sends the FSDP
    style's `comm_dtype`; a `QuantizedArray` weight travels as its stored values and
    scales (no gradient), or, carrying a `master`, as the master quantized by the op
    to the values' dtype (straight-through gradient to the master). A block-quantized one
    is gathered whole first (`gathered_whole`).
    """
    f = rule.fsdp
    if f is None:
        return matmul_t(x, w, out_dtype)
    if gathered_whole(w):
        return matmul_t(x, gather_fsdp(w, rule), out_dtype)
    comm, grad_comm = f.comm_dtype, f.grad_comm_dtype
    if isinstance(w, QuantizedArray) and w.master is not None:
        w, comm = w.master.astype(w.dtype), w.values.dtype
    wt = w.T.as_payload() if isinstance(w, QuantizedArray) else w.T
    return all_gather_matmul(x, wt, f.axis, gather="rhs", dim=1 - rule.fsdp_dim,
                             backend=backend, preferred_element_type=out_dtype,
                             comm_dtype=comm, grad_comm_dtype=grad_comm,
                             reduce_dtype=f.reduce_dtype)
