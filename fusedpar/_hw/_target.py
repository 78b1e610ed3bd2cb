"""The hardware a program is for, read from the devices of the mesh it runs on.

A program traced on a laptop for "8 x H100" or a TPU v5e slice (compiled ahead of time,
without the hardware: `fusedpar.aot`) must make the same choices as one traced on that
hardware: platform, TPU generation or GPU compute capability, the Pallas kernel family,
interpret mode, tile presets and VMEM limits, the cost preset behind `"auto"`. So none of
them come from `jax.default_backend()` (the machine doing the tracing, "cpu" when
compiling for an absent TPU): they come from the `Target` this module reads from

1. the mesh in context: inside `jax.shard_map` (or under `jax.set_mesh`) JAX's abstract
   mesh carries the kind of its devices (`AbstractMesh.abstract_device`);
2. else the sharding of the arrays being worked on (`jax.typeof(x).sharding.mesh`);
3. else, with no mesh anywhere, the local default device (the only place that asks).

Simulated CPU devices are the target "cpu": Pallas kernels run in interpret mode there.
What the package knows of a kind of device (generation, compute capability, cost numbers,
chip limits, kernel families) is its entry in the registry, `fusedpar._hw._registry`.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import jax

from . import _registry
from ._hardware import CPU, GPU, TPU

PLATFORMS = (CPU, GPU, TPU)
_PLATFORM_ALIASES = {"cuda": GPU, "rocm": GPU}


@dataclasses.dataclass(frozen=True)
class Target:
    """The kind of device a program is built for.

    - `platform`: "cpu", "gpu" or "tpu".
    - `device_kind`: what JAX calls the device ("TPU v5 lite", "NVIDIA H100 80GB HBM3",
      "cpu"); "" when only the platform is known (`explain(platform=...)`).
    - `num_cores`: TensorCores one TPU device drives (2 in megacore mode), streaming
      multiprocessors of a GPU; None when unknown.
    """

    platform: str
    device_kind: str = ""
    num_cores: Optional[int] = None

    def __post_init__(self):
        platform = _PLATFORM_ALIASES.get(self.platform, self.platform)
        if platform not in PLATFORMS:
            raise ValueError(f"target platform must be one of {', '.join(PLATFORMS)}, got "
                             f"{self.platform!r}.")
        object.__setattr__(self, "platform", platform)

    @property
    def interpret(self) -> bool:
        """Whether Pallas kernels run in interpret mode (simulated CPU devices)."""
        return self.platform == CPU

    @property
    def kind(self):
        """The registry's entry for these devices (`fusedpar._hw._registry`), or None when
        none names their kind (or only the platform is known)."""
        if not self.device_kind:
            return None
        return _registry.find(self.platform, self.device_kind)

    @property
    def tpu_generation(self) -> Optional[str]:
        """"v4", "v5e", "v5p", "v6e", ... for a TPU of a known kind, else None."""
        kind = self.kind if self.platform == TPU else None
        return None if kind is None else kind.generation

    @property
    def compute_capability(self) -> Optional[tuple[int, int]]:
        """`(major, minor)` of an NVIDIA GPU of a known kind, else None."""
        if self.platform != GPU or not self.device_kind:
            return None
        kind = self.kind
        if kind is not None and kind.compute_capability is not None:
            return kind.compute_capability
        return _local_compute_capability(self.device_kind)

    @property
    def cost_preset(self) -> str:
        """The `cost_model.PRESETS` key `"auto"` assumes for this target: its entry's,
        else the platform default's."""
        kind = self.kind
        if kind is None or kind.hardware is None:
            kind = _registry.default(self.platform)
        return kind.name

    def devices_are(self) -> str:
        """The target as an error message names it: "the mesh's devices are <kind>", or,
        for a platform named alone (`explain(platform=...)`), that no device was named."""
        if self.device_kind:
            return f"the mesh's devices are {self}"
        return (f"only the platform {self.platform!r} was named, no device kind (pass "
                "target=, a mesh or a device, to say which)")

    def __str__(self):
        if not self.device_kind:
            return f"{self.platform} (device kind unknown)"
        extra = ""
        if self.tpu_generation:
            extra = f", TPU {self.tpu_generation}"
            extra += ", megacore" if self.num_cores == 2 else ""
        elif self.compute_capability:
            extra = ", compute capability {}.{}".format(*self.compute_capability)
        return f"{self.device_kind} ({self.platform}{extra})"


def _local_compute_capability(kind: str) -> Optional[tuple[int, int]]:
    """A local GPU of this kind says its compute capability (a kind not in the table)."""
    try:
        for d in jax.devices(GPU):
            if d.device_kind == kind and getattr(d, "compute_capability", None):
                return tuple(int(v) for v in str(d.compute_capability).split(".")[:2])
    except RuntimeError:  # no GPU backend here
        pass
    return None


