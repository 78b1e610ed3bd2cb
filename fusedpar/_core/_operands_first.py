"""rs_rows with the operands moved instead of the partial sums: x's rows exchanged, w
gathered, one local matmul.

`psum_scatter(x @ w)` over rows (x (m, k) and w (k, n) this device's slices of the
contraction) equals `x_rows @ w_full`, where `x_rows` (m/N, N*k) is this device's rows
of every device's x (an all-to-all) and `w_full` (N*k, n) every device's w: block for
block, the same products summed over the ring, now inside one matmul that accumulates
in float32 (at least as precise as summing float32 partial sums). What travels is x's
rows, `(N-1)/N * m*k` elements, and w, `(N-1) * k*n`, in their own dtype, instead of
`(N-1)/N * m*n` partial sums in `reduce_dtype`. That pays where the output is much
wider than the contraction slice and the rows are many: a row-parallel output
projection in a forward pass over a long sequence (`cost_model.operands_first`).

w's blocks travel by one collective-permute per ring offset rather than an all-gather:
w does not depend on x, so XLA can start them early, and on TPU a collective-permute
stays asynchronous beside Mosaic kernels where an all-gather runs synchronously there.
x's rows go by one all-to-all (the transfer on the critical path; one collective).

`"auto"` takes it where the cost model estimates it faster than the backend it would
pick otherwise (`_dispatch.operands_first`), never for a run that sums another op's
partial sums too (`Call.adding`: those would need their own reduce-scatter). The
backward is rs_rows' own (`_primitives`), on the operands this device holds.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import _definition
from ._backends import _ring_loop


def forward(cfg, x, w):
    """`psum_scatter(x @ w)` over the ring's rows: x (m, k), w (k, n) -> (m/N, n)."""
    n = cfg.axis_size
    # Offset s: every device d sends its w to device d - s, so this device receives the w
    # of device me + s, whose x block is column block me + s of the all-to-all's result:
    # rolled by -me blocks, block s. Pairing by sender keeps the definition's products.
    # (Rolling x, the smaller operand where this pays; XLA fuses the roll into the
    # matmul's operand: v5e prefill 10,392 -> 10,351 us against a transposed x.)
    # `ppermute` numbers devices in the mesh's axis order, the all-to-all and
    # `axis_index` in `axis_name`'s (`_ppermute_index`).
    index = _ring_loop._ppermute_index(cfg.axis_name)
    ws = [w] + [lax.ppermute(w, cfg.axis_name, [(index(d), index((d - s) % n))
                                                for d in range(n)])
                for s in range(1, n)]
    rows = lax.all_to_all(x, cfg.axis_name, 0, 1, tiled=True)  # (m/N, N*k); block j: device j's
    x_rows = jnp.roll(rows, -lax.axis_index(cfg.axis_name) * x.shape[1], axis=1)
    return _definition.matmul(x_rows, jnp.concatenate(ws, axis=0), precision=cfg.precision,
                              out_dtype=cfg.out_dtype)
