"""The `"pallas_tpu"` backend: one fused Pallas TPU kernel per primitive, the ring inside.

The kernels (`fusedpar.kernels.tpu`) move blocks with remote DMAs between neighbours
while the MXU multiplies the block in hand. On TPU they compile with Mosaic; on CPU they
run in TPU interpret mode, which simulates every device, DMA and semaphore (a correctness
simulator: slow).

These are collective kernels: the enclosing `jax.shard_map` must use `check_vma=False`.

Options (`options={...}` of the public ops): `block_m`, `block_n`, `block_k` (tile
targets), `vmem` (force every buffer into VMEM, or force the tiled HBM path),
`interpret` (bool: force or forbid interpret mode; lowering for TPU from a CPU host needs
False), `interpret_params` (a `pltpu.InterpretParams`), and `_broken` (a deliberately
broken protocol variant, for the tests that prove the checks can fail).
"""

from __future__ import annotations

import jax
import numpy as np

from .. import _batching, _primitives as prims
from .._schedule import Ring

DESCRIPTION = "one fused Pallas TPU kernel per op: the ring runs inside it with remote DMAs"
CHECK_VMA = False
_DTYPES = ("float32", "bfloat16")
_OPTIONS = frozenset({"block_m", "block_n", "block_k", "vmem", "interpret",
                      "interpret_params", "_broken"})


def _kernels():
    # Imported on first use: importing fusedpar does not import Pallas.
    from ..kernels import tpu

    return tpu


def options(platform: str) -> frozenset:
    return _OPTIONS


class _DefaultOptions:
    """Stands in for a Config: `unavailable` checks the default tiles (options are
    checked when the kernel is built, with a message naming the option)."""

    @staticmethod
    def option(name, default=None):
        return default


def unavailable(call):
    """Why the TPU kernels cannot run `call` (a `_primitives.Call`), or None."""
    if call.platform not in ("tpu", "cpu"):
        return (f"the fused TPU kernels run on TPU (or interpreted on CPU), not on "
                f"platform {call.platform!r}")
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} is not supported (supported: {', '.join(_DTYPES)})"
    tpu = _kernels()
    ring = Ring(call.axis_size, call.runs_bidirectional)
    x = jax.ShapeDtypeStruct(call.x_shape, call.dtype)
    w = jax.ShapeDtypeStruct(call.w_shape, call.dtype)
    try:  # the largest variant: f32 results, gathered operand returned
        if call.prim in prims.GATHERS:
            module = tpu.all_gather_matmul
            out = module.buffers(call.prim, ring, x, w, "float32", True)
        else:
            module = tpu.matmul_reduce_scatter
            out = module.buffers(call.prim, ring, x, w, "float32", "float32")
        _, _, dims = module.shapes(call.prim, ring.size, ring.bidirectional,
                                   call.x_shape, call.w_shape)
    except ValueError as e:
        return str(e)
    if call.platform == "tpu":
        why = _aligned(call, ring)
        if why is not None:
            return why
    vmem, why = tpu.plan(_DefaultOptions, dims, tpu.nbytes([x, w, *out]))
    return why if vmem is None else None


def _aligned(call, ring):
    """On TPU every ring segment starts at a traced offset: keep it on (sublane, lane)
    tile boundaries (8 rows of 32 bits, i.e. 16 for bf16; 128 columns). The interpreter
    does not need this, so it is only checked for platform "tpu"."""
    length = call.block_length // ring.num_directions
    cols = prims.GATHER_AXIS[call.prim] == 1 or call.prim == prims.AG_CONTRACT
    align = 128 if cols else 8 * 4 // np.dtype(call.dtype).itemsize
    if length % align:
        what = "columns" if cols else "rows"
        return (f"on TPU each ring segment must be a multiple of {align} {what} (TPU "
                f"tiles), but {call.prim} with x {call.x_shape}, w {call.w_shape} over "
                f"{call.axis_size} devices has segments of {length}"
                f"{' (bidirectional halves)' if ring.bidirectional else ''}")
    return None


def _run(prim, cfg, x, w, return_gathered=False):
    """Run primitive `prim` as a fused TPU kernel; see `_primitives.py` for shapes."""
    tpu = _kernels()
    if cfg.option("_broken") not in tpu.BROKEN:
        raise ValueError(f"unknown _broken option {cfg.option('_broken')!r}")
    try:
        if prim in prims.GATHERS:
            return tpu.all_gather_matmul.all_gather_matmul(prim, cfg, x, w, return_gathered)
        return tpu.matmul_reduce_scatter.matmul_reduce_scatter(prim, cfg, x, w)
    except ValueError as e:  # JAX's vma message suggests a fix that is not enough
        if "vma" in str(e):
            raise type(e)(f"{e}\n\n{tpu.CHECK_VMA_HINT}") from e
        raise


# pallas_call cannot be batched by jax.vmap on these 2-D layouts: fold the mapped
# dimension into the problem instead (see _batching.py).
run = _batching.vmappable(_run)
