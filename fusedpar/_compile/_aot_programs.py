"""The programs `fusedpar.aot` compiles for a target: the ops and two layer programs.

Each builder takes a mesh (of compile-only devices, or any other) and a backend and
returns `(jitted function, argument ShapeDtypeStructs)`, the arguments laid out on the
mesh; nothing is materialised (models are built with `eqx.filter_eval_shape`), so
realistic sizes cost no memory. Backward passes are taken with `jax.vjp` against a
cotangent made from the forward's output (`ct * y`), or from a loss against a target: a
`sum()` loss has a constant cotangent, which lets XLA merge the backward's ring steps into
one matmul, and a cotangent that does not wait for the forward lets XLA hide the forward's
collectives behind the backward's matmuls, which no training step can do.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from .._core import _primitives as prims
from .._core._ops import all_gather_matmul, matmul_reduce_scatter
from .._nn._parallelize import parallelize
from .._sharding._specs import Column, FSDP, Row, param_specs

# Per device: x (ROWS, K) @ w (K, COLS) in bfloat16 (the size the README's table and the
# overlap targets are stated at).
ROWS, K, COLS = 1024, 4096, 4096


def _struct(mesh, shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _op(prim):
    """`(call(x, w, axis, **kw), x global shape, w global shape, x spec, w spec, out spec)`
    of `prim` over a ring of `n` on the axis "x", as functions of n and the sizes: an
    all-gather's x is (n * rows, k) split by rows, its travelling w split along the
    gather axis (x travels: w whole); a reduce-scatter contracts over n * k, split."""
    p = prims.of(prim)
    split = P("x") if p.gather_axis == 0 else P(None, "x")
    if p.gathers:
        def gather(x, w, **kw):
            return all_gather_matmul(x, w, "x", gather=p.side, dim=p.gather_axis, **kw)

        wspec = P() if p.traveller == "x" else split
        ospec = P("x")  # by rows: x's rows are split everywhere
        return lambda n, r, k, c: (gather, (n * r, k), (k, c), P("x"), wspec, ospec)

    def scatter(x, w, **kw):
        return matmul_reduce_scatter(x, w, "x", dim=p.gather_axis, **kw)

    return lambda n, r, k, c: (scatter, (r, n * k), (n * k, c), P(None, "x"), P("x"), split)


def op_program(mesh, prim, backend="ring", *, bidirectional=None, backward=True,
               rows=ROWS, k=K, cols=COLS, dtype=jnp.bfloat16, options=None, comm_dtype=None,
               check_vma=None, reduce_dtype=None):
    """Primitive `prim` on the mesh's one axis "x": its forward, and with `backward` its
    vjp, against the cotangent `ct * y` of the forward's output `y` and an argument `ct`
    (a training step's backward waits for its forward); `comm_dtype` is the op's (what
    the ring sends), `reduce_dtype` the dtype its reduce-scatter (forward's or
    backward's) sums in. `check_vma` (None: `op_check_vma`) is the `shard_map`'s."""
    n = mesh.shape["x"]
    call, xs, ws, xspec, wspec, ospec = _op(prim)(n, rows, k, cols)
    if check_vma is None:
        check_vma = op_check_vma(backend, wspec)
    fn = functools.partial(call, backend=backend, bidirectional=bidirectional,
                           options=options, comm_dtype=comm_dtype, reduce_dtype=reduce_dtype)
    args = [_struct(mesh, xs, dtype, xspec), _struct(mesh, ws, dtype, wspec)]
    if not backward:
        body, in_specs, out_specs = fn, (xspec, wspec), ospec
    else:
        out = jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=(xspec, wspec),
                                           out_specs=ospec, check_vma=False), *args)
        args.append(_struct(mesh, out.shape, dtype, ospec))

        def body(x, w, ct):
            y, vjp = jax.vjp(fn, x, w)
            # The cotangent of the loss sum(ct * y**2) / 2, which, as in a training
            # step, exists only once the forward is done. A cotangent given as an
            # argument would let XLA run the backward's matmuls while the forward's
            # collective is in flight, which no training step allows (on 8 x H100 the
            # reference's ag_cols hid its all-gather so, 217 us against 371 us).
            return (y,) + vjp(ct * y)

        in_specs, out_specs = (xspec, wspec, ospec), (ospec, xspec, wspec)
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                    out_specs=out_specs, check_vma=check_vma))
    return _under_mesh(mesh, program), args


def op_check_vma(backend, wspec) -> bool:
    """The `check_vma` of an op program: True for `"auto"` with a replicated w (ag_rows),
    as the default `shard_map` a user writes, since only JAX's varying-axes types prove
    w replicated, which lets auto multiply first (`fusedpar._core._product_first`); False
    otherwise, which the fused Pallas kernels a backend may run need."""
    return backend == "auto" and wspec == P()


def ops_program(mesh, prim, variants, *, rows=ROWS, k=K, cols=COLS, dtype=jnp.bfloat16):
    """Primitive `prim` in every variant (`(backend, bidirectional)` pairs) in one
    program, forward and backward: one compile checks that they all build. (Whether a
    variant overlaps is read from a program of its own: in a shared one, one variant's
    transfers could hide behind another's matmuls.)"""
    n = mesh.shape["x"]
    call, xs, ws, xspec, wspec, ospec = _op(prim)(n, rows, k, cols)
    args = [_struct(mesh, xs, dtype, xspec), _struct(mesh, ws, dtype, wspec)]
    out = jax.eval_shape(jax.shard_map(functools.partial(call, backend="reference"),
                                       mesh=mesh, in_specs=(xspec, wspec), out_specs=ospec,
                                       check_vma=False), *args)
    args.append(_struct(mesh, out.shape, dtype, ospec))

    def body(x, w, ct):
        outs = []
        for backend, bidirectional in variants:
            fn = functools.partial(call, backend=backend, bidirectional=bidirectional)
            y, vjp = jax.vjp(fn, x, w)
            outs.append((y,) + vjp(ct))
        return outs

    spec = (ospec, xspec, wspec)
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xspec, wspec, ospec),
                                    out_specs=[spec] * len(variants), check_vma=False))
    return _under_mesh(mesh, program), args


