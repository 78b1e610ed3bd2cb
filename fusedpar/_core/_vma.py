"""Varying-manual-axes bookkeeping for code inside `shard_map(check_vma=True)`.

Inside shard_map JAX types each value as varying or invariant over each manual axis.
Two places need to care: fresh arrays carried through `fori_loop` (zeros are invariant,
the loop body's output is varying), and custom_vjp cotangents of invariant inputs (a
replicated weight used on every device gets the sum of every device's cotangent, which
is what JAX's autodiff gives by transposing its implicit `pvary`). With
check_vma=False nothing is typed and these helpers do nothing.
"""

from __future__ import annotations

from jax import lax


def varying_axes(x) -> frozenset:
    """Mesh axes along which `x` varies (empty outside shard_map or with check_vma=False)."""
    aval = x.aval if hasattr(x, "aval") else x
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10 spelling
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # earlier spelling


def axis_names(axis_name) -> tuple:
    """The mesh axes an `axis_name` argument names (a name, or a tuple of names)."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _names(axes):
    return tuple(sorted(axes, key=str))


def as_varying(init, axes):
    """`init` typed as varying over `axes` too (for fori_loop carries)."""
    missing = _names(set(axes) - varying_axes(init))
    return lax.pcast(init, missing, to="varying") if missing else init


def cotangent_like(ct, primal):
    """Sum `ct` over the axes it varies on but `primal` does not (implicit-broadcast transpose)."""
    extra = _names(varying_axes(ct) - varying_axes(primal))
    return lax.psum(ct, extra) if extra else ct


def typed(axis) -> bool:
    """Whether the enclosing shard_map types values as varying or invariant over `axis`
    (check_vma=True): `axis_index` varies over its axis exactly when it does."""
    return axis in varying_axes(lax.axis_index(axis))


def checked(axis_name) -> bool:
    """Whether the enclosing shard_map checks varying axes (check_vma=True, its default)
    over any of `axis_name`'s axes."""
    return any(typed(a) for a in axis_names(axis_name))


def invariant(x, axis_name) -> bool:
    """Whether JAX's varying-axes type proves `x` the same on every device of
    `axis_name` (a name or a tuple): inside `shard_map(check_vma=True)`, `x` varies over
    none of those axes. False wherever nothing is typed (check_vma=False): never a guess."""
    return all(typed(a) and a not in varying_axes(x) for a in axis_names(axis_name))


def check_layout(where: str, what: str, x, spec, axes, explain: str) -> None:
    """Raise unless `x` varies over the `axes` named in `spec` and is invariant over the
    other `axes`, wherever the enclosing shard_map types them (with check_vma=False JAX
    says nothing and nothing is checked). `explain` says which layout or style to use."""
    named = {a for e in spec for a in axis_names(e) if e is not None}
    varying = varying_axes(x)
    for a in axes:
        if (a in named) != (a in varying) and typed(a):
            how = ("sharded over mesh axis {!r} (it varies over it)" if a in varying else
                   "replicated over mesh axis {!r} (it is invariant over it)").format(a)
            raise ValueError(
                f"{where}: inside shard_map the varying-axes type of {what} says {how}, but "
                f"the layer expects {what} laid out as {spec}: {explain}.")
