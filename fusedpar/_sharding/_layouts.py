"""An activation's layout through a layer: the mesh axes the layer does not use.

A layer's activation specs name only its own axes; these carry the input's other axes
(a data-parallel batch, say) through to the output, and say which axes an input's
varying-axes type must show inside `shard_map`.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from ._rules import Rule, axes_of, axes_product, has_data_dim as has_data_dim


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
        keep = tuple(a for a in axes_of(current[d]) if a not in used)
        if keep:
            axes = keep + axes_of(xs[d])
            xs[d] = ys[d] = axes[0] if len(axes) == 1 else axes
    return P(*xs), P(*ys)


def with_unknown_axes(shape, x_spec: P, y_spec: P, others: tuple, sizes: dict,
                      order: tuple = ()) -> tuple[P, P]:
    """`(x_spec, y_spec)` plus the mesh axes `others` (names, in mesh order) for an input
    whose layout over them is unknown (Auto axes keep it out of the array's type).

    They go where a data-parallel batch is laid out: on dim 0, when the layer keeps that
    dimension from input to output (`with_other_axes`) and its length divides by every
    axis on it; as many of them as divide, in mesh order, the rest replicated.

    `order`: the mesh's axis names. Dim 0's axes (these and an FSDP axis already there)
    are then put in the mesh's order, so that dim 0 tiles the devices in the mesh's own
    order, as every other layout on that mesh does: GSPMD reshards between such layouts
    with all-to-alls and gathers. Other axes put before an FSDP axis that comes first in
    the mesh (an FSDP-only layer on an ("fsdp", "tp") mesh: P(("tp", "fsdp"))) tile the
    devices transposed, and GSPMD can only reach the next layer's layout from there by
    replicating the array ("Involuntary full rematerialization").
    """
    axes = [a for a in others if sizes[a] > 1]
    while axes:
        xs, ys = with_other_axes(P(tuple(axes)), x_spec, y_spec, ())
        if xs == x_spec:  # dim 0 is not kept: nowhere to carry them
            break
        if shape[0] % axes_product(axes_of(xs[0]), sizes) == 0:
            return _in_order(xs, order), _in_order(ys, order)
        axes.pop()
    return x_spec, y_spec


def _in_order(spec: P, order: tuple) -> P:
    """`spec` with the axes of its dim 0 in the order of `order` (those it names)."""
    dim0 = axes_of(spec[0])
    if len(dim0) < 2 or not all(a in order for a in dim0):
        return spec
    dim0 = tuple(sorted(dim0, key=order.index))
    return P(dim0, *tuple(spec)[1:])


def axis_dims(spec: P, axes) -> dict:
    """`{axis: the dimension of spec it shards}` for those of `axes` in `spec`."""
    return {a: d for d, e in enumerate(spec) for a in axes_of(e) if a in axes}


def layout_axes(rule: Rule, x_spec: P) -> list:
    """The mesh axes whose varying-axes type inside shard_map says whether an input fits
    `x_spec`: the tensor-parallel axis (the input varies over it exactly when `x_spec`
    names it), and the FSDP axis when it shards the batch. An FSDP axis that does not
    (an input without a batch dimension) says nothing about the input."""
    axes = [rule.tp.axis] if rule.tp is not None else []
    if rule.fsdp is not None and rule.fsdp.axis in tuple(x_spec):
        axes.append(rule.fsdp.axis)
    return axes
