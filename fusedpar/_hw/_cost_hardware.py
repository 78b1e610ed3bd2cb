"""The hardware the cost model assumes: `PRESETS` (a view of the hardware registry,
`fusedpar._hw._registry`), the process-wide default (`set_hardware`), and presets fitted to
measurements (`calibrate`). Re-exported by `fusedpar.cost_model`."""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Mapping, Optional, Union

import numpy as np

from . import _registry
from ._hardware import Hardware


class _Presets(collections.abc.Mapping):
    """`{name: Hardware}` of every registry entry with cost numbers of its own, in
    registration order (an entry registered later shows up here too)."""

    def __getitem__(self, name):
        kind = next((k for k in _registry.kinds() if k.name == name and k.hardware), None)
        if kind is None:
            raise KeyError(name)
        return kind.hardware

    def __iter__(self):
        return iter([k.name for k in _registry.kinds() if k.hardware is not None])

    def __len__(self):
        return sum(k.hardware is not None for k in _registry.kinds())

    def __repr__(self):
        return f"PRESETS({dict(self)!r})"


PRESETS: Mapping[str, Hardware] = _Presets()

_default: Optional[Hardware] = None


def get_hardware(spec: Union[str, Hardware, None] = None, target=None) -> Hardware:
    """A `Hardware`: `spec` itself, a preset by name, or the one for `target`.

    With `spec=None`: the hardware set by `set_hardware`, else the preset for `target` (a
    `fusedpar` target, as the ops read it from the mesh's devices, or a platform name:
    H100 SXM for "gpu", TPU v5e for "tpu", the simulated-device preset for "cpu"), else
    the preset for this process's default device.
    """
    if isinstance(spec, Hardware):
        return spec
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"cost_model: hardware must be a preset name ({', '.join(PRESETS)}) "
                        f"or a Hardware, got {type(spec).__name__} {spec!r}.")
    if spec is not None:
        try:
            hardware = _registry.get(spec).hardware
        except ValueError:
            hardware = None
        if hardware is None:
            raise ValueError(f"cost_model: unknown hardware {spec!r}; presets are "
                             f"{', '.join(PRESETS)} (or pass a Hardware).")
        return hardware
    if _default is not None:
        return _default
    from . import _target  # jax is imported only when a target must be read

    if target is None:
        target = _target.local()
    elif isinstance(target, str):
        target = _target.of_platform(target)
    return PRESETS[target.cost_preset]


def set_hardware(spec: Union[str, Hardware, None]) -> None:
    """Make `spec` the hardware `"auto"` assumes (None: the target's preset again)."""
    global _default
    _default = None if spec is None else get_hardware(spec)


def calibrate(base: Union[str, Hardware], *, matmul: Optional[tuple] = None,
              transfer: Optional[tuple] = None, step_latency: Optional[float] = None,
              overlap: Optional[float] = None, name: Optional[str] = None) -> Hardware:
    """`base` with numbers fitted to measurements.

    - `matmul=(m, k, n, dtype, seconds)`: a measured `(m, k) @ (k, n)` matmul; sets the
      achieved FLOP/s for `dtype` (with `efficiency` 1, so the number is used as is).
    - `transfer=(bytes, seconds)`: one ppermute of `bytes` to a neighbour; sets the link
      bandwidth (and raises the egress bandwidth to at least it).
    - `step_latency`, `overlap`: replace those fields.
    """
    hw = get_hardware(base)
    changes = {"name": name or f"{hw.name} (calibrated)"}
    if matmul is not None:
        m, k, n, dtype, seconds = matmul
        achieved = 2.0 * m * k * n / seconds
        flops = {key: value * hw.efficiency for key, value in hw.flops.items()}
        flops[np.dtype(dtype).name] = achieved
        changes.update(flops=flops, efficiency=1.0)
    if transfer is not None:
        nbytes, seconds = transfer
        bw = nbytes / seconds
        changes.update(link_bandwidth=bw, egress_bandwidth=max(bw, hw.egress_bandwidth))
    if step_latency is not None:
        changes["step_latency"] = step_latency
    if overlap is not None:
        changes["overlap"] = overlap
    return dataclasses.replace(hw, **changes)