def of_device(device) -> Target:
    """The target of a `jax.Device` or of an abstract mesh's `AbstractDevice`."""
    platform = device.platform
    cores = getattr(device, "num_cores", None)
    if cores is None and _PLATFORM_ALIASES.get(platform, platform) == GPU:
        cores = getattr(device, "core_count", None)
    return Target(platform, device.device_kind, cores)


def of_mesh(mesh) -> Optional[Target]:
    """The target of a `Mesh` or `AbstractMesh`, or None when it does not say."""
    if mesh is None or mesh.empty:
        return None
    if isinstance(mesh, jax.sharding.Mesh):
        return of_device(mesh.devices.flat[0])
    abstract = getattr(mesh, "abstract_device", None)
    return None if abstract is None else of_device(abstract)


def of_platform(platform: str) -> Target:
    """A target known only by its platform ("cpu", "gpu"/"cuda", "tpu")."""
    if platform == CPU:
        return Target(CPU, CPU)
    return Target(platform)


def local() -> Target:
    """The target of this process's default device (used only where no mesh says)."""
    return of_device(jax.devices()[0])


def automatic_axes() -> tuple:
    """`((name, size), ...)`: the mesh axes the enclosing `jax.shard_map` leaves to XLA
    (those not in its `axis_names`); () outside `shard_map` or where every axis is manual.

    A Pallas TPU kernel cannot run there: Mosaic kernels cannot be partitioned
    automatically (even over an axis of size 1), interpret mode's host callbacks run only
    where every axis is manual, and a kernel addresses its neighbours by their
    coordinates on every mesh axis.
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    if mesh.empty or not manual:
        return ()
    return tuple((a, n) for a, n in zip(mesh.axis_names, mesh.axis_sizes) if a not in manual)


def compile_only(where) -> bool:
    """Whether the devices of `where` (a `jax.sharding.Mesh`, a device, or None: none)
    are compile-only (`fusedpar.aot`'s): they compile programs but hold no arrays, and
    take their compiler flags from the compile call."""
    devices = (where.devices.flat if isinstance(where, jax.sharding.Mesh)
               else () if where is None else (where,))
    return any(type(getattr(d, "client", None)).__name__ == "CompileOnlyPyClient"
               for d in devices)


def concrete_mesh():
    """The `jax.sharding.Mesh` (its devices, with their coordinates) the code being traced
    runs on, or None where no such mesh can be found.

    1. The mesh `jax.set_mesh` set, if it has the axes of the abstract mesh in context.
    2. Inside a `jax.shard_map(mesh=m)` traced without `jax.set_mesh`, the context holds
       only the abstract mesh (names, sizes, device kind) and JAX offers no way to reach
       `m`. It is a local variable, `mesh`, of JAX's own shard_map frames on the call
       stack: the innermost concrete `Mesh` there with the abstract mesh's axis names,
       sizes and device kind is the one the shard_map was given (a nested shard_map
       with no mesh of its own holds an abstract one and is skipped). If a JAX version
       keeps it elsewhere this finds nothing, and callers say so (`_schedule.ring_for`).
    """
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return None
    try:
        from jax._src import mesh as mesh_lib

        found = mesh_lib.get_concrete_mesh()
    except (ImportError, AttributeError):  # pragma: no cover - a JAX without it
        found = None
    if found is not None and not found.empty and _same_axes(found, abstract):
        return found
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith("jax/_src/shard_map.py"):
            mesh = frame.f_locals.get("mesh")
            if isinstance(mesh, jax.sharding.Mesh) and _same_axes(mesh, abstract):
                return mesh
        frame = frame.f_back
    return None


def _same_axes(mesh, abstract) -> bool:
    """Whether the concrete `mesh` has the axis names, sizes and device kind of the
    abstract mesh in context."""
    if dict(mesh.shape) != dict(zip(abstract.axis_names, abstract.axis_sizes)):
        return False
    kind = getattr(getattr(abstract, "abstract_device", None), "device_kind", None)
    return kind is None or mesh.devices.flat[0].device_kind == kind


def current(*arrays) -> Target:
    """The target of the code being traced: the mesh in context, else the mesh of the
    first of `arrays` that has one, else the local default device."""
    found = of_mesh(jax.sharding.get_abstract_mesh())
    if found is not None:
        return found
    for a in arrays:
        try:
            sharding = jax.typeof(a).sharding
        except (TypeError, AttributeError):  # not an array, or an aval without sharding
            continue
        found = of_mesh(getattr(sharding, "mesh", None))
        if found is not None:
            return found
    return local()
