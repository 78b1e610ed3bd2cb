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

`ag_*` can also return the gathered travelling operand (for the backward pass). Each
primitive is a `Primitive` record in `PRIMITIVES` (its travelling operand, the axes of
its ring blocks and of its quantization scales, its shapes, its backward's duals): code
that treats primitives differently reads the record rather than testing names.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Hashable, Optional

import jax.numpy as jnp

from .._hw import _target
from . import _vma
from ._schedule import prefers_bidirectional

# The two public ops.
ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER = "all_gather_matmul", "matmul_reduce_scatter"
OPS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER)

AG_ROWS, AG_COLS, AG_CONTRACT, RS_ROWS, RS_COLS = (
    "ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols")

# The arrangements `auto` may run a call in on lax collectives instead of a backend's
# (`Config.rearranged`): multiply, then gather the product (`_product_first`); move the
# operands, then multiply (`_operands_first`).
PRODUCT_FIRST, OPERANDS_FIRST = "product_first", "operands_first"

# The name scope every run of a primitive is traced in (`_autodiff.scope`), which compiled
# programs keep in each instruction's `op_name`: the primitive, the backend and, for a
# ring, its shape (`fusedpar.aot` and the replay read them back).
SCOPE = re.compile(r"fusedpar\.(\w+)\.(\w+)(?:\.(bi|uni)directional)?")


@dataclasses.dataclass(frozen=True)
class Grad:
    """How one gradient of a primitive's backward pass is computed, on local operands.

    - `of`: the operand whose gradient it is, "x" or "w".
    - `prim`: the dual primitive run on the ring (same backend, or its own "auto" pick),
      or None for a local matmul.
    - `lhs`, `rhs`: its operands, named from `x`, `w`, `dy` (the cotangent) and `g` (the
      gathered operand: the forward's residual, or the one an earlier `Grad` with
      `keeps` returned), with a `.T` suffix for the transpose.
    - `transposed`: the result is transposed (it computed the gradient's transpose).
    - `keeps`: the dual run also returns its gathered operand, bound to `g` after it.
    """

    of: str
    prim: Optional[str]
    lhs: str
    rhs: str
    transposed: bool = False
    keeps: bool = False


@dataclasses.dataclass(frozen=True)
class Primitive:
    """One primitive as data: which operand travels, along which axes, and its duals.

    - `name`: its identity (tests, reports and op_name scopes `fusedpar.<name>.<backend>`).
    - `op`: the public op it implements; `side`: which operand that op gathers ("lhs",
      "rhs"; "lhs" for reduce-scatters), along its dim `gather_axis`.
    - `traveller`: the operand that travels for an all-gather ("x" or "w"), None for a
      reduce-scatter (its f32 accumulator travels).
    - `gather_axis`: the axis of the travelling operand (all-gathers) or of the output
      (reduce-scatters) cut into ring blocks; a bidirectional ring halves blocks along it.
    - `ring_dim`: which dimension of the matmul `(m, k, n)` the ring cuts: "m" rows of x,
      "k" the contraction, "n" columns of w.
    - `scale_axis`: the axis one float32 scale covers when the travelling operand (or a
      reduce-scatter's accumulator segment) is quantized: the travelling operand's
      contraction axis, so a scale belongs to a row or column of the product.
    - `backward`, `backward_keep`: the gradients (`Grad`) without and with
      `keep_gathered`; the dual runs are computed first, in this order (a local matmul
      reads the operand a keeping dual gathers, `g`).
    """

    name: str
    op: str
    side: str
    traveller: Optional[str]
    gather_axis: int
    ring_dim: str
    scale_axis: int
    backward: tuple
    backward_keep: tuple

    @property
    def gathers(self) -> bool:
        return self.op == ALL_GATHER_MATMUL

    @property
    def sums_steps(self) -> bool:
        """Each ring step adds its product into one accumulator (ag_contract, and every
        reduce-scatter), rather than writing a segment of the output."""
        return self.ring_dim == "k" or not self.gathers

    @property
    def out_axis(self) -> Optional[int]:
        """The output axis the ring gathers (N times longer) or scatters (N times
        shorter); None for ag_contract, whose output is the whole (M, n)."""
        return {"m": 0, "n": 1, "k": None}[self.ring_dim]

    def out_shape(self, x_shape, w_shape, n: int) -> tuple[int, int]:
        """Result shape on local operands x (m, K), w (K', cols) over a ring of `n`."""
        shape = [x_shape[0], w_shape[1]]
        if self.out_axis is not None:
            a = self.out_axis
            shape[a] = shape[a] * n if self.gathers else shape[a] // n
        return tuple(shape)

    def full_matmul(self, x_shape, w_shape, n: int) -> tuple[int, int, int]:
        """The reference's single matmul `(m, k, cols)` over the gathered operand (an
        all-gather) or the whole product (a reduce-scatter)."""
        m, cols = self.out_shape(x_shape, w_shape, n) if self.gathers else (
            x_shape[0], w_shape[1])
        return m, x_shape[1], cols

    def step_matmul(self, x_shape, w_shape, n: int, directions: int = 1):
        """`(rows, contraction, cols)` of the matmul one ring step does, per direction:
        all-gathers multiply the piece in hand (a block, or half of one when `directions`
        is 2); reduce-scatters compute this device's part of one output segment."""
        dims = [x_shape[0], w_shape[0], w_shape[1]]
        i = "mkn".index(self.ring_dim)
        dims[i] = dims[i] // directions if self.gathers else dims[i] // n // directions
        return tuple(dims)

    def block_length(self, x_shape, w_shape, n: int) -> int:
        """Length, along `gather_axis`, of one ring block (what a bidirectional ring
        halves)."""
        if self.gathers:
            return (x_shape if self.traveller == "x" else w_shape)[self.gather_axis]
        return self.out_shape(x_shape, w_shape, n)[self.gather_axis]

    def travelling(self, x, w):
        """The operand of an all-gather that travels."""
        return x if self.traveller == "x" else w


