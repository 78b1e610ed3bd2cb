"""Bad input everywhere in the public API: one test per row of docs/errors.md.

Each row is (API, the bad input, a call that makes it, the exception, fragments its
message must contain). The fragments are what a user needs: the argument, the shapes or
axis sizes involved, and what is valid. Nothing here compiles or runs a collective (the
errors come at trace time, under `jax.eval_shape`), so the whole table takes seconds.

`python tests/test_errors.py` prints the table as Markdown, with the actual messages,
for docs/errors.md.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # under pytest, conftest.py sets this up
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, os.path.dirname(__file__))

import contextlib
import dataclasses
import importlib.util
import io
import pathlib
import subprocess
import tempfile
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fusedpar
from helpers import mesh

pytestmark = pytest.mark.timeout(60)

AGM, MRS = fusedpar.all_gather_matmul, fusedpar.matmul_reduce_scatter
S = jax.ShapeDtypeStruct
KEY = jax.random.key(0)
ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Row:
    api: str
    case: str
    call: Callable
    error: type  # or a tuple of types
    fragments: tuple
    xfail: str = ""  # not caught yet: why (see the report); strict, so a fix flips it


def in_shard_map(f, x_shape=(4, 8), w_shape=(8, 12), *, x_dtype=jnp.float32,
                 w_dtype=None, n=4, check_vma=True):
    """Trace `f(x, w)` per device inside shard_map over a ring "x" of `n` devices; `x` has
    the local shape `x_shape` (sharded along dim 0, or replicated if it is a scalar)."""
    def call():
        x_spec = P("x") if x_shape else P()
        fn = jax.shard_map(f, mesh=mesh((n,), ("x",)), in_specs=(x_spec, P()),
                           out_specs=P("x"), check_vma=check_vma)
        xs = (n * x_shape[0],) + tuple(x_shape[1:]) if x_shape else ()
        return jax.eval_shape(fn, S(xs, x_dtype), S(w_shape, w_dtype or x_dtype))
    return call


def partially_manual(f):
    """Trace `f(x, w)` inside a shard_map over a (2, 4) ("data", "tp") mesh that is manual
    over "tp" only (x (4, 8) per device, w (8, 12))."""
    def call():
        fn = jax.shard_map(f, mesh=mesh((2, 4), ("data", "tp")), in_specs=(P("tp"), P()),
                           out_specs=P("tp"), axis_names={"tp"}, check_vma=False)
        return jax.eval_shape(fn, S((16, 8), jnp.float32), S((8, 12), jnp.float32))
    return call


def global_call(layer, x_shape, mesh_shape=(2, 4), names=("fsdp", "tp"), dtype=jnp.float32):
    """Trace `layer(x)` on a global array under `jax.set_mesh`."""
    def call():
        with jax.set_mesh(mesh(mesh_shape, names)):
            return jax.eval_shape(layer, S(x_shape, dtype))
    return call


def _grad_through_checkpoint(layer, differentiate=True):
    """`grad(checkpoint(sum(layer(x))))` (or the checkpoint alone), of a fresh function at
    each call: JAX caches a checkpoint's trace by function, and a cached one is not traced,
    so not checked, again."""
    def call(x):
        f = jax.checkpoint(lambda x: jnp.sum(layer(x)))
        return (jax.grad(f) if differentiate else f)(x)
    return call


def local_call(layer, x_spec, x_shape, dtype=jnp.float32, vmaps=0):
    """Trace `layer` inside shard_map, its parameters passed with `param_specs` (applied
    under `vmaps` nested jax.vmaps)."""
    def call():
        params, static = eqx.partition(layer, eqx.is_array)
        m = mesh((2, 4), ("fsdp", "tp"))

        def body(p, x):
            f = eqx.combine(p, static)
            for _ in range(vmaps):
                f = jax.vmap(f)
            return f(x)

        fn = jax.shard_map(body, mesh=m, in_specs=(fusedpar.param_specs(layer), x_spec),
                           out_specs=P())
        return jax.eval_shape(fn, params, S(x_shape, dtype))
    return call


def ce_call(logits_shape, labels_shape, logits_dtype=jnp.float32, labels_dtype=jnp.int32,
            mesh_shape=None, specs=None, **kw):
    """Trace `cross_entropy`: with no mesh, on global arrays under a ("tp",) mesh of
    `mesh_shape`, or inside shard_map over a (2, 4) ("fsdp", "tp") mesh with `specs`."""
    def call():
        args = S(logits_shape, logits_dtype), S(labels_shape, labels_dtype)
        f = lambda x, y: fusedpar.cross_entropy(x, y, **kw)  # noqa: E731
        if specs is not None:
            return jax.eval_shape(jax.shard_map(f, mesh=mesh((2, 4), ("fsdp", "tp")),
                                                in_specs=specs, out_specs=P()), *args)
        if mesh_shape is None:
            return jax.eval_shape(f, *args)
        with jax.set_mesh(mesh(mesh_shape, ("tp",))):
            return jax.eval_shape(f, *args)
    return call


def specs_of(model, x, call):
    """`fusedpar.shard_map_specs` of `model` on an input of shape `x`, applied by `call`."""
    return lambda: fusedpar.shard_map_specs(model, S(x, jnp.int32), call=call)


def lazy(make):
    """`make()` builds the bad input itself (a constructor that raises)."""
    return make


def mlp():
    k1, k2 = jax.random.split(KEY)
    return eqx.nn.Sequential([eqx.nn.Linear(8, 16, key=k1), eqx.nn.Linear(16, 8, key=k2)])


def _col(*a, **k):
    return fusedpar.ColumnLinear(*a, key=KEY, **k)


def _emb(vocab=16, **k):
    return fusedpar.Embedding(vocab, 8, key=KEY, **k)


def _legacy_mesh_call():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # JAX's, for `with mesh:`
        with mesh((4,), ("tp",)):
            return _col(8, 8)(jnp.ones((2, 8)))


def _few_threads():
    """An interpreted TPU kernel traced as if JAX had started with NPROC=4."""
    old = os.environ.get("NPROC")
    os.environ["NPROC"] = "4"
    try:
        return in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu"), (8, 128),
                            (128, 128), n=8, check_vma=False)()
    finally:
        os.environ["NPROC"] = old if old is not None else ""


def _other_mesh_call():
    """A layer placed on a (2, 4) mesh, traced under a (4, 2) mesh of the same axes."""
    layer = fusedpar.shard(_col(8, 8), mesh((2, 4), ("fsdp", "tp")))
    with jax.set_mesh(mesh((4, 2), ("fsdp", "tp"))):
        return eqx.filter_eval_shape(lambda l, x: l(x), layer, jnp.ones((2, 8)))


def _swapped_axes_call():
    """A layer placed on a (2, 2, 2) ("data", "fsdp", "tp") mesh, traced under one whose
    first two names are swapped: the sizes agree, the axes do not."""
    layer = fusedpar.shard(_col(8, 8, fsdp_axis="fsdp"),
                           mesh((2, 2, 2), ("data", "fsdp", "tp")))
    with jax.set_mesh(mesh((2, 2, 2), ("fsdp", "data", "tp"))):
        return eqx.filter_eval_shape(lambda l, x: l(x), layer, jnp.ones((4, 8)))


def _restore_other_model():
    """An (8, 16) weight read from a checkpoint into a sharded skeleton's (8, 8) one (what
    `eqx.tree_deserialise_leaves` asks per leaf; it adds the leaf's path)."""
    f = io.BytesIO()
    np.save(f, np.zeros((8, 16), np.float32))
    f.seek(0)
    skeleton = fusedpar.shard(eqx.filter_eval_shape(lambda: _col(8, 8)),
                              mesh((2, 4), ("fsdp", "tp")))
    fusedpar.deserialise_filter_spec(f, skeleton.weight)


def _explicit_data_fsdp_call():
    """An FSDP layer on a batch of 6 placed over "data" (2) of an Explicit (2, 2, 2) mesh:
    the layer adds "fsdp" to that batch (4 ways)."""
    m = mesh((2, 2, 2), ("data", "fsdp", "tp"), AxisType.Explicit)
    with jax.set_mesh(m):
        layer = fusedpar.shard(_col(8, 16, fsdp_axis="fsdp"), m)
        x = jax.device_put(jnp.ones((6, 4, 8)), NamedSharding(m, P("data")))
        eqx.filter_jit(lambda l, x: l(x))(layer, x)


def _restore(saved, skeleton_dtype):
    """A checkpoint's (8, 8) array of `saved`'s dtype read into a skeleton of another:
    bfloat16 (raw bytes to NumPy) into float16; a quantized weight's int8 values into
    the dense model's bfloat16."""
    def restore():
        f = io.BytesIO()
        jnp.save(f, jnp.zeros((8, 8), saved))
        f.seek(0)
        skeleton = fusedpar.shard(
            eqx.filter_eval_shape(lambda: _col(8, 8, dtype=skeleton_dtype)),
            mesh((2, 4), ("fsdp", "tp")))
        fusedpar.deserialise_filter_spec(f, skeleton.weight)

    return restore


def _restore_float_into_quantized():
    """A bfloat16 checkpoint (of the model before `fusedpar.quantize`) read into a
    quantized skeleton's int8 values, which no cast makes."""
    f = io.BytesIO()
    jnp.save(f, jnp.zeros((8, 8), jnp.bfloat16))
    f.seek(0)
    skeleton = fusedpar.shard(eqx.filter_eval_shape(lambda: fusedpar.quantize(_col(8, 8))),
                              mesh((2, 4), ("fsdp", "tp")))
    fusedpar.deserialise_filter_spec(f, skeleton.weight.values)


def _emb_head():
    """Token ids -> vocabulary-parallel embedding -> column-parallel head, per example."""
    embed, head = _emb(), _col(8, 16)
    return (embed, head), lambda m, t: jax.vmap(jax.vmap(lambda i: m[1](m[0](i))))(t)


def _sp_mlp(head):
    """A sequence-parallel up/down pair on (batch, seq, 8) floats, then `head`'s style,
    every layer FSDP too (the README's plan)."""
    k = jax.random.split(KEY, 3)
    model = [eqx.nn.Linear(8, 16, key=k[0]), eqx.nn.Linear(16, 8, key=k[1]),
             eqx.nn.Linear(8, 8, key=k[2])]
    return fusedpar.parallelize(model, {"0": fusedpar.Column(sequence_parallel=True),
                                        "1": fusedpar.Row(sequence_parallel=True),
                                        "2": head, "*": "fsdp"})


