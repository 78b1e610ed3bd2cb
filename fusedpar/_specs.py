"""Sharding rules, and every PartitionSpec the layers use, derived in one place.

A layer's sharding is a `Rule`: at most one tensor-parallel style (`Column` or `Row`) and
at most one `FSDP` style, composed by `compose` in any order. From the rule come

- the parameter specs (`Rule.param_specs`): which weight/bias dimension lies on which
  mesh axis. Several axes on one dimension form a tuple in the canonical order
  tensor-parallel first, FSDP second (`ROLES`), whatever order the styles were stacked
  in. That order is what the layers rely on: gathering a weight over the FSDP axis
  alone yields the tensor-parallel shard (the FSDP blocks are the minor ones);
- the activation specs (`Rule.activation_specs`): the layout of the layer's input and
  output, i.e. the `shard_map` in/out specs the layer wraps itself in;
- the local (per-device) weight shape, and validation against a mesh: the axis exists,
  the dimension divides, an axis shards an array once. Errors name the parameter path,
  dimension, size and axes. Relaxed validation drops the tensor-parallel or FSDP style
  whose axes do not divide, and reports what it dropped.

Whole-model functions (`param_specs`, `validate`) walk a model and apply these per layer;
non-parallel arrays are replicated (`PartitionSpec()`). An embedding table's rule is a
`TableRule`, the same styles on the transposed weight.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P

from . import _quantize
from ._quantized_array import QuantizedArray

ROLES = ("tp", "fsdp")  # canonical order of axes sharing one dimension: major first


class _Style:
    """What the three styles share: their comm dtypes checked and normalised on
    construction, and a repr that shows them only when set."""

    def __post_init__(self):
        _comm_dtypes(self)

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
    `sequence_parallel=True`.
    """

    axis: str = "tp"
    sequence_parallel: bool = False
    gather_output: bool = False
    comm_dtype: Any = None
    grad_comm_dtype: Any = None


