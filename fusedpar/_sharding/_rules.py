"""A layer's sharding `Rule` (an embedding's `TableRule`), and the PartitionSpecs it gives.

A rule holds at most one tensor-parallel style and one FSDP style (`compose`, in any
order). From it come the parameter specs (several axes on one dimension form a tuple in
the canonical order tensor-parallel first, FSDP second, `ROLES`: gathering a weight over
the FSDP axis alone yields the tensor-parallel shard), the activation specs (the layer's
`shard_map` in/out specs), the local weight shape, and relaxation (the rule minus the
styles whose axes do not divide their dimension).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Optional, Union

from jax.sharding import PartitionSpec as P

from .._core import _validate
from ._styles import FSDP, Column, Row

ROLES = ("tp", "fsdp")  # canonical order of axes sharing one dimension: major first


@dataclasses.dataclass(frozen=True)
class Placement:
    """One mesh axis on one dimension of one parameter, put there by a style's `role`."""

    param: str
    dim: int
    axis: str
    role: str


@dataclasses.dataclass(frozen=True)
class Drop:
    """What relaxed validation dropped: `axes` no longer shard `path`'s dim `dim`."""

    path: str
    dim: int
    size: int
    axes: tuple

    def __str__(self):
        return (f"{self.path}: dim {self.dim} (size {self.size}) no longer sharded over "
                f"{self.axes}")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A layer's composed sharding: `tp` (a `Column`/`Row` or None), `fsdp` (or None)."""

    tp: Optional[Union[Column, Row]] = None
    fsdp: Optional[FSDP] = None

    @property
    def axes(self) -> tuple:
        """The mesh axes this rule uses, tensor-parallel first."""
        return tuple(s.axis for s in (self.tp, self.fsdp) if s is not None)

    def missing_axes(self, names) -> list:
        """Each axis of this rule not among the mesh axis `names`, with the style that
        uses it and the argument that set it, e.g. `"'tp' (Column's axis=, default 'tp')"`."""
        out = []
        for s in (self.tp, self.fsdp):
            if s is not None and s.axis not in names:
                # A typo's likely fix: the mesh's closest name ('pt' -> 'tp').
                close = difflib.get_close_matches(s.axis, [str(n) for n in names], n=1,
                                                  cutoff=0.5)
                arg = "axis=, a layer's fsdp_axis=" if isinstance(s, FSDP) else "axis="
                default = {f.name: f.default for f in dataclasses.fields(s)}["axis"]
                out.append(f"{s.axis!r} ({type(s).__name__}'s {arg}"
                           f"{f', default {default!r}' if s.axis == default else ''}"
                           f"{f'; did you mean {close[0]!r}?' if close else ''})")
        return out

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.tp is not None and self.tp.sequence_parallel)

    @property
    def tp_dim(self) -> Optional[int]:
        """The weight dimension the tensor-parallel style shards."""
        return None if self.tp is None else (0 if isinstance(self.tp, Column) else 1)

    @property
    def fsdp_dim(self) -> Optional[int]:
        """The weight dimension the FSDP style shards (resolving `dim=None`)."""
        if self.fsdp is None:
            return None
        if self.fsdp.dim is not None:
            return self.fsdp.dim
        return 1 if self.tp_dim == 0 else 0

    def without_fsdp(self) -> "Rule":
        return Rule(self.tp, None)

    def placements(self, use_bias: bool) -> tuple:
        out = []
        if self.tp is not None:
            out.append(Placement("weight", self.tp_dim, self.tp.axis, "tp"))
            if isinstance(self.tp, Column) and use_bias:
                out.append(Placement("bias", 0, self.tp.axis, "tp"))
        if self.fsdp is not None:
            out.append(Placement("weight", self.fsdp_dim, self.fsdp.axis, "fsdp"))
        return tuple(out)

    def param_specs(self, where: str, use_bias: bool) -> dict:
        """`{"weight": P, "bias": P or None}`; `where` names the layer in errors."""
        pl = self.placements(use_bias)
        return {"weight": merge(f"{where}.weight", 2, pl),
                "bias": merge(f"{where}.bias", 1, pl) if use_bias else None}

    def local_weight_shape(self, shape, sizes: dict) -> tuple:
        """Per-device weight shape on a mesh with `sizes` (axis -> size)."""
        return local_shape(shape, self.param_specs("weight", False)["weight"], sizes)

    def activation_specs(self, ndim: int, data: Optional[bool] = None) -> tuple[P, P]:
        """(input spec, output spec) of a `(..., features)` activation of rank `ndim`.

        `data`: the batch dimension (dim 0) is sharded over the FSDP axis; None: as the
        layer lays out an input of rank `ndim` (`has_data_dim`).
        """
        x = [None] * ndim
        y = [None] * ndim
        if _data(self, data, ndim):
            x[0] = y[0] = self.fsdp.axis
        tp = self.tp
        if isinstance(tp, Column):
            if tp.sequence_parallel:
                x[ndim - 2] = tp.axis
            if not tp.gather_output:
                y[ndim - 1] = tp.axis
        elif isinstance(tp, Row):
            x[ndim - 1] = tp.axis
            if tp.sequence_parallel:
                y[ndim - 2] = tp.axis
        return P(*x), P(*y)

    def relax(self, where: str, weight_shape, sizes: dict) -> tuple["Rule", list]:
        """This rule minus the styles whose axes do not divide their weight dimension."""
        rule, drops = self, []
        if rule.tp is not None and weight_shape[rule.tp_dim] % sizes[rule.tp.axis]:
            drops.append(Drop(f"{where}.weight", rule.tp_dim, weight_shape[rule.tp_dim],
                              (rule.tp.axis,)))
            rule = Rule(None, rule.fsdp if rule.fsdp is None or rule.fsdp.dim is not None
                        else dataclasses.replace(rule.fsdp, dim=rule.fsdp_dim))
        if rule.fsdp is not None:
            d = rule.fsdp_dim
            n = sizes[rule.fsdp.axis] * (sizes[rule.tp.axis] if rule.tp_dim == d else 1)
            if weight_shape[d] % n:
                drops.append(Drop(f"{where}.weight", d, weight_shape[d], (rule.fsdp.axis,)))
                rule = Rule(rule.tp, None)
        return rule, drops


