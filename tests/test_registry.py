"""A new target is one registry entry (`fusedpar._hw._registry`): every hardware decision —
cost preset, `auto`, ring shape and order, the TPU kernels' tiles and VMEM, the GPU kernel
family and its limits, the AOT target name — follows the entry of the mesh's devices.
And the H200 and B200 entries."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedpar
from fusedpar._compile import _aot, _links
from fusedpar._hw import _registry
from fusedpar._core import _schedule
from fusedpar import cost_model
from fusedpar._core._backends import pallas_gpu, pallas_tpu
from fusedpar._hw._hardware import MOSAIC, TRITON, Aot, Kind
from fusedpar._hw._target import Target
from helpers import needs_aot

AGM = "all_gather_matmul"
MiB = 2**20
V5E = _registry.get("tpu_v5e")
# v5e's devices under another name, with other numbers: links 1000x faster (and one per
# device, so a bidirectional ring gains nothing), VMEM of 8 MiB, 256-wide tiles, and a
# torus every 4 chips along any axis.
FAKE_TPU = dataclasses.replace(
    V5E, name="tpu_fake", device_kinds=("TPU fake",), aliases=(), generation="fake",
    default=False, hardware=dataclasses.replace(
        V5E.hardware, name="TPU fake", link_bandwidth=50e12, egress_bandwidth=50e12,
        torus_period=4, torus_axes=0),
    vmem_bytes=8 * MiB, default_scoped_vmem_bytes=4 * MiB, tiles=(256, 256, 256),
    aot=Aot("fake", topology="v5e"))
# A Hopper-like GPU whose entry allows only the Triton kernels.
FAKE_GPU = Kind("gpu_fake", "gpu", words=("FAKE9000",), compute_capability=(9, 0),
                cores=16, smem_bytes=100_000, families=(TRITON,),
                refused={MOSAIC: "the Fake9000 has no wgmma"})


@dataclasses.dataclass
class Device:
    """What the package reads of a device: platform, kind, and a TPU chip's coordinates."""

    platform: str
    device_kind: str
    coords: tuple = (0, 0, 0)
    id: int = 0


@pytest.fixture
def register():
    added = []

    def add(kind):
        added.append(_registry.register(kind).name)
        return kind

    yield add
    for name in added:
        if any(k.name == name for k in _registry.kinds()):
            _registry.unregister(name)


def _structs(*shapes, dtype=jnp.bfloat16):
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def test_a_made_up_tpu_follows_its_entry(register):
    x, w = _structs((2048, 8192), (8192, 2048))
    real, fake = Device("tpu", "TPU v5 lite"), Device("tpu", "TPU fake")
    assert Target("tpu", "TPU fake").kind is None  # not known before it is registered
    register(FAKE_TPU)
    target = Target("tpu", "TPU fake")
    # Cost preset: the entry's numbers, a view of the registry.
    assert (target.tpu_generation, target.cost_preset) == ("fake", "tpu_fake")
    assert cost_model.PRESETS["tpu_fake"] is FAKE_TPU.hardware
    assert cost_model.get_hardware(None, target) is FAKE_TPU.hardware
    # auto: with the fake's fast links decomposing does not pay; on v5e it does (in the
    # fused kernel, which the model times with one launch and no assembly).
    on_v5e, on_fake = (fusedpar.explain(AGM, x, w, 8, target=d) for d in (real, fake))
    assert on_v5e.backend == "pallas" and "TPU v5e:" in on_v5e.reason
    assert on_fake.backend == "reference" and "TPU fake:" in on_fake.reason
    # Ring shape: one link per device gives a bidirectional ring nothing.
    assert fusedpar.explain(AGM, x, w, 8, target=real, backend="ring").bidirectional
    assert not fusedpar.explain(AGM, x, w, 8, target=fake, backend="ring").bidirectional
    # The fused kernels are planned for the entry's chip: its VMEM and tiles.
    assert fusedpar.explain(AGM, x, w, 8, target=fake, backend="pallas").kernels.endswith(
        "compiled by Mosaic for TPU fake")
    layouts = {}
    for t in (Target("tpu", "TPU v5 lite"), target):
        module, params = pallas_tpu._params(
            "ag_rows", axis_name=None, axis_size=4, bidirectional=False,
            out_dtype="bfloat16", reduce_dtype="float32", return_gathered=False, target=t)
        layouts[t.tpu_generation] = params.launch.chip, module.plan(
            params, *_structs((4096, 8192), (8192, 4096)))[1]
    chip, layout = layouts["fake"]
    assert (chip.name, chip.vmem_limit_bytes, chip.tiles) == ("fake", 6 * MiB, (256,) * 3)
    assert layout.tiles == (256, 256, 256) and not layout.resident
    assert layouts["v5e"][1].resident  # v5e's 84 MiB budget keeps w in VMEM
    # Ring order and routes: a line of 4 chips is a torus by the entry's rule, so index
    # order is one link per hop (v5e's line has no wrap-around: 3 links back).
    line = [(0, y, 0) for y in range(4)]
    assert _schedule.tpu_wraps("TPU fake", (1, 4, 1)) == (False, True, False)
    assert _schedule.tpu_wraps("TPU v5 lite", (1, 4, 1)) == (False, False, False)
    hops = {kind: _schedule.ring_hops(line, None, _schedule.tpu_wraps(kind, (1, 4, 1)),
                                      (1, 4, 1)) for kind in ("TPU fake", "TPU v5 lite")}
    assert hops == {"TPU fake": [1, 1, 1, 1], "TPU v5 lite": [1, 1, 1, 3]}
    mesh = type("Mesh", (), {"axis_names": ("x",), "devices": np.array(
        [Device("tpu", "TPU fake", c, i) for i, c in enumerate(line)])})
    assert _schedule.mesh_ring_order(mesh, "x") is None  # index order: the torus ring
    assert _links.wraps_of(line, FAKE_TPU.hardware) == (0, 4, 0)  # the replay's routes
    # The AOT target names: "fake:<slice>" compiles with libtpu's v5e topology.
    assert _aot._check_target("fake:2x4") == (FAKE_TPU, "2x4")


