"""ag_rows with a w JAX proves replicated: `auto` multiplies first and gathers the product.

Values and gradients against the pure-lax definition under JAX's autodiff, on rings of
2 and 4; with check_vma=False nothing proves w replicated and the op gathers x as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _definition
from helpers import assert_close, equations, mesh, needs_aot, normal

pytestmark = pytest.mark.timeout(120)

K, N = 16, 8  # k != n, so which operand an all-gather moves shows in its shape


def _programs(n, check_vma, op="ag", dim=0, **kw):
    """(oracle, fusedpar) shard_map'd: x rows sharded over "x", w replicated."""
    m = mesh((n,), ("x",))
    if op == "ag":  # y = all_gather(x) @ w: every device's copy, stacked
        def call(f, **kw):
            return lambda x, w: f(x, w, "x", gather="lhs", dim=dim, **kw)[None]
        ours = call(fusedpar.all_gather_matmul, **kw)
        oracle = call(_definition.all_gather_matmul)
        specs = (P(*(None,) * dim, "x"), P()), P("x")
    else:  # y = psum_scatter(x @ w) with w replicated: its backward gathers dy
        ours = lambda x, w: fusedpar.matmul_reduce_scatter(x, w, "x", dim=0, **kw)
        oracle = lambda x, w: _definition.matmul_reduce_scatter(x, w, "x", dim=0)
        specs = (P("x"), P()), P("x")
    return [jax.shard_map(f, mesh=m, in_specs=specs[0], out_specs=specs[1],
                          check_vma=check_vma) for f in (oracle, ours)]


def _run(fns, x, w):
    """(y, dx, dw) of each program, one cotangent shared."""
    ct = normal(2, jax.eval_shape(fns[0], x, w).shape, jnp.float32)

    def loss(f, x, w):
        return jnp.vdot(f(x, w).astype(jnp.float32), ct)

    return [(f(x, w),) + jax.grad(loss, argnums=(1, 2))(f, x, w) for f in fns]


def _gathered_widths(f, x, w):
    """The last dimension of every array the program all-gathers (forward and backward)."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(),
                                    argnums=(0, 1)))(x, w)
    return [e.invars[0].aval.shape[-1] for e in equations(jaxpr)
            if e.primitive.name == "all_gather"]


@pytest.mark.parametrize("n, dtype", [(2, jnp.float32), (4, jnp.bfloat16)],
                         ids=["2-f32", "4-bf16"])
def test_product_first_matches_definition(n, dtype):
    x, w = normal(0, (4 * n, K), dtype), normal(1, (K, N), dtype)
    oracle, ours = _programs(n, check_vma=True)
    (want, got) = _run([oracle, ours], x, w)
    for name, g, e in zip(("y", "dx", "dw"), got, want):
        assert_close(g, e, dtype, f"ring of {n} {name}")
    # Forward gathers the (m, n) product; nothing gathers x (k columns).
    assert _gathered_widths(ours, x, w) == [N]


def _collectives(f, x, w):
    """`(primitive, dtype)` of every collective in the program's forward and backward
    besides its all-gathers (which `_gathered_widths` reads)."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(),
                                    argnums=(0, 1)))(x, w)
    return [(e.primitive.name, jnp.dtype(e.invars[0].aval.dtype).name)
            for e in equations(jaxpr)
            if e.primitive.name in ("all_to_all", "reduce_scatter", "psum", "psum_invariant")]


def test_bfloat16_cotangents_travel_as_they_are():
    """The backward sums every device's copy of the product's cotangent in float32
    (`reduce_dtype`). Its addends are bfloat16 already, so off TPU they travel as they
    are, by all-to-all, and each device adds its rows of them in float32: no float32
    reduce-scatter (its values: `test_product_first_matches_definition`)."""
    x, w = normal(0, (16, K), jnp.bfloat16), normal(1, (K, N), jnp.bfloat16)
    _, ours = _programs(4, check_vma=True)
    found = _collectives(ours, x, w)
    assert ("all_to_all", "bfloat16") in found, found
    assert not any(name == "reduce_scatter" for name, _ in found), found


@needs_aot
@pytest.mark.parametrize("reduce_dtype", [None, jnp.bfloat16], ids=["f32-sums", "bf16-sums"])
@pytest.mark.parametrize("target, travels", [("v5p:2x2x2", "all_to_all"),
                                             ("v5e:2x4", "reduce_scatter")])
