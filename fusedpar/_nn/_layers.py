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
  itself in `shard_map` over its own axes with the specs of `fusedpar._sharding._specs`;
- with no mesh: the dense result, the same as `eqx.nn.Linear` with the same weights.

Inputs are `(in_features,)` or `(..., in_features)`. Under `jax.vmap` the vmapped axes
are folded into the input's leading dimensions (`fusedpar._core._folding`), so
`jax.vmap(jax.vmap(layer))(x) == layer(x)` with the outer axis the batch and the inner one
the sequence. The layouts (see `fusedpar._sharding._specs`): a sequence-parallel layer's sequence
dimension is dim -2 of the input; an FSDP layer shards the batch dimension (dim 0, when
the input has one besides the sequence and feature dimensions) over its FSDP axis; an
FSDP layer given an input without a batch dimension in the global context gathers its
weight on entry and computes like its tensor-parallel part alone. Inside `shard_map`, an
input whose varying-axes type contradicts the layout is an error.

Beside this module: the checks of arguments and inputs (`_layer_checks`), the per-device
arithmetic (`_layer_math`), the FSDP weight gather and matmul (`_fsdp_gather`), and what
`fusedpar.describe` says each layer sends (`_collective_names`).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from equinox import field
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from . import _collective_names, _context, _fsdp_activations, _shared_gather
from .._core import _definition, _dispatch, _folding, _interpret, _validate, _vma
from .._sharding import _specs, _whole_model
from .._hw import _target
from .._hw._cost_hardware import get_hardware
from ._fsdp_gather import fsdp_matmul, gather_fsdp
from ._layer_checks import (check_quantized_weight, check_sequence, check_stored_comm,
                            features, layout_hint, length, param_dtype)
from ._layer_math import add_bias, array_of, matmul_t, same_dtype, stationary
from .._core._ops import (all_gather_matmul, all_gather_matmul_given,
                          all_gather_matmul_keeping, matmul_reduce_scatter)
