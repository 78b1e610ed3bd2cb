"""rs_rows with its operands moved instead of its partial sums (`_operands_first`).

Values and gradients against the pure-lax definition under JAX's autodiff, on rings of
2 and 4; which collectives it runs; where `auto` takes it (never on CPU, never for a
run that also sums another op's partial sums).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _autodiff, _definition, _dispatch, _primitives as prims
from helpers import assert_close, equations, mesh, normal

pytestmark = pytest.mark.timeout(120)

K, N = 8, 16  # per device x (4 * n, K) @ w (K, N)


def _config(n, dtype, axis="x"):
    return prims.Config(backend="reference", axis_name=axis, axis_size=n,
                        bidirectional=False, unroll=True, out_dtype=np.dtype(dtype),
                        reduce_dtype=np.dtype(np.float32), auto=True,
                        rearranged=prims.OPERANDS_FIRST)


def _programs(n, dtype, axes=None):
    """(oracle, operands first): x's columns and w's rows split over "x", y's rows; with
    `axes`, over those axes of a 2x2 mesh ("a", "b"), in their order."""
    m = mesh((n,), ("x",)) if axes is None else mesh((2, 2), ("a", "b"))
    axis = "x" if axes is None else axes
    cfg = _config(n, dtype, axis)
    ours = lambda x, w: _autodiff.apply(prims.RS_ROWS, cfg, x, w)
    oracle = lambda x, w: _definition.matmul_reduce_scatter(x, w, axis, dim=0)
    return [jax.shard_map(f, mesh=m, in_specs=(P(None, axis), P(axis)), out_specs=P(axis))
            for f in (oracle, ours)]


@pytest.mark.parametrize("n, axes, dtype", [(2, None, jnp.float32), (4, None, jnp.bfloat16),
                                            (4, ("b", "a"), jnp.float32)],
                         ids=["2-f32", "4-bf16", "4-axes-b-a-f32"])
def test_operands_first_matches_definition(n, axes, dtype):
    """Rings of 2 and 4, and a ring over two mesh axes in the other order than the
    mesh's (`ppermute` numbers devices in the mesh's order); each dtype on some of them
    (each of the six pairs took 6-12 s on 2 cores)."""
    x, w = normal(0, (4 * n, n * K), dtype), normal(1, (n * K, N), dtype)
    ct = normal(2, (4 * n, N), jnp.float32)
    fns = _programs(n, dtype, axes)

    def loss(f, x, w):
        return jnp.vdot(f(x, w).astype(jnp.float32), ct)

    want, got = [(f(x, w),) + jax.grad(loss, argnums=(1, 2))(f, x, w) for f in fns]
    for name, g, e in zip(("y", "dx", "dw"), got, want):
        assert_close(g, e, dtype, f"ring of {n} {name}")


def test_operands_first_moves_operands_not_sums():
    """Forward: one all-to-all of x's rows and n - 1 permutes of w, no reduce-scatter."""
    n = 4
    x, w = normal(0, (4 * n, n * K), jnp.bfloat16), normal(1, (n * K, N), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(_programs(n, jnp.bfloat16)[1])(x, w)
    found = [e.primitive.name for e in equations(jaxpr)]
    assert found.count("all_to_all") == 1 and found.count("ppermute") == n - 1
    assert "reduce_scatter" not in found and "psum" not in found


def _rs(rows, k, cols, n, platform):
    s = jax.ShapeDtypeStruct
    return fusedpar.explain("matmul_reduce_scatter", s((rows, k), jnp.bfloat16),
                            s((k, cols), jnp.bfloat16), n, platform=platform)


def test_auto_moves_operands_where_the_sums_outweigh_them():
    """A row-parallel output projection over a long sequence (per device x (8192, 1024) @
    w (1024, 4096) over 4): x's rows and w, 36 MiB a device, against 96 MiB of float32
    partial sums, even with w's transfer counted in full. Half the rows pay only where
    w, a weight, goes ahead of the call. Square slices keep the ring; CPU keeps the
    reference; a run that sums another op's partial sums too cannot move its operands."""
    wide = _rs(8192, 1024, 4096, 4, "tpu")
    assert wide.rearranged == prims.OPERANDS_FIRST and wide.backend == "reference"
    assert "operands first" in str(wide) and "96 MiB" in wide.reason
    assert not _rs(8192, 4096, 4096, 4, "tpu").rearranged
    assert not _rs(8192, 1024, 4096, 4, "cpu").rearranged
    call = prims.Call("matmul_reduce_scatter", prims.RS_ROWS, (8192, 1024), (1024, 4096),
                      "bfloat16", 4, "tpu")
    assert _dispatch.operands_first(call, "pallas")
    assert _dispatch.operands_first(dataclasses.replace(call, w_ahead=False), "pallas")
    half = dataclasses.replace(call, x_shape=(4096, 1024))
    assert _dispatch.operands_first(half, "pallas")
    assert not _dispatch.operands_first(dataclasses.replace(half, w_ahead=False), "pallas")
    assert not _dispatch.operands_first(dataclasses.replace(call, adding=True), "pallas")


def test_w_counts_beyond_one_matmul_of_work_before_the_call():
    """w goes to N - 1 devices: over 16 TPU v5e chips a sequence-parallel MLP's row layer
    (per device x (16384, 1024) @ w (1024, 4096)) would send 120 MiB of w, more than the
    work before the call hides (counted as one matmul of the call's FLOPs). Counted
    free, `auto` moved the operands, and the compiled step replayed slower than on the
    fused kernel it would otherwise run."""
    call = prims.Call("matmul_reduce_scatter", prims.RS_ROWS, (16384, 1024), (1024, 4096),
                      "bfloat16", 16, "tpu")
    hw = fusedpar.cost_model.get_hardware(None, call.target)
    est = fusedpar.cost_model.operands_first(call, hw)
    local = est.compute_step
    alone = fusedpar.cost_model.operands_first(dataclasses.replace(call, w_ahead=False), hw)
    assert est.seconds == pytest.approx(alone.seconds - local)  # one matmul of w hidden
    assert not _dispatch.operands_first(call, "pallas")


def test_a_reference_hidden_beside_other_work_stays():
    """A backward's rs_rows beside the other gradient's matmul (on 8 x H100's preset, x
    (8192, 2048) @ w (2048, 4096) over 2): the reference's reduce-scatter hides behind
    that matmul, which the comparison counts as `auto_choice` does."""
    call = prims.Call("all_gather_matmul", prims.RS_ROWS, (8192, 2048), (2048, 4096),
                      "bfloat16", 2, "gpu")
    assert _dispatch.operands_first(call, "reference")
    hw = fusedpar.cost_model.PRESETS["h100_sxm"]
    beside = (fusedpar.cost_model.matmul_seconds(2048, 8192, 4096, "bfloat16", hw)
              - hw.launch_overhead)
    assert not _dispatch.operands_first(dataclasses.replace(call, beside=beside), "reference")
