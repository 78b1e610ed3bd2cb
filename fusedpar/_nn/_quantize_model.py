"""`fusedpar.quantize(model, where, dtype)`: a model's linear weights as `QuantizedArray`s."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core import _validate
from .._sharding import _specs
from .._core._quantized_array import QuantizedArray
from ._layer_checks import check_stored_comm


def _is_linear(x) -> bool:
    return isinstance(x, eqx.nn.Linear) or (_specs.is_layer(x) and hasattr(x, "in_features"))


def _is_embedding(x) -> bool:
    return isinstance(x, eqx.nn.Embedding) or (_specs.is_layer(x) and
                                               hasattr(x, "num_embeddings"))


def _is_layer(x) -> bool:
    return _is_linear(x) or _is_embedding(x)


def quantize(model, where: Union[None, Mapping, Callable] = None, *, dtype=jnp.int8,
             block_size: Optional[int] = None, master: bool = False):
    """`model` with the weights of its linear layers quantized (`QuantizedArray`).

    **Arguments:**

    - `model`: any pytree with `eqx.nn.Linear` or fusedpar linear layers.
    - `where`: which layers: None (every linear layer); a plan, `{pattern: ...}`, whose
      `fnmatch` patterns select layers by dotted path as `fusedpar.parallelize`'s do
      (the values are ignored, so the plan that parallelizes a model can quantize it:
      each pattern must match a linear layer or an embedding, whose table stays as it
      is); or a callable `(path, layer) -> bool`.
    - `dtype`: `jnp.int8` or `jnp.float8_e4m3fn`. `block_size`: one scale per that many
      input features (None: one per output channel, what a layer can send round a ring).
    - `master`: keep each full-precision weight in its QuantizedArray: gradients then
      reach it straight through the quantization (call this inside the loss).

    **Returns:** the model, each selected weight `(..., out, in)` a QuantizedArray of
    the same shape scaled along `in`. Under `quax.quaxify` the model's matmuls use the
    quantized values; fusedpar layers send them round their rings as they are.
    """
    if where is not None and not (isinstance(where, Mapping) or callable(where)):
        raise TypeError(f"quantize: where must be None, a plan {{pattern: style}} or a "
                        f"callable (path, layer) -> bool, got {type(where).__name__}.")
    if isinstance(where, Mapping):
        _specs.check_patterns("quantize", "where", where)
    _validate.boolean("quantize", "master", master)
    used = set()

    def chosen(path, layer) -> bool:
        name = _specs.path_str(path)
        if isinstance(where, Mapping):  # a plan's patterns may name embeddings too
            hits = [p for p in where if fnmatch.fnmatchcase(name, p)]
            used.update(hits)
            return bool(hits) and _is_linear(layer)
        if _is_embedding(layer):  # its table stays as it is: looked up, not multiplied
            return False
        return where is None or bool(where(name, layer))

    def one(path, x):
        if not _is_layer(x) or not chosen(path, x):
            return x
        w = x.weight
        if isinstance(w, QuantizedArray):
            raise ValueError(f"quantize: {_specs.path_str(path)}.weight is already "
                             "quantized.")
        if not eqx.is_inexact_array(w):  # e.g. the placeholder of an eqx.nn.Shared tie
            raise ValueError(
                f"quantize: {_specs.path_str(path)}.weight is a {type(w).__name__}, not a "
                "floating array (a weight tied to another, e.g. by eqx.nn.Shared, is a "
                "placeholder there); leave the layer out with where=, e.g. where=lambda "
                f"path, layer: path != {_specs.path_str(path)!r}.")
        q = QuantizedArray.quantize(w, dtype, axis=-1, block_size=block_size, master=master)
        # The FSDP gather sends the values' dtype, a master quantized to it too.
        check_stored_comm(f"quantize: {_specs.path_str(path)}", q, getattr(x, "rule", None))
        return eqx.tree_at(lambda l: l.weight, x, q)

    out = jax.tree_util.tree_map_with_path(one, model, is_leaf=_is_layer)
    if isinstance(where, Mapping):
        unused = [p for p in where if p not in used]
        if unused:
            leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
            names = [_specs.path_str(p) for p, x in leaves if _is_layer(x)]
            raise ValueError(f"quantize: plan pattern(s) {unused} matched no linear layer "
                             f"or embedding; the model's are {names}.")
    return out