@dataclasses.dataclass(frozen=True, repr=False)
class Row(_Style):
    """Tensor parallel on the input features: weight `(out, in)` dim 1 over `axis`.

    Input sharded on its features (a `Column` output); output replicated (or, with
    `sequence_parallel`, sharded on its sequence dimension, dim -2).
    `comm_dtype` / `grad_comm_dtype`: passed to the sequence-parallel
    `matmul_reduce_scatter` (forward) for its ring and its backward's gather; need
    `sequence_parallel=True`.
    """

    axis: str = "tp"
    sequence_parallel: bool = False
    comm_dtype: Any = None
    grad_comm_dtype: Any = None


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
    gradient's reduce-scatter (where the gather is an `all_gather_matmul`).
    """

    axis: str = "fsdp"
    dim: Optional[int] = None
    comm_dtype: Any = None
    grad_comm_dtype: Any = None


Style = Union[Column, Row, FSDP]


def _style_repr(style) -> str:
    """The dataclass repr, with the comm dtypes only when set (by name)."""
    parts = []
    for f in dataclasses.fields(style):
        v = getattr(style, f.name)
        if f.name in ("comm_dtype", "grad_comm_dtype"):
            if v is None:
                continue
            v = f"jnp.{v.name}"
        else:
            v = repr(v)
        parts.append(f"{f.name}={v}")
    return f"{type(style).__name__}({', '.join(parts)})"


def _comm_dtypes(style) -> None:
    """Validate and normalise a style's `comm_dtype` / `grad_comm_dtype` (numpy dtypes),
    so that styles asking for one dtype compare equal however it was spelt."""
    for name in ("comm_dtype", "grad_comm_dtype"):
        d = _quantize.comm_dtype(type(style).__name__, name, getattr(style, name))
        object.__setattr__(style, name, d)
    if isinstance(style, (Column, Row)) and not style.sequence_parallel and (
            style.comm_dtype is not None or style.grad_comm_dtype is not None):
        raise ValueError(
            f"{type(style).__name__}: comm_dtype / grad_comm_dtype need "
            "sequence_parallel=True: they set the dtype of the sequence-parallel collective "
            "matmul; without it the layer's tensor-parallel collective is a psum, sent in "
            "the activation dtype.")


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
        spec = tuple(self.param_specs("weight", False)["weight"])
        spec += (None,) * (len(shape) - len(spec))
        return tuple(n // _product(_axes_of(e), sizes) for n, e in zip(shape, spec))

    def activation_specs(self, ndim: int, data: bool = False) -> tuple[P, P]:
        """(input spec, output spec) of a `(..., features)` activation of rank `ndim`.

        `data`: the batch dimension (dim 0) is sharded over the FSDP axis.
        """
        x = [None] * ndim
        y = [None] * ndim
        if data:
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
        return cls(rule.tp, rule.fsdp)

    def param_specs(self, where: str, use_bias: bool = False) -> dict:
        spec = Rule(self.tp, self.fsdp).param_specs(where, False)["weight"]
        return {"weight": transpose(spec), "bias": None}

    @property
    def table_fsdp_dim(self) -> Optional[int]:
        """The table dimension the FSDP style shards."""
        return None if self.fsdp is None else 1 - self.fsdp_dim

    def activation_specs(self, ndim: int, data: bool = False) -> tuple[P, P]:
        """(ids spec, output spec) for ids of rank `ndim` (the output has rank `ndim + 1`).

        `data`: the batch dimension (dim 0) is sharded over the FSDP axis.
        """
        x = [None] * ndim
        y = [None] * (ndim + 1)
        if data:
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
            if not isinstance(getattr(s, flag, False), bool):
                raise TypeError(f"{where}: {flag} must be True or False, got "
                                f"{getattr(s, flag)!r}.")
    if fsdp is not None and fsdp.dim not in (None, 0, 1):
        raise ValueError(f"{where}: FSDP dim must be None, 0 or 1 (a weight dimension), "
                         f"got {fsdp.dim!r}.")
    rule = Rule(tp, fsdp)
    rule.param_specs(where, True)  # raises if an axis is used twice
    return rule


def check_fsdp_dim(where: str, fsdp_axis, fsdp_dim) -> None:
    """Raise if `fsdp_dim` is given without the `fsdp_axis` it would apply to."""
    if fsdp_dim is not None and fsdp_axis is None:
        raise ValueError(f"{where}: fsdp_dim={fsdp_dim!r} without fsdp_axis does nothing; "
                         "pass fsdp_axis (e.g. 'fsdp') to shard the weight with FSDP, or "
                         "drop fsdp_dim.")


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


def _axes_of(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _product(axes, sizes) -> int:
    return math.prod(sizes[a] for a in axes)


def mesh_sizes(mesh) -> dict:
    """`{axis name: size}` of a `Mesh` or `AbstractMesh`."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def check_scalar(where: str, rule: Rule, in_features, out_features) -> None:
    """Refuse a rule that shards a "scalar" feature dimension of a linear layer.

    `eqx.nn.Linear` takes `"scalar"` features (a weight dimension of length 1); a layer
    with them computes as it does with no mesh, but no mesh axis can split that dimension.
    """
    names = {0: ("out_features", out_features), 1: ("in_features", in_features)}
    for pl in rule.placements(use_bias=False):
        name, value = names[pl.dim]
        if value == "scalar":
            style = "FSDP" if pl.role == "fsdp" else type(rule.tp).__name__
            raise ValueError(
                f"{where}: {name}='scalar' is a weight dimension of length 1, which its "
                f"{style} style shards over mesh axis {pl.axis!r}; keep this layer an "
                "eqx.nn.Linear (leave it out of the parallelize plan), or use a style "
                "that shards the other dimension.")