def _sp_mlp_specs(head, between):
    model = _sp_mlp(head)
    return lambda: fusedpar.shard_map_specs(
        model, S((4, 8, 8), jnp.float32), call=lambda m, x: m[2](between(m[1](m[0](x)))))


OPS = [
    Row("ops", "scattered dimension not divisible by the ring",
        in_shard_map(lambda x, w: MRS(x, w, "x", dim=0), (3, 8)), ValueError,
        ("matmul_reduce_scatter", "dim 0 of the result (shape (3, 12)) is 3",
         "not divisible by 4")),
    Row("ops", "unknown axis name",
        in_shard_map(lambda x, w: AGM(x, w, "y")), ValueError,
        ("axis_name='y' is not a bound mesh axis", "the enclosing shard_map binds ('x',)")),
    Row("ops", "axis name not a string",
        in_shard_map(lambda x, w: AGM(x, w, 3)), TypeError,
        ("all_gather_matmul: axis_name must be a mesh axis name (a str)", "got 3")),
    Row("ops", "axis named twice",
        in_shard_map(lambda x, w: AGM(x, w, ("x", "x"))), ValueError,
        ("all_gather_matmul: axis_name=('x', 'x') names an axis twice",)),
    Row("ops", "called outside shard_map",
        lambda: AGM(jnp.ones((4, 8)), jnp.ones((8, 12)), "x"), ValueError,
        ("axis_name='x' is not a bound mesh axis", "no shard_map is active",
         "inside jax.shard_map")),
    Row("ops", "w not 2-D",
        in_shard_map(lambda x, w: AGM(x, w, "x"), w_shape=(1, 8, 12)), ValueError,
        ("w must be 2-D (k, n)", "w.shape=(1, 8, 12)")),
    Row("ops", "x a scalar",
        in_shard_map(lambda x, w: AGM(x, w, "x"), ()),
        ValueError, ("x must have at least 1 dimension (..., k)", "scalar")),
    Row("ops", "contracting dimensions differ",
        in_shard_map(lambda x, w: AGM(x, w, "x"), w_shape=(4, 12)), ValueError,
        ("contracting dimensions differ: x has 8, w has 4",)),
    Row("ops", "gather='rhs', dim=0: x's k is not N x w's rows",
        in_shard_map(lambda x, w: AGM(x, w, "x", gather="rhs", dim=0)), ValueError,
        ("x has 8, w has 32", "w gathered along dim 0 over 4 devices has 32 rows")),
    Row("ops", "x and w dtypes differ",
        in_shard_map(lambda x, w: AGM(x, w, "x"), w_dtype=jnp.bfloat16), TypeError,
        ("x and w must have the same dtype", "x float32 and w bfloat16", "w.astype(x.dtype)")),
    Row("ops", "boolean dtype",
        in_shard_map(lambda x, w: MRS(x, w, "x"), x_dtype=jnp.bool_), TypeError,
        ("x and w must be floating point or integer, got bool",)),
    Row("ops", "TPU kernel interpreted on CPU with too few threads (NPROC)",
        lambda: _few_threads(), RuntimeError,
        ("all_gather_matmul: backend 'pallas_tpu' runs the TPU kernels in interpret mode",
         "8 simulated devices", "at least 9 threads (NPROC=4)", "the kernel would hang",
         "Set NPROC=9")),
    Row("ops", "not an array",
        in_shard_map(lambda x, w: AGM([[1.0] * 8] * 4, w, "x")), TypeError,
        ("x must be an array, got list",)),
    Row("ops", "unknown backend",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="nope")), ValueError,
        ("unknown backend='nope'", "valid backends are 'auto', 'reference', 'ring'")),
    Row("ops", "gather neither 'lhs' nor 'rhs'",
        in_shard_map(lambda x, w: AGM(x, w, "x", gather="both")), ValueError,
        ("gather must be 'lhs' or 'rhs', got 'both'",)),
    Row("ops", "gather='lhs', dim is the contracting dimension",
        in_shard_map(lambda x, w: AGM(x, w, "x", dim=1)), ValueError,
        ("dim=1 is not valid for gather='lhs' with x of shape (4, 8)", "valid dims: 0")),
    Row("ops", "gather='rhs', dim not 0 or 1",
        in_shard_map(lambda x, w: AGM(x, w, "x", gather="rhs", dim=2)), ValueError,
        ("dim=2 is not valid for gather='rhs'", "valid dims: 0, 1")),
    Row("ops", "matmul_reduce_scatter, dim out of range",
        in_shard_map(lambda x, w: MRS(x, w, "x", dim=-3)), ValueError,
        ("dim=-3 is not valid for the result of shape (4, 12)", "valid dims: 0, 1")),
    Row("ops", "dim not an int",
        in_shard_map(lambda x, w: AGM(x, w, "x", dim=0.0)), TypeError,
        ("dim must be an int, got 0.0",)),
    Row("ops", "bidirectional=True with an odd block",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="ring", bidirectional=True), (3, 8)),
        ValueError, ("bidirectional=True splits each ring block in two",
                     "a block has 3 rows", "x (3, 8), w (8, 12), 4 devices",
                     "use bidirectional=False")),
    Row("ops", "explicit backend that cannot run the dtype",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu"), x_dtype=jnp.float16),
        NotImplementedError, ("backend 'pallas_tpu' cannot run this call",
                              "dtype float16 is not supported")),
    Row("ops", "explicit backend that cannot run the shape",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_gpu")), NotImplementedError,
        ("backend 'pallas_gpu' cannot run this call", "a ring step multiplies (2, 8) by (8, 12)",
         "m=2 is not a multiple of 16", "use the 'ring' backend")),
    Row("ops", "fused TPU kernel in a shard_map that leaves a mesh axis to XLA",
        partially_manual(lambda x, w: AGM(x, w, "tp", backend="pallas_tpu")),
        NotImplementedError, ("all_gather_matmul: backend 'pallas_tpu' cannot run this call",
                              "leaves mesh axes {'data': 2} to XLA",
                              "leave axis_names out", "backend='ring'")),
    Row("ops", "comm_dtype not a supported narrow dtype",
        in_shard_map(lambda x, w: AGM(x, w, "x", comm_dtype=jnp.float16)), ValueError,
        ("comm_dtype must be None (send the input dtype) or one of jnp.int8, "
         "jnp.float8_e4m3fn", "got float16")),
    Row("ops", "grad_comm_dtype not a supported narrow dtype",
        in_shard_map(lambda x, w: MRS(x, w, "x", grad_comm_dtype="int4")), ValueError,
        ("grad_comm_dtype must be None", "jnp.int8, jnp.float8_e4m3fn", "got int4")),
    Row("ops", "comm_dtype with integer inputs",
        in_shard_map(lambda x, w: AGM(x, w, "x", comm_dtype=jnp.int8), x_dtype=jnp.int8),
        TypeError, ("comm_dtype=int8 quantizes the operands it sends",
                    "only defined for real floating point inputs", "x and w are int8",
                    "Pass comm_dtype=None")),
    Row("ops", "grad_comm_dtype with complex inputs",
        in_shard_map(lambda x, w: MRS(x, w, "x", grad_comm_dtype=jnp.float8_e4m3fn),
                     x_dtype=jnp.complex64), TypeError,
        ("grad_comm_dtype=float8_e4m3fn quantizes", "x and w are complex64")),
    Row("ops", "comm_dtype on a backend that cannot send quantized payloads",
        in_shard_map(lambda x, w: MRS(x, w, "x", backend="pallas_tpu",
                                      comm_dtype=jnp.float8_e4m3fn), check_vma=False),
        NotImplementedError, ("backend 'pallas_tpu' cannot run this call",
                              "comm_dtype=float8_e4m3fn: the fused TPU reduce-scatter "
                              "kernels", "backend='ring' requantizes it")),
    Row("ops", "explicit kernel backend whose backward step no tile fits",
        in_shard_map(lambda x, w: jax.grad(
            lambda x, w: AGM(x, w, "x", backend="pallas_gpu", options={"kernels": "mosaic"})
            .astype(jnp.float32).sum(), (0, 1))(x, w), (64, 32), (32, 64),
            x_dtype=jnp.bfloat16, n=2, check_vma=False), NotImplementedError,
        ("all_gather_matmul: the backward pass of ag_rows runs rs_rows on local x(128, 64) "
         "w(64, 32) (bfloat16), which backend 'pallas_gpu' cannot run",
         "m and n must be multiples of 64", "backend='ring' runs both")),
    Row("ops", "TPU kernel tiled from HBM, no tile divides a dimension",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu",
                                      options={"vmem": False}), (8, 2000), (2000, 128),
                     check_vma=False), NotImplementedError,
        ("no tile of at most block_k=1024 divides the dimension of length 2000",
         "options={'block_k': ...}")),
    Row("ops", "TPU kernel tiles larger than the chip's VMEM",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu", options={
            "vmem": False, "block_m": 4096, "block_k": 4096, "block_n": 4096}),
            (4096, 4096), (4096, 4096), check_vma=False), NotImplementedError,
        ("tiles (2048, 4096, 4096) need 288.0 MiB of VMEM, more than the 84 MiB",
         "TPU v5e kernel plans with", "pass smaller block_m/block_k/block_n")),
    Row("ops", "TPU kernel built for TPU, a ring window off Mosaic's tiles",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu", gather="rhs", dim=1,
                                      options={"interpret": False}), (16, 128), (128, 64),
                     check_vma=False), NotImplementedError,
        ("ag_cols: backend 'pallas_tpu' cannot build this call for TPU",
         "a window of 32 along dimension 1 of w (128, 64) float32",
         "not a multiple of 128 lanes", "Mosaic for TPU v5e lays float32 out in (8, 128) tiles",
         "over 4 devices, bidirectional halves", "pad the operands")),
    Row("ops", "TPU kernel option: unknown TPU generation",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu",
                                      options={"chip": "v9"}), check_vma=False), ValueError,
        ("options['chip']='v9'", "unknown TPU generation 'v9'", "v5e, v5p, v6e")),
    Row("ops", "TPU kernel option: TensorCores not 1 or 2",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu",
                                      options={"cores": 3}), check_vma=False), ValueError,
        ("options['cores']=3 must be 1 or 2",)),
    Row("ops", "TPU kernel option: two TensorCores on a one-core chip",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu",
                                      options={"chip": "v6e", "cores": 2}), check_vma=False),
        ValueError, ("options['chip']='v6e', options['cores']=2",
                     "a TPU v6e device has 1 TensorCore(s) to split a step between, not 2")),
    Row("ops", "TPU kernel inside shard_map(check_vma=True)",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu")),
        NotImplementedError,
        ("all_gather_matmul: backend 'pallas_tpu' cannot run this call",
         "checks varying axes (check_vma=True", "called with check_vma=False",
         "backend='ring' or 'auto'")),
    Row("ops", "GPU kernel tile option not a power of 2",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_gpu", bidirectional=False,
                                      options={"block_m": 24}), (32, 16), (16, 32),
                     check_vma=False), ValueError,
        ("options['block_m']=24 must be a power of 2",)),
    Row("ops", "explain: unknown op",
        lambda: fusedpar.explain("all_gather", S((4, 8), jnp.float32),
                                 S((8, 12), jnp.float32), 4), ValueError,
        ("explain: op must be 'all_gather_matmul' or 'matmul_reduce_scatter'",)),
    Row("ops", "dim a bool",
        in_shard_map(lambda x, w: AGM(x, w, "x", dim=True)), TypeError,
        ("dim must be an int, got True",)),
    Row("ops", "integer reduce_dtype",
        in_shard_map(lambda x, w: MRS(x, w, "x", backend="ring", reduce_dtype=jnp.int8)),
        TypeError, ("reduce_dtype must be a floating dtype", "got int8")),
    Row("ops", "a floating reduce_dtype for integer operands",
        in_shard_map(lambda x, w: MRS(x, w, "x", reduce_dtype=jnp.float32), x_dtype=jnp.int32),
        TypeError, ("reduce_dtype float32 would round the sums of int32 operands",
                    "pass jnp.int32")),
    Row("ops", "options not a dict",
        in_shard_map(lambda x, w: AGM(x, w, "x", options=["block_m"])),
        TypeError, ("options must be a dict", "['block_m']")),
    Row("ops", "a fusedpar.QuantizedArray as w",
        in_shard_map(lambda x, w: AGM(x, fusedpar.QuantizedArray(
            jnp.zeros((8, 12), jnp.int8), jnp.ones((1, 12), jnp.float32), axis=0), "x")),
        TypeError, ("w is a fusedpar.QuantizedArray", "w.as_payload()")),
    Row("ops", "a ring axis jax.vmap binds, not a shard_map",
        lambda: jax.eval_shape(jax.vmap(lambda x: AGM(x, jnp.ones((8, 12)), "v"),
                                        axis_name="v"), S((4, 2, 8), jnp.float32)),
        ValueError, ("axis 'v' is not an axis of the mesh in context", "jax.vmap",
                     "inside jax.shard_map")),
    Row("ops", "reduce_dtype narrower than the operands (float16 sums of bfloat16)",
        in_shard_map(lambda x, w: MRS(x, w, "x", reduce_dtype=jnp.float16),
                     x_dtype=jnp.bfloat16),
        ValueError, ("reduce_dtype float16 has a narrower range than the operands' bfloat16",
                     "6.55e+04 < 3.39e+38", "jnp.float32")),
    Row("ops", "forward-mode differentiation (jax.jacfwd of the op)",
        lambda: jax.eval_shape(jax.jacfwd(jax.shard_map(
            lambda x, w: AGM(x, w, "x", backend="reference"), mesh=mesh((4,), ("x",)),
            in_specs=(P("x"), P()), out_specs=P("x"))), S((16, 8), jnp.float32),
            S((8, 12), jnp.float32)),
        TypeError, ("all_gather_matmul: forward-mode differentiation", "jax.jacrev")),
    Row("ops", "second-order differentiation through the fused kernels (grad of grad)",
        lambda: jax.eval_shape(jax.grad(lambda w: jnp.sum(jax.grad(lambda w: jnp.sum(
            jax.shard_map(lambda x, w: AGM(x, w, "x", backend="pallas_tpu"),
                          mesh=mesh((2,), ("x",)), in_specs=(P("x"), P()), out_specs=P(),
                          check_vma=False)(jnp.ones((8, 8)), w) ** 3))(w) ** 2)),
            S((8, 128), jnp.float32)),
        NotImplementedError, ("backend 'pallas_tpu': second-order differentiation",
                              "fused kernels have no derivative", "backend='ring'")),
    Row("ops", "integer preferred_element_type",
        in_shard_map(lambda x, w: AGM(x, w, "x", preferred_element_type=jnp.int32)),
        TypeError, ("preferred_element_type must be a floating dtype", "got int32")),
    Row("ops", "an integer preferred_element_type narrower than integer operands",
        in_shard_map(lambda x, w: AGM(x, w, "x", preferred_element_type=jnp.int8),
                     x_dtype=jnp.int32),
        TypeError, ("for int32 operands, an integer dtype at least as wide", "got int8")),
    Row("ops", "bidirectional not a bool",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="ring", bidirectional="no")),
        TypeError, ("bidirectional must be True, False or None, got 'no'",)),
    Row("ops", "unroll not a bool",
        in_shard_map(lambda x, w: MRS(x, w, "x", backend="ring", unroll=1)),
        TypeError, ("unroll must be True, False or None, got 1",)),
    Row("ops", "keep_gathered not a bool",
        in_shard_map(lambda x, w: AGM(x, w, "x", keep_gathered=None)),
        TypeError, ("keep_gathered must be True or False, got None",)),
    Row("ops", "w_transposed not a bool",
        in_shard_map(lambda x, w: MRS(x, w, "x", w_transposed="yes")),
        TypeError, ("w_transposed must be True or False, got 'yes'",)),
    Row("ops", "w_resident without w_transposed",
        in_shard_map(lambda x, w: MRS(x, w, "x", w_resident=True)),
        ValueError, ("w_resident=True describes a w passed with w_transposed=True",
                     "leave w_resident False")),
    Row("ops", "gather='lhs' with a 1-D x",
        in_shard_map(lambda x, w: AGM(x, w, "x"), (8,)), ValueError,
        ("gather='lhs' gathers a dimension of x besides the contracting one",
         "x needs at least 2 dims (..., rows, k), got x of shape (8,)",
         "reshape it to (1, 8)")),
    Row("ops", "an option no backend reads (auto)",
        in_shard_map(lambda x, w: AGM(x, w, "x", options={"bogus": 1}), check_vma=False),
        ValueError, ("options ['bogus'] are not read by any backend", "valid keys: 'block_k'")),
    Row("ops", "explain: unknown platform",
        lambda: fusedpar.explain("all_gather_matmul", S((4, 8), jnp.float32),
                                 S((8, 12), jnp.float32), 4, platform="GPU"), ValueError,
        ("explain: platform must be one of 'cpu', 'gpu', 'tpu', 'cuda'", "got 'GPU'")),
    Row("ops", "explain: a target name instead of a mesh",
        lambda: fusedpar.explain("all_gather_matmul", S((4, 8), jnp.float32),
                                 S((8, 12), jnp.float32), 4, target="h100x8"), TypeError,
        ("explain: target must be a jax.sharding.Mesh", "got str",
         "target=fusedpar.aot.mesh('h100x8')")),
    Row("ops", "an option the backend does not read",
        in_shard_map(lambda x, w: AGM(x, w, "x", backend="ring", options={"tile_mm": 3})),
        ValueError, ("options ['tile_mm'] are not read by backend 'ring'",
                     "valid keys: none")),
    Row("ops", "explain: axis_size not a positive int",
        lambda: fusedpar.explain("matmul_reduce_scatter", S((4, 8), jnp.float32),
                                 S((8, 12), jnp.float32), 0), ValueError,
        ("explain: axis_size must be a positive int", "got 0")),
    Row("ops", "explain: w_invariant with check_vma=False",
        lambda: fusedpar.explain("all_gather_matmul", S((4, 8), jnp.float32),
                                 S((8, 12), jnp.float32), 4, w_invariant=True,
                                 check_vma=False), ValueError,
        ("explain: w_invariant=True needs check_vma=True (or None)",)),
    Row("ops", "explain: w_resident without w_transposed",
        lambda: fusedpar.explain("matmul_reduce_scatter", S((4, 8), jnp.float32),
                                 S((8, 12), jnp.float32), 4, w_resident=True), ValueError,
        ("explain: w_resident=True describes a w passed with w_transposed=True",)),
]

