"""The cost model's limits, and that `"auto"` follows it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedpar
from fusedpar._core import _dispatch
from fusedpar import cost_model
from fusedpar._core._primitives import Call
from fusedpar._hw._target import Target

AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"


def _one_link(**changes):
    """A simple accelerator: one link per neighbour, full overlap, no fixed costs."""
    base = dict(name="test", flops={"float32": 1e12}, efficiency=1.0, hbm_bandwidth=1e15,
                link_bandwidth=1e9, egress_bandwidth=1e12, step_latency=0.0,
                kernel_step_latency=0.0, hop_latency=0.0, launch_overhead=0.0, overlap=1.0)
    base.update(changes)
    return cost_model.Hardware(**base)


def test_ring_of_one_has_no_communication():
    for op in (AGM, MRS):
        est = cost_model.estimate(op, (256, 512), (512, 256), 1, "bfloat16", "h100_sxm",
                                  details=True)
        for b in est.values():
            assert b.bytes_sent == 0 and b.bytes_step == 0 and b.transfer_step == 0
        # Nothing to overlap: every backend is the one matmul.
        assert est["ring"].seconds == pytest.approx(est["reference"].seconds)


def test_compute_bound_ring_hides_all_communication():
    # Huge FLOP/s cost per step vs a tiny transfer: ring time = N matmul steps, the
    # reference pays the matmul plus the whole all-gather.
    hw = _one_link(flops={"float32": 1e9}, link_bandwidth=1e12, egress_bandwidth=4e12)
    n, m, k, cols = 4, 64, 128, 256
    est = cost_model.estimate(AGM, (m, k), (k, cols), n, "float32", hw, details=True)
    step = 2 * m * k * cols / 1e9
    assert est["ring"].bound == "compute"
    assert est["ring"].seconds == pytest.approx(n * step)
    gather = (n - 1) * m * k * 4 / 2e12  # reference uses both directions' links
    assert est["reference"].seconds == pytest.approx(n * step + gather)
    assert est["ring"].seconds < est["reference"].seconds


def test_a_kept_gathered_operand_costs_the_lax_ring_a_copy_per_step():
    """With the gathered operand kept (a training step's all-gather), the lax ring copies
    each block into it: one read and one write of the block per step, every step. The
    kernels write it as they go and the reference's collective makes it: no change."""
    hw = _one_link(flops={"float32": 1e9}, link_bandwidth=1e12, egress_bandwidth=4e12,
                   hbm_bandwidth=1e9)
    n, m, k, cols = 4, 64, 128, 256
    plain, kept = (cost_model.breakdown("ag_rows", (m, k), (k, cols), n, "float32", hw,
                                        backends=("reference", "ring", "pallas"),
                                        gathered=g) for g in (False, True))
    copy = 2 * m * k * 4 / 1e9
    assert kept["ring"].compute_step == pytest.approx(plain["ring"].compute_step + copy)
    assert kept["ring"].seconds == pytest.approx(plain["ring"].seconds + n * copy)
    for name in ("reference", "pallas"):
        assert kept[name] == plain[name], name


def test_communication_bound_ring_costs_first_step_plus_transfers():
    hw = _one_link(flops={"float32": 1e15})
    n, m, k, cols = 8, 64, 128, 256
    est = cost_model.estimate(AGM, (m, k), (k, cols), n, "float32", hw,
                              bidirectional=False, details=True)
    ring = est["ring"]
    assert ring.bound == "communication"
    transfer = m * k * 4 / 1e9
    assert ring.transfer_step == pytest.approx(transfer)
    # The exposed step's compute plus N - 1 transfers that nothing hides (the output is
    # not zero-filled first: every step writes its segment).
    assert ring.seconds == pytest.approx(ring.compute_step + (n - 1) * transfer)
    assert ring.bytes_sent == (n - 1) * m * k * 4


def test_no_overlap_adds_compute_and_communication():
    hw = _one_link(overlap=0.0, flops={"float32": 1e10})
    est = cost_model.estimate(AGM, (64, 128), (128, 256), 4, "float32", hw,
                              bidirectional=False, details=True)["ring"]
    assert est.seconds == pytest.approx(4 * est.compute_step + 3 * est.transfer_step)


def test_bidirectional_halves_per_step_bytes_and_time():
    hw = _one_link(flops={"float32": 1e15})
    kw = dict(dtype="float32", hardware=hw, details=True)
    uni = cost_model.estimate(AGM, (64, 128), (128, 256), 8, bidirectional=False, **kw)
    bi = cost_model.estimate(AGM, (64, 128), (128, 256), 8, bidirectional=True, **kw)
    assert bi["ring"].bytes_step * 2 == uni["ring"].bytes_step
    assert bi["ring"].transfer_step == pytest.approx(uni["ring"].transfer_step / 2)
    assert bi["ring"].bytes_sent == uni["ring"].bytes_sent  # the same data, both ways
    # Through one shared egress (NVSwitch) both directions share the bandwidth: no gain.
    shared = _one_link(flops={"float32": 1e15}, egress_bandwidth=1e9)
    kw["hardware"] = shared
    uni = cost_model.estimate(AGM, (64, 128), (128, 256), 8, bidirectional=False, **kw)
    bi = cost_model.estimate(AGM, (64, 128), (128, 256), 8, bidirectional=True, **kw)
    assert bi["ring"].transfer_step == pytest.approx(uni["ring"].transfer_step)


def test_reduce_scatter_accumulator_bytes_follow_reduce_dtype():
    args = (MRS, (512, 256), (256, 128), 4, "bfloat16", "tpu_v5e")
    f32 = cost_model.estimate(*args, details=True)["ring"]
    bf16 = cost_model.estimate(*args, reduce_dtype="bfloat16", details=True)["ring"]
    assert f32.bytes_sent == 3 * (512 // 4) * 128 * 4
    assert bf16.bytes_sent * 2 == f32.bytes_sent
    assert cost_model.bytes_sent(MRS, (512, 256), (256, 128), 4, "bfloat16") == f32.bytes_sent


def test_comm_dtype_counts_narrow_values_and_their_scales():
    # x's (512, 256) row block travels 3 times: 1-byte values and a float32 scale per row;
    # a reduce-scatter's (128, 128) accumulator segment: values and a scale per row.
    for narrow in (jnp.int8, jnp.float8_e4m3fn):
        sent = cost_model.bytes_sent(AGM, (512, 256), (256, 128), 4, "bfloat16",
                                     comm_dtype=narrow)
        assert sent == 3 * (512 * 256 * 1 + 512 * 4)
        sent = cost_model.bytes_sent(MRS, (512, 256), (256, 128), 4, "bfloat16",
                                     comm_dtype=narrow)
        assert sent == 3 * (128 * 128 * 1 + 128 * 4)
    wide = cost_model.estimate(AGM, (4096, 4096), (4096, 4096), 8, "bfloat16", "h100_sxm")
    narrow = cost_model.estimate(AGM, (4096, 4096), (4096, 4096), 8, "bfloat16", "h100_sxm",
                                 comm_dtype=jnp.int8)
    assert narrow["ring"] < wide["ring"] and narrow["reference"] < wide["reference"]
    with pytest.raises(ValueError, match="comm_dtype must be None.*int8.*got float16"):
        cost_model.estimate(AGM, (8, 8), (8, 8), 2, comm_dtype=jnp.float16)


def test_estimate_validates_like_the_ops():
    with pytest.raises(ValueError, match="scattered over 3 devices"):
        cost_model.estimate(MRS, (10, 8), (8, 8), 3)
    with pytest.raises(ValueError, match="unknown hardware 'a100'.*h100_sxm"):
        cost_model.estimate(AGM, (8, 8), (8, 8), 2, hardware="a100")


def test_presets_and_calibration():
    assert set(cost_model.PRESETS) >= {"h100_sxm", "h200", "tpu_v5e", "tpu_v5p", "cpu"}
    assert cost_model.get_hardware("v5p") is cost_model.PRESETS["tpu_v5p"]
    hw = cost_model.calibrate("h100", matmul=(1024, 1024, 1024, "bfloat16", 4e-6),
                              transfer=(1 << 20, 1e-5), step_latency=2e-5)
    assert hw.matmul_flops("bfloat16") == pytest.approx(2 * 1024**3 / 4e-6)
    assert hw.link_bandwidth == pytest.approx((1 << 20) / 1e-5)
    assert hw.step_latency == 2e-5
    # The calibrated hardware drives the estimate: 1 step of that matmul, N=1.
    est = cost_model.estimate(AGM, (1024, 1024), (1024, 1024), 1, "bfloat16", hw)
    assert est["reference"] >= 4e-6


def _call(prim, x_shape, w_shape, n, platform, dtype="bfloat16"):
    return Call("op", prim, x_shape, w_shape, dtype, n, platform)


def test_auto_follows_the_model_on_gpu():
    big = _call("ag_rows", (2048, 8192), (8192, 2048), 8, "gpu")
    name, reason = _dispatch.auto_choice(big)
    est = cost_model.estimate_call(big, "h100_sxm")
    assert est["ring"].seconds < _dispatch.AUTO_MARGIN * est["reference"].seconds
    # The GPU step kernels write each product in place, where the lax ring updates the
    # output with it afterwards: estimated faster. This call names no GPU, so they cannot
    # run it (an unknown compute capability) and the lax ring runs.
    assert est["pallas"].seconds < _dispatch.KERNEL_MARGIN * est["ring"].seconds
    assert name == "ring" and "estimated" in reason and "faster than reference" in reason
    assert "pallas cannot run it" in reason
    tiny = _call("ag_rows", (16, 64), (64, 64), 8, "gpu")
    est = cost_model.estimate_call(tiny, "h100_sxm")
    assert est["ring"].seconds > est["reference"].seconds
    name, reason = _dispatch.auto_choice(tiny)
    assert name == "reference" and "does not pay" in reason


def test_auto_follows_the_model_on_tpu_and_uses_set_hardware():
    call = _call("rs_rows", (4096, 4096), (4096, 4096), 4, "tpu")
    # The model's fastest ring, each backend at its own ring shape.
    est = {name: cost_model.estimate_call(_dispatch._shaped(call, name)[0],
                                          backends=(name,))[name].seconds
           for name in ("ring", "pallas")}
    assert _dispatch.auto_choice(call)[0] == min(est, key=est.get)
    # A machine whose links are so slow that nothing hides keeps the reference.
    slow = dataclasses.replace(cost_model.PRESETS["tpu_v5e"], overlap=0.0)
    cost_model.set_hardware(slow)
    try:
        name, reason = _dispatch.auto_choice(call)
        assert name == "reference" and "TPU v5e" in reason
    finally:
        cost_model.set_hardware(None)


def test_auto_counts_the_work_the_reference_collective_hides_behind():
    """In a backward pass the reference's reduce-scatter runs beside the other gradient's
    matmul (`Call.beside`): its estimate loses the collective time that work hides, so
    a ring that beat the bare reference may no longer pay."""
    # A size where the ring beats the bare reference on 8 H100s (calibrated preset).
    call = _call("rs_rows", (16384, 4096), (4096, 4096), 8, "gpu")
    ref = cost_model.estimate_call(call, "h100_sxm")["reference"]
    ring = cost_model.estimate_call(_dispatch._shaped(call, "ring")[0], "h100_sxm")["ring"]
    assert _dispatch.auto_choice(call)[0] == "ring"
    # The other gradient of an 8-way ag_rows at this size: (4096, 16384) @ (16384, 4096).
    hw = cost_model.PRESETS["h100_sxm"]
    beside = cost_model.matmul_seconds(4096, 16384, 4096, "bfloat16", hw) - hw.launch_overhead
    assert beside > ref.transfer_step  # enough to hide the whole collective
    name, reason = _dispatch.auto_choice(dataclasses.replace(call, beside=beside))
    assert ring.seconds > _dispatch.AUTO_MARGIN * ref.compute_step
    assert name == "reference" and "can hide behind" in reason
    # Less work beside it hides less: the reference pays what sticks out.
    half = dataclasses.replace(call, beside=ref.transfer_step / 2)
    pays = ring.seconds < _dispatch.AUTO_MARGIN * (ref.compute_step + ref.transfer_step / 2)
    assert _dispatch.auto_choice(half)[0] == ("ring" if pays else "reference")
    assert cost_model.matmul_seconds(1, 1, 1, "bfloat16", "h100_sxm") == pytest.approx(
        cost_model.PRESETS["h100_sxm"].launch_overhead, rel=1e-3)


def test_auto_stays_on_reference_for_tiny_rings_and_cpu():
    assert _dispatch.auto_choice(_call("ag_rows", (2048, 8192), (8192, 8192), 1, "gpu"))[0] \
        == "reference"
    assert _dispatch.auto_choice(_call("ag_rows", (2048, 8192), (8192, 8192), 8, "cpu"))[0] \
        == "reference"


def test_explain_prints_the_estimate():
    x = jax.ShapeDtypeStruct((2048, 8192), np.dtype("float32"))
    w = jax.ShapeDtypeStruct((8192, 2048), np.dtype("float32"))
    choice = fusedpar.explain(AGM, x, w, 8, platform="gpu")
    assert choice.backend in ("ring", "pallas")
    assert "estimated reference" in str(choice) and "ring" in str(choice)


def test_gpu_step_kernels_write_in_place_and_add_apart():
    # What an H100 measured of the step kernels' compute streams (docs/measurements.md):
    # a gather step's kernel writes its product into the output, where the lax ring
    # writes it and updates the output with it (one more read and write of the product);
    # a reduce-scatter's kernel makes the product and the ring adds the accumulator that
    # arrived in a pass of its own (reads both, writes the sum), where the lax ring's
    # model counts the accumulator's bytes in its step matmul.
    hw = cost_model.PRESETS["h100_sxm"]
    ag = cost_model.estimate_call(_call("ag_rows", (1024, 4096), (4096, 2048), 8, "gpu"), hw)
    update = 2 * 1024 * 2048 * 2 / hw.hbm_bandwidth
    assert ag["ring"].compute_step - ag["pallas"].compute_step == pytest.approx(update)
    rs = cost_model.breakdown("rs_rows", (8192, 2048), (2048, 4096), 8, hardware=hw)
    product = cost_model._matmul_time(hw, 1024, 2048, 4096, "bfloat16", 4)
    add = 3 * 1024 * 4096 * 4 / hw.hbm_bandwidth
    assert rs["pallas"].compute_step == pytest.approx(product + add)
    # On a TPU the step kernels are one fused kernel, modelled whole (`_kernel_step`).
    tpu = cost_model.estimate_call(_call("rs_rows", (8192, 2048), (2048, 4096), 8, "tpu"),
                                   "tpu_v5e")
    assert tpu["pallas"].compute_step < tpu["ring"].compute_step


def _fake_pallas(monkeypatch, why_not):
    from fusedpar._core import _backends

    record = dataclasses.replace(_backends.get("pallas"), unavailable=lambda call: why_not)
    monkeypatch.setitem(_backends.TABLE, "pallas", record)


def test_auto_picks_pallas_only_when_it_can_run_and_the_model_says_so(monkeypatch):
    # Fused kernels with a tiny per-step cost win at a latency-bound size.
    hw = dataclasses.replace(cost_model.PRESETS["tpu_v5p"], step_latency=50e-6,
                             kernel_step_latency=1e-6)
    call = _call("ag_rows", (256, 8192), (8192, 4096), 8, "tpu")
    est = cost_model.estimate_call(call, hw)
    assert est["pallas"].seconds < _dispatch.AUTO_MARGIN * est["reference"].seconds
    assert est["pallas"].seconds < _dispatch.KERNEL_MARGIN * est["ring"].seconds
    cost_model.set_hardware(hw)
    try:
        _fake_pallas(monkeypatch, None)
        assert _dispatch.auto_choice(call)[0] == "pallas"
        _fake_pallas(monkeypatch, "no kernel for this shape")
        name, reason = _dispatch.auto_choice(call)
        # Then the model's pick among the rest: this latency-bound ring does not pay.
        assert est["ring"].seconds > _dispatch.AUTO_MARGIN * est["reference"].seconds
        assert name == "reference" and "pallas cannot run it: no kernel for this shape" in reason
        # Never on CPU, where Pallas is an interpreter, even if it says it can run.
        _fake_pallas(monkeypatch, None)
        cpu = dataclasses.replace(call, target="cpu")
        assert _dispatch.auto_choice(cpu)[0] == "reference"
    finally:
        cost_model.set_hardware(None)


def test_gpu_calibration_recovers_what_it_measures():
    """bench/calibrate_gpu.py on a bench JSON whose times follow a known device."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import calibrate_gpu

    peak, launch = {"bfloat16": 700e12, "float32": 350e12}, 7e-6
    rows = []
    for dtype, f in peak.items():
        for s in (1024, 4096, 8192):
            t = 2 * s ** 3 / f + launch
            rows.append(dict(section="kernel", variant="jnp.dot", dtype=dtype, size=s,
                             flops=2 * s ** 3, seconds=t, device_kind="Test GPU"))
            rows.append(dict(section="decomp", backend="jnp.dot", prim="ag_rows",
                             dtype=dtype, size=s, steps=1, seconds=t))
            for n in (2, 4, 8):
                rows.append(dict(section="decomp", backend="ring", prim="ag_rows",
                                 dtype=dtype, size=s, steps=n, seconds=t + (n - 1) * launch))
    data = {"benchmarks": [{"extra_info": {k: v for k, v in r.items() if k != "seconds"},
                            "stats": {"min": r["seconds"]}} for r in rows]}
    fitted = calibrate_gpu.fit(data)
    assert fitted["launch_overhead"] == pytest.approx(launch)
    for dtype, f in peak.items():  # the largest size's rate: the launch is 0.4% of it
        assert fitted["flops"][dtype] == pytest.approx(f, rel=5e-3)
    hw = calibrate_gpu.calibrated("h100_sxm", fitted)
    assert hw.efficiency == 1.0 and hw.launch_overhead == pytest.approx(launch)
    assert hw.matmul_flops("bfloat16") == pytest.approx(fitted["flops"]["bfloat16"])
    # What one GPU cannot measure stays the preset's.
    assert hw.link_bandwidth == cost_model.PRESETS["h100_sxm"].link_bandwidth
    with pytest.raises(ValueError, match="no `kernel` rows"):
        calibrate_gpu.fit({"benchmarks": []})


H100 = fusedpar._hw._target.Target("gpu", "NVIDIA H100 80GB HBM3")


def modelled_table() -> str:
    """README's "What to expect" table: every backend for one all-gather-matmul on H100s."""
    x = jax.ShapeDtypeStruct((1024, 4096), np.dtype("float16"))
    w = jax.ShapeDtypeStruct((4096, 4096), np.dtype("float16"))
    lines = ["| H100s | reference | ring | ring, bidirectional | pallas | pallas, bidirectional "
             "| auto |", "|---:|---:|---:|---:|---:|---:|---|"]
    us = lambda seconds: f"{seconds * 1e6:.0f} us"  # noqa: E731
    for n in (2, 4, 8):
        est = {bi: cost_model.estimate(AGM, x.shape, w.shape, n, "float16", "h100_sxm",
                                       bidirectional=bi) for bi in (False, True)}
        ref = est[False]["reference"]
        choice = fusedpar.explain(AGM, x, w, n, target=H100)
        best = ref if choice.backend == "reference" else est[choice.bidirectional][choice.backend]
        pick = choice.backend + (", bidirectional" if choice.bidirectional else "")
        lines.append(f"| {n} | {us(ref)} | {us(est[False]['ring'])} | {us(est[True]['ring'])} "
                     f"| {us(est[False]['pallas'])} | {us(est[True]['pallas'])} "
                     f"| {pick}: {ref / best:.2f}x |")
    return "\n".join(lines)


def test_readme_shows_the_model():
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert modelled_table() in readme, "regenerate: python -c 'import test_cost_model as t; " \
                                       "print(t.modelled_table())' from tests/"


def test_auto_picks_the_faster_ring_shape():
    x = jax.ShapeDtypeStruct((2048, 8192), np.dtype("float16"))
    w = jax.ShapeDtypeStruct((8192, 2048), np.dtype("float16"))
    # Through NVSwitch both directions share the egress: bidirectional only adds launches.
    gpu = fusedpar.explain(AGM, x, w, 8, platform="gpu")
    assert not gpu.bidirectional and "bidirectional one is no faster" in gpu.reason
    # One link per neighbour and direction, communication-bound: halving the transfer pays.
    hw = _one_link(flops={"float16": 1e15, "float32": 1e15}, step_latency=1e-6)
    cost_model.set_hardware(hw)
    try:
        tpu = fusedpar.explain(AGM, x, w, 8, platform="tpu")
    finally:
        cost_model.set_hardware(None)
    assert tpu.bidirectional
    # A shape asked for is kept.
    assert fusedpar.explain(AGM, x, w, 8, platform="gpu", bidirectional=True).bidirectional


def test_a_call_is_estimated_with_its_reduce_dtype():
    """bfloat16 partial sums halve what a reduce-scatter sends, and auto sees it."""
    f32 = _call("rs_rows", (1024, 4096), (4096, 4096), 8, "gpu")
    bf16 = dataclasses.replace(f32, reduce_dtype="bfloat16")
    a, b = (cost_model.estimate_call(c, "h100_sxm") for c in (f32, bf16))
    for name in ("reference", "ring"):
        assert b[name].bytes_sent * 2 == a[name].bytes_sent
        assert b[name].seconds < a[name].seconds


def test_product_first_estimate():
    """An ag_rows run product first: 1/N of the FLOPs; gathering x too costs its bytes."""
    call = dataclasses.replace(_call("ag_rows", (1024, 4096), (4096, 4096), 8, "gpu"),
                               w_invariant=True)
    first = cost_model.product_first(call, "h100_sxm")
    both = cost_model.product_first(dataclasses.replace(call, gathered=True), "h100_sxm")
    assert first.seconds < cost_model.estimate_call(call, "h100_sxm")["reference"].seconds
    assert both.bytes_sent == 2 * first.bytes_sent and both.seconds > first.seconds
    assert _dispatch.product_first(call, "reference")
    assert not _dispatch.product_first(dataclasses.replace(call, w_invariant=False),
                                       "reference")


def test_the_backward_counts_on_hiding_the_reference_collective_only_where_xla_does():
    """On v5p XLA runs the reference's reduce-scatter synchronously (the compiled
    training steps hid none), so the backward of an ag_cols under auto must not count
    on the other gradient's matmul to hide it: it picks a ring there. A preset that says
    XLA would hide it (`collective_beside_matmul`, as on H100) picks the reference."""
    import re

    from fusedpar import aot
    from fusedpar._compile import _aot_programs

    mesh = aot.mesh("v5p:2x2x2", (8,), ("x",))

    def backward_backend():
        program, args = _aot_programs.op_program(mesh, "ag_cols", "auto")
        text = program.lower(*args).as_text(debug_info=True)  # with the ops' scopes
        return set(re.findall(r"fusedpar\.rs_cols\.([a-z_]+)", text))

    hw = cost_model.get_hardware("tpu_v5p")
    assert not hw.collective_beside_matmul
    assert backward_backend() - {"reference"}  # a ring or the kernels, named
    assert "reference" not in backward_backend()
    cost_model.set_hardware(dataclasses.replace(hw, collective_beside_matmul=True))
    try:
        assert backward_backend() == {"reference"}
    finally:
        cost_model.set_hardware(None)


def test_other_work_hides_a_collective_as_the_preset_says():
    """How much of a reference collective's transfer the backward's other matmul hides:
    as much as it covers (H100), none where XLA keeps the collective synchronous (v5p),
    and on v5e only a transfer it covers whole: there the op programs' partly covered
    backward reduce-scatter stayed synchronous, and auto picking the kernels for it
    replayed 1,405 -> 1,262 us (ag_cols)."""
    h100, v5e, v5p = (cost_model.get_hardware(n) for n in ("h100_sxm", "tpu_v5e", "tpu_v5p"))
    assert h100.hidden_beside(218e-6, 596e-6) == 218e-6
    assert h100.hidden_beside(900e-6, 596e-6) == 596e-6
    assert v5p.hidden_beside(900e-6, 596e-6) == 0.0
    assert v5e.hidden_beside(218e-6, 596e-6) == 0.0
    assert v5e.hidden_beside(900e-6, 596e-6) == 596e-6
    assert dataclasses.replace(v5e, beside_hides_part=True).hidden_beside(
        218e-6, 596e-6) == 218e-6
    # auto's choice for the backward of ag_cols (8 devices, the AOT op sizes), with
    # 218 us of the other gradient's matmul beside its reduce-scatter.
    call = Call("all_gather_matmul", "rs_cols", (4096, 1024), (1024, 4096), "bfloat16", 8,
                Target("tpu", "TPU v5 lite"), beside=218e-6, reduce_dtype="float32")
    backend, reason = _dispatch.auto_choice(call)
    assert backend != "reference" and "unless it is hidden whole" in reason, reason


def test_explain_estimates_with_the_reduce_dtype():
    """`explain(reduce_dtype=)` estimates the reduce-scatter's accumulator in that dtype,
    as the op does: bfloat16 partial sums halve the bytes of the ring's transfers (a step
    keeps its fixed latency: less than twice as fast)."""
    import re

    x = jax.ShapeDtypeStruct((4096, 4096), np.dtype("bfloat16"))
    w = jax.ShapeDtypeStruct((4096, 4096), np.dtype("bfloat16"))

    def ring_transfer(reduce_dtype):
        reason = fusedpar.explain(MRS, x, w, 8, platform="gpu",
                                  reduce_dtype=reduce_dtype).reason
        return float(re.search(r"ring [\d.]+ us \(\d+ steps of [\d.]+ us compute / "
                               r"([\d.]+) us transfer", reason).group(1))

    half = ring_transfer(jnp.bfloat16)
    assert half < ring_transfer(None) < 2 * half
    assert ring_transfer(None) == ring_transfer(jnp.float32)


def test_each_backend_runs_the_ring_shape_its_own_estimate_prefers():
    """The lax ring runs a half-size matmul per direction, which on a memory-bound step
    reads the stationary operand twice; a fused TPU kernel multiplies both halves of a
    step at once, so a bidirectional ring only halves its transfer. On v5p, rs_rows of
    1024 x 4096 @ 4096 x 4096 over 8: the ring stays unidirectional, the kernel goes
    both ways, and each is estimated (and auto chooses) with its own shape."""
    cost_model.set_hardware(cost_model.PRESETS["tpu_v5p"])
    try:
        call = _call("rs_rows", (1024, 4096), (4096, 4096), 8, "tpu")
        shapes = {}
        for name in ("ring", "pallas"):
            est = {b: cost_model.estimate_call(dataclasses.replace(call, bidirectional=b),
                                               backends=(name,))[name].seconds
                   for b in (False, True)}
            shapes[name], why = _dispatch.auto_ring_shape(call, name)
            assert shapes[name] == (est[True] < (1 - _dispatch.BIDIRECTIONAL_MARGIN)
                                    * est[False])
            assert bool(why) == (not shapes[name])
        assert shapes == {"ring": False, "pallas": True}
        # The reference runs no ring: its shape is the call's default, unasked.
        assert _dispatch.auto_ring_shape(call, "reference") == (call.runs_bidirectional, "")
        name, reason = _dispatch.auto_choice(call)
        bi = cost_model.estimate_call(dataclasses.replace(call, bidirectional=True),
                                      backends=("pallas",))["pallas"]
        assert name == "pallas"
        assert cost_model.describe({"pallas": bi}).removeprefix("estimated ") in reason
    finally:
        cost_model.set_hardware(None)


def test_a_fused_tpu_kernel_step_reads_its_stationary_operand_once_per_ring():
    """`kernels/tpu/_tile_plan` keeps the operand every step reads resident in VMEM: a
    step of the fused kernel moves an n-th of the whole product's bytes (the kernel's
    `pl.CostEstimate`), where a lax step's matmul reads all of w again."""
    hw = cost_model.PRESETS["tpu_v5e"]
    n, m, k, cols = 8, 1024, 4096, 4096
    est = cost_model.breakdown("rs_rows", (m, k), (k, cols), n, "bfloat16", hw,
                               backends=("ring", "pallas"), bidirectional=False)
    whole = max(2 * m * k * cols / hw.matmul_flops("bfloat16"),
                (m * k + k * cols + m * cols) * 2 / hw.hbm_bandwidth)
    assert est["pallas"].compute_step == pytest.approx(whole / n, rel=1e-9)
    # The lax step reads w (32 MiB) itself: memory-bound, well above the kernel's step.
    assert est["ring"].compute_step > k * cols * 2 / hw.hbm_bandwidth > 1.5 * whole / n


def test_a_backend_runs_the_other_ring_shape_where_only_that_one_fits():
    """A fused TPU kernel whose preferred (bidirectional) shape would cut 4-row windows,
    which Mosaic refuses for bfloat16, runs unidirectional instead: named, and when auto
    weighs it (its estimate and its availability both at the shape it would run)."""
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    call = _call("rs_rows", (64, 256), (256, 256), 8, "tpu")
    preferred, _ = _dispatch.auto_ring_shape(call, "pallas")
    assert preferred and _dispatch._unavailable(
        "pallas", dataclasses.replace(call, bidirectional=True)) is not None
    shaped, why = _dispatch._shaped(call, "pallas")
    assert shaped.bidirectional is False and "a bidirectional ring cannot run it" in why
    for backend in ("pallas", "pallas_tpu"):
        assert not fusedpar.explain(MRS, x, w, 8, platform="tpu", backend=backend).bidirectional
    # A shape asked for is not swapped: the kernel refuses it.
    with pytest.raises(NotImplementedError, match="multiple of 8 rows"):
        fusedpar.explain(MRS, x, w, 8, platform="tpu", backend="pallas", bidirectional=True)


def test_backends_any_iterable():
    """`backends` read once: a generator gave an empty result after the name check."""
    want = cost_model.breakdown("ag_rows", (16, 512), (512, 256), 8,
                                backends=["ring", "reference"])
    got = cost_model.breakdown("ag_rows", (16, 512), (512, 256), 8,
                               backends=(b for b in ["ring", "reference"]))
    assert set(got) == {"ring", "reference"} and got == want
