"""Vocabulary-parallel embedding: a drop-in for `eqx.nn.Embedding` that shards its table.

```python
import equinox as eqx, jax, jax.numpy as jnp
import fusedpar

embed = fusedpar.Embedding(100, 64, key=jax.random.key(0), sequence_parallel=True)
ids = jnp.zeros((8, 32), jnp.int32)                      # (batch, seq)
with jax.set_mesh(jax.make_mesh((4,), ("tp",))):
    x = eqx.filter_jit(lambda e, ids: e(ids))(embed, ids)  # (8, 32, 64), seq sharded
```

The table `(num_embeddings, embedding_size)` is split over the mesh axis `axis` along the
vocabulary. Each device looks up the ids that fall in its rows (the others give zeros)
and the partial embeddings are summed over `axis`: `psum` gives them replicated, or with
`sequence_parallel=True` `psum_scatter` along the sequence gives them sharded the way a
sequence-parallel `ColumnLinear` takes its input. In the backward pass each device
scatters the cotangent into its own rows: after a sum that needs no collective, after a
reduce-scatter the cotangent is gathered along the sequence. With `fsdp_axis` the table's
embedding dimension is also sharded over that axis and gathered before the lookup.

Like the linear layers it works inside `shard_map`, on global arrays under
`jax.set_mesh`, with no mesh, and under `jax.vmap` (the vmapped axes fold into the ids'
leading dimensions).
"""

from __future__ import annotations

import functools
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from equinox import field
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from . import _context
from .._core import _definition, _folding, _validate, _vma
from .._core._quantized_array import QuantizedArray
from .._hw import _target
from .._sharding import _specs, _whole_model
from .._sharding._specs import TableRule
from ._layer_checks import param_dtype


def _normalize(ids, vocab):
    """The row `table[ids]` reads in NumPy/JAX indexing, which `eqx.nn.Embedding` uses: a
    negative id counts from the end (-1 is the last row) and an id still outside
    `[0, vocab)` is clamped to the nearest row. Done on the global id, before any device
    looks for it in its shard, so every context reads the same row."""
    ids = ids.astype(jnp.int32)
    ids = jnp.where(ids < 0, ids + jnp.int32(vocab), ids)
    return jnp.clip(ids, 0, vocab - 1)


def _summed(rows, collective):
    """`collective(rows)`, the sum over the vocabulary shards of each device's rows, of
    which one is the row and the rest zeros: exact in any dtype. On CPU a 16-bit one is
    summed in float32: XLA's CPU compiler aborts the process on a bfloat16 all-reduce in
    a `shard_map` that leaves other mesh axes to XLA ("Invalid binary instruction opcode
    copy"; jax 0.10 and 0.11), a data x tensor-parallel mesh's embedding."""
    if rows.dtype.itemsize >= 4 or _target.current(rows).platform != "cpu":
        return collective(rows)
    return collective(rows.astype(jnp.float32)).astype(rows.dtype)


def _lookup(table, ids, start):
    """Rows `ids - start` of `table` (normalised ids), zeros for ids outside it."""
    local = ids - start
    hit = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
    return jnp.where(hit[..., None], rows, jnp.zeros((), table.dtype))