LAYERS = [
    Row("layers", "comm_dtype on a layer without sequence parallelism",
        lazy(lambda: _col(8, 8, comm_dtype=jnp.int8)), ValueError,
        ("Column: comm_dtype / grad_comm_dtype need sequence_parallel=True",)),
    Row("layers", "keep_gathered=False on a layer without sequence parallelism",
        lazy(lambda: fusedpar.RowLinear(8, 8, key=KEY, keep_gathered=False)), ValueError,
        ("Row: keep_gathered=False needs sequence_parallel=True",)),
    Row("layers", "reduce_dtype narrower than x on a Row's psum (no sequence parallelism)",
        global_call(fusedpar.RowLinear(8, 8, key=KEY, reduce_dtype=jnp.float16), (2, 8)),
        ValueError, ("RowLinear: reduce_dtype float16 has a narrower range than the "
                     "operands' float32",)),
    Row("layers", "a weight replaced by one of another shape (its transpose)",
        lambda: fusedpar.shard(eqx.tree_at(lambda l: l.weight, _col(16, 32),
                                           jnp.ones((16, 32))), mesh((2, 4), ("fsdp", "tp"))),
        ValueError, ("ColumnLinear.weight has shape (16, 32), but the layer's (out_features, "
                     "in_features) is (32, 16) (it is that shape transposed)",)),
    Row("layers", "a bias replaced by one of another shape",
        global_call(eqx.tree_at(lambda l: l.bias, _col(16, 32), jnp.ones((16,))), (2, 16)),
        ValueError, ("ColumnLinear.bias has shape (16,), but the layer's out_features is 32",)),
    Row("layers", "keep_gathered not a bool",
        lambda: fusedpar.Column(sequence_parallel=True, keep_gathered="no"), TypeError,
        ("Column: keep_gathered must be True or False", "got 'no'")),
    Row("layers", "fsdp_comm_dtype without fsdp_axis",
        lazy(lambda: fusedpar.RowLinear(8, 8, key=KEY, fsdp_comm_dtype=jnp.int8)),
        ValueError, ("RowLinear: fsdp_comm_dtype / fsdp_grad_comm_dtype", "pass fsdp_axis")),
    Row("layers", "fsdp_grad_comm_dtype on a sequence-parallel layer",
        lazy(lambda: _col(8, 8, sequence_parallel=True, fsdp_axis="fsdp",
                          fsdp_grad_comm_dtype=jnp.int8)),
        ValueError, ("ColumnLinear: FSDP(axis='fsdp'", "grad_comm_dtype sets the weight "
                     "gradient's reduce-scatter where the FSDP gather is an "
                     "all_gather_matmul", "Leave this layer's FSDP grad_comm_dtype None")),
    Row("quantized", "QuantizedArray dtype not int8 or fp8",
        lazy(lambda: fusedpar.QuantizedArray.quantize(jnp.ones((4, 8)), jnp.bfloat16)),
        ValueError, ("QuantizedArray.quantize: dtype must be one of jnp.int8, "
                     "jnp.float8_e4m3fn",)),
    Row("quantized", "block_size that does not divide the reduced dimension",
        lazy(lambda: fusedpar.QuantizedArray.quantize(jnp.ones((4, 10)), block_size=4)),
        ValueError, ("dimension 1 of shape (4, 10) (size 10) does not split into blocks "
                     "of block_size=4",)),
    Row("layers", "axis not a mesh axis name",
        lazy(lambda: _col(8, 8, axis=None)), TypeError,
        ("ColumnLinear: a mesh axis must be a name, a non-empty str such as 'tp'",
         "got axis=None")),
    Row("layers", "fsdp_dim without fsdp_axis",
        lazy(lambda: fusedpar.RowLinear(8, 8, key=KEY, fsdp_dim=0)), ValueError,
        ("RowLinear: fsdp_dim=0 without fsdp_axis does nothing",
         "pass fsdp_axis (e.g. 'fsdp')")),
    Row("layers", "use_bias not a bool",
        lazy(lambda: _col(8, 8, use_bias="yes")), TypeError,
        ("ColumnLinear: use_bias must be True or False, got 'yes'",)),
    Row("layers", "in_features not a positive int",
        lazy(lambda: _col(0, 8)), ValueError,
        ("ColumnLinear: in_features must be a positive int or 'scalar', got 0",)),
    Row("layers", "unknown backend",
        lazy(lambda: fusedpar.FSDPLinear(8, 8, key=KEY, backend="nope")), ValueError,
        ("FSDPLinear: unknown backend='nope'", "valid backends are 'auto', 'reference'")),
    Row("layers", "weight placed on a mesh, called with no mesh set",
        lambda: fusedpar.shard(_col(8, 8), mesh((2, 4), ("fsdp", "tp")))(jnp.ones((2, 8))),
        ValueError, ("ColumnLinear: its weight is placed on a mesh {'fsdp': 2, 'tp': 4}",
                     "no mesh is set", "without any fused collective",
                     "inside `with jax.set_mesh(mesh):`")),
    Row("layers", "weight placed on one mesh, called under another",
        lambda: _other_mesh_call(), ValueError,
        ("ColumnLinear: its weight is placed on a mesh {'fsdp': 2, 'tp': 4}",
         "called under jax.set_mesh of a mesh {'fsdp': 4, 'tp': 2}",
         "fusedpar.shard(model, mesh)")),
    Row("layers", "weight placed on one mesh, called under one with its axes reordered",
        lambda: _swapped_axes_call(), ValueError,
        ("its weight is placed on a mesh {'data': 2, 'fsdp': 2, 'tp': 2}",
         "called under jax.set_mesh of a mesh {'fsdp': 2, 'data': 2, 'tp': 2}")),
    Row("layers", "checkpoint of another model restored into a sharded skeleton",
        _restore_other_model, ValueError,
        ("deserialise_filter_spec: the checkpoint holds an array of shape (8, 16) where "
         "the skeleton has (8, 8)", "restore it into the model it was saved from")),
    Row("layers", "Explicit axes: a batch the input's data axis divides, not with FSDP's",
        lambda: _explicit_data_fsdp_call(), ValueError,
        ("ColumnLinear: input of shape (6, 4, 8) (with the mesh axes its layout "
         "P('data', None, None) carries beside the layer's)", "not divisible by 4",
         "('data', 'fsdp')")),
    Row("layers", "a plan keyed by something other than a path pattern",
        lambda: fusedpar.parallelize({"up": eqx.nn.Linear(8, 8, key=KEY)}, {1: "column"}),
        TypeError, ("parallelize: plan's keys must be str patterns on layer paths",
                    "got 1")),
    Row("layers", "an FSDP dim that is not an int",
        lambda: fusedpar.compose(fusedpar.Column(), fusedpar.FSDP(dim=1.0)), ValueError,
        ("FSDP dim must be None, 0 or 1 (a weight dimension), got 1.0",)),
    Row("quantized", "quantize's where keyed by something other than a path pattern",
        lambda: fusedpar.quantize({"up": eqx.nn.Linear(8, 8, key=KEY)}, {2: "column"}),
        TypeError, ("quantize: where's keys must be str patterns on layer paths",
                    "got 2")),
    Row("layers", "shard with its arguments swapped",
        lambda: fusedpar.shard(mesh((2, 4), ("fsdp", "tp")), _col(8, 8)), TypeError,
        ("shard: mesh must be a jax.sharding.Mesh or AbstractMesh", "got ColumnLinear",
         "the arguments are (model, mesh)")),
    Row("layers", "init_sharded given a model, not a function that builds one",
        lambda: fusedpar.init_sharded(_col(8, 8), mesh((2, 4), ("fsdp", "tp"))), TypeError,
        ("init_sharded: make must be a function that builds the model",
         "use fusedpar.shard(model, mesh)")),
    Row("layers", "arrays sharded onto an AbstractMesh",
        lambda: fusedpar.shard(_col(8, 8), jax.sharding.AbstractMesh((4,), ("tp",))),
        ValueError, ("shard: an AbstractMesh has no devices to build arrays on",
                     "eqx.filter_eval_shape")),
    Row("layers", "checkpoint restored into a skeleton of another dtype",
        _restore(jnp.bfloat16, jnp.float16), ValueError,
        ("deserialise_filter_spec: the checkpoint holds a bfloat16 array of shape (8, 8) "
         "where the skeleton has float16", "build the skeleton in the dtype it was saved in")),
    Row("layers", "quantized checkpoint restored into a float skeleton",
        _restore(jnp.int8, jnp.bfloat16), ValueError,
        ("the checkpoint holds an int8 array of shape (8, 8) where the skeleton has "
         "bfloat16 (a quantized weight's values?)",
         "fusedpar.quantize(...) of the model inside eqx.filter_eval_shape")),
    Row("layers", "float checkpoint restored into a quantized skeleton",
        _restore_float_into_quantized, ValueError,
        ("the checkpoint holds a bfloat16 array of shape (8, 8) where the skeleton has int8",
         "restore it into a skeleton of that model and quantize the restored model")),
    Row("layers", "called under the deprecated `with mesh:`",
        lambda: _legacy_mesh_call(), ValueError,
        ("ColumnLinear: called inside `with mesh:`", "{'tp': 4}",
         "use `with jax.set_mesh(mesh):` instead")),
    Row("layers", "'scalar' features that the layer's rule shards, on a mesh",
        global_call(_col(8, "scalar"), (2, 8)), ValueError,
        ("ColumnLinear: out_features='scalar' is a weight dimension of length 1",
         "Column style shards over mesh axis 'tp'", "keep this layer an eqx.nn.Linear")),
    Row("layers", "x a scalar",
        lambda: _col(8, 8)(jnp.float32(1)), ValueError,
        ("ColumnLinear: x must have shape (..., 8), got a scalar",)),
    Row("layers", "x's last dimension is not in_features",
        lambda: _col(8, 8)(jnp.ones((2, 5))), ValueError,
        ("ColumnLinear: x has shape (2, 5)", "must be in_features=8")),
    Row("layers", "weight dimension not divisible by its mesh axis",
        global_call(_col(8, 6), (2, 8)), ValueError,
        ("ColumnLinear.weight: parameter dim 0 has size 6, not divisible by 4",
         "mesh axes ('tp',) (tp=4)")),
    Row("layers", "sequence not divisible by the tensor-parallel axis",
        global_call(_col(8, 8, sequence_parallel=True), (3, 8)), ValueError,
        ("ColumnLinear: x of shape (3, 8): input dim 0 has size 3, not divisible by 4",
         "('tp',) (tp=4)", "a sequence that 'tp' does not divide (a few tokens while decoding",
         "sequence_parallel=False (fusedpar.parallelize(model, plan) re-plans a parallel "
         "model), or pad the sequence")),
    Row("layers", "batch of one on an FSDP layer (decoding)",
        global_call(_col(8, 8, fsdp_axis="fsdp"), (1, 8)), ValueError,
        ("input dim 0 has size 1, not divisible by 2", "call the layer on x[0] (no batch "
         "dimension: the layer gathers its weight whole)", "under a plan without FSDP "
         "(fusedpar.parallelize(model, plan) re-plans a parallel model), or pad the batch")),
    Row("layers", "sequence of a sequence-parallel RowLinear's output not divisible",
        global_call(fusedpar.RowLinear(8, 8, key=KEY, sequence_parallel=True), (3, 8)),
        ValueError, ("RowLinear: x of shape (3, 8) gives an output of shape (3, 8)",
                     "output dim 0 has size 3, not divisible by 4", "(tp=4)")),
    Row("layers", "TPU kernels interpreted on CPU beside an FSDP weight gather",
        global_call(_col(8, 8, sequence_parallel=True, fsdp_axis="fsdp",
                         backend="pallas_tpu"), (2, 4, 8)), RuntimeError,
        ("ColumnLinear: backend 'pallas_tpu' runs the TPU kernels in interpret mode",
         "FSDP axis 'fsdp' puts XLA collectives beside them", "can deadlock", "backend='ring'")),
    Row("layers", "TPU kernels interpreted on CPU, differentiated through jax.checkpoint",
        global_call(_grad_through_checkpoint(_col(8, 8, sequence_parallel=True,
                                                  backend="pallas_tpu")), (2, 4, 8)),
        NotImplementedError,
        ("all_gather_matmul: backend 'pallas_tpu' runs the TPU kernels in interpret mode",
         "differentiated through a jax.checkpoint (remat)", "Use backend='ring'")),
    Row("layers", "batch not divisible by the FSDP axis",
        global_call(fusedpar.FSDPLinear(8, 8, key=KEY), (3, 5, 8)), ValueError,
        ("FSDPLinear: x of shape (3, 5, 8): input dim 0 has size 3, not divisible by 2",
         "('fsdp',) (fsdp=2)", "one sequence at a time (x[i]")),
    Row("layers", "integer dtype for the parameters", lambda: _col(8, 8, dtype=jnp.int8),
        ValueError, ("ColumnLinear: dtype must be a floating dtype", "got int8",
                     "fusedpar.quantize")),
    Row("layers", "layer axis not in the mesh",
        global_call(_col(8, 8, axis="model"), (4, 8)), ValueError,
        ("ColumnLinear: mesh axis 'model' (Column's axis=) is not in the current mesh",
         "whose axes are ('fsdp', 'tp')", "Name one of them")),
    Row("layers", "shard_map binds only some of the layer's axes",
        lambda: jax.eval_shape(jax.shard_map(
            _col(8, 8, fsdp_axis="fsdp"), mesh=mesh((2, 4), ("fsdp", "tp")), in_specs=P(),
            out_specs=P(), axis_names={"tp"}), S((2, 8), jnp.float32)), ValueError,
        ("ColumnLinear: uses mesh axes ('tp', 'fsdp')",
         "the enclosing shard_map binds only ('tp',)")),
    Row("layers", "global weight inside shard_map (layer closed over)",
        lambda: jax.eval_shape(jax.shard_map(
            lambda x: _col(8, 8)(x), mesh=mesh((2, 4), ("fsdp", "tp")), in_specs=P(),
            out_specs=P(None, "tp")), S((2, 8), jnp.float32)), ValueError,
        ("the local weight must have shape (2, 8)", "got (8, 8)", "its global shape",
         "fusedpar.param_specs")),
    Row("layers", "local input with the wrong number of features",
        local_call(_col(8, 8), P(None, "tp"), (2, 8)), ValueError,
        ("inside shard_map over {'fsdp': 2, 'tp': 4} (the layer's: ('tp',)) the local "
         "input must have 8 features",
         "got x of shape (2, 2)")),
    Row("layers", "sequence-parallel layer given a 1-D input",
        local_call(fusedpar.RowLinear(8, 8, key=KEY, sequence_parallel=True), P("tp"), (8,)),
        ValueError, ("RowLinear: sequence_parallel=True needs an input (..., seq, features)",
                     "got x of shape (2,)")),
    Row("layers", "sequence-parallel layer given a 1-D global input",
        global_call(_col(8, 8, sequence_parallel=True), (8,)), ValueError,
        ("ColumnLinear: sequence_parallel=True needs an input (..., seq, features)",
         "got x of shape (8,)")),
    Row("layers", "sequence-parallel layer vmapped over the sequence inside shard_map",
        local_call(_col(8, 8, sequence_parallel=True), P(None, "tp"), (2, 8, 8), vmaps=2),
        ValueError, ("ColumnLinear: under jax.vmap the mapped axis (size 2) changes "
                     "length through the layer (its output has length 8 there)",
                     "gathers or scatters the sequence over 'tp'",
                     "vmap over the batch only")),
    Row("layers", "sequence-sharded input into a ColumnLinear inside shard_map",
        local_call(_col(8, 8), P(None, "tp"), (4, 8, 8)), ValueError,
        ("ColumnLinear: inside shard_map the varying-axes type of the input says sharded "
         "over mesh axis 'tp'", "expects the input laid out as P(None, None, None)",
         "needs sequence_parallel=True")),
    Row("layers", "replicated input into a RowLinear inside shard_map",
        local_call(fusedpar.RowLinear(8, 8, key=KEY), P(), (4, 2)), ValueError,
        ("RowLinear: inside shard_map the varying-axes type of the input says replicated "
         "over mesh axis 'tp'", "P(None, 'tp')", "features sharded over 'tp'")),
    Row("layers", "replicated batch into an FSDP layer inside shard_map",
        local_call(_col(8, 8, fsdp_axis="fsdp"), P(), (4, 8)), ValueError,
        ("says replicated over mesh axis 'fsdp'", "P('fsdp', None)",
         "FSDP takes the batch (dim 0) sharded over 'fsdp'")),
    Row("layers", "local_size over an axis the mesh lacks",
        lambda: jax.eval_shape(jax.shard_map(
            lambda x: x * fusedpar.local_size(8, "tp"), mesh=mesh((8,), ("model",)),
            in_specs=P("model"), out_specs=P("model")), S((8,), jnp.float32)),
        ValueError, ("local_size: axis 'tp' is not an axis of the mesh of the enclosing "
                     "shard_map", "its axes are ('model',)")),
    Row("layers", "local_size of a count that is not an int",
        lambda: fusedpar.local_size(8.0, "tp"), TypeError,
        ("local_size: n must be an int (a global dimension's length), got 8.0",)),
    Row("layers", "local_size of a count that does not divide",
        lambda: jax.eval_shape(jax.shard_map(
            lambda x: x * fusedpar.local_size(6, "tp"), mesh=mesh((2, 4), ("fsdp", "tp")),
            in_specs=P(), out_specs=P()), S((2,), jnp.float32)), ValueError,
        ("local_size: 6 does not divide over mesh axis 'tp' of size 4",
         "make it a multiple of 4")),
]

