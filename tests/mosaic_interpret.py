"""Test-only: teach jax's Mosaic GPU interpreter two things the Mosaic kernels use.

1. The TMA reduce-add store. `matmul_acc` stores its tiles with
   `copy_smem_to_gmem(..., reduction_op="add")`; jax's GPU interpret mode (0.10.2 and
   0.11.2 alike) raises NotImplementedError for any `reduction_op`. The patched callback
   reads the destination window, adds the source and stores the sum (what the TMA unit
   does, done eagerly); everything else goes to the original callback.
2. A transposed wgmma operand (`b_smem.T`, the K-major B of TF32). jax 0.10.2's
   interpreter cannot index a transposed ref (0.11.2's can); the patched wgmma drops a
   trailing transpose of B and transposes the block it read.

Both patch private module attributes, looked up when a kernel is traced in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

_installed = False


def install():
    global _installed
    if _installed:
        return
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

    original = cb.copy_smem_to_gmem

    @functools.wraps(original)
    def copy_smem_to_gmem(*, reduction_op=None, **kw):
        if reduction_op is None:
            return original(reduction_op=None, **kw)
        if reduction_op != "add" or kw.get("predicate") is not None:
            raise NotImplementedError(f"reduction_op={reduction_op!r} in the test patch")
        device_id = int(kw["device_id"])
        thread_id = int(kw["thread_id"])
        src_key = cb.HostAllocationKey.from_array(kw["src_allocation_key_as_array"])
        dst_key = cb.HostAllocationKey.from_array(kw["dst_allocation_key_as_array"])
        src_tr = jax.tree.map(int, cb._remove_noop_transforms(kw["src_transforms"]))
        dst_tr = jax.tree.map(int, cb._remove_noop_transforms(kw["dst_transforms"]))
        mem = cb._get_shared_memory()
        tid = mem.get_global_thread_id(device_id, thread_id)
        info = interpret_utils.GPULoggingInfo(
            device_id=device_id, grid_point_coords=jax.tree.map(int, kw["grid_point_coords"]),
            thread_id=thread_id, source_info=kw["source_info"])
        val, _, _ = mem.get_buffer_content(src_key, interpret_utils.to_range(src_tr), tid,
                                           logging_info=info)
        old, _, _ = mem.get_buffer_content(dst_key, interpret_utils.to_range(dst_tr), tid,
                                           logging_info=info)
        new = (np.asarray(old, np.float32) + np.asarray(val, np.float32)).astype(old.dtype)
        mem.store_buffer_content(dst_key, interpret_utils.to_range(dst_tr), new, tid,
                                 logging_info=info)
        return kw["token"]

    cb.copy_smem_to_gmem = copy_smem_to_gmem

    from jax._src.state import types as state_types

    original_wgmma = cb.wgmma

    @functools.wraps(original_wgmma)
    def wgmma(**kw):
        b_tr = tuple(kw["b_transforms"])
        if not b_tr or not isinstance(b_tr[-1], state_types.TransposeTransform):
            return original_wgmma(**kw)
        if tuple(int(p) for p in b_tr[-1].permutation) != (1, 0):
            raise NotImplementedError(f"transpose {b_tr[-1]} in the test patch")
        device_id, thread_id = int(kw["device_id"]), int(kw["thread_id"])
        mem = cb._get_shared_memory()
        tid = mem.get_global_thread_id(device_id, thread_id)
        info = interpret_utils.GPULoggingInfo(
            device_id=device_id, grid_point_coords=jax.tree.map(int, kw["grid_point_coords"]),
            thread_id=thread_id, source_info=kw.get("source_info"))

        def read(key, transforms):
            key = cb.HostAllocationKey.from_array(key)
            rng = interpret_utils.to_range(
                jax.tree.map(int, cb._remove_noop_transforms(transforms)))
            val, _, _ = mem.get_buffer_content(key, rng, tid, logging_info=info)
            return key, rng, val

        _, _, a = read(kw["a_allocation_key_as_array"], kw["a_transforms"])
        _, _, b = read(kw["b_allocation_key_as_array"], b_tr[:-1])
        acc_key, acc_rng, acc = read(kw["acc_allocation_key_as_array"], kw["acc_transforms"])
        res = acc + np.matmul(a, np.transpose(b), dtype=kw["acc_dtype"])
        mem.store_buffer_content(acc_key, acc_rng, res, tid, logging_info=info)
        return kw["token"]

    cb.wgmma = wgmma
    _installed = True
