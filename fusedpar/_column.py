"""`ColumnLinear`: tensor parallel on the output features."""

from __future__ import annotations

from typing import Optional

from . import _context, _specs
from ._layer import ParallelLinear, add_bias, fsdp_matmul, gather_fsdp
from ._ops import all_gather_matmul


class ColumnLinear(ParallelLinear):
    """`eqx.nn.Linear` with its weight `(out_features, in_features)` split over the mesh
    axis `axis` along `out_features` (and the bias with it).

    The input is replicated over `axis`; the output is sharded on its features (the input
    a `RowLinear` expects), or whole with `gather_output=True`. With
    `sequence_parallel=True` the input arrives sharded along its sequence dimension (dim
    -2) and the layer runs `all_gather_matmul(gather="lhs")`, overlapping the gather with
    the matmul; without it the forward is a local matmul and the backward sums the input
    gradient over `axis` (inside `shard_map(check_vma=True)` JAX does this for an input
    that is invariant over `axis`).
    """

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key, axis: str = "tp", sequence_parallel: bool = False,
                 gather_output: bool = False, fsdp_axis: Optional[str] = None,
                 fsdp_dim: Optional[int] = None, backend: str = "auto"):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as `eqx.nn.Linear`
          (the same key gives the same weights).
        - `axis`: the mesh axis of the tensor-parallel split.
        - `sequence_parallel`: the input is sharded over `axis` along dim -2.
        - `gather_output`: return the whole output instead of its feature shard.
        - `fsdp_axis`: also shard the weight over this mesh axis (FSDP): along
          `in_features` by default, or `fsdp_dim` (0 puts it on `out_features` after
          `axis`); the input's batch dimension (dim 0) is sharded over it.
        - `backend`: the backend of the collective matmul ops (`"auto"`, `"reference"`,
          `"ring"`, ...).
        """
        rule = _specs.compose(_specs.Column(axis, sequence_parallel, gather_output),
                              _specs.FSDP(fsdp_axis, fsdp_dim) if fsdp_axis else None,
                              where="ColumnLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def _local(self, x, rule):
        tp = rule.tp
        w, b, x = self._operands(x, rule, self.in_features)
        if tp.sequence_parallel:
            w = gather_fsdp(w, rule)
            y = all_gather_matmul(x, w.T, tp.axis, gather="lhs", dim=x.ndim - 2,
                                  backend=self.backend)
        else:
            y = fsdp_matmul(x, w, rule, self.backend)
        y = add_bias(y, b)
        if tp.gather_output:
            y = _context.gather_invariant(y, tp.axis, y.ndim - 1)
        return y
