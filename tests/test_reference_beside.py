"""A backward reduce-scatter that `auto` gives the reference, counting on it to run beside
the other gradient's matmul, is ordered so it does (`reference.run_beside`): values and
gradients against the pure-lax definition under JAX's autodiff.

On CPU `auto` never takes that path (it counts on nothing there), so these tests make it
(`_autodiff._counts_on_sibling`); the compiled 8 x H100 schedule it gives is checked in
tests/test_aot.py (`test_layer_programs_compile`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _autodiff, _definition, _primitives as prims
from fusedpar._core._backends import reference
from helpers import assert_close, mesh, needs_aot, normal

pytestmark = pytest.mark.timeout(120)

M, K, N = 8, 16, 24  # per device; k != n, so a transposed operand shows in its shape

# The gathers whose backward is a reduce-scatter beside a local matmul (keep_gathered):
# (gather, dim, x's spec, w's spec).
GATHERS = {prims.AG_ROWS: ("lhs", 0, P("x"), P(None, "x")),
           prims.AG_COLS: ("rhs", 1, P(), P(None, "x")),
           prims.AG_CONTRACT: ("rhs", 0, P("x"), P("x"))}


def _grads(f, m, specs, x, w):
    g = jax.shard_map(f, mesh=m, in_specs=specs, out_specs=P(None, "x"))
    ct = normal(2, jax.eval_shape(g, x, w).shape, jnp.float32)
    loss = lambda x, w: jnp.vdot(g(x, w).astype(jnp.float32), ct)
    return (g(x, w),) + jax.grad(loss, argnums=(0, 1))(x, w)


# Each gather once, the ring sizes and dtypes spread over them (every pair took 7-12 s
# on 2 cores).
@pytest.mark.parametrize("prim, n, dtype", [
    (prims.AG_ROWS, 4, jnp.bfloat16), (prims.AG_COLS, 2, jnp.float32),
    (prims.AG_CONTRACT, 4, jnp.bfloat16)], ids=["ag_rows-4-bf16", "ag_cols-2-f32",
                                                  "ag_contract-4-bf16"])
def test_a_gradient_beside_its_reduce_scatter_matches_definition(n, prim, dtype,
                                                                 monkeypatch):
    gather, dim, x_spec, w_spec = GATHERS[prim]
    seen = []

    def counts(call, cfg, return_gathered):
        seen.append(call.prim)
        return True

    monkeypatch.setattr(_autodiff, "_counts_on_sibling", counts)
    m = mesh((n,), ("x",))
    x, w = normal(0, (M * n, K * n), dtype), normal(1, (K * n, N * n), dtype)
    ours = lambda x, w: fusedpar.all_gather_matmul(x, w, "x", gather=gather, dim=dim)
    oracle = lambda x, w: _definition.all_gather_matmul(x, w, "x", gather=gather, dim=dim)
    got = _grads(ours, m, (x_spec, w_spec), x, w)
    want = _grads(oracle, m, (x_spec, w_spec), x, w)
    for name, g, e in zip(("y", "dx", "dw"), got, want):
        assert_close(g, e, dtype, f"{prim} ring of {n} {name}")
    # The backward's reduce-scatter dual, and only it, was asked (then ran `run_beside`).
    assert seen == [g.prim for g in prims.of(prim).backward_keep if g.prim], seen


@pytest.mark.parametrize("prim", [prims.RS_ROWS, prims.RS_COLS])
def test_run_beside_is_its_reduce_scatter_and_its_sibling(prim):
    """Both results as computed apart, with an addend summed in the same scatter."""
    n = 4
    m = mesh((n,), ("x",))
    dim = prims.of(prim).gather_axis
    x, w = normal(0, (M * n, K), jnp.float32), normal(1, (K, N * n), jnp.float32)
    addend = normal(3, (M * n, N * n), jnp.float32)
    a, b = normal(4, (K, M), jnp.float32), normal(5, (M, N), jnp.float32)
    config = prims.Config(backend="reference", axis_name="x", axis_size=n,
                          bidirectional=False, unroll=True, out_dtype=np.dtype("float32"),
                          reduce_dtype=np.dtype("float32"))

    def ours(x, w, addend, a, b):
        return reference.run_beside(prim, config, x, w, (jnp.matmul, (a, b)), addend)

    def oracle(x, w, addend, a, b):
        return (_definition.matmul_reduce_scatter(x, w, "x", dim=dim, addend=addend),
                jnp.matmul(a, b))

    specs = (P(), P(), P(), P(), P())
    out_specs = (P("x") if dim == 0 else P(None, "x"), P())
    run = lambda f: jax.shard_map(f, mesh=m, in_specs=specs, out_specs=out_specs,
                                  check_vma=False)(x, w, addend, a, b)
    for g, e in zip(run(ours), run(oracle)):
        assert_close(g, e, jnp.float32, prim)


@pytest.mark.aot
@needs_aot
def test_auto_counts_only_on_a_sibling_that_can_hide_something():
    """On 8 H100s the block's MLP input gradient (its sibling 178 us beside a 125 us
    reduce-scatter; 7.2 beside 20.5 at tests/test_aot.py's smaller size) is ordered; a
    width-256 step (4.6 us, 4.5 of them the launch, beside a 14 us one) is not: there
    the barriers only constrained XLA's schedule."""
    from fusedpar import aot, cost_model
    from fusedpar._hw import _target

    target = _target.of_mesh(aot.mesh("h100x8"))
    hw = cost_model.get_hardware(None, target)

    def counted(rows, k, n):
        call = prims.Call(op=prims.MATMUL_REDUCE_SCATTER, prim=prims.RS_ROWS,
                          x_shape=(rows, k), w_shape=(k, n), dtype="bfloat16", axis_size=4,
                          target=target,
                          beside=cost_model.matmul_seconds(rows, k, n, "bfloat16", hw)
                          - hw.launch_overhead)
        cfg = prims.Config(backend="reference", axis_name="x", axis_size=4,
                           bidirectional=False, unroll=True, out_dtype=np.dtype("float32"),
                           reduce_dtype=np.dtype("float32"))
        return _autodiff._counts_on_sibling(call, cfg, False)

    assert counted(4096, 4096, 4096) and counted(1024, 1024, 1024)
    assert not counted(256, 256, 256)
