"""Collective ids: two TPU ring kernels in flight on different mesh axes at once.

Each (kernel, mesh axes) pair has its own collective id, hence its own barrier semaphore
(`kernels/tpu/_collective_ids.py`). The interpreter normally ends every kernel with a
barrier across all devices (a TODO in JAX's interpreter), so kernels never overlap
there; the overlap test removes that barrier, the way kernels run on a TPU, and delays
some devices so that a fast device enters the second kernel (a reduce-scatter over
mesh axis "a") while its neighbour on "a" is still before or inside the first one (an
all-gather over "b"). With one id for both, the delayed device's all-gather barrier
counts the other kernel's signals, starts its DMAs before its own ring neighbour has
entered the kernel, and the interpreter fails writing into buffers that do not exist yet
(eager DMAs). With an id each, both kernels equal the lax expression, race-free.
"""

import time

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import io_callback
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _definition
from fusedpar.kernels.tpu._collective_ids import KERNELS, collective_id

from helpers import assert_close, mesh, normal

pytestmark = pytest.mark.timeout(120)


def test_ids_differ_for_every_kernel_and_axis_tuple():
    mesh_axes = ("data", "fsdp", "tp")
    rings = [("data",), ("fsdp",), ("tp",), ("fsdp", "tp"), ("tp", "fsdp"),
             ("data", "fsdp", "tp")]
    ids = [collective_id(k, r, mesh_axes) for k in KERNELS for r in rings]
    assert len(set(ids)) == len(ids), ids
    assert max(ids) < 2 * 4**3  # small: base (axes + 1), one digit per ring axis
    # Every host must get the same ids: they come from names and positions only (no
    # per-process hashing), so these exact values.
    assert ids == [2, 4, 6, 22, 28, 54, 3, 5, 7, 23, 29, 55]
    with pytest.raises(ValueError, match="ring axis 'sp' is not an axis of the mesh"):
        collective_id("all_gather_matmul", ("sp",), mesh_axes)


def _delay(x, a, b):
    """Hold devices (1, 0) and (1, 1) back 0.5 s and 1 s before the first kernel."""
    time.sleep(0.5 * int(a) * (1 + int(b)))
    return x


def _program(backend, options):
    def local(x, w, x2, w2):
        if backend == "reference":
            return (_definition.all_gather_matmul(x, w, "b"),
                    _definition.matmul_reduce_scatter(x2, w2, "a", dim=0))
        x = io_callback(_delay, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                        lax.axis_index("a"), lax.axis_index("b"))
        kw = dict(backend="pallas_tpu", options=options)
        return (fusedpar.all_gather_matmul(x, w, "b", **kw),
                fusedpar.matmul_reduce_scatter(x2, w2, "a", **kw))

    spec = P(("a", "b"))
    return jax.jit(jax.shard_map(local, mesh=mesh((2, 2), ("a", "b")), in_specs=(spec,) * 4,
                                 out_specs=(spec, spec), check_vma=False))


def _inputs():
    # Per device: x (16, 128), w (128, 128) gathered over "b"; x2 (32, 128), w2 (128, 128)
    # reduce-scattered over "a".
    return (normal(0, (64, 128), jnp.float32), normal(1, (512, 128), jnp.float32),
            normal(2, (128, 128), jnp.float32), normal(3, (512, 128), jnp.float32))


@pytest.fixture
def overlapping_kernels(monkeypatch):
    """Remove the interpreter's barrier at kernel exit, so kernels overlap across devices."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    if not hasattr(interpreter, "_clean_up_shared_memory"):
        pytest.skip("this JAX's TPU interpreter has no exit barrier to remove")
    monkeypatch.setattr(interpreter, "_clean_up_shared_memory", lambda token, device_id: token)
    return interpreter


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_kernels_on_two_axes_overlap_safely(overlapping_kernels, mode, capfd):
    args = _inputs()
    want = _program("reference", None)(*args)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    capfd.readouterr()
    got = jax.block_until_ready(_program("pallas_tpu", {"interpret_params": params})(*args))
    text = "".join(capfd.readouterr())
    assert not overlapping_kernels.races.races_found and "RACE DETECTED" not in text
    assert_close(got, want, jnp.float32, f"two kernels in flight ({mode})")
    # Only the reduce-scatter's barrier semaphore may hold signals when a delayed device
    # leaves the all-gather: its neighbour on "a" already entered the reduce-scatter.
    rs_id = collective_id("matmul_reduce_scatter", ("a",), ("a", "b"))
    for line in text.splitlines():
        if "non-zero count" in line:
            assert line.startswith(f"Semaphore {rs_id} has non-zero count for"), line


def test_one_id_for_both_kernels_is_caught(overlapping_kernels):
    """The same program with collective id 0 for both kernels fails."""
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    options = {"interpret_params": params, "_broken": "shared_collective_id"}
    with pytest.raises(Exception, match="KeyError"):
        jax.block_until_ready(_program("pallas_tpu", options)(*_inputs()))
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()  # the failed devices' tokens: nothing left to wait for