def check_spec(path: str, shape, spec: P, sizes: dict, what="parameter",
               vocab_dim: Optional[int] = None):
    """Raise unless every axis of `spec` is in the mesh and divides its dimension.

    `vocab_dim`: the dimension that is a vocabulary, which the message says to pad.
    """
    for d, entry in enumerate(spec):
        axes = _axes_of(entry)
        missing = [a for a in axes if a not in sizes]
        if missing:
            raise ValueError(
                f"{path}: mesh axis {missing[0]!r} (sharding dim {d}) is not in the mesh, "
                f"whose axes are {tuple(sizes)}.")
        n = _product(axes, sizes)
        if axes and shape[d] % n:
            sz = ", ".join(f"{a}={sizes[a]}" for a in axes)
            fix = ("change the size, the mesh, or use relaxed=True to replicate this "
                   "dimension" if what == "parameter" else "change the size or the mesh")
            if d == vocab_dim:
                fix = pad_vocab_hint(shape[d], n) + ", or use relaxed=True to replicate it"
            raise ValueError(
                f"{path}: {what} dim {d} has size {shape[d]}, not divisible by {n}, the "
                f"product of mesh axes {axes} ({sz}); {fix}.")


# --- whole models -----------------------------------------------------------------

def is_param(x) -> bool:
    """An array, or the shape of one (`jax.eval_shape` / `eqx.filter_eval_shape` output)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_layer(x) -> bool:
    """A fusedpar layer: a module with a sharding `Rule`."""
    return isinstance(x, eqx.Module) and isinstance(getattr(x, "rule", None), Rule)


def path_str(path) -> str:
    """A pytree path as a dotted string (`"blocks.0.mlp.up"`), as plans and errors name it."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        else:
            parts.append(str(getattr(k, "key", getattr(k, "name", k))))
    return ".".join(parts) or "model"


def layer_name(path, layer) -> str:
    """How errors name `layer` at `path`: the path, or its class when it is the model."""
    return path_str(path) if path else type(layer).__name__


def layer_param_specs(layer, where: str, rule: Optional[Rule] = None) -> Any:
    """`layer` with each array replaced by its PartitionSpec (under `rule`, default its own)."""
    rule = layer.rule if rule is None else rule
    specs = rule.param_specs(where, getattr(layer, "bias", None) is not None)

    def spec(path, leaf):
        name = path[-1].name if path and hasattr(path[-1], "name") else None
        # A weight tied by `eqx.nn.Shared` is a placeholder here: it is stored once, with
        # the spec of the array it is tied to (`check_ties` makes sure the two agree).
        if name in specs and specs[name] is not None and (is_param(leaf) or is_quantized(leaf)):
            one = stacked(specs[name], leaf.shape, PARAM_RANK[name])
            return quantized_specs(leaf, one) if is_quantized(leaf) else one
        if is_quantized(leaf):
            return quantized_specs(leaf, P())
        return P() if is_param(leaf) else None

    return jax.tree_util.tree_map_with_path(spec, layer, is_leaf=is_quantized)


def is_quantized(x) -> bool:
    """A `QuantizedArray` (a weight stored as values and scales)."""
    return isinstance(x, QuantizedArray)


def quantized_specs(q, spec: P):
    """The specs of a QuantizedArray sharded like an array of spec `spec`: its `values`
    (and `master`) by `spec`; its `scales` by `spec` too, except along the reduced axis
    where one scale covers the whole axis (scales of size 1 there are replicated). A
    QuantizedArray of those specs, so it matches `eqx.filter(model, eqx.is_array)`."""
    full = tuple(spec) + (None,) * (q.ndim - len(spec))
    ax = q.axis % q.ndim
    whole = q.scales.shape[ax] == 1
    scales = P(*(None if i == ax and whole else e for i, e in enumerate(full)))
    leaves = [spec, scales] + ([spec] if q.master is not None else [])
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(q), leaves)


# The rank of each parameter of one layer; more leading dimensions are a stack of layers.
PARAM_RANK = {"weight": 2, "bias": 1}


def stacked(spec: P, shape, rank: int) -> P:
    """`spec` (of one layer's rank-`rank` parameter) for a parameter of `shape`, whose
    leading dimensions beyond `rank` stack layers (`eqx.filter_vmap` over their
    constructor, run with `lax.scan`): those stay unsharded, each layer sharded as one."""
    lead = len(shape) - rank
    return P(*((None,) * lead + tuple(spec))) if lead > 0 and len(spec) else spec


