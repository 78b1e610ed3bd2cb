"""The fused TPU kernels lower for TPU without a TPU (Pallas -> Mosaic), at real sizes.

`jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))` runs the Pallas TPU
lowering of every kernel in `f` (forward and the custom-VJP backward) and embeds the
Mosaic module in a `tpu_custom_call`; nothing runs. Per-device layer size 4096 x 8192 x
4096 bf16: the operands are far larger than the all-in-VMEM threshold, so these are the
tiled HBM kernels (`emit_pipeline`), planned for each TPU generation (tile presets, the
VMEM limit, resident operands, and the megacore split on v4/v5p). Small problems lower
the all-in-VMEM variant.

Neither the interpreter nor the Pallas lowering checks Mosaic's (sublane, lane) tiles, so
every window the kernels cut is recorded while they are built and checked against those
rules here (`kernels/tpu/_layout.py`: 8 rows for float32 and bfloat16, 128 lanes, as
measured with Mosaic); a size whose ring halves are 32 lanes wide is refused before
lowering. Mosaic's own compilation, deviceless, is `tests/test_tpu_mosaic.py` (needs
libtpu); running still needs a TPU: these kernels have not run on one.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar.kernels.tpu import _layout

from helpers import mesh

pytestmark = pytest.mark.timeout(120)

N = 4
LAYER = (4096, 8192, 4096)  # per-device rows, contraction, output columns
SMALL = (256, 1024, 1024)  # every buffer in VMEM; ring halves of 128 lanes / 32 rows


def _op(prim, n, m, k, c):
    """(op(x, w, **kw), per-device x shape, per-device w shape) for each primitive."""
    agm, mrs = fusedpar.all_gather_matmul, fusedpar.matmul_reduce_scatter
    return {
        "ag_rows": (lambda x, w, **kw: agm(x, w, "x", **kw), (m, k), (k, c)),
        "ag_cols": (lambda x, w, **kw: agm(x, w, "x", gather="rhs", dim=1, **kw),
                    (m, k), (k, c // n)),
        "ag_contract": (lambda x, w, **kw: agm(x, w, "x", gather="rhs", dim=0, **kw),
                        (m, k), (k // n, c)),
        "rs_rows": (lambda x, w, **kw: mrs(x, w, "x", dim=0, **kw), (m, k), (k, c)),
        "rs_cols": (lambda x, w, **kw: mrs(x, w, "x", dim=1, **kw), (m, k), (k, c)),
    }[prim]


def _lower(prim, bidirectional, sizes=LAYER, options=None, **op_kw):
    op, xs, ws = _op(prim, N, *sizes)
    kw = dict(backend="pallas_tpu", bidirectional=bidirectional,
              options={"interpret": False, **(options or {})}, **op_kw)

    def loss(x, w):
        return jnp.sum(op(x, w, **kw).astype(jnp.float32))

    f = jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1)), mesh=mesh((N,), ("x",)),
                      in_specs=(P("x"), P("x")), out_specs=(P(), (P("x"), P("x"))),
                      check_vma=False)
    x = jax.ShapeDtypeStruct((N * xs[0], xs[1]), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((N * ws[0], ws[1]), jnp.bfloat16)
    return jax.jit(f).trace(x, w).lower(lowering_platforms=("tpu",)).as_text()


def _lower_checked(prim, bidirectional, sizes=LAYER, options=None):
    """Lower, and replay Mosaic's layout rules on every window the kernels cut."""
    with _layout.recording() as windows:
        text = _lower(prim, bidirectional, sizes, options)
    assert windows, "no window was recorded: the kernels were not built"
    bad = [w for w in windows if w.problem() is not None]
    assert not bad, f"{prim}: windows Mosaic would refuse: {bad[:3]}"
    return text, windows


PRIMS = ["ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols"]


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("prim", PRIMS)
def test_lowers_for_tpu_at_layer_size(prim, bidirectional):
    text, windows = _lower_checked(prim, bidirectional)
    # Forward and backward each contain one fused ring kernel.
    assert text.count("tpu_custom_call") >= 2, prim
    # Ring segments and pipeline tiles were both cut (and checked).
    names = {w.name for w in windows}
    assert "out" in names and "the step's left operand" in names, names


@pytest.mark.parametrize("chip", ["v4", "v5p", "v6e"])
@pytest.mark.parametrize("prim", PRIMS)
def test_lowers_for_each_generation(prim, chip):
    """Each generation's tiles, VMEM limit and residents (v4, v5p: two TensorCores)."""
    text, _ = _lower_checked(prim, True, options={"chip": chip})
    assert text.count("tpu_custom_call") >= 2, prim
    # Each kernel asks for the generation's scoped VMEM limit (3/4 of VMEM, at least the
    # compiler's default), and the forward and backward kernels have different ids.
    limit = {"v4": 16, "v5p": 48, "v6e": 96}[chip] * 2**20
    assert text.count(f"\\22size\\22: {limit}") >= 2, prim
    ids = set(re.findall(r"\\22collective_id\\22: (\d+)", text))
    assert len(ids) == 2, ids


@pytest.mark.parametrize("prim", PRIMS)
def test_lowers_for_tpu_all_in_vmem(prim):
    """256 x 1024 x 1024 per device: every buffer fits VMEM (no tiling)."""
    text, windows = _lower_checked(prim, True, SMALL)
    assert text.count("tpu_custom_call") >= 2, prim
    assert not any(w.name.startswith("the step's") for w in windows)  # no pipeline tiles


def test_misaligned_ring_halves_are_refused_before_lowering():
    """256 x 512 x 256 per device: ag_cols' bidirectional halves are 32 lanes wide."""
    with pytest.raises(NotImplementedError, match="window of 32 along dimension 1 of w "
                                                  r"\(512, 64\) bfloat16"):
        _lower("ag_cols", True, (256, 512, 256))


def test_backward_windows_are_checked_too():
    """rs_rows at 256 x 1024 x 1024: its forward and its keep_gathered backward lower,
    but the keep_gathered=False backward gathers x.T's columns in halves of 32 lanes (the
    forward and keep_gathered backward: test_lowers_for_tpu_all_in_vmem[rs_rows])."""
    with pytest.raises(NotImplementedError, match=r"ag_contract: .* window of 32 along "
                                                  r"dimension 1 of x \(1024, 256\)"):
        _lower("rs_rows", True, SMALL, keep_gathered=False)


def test_lowers_with_tile_options():
    text = _lower("ag_rows", True, options={"block_m": 256, "block_n": 1024, "block_k": 256})
    assert "tpu_custom_call" in text


def test_bfloat16_ring_windows_of_eight_rows_lower_and_twelve_are_refused():
    """bfloat16's tile has 8 rows (T(8,128)(2,1)): ag_rows' bidirectional halves of 8 rows
    (16 per device) lower; halves of 12 rows are refused before lowering."""
    _, windows = _lower_checked("ag_rows", True, (16, 1024, 1024))
    assert 8 in {w.length for w in windows if w.name == "out"}
    with pytest.raises(NotImplementedError, match=r"window of 12 along dimension 0 of x "
                                                  r"\(24, 1024\) bfloat16 is not a multiple "
                                                  "of 8 rows of bfloat16"):
        _lower("ag_rows", True, (24, 1024, 1024))
