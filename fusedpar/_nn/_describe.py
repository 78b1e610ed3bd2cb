"""`describe(model)`: what each linear layer and embedding of a model became, as a table."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np

from .._sharding import _specs


def _style(rule) -> str:
    parts = []
    tp = rule.tp
    if tp is not None:
        flags = [name for name in ("sequence_parallel", "gather_output")
                 if getattr(tp, name, False)] + ([] if tp.keep_gathered else
                                                 ["keep_gathered=False"])
        parts.append(f"{type(tp).__name__}({', '.join([repr(tp.axis)] + flags + _comm(tp))})")
    if rule.fsdp is not None:
        gather = [] if rule.fsdp.gather == "auto" else [f"gather={rule.fsdp.gather!r}"]
        parts.append(f"FSDP({', '.join([repr(rule.fsdp.axis)] + _comm(rule.fsdp) + gather)})")
    return " + ".join(parts)


def _comm(style) -> list:
    return [f"{name}={np.dtype(d).name}" for name in ("comm_dtype", "grad_comm_dtype",
                                                       "reduce_dtype")
            if (d := getattr(style, name, None)) is not None]


def _quantized(w) -> str:
    """How a QuantizedArray weight is stored, e.g. `int8 (one scale per row)`."""
    per = ("one scale per row" if w.scales.shape[w.axis] == 1
           else f"one scale per {w.block_size} elements of a row")
    master = ", with master" if w.master is not None else ""
    return f"{np.dtype(w.values.dtype).name} ({per}{master}) "


def _params(specs, layer=None, where="") -> str:
    out = []
    for name, spec in specs.items():
        if spec is None and name == "weight" and layer is not None:
            # A weight tied by eqx.nn.Shared is a placeholder here, stored where it is
            # tied to, with the spec its own rule gives it (`check_ties` makes them agree).
            tied = layer.rule.param_specs(where, getattr(layer, "bias", None) is not None)[
                "weight"]
            out.append(f"weight tied (eqx.nn.Shared) {tied}")
        if spec is None:
            continue
        w = getattr(layer, name, None)
        if _specs.is_quantized(w):
            out.append(f"{name} {_quantized(w)}{spec.values}, scales {spec.scales}")
        else:
            out.append(f"{name} {spec}")
    return ", ".join(out)


def _param_specs(layer, where) -> dict:
    specs = _specs.layer_param_specs(layer, where)
    return {name: getattr(specs, name, None) for name in _specs.PARAM_RANK}


def _row(path, x) -> list:
    where = _specs.path_str(path)
    if _specs.is_layer(x):
        fwd, bwd = x.collectives()
        return [where, type(x).__name__, _style(x.rule),
                _params(_param_specs(x, where), x, where),
                getattr(x, "backend", "-"), "; ".join(fwd) or "-", "; ".join(bwd) or "-"]
    names = ["weight"] + (["bias"] if getattr(x, "bias", None) is not None else [])
    stored = [getattr(x, n) for n in names]
    params = ", ".join(f"{n} {_quantized(a) if _specs.is_quantized(a) else ''}P()"
                       for n, a in zip(names, stored))
    return [where, type(x).__name__, "replicated", params,
            "-", "-", "-"]


def _is_target(x) -> bool:
    return _specs.is_layer(x) or isinstance(x, (eqx.nn.Linear, eqx.nn.Embedding))


def describe(model) -> str:
    """A table of every linear layer and embedding of `model` and what it became.

    One row per `eqx.nn.Linear`, `eqx.nn.Embedding` or fusedpar layer, in pytree
    order: its path, class, style (the sharding rule), parameter specs, backend, and
    the collectives its forward and backward passes run (W: the weight; x, y, dy: the
    input, output and output cotangent; "(seq)": along the sequence dimension; "in
    int8": the dtype a `comm_dtype` sends). A `QuantizedArray` weight shows its dtype
    and scale layout, and the specs of its values and scales. A
    layer left dense is "replicated" and runs none. Print it, e.g.
    `print(fusedpar.describe(fusedpar.parallelize(model, plan)))`.
    """
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_target)[0]
    rows = [_row(p, x) for p, x in leaves if _is_target(x)]
    head = ["path", "layer", "style", "parameters", "backend", "forward", "backward"]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])
