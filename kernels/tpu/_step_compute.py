"""A ring step's compute: `o = a @ b (* scale) (+ prev)` and `o = a + b`, whole or tiled.

In VMEM (`tiles` None) the refs are whole blocks and the step is one `jnp.dot`. On the
tiled path the refs are HBM windows (or VMEM-resident buffers) and the step is a
`pltpu.emit_pipeline` over `(bm, bk) x (bk, bn)` tiles that double-buffers the next
tiles' HBM->VMEM copies behind the MXU work on the current ones and accumulates in an f32
VMEM scratch. A ref that already lives in VMEM (a resident buffer) is not copied: the
pipeline hands the body a window of it.

Megacore (`cores` > 1): the pallas_call's grid axis 0 has one program per TensorCore, and
the pipeline splits its (parallel) row and column tiles between them (`core_axis=0`), so
each core computes its own tiles; the reduction over k stays on one core. A given
`(rows, cols)` problem is always split the same way, so the matmul and the add that
follows it touch the same tiles on the same core.

Every pipeline block is checked against Mosaic's layout (`_layout.check_block`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _layout

_PARALLEL, _ARBITRARY = pltpu.PARALLEL, pltpu.ARBITRARY


def _split(cores):
    """emit_pipeline arguments that share the tile grid between `cores` TensorCores."""
    return {} if cores == 1 else {"core_axis": 0}


def _widen(a, b):
    """Both operand values in the wider of their dtypes: an 8-bit (quantized) operand is
    converted in VMEM before the MXU, which Mosaic does not give int8 x bf16 with a float
    accumulator ("float acc with int lhs"). Exact: int8 and float8_e4m3fn values are
    bfloat16 (and float32) values."""
    if a.dtype == b.dtype:
        return a, b
    if a.dtype.itemsize < b.dtype.itemsize:
        return a.astype(b.dtype), b
    return a, b.astype(a.dtype)


# `a @ b.T` for a `b` held as (cols, contraction): the MXU takes a transposed right
# operand as it loads it, so a weight kept in (out, in) order is read in place.
_NT = (((1,), (1,)), ((), ()))
# `a.T @ b` for an `a` held as (contraction, rows): a weight gradient's `x.T @ dy` on the
# rows of x that match a block of dy, read in place (Mosaic transposes the tile in VMEM).
_TN = (((0,), (0,)), ((), ()))


def _product(a, b, scale, precision, b_transposed=False, a_transposed=False):
    """`a @ b` (`a @ b.T` with `b_transposed`, `a.T @ b` with `a_transposed`) in f32
    (operands widened), times `scale` (broadcast) if given."""
    a, b = _widen(a, b)
    if b_transposed or a_transposed:
        y = lax.dot_general(a, b, _NT if b_transposed else _TN,
                            preferred_element_type=jnp.float32, precision=precision)
    else:
        y = jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)
    return y if scale is None else y * scale


def _column(row):
    """A `(1, rows)` row of per-row scales as the `(rows, 1)` column that scales the
    product's rows. The scales travel lane-dense: a `(rows, 1)` f32 buffer would take 128
    lanes a row in Mosaic's (8, 128) tiles (and its DMAs as many bytes)."""
    return row.reshape(row.shape[1], 1)