class Embedding(eqx.Module):
    """`eqx.nn.Embedding` with its table `(num_embeddings, embedding_size)` split over the
    mesh axis `axis` along the vocabulary (`num_embeddings`).

    Takes integer ids of any shape `(...)` and returns `(..., embedding_size)`,
    replicated over `axis`, or with `sequence_parallel=True` sharded over `axis` along
    the sequence (the last dimension of the ids). Ids are read as `eqx.nn.Embedding`
    reads them (`table[id]`): a negative id counts from the end (-1 is the last row)
    and an id still out of range is clamped to the first or last row, in every context
    (on a mesh the id is resolved before the device holding its row is found).
    """

    weight: Array
    num_embeddings: int = field(static=True)
    embedding_size: int = field(static=True)
    rule: TableRule = field(static=True)

    def __init__(self, num_embeddings: Optional[int] = None,
                 embedding_size: Optional[int] = None, weight: Optional[Array] = None,
                 dtype=None, *, key=None, axis: Optional[str] = "tp",
                 sequence_parallel: bool = False, fsdp_axis: Optional[str] = None,
                 fsdp_dim: Optional[int] = None):
        """**Arguments:**

        - `num_embeddings`, `embedding_size`, `weight`, `dtype`, `key`: as
          `eqx.nn.Embedding` (the same key gives the same table).
        - `axis`: the mesh axis the vocabulary is split over (None: not split).
        - `sequence_parallel`: return the output sharded over `axis` along the sequence
          (a reduce-scatter instead of a sum).
        - `fsdp_axis`: also shard the table over this mesh axis (FSDP): along
          `embedding_size` by default, or `fsdp_dim=0` (the vocabulary, after `axis`);
          the ids' batch dimension (dim 0) is sharded over it.
        """
        _specs.check_fsdp_dim("Embedding", fsdp_axis, fsdp_dim)
        if axis is None and sequence_parallel:
            raise ValueError("Embedding: sequence_parallel=True scatters the sequence over "
                             "axis, but axis is None (a replicated table); give the "
                             "tensor-parallel axis (e.g. axis='tp') or leave "
                             "sequence_parallel False.")
        if weight is None:  # else eqx.nn.Embedding reads the sizes from it
            num_embeddings = _validate.positive_int("Embedding", "num_embeddings",
                                                    num_embeddings)
            embedding_size = _validate.positive_int("Embedding", "embedding_size",
                                                    embedding_size)
        styles = [_specs.Row(axis, sequence_parallel) if axis is not None else None]
        if fsdp_axis is not None:
            if fsdp_dim is not None and not (_validate.is_int(fsdp_dim)
                                             and fsdp_dim in (0, 1)):
                raise ValueError(f"Embedding: fsdp_dim must be None, 0 or 1 (a table "
                                 f"dimension), got {fsdp_dim!r}.")
            styles.append(_specs.FSDP(fsdp_axis, None if fsdp_dim is None else 1 - fsdp_dim))
        rule = TableRule.of(_specs.compose(*styles, where="Embedding"), "Embedding")
        if weight is None:
            param_dtype("Embedding", dtype)
        table = eqx.nn.Embedding(num_embeddings, embedding_size, weight, dtype, key=key)
        self.weight = table.weight
        self.num_embeddings, self.embedding_size = table.num_embeddings, table.embedding_size
        self.rule = rule

    @classmethod
    def from_embedding(cls, embedding: eqx.nn.Embedding, rule: _specs.Rule,
                       where: str = "Embedding"):
        """An `Embedding` with `embedding`'s table and the sharding `rule` (Row and FSDP
        styles, as a plan gives them for a linear weight; see `TableRule`)."""
        obj = object.__new__(cls)
        for name, value in (("weight", embedding.weight),
                            ("num_embeddings", embedding.num_embeddings),
                            ("embedding_size", embedding.embedding_size),
                            ("rule", TableRule.of(rule, where))):
            object.__setattr__(obj, name, value)
        return obj

    def with_rule(self, rule: TableRule):
        """The same table under `rule` (with no style left: replicated, and still called
        on ids of any shape, as `eqx.nn.Embedding`, which takes one id, is not)."""
        return Embedding.from_embedding(self, rule)

    def collectives(self) -> tuple[list, list]:
        """The collectives of the forward and of the backward pass (`fusedpar.describe`)."""
        tp, f = self.rule.tp, self.rule.fsdp
        fwd = [f"all_gather table over {f.axis}"] if f else []
        bwd = []
        if tp is not None and tp.sequence_parallel:
            fwd.append(f"psum_scatter rows(seq) over {tp.axis}")
            bwd.append(f"all_gather dy(seq) over {tp.axis}")
        elif tp is not None:
            fwd.append(f"psum rows over {tp.axis}")
        bwd += [f"reduce_scatter dtable over {f.axis}"] if f else []
        return fwd, bwd

    def __call__(self, x, *, key=None) -> Array:
        """**Arguments:**

        - `x`: integer ids, a scalar or `(...)`; inside `shard_map`, the local shard.
          Under `jax.vmap` the vmapped axes are leading dimensions of `x`.
        - `key`: ignored; for compatibility with the rest of the Equinox API.

        **Returns:** `(..., embedding_size)` (or its local shard inside `shard_map`).
        """
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"Embedding: x must be integer ids, got dtype {x.dtype}.")
        if isinstance(self.weight, QuantizedArray):
            raise TypeError("Embedding: weight is a QuantizedArray; the embedding looks up a "
                            "floating table (fusedpar.quantize leaves embeddings as they "
                            "are): give it weight.dequantize().")
        tp = self.rule.tp
        hint = (f"sequence_parallel=True inside shard_map scatters the sequence over "
                f"{tp.axis!r}, so call the embedding on (..., seq) ids and vmap over the "
                "batch only" if self.rule.sequence_parallel else "")
        return _folding.fold(self._apply, (x,), self, where="Embedding", hint=hint)

    def _apply(self, ids):
        kind, mesh = _context.detect("Embedding", self.rule.axes, self.weight,
                                     self.rule)
        if self.rule.sequence_parallel and ids.ndim < 1 and kind != _context.DENSE:
            raise ValueError("Embedding: sequence_parallel=True needs ids (..., seq) whose "
                             "last dimension is the sequence, got a scalar id.")
        if kind != _context.LOCAL:
            _specs.check_param_shapes("Embedding", self)
        if kind == _context.LOCAL:
            out = self._local(ids, self.rule)
        elif kind == _context.DENSE:
            out = self._dense(ids)
        else:
            out = self._global(ids, mesh)
        ids_spec, out_spec = self._specs(self.rule, ids.ndim)
        _whole_model.record("Embedding", self.weight, [(ids, ids_spec)], (out, out_spec),
                            ids.ndim - 1 if self.rule.sequence_parallel else None)
        return out

    @staticmethod
    def _specs(rule, ndim):
        return rule.activation_specs(ndim, _specs.has_data_dim(rule, ndim + 1))

    def _dense(self, ids, table=None):
        table = self.weight if table is None else table
        return jnp.take(table, _normalize(ids, self.num_embeddings), axis=0)

    def _global(self, ids, mesh):
        rule = self.rule
        data = _specs.has_data_dim(rule, ids.ndim + 1)
        if rule.fsdp is not None and not data:
            rule = rule.without_fsdp()  # the table is gathered on entry to shard_map
        if not rule.axes:
            return self._dense(ids)
        sizes = _specs.mesh_sizes(mesh)
        pspecs = _specs.layer_param_specs(self, "Embedding", rule)
        _specs.check_spec("Embedding.weight", self.weight.shape, pspecs.weight, sizes,
                          vocab_dim=0)
        ids_spec, out_spec = rule.activation_specs(ids.ndim, data)
        fixes = _specs.decoding_fixes(rule, data, ids.ndim - 1, ids.shape[0] if ids.ndim else None)
        _specs.check_spec(f"Embedding: ids of shape {ids.shape}", ids.shape, ids_spec, sizes,
                          what="input", fixes=fixes)
        if rule.sequence_parallel:
            _specs.check_spec(f"Embedding: ids of shape {ids.shape}", ids.shape + (1,),
                              out_spec, sizes, what="input", fixes=fixes)
        # The output has one more dimension than the ids: lay both out as the output.
        # Lax collectives only: the mesh's other Auto axes go on a batch of ids.
        padded, out_spec, manual = _context.layouts(
            "Embedding", mesh, rule.axes, ids, P(*ids_spec, None), out_spec,
            every_axis=False, batched=ids.ndim >= 2)
        ids_spec = P(*tuple(padded)[:ids.ndim])
        return _context.shard_mapped(
            functools.partial(Embedding._local, rule=rule), mesh, rule.axes, manual, self,
            pspecs, [ids], [ids_spec], out_spec, check_vma=True, where="Embedding")

    def _local(self, ids, rule):
        sizes = {a: lax.axis_size(a) for a in rule.axes}
        over = _context.shard_map_sizes(rule.axes)
        shape = (self.num_embeddings, self.embedding_size)
        want = rule.local_weight_shape(shape, sizes)
        if self.weight.shape != want:
            raise ValueError(
                f"Embedding: inside shard_map over {over} the local table must have shape "
                f"{want} (spec {rule.param_specs('Embedding')['weight']} of {shape}), got "
                f"{self.weight.shape}; pass the embedding through shard_map as an argument "
                "with in_specs from fusedpar.param_specs.")
        ids_spec = self._specs(rule, ids.ndim)[0]
        tp = rule.tp
        _vma.check_layout(
            "Embedding", "the ids", ids, ids_spec, _specs.layout_axes(rule, ids_spec),
            (f"a vocabulary-parallel lookup sums every device's rows over {tp.axis!r}, so "
             f"the ids are replicated over it; sequence_parallel=True then scatters the "
             f"output along the sequence" if tp else "") +
            (f"; FSDP takes the batch (dim 0) sharded over {rule.fsdp.axis!r}"
             if rule.fsdp else ""))
        table = self.weight
        if rule.fsdp is not None:
            table = lax.all_gather(table, rule.fsdp.axis, axis=rule.table_fsdp_dim, tiled=True)
        if tp is None:
            return self._dense(ids, table)
        n = table.shape[0]
        rows = _lookup(table, _normalize(ids, self.num_embeddings),
                       lax.axis_index(tp.axis) * n)
        if not tp.sequence_parallel:
            return _summed(rows, lambda r: lax.psum(r, tp.axis))
        seq, size = ids.shape[-1], sizes[tp.axis]
        if seq % size:
            raise ValueError(f"Embedding: inside shard_map over {over} the ids' sequence "
                             f"(last dim, {seq}) must divide by {size} to be scattered, got "
                             f"ids of shape {ids.shape}.")
        return _summed(rows, lambda r: _scattered(r, tp.axis, ids.ndim - 1, size))


def _scattered(rows, axis, dim, size):
    """`psum_scatter` of `rows` along `dim` over `axis`: zeros where it is empty, which
    XLA refuses to scatter (a sequence of length 0: nothing to sum)."""
    if 0 not in rows.shape:
        return _definition.psum_scatter(rows, axis, dim)
    shape = rows.shape[:dim] + (rows.shape[dim] // size,) + rows.shape[dim + 1:]
    axes = _vma.varying_axes(rows) | ({axis} if _vma.typed(axis) else set())
    return _vma.as_varying(jnp.zeros(shape, rows.dtype), axes)
