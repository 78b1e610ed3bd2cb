"""The hardware registry: one entry (`_hardware.Kind`) per kind of device the package
knows, and the lookups every hardware decision makes.

The target (`fusedpar._hw._target`: the devices of the mesh a program is for) finds its entry
here by `device_kind`; the cost model, `"auto"`, the ring order, the kernels' tiles and
limits, the kernel family and `fusedpar.aot` all read that entry. **Adding a target is
one entry below** (`register(Kind(...))`): its device-kind matcher, generation or compute
capability, cores, cost numbers, chip limits, kernel families and AOT topology.

Numbers come from public spec sheets (cited beside each entry); the cost numbers have not
been calibrated on the hardware (`cost_model.calibrate`, bench/calibrate_gpu.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ._hardware import CPU, GPU, MOSAIC, TPU, TPU_KERNELS, TRITON, Aot, Hardware, Kind

_T, _G, MiB = 1e12, 1e9, 2**20
_KINDS: list = []  # registration order; lookups prefer the latest entry


def register(kind: Kind) -> Kind:
    """Add `kind` to the registry (it wins over earlier entries matching the same
    devices). Its name and aliases must be new: `unregister` an entry to replace it."""
    taken = {n.lower() for k in _KINDS for n in (k.name, *k.aliases)}
    clash = sorted(n for n in (kind.name, *kind.aliases) if n.lower() in taken)
    if clash:
        raise ValueError(f"register: hardware name(s) {clash} are taken; unregister "
                         "the entry first to replace it.")
    if kind.default and any(k.default and k.platform == kind.platform for k in _KINDS):
        raise ValueError(f"register: platform {kind.platform!r} has a default kind "
                         f"already ({default(kind.platform).name}).")
    _KINDS.append(kind)
    return kind


def unregister(name: str) -> Kind:
    """Remove the entry named `name` and return it."""
    kind = get(name)
    _KINDS.remove(kind)
    return kind


def kinds() -> tuple:
    """Every entry, in registration order."""
    return tuple(_KINDS)


def get(name: str) -> Kind:
    """The entry named `name` or one of its aliases (any case); ValueError if none."""
    key = name.lower()
    for kind in reversed(_KINDS):
        if key == kind.name.lower() or key in (a.lower() for a in kind.aliases):
            return kind
    raise ValueError(f"unknown hardware {name!r}; known: "
                     f"{', '.join(k.name for k in _KINDS)}.")


def find(platform: str, device_kind: str) -> Optional[Kind]:
    """The entry of a device of `platform` and `device_kind`: one naming the kind
    exactly, else one naming a word of it; None if no entry knows it."""
    mine = [k for k in reversed(_KINDS) if k.platform == platform]
    for kind in mine:
        if device_kind in kind.device_kinds:
            return kind
    for kind in mine:
        if device_kind and kind.matches(device_kind):
            return kind
    return None


def default(platform: str) -> Kind:
    """The kind a platform named alone stands for (and what the TPU kernels plan for
    when they run interpreted on CPU): H100 SXM, TPU v5e, the simulated CPU device."""
    for kind in reversed(_KINDS):
        if kind.default and kind.platform == platform:
            return kind
    raise ValueError(f"no default hardware for platform {platform!r}")


def tpu_kind(generation: str) -> Optional[Kind]:
    """The TPU entry of `generation` ("v5e", "7x"), or None."""
    for kind in reversed(_KINDS):
        if kind.platform == TPU and kind.generation == generation:
            return kind
    return None


def aot_kind(name: str) -> Optional[Kind]:
    """The entry whose AOT target names start with `name` ("v5e", "h100"), or None."""
    for kind in reversed(_KINDS):
        if kind.aot is not None and kind.aot.name == name:
            return kind
    return None


def gpu_families(compute_capability) -> tuple:
    """`(families, refused)` of an NVIDIA GPU no entry names, from its compute
    capability: the Mosaic GPU kernels need Hopper (9.x: wgmma and TMA), the Triton
    kernels run on the rest."""
    if compute_capability is None:
        return (), {}
    if compute_capability[0] == 9:
        return (MOSAIC, TRITON), {}
    return (TRITON,), {MOSAIC: _no_wgmma(compute_capability)}


def _no_wgmma(cc) -> str:
    return ("the Mosaic GPU step kernels use wgmma, Hopper's matrix instruction "
            "(compute capability 9.0a), which compute capability {}.{} does not run; "
            "options={{'kernels': 'triton'}} runs the Triton kernels, backend='ring' "
            "the lax ring".format(*cc))


def position(device, kind: Optional[Kind] = None) -> Optional[tuple]:
    """A TPU device's place in its slice: its chip's `coords`, and `core_on_chip` where
    a chip holds several devices (`Kind.devices_per_chip`); None without coordinates."""
    coords = getattr(device, "coords", None)
    if coords is None:
        return None
    kind = kind or find(TPU, getattr(device, "device_kind", ""))
    if kind is not None and kind.devices_per_chip > 1:
        return tuple(coords) + (int(getattr(device, "core_on_chip", 0)),)
    return tuple(coords)


# -- the entries ---------------------------------------------------------------------------

# The simulated CPU devices (one of 8 on a 2-core CPU, fitted by eye to bench/RESULTS.md:
# ~200 GFLOP/s f32 for the two cores together). A "transfer" is a copy made by the cores
# that compute, so nothing overlaps. Pallas kernels run interpreted there.
register(Kind(
    "cpu", CPU, device_kinds=("cpu",), default=True,
    families=(TPU_KERNELS, TRITON, MOSAIC),
    hardware=Hardware("CPU (simulated device)", {"float32": 25 * _G}, efficiency=1.0,
                      hbm_bandwidth=4 * _G, link_bandwidth=4 * _G, egress_bandwidth=4 * _G,
                      step_latency=150e-6, kernel_step_latency=150e-6, hop_latency=20e-6,
                      launch_overhead=20e-6, overlap=0.0)))


def _nvswitch(name, flops, hbm_bandwidth, egress, compute):
    """An NVIDIA SXM part in an NVSwitch box: `egress` bytes/s out of a device, shared
    by all its peers through the switch. The latencies are estimates; the "pallas"
    backend drives its ring with the lax ring's ppermutes, so its per-step latency is
    the lax ring's.

    `hbm_bandwidth` is the datasheet's; `compute`, `(matmul efficiency, fraction of the
    datasheet's HBM bandwidth, seconds per matmul launch)`, calibrated on the part itself:
    the replay of layer programs against their measured compute stream on one GPU (how,
    in docs/measurements.md)."""
    efficiency, hbm_fraction, launch = compute
    return Hardware(name, flops, efficiency=efficiency,
                    hbm_bandwidth=hbm_fraction * hbm_bandwidth, link_bandwidth=egress,
                    egress_bandwidth=egress, step_latency=10e-6, kernel_step_latency=10e-6,
                    hop_latency=3e-6, launch_overhead=launch, overlap=0.9,
                    host_bandwidth=_PCIE5_X16)


# The host link of NVIDIA's SXM parts (H100, H200, B200 datasheets: PCIe Gen5, 128 GB/s
# both ways): bytes/s one way.
_PCIE5_X16 = 64e9
# `_nvswitch`'s `compute` as an H200 measured it (the B200 takes it too, until measured).
_H200_COMPUTE = (0.75, 0.87, 6e-6)
# Hopper (NVIDIA H100 datasheet): 989 TFLOP/s dense bf16/fp16, 1979 dense fp8 and int8,
# 495 TF32 (JAX's default precision for float32 matmuls on GPU, and its "high"), 67 fp32
# (precision "highest": no tensor cores) and 67 fp64; 132 SMs; 227 KiB of shared memory
# per block (opt-in, compute capability 9.0); NVLink 4: 900 GB/s both ways = 450 GB/s out.
_HOPPER = {"bfloat16": 989 * _T, "float16": 989 * _T, "float32": 495 * _T,
           "float32_high": 495 * _T, "float32_highest": 67 * _T, "float64": 67 * _T,
           "int8": 1979 * _T, "float8_e4m3fn": 1979 * _T, "float8_e5m2": 1979 * _T}
_HOPPER_KIND = dict(platform=GPU, compute_capability=(9, 0), cores=132, smem_bytes=232448,
                    families=(MOSAIC, TRITON))
register(Kind(
    "h100_sxm", words=("H100", "H800", "GH200"), aliases=("h100",), default=True,
    # Calibrated on an H100 SXM (2026-11-26, 23 programs within 2.7%).
    hardware=_nvswitch("H100 SXM", _HOPPER, 3.35 * _T, 450 * _G, (0.80, 0.82, 4.5e-6)),
    aot=Aot("h100", example="h100x8", target_config="h100_sxm.txtpb"), **_HOPPER_KIND))
# H200 SXM: H100's compute, 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200 datasheet).
register(Kind(
    "h200", words=("H200",), aliases=("h200_sxm",),
    # Calibrated on an H200 (2026-11-26, 6 programs within 2.2%).
    hardware=_nvswitch("H200 SXM", _HOPPER, 4.8 * _T, 450 * _G, _H200_COMPUTE),
    aot=Aot("h200", target_config="h200_sxm.txtpb"), **_HOPPER_KIND))
# B200 (NVIDIA HGX B200 spec, 1000 W): 2250 TFLOP/s dense bf16/fp16, 4500 dense fp8 and
# int8, 1100 TF32 (no float32 "highest" figure: the replay says it assumed TF32's), 40
# fp64;
# 8 TB/s HBM3e; NVLink 5: 1.8 TB/s both ways = 900 GB/s out; 148 SMs; 227 KiB of shared
# memory per block (compute capability 10.0). No Blackwell step kernels yet: the Mosaic
# GPU ones use wgmma, which Blackwell does not run; the Triton ones compile `tl.dot` for
# the GPU at hand (not yet run on a B200; its compute side takes the H200's calibration,
# the HBM3e part).
register(Kind(
    "b200", GPU, words=("B200",), compute_capability=(10, 0), cores=148, smem_bytes=232448,
    hardware=_nvswitch("B200", {"bfloat16": 2250 * _T, "float16": 2250 * _T,
                                "float32": 1100 * _T, "float32_high": 1100 * _T,
                                "float64": 40 * _T, "int8": 4500 * _T,
                                "float8_e4m3fn": 4500 * _T, "float8_e5m2": 4500 * _T},
                       8 * _T, 900 * _G,
                       _H200_COMPUTE),
    families=(TRITON,), refused={MOSAIC: _no_wgmma((10, 0))}))
# NVIDIA GPUs known by compute capability only (NVIDIA's CUDA GPUs table): no cost preset
# of their own (they get the GPU default's), the kernel families their capability runs.
for _name, _cc, _words in (
        ("nvidia_sm100", (10, 0), ("B100", "GB200")),
        ("nvidia_sm90", (9, 0), ("H20",)),
        ("nvidia_sm89", (8, 9), ("L4", "L40", "L40S", "RTX 4090", "RTX 6000 Ada")),
        ("nvidia_sm86", (8, 6), ("A10", "A10G", "A40", "RTX 3090", "RTX A6000")),
        ("nvidia_sm80", (8, 0), ("A100", "A800", "A30")),
        ("nvidia_sm75", (7, 5), ("T4",)),
        ("nvidia_sm70", (7, 0), ("V100",))):
    _families, _refused = gpu_families(_cc)
    register(Kind(_name, GPU, words=_words, compute_capability=_cc, families=_families,
                  refused=_refused))


def _tpu(name, peak_tflops, hbm_gbs, link_gbs, links, torus_period, torus_axes,
         efficiency=0.8, collective_beside_matmul=False, beside_hides_part=True,
         narrow=None):
    """A TPU generation's numbers per JAX device (a v4/v5p chip's two TensorCores
    together in megacore mode). float32 matmuls run as bf16 passes: one at the default
    precision, three at "high", six at "highest" (JAX's `lax.Precision`). `narrow`:
    TFLOP/s (TOP/s) of the 8-bit types the MXUs run natively, by dtype name; others are
    widened to bf16. The fused kernel's step is a DMA start and a semaphore wait
    (`kernel_step_latency`), the lax ring's a ppermute launch. `efficiency` is what the
    fused kernels' step matmuls are expected to reach: their tile presets are
    compute-bound from HBM on every generation, with the most headroom on v5e/v5p (tile
    intensity 341 flop/byte against 240/166 needed) and the least on v6e (683 against
    560, 256-wide MXUs), hence 0.8 and 0.75. Calibrate with a measured step
    (bench/test_tpu_speed.py) when a TPU is available. `collective_beside_matmul`:
    only where `set_overlap_flags`' async collective fusion lets a weight gradient's
    reduce-scatter run beside the backward's matmuls (v5e), and where they run on the
    SparseCores (v6e; docs/measurements.md). v5p's op programs still replay the reference
    collective synchronous, offload or not. `beside_hides_part`: False where XLA hides
    such a collective only behind work that covers it whole (v5e)."""
    rates = {"bfloat16": peak_tflops * _T, "float32": peak_tflops * _T,
             "float32_high": peak_tflops / 3 * _T, "float32_highest": peak_tflops / 6 * _T}
    rates.update({k: v * _T for k, v in (narrow or {}).items()})
    return Hardware(name, rates,
                    efficiency=efficiency, hbm_bandwidth=hbm_gbs * _G,
                    link_bandwidth=link_gbs * _G, egress_bandwidth=links * link_gbs * _G,
                    step_latency=5e-6, kernel_step_latency=1.5e-6, hop_latency=1e-6,
                    launch_overhead=2e-6, overlap=1.0, torus_period=torus_period,
                    torus_axes=torus_axes,
                    collective_beside_matmul=collective_beside_matmul,
                    beside_hides_part=beside_hides_part)


# TPU entries. VMEM per TensorCore from JAX's TPU table (`pltpu.get_tpu_info_for_chip`);
# the compiler's default scoped VMEM limit as XLA's "exceeded scoped vmem limit" messages
# print it; tiles `(bm, bk, bn)` compute-bound from HBM (docs/tpu.md has the arithmetic).
# Tori: v4, v5p slices of whole 4x4x4 cubes are 3-D tori; v5e, v6e 2-D tori only as
# whole 16x16 pods.
_TPU_KIND = dict(platform=TPU, families=(TPU_KERNELS,))
# TPU v4: 275 TFLOP/s bf16 and int8, 1.2 TB/s HBM2, 6 ICI links of 50 GB/s one way (3-D
# torus).
register(Kind(
    "tpu_v4", device_kinds=("TPU v4",), aliases=("v4",), generation="v4", cores=2,
    hardware=_tpu("TPU v4", 275, 1200, 50, 6, 4, 3, narrow={"int8": 275}),
    vmem_bytes=16 * MiB,
    default_scoped_vmem_bytes=16 * MiB, tiles=(512, 512, 512),
    aot=Aot("v4", example="v4:2x2x2"), **_TPU_KIND))
# TPU v5e: 197 TFLOP/s bf16, 394 TOP/s int8, 819 GB/s HBM2, ICI 400 GB/s both ways per
# chip over 4 links (2-D torus) = 50 GB/s one way per link.
register(Kind(
    "tpu_v5e", device_kinds=("TPU v5 lite", "TPU v5e"), aliases=("v5e",), generation="v5e",
    default=True, hardware=_tpu("TPU v5e", 197, 819, 50, 4, 16, 2,
                                collective_beside_matmul=True, beside_hides_part=False,
                                narrow={"int8": 394}),
    vmem_bytes=128 * MiB,
    default_scoped_vmem_bytes=16 * MiB, tiles=(512, 1024, 1024),
    aot=Aot("v5e", example="v5e:2x4"), **_TPU_KIND))
# TPU v5p: 459 TFLOP/s bf16, 918 TOP/s int8, 2765 GB/s HBM2e, ICI 1200 GB/s both ways per
# chip over 6 links (3-D torus) = 100 GB/s one way per link.
register(Kind(
    "tpu_v5p", device_kinds=("TPU v5", "TPU v5p"), aliases=("v5p",), generation="v5p",
    cores=2, hardware=_tpu("TPU v5p", 459, 2765, 100, 6, 4, 3, narrow={"int8": 918}),
    vmem_bytes=64 * MiB,
    default_scoped_vmem_bytes=16 * MiB, tiles=(512, 1024, 1024),
    aot=Aot("v5p", example="v5p:2x2x2"), **_TPU_KIND))
# TPU v6e (Trillium): 918 TFLOP/s bf16, 1836 TOP/s int8, 1640 GB/s HBM, ICI 3584 Gbit/s
# one way per chip over 4 links (2-D torus) = 112 GB/s one way per link; 256-wide MXUs.
register(Kind(
    "tpu_v6e", device_kinds=("TPU v6 lite", "TPU v6e"), aliases=("v6e",), generation="v6e",
    hardware=_tpu("TPU v6e", 918, 1640, 112, 4, 16, 2, efficiency=0.75,
                  collective_beside_matmul=True, narrow={"int8": 1836}),
    vmem_bytes=128 * MiB, default_scoped_vmem_bytes=32 * MiB, tiles=(1024, 1024, 2048),
    aot=Aot("v6e", example="v6e:2x4"), **_TPU_KIND))
# TPU7x (Ironwood; Google Cloud's TPU7x page, https://cloud.google.com/tpu/docs/tpu7x):
# per chip 2307 TFLOP/s bf16, 4614 fp8 (no int8 figure), 7380 GB/s HBM, ICI 1200 GB/s
# both ways, two TensorCores that JAX sees as two devices (one per `core_on_chip`;
# libtpu's "tpu7x:2x2x1" is 8 devices on 4 chips). Per device: half of each. The page gives no link count: 6 links
# of 100 GB/s one way, as on v5p (the same 1200 GB/s, and pods of 4x4x4 cubes, like
# v5p), shared by the chip's two devices; the hop between a chip's two devices is
# modelled as one such link. VMEM 64 MiB per TensorCore (JAX's table); its default
# scoped limit is not known here (the kernels ask for 3/4 of VMEM anyway); tiles of
# 1024 give 512 flop/byte against 1154 / 3.69 = 313 needed.
register(Kind(
    "tpu_v7x", device_kinds=("TPU7x",), aliases=("v7x", "tpu7x"), generation="7x",
    devices_per_chip=2, hardware=dataclasses.replace(
        _tpu("TPU7x", 2307 / 2, 7380 / 2, 100, 3, 4, 3,
             narrow={"float8_e4m3fn": 4614 / 2, "float8_e5m2": 4614 / 2}),
        name="TPU7x (one TensorCore)"),
    vmem_bytes=64 * MiB, default_scoped_vmem_bytes=16 * MiB, tiles=(1024, 1024, 1024),
    aot=Aot("tpu7x"), **_TPU_KIND))
# Older generations JAX knows: planned like the smallest chips, no cost preset of their
# own (the TPU default's), not compiled or tested by this package.
for _generation, _kinds in (("v2", ("TPU v2",)), ("v3", ("TPU v3",)),
                            ("v4i", ("TPU v4 lite",))):
    register(Kind(f"tpu_{_generation}", device_kinds=_kinds, generation=_generation,
                  vmem_bytes=16 * MiB, default_scoped_vmem_bytes=16 * MiB,
                  tiles=(512, 512, 512), **_TPU_KIND))