@dataclasses.dataclass(frozen=True)
class TableRule(Rule):
    """An embedding table's sharding. The table `(vocab, dim)` is the weight of the linear
    map from one-hot ids to embeddings, transposed: `Row` shards the vocabulary (dim 0)
    and `FSDP` the embedding dimension (dim 1) unless given `dim=`.

    The input is the ids `(...)`, the output `(..., dim)`: replicated over the
    tensor-parallel axis, or with `sequence_parallel` sharded along the sequence (dim -1
    of the ids, dim -2 of the output). `Column` does not apply to a table.
    """

    @classmethod
    def of(cls, rule: Rule, where: str) -> "TableRule":
        if isinstance(rule.tp, Column):
            raise ValueError(
                f"{where}: an embedding takes Row (a vocabulary-parallel table, "
                f"fusedpar.Row()) and FSDP styles, not {rule.tp}; give the embedding its "
                "own plan pattern.")
        for s in (rule.tp, rule.fsdp):
            if s is not None and (s.comm_dtype is not None or s.grad_comm_dtype is not None):
                raise ValueError(
                    f"{where}: an embedding runs no collective matmul, so {s} cannot set "
                    "its comm_dtype / grad_comm_dtype; give the embedding its own plan "
                    "pattern without them.")
        if rule.tp is not None and not rule.tp.keep_gathered:
            raise ValueError(
                f"{where}: an embedding runs no collective matmul, so {rule.tp} has nothing "
                "to keep; give the embedding its own plan pattern without keep_gathered.")
        if rule.fsdp is not None and rule.fsdp.gather == "activations":
            raise ValueError(
                f"{where}: an embedding gathers its table over {rule.fsdp.axis!r}; "
                "FSDP(gather='activations') moves a linear layer's tokens instead, which a "
                "lookup has no use for; its FSDP style needs gather='auto' or 'weights': "
                "where a glob gives it this one, narrow the glob to the linear layers and "
                "give the embedding's own pattern its FSDP style.")
        return cls(rule.tp, rule.fsdp)

    def param_specs(self, where: str, use_bias: bool = False) -> dict:
        spec = Rule(self.tp, self.fsdp).param_specs(where, False)["weight"]
        return {"weight": transpose(spec), "bias": None}

    @property
    def table_fsdp_dim(self) -> Optional[int]:
        """The table dimension the FSDP style shards."""
        return None if self.fsdp is None else 1 - self.fsdp_dim

    def activation_specs(self, ndim: int, data: Optional[bool] = None) -> tuple[P, P]:
        """(ids spec, output spec) for ids of rank `ndim` (the output has rank `ndim + 1`).

        `data`: the batch dimension (dim 0) is sharded over the FSDP axis; None: as the
        embedding lays out ids of rank `ndim`.
        """
        x = [None] * ndim
        y = [None] * (ndim + 1)
        if _data(self, data, ndim + 1):
            x[0] = y[0] = self.fsdp.axis
        if self.sequence_parallel:
            y[ndim - 1] = self.tp.axis
        return P(*x), P(*y)

    def relax(self, where: str, weight_shape, sizes: dict) -> tuple["TableRule", list]:
        rule, drops = Rule(self.tp, self.fsdp).relax(where, tuple(reversed(weight_shape)),
                                                     sizes)
        drops = [dataclasses.replace(d, dim=1 - d.dim) for d in drops]
        return TableRule(rule.tp, rule.fsdp), drops

    def without_fsdp(self) -> "TableRule":
        return TableRule(self.tp, None)