EMBEDDING = [
    Row("embedding", "sequence_parallel with no axis",
        lambda: fusedpar.Embedding(16, 8, key=KEY, axis=None, sequence_parallel=True),
        ValueError, ("Embedding: sequence_parallel=True scatters the sequence over axis, "
                     "but axis is None",)),
    Row("embedding", "an empty vocabulary",
        lambda: fusedpar.Embedding(0, 8, key=KEY), ValueError,
        ("Embedding: num_embeddings must be a positive int, got 0",)),
    Row("embedding", "ids not integer",
        lambda: _emb()(jnp.ones(3)), TypeError,
        ("Embedding: x must be integer ids, got dtype float32",)),
    Row("embedding", "fsdp_dim not a table dimension",
        lazy(lambda: _emb(fsdp_axis="fsdp", fsdp_dim=2)), ValueError,
        ("Embedding: fsdp_dim must be None, 0 or 1 (a table dimension), got 2",)),
    Row("embedding", "vocabulary not divisible by the axis",
        global_call(_emb(10), (4, 8), dtype=jnp.int32), ValueError,
        ("Embedding.weight: parameter dim 0 has size 10, not divisible by 4",
         "pad the vocabulary to a multiple of 4 (e.g. 12", "vocab_size=10",
         "relaxed=True")),
    Row("embedding", "shard: vocabulary not divisible",
        lambda: fusedpar.shard({"embed": _emb(10)}, mesh((2, 4), ("fsdp", "tp"))), ValueError,
        ("embed.weight: parameter dim 0 has size 10, not divisible by 4",
         "pad the vocabulary to a multiple of 4")),
    Row("embedding", "sequence-parallel embedding given one id",
        global_call(_emb(sequence_parallel=True), (), dtype=jnp.int32), ValueError,
        ("Embedding: sequence_parallel=True needs ids (..., seq)", "got a scalar id")),
    Row("embedding", "sequence not divisible by the axis",
        global_call(_emb(sequence_parallel=True), (2, 6), dtype=jnp.int32), ValueError,
        ("Embedding: ids of shape (2, 6): input dim 1 has size 6, not divisible by 4",)),
    Row("embedding", "sequence-sharded ids inside shard_map",
        local_call(_emb(), P(None, "tp"), (2, 8), dtype=jnp.int32), ValueError,
        ("Embedding: inside shard_map the varying-axes type of the ids says sharded over "
         "mesh axis 'tp'", "laid out as P(None, None)", "replicated over it")),
    Row("embedding", "global table inside shard_map (embedding closed over)",
        lambda: jax.eval_shape(jax.shard_map(
            lambda i: _emb()(i), mesh=mesh((2, 4), ("fsdp", "tp")), in_specs=P(),
            out_specs=P()), S((2, 8), jnp.int32)), ValueError,
        ("Embedding: inside shard_map over {'fsdp': 2, 'tp': 4} (the layer's: ('tp',)) the "
         "local table must have shape (4, 8)",
         "got (16, 8)", "fusedpar.param_specs")),
    Row("embedding", "Column style on an embedding in a plan",
        lambda: fusedpar.parallelize({"embed": eqx.nn.Embedding(16, 8, key=KEY)},
                                     {"*": "column"}), ValueError,
        ("embed: an embedding takes Row", "not Column(axis='tp'",
         "give the embedding its own plan pattern")),
    Row("embedding", "FSDP(gather='activations') on an embedding in a plan",
        lambda: fusedpar.parallelize({"embed": eqx.nn.Embedding(16, 8, key=KEY)},
                                     {"*": fusedpar.FSDP(gather="activations")}), ValueError,
        ("embed: an embedding gathers its table over 'fsdp'",
         "FSDP(gather='activations') moves a linear layer's tokens instead",
         "gather='auto' or 'weights'")),
]

