"""The type of a kernel's result inside `jax.shard_map(check_vma=True)`."""

from __future__ import annotations

import jax


def result_type(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
    """`ShapeDtypeStruct` varying over every mesh axis any operand varies over.

    Inside `shard_map(check_vma=True)` a `pallas_call` must be told how its result varies
    (JAX cannot see through the kernel); outside it, or with `check_vma=False`, nothing
    varies and this is a plain `ShapeDtypeStruct`.
    """
    varying = frozenset()
    for o in operands:
        mat = getattr(getattr(o, "aval", None), "manual_axis_type", None)
        if mat is not None:
            varying |= frozenset(mat.varying)
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
