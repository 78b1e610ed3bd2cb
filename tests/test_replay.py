"""The replay (`fusedpar.aot.predict`, `fusedpar._compile._simulate`) on XLA's own programs: loops
whose trip count is in their condition, transfers a loop iteration starts and the next
finishes, every replica-group syntax, asynchronous slices and copies, transfers that cross
several ICI links — in hand-written schedules of both dialects (GPU: cuBLAS custom calls,
plain layouts; TPU: convolutions in fusions, tiled layouts, `/*index=N*/` comments) and in
GSPMD programs compiled here. On every program its compute is at least the program's dot
FLOPs at the preset's matmul rate, and its communication at least the bytes its
collectives must move over the device's links."""

import jax
import jax.numpy as jnp
import pytest

from fusedpar._compile import _hlo, _links, _simulate
from fusedpar import cost_model

from helpers import needs_aot

H100 = cost_model.get_hardware("h100_sxm")
V5E = cost_model.get_hardware("v5e")
SQUARE = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]  # a 2x2 slice, no wrap-around

GEMM = ('custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":'
        '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
        '"rhs_contracting_dimensions":["0"]}}}')
GPU_LOOP = "(s32[], f16[2048,2048]{1,0}, f16[2048,1024]{1,0}, (f16[2048,2048]{1,0}, f16[2048,2048]{1,0}), f16[2048,1024]{1,0})"

# A ring XLA pipelined (GPU dialect): each iteration multiplies the block it holds, then
# waits for the block the previous iteration started sending (carried in the loop's
# tuple), starts sending it on and multiplies it. The first transfer starts before the
# loop, the last finishes after it. No known_trip_count: the condition says 3.
GPU_PIPELINED = f"""\
HloModule pipelined, is_scheduled=true, num_partitions=4

%ring_cond (cp: {GPU_LOOP}) -> pred[] {{
  %cp = {GPU_LOOP} parameter(0)
  %i = s32[] get-tuple-element(%cp), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%ring_body (bp: {GPU_LOOP}) -> {GPU_LOOP} {{
  %bp = {GPU_LOOP} parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %x = f16[2048,2048]{{1,0}} get-tuple-element(%bp), index=1
  %w = f16[2048,1024]{{1,0}} get-tuple-element(%bp), index=2
  %inflight = (f16[2048,2048]{{1,0}}, f16[2048,2048]{{1,0}}) get-tuple-element(%bp), index=3
  %gemm-a = (f16[2048,1024]{{1,0}}, s8[0]{{0}}) custom-call(%x, %w), {GEMM}
  %block = f16[2048,2048]{{1,0}} collective-permute-done(%inflight)
  %next = (f16[2048,2048]{{1,0}}, f16[2048,2048]{{1,0}}) collective-permute-start(%block), channel_id=1, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}}}}
  %gemm-b = (f16[2048,1024]{{1,0}}, s8[0]{{0}}) custom-call(%block, %w), {GEMM}
  %y = f16[2048,1024]{{1,0}} get-tuple-element(%gemm-b), index=0
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = {GPU_LOOP} tuple(%i1, %x, %w, %next, %y)
}}

ENTRY %main (x: f16[2048,2048], w: f16[2048,1024]) -> f16[2048,2048] {{
  %x = f16[2048,2048]{{1,0}} parameter(0)
  %w = f16[2048,1024]{{1,0}} parameter(1)
  %zero = s32[] constant(0)
  %acc = f16[2048,1024]{{1,0}} constant({{...}})
  %first = (f16[2048,2048]{{1,0}}, f16[2048,2048]{{1,0}}) collective-permute-start(%x), channel_id=2, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}}}}
  %init = {GPU_LOOP} tuple(%zero, %x, %w, %first, %acc)
  %loop = {GPU_LOOP} while(%init), condition=%ring_cond, body=%ring_body
  %last = (f16[2048,2048]{{1,0}}, f16[2048,2048]{{1,0}}) get-tuple-element(%loop), index=3
  ROOT %done = f16[2048,2048]{{1,0}} collective-permute-done(%last)
}}
"""

B = "{1,0:T(8,128)(2,1)}"
BS = "{1,0:T(8,128)(2,1)S(1)}"
U = "{:T(128)}"


def _fused_conv(cols):
    """The TPU compiler's matmul, a convolution in a fusion: (2048, 2048) @ (2048, cols)."""
    return f"""\
%fused_conv (p0: bf16[2048,2048], p1: bf16[2048,{cols}]) -> bf16[2048,{cols}] {{
  %p0 = bf16[2048,2048]{B} parameter(0)
  %p1 = bf16[2048,{cols}]{B} parameter(1)
  ROOT %c = bf16[2048,{cols}]{B} convolution(%p0, %p1), dim_labels=bf_io->bf
}}"""


TPU_START = f"(bf16[2048,2048]{B}, bf16[2048,2048]{BS}, u32[]{{:S(2)}}, u32[]{{:S(2)}})"
TPU_LOOP = (f"(u32[]{U}, bf16[2048,2048]{B}, bf16[2048,2048]{B}, {TPU_START}, "
            f"bf16[2048,2048]{B}, /*index=5*/u32[]{U})")

# The same ring in the TPU dialect: matmuls as convolutions in fusions, tiled layouts,
# the start's tuple with its sync flags, a counter copied from a constant, index comments.
TPU_PIPELINED = f"""\
HloModule pipelined_tpu, is_scheduled=true, num_partitions=4

{_fused_conv(2048)}

%windowed_cond (cp: {TPU_LOOP}) -> pred[] {{
  %limit = u32[]{U} constant(3)
  %cp = {TPU_LOOP} parameter(0)
  %i = u32[]{U} get-tuple-element(%cp), index=5
  ROOT %lt = pred[]{{:T(512)}} compare(%i, %limit), direction=LT
}}

%windowed_body (bp: {TPU_LOOP}) -> {TPU_LOOP} {{
  %one = u32[]{U} constant(1)
  %bp = {TPU_LOOP} parameter(0)
  %x = bf16[2048,2048]{B} get-tuple-element(%bp), index=1
  %w = bf16[2048,2048]{B} get-tuple-element(%bp), index=2
  %fusion.a = bf16[2048,2048]{B} fusion(%x, %w), kind=kOutput, calls=%fused_conv
  %inflight = {TPU_START} get-tuple-element(%bp), index=3
  %block = bf16[2048,2048]{BS} collective-permute-done(%inflight)
  %next = {TPU_START} collective-permute-start(%block), channel_id=1, source_target_pairs={{{{0,1}},{{1,3}},{{3,2}},{{2,0}}}}
  %fusion.b = bf16[2048,2048]{B} fusion(%block, %w), kind=kOutput, calls=%fused_conv
  %i = u32[]{U} get-tuple-element(%bp), index=5
  %copy.1 = u32[]{{:T(128)S(6)}} copy(%i)
  %i1 = u32[]{U} add(%copy.1, %one)
  %c0 = u32[]{U} get-tuple-element(%bp), index=0
  ROOT %t = {TPU_LOOP} tuple(%c0, %x, %w, %next, %fusion.b, /*index=5*/%i1)
}}

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,2048]) -> bf16[2048,2048] {{
  %zero = u32[]{U} constant(0)
  %x = bf16[2048,2048]{B} parameter(0)
  %w = bf16[2048,2048]{B} parameter(1)
  %counter = u32[]{U} copy(%zero)
  %first = {TPU_START} collective-permute-start(%x), channel_id=2, source_target_pairs={{{{0,1}},{{1,3}},{{3,2}},{{2,0}}}}
  %init = {TPU_LOOP} tuple(%zero, %x, %w, %first, %x, /*index=5*/%counter)
  %loop = {TPU_LOOP} while(%init), condition=%windowed_cond, body=%windowed_body
  %last = {TPU_START} get-tuple-element(%loop), index=3
  ROOT %done = bf16[2048,2048]{BS} collective-permute-done(%last)
}}
"""


@pytest.mark.parametrize("dialect", ("gpu", "tpu"))
def test_a_transfer_straddling_iterations_overlaps_the_next_one(dialect):
    # Each transfer (T) is longer than one matmul (G) but shorter than the two it has in
    # flight (the rest of its iteration and the next's first): only the first (behind
    # one matmul) and the last (after the loop, behind one) wait T - G. Finishing each
    # transfer at the end of the body that started it would wait T - G every iteration.
    if dialect == "gpu":
        text, hw, coords = GPU_PIPELINED, H100, None
        t = H100.hop_latency + 2048 * 2048 * 2 / H100.link_bandwidth
        g = 2 * 2048 * 2048 * 1024 / H100.matmul_flops("float16") + H100.launch_overhead
    else:
        text, hw, coords = TPU_PIPELINED, V5E, SQUARE
        t = V5E.hop_latency + 2048 * 2048 * 2 / V5E.link_bandwidth
        g = 2 * 2048 ** 3 / V5E.matmul_flops("bfloat16") + V5E.launch_overhead
    assert g < t < 2 * g
    p = _simulate.predict(text, hw, coords)
    assert p.seconds == pytest.approx(2 * t + 4 * g, rel=1e-6)
    assert p.exposed == pytest.approx(2 * (t - g), rel=1e-6)
    assert p.communication == pytest.approx(4 * t, rel=1e-6)
    assert p.compute == pytest.approx(6 * g, rel=1e-6)
    runs = {c.name: c.runs for c in p.transfers}
    assert runs == {"first": 1, "next": 3}
    assert p.unread == ()


