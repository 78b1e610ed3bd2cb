"""Drop-in replacements for `eqx.nn.Linear` that shard their weight over a mesh.

```python
import equinox as eqx, jax, jax.numpy as jnp
import fusedpar

k1, k2 = jax.random.split(jax.random.key(0))
# A transformer MLP block, sequence parallel over "tp" and FSDP over "fsdp".
up = fusedpar.ColumnLinear(64, 256, key=k1, sequence_parallel=True, fsdp_axis="fsdp")
down = fusedpar.RowLinear(256, 64, key=k2, sequence_parallel=True, fsdp_axis="fsdp")

mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
with jax.set_mesh(mesh):
    model = fusedpar.shard((up, down), mesh)             # weights placed per their specs
    x = jnp.ones((8, 32, 64))                            # (batch, seq, features)

    @eqx.filter_jit
    def loss(model, x):
        up, down = model
        return jnp.mean(down(jax.nn.gelu(up(x))) ** 2)

    grads = eqx.filter_grad(loss)(model, x)             # sharded like the weights
```

Each layer works in three contexts:

- inside `jax.shard_map` binding its axes: the weight and input are per-device shards
  (pass the layer through shard_map with `fusedpar.param_specs` / `shard_map_specs`)
  and the layer runs the collective matmul op on them;
- on global arrays under `jax.set_mesh(mesh)` (Auto or Explicit axes): the layer wraps
  itself in `shard_map` over its own axes with the specs of `fusedpar._specs`;
- with no mesh: the dense result, the same as `eqx.nn.Linear` with the same weights.

Inputs are `(in_features,)` or `(..., in_features)`; `jax.vmap(layer)(x) == layer(x)`.
The layouts (see `fusedpar._specs`): a sequence-parallel layer's sequence dimension is
dim -2 of the input; an FSDP layer shards the batch dimension (dim 0, when the input has
one besides the sequence and feature dimensions) over its FSDP axis; an FSDP layer given
an input without a batch dimension (e.g. one example under `jax.vmap`) in the global
context gathers its weight on entry and computes like its tensor-parallel part alone.
"""

from __future__ import annotations

import functools
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from equinox import field
from jax import lax
from jaxtyping import Array

from . import _backends, _context, _definition, _specs
from ._ops import all_gather_matmul
from ._specs import Rule


