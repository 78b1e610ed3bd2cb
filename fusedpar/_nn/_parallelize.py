"""Rewriting the `eqx.nn.Linear` and `eqx.nn.Embedding` leaves of a model into fusedpar
layers by a plan."""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping

import equinox as eqx
import jax

from .._sharding import _specs
from ._embedding import Embedding
from ._layer_checks import check_stored_comm
from ._layers import ParallelLinear, layer_class

_NAMES = {"column": _specs.Column, "row": _specs.Row, "fsdp": _specs.FSDP}


def _style(pattern, s):
    if isinstance(s, str):
        if s not in _NAMES:
            raise ValueError(f"parallelize: plan[{pattern!r}] = {s!r} is not a style; use "
                             f"{', '.join(map(repr, _NAMES))} or fusedpar.Column/Row/FSDP.")
        return _NAMES[s]()
    if not isinstance(s, (_specs.Column, _specs.Row, _specs.FSDP)):
        raise TypeError(f"parallelize: plan[{pattern!r}] must be a style or a tuple of "
                        f"styles, got {s!r}.")
    return s


def _compose(styles, matched, plan, where):
    """The rule of the styles the patterns `matched` give `where`. Where they conflict
    only together, the message names the patterns: every match contributes (no "most
    specific wins"), which a user of other frameworks may not expect."""
    try:
        return _specs.compose(*styles, where=where)
    except ValueError as e:
        if len(matched) < 2:
            raise
        for p in matched:  # one pattern's own styles conflict: its error alone
            _specs.compose(*plan[p], where=where)
        raise ValueError(f"{e} The plan's patterns {matched} all match {where!r} and every "
                         "match contributes its styles; where a glob's styles were not "
                         "meant for it, narrow that glob (an fnmatch class such as "
                         "'[qkv]*_proj' for '*_proj').") from None


def parallelize(model, plan: dict, *, backend: str = "auto"):
    """`model` with its `eqx.nn.Linear` and `eqx.nn.Embedding` leaves replaced by fusedpar
    layers per `plan`.

    **Arguments:**

    - `model`: any pytree (e.g. a nested `eqx.Module`).
    - `plan`: `{pattern: style or tuple of styles}`. A pattern is an `fnmatch` glob on a
      layer's dotted path (`"blocks.0.mlp.up"`; list indices are path components, so
      `"blocks.*.mlp.up"` matches every block). A style is `fusedpar.Column(...)`,
      `fusedpar.Row(...)`, `fusedpar.FSDP(...)` or the strings `"column"`, `"row"`,
      `"fsdp"` (default arguments). Every pattern a path matches contributes its
      styles and they compose in any order (`"*": "fsdp"` with `"*.up": "column"` gives
      a `ColumnLinear` with FSDP); two different tensor-parallel styles on one layer are
      an error naming the path. On an embedding, `Row` shards the vocabulary (a
      `fusedpar.Embedding`) and `FSDP` the embedding dimension; `Column` is an error.
    - `backend`: the backend of the new linear layers.

    **Returns:** the model with the same weights. Each pattern must match at least one
    `eqx.nn.Linear` or `eqx.nn.Embedding`, or a fusedpar layer: a model already
    parallelized is re-planned (e.g. decoding one token at a time without the sequence
    parallelism it trained with): a fusedpar layer that a pattern matches takes that
    plan's styles in place of its own, one that none matches keeps its own (call
    `fusedpar.shard` again to lay the weights out for the new plan). A linear layer
    with `"scalar"` features whose styles would shard that dimension (of length 1)
    stays an `eqx.nn.Linear` with a warning when only globs match it (`"*"`), and is an
    error when a pattern is its path. `fusedpar.describe(model)` shows what each
    became.
    """
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize: plan must be a dict {{pattern: style}}, e.g. "
                        f"{{'blocks.*.up': 'column'}}, got {type(plan).__name__}.")
    _specs.check_patterns("parallelize", "plan", plan)
    plan = {p: tuple(_style(p, s) for s in (v if isinstance(v, tuple) else (v,)))
            for p, v in plan.items()}
    used, skipped = set(), []

    def is_target(x):
        # A fusedpar layer is re-planned: its weights under the plan's styles.
        return isinstance(x, (eqx.nn.Linear, ParallelLinear, eqx.nn.Embedding, Embedding))

    def one(path, x):
        if not is_target(x):
            return x
        where = _specs.path_str(path)
        styles, matched = [], []
        for pattern, s in plan.items():
            if fnmatch.fnmatchcase(where, pattern):
                used.add(pattern)
                matched.append(pattern)
                styles.extend(s)
        if not styles:
            return x
        rule = _compose(styles, matched, plan, where)
        if isinstance(x, (eqx.nn.Embedding, Embedding)):
            return Embedding.from_embedding(x, rule, where)
        try:
            _specs.check_scalar(f"parallelize: {where}", rule, x.in_features, x.out_features)
        except ValueError:
            # A glob ("*") means "every layer that can be": a "scalar" dimension cannot.
            # A pattern that names the layer exactly asked for the impossible: an error.
            if any(p == where for p in matched):
                raise
            skipped.append(where)
            return x
        # A weight stored quantized (`fusedpar.quantize` first) travels as it is: refused
        # here, where the plan is, not at the first call.
        check_stored_comm(f"parallelize: {where}", x.weight, rule)
        return layer_class(rule).from_linear(x, rule, backend)

    out = jax.tree_util.tree_map_with_path(one, model, is_leaf=is_target)
    if skipped:
        warnings.warn(f"parallelize: left {skipped} as eqx.nn.Linear: their plan patterns "
                      "would shard a 'scalar' feature dimension (of length 1); name the "
                      "paths in the plan to make this an error.", stacklevel=2)
    unused = [p for p in plan if p not in used]
    if unused:
        leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_target)[0]
        linear = [_specs.path_str(p) for p, x in leaves if is_target(x)
                  and not isinstance(x, (eqx.nn.Embedding, Embedding))]
        tables = [_specs.path_str(p) for p, x in leaves
                  if isinstance(x, (eqx.nn.Embedding, Embedding))]
        raise ValueError(f"parallelize: plan pattern(s) {unused} matched no eqx.nn.Linear"
                         + (" or eqx.nn.Embedding" if tables else "")
                         + f"; the model's linear layers are {linear}"
                         + (f" and its embeddings {tables}." if tables else "."))
    return out
