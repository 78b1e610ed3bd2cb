"""The warp-specialised persistent Hopper GEMM both step kernels are built on.

`emit_gemm` emits the body of a `plgpu` kernel (Warpgroup lowering semantics) given:

- `k_steps`: the contraction steps of each *segment* of a tile: every output tile sums
  the products of its segments (one segment for `matmul_into`; one per term for
  `matmul_acc`), all into one wgmma accumulator;
- `issue(seg, kk, tile, a_dst, b_dst, barrier)`: issues the TMA copies of step `kk` of
  segment `seg` of `tile` into one ring slot (A block `(cta_m, tile_k)`, B block
  `(tile_k, cta_n)`, or `(cta_n, tile_k)` when B is K-major), both arriving on `barrier`;
- `out_origin(tile)`: the (row, column) of the CTA tile in the output ref (traced);
- `reduce_add`: store with a TMA reduce-add (`out += tile`) instead of a plain store;
- `keep`: None, or `(operand, ref, origin)`: the compute warpgroups also store the
  blocks of `operand` ("a" or "b", the travelling piece) they multiply into `ref`, each
  block once, straight from the shared-memory slot the TMA load filled: `origin(tile,
  kk)` is the (row, column) in `ref` of step `kk`'s `(cta_m, tile_k)` A block (or
  `(tile_k, cta_n)` B block) of `tile`. Step `kk`'s A block is stored by the tile of
  column `kk % tiles_n` of its row (B's by row `kk % tiles_m` of its column): the
  stores are spread over the tiles that load the block. (Stored all by the first
  column's tiles, those tiles ran 1.6x as long as the others on an H100, and a launch
  takes as long as its slowest tile: a 1024 x 4096 x 2048 step 39 us against 24.) A
  gather keeps its gathered operand this way with no pass of its own: the store runs
  beside the wgmma, and the slot is released once the store has read it.

Synchronisation, per ring slot `s` (`stages` slots, step `g` of the CTA uses `g % stages`):
`full[s]` (2 arrivals: the A and B copies, with their byte counts) and `empty[s]`
(one arrival per compute warpgroup, once the wgmma reading the slot has retired). The
memory warpgroup waits `empty` before refilling a slot; the compute warpgroups wait
`full`, issue the wgmma, keep one wgmma in flight (`wgmma_wait(1)`) and release the
previous step's slot. The step counter runs on across a CTA's tiles, so the loads of the
next tile overlap the last MMAs and the epilogue of the current one. With `keep`, a
compute warpgroup stores step `g`'s block (if it is its to store) before its wgmma and
releases slot `g - 1` only once that block's store has read it (all store groups but
step `g`'s own; all of them at the end of a tile, before the epilogue reuses the store
groups). Mosaic tracks each barrier's phase per thread; every thread waits every phase
of the barriers it waits on (the memory warpgroup drains `empty` at the end), as the
phase tracking needs.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._tile_order import tile_of
from ._config import GemmConfig

SM_AXIS = "sm"
WG_AXIS = "wg"


def swizzled(minor_elems: int, dtype):
    """The (tiling, swizzle) transforms for a shared-memory block with this minor dim."""
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def emit_gemm(cfg: GemmConfig, *, in_dtype, out_dtype, b_k_major: bool,
              k_steps: tuple[int, ...], num_groups: int, tiles_m: int, tiles_n: int,
              num_ctas: int, issue: Callable, out_origin: Callable, out_ref,
              reduce_add: bool, keep=None):
    """Emit the kernel body (call inside the `plgpu` kernel, all warpgroups)."""
    if keep is not None and keep[0] == "b" and b_k_major:
        raise NotImplementedError("keep: a K-major B block is stored transposed in shared "
                                  "memory; keep the A operand, or a 16-bit B")
    stages, nwg = cfg.stages, cfg.num_compute_wgs
    cta_m, cta_n, tk = cfg.cta_m, cfg.cta_n, cfg.tile_k
    steps_per_tile = sum(k_steps)
    seg_start = [sum(k_steps[:s]) for s in range(len(k_steps))]
    total_tiles = num_groups * tiles_m * tiles_n
    in_tr = swizzled(tk, in_dtype)
    b_shape = (cta_n, tk) if b_k_major else (tk, cta_n)
    b_tr = in_tr if b_k_major else swizzled(cta_n, in_dtype)
    chunks_m, chunks_n = cfg.tile_m // cfg.epi_m, cfg.tile_n // cfg.epi_n

    def scoped(a_smem, b_smem, o_smem, full, empty):
        cta = lax.axis_index(SM_AXIS)
        wg = lax.axis_index(WG_AXIS)
        # Tiles of this CTA: cta, cta + num_ctas, ...
        my_tiles = lax.div(total_tiles - cta + (num_ctas - 1), num_ctas)

        def coords(it):
            return tile_of(cta + it * num_ctas, num_groups=num_groups, tiles_m=tiles_m,
                           tiles_n=tiles_n, group_m=cfg.group_m)

        def memory_wg():
            plgpu.set_max_registers(cfg.memory_registers, action="decrease")

            def tile_body(it, carry):
                tile = coords(it)
                base = it * steps_per_tile
                for s, ks in enumerate(k_steps):
                    def step(kk, carry, s=s):
                        g = base + seg_start[s] + kk
                        slot = lax.rem(g, stages)

                        @pl.when(g >= stages)
                        def _():
                            plgpu.barrier_wait(empty.at[slot])

                        issue(s, kk, tile, a_smem.at[slot], b_smem.at[slot], full.at[slot])
                        return carry

                    lax.fori_loop(0, ks, step, 0)
                return carry

            lax.fori_loop(0, my_tiles, tile_body, 0)
            # Drain: wait for the consumption of the last `stages` steps, so that every
            # phase of `empty` is observed (and the ring is idle at exit).
            total = my_tiles * steps_per_tile

            def drain(g, carry):
                plgpu.barrier_wait(empty.at[lax.rem(g, stages)])
                return carry

            lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, 0)

        def compute_wg():
            plgpu.set_max_registers(cfg.compute_registers, action="increase")
            if cfg.wg_dim == "m":
                a_rows = pl.ds(wg * cfg.tile_m, cfg.tile_m)
                b_cols = slice(None)
            else:
                a_rows = slice(None)
                b_cols = pl.ds(wg * cfg.tile_n, cfg.tile_n)

            def stores_kept(tile, kk):
                """Whether this warpgroup stores (its share of) step `kk`'s block."""
                operand = keep[0]
                if operand == "a":
                    ours = lax.rem(kk, tiles_n) == tile.j
                else:
                    ours = lax.rem(kk, tiles_m) == tile.i
                # A blocks split by rows (wg_dim "m"): each warpgroup stores its rows.
                # Otherwise one stores the whole block (a column share of a swizzled B
                # block is not contiguous, which a TMA store needs).
                if operand == "a" and cfg.wg_dim == "m":
                    return ours
                return jnp.logical_and(ours, wg == 0)

            def store_kept(tile, kk, slot):
                """`keep`'s store of this warpgroup's share of step `kk`'s block."""
                operand, ref, origin = keep
                row, col = origin(tile, kk)
                if operand == "a":
                    src, rows, cols = a_smem.at[slot], cta_m, tk
                    if cfg.wg_dim == "m":
                        src, row, rows = src.at[a_rows], row + wg * cfg.tile_m, cfg.tile_m
                else:
                    src, rows, cols = b_smem.at[slot], tk, cta_n

                # A branch, not the copy's predicate (which jax's GPU interpreter lacks).
                @pl.when(stores_kept(tile, kk))
                def _():
                    plgpu.copy_smem_to_gmem(src, ref.at[pl.ds(row, rows), pl.ds(col, cols)])

            def release_kept(tile, kk):
                """Wait until the store of step `kk - 1`'s block (if any) has read its
                slot; step `kk`'s own store (if any) may still be reading."""
                before = jnp.logical_and(kk > 0, stores_kept(tile, kk - 1))
                now = stores_kept(tile, kk)

                @pl.when(jnp.logical_and(before, now))
                def _():
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                @pl.when(jnp.logical_and(before, jnp.logical_not(now)))
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            def tile_body(it, carry):
                tile = coords(it)
                base = it * steps_per_tile

                def acc_scope(acc_ref):
                    for s, ks in enumerate(k_steps):
                        def step(kk, carry, s=s):
                            g_in = seg_start[s] + kk
                            g = base + g_in
                            slot = lax.rem(g, stages)
                            plgpu.barrier_wait(full.at[slot])
                            a = a_smem.at[slot].at[a_rows]
                            if b_k_major:
                                b = b_smem.at[slot].at[b_cols].T
                            else:
                                b = b_smem.at[slot].at[:, b_cols]
                            if keep is not None:
                                store_kept(tile, kk, slot)
                            plgpu.wgmma(acc_ref, a, b)
                            plgpu.wgmma_wait(1)  # the previous step's wgmma has retired
                            if keep is not None:  # and its block's store has read it
                                release_kept(tile, kk)

                            @pl.when(g_in > 0)
                            def _():
                                plgpu.barrier_arrive(empty.at[lax.rem(g + stages - 1, stages)])

                            return carry

                        lax.fori_loop(0, ks, step, 0)
                    plgpu.wgmma_wait(0)
                    if keep is not None:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(
                        empty.at[lax.rem(base + steps_per_tile - 1, stages)])
                    return acc_ref[...]

                acc = pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                row0, col0 = out_origin(tile)
                if cfg.wg_dim == "m":
                    row0 = row0 + wg * cfg.tile_m
                else:
                    col0 = col0 + wg * cfg.tile_n
                out = acc if jnp.dtype(out_dtype) == jnp.float32 else acc.astype(out_dtype)
                for c in range(chunks_m * chunks_n):
                    mi, ni = divmod(c, chunks_n)
                    slot = c % cfg.epi_slots
                    # The store that last used this buffer has read it.
                    plgpu.wait_smem_to_gmem(cfg.epi_slots - 1, wait_read_only=True)
                    o_smem[wg, slot] = out[mi * cfg.epi_m:(mi + 1) * cfg.epi_m,
                                           ni * cfg.epi_n:(ni + 1) * cfg.epi_n]
                    plgpu.commit_smem()
                    dst = out_ref.at[pl.ds(row0 + mi * cfg.epi_m, cfg.epi_m),
                                     pl.ds(col0 + ni * cfg.epi_n, cfg.epi_n)]
                    if reduce_add:
                        plgpu.copy_smem_to_gmem(o_smem.at[wg, slot], dst, reduction_op="add")
                    else:
                        plgpu.copy_smem_to_gmem(o_smem.at[wg, slot], dst)
                return carry

            lax.fori_loop(0, my_tiles, tile_body, 0)
            plgpu.wait_smem_to_gmem(0)

        lax.cond(wg == nwg, memory_wg, compute_wg)

    pl.run_scoped(
        scoped,
        a_smem=plgpu.SMEM((stages, cta_m, tk), in_dtype, transforms=in_tr),
        b_smem=plgpu.SMEM((stages, *b_shape), in_dtype, transforms=b_tr),
        o_smem=plgpu.SMEM((nwg, cfg.epi_slots, cfg.epi_m, cfg.epi_n), out_dtype,
                          transforms=swizzled(cfg.epi_n, out_dtype)),
        full=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        empty=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
        collective_axes=WG_AXIS,
    )


