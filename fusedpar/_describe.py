"""`describe(model)`: what each linear layer and embedding of a model became, as a table."""

from __future__ import annotations

import equinox as eqx
import jax

from . import _specs


def _style(rule) -> str:
    parts = []
    tp = rule.tp
    if tp is not None:
        flags = [name for name in ("sequence_parallel", "gather_output")
                 if getattr(tp, name, False)]
        parts.append(f"{type(tp).__name__}({', '.join([repr(tp.axis)] + flags)})")
    if rule.fsdp is not None:
        parts.append(f"FSDP({rule.fsdp.axis!r})")
    return " + ".join(parts)


def _params(specs) -> str:
    return ", ".join(f"{name} {spec}" for name, spec in specs.items() if spec is not None)


def _param_specs(layer, where) -> dict:
    specs = _specs.layer_param_specs(layer, where)
    return {name: getattr(specs, name, None) for name in _specs.PARAM_RANK}


def _row(path, x) -> list:
    where = _specs.path_str(path)
    if _specs.is_layer(x):
        fwd, bwd = x.collectives()
        return [where, type(x).__name__, _style(x.rule),
                _params(_param_specs(x, where)),
                getattr(x, "backend", "-"), "; ".join(fwd) or "-", "; ".join(bwd) or "-"]
    names = ["weight"] + (["bias"] if getattr(x, "bias", None) is not None else [])
    return [where, type(x).__name__, "replicated", ", ".join(f"{n} P()" for n in names),
            "-", "-", "-"]


def _is_target(x) -> bool:
    return _specs.is_layer(x) or isinstance(x, (eqx.nn.Linear, eqx.nn.Embedding))


def describe(model) -> str:
    """A table of every linear layer and embedding of `model` and what it became.

    One row per `eqx.nn.Linear`, `eqx.nn.Embedding` or fusedpar layer, in pytree
    order: its path, class, style (the sharding rule), parameter specs, backend, and
    the collectives its forward and backward passes run (W: the weight; x, y, dy: the
    input, output and output cotangent; "(seq)": along the sequence dimension). A
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
