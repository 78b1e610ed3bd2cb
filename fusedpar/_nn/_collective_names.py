"""What `fusedpar.describe` says a linear layer sends: its collectives, forward and
backward, each with the dtype it travels in where that is narrower than the data's."""

from __future__ import annotations

import jax.numpy as jnp

from .._core._quantized_array import QuantizedArray
from .._sharding._styles import FSDP, Row
from ._fsdp_gather import gathered_whole


def _in(layer, style, name) -> str:
    """" in int8" where the collective of `style` sends a narrow dtype (its `name`, or
    the FSDP gather of a stored QuantizedArray weight), else ""."""
    if style is None:
        return ""
    d = getattr(style, name)
    w = layer.weight
    if name == "comm_dtype" and isinstance(style, FSDP) and isinstance(w, QuantizedArray):
        d = w.values.dtype
    return "" if d is None else f" in {jnp.dtype(d).name}"


def _backward(layer, bwd) -> list:
    """`bwd` without the weight gradient's collectives where the weight gets none: one
    stored quantized without a master serves (no gradient reaches its values)."""
    w = layer.weight
    if isinstance(w, QuantizedArray) and w.master is None:
        bwd = [c for c in bwd if "dW" not in c]
    return bwd + _bias_grad_sum(layer)


def _bias_grad_sum(layer) -> list:
    """A bias is added to every shard of an output sharded along the batch (FSDP) or the
    sequence (a sequence-parallel RowLinear), so its gradient is summed over those axes."""
    rule = layer.rule
    axes = [rule.fsdp.axis] if rule.fsdp is not None else []
    if isinstance(rule.tp, Row) and rule.tp.sequence_parallel:
        axes.append(rule.tp.axis)
    return [f"psum db over {', '.join(axes)}"] if axes and layer.bias is not None else []


def _by_activations(layer, tp_fwd, tp_bwd) -> tuple[list, list]:
    """FSDP(gather="activations"): the tokens of the FSDP peers come to the weight
    (`fusedpar._nn._fsdp_activations`); the weight gradient stays on its shard.
    `tp_fwd`, `tp_bwd`: the tensor-parallel collective of each pass (None: none)."""
    f = layer.rule.fsdp
    if layer.rule.fsdp_dim == 1:  # the contracting features: partial sums
        fwd = [f"all_to_all x over {f.axis}", tp_fwd, f"reduce_scatter y(batch) over {f.axis}"]
        bwd = [f"all_gather dy(batch) over {f.axis}", tp_bwd, f"all_to_all dx over {f.axis}"]
    else:
        fwd = [f"all_gather x(batch) over {f.axis}", tp_fwd, f"all_to_all y over {f.axis}"]
        bwd = [f"all_to_all dy over {f.axis}", tp_bwd, f"reduce_scatter dx(batch) over {f.axis}"]
    tp = layer.rule.tp
    if tp_bwd and not tp.keep_gathered:  # the weight gradient's own gather
        bwd.insert(bwd.index(tp_bwd) + 1, _gathered_again(
            "x" if tp_fwd.startswith("all_gather") else "dy", layer, tp))
    return [c for c in fwd if c], [c for c in bwd if c]  # (None: no tp collective)


def _weight_gather(layer, fw) -> str:
    """The FSDP gather of the weight beside a matmul (`fsdp_matmul`): overlapped with it,
    or, for a weight it gathers whole first (`gathered_whole`), before it."""
    f = layer.rule.fsdp
    op = "all_gather" if gathered_whole(layer.weight) else "all_gather_matmul"
    return f"{op} W over {f.axis}{fw}"


def _weight_grad(layer, fg) -> str:
    """The weight gradient's FSDP reduce-scatter beside a matmul (`fsdp_matmul`), or, for
    a weight gathered whole (`gathered_whole`, its master's gradient), after it."""
    f = layer.rule.fsdp
    if gathered_whole(layer.weight):
        return f"reduce_scatter dW over {f.axis}"
    return f"matmul_reduce_scatter dW over {f.axis}{fg}"