PAIRS = 'frontend_attributes={_xla_send_recv_source_target_pairs="{{0,1},{1,2},{2,3},{3,0}}"}'

# A collective-permute XLA split into a send and a receive (GPU dialect): the received
# block arrives when the send on the same channel does.
GPU_SEND_RECV = f"""\
HloModule p2p, is_scheduled=true, num_partitions=4

ENTRY %main (x: f16[2048,2048], w: f16[2048,1024]) -> f16[2048,1024] {{
  %x = f16[2048,2048]{{1,0}} parameter(0)
  %w = f16[2048,1024]{{1,0}} parameter(1)
  %token = token[] after-all()
  %recv = (f16[2048,2048]{{1,0}}, u32[], token[]) recv(%token), channel_id=5, {PAIRS}
  %send = (f16[2048,2048]{{1,0}}, u32[], token[]) send(%x, %token), channel_id=5, {PAIRS}
  %gemm = (f16[2048,1024]{{1,0}}, s8[0]{{0}}) custom-call(%x, %w), {GEMM}
  %recv-done = (f16[2048,2048]{{1,0}}, token[]) recv-done(%recv), channel_id=5
  %block = f16[2048,2048]{{1,0}} get-tuple-element(%recv-done), index=0
  %gemm.1 = (f16[2048,1024]{{1,0}}, s8[0]{{0}}) custom-call(%block, %w), {GEMM}
  %send-done = token[] send-done(%send), channel_id=5
  ROOT %y = f16[2048,1024]{{1,0}} get-tuple-element(%gemm.1), index=0
}}
"""


def test_a_send_and_its_receive_are_one_transfer():
    t = H100.hop_latency + 2048 * 2048 * 2 / H100.link_bandwidth
    g = 2 * 2048 * 2048 * 1024 / H100.matmul_flops("float16") + H100.launch_overhead
    p = _simulate.predict(GPU_SEND_RECV, H100)
    assert p.seconds == pytest.approx(t + g, rel=1e-6)  # gemm.1 waits for the block
    assert p.communication == pytest.approx(t, rel=1e-6)
    assert [(c.name, c.runs) for c in p.transfers] == [("send", 1)] and p.unread == ()


def _loop(start, limit, step, direction, mirrored=False, known=None):
    """A loop over a counter (tuple element 0) from `start` by `step`, while
    `counter <direction> limit` (`limit <direction> counter` when mirrored)."""
    compare = "%limit, %i" if mirrored else "%i, %limit"
    update = "subtract(%i, %step)" if step < 0 else "add(%i, %step)"
    config = f', backend_config={{"known_trip_count":{{"n":"{known}"}}}}' if known else ""
    return f"""\
HloModule loop, is_scheduled=true

%cond (cp: (s32[], f32[8])) -> pred[] {{
  %cp = (s32[], f32[8]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%cp), index=0
  %limit = s32[] constant({limit})
  ROOT %c = pred[] compare({compare}), direction={direction}
}}

%body (bp: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %bp = (s32[], f32[8]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %x = f32[8]{{0}} get-tuple-element(%bp), index=1
  %step = s32[] constant({abs(step)})
  %next = s32[] {update}
  ROOT %t = (s32[], f32[8]{{0}}) tuple(%next, %x)
}}

ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {{
  %x = f32[8]{{0}} parameter(0)
  %start = s32[] constant({start})
  %init = (s32[], f32[8]{{0}}) tuple(%start, %x)
  ROOT %loop = (s32[], f32[8]{{0}}) while(%init), body=%body, condition=%cond{config}
}}
"""


@pytest.mark.parametrize("text", (GPU_PIPELINED, TPU_PIPELINED), ids=("gpu", "tpu"))
def test_the_overlap_report_counts_each_trip(text):
    """`aot.overlap` counts a loop body's transfers and bytes as often as it runs (3
    trips, read from the condition), as `predict` does: one block before the loop and
    one an iteration."""
    from fusedpar import aot

    report = aot.overlap(text)
    (ring,) = report.ops
    assert (report.total, ring.transfers, ring.bytes) == (4, 4, 4 * 2048 * 2048 * 2)
    assert [t.runs for t in report.transfers if t.computation != "main"] == [3]


@pytest.mark.parametrize("start,limit,step,direction,mirrored,trips", [
    (0, 4, 1, "LT", False, 4),
    (0, 4, 2, "LT", False, 2),  # a loop XLA widened: two iterations per trip
    (2, 4, 2, "LT", False, 1),  # its first trip peeled off before the loop
    (0, 5, 2, "LT", False, 3),
    (0, 4, 2, "LE", False, 3),
    (7, 0, -1, "GT", False, 7),
    (0, 6, 3, "NE", False, 2),
    (0, 4, 1, "GT", True, 4),  # 4 > counter
])
def test_trip_count_from_the_condition(start, limit, step, direction, mirrored, trips):
    text = _loop(start, limit, step, direction, mirrored)
    module = _hlo.parse(text)
    entry = {i.name: i for i in module.computations[module.entry]}
    # body and condition named in either order (XLA prints condition first)
    assert _hlo.loop_parts(entry["loop"]) == ("cond", "body")
    assert _hlo.trip_count(module, entry["loop"], entry) == trips
    known = _hlo.parse(_loop(start, limit, step, direction, mirrored, known=9))
    loop = {i.name: i for i in known.computations[known.entry]}["loop"]
    assert _hlo.trip_count(known, loop, {}) == 9  # XLA's own count wins


WIDE_LOOP = (f"(bf16[2048,2048]{B}, bf16[2048,1024]{B}, bf16[2048,1024]{B}, u32[]{U}, "
             f"u32[]{U}, /*index=5*/u32[]{U})")

# XLA's "wide" windowed loop (TPU dialect, as in a GSPMD MLP for v5e): two steps per
# iteration, the counter (element 4) starting from a copy of 0 and stepping by 2 while
# below 4; a convolution per step.
TPU_WIDE = f"""\
HloModule wide, is_scheduled=true, num_partitions=8

{_fused_conv(1024)}

%wide.windowed_dot_general_body_rs (wide.param.0: {WIDE_LOOP}) -> {WIDE_LOOP} {{
  %two = u32[]{U} constant(2)
  %wide.param.0 = {WIDE_LOOP} parameter(0)
  %x = bf16[2048,2048]{B} get-tuple-element(%wide.param.0), index=0
  %w = bf16[2048,1024]{B} get-tuple-element(%wide.param.0), index=1
  %step.0 = bf16[2048,1024]{B} fusion(%x, %w), kind=kOutput, calls=%fused_conv
  %step.1 = bf16[2048,1024]{B} fusion(%x, %step.0), kind=kOutput, calls=%fused_conv
  %i = u32[]{U} get-tuple-element(%wide.param.0), index=4
  %i2 = u32[]{U} add(%i, %two)
  %s = u32[]{U} get-tuple-element(%wide.param.0), index=3
  %f = u32[]{U} get-tuple-element(%wide.param.0), index=5
  ROOT %t = {WIDE_LOOP} tuple(%x, %w, %step.1, %s, %i2, /*index=5*/%f)
}}

%wide.windowed_dot_general_cond_rs (wide.param.8: {WIDE_LOOP}) -> pred[] {{
  %four = u32[]{U} constant(4)
  %wide.param.8 = {WIDE_LOOP} parameter(0)
  %i = u32[]{U} get-tuple-element(%wide.param.8), index=4
  ROOT %lt = pred[]{{:T(512)}} compare(%i, %four), direction=LT
}}

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,1024]) -> bf16[2048,1024] {{
  %zero = u32[]{U} constant(0)
  %x = bf16[2048,2048]{B} parameter(0)
  %w = bf16[2048,1024]{B} parameter(1)
  %counter = u32[]{U} copy(%zero)
  %init = {WIDE_LOOP} tuple(%x, %w, %w, %zero, %counter, /*index=5*/%zero)
  %while.2 = {WIDE_LOOP} while(%init), condition=%wide.windowed_dot_general_cond_rs, body=%wide.windowed_dot_general_body_rs
  ROOT %out = bf16[2048,1024]{B} get-tuple-element(%while.2), index=2
}}
"""


