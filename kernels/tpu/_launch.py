"""How a ring kernel is compiled and launched: `RingLaunch` and the `pallas_call` around it.

`RingLaunch` holds what every ring kernel is given besides its operands (the ring, its
mesh axes and collective id, the chip it is built for, interpret mode, tile settings);
each kernel's own parameters (`AllGatherMatmulParams`, `MatmulReduceScatterParams`) hold
one. `call` builds the `pallas_call`: operands whole in VMEM or left in HBM (`pl.ANY`),
results, scratch buffers and semaphores, one program per TensorCore on megacore chips,
and the compiler parameters: the collective id, the chip's `vmem_limit_bytes`, and the
parallel grid axis that puts one program on each core.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Hashable, Optional

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._ring import RingSchedule
from . import _protocol
from ._chips import Chip

CHECK_VMA_HINT = (
    "The fused TPU kernels are collective Pallas kernels: the enclosing jax.shard_map "
    "must be called with check_vma=False. Tagging the outputs as varying "
    "(manual_axis_type) is not enough: the kernels use lax.axis_index in data.")


@dataclasses.dataclass(frozen=True)
class RingLaunch:
    """What a ring kernel is built with, besides its operands.

    - `axis_name`: the mesh axis (or tuple of axes, the first major) the ring runs over;
      `ring`: its schedule (`fusedpar.Ring`, or any `_ring.RingSchedule`).
    - `collective_id`: the kernel's barrier semaphore (`_collective_ids`); None on a ring
      of one device, which has no collective.
    - `chip`: the `_chips.Chip` it is planned and compiled for.
    - `interpret`: False to compile with Mosaic, or a `pltpu.InterpretParams` (TPU
      interpret mode on CPU). Only a kernel built for Mosaic enforces Mosaic's layout.
    - `vmem`: force every buffer into VMEM (True) or the tiled HBM path (False); None
      decides by size. `tile_targets`: `(bm, bk, bn)` overriding the chip's presets.
    - `precision`: passed to every matmul. `broken`: a deliberately broken protocol
      variant (`_protocol.BROKEN`), for the tests that prove the checks can fail.
    """

    axis_name: Hashable
    ring: RingSchedule
    collective_id: Optional[int]
    chip: Chip
    interpret: Any = False
    vmem: Optional[bool] = None
    tile_targets: Optional[tuple] = None
    precision: Any = None
    broken: Optional[str] = None

    @property
    def for_mosaic(self) -> bool:
        """Whether the kernel is compiled by Mosaic (and must obey its layout rules)."""
        return self.interpret is False


def one_of(name: str, value, valid: tuple) -> None:
    """Check a kernel parameter that takes one of a few values."""
    if value not in valid:
        raise ValueError(f"{name} must be one of {valid}, got {value!r}")


def register_cpu_chip():
    """Let `pltpu.emit_pipeline` run (interpret mode) or lower (for TPU) on a CPU host.

    emit_pipeline asks `get_tpu_info()` for the chip of the mesh's devices (or of the
    default device), which fails for "cpu". We register a TPU v5p's description for the
    device kind "cpu" (a private JAX registry; it only answers for CPU devices, a TPU mesh
    answers with its own kind, and it never replaces an existing entry).
    """
    from jax._src.pallas.mosaic import tpu_info

    if "cpu" not in tpu_info.registry:
        tpu_info.registry["cpu"] = lambda: pltpu.get_tpu_info_for_chip(
            pltpu.ChipVersion.TPU_V5P, 1)


def _named(kernel, names, *refs):
    kernel(dict(zip(names, refs)))


def call(name, kernel, launch: RingLaunch, layout, inputs: dict, outputs: dict,
         scratch: dict, cost_estimate=None):
    """Run `kernel(refs)` (refs: a dict by name of `inputs`, `outputs`, `scratch`) as one
    `pallas_call` named `name` (what profiles show), laid out by `layout` (a
    `_tile_plan.StepLayout`); returns the outputs as a dict. `cost_estimate`: the
    kernel's whole ring, for XLA's scheduler (`fusedpar.kernels._cost`)."""
    register_cpu_chip()
    memory = pltpu.VMEM if layout.in_vmem else pl.ANY
    spec = pl.BlockSpec(memory_space=memory)
    cores = layout.cores
    params = pltpu.CompilerParams(
        collective_id=launch.collective_id if launch.ring.size > 1 else None,
        vmem_limit_bytes=launch.chip.vmem_limit_bytes,
        dimension_semantics=(pltpu.PARALLEL,) if cores > 1 else None)
    interpret = launch.interpret
    if interpret is not False and cores > 1:
        interpret = dataclasses.replace(interpret, num_cores_or_threads=cores)
    names = list(inputs) + list(outputs) + list(scratch)
    f = pl.pallas_call(
        functools.partial(_named, kernel, names), out_shape=list(outputs.values()),
        grid=(cores,) if cores > 1 else (), in_specs=[spec] * len(inputs),
        out_specs=[spec] * len(outputs), scratch_shapes=list(scratch.values()),
        compiler_params=params, interpret=interpret, name=name,
        cost_estimate=cost_estimate)
    return dict(zip(outputs, f(*inputs.values())))


def place(layout, operands: dict, ring_buffers: dict, ring):
    """Where a kernel's buffers live: `(results, scratch)` for `call`, to add to its own.

    - `ring_buffers` (name -> `(shape, dtype)`: slots, send and staging buffers, sums;
      with `scale_slots` every transfer has two parts, the values and their scales)
      are VMEM scratch when everything is in VMEM or the layout keeps them resident,
      else results in HBM (XLA allocates them; remote DMAs reach them there);
    - an operand the layout keeps resident gets a VMEM copy, `<name>_resident`;
    - then the ring's semaphores and, on several cores, the cores' (`_protocol`).
    """
    results, scratch = {}, {}
    for name, (shape, dtype) in ring_buffers.items():
        if layout.in_vmem or name in layout.resident:
            scratch[name] = pltpu.VMEM(shape, dtype)
        else:
            results[name] = jax.ShapeDtypeStruct(shape, dtype)
    for name, a in operands.items():
        if name + "_resident" in layout.resident:
            scratch[name + "_resident"] = pltpu.VMEM(a.shape, a.dtype)
    parts = 2 if "scale_slots" in ring_buffers else 1  # quantized values and scales
    scratch.update(zip(("send", "recv", "local", "credit", "done"),
                       _protocol.semaphores(ring, parts)))
    scratch.update(zip(("ready", "computed"), _protocol.core_semaphores(layout.cores)))
    return results, scratch


def operand(refs: dict, name: str):
    """Operand `name` as the kernel reads it: its VMEM copy if the layout keeps it
    resident (copied in here, once per core: each TensorCore has its own VMEM), else the
    ref itself."""
    resident = refs.get(name + "_resident")
    if resident is None:
        return refs[name]
    pltpu.sync_copy(refs[name], resident)
    return resident


def ring_of(refs: dict, launch: RingLaunch, layout):
    """`(Link, Cores)` of a kernel: the ring over its slots and semaphores, and the
    TensorCores sharing its steps."""
    slots = refs["slots"]
    if "scale_slots" in refs:  # quantized transfers: values and scales, two DMAs
        slots = (slots, refs["scale_slots"])
    link = _protocol.Link(launch.ring, launch.axis_name, slots, refs["send"],
                          refs["recv"], refs["local"], refs["credit"], refs["done"],
                          launch.broken)
    cores = _protocol.Cores(layout.cores, refs.get("ready"), refs.get("computed"),
                            launch.broken)
    return link, cores
