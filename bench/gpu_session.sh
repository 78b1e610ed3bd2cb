#!/usr/bin/env bash
# Everything one rationed GPU session measures, most important first, each step bounded
# so that a hang or a failure leaves the others' results. Results go to $OUT (default
# /tmp/gpu-out). Prepared compute-stream modules are read from $PREPARED (made on any
# machine by `python bench/compute_stream.py prepare --out DIR`).
#
#   PREPARED=.cs/prepared OUT=/tmp/out bash bench/gpu_session.sh
set -u
OUT=${OUT:-/tmp/gpu-out}
PREPARED=${PREPARED:-.cs/prepared}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (quax and its needs)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
# kernels/ is installed as fusedpar.kernels (pyproject's package-dir); uninstalled, a link.
[ -e fusedpar/kernels ] || ln -s ../kernels fusedpar/kernels
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,memory.total,driver_version \
  --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import jax, fusedpar; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -3
FLAGS=$(python3 -c "import fusedpar; print(fusedpar.gpu_overlap_flags())" 2>/dev/null)

echo "== 0. the gather kernels' kept store, checked at real sizes (interpret mode cannot race)"
timeout 170 python3 bench/gpu_kept_check.py --trials 2 --out "$OUT/kept-check.json" \
  > "$OUT/kept-check.log" 2>&1; grep -E "^FAIL|passed" "$OUT/kept-check.log" | cut -c1-200

echo "== 1. compute stream"
timeout 230 python3 bench/compute_stream.py measure "$PREPARED" --out "$OUT/compute-stream.json" \
  --runs 20 2>&1 | grep -v -e "^W0" -e "^I0" | tee "$OUT/compute-stream.log" | tail -12

# The compiled modules, in one file (what comes back from a lent machine is counted).
tar czf "$OUT/compute-stream-compiled.tgz" -C "$OUT" compute-stream.json.d && rm -r "$OUT/compute-stream.json.d"

echo "== 2. step kernels vs cuBLAS and hopper_matmul_mgpu; ops on a ring of one"
K="kernel or (ring1 and 4096 and bfloat16) or (decomp and 4096 and bfloat16)"
FUSEDPAR_BENCH_SIZES=accelerator FUSEDPAR_BENCH_BUDGET=0.1 XLA_FLAGS="$FLAGS" timeout 200 \
  python3 -m pytest -p no:cacheprovider -q -rs bench/test_gpu_steps.py --benchmark-only \
  --benchmark-json="$OUT/results-gpu.json" -k "$K" --benchmark-columns=min \
  > "$OUT/bench-gpu.log" 2>&1
tail -5 "$OUT/bench-gpu.log"
FUSEDPAR_BENCH_SIZES=accelerator python3 bench/test_gpu_steps.py "$OUT/results-gpu.json" > "$OUT/RESULTS-gpu.md" 2>&1

