"""Restoring an Equinox checkpoint into a sharded model: each array where its layer's spec
puts it.

`eqx.tree_deserialise_leaves(path, like)` reads every array with `jnp.load`, onto one
device, whatever `like`'s arrays are: a model restored into a skeleton placed by
`fusedpar.shard` came back unsharded (replicated under `jax.set_mesh`), each device
holding every parameter. `deserialise_filter_spec` is Equinox's extension point for
that read: each array goes where the skeleton's leaf says (docs/checkpoints.md).
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding


def deserialise_filter_spec(f, like):
    """A `filter_spec` for `eqx.tree_deserialise_leaves` that restores each array with the
    sharding of its leaf in the skeleton `like`, e.g.

        skeleton = fusedpar.shard(eqx.filter_eval_shape(make_model, key), mesh)
        model = eqx.tree_deserialise_leaves(path, skeleton,
                                            filter_spec=fusedpar.deserialise_filter_spec)

    **Arguments:** `f`, the open checkpoint; `like`, the skeleton's leaf: an array or a
    `jax.ShapeDtypeStruct` with a `NamedSharding` (from `fusedpar.shard`) is read on the
    host and sent to the devices that hold it, each its shard, never whole to one device;
    any other leaf is read as `eqx.default_deserialise_filter_spec` reads it.

    **Returns:** the restored leaf. Raises a `ValueError` when the stored array's shape
    differs from the leaf's (a checkpoint of another model).
    """
    sharding = getattr(like, "sharding", None)
    if not (isinstance(like, (jax.Array, jax.ShapeDtypeStruct))
            and isinstance(sharding, NamedSharding)):
        return eqx.default_deserialise_filter_spec(f, like)
    value = np.load(f)
    if value.dtype.kind == "V" and value.dtype.itemsize == np.dtype(like.dtype).itemsize:
        # `jnp.save` writes a dtype NumPy does not know (bfloat16, the float8s) as raw
        # bytes, which `np.load` reads back as void: they are the skeleton's dtype.
        value = value.view(like.dtype)
    if value.shape != tuple(like.shape):
        raise ValueError(f"deserialise_filter_spec: the checkpoint holds an array of shape "
                         f"{value.shape} where the skeleton has {tuple(like.shape)} "
                         f"({like.dtype}); restore it into the model it was saved from.")
    return jax.device_put(value, sharding)