LOSS = [
    Row("cross_entropy", "logits not floating",
        ce_call((4, 16), (4,), logits_dtype=jnp.int32), TypeError,
        ("cross_entropy: logits must be a floating array (..., vocab), got int32",)),
    Row("cross_entropy", "axis a tuple of mesh axes",
        lambda: fusedpar.cross_entropy(jnp.ones((2, 8)), jnp.zeros((2,), jnp.int32),
                                       axis=("fsdp", "tp")), TypeError,
        ("cross_entropy: axis must be a mesh axis name", "got axis=('fsdp', 'tp')")),
    Row("cross_entropy", "forward-mode differentiation",
        lambda: jax.jvp(lambda lo: fusedpar.cross_entropy(lo, jnp.zeros((2,), jnp.int32),
                                                          None).sum(),
                        (jnp.ones((2, 8)),), (jnp.ones((2, 8)),)), TypeError,
        ("cross_entropy: forward-mode differentiation", "jax.jacrev")),
    Row("cross_entropy", "labels not integer",
        ce_call((4, 16), (4,), labels_dtype=jnp.float32), TypeError,
        ("cross_entropy: labels must be integer, got float32",)),
    Row("cross_entropy", "labels of the wrong shape",
        ce_call((4, 16), (4, 1)), ValueError,
        ("labels must have the shape of logits without its last dimension, (4,)",
         "got labels of shape (4, 1)")),
    Row("cross_entropy", "ignore_index not an int",
        ce_call((4, 16), (4,), ignore_index=-1.0), TypeError,
        ("ignore_index must be an int, got -1.0",)),
    Row("cross_entropy", "vocab_size not a positive int",
        ce_call((4, 16), (4,), vocab_size=0), ValueError,
        ("vocab_size must be a positive int, got 0",)),
    Row("cross_entropy", "vocab_size larger than the logits' vocabulary",
        ce_call((4, 16), (4,), vocab_size=20), ValueError,
        ("vocab_size=20 is larger than the vocabulary of the logits, 16",)),
    Row("cross_entropy", "vocabulary not divisible by the axis",
        ce_call((4, 10), (4,), mesh_shape=(4,)), ValueError,
        ("logits of shape (4, 10): the vocabulary (last dim) has 10 entries, not divisible "
         "by 4", "pad the vocabulary to a multiple of 4 (e.g. 12",
         "pass vocab_size=10 to fusedpar.cross_entropy")),
    Row("cross_entropy", "replicated logits inside shard_map",
        ce_call((4, 16), (4,), specs=(P(), P())), ValueError,
        ("varying-axes type of the logits says replicated over mesh axis 'tp'",
         "P(None, 'tp')", "for whole logits pass axis=None")),
    Row("cross_entropy", "labels sharded over the vocabulary axis inside shard_map",
        lambda: jax.eval_shape(jax.shard_map(  # labels that differ on every device
            lambda x, y: fusedpar.cross_entropy(x, y + 0 * jax.lax.axis_index("tp")),
            mesh=mesh((2, 4), ("fsdp", "tp")), in_specs=(P(None, "tp"), P()), out_specs=P()),
            S((4, 16), jnp.float32), S((4,), jnp.int32)), ValueError,
        ("varying-axes type of the labels says sharded over mesh axis 'tp'",
         "the labels are replicated over it")),
]

