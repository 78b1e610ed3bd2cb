"""What the TPU kernels plan for, without running anything: Mosaic's tiles per dtype, the
presets per TPU generation and the numbers docs/tpu.md gives for them."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from fusedpar._core._backends.pallas_tpu import chip as tpu_chip
from fusedpar.kernels.tpu import _layout, _tile_plan
from fusedpar._hw._target import of_platform

MiB = 2**20
GENERATIONS = ("v4", "v5e", "v5p", "v6e", "7x")


def test_tiles_are_eight_rows_for_32_16_and_8_bit_values():
    """Measured with Mosaic (kernels/tpu/_layout.py; tests/test_tpu_mosaic.py proves it):
    bfloat16 is laid out T(8,128)(2,1) and 8-bit values T(8,128)(4,1), so their tiles
    have 8 rows like float32's (not the packed 16 or 32)."""
    assert _layout.tile(jnp.float32) == (8, 128)
    assert _layout.tile(jnp.bfloat16) == (8, 128)
    assert _layout.tile(jnp.int8) == (8, 128)
    assert _layout.tile(jnp.float8_e4m3fn) == (8, 128)


@pytest.mark.parametrize("dtype,rows_ok,rows_bad", [
    ("float32", 8, 4), ("bfloat16", 8, 12), ("int8", 8, 4), ("float8_e4m3fn", 8, 12)])
def test_row_windows(dtype, rows_ok, rows_bad):
    def window(length):
        return _layout.Window("x", (256, 512), dtype, -2, length)

    assert window(rows_ok).problem() is None
    assert window(3 * rows_ok).problem() is None
    why = window(rows_bad).problem(tpu_chip("v6e"))
    assert f"not a multiple of {rows_ok} rows of {dtype}" in why
    assert f"Mosaic for TPU v6e lays {dtype} out in ({rows_ok}, 128) tiles" in why
    assert f"make that dimension's blocks multiples of {rows_ok}" in why
    assert window(256).problem() is None  # the whole dimension is always a window


def test_lane_windows_and_free_leading_dimensions():
    W = _layout.Window
    assert W("w", (256, 512), "bfloat16", -1, 128).problem() is None
    assert "not a multiple of 128 lanes" in W("w", (256, 512), "bfloat16", -1, 32).problem()
    assert W("w", (256, 96), "bfloat16", -1, 96).problem() is None  # whole dimension
    assert W("slots", (2, 2, 24, 96), "bfloat16", 0, 1).problem() is None


def test_the_bad_window_is_raised_only_when_enforced():
    bad = _layout.Window("w", (512, 64), "bfloat16", -1, 32)
    with _layout.recording() as seen:
        _layout.check(bad, enforce=False)
        with pytest.raises(_layout.LayoutError, match="window of 32 along dimension 1"):
            _layout.check(bad, enforce=True)
        with pytest.raises(_layout.LayoutError, match="Mosaic for TPU v5p lays"):
            _layout.check(bad, enforce=tpu_chip("v5p"))  # the chip built for
        _layout.check(bad, enforce=None)
    assert seen == [bad, bad, bad, bad]


@pytest.mark.parametrize("name", GENERATIONS)
def test_presets_rest_on_the_documented_numbers(name):
    chip = tpu_chip(name)
    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(name), 1)
    expected = {"v4": (16, 16, 16), "v5e": (128, 16, 96), "v5p": (64, 16, 48),
                "v6e": (128, 32, 96), "7x": (64, 16, 48)}[name]  # VMEM, default, ours (MiB)
    assert (chip.vmem_bytes // MiB, chip.default_scoped_vmem_bytes // MiB,
            chip.vmem_limit_bytes // MiB) == expected
    assert chip.vmem_limit_bytes <= chip.vmem_bytes
    assert chip.cores == (2 if name in ("v4", "v5p") else 1)
    bm, bk, bn = chip.tiles
    # Compute-bound from HBM: a bf16 tile's flop per byte above the device's peak / HBM BW
    # (a TPU7x chip's two TensorCores are two devices).
    peak = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12, "7x": 2307e12 / 2}[name]
    hbm = info.mem_bw_bytes_per_second * {"v4": 2, "v5p": 2}.get(name, 1)  # per device
    assert bm * bn / (bm + bn) > peak / hbm
    mxu = info.mxu_column_size
    assert bm % mxu == bk % mxu == bn % mxu == 0
    # The tiles fit the budget in bf16 and in f32 (ints: documented MiB in bf16).
    bf16 = _tile_plan.tile_bytes(chip.tiles, jnp.bfloat16, jnp.bfloat16)
    assert bf16 // MiB == {"v4": 4, "v5e": 10, "v5p": 10, "v6e": 28, "7x": 16}[name]
    assert _tile_plan.tile_bytes(chip.tiles, jnp.float32, jnp.float32) <= chip.budget_bytes
    if name == "v6e":  # the reason vmem_limit_bytes is set
        assert bf16 + 8 * MiB > chip.default_scoped_vmem_bytes * 7 // 8


