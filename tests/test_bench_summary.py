"""The summary that ends `pytest bench/ --benchmark-only` (bench/summary.py), on made-up
pytest-benchmark records: the ratios it prints, what it says about CPU numbers, widths."""

import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import summary  # noqa: E402


def _op(op, mode, shape, ring, backend, seconds, platform="cpu", **extra):
    m, k, n = shape
    return dict(group=f"{op} {mode} {m}x{k}x{n} N={ring}", name=f"op[{backend}]",
                stats=dict(min=seconds, rounds=5),
                extra_info=dict(op=op, mode=mode, shape=list(shape), ring=ring,
                                backend=backend, platform=platform, num_devices=8,
                                device_kind="cpu", simulated=False, **extra))


def _compile(op, ring, unroll, lines, seconds, kind="trace+lower"):
    return dict(group=f"compile cost: {kind} {op}", name="c", stats=dict(min=seconds, rounds=5),
                extra_info=dict(op=op, ring=ring, unroll=unroll, kind=kind, hlo_lines=lines))


SMALL, LARGE = (256, 256, 256), (1024, 512, 1024)


def _records(platform="cpu"):
    recs = []
    for shape, ref in ((SMALL, 1e-3), (LARGE, 4e-3)):
        recs += [_op("agm_lhs", "fwd", shape, 4, "reference", ref, platform),
                 # ring: 2x the reference at the small shape, 0.5x at the large: geomean 1.
                 _op("agm_lhs", "fwd", shape, 4, "ring", ref * (2 if shape == SMALL else .5),
                     platform),
                 _op("agm_lhs", "fwd", shape, 4, "xla", ref * 1.25, platform)]
    # A quantized row at the largest shape only.
    recs.append(_op("agm_lhs", "fwd", LARGE, 4, "ring-bidi-int8", 4e-3 * 0.8, platform))
    recs.append(_op("mrs", "fwd+bwd", SMALL, 2, "reference", 2e-3, platform))
    recs.append(_op("mrs", "fwd+bwd", SMALL, 2, "ring", 3e-3, platform))
    return recs


def _row(text, *start):
    hits = [line.split() for line in text.splitlines()
            if line.split()[:len(start)] == list(start)]
    assert len(hits) == 1, (start, text)
    return hits[0]


def test_summary_ratios_per_op_mode_and_ring():
    text = summary.render(_records(), cores=2)
    head = _row(text, "op", "mode", "N")
    assert head[3:] == ["ref", "ms", "xla", "ring", "int8", "best", "vs", "xla"], head
    row = _row(text, "agm_lhs", "fwd", "4")
    # ref 1-4 ms; xla 1.25x; ring geomean(2, 0.5) = 1.00x; int8 at one shape of two: starred;
    # best against xla: int8, 0.8 / 1.25 = 0.64x.
    assert row[3:] == ["1-4", "1.25x", "1.00x", "0.80x*", "0.64x", "int8"], row
    assert _row(text, "mrs", "fwd+bwd", "2")[3:] == ["2", "-", "1.50x", "-", "-"]
    assert "*: measured at fewer shapes" in text and "int8: ring-bidi sending its payload as those values" in text
    # Over everything: ring geomean(2, 0.5, 1.5).
    assert f"ring {(2 * 0.5 * 1.5) ** (1 / 3):.2f}x" in text


def test_summary_says_what_cpu_numbers_are_and_where_predictions_are():
    cpu = summary.render(_records("cpu"), cores=2)
    assert "CPU, 8 simulated devices on 2 cores" in cpu and "never a speed-up" in cpu
    gpu = summary.render(_records("gpu"))
    assert "never a speed-up" not in gpu and gpu.startswith("8 x cpu.")
    for text in (cpu, gpu):
        assert "bench/RESULTS-aot.md" in " ".join(text.split())
        assert max(len(line) for line in text.splitlines()) <= summary.WIDTH


def test_summary_program_size_and_the_simulated_kernels():
    recs = [_compile(op, n, u, lines=(40 * n if u else 100), seconds=n * 1e-3)
            for op in ("agm_lhs", "mrs") for n in (2, 4, 64) for u in (True, False)]
    recs += [_compile("mrs", n, True, 0, 0.5, kind="lower+compile") for n in (2, 4)]
    sim = [_op("agm_lhs", "fwd", (256, 128, 128), 2, b, t) for b, t in
           (("reference", 1e-3), ("pallas_tpu", 2.0))]
    for r in sim:
        r["group"] += " (simulated TPU)"
        r["extra_info"]["simulated"] = r["extra_info"]["backend"] == "pallas_tpu"
    text = summary.render(recs + sim)
    heads = [line.split() for line in text.splitlines() if line.startswith("op  ")]
    # trace+lower (to 64, no devices needed), then lower+compile (the devices there are).
    assert heads == [["op", "ring", "N=2", "N=4", "N=64"], ["op", "ring", "N=2", "N=4"]]
    assert _row(text, "mrs", "unrolled", "80/2")[3:] == ["160/4", "2560/64"]
    assert _row(text, "agm_lhs", "rolled") == ["agm_lhs", "rolled", "100/2", "100/4", "100/64"]
    assert re.search(r"lower\+compile.*\n.*\nmrs\s+unrolled\s+500\s+500", text)
    assert "agm_lhs 256x128x128: N=2 2 s (2,000x reference)" in text
    assert "Ops:" not in text  # no op rows outside the simulator: no ops table


def test_summary_of_nothing_is_empty():
    assert summary.render([]) == ""

