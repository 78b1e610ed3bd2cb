"""The layer family: drop-in replacements for `eqx.nn.Linear` that shard their weight.

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

Inputs are `(in_features,)` or `(..., in_features)`. Under `jax.vmap` the vmapped axes
are folded into the input's leading dimensions (`fusedpar._folding`), so
`jax.vmap(jax.vmap(layer))(x) == layer(x)` with the outer axis the batch and the inner one
the sequence. The layouts (see `fusedpar._specs`): a sequence-parallel layer's sequence
dimension is dim -2 of the input; an FSDP layer shards the batch dimension (dim 0, when
the input has one besides the sequence and feature dimensions) over its FSDP axis; an
FSDP layer given an input without a batch dimension in the global context gathers its
weight on entry and computes like its tensor-parallel part alone. Inside `shard_map`, an
input whose varying-axes type contradicts the layout is an error.
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

from . import _context, _definition, _dispatch, _folding, _specs, _target, _vma, _whole_model
from ._ops import all_gather_matmul, matmul_reduce_scatter
from ._specs import Rule


def _positive_int(where, name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {v!r}.")


def _features(where, name, v):
    """A positive int, or "scalar" as `eqx.nn.Linear` takes it (a dimension of 1)."""
    if v != "scalar" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{where}: {name} must be a positive int or 'scalar', got {v!r}.")


def _length(features) -> int:
    return 1 if features == "scalar" else features


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
        _features(where, "in_features", in_features)
        _features(where, "out_features", out_features)
        if not isinstance(use_bias, bool):
            raise TypeError(f"{where}: use_bias must be True or False, got {use_bias!r}.")
        _dispatch.check_backend_name(where, backend)
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
            _features(cls.__name__, name, getattr(linear, name))
        _dispatch.check_backend_name(cls.__name__, backend)
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
          shard inside `shard_map`. Under `jax.vmap` the layer sees the vmapped axes as
          leading dimensions of `x` (`fusedpar._folding`).
        - `key`: ignored; for compatibility with the rest of the Equinox API.

        **Returns:** `(..., out_features)` (or its local shard inside `shard_map`).
        """
        where = type(self).__name__
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        if self.in_features == "scalar":  # as eqx.nn.Linear: (...) -> (..., 1)
            x = x[..., None]
        if x.ndim < 1:
            raise ValueError(f"{where}: x must have shape (..., {self.in_features}), got a "
                             "scalar.")
        hint = (f"sequence_parallel=True inside shard_map gathers or scatters the sequence "
                f"over {self.rule.tp.axis!r}, so call the layer on (..., seq, features) and "
                "vmap over the batch only" if self.rule.sequence_parallel else "")
        y = _folding.fold(self._apply, (x,), self, where=where, hint=hint)
        return y[..., 0] if self.out_features == "scalar" else y

    def _apply(self, x):
        """The layer on `x` with every vmapped axis folded in."""
        where = type(self).__name__
        kind, mesh = _context.detect(where, self.rule.axes, self.weight)
        if kind == _context.LOCAL:
            y = self._local(x, self.rule)
        elif x.shape[-1] != _length(self.in_features):
            raise ValueError(f"{where}: x has shape {x.shape}; its last dimension must be "
                             f"in_features={self.in_features}.")
        elif kind == _context.DENSE:
            y = self._dense(x)
        else:
            y = self._global(x, mesh)
        rule = self.rule
        x_spec, y_spec = rule.activation_specs(x.ndim, _specs.has_data_dim(rule, x.ndim))
        _whole_model.record(where, self.weight, [(x, x_spec)], (y, y_spec),
                            x.ndim - 2 if rule.sequence_parallel else None)
        return y

    def _dense(self, x):
        w, x = _same_dtype(self.weight, x)
        y = _definition.matmul(x, w.T).astype(x.dtype)
        return add_bias(y, self.bias)

    def _global(self, x, mesh):
        where = type(self).__name__
        rule = self.rule
        _specs.check_scalar(where, rule, self.in_features, self.out_features)
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
        x_spec, y_spec, manual = _context.layouts(mesh, rule.axes, x, x_spec, y_spec)
        return _context.shard_mapped(
            functools.partial(type(self)._local, rule=rule), mesh, rule.axes, manual, self,
            pspecs, [x], [x_spec], y_spec,
            _dispatch.check_vma(self.backend, _target.current(x).platform))

    # --- helpers for `_local` ----------------------------------------------------

    def _operands(self, x, rule, local_in):
        """Check local shapes; return (w, b, x) in one dtype. `local_in`: x's features."""
        where = type(self).__name__
        _specs.check_scalar(where, rule, self.in_features, self.out_features)
        sizes = {a: lax.axis_size(a) for a in rule.axes}
        over = _context.shard_map_sizes(rule.axes)
        shape = (_length(self.out_features), _length(self.in_features))
        want = rule.local_weight_shape(shape, sizes)
        if self.weight.shape != want:
            hint = (" — its global shape: pass the layer through shard_map as an argument "
                    "with in_specs from fusedpar.param_specs / fusedpar.shard_map_specs"
                    if self.weight.shape == shape else "")
            raise ValueError(
                f"{where}: inside shard_map over {over} the local weight must have shape "
                f"{want} (spec {rule.param_specs(where, False)['weight']} of {shape}), got "
                f"{self.weight.shape}{hint}.")
        if x.shape[-1] != local_in:
            raise ValueError(
                f"{where}: inside shard_map over {over} the local input must have "
                f"{local_in} features (last dim), got x of shape {x.shape}.")
        _check_sequence(where, rule, x)
        x_spec = rule.activation_specs(x.ndim, _specs.has_data_dim(rule, x.ndim))[0]
        _vma.check_layout(where, "the input", x, x_spec, _specs.layout_axes(rule, x_spec),
                          layout_hint(rule))
        w, x = _same_dtype(self.weight, x)
        return w, self.bias, x


