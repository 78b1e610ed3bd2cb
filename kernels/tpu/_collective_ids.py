"""One collective id per (kernel, mesh axes) pair: which barrier semaphore a kernel uses.

A collective Pallas TPU kernel's barrier semaphore comes from its `collective_id`. Two
collective kernels in flight at once — an FSDP gather on one mesh axis while a
tensor-parallel reduce-scatter runs on another — must use different ids, or one
kernel's entry signals count as the other's (the Pallas docs on
`pltpu.get_barrier_semaphore`: kernels that synchronise differently must not share a
collective id). So the id encodes the kernel and the ordered mesh axes its ring runs
over, as positions in the mesh: it is the same on every device and every host that
traces the same program, and different for every pair.

With `M` mesh axes, a ring over axes at positions `p_1, ..., p_j` (in ring order) has the
code `sum_i (p_i + 1) * (M + 1) ** (j - i)`, a base-`M + 1` number with no zero digit,
so distinct ordered axis tuples get distinct codes; the id is
`code * len(KERNELS) + KERNELS.index(kernel)`. The ids stay small (a 2-D mesh: below 24).
"""

from __future__ import annotations

KERNELS = ("all_gather_matmul", "matmul_reduce_scatter")


def collective_id(kernel: str, ring_axes: tuple, mesh_axes: tuple) -> int:
    """The collective id of `kernel` (one of `KERNELS`) on a ring over `ring_axes` (mesh
    axis names, in ring order) of a mesh whose axes are `mesh_axes`."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown ring kernel {kernel!r}; kernels are {KERNELS}")
    base = len(mesh_axes) + 1
    code = 0
    for name in ring_axes:
        if name not in mesh_axes:
            raise ValueError(f"ring axis {name!r} is not an axis of the mesh {mesh_axes}")
        code = code * base + mesh_axes.index(name) + 1
    return code * len(KERNELS) + KERNELS.index(kernel)
