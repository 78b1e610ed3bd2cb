"""Fused Pallas TPU ring kernels (the `"pallas_tpu"` backend, and `"pallas"` on TPU/CPU).

Each primitive (`fusedpar/_primitives.py`) is one kernel in which the ring runs: remote
DMAs between neighbours overlap the matmul of the block in hand. On TPU they compile
with Mosaic; on CPU they run in TPU interpret mode, which simulates every device, DMA and
semaphore (a correctness simulator: slow). See `all_gather_matmul.py`,
`matmul_reduce_scatter.py` (kernels), `_common.py` (the ring protocol) and `_tiling.py`
(tile sizes).

**check_vma.** These are collective kernels: the enclosing `jax.shard_map` must be called
with `check_vma=False`.

**Options** (`options={...}` of the public ops): `block_m`, `block_n`, `block_k` (tile
targets, default 512), `interpret` (bool: force or forbid interpret mode; lowering for TPU
from a CPU host needs False), `interpret_params` (a `pltpu.InterpretParams`).
"""

from __future__ import annotations

from fusedpar import _primitives as P

_DTYPES = ("float32", "bfloat16")

# The `options` keys these kernels read (the dispatcher rejects others). `_broken` selects
# a deliberately broken protocol variant for the tests that prove the checks can fail.
OPTIONS = frozenset({"block_m", "block_n", "block_k", "vmem", "interpret",
                     "interpret_params", "_broken"})


def unavailable(call):
    """Why the TPU kernels cannot run `call` (a `fusedpar._backends.Call`), or None."""
    import jax

    from fusedpar._schedule import Ring

    from . import _common, _tiling, all_gather_matmul, matmul_reduce_scatter

    if call.platform not in ("tpu", "cpu"):
        return (f"the fused TPU kernels run on TPU (or interpreted on CPU), not on "
                f"platform {call.platform!r}")
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} is not supported (supported: {', '.join(_DTYPES)})"
    # The dispatcher picks the ring shape after this check; a default bidirectional ring
    # needs even blocks, which it only picks when they are (see _backends.ring_shape).
    ring = Ring(call.axis_size, bool(call.bidirectional) and call.block_length % 2 == 0)
    x = jax.ShapeDtypeStruct(call.x_shape, call.dtype)
    w = jax.ShapeDtypeStruct(call.w_shape, call.dtype)
    try:  # the largest variant: f32 results, gathered operand returned
        if call.prim in P.GATHERS:
            module = all_gather_matmul
            out = module.buffers(call.prim, ring, x, w, "float32", True)
        else:
            module = matmul_reduce_scatter
            out = module.buffers(call.prim, ring, x, w, "float32", "float32")
        _, _, dims = module.shapes(call.prim, ring.size, ring.bidirectional,
                                   call.x_shape, call.w_shape)
    except ValueError as e:
        return str(e)
    if call.platform == "tpu":
        why = _aligned(call, ring)
        if why is not None:
            return why
    vmem, why = _tiling.plan(_DefaultOptions, dims, _common.nbytes([x, w, *out]))
    return why if vmem is None else None


def _aligned(call, ring):
    """On TPU every ring segment starts at a traced offset: keep it on (sublane, lane)
    tile boundaries (8 rows of 32 bits, i.e. 16 for bf16; 128 columns). The interpreter
    does not need this, so it is only checked for platform "tpu"."""
    import numpy as np

    length = call.block_length // ring.num_directions
    cols = P.GATHER_AXIS[call.prim] == 1 or call.prim == P.AG_CONTRACT  # x's columns
    align = 128 if cols else 8 * 4 // np.dtype(call.dtype).itemsize
    if length % align:
        what = "columns" if cols else "rows"
        return (f"on TPU each ring segment must be a multiple of {align} {what} (TPU "
                f"tiles), but {call.prim} with x {call.x_shape}, w {call.w_shape} over "
                f"{call.axis_size} devices has segments of {length}"
                f"{' (bidirectional halves)' if ring.bidirectional else ''}")
    return None


class _DefaultOptions:
    """Stands in for a Config: `unavailable` checks the default tiles (options are
    checked when the kernel is built, with a message naming the option)."""

    @staticmethod
    def option(name, default=None):
        return default


def run(prim, cfg, x, w, return_gathered=False):
    """Run primitive `prim` as a fused TPU kernel; see `fusedpar/_primitives.py` for shapes."""
    from . import _common, all_gather_matmul, matmul_reduce_scatter

    if cfg.option("_broken") not in _common.BROKEN:
        raise ValueError(f"unknown _broken option {cfg.option('_broken')!r}")
    try:
        if prim in P.GATHERS:
            return all_gather_matmul.all_gather_matmul(prim, cfg, x, w, return_gathered)
        return matmul_reduce_scatter.matmul_reduce_scatter(prim, cfg, x, w)
    except ValueError as e:  # JAX's vma message suggests a fix that is not enough
        if "vma" in str(e):
            raise type(e)(f"{e}\n\n{_common.CHECK_VMA_HINT}") from e
        raise