def has_data_dim(rule: Rule, ndim: int) -> bool:
    """Whether an input of rank `ndim` has a batch dimension for the FSDP axis.

    Dim 0, when it is neither the feature dimension nor the sequence dimension (dim -2)
    of a sequence-parallel layer.
    """
    return rule.fsdp is not None and ndim >= 2 + rule.sequence_parallel


def _data(rule: Rule, data: Optional[bool], ndim: int) -> bool:
    """`activation_specs`' `data`: as given, or where the layer has a batch dimension."""
    if data is None:
        return has_data_dim(rule, ndim)
    if data and rule.fsdp is None:
        raise ValueError("activation_specs: data=True shards the batch over the FSDP axis, "
                         "but this rule has no FSDP style (pass data=False or None).")
    return bool(data)


def transpose(spec: P) -> P:
    """The PartitionSpec of a 2-D array's transpose."""
    entries = tuple(spec) + (None,) * (2 - len(spec))
    return P(*reversed(entries)) if any(e is not None for e in entries) else P()


def compose(*styles, where: str = "layer") -> Rule:
    """Compose styles (and rules) into one `Rule`; the order of `styles` is irrelevant.

    At most one tensor-parallel style (`Column`/`Row`) and one `FSDP` style; None is
    ignored. Placing one mesh axis twice is caught when specs are derived.
    """
    tp = fsdp = None
    flat = []
    for s in styles:
        flat.extend([s.tp, s.fsdp] if isinstance(s, Rule) else [s])
    for s in flat:
        if s is None:
            continue
        if isinstance(s, (Column, Row)):
            if tp is not None and tp != s:
                raise ValueError(f"{where}: two tensor-parallel styles, {tp} and {s}; a "
                                 "layer can be column- or row-parallel, not both.")
            tp = s
        elif isinstance(s, FSDP):
            if fsdp is not None and fsdp != s:
                raise ValueError(f"{where}: two FSDP styles, {fsdp} and {s}; a layer "
                                 "takes one.")
            fsdp = s
        else:
            raise TypeError(f"{where}: expected Column, Row or FSDP styles, got {s!r}.")
        if not isinstance(s.axis, str) or not s.axis:
            raise TypeError(f"{where}: a mesh axis must be a name, a non-empty str such as "
                            f"{type(s)().axis!r}, got axis={s.axis!r} in {s}.")
        for flag in ("sequence_parallel", "gather_output"):
            _validate.boolean(where, flag, getattr(s, flag, False))
    if fsdp is not None and fsdp.dim is not None and not (
            _validate.is_int(fsdp.dim) and fsdp.dim in (0, 1)):  # 1.0 == 1 passed
        raise ValueError(f"{where}: FSDP dim must be None, 0 or 1 (a weight dimension), "
                         f"got {fsdp.dim!r}.")
    if (fsdp is not None and fsdp.grad_comm_dtype is not None and tp is not None
            and tp.sequence_parallel):
        raise ValueError(
            f"{where}: {fsdp} with {tp}: grad_comm_dtype sets the weight gradient's "
            "reduce-scatter where the FSDP gather is an all_gather_matmul; a "
            "sequence-parallel layer's ring moves the activations and gathers its FSDP "
            "weight whole (lax.all_gather), whose gradient is a psum_scatter in the "
            "weight's dtype. Leave this layer's FSDP grad_comm_dtype None (in a plan, give "
            "the sequence-parallel layers an FSDP style of their own).")
    rule = Rule(tp, fsdp)
    rule.param_specs(where, True)  # raises if an axis is used twice
    return rule


def merge(path: str, ndim: int, placements) -> P:
    """The PartitionSpec of a rank-`ndim` parameter from the placements naming it.

    Axes on one dimension are ordered by `ROLES`, so stacking order never matters.
    """
    dims: list[list[Placement]] = [[] for _ in range(ndim)]
    seen: dict[str, Placement] = {}
    param = path.rsplit(".", 1)[-1]
    for p in placements:
        if p.param != param:
            continue
        if p.axis in seen:
            q = seen[p.axis]
            raise ValueError(
                f"{path}: mesh axis {p.axis!r} is used twice (dim {q.dim} by {q.role}, dim "
                f"{p.dim} by {p.role}); an axis can shard an array only once — give the "
                "tensor-parallel and FSDP styles different axes.")
        seen[p.axis] = p
        dims[p.dim].append(p)
    entries = []
    for ps in dims:
        axes = tuple(p.axis for p in sorted(ps, key=lambda p: ROLES.index(p.role)))
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries) if any(e is not None for e in entries) else P()


def axes_of(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def local_shape(shape, spec, sizes: dict) -> tuple:
    """The per-device shape of an array of `shape` laid out by `spec` on a mesh of
    `sizes` (axis -> size); dimensions the spec leaves out are whole."""
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    return tuple(n // axes_product(axes_of(e), sizes) for n, e in zip(shape, spec))


def axes_product(axes, sizes: dict) -> int:
    """The number of devices `axes` span on a mesh of `sizes` (axis -> size)."""
    return math.prod(sizes[a] for a in axes)
