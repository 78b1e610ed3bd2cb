"""A small analytic model of how long each backend takes for one op, used by `"auto"`.

The model follows one device through a ring of `N` devices (`_schedule.Ring`). Each
backend declares which of three families estimates it (`_backends.Backend.cost`):
"reference" (the `reference` backend), "ring" (`ring`) or "kernel" (`pallas`,
`pallas_tpu`, `pallas_gpu`):

- **reference**: the whole collective, then the whole matmul (nothing overlaps). The
  collective moves `N - 1` blocks over the faster of the device's ring links (collective
  libraries use both directions where the topology has separate links).
- **ring** / **kernel**: `N` compute steps, each multiplying one block, and `N - 1`
  transfers, each running while a step computes. A step lasts `max(compute, transfer)`
  when the two overlap fully; `Hardware.overlap` < 1 adds back the part that does not
  hide. One step is always exposed: an all-gather's last step computes with nothing left
  to send, a reduce-scatter's first step computes before there is anything to send, so

      time = compute_step + (N - 1) * overlapped(compute_step, transfer_step)
             + N * step_overhead

  A bidirectional ring sends half a block each way per step, so on hardware with one link
  per neighbour (TPU ICI torus) the per-step transfer time halves; where both directions
  share the device's egress (NVLink through NVSwitch) it does not.

Compute time is a roofline: `max(flops / (peak * efficiency), bytes / hbm_bandwidth)` plus
a per-kernel launch overhead, so thin per-step matmuls of small shapes become memory- and
overhead-bound and decomposing stops paying. The reduce-scatter accumulator travels in
`reduce_dtype` (float32 by default), doubling its bytes for bfloat16 inputs.

Presets (`PRESETS`, a view of the hardware registry, `fusedpar._hw._registry`) come from public
spec sheets; `calibrate` fits a preset to measured numbers (for example the single-GPU
bench: a matmul's time and a transfer's time).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Union

import numpy as np

from ._core import _backends, _primitives as prims, _schedule, _validate
from ._hw import _registry
from ._hw._cost_hardware import (PRESETS as PRESETS, calibrate as calibrate,
                             get_hardware as get_hardware, set_hardware as set_hardware)
from ._hw._hardware import Hardware

# -- the model -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """One backend's estimate for one primitive call, and where the time goes.

    Times in seconds, bytes per device. `compute_step`/`transfer_step` are one ring step's
    matmul and one direction's transfer (for "reference": the whole matmul and the whole
    collective); `steps` the compute steps; `bytes_step` the bytes sent per direction per
    step; `bytes_sent` the bytes a device sends in the whole op.
    """

    backend: str
    seconds: float
    compute_step: float
    transfer_step: float
    steps: int
    bytes_step: int
    bytes_sent: int

    @property
    def bound(self) -> str:
        """"compute" or "communication": which side of a step is longer."""
        return "communication" if self.transfer_step > self.compute_step else "compute"


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def _acc_dtype(dtype):
    return np.promote_types(np.dtype(dtype), np.float32)


def _roofline(hw: Hardware, m, k, n, dtype, out_bytes_per_elem, extra_bytes=0) -> float:
    """Roofline time of one (m, k) @ (k, n) product."""
    flops = 2.0 * m * k * n
    nbytes = (m * k + k * n) * _itemsize(dtype) + m * n * out_bytes_per_elem + extra_bytes
    return max(flops / hw.matmul_flops(dtype), nbytes / hw.hbm_bandwidth)


def _matmul_time(hw: Hardware, m, k, n, dtype, out_bytes_per_elem, extra_bytes=0) -> float:
    """Roofline time of one (m, k) @ (k, n) kernel, plus its launch overhead."""
    return _roofline(hw, m, k, n, dtype, out_bytes_per_elem, extra_bytes) + hw.launch_overhead


def _problem(prim, x_shape, w_shape, n, dtype, reduce_dtype, comm_dtype=None):
    """Per-step matmul (m, k, n, out bytes/elem, extra bytes) and the travelling block's
    bytes: with a `comm_dtype`, its values plus a float32 scale per row or column."""
    if prim not in prims.PRIMITIVES:
        raise ValueError(f"cost_model: unknown primitive {prim!r}; valid: "
                         f"{', '.join(prims.PRIMITIVES)}.")
    p = prims.of(prim)
    m, k, cols = p.step_matmul(x_shape, w_shape, n)
    b = _itemsize(dtype)
    acc = _itemsize(_acc_dtype(dtype))
    rb = _itemsize(reduce_dtype)
    if p.gathers:
        # The travelling block, and its float32 scales when it is quantized (one per row
        # of x, one per column of w: its extent across the scale axis).
        shape = x_shape if p.traveller == "x" else w_shape
        tb = b if comm_dtype is None else _itemsize(comm_dtype)
        scales = 0 if comm_dtype is None else shape[1 - p.scale_axis] * 4
        block = shape[0] * shape[1] * tb + scales
        if p.sums_steps:  # ag_contract: each step adds into an f32 (M, n)
            return (m, k, cols, acc, m * cols * acc), block
        return (m, k, cols, b, 0), block  # each step writes a segment of the output
    # reduce-scatters: the accumulator of one output segment travels; each step adds into it
    if comm_dtype is not None:  # a scale per row of the segment
        return (m, k, cols, rb, m * cols * rb), m * cols * _itemsize(comm_dtype) + m * 4
    return (m, k, cols, rb, m * cols * rb), m * cols * rb


def breakdown(prim: str, x_shape, w_shape, ring_size: int, dtype="bfloat16",
              hardware: Union[str, Hardware, None] = None, *,
              bidirectional: bool = False, reduce_dtype=None,
              backends=None, comm_dtype=None, gathered: bool = False) -> dict[str, Breakdown]:
    """The model for one primitive (`_primitives.py`) on canonical 2-D local shapes.

    `backends`: the backend names to estimate (default: those `"auto"` weighs, the
    registry's candidates: "reference", "ring", "pallas"); each is estimated by the cost
    family it declares (`_backends.Backend.cost`); names without one are left out.
    `comm_dtype`: the narrow dtype the travelling block is sent in (its values, plus
    float32 scales), None for the inputs' own. `gathered`: an all-gather also keeps its
    gathered operand (for the backward): the lax ring copies each block into it, the
    kernels write it as they go and the reference's collective makes it.
    """
    hw = get_hardware(hardware)
    x_shape, w_shape = _shape("x_shape", x_shape), _shape("w_shape", w_shape)
    n = _validate.ring_size("cost_model", ring_size, "ring_size")  # 8.5 was read as 8
    if prim in prims.PRIMITIVES:  # an unknown one is refused by `_problem`
        _check_contraction(prim, x_shape, w_shape, n)
    reduce_dtype = np.dtype(_acc_dtype(dtype) if reduce_dtype is None else reduce_dtype)
    (m, k, cols, out_b, extra), block_bytes = _problem(prim, x_shape, w_shape, n, dtype,
                                                       reduce_dtype, comm_dtype)
    # The step's matmul, whole and per direction of a bidirectional ring (at least 1 x 1).
    step = ((m, k, cols),
            tuple(max(v, 1) for v in prims.of(prim).step_matmul(x_shape, w_shape, n, 2)))
    sent = (n - 1) * block_bytes
    families = _families(backends)
    # The whole product the ring makes (the reference's one matmul).
    full = prims.of(prim).full_matmul(x_shape, w_shape, n)
    result = {}
    for name in (name for name, family in families.items() if family == "reference"):
        # One matmul over the whole problem, and one collective before (all-gathers) or
        # after it (reduce-scatters) that uses every link the device has to ring neighbours.
        whole = _matmul_time(hw, *full, dtype, out_b)
        collective = _collective_time(hw, n, sent)
        result[name] = Breakdown(name, whole + collective, whole, collective, 1, sent, sent)
    platform = _platform(hw)
    dirs = 2 if bidirectional and n > 1 else 1
    per_dir = block_bytes // dirs
    transfer = per_dir / hw.send_bandwidth(dirs) if n > 1 else 0.0
    for name, family in families.items():
        if family not in _STEP_LATENCY:
            continue
        latency = getattr(hw, _STEP_LATENCY[family])
        if family == "kernel" and n > 1 and platform == "tpu":
            # One fused kernel (`fusedpar.kernels.tpu`): one launch, each step's whole
            # block (both halves of a bidirectional one) multiplied in place with its DMA
            # beside it -- what the replay reads from a compiled kernel's plan
            # (`fusedpar._compile._hlo_ring_kernel`), whose step reads its share of the
            # whole product's traffic (`_kernel_step`).
            c = _kernel_step(hw, full, n, dtype)
            t = transfer + latency
            result[name] = Breakdown(name, hw.ring_kernel_seconds(n, c, t), c, t, n,
                                     per_dir, sent)
            continue
        gpu = platform == "gpu"
        # A reduce-scatter step's add of the accumulator that arrived: counted in the
        # step's matmul (its bytes read as `extra`), except for the GPU step kernels,
        # whose product the ring loop adds to what arrived in a pass of its own.
        apart = family == "kernel" and gpu and not prims.of(prim).gathers and n > 1
        adds = 3 * extra / hw.hbm_bandwidth if apart else 0.0
        # Each direction runs its own half-size matmul per step: more launches, same flops.
        c = _step_time(hw, prim, step, dtype, out_b, 0 if apart else extra, dirs) + adds
        # The first step has no accumulator to read yet (nothing has arrived).
        first = _step_time(hw, prim, step, dtype, out_b, 0, dirs)
        if n > 1 and not (family == "kernel" and gpu):  # GPU kernels write in place
            c, first = _assembly(hw, prim, step, out_b, c, first)
        if n > 1 and gathered and family == "ring" and prims.of(prim).gathers:
            # `_ring_loop.put`: each step's block copied into the kept operand (read and
            # written, in the inputs' dtype however it travelled).
            own = x_shape if prims.of(prim).traveller == "x" else w_shape
            keep = 2 * own[0] * own[1] * _itemsize(dtype) / hw.hbm_bandwidth
            c, first = c + keep, first + keep
        t = transfer + (latency if n > 1 else 0.0)
        chunk = _folded_chunk(prim, x_shape, w_shape, n, dirs, comm_dtype, platform)
        if family == "ring" and chunk is not None:
            # ring._folded_reduce_scatter: per direction two chunks half a step apart,
            # each step's add in its matmul; two transfers of half the bytes a step, whose
            # latencies pipeline behind each other's chunk matmul (one latency a step, as
            # the replay of the compiled ring shows: docs/measurements.md).
            # Exposed: chunk a's first product and chunk b's last step.
            ce = extra // (2 * dirs)
            c = 2 * dirs * _matmul_time(hw, *chunk, dtype, out_b, ce)
            first = dirs * (_matmul_time(hw, *chunk, dtype, out_b, 0)
                            + _matmul_time(hw, *chunk, dtype, out_b, ce))
            t = transfer + latency
        total = first + (n - 1) * hw.overlapped(c, t)
        result[name] = Breakdown(name, total, c, t, n, per_dir if n > 1 else 0, sent)
    return result


# The per-step latency of each ring family: XLA's (a lax step, its ppermute) or a kernel's.
_STEP_LATENCY = {"ring": "step_latency", "kernel": "kernel_step_latency"}


def _families(backends) -> dict:
    """`{name: cost family}` of the backends to estimate, in the order asked (default:
    `auto`'s candidates); registered names the model has no family for are left out, a
    name the registry does not know (or a str for the list) is refused."""
    backends = backends if backends is None or isinstance(backends, str) else list(backends)
    if isinstance(backends, str):
        raise TypeError(f"cost_model: backends must be a list of backend names, e.g. "
                        f"[{backends!r}], got the str {backends!r}.")
    unknown = [] if backends is None else [b for b in backends if b not in _backends.TABLE]
    if unknown:
        raise ValueError(f"cost_model: unknown backend {unknown[0]!r}; valid: "
                         f"{', '.join(_backends.TABLE)}.")
    chosen = _backends.candidates() if backends is None else [
        _backends.TABLE[name] for name in backends]
    return {b.name: b.cost for b in chosen if b.cost is not None}


def _check_contraction(prim, x_shape, w_shape, n) -> None:
    """Refuse local shapes whose contraction does not match, as `estimate` (through the
    ops' own checks) does: x's last dimension against w's first, a gathered w's
    (ag_contract) counting the ring."""
    k_w = w_shape[0] * (n if prim == prims.AG_CONTRACT else 1)
    if len(x_shape) != 2 or len(w_shape) != 2 or x_shape[1] != k_w:
        raise ValueError(f"cost_model: {prim}: x {x_shape} and w {w_shape} (local 2-D "
                         f"shapes) do not contract: x's columns must equal w's rows"
                         + (f" times the ring ({n})" if prim == prims.AG_CONTRACT else "")
                         + ".")


def _collective_time(hw: Hardware, n: int, sent: int) -> float:
    """One lax collective over a ring of `n` that sends `sent` bytes per device, over
    every link the device has to ring neighbours."""
    if n < 2:
        return 0.0
    return (hw.launch_overhead + (n - 1) * hw.hop_latency
            + sent / max(hw.send_bandwidth(1), 2 * hw.send_bandwidth(2)))


def product_first(call, hardware=None) -> Breakdown:
    """An ag_rows whose w is invariant over the ring, run as `all_gather(x @ w)`
    (`fusedpar._core._product_first`): the local (m, k) @ (k, n) matmul, then one all-gather of
    the (m, n) product, and one of x too where the run returns it (`call.gathered`)."""
    hw = get_hardware(hardware, call.target)
    (m, k), (_, cols) = call.x_shape, call.w_shape
    b = _itemsize(call.dtype)
    local = _matmul_time(hw, m, k, cols, call.dtype, b)
    sent = (call.axis_size - 1) * (m * cols + (m * k if call.gathered else 0)) * b
    collective = _collective_time(hw, call.axis_size, sent)
    return Breakdown("product first", local + collective, local, collective, 1, sent, sent)


def operands_first(call, hardware=None) -> Breakdown:
    """An rs_rows run with its operands moved instead of its partial sums
    (`fusedpar._core._operands_first`): x's (m, k) rows exchanged by an all-to-all and w
    (k, n) sent to every other device, then one (m/N, N*k) @ (N*k, n) matmul. w does not
    wait for x: where it exists before the work around the call (`call.w_ahead`: a
    weight), XLA sends it ahead, behind that work (the replayed FSDP x TP blocks hide it
    whole), and only x's rows are in the way; else both transfers share the device's
    links, one after the other.

    The work w hides behind is counted as one matmul of the call's own FLOPs (what the
    layer before a row-parallel one multiplies in a sequence-parallel pair, and no more
    is known here): the part of w's transfer beyond it waits. w goes to N - 1 devices, so
    its bytes grow with the ring where the partial sums' do not: over 16 v5e chips a
    sequence-parallel MLP's row layer (x (16384, 1024) @ w (1024, 4096)) would send 120
    MiB of w, 5.4 ms of links against 0.9 ms of matmul; counted free, the replayed step
    took 9.7 ms against the fused kernel's 6.9 (docs/measurements.md)."""
    hw = get_hardware(hardware, call.target)
    (m, k), (_, cols) = call.x_shape, call.w_shape
    n, b = call.axis_size, _itemsize(call.dtype)
    rows = _exchange_time(hw, n, m // n * k * b)
    weights = _exchange_time(hw, n, k * cols * b)
    local = _matmul_time(hw, m // n, n * k, cols, call.dtype, b)
    if call.w_ahead:
        weights = max(0.0, weights - local)
    sent = (n - 1) * (m // n * k + k * cols) * b
    return Breakdown("operands first", rows + weights + local, local, rows + weights, 1,
                     sent, sent)


def _exchange_time(hw, n: int, block: int) -> float:
    """Every device of a ring of `n` sending its own `block` bytes to each of the others
    at once (an all-to-all). Through a GPU's switch, the `(n - 1) * block` bytes move as
    a ring collective's do (`_collective_time`). A TPU ring forwards a block to a device
    d places away over min(d, n - d) links, the shorter way round: `sum(min(d, n - d))`
    blocks cross each device's two outgoing links, against a ring collective's `n - 1`
    (2.3x at n = 8, 1.3x at n = 4). Where the devices' coordinates are known the package
    reads the same load off them instead (`_schedule.all_to_all_load`: twice its value on
    a ring that wraps, for n > 2)."""
    if n < 2:
        return 0.0
    hops = (sum(min(d, n - d) for d in range(1, n)) / (n - 1)
            if _platform(hw) == "tpu" else 1.0)
    return _collective_time(hw, n, int((n - 1) * block * hops))


def _kernel_step(hw, full, n, dtype) -> float:
    """One step of a fused TPU ring kernel: an `n`-th of the whole product `full`'s
    flops and HBM traffic (`kernels/_cost.matmul_cost`, the estimate the
    kernel gives XLA). The kernel keeps the operand every step reads (the stationary one)
    and a reduce-scatter's partial sums resident in VMEM where they fit
    (`kernels/tpu/_tile_plan`), so it reads the stationary operand once per ring, not
    once per step as a lax step's matmul does: at 1024 x 4096 x 4096 bfloat16 over 8
    devices, a step's w read alone is 41 us on v5e against 22 us of matmul."""
    return _roofline(hw, *full, dtype, _itemsize(dtype)) / n


def _assembly(hw, prim, step, out_b, c, first):
    """The ring's memory traffic besides its step matmuls, `(c, first)`: a gather along
    rows or columns writes each step's product into its output with a
    dynamic-update-slice (one more read and write of the product); XLA does not have
    the matmul write into the output in place. The output itself is not filled first
    (`ring.gather_out`: every step writes its segment), and an ag_contract sum starts
    from the first product; a reduce-scatter step's add is in the step model already.
    The GPU step kernels write in place (`breakdown` leaves this out for them); the
    fused TPU kernels are modelled whole."""
    if prims.of(prim).sums_steps:
        return c, first
    m, _, cols = step[0]
    update = 2 * m * cols * out_b / hw.hbm_bandwidth
    return c + update, first + update


def _platform(hw) -> str:
    """The platform of the registry entry whose numbers `hw` are ("" for others)."""
    return next((k.platform for k in _registry.kinds() if k.hardware == hw), "")


def _folded_chunk(prim, x_shape, w_shape, n, dirs, comm_dtype, platform):
    """The matmul `(m, k, n)` of one chunk of a reduce-scatter step the lax ring folds its
    adds into (`ring._folded_reduce_scatter`: half a direction's segment), or None where
    it does not (an all-gather, a ring of one, an odd segment, a `comm_dtype`)."""
    p = prims.of(prim)
    if p.gathers or n < 2 or comm_dtype is not None:
        return None
    chunk = list(p.step_matmul(x_shape, w_shape, n, dirs))
    i = "mkn".index(p.ring_dim)  # the segment's rows (rs_rows) or columns (rs_cols)
    if chunk[i] % 2 or not _schedule.folds(chunk[i] // 2, platform):
        return None
    chunk[i] //= 2
    return tuple(chunk)


def _step_time(hw, prim, step, dtype, out_b, extra, dirs):
    """One ring step's compute: one matmul, or one half-size matmul per direction."""
    whole, half = step
    if dirs == 1:
        return _matmul_time(hw, *whole, dtype, out_b, extra)
    # Each direction's piece is half the block; an ag_contract step still adds into the
    # whole (M, n) accumulator per direction.
    half_extra = extra if prims.of(prim).ring_dim == "k" else extra // 2
    return 2 * _matmul_time(hw, *half, dtype, out_b, half_extra)


def estimate_call(call, hardware=None, reduce_dtype=None,
                  backends=None) -> dict[str, Breakdown]:
    """The model for a `_primitives.Call`, with the ring shape the call runs with and its
    `reduce_dtype` (unless `reduce_dtype` is given), for `backends` (as `breakdown`'s)."""
    reduce_dtype = call.reduce_dtype if reduce_dtype is None else reduce_dtype
    return breakdown(call.prim, call.x_shape, call.w_shape, call.axis_size, call.dtype,
                     get_hardware(hardware, call.target),
                     bidirectional=call.runs_bidirectional, reduce_dtype=reduce_dtype,
                     comm_dtype=call.comm_dtype, backends=backends,
                     gathered=bool(call.gathered))


def matmul_seconds(m: int, k: int, n: int, dtype="bfloat16",
                   hardware: Union[str, Hardware, None] = None) -> float:
    """Roofline time of one local (m, k) @ (k, n) matmul with its result in `dtype`."""
    if not all(_validate.is_int(d) and d >= 0 for d in (m, k, n)):
        raise ValueError(f"cost_model.matmul_seconds: m, k and n must be ints >= 0, got "
                         f"{(m, k, n)}.")
    return _matmul_time(get_hardware(hardware), m, k, n, dtype, _itemsize(dtype))


def _call(op, x_shape, w_shape, ring_size, dtype, gather, dim, bidirectional, comm_dtype):
    """Validate an op's local shapes and canonicalise them, as the ops do (no target)."""
    import jax

    x = jax.ShapeDtypeStruct(_shape("x_shape", x_shape), np.dtype(dtype))
    w = jax.ShapeDtypeStruct(_shape("w_shape", w_shape), np.dtype(dtype))
    n = _validate.ring_size("cost_model", ring_size, "ring_size")
    return _validate.op_call(op, x, w, n, gather, dim, bidirectional, comm_dtype,
                             where=f"cost_model: {op}")[1]


def _shape(name: str, shape) -> tuple:
    """`shape` as a tuple of ints, refused unless every size is an integer >= 0 (a
    `jax.ShapeDtypeStruct` takes a negative one without a word)."""
    sizes = tuple(shape) if isinstance(shape, (tuple, list)) else None
    if sizes is None or not all(_validate.is_int(d) and d >= 0 for d in sizes):
        raise ValueError(f"cost_model: {name} must be a tuple of sizes >= 0 (the local "
                         f"shape inside shard_map), got {shape!r}.")
    return tuple(int(d) for d in sizes)


def estimate(op: str, x_shape, w_shape, ring_size: int, dtype="bfloat16",
             hardware: Union[str, Hardware] = "h100_sxm", *, gather="lhs", dim=0,
             bidirectional: Optional[bool] = None, reduce_dtype=None, comm_dtype=None,
             details: bool = False) -> dict:
    """Estimated seconds of one call of `op` per backend: `{"reference": s, "ring": s, ...}`.

    **Arguments:**

    - `op`: `"all_gather_matmul"` or `"matmul_reduce_scatter"`.
    - `x_shape`, `w_shape`: per-device (local) shapes, as passed to the op inside
      `shard_map`; `gather`, `dim`: as for the op.
    - `ring_size`: the size of the mesh axis the op runs over.
    - `dtype`: the inputs' dtype. `reduce_dtype`: the reduce-scatter accumulator's dtype
      (default float32 for 16-bit inputs, as the op's default).
    - `comm_dtype`: the narrow dtype the travelling block is sent in, as for the op
      (`jnp.int8` or `jnp.float8_e4m3fn`: its values plus float32 scales); None sends
      `dtype`.
    - `hardware`: a preset name (`PRESETS`: "h100_sxm", "h200", "b200", "tpu_v4",
      "tpu_v5e", "tpu_v5p", "tpu_v6e", "tpu_v7x", "cpu") or a `Hardware` (e.g. from
      `calibrate`).
    - `bidirectional`: the ring shape (default: what the op would use).
    - `details`: return `Breakdown`s (per-step compute/transfer, bytes) instead of seconds.

    Covers "reference", "ring" and "pallas" (the fused kernels' smaller per-step cost);
    whether a backend can run the call at all is not the model's business.
    """
    hw = get_hardware(hardware)
    call = _call(op, x_shape, w_shape, ring_size, dtype, gather, dim, bidirectional,
                 comm_dtype)
    result = estimate_call(call, hw, reduce_dtype)
    return result if details else {name: b.seconds for name, b in result.items()}


def bytes_sent(op: str, x_shape, w_shape, ring_size: int, dtype="float32", *, gather="lhs",
               dim=0, reduce_dtype=None, comm_dtype=None) -> int:
    """Bytes one device sends in one call of `op` (any backend, either ring direction);
    `comm_dtype` as for `estimate`."""
    result = estimate(op, x_shape, w_shape, ring_size, dtype, "cpu", gather=gather, dim=dim,
                      reduce_dtype=reduce_dtype, comm_dtype=comm_dtype, details=True)
    return next(iter(result.values())).bytes_sent  # every backend sends the same bytes


def describe(result: Mapping[str, Breakdown]) -> str:
    """A one-line summary of a `breakdown` for people: time per backend, and why."""
    if not (isinstance(result, Mapping)
            and all(isinstance(b, Breakdown) for b in result.values())):
        raise TypeError("cost_model.describe: result must be what breakdown (or estimate "
                        "with details=True) returns, {backend: Breakdown}; estimate "
                        "returns seconds unless details=True.")
    parts = []
    for name, b in result.items():
        if name in _backends.TABLE and _backends.TABLE[name].cost == "reference":
            parts.append(f"reference {_fmt(b.seconds)}")
        else:
            parts.append(f"{name} {_fmt(b.seconds)} ({b.steps} steps of "
                         f"{_fmt(b.compute_step)} compute / {_fmt(b.transfer_step)} transfer, "
                         f"{b.bound}-bound)")
    return "estimated " + ", ".join(parts)


def _fmt(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


__all__ = ["Hardware", "PRESETS", "Breakdown", "get_hardware", "set_hardware", "calibrate",
           "estimate", "breakdown", "estimate_call", "bytes_sent", "describe",
           "matmul_seconds", "product_first", "operands_first"]