from .._core._quantized_array import QuantizedArray, fake_quantize
from .._sharding._rules import local_shape
from .._sharding._specs import Rule


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
        in_features = features(where, "in_features", in_features)
        out_features = features(where, "out_features", out_features)
        param_dtype(where, dtype)
        _validate.boolean(where, "use_bias", use_bias)
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
        in_features, out_features = (features(cls.__name__, name, getattr(linear, name))
                                     for name in ("in_features", "out_features"))
        _dispatch.check_backend_name(cls.__name__, backend)
        return _new(cls, weight=linear.weight, bias=linear.bias,
                    in_features=in_features, out_features=out_features,
                    use_bias=linear.use_bias, rule=rule, backend=backend)

    def with_rule(self, rule: Rule):
        """The same weights under `rule`, as the class that implements it.

        Column -> ColumnLinear, Row -> RowLinear, FSDP alone -> FSDPLinear, no style ->
        `Linear` (replicated, and called as every fusedpar layer is).
        """
        return layer_class(rule).from_linear(self, rule, self.backend)

    @property
    def _ops_backend(self) -> str:
        """The backend of the collective ops: the layer's, except while
        `fusedpar.shard_map_specs` checks the layouts it derived inside a `shard_map` with
        JAX's varying-axes types on (every backend gives the same layouts, and the
        reference is the one that runs with those types)."""
        return "reference" if _whole_model.tracing() else self.backend

    def __call__(self, x: Array, *, key=None) -> Array:
        """**Arguments:**

        - `x`: `(in_features,)` or `(..., in_features)` (global arrays), or the local
          shard inside `shard_map`. Under `jax.vmap` the layer sees the vmapped axes as
          leading dimensions of `x` (`fusedpar._core._folding`).
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
        check_quantized_weight(where, self.weight)
        check_stored_comm(where, self.weight, self.rule)
        kind, mesh = _context.detect(where, self.rule.axes, array_of(self.weight),
                                     self.rule)
        tp, f = self.rule.tp, self.rule.fsdp
        if (kind != _context.DENSE and tp is not None and f is not None
                and dict(mesh.shape).get(f.axis, 1) > 1):  # before a hang
            _interpret.check_fsdp_beside(where, self._ops_backend, f.axis, tp.axis,
                                         _target.current(x, array_of(self.weight)))
        if kind != _context.LOCAL:
            _specs.check_param_shapes(where, self)
        if kind == _context.LOCAL:
            y = self._local(x, self.rule)
        elif x.shape[-1] != length(self.in_features):
            raise ValueError(f"{where}: x has shape {x.shape}; its last dimension must be "
                             f"in_features={self.in_features}.")
        elif kind == _context.DENSE:
            y = self._dense(x)
        else:
            with _interpret.remat_seen(  # the ops inside its shard_map cannot see it
                    self._ops_backend, _target.current(x, array_of(self.weight))):
                y = self._global(x, mesh)
        rule = self.rule
        x_spec, y_spec = rule.activation_specs(x.ndim, _specs.has_data_dim(rule, x.ndim))
        _whole_model.record(where, self.weight, [(x, x_spec)], (y, y_spec),
                            x.ndim - 2 if rule.sequence_parallel else None,
                            _specs.layout_axes(rule, x_spec))
        return y

    def _dense(self, x):
        """The layer with no mesh: what the sharded layer computes, so the result does not
        depend on the context. An operand a `comm_dtype` would send quantized is
        fake-quantized as it would be (straight-through gradient): the input of a
        sequence-parallel Column (one scale per row), the weight of an FSDP style (one
        scale per output channel). Where the weight's input features are split (a
        RowLinear's over tp, a Column's FSDP on `in`) the sharded gather scales each
        device's part of a row apart, which the dense layer cannot know: it agrees
        within the quantization error. A Row's `comm_dtype` acts on the partial sums of
        its ring, which the dense product does not form: that layer is exact here. A
        `QuantizedArray` weight is multiplied as stored. (docs/quantized.md)"""
        w, x = same_dtype(self.weight, x)
        tp, f = self.rule.tp, self.rule.fsdp
        if isinstance(tp, _specs.Column) and tp.comm_dtype is not None:
            x = fake_quantize(x, tp.comm_dtype, -1)
        if f is not None and f.comm_dtype is not None and not isinstance(w, QuantizedArray):
            w = fake_quantize(w, f.comm_dtype, -1)
        y = matmul_t(x, w)
        return add_bias(y, self.bias)

    def _global(self, x, mesh):
        where = type(self).__name__
        rule = self.rule
        _specs.check_scalar(where, rule, self.in_features, self.out_features)
        check_sequence(where, rule, x)
        data = _specs.has_data_dim(rule, x.ndim)
        if rule.fsdp is not None and not data:
            self._moves_activations(rule, x, x.shape, _specs.mesh_sizes(mesh))  # refuses
            rule = rule.without_fsdp()  # the weight is gathered on entry to shard_map
        if not rule.axes:
            return self._dense(x)
        sizes = _specs.mesh_sizes(mesh)
        pspecs = _specs.layer_param_specs(self, where, rule)
        _specs.check_spec(f"{where}.weight", self.weight.shape, array_of(pspecs.weight), sizes)
        x_spec, y_spec = rule.activation_specs(x.ndim, data)
        fixes = _specs.decoding_fixes(rule, data, x.ndim - 2, x.shape[0] if x.ndim else None)
        _specs.check_spec(f"{where}: x of shape {x.shape}", x.shape, x_spec, sizes,
                          what="input", fixes=fixes)
        # A sequence-parallel Row scatters the sequence of its output, not of its input.
        y_shape = x.shape[:-1] + (length(self.out_features),)
        _specs.check_spec(f"{where}: x of shape {x.shape} gives an output of shape "
                          f"{y_shape}", y_shape, y_spec, sizes, what="output", fixes=fixes)
        platform = _target.current(x).platform
        check = _dispatch.check_vma(self.backend, platform)
        # Every axis manual where a kernel may run (it addresses devices by their
        # coordinates on every axis; `auto` then estimates per-device shapes) and on a
        # batch of Auto axes (`layouts` says why). Elsewhere (`check`: the reference, the
        # ring, `auto` on CPU) the layer's own axes, as for the embedding and the loss:
        # under Explicit axes a jax.vmap over a batch sharded on another axis takes that
        # axis from a shard_map under a jit, scan or checkpoint inside it.
        x_spec, y_spec, manual = _context.layouts(where, mesh, rule.axes, x, x_spec,
                                                  y_spec, every_axis=not check,
                                                  batched=x.ndim >= 3)

        def mapped(fn, args, arg_specs, out_spec):
            return _context.shard_mapped(fn, mesh, rule.axes, manual, self, pspecs, args,
                                         arg_specs, out_spec, check, where)

        return self._mapped(mapped, x, rule, x_spec, y_spec, (mesh, frozenset(manual)))

    def _mapped(self, mapped, x, rule, x_spec, y_spec, where):
        """`_local` on the global `x` by `mapped(fn, args, arg_specs, out_spec)` (the
        layer's `shard_map`); `where`: what else decides the layout (mesh, manual axes)."""
        return mapped(functools.partial(type(self)._local, rule=rule), [x], [x_spec], y_spec)

    # --- helpers for `_local` ----------------------------------------------------

    def _operands(self, x, rule, local_in):
        """Check local shapes; return (w, b, x) in one dtype. `local_in`: x's features."""
        where = type(self).__name__
        _specs.check_scalar(where, rule, self.in_features, self.out_features)
        sizes = {a: lax.axis_size(a) for a in rule.axes}
        over = _context.shard_map_sizes(rule.axes)
        shape = (length(self.out_features), length(self.in_features))
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
        check_sequence(where, rule, x)
        x_spec = rule.activation_specs(x.ndim, _specs.has_data_dim(rule, x.ndim))[0]
        _vma.check_layout(where, "the input", x, x_spec, _specs.layout_axes(rule, x_spec),
                          layout_hint(rule))
        w, x = same_dtype(self.weight, x)
        return w, self.bias, x

    def _op_kwargs(self, tp, x) -> dict:
        """The sequence-parallel op's arguments from the tensor-parallel style `tp`, for
        `x` (its sequence dimension -2): w is the transpose of the (out, in) weight as
        it lies, which the TPU kernels read in place."""
        return dict(dim=x.ndim - 2, backend=self._ops_backend, comm_dtype=tp.comm_dtype,
                    grad_comm_dtype=tp.grad_comm_dtype, reduce_dtype=tp.reduce_dtype,
                    keep_gathered=tp.keep_gathered, w_transposed=True)

    def _moves_activations(self, rule, x, x_shape, sizes) -> bool:
        """Whether FSDP moves the activations instead of the weight
        (`_fsdp_activations`): `x_shape` the local input (`x` the array, whose target's
        cost numbers decide), `sizes` the mesh's."""
        shape = (length(self.out_features), length(self.in_features))
        w = array_of(self.weight)  # a QuantizedArray's values: what a gather would send
        weight_bytes = math.prod(rule.local_weight_shape(shape, sizes)) * w.dtype.itemsize
        return _fsdp_activations.moves_activations(
            type(self).__name__, rule, x_shape, x.dtype, shape[1], shape[0], sizes,
            weight_bytes, get_hardware(target=_target.current(x, w)))


def _fsdp_style(where, axis, dim, comm_dtype, grad_comm_dtype, reduce_dtype=None,
                gather="auto"):
    if axis is None:
        if comm_dtype is not None or grad_comm_dtype is not None:
            raise ValueError(f"{where}: fsdp_comm_dtype / fsdp_grad_comm_dtype set the dtype "
                             "of the FSDP weight gather; pass fsdp_axis too (or drop them).")
        if gather != "auto":
            raise ValueError(f"{where}: fsdp_gather={gather!r} chooses what moves over the "
                             "FSDP axis; pass fsdp_axis too (or drop it).")
        return None
    return _specs.FSDP(axis, dim, comm_dtype, grad_comm_dtype, reduce_dtype, gather)



def layer_class(rule: Rule):
    """The layer class that implements `rule`: Column, Row, FSDP alone, or no style."""
    if isinstance(rule.tp, _specs.Column):
        return ColumnLinear
    if isinstance(rule.tp, _specs.Row):
        return RowLinear
    return FSDPLinear if rule.fsdp is not None else Linear


class ColumnLinear(ParallelLinear):
    """`eqx.nn.Linear` with its weight `(out_features, in_features)` split over the mesh
    axis `axis` along `out_features` (and the bias with it).

    The input is replicated over `axis`; the output is sharded on its features (the input
    a `RowLinear` expects), or whole with `gather_output=True`. With
    `sequence_parallel=True` the input arrives sharded along its sequence dimension (dim
    -2) and the layer runs `all_gather_matmul(gather="lhs")`, overlapping the gather with
    the matmul; without it the forward is a local matmul and the backward sums the input
    gradient over `axis` (inside `shard_map(check_vma=True)` JAX does this for an input
    that is invariant over `axis`). Sequence-parallel layers called on the same input
    array in one trace (q, k and v) gather it once (`_shared_gather`).
    """

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key, axis: str = "tp", sequence_parallel: bool = False,
                 gather_output: bool = False, fsdp_axis: Optional[str] = None,
                 fsdp_dim: Optional[int] = None, backend: str = "auto", comm_dtype=None,
                 grad_comm_dtype=None, fsdp_comm_dtype=None, fsdp_grad_comm_dtype=None,
                 reduce_dtype=None, fsdp_gather: str = "auto", keep_gathered: bool = True):
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
        - `comm_dtype`, `grad_comm_dtype`: `jnp.int8`, `jnp.float8_e4m3fn` or None: what
          the sequence-parallel input gather (and its backward's reduce-scatter) sends
          (`fusedpar.Column`); need `sequence_parallel=True`.
        - `fsdp_comm_dtype`, `fsdp_grad_comm_dtype`: the same for the FSDP weight gather
          (`fusedpar.FSDP`); need `fsdp_axis`.
        - `reduce_dtype`: the floating dtype the layer's reduce-scatters (the
          sequence-parallel backward's, the FSDP weight gradient's) sum and send partial
          sums in; None: float32 for 16-bit inputs (docs/ops.md says what bfloat16 saves
          and costs).
        - `fsdp_gather`: with `fsdp_axis`, what moves over it: "weights", "activations"
          (the FSDP peers' tokens, for steps with few of them) or "auto"
          (`fusedpar.FSDP(gather=)`).
        - `keep_gathered`: False keeps no gathered input for the weight gradient, which
          gathers it again: less memory, one more gather (`fusedpar.Column`); needs
          `sequence_parallel=True`.
        """
        _specs.check_fsdp_dim("ColumnLinear", fsdp_axis, fsdp_dim)
        rule = _specs.compose(
            _specs.Column(axis, sequence_parallel, gather_output, comm_dtype, grad_comm_dtype,
                          reduce_dtype, keep_gathered),
            _fsdp_style("ColumnLinear", fsdp_axis, fsdp_dim, fsdp_comm_dtype,
                        fsdp_grad_comm_dtype, reduce_dtype, fsdp_gather),
            where="ColumnLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def collectives(self) -> tuple[list, list]:
        """The collectives of the forward and of the backward pass (`fusedpar.describe`)."""
        return _collective_names.column(self)

    def _local(self, x, rule, gathered=None, keep=False):
        """The per-device layer. Sequence parallel, an input gathered already for a layer
        before this one on the same array is multiplied again (`_shared_gather`): found
        here inside `shard_map`; for global arrays `_mapped` passes `gathered` (this
        device's block of its stacked form) or asks to `keep` it, returning
        `(y, x gathered)` with a leading axis of length 1 to stack over `axis`."""
        tp = rule.tp
        x_in = x
        w, b, x = self._operands(x, rule, length(self.in_features))
        g = None
        kw = self._op_kwargs(tp, x)
        if not keep and gathered is None and self._moves_activations(
                rule, x, x.shape, {a: lax.axis_size(a) for a in rule.axes}):
            y = _fsdp_activations.local(x, w, rule, lambda x, w, out: (
                all_gather_matmul(x, w.T, tp.axis, gather="lhs", w_resident=True,
                                  preferred_element_type=out, **kw)
                if tp.sequence_parallel else matmul_t(x, w, out)))
        elif tp.sequence_parallel:
            kw["w_resident"] = rule.fsdp is None  # no gather this step (`w_resident`)
            w = stationary(gather_fsdp(w, rule))
            key = None
            if gathered is None and not keep and self._shares():
                key = ("local", x.ndim, x.dtype, self._sharing(tp))
                gathered = _shared_gather.lookup(x_in, key)
            if gathered is not None:
                y = all_gather_matmul_given(x, gathered, w.T, tp.axis, **kw)
            elif keep or key is not None:
                y, g = all_gather_matmul_keeping(x, w.T, tp.axis, **kw)
                if key is not None:
                    _shared_gather.remember(x_in, key, g)
            else:
                y = all_gather_matmul(x, w.T, tp.axis, gather="lhs", **kw)
        else:
            y = fsdp_matmul(x, w, rule, self._ops_backend)
        y = add_bias(y, b)
        if tp.gather_output:
            y = _context.gather_invariant(y, tp.axis, y.ndim - 1)
        return (y, g[None]) if keep else y

    def _shares(self) -> bool:
        """Whether the layer's input gather may be shared with sibling layers
        (`_shared_gather`): not for a stored quantized weight (its op keeps no gathered
        input of the same kind), nor where the style keeps none (`keep_gathered=False`:
        sharing is keeping the gathered input for the siblings and the backward)."""
        return not isinstance(self.weight, QuantizedArray) and self.rule.tp.keep_gathered

    def _sharing(self, tp) -> tuple:
        """What siblings sharing a gather must agree on: the gather (axis, comm dtype)
        and the backward the first one's op runs for them all (its input gradient's
        reduce-scatter: comm and reduce dtypes, backend)."""
        return (tp.axis, tp.comm_dtype, tp.grad_comm_dtype, tp.reduce_dtype,
                self._ops_backend)

    def _mapped(self, mapped, x, rule, x_spec, y_spec, where):
        tp, seq = rule.tp, x.ndim - 2
        spec = tuple(x_spec) + (None,) * (x.ndim - len(x_spec))
        if not (tp.sequence_parallel and self._shares() and spec[seq] == tp.axis) or (
                self._moves_activations(
                    rule, x, local_shape(x.shape, spec, _specs.mesh_sizes(where[0])),
                    _specs.mesh_sizes(where[0]))):
            return super()._mapped(mapped, x, rule, x_spec, y_spec, where)
        # x gathered, one copy per device of `axis`: stacked on a new leading axis so
        # that each device's copy stays its own (nothing is summed over `axis`).
        stacked_spec = P(tp.axis, *(None if i == seq else e for i, e in enumerate(spec)))
        key = ("global", where, spec, x.dtype, array_of(self.weight).dtype,
               self._sharing(tp))
        stacked = _shared_gather.lookup(x, key)
        if stacked is not None:
            return mapped(lambda layer, x, s: layer._local(x, rule, gathered=s[0]),
                          [x, stacked], [x_spec, stacked_spec], y_spec)
        y, stacked = mapped(lambda layer, x: layer._local(x, rule, keep=True), [x],
                            [x_spec], (y_spec, stacked_spec))
        _shared_gather.remember(x, key, stacked)
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
                 backend: str = "auto", comm_dtype=None, grad_comm_dtype=None,
                 fsdp_comm_dtype=None, fsdp_grad_comm_dtype=None, reduce_dtype=None,
                 fsdp_gather: str = "auto", keep_gathered: bool = True):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as `eqx.nn.Linear`.
        - `axis`: the mesh axis of the tensor-parallel split.
        - `sequence_parallel`: reduce-scatter the output along dim -2 instead of psum.
        - `fsdp_axis`: also shard the weight over this mesh axis (FSDP): along
          `out_features` by default, or `fsdp_dim` (1 puts it on `in_features` after
          `axis`); the input's batch dimension (dim 0) is sharded over it.
        - `backend`: the backend of the collective matmul ops.
        - `comm_dtype`, `grad_comm_dtype`: passed to the sequence-parallel
          `matmul_reduce_scatter` (`fusedpar.Row`); need `sequence_parallel=True`.
        - `fsdp_comm_dtype`, `fsdp_grad_comm_dtype`: what the FSDP weight gather (and
          its gradient's reduce-scatter) sends (`fusedpar.FSDP`); need `fsdp_axis`.
        - `reduce_dtype`: the floating dtype the partial sums are summed and sent in (the
          reduce-scatter's, or the psum's, and the FSDP weight gradient's); None: float32
          for 16-bit inputs (docs/ops.md says what bfloat16 saves and costs).
        - `fsdp_gather`: as `ColumnLinear`'s.
        - `keep_gathered`: False gathers the output's cotangent once for each gradient
          instead of keeping it between them: less memory, one more gather
          (`fusedpar.Row`); needs `sequence_parallel=True`.
        """
        _specs.check_fsdp_dim("RowLinear", fsdp_axis, fsdp_dim)
        rule = _specs.compose(
            _specs.Row(axis, sequence_parallel, comm_dtype, grad_comm_dtype, reduce_dtype,
                       keep_gathered),
            _fsdp_style("RowLinear", fsdp_axis, fsdp_dim, fsdp_comm_dtype,
                        fsdp_grad_comm_dtype, reduce_dtype, fsdp_gather),
            where="RowLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def collectives(self) -> tuple[list, list]:
        """The collectives of the forward and of the backward pass (`fusedpar.describe`)."""
        return _collective_names.row(self)

    def _local(self, x, rule):
        tp = rule.tp
        w, b, x = self._operands(x, rule, self.in_features // lax.axis_size(tp.axis))
        kw = self._op_kwargs(tp, x)
        # Partial sums stay in the accumulation dtype (or reduce_dtype) through the psum
        # without sequence parallelism, as the reduce-scatter's do.
        acc = (_definition.accumulation_dtype(x.dtype) if tp.reduce_dtype is None
               else _validate.reduce_dtype(type(self).__name__, tp.reduce_dtype, x.dtype))
        if self._moves_activations(rule, x, x.shape,
                                   {a: lax.axis_size(a) for a in rule.axes}):
            y = _fsdp_activations.local(x, w, rule, lambda x, w, out: (
                matmul_reduce_scatter(x, w.T, tp.axis, preferred_element_type=out,
                                      w_resident=True, **kw) if tp.sequence_parallel
                else lax.psum(matmul_t(x, w, acc), tp.axis).astype(out)))
        elif tp.sequence_parallel:
            w = stationary(gather_fsdp(w, rule))
            # No gather this step (`w_resident`): the TPU kernel reads w where it lies.
            y = matmul_reduce_scatter(x, w.T, tp.axis, w_resident=rule.fsdp is None, **kw)
        else:
            y = lax.psum(fsdp_matmul(x, w, rule, self._ops_backend, acc), tp.axis).astype(x.dtype)
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
                 dtype=None, *, key, axis: str = "fsdp", backend: str = "auto",
                 comm_dtype=None, grad_comm_dtype=None, reduce_dtype=None,
                 gather: str = "auto"):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as `eqx.nn.Linear`.
        - `axis`: the mesh axis the weight (and the input's batch) is sharded over.
        - `backend`: the backend of the collective matmul op.
        - `comm_dtype`, `grad_comm_dtype`: `jnp.int8`, `jnp.float8_e4m3fn` or None: what
          the weight gather and the weight gradient's reduce-scatter send
          (`fusedpar.FSDP`).
        - `reduce_dtype`: the floating dtype the weight gradient's reduce-scatter sums
          in; None: float32 for 16-bit weights.
        - `gather`: what moves over `axis`: "weights", "activations" (the FSDP peers'
          tokens, for steps with few of them) or "auto" (`fusedpar.FSDP(gather=)`).
        """
        rule = _specs.compose(_specs.FSDP(axis, None, comm_dtype, grad_comm_dtype,
                                          reduce_dtype, gather),
                              where="FSDPLinear")
        self._setup(in_features, out_features, use_bias, dtype, key, rule, backend)

    def collectives(self) -> tuple[list, list]:
        """The collectives of the forward and of the backward pass (`fusedpar.describe`)."""
        return _collective_names.fsdp(self)

    def _local(self, x, rule):
        w, b, x = self._operands(x, rule, length(self.in_features))
        if self._moves_activations(rule, x, x.shape, {a: lax.axis_size(a) for a in rule.axes}):
            return add_bias(_fsdp_activations.local(x, w, rule, matmul_t), b)
        return add_bias(fsdp_matmul(x, w, rule, self._ops_backend), b)


class Linear(ParallelLinear):
    """`eqx.nn.Linear` replicated on every device, called as the fusedpar layers are: on
    `(in_features,)` or `(..., in_features)`, with no collective. It is what
    `fusedpar.validate(..., relaxed=True)` (and `shard`) leaves of a layer none of whose
    styles divide its dimensions, so the model's code calls it as it called the layer.
    """

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key):
        """**Arguments:** `in_features`, `out_features`, `use_bias`, `dtype`, `key`: as
        `eqx.nn.Linear` (the same key gives the same weights)."""
        self._setup(in_features, out_features, use_bias, dtype, key, Rule(), "auto")

    def collectives(self) -> tuple[list, list]:
        """The collectives of the forward and of the backward pass: none."""
        return [], []

    def _local(self, x, rule):
        w, b, x = self._operands(x, rule, length(self.in_features))
        return add_bias(matmul_t(x, w), b)