SPECS = [
    Row("specs", "two tensor-parallel styles",
        lambda: fusedpar.compose(fusedpar.Column("tp"), fusedpar.Row("tp")), ValueError,
        ("two tensor-parallel styles", "column- or row-parallel, not both")),
    Row("specs", "two FSDP styles",
        lambda: fusedpar.compose(fusedpar.FSDP("a"), fusedpar.FSDP("b")), ValueError,
        ("two FSDP styles", "a layer takes one")),
    Row("specs", "not a style",
        lambda: fusedpar.compose("column"), TypeError,
        ("expected Column, Row or FSDP styles, got 'column'",)),
    Row("specs", "FSDP gather not a route",
        lambda: fusedpar.FSDP("fsdp", gather="both"), ValueError,
        ("FSDP: gather must be 'auto', 'weights' or 'activations'", "got 'both'")),
    Row("specs", "FSDP gather='activations' with an FSDP comm_dtype",
        global_call(_col(8, 8, sequence_parallel=True, fsdp_axis="fsdp",
                         fsdp_gather="activations", fsdp_comm_dtype=jnp.int8), (4, 8, 8)),
        ValueError, ("ColumnLinear: FSDP(gather='activations') moves the tokens of the FSDP "
                     "peers instead of the weight", "FSDP's comm_dtype / grad_comm_dtype "
                     "quantize the weight gather", "use gather='weights' (or 'auto')")),
    Row("specs", "FSDP gather='activations' with an input that has no batch dimension",
        global_call(_col(8, 8, sequence_parallel=True, fsdp_axis="fsdp",
                         fsdp_gather="activations"), (8, 8)),
        ValueError, ("its input of rank 2 has no batch dimension",)),
    Row("specs", "FSDP gather='activations' on an empty batch",
        global_call(fusedpar.FSDPLinear(8, 8, key=KEY, gather="activations"), (0, 8)),
        ValueError, ("FSDPLinear: FSDP(gather='activations') moves the tokens",
                     "its input's batch is empty (local shape (0, 8)): no tokens to move")),
    Row("specs", "FSDP dim not a weight dimension",
        lambda: fusedpar.compose(fusedpar.FSDP("fsdp", 2)), ValueError,
        ("FSDP dim must be None, 0 or 1", "got 2")),
    Row("specs", "one mesh axis used by both styles",
        lazy(lambda: _col(8, 8, fsdp_axis="tp")), ValueError,
        ("ColumnLinear.weight: mesh axis 'tp' is used twice", "dim 0 by tp, dim 1 by fsdp",
         "different axes")),
    Row("specs", "shard: axis not in the mesh",
        lambda: fusedpar.shard(_col(8, 8, axis="model"), mesh((2, 4), ("fsdp", "tp"))),
        ValueError, ("ColumnLinear: mesh axis 'model' (Column's axis=): not in the mesh",
                     "('fsdp', 'tp')", "Name one of them")),
    Row("specs", "shard: a typo of a mesh axis",
        lambda: fusedpar.shard(_col(8, 8, axis="pt"), mesh((2, 4), ("fsdp", "tp"))),
        ValueError, ("mesh axis 'pt' (Column's axis=; did you mean 'tp'?)",)),
    Row("specs", "shard: axes not in the mesh, several layers",
        lambda: fusedpar.shard({"up": _col(8, 8, axis="model", fsdp_axis="data"),
                                "down": _col(8, 8)}, mesh((2, 4), ("fsdp", "tp"))),
        ValueError, ("up: mesh axis 'model' (Column's axis=), 'data' (FSDP's axis=, a layer's fsdp_axis=)",
                     "not in the mesh, whose axes are ('fsdp', 'tp')")),
    Row("specs", "shard: dimension not divisible",
        lambda: fusedpar.shard({"up": _col(8, 6)}, mesh((2, 4), ("fsdp", "tp"))), ValueError,
        ("up.weight: parameter dim 0 has size 6, not divisible by 4", "relaxed=True")),
    Row("specs", "init_sharded: dimension not divisible",
        lambda: fusedpar.init_sharded(lambda k: fusedpar.ColumnLinear(8, 6, key=k),
                                      mesh((2, 4), ("fsdp", "tp")), KEY), ValueError,
        ("weight: parameter dim 0 has size 6, not divisible by 4",)),
    Row("specs", "shard_map_specs of a model without fusedpar layers",
        lambda: fusedpar.shard_map_specs(mlp(), 2), ValueError,
        ("shard_map_specs: the model has no fusedpar layers", "in_specs=P()")),
    Row("specs", "shard_map_specs: an eqx.nn.MultiheadAttention with column-parallel q/k/v",
        lambda: fusedpar.shard_map_specs(
            fusedpar.parallelize(eqx.nn.MultiheadAttention(4, 16, key=KEY),
                                 {"[qkv]*_proj": "column", "output_proj": "row"}),
            S((6, 16), jnp.float32), call=lambda m, x: m(x, x, x)), ValueError,
        ("model is an eqx.nn.MultiheadAttention whose query_proj, key_proj, value_proj "
         "are column-parallel over 'tp'", "wrong numbers", "jax.set_mesh",
         "fusedpar.local_size(num_heads, 'tp')")),
    Row("specs", "shard_map_specs given the input's rank (the old signature)",
        lambda: fusedpar.shard_map_specs(_emb(), 2), TypeError,
        ("x must be the model's input (an array or jax.ShapeDtypeStruct", "got the int 2")),
    Row("specs", "shard_map_specs: the input does not go straight into a fusedpar layer",
        specs_of(*_emb_head()[:1], (4, 8), lambda m, t: _emb_head()[1](m, t + 1)),
        ValueError, ("the input x (shape (4, 8)) does not go into a fusedpar layer as it is",
                     "none of the fusedpar calls, 0 (Embedding), 1 (ColumnLinear), takes "
                     "it unchanged",
                     "write the in_spec of x yourself")),
    Row("specs", "shard_map_specs: the layers under jax.checkpoint inside call",
        specs_of(*_emb_head()[:1], (4, 8),
                 lambda m, t: jax.checkpoint(lambda t: _emb_head()[1](m, t))(t)),
        ValueError, ("does not go into a fusedpar layer as it is",
                     "If call applies the layers under jax.checkpoint",
                     "derive the specs from a call without it")),
    Row("specs", "shard_map_specs: the output is not a fusedpar call's",
        specs_of(*_emb_head()[:1], (4, 8), lambda m, t: jnp.tanh(_emb_head()[1](m, t))),
        ValueError, ("the output (shape (4, 8, 16)) is not what a fusedpar call returned",
                     "the last fusedpar call is 1 (ColumnLinear)",
                     "write the out_specs yourself")),
    Row("specs", "shard_map_specs: a sequence-parallel layer applied per token (vmap)",
        specs_of(_emb(sequence_parallel=True), (4, 8),
                 lambda m, t: jax.vmap(jax.vmap(m))(t)), ValueError,
        ("Embedding is sequence parallel", "under a jax.vmap over the sequence",
         "this model cannot run there", "vmap over the batch only", "jax.set_mesh")),
    Row("specs", "shard_map_specs: call with several inputs",
        specs_of(_emb(), (4, 8), lambda m, t, labels: m(t)), TypeError,
        ("call is called as call(model, x)", "signature (m, t, labels)",
         "x=(tokens, labels)", "call=lambda m, xs: f(m, *xs)")),
    Row("specs", "shard_map_specs: the input goes into layers with different layouts",
        specs_of((_emb(fsdp_axis="fsdp"), _emb()), (4, 8), lambda m, t: m[0](t) + m[1](t)),
        ValueError, ("the input x goes into fusedpar layers that want different layouts",
                     "0 (Embedding) wants P('fsdp', None); 1 (Embedding) wants P(None, None)")),
    Row("specs", "shard_map_specs: an axis brought by code between layers",
        _sp_mlp_specs("fsdp", jnp.tanh), ValueError,
        ("the output would be laid out as P('fsdp', None, None)",
         "inside shard_map it varies over mesh axes ('fsdp', 'tp')",
         "'tp' came through code between fusedpar layers (first into 2 (FSDPLinear)",
         "write the out_specs yourself")),
    Row("specs", "shard_map_specs: a layer given another's output in a layout it refuses",
        _sp_mlp_specs("column", lambda y: y), ValueError,
        ("2 (ColumnLinear) takes its input laid out as P('fsdp', None, None)",
         "the output of 1 (RowLinear), laid out as P('fsdp', 'tp', None)",
         "Change one of the two layers' styles")),
    Row("specs", "shard_map_specs: an FSDP layer given an output whose batch is whole",
        specs_of((_emb(), _col(8, 16, fsdp_axis="fsdp")), (4, 3),
                 lambda m, t: m[1](m[0](t))), ValueError,
        ("1 (ColumnLinear) takes its input laid out as P('fsdp', None, None)",
         "the output of 0 (Embedding), laid out as P(None, None, None)",
         "Only the batch (dim 0) differs: 'fsdp', an FSDP axis, splits it for one of them",
         "give both layers the same FSDP style (an embedding takes FSDP too), or neither")),
]

