"""The five 2-D problems every non-reference backend implements, and the map to them.

Each public op call is reshaped (`canonicalize`) into one primitive on 2-D operands, run
per device inside `shard_map` over a ring of `N` devices:

| primitive     | local operands                  | result          | the travelling operand   |
|---------------|---------------------------------|-----------------|--------------------------|
| `ag_rows`     | x (m, K), w (K, n)              | (N*m, n)        | x, row blocks            |
| `ag_cols`     | x (M, K), w (K, n_l)            | (M, N*n_l)      | w, column blocks         |
| `ag_contract` | x (M, N*k_l), w (k_l, n)        | (M, n)          | w, row blocks (summed)   |
| `rs_rows`     | x (M, K), w (K, n)              | (M/N, n)        | the f32 accumulator      |
| `rs_cols`     | x (M, K), w (K, n)              | (M, n/N)        | the f32 accumulator      |

`ag_*` can also return the gathered travelling operand (for the backward pass).
`GATHER_AXIS` says along which axis of the travelling operand, or of the output for
`rs_*`, the blocks lie; a bidirectional ring splits each block in halves along it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Hashable, Optional

import jax.numpy as jnp

from . import _target, _vma
from ._schedule import prefers_bidirectional

# The two public ops.
ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER = "all_gather_matmul", "matmul_reduce_scatter"
OPS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER)

AG_ROWS, AG_COLS, AG_CONTRACT, RS_ROWS, RS_COLS = (
    "ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols")
PRIMITIVES = (AG_ROWS, AG_COLS, AG_CONTRACT, RS_ROWS, RS_COLS)
GATHERS = (AG_ROWS, AG_COLS, AG_CONTRACT)

# The name scope every run of a primitive is traced in (`_autodiff.scope`), which compiled
# programs keep in each instruction's `op_name`: the primitive, the backend and, for a
# ring, its shape (`fusedpar.aot` and the replay read them back).
SCOPE = re.compile(r"fusedpar\.(\w+)\.(\w+)(?:\.(bi|uni)directional)?")

# Which operand travels for an all-gather primitive ("x" or "w"), and the axis of that
# operand (all-gathers) or of the output (reduce-scatters) that is cut into ring blocks.
TRAVELLER = {AG_ROWS: "x", AG_COLS: "w", AG_CONTRACT: "w"}
GATHER_AXIS = {AG_ROWS: 0, AG_COLS: 1, AG_CONTRACT: 0, RS_ROWS: 0, RS_COLS: 1}


def primitive_of(op: str, gather: str, dim: int, x_ndim: int) -> str:
    """The primitive a public op call becomes (`dim` already normalised, non-negative)."""
    if op == ALL_GATHER_MATMUL:
        if gather == "rhs":
            return AG_CONTRACT if dim == 0 else AG_COLS
        return AG_ROWS
    return RS_COLS if dim == x_ndim - 1 else RS_ROWS


@dataclasses.dataclass(frozen=True)
class Call:
    """One primitive call described statically: what a dispatch decision, a backend's
    `unavailable` check and the cost model look at.

    `x_shape`, `w_shape` are the canonical 2-D local shapes; `target` is the
    `_target.Target` the call is built for (None when unknown; a platform name "cpu",
    "gpu", "tpu" stands for a target known only by its platform); `bidirectional` is the
    ring shape as requested (None: the default, `_schedule.prefers_bidirectional`);
    `precision` is the matmuls' (some kernels cannot compute every precision); `options`
    the backend options, as pairs; `comm_dtype` the name of the narrow dtype the
    travelling operand or accumulator is sent in (`_quantize.COMM_DTYPES`), None for
    the inputs' own (not every backend can send a quantized payload); `beside` the
    seconds of other work the program can run while the reference's collective is in
    flight (a backward pass's other gradient matmul, which needs nothing this call
    computes: XLA hides the reference's collective behind it); `automatic_axes` the
    `(name, size)` pairs of the mesh axes the enclosing `shard_map` leaves to XLA
    (`_target.automatic_axes`: a kernel that addresses devices by their coordinates on
    every mesh axis cannot run there); `w_invariant` whether JAX's varying-axes type
    proves w the same on every device of the ring (`_vma.invariant`: an ag_rows can then
    multiply first and gather the product, `_product_first`); `gathered` whether the run
    must also return the gathered operand (what that path gathers separately);
    `reduce_dtype` the name of the dtype reduce-scatter partial sums travel in (None:
    the accumulation dtype, float32 for 16-bit inputs).
    """

    op: str
    prim: str
    x_shape: tuple
    w_shape: tuple
    dtype: str
    axis_size: int
    target: Any
    bidirectional: Optional[bool] = None
    precision: Any = None
    options: tuple = ()
    comm_dtype: Optional[str] = None
    beside: float = 0.0
    automatic_axes: tuple = ()
    w_invariant: bool = False
    gathered: bool = False
    reduce_dtype: Optional[str] = None

    def __post_init__(self):
        if isinstance(self.target, str):
            object.__setattr__(self, "target",
                               _target.of_platform(self.target) if self.target else None)

    @property
    def platform(self) -> str:
        """The target's platform, "" when unknown."""
        return "" if self.target is None else self.target.platform

    def option(self, name, default=None):
        return dict(self.options).get(name, default)

    @property
    def block_length(self) -> int:
        return block_length(self.prim, self.x_shape, self.w_shape, self.axis_size)

    @property
    def runs_bidirectional(self) -> bool:
        """The ring shape the call runs with: as requested, else the default."""
        if self.bidirectional is not None:
            return self.bidirectional
        return prefers_bidirectional(self.axis_size, self.block_length)


@dataclasses.dataclass(frozen=True)
class Config:
    """Static description of one primitive call (hashable: it is a custom_vjp nondiff arg).

    - `backend`: the backend name that runs it.
    - `axis_name`, `axis_size`: the ring's mesh axis.
    - `bidirectional`, `unroll`: ring shape (unroll=False runs a `fori_loop`).
    - `out_dtype`: result dtype; `reduce_dtype`: dtype of the travelling reduce-scatter
      accumulator; `precision`: passed to every matmul.
    - `keep_gathered`: the forward keeps the gathered operand for the backward (memory)
      instead of gathering it again (communication).
    - `options`: backend-specific settings (e.g. kernel tile sizes), a tuple of pairs.
    - `target`: the `_target.Target` the call is built for (from the mesh it runs on).
    - `comm_dtype`: the narrow dtype (`_quantize.COMM_DTYPES`) the forward's travelling
      operand or accumulator is sent in, None for its own dtype; `grad_comm_dtype`: the
      same for the backward pass.
    - `auto`: the backend was picked by `backend="auto"`; the backward pass then picks
      the backend of each dual primitive it runs the same way, for that primitive's own
      shapes (`_autodiff._run_dual`).
    - `automatic_axes`: the mesh axes the enclosing `shard_map` leaves to XLA (`Call`).
    - `product_first`: an ag_rows with an invariant w runs as `all_gather(x @ w)`
      (`_product_first`), whatever `backend` says.
    """

    backend: str
    axis_name: Hashable
    axis_size: int
    bidirectional: bool
    unroll: bool
    out_dtype: Any
    reduce_dtype: Any
    precision: Any = None
    keep_gathered: bool = True
    options: tuple = ()
    target: Any = None
    comm_dtype: Any = None
    grad_comm_dtype: Any = None
    auto: bool = False
    automatic_axes: tuple = ()
    product_first: bool = False

    def option(self, name, default=None):
        return dict(self.options).get(name, default)

    @property
    def on(self) -> "_target.Target":
        """The target: as configured, else read from the code being traced."""
        return self.target if self.target is not None else _target.current()

    def call(self, op: str, prim: str, x, w, gathered=False) -> Call:
        """The `Call` that describes running `prim` with this config on `x` and `w`
        (`gathered`: the run also returns the gathered operand)."""
        comm = None if self.comm_dtype is None else jnp.dtype(self.comm_dtype).name
        return Call(op, prim, tuple(x.shape), tuple(w.shape), jnp.dtype(x.dtype).name,
                    self.axis_size, self.target, self.bidirectional, self.precision,
                    self.options, comm, automatic_axes=self.automatic_axes,
                    w_invariant=_vma.invariant(w, self.axis_name), gathered=gathered,
                    reduce_dtype=jnp.dtype(self.reduce_dtype).name)


def out_shape(prim: str, x_shape, w_shape, n: int) -> tuple[int, int]:
    """Result shape of `prim` on local operands of these shapes over a ring of `n`."""
    (m, _), (_, cols) = x_shape, w_shape
    return {
        AG_ROWS: (n * m, cols),
        AG_COLS: (m, n * cols),
        AG_CONTRACT: (m, cols),
        RS_ROWS: (m // n, cols),
        RS_COLS: (m, cols // n),
    }[prim]


def step_matmul(prim: str, x_shape, w_shape, n: int, directions: int = 1):
    """`(rows, contraction, cols)` of the matmul one ring step does, per direction.

    All-gathers multiply the piece in hand (a block, or half of one when `directions` is
    2); reduce-scatters compute this device's part of one output segment.
    """
    (m, k), (kw, cols) = x_shape, w_shape
    d = directions
    return {
        AG_ROWS: (m // d, k, cols),
        AG_COLS: (m, k, cols // d),
        AG_CONTRACT: (m, kw // d, cols),
        RS_ROWS: (m // n // d, k, cols),
        RS_COLS: (m, k, cols // n // d),
    }[prim]


def block_length(prim: str, x_shape, w_shape, n: int) -> int:
    """Length, along `GATHER_AXIS`, of one ring block (what a bidirectional ring halves)."""
    if prim in GATHERS:
        shape = x_shape if TRAVELLER[prim] == "x" else w_shape
        return shape[GATHER_AXIS[prim]]
    return out_shape(prim, x_shape, w_shape, n)[GATHER_AXIS[prim]]


@dataclasses.dataclass(frozen=True)
class Canonical:
    """A public op call reshaped into one primitive; `restore` maps the result back."""

    prim: str
    x: Any
    w: Any
    restore: Callable


def _rows_first(x, dim):
    """Move `dim` to the front and flatten the rest of the non-contracting dims into it.

    Tiled blocks along `dim` stay contiguous row ranges of the 2-D result, which is what
    makes `ag_rows`/`rs_rows` equal the op along any dimension. Free when `dim` is 0.
    """
    xt = jnp.moveaxis(x, dim, 0)
    return xt.reshape(-1, x.shape[-1]), xt.shape[:-1]


def canonicalize(op: str, gather: str, dim: int, x, w, n: int) -> Canonical:
    """Reshape a public op call (`dim` already normalised to be non-negative)."""
    if op == ALL_GATHER_MATMUL and gather == "rhs":
        lead = x.shape[:-1]
        prim = AG_CONTRACT if dim == 0 else AG_COLS
        return Canonical(prim, x.reshape(-1, x.shape[-1]), w,
                         lambda y: y.reshape(*lead, y.shape[-1]))
    last = x.ndim - 1
    if op == MATMUL_REDUCE_SCATTER and dim == last:
        lead = x.shape[:-1]
        return Canonical(RS_COLS, x.reshape(-1, x.shape[-1]), w,
                         lambda y: y.reshape(*lead, y.shape[-1]))
    prim = AG_ROWS if op == ALL_GATHER_MATMUL else RS_ROWS
    x2, lead = _rows_first(x, dim)
    block = lead[0] * n if prim == AG_ROWS else lead[0] // n

    def restore(y):
        return jnp.moveaxis(y.reshape(block, *lead[1:], y.shape[-1]), 0, dim)

    return Canonical(prim, x2, w, restore)
