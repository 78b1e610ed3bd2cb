"""`FSDPLinear`: the weight sharded over the data-parallel axis, gathered as it is used."""

from __future__ import annotations

from . import _specs
from ._layer import ParallelLinear, add_bias, fsdp_matmul


class FSDPLinear(ParallelLinear):
    """`eqx.nn.Linear` with its weight `(out_features, in_features)` split over the mesh
    axis `axis` along `out_features` (fully sharded data parallel); the bias is
    replicated.

    The input's batch dimension (dim 0) is sharded over `axis`. The forward gathers the
    weight with `all_gather_matmul(gather="rhs")`, overlapping the gather with the
    matmul; the op's backward reduce-scatters the weight gradient back to its shard.
    To combine FSDP with tensor parallelism use `ColumnLinear`/`RowLinear` with
    `fsdp_axis=`.
    """

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key, axis: str = "fsdp", backend: str = "auto"):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as `eqx.nn.Linear`.
        - `axis`: the mesh axis the weight (and the input's batch) is sharded over.
        - `backend`: the backend of the collective matmul op.
        """
        rule = _specs.compose(_specs.FSDP(axis), where="FSDPLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def _local(self, x, rule):
        w, b, x = self._operands(x, rule, self.in_features)
        return add_bias(fsdp_matmul(x, w, rule, self.backend), b)
