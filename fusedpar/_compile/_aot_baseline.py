"""The `xla` baseline: each program `fusedpar.aot` compiles, written as a user without
fusedpar would write it, and the XLA settings that turn on XLA's own collective matmul.

The layer programs use plain `eqx.nn.Linear` layers (the models of `_aot_programs`, at its
`LAYER_SIZES`) under `jax.jit`: the parameters and input placed with `NamedSharding`s,
Megatron-style sequence parallelism stated with `with_sharding_constraint` (a column
layer's output has the whole sequence and a shard of the features, a row layer's output
a shard of the sequence and every feature), no `shard_map`. XLA's partitioner (GSPMD or
Shardy) then inserts the all-gathers and reduce-scatters, and, with the settings of
`collective_matmul_options`, decomposes them into loops of its own. The ops are `x @ w`
with the op's layouts (`_aot_programs._op`): the inputs' shardings and a constraint on
the output. The mesh is the one `jax.make_mesh` builds over the target's devices
(`fusedpar.aot.mesh(..., make_mesh=True)`), with Auto axes (GSPMD's sharding-in-types
off, as most such code is written).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _aot_programs as progs

LAYER_PROGRAMS = ("mlp", "block", "prefill", "decode")

# XLA's collective matmul, as the platforms' own guides set it.
# - TPU (libtpu flags; MaxText's and vLLM's TPU setting): decompose an all-gather or a
#   reduce-scatter feeding or fed by an einsum into a loop of steps after the
#   partitioner has run ("post SPMD"), conservatively (where the loop is expected to
#   pay). The partitioner's own windowed einsum already runs by default on TPU.
# - GPU (NVIDIA's JAX guide): the partitioner's windowed einsum for every size (the
#   threshold is the einsum's operand size in MiB; 100000 by default, so never) and its
#   loops' matmuls on several streams; the latency-hiding scheduler, without which no
#   transfer runs beside a matmul. The windowed einsum is a rewrite of the SPMD
#   partitioner, so it applies to the einsums it partitions: a `shard_map`'s explicit
#   all_gather + dot (fusedpar's reference) stays as it is.
#   It does not fire in a deviceless compile (jax 0.10.2's CUDA plugin), with any of
#   these flags, through `compiler_options` or `XLA_FLAGS`, Shardy on or off: the GPU
#   compiler caps a windowed loop's iterations at the size of the fast-interconnect
#   (NVLink) domain it detects from the live devices (openxla/xla PR 26391:
#   `max_windowed_einsum_iteration` = the compile options' `slice_size`). With no
#   devices the size is 0, the partitioner logs "Set SPMD max windowed einsum iteration
#   to 0" (TF_CPP_MAX_VLOG_LEVEL=1) and every windowed einsum, 8 partitions > 0
#   iterations, is refused; no flag or compile option reachable from JAX sets it. So
#   `xla (collective matmul)` on an `h100xN` target is XLA's default program with the
#   latency-hiding scheduler: what XLA would do on 8 real H100s is not seen here.
COLLECTIVE_MATMUL = {
    "tpu": (("xla_tpu_all_gather_collective_matmul_mode", "post_spmd_conservative"),
            ("xla_tpu_reduce_scatter_collective_matmul_mode", "post_spmd_conservative")),
    "gpu": (("xla_gpu_threshold_for_windowed_einsum_mib", "0"),
            ("xla_gpu_multi_streamed_windowed_einsum", "true"),
            ("xla_gpu_enable_latency_hiding_scheduler", "true")),
}


def collective_matmul_flags(platform: str) -> str:
    """XLA's collective-matmul settings for `platform` ("gpu" or "tpu") as one string
    (`XLA_FLAGS` syntax on GPU, `LIBTPU_INIT_ARGS` syntax on TPU)."""
    if platform not in COLLECTIVE_MATMUL:
        raise ValueError(f"collective_matmul_flags: platform must be one of "
                         f"{sorted(COLLECTIVE_MATMUL)}, got {platform!r}.")
    return " ".join(f"--{k}={v}" for k, v in COLLECTIVE_MATMUL[platform])


def _linear(layer, x, spec, constrain):
    """`eqx.nn.Linear` (which takes one vector) on x (..., in) -> (..., out), vmapped over
    the leading dimensions, its output constrained to `spec`."""
    f = layer
    for _ in range(x.ndim - 1):
        f = jax.vmap(f)
    return constrain(f(x), spec)


def _mlp(mlp, x, batch, constrain):
    """`_aot_programs._MLP` on global x (batch, seq, dim) -> (batch, seq, dim)."""
    # Column: the whole sequence, a shard of the hidden features; row: the sum
    # reduce-scattered back to a shard of the sequence.
    h = jax.nn.gelu(_linear(mlp.up, x, P(batch, None, "tp"), constrain))
    return x + _linear(mlp.down, h, P(batch, "tp", None), constrain)


def _block(block, x, constrain):
    """`_aot_programs._Block` on global x (batch, seq, dim) -> (batch, seq, dim), the
    layouts stated as constraints (batch over "fsdp"; seq or features over "tp")."""
    b, s, _ = x.shape
    heads = P("fsdp", None, "tp", None)
    q, k, v = (constrain(_linear(f, x, P("fsdp", None, "tp"), constrain)
                         .reshape(b, s, block.heads, -1), heads)
               for f in (block.q, block.k, block.v))
    attn = constrain(progs._attention(x, q, k, v), P("fsdp", None, "tp"))
    x = x + _linear(block.out, attn, P("fsdp", "tp", None), constrain)
    return _mlp(block.mlp, x, "fsdp", constrain)


def _param_specs(model, fsdp):
    """The parameters' PartitionSpecs a user would write for an `_MLP` or `_Block`: a
    column layer's weight (out, in) sharded on out over "tp", a row layer's on in, with
    `fsdp` the other dimension over "fsdp"; a column layer's bias over "tp", a row
    layer's replicated."""
    other = "fsdp" if fsdp else None
    specs = jax.tree.map(lambda a: P(), eqx.filter(model, progs._is_array),
                         is_leaf=progs._is_array)
    if isinstance(model, progs._MLP):
        layers = {"column": [lambda m: m.up], "row": [lambda m: m.down]}
    else:
        layers = {"column": [lambda m: m.q, lambda m: m.k, lambda m: m.v,
                             lambda m: m.mlp.up],
                  "row": [lambda m: m.out, lambda m: m.mlp.down]}
    for kind, gets in layers.items():
        weight = P("tp", other) if kind == "column" else P(other, "tp")
        bias = P("tp") if kind == "column" else P()
        for get in gets:
            specs = eqx.tree_at(lambda s: get(s).weight, specs, weight)
            if get(model).bias is not None:
                specs = eqx.tree_at(lambda s: get(s).bias, specs, bias)
    return specs


