"""Protocol checks of the fused TPU kernels in interpret mode: races, NaN, semaphores.

Each check runs a kernel with `InterpretParams(detect_races=True, dma_execution_mode=...)`
(uninitialized memory is NaN, the default) and asserts: the race flag is down, the
captured output has neither "RACE DETECTED" nor a semaphore "non-zero count" at kernel
exit, and the result is finite and equal to the definition. "on_wait" runs twice (its
DMA timing varies run to run), "eager" once. Deliberately broken variants (private
option `_broken`, same kernel code otherwise) show that every one of these checks fails
when the protocol is wrong.

Coverage: every primitive bidirectional (both directions' slots, semaphores and credits)
at ring sizes 2, 4 and 8, all in VMEM (ring buffers as scratch); the unidirectional ring
(same code, one direction) and the tiled HBM path (emit_pipeline, vmem=False) for
ag_rows, ag_contract and rs_rows at size 4, with the stationary operand, the partial
product and the f32 sum resident in VMEM, and again on a chip too small for them (every
buffer in HBM); the megacore split (two TensorCores per device, interpreted as two
cores: core 0 runs the ring, both compute) for ag_rows, ag_contract and rs_rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpret_state
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from fusedpar._core import _definition, _primitives as Prim
from fusedpar._core._backends import pallas_tpu
from fusedpar.kernels.tpu import Chip, _tile_plan

from helpers import assert_close, mesh, normal
from fusedpar._hw._target import of_platform

pytestmark = pytest.mark.timeout(240)

R, K, C = 16, 32, 128


def _shapes(prim, n):
    return {"ag_rows": ((R, K), (K, C)), "ag_cols": ((R, K), (K, C)),
            "ag_contract": ((R, n * K), (K, C)), "rs_rows": ((n * R, K), (K, C)),
            "rs_cols": ((R, K), (K, n * C))}[prim]


def _definition_of(prim, x, w):
    d = _definition
    if prim == "ag_rows":
        return d.all_gather_matmul(x, w, "x"), jax.lax.all_gather(x, "x", tiled=True)
    if prim == "ag_cols":
        return (d.all_gather_matmul(x, w, "x", gather="rhs", dim=1),
                jax.lax.all_gather(w, "x", axis=1, tiled=True))
    if prim == "ag_contract":
        return (d.all_gather_matmul(x, w, "x", gather="rhs", dim=0),
                jax.lax.all_gather(w, "x", axis=0, tiled=True))
    return d.matmul_reduce_scatter(x, w, "x", dim=0 if prim == "rs_rows" else 1)


def _functions(prim, n, bidirectional, params, **options):
    """(kernel, definition): jitted shard_maps over n devices of per-device operands."""
    cfg = Prim.Config("pallas_tpu", "x", n, bidirectional, True, np.dtype(jnp.float32),
                      np.dtype(jnp.float32),
                      options=tuple(sorted({"interpret_params": params, **options}.items())))

    def kernel(x, w):  # gathers also return the gathered operand (its own local DMAs)
        return pallas_tpu.run(prim, cfg, x, w, return_gathered=prim in Prim.GATHERS)

    out = (P("x"), P("x")) if prim in Prim.GATHERS else P("x")
    m = mesh((n,), ("x",))

    def wrap(f):
        return jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("x"), P("x")), out_specs=out,
                                     check_vma=False))

    return wrap(kernel), wrap(lambda x, w: _definition_of(prim, x, w))


def _inputs(prim, n):
    xs, ws = _shapes(prim, n)
    return (normal(0, (n * xs[0], xs[1]), jnp.float32),
            normal(1, (n * ws[0], ws[1]), jnp.float32))


def _run_checked(f, args, capfd):
    """Run `f`; return (result, races flag, captured output)."""
    capfd.readouterr()
    got = jax.block_until_ready(f(*args))
    races = interpret_state.races.races_found
    out, err = capfd.readouterr()
    return got, races, out + err


def _assert_clean(prim, n, bidirectional, capfd, runs, **options):
    args = _inputs(prim, n)
    want = None
    for mode, times in runs:
        params = pltpu.InterpretParams(dma_execution_mode=mode, detect_races=True)
        f, definition = _functions(prim, n, bidirectional, params, **options)
        want = definition(*args) if want is None else want
        for i in range(times):
            got, races, text = _run_checked(f, args, capfd)
            what = f"{prim} n={n} bidirectional={bidirectional} {mode} run {i}"
            assert not races, f"{what}: race detected\n{text[:2000]}"
            assert "RACE DETECTED" not in text, what
            assert "non-zero count" not in text, f"{what}: semaphore left non-zero\n{text[:2000]}"
            assert_close(got, want, jnp.float32, what)  # also asserts no NaN


RUNS = [("on_wait", 2), ("eager", 1)]


# Every primitive at rings of 2 and 4; at 8 (each case 7-11 s interpreted) the two kernel
# files' first primitives, whose protocol the others share.
@pytest.mark.parametrize("prim,n", [(p, n) for n in (2, 4) for p in Prim.PRIMITIVES]
                         + [("ag_rows", 8), ("rs_rows", 8)],
                         ids=lambda v: str(v))
def test_protocol_clean_bidirectional(prim, n, capfd):
    _assert_clean(prim, n, True, capfd, RUNS)


@pytest.mark.parametrize("prim", ["ag_rows", "rs_rows"])
def test_protocol_clean_unidirectional(prim, capfd):
    _assert_clean(prim, 4, False, capfd, RUNS)


@pytest.mark.parametrize("prim", ["ag_rows", "ag_contract", "rs_rows"])
def test_protocol_clean_tiled_hbm_path(prim, capfd):
    """Operands in HBM, each step an emit_pipeline over several row tiles (ag_contract:
    its f32 running sum is read and rewritten in place, tile by tile). The default chip's
    VMEM holds the stationary operand, the staging buffer and the sum resident."""
    layout = _layout(prim, 4, vmem=False, block_m=8)
    assert layout.resident and layout.tiles[0] == 8, layout
    _assert_clean(prim, 4, False, capfd, [("on_wait", 2)], vmem=False, block_m=8)


def _chip_without_room(prim, n):
    """A made-up generation whose VMEM budget holds the pipeline's tiles for `prim` and
    4 KiB more: no resident buffer (8 KiB and up at these shapes) fits."""
    tiles = _layout(prim, n, vmem=False).tiles
    need = _tile_plan.tile_bytes(tiles, jnp.float32, jnp.float32, prim == "ag_contract")
    # budget = 7/8 of the limit = 7/8 * 3/4 of VMEM (the default scoped limit set to 0)
    return Chip("small", vmem_bytes=(need + 4096) * 32 // 21 + 64,
                default_scoped_vmem_bytes=0, cores=1, tiles=tiles)


@pytest.mark.parametrize("prim", ["ag_contract", "rs_rows"])
def test_protocol_clean_tiled_without_resident_buffers(prim, capfd):
    """Every buffer in HBM: the stationary operand read by each step's pipeline, the
    partial product and the f32 sum written to and read back from HBM."""
    chip = _chip_without_room(prim, 4)
    assert not _layout(prim, 4, vmem=False, chip=chip).resident
    _assert_clean(prim, 4, False, capfd, [("on_wait", 1)], vmem=False, chip=chip)


@pytest.mark.parametrize("prim,n", [("ag_rows", 2), ("ag_contract", 2), ("rs_rows", 2)])
def test_protocol_clean_megacore(prim, n, capfd):
    """Two TensorCores per device (TPU v5p): each step's tiles split between them."""
    assert _layout(prim, n, vmem=False, chip="v5p", block_m=8).cores == 2
    _assert_clean(prim, n, True, capfd, [("on_wait", 1)], vmem=False, chip="v5p", block_m=8)


