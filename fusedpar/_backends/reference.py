"""The `"reference"` backend: each primitive as its lax expression (`_definition.py`).

Forward, a primitive is literally `all_gather` then `dot`, or `dot` then `psum_scatter`.
Its gradient comes from the shared custom VJP (`_autodiff.py`) like every backend's, so the
backward's reduce-scatter also sums in `reduce_dtype` (float32 by default): JAX's own
autodiff of a bfloat16 `all_gather` would reduce-scatter the cotangent in bfloat16,
rounding each device's partial sum before adding. The tests' oracle is `_definition`
under JAX's autodiff, which shares no code with the VJP rules.
"""

from __future__ import annotations

from jax import lax

from .. import _definition, _primitives as prims

DESCRIPTION = "the pure-lax expression: all_gather then dot; dot then psum_scatter"
CHECK_VMA = True

# (gather side, dim) of each all-gather primitive in the public op's terms.
_GATHER = {prims.AG_ROWS: ("lhs", 0), prims.AG_COLS: ("rhs", 1),
           prims.AG_CONTRACT: ("rhs", 0)}


def options(platform: str) -> frozenset:
    return frozenset()


def unavailable(call) -> None:
    return None  # the lax expression runs everywhere


def run(prim, cfg, x, w, return_gathered=False):
    """Run `prim` (see `_primitives.py`) as the lax expression it is defined by."""
    if prim not in prims.GATHERS:
        return _definition.matmul_reduce_scatter(
            x, w, cfg.axis_name, dim=prims.GATHER_AXIS[prim], out_dtype=cfg.out_dtype,
            reduce_dtype=cfg.reduce_dtype, precision=cfg.precision)
    gather, dim = _GATHER[prim]
    out = _definition.all_gather_matmul(x, w, cfg.axis_name, gather=gather, dim=dim,
                                        out_dtype=cfg.out_dtype, precision=cfg.precision)
    if not return_gathered:
        return out
    # The same all_gather as inside the expression: XLA computes it once.
    travelling = x if prims.TRAVELLER[prim] == "x" else w
    return out, lax.all_gather(travelling, cfg.axis_name, axis=dim, tiled=True)