def layer_program(mesh, program, *, dtype=jnp.bfloat16, wrt_input=False, **sizes):
    """`(jitted, args)` of layer program `program` (one of `LAYER_PROGRAMS`) as XLA's
    partitioner makes it from `eqx.nn.Linear` layers: the MLP over the mesh axis "tp",
    the blocks over ("fsdp", "tp"), at `_aot_programs.LAYER_SIZES` unless given;
    `wrt_input`: the blocks' step also differentiates their input
    (`_aot_programs.step_program`)."""
    if program not in LAYER_PROGRAMS:
        raise ValueError(f"layer_program: program must be one of {LAYER_PROGRAMS}, got "
                         f"{program!r}.")

    def constrain(a, spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    if program == "mlp":
        dim, hidden, tokens = progs._sizes("mlp", sizes, "dim", "hidden", "tokens")
        model = eqx.filter_eval_shape(progs._MLP, dim, hidden, dtype, jax.random.key(0))
        return progs.step_program(
            mesh, model, _param_specs(model, False),
            lambda m, x: _mlp(m, x, None, constrain), (1, mesh.shape["tp"] * tokens, dim),
            P(None, "tp", None), dtype)
    model, x_shape, train = progs.block_model(program, dtype, **sizes)
    return progs.step_program(
        mesh, model, _param_specs(model, True), lambda m, x: _block(m, x, constrain),
        x_shape(mesh.shape["fsdp"], mesh.shape["tp"]), P("fsdp", "tp", None), dtype,
        train=train, wrt_input=wrt_input)


def op_program(mesh, prim, *, rows=progs.ROWS, k=progs.K, cols=progs.COLS,
               dtype=jnp.bfloat16):
    """`(jitted, args)` of primitive `prim`'s forward and backward as `x @ w` under
    `jax.jit` on the mesh's one axis "x": the op's global shapes and layouts
    (`_aot_programs._op`), the output constrained to the op's layout, the backward's
    cotangent `ct * y` as `_aot_programs.op_program`'s. ag_rows' output is what the op's
    `shard_map` returns, the n devices' copies of the whole product stacked (n * M, N),
    so that each device's copy gets a cotangent of its own, as in fusedpar's program."""
    n = mesh.shape["x"]
    _, xs, ws, xspec, wspec, ospec = progs._op(prim)(n, rows, k, cols)
    out = NamedSharding(mesh, ospec)
    copies = n if progs.prims.of(prim).traveller == "x" else 1  # w whole: n copies

    def fn(x, w):
        return jax.lax.with_sharding_constraint(jnp.tile(jnp.matmul(x, w), (copies, 1)),
                                                out)

    def body(x, w, ct):
        y, vjp = jax.vjp(fn, x, w)
        return (y,) + vjp(ct * y)

    args = [progs._struct(mesh, xs, dtype, xspec), progs._struct(mesh, ws, dtype, wspec)]
    y = jax.eval_shape(fn, *args)
    args.append(progs._struct(mesh, y.shape, dtype, ospec))
    return progs._under_mesh(mesh, jax.jit(body)), args