PARALLELIZE = [
    Row("parallelize", "plan not a dict",
        lambda: fusedpar.parallelize(mlp(), [("layers.0", "column")]), TypeError,
        ("parallelize: plan must be a dict {pattern: style}", "got list")),
    Row("parallelize", "unknown style name",
        lambda: fusedpar.parallelize(mlp(), {"layers.0": "col"}), ValueError,
        ("plan['layers.0'] = 'col' is not a style", "'column', 'row', 'fsdp'")),
    Row("parallelize", "style of the wrong type",
        lambda: fusedpar.parallelize(mlp(), {"layers.0": 3}), TypeError,
        ("plan['layers.0'] must be a style or a tuple of styles, got 3",)),
    Row("parallelize", "pattern that matches no linear layer",
        lambda: fusedpar.parallelize(mlp(), {"layers.5": "column"}), ValueError,
        ("pattern(s) ['layers.5'] matched no eqx.nn.Linear",
         "the model's linear layers are ['layers.0', 'layers.1']")),
    Row("parallelize", "a plan whose FSDP comm_dtype differs from a stored quantized weight's",
        lambda: fusedpar.parallelize(fusedpar.quantize(mlp()),
                                     {"*": fusedpar.FSDP(comm_dtype=jnp.float8_e4m3fn)}),
        ValueError, ("parallelize: layers.0: the weight is stored quantized as int8",
                     "FSDP(comm_dtype=float8_e4m3fn) asks for another dtype")),
    Row("parallelize", "two tensor-parallel styles on one layer",
        lambda: fusedpar.parallelize(mlp(), {"*": "column", "layers.1": "row"}), ValueError,
        ("layers.1: two tensor-parallel styles",
         "patterns ['*', 'layers.1'] all match 'layers.1'")),
    Row("parallelize", "a pattern naming a layer whose 'scalar' features it would shard",
        lambda: fusedpar.parallelize(eqx.nn.Sequential([eqx.nn.Linear(4, "scalar", key=KEY)]),
                                     {"layers.0": "column"}), ValueError,
        ("parallelize: layers.0: out_features='scalar' is a weight dimension of length 1",
         "Column style shards over mesh axis 'tp'", "leave it out of the parallelize plan")),
    Row("parallelize", "unknown backend",
        lambda: fusedpar.parallelize(mlp(), {"layers.0": "column"}, backend="nope"),
        ValueError, ("unknown backend='nope'",)),
]

def _late_flags():
    jax.devices()  # JAX's backends are up (as in any test)
    return fusedpar.set_overlap_flags()


COST_MODEL = [
    Row("cost model", "unknown hardware preset",
        lambda: fusedpar.cost_model.get_hardware("tpu-v9"), ValueError,
        ("unknown hardware 'tpu-v9'", "presets are cpu, h100_sxm")),
    Row("cost model", "ring_size below 1",
        lambda: fusedpar.cost_model.estimate("all_gather_matmul", (8, 128), (128, 128), 0),
        ValueError, ("ring_size must be a positive int", "got 0")),
    Row("cost model", "a ring size that is not an int",
        lambda: fusedpar.cost_model.estimate("all_gather_matmul", (8, 128), (128, 128), 8.5),
        ValueError, ("ring_size must be a positive int", "got 8.5")),
    Row("cost model", "breakdown of shapes that do not contract",
        lambda: fusedpar.cost_model.breakdown("ag_rows", (16, 512), (256, 256), 8),
        ValueError, ("ag_rows: x (16, 512) and w (256, 256) (local 2-D shapes) do not "
                     "contract",)),
    Row("cost model", "an unknown backend name",
        lambda: fusedpar.cost_model.breakdown("ag_rows", (16, 512), (512, 256), 8,
                                              backends=["Ring"]), ValueError,
        ("unknown backend 'Ring'; valid: reference, ring",)),
    Row("cost model", "hardware that is neither a preset name nor a Hardware",
        lambda: fusedpar.cost_model.get_hardware(123), TypeError,
        ("hardware must be a preset name", "got int 123")),
    Row("cost model", "backends a str, not a list",
        lambda: fusedpar.cost_model.breakdown("ag_rows", (16, 512), (512, 256), 8,
                                              backends="ring"), TypeError,
        ("backends must be a list of backend names, e.g. ['ring']",)),
    Row("cost model", "matmul_seconds of a negative size",
        lambda: fusedpar.cost_model.matmul_seconds(-16, 512, 256), ValueError,
        ("matmul_seconds: m, k and n must be ints >= 0, got (-16, 512, 256)",)),
    Row("cost model", "describe of estimate's seconds",
        lambda: fusedpar.cost_model.describe(fusedpar.cost_model.estimate(
            "all_gather_matmul", (8, 128), (128, 128), 4)), TypeError,
        ("describe: result must be what breakdown", "unless details=True")),
    Row("cost model", "a negative size",
        lambda: fusedpar.cost_model.estimate("all_gather_matmul", (-8, 128), (128, 128), 4),
        ValueError, ("x_shape must be a tuple of sizes >= 0", "got (-8, 128)")),
    Row("cost model", "unknown primitive",
        lambda: fusedpar.cost_model.breakdown("ag_foo", (8, 128), (128, 128), 4), ValueError,
        ("unknown primitive 'ag_foo'", "valid: ag_rows, ag_cols, ag_contract")),
    Row("cost model", "shapes the op rejects",
        lambda: fusedpar.cost_model.estimate("all_gather_matmul", (8, 128), (64, 128), 4),
        ValueError, ("contracting dimensions differ: x has 128, w has 64",)),
    Row("cost model", "unknown op",
        lambda: fusedpar.cost_model.estimate("allgather", (8, 128), (128, 128), 4),
        ValueError, ("allgather",)),
    Row("XLA flags", "set_overlap_flags after JAX started", _late_flags, RuntimeError,
        ("must run before JAX starts its backends", "export XLA_FLAGS=")),
]


def cli(main, argv):
    """Run a command-line entry point; an argparse error (exit status 2) is re-raised as
    `SystemExit(its stderr)`, so the message can be asserted."""
    def call():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                return main(argv)
        except SystemExit as e:
            raise SystemExit(err.getvalue().strip() or str(e.code)) from None
    return call


def _demo_parse(argv):
    from fusedpar import demo

    return demo._parse(argv)  # the option checks, without starting a run


def _demo_on_cpu(argv):
    from fusedpar import demo

    # What the demo decides once it knows its devices are CPUs, without starting a run.
    return demo._fit_the_interpreter(demo._parse(argv), "cpu")


def _aot_parse(argv):
    from fusedpar._compile import _aot_cli

    return _aot_cli._parse(argv)  # the option checks, without compiling


def _aot_missing_extra():
    from fusedpar._compile import _aot

    # What devices() says for a compiler that is not installed (here: a module that is
    # not there stands for libtpu).
    _aot._need("fusedpar_no_such_compiler", "libtpu (the TPU compiler)", "v5e:2x4")


def _aot_missing_gpu_extra():
    from fusedpar._compile import _aot

    # A plugin in a package that is not there at all (no JAX plugin installed): the same
    # ImportError, not importlib's ModuleNotFoundError about the parent package.
    _aot._need(("fusedpar_no_such_package.xla_cuda12", "fusedpar_no_such_package.xla_cuda13"),
               "JAX's CUDA compiler plugin", "h100x8")


def _aot_tpu_mesh_chip():
    from fusedpar import aot

    fusedpar.explain("all_gather_matmul", S((1024, 4096), jnp.bfloat16),
                     S((4096, 4096), jnp.bfloat16), 8, backend="pallas_tpu",
                     target=aot.mesh("v5e:2x4"), options={"chip": "v6e"})


