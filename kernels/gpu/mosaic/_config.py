"""Typed parameters of the Mosaic GPU step kernels, and a heuristic per shape and dtype.

Both kernels run one warp-specialised, persistent GEMM on Hopper:

- a grid of `num_ctas` CTAs (at most one per SM), each walking a strided list of output
  tiles (CTA tiles, `cta_m x cta_n`), in an order that keeps `group_m` tile rows together
  so that CTAs running at once share operand blocks in L2;
- in each CTA, one *memory* warpgroup issues TMA copies of `(cta_m, tile_k)` blocks of A
  and `(tile_k, cta_n)` blocks of B into a ring of `stages` shared-memory slots, and
  `num_compute_wgs` *compute* warpgroups each own a `(tile_m, tile_n)` float32 wgmma
  accumulator (the CTA tile is split between them along `wg_dim`);
- the ring runs continuously across a CTA's tiles (no drain between tiles), and the
  epilogue stores the accumulator through shared memory with TMA, `epi_m x epi_n` at a
  time in `epi_slots` buffers (a TMA reduce-add into the float32 accumulator for
  `matmul_acc` with an accumulator).

`GemmConfig` is what a caller can override; `choose` is the heuristic (a starting point
for an H100: it has not been tuned on hardware). The GPU's limits are plain values too
(`num_sms`, `smem_limit`): the package passes its target's, from its hardware registry;
a direct caller gets an H100's.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

# What a direct caller's config assumes (an H100 SXM: 132 SMs, 227 KiB of shared memory
# per CTA, 232448 bytes opt-in); the package passes its target's.
NUM_SMS = 132
SMEM_LIMIT = 232448
_SMEM_RESERVE = 2304  # barriers and the lowering's reduction scratch (2 KiB)
_MAX_STAGES = 6
OPTIONS = ("tile_m", "tile_n", "tile_k", "stages", "num_compute_wgs", "wg_dim", "epi_m",
           "epi_n", "epi_slots", "group_m", "num_sms", "memory_registers", "smem_limit")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling and pipelining of one step kernel.

    - `tile_m`, `tile_n`: one compute warpgroup's accumulator (`tile_m` a multiple of 64,
      wgmma's M; `tile_n` a multiple of 64 and at most 256, wgmma's largest N).
    - `tile_k`: the contraction per pipeline stage; its bytes set the swizzle (128 B for
      64 x 16-bit or 32 x 32-bit elements).
    - `stages`: depth of the shared-memory ring (TMA loads in flight).
    - `num_compute_wgs`: compute warpgroups per CTA (plus one memory warpgroup);
      `wg_dim`: how they split the CTA tile, `"m"` (CTA tile `num_compute_wgs*tile_m x
      tile_n`) or `"n"` (`tile_m x num_compute_wgs*tile_n`).
    - `epi_m`, `epi_n`, `epi_slots`: epilogue sub-tile and its shared-memory buffers per
      warpgroup (2 lets one TMA store run while the next sub-tile is written).
    - `group_m`: tile rows walked together in the persistent tile order.
    - `num_sms`: CTAs in the persistent grid (capped at the number of tiles).
    - `memory_registers`: registers per thread left to the memory warpgroup
      (`setmaxnreg`); the compute warpgroups share the rest.
    - `smem_limit`: the shared memory one CTA may use (the GPU's opt-in limit).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    num_compute_wgs: int = 2
    wg_dim: Literal["m", "n"] = "m"
    epi_m: int = 64
    epi_n: int = 64
    epi_slots: int = 2
    group_m: int = 8
    num_sms: int = NUM_SMS
    memory_registers: int = 40
    smem_limit: int = SMEM_LIMIT

    @property
    def cta_m(self) -> int:
        return self.tile_m * (self.num_compute_wgs if self.wg_dim == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (self.num_compute_wgs if self.wg_dim == "n" else 1)

    @property
    def compute_registers(self) -> int:
        # 64K registers per SM over 128-thread warpgroups: 512 per thread in all.
        return int(min(256, (512 - self.memory_registers) // self.num_compute_wgs) // 8 * 8)

    def smem_bytes(self, in_dtype, out_dtype) -> int:
        isz, osz = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
        ring = self.stages * (self.cta_m + self.cta_n) * self.tile_k * isz
        epilogue = self.num_compute_wgs * self.epi_slots * self.epi_m * self.epi_n * osz
        return ring + epilogue + _SMEM_RESERVE

    def tiles(self, m: int, n: int) -> int:
        return (m // self.cta_m) * (n // self.cta_n)

    def check(self, m: int, n: int, ks, in_dtype, out_dtype) -> None:
        """Raise ValueError (naming the field) unless this config can run the problem.

        `ks`: the contraction length of each term (one for `matmul_into`).
        """
        isz = jnp.dtype(in_dtype).itemsize
        def bad(msg):
            raise ValueError(f"GemmConfig {self}: {msg}")
        if self.wg_dim not in ("m", "n"):
            bad("wg_dim must be 'm' or 'n'")
        if self.num_compute_wgs not in (1, 2):
            bad("num_compute_wgs must be 1 or 2")
        if self.tile_m % 64 or self.tile_m <= 0:
            bad("tile_m must be a positive multiple of 64 (wgmma M)")
        if self.tile_n % 64 or not 0 < self.tile_n <= 256:
            bad("tile_n must be a multiple of 64 in [64, 256] (wgmma N, swizzled tiles)")
        if self.tile_k * isz * 8 % (32 * 8) or self.tile_k <= 0:
            bad(f"tile_k*itemsize must be a multiple of 32 bytes (got {self.tile_k * isz})")
        if self.tile_k * isz > 128:
            bad("tile_k*itemsize must be at most 128 bytes (one swizzle atom)")
        if not 2 <= self.stages <= 16:
            bad("stages must be in [2, 16]")
        if self.tile_m % self.epi_m or self.tile_n % self.epi_n or self.epi_m % 64:
            bad("epi_m (a multiple of 64) and epi_n must divide tile_m and tile_n")
        if self.epi_n * jnp.dtype(out_dtype).itemsize % 32:
            bad("epi_n*out itemsize must be a multiple of 32 bytes")
        chunks = (self.tile_m // self.epi_m) * (self.tile_n // self.epi_n)
        if self.epi_slots not in (1, 2) or chunks % self.epi_slots:
            bad("epi_slots must be 1 or 2 and divide the epilogue sub-tiles per tile")
        if self.group_m < 1 or self.num_sms < 1:
            bad("group_m and num_sms must be positive")
        if not 24 <= self.memory_registers <= 256 or self.memory_registers % 8:
            bad("memory_registers must be a multiple of 8 in [24, 256]")
        if m % self.cta_m:
            bad(f"the CTA tile's {self.cta_m} rows do not divide m={m}")
        if n % self.cta_n:
            bad(f"the CTA tile's {self.cta_n} columns do not divide n={n}")
        for k in ks:
            if k % self.tile_k:
                bad(f"tile_k={self.tile_k} does not divide the contraction k={k}")
        if self.smem_bytes(in_dtype, out_dtype) > self.smem_limit:
            bad(f"needs {self.smem_bytes(in_dtype, out_dtype)} bytes of shared memory, "
                f"over {self.smem_limit}")


def _fit_stages(cfg: GemmConfig, in_dtype, out_dtype) -> GemmConfig | None:
    """`cfg` with the deepest ring (and 2 epilogue slots if 4+ stages still fit)."""
    for slots in (2, 1):
        chunks = (cfg.tile_m // cfg.epi_m) * (cfg.tile_n // cfg.epi_n)
        if chunks % slots:
            continue
        for stages in range(_MAX_STAGES, 1, -1):
            c = dataclasses.replace(cfg, stages=stages, epi_slots=slots)
            if c.smem_bytes(in_dtype, out_dtype) <= c.smem_limit and (stages >= 4 or slots == 1):
                return c
    return None


def choose(m: int, n: int, ks, in_dtype, out_dtype, options=()) -> GemmConfig:
    """The config for an `(m, k) @ (k, n)` step (k per term in `ks`), with overrides.

    `options`: a mapping or pairs of `GemmConfig` field overrides. Raises ValueError,
    naming the dimension, when no config fits (the caller falls back to the lax ring).
    """
    opts = dict(options)
    unknown = set(opts) - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown Mosaic GPU kernel options {sorted(unknown)}; "
                         f"known: {OPTIONS}")
    ks = tuple(ks)
    isz = jnp.dtype(in_dtype).itemsize
    if isz not in (2, 4):
        raise ValueError(f"the Mosaic GPU kernels take 16- or 32-bit inputs, not {in_dtype}")
    if "tile_k" not in opts:
        tile_k = None
        for cand in (128 // isz, 64 // isz, 32 // isz):
            if all(k % cand == 0 for k in ks):
                tile_k = cand
                break
        if tile_k is None:
            raise ValueError(f"the contraction k={ks} must be a multiple of {32 // isz} "
                             f"for {jnp.dtype(in_dtype).name} wgmma")
        opts["tile_k"] = tile_k
    num_sms = opts.get("num_sms", NUM_SMS)
    # Candidate warpgroup tiles, largest first. Score: the fraction of the persistent
    # grid's last wave that is busy, times a mild preference for larger CTA tiles (more
    # FLOPs per byte loaded). Untuned: a starting point.
    # One compute warpgroup (the last three) only for steps too small for two.
    candidates = [(128, 128, "m", 2), (128, 128, "n", 2), (64, 128, "m", 2),
                  (64, 256, "m", 2), (64, 128, "n", 2), (64, 64, "m", 2),
                  (128, 128, "m", 1), (64, 128, "m", 1), (64, 64, "m", 1)]
    best, best_score = None, -1.0
    for tm, tn, dim, wgs in candidates:
        if best is not None and wgs == 1:
            break
        base = dict(tile_m=tm, tile_n=tn, wg_dim=dim, num_compute_wgs=wgs, epi_m=64,
                    epi_n=min(64, tn))
        base.update({k: v for k, v in opts.items() if k not in ("stages", "epi_slots")})
        cfg = GemmConfig(**base)
        if m % cfg.cta_m or n % cfg.cta_n:
            continue
        fitted = _fit_stages(cfg, in_dtype, out_dtype)
        if fitted is None:
            continue
        fitted = dataclasses.replace(fitted, **{k: opts[k] for k in ("stages", "epi_slots")
                                                if k in opts})
        t = fitted.tiles(m, n)
        waves = -(-t // num_sms)
        util = t / (waves * num_sms)
        intensity = fitted.cta_m * fitted.cta_n / (fitted.cta_m + fitted.cta_n)
        score = util * (0.85 + 0.15 * intensity / (256 * 128 / 384))
        if score > best_score + 1e-9:
            best, best_score = fitted, score
    if best is None:
        raise ValueError(
            f"no Mosaic GPU tile fits a ({m}, k) @ (k, {n}) step: m and n must be multiples "
            f"of 64 (of the CTA tile, with overrides {dict(options)})")
    best.check(m, n, ks, in_dtype, out_dtype)
    return best
