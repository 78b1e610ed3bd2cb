"""`Term`: one window product of an accumulating step kernel (both kernel families)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("a", "b", "a_row", "a_col", "b_row", "b_col"),
                   meta_fields=("k",))
@dataclasses.dataclass(frozen=True)
class Term:
    """`a[a_row:+m, a_col:+k] @ b[b_row:+k, b_col:+n]`; offsets may be traced int32.

    `k` is the window's contraction length; `m` and `n` are the accumulator's. The ring
    keeps every offset a multiple of the window's length along its axis.
    """

    a: Any
    b: Any
    k: int
    a_row: Any = 0
    a_col: Any = 0
    b_row: Any = 0
    b_col: Any = 0

    def offsets(self):
        return (self.a_row, self.a_col, self.b_row, self.b_col)