def _grads(*grads) -> tuple:
    return tuple(Grad(*g) for g in grads)


# The backward of each primitive. An all-gather's gradient of the non-gathered operand is
# a reduce-scatter and vice versa; with `keep_gathered` the other gradient is a local
# matmul on the kept gathered operand `g` (for a reduce-scatter: on the cotangent its
# all-gather returns), without it a second ring.
_PRIMITIVES = (
    # y = AG_rows(x) @ w
    Primitive(AG_ROWS, ALL_GATHER_MATMUL, "lhs", "x", 0, "m", 1,
              backward=_grads(("x", RS_ROWS, "dy", "w.T"),
                              ("w", AG_CONTRACT, "dy.T", "x", True)),
              backward_keep=_grads(("x", RS_ROWS, "dy", "w.T"), ("w", None, "g.T", "dy"))),
    # y = x @ AG_cols(w)
    Primitive(AG_COLS, ALL_GATHER_MATMUL, "rhs", "w", 1, "n", 0,
              backward=_grads(("x", AG_CONTRACT, "dy", "w.T"), ("w", RS_COLS, "x.T", "dy")),
              backward_keep=_grads(("x", None, "dy", "g.T"), ("w", RS_COLS, "x.T", "dy"))),
    # y = x @ AG_rows(w)
    Primitive(AG_CONTRACT, ALL_GATHER_MATMUL, "rhs", "w", 0, "k", 0,
              backward=_grads(("x", AG_COLS, "dy", "w.T"), ("w", RS_ROWS, "x.T", "dy")),
              backward_keep=_grads(("x", None, "dy", "g.T"), ("w", RS_ROWS, "x.T", "dy"))),
    # y = RS_rows(x @ w): dy gathers along rows
    Primitive(RS_ROWS, MATMUL_REDUCE_SCATTER, "lhs", None, 0, "m", 1,
              backward=_grads(("x", AG_ROWS, "dy", "w.T"), ("w", AG_CONTRACT, "x.T", "dy")),
              backward_keep=_grads(("x", AG_ROWS, "dy", "w.T", False, True),
                                   ("w", None, "x.T", "g"))),
    # y = RS_cols(x @ w): dy gathers along columns
    Primitive(RS_COLS, MATMUL_REDUCE_SCATTER, "lhs", None, 1, "n", 1,
              backward=_grads(("w", AG_COLS, "x.T", "dy"),
                              ("x", AG_CONTRACT, "w", "dy.T", True)),
              backward_keep=_grads(("w", AG_COLS, "x.T", "dy", False, True),
                                   ("x", None, "g", "w.T"))),
)

# The registry, keyed by name (iterating it gives the names).
PRIMITIVES = {p.name: p for p in _PRIMITIVES}
GATHERS = tuple(name for name, p in PRIMITIVES.items() if p.gathers)


def of(prim: str) -> Primitive:
    """The record of primitive `prim` (a name); an error lists the valid ones."""
    try:
        return PRIMITIVES[prim]
    except (KeyError, TypeError):
        raise ValueError(f"unknown primitive {prim!r}; valid: "
                         f"{', '.join(PRIMITIVES)}.") from None


