"""`RowLinear`: tensor parallel on the input features."""

from __future__ import annotations

from typing import Optional

from jax import lax

from . import _definition, _specs
from ._layer import ParallelLinear, add_bias, fsdp_matmul, gather_fsdp
from ._ops import matmul_reduce_scatter


class RowLinear(ParallelLinear):
    """`eqx.nn.Linear` with its weight `(out_features, in_features)` split over the mesh
    axis `axis` along `in_features`; the bias is replicated.

    The input is sharded on its features (a `ColumnLinear`'s output); each device's
    partial product is summed over `axis`: `matmul_reduce_scatter` along the sequence
    dimension (dim -2) with `sequence_parallel=True`, so the output is sharded on it (the
    input a sequence-parallel `ColumnLinear` expects); a matmul and `psum` without. The
    bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key, axis: str = "tp", sequence_parallel: bool = False,
                 fsdp_axis: Optional[str] = None, fsdp_dim: Optional[int] = None,
                 backend: str = "auto"):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as `eqx.nn.Linear`.
        - `axis`: the mesh axis of the tensor-parallel split.
        - `sequence_parallel`: reduce-scatter the output along dim -2 instead of psum.
        - `fsdp_axis`: also shard the weight over this mesh axis (FSDP): along
          `out_features` by default, or `fsdp_dim` (1 puts it on `in_features` after
          `axis`); the input's batch dimension (dim 0) is sharded over it.
        - `backend`: the backend of the collective matmul ops.
        """
        rule = _specs.compose(_specs.Row(axis, sequence_parallel),
                              _specs.FSDP(fsdp_axis, fsdp_dim) if fsdp_axis else None,
                              where="RowLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def _local(self, x, rule):
        tp = rule.tp
        w, b, x = self._operands(x, rule, self.in_features // lax.axis_size(tp.axis))
        if tp.sequence_parallel:
            w = gather_fsdp(w, rule)
            y = matmul_reduce_scatter(x, w.T, tp.axis, dim=x.ndim - 2, backend=self.backend)
        else:
            # Partial sums stay in the accumulation dtype through the psum, as the
            # reduce-scatter's do.
            acc = _definition.accumulation_dtype(x.dtype)
            y = lax.psum(fsdp_matmul(x, w, rule, self.backend, acc), tp.axis).astype(x.dtype)
        return add_bias(y, b)
