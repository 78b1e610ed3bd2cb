"""The ring schedule's invariants, for every ring size and direction (pure Python + jit)."""

import jax
import jax.numpy as jnp
import pytest

from fusedpar import Ring

RINGS = [Ring(n, bidi) for n in (1, 2, 3, 4, 5, 8, 16) for bidi in (False, True)] + [
    Ring(8, bidi, (0, 2, 4, 6, 7, 5, 3, 1)) for bidi in (False, True)] + [
    Ring(4, False, (0, 2, 3, 1)), Ring(5, True, (0, 3, 1, 4, 2))]


@pytest.mark.parametrize("ring", RINGS, ids=str)
def test_permutations_are_rings(ring):
    for r in ring.directions:
        perm = ring.permutation(r)
        assert sorted(src for src, _ in perm) == list(range(ring.size))
        assert sorted(dst for _, dst in perm) == list(range(ring.size))
        for src, dst in perm:
            assert ring.recv_from(dst, r) == src
            assert (ring.position(dst) - ring.position(src)) % ring.size == r % ring.size
            if ring.order is None:
                assert (dst - src) % ring.size == r % ring.size


@pytest.mark.parametrize("ring", RINGS, ids=str)
def test_all_gather_every_device_sees_every_block_once(ring):
    for r in ring.directions:
        for d in range(ring.size):
            seen = [ring.gather_block(d, s, r) for s in range(ring.num_steps)]
            assert sorted(seen) == list(range(ring.size))
            assert seen[0] == d  # step 0 computes with the block it holds
        for s in range(ring.num_transfers):
            for d in range(ring.size):  # what I hold now, my receiver holds next step
                assert ring.gather_block(ring.send_to(d, r), s + 1, r) == \
                    ring.gather_block(d, s, r)


@pytest.mark.parametrize("ring", RINGS, ids=str)
def test_reduce_scatter_accumulators_finish_home(ring):
    for r in ring.directions:
        for start in range(ring.size):
            d = start
            block = ring.scatter_block(d, 0, r)
            contributors = {d}
            for s in range(1, ring.num_steps):  # follow one accumulator round the ring
                d = ring.send_to(d, r)
                assert ring.scatter_block(d, s, r) == block
                contributors.add(d)
            assert d == block  # it ends on the device that owns its block
            assert contributors == set(range(ring.size))  # every device added once


@pytest.mark.parametrize("ring", [Ring(4, True), Ring(3, False)], ids=str)
def test_segments_cover_the_operand(ring):
    for d in range(ring.size):
        segs = {ring.gather_segment(d, s, r) for s in range(ring.num_steps)
                for r in ring.directions}
        assert segs == set(range(ring.num_segments))
        segs = {ring.scatter_segment(d, ring.num_steps - 1, r) for r in ring.directions}
        assert segs == {d * ring.num_directions + h for h in range(ring.num_directions)}


@pytest.mark.parametrize("ring", [Ring(8, True), Ring(8, True, (0, 2, 4, 6, 7, 5, 3, 1))],
                         ids=str)
def test_traced_indices_match_python(ring):

    @jax.jit
    def blocks(d, s):
        return jnp.stack([ring.gather_block(d, s, -1), ring.scatter_segment(d, s, 1),
                          ring.send_to(d, -1)])

    for d in range(8):
        for s in range(8):
            want = [ring.gather_block(d, s, -1), ring.scatter_segment(d, s, 1),
                    ring.send_to(d, -1)]
            assert blocks(jnp.int32(d), jnp.int32(s)).tolist() == want


def test_bad_rings():
    with pytest.raises(ValueError, match="positive int"):
        Ring(0)
    with pytest.raises(ValueError, match="cannot split"):
        Ring(4, True).split_size(3, "x's block")
    with pytest.raises(ValueError, match="direction must be one of"):
        Ring(4).direction_index(-1)
    with pytest.raises(ValueError, match="permutation"):
        Ring(4, order=(0, 1, 1, 2))
    assert Ring(4, order=(0, 1, 2, 3)) == Ring(4)  # the identity is the plain ring


def test_mesh_coordinates_count_the_first_axis_major():
    import numpy as np

    from fusedpar._core._schedule import mesh_coordinates

    sizes = {"b": 4, "a": 2, "c": 3}
    for position in range(24):
        want = np.unravel_index(position, (4, 2, 3))  # C order: the first axis is major
        assert mesh_coordinates(position, sizes) == dict(zip(sizes, map(int, want)))


# -- the ring order on a TPU slice's wires ----------------------------------------------


def _grid(shape, index_order="xyz"):
    """Coordinates of a slice of `shape` chips, numbered x fastest (as TPU topologies
    number them) or in another order."""
    import itertools

    points = [tuple(reversed(p)) for p in itertools.product(*map(range, reversed(shape)))]
    if index_order == "shuffled":
        import random

        random.Random(0).shuffle(points)
    return points


@pytest.mark.parametrize("shape", [(2, 2, 1), (2, 4, 1), (4, 2, 1), (4, 4, 1), (2, 2, 2),
                                   (2, 2, 4), (3, 4, 1), (4, 4, 4), (16, 16, 1)], ids=str)