def _report(argv):
    spec = importlib.util.spec_from_file_location("fusedpar_bench_report",
                                                  ROOT / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report.main(argv)


def _bench_sizes(value):
    """Import bench/conftest.py (in a child: it configures JAX) with FUSEDPAR_BENCH_SIZES."""
    def call():
        env = dict(os.environ, FUSEDPAR_BENCH_SIZES=value)
        env.pop("XLA_FLAGS", None)
        out = subprocess.run([sys.executable, "-c", "import runpy; runpy.run_path("
                              "'bench/conftest.py')"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
        if out.returncode:  # the last line of the traceback: "ValueError: ..."
            raise ValueError(out.stderr.strip().splitlines()[-1].split(": ", 1)[-1])
    return call


def _json(tmp_name, text):
    path = pathlib.Path(tempfile.gettempdir()) / tmp_name
    path.write_text(text)
    return str(path)


def _report_args(path):
    out = pathlib.Path(tempfile.gettempdir())
    return [path, "--out", str(out / "fusedpar-report.md"), "--plot",
            str(out / "fusedpar-report.png")]


DEMO_BENCH = [
    Row("demo", "--mesh not FSDPxTP", cli(_demo_parse, ["--mesh", "2by4"]), SystemExit,
        ("--mesh must look like 2x4 (FSDP x TP), got '2by4'",)),
    Row("demo", "a size that does not divide its mesh axis",
        cli(_demo_parse, ["--seq", "63"]), SystemExit,
        ("--seq=63 must divide by the mesh axis it is sharded over (4)",)),
    Row("demo", "--dtype not float32/bfloat16", cli(_demo_parse, ["--dtype", "float16"]),
        SystemExit, ("argument --dtype: invalid choice: 'float16'",)),
    Row("demo", "--mesh with a zero axis", cli(_demo_parse, ["--mesh", "0x4"]), SystemExit,
        ("--mesh",)),
    Row("demo", "--steps 0", cli(_demo_parse, ["--steps", "0"]), SystemExit, ("--steps",),),
    Row("demo", "--devices fewer than the mesh", cli(_demo_parse, ["--devices", "6"]),
        SystemExit, ("--devices 6", "mesh 2x4 needs (8)", "--devices 8 or more")),
    Row("demo", "unknown backend in --backends", cli(_demo_parse, ["--backends", "nope"]),
        SystemExit, ("--backends", "nope"),),
    Row("demo", "TPU kernels interpreted on CPU with an FSDP axis",
        cli(_demo_on_cpu, ["--backends", "pallas_tpu", "--mesh", "2x4"]), SystemExit,
        ("--backends pallas_tpu runs the TPU kernels in TPU interpret mode", "--mesh 2x4",
         "deadlock", "Use --mesh 1x4")),
    Row("aot", "a 3-D slice of a 2-D TPU", lambda: __import__("fusedpar.aot").aot.devices(
        "v5e:2x4x2"), ValueError, ("target 'v5e:2x4x2': a v5e slice is 2-D (like 'v5e:2x4')",)),
    Row("aot", "unknown target", lambda: __import__("fusedpar.aot").aot.devices("v9x:2x2"),
        ValueError, ("unknown target 'v9x:2x2'; valid: h100x8, v4:2x2x2, v5e:2x4",)),
    Row("aot", "unknown --target", cli(_aot_parse, ["--target", "tpu9"]), SystemExit,
        ("--target: unknown target 'tpu9'",)),
    Row("aot", "--mesh not sizes", cli(_aot_parse, ["--target", "h100x8", "--mesh", "2by4"]),
        SystemExit, ("--mesh: '2by4' must be positive sizes separated by x", "e.g. 2x4")),
    Row("aot", "--mesh with fewer sizes than axis names",
        cli(_aot_parse, ["--target", "h100x8", "--program", "block", "--mesh", "8"]),
        SystemExit, ("--mesh: '8' has 1 size but the mesh's axis names are ('fsdp', 'tp')",
                     "give one size per name")),
    Row("aot", "--axes without the axis a built-in program shards over",
        cli(_aot_parse, ["--target", "h100x8", "--program", "mlp", "--axes", "x"]),
        SystemExit, ("--axes: --program mlp shards over the mesh axes tp; --axes x lacks tp",)),
    Row("aot", "--json into a folder that does not exist",
        cli(_aot_parse, ["--target", "h100x8", "--json", "/nonexistent/rows.json"]),
        SystemExit, ("--json: cannot write '/nonexistent/rows.json'",)),
    Row("aot", "--json a folder", cli(_aot_parse, ["--target", "h100x8", "--json", "/tmp"]),
        SystemExit, ("--json: '/tmp' is a folder; give a file's path in it",)),
    Row("aot", "a mesh with one axis name twice",
        lambda: __import__("fusedpar.aot").aot.mesh("h100x4", (2, 2), ("tp", "tp")),
        ValueError, ("mesh: axis_names ('tp', 'tp') must be distinct",)),
    Row("aot", "StableHLO text (a Lowered's) instead of the compiled HLO",
        lambda: __import__("fusedpar.aot").aot.overlap(
            jax.jit(jnp.sin).lower(1.0).as_text(debug_info=True)), ValueError,
        ("overlap: program is StableHLO text (a Lowered's as_text())",)),
    Row("aot", "the aot extra not installed", _aot_missing_extra, ImportError,
        ("compiling for 'v5e:2x4' needs libtpu", 'pip install "fusedpar[aot]"')),
    Row("aot", "the aot extra not installed, no JAX plugin at all", _aot_missing_gpu_extra,
        ImportError, ("compiling for 'h100x8' needs JAX's CUDA compiler plugin",
                      'pip install "fusedpar[aot]"')),
    Row("aot", "overlap of something that is not a compiled program",
        lambda: __import__("fusedpar.aot").aot.overlap(42), TypeError,
        ("overlap: program must be a compiled program",)),
    Row("aot", "a file's path (or any text but HLO) instead of the program",
        lambda: __import__("fusedpar.aot").aot.predict("/tmp/step.hlo", "h100x8"),
        ValueError, ("predict: program must be a compiled program or its as_text()",
                     "starting '/tmp/step.hlo'", "pass its contents")),
    Row("aot", "predict's target neither a name, a Mesh nor a Hardware",
        lambda: __import__("fusedpar.aot").aot.predict("HloModule m", 8), TypeError,
        ("predict: target must be a target name, a Mesh of devices or a "
         "cost_model.Hardware, got int 8",)),
    Row("aot", "a program compiled for 8 devices replayed on 2",
        lambda: __import__("fusedpar.aot").aot.predict(
            "HloModule m, num_partitions=8\nENTRY e { ROOT p = f32[] parameter(0) }",
            "h100x2"), ValueError,
        ("predict: the program was compiled for 8 devices, but the target has 2",)),
    Row("aot", "a lowered program not compiled yet",
        lambda: __import__("fusedpar.aot").aot.overlap(jax.jit(jnp.sin).lower(1.0)),
        TypeError, ("overlap: program is a jax.stages.Lowered, not compiled yet",
                    "lowered.compile()")),
    Row("aot", "a program compiled for this CPU replayed as a TPU's",
        lambda: __import__("fusedpar.aot").aot.predict(
            jax.jit(jnp.sin).lower(1.0).compile(), "v5e:2x4"), ValueError,
        ("predict: the program was compiled for a CPU", "the target is a TPU")),
    Row("aot", "init_sharded on compile-only devices",
        lambda: fusedpar.init_sharded(lambda k: fusedpar.ColumnLinear(8, 8, key=k),
                                      __import__("fusedpar.aot").aot.mesh("v5e:2x4"),
                                      jax.random.key(0)), ValueError,
        ("init_sharded: the mesh's devices are compile-only", "eqx.filter_eval_shape")),
    Row("aot", "shard of arrays onto compile-only devices",
        lambda: fusedpar.shard(fusedpar.ColumnLinear(8, 8, key=KEY), __import__(
            "fusedpar.aot").aot.mesh("v5e:2x4", (8,), ("tp",))), ValueError,
        ("shard: the mesh's devices are compile-only", "eqx.filter_eval_shape")),
    Row("ops", "TPU kernels for another generation than the mesh's", _aot_tpu_mesh_chip,
        ValueError, ("the mesh's devices are TPU v5 lite", "not TPU v6e")),
    Row("bench", "FUSEDPAR_BENCH_SIZES not cpu/accelerator", _bench_sizes("gpu"), ValueError,
        ("FUSEDPAR_BENCH_SIZES must be 'cpu' or 'accelerator', got 'gpu'",)),
    Row("bench", "report.py: a JSON file that does not exist",
        cli(_report, _report_args("/nonexistent/bench.json")), SystemExit,
        ("No such file or directory", "/nonexistent/bench.json")),
    Row("bench", "report.py: a file that is not JSON",
        cli(_report, _report_args(_json("fusedpar-not-json.json", "nope"))),
        (ValueError, SystemExit), ("fusedpar-not-json.json",),),
    Row("bench", "report.py: JSON that is not pytest-benchmark output",
        cli(_report, _report_args(_json("fusedpar-not-bench.json", "{}"))),
        (ValueError, KeyError, SystemExit), ("fusedpar-not-bench.json",),),
]

ROWS = OPS + LAYERS + EMBEDDING + LOSS + SPECS + PARALLELIZE + COST_MODEL + DEMO_BENCH


def _param(row):
    marks = [pytest.mark.xfail(strict=True, reason=row.xfail)] if row.xfail else []
    return pytest.param(row, id=f"{row.api}: {row.case}", marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_error(row):
    with pytest.raises(row.error) as info:
        row.call()
    message = str(info.value)
    for fragment in row.fragments:
        assert fragment in message, f"{fragment!r} not in the message: {message}"


def test_a_checkpoint_refuses_only_an_interpreted_kernel_it_differentiates():
    # The refusal's other side: what JAX runs is not refused (an undifferentiated
    # checkpoint; a layer whose ops run no kernel: a Column without sequence parallelism).
    sp, plain = (_col(8, 8, sequence_parallel=s, backend="pallas_tpu") for s in (True, False))
    global_call(_grad_through_checkpoint(sp, differentiate=False), (2, 4, 8))()
    global_call(_grad_through_checkpoint(plain), (2, 4, 8))()


def test_docs_table_is_the_raised_messages():
    """docs/errors.md shows what the code raises (regenerate: python tests/test_errors.py)."""
    assert markdown() in (ROOT / "docs" / "errors.md").read_text()


def markdown() -> str:
    """The docs/errors.md table: each row's API, case and the error it actually raises."""
    lines = ["| API | Bad input | Error |", "|---|---|---|"]
    for row in ROWS:
        try:
            row.call()
            got = "*(no error)*"
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the table shows what is raised
            first = (str(e).splitlines() or [""])[0]
            got = f"`{type(e).__name__}`: {first}".replace("|", "\\|")
            if isinstance(e, SystemExit):  # argparse: usage line, then the error
                got = f"exit 2: {str(e).splitlines()[-1]}".replace("|", "\\|")
        note = f" — *not caught yet: {row.xfail}*" if row.xfail else ""
        lines.append(f"| {row.api} | {row.case}{note} | {got} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
