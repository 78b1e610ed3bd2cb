"""Ring schedules: which block a device holds, computes and sends at each step.

This is the one place that knows the ring arithmetic. The lax ring backend, the TPU
kernels and the GPU ring all ask a `Ring` instead of re-deriving it.

Vocabulary. A ring of `size` devices moves data in one or two *directions*: `+1` sends
to the right neighbour `(d + 1) % size`, `-1` to the left one. A bidirectional ring
splits every block into two halves, one per direction, so each link carries half the
bytes and both links of a device are busy at once.

A *segment* names one piece of the full (gathered or reduced) operand: block `b` of the
`size` blocks, half `h` of its `num_directions` halves, as the single index
`b * num_directions + h`. Segments are what a step computes with, so code that writes
"segment s of the output" is the same for uni- and bidirectional rings.

All index functions accept Python ints or traced int32 scalars (`lax.axis_index`,
`fori_loop` counters, `pl.program_id`): they only use `+`, `*` and `%` on non-negative
operands, which lower the same way in lax, Triton and Mosaic.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Ring:
    """A ring schedule over `size` devices.

    **Arguments:**

    - `size`: the number of devices on the ring (the mesh axis size), at least 1.
    - `bidirectional`: whether blocks are split into two halves that travel in opposite
      directions. A ring of size 1 or 2 gains nothing from it but stays correct.
    """

    size: int
    bidirectional: bool = False

    def __post_init__(self):
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"Ring size must be a positive int, got {self.size!r}.")

    @property
    def directions(self) -> tuple[int, ...]:
        """The directions data travels in: `(+1,)` or `(+1, -1)`."""
        return (1, -1) if self.bidirectional else (1,)

    @property
    def num_directions(self) -> int:
        return len(self.directions)

    @property
    def num_steps(self) -> int:
        """Compute steps per direction: every device sees every block once."""
        return self.size

    @property
    def num_transfers(self) -> int:
        """Transfers per direction: there is nothing to send after the last step."""
        return self.size - 1

    @property
    def num_segments(self) -> int:
        """Segments in the full operand: `size` blocks times `num_directions` halves."""
        return self.size * self.num_directions

    # -- neighbours ---------------------------------------------------------------------

    def send_to(self, device, direction: int):
        """The device that `device` sends to in `direction` (+1 or -1)."""
        return (device + direction + self.size) % self.size

    def recv_from(self, device, direction: int):
        """The device that `device` receives from in `direction` (+1 or -1)."""
        return (device - direction + self.size) % self.size

    def permutation(self, direction: int) -> list[tuple[int, int]]:
        """`(source, destination)` pairs of one transfer step, for `lax.ppermute`."""
        return [(d, self.send_to(d, direction)) for d in range(self.size)]

    # -- all-gather ---------------------------------------------------------------------

    def gather_block(self, device, step, direction: int):
        """Block that `device` holds (and computes with) at `step` of an all-gather.

        At step 0 a device holds its own block; each transfer moves every block one
        device along `direction`, so at step `s` device `d` holds the block that started
        on device `d - direction * s`.
        """
        return (device - direction * step + self.size * self.size) % self.size

    def gather_segment(self, device, step, direction: int):
        """Segment of the gathered operand that `device` holds at `step` in `direction`."""
        block = self.gather_block(device, step, direction)
        return block * self.num_directions + self.direction_index(direction)

    # -- reduce-scatter -----------------------------------------------------------------

    def scatter_block(self, device, step, direction: int):
        """Output block whose partial sum `device` adds at `step` of a reduce-scatter.

        The accumulator that a device holds at step `s` started on device `d - direction
        * s`; choosing block `d - direction * (s + 1)` for it makes the accumulator for
        block `b` finish on device `b` after the last step (`s = size - 1`).
        """
        return self.gather_block(device, step + 1, direction)

    def scatter_segment(self, device, step, direction: int):
        """Segment of the reduced output that `device` adds into at `step`."""
        block = self.scatter_block(device, step, direction)
        return block * self.num_directions + self.direction_index(direction)

    # -- helpers ------------------------------------------------------------------------

    def direction_index(self, direction: int) -> int:
        """Position of `direction` in `directions` (which half of a block it carries)."""
        if direction not in self.directions:
            raise ValueError(f"direction must be one of {self.directions}, got {direction!r}.")
        return self.directions.index(direction)

    def split_size(self, length: int, what: str) -> int:
        """Length of one direction's half of a block of `length`, checking it divides."""
        if length % self.num_directions:
            raise ValueError(
                f"{what} has length {length}, which a bidirectional ring cannot split into "
                f"two equal halves; use an even length or bidirectional=False."
            )
        return length // self.num_directions


def prefers_bidirectional(size: int, block_length: int) -> bool:
    """The default ring shape: bidirectional when the ring has more than 2 devices (with 2,
    both directions reach the same neighbour) and each block splits into equal halves."""
    return size > 2 and block_length % 2 == 0


def mesh_coordinates(position, sizes: dict) -> dict:
    """Per-axis coordinates of ring `position` on a ring over several mesh axes.

    `sizes` maps each axis name to its size, in the order of the axis tuple the ring runs
    over: the first axis is major, as `lax.axis_index(tuple)` counts. Works on traced ints.
    """
    coords = {}
    for name in reversed(list(sizes)):
        coords[name] = position % sizes[name]
        position = position // sizes[name]
    return coords
