"""The order in which a launch's programs (or a persistent CTA's steps) visit output tiles."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Tile:
    """One output tile: `group` (which piece of a two-piece launch), row `i`, column `j`."""

    group: Any
    i: Any
    j: Any


def tile_of(t, *, tiles_m: int, tiles_n: int, group_m: int, num_groups: int = 1) -> Tile:
    """The tile of linear index `t` (a traced int32): groups major, then bands of rows.

    Inside a group, consecutive indices walk down `group_m` tile rows before moving one
    tile column right, so the tiles computed at the same time share the columns of the
    right operand (and rows of the left) in L2 instead of each streaming its own.
    """
    per_group = tiles_m * tiles_n
    group = lax.div(t, per_group) if num_groups > 1 else jnp.int32(0)
    r = lax.rem(t, per_group) if num_groups > 1 else t
    gm = min(group_m, tiles_m)
    band = gm * tiles_n
    first = lax.div(r, band) * gm
    rows = jnp.minimum(tiles_m - first, gm)
    local = lax.rem(r, band)
    return Tile(group, first + lax.rem(local, rows), lax.div(local, rows))