def primitive_of(op: str, gather: str, dim: int, x_ndim: int) -> str:
    """The primitive a public op call becomes (`dim` already normalised, non-negative):
    the one with its op, side and gather axis on the 2-D operands, where x's dimensions
    besides the last fold into rows (axis 0) and its last is the columns (axis 1)."""
    side = gather if op == ALL_GATHER_MATMUL else "lhs"
    axis = dim if side == "rhs" else int(dim == x_ndim - 1)
    return next(p.name for p in _PRIMITIVES
                if (p.op, p.side, p.gather_axis) == (op, side, axis))


class _Options:
    """`option(name)`: a record's backend option (its `options`, a tuple of pairs)."""

    def option(self, name, default=None):
        return dict(self.options).get(name, default)


@dataclasses.dataclass(frozen=True)
class Call(_Options):
    """One primitive call described statically: what a dispatch decision, a backend's
    `unavailable` check and the cost model look at.

    `x_shape`, `w_shape` are the canonical 2-D local shapes; `target` is the
    `_target.Target` the call is built for (None when unknown; a platform name "cpu",
    "gpu", "tpu" stands for a target known only by its platform); `bidirectional` is the
    ring shape as requested (None: the default, `_schedule.prefers_bidirectional`);
    `precision` is the matmuls' (some kernels cannot compute every precision); `options`
    the backend options, as pairs; `comm_dtype` the narrow numpy dtype the travelling
    operand or accumulator is sent in (`_quantize.COMM_DTYPES`), None for the inputs'
    own (not every backend can send a quantized payload); `beside` the
    seconds of other work the program can run while the reference's collective is in
    flight (a backward pass's other gradient matmul, which needs nothing this call
    computes: XLA hides the reference's collective behind it; its launch excluded, which
    hides nothing); `automatic_axes` the
    `(name, size)` pairs of the mesh axes the enclosing `shard_map` leaves to XLA
    (`_target.automatic_axes`: a kernel that addresses devices by their coordinates on
    every mesh axis cannot run there); `w_invariant` whether JAX's varying-axes type
    proves w the same on every device of the ring (`_vma.invariant`: an ag_rows can then
    multiply first and gather the product, `_product_first`); `gathered` whether the run
    must also return the gathered operand (what that path gathers separately);
    `adding` whether a reduce-scatter's run also sums another op's partial sums (the
    backward of layers sharing a gathered input: `_operands_first` has no reduce-scatter
    to sum them in); `w_ahead` whether w exists before the work around the call, so that
    XLA can send it ahead of that work: the op's own w (a weight, as a rule) and a
    backward run's that is the forward's w, not one that is a cotangent;
    `vma_typed` whether the enclosing `shard_map` types varying axes (`check_vma=True`,
    `jax.shard_map`'s default: `_vma.typed`), where a backend whose kernels need
    `check_vma=False` (`Backend.check_vma`) cannot run; `reduce_dtype` the name of the
    dtype reduce-scatter partial sums travel in (None: the accumulation dtype, float32
    for 16-bit inputs); `w_transposed` whether w is the transpose of the array in memory
    (`Config.w_transposed`: what a kernel reading it in place must tile); `w_resident`
    whether that array is one the program holds, not a collective's fresh result
    (`Config.w_resident`); `explicit_vmap` the Explicit mesh axes of a `jax.vmap` around
    the call that JAX batches its traced program over afterwards
    (`_folding.explicit_vmap_axes`), where the ring's steps cannot be batched.
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
    comm_dtype: Any = None
    beside: float = 0.0
    automatic_axes: tuple = ()
    w_invariant: bool = False
    gathered: bool = False
    adding: bool = False
    w_ahead: bool = True
    vma_typed: bool = False
    reduce_dtype: Optional[str] = None
    w_transposed: bool = False
    w_resident: bool = False
    explicit_vmap: tuple = ()

    def __post_init__(self):
        if isinstance(self.target, str):
            object.__setattr__(self, "target",
                               _target.of_platform(self.target) if self.target else None)

    @property
    def platform(self) -> str:
        """The target's platform, "" when unknown."""
        return "" if self.target is None else self.target.platform

    @property
    def primitive(self) -> Primitive:
        return of(self.prim)

    @property
    def block_length(self) -> int:
        return self.primitive.block_length(self.x_shape, self.w_shape, self.axis_size)

    @property
    def runs_bidirectional(self) -> bool:
        """The ring shape the call runs with: as requested, else the default."""
        if self.bidirectional is not None:
            return self.bidirectional
        return prefers_bidirectional(self.axis_size, self.block_length)