def _gathered_again(name, layer, tp) -> str:
    """The second gather of a `keep_gathered=False` style: the weight gradient's ring
    over `name` (the op's backward without the kept operand)."""
    return (f"all_gather_matmul {name}(seq) again over {tp.axis}"
            f"{_in(layer, tp, 'grad_comm_dtype')} for dW")


def column(layer) -> tuple[list, list]:
    """A `ColumnLinear`'s collectives: `(forward, backward)`."""
    tp, f = layer.rule.tp, layer.rule.fsdp
    fw, fg = _in(layer, f, "comm_dtype"), _in(layer, f, "grad_comm_dtype")
    fwd, bwd = [], []
    if f is not None and f.gather == "activations":
        fwd, bwd = _by_activations(layer, *(
            (f"all_gather_matmul x(seq) over {tp.axis}{_in(layer, tp, 'comm_dtype')}",
             f"matmul_reduce_scatter dx(seq) over {tp.axis}"
             f"{_in(layer, tp, 'grad_comm_dtype')}") if tp.sequence_parallel
            else (None, f"psum dx over {tp.axis}")))
    elif tp.sequence_parallel:
        fwd += [f"all_gather W over {f.axis}{fw}"] if f else []
        fwd.append(f"all_gather_matmul x(seq) over {tp.axis}{_in(layer, tp, 'comm_dtype')}")
        bwd.append(f"matmul_reduce_scatter dx(seq) over {tp.axis}"
                   f"{_in(layer, tp, 'grad_comm_dtype')}")
        bwd += [] if tp.keep_gathered else [_gathered_again("x", layer, tp)]
        bwd += [f"reduce_scatter dW over {f.axis}"] if f else []
    else:
        fwd += [_weight_gather(layer, fw)] if f else []
        bwd += [_weight_grad(layer, fg)] if f else []
        bwd.append(f"psum dx over {tp.axis}")
    fwd += [f"all_gather y over {tp.axis}"] if tp.gather_output else []
    return fwd, _backward(layer, bwd)


def row(layer) -> tuple[list, list]:
    """A `RowLinear`'s collectives: `(forward, backward)`."""
    tp, f = layer.rule.tp, layer.rule.fsdp
    fw, fg = _in(layer, f, "comm_dtype"), _in(layer, f, "grad_comm_dtype")
    if f is not None and f.gather == "activations":
        fwd, bwd = _by_activations(layer, *(
            (f"matmul_reduce_scatter y(seq) over {tp.axis}{_in(layer, tp, 'comm_dtype')}",
             f"all_gather_matmul dy(seq) over {tp.axis}{_in(layer, tp, 'grad_comm_dtype')}")
            if tp.sequence_parallel else (f"psum y over {tp.axis}", None)))
    elif tp.sequence_parallel:
        fwd = ([f"all_gather W over {f.axis}{fw}"] if f else []) + [
            f"matmul_reduce_scatter y(seq) over {tp.axis}{_in(layer, tp, 'comm_dtype')}"]
        bwd = [f"all_gather_matmul dy(seq) over {tp.axis}"
               f"{_in(layer, tp, 'grad_comm_dtype')}"] + (
            [] if tp.keep_gathered else [_gathered_again("dy", layer, tp)]) + (
            [f"reduce_scatter dW over {f.axis}"] if f else [])
    else:
        fwd = ([_weight_gather(layer, fw)] if f else []) + [f"psum y over {tp.axis}"]
        bwd = [_weight_grad(layer, fg)] if f else []
    return fwd, _backward(layer, bwd)


def fsdp(layer) -> tuple[list, list]:
    """An `FSDPLinear`'s collectives: `(forward, backward)`."""
    f = layer.rule.fsdp
    if f.gather == "activations":
        fwd, bwd = _by_activations(layer, None, None)
        return fwd, _backward(layer, bwd)
    return ([_weight_gather(layer, _in(layer, f, "comm_dtype"))],
            _backward(layer, [_weight_grad(layer, _in(layer, f, "grad_comm_dtype"))]))