def param_specs(model) -> Any:
    """A PartitionSpec for every array of `model` (a pytree of any depth).

    Arrays of fusedpar layers get their rule's specs; every other array is replicated,
    `PartitionSpec()`; non-array leaves become None. The result matches
    `eqx.filter(model, eqx.is_array)`, so it serves as `shard_map` in_specs for it.
    Raises if a layer uses one mesh axis twice on an array (naming its path).
    """

    specs = _specs_of(model)
    check_ties(model)
    return specs


def _specs_of(model) -> Any:
    def one(path, x):
        if is_layer(x):
            return layer_param_specs(x, layer_name(path, x))
        if is_quantized(x):
            return quantized_specs(x, P())
        return P() if is_param(x) else None

    return jax.tree_util.tree_map_with_path(
        one, model, is_leaf=lambda x: is_layer(x) or is_quantized(x))


def _is_shared(x) -> bool:
    return isinstance(x, eqx.nn.Shared)


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) and not isinstance(x, P) else [x]


def check_ties(model) -> None:
    """Raise unless every weight tied by an `eqx.nn.Shared` in `model` (a language model's
    embedding table and LM head, say) is sharded by its layer as the array it is tied to.

    A tied weight is stored once, with its source's spec. Were the layer it is restored
    into to shard it otherwise, it would be resharded at every call on global arrays and
    have the wrong local shape inside `shard_map`. Ties whose `get` transforms the source
    (`jnp.transpose`, say) are not checked: the layout of the result is not a spec here.
    """
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_shared)[0]
    for path, node in found:
        if not (_is_shared(node) and callable(node.where) and callable(node.get)):
            continue  # not a tie, or one filtered (`eqx.partition`) to its arrays
        # The spec each tied position gets from its layer: the specs of the pytree with
        # the ties restored (shapes only), read at the positions `where` names.
        restored = eqx.filter_eval_shape(lambda n: n(), node)
        wanted = _as_list(node.where(_specs_of(restored)))
        try:
            given = _as_list(node.get(_specs_of(node.pytree)))
        except Exception:  # noqa: BLE001 - a transforming `get`: nothing to compare
            continue
        for dest, source in zip(wanted, given):
            if isinstance(source, P) and isinstance(dest, P) and dest != source:
                raise ValueError(
                    f"{path_str(path)}: eqx.nn.Shared ties a weight its layer shards "
                    f"{dest} to an array sharded {source}; tied weights need one layout "
                    "(a vocabulary-parallel table, Row(), ties to a Column() LM head).")


def validate(model, mesh, *, relaxed: bool = False) -> tuple[Any, list]:
    """Check `model`'s specs against `mesh`; return `(model, dropped)`.

    Every axis a layer uses must be in the mesh, and every sharded dimension must divide
    by the product of its axes' sizes; otherwise a `ValueError` names the parameter path,
    dimension, size and axes. With `relaxed=True` a layer whose dimension does not divide
    loses that style instead (its dimension is replicated; a layer left with no style
    becomes an `eqx.nn.Linear` with the same weights), and `dropped` lists each `Drop`.
    """
    sizes = mesh_sizes(mesh)
    dropped: list = []
    check_ties(model)

    def one(path, x):
        if not is_layer(x):
            return x
        where = layer_name(path, x)
        for a in x.rule.axes:
            if a not in sizes:
                raise ValueError(f"{where}: mesh axis {a!r} is not in the mesh, whose axes "
                                 f"are {tuple(sizes)}.")
        if relaxed and (is_param(x.weight) or is_quantized(x.weight)):  # tied: its source's
            rule, drops = x.rule.relax(where, x.weight.shape[-2:], sizes)
            if drops:
                dropped.extend(drops)
                x = x.with_rule(rule)
                if not is_layer(x):
                    return x
        if hasattr(x, "in_features"):
            check_scalar(where, x.rule, x.in_features, x.out_features)
        specs = layer_param_specs(x, where)
        if is_quantized(x.weight):
            check_spec(f"{where}.weight", x.weight.shape, specs.weight.values, sizes)
            check_spec(f"{where}.weight.scales", x.weight.scales.shape,
                       specs.weight.scales, sizes)
        elif is_param(x.weight):  # else tied: checked where its array is stored
            shape = x.weight.shape
            check_spec(f"{where}.weight", shape, specs.weight, sizes,
                       vocab_dim=len(shape) - 2 if isinstance(x.rule, TableRule) else None)
        if getattr(x, "bias", None) is not None:
            check_spec(f"{where}.bias", x.bias.shape, specs.bias, sizes)
        return x

    model = jax.tree_util.tree_map_with_path(one, model, is_leaf=is_layer)
    return model, dropped


