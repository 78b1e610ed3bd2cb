"""The `"pallas_gpu"` backend: the lax ring (`fusedpar._ring`) with Triton step kernels.

The ring loops, and which block is where at each step (`fusedpar._schedule.Ring`), are the
lax ring's own; only each step's compute is replaced:

| primitive     | step                                               | kernel         |
|---------------|----------------------------------------------------|----------------|
| `ag_rows`     | `out[rows of seg] = piece @ w`                     | `matmul_into`  |
| `ag_cols`     | `out[:, cols of seg] = x @ piece` (FSDP gather)    | `matmul_into`  |
| `ag_contract` | `out += x[:, cols of seg] @ piece` (FSDP gather)   | `matmul_acc`   |
| `rs_rows`     | `acc += x[rows of seg] @ w`                        | `matmul_acc`   |
| `rs_cols`     | `acc += x @ w[:, cols of seg]`                     | `matmul_acc`   |

On CPU the kernels run in Pallas interpret mode; `options={"interpret": False}` forces
the Triton lowering (used to lower for CUDA on a machine without a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedpar import _definition, _primitives as P, _ring
from fusedpar._backends import ring_shape

from . import _tiles
from ._accumulate import Term, matmul_acc
from ._matmul_into import matmul_into

_DTYPES = ("float32", "bfloat16", "float16")


def _interpret(cfg) -> bool:
    interpret = cfg.option("interpret")
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _kernel_options(cfg):
    return tuple((k, v) for k, v in cfg.options if k in _tiles.OPTIONS)


def unavailable(call):
    """Why the GPU step kernels cannot run `call`, or None."""
    if call.platform not in ("cpu", "gpu", "cuda"):
        return (f"the Pallas Triton kernels run on NVIDIA GPUs (and interpreted on CPU), "
                f"not on {call.platform!r}")
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} is not supported (only {', '.join(_DTYPES)})"
    bidirectional, _ = ring_shape(call, None)
    rows, k, cols = P.step_matmul(call.prim, call.x_shape, call.w_shape, call.axis_size,
                                  2 if bidirectional else 1)
    try:
        _tiles.choose(rows, cols, k, call.dtype)
    except ValueError as e:
        return str(e)
    return None


def run(prim, cfg, x, w, return_gathered=False):
    """Run primitive `prim` (`_primitives.py`) on the lax ring with Triton step kernels."""
    kw = dict(precision=cfg.precision, options=_kernel_options(cfg),
              interpret=_interpret(cfg))
    if prim in P.GATHERS:
        return _gather(prim, cfg, x, w, return_gathered, kw)
    rows = prim == P.RS_ROWS
    axis = P.GATHER_AXIS[prim]
    out_len = P.out_shape(prim, x.shape, w.shape, cfg.axis_size)[axis]

    def accumulate(acc, seg, length):
        if rows:
            term, shape = Term(x, w, x.shape[1], a_row=seg * length), (length, w.shape[1])
        else:
            term, shape = Term(x, w, x.shape[1], b_col=seg * length), (x.shape[0], length)
        return matmul_acc(acc, [term], shape, cfg.reduce_dtype, **kw)

    return _ring.ring_reduce_scatter(cfg, accumulate, out_len, axis)


def _gather(prim, cfg, x, w, return_gathered, kw):
    axis = P.GATHER_AXIS[prim]
    travelling = x if P.TRAVELLER[prim] == "x" else w
    out_dtype = cfg.out_dtype
    if prim == P.AG_CONTRACT:  # summed over the steps: keep it in float32 until the end
        out_dtype = _definition.accumulation_dtype(x.dtype)
    out = jnp.zeros(P.out_shape(prim, x.shape, w.shape, cfg.axis_size), out_dtype)

    def step_fn(carry, pieces, segs):
        # Every direction's piece of a step goes to one launch.
        out, gathered = carry
        if return_gathered:
            for piece, seg in zip(pieces, segs):
                gathered = _ring.put(gathered, piece, seg, axis)
        if prim == P.AG_CONTRACT:  # x's columns matching each row block of w in hand
            k = pieces[0].shape[0]
            terms = [Term(x, p, k, a_col=s * k) for p, s in zip(pieces, segs)]
            return matmul_acc(out, terms, out.shape, out.dtype, **kw), gathered
        resident = w if prim == P.AG_ROWS else x
        return matmul_into(out, pieces, resident, jnp.stack(segs), axis=axis, **kw), gathered

    gathered = _ring.gathered_buffer(cfg, travelling, axis) if return_gathered else None
    out, gathered = _ring.ring_gather(cfg, travelling, axis, step_fn, (out, gathered),
                                      inputs=(x, w))
    out = out.astype(cfg.out_dtype)
    return (out, gathered) if return_gathered else out