def test_a_widened_loop_runs_half_as_many_iterations():
    p = _simulate.predict(TPU_WIDE, V5E)
    flops = 2 * 2048 * 2048 * 1024
    assert p.dot_flops == 2 * 2 * flops  # 2 iterations of 2 steps
    g = flops / V5E.matmul_flops("bfloat16") + V5E.launch_overhead
    assert p.compute == pytest.approx(4 * g, rel=1e-6)
    assert p.unread == ()


def _all_gather(groups: str) -> str:
    return f"""\
HloModule groups, is_scheduled=true, num_partitions=8

ENTRY %main (x: f16[1024,1024]) -> f16[8192,1024] {{
  %x = f16[1024,1024]{{1,0}} parameter(0)
  %ags = (f16[1024,1024]{{1,0}}, f16[8192,1024]{{1,0}}) all-gather-start(%x), channel_id=1, replica_groups={groups}, dimensions={{0}}, use_global_device_ids=true
  ROOT %agd = f16[8192,1024]{{1,0}} all-gather-done(%ags)
}}
"""


@pytest.mark.parametrize("groups,expected", [
    ("{{0,1,2,3},{4,5,6,7}}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("{}", [list(range(8))]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    # GSPMD / Shardy: the devices that differ only along the named mesh axes
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", [list(range(8))]),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['x'=2,'y'=4] {'y'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['x'=2,'y'=2,'z'=2] {'x','z'}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ("mesh['a'=8] {'a':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),  # a sub-axis
    ("mesh['x'=2,'y'=4], device_ids=([[0,2,4,6],[1,3,5,7]]) {'y'}",
     [[0, 2, 4, 6], [1, 3, 5, 7]]),
    # the device list as an iota (an fsdp x tp mesh's tp groups, as GPU programs print it)
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_every_replica_group_syntax(groups, expected):
    module = _hlo.parse(_all_gather(groups))
    start = {i.name: i for i in module.computations[module.entry]}["ags"]
    assert _hlo.replica_groups(start, module.devices) == expected
    # The transfer costs a ring over the group's devices (mesh-form groups cost nothing
    # before: a group of one).
    n = len(expected[0])
    p = _simulate.predict(_all_gather(groups), H100)
    ring = (n - 1) * 1024 * 1024 * 2 / H100.egress_bandwidth
    assert p.communication == pytest.approx(
        H100.launch_overhead + (n - 1) * H100.hop_latency + ring, rel=1e-6)
    assert p.min_comm_s == pytest.approx(ring, rel=1e-6)


# The TPU's asynchronous slice and copy (DMAs between HBM and on-chip memory): a window of
# w sliced while a convolution runs, and a copy its consumer waits for at once.
TPU_ASYNC_SLICE = f"""\
HloModule slices, is_scheduled=true

{_fused_conv(2048)}

ENTRY %main (x: bf16[2048,2048], w: bf16[8192,2048]) -> bf16[2048,2048] {{
  %x = bf16[2048,2048]{B} parameter(0)
  %w = bf16[8192,2048]{B} parameter(1)
  %slice-start = ((bf16[8192,2048]{B}), bf16[2048,2048]{BS}, s32[]{{:S(2)}}) slice-start(%w), slice={{[2048:4096], [0:2048]}}
  %fusion.1 = bf16[2048,2048]{B} fusion(%x, %x), kind=kOutput, calls=%fused_conv
  %slice-done = bf16[2048,2048]{BS} slice-done(%slice-start)
  %copy-start = (bf16[2048,2048]{BS}, bf16[2048,2048]{B}, u32[]{{:S(2)}}) copy-start(%fusion.1)
  %copy-done = bf16[2048,2048]{BS} copy-done(%copy-start)
  ROOT %fusion.2 = bf16[2048,2048]{B} fusion(%copy-done, %slice-done), kind=kOutput, calls=%fused_conv
}}
"""


def test_async_slices_and_copies_run_beside_the_compute_stream():
    p = _simulate.predict(TPU_ASYNC_SLICE, V5E)
    window = 2048 * 2048 * 2 / V5E.hbm_bandwidth  # the slice's and the copy's bytes
    g = 2 * 2048 ** 3 / V5E.matmul_flops("bfloat16") + V5E.launch_overhead
    assert g > window
    assert p.copies == pytest.approx(window, rel=1e-6)  # the slice hid behind fusion.1
    assert p.seconds == pytest.approx(2 * g + window, rel=1e-6)
    assert p.compute == pytest.approx(2 * g, rel=1e-6) and p.unread == ()


def _offloaded_gather(offloaded: bool) -> str:
    """An FSDP weight gather over 2 devices beside a matmul: offloaded to the SparseCores
    (the TPU compiler's `call-start` / `call-done` of a computation on the "sparsecore"
    execution thread, after its handshake custom calls), or XLA's synchronous all-gather."""
    gather = ("all-gather(%w), channel_id=1, replica_groups={{0,1}}, dimensions={0}, "
              "use_global_device_ids=true")
    if offloaded:
        head = f"""\
%called_computation (param_0: bf16[1024,2048], param_1: token[]) -> bf16[2048,2048] {{
  %param_1 = token[] parameter(1)
  %param_0 = bf16[1024,2048]{B} parameter(0)
  ROOT %all-gather.1 = bf16[2048,2048]{B} {gather.replace("%w", "%param_0")}
}}, execution_thread="sparsecore"
"""
        body = f"""\
  %prepare_start = s32[]{{:S(2)}} custom-call(), custom_call_target="PrepareAsyncCallStart"
  %prepare_done = token[] custom-call(%prepare_start), custom_call_target="PrepareAsyncCallDone"
  %call-start = ((bf16[1024,2048]{B}, token[]), bf16[2048,2048]{B}) call-start(%w, %prepare_done), async_execution_thread="sparsecore", to_apply=%called_computation
  %fusion.1 = bf16[2048,2048]{B} fusion(%x, %x), kind=kOutput, calls=%fused_conv
  %gathered = bf16[2048,2048]{B} call-done(%call-start)
"""
    else:
        head = ""
        body = f"""\
  %fusion.1 = bf16[2048,2048]{B} fusion(%x, %x), kind=kOutput, calls=%fused_conv
  %gathered = bf16[2048,2048]{B} {gather}
"""
    return f"""\
HloModule offload, is_scheduled=true, num_partitions=2

{_fused_conv(2048)}

{head}
ENTRY %main (x: bf16[2048,2048], w: bf16[1024,2048]) -> bf16[2048,2048] {{
  %x = bf16[2048,2048]{B} parameter(0)
  %w = bf16[1024,2048]{B} parameter(1)
{body}  ROOT %fusion.2 = bf16[2048,2048]{B} fusion(%fusion.1, %gathered), kind=kOutput, calls=%fused_conv
}}
"""


def test_a_collective_offloaded_to_the_sparsecores_runs_beside_the_compute_stream():
    """The computation a SparseCore collective calls ends with its execution thread
    (`}, execution_thread="sparsecore"`): the module after it is still read, the
    handshake costs nothing, and the gather hides behind the matmul before its done."""
    sync = _simulate.predict(_offloaded_gather(False), V5E)
    p = _simulate.predict(_offloaded_gather(True), V5E)
    g = 2 * 2048 ** 3 / V5E.matmul_flops("bfloat16") + V5E.launch_overhead
    assert p.unread == () and sync.unread == ()
    assert [t.kind for t in p.transfers] == ["all-gather"]
    assert p.communication == pytest.approx(sync.communication, rel=1e-9)
    assert 0 < p.communication < g
    assert p.seconds == pytest.approx(2 * g, rel=1e-6)
    assert sync.seconds == pytest.approx(2 * g + sync.communication, rel=1e-6)


def test_where_the_time_goes():
    """`Prediction.kernels` is the compute stream by kind of instruction (its sum the
    compute), `TransferCost.waited` what the stream waited for each transfer: all of a
    synchronous gather's time in flight, none of one hidden behind a matmul."""
    g = 2 * 2048 ** 3 / V5E.matmul_flops("bfloat16") + V5E.launch_overhead
    for hidden in (False, True):
        p = _simulate.predict(_offloaded_gather(hidden), V5E)
        matmul = next(k for k in p.kernels if k.kind == "matmul")
        assert (matmul.count, matmul.seconds) == (2, pytest.approx(2 * g, rel=1e-9))
        assert sum(k.seconds for k in p.kernels) == pytest.approx(p.compute, rel=1e-9)
        (gather,) = p.transfers
        assert gather.waited == (0.0 if hidden else pytest.approx(gather.seconds, rel=1e-9))
        assert gather.waited == pytest.approx(p.exposed, rel=1e-9, abs=1e-12)


LINE = [(0, 0, 0), (1, 0, 0), (2, 0, 0)]  # three chips in a row, no wrap-around


def _permutes(pairs_a, pairs_b):
    return f"""\
HloModule hops, is_scheduled=true, num_partitions=3

ENTRY %main (x: bf16[1024,1024]) -> (bf16[1024,1024], bf16[1024,1024]) {{
  %x = bf16[1024,1024]{B} parameter(0)
  %a = (bf16[1024,1024]{B}, bf16[1024,1024]{B}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(%x), channel_id=1, source_target_pairs={pairs_a}
  %b = (bf16[1024,1024]{B}, bf16[1024,1024]{B}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(%x), channel_id=2, source_target_pairs={pairs_b}
  %a.done = bf16[1024,1024]{B} collective-permute-done(%a)
  %b.done = bf16[1024,1024]{B} collective-permute-done(%b)
  ROOT %t = (bf16[1024,1024]{B}, bf16[1024,1024]{B}) tuple(%a.done, %b.done)
}}
"""


def test_a_transfer_over_several_links_is_cut_through_and_shares_links():
    message = 1024 * 1024 * 2 / V5E.link_bandwidth
    # 0 -> 2 crosses two links: a hop's latency each, its bytes once (not twice); 2 -> 1
    # runs the other way, on links of its own.
    p = _simulate.predict(_permutes("{{0,2}}", "{{2,1}}"), V5E, LINE)
    assert p.seconds == pytest.approx(2 * V5E.hop_latency + message, rel=1e-6)
    a, b = p.transfers
    assert (a.shared, b.shared) == (1, 1)
    assert a.links == ("device 0 (0, 0, 0) -> device 2 (2, 0, 0): 2 links (axis 0 0 -> 1 -> 2)"
                       "; the slice has no wrap-around links")
    # 1 -> 2 crosses the link 1 -> 2 that 0 -> 2 takes too: they share it.
    p = _simulate.predict(_permutes("{{0,2}}", "{{1,2}}"), V5E, LINE)
    assert p.seconds == pytest.approx(2 * V5E.hop_latency + 2 * message, rel=1e-6)
    assert [t.shared for t in p.transfers] == [1, 2]
    # Which slices are tori: v5e's 16x16 pod, not its 2x4 slice; v5p's 4x4x4 cube, not 2x2x2.
    grid = lambda *e: [(x, y, z) for x in range(e[0]) for y in range(e[1])  # noqa: E731
                       for z in range(e[2])]
    assert _links.wraps_of(grid(16, 16, 1), V5E) == (16, 16, 0)
    assert _links.wraps_of(grid(2, 4, 1), V5E) == (0, 0, 0)
    v5p = cost_model.get_hardware("v5p")
    assert _links.wraps_of(grid(4, 4, 4), v5p) == (4, 4, 4)
    assert _links.wraps_of(grid(2, 2, 2), v5p) == (0, 0, 0)
    # On a ring of 4 that wraps, 0 -> 3 is one link: the wrap-around one.
    ring = _links.Torus([(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)], (4, 0, 0))
    (hop,) = ring.route(0, 3)
    assert hop.wrap and "through the wrap-around link" in ring.describe(0, 3)
    assert len(ring.route(0, 2)) == 2


ALL_TO_ALL = """\
HloModule a2a, is_scheduled=true, num_partitions=4

ENTRY %main (x: bf16[4,256,1024]) -> bf16[4,256,1024] {
  %x = bf16[4,256,1024]{2,1,0} parameter(0)
  ROOT %a = bf16[4,256,1024]{2,1,0} all-to-all(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
}
"""


def test_an_all_to_all_is_routed_message_by_message():
    """Four chips in a row: each sends every other one a quarter of its operand, routed
    like a permute's messages. The link 1 -> 2 carries four of them (0 and 1 to 2 and 3),
    which set the time: 2.7x what the same bytes take as a ring collective's."""
    p = _simulate.predict(ALL_TO_ALL, V5E, [(i, 0, 0) for i in range(4)])
    block = 256 * 1024 * 2
    assert p.seconds == pytest.approx(3 * V5E.hop_latency + 4 * block / V5E.link_bandwidth,
                                      rel=1e-6)
    (t,) = p.transfers
    assert t.shared == 4 and t.links.startswith(
        "an all-to-all over 4 devices; device 0 (0, 0, 0) -> device 3 (3, 0, 0): 3 links")
    assert p.min_comm_s <= p.communication


UNREAD = """\
HloModule unread, is_scheduled=true

%c (cp: (s32[], s32[])) -> pred[] {
  %cp = (s32[], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%cp), index=0
  %n = s32[] get-tuple-element(%cp), index=1
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%b (bp: (s32[], s32[])) -> (s32[], s32[]) {
  %bp = (s32[], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %n = s32[] get-tuple-element(%bp), index=1
  %k = f32[1024]{0} custom-call(), custom_call_target="SomeVendorKernel"
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %t = (s32[], s32[]) tuple(%i1, %n)
}

ENTRY %main (n: s32[]) -> (s32[], s32[]) {
  %n = s32[] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], s32[]) tuple(%zero, %n)
  ROOT %loop = (s32[], s32[]) while(%init), condition=%c, body=%b
}
"""


def test_what_it_cannot_read_is_listed():
    p = _simulate.predict(UNREAD, H100)
    assert p.unread == (
        "while loop: trip count not read: assumed one iteration",
        "custom-call k (SomeVendorKernel): assumed a kernel costing its bytes over HBM "
        "bandwidth")


# `lax.cond` on GPU: a predicated conditional names its branches `true_computation=` and
# `false_computation=` (TPU programs, and `lax.switch`, use `branch_computations=`).
GPU_COND = f"""\
HloModule cond, is_scheduled=true, num_partitions=4

%skip (sp: f16[2048,2048]) -> f16[2048,2048] {{
  ROOT %sp = f16[2048,2048]{{1,0}} parameter(0)
}}

%work (wp: f16[2048,2048]) -> f16[2048,2048] {{
  %wp = f16[2048,2048]{{1,0}} parameter(0)
  %gemm = (f16[2048,2048]{{1,0}}, s8[0]{{0}}) custom-call(%wp, %wp), {GEMM}
  %y = f16[2048,2048]{{1,0}} get-tuple-element(%gemm), index=0
  ROOT %sum = f16[2048,2048]{{1,0}} all-reduce(%y), channel_id=1, replica_groups={{{{0,1,2,3}}}}, use_global_device_ids=true, to_apply=%skip
}}

ENTRY %main (p: pred[], x: f16[2048,2048]) -> f16[2048,2048] {{
  %p = pred[] parameter(0)
  %x = f16[2048,2048]{{1,0}} parameter(1)
  ROOT %c = f16[2048,2048]{{1,0}} conditional(%p, %x, %x), true_computation=%work, false_computation=%skip
}}
"""


def test_a_conditional_runs_its_costliest_branch():
    """The replay cannot know the predicate: it runs the branch with the most work (here
    `lax.cond`'s true branch, a GEMM and an all-reduce) and says so; the bounds count
    the same branch."""
    p = _simulate.predict(GPU_COND, H100)
    gemm = 2 * 2048 ** 3 / H100.matmul_flops("float16")
    assert p.compute >= gemm and p.communication > 0
    assert p.unread == ("conditional c: which branch runs: assumed work, the costliest of "
                        "its 2 branches",)
    assert p.dot_flops == 2 * 2048 ** 3 and p.compute >= p.min_compute_s > 0


# A convolution's training step on GPU: cuDNN calls for the forward and both gradients,
# each written with the forward's window and dim_labels.
_CONV = ('window={{size=3x3 pad=1_1x1_1}}, dim_labels=b01f_o01i->b01f, '
         'custom_call_target="__cudnn$conv{}"')
GPU_CUDNN = f"""\
HloModule convs, is_scheduled=true, num_partitions=1

ENTRY %main (x: bf16[8,16,16,32], w: bf16[64,3,3,32], dy: bf16[8,16,16,64]) -> bf16[8,16,16,32] {{
  %x = bf16[8,16,16,32]{{3,2,1,0}} parameter(0)
  %w = bf16[64,3,3,32]{{3,2,1,0}} parameter(1)
  %dy = bf16[8,16,16,64]{{3,2,1,0}} parameter(2)
  %fwd = (bf16[8,16,16,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%x, %w), {_CONV.format("Forward")}
  %dw = (bf16[64,3,3,32]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%x, %dy), {_CONV.format("BackwardFilter")}
  %dx = (bf16[8,16,16,32]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%dy, %w), {_CONV.format("BackwardInput")}
  ROOT %out = bf16[8,16,16,32]{{3,2,1,0}} get-tuple-element(%dx), index=0
}}
"""


def test_cudnn_convolutions_are_matmuls():
    """Each cuDNN call (forward, filter and input gradients) counts the forward
    convolution's flops (the taps on the padding left out), at the matmul rate."""
    p = _simulate.predict(GPU_CUDNN, H100)
    one = 2 * 8 * 16 * 16 * 64 * 32 * (46 / 16) ** 2  # 3x3 taps, 46 of 48 per row on input
    assert p.dot_flops == pytest.approx(3 * one)
    assert p.compute >= p.min_compute_s == pytest.approx(3 * one / H100.matmul_flops("bfloat16"))
    assert not p.unread


def _one_dot(dtype, precision=""):
    """One (4096, 4096) @ (4096, 4096) dot of `dtype`, at `precision` if given."""
    both = precision if "," in precision else f"{precision},{precision}"
    at = f", operand_precision={{{both}}}" if precision else ""
    out = "s32" if dtype == "s8" else "f32"
    return f"""\
HloModule one, is_scheduled=true, num_partitions=1

ENTRY %main (a: {dtype}[4096,4096], b: {dtype}[4096,4096]) -> {out}[4096,4096] {{
  %a = {dtype}[4096,4096]{{1,0}} parameter(0)
  %b = {dtype}[4096,4096]{{1,0}} parameter(1)
  ROOT %d = {out}[4096,4096]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}{at}
}}
"""


@pytest.mark.parametrize("dtype,precision,hw,rate,unread", [
    ("s8", "", H100, 1979e12, ()),
    ("f8e4m3", "", H100, 989e12, ("float8_e4m3 matmuls: no float8_e4m3 rate in the preset: "
                                  "assumed bfloat16's",)),
    ("f8e4m3fn", "", H100, 1979e12, ()),
    ("f32", "", H100, 495e12, ()),  # TF32, JAX's default on GPU
    ("f32", "highest", H100, 67e12, ()),  # no tensor cores
    ("f32", "default,highest", H100, 67e12, ()),  # the higher of the two
    ("s8", "", V5E, 394e12, ()),
    ("f32", "high", V5E, 197e12 / 3, ()),  # three bf16 passes
    ("f32", "highest", V5E, 197e12 / 6, ()),  # six
    ("f8e4m3fn", "", V5E, 197e12, ("float8_e4m3fn matmuls: no float8_e4m3fn rate in the "
                                   "preset: assumed bfloat16's",)),
], ids=["h100-int8", "h100-fp8-e4m3", "h100-fp8", "h100-f32", "h100-f32-highest",
        "h100-f32-mixed", "v5e-int8",
        "v5e-f32-high", "v5e-f32-highest", "v5e-fp8"])
def test_a_matmul_runs_at_its_dtype_and_precision_rate(dtype, precision, hw, rate, unread):
    """The preset's rate for the dot's operand dtype and precision (datasheets: H100
    1979 TOP/s int8 and fp8, 495 TF32, 67 fp32; v5e 394 TOP/s int8, float32 as one,
    three or six bf16 passes); a dtype the preset has no rate for is listed."""
    p = _simulate.predict(_one_dot(dtype, precision), hw)
    assert p.min_compute_s == pytest.approx(2 * 4096 ** 3 / (rate * hw.efficiency))
    assert p.compute >= p.min_compute_s and p.unread == unread


# Activations offloaded to host memory (`S(5)`, a remat policy's `offload_dst=
# "pinned_host"`): an update written to the host buffer, and a slice read back of it.
HOST = "{2,1,0:S(5)}"
OFFLOAD = f"""\
HloModule offload, is_scheduled=true, num_partitions=1

ENTRY %main (buf: bf16[4,1024,1024], x: bf16[1,1024,1024]) -> bf16[1,1024,1024] {{
  %buf = bf16[4,1024,1024]{HOST} parameter(0)
  %x = bf16[1,1024,1024]{{2,1,0}} parameter(1)
  %i = s32[] constant(1)
  %put = ((bf16[4,1024,1024]{HOST}, bf16[1,1024,1024]{{2,1,0}}, s32[], s32[], s32[]), bf16[4,1024,1024]{HOST}, u32[]) dynamic-update-slice-start(%buf, %x, %i, %i, %i)
  %saved = bf16[4,1024,1024]{HOST} dynamic-update-slice-done(%put)
  %get = ((bf16[4,1024,1024]{HOST}, s32[], s32[], s32[]), bf16[1,1024,1024]{{2,1,0}}, u32[]) dynamic-slice-start(%saved, %i, %i, %i), dynamic_slice_sizes={{1,1024,1024}}
  ROOT %back = bf16[1,1024,1024]{{2,1,0}} dynamic-slice-done(%get)
}}
"""


# Whole arrays: a `copy-start`'s tuple is (destination, source, context). One goes out
# while the other comes back: each direction of the link its own.
COPIES = f"""\
HloModule copies, is_scheduled=true, num_partitions=1

ENTRY %main (x: bf16[1024,1024], h: bf16[1024,1024]) -> (bf16[1024,1024], bf16[1024,1024]) {{
  %x = bf16[1024,1024]{{1,0}} parameter(0)
  %h = bf16[1024,1024]{{1,0:S(5)}} parameter(1)
  %out = (bf16[1024,1024]{{1,0:S(5)}}, bf16[1024,1024]{{1,0}}, u32[]) copy-start(%x)
  %in = (bf16[1024,1024]{{1,0}}, bf16[1024,1024]{{1,0:S(5)}}, u32[]) copy-start(%h)
  %saved = bf16[1024,1024]{{1,0:S(5)}} copy-done(%out)
  %back = bf16[1024,1024]{{1,0}} copy-done(%in)
  ROOT %t = (bf16[1024,1024]{{1,0:S(5)}}, bf16[1024,1024]{{1,0}}) tuple(%saved, %back)
}}
"""


@pytest.mark.parametrize("text,waits", [(OFFLOAD, 2), (COPIES, 1)], ids=["slices", "copies"])
@pytest.mark.parametrize("hw,rate,unread", [(H100, 64e9, 0), (V5E, 32e9, 2)],
                         ids=["h100", "v5e"])
def test_an_offload_to_host_memory_runs_over_the_host_link(text, waits, hw, rate, unread):
    """Each transfer moves its 2 MiB block (not the host buffer) at the host link's rate
    (H100: PCIe Gen5 x16, 64 GB/s each way), one after the other, or both directions at
    once; a TPU has no published figure: 32 GB/s (PCIe 4.0 x16) is assumed and listed,
    once a direction."""
    p = _simulate.predict(text, hw)
    assert p.copies == pytest.approx(waits * 2 ** 21 / rate) and p.compute == 0
    assert len(p.unread) == unread and all("PCIe 4.0 x16" in u for u in p.unread)


def test_braces_inside_a_quoted_attribute_are_not_the_instructions():
    """A Mosaic GPU call carries its kernel as MLIR bytecode in a quoted string, whose
    printable bytes come out as they are, `{` and `}` among them, unbalanced as often as
    not (an escaped quote is `\\22`; a TPU call's metadata escapes them `\\"`). Read as the
    instruction's own braces they joined every later line onto it: the instructions
    after it were lost, and the replay of an 8-H100 MLP came out at half its time."""
    kernel = ('  %k = f32[8]{0} custom-call(%p), custom_call_target="mosaic_gpu_v2", '
              'backend_config={kernel_hash = "\\02{\\E2", module = "ML\\EFR{{}\\22{[", '
              'meta = "{\\"x\\": 1"}\n')
    text = ("HloModule m, is_scheduled=true\n\n"
            "ENTRY %main (p: f32[8]) -> f32[8] {\n"
            "  %p = f32[8]{0} parameter(0)\n" + kernel +
            "  %n = f32[8]{0} negate(%k)\n"
            "  ROOT %r = f32[8]{0} add(%n, %k)\n"
            "}\n")
    module = _hlo.parse(text)
    assert [i.name for i in module.computations[module.entry]] == ["p", "k", "n", "r"]
    assert module.roots[module.entry].name == "r"


def _kernel_call(scope, rows=1024, k=4096, cols=4096, n=8):
    """A fused TPU ring kernel's call `%kernel` as the compiler prints it (operands `%x`,
    `%w`): an all-gather of x's row blocks and a matmul with w in one `tpu_custom_call`, its cost estimate the kernel's
    own (`kernels/_cost.matmul_cost`: the whole product's flops and bytes, the blocks its
    DMAs send), its `kernel_metadata` over three lines."""
    from fusedpar.kernels._cost import matmul_cost

    cost = matmul_cost([(n * rows, cols, k)], jnp.bfloat16, jnp.bfloat16,
                       remote_bytes=(n - 1) * rows * k * 2)
    estimate = ('"flops":"%d","transcendentals":"0","bytes_accessed":"%d",'
                '"remote_bytes_transferred":"%d"' % (
                    cost.flops, cost.bytes_accessed, cost.remote_bytes_transferred))
    out = f"bf16[{n * rows},{cols}]"
    return (
        f"  %kernel = ({out}{B}, bf16[2,{rows},{k}]{B}) custom-call(%x, %w), "
        'custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={\n'
        '"mesh_axes":"[\\"x\\"]"\n'
        f'}}}}, metadata={{op_name="jit(f)/shard_map/{scope}/all_gather_matmul_rows/'
        'pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{'
        + estimate + "}}}\n")


def _ring_kernel(scope, rows=1024, k=4096, cols=4096, n=8):
    """A module of one fused ring kernel (`_kernel_call`)."""
    x, w, out = f"bf16[{rows},{k}]", f"bf16[{k},{cols}]", f"bf16[{n * rows},{cols}]"
    return (
        f"HloModule kernel, is_scheduled=true, num_partitions={n}\n\n"
        f"ENTRY %main (x: {x}, w: {w}) -> {out} {{\n"
        f"  %x = {x}{B} parameter(0)\n"
        f"  %w = {w}{B} parameter(1)\n"
        + _kernel_call(scope, rows, k, cols, n) +
        f"  ROOT %out = {out}{B} get-tuple-element(%kernel), index=0\n"
        "}\n")


@pytest.mark.parametrize("directions", (1, 2))
def test_a_fused_ring_kernel_is_replayed_from_its_plan(directions):
    """The kernel's ring (8, from its operand and result rows), directions (its name
    scope), step matmuls and DMAs (its cost estimate): one step with nothing in flight,
    then 7 steps of matmul beside DMA, as the analytic model times the fused kernels."""
    way = "bidirectional" if directions == 2 else "unidirectional"
    p = _simulate.predict(_ring_kernel(f"fusedpar.ag_rows.pallas_tpu.{way}"), V5E)
    n, rows, k, cols = 8, 1024, 4096, 4096
    step = max(2 * rows * k * cols / V5E.matmul_flops("bfloat16"),
               ((rows * k + k * cols / n + rows * cols) * 2) / V5E.hbm_bandwidth)
    dma = rows * k * 2 / directions / V5E.send_bandwidth(directions) + V5E.kernel_step_latency
    want = V5E.launch_overhead + step + (n - 1) * max(step, dma)
    assert p.seconds == pytest.approx(want, rel=1e-6)
    assert p.communication == pytest.approx((n - 1) * dma, rel=1e-6)
    assert p.exposed == pytest.approx(max(0.0, dma - step) * (n - 1), rel=1e-6)
    kernel, = p.transfers
    assert (kernel.kind, kernel.runs, kernel.bytes) == (
        "ring kernel", (n - 1) * directions, rows * k * 2 // directions)
    assert p.unread == () and p.min_comm_s > 0
    model = cost_model.breakdown("ag_rows", (rows, k), (k, cols), n, "bfloat16", V5E,
                                 bidirectional=directions == 2, backends=("pallas",))
    assert p.seconds == pytest.approx(model["pallas"].seconds, rel=1e-6)


STATE = (f"bf16[2048,1024]{BS}", f"bf16[2048,2048]{BS}", "u32[]{:S(2)}", "u32[]{:S(2)}")
# A gather's state as a tuple, as parameters, and as those parameters' instructions.
STATE_TUPLE = ", ".join(STATE)
STATE_PARAMS = ", ".join(f"s{j}: {t.split('{')[0]}" for j, t in enumerate(STATE))
STATE_PASSED = "\n".join(f"  %s{j} = {t} parameter({j})" for j, t in enumerate(STATE))
GATHER_2 = ("channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={1}, "
            "use_global_device_ids=true")  # over 2 devices, along the columns
# The gather's start (its first step) and done, as the TPU compiler's fusions call them.
GATHER_START_DONE = f"""\
%start_comp (p: bf16[2048,1024]) -> ({STATE_TUPLE}) {{
  %p = bf16[2048,1024]{B} parameter(0)
  %all-gather.1 = bf16[2048,2048]{B} all-gather(%p), {GATHER_2}
  ROOT %cc = ({STATE_TUPLE}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}}

%done_comp ({STATE_PARAMS}) -> bf16[2048,2048] {{
{STATE_PASSED}
  ROOT %cd = bf16[2048,2048]{B} custom-call(%s0, %s1, %s2, %s3), custom_call_target="AsyncCollectiveDone"
}}"""


def _collective_beside(kernel: bool) -> str:
    """A TPU asynchronous collective fusion (an FSDP weight gather over 2 devices) whose
    state (buffers, semaphores) goes from its start through a continuation fusion, which
    runs a step of the gather beside its own work and passes the state on in its result
    tuple, to its done; then a matmul that needs the gathered weight. The continuation's
    work is a fused ring kernel (`kernel`: as the compiler places a Mosaic call with
    `xla_tpu_enable_async_collective_fusion_with_mosaic_custom_call`) or a small
    elementwise one (as with `..._fuse_kloop_fusions`)."""
    state, params, passed = STATE_TUPLE, STATE_PARAMS, STATE_PASSED
    if kernel:
        work = _kernel_call("fusedpar.ag_rows.pallas_tpu.bidirectional")
        work += f"  %o = bf16[8192,4096]{B} get-tuple-element(%kernel), index=0\n"
        out, extra = f"bf16[8192,4096]{B}", "x: bf16[1024,4096], w: bf16[4096,4096]"
        inputs = (f"  %x = bf16[1024,4096]{B} parameter(4)\n"
                  f"  %w = bf16[4096,4096]{B} parameter(5)\n")
    else:
        work = f"  %o = bf16[1024,128]{B} negate(%x)\n"
        out, extra = f"bf16[1024,128]{B}", "x: bf16[1024,128]"
        inputs = f"  %x = bf16[1024,128]{B} parameter(4)\n"
    args = "%x, %w" if kernel else "%x"
    shapes = "x: bf16[1024,4096], w: bf16[4096,4096]" if kernel else "x: bf16[1024,128]"
    entry_inputs = inputs.replace("parameter(4)", "parameter(1)").replace(
        "parameter(5)", "parameter(2)")
    gtes = "\n".join(f"  %g{j} = {t} get-tuple-element(%async-collective-start), index={j}"
                      for j, t in enumerate(STATE))
    carried = "\n".join(f"  %c{j} = {t} get-tuple-element(%cont), index={j + 1}"
                         for j, t in enumerate(STATE))
    return f"""\
HloModule beside, is_scheduled=true, num_partitions=8

{_fused_conv(2048)}

{GATHER_START_DONE}

%async_collective_fusion.7 ({params}, {extra}) -> ({out}, {state}) {{
{passed}
{inputs}{work}  %step = bf16[2048,2048]{BS} all-gather(%s0), {GATHER_2}
  ROOT %t = ({out}, {state}) tuple(%o, %s0, %step, %s2, %s3)
}}

ENTRY %main (g: bf16[2048,1024], {shapes}) -> bf16[2048,2048] {{
  %g = bf16[2048,1024]{B} parameter(0)
{entry_inputs}  %async-collective-start = ({state}) fusion(%g), kind=kCustom, calls=%start_comp
{gtes}
  %cont = ({out}, {state}) fusion(%g0, %g1, %g2, %g3, {args}), kind=kCustom, calls=%async_collective_fusion.7
{carried}
  %async-collective-done = bf16[2048,2048]{B} fusion(%c0, %c1, %c2, %c3), kind=kCustom, calls=%done_comp
  ROOT %after = bf16[2048,2048]{B} fusion(%async-collective-done, %async-collective-done), kind=kOutput, calls=%fused_conv
}}
"""


@pytest.mark.parametrize("kernel", (True, False))
def test_a_collective_fusion_ends_at_its_done_through_its_continuations(kernel):
    """The done finishes the gather its start began, found through the continuation
    that carries its state; the continuation is its own work (not a synchronous gather,
    though it holds the gather's step), and one that runs a fused ring kernel is
    replayed from the kernel's plan, with the gather in flight beside it."""
    text = _collective_beside(kernel)
    module = _hlo.parse(text)
    by_name = {i.name: i for i in module.computations[module.entry]}
    assert _hlo.started_by(by_name["async-collective-done"], by_name, module) == \
        "async-collective-start"
    p = _simulate.predict(text, V5E)
    gather = next(t for t in p.transfers if t.kind == "all-gather")
    conv = 2 * 2048 ** 3 / V5E.matmul_flops("bfloat16") + V5E.launch_overhead
    assert gather.runs == 1 and gather.seconds > 0 and p.unread == ()
    assert [t.kind for t in p.transfers].count("all-gather") == 1
    if kernel:
        alone = _simulate.predict(_ring_kernel("fusedpar.ag_rows.pallas_tpu.bidirectional"),
                                  V5E)
        assert gather.seconds < alone.seconds  # hidden behind the kernel
        assert p.seconds == pytest.approx(alone.seconds + conv, rel=1e-6)
        assert p.exposed == pytest.approx(alone.exposed, rel=1e-6)
        assert {t.kind for t in p.transfers} == {"all-gather", "ring kernel"}
        # The bounds count the kernel's matmul inside the fusion, and its ring's bytes.
        assert p.dot_flops == pytest.approx(alone.dot_flops + 2 * 2048 ** 3, rel=1e-9)
        assert p.min_comm_s >= alone.min_comm_s > 0
    else:
        small = p.compute - conv  # the continuation's own work
        assert small < gather.seconds < conv
        # The matmul after the done waits for the gather (it did not before: the flow
        # ended with the program, hidden behind the matmul).
        assert p.seconds == pytest.approx(gather.seconds + conv, rel=1e-6)
        assert p.exposed == pytest.approx(gather.seconds - small, rel=1e-6)


def test_each_collective_fusion_done_finds_its_own_start():
    """Two gathers in flight whose state has the same shapes, one continuation's work
    taking the other's result (of a state array's shape): each done is matched with its
    own start by the tuple elements its state travels in, not by shapes."""
    state = STATE_TUPLE
    big = f"bf16[2048,2048]{BS}"
    lines = [f"  %x = {big} parameter(2)"]
    for c in "ab":
        lines.append(f"  %async-collective-start.{c} = ({state}) fusion(%g{c}), "
                     "kind=kCustom, calls=%start_comp")
        lines += [f"  %{c}{j} = {t} get-tuple-element(%async-collective-start.{c}), "
                  f"index={j}" for j, t in enumerate(STATE)]
    # b's continuation first; a's takes b's work result as its own input.
    for c, work in (("b", "%x"), ("a", "%ob")):
        lines.append(f"  %cont{c} = ({big}, {state}) fusion(%{c}0, %{c}1, %{c}2, %{c}3, "
                     f"{work}), kind=kCustom, calls=%async_collective_fusion.1")
        lines.append(f"  %o{c} = {big} get-tuple-element(%cont{c}), index=0")
        lines += [f"  %c{c}{j} = {t} get-tuple-element(%cont{c}), index={j + 1}"
                  for j, t in enumerate(STATE)]
    for c in "ab":
        lines.append(f"  %async-collective-done.{c} = bf16[2048,2048]{B} fusion(%c{c}0, "
                     f"%c{c}1, %c{c}2, %c{c}3), kind=kCustom, calls=%done_comp")
    lines.append(f"  ROOT %t = ({big}, bf16[2048,2048]{B}, bf16[2048,2048]{B}) tuple(%oa, "
                 "%async-collective-done.a, %async-collective-done.b)")
    text = f"""\
HloModule two, is_scheduled=true, num_partitions=8

{GATHER_START_DONE}

%async_collective_fusion.1 ({STATE_PARAMS}, w: bf16[2048,2048]) -> ({big}, {state}) {{
{STATE_PASSED}
  %w = {big} parameter(4)
  %o = {big} negate(%w)
  %step = {big} all-gather(%s0), {GATHER_2}
  ROOT %r = ({big}, {state}) tuple(%o, %s0, %step, %s2, %s3)
}}

ENTRY %main (ga: bf16[2048,1024], gb: bf16[2048,1024], x: bf16[2048,2048]) -> ({big}, bf16[2048,2048], bf16[2048,2048]) {{
  %ga = bf16[2048,1024]{B} parameter(0)
  %gb = bf16[2048,1024]{B} parameter(1)
""" + "\n".join(lines) + "\n}\n"
    module = _hlo.parse(text)
    by_name = {i.name: i for i in module.computations[module.entry]}
    for c in "ab":
        assert _hlo.started_by(by_name[f"async-collective-done.{c}"], by_name, module) == \
            f"async-collective-start.{c}"
    p = _simulate.predict(text, V5E)
    assert [t.runs for t in p.transfers if t.kind == "all-gather"] == [1, 1]


ST = f"(bf16[2048,2048]{B}, bf16[2048,2048]{BS}, u32[]{{:S(2)}}, u32[]{{:S(2)}})"
ST_LOOP = (f"(u32[]{U}, bf16[2048,2048]{B}, bf16[2048,2048]{B}, {ST}, bf16[2048,2048]{B}, "
           f"u32[]{U})")

# A TPU collective fusion carried across a loop's iterations: started before the loop,
# each iteration waits for the transfer in flight (its done), starts the next and
# multiplies; the last finishes after the loop.
TPU_FUSION_LOOP = f"""HloModule l, is_scheduled=true, num_partitions=4

{_fused_conv(2048)}

%start_comp (p: bf16[2048,2048]) -> {ST} {{
  %p = bf16[2048,2048]{B} parameter(0)
  %cp = bf16[2048,2048]{B} collective-permute(%p), channel_id=1, source_target_pairs={{{{0,1}},{{1,3}},{{3,2}},{{2,0}}}}
  ROOT %cc = {ST} custom-call(%cp), custom_call_target="AsyncCollectiveStart"
}}

%done_comp (s0: bf16[2048,2048], s1: bf16[2048,2048], s2: u32[], s3: u32[]) -> bf16[2048,2048] {{
  %s0 = bf16[2048,2048]{B} parameter(0)
  %s1 = bf16[2048,2048]{BS} parameter(1)
  %s2 = u32[]{{:S(2)}} parameter(2)
  %s3 = u32[]{{:S(2)}} parameter(3)
  ROOT %cd = bf16[2048,2048]{B} custom-call(%s0, %s1, %s2, %s3), custom_call_target="AsyncCollectiveDone"
}}

%cond (cp: {ST_LOOP}) -> pred[] {{
  %limit = u32[]{U} constant(3)
  %cp = {ST_LOOP} parameter(0)
  %i = u32[]{U} get-tuple-element(%cp), index=5
  ROOT %lt = pred[]{{:T(512)}} compare(%i, %limit), direction=LT
}}

%body (bp: {ST_LOOP}) -> {ST_LOOP} {{
  %one = u32[]{U} constant(1)
  %bp = {ST_LOOP} parameter(0)
  %x = bf16[2048,2048]{B} get-tuple-element(%bp), index=1
  %w = bf16[2048,2048]{B} get-tuple-element(%bp), index=2
  %fusion.a = bf16[2048,2048]{B} fusion(%x, %w), kind=kOutput, calls=%fused_conv
  %inflight = {ST} get-tuple-element(%bp), index=3
  %e0 = bf16[2048,2048]{B} get-tuple-element(%inflight), index=0
  %e1 = bf16[2048,2048]{BS} get-tuple-element(%inflight), index=1
  %e2 = u32[]{{:S(2)}} get-tuple-element(%inflight), index=2
  %e3 = u32[]{{:S(2)}} get-tuple-element(%inflight), index=3
  %async-collective-done = bf16[2048,2048]{B} fusion(%e0, %e1, %e2, %e3), kind=kCustom, calls=%done_comp
  %async-collective-start.1 = {ST} fusion(%async-collective-done), kind=kCustom, calls=%start_comp
  %fusion.b = bf16[2048,2048]{B} fusion(%async-collective-done, %w), kind=kOutput, calls=%fused_conv
  %i = u32[]{U} get-tuple-element(%bp), index=5
  %i1 = u32[]{U} add(%i, %one)
  %c0 = u32[]{U} get-tuple-element(%bp), index=0
  ROOT %t = {ST_LOOP} tuple(%c0, %x, %w, %async-collective-start.1, %fusion.b, %i1)
}}

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,2048]) -> bf16[2048,2048] {{
  %zero = u32[]{U} constant(0)
  %x = bf16[2048,2048]{B} parameter(0)
  %w = bf16[2048,2048]{B} parameter(1)
  %async-collective-start = {ST} fusion(%x), kind=kCustom, calls=%start_comp
  %init = {ST_LOOP} tuple(%zero, %x, %w, %async-collective-start, %x, %zero)
  %loop = {ST_LOOP} while(%init), condition=%cond, body=%body
  %last = {ST} get-tuple-element(%loop), index=3
  %l0 = bf16[2048,2048]{B} get-tuple-element(%last), index=0
  %l1 = bf16[2048,2048]{BS} get-tuple-element(%last), index=1
  %l2 = u32[]{{:S(2)}} get-tuple-element(%last), index=2
  %l3 = u32[]{{:S(2)}} get-tuple-element(%last), index=3
  %async-collective-done.9 = bf16[2048,2048]{B} fusion(%l0, %l1, %l2, %l3), kind=kCustom, calls=%done_comp
  ROOT %r = bf16[2048,2048]{B} fusion(%async-collective-done.9, %w), kind=kOutput, calls=%fused_conv
}}
"""


def test_a_collective_fusion_carried_through_a_loop_is_waited_for():
    """Each done in the loop body finds the start the previous iteration left in the
    loop's tuple (and the one after the loop, the last iteration's): three waits the
    convolutions beside cannot cover, none dropped."""
    p = _simulate.predict(TPU_FUSION_LOOP, V5E)
    assert sorted((t.name, t.runs) for t in p.transfers) == [
        ("async-collective-start", 1), ("async-collective-start.1", 3)]
    assert p.exposed > 0 and p.unread == ()
    assert p.seconds == pytest.approx(p.compute + p.exposed, rel=1e-9)


def test_the_overlap_report_says_what_fused_kernels_move_themselves():
    """A program of fused ring kernels has no transfer XLA can see: the report's last
    line says its kernels' blocks are not counted, rather than reading as 'nothing
    overlaps'; the kernel inside a continuation fusion counts as one too."""
    from fusedpar import aot

    for text in (_ring_kernel("fusedpar.ag_rows.pallas_tpu.bidirectional"),
                 _collective_beside(kernel=True)):
        # The name the fused kernel has in a program (not a local kernel's).
        report = aot.overlap(text.replace("%kernel", "%all_gather_matmul_rows.3"))
        op, = [s for s in report.ops if s.kernels]
        assert op.op == ("ag_rows", "pallas_tpu", "fused kernel") and op.kernels == 1
        assert "Not counted: the blocks 1 fused kernel(s) move" in report.markdown()
    # A Pallas kernel that is not one of fusedpar's rings: nothing said.
    report = aot.overlap(_ring_kernel("fusedpar.ag_rows.pallas_tpu.bidirectional"))
    assert "Not counted" not in report.markdown()


def test_a_kernel_that_sends_without_a_plan_is_listed():
    """A kernel that sends bytes itself but carries no fusedpar scope: its matmul is
    timed, its transfers cannot be, and the replay says so (a floor)."""
    p = _simulate.predict(_ring_kernel("someone.elses_kernel"), V5E)
    assert p.communication == 0.0
    assert len(p.unread) == 1 and "a kernel that sends bytes itself" in p.unread[0]


S3 = "{2,1,0:T(8,128)(2,1)}"


def _merged(operands: int) -> str:
    """A TPU program with what XLA makes of a user's step: an all-reduce merged from
    `operands` (XLA combines a step's gradient all-reduces), a matmul fusion nested in
    another's, and a loop fusion whose root tuple updates a stacked buffer in place (a
    scan's residuals: one layer's slice an iteration) beside a second output."""
    shape = ", ".join([f"bf16[2048,2048]{B}"] * operands)
    return f"""\
HloModule merged, is_scheduled=true, num_partitions=4

%sum (a: bf16[], b: bf16[]) -> bf16[] {{
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}}

{_fused_conv(2048)}

%outer (p0: bf16[2048,2048], p1: bf16[2048,2048]) -> bf16[2048,2048] {{
  %p0 = bf16[2048,2048]{B} parameter(0)
  %p1 = bf16[2048,2048]{B} parameter(1)
  %f = bf16[2048,2048]{B} fusion(%p0, %p1), kind=kOutput, calls=%fused_conv
  ROOT %n = bf16[2048,2048]{B} negate(%f)
}}

%stack_update (s0: bf16[8,2048,2048], s1: bf16[2048,2048], s2: s32[]) -> (bf16[8,2048,2048], bf16[2048,2048]) {{
  %s0 = bf16[8,2048,2048]{S3} parameter(0)
  %s1 = bf16[2048,2048]{B} parameter(1)
  %s2 = s32[]{U} parameter(2)
  %z = s32[]{U} constant(0)
  %b = bf16[1,2048,2048]{S3} bitcast(%s1)
  %dus = bf16[8,2048,2048]{S3} dynamic-update-slice(%s0, %b, %s2, %z, %z)
  %neg = bf16[2048,2048]{B} negate(%s1)
  ROOT %t = (bf16[8,2048,2048]{S3}, bf16[2048,2048]{B}) tuple(%dus, %neg)
}}

ENTRY %main (x: bf16[2048,2048], w: bf16[2048,2048], stack: bf16[8,2048,2048]) -> (bf16[8,2048,2048], bf16[2048,2048]) {{
  %x = bf16[2048,2048]{B} parameter(0)
  %w = bf16[2048,2048]{B} parameter(1)
  %stack = bf16[8,2048,2048]{S3} parameter(2)
  %ar = ({shape}) all-reduce({", ".join(["%x", "%w"][:operands])}), channel_id=1, replica_groups={{{{0,1,2,3}}}}, to_apply=%sum
  %x2 = bf16[2048,2048]{B} get-tuple-element(%ar), index=0
  %f = bf16[2048,2048]{B} fusion(%x2, %w), kind=kOutput, calls=%outer
  %i = s32[]{U} constant(3)
  ROOT %u = (bf16[8,2048,2048]{S3}, bf16[2048,2048]{B}) fusion(%stack, %f, %i), kind=kLoop, calls=%stack_update
}}
"""


def test_merged_collectives_nested_matmuls_and_in_place_updates():
    one, two = _simulate.predict(_merged(1), V5E), _simulate.predict(_merged(2), V5E)
    # A merged all-reduce sends every operand: twice one's bytes.
    assert two.min_comm_s == pytest.approx(2 * one.min_comm_s, rel=1e-9)
    assert two.communication > one.communication
    # The matmul nested two fusions deep counts.
    flops = 2.0 * 2048 ** 3
    assert two.dot_flops == flops and two.unread == ()
    # The update moves the slice it writes, not the stacked buffer (64 MiB: 82 us more).
    block = 2048 * 2048 * 2
    matmul = max(flops / V5E.matmul_flops("bfloat16"), 3 * block / V5E.hbm_bandwidth)
    update = (block + 4 + 2 * block) / V5E.hbm_bandwidth  # reads f, writes slice and neg
    assert two.compute == pytest.approx(matmul + V5E.launch_overhead + update, rel=1e-9)


@pytest.mark.parametrize("text,hw,coords", [
    (GPU_PIPELINED, H100, None), (TPU_PIPELINED, V5E, SQUARE), (TPU_WIDE, V5E, None),
    (GPU_SEND_RECV, H100, None),
    (TPU_ASYNC_SLICE, V5E, None), (_all_gather("mesh['x'=2,'y'=4] {'y'}"), H100, None),
    (_permutes("{{0,2}}", "{{1,2}}"), V5E, LINE),
    (_ring_kernel("fusedpar.ag_rows.pallas_tpu.bidirectional"), V5E, None),
    (_collective_beside(kernel=True), V5E, None), (_collective_beside(kernel=False), V5E, None),
    (_merged(2), V5E, None)])
def test_the_bounds_hold(text, hw, coords):
    p = _simulate.predict(text, hw, coords)
    assert p.compute >= p.min_compute_s * (1 - 1e-9)
    assert p.communication >= p.min_comm_s * (1 - 1e-9)
    assert p.lower_bound <= p.seconds * (1 + 1e-9)


# -- GSPMD programs compiled here ----------------------------------------------------------

TOKENS, DIM, HIDDEN = 256, 1024, 4096  # per device; sequence-parallel MLP, 8 devices


def _gspmd_mlp(mesh):
    """What a user without fusedpar writes: a Megatron-style sequence-parallel MLP under
    `jax.jit` with sharding constraints (x sharded on the sequence, w1 by columns, w2 by
    rows), its training step's gradients."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.shape["tp"]

    def spec(*axes):
        return NamedSharding(mesh, P(*axes))

    def loss(w1, w2, x, y):
        h = jax.lax.with_sharding_constraint(jax.nn.gelu(x @ w1.T), spec(None, "tp"))
        out = jax.lax.with_sharding_constraint(h @ w2.T, spec("tp", None))
        return jnp.mean(jnp.square((x + out - y).astype(jnp.float32)))

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=spec(*p)) for s, p in (
        ((HIDDEN, DIM), ("tp", None)), ((DIM, HIDDEN), (None, "tp")),
        ((n * TOKENS, DIM), ("tp", None)), ((n * TOKENS, DIM), ("tp", None)))]
    return jax.jit(jax.grad(loss, argnums=(0, 1))), args


@pytest.mark.aot
@needs_aot
@pytest.mark.parametrize("target", (
    "h100x8", pytest.param("v5e:2x4", marks=pytest.mark.slow)))
def test_a_gspmd_program_compiled_here(target):
    # On v5e, XLA's collective matmul (post_spmd) turns the gathers and reduce-scatters
    # into windowed loops: their bodies, trip counts, mesh-form groups are all read.
    from jax.sharding import AxisType

    from fusedpar import aot

    devices = aot.devices(target)
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Auto,), devices=devices)
    program, args = _gspmd_mlp(mesh)
    options = {} if target == "h100x8" else dict(
        xla_tpu_all_gather_collective_matmul_mode="post_spmd",
        xla_tpu_reduce_scatter_collective_matmul_mode="post_spmd")
    compiled = program.lower(*args).compile(compiler_options=options or None)
    text = compiled.as_text()
    p = aot.predict(compiled, mesh)
    assert p.unread == ()
    # Forward x @ w1, h @ w2; backward both weights' gradients and h's (x needs none).
    assert p.dot_flops == 5 * 2 * 8 * TOKENS * DIM * HIDDEN / 8
    assert p.compute >= p.min_compute_s and p.communication >= p.min_comm_s > 0
    if target == "h100x8":
        assert "mesh[" in text  # GSPMD's replica groups: all-gathers, a reduce-scatter
    else:  # every collective became a collective-permute in a loop
        assert " while(" in text and "known_trip_count" not in text
        assert any(t.runs > 1 for t in p.transfers)  # collectives inside the loops
