"""The sharding styles a layer is built from: `Column`, `Row` (tensor parallel) and `FSDP`.

Each is a frozen dataclass; its comm dtypes are checked and normalised on construction,
so styles asking for one dtype compare equal however it was spelt. `_rules.compose`
combines them into a layer's `Rule`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import numpy as np

from .._core import _quantize, _validate


class _Style:
    """What the three styles share: their fields checked (comm dtypes normalised) on
    construction, and a repr that shows the optional ones only when set."""

    def __post_init__(self):
        _checked(self)

    def __repr__(self):
        return _style_repr(self)


@dataclasses.dataclass(frozen=True, repr=False)
class Column(_Style):
    """Tensor parallel on the output features: weight `(out, in)` dim 0 over `axis`.

    Input replicated (or, with `sequence_parallel`, sharded on its sequence dimension,
    dim -2); output sharded on its features (replicated with `gather_output`).
    `comm_dtype` (`jnp.int8`, `jnp.float8_e4m3fn` or None): the dtype the
    sequence-parallel input gather sends (`all_gather_matmul(comm_dtype=)`);
    `grad_comm_dtype`: that of the backward's reduce-scatter. Both need
    `sequence_parallel=True`. `reduce_dtype`: the floating dtype that backward's
    reduce-scatter sums and sends its partial sums in (the op's `reduce_dtype`; None:
    float32 for 16-bit inputs). `keep_gathered=False`: the forward keeps no gathered
    input for the weight gradient, which gathers it again (less memory, one more
    gather; needs `sequence_parallel=True`; layers sharing one input, as q, k and v do,
    then gather it each).
    """

    axis: str = "tp"
    sequence_parallel: bool = False
    gather_output: bool = False
    comm_dtype: Any = None
    grad_comm_dtype: Any = None
    reduce_dtype: Any = None
    keep_gathered: bool = True


@dataclasses.dataclass(frozen=True, repr=False)
class Row(_Style):
    """Tensor parallel on the input features: weight `(out, in)` dim 1 over `axis`.

    Input sharded on its features (a `Column` output); output replicated (or, with
    `sequence_parallel`, sharded on its sequence dimension, dim -2).
    `comm_dtype` / `grad_comm_dtype`: passed to the sequence-parallel
    `matmul_reduce_scatter` (forward) for its ring and its backward's gather; need
    `sequence_parallel=True`. `reduce_dtype`: the floating dtype the partial sums are
    summed and sent in, by the reduce-scatter (its `reduce_dtype`) or, without
    `sequence_parallel`, the psum (None: float32 for 16-bit inputs).
    `keep_gathered=False`: the backward gathers the output's cotangent twice, once for
    each gradient, instead of keeping it between them (less memory, one more gather;
    needs `sequence_parallel=True`).
    """

    axis: str = "tp"
    sequence_parallel: bool = False
    comm_dtype: Any = None
    grad_comm_dtype: Any = None
    reduce_dtype: Any = None
    keep_gathered: bool = True


@dataclasses.dataclass(frozen=True, repr=False)
class FSDP(_Style):
    """Fully sharded data parallel: the weight's dimension `dim` over `axis`.

    `dim=None` picks the weight dimension a tensor-parallel style leaves free (dim 1 with
    `Column`, dim 0 with `Row` or alone); `dim` equal to the tensor-parallel dimension
    shards it over both axes, `(tp, fsdp)`. The bias stays replicated over `axis` (it
    is small; its gradient is summed over the data shards by autodiff). The input's
    batch dimension (dim 0) is sharded over `axis`. `comm_dtype`: the dtype the weight
    gather sends (e.g. `jnp.int8`, one scale per output channel, or per shard of it
    where `axis` splits the input features); `grad_comm_dtype`: that of the weight
    gradient's reduce-scatter (where the gather is an `all_gather_matmul`);
    `reduce_dtype`: the floating dtype that reduce-scatter sums in (None: float32 for
    16-bit weights). `gather`: what the layer moves over `axis`: "weights" (each shard
    gathered before the product), "activations" (the weight stays on its shard; the
    FSDP peers' tokens come to it and their products go back, for steps with few tokens
    such as decoding), or "auto": the activations where the target's cost numbers say
    their two collectives take less time than the weight gather, no `comm_dtype` is set
    and the input has a batch dimension (a weight stored quantized stays home and is
    dequantized there).
    """

    axis: str = "fsdp"
    dim: Optional[int] = None
    comm_dtype: Any = None
    grad_comm_dtype: Any = None
    reduce_dtype: Any = None
    gather: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.gather not in ("auto", "weights", "activations"):
            raise ValueError(f"FSDP: gather must be 'auto', 'weights' or 'activations', "
                             f"got {self.gather!r}.")


Style = Union[Column, Row, FSDP]


def _style_repr(style) -> str:
    """The dataclass repr, with the comm and reduce dtypes only when set (by name)."""
    parts = []
    for f in dataclasses.fields(style):
        v = getattr(style, f.name)
        if f.name in ("comm_dtype", "grad_comm_dtype", "reduce_dtype"):
            if v is None:
                continue
            v = f"jnp.{v.name}"
        elif (f.name, v) in (("gather", "auto"), ("keep_gathered", True)):
            continue
        else:
            v = repr(v)
        parts.append(f"{f.name}={v}")
    return f"{type(style).__name__}({', '.join(parts)})"


def _checked(style) -> None:
    """Validate a style's fields and normalise its `comm_dtype` / `grad_comm_dtype` /
    `reduce_dtype` (numpy dtypes), so that styles asking for one dtype compare equal
    however it was spelt."""
    for name in ("comm_dtype", "grad_comm_dtype"):
        d = _quantize.comm_dtype(type(style).__name__, name, getattr(style, name))
        object.__setattr__(style, name, d)
    d = _validate.float_dtype(type(style).__name__, "reduce_dtype", style.reduce_dtype)
    object.__setattr__(style, "reduce_dtype", None if d is None else np.dtype(d))
    if isinstance(style, (Column, Row)) and not style.sequence_parallel and (
            style.comm_dtype is not None or style.grad_comm_dtype is not None):
        raise ValueError(
            f"{type(style).__name__}: comm_dtype / grad_comm_dtype need "
            "sequence_parallel=True: they set the dtype of the sequence-parallel collective "
            "matmul; without it the layer's tensor-parallel collective is a psum, sent in "
            "the activation dtype.")
    if isinstance(style, (Column, Row)):
        _validate.boolean(type(style).__name__, "keep_gathered", style.keep_gathered)
        if not (style.keep_gathered or style.sequence_parallel):
            raise ValueError(
                f"{type(style).__name__}: keep_gathered=False needs sequence_parallel=True: "
                "without it the layer gathers nothing over its axis that it could keep.")