def layout_hint(rule) -> str:
    """What input layout a layer under `rule` takes, and the style for other layouts."""
    tp, parts = rule.tp, []
    if isinstance(tp, _specs.Column) and tp.sequence_parallel:
        parts.append(f"a sequence-parallel ColumnLinear gathers its input's sequence (dim -2) "
                     f"over {tp.axis!r}; an input replicated over {tp.axis!r} needs "
                     "sequence_parallel=False")
    elif isinstance(tp, _specs.Column):
        parts.append(f"a ColumnLinear takes an input replicated over {tp.axis!r}; one sharded "
                     f"along the sequence (dim -2) over {tp.axis!r} needs "
                     "sequence_parallel=True, one sharded on its features goes into a "
                     "RowLinear")
    elif isinstance(tp, _specs.Row):
        parts.append(f"a RowLinear takes its input's features sharded over {tp.axis!r} (a "
                     "ColumnLinear's output); a replicated input goes into a ColumnLinear")
    if rule.fsdp is not None:
        parts.append(f"FSDP takes the batch (dim 0) sharded over {rule.fsdp.axis!r}")
    return "; ".join(parts)


def _check_sequence(where, rule, x):
    if rule.sequence_parallel and x.ndim < 2:
        raise ValueError(
            f"{where}: sequence_parallel=True needs an input (..., seq, features) whose "
            f"dim -2 is the sequence, got x of shape {x.shape}.")


def layer_class(rule: Rule):
    """The layer class that implements `rule`: Column, Row, or FSDP alone."""
    if isinstance(rule.tp, _specs.Column):
        return ColumnLinear
    if isinstance(rule.tp, _specs.Row):
        return RowLinear
    return FSDPLinear


def _bias_grad_sum(layer) -> list:
    """A bias is added to every shard of an output sharded along the batch (FSDP) or the
    sequence (a sequence-parallel RowLinear), so its gradient is summed over those axes."""
    rule = layer.rule
    axes = [rule.fsdp.axis] if rule.fsdp is not None else []
    if isinstance(rule.tp, _specs.Row) and rule.tp.sequence_parallel:
        axes.append(rule.tp.axis)
    return [f"psum db over {', '.join(axes)}"] if axes and layer.bias is not None else []