def _positive_int(where, name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {v!r}.")


def _check_backend(where, backend):
    valid = (_backends.AUTO,) + _backends.names()
    if backend not in valid:
        raise ValueError(f"{where}: unknown backend={backend!r}; valid backends are "
                         f"{', '.join(repr(n) for n in valid)}.")


def _new(cls, **fields):
    """An instance of the module `cls` with these fields, without running `__init__`."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


class ParallelLinear(eqx.Module):
    """What the fusedpar layers share: parameters, sharding rule, the three contexts.

    Subclasses implement `_local(x, rule)`, the per-device computation.
    """

    weight: Array
    bias: Optional[Array]
    in_features: int = field(static=True)
    out_features: int = field(static=True)
    use_bias: bool = field(static=True)
    rule: Rule = field(static=True)
    backend: str = field(static=True)

    def _setup(self, in_features, out_features, use_bias, dtype, key, rule, backend):
        where = type(self).__name__
        _positive_int(where, "in_features", in_features)
        _positive_int(where, "out_features", out_features)
        _check_backend(where, backend)
        # eqx.nn.Linear's initialisation, so one key gives the same weights as it does.
        lin = eqx.nn.Linear(in_features, out_features, use_bias, dtype, key=key)
        self.weight, self.bias = lin.weight, lin.bias
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.rule, self.backend = rule, backend

    @classmethod
    def from_linear(cls, linear: eqx.nn.Linear, rule: Rule, backend: str = "auto"):
        """A layer of class `cls` with `linear`'s weights and the sharding `rule`."""
        # Any linear layer will do (eqx.nn.Linear, or a fusedpar layer being re-ruled).
        if not all(hasattr(linear, a) for a in ("weight", "bias", "in_features",
                                                "out_features", "use_bias")):
            raise TypeError(f"{cls.__name__}.from_linear: linear must be an eqx.nn.Linear "
                            f"(or a fusedpar linear layer), got {type(linear).__name__}.")
        for name in ("in_features", "out_features"):
            _positive_int(cls.__name__, name, getattr(linear, name))
        _check_backend(cls.__name__, backend)
        return _new(cls, weight=linear.weight, bias=linear.bias,
                    in_features=linear.in_features, out_features=linear.out_features,
                    use_bias=linear.use_bias, rule=rule, backend=backend)

    def with_rule(self, rule: Rule):
        """The same weights under `rule`, as the class that implements it.

        Column -> ColumnLinear, Row -> RowLinear, FSDP alone -> FSDPLinear, no style ->
        `eqx.nn.Linear`.
        """
        if rule.tp is None and rule.fsdp is None:
            return _new(eqx.nn.Linear, weight=self.weight, bias=self.bias,
                        in_features=self.in_features, out_features=self.out_features,
                        use_bias=self.use_bias)
        return layer_class(rule).from_linear(self, rule, self.backend)

    def __call__(self, x: Array, *, key=None) -> Array:
        """**Arguments:**

        - `x`: `(in_features,)` or `(..., in_features)` (global arrays), or the local
          shard inside `shard_map`.
        - `key`: ignored; for compatibility with the rest of the Equinox API.

        **Returns:** `(..., out_features)` (or its local shard inside `shard_map`).
        """
        where = type(self).__name__
        x = jnp.asarray(x)
        if x.ndim < 1:
            raise ValueError(f"{where}: x must have shape (..., {self.in_features}), got a "
                             "scalar.")
        kind, mesh = _context.detect(where, self.rule.axes)
        if kind == _context.LOCAL:
            return self._local(x, self.rule)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{where}: x has shape {x.shape}; its last dimension must be "
                             f"in_features={self.in_features}.")
        if kind == _context.DENSE:
            return self._dense(x)
        return self._global(x, mesh)

    def _dense(self, x):
        w, x = _same_dtype(self.weight, x)
        y = _definition.matmul(x, w.T).astype(x.dtype)
        return y if self.bias is None else y + self.bias.astype(y.dtype)

    def _global(self, x, mesh):
        where = type(self).__name__
        rule = self.rule
        _check_sequence(where, rule, x)
        data = _specs.has_data_dim(rule, x.ndim)
        if rule.fsdp is not None and not data:
            rule = rule.without_fsdp()  # the weight is gathered on entry to shard_map
        if not rule.axes:
            return self._dense(x)
        sizes = _specs.mesh_sizes(mesh)
        pspecs = _specs.layer_param_specs(self, where, rule)
        _specs.check_spec(f"{where}.weight", self.weight.shape, pspecs.weight, sizes)
        x_spec, y_spec = rule.activation_specs(x.ndim, data)
        _specs.check_spec(f"{where}: x of shape {x.shape}", x.shape, x_spec, sizes,
                          what="input")
        if _context.is_explicit(mesh, rule.axes):
            # Explicit axes: the input's layout is known; if it uses other mesh axes on
            # dimensions the layer keeps (e.g. "data" on the batch), the shard_map is
            # manual over every axis and keeps them there.
            x_spec2, y_spec2 = _specs.with_other_axes(_context.current_spec(x), x_spec,
                                                      y_spec, rule.axes)
            manual = set(rule.axes)
            if (x_spec2, y_spec2) != (x_spec, y_spec):
                x_spec, y_spec, manual = x_spec2, y_spec2, set(mesh.axis_names)
            layer = jax.tree.map(lambda a, s: _context.place(a, s, True), self, pspecs)
            x = _context.place(x, x_spec, True)
        else:
            # Auto axes: manual over the layer's axes only; XLA lays out the others.
            layer, manual = self, set(rule.axes)
        fn = jax.shard_map(functools.partial(type(self)._local, rule=rule), mesh=mesh,
                           in_specs=(pspecs, x_spec), out_specs=y_spec, axis_names=manual,
                           check_vma=_context.check_vma(self.backend))
        return fn(layer, x)

    # --- helpers for `_local` ----------------------------------------------------

    def _operands(self, x, rule, local_in):
        """Check local shapes; return (w, b, x) in one dtype. `local_in`: x's features."""
        where = type(self).__name__
        sizes = {a: lax.axis_size(a) for a in rule.axes}
        shape = (self.out_features, self.in_features)
        want = rule.local_weight_shape(shape, sizes)
        if self.weight.shape != want:
            hint = (" — its global shape: pass the layer through shard_map as an argument "
                    "with in_specs from fusedpar.param_specs / fusedpar.shard_map_specs"
                    if self.weight.shape == shape else "")
            raise ValueError(
                f"{where}: inside shard_map over {sizes} the local weight must have shape "
                f"{want} (spec {rule.param_specs(where, False)['weight']} of {shape}), got "
                f"{self.weight.shape}{hint}.")
        if x.shape[-1] != local_in:
            raise ValueError(
                f"{where}: inside shard_map over {sizes} the local input must have "
                f"{local_in} features (last dim), got x of shape {x.shape}.")
        _check_sequence(where, rule, x)
        w, x = _same_dtype(self.weight, x)
        return w, self.bias, x


def _check_sequence(where, rule, x):
    if rule.sequence_parallel and x.ndim < 2:
        raise ValueError(
            f"{where}: sequence_parallel=True needs an input (..., seq, features) whose "
            f"dim -2 is the sequence, got x of shape {x.shape}.")


def layer_class(rule: Rule):
    from ._column import ColumnLinear
    from ._fsdp import FSDPLinear
    from ._row import RowLinear

    if isinstance(rule.tp, _specs.Column):
        return ColumnLinear
    if isinstance(rule.tp, _specs.Row):
        return RowLinear
    return FSDPLinear


def _same_dtype(w, x):
    dt = jnp.result_type(w, x)
    return w.astype(dt), x.astype(dt)


def add_bias(y, b):
    return y if b is None else y + b.astype(y.dtype)


def gather_fsdp(w, rule: Rule):
    """Gather the FSDP shards of the local weight (its transpose reduce-scatters the grad)."""
    if rule.fsdp is None:
        return w
    return lax.all_gather(w, rule.fsdp.axis, axis=rule.fsdp_dim, tiled=True)


def fsdp_matmul(x, w, rule: Rule, backend, out_dtype=None):
    """`x @ w.T` with the full weight: the FSDP gather overlapped with the matmul.

    The weight's FSDP dimension `d` is `w.T`'s dimension `1 - d`: the contracting rows
    (gather="rhs", dim=0) or the output columns (dim=1). The op's backward
    reduce-scatters the weight gradient over the FSDP axis.
    """
    if rule.fsdp is None:
        return _definition.matmul(x, w.T).astype(out_dtype or x.dtype)
    return all_gather_matmul(x, w.T, rule.fsdp.axis, gather="rhs", dim=1 - rule.fsdp_dim,
                             backend=backend, preferred_element_type=out_dtype)