@dataclasses.dataclass(frozen=True)
class Config(_Options):
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
    - `comm_dtype`: the narrow numpy dtype (`_quantize.COMM_DTYPES`, converted once where
      the call's arguments are validated, `_validate.op_call`) the forward's travelling
      operand or accumulator is sent in, None for its own dtype; `grad_comm_dtype`: the
      same for the backward pass.
    - `auto`: the backend was picked by `backend="auto"`; the backward pass then picks
      the backend of each dual primitive it runs the same way, for that primitive's own
      shapes (`_autodiff._run_dual`).
    - `automatic_axes`: the mesh axes the enclosing `shard_map` leaves to XLA (`Call`).
    - `rearranged`: `auto` runs the call on lax collectives in another arrangement,
      whatever `backend` says ("" where it does not): `PRODUCT_FIRST`, an ag_rows with
      an invariant w as `all_gather(x @ w)` (`_product_first`); `OPERANDS_FIRST`, an
      rs_rows as x's rows exchanged times w gathered (`_operands_first`).
    - `shape_requested`: the caller gave `bidirectional`; else, under `auto`, each dual
      primitive of the backward runs the ring shape of its own pick.
    - `w_transposed`: w is the transpose of the array in memory (a layer's `weight.T`;
      in the backward, a `.T` operand of an array computed row-major): a backend that
      reads w in place (the fused TPU kernels' row primitives) takes that array and
      multiplies by its transpose, where XLA would otherwise copy it into (k, n) order.
    - `w_resident`: that array is one the program holds (a weight not gathered this
      step), so the fused TPU reduce-scatter kernel reads it in place too; a freshly
      gathered weight it is given copied, a copy XLA's collective fusion hides the
      gather in (`pallas_tpu._in_place`).
    - `explicit_vmap`: as `Call`'s; its reduce-scatters then sum over the ring and slice
      (`_definition.psum_scatter`), in the backward pass too.
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
    rearranged: str = ""
    shape_requested: bool = False
    w_transposed: bool = False
    w_resident: bool = False
    explicit_vmap: tuple = ()

    @property
    def product_first(self) -> bool:
        """An ag_rows run as `all_gather(x @ w)` (`_product_first`)."""
        return self.rearranged == PRODUCT_FIRST

    @property
    def on(self) -> "_target.Target":
        """The target: as configured, else read from the code being traced."""
        return self.target if self.target is not None else _target.current()

    def call(self, op: str, prim: str, x, w, gathered=False, adding=False,
             w_ahead=True) -> Call:
        """The `Call` that describes running `prim` with this config on `x` and `w`
        (`gathered`: the run also returns the gathered operand; `adding`: it also sums
        an addend; `w_ahead`: `Call`'s)."""
        return Call(op, prim, tuple(x.shape), tuple(w.shape), jnp.dtype(x.dtype).name,
                    self.axis_size, self.target, self.bidirectional, self.precision,
                    self.options, self.comm_dtype, automatic_axes=self.automatic_axes,
                    w_invariant=_vma.invariant(w, self.axis_name), gathered=gathered,
                    adding=adding, w_ahead=w_ahead, vma_typed=_vma.checked(self.axis_name),
                    reduce_dtype=jnp.dtype(self.reduce_dtype).name,
                    w_transposed=self.w_transposed, w_resident=self.w_resident,
                    explicit_vmap=self.explicit_vmap)


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


def rows_first(x, dim):
    """`x` as `canonicalize` lays out a `*_rows` primitive's operand: 2-D, `dim` first."""
    return _rows_first(x, dim)[0]


def canonicalize(op: str, gather: str, dim: int, x, w, n: int) -> Canonical:
    """Reshape a public op call (`dim` already normalised to be non-negative)."""
    prim = primitive_of(op, gather, dim, x.ndim)
    p = PRIMITIVES[prim]
    if p.ring_dim != "m":  # the ring cuts w, or the columns: x's rows stay as they are
        lead = x.shape[:-1]
        return Canonical(prim, x.reshape(-1, x.shape[-1]), w,
                         lambda y: y.reshape(*lead, y.shape[-1]))
    x2, lead = _rows_first(x, dim)
    block = lead[0] * n if p.gathers else lead[0] // n

    def restore(y):
        return jnp.moveaxis(y.reshape(block, *lead[1:], y.shape[-1]), 0, dim)

    return Canonical(prim, x2, w, restore)
