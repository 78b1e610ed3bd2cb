"""Fit the cost model's GPU numbers to a run of bench/test_gpu_steps.py on one GPU.

    FUSEDPAR_BENCH_SIZES=accelerator pytest bench/test_gpu_steps.py --benchmark-only \
        --benchmark-json=bench/results-gpu.json
    python bench/calibrate_gpu.py bench/results-gpu.json [--base h100_sxm]

prints the fitted fields and the `Hardware` they give. What one GPU can measure:

- `flops[dtype]`: the FLOP/s `jnp.dot` reaches on the largest S x S x S problem of each
  dtype (the model then uses them with `efficiency=1`);
- `launch_overhead`: what one more ring step costs beyond its share of the FLOPs, from the
  decomposition section (N steps of the lax ring back to back against one `jnp.dot` of
  the same FLOPs): the median over sizes, dtypes and N of `(t_N - t_1) / (N - 1)`, which
  is what the model charges per extra step.

What it cannot: transfers (link bandwidth, per-step ppermute latency, how much of a
transfer hides behind a step), which need several GPUs; those stay the base preset's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys


def _rows(data):
    for b in data["benchmarks"]:
        info = dict(b.get("extra_info") or {})
        if info.get("section") in ("kernel", "decomp"):
            yield dict(info, seconds=b["stats"]["min"])


def fit(data) -> dict:
    """`{"flops": {dtype: FLOP/s}, "launch_overhead": seconds, "device": ...}` from a
    pytest-benchmark JSON of bench/test_gpu_steps.py."""
    rows = list(_rows(data))
    dots = [r for r in rows if r["section"] == "kernel" and r["variant"] == "jnp.dot"]
    if not dots:
        raise ValueError("no `kernel` rows of jnp.dot: run bench/test_gpu_steps.py -k "
                         "test_kernel with FUSEDPAR_BENCH_SIZES=accelerator")
    flops = {}
    for dtype in sorted({r["dtype"] for r in dots}):
        largest = max((r for r in dots if r["dtype"] == dtype), key=lambda r: r["size"])
        flops[dtype] = largest["flops"] / largest["seconds"]
    one = {(r["prim"], r["dtype"], r["size"]): r["seconds"] for r in rows
           if r["section"] == "decomp" and r["backend"] == "jnp.dot"}
    extra = []
    for r in rows:
        if r["section"] != "decomp" or r["backend"] != "ring" or r["steps"] < 2:
            continue
        base = one.get((r["prim"], r["dtype"], r["size"]))
        if base is None or r["dtype"] not in flops:
            continue
        extra.append((r["seconds"] - base) / (r["steps"] - 1))
    if not extra:
        raise ValueError("no `decomp` rows of the lax ring beside jnp.dot: run "
                         "bench/test_gpu_steps.py -k test_decomp")
    device = dots[0].get("device_kind", "?")
    return {"flops": flops, "launch_overhead": max(statistics.median(extra), 0.0),
            "device": device, "jax_version": dots[0].get("jax_version", "?")}


def calibrated(base, fitted):
    """The base preset with the fitted numbers (dtypes not measured keep the base's)."""
    from fusedpar import cost_model

    hw = cost_model.get_hardware(base)
    flops = {k: v * hw.efficiency for k, v in hw.flops.items()}
    flops.update(fitted["flops"])
    return dataclasses.replace(hw, name=f"{hw.name} (calibrated on {fitted['device']})",
                               flops=flops, efficiency=1.0,
                               launch_overhead=fitted["launch_overhead"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="pytest-benchmark JSON of bench/test_gpu_steps.py")
    parser.add_argument("--base", default="h100_sxm", help="the preset to start from")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        fitted = fit(json.load(f))
    print(json.dumps(fitted, indent=1))
    print(calibrated(args.base, fitted))


if __name__ == "__main__":
    main(sys.argv[1:])