def matmul(a, b, o, tiles, *, prev=None, scale=None, scale_rows=False, precision=None,
           cores=1, enforce=None, b_transposed=False, a_transposed=False):
    """`o = (a @ b) * scale (+ prev)` with f32 accumulation: whole VMEM refs (`tiles`
    None), or refs tiled by `tiles = (bm, bk, bn)`. `enforce`: the `Chip` built for (check
    tiles against Mosaic's layout), or None. `b_transposed`: `b` holds the right operand
    transposed, `(cols, contraction)`, and is tiled `(bn, bk)`; `a_transposed`: `a` holds
    the left one transposed, `(contraction, rows)`, tiled `(bk, bm)` (not with a scale).

    `scale` (float32, optional) is a quantized operand's scales, `(1, rows)` with
    `scale_rows` (one per row of the product, laid along lanes) or `(1, cols)` (one per
    column): the step multiplies the 8-bit values (widened in VMEM, exactly) and scales
    the f32 product once, before adding `prev`."""
    if a_transposed and scale is not None:
        raise ValueError("matmul: a_transposed takes no scale (a weight gradient's step)")
    if tiles is None:
        s = None if scale is None else scale[...]
        y = _product(a[...], b[...], _column(s) if s is not None and scale_rows else s,
                     precision, b_transposed, a_transposed)
        if prev is not None:
            y = y + prev[...].astype(jnp.float32)
        o[...] = y.astype(o.dtype)
        return
    rows, contraction = a.shape[::-1] if a_transposed else a.shape
    cols = b.shape[0 if b_transposed else 1]
    bm, bk, bn = tiles
    a_block = (bk, bm) if a_transposed else (bm, bk)
    b_block = (bn, bk) if b_transposed else (bk, bn)
    if cores == 1 and (bm, bk, bn) == (rows, contraction, cols):
        return _whole(a, b, o, prev, scale, scale_rows, precision, b_transposed,
                      a_transposed)
    if scale is not None and scale_rows:  # the pipeline takes (bm, 1) blocks of a column
        def with_column(row, column):
            pltpu.sync_copy(scale, row)
            column[...] = _column(row[...])
            matmul(a, b, o, tiles, prev=prev, scale=column, precision=precision,
                   cores=cores, enforce=enforce, b_transposed=b_transposed)

        pl.run_scoped(with_column, pltpu.VMEM((1, rows), jnp.float32),
                      pltpu.VMEM((rows, 1), jnp.float32))
        return
    nk = contraction // bk
    # A (rows, 1) column here is per-row scales (the VMEM column made above).
    per_row = scale is not None and tuple(scale.shape) == (rows, 1) and rows > 1
    checks = [("the step's left operand", a, a_block),
              ("the step's right operand", b, b_block),
              ("the step's result", o, (bm, bn))]
    if scale is not None:
        checks.append(("the step's scales", scale, (bm, 1) if per_row else (1, bn)))
    for name, ref, block in checks:
        _layout.check_block(name, ref.shape, ref.dtype, block, enforce)

    def body(acc, a_t, b_t, *rest):
        o_t = rest[-1]
        prev_t = rest[0] if prev is not None else None
        scale_t = rest[-2] if scale is not None else None
        k = pl.program_id(2)

        @pl.when(k == 0)
        def _():
            if prev is None or scale is not None:  # a scaled sum adds `prev` at the end
                acc[...] = jnp.zeros_like(acc)
            else:
                acc[...] = prev_t[...].astype(jnp.float32)

        acc[...] += _product(a_t[...], b_t[...], None, precision, b_transposed,
                             a_transposed)

        @pl.when(k == nk - 1)
        def _():
            y = acc[...]
            if scale is not None:
                y = y * scale_t[...]
                if prev is not None:
                    y = y + prev_t[...].astype(jnp.float32)
            o_t[...] = y.astype(o_t.dtype)

    in_specs = [pl.BlockSpec(a_block, (lambda i, j, k: (k, i)) if a_transposed
                             else (lambda i, j, k: (i, k))),
                pl.BlockSpec(b_block, (lambda i, j, k: (j, k)) if b_transposed
                             else (lambda i, j, k: (k, j)))]
    args = [a, b]
    if prev is not None:
        in_specs.append(pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)))
        args.append(prev)
    if scale is not None:
        in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, k: (i, 0)) if per_row
                        else pl.BlockSpec((1, bn), lambda i, j, k: (0, j)))
        args.append(scale)

    def scoped(acc):
        pltpu.emit_pipeline(
            functools.partial(body, acc), grid=(rows // bm, cols // bn, nk),
            in_specs=in_specs, out_specs=[pl.BlockSpec((bm, bn), lambda i, j, k: (i, j))],
            dimension_semantics=(_PARALLEL, _PARALLEL, _ARBITRARY), **_split(cores),
        )(*args, o)

    pl.run_scoped(scoped, pltpu.VMEM((bm, bn), jnp.float32))


def _whole(a, b, o, prev, scale, scale_rows, precision, b_transposed=False,
           a_transposed=False):
    """One tile: copy the operands into VMEM, multiply, copy the result out."""
    extra = [r for r in (prev, scale) if r is not None]
    refs = [a, b] + extra

    def scoped(*vmem):
        *ins, o_v = vmem
        for src, dst in zip(refs, ins):
            pltpu.sync_copy(src, dst)
        s = None if scale is None else ins[-1][...]
        y = _product(ins[0][...], ins[1][...], _column(s) if s is not None and scale_rows else s,
                     precision, b_transposed, a_transposed)
        if prev is not None:
            y = y + ins[2][...].astype(jnp.float32)
        o_v[...] = y.astype(o_v.dtype)
        pltpu.sync_copy(o_v, o)

    pl.run_scoped(scoped, *[pltpu.VMEM(r.shape, r.dtype) for r in refs + [o]])


def add(a, b, o, tiles, *, cores=1, enforce=None):
    """`o = a + b` (in f32, cast to o's dtype): whole VMEM refs (`tiles` None), or refs in
    `tiles = (bm, bn)` tiles (split between `cores` as `matmul` splits its tiles)."""

    def body(a_t, b_t, o_t):
        o_t[...] = (a_t[...].astype(jnp.float32)
                    + b_t[...].astype(jnp.float32)).astype(o_t.dtype)

    if tiles is None:
        return body(a, b, o)
    bm, bn = tiles
    rows, cols = o.shape
    if cores == 1 and (bm, bn) == (rows, cols):
        def scoped(a_v, b_v, o_v):
            pltpu.sync_copy(a, a_v)
            pltpu.sync_copy(b, b_v)
            body(a_v, b_v, o_v)
            pltpu.sync_copy(o_v, o)

        pl.run_scoped(scoped, *[pltpu.VMEM(r.shape, r.dtype) for r in (a, b, o)])
        return
    for name, ref in (("the accumulator in hand", a), ("the received accumulator", b),
                      ("the sum", o)):
        _layout.check_block(name, ref.shape, ref.dtype, (bm, bn), enforce)
    spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    pltpu.emit_pipeline(body, grid=(rows // bm, cols // bn), in_specs=[spec, spec],
                        out_specs=[spec], dimension_semantics=(_PARALLEL, _PARALLEL),
                        **_split(cores))(a, b, o)