def test_unknown_generation_and_missing_cores_are_refused():
    with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
        tpu_chip("v9")
    with pytest.raises(ValueError, match="a TPU v5e device has 1 TensorCore"):
        tpu_chip("v5e", cores=2)  # the two programs would run one after the other
    assert tpu_chip("v5p", cores=1).cores == 1  # split mode


class _Launch:
    def __init__(self, chip, vmem=None, tile_targets=None):
        self.chip, self.vmem, self.tile_targets = chip, vmem, tile_targets


def test_tiles_are_aligned_for_the_dtypes_they_cut():
    chip = tpu_chip("v5e")
    # bf16 operands: rows in steps of 8 (bf16's tile has 8 rows, measured with Mosaic):
    # 984 = 8 * 123 rows have the tile 24, none that is a multiple of 16.
    t, why = _tile_plan.tiles((24 * 41, 4096, 4096), jnp.bfloat16, jnp.bfloat16, (100, 512, 512))
    assert why is None and t == (24, 512, 512)
    assert _tile_plan.pick(24 * 41, 100, 16) is None
    t, _ = _tile_plan.tiles((24 * 40, 4096, 4096), jnp.float32, jnp.float32, (100, 512, 512))
    assert t == (96, 512, 512) and _tile_plan.pick(24 * 40, 100, 8) == 96
    assert _tile_plan.pick(40, 20, 16) is None  # no multiple of 16 divides 40
    layout, _ = _tile_plan.plan(_Launch(chip, vmem=False), (4096, 8192, 4096),
                                jnp.bfloat16, jnp.bfloat16, [], [
                                    ("w_resident", (8192, 4096), jnp.bfloat16),
                                    ("acc", (4096, 4096), jnp.float32)])
    # 84 MiB budget - 10 MiB of tiles: the 64 MiB stationary operand stays, the sum not.
    assert layout.tiles == chip.tiles and layout.resident == {"w_resident"}


def _resident(prim, chip, m, k, c, n=4):
    """What the plan keeps in VMEM for `prim` at per-device sizes (m, k, c), bf16."""
    import jax

    from fusedpar._core._backends import pallas_tpu

    shapes = {"ag_rows": ((m, k), (k, c)), "ag_cols": ((m, k), (k, c // n)),
              "ag_contract": ((m, k), (k // n, c)), "rs_rows": ((m, k), (k, c)),
              "rs_cols": ((m, k), (k, c))}[prim]
    module, params = pallas_tpu._params(
        prim, axis_name=None, axis_size=n, bidirectional=True, out_dtype="bfloat16",
        reduce_dtype="float32", return_gathered=False, target=of_platform("cpu"), get={"chip": chip}.get)
    x, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes)
    return {name.replace("_resident", "") for name in module.plan(params, x, w)[1].resident}


PRIMS = ("ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols")
STATIONARY = {"ag_rows": "w", "ag_cols": "x", "ag_contract": "x", "rs_rows": "w",
              "rs_cols": "x"}


def test_resident_buffers_at_the_layer_size():
    """docs/tpu.md: what stays in VMEM at 4096 x 8192 x 4096 bf16 per device, ring of 4."""
    got = {chip: {p: _resident(p, chip, 4096, 8192, 4096) for p in PRIMS}
           for chip in GENERATIONS}
    assert got["v5e"] == {p: {STATIONARY[p]} for p in PRIMS}
    assert got["v6e"] == {"ag_rows": set(), "ag_cols": {"x"}, "ag_contract": set(),
                          "rs_rows": {"stage"}, "rs_cols": {"x"}}
    assert got["v5p"] == {"ag_rows": set(), "ag_cols": set(), "ag_contract": set(),
                          "rs_rows": {"stage"}, "rs_cols": {"stage"}}
    assert got["v4"] == {p: set() for p in PRIMS}
    for chip in ("v5e", "v5p", "v6e"):  # at half the size
        for p in PRIMS:
            want = {STATIONARY[p]} | ({"stage"} if p.startswith("rs") else set())
            assert want <= _resident(p, chip, 2048, 4096, 2048), (chip, p)


def test_small_problems_stay_in_vmem():
    chip = tpu_chip("v5e")
    small = [((256, 256), np.float32)] * 4
    layout, _ = _tile_plan.plan(_Launch(chip), (256, 256, 256), np.float32, np.float32,
                                small, [])
    assert layout.in_vmem and layout.cores == 1
