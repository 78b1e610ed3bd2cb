"""The fused TPU kernels lower for TPU without a TPU (Pallas -> Mosaic), at real sizes.

`jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))` runs the Pallas TPU
lowering of every kernel in `f` (forward and the custom-VJP backward) and embeds the
Mosaic module in a `tpu_custom_call`; nothing runs. Per-device layer size 4096 x 8192 x
4096 bf16: the operands are far larger than VMEM, so these are the tiled HBM kernels
(`emit_pipeline`). Small problems lower the all-in-VMEM variant. Mosaic's final
compilation (and running) still needs a TPU: these kernels have not run on one.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar

from helpers import mesh

pytestmark = pytest.mark.timeout(120)

N = 4
M, K, C = 4096, 8192, 4096  # per-device rows, contraction, output columns


def _op(prim, n):
    """(op(x, w, **kw), per-device x shape, per-device w shape) for each primitive."""
    agm, mrs = fusedpar.all_gather_matmul, fusedpar.matmul_reduce_scatter
    return {
        "ag_rows": (lambda x, w, **kw: agm(x, w, "x", **kw), (M, K), (K, C)),
        "ag_cols": (lambda x, w, **kw: agm(x, w, "x", gather="rhs", dim=1, **kw),
                    (M, K), (K, C // n)),
        "ag_contract": (lambda x, w, **kw: agm(x, w, "x", gather="rhs", dim=0, **kw),
                        (M, K), (K // n, C)),
        "rs_rows": (lambda x, w, **kw: mrs(x, w, "x", dim=0, **kw), (M, K), (K, C)),
        "rs_cols": (lambda x, w, **kw: mrs(x, w, "x", dim=1, **kw), (M, K), (K, C)),
    }[prim]


def _lower(prim, bidirectional, scale=1, options=None):
    op, xs, ws = _op(prim, N)
    xs, ws = (xs[0] // scale, xs[1] // scale), (ws[0] // scale, ws[1] // scale)
    kw = dict(backend="pallas_tpu", bidirectional=bidirectional,
              options={"interpret": False, **(options or {})})

    def loss(x, w):
        return jnp.sum(op(x, w, **kw).astype(jnp.float32))

    f = jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1)), mesh=mesh((N,), ("x",)),
                      in_specs=(P("x"), P("x")), out_specs=(P(), (P("x"), P("x"))),
                      check_vma=False)
    x = jax.ShapeDtypeStruct((N * xs[0], xs[1]), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((N * ws[0], ws[1]), jnp.bfloat16)
    return jax.jit(f).trace(x, w).lower(lowering_platforms=("tpu",)).as_text()


PRIMS = ["ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols"]


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("prim", PRIMS)
def test_lowers_for_tpu_at_layer_size(prim, bidirectional):
    text = _lower(prim, bidirectional)
    # Forward and backward each contain one fused ring kernel.
    assert text.count("tpu_custom_call") >= 2, prim


@pytest.mark.parametrize("prim", PRIMS)
def test_lowers_for_tpu_all_in_vmem(prim):
    """256 x 512 x 256 per device: every buffer fits VMEM (no tiling)."""
    text = _lower(prim, True, scale=16)
    assert text.count("tpu_custom_call") >= 2, prim


def test_lowers_with_tile_options():
    text = _lower("ag_rows", True, options={"block_m": 256, "block_n": 1024, "block_k": 256})
    assert "tpu_custom_call" in text
