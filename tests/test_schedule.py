"""The ring schedule's invariants, for every ring size and direction (pure Python + jit)."""

import jax
import jax.numpy as jnp
import pytest

from fusedpar import Ring

RINGS = [Ring(n, bidi) for n in (1, 2, 3, 4, 5, 8, 16) for bidi in (False, True)]


@pytest.mark.parametrize("ring", RINGS, ids=str)
def test_permutations_are_rings(ring):
    for r in ring.directions:
        perm = ring.permutation(r)
        assert sorted(src for src, _ in perm) == list(range(ring.size))
        assert sorted(dst for _, dst in perm) == list(range(ring.size))
        for src, dst in perm:
            assert ring.recv_from(dst, r) == src
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


def test_traced_indices_match_python():
    ring = Ring(8, True)

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


def test_mesh_coordinates_count_the_first_axis_major():
    import numpy as np

    from fusedpar._schedule import mesh_coordinates

    sizes = {"b": 4, "a": 2, "c": 3}
    for position in range(24):
        want = np.unravel_index(position, (4, 2, 3))  # C order: the first axis is major
        assert mesh_coordinates(position, sizes) == dict(zip(sizes, map(int, want)))