def launch(body: Callable, cfg: GemmConfig, *, num_ctas: int, operands, out_type,
           aliases: dict[int, int], interpret, name: str, cost_estimate=None):
    """Run `body(*in_refs, *out_refs)` as a warp-specialised Mosaic GPU kernel:
    its result, or a tuple of them for a tuple `out_type`.

    `aliases` maps operand index -> output index (the output *is* that operand's buffer).
    `plgpu.kernel` cannot alias an input to an output except through a Ref, and jax
    0.11's `mpmd_map` rejects Refs that vary over a `shard_map` axis; so this goes
    through `mpmd_map`'s own entry point with `input_output_aliases` (private in both
    jax 0.10.2 and 0.11.2, same signature).
    """
    from jax._src import config as jax_config
    from jax._src.pallas import mpmd

    mesh = plgpu.Mesh(grid=(num_ctas,), grid_names=(SM_AXIS,),
                      num_threads=cfg.num_compute_wgs + 1, thread_name=WG_AXIS)
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    out_types = out_type if isinstance(out_type, tuple) else (out_type,)
    with jax_config._check_vma(False):
        call = mpmd._mpmd_map([(mesh, body)], out_types, input_output_aliases=aliases,
                              compiler_params=params, interpret=_interpret_params(interpret),
                              cost_estimate=cost_estimate, name=name)
        outs = call(*operands)
    return tuple(outs) if isinstance(out_type, tuple) else outs[0]


def _interpret_params(interpret):
    """`interpret=True` means Mosaic GPU's own interpreter (the generic Pallas one cannot
    run warpgroup-collective scratch); a params object is used as given."""
    if interpret is True:
        params = getattr(plgpu, "InterpretGPUParams", None)  # public from jax 0.11
        if params is None:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

            params = InterpretGPUParams
        return params()
    return interpret or False
