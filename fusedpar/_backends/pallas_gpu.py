"""The `"pallas_gpu"` backend: the lax ring (`ring.py`) with Pallas GPU step kernels.

The ring loops, and which block is where at each step (`fusedpar._schedule.Ring`), are the
lax ring's own: `lax.ppermute` moves the blocks, so XLA runs the transfers on its
collective stream and overlaps them with the kernels. Only each step's compute is a
kernel (`fusedpar.kernels.gpu`):

| primitive     | step                                               | kernel         |
|---------------|----------------------------------------------------|----------------|
| `ag_rows`     | `out[rows of seg] = piece @ w`                     | `matmul_into`  |
| `ag_cols`     | `out[:, cols of seg] = x @ piece` (FSDP gather)    | `matmul_into`  |
| `ag_contract` | `out += x[:, cols of seg] @ piece` (FSDP gather)   | `matmul_acc`   |
| `rs_rows`     | `acc += x[rows of seg] @ w`                        | `matmul_acc`   |
| `rs_cols`     | `acc += x @ w[:, cols of seg]`                     | `matmul_acc`   |

On CPU the kernels run in Pallas interpret mode; `options={"interpret": False}` forces
the GPU lowering (used to lower for CUDA on a machine without a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _batching, _primitives as prims
from . import ring

DESCRIPTION = "a lax ppermute ring whose per-step compute is Pallas GPU kernels"
# The kernels type their results for shard_map's varying-axes check, but a layer wraps
# every Pallas backend in shard_map(check_vma=False), as it always has.
CHECK_VMA = False
_DTYPES = ("float32", "bfloat16", "float16")


def _kernels():
    # Imported on first use: importing fusedpar does not import Pallas.
    from ..kernels import gpu

    return gpu


def options(platform: str) -> frozenset:
    # Tile overrides, and `interpret` (force or forbid Pallas interpret mode).
    return frozenset(_kernels().TILE_OPTIONS) | {"interpret"}


def _interpret(cfg) -> bool:
    interpret = cfg.option("interpret")
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _kernel_options(cfg):
    return tuple((k, v) for k, v in cfg.options if k in _kernels().TILE_OPTIONS)


def unavailable(call):
    """Why the GPU step kernels cannot run `call`, or None."""
    if call.platform not in ("cpu", "gpu", "cuda"):
        return (f"the Pallas GPU kernels run on NVIDIA GPUs (and interpreted on CPU), "
                f"not on {call.platform!r}")
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} is not supported (only {', '.join(_DTYPES)})"
    rows, k, cols = prims.step_matmul(call.prim, call.x_shape, call.w_shape,
                                      call.axis_size, 2 if call.runs_bidirectional else 1)
    try:
        _kernels().choose_tiles(rows, cols, k, call.dtype)
    except ValueError as e:
        return str(e)
    return None


def _kernel_args(cfg):
    return dict(precision=cfg.precision, options=_kernel_options(cfg),
                interpret=_interpret(cfg))


def gather_step(prim, cfg, x, w):
    """One all-gather step: every direction's piece in one kernel launch."""
    gpu, kw = _kernels(), _kernel_args(cfg)

    def step(out, pieces, segs):
        if prim == prims.AG_CONTRACT:  # x's columns matching each row block of w in hand
            k = pieces[0].shape[0]
            terms = [gpu.Term(x, p, k, a_col=s * k) for p, s in zip(pieces, segs)]
            return gpu.matmul_acc(out, terms, out.shape, out.dtype, **kw)
        resident = w if prim == prims.AG_ROWS else x
        return gpu.matmul_into(out, pieces, resident, jnp.stack(segs),
                               axis=prims.GATHER_AXIS[prim], **kw)

    return step


def scatter_step(prim, cfg, x, w):
    """One reduce-scatter step: `acc + x_block @ w` (or `x @ w_block`) in one pass."""
    gpu, kw = _kernels(), _kernel_args(cfg)

    def accumulate(acc, seg, length):
        if prim == prims.RS_ROWS:
            term, shape = gpu.Term(x, w, x.shape[1], a_row=seg * length), (length, w.shape[1])
        else:
            term, shape = gpu.Term(x, w, x.shape[1], b_col=seg * length), (x.shape[0], length)
        return gpu.matmul_acc(acc, [term], shape, cfg.reduce_dtype, **kw)

    return accumulate


def _run(prim, cfg, x, w, return_gathered=False):
    """Run primitive `prim` (`_primitives.py`) on the lax ring with GPU step kernels."""
    return ring.run_steps(gather_step, scatter_step, prim, cfg, x, w, return_gathered)


# pallas_call cannot be batched by jax.vmap on these 2-D layouts: fold the mapped
# dimension into the problem instead (see _batching.py).
run = _batching.vmappable(_run)