def test_a_made_up_gpu_follows_its_entry(register):
    x, w = _structs((1024, 4096), (4096, 4096))
    gpu = Device("gpu", "NVIDIA FAKE9000")
    assert Target("gpu", "NVIDIA FAKE9000").compute_capability is None  # unknown before
    register(FAKE_GPU)
    target = Target("gpu", "NVIDIA FAKE9000")
    assert target.compute_capability == (9, 0) and target.cost_preset == "h100_sxm"
    assert "Pallas Triton step kernels" in fusedpar.explain(
        AGM, x, w, 8, target=gpu, backend="pallas").kernels
    with pytest.raises(NotImplementedError, match="the Fake9000 has no wgmma"):
        fusedpar.explain(AGM, x, w, 8, target=gpu, backend="pallas",
                         options={"kernels": "mosaic"})
    # The Mosaic kernels' limits are the entry's (where it allows them).
    _registry.unregister("gpu_fake")
    register(dataclasses.replace(FAKE_GPU, families=(MOSAIC, TRITON), refused={}))
    limits = pallas_gpu._limits(MOSAIC, target)
    assert limits == {"num_sms": 16, "smem_limit": 100_000}
    from fusedpar.kernels.gpu import mosaic

    cfg = mosaic.choose_config(4096, 4096, (4096,), "bfloat16", "float32", limits)
    assert cfg.num_sms == 16 and cfg.smem_bytes("bfloat16", "float32") <= 100_000


def test_registry_refuses_a_taken_name():
    with pytest.raises(ValueError, match=r"hardware name\(s\) \['v5e'\] are taken"):
        _registry.register(dataclasses.replace(FAKE_TPU, aliases=("v5e",)))
    with pytest.raises(ValueError, match="unknown hardware 'tpu_v9'; known: cpu, h100_sxm"):
        _registry.get("tpu_v9")


def test_b200_runs_the_triton_kernels_and_refuses_mosaic():
    x, w = _structs((1024, 4096), (4096, 4096))
    b200 = Target("gpu", "NVIDIA B200")
    assert b200.compute_capability == (10, 0) and b200.cost_preset == "b200"
    # The datasheet's 8 TB/s at the fraction the kernels reached on Hopper (calibrated).
    assert cost_model.PRESETS["b200"].hbm_bandwidth == pytest.approx(0.87 * 8e12)
    device = Device("gpu", "NVIDIA B200")
    assert fusedpar.explain(AGM, x, w, 8, target=device, backend="pallas").kernels == (
        "pallas_gpu: a lax ring with Pallas Triton step kernels, compiled for compute "
        "capability 10.0")
    with pytest.raises(NotImplementedError, match=r"backend 'pallas' cannot run this call \(.*\): "
                       r"the Mosaic GPU step kernels use wgmma.*compute capability 10\.0 "
                       r"does not run; options=\{'kernels': 'triton'\}"):
        fusedpar.explain(AGM, x, w, 8, target=device, backend="pallas",
                         options={"kernels": "mosaic"})
    # A GPU no entry names, by its compute capability: only Hopper runs Mosaic.
    assert _registry.gpu_families((12, 0))[0] == (TRITON,)
    assert _registry.gpu_families((9, 0))[0] == (MOSAIC, TRITON)


@needs_aot
def test_h200_target_has_its_own_preset():
    from fusedpar import aot

    mesh = aot.mesh("h200x8")
    target = fusedpar._hw._target.of_mesh(mesh)
    assert (target.device_kind, target.compute_capability, target.cost_preset) == (
        "NVIDIA H200", (9, 0), "h200")
    h200, h100 = cost_model.PRESETS["h200"], cost_model.PRESETS["h100_sxm"]
    # Each calibrated on its own part (docs/measurements.md).
    assert (h200.hbm_bandwidth, h100.hbm_bandwidth) == (
        pytest.approx(0.87 * 4.8e12), pytest.approx(0.82 * 3.35e12))
    assert (h200.efficiency, h100.efficiency) == (0.75, 0.80)
    x, w = _structs((1024, 4096), (4096, 4096))
    choice = fusedpar.explain(AGM, x, w, 8, target=mesh)
    assert "H200 SXM:" in choice.reason
    assert fusedpar.explain(AGM, x, w, 8, target=mesh, backend="pallas").kernels.startswith(
        "pallas_gpu: a lax ring with Mosaic GPU (TMA, wgmma) step kernels")


@needs_aot
def test_tpu7x_rings_cross_one_link_per_hop():
    """TPU7x: two devices per chip (`core_on_chip`); the ring visits a chip's two devices
    one after the other, every hop one link (index order would cross up to 3)."""
    from fusedpar import aot

    mesh = aot.mesh("tpu7x:2x2x1")
    target = fusedpar._hw._target.of_mesh(mesh)
    assert (target.tpu_generation, target.cost_preset) == ("7x", "tpu_v7x")
    places = [_registry.position(d) for d in mesh.devices.flat]
    order = _schedule.mesh_ring_order(mesh, "x")
    assert _schedule.ring_hops(places, order) == [1] * 8
    assert max(_schedule.ring_hops(places)) == 3