def _partnered(n, bidirectional, params, transposed=False, **options):
    """(kernel, definition) of an ag_rows with a partner (an rs_rows's backward: the
    cotangent gathered for x's gradient, `x.T @ gathered` for w's in the same kernel;
    `transposed`: written in memory as its transpose, a layer's `(out, in)` weight's)."""
    cfg = Prim.Config("pallas_tpu", "x", n, bidirectional, True, np.dtype(jnp.float32),
                      np.dtype(jnp.float32),
                      options=tuple(sorted({"interpret_params": params, **options}.items())))

    def kernel(x, w, p):
        done = pallas_tpu._run_partnered("ag_rows", cfg, x, w, p, jnp.float32, transposed)
        assert done is not None, "the partnered kernel cannot run this call"
        return done

    def definition(x, w, p):
        g = jax.lax.all_gather(x, "x", tiled=True)
        return g @ w, p.T @ g

    def wrap(f):
        return jax.jit(jax.shard_map(f, mesh=mesh((n,), ("x",)), in_specs=(P("x"),) * 3,
                                     out_specs=(P("x"), P("x")), check_vma=False))

    return wrap(kernel), wrap(definition)


# The partner's product at a ring of 4 both ways in VMEM, one way on the tiled HBM path
# (its f32 sum resident, its left operand read transposed in (bk, bm) tiles; the product
# written transposed, the piece then the transposed operand), and split between two
# TensorCores (v5p).
@pytest.mark.parametrize("n,bidirectional,options", [
    (4, True, {}), (4, False, {"vmem": False, "block_m": 8}),
    (4, False, {"vmem": False, "block_m": 8, "transposed": True}),
    (2, True, {"vmem": False, "chip": "v5p", "block_m": 8})],
    ids=["vmem", "tiled", "tiled-transposed", "megacore"])