def comm_program(mesh, prims_, comm_dtype, backend="ring", *, bidirectional=True,
                 rows=ROWS, k=K, cols=COLS, dtype=jnp.bfloat16):
    """Primitives `prims_` forward in one program, each sending in `comm_dtype` (None: the
    inputs' dtype; reduce-scatters' accumulators in `dtype` then, not float32): what a
    quantized ring's transfers carry, each op under its own name scope."""
    n = mesh.shape["x"]
    ops = [_op(prim)(n, rows, k, cols) for prim in prims_]
    args, specs = [], []
    for call, xs, ws, xspec, wspec, _ in ops:
        args += [_struct(mesh, xs, dtype, xspec), _struct(mesh, ws, dtype, wspec)]
        specs += [xspec, wspec]

    def body(*xw):
        outs = []
        for prim, (call, *_), x, w in zip(prims_, ops, xw[0::2], xw[1::2]):
            kw = {} if prims.of(prim).gathers else dict(reduce_dtype=dtype)
            outs.append(call(x, w, backend=backend, bidirectional=bidirectional,
                             comm_dtype=comm_dtype, **kw))
        return outs

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                                    out_specs=[o[-1] for o in ops], check_vma=False))
    return _under_mesh(mesh, program), args


class _MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim, hidden, dtype, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(dim, hidden, dtype=dtype, key=k1)
        self.down = eqx.nn.Linear(hidden, dim, dtype=dtype, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


def _attention(x, q, k, v):
    """Softmax attention of (batch, seq, heads, head_dim) q, k, v, heads flattened back."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    attn = jax.nn.softmax(scores / q.shape[-1] ** 0.5, axis=-1).astype(x.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(*q.shape[:2], -1)


class _Block(eqx.Module):
    """A transformer block like examples/gpt.py's, on (batch, seq, dim) arrays."""

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    out: eqx.nn.Linear
    mlp: _MLP
    heads: int = eqx.field(static=True)

    def __init__(self, dim, hidden, heads, dtype, key):
        keys = jax.random.split(key, 5)
        self.q, self.k, self.v, self.out = (eqx.nn.Linear(dim, dim, use_bias=False,
                                                          dtype=dtype, key=kk)
                                            for kk in keys[:4])
        self.mlp = _MLP(dim, hidden, dtype, keys[4])
        self.heads = heads

    def __call__(self, x):
        from .._nn._context import local_size

        heads = local_size(self.heads, "tp")
        b, s, _ = x.shape
        q, k, v = (f(x).reshape(b, -1, heads, f.out_features // self.heads)
                   for f in (self.q, self.k, self.v))
        return self.mlp(x + self.out(_attention(x, q, k, v)))


class _FusedQKVBlock(eqx.Module):
    """`_Block` with one `qkv` projection, its columns ordered (heads, 3, head_dim) so that
    a column shard holds whole heads with their q, k and v: one gather of the input."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    mlp: _MLP
    heads: int = eqx.field(static=True)

    def __init__(self, dim, hidden, heads, dtype, key):
        keys = jax.random.split(key, 3)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, use_bias=False, dtype=dtype, key=keys[0])
        self.out = eqx.nn.Linear(dim, dim, use_bias=False, dtype=dtype, key=keys[1])
        self.mlp = _MLP(dim, hidden, dtype, keys[2])
        self.heads = heads

    def __call__(self, x):
        from .._nn._context import local_size

        heads = local_size(self.heads, "tp")
        b = x.shape[0]
        y = self.qkv(x).reshape(b, -1, heads, 3, self.qkv.out_features // 3 // self.heads)
        return self.mlp(x + self.out(_attention(x, y[..., 0, :], y[..., 1, :], y[..., 2, :])))


def _is_array(a) -> bool:
    return isinstance(a, (jax.Array, jax.ShapeDtypeStruct))


def _layer_program(mesh, model, plan, backend, x_shape, x_spec, dtype, *, train=True,
                   wrt_input=False):
    """`model` made by `parallelize(model, plan, backend=backend)` (`plan` None: as it
    is), its parameters laid out by `param_specs`: see `step_program`."""
    if plan is not None:
        model = parallelize(model, plan, backend=backend)
    return step_program(mesh, model, param_specs(model), lambda m, x: m(x), x_shape,
                        x_spec, dtype, train=train, wrt_input=wrt_input)


def step_program(mesh, model, specs, apply, x_shape, x_spec, dtype, *, train=True,
                 wrt_input=False):
    """`apply(model, x)` on global arrays under `jax.set_mesh`, the model's arrays laid
    out by `specs` (a PartitionSpec tree of them): with `train`, a training step's
    forward and backward (the mean squared error against a target argument: a real,
    non-constant cotangent); otherwise the forward alone (a prefill or decode step).
    `wrt_input`: the step also differentiates `x`, as every block of a deep model but
    the first does (`bench/aot_input_grad.py`)."""
    params = jax.tree.map(lambda a, s: _struct(mesh, a.shape, a.dtype, s),
                          eqx.filter(model, _is_array), specs, is_leaf=_is_array)
    static = eqx.filter(model, _is_array, inverse=True)
    x = _struct(mesh, x_shape, dtype, x_spec)

    def step(params, x, y):
        def loss(params, x):
            out = apply(eqx.combine(params, static), x)
            return jnp.mean(jnp.square((out - y).astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1) if wrt_input else 0)(params, x)

    if not train:
        return _under_mesh(mesh, jax.jit(lambda params, x: apply(
            eqx.combine(params, static), x))), [params, x]
    return _under_mesh(mesh, jax.jit(step)), [params, x, x]


class _under_mesh:
    """`jitted`, traced under `jax.set_mesh(mesh)` by `.lower(*args)`: the layers' global
    context, and the concrete mesh whose device coordinates give the ring its order
    (`fusedpar._core._schedule.ring_for`)."""

    def __init__(self, mesh, jitted):
        self.mesh, self.jitted = mesh, jitted

    def lower(self, *args):
        with jax.set_mesh(self.mesh):
            return self.jitted.trace(*args).lower()


# The layer programs' sizes, in one place (`fusedpar._compile._aot_baseline` builds XLA's own
# versions from them): `tokens` and `seq` are sequence positions per tensor-parallel
# device (batch 1 per FSDP device). `prefill` and `decode` are forward passes of the block.
LAYER_SIZES = {
    "mlp": dict(dim=4096, hidden=4096 * 4, tokens=1024),
    "block": dict(dim=4096, hidden=4096 * 4, heads=32, seq=1024),
    "prefill": dict(dim=4096, hidden=4096 * 4, heads=32, seq=2048),
    "decode": dict(dim=4096, hidden=4096 * 4, heads=32, seq=4),
}
BLOCK_PROGRAMS = {"block": True, "prefill": False, "decode": False}  # name -> training


def mlp_program(mesh, backend="ring", *, dtype=jnp.bfloat16, reduce_dtype=None,
                keep_gathered=True, **sizes):
    """A sequence-parallel MLP made by `parallelize` over the mesh's axis "tp": `tokens`
    sequence positions per device, batch 1 (`LAYER_SIZES["mlp"]` unless given);
    `reduce_dtype`, `keep_gathered`: the styles' (what the reduce-scatters sum in; whether
    the backward keeps what the layers gather: one bool, or the Column's and the Row's)."""
    dim, hidden, tokens = _sizes("mlp", sizes, "dim", "hidden", "tokens")
    n = mesh.shape["tp"]
    model = eqx.filter_eval_shape(_MLP, dim, hidden, dtype, jax.random.key(0))
    sp = dict(sequence_parallel=True, reduce_dtype=reduce_dtype)
    col, row = _keeps(keep_gathered)
    plan = {"up": Column(**sp, keep_gathered=col), "down": Row(**sp, keep_gathered=row)}
    return _layer_program(mesh, model, plan, backend, (1, n * tokens, dim),
                          P(None, "tp", None), dtype)


def _keeps(keep_gathered) -> tuple:
    """The programs' `keep_gathered`: one bool for every style, or (the Columns', the
    Rows')."""
    return keep_gathered if isinstance(keep_gathered, tuple) else (keep_gathered,) * 2


def _sizes(program, given, *names):
    sizes = {**LAYER_SIZES[program], **given}
    unknown = set(given) - set(LAYER_SIZES[program])
    if unknown:
        raise TypeError(f"{program} program: unknown sizes {sorted(unknown)}; valid: "
                        f"{sorted(LAYER_SIZES[program])}")
    return tuple(sizes[n] for n in names)


def block_model(program, dtype=jnp.bfloat16, fused_qkv=False, **sizes):
    """`(model of eqx.nn.Linear layers, x's global shape as a function of the mesh's
    ("fsdp", "tp") sizes, training or not)` of a block program."""
    dim, hidden, heads, seq = _sizes(program, sizes, "dim", "hidden", "heads", "seq")
    block = _FusedQKVBlock if fused_qkv else _Block
    model = eqx.filter_eval_shape(block, dim, hidden, heads, dtype, jax.random.key(0))
    return model, lambda f, t: (f, t * seq, dim), BLOCK_PROGRAMS[program]


def block_program(mesh, backend="ring", *, program="block", dtype=jnp.bfloat16,
                  fused_qkv=False, reduce_dtype=None, keep_gathered=True, wrt_input=False,
                  **sizes):
    """An FSDP x TP transformer block (sequence parallel) over the axes ("fsdp", "tp"):
    `seq` positions per tensor-parallel device, one sequence per FSDP device; with
    `fused_qkv`, one q, k, v projection instead of three. `program`: "block" (a training
    step), "prefill" or "decode" (forward only; `LAYER_SIZES` gives each one's sizes).
    `reduce_dtype`, `keep_gathered`: the tensor-parallel styles' (what the reduce-scatters
    sum in; whether the backward keeps what they gather: one bool, or the Columns' and the
    Rows'); `wrt_input`: `step_program`'s."""
    model, x_shape, train = block_model(program, dtype, fused_qkv, **sizes)
    sp = dict(sequence_parallel=True, reduce_dtype=reduce_dtype)
    col, row = _keeps(keep_gathered)
    column, row = Column(**sp, keep_gathered=col), Row(**sp, keep_gathered=row)
    plan = {"qkv" if fused_qkv else "[qkv]": column, "out": row, "mlp.up": column,
            "mlp.down": row,
            "*": FSDP(reduce_dtype=reduce_dtype)}
    return _layer_program(mesh, model, plan, backend,
                          x_shape(mesh.shape["fsdp"], mesh.shape["tp"]),
                          P("fsdp", "tp", None), dtype, train=train, wrt_input=wrt_input)


def demo_program(mesh, backend="ring"):
    """The demo's model (`python -m fusedpar.demo`, default sizes) and its training step,
    over the axes ("fsdp", "tp")."""
    import argparse

    from .. import demo

    args = argparse.Namespace(dim=64, hidden=256, blocks=2, dtype="float32", batch=8,
                              seq=64)
    model = eqx.filter_eval_shape(demo._model, args, backend, jax.random.key(0))
    spec = P("fsdp", "tp", None)
    return _layer_program(mesh, model, None, backend, (args.batch, args.seq, args.dim),
                          spec, jnp.float32)
