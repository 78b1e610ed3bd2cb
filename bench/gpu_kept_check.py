"""The gather step kernels' `kept` store on a real GPU, at real sizes.

    python bench/gpu_kept_check.py [--trials 3] [--out F.json]

`matmul_into(..., kept=buf)` writes each travelling piece into its segment of the
gathered buffer in the same launch as its product (the Mosaic kernel TMA-stores the block
from its shared-memory slot before releasing the slot to the next load). The tests check
it in Mosaic GPU's interpreter, which completes every TMA copy at once: where the
`wait_smem_to_gmem` before the release is misplaced, only real asynchrony shows it, as a
kept block overwritten by the next load. So here, on the GPU, for each kernel family,
dtype, axis and warpgroup split: two pieces (a bidirectional ring's step) and one, the
kept segments poisoned with NaN and the others random, fresh inputs each trial:
the kept segments hold the pieces bit for bit, every other segment of both buffers is
left bit for bit, and the products match a float32 `jnp.dot` of the same inputs.
A race shows as a failure in some trials and not others, so every trial is reported.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fusedpar.kernels import gpu

SEGMENTS, BLOCK, K, N = 8, 1024, 4096, 4096
INTERPRET = False  # --smoke: tiny sizes in interpret mode, to check this script on a CPU

# (family, dtype, axis, config overrides): every way the Mosaic warpgroups split the kept
# block, a grid small enough that each CTA walks many tiles (its slot ring wraps), and
# Triton's row and column pieces.
CASES = [
    ("mosaic", "bfloat16", 0, {}),
    ("mosaic", "bfloat16", 0, {"num_sms": 7}),
    ("mosaic", "bfloat16", 0, {"stages": 2}),
    ("mosaic", "float16", 0, {"wg_dim": "n"}),
    ("mosaic", "bfloat16", 1, {}),
    ("mosaic", "bfloat16", 1, {"wg_dim": "n", "num_sms": 5}),
    ("mosaic", "float32", 0, {}),
    ("triton", "bfloat16", 0, ()),
    ("triton", "bfloat16", 1, ()),
    ("triton", "float32", 0, ()),
]
SEGS = ([5, 2], [7])


def _window(axis, seg):
    w = slice(seg * BLOCK, (seg + 1) * BLOCK)
    return (w, slice(None)) if axis == 0 else (slice(None), w)


@functools.cache
def _launch(family, axis, config):
    kernels = getattr(gpu, family)
    return jax.jit(lambda o, g, ps, w, sg: kernels.matmul_into(
        o, ps, w, sg, axis=axis, config=dict(config), kept=g, interpret=INTERPRET),
        donate_argnums=(0, 1))


def check(family, dtype, axis, config, segs, seed):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)

    def normal(shape):
        return np.asarray(rng.standard_normal(shape, np.float32)).astype(dt)

    if axis == 0:  # row pieces (BLOCK, K) of x, w resident (K, N), out (SEGMENTS*BLOCK, N)
        pieces = [normal((BLOCK, K)) for _ in segs]
        other = normal((K, N))
        out0, kept0 = normal((SEGMENTS * BLOCK, N)), normal((SEGMENTS * BLOCK, K))
    else:  # column pieces (K, BLOCK) of w, x resident (N, K), out (N, SEGMENTS*BLOCK)
        pieces = [normal((K, BLOCK)) for _ in segs]
        other = normal((N, K))
        out0, kept0 = normal((N, SEGMENTS * BLOCK)), normal((K, SEGMENTS * BLOCK))
    for s in segs:  # poisoned: what the launch must write
        out0[_window(axis, s)] = np.nan
        kept0[_window(axis, s)] = np.nan
    f = _launch(family, axis, tuple(dict(config).items()))
    out, kept = f(jnp.asarray(out0), jnp.asarray(kept0), [jnp.asarray(p) for p in pieces],
                  jnp.asarray(other), jnp.asarray(segs, jnp.int32))
    # The oracle beside the kernels (float32 products at HIGHEST, not the GPU's TF32).
    want_out, want_kept = (np.asarray(a, np.float32) for a in gpu.matmul_into_reference(
        jnp.asarray(out0).astype(jnp.float32), [jnp.asarray(p) for p in pieces],
        jnp.asarray(other), jnp.asarray(segs, jnp.int32), axis=axis,
        precision=lax.Precision.HIGHEST, kept=jnp.asarray(kept0)))
    out, kept = np.asarray(out.astype(jnp.float32)), np.asarray(kept.astype(jnp.float32))
    problems, errors = [], []
    for s in range(SEGMENTS):
        w = _window(axis, s)
        what = "" if s in segs else " (not a piece's)"
        if not np.array_equal(kept[w], want_kept[w]):
            problems.append(f"kept segment {s}{what}: {int((kept[w] != want_kept[w]).sum())} "
                            "elements wrong")
        if s not in segs:  # left bit for bit as it was
            if not np.array_equal(out[w], want_out[w]):
                problems.append(f"out segment {s}{what} changed")
            continue
        if np.isnan(out[w]).any():
            problems.append(f"out segment {s}: {int(np.isnan(out[w]).sum())} elements unwritten")
        err = float(np.linalg.norm(out[w] - want_out[w]) / np.linalg.norm(want_out[w]))
        errors.append(err)
        if not err < (2e-3 if dt == jnp.float32 else 1e-2):
            problems.append(f"out segment {s}: relative error {err:.3g}")
    return problems, max(errors)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        global SEGMENTS, BLOCK, K, N, INTERPRET
        SEGMENTS, BLOCK, K, N, INTERPRET = 8, 128, 128, 128, True
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__)
    rows, failed = [], 0
    for family, dtype, axis, config in CASES:
        for segs in SEGS:
            for trial in range(args.trials):
                name = f"{family} {dtype} axis={axis} {dict(config)} segs={segs} trial {trial}"
                try:
                    problems, err = check(family, dtype, axis, config, segs, seed=trial)
                except Exception as e:  # a refusal or a compile failure is a result too
                    problems, err = [f"{type(e).__name__}: {str(e)[:300]}"], None
                failed += bool(problems)
                rows.append({"case": name, "problems": problems, "max_rel_error": err})
                print(("FAIL " if problems else "ok   ") + name,
                      f"err {err:.2e}" if err is not None else "", "; ".join(problems))
    print(f"{len(rows) - failed} of {len(rows)} checks passed")
    if args.out:
        json.dump({"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
                   "rows": rows}, open(args.out, "w"), indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