def pad_vocab_hint(vocab: int, n: int) -> str:
    """How to make a vocabulary of `vocab` entries shard over `n` devices."""
    padded = -(-vocab // n) * n
    return (f"pad the vocabulary to a multiple of {n} (e.g. {padded}: the embedding's "
            f"num_embeddings and the LM head's out_features), and pass "
            f"vocab_size={vocab} to fusedpar.cross_entropy so the padding gets no "
            "probability")


def with_other_axes(current: P, x_spec: P, y_spec: P, used: tuple) -> tuple[P, P]:
    """`(x_spec, y_spec)` plus the axes of `current` (the input's layout) the layer does not
    use, on the leading dimensions whose layout the layer keeps from input to output.

    Those are the dimensions unsharded in both specs other than the features, and the
    FSDP batch dimension (the other axes go before the FSDP axis there). So, e.g., a
    data-parallel axis on the batch dimension survives a tensor-parallel layer.
    """
    xs, ys = list(x_spec), list(y_spec)
    for d in range(len(xs) - 1):
        if d >= len(current) or xs[d] != ys[d]:
            continue
        keep = tuple(a for a in _axes_of(current[d]) if a not in used)
        if keep:
            axes = keep + _axes_of(xs[d])
            xs[d] = ys[d] = axes[0] if len(axes) == 1 else axes
    return P(*xs), P(*ys)


def with_unknown_axes(shape, x_spec: P, y_spec: P, others: tuple, sizes: dict) -> tuple[P, P]:
    """`(x_spec, y_spec)` plus the mesh axes `others` (names, in mesh order) for an input
    whose layout over them is unknown (Auto axes keep it out of the array's type).

    They go where a data-parallel batch is laid out: on dim 0, when the layer keeps that
    dimension from input to output (`with_other_axes`) and its length divides by every
    axis on it; as many of them as divide, in mesh order, the rest replicated.
    """
    axes = [a for a in others if sizes[a] > 1]
    while axes:
        xs, ys = with_other_axes(P(tuple(axes)), x_spec, y_spec, ())
        if xs == x_spec:  # dim 0 is not kept: nowhere to carry them
            break
        if shape[0] % _product(_axes_of(xs[0]), sizes) == 0:
            return xs, ys
        axes.pop()
    return x_spec, y_spec


def axis_dims(spec: P, axes) -> dict:
    """`{axis: the dimension of spec it shards}` for those of `axes` in `spec`."""
    return {a: d for d, e in enumerate(spec) for a in _axes_of(e) if a in axes}


def layout_axes(rule: Rule, x_spec: P) -> list:
    """The mesh axes whose varying-axes type inside shard_map says whether an input fits
    `x_spec`: the tensor-parallel axis (the input varies over it exactly when `x_spec`
    names it), and the FSDP axis when it shards the batch. An FSDP axis that does not
    (an input without a batch dimension) says nothing about the input."""
    axes = [rule.tp.axis] if rule.tp is not None else []
    if rule.fsdp is not None and rule.fsdp.axis in tuple(x_spec):
        axes.append(rule.fsdp.axis)
    return axes


def has_data_dim(rule: Rule, ndim: int) -> bool:
    """Whether an input of rank `ndim` has a batch dimension for the FSDP axis.

    Dim 0, when it is neither the feature dimension nor the sequence dimension (dim -2)
    of a sequence-parallel layer.
    """
    return rule.fsdp is not None and ndim >= 2 + rule.sequence_parallel