def _same_dtype(w, x):
    # The promotion of `jnp.result_type`, without the strict-promotion check: an input
    # of another dtype than the weight is what mixed-precision models pass on purpose.
    with jax.numpy_dtype_promotion("standard"):
        dt = jnp.result_type(w, x)
    return w.astype(dt), x.astype(dt)


def add_bias(y, b):
    # Broadcast explicitly: jax_numpy_rank_promotion="raise" refuses `y + b` on batches.
    return y if b is None else y + jnp.broadcast_to(b.astype(y.dtype), y.shape)


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


class ColumnLinear(ParallelLinear):
    """`eqx.nn.Linear` with its weight `(out_features, in_features)` split over the mesh
    axis `axis` along `out_features` (and the bias with it).

    The input is replicated over `axis`; the output is sharded on its features (the input
    a `RowLinear` expects), or whole with `gather_output=True`. With
    `sequence_parallel=True` the input arrives sharded along its sequence dimension (dim
    -2) and the layer runs `all_gather_matmul(gather="lhs")`, overlapping the gather with
    the matmul; without it the forward is a local matmul and the backward sums the input
    gradient over `axis` (inside `shard_map(check_vma=True)` JAX does this for an input
    that is invariant over `axis`).
    """

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key, axis: str = "tp", sequence_parallel: bool = False,
                 gather_output: bool = False, fsdp_axis: Optional[str] = None,
                 fsdp_dim: Optional[int] = None, backend: str = "auto"):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as `eqx.nn.Linear`
          (the same key gives the same weights).
        - `axis`: the mesh axis of the tensor-parallel split.
        - `sequence_parallel`: the input is sharded over `axis` along dim -2.
        - `gather_output`: return the whole output instead of its feature shard.
        - `fsdp_axis`: also shard the weight over this mesh axis (FSDP): along
          `in_features` by default, or `fsdp_dim` (0 puts it on `out_features` after
          `axis`); the input's batch dimension (dim 0) is sharded over it.
        - `backend`: the backend of the collective matmul ops (`"auto"`, `"reference"`,
          `"ring"`, ...).
        """
        _specs.check_fsdp_dim("ColumnLinear", fsdp_axis, fsdp_dim)
        rule = _specs.compose(_specs.Column(axis, sequence_parallel, gather_output),
                              None if fsdp_axis is None else _specs.FSDP(fsdp_axis, fsdp_dim),
                              where="ColumnLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def collectives(self) -> tuple[list, list]:
        """The collectives of the forward and of the backward pass (`fusedpar.describe`)."""
        tp, f = self.rule.tp, self.rule.fsdp
        fwd, bwd = [], []
        if tp.sequence_parallel:
            fwd += [f"all_gather W over {f.axis}"] if f else []
            fwd.append(f"all_gather_matmul x(seq) over {tp.axis}")
            bwd.append(f"matmul_reduce_scatter dx(seq) over {tp.axis}")
            bwd += [f"reduce_scatter dW over {f.axis}"] if f else []
        else:
            fwd += [f"all_gather_matmul W over {f.axis}"] if f else []
            bwd += [f"matmul_reduce_scatter dW over {f.axis}"] if f else []
            bwd.append(f"psum dx over {tp.axis}")
        fwd += [f"all_gather y over {tp.axis}"] if tp.gather_output else []
        return fwd, bwd + _bias_grad_sum(self)

    def _local(self, x, rule):
        tp = rule.tp
        w, b, x = self._operands(x, rule, _length(self.in_features))
        if tp.sequence_parallel:
            w = gather_fsdp(w, rule)
            y = all_gather_matmul(x, w.T, tp.axis, gather="lhs", dim=x.ndim - 2,
                                  backend=self.backend)
        else:
            y = fsdp_matmul(x, w, rule, self.backend)
        y = add_bias(y, b)
        if tp.gather_output:
            y = _context.gather_invariant(y, tp.axis, y.ndim - 1)
        return y


class RowLinear(ParallelLinear):
    """`eqx.nn.Linear` with its weight `(out_features, in_features)` split over the mesh
    axis `axis` along `in_features`; the bias is replicated.

    The input is sharded on its features (a `ColumnLinear`'s output); each device's
    partial product is summed over `axis`: `matmul_reduce_scatter` along the sequence
    dimension (dim -2) with `sequence_parallel=True`, so the output is sharded on it (the
    input a sequence-parallel `ColumnLinear` expects); a matmul and `psum` without. The
    bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key, axis: str = "tp", sequence_parallel: bool = False,
                 fsdp_axis: Optional[str] = None, fsdp_dim: Optional[int] = None,
                 backend: str = "auto"):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as `eqx.nn.Linear`.
        - `axis`: the mesh axis of the tensor-parallel split.
        - `sequence_parallel`: reduce-scatter the output along dim -2 instead of psum.
        - `fsdp_axis`: also shard the weight over this mesh axis (FSDP): along
          `out_features` by default, or `fsdp_dim` (1 puts it on `in_features` after
          `axis`); the input's batch dimension (dim 0) is sharded over it.
        - `backend`: the backend of the collective matmul ops.
        """
        _specs.check_fsdp_dim("RowLinear", fsdp_axis, fsdp_dim)
        rule = _specs.compose(_specs.Row(axis, sequence_parallel),
                              None if fsdp_axis is None else _specs.FSDP(fsdp_axis, fsdp_dim),
                              where="RowLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def collectives(self) -> tuple[list, list]:
        """The collectives of the forward and of the backward pass (`fusedpar.describe`)."""
        tp, f = self.rule.tp, self.rule.fsdp
        if tp.sequence_parallel:
            fwd = ([f"all_gather W over {f.axis}"] if f else []) + [
                f"matmul_reduce_scatter y(seq) over {tp.axis}"]
            bwd = [f"all_gather_matmul dy(seq) over {tp.axis}"] + (
                [f"reduce_scatter dW over {f.axis}"] if f else [])
        else:
            fwd = ([f"all_gather_matmul W over {f.axis}"] if f else []) + [
                f"psum y over {tp.axis}"]
            bwd = [f"matmul_reduce_scatter dW over {f.axis}"] if f else []
        return fwd, bwd + _bias_grad_sum(self)

    def _local(self, x, rule):
        tp = rule.tp
        w, b, x = self._operands(x, rule, self.in_features // lax.axis_size(tp.axis))
        if tp.sequence_parallel:
            w = gather_fsdp(w, rule)
            y = matmul_reduce_scatter(x, w.T, tp.axis, dim=x.ndim - 2, backend=self.backend)
        else:
            # Partial sums stay in the accumulation dtype through the psum, as the
            # reduce-scatter's do.
            acc = _definition.accumulation_dtype(x.dtype)
            y = lax.psum(fsdp_matmul(x, w, rule, self.backend, acc), tp.axis).astype(x.dtype)
        return add_bias(y, b)


class FSDPLinear(ParallelLinear):
    """`eqx.nn.Linear` with its weight `(out_features, in_features)` split over the mesh
    axis `axis` along `out_features` (fully sharded data parallel); the bias is
    replicated.

    The input's batch dimension (dim 0) is sharded over `axis`. The forward gathers the
    weight with `all_gather_matmul(gather="rhs")`, overlapping the gather with the
    matmul; the op's backward reduce-scatters the weight gradient back to its shard.
    To combine FSDP with tensor parallelism use `ColumnLinear`/`RowLinear` with
    `fsdp_axis=`.
    """

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key, axis: str = "fsdp", backend: str = "auto"):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as `eqx.nn.Linear`.
        - `axis`: the mesh axis the weight (and the input's batch) is sharded over.
        - `backend`: the backend of the collective matmul op.
        """
        rule = _specs.compose(_specs.FSDP(axis), where="FSDPLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def collectives(self) -> tuple[list, list]:
        """The collectives of the forward and of the backward pass (`fusedpar.describe`)."""
        axis = self.rule.fsdp.axis
        return ([f"all_gather_matmul W over {axis}"],
                [f"matmul_reduce_scatter dW over {axis}"] + _bias_grad_sum(self))

    def _local(self, x, rule):
        w, b, x = self._operands(x, rule, _length(self.in_features))
        return add_bias(fsdp_matmul(x, w, rule, self.backend), b)
