"""The gathered buffer `matmul_into(kept=...)` writes its pieces into, checked the same
way for both kernel families."""

from __future__ import annotations


def check_kept(kept, out_shape, k: int, axis: int, dtype) -> None:
    """`kept` must be the pieces' gathered operand: `(R, k)` for row pieces (`axis=0`,
    `out` `(R, C)`), `(k, C)` for column pieces, in the pieces' dtype."""
    want = (out_shape[0], k) if axis == 0 else (k, out_shape[1])
    if kept.shape != want or kept.dtype != dtype:
        raise ValueError(f"matmul_into(axis={axis}): kept is {kept.dtype}{list(kept.shape)}"
                         f", the pieces gather into {dtype}{list(want)}")
