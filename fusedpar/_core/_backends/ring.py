"""The `"ring"` backend: ppermute ring schedules written in lax.

The loops (which block is where, the transfers, the barriers that keep each transfer
beside a matmul, the folded reduce-scatter) are the shared ring library, `_ring_loop.py`;
this module gives it the lax step functions: each step's product is a lax dot, and a
reduce-scatter's add folds into its matmul (`Steps.fold_adds`). `unroll=False` rolls the
steps into a `fori_loop`.
"""

from __future__ import annotations

from .. import _definition, _primitives as prims
from ._backend import Backend
from ._ring_loop import Steps, put, run_steps, segment


def _dot(cfg, a, b, out_dtype=None):
    return _definition.matmul(a, b, precision=cfg.precision, out_dtype=out_dtype)


def gather_step(prim, cfg, x, w):
    """One all-gather step in lax: each piece's product into (or onto) its segment."""
    p = prims.of(prim)

    def step(out, pieces, segs):
        for piece, seg in zip(pieces, segs):
            if p.sums_steps:  # ag_contract: the piece is rows of w; x's matching columns
                # The sum starts from the first product (`run_steps`): no zeros to add to.
                part = _dot(cfg, segment(x, seg, piece.shape[0], 1), piece)
                out = part if out is None else out + part
            elif p.traveller == "x":  # ag_rows: a row block of x, a row block of out
                out = put(out, _dot(cfg, piece, w), seg, p.out_axis)
            else:  # ag_cols: a column block of w, a column block of out
                out = put(out, _dot(cfg, x, piece), seg, p.out_axis)
        return out

    return step


def scatter_step(prim, cfg, x, w):
    """One reduce-scatter step in lax: this device's part of segment `seg`, added in."""
    rows = prims.of(prim).ring_dim == "m"

    def accumulate(acc, seg, length):
        a, b = (segment(x, seg, length, 0), w) if rows else (x, segment(w, seg, length, 1))
        # In `reduce_dtype` as the dot writes it (`_definition.matmul`).
        part = _dot(cfg, a, b, cfg.reduce_dtype)
        return part if acc is None else acc + part

    return accumulate


STEPS = Steps(gather_step, scatter_step, first_product_starts_sum=True, fold_adds=True)


def run(prim, cfg, x, w, return_gathered=False):
    """Run primitive `prim` with the lax ring; see `_primitives.py` for shapes."""
    return run_steps(STEPS, prim, cfg, x, w, return_gathered)


def run_adding(prim, cfg, x, w, addend):
    """`run` of a reduce-scatter with `addend` in each step's contribution."""
    return run_steps(STEPS, prim, cfg, x, w, addend=addend)


BACKEND = Backend(
    name="ring",
    description="ppermute ring schedules in lax, uni- or bidirectional, unrolled or rolled",
    run=run, check_vma=True, cost="ring", candidate=True, run_adding=run_adding)
