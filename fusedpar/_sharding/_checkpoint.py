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
import jax.numpy as jnp
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
    stored = _stored_dtype(value.dtype, np.dtype(like.dtype))
    if value.shape != tuple(like.shape):
        raise ValueError(f"deserialise_filter_spec: the checkpoint holds an array of shape "
                         f"{value.shape} where the skeleton has {tuple(like.shape)} "
                         f"({like.dtype}); restore it into the model it was saved from.")
    if stored != np.dtype(like.dtype):
        raw = stored == value.dtype and stored.kind == "V"  # bytes no dtype was read from
        saved = (f"a {stored.itemsize}-byte dtype NumPy does not know (a float8 or int4)"
                 if raw else f"{'an' if stored.name[0] in 'aeiou' else 'a'} {stored.name}")
        # One byte a parameter where the skeleton has a float: the values of a quantized
        # weight (`fusedpar.quantize`), whose skeleton is quantized too.
        quantized = (stored.itemsize == 1 and np.dtype(like.dtype).itemsize > 1
                     and jnp.issubdtype(like.dtype, jnp.floating))
        # The other way round: a float checkpoint where the skeleton is quantized (its
        # values one byte), which no cast makes.
        unquantized = (np.dtype(like.dtype).itemsize == 1 and stored.itemsize > 1
                       and jnp.issubdtype(stored, jnp.floating))  # bfloat16's kind is "V"
        fix = ("build the skeleton of the quantized model: fusedpar.quantize(...) of the "
               "model inside eqx.filter_eval_shape, as it was saved" if quantized else
               "the checkpoint is of the model before fusedpar.quantize: restore it into "
               "a skeleton of that model and quantize the restored model" if unquantized
               else "build the skeleton in the dtype it was saved in and cast the restored "
               "model after")
        raise ValueError(
            f"deserialise_filter_spec: the checkpoint holds {saved} array of shape "
            f"{value.shape} where the skeleton has {like.dtype}"
            + (" (a quantized weight's values?)" if quantized else "") + f"; {fix}.")
    return jax.device_put(value.view(stored), sharding)


def _stored_dtype(loaded: np.dtype, like: np.dtype) -> np.dtype:
    """The dtype an array was saved in, from the dtype `np.load` gives it.

    `jnp.save` writes a dtype NumPy does not know as raw bytes, which `np.load` reads
    back as void: two bytes are bfloat16 (what `jnp.load` assumes; float16 is NumPy's
    own), one byte a float8 or int4, which the file does not tell apart: the
    skeleton's, where it is one of those. Equinox's own reader then checks the dtype; read
    as the skeleton's bytes, a bfloat16 checkpoint restored into a float16 skeleton came
    back as nonsense weights without a word."""
    if loaded.kind != "V":
        return loaded
    if loaded.itemsize == 2:
        return np.dtype(jnp.bfloat16)
    if loaded.itemsize == 1 and like.itemsize == 1 and like.kind == "V":
        return like  # ml_dtypes' float8s and int4 are kind "V" to NumPy
    return loaded