def test_tpu_cotangents_travel_where_the_links_carry_less(target, travels, reduce_dtype):
    """On a TPU slice the cotangents travel by all-to-all where its most loaded links
    carry less than a one-hop ring's, with either sum dtype: on v5p's 2x2x2 cube (0.57),
    not on v5e's 2x4 grid (1.14). With bfloat16 sums, v5p's all-to-all replayed at
    1,316 us against 1,551 for the bfloat16 reduce-scatter it had run."""
    from fusedpar import aot
    from fusedpar._compile import _aot_programs as progs
    from fusedpar._core import _primitives as prims

    m = aot.mesh(target, (8,), ("x",))
    program, args = progs.op_program(m, prims.AG_ROWS, "auto", rows=64, k=256, cols=256,
                                     reduce_dtype=reduce_dtype)
    text = program.lower(*args).as_text()
    found = {c for c in ("all_to_all", "reduce_scatter") if f"stablehlo.{c}" in text}
    assert found == {travels}, found


def test_batched_dim_and_keep_gathered_false():
    """A gathered middle dim (rows after canonicalisation) and keep_gathered=False."""
    x, w = normal(0, (3, 8, K), jnp.float32), normal(1, (K, N), jnp.float32)
    oracle, ours = _programs(4, check_vma=True, dim=1, keep_gathered=False)
    want, got = _run([oracle, ours], x, w)
    assert_close(got, want, jnp.float32, "dim=1")
    assert _gathered_widths(ours, x, w) == [N]


def test_check_vma_false_gathers_x():
    """Unproven invariance is never assumed: the op gathers x, with the same results."""
    x, w = normal(0, (8, K), jnp.float32), normal(1, (K, N), jnp.float32)
    oracle, ours = _programs(2, check_vma=False)
    want, got = _run([oracle, ours], x, w)
    assert_close(got, want, jnp.float32, "check_vma=False")
    assert K in _gathered_widths(ours, x, w) and N not in _gathered_widths(ours, x, w)


def test_reduce_scatter_backward_gathers_dy_and_product():
    """rs_rows with a replicated w: its backward's ag_rows(dy, w.T) must also return the
    gathered dy (for dw); product first, it gathers both."""
    x, w = normal(0, (4 * 8, K), jnp.float32), normal(1, (K, N), jnp.float32)
    oracle, ours = _programs(4, check_vma=True, op="rs")
    want, got = _run([oracle, ours], x, w)
    assert_close(got, want, jnp.float32, "rs_rows backward")
    assert sorted(_gathered_widths(ours, x, w)) == [N, K]  # dy, and dy @ w.T


def test_explain_says_so():
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    first = fusedpar.explain("all_gather_matmul", x, w, 8, platform="gpu", w_invariant=True)
    assert first.product_first and first.backend == "reference"
    assert "invariant" in first.reason and "product first" in str(first)
    plain = fusedpar.explain("all_gather_matmul", x, w, 8, platform="gpu")
    assert not plain.product_first
    asked = fusedpar.explain("all_gather_matmul", x, w, 8, backend="ring", w_invariant=True)
    assert not asked.product_first  # an explicit backend runs as asked


def test_explain_reads_a_named_axis_as_the_op_does():
    """Inside shard_map, `explain` given the axis name sees w's varying-axes type as the
    op does: a replicated w is multiplied first (the op gathers the N-wide product, not
    x), a sharded one is not; given only the size it cannot know."""
    x, w = normal(0, (8 * 8, K), jnp.float32), normal(1, (K, N), jnp.float32)
    seen = {}

    def f(x, w, w_sharded):
        seen["replicated"] = fusedpar.explain("all_gather_matmul", x, w, "x")
        seen["sharded"] = fusedpar.explain("all_gather_matmul", x, w_sharded, "x")
        seen["size"] = fusedpar.explain("all_gather_matmul", x, w, 8)
        seen["int8 grads"] = fusedpar.explain("all_gather_matmul", x, w, "x",
                                              grad_comm_dtype=jnp.int8)
        return fusedpar.all_gather_matmul(x, w, "x")[None]

    prog = jax.shard_map(f, mesh=mesh((8,), ("x",)), in_specs=(P("x"), P(), P("x")),
                         out_specs=P("x"))
    jaxpr = jax.make_jaxpr(prog)(x, w, jnp.tile(w, (8, 1)))
    gathered = [e.invars[0].aval.shape[-1] for e in equations(jaxpr)
                if e.primitive.name == "all_gather"]
    assert seen["replicated"].product_first and gathered == [N]
    assert not seen["sharded"].product_first and not seen["size"].product_first
    assert not seen["int8 grads"].product_first  # no quantized backward multiplies first
    with pytest.raises(ValueError, match="outside shard_map pass the axis's size"):
        fusedpar.explain("all_gather_matmul", x, w, "x")