@pytest.mark.parametrize("numbering", ["xyz", "shuffled"])
def test_ring_order_hops_one_link_on_a_grid(shape, numbering):
    """A slice with an even side has a cycle of single ICI links, whatever order its
    devices are numbered in; index order does not (2x4: device 1 -> 2 is diagonal)."""
    from fusedpar._core._schedule import ring_hops, ring_order

    coords = _grid(shape, numbering)
    order = ring_order(coords)
    assert sorted(order) == list(range(len(coords))) and order[0] == 0
    assert ring_hops(coords, order) == [1] * len(coords)
    if shape == (2, 4, 1) and numbering == "xyz":
        assert ring_hops(coords) == [1, 2, 1, 2, 1, 2, 1, 4]
        assert order == (0, 2, 4, 6, 7, 5, 3, 1)


def test_ring_order_lines_odd_grids_and_wraps():
    from fusedpar._core._schedule import ring_hops, ring_order, tpu_wraps

    line = [(0, y, 0) for y in range(8)]
    assert ring_hops(line) == [1] * 7 + [7]  # index order comes back across the line
    assert max(ring_hops(line, ring_order(line))) == 2  # there on evens, back on odds
    # With wrap-around links the line is a torus ring: index order is best.
    wraps, extent = (False, True, False), (1, 8, 1)
    assert ring_order(line, wraps, extent) == tuple(range(8))
    assert ring_hops(line, None, wraps, extent) == [1] * 8
    # 3x3: no cycle of single links exists; the snake closes with one longer hop.
    odd = _grid((3, 3, 1))
    hops = ring_hops(odd, ring_order(odd))
    assert sorted(hops)[:-1] == [1] * 8
    # Two cores of one chip share coordinates: nothing to route, index order.
    assert ring_order([(0, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0)]) == (0, 1, 2, 3)
    assert tpu_wraps("TPU v5 lite", (2, 4, 1)) == (False, False, False)
    assert tpu_wraps("TPU v5", (4, 4, 8)) == (True, True, True)
    assert tpu_wraps("TPU v5", (2, 2, 2)) == (False, False, False)


class _Device:
    platform, device_kind = "tpu", "TPU v5 lite"

    def __init__(self, i, coords):
        self.id, self.coords = i, coords


def test_mesh_ring_order_one_order_for_every_group():
    """A ring over one axis of a 2-D mesh: one ppermute serves every group, so one order
    must suit them all; on a 2x4 slice split (2, 4) each group is a 2x2 block."""
    import types

    import numpy as np

    from fusedpar._core._schedule import mesh_ring_order, ring_hops

    devices = [_Device(i, c) for i, c in enumerate(_grid((2, 4, 1)))]
    mesh = types.SimpleNamespace(devices=np.array(devices).reshape(2, 4),
                                 axis_names=("fsdp", "tp"))
    order = mesh_ring_order(mesh, "tp")
    for row in mesh.devices:
        assert ring_hops([d.coords for d in row], order) == [1] * 4
    assert mesh_ring_order(mesh, "fsdp") is None  # two devices: nothing to choose
    both = mesh_ring_order(mesh, ("fsdp", "tp"))
    flat = [d.coords for d in mesh.devices.reshape(-1)]
    assert ring_hops(flat, both) == [1] * 8
    gpu = types.SimpleNamespace(devices=np.array([object()] * 8), axis_names=("x",))
    assert mesh_ring_order(gpu, "x") is None  # no coordinates: index order


def test_all_to_all_load_counts_the_links_each_block_crosses():
    """An all-to-all's blocks on the most loaded device's links, over a one-hop ring
    collective's n - 1: what decides whether bfloat16 addends beat a float32
    reduce-scatter on a TPU slice (`_product_first`)."""
    from fusedpar._core._schedule import all_to_all_load

    cube = _grid((2, 2, 2))  # every chip a corner: 3 + 2*3 + 3 links over 3 neighbours
    assert all_to_all_load(cube) == pytest.approx(12 / 3 / 7)
    grid = _grid((2, 4, 1))  # a corner: 16 links over 2 neighbours
    assert all_to_all_load(grid) == pytest.approx(16 / 2 / 7)
    line = [(0, y, 0) for y in range(8)]
    assert all_to_all_load(line) == pytest.approx(28 / 7)
    # Round the wrap-around link a ring of 8 is 16 links over 2 neighbours.
    assert all_to_all_load(line, (False, True, False), (1, 8, 1)) == pytest.approx(8 / 7)
    assert all_to_all_load(line[:1]) == 0.0


def test_ring_for_cpu_devices_in_index_order():
    """CPU devices have no coordinates: index order, under set_mesh or not."""
    from helpers import mesh

    from fusedpar._core._schedule import ring_for

    with jax.set_mesh(mesh((8,), ("x",))):
        assert ring_for("x", 8, True) == Ring(8, True)
    assert ring_for("x", 8) == Ring(8)
