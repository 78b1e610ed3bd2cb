"""Tile configurations for the Triton step kernels: a heuristic per shape and dtype.

A kernel instance computes one `(block_m, block_n)` tile of a product, stepping over the
contraction `block_k` at a time; `num_warps` and `num_stages` (software-pipelining depth)
go to the Triton compiler; `group_m` tiles along m share one launch group so that
neighbouring programs reuse the same columns of the right operand from L2.

Triton needs every loaded block to be a power of 2, and `tl.dot` at least 16 along each
dimension; the kernels do not mask, so blocks must also divide the problem. Any field
can be overridden through the op's `options` (`block_m`, `block_n`, `block_k`,
`num_warps`, `num_stages`, `group_m`); an override that breaks these rules is an error.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Starting points for an H100/H200 (228 KiB of shared memory per SM, 132 SMs). They
# follow the usual Triton GEMM configurations; they have not been tuned on hardware yet
# (bench/test_gpu_steps.py measures them).
_PREFERRED = {
    # itemsize: (block_m, block_n, block_k)
    2: (128, 256, 64),  # bf16/f16: 3 stages of (128x64 + 64x256) x 2 B = 144 KiB
    4: (128, 128, 32),  # f32 (TF32 MMA): 3 stages of (128x32 + 32x128) x 4 B = 96 KiB
}
_MIN_BLOCK = 16  # tl.dot's smallest tile along every dimension
_NUM_SMS = 132  # below this many tiles a launch leaves SMs idle: use smaller tiles
OPTIONS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def _largest_block(length: int, preferred: int) -> int | None:
    """Largest power of 2 <= `preferred` dividing `length`, at least _MIN_BLOCK (or None)."""
    block = preferred
    while block >= _MIN_BLOCK:
        if length % block == 0:
            return block
        block //= 2
    return None


def _check_block(name, block, length, what):
    if block < _MIN_BLOCK or block & (block - 1):
        raise ValueError(f"options[{name!r}]={block} must be a power of 2 and at least "
                         f"{_MIN_BLOCK} (Triton blocks).")
    if length % block:
        raise ValueError(f"options[{name!r}]={block} does not divide {what}={length} of "
                         "a ring step's matmul.")


def choose(m: int, n: int, k: int, dtype, options=()) -> Tiles:
    """Tiles for one step's `(m, k) @ (k, n)` in `dtype`, with `options` overrides.

    Raises `ValueError` naming the dimension when no valid block exists.
    """
    opts = dict(options)
    itemsize = min(jnp.dtype(dtype).itemsize, 4)
    pref_m, pref_n, pref_k = _PREFERRED[itemsize if itemsize in _PREFERRED else 4]
    blocks = {}
    for name, length, pref, what in (("block_m", m, pref_m, "m"), ("block_n", n, pref_n, "n"),
                                     ("block_k", k, pref_k, "k")):
        if name in opts:
            _check_block(name, opts[name], length, what)
            blocks[name] = opts[name]
            continue
        block = _largest_block(length, pref)
        if block is None:
            raise ValueError(
                f"a ring step multiplies ({m}, {k}) by ({k}, {n}): {what}={length} is not a "
                f"multiple of {_MIN_BLOCK}, which the Triton kernels need (use the 'ring' "
                "backend for such shapes).")
        blocks[name] = block
    # Small problems: shrink the output tile (n first) until every SM has work.
    while (m // blocks["block_m"]) * (n // blocks["block_n"]) < _NUM_SMS:
        if "block_n" not in opts and blocks["block_n"] > 64:
            blocks["block_n"] //= 2
        elif "block_m" not in opts and blocks["block_m"] > 64:
            blocks["block_m"] //= 2
        else:
            break
    big = blocks["block_m"] * blocks["block_n"] >= 128 * 256
    tiles = Tiles(num_warps=8 if big else 4, num_stages=3, **blocks)
    overrides = {o: opts[o] for o in ("num_warps", "num_stages", "group_m") if o in opts}
    for name, value in overrides.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"options[{name!r}] must be a positive int, got {value!r}.")
    if overrides.get("num_warps", 1) & (overrides.get("num_warps", 1) - 1):
        raise ValueError(f"options['num_warps'] must be a power of 2, got "
                         f"{overrides['num_warps']}.")
    return dataclasses.replace(tiles, **overrides)