def test_protocol_clean_with_a_partner(n, bidirectional, options, capfd):
    args = (normal(0, (n * R, K), jnp.float32), normal(1, (n * K, C), jnp.float32),
            normal(2, (n * n * R, 128), jnp.float32))
    params = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)
    f, definition = _partnered(n, bidirectional, params, **options)
    want = definition(*args)
    got, races, text = _run_checked(f, args, capfd)
    assert not races and "RACE DETECTED" not in text, text[:2000]
    assert "non-zero count" not in text, text[:2000]
    assert_close(got, want, jnp.float32, f"partner n={n} {options}")


def _layout(prim, n, **options):
    """The StepLayout `pallas_tpu` plans for `prim` on this file's shapes."""
    module, params = pallas_tpu._params(
        prim, axis_name=None, axis_size=n, bidirectional=False, out_dtype="float32",
        reduce_dtype="float32", return_gathered=False, target=of_platform("cpu"), get=options.get)
    xs, ws = _shapes(prim, n)
    return module.plan(params, jax.ShapeDtypeStruct(xs, jnp.float32),
                       jax.ShapeDtypeStruct(ws, jnp.float32))[1]


def _broken(prim, n, broken, mode, capfd, **options):
    params = pltpu.InterpretParams(dma_execution_mode=mode, detect_races=True)
    f, definition = _functions(prim, n, False, params, _broken=broken, **options)
    args = _inputs(prim, n)
    got, races, text = _run_checked(f, args, capfd)
    leaves = [np.asarray(a) for a in jax.tree.leaves(got)]
    wrong = any(not np.allclose(g, np.asarray(w), rtol=1e-4, atol=1e-4)
                for g, w in zip(leaves, jax.tree.leaves(definition(*args))))
    nan = any(not np.all(np.isfinite(g)) for g in leaves)
    return races, nan, wrong, text


@pytest.mark.parametrize("prim", ["ag_rows", "rs_rows"])
def test_reading_a_slot_before_its_dma_wait_is_caught(prim, capfd):
    races, nan, wrong, text = _broken(prim, 4, "read_before_wait", "on_wait", capfd)
    assert races and "RACE DETECTED" in text
    assert wrong  # on_wait: the slot still holds NaN (ag) or a stale accumulator (rs)
    if prim == "ag_rows":
        assert nan


def test_skipping_the_credit_handshake_is_caught(capfd):
    """Without credits a sender overwrites a slot its neighbour may still read."""
    races, _, _, text = _broken("ag_rows", 4, "no_credit", "eager", capfd)
    assert races and "RACE DETECTED" in text


def test_a_semaphore_left_non_zero_is_caught(capfd):
    races, nan, wrong, text = _broken("rs_rows", 4, "stray_credit", "on_wait", capfd)
    assert "non-zero count" in text
    assert not (nan or wrong)  # only the semaphore check sees this one


def test_megacore_without_hand_over_is_caught(capfd):
    """The second core computes with a slot before core 0 has waited for its DMA."""
    races, _, _, text = _broken("ag_rows", 2, "no_hand_over", "on_wait", capfd,
                                vmem=False, chip="v5p", block_m=8)
    assert races and "RACE DETECTED" in text


def test_unknown_broken_option_is_rejected():
    cfg = Prim.Config("pallas_tpu", "x", 2, False, True, np.dtype(jnp.float32),
                      np.dtype(jnp.float32), options=(("_broken", "nope"),))
    with pytest.raises(ValueError, match="_broken"):
        pallas_tpu.run("ag_rows", cfg, jnp.zeros((8, 128)), jnp.zeros((128, 128)))
