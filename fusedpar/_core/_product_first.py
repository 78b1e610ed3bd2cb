"""ag_rows with a replicated w: multiply the local rows first, then gather the product.

When every device of the ring holds the same w, and JAX says so (inside
`shard_map(check_vma=True)`, w is invariant over the ring's axis: `_vma.invariant`),
`all_gather(x) @ w` equals `all_gather(x @ w)` block for block: each device multiplies
only its own (m, k) rows, 1/N of the reference's FLOPs, and the collective moves the
(m, n) product instead of x. This is what XLA's partitioner does with the same program
(w replicated, x sharded by rows). With `check_vma=False` nothing is typed, and a w that
only looks replicated may differ per device: then the op never takes this path.

`"auto"` takes it where the cost model (`cost_model.product_first`) estimates it faster
than the backend it would pick otherwise (`_dispatch`); it runs on lax collectives
(there is no matmul left to overlap the gather with).

Backward, with `dy_d` the cotangent of device d's copy `y_d` of the gathered product
(`L = sum_d <dy_d, y_d>`):

    dL/dx_j = sum_d dy_d[j] @ w.T   ->  dys = psum_scatter(dy) (rows), dx = dys @ w.T
    dL/dw   = sum_j x_j.T @ dys_j   ->  dw = psum(x.T @ dys)

both local matmuls 1/N of the reference's again. The cotangents are summed in
`cfg.reduce_dtype` (float32 for 16-bit inputs, as the reference's reduce-scatter; off
TPU, and on a TPU slice whose shape suits it, they travel in their own dtype, by
all-to-all, and are summed on arrival: `_sum_scattered`), and the psum of dw is
`_vma.cotangent_like`'s, the one every invariant w's cotangent gets.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .._hw import _target
from . import _definition, _schedule


def forward(cfg, x, w, return_gathered=False):
    """`all_gather(x @ w)` over the ring: x (m, k), w (k, n) invariant -> (N*m, n); with
    `return_gathered`, also x gathered (N*m, k), by a second all-gather."""
    y = _definition.matmul(x, w, precision=cfg.precision, out_dtype=cfg.out_dtype)
    out = lax.all_gather(y, cfg.axis_name, axis=0, tiled=True)
    if not return_gathered:
        return out
    return out, lax.all_gather(x, cfg.axis_name, axis=0, tiled=True)


def backward(cfg, x, w, dy):
    """`(dx (m, k), dw (k, n))` for this device's x and the cotangent dy (N*m, n) of its
    copy of the product; dw is this device's part, which the caller sums over the ring."""
    dys = _sum_scattered(cfg, dy).astype(x.dtype)
    dx = _definition.matmul(dys, w.T, precision=cfg.precision, out_dtype=x.dtype)
    dw = _definition.matmul(x.T, dys, precision=cfg.precision, out_dtype=w.dtype)
    return dx, dw


def _sum_scattered(cfg, dy):
    """This device's rows of the sum of every device's dy (N*m, n), summed in
    `cfg.reduce_dtype`.

    dy's addends are exact in its own dtype, so they can travel as they are: an
    all-to-all sends each device its rows of every dy, which it adds in `reduce_dtype`
    (`_by_all_to_all` says where); else a `reduce_dtype` reduce-scatter sums them."""
    n = cfg.axis_size
    if not _by_all_to_all(cfg, dy):
        return _definition.psum_scatter(dy.astype(cfg.reduce_dtype), cfg.axis_name, 0,
                                        cfg.explicit_vmap)
    blocks = lax.all_to_all(dy, cfg.axis_name, 0, 0, tiled=True)  # (N*m, n): rows from each
    return blocks.reshape(n, -1, *dy.shape[1:]).astype(cfg.reduce_dtype).sum(axis=0)


def _by_all_to_all(cfg, dy) -> bool:
    """Whether dy's addends travel by all-to-all rather than summed in a reduce-scatter.

    The same sum, at the bytes of dy's dtype (half a float32 reduce-scatter's, for
    bfloat16), never more. Through NVSwitch an all-to-all runs at the GPU's full egress:
    it pays where it sends fewer bytes. A TPU slice forwards each block over as many ICI
    links as its devices are apart: it pays where that load (`_schedule.all_to_all_load`,
    from the devices' coordinates) is below a one-hop ring's, with fewer bytes or as
    many, as on a v5p 2x2x2 cube (0.57; replayed, v5p ag_rows with float32 sums 2,243 ->
    1,396 us, with bfloat16 sums 1,551 -> 1,316), not on a 2x4 grid (1.14: v5e 3,664 ->
    3,746 with float32 sums, 2,985 -> 3,746 with bfloat16; v6e 1,188 -> 1,566 with
    bfloat16) nor where the devices are unknown."""
    dy_bytes, sum_bytes = dy.dtype.itemsize, jnp.dtype(cfg.reduce_dtype).itemsize
    if cfg.on.platform != "tpu" or dy_bytes > sum_bytes:
        return dy_bytes < sum_bytes
    names = cfg.axis_name if isinstance(cfg.axis_name, tuple) else (cfg.axis_name,)
    mesh = _target.concrete_mesh()
    found = (None if mesh is None or not all(a in mesh.shape for a in names)
             else _schedule.mesh_groups(mesh, cfg.axis_name))
    if found is None:
        return False
    coords, wraps, extent = found
    return max(_schedule.all_to_all_load(c, wraps, extent) for c in coords) < 1
