"""fusedpar.aot.overlap reads a compiled schedule right: which transfers have a matmul in
flight, which matmuls are exposed, and which op each belongs to — in the GPU and TPU
dialects (hand-written schedules) and on a real CPU program, whose collective-permutes
are synchronous (nothing can overlap)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._compile import _hlo
from fusedpar import aot
from helpers import mesh

SCOPE = 'metadata={op_name="jit(f)/shard_map/jvp(fusedpar.ag_rows.ring.unidirectional)/%s"}'
BWD = 'metadata={op_name="jit(f)/transpose(jvp(fusedpar.ag_rows.ring.unidirectional))/fusedpar.rs_rows.ring.unidirectional/%s"}'

# A 3-step ring as XLA's GPU scheduler writes it: each transfer starts before a step's
# matmul (a cuBLAS gemm, then a fusion with a dot inside) and is done after it.
OVERLAPPED = f"""\
HloModule ring, is_scheduled=true

%fused_dot (p0: f16[8,8], p1: f16[8,8]) -> f16[8,8] {{
  %p0 = f16[8,8]{{1,0}} parameter(0)
  %p1 = f16[8,8]{{1,0}} parameter(1)
  ROOT %d = f16[8,8]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (x: f16[8,8], w: f16[8,8]) -> f16[8,8] {{
  %x = f16[8,8]{{1,0}} parameter(0)
  %w = f16[8,8]{{1,0}} parameter(1)
  %cp-start = (f16[8,8]{{1,0}}, f16[8,8]{{1,0}}) collective-permute-start(%x), channel_id=1, source_target_pairs={{{{0,1}},{{1,2}},{{2,0}}}}, {SCOPE % "ppermute"}
  %gemm = (f16[8,8]{{1,0}}, s8[0]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$gemm", {SCOPE % "dot_general"}
  %cp-done = f16[8,8]{{1,0}} collective-permute-done(%cp-start)
  %cp-start.1 = (f16[8,8]{{1,0}}, f16[8,8]{{1,0}}) collective-permute-start(%cp-done), channel_id=2, source_target_pairs={{{{0,1}},{{1,2}},{{2,0}}}}, {SCOPE % "ppermute"}
  %fusion = f16[8,8]{{1,0}} fusion(%cp-done, %w), kind=kCustom, calls=%fused_dot, {SCOPE % "dot_general"}
  %cp-done.1 = f16[8,8]{{1,0}} collective-permute-done(%cp-start.1)
  ROOT %kernel = f16[8,8]{{1,0}} custom-call(%cp-done.1, %w), custom_call_target="mosaic_gpu", {SCOPE % "pallas_call"}
}}
"""

# The TPU dialect: tiled layouts in shapes, u32 sync flags in the start's tuple, matmuls
# as convolutions inside fusions, index comments in operand lists; a backward step.
TPU = f"""\
HloModule ring, is_scheduled=true

%fused_conv (p0: bf16[16,128], p1: bf16[128,128]) -> f32[16,128] {{
  %p0 = bf16[16,128]{{1,0:T(8,128)(2,1)}} parameter(0)
  %p1 = bf16[128,128]{{1,0:T(8,128)(2,1)}} parameter(1)
  ROOT %c = f32[16,128]{{1,0:T(8,128)}} convolution(%p0, %p1), dim_labels=bf_io->bf
}}

ENTRY %main (x: bf16[16,128], w: bf16[128,128]) -> f32[16,128] {{
  %x = bf16[16,128]{{1,0:T(8,128)(2,1)}} parameter(0)
  %w = bf16[128,128]{{1,0:T(8,128)(2,1)}} parameter(1)
  %collective-permute-start = (bf16[16,128]{{1,0:T(8,128)(2,1)}}, bf16[16,128]{{1,0:T(8,128)(2,1)}}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(%x), channel_id=1, source_target_pairs={{{{0,1}},{{1,0}}}}, {BWD % "ppermute"}
  %fusion.1 = f32[16,128]{{1,0:T(8,128)}} fusion(%x, /*index=1*/%w), kind=kOutput, calls=%fused_conv, {BWD % "dot_general"}
  %collective-permute-done = bf16[16,128]{{1,0:T(8,128)(2,1)}} collective-permute-done(%collective-permute-start)
  ROOT %fusion.2 = f32[16,128]{{1,0:T(8,128)}} fusion(%collective-permute-done, %w), kind=kOutput, calls=%fused_conv, {BWD % "dot_general"}
}}
"""


def test_overlapped_schedule():
    r = aot.overlap(OVERLAPPED)
    assert (r.total, r.hidden) == (2, 2)
    s = r.op("ag_rows", "ring", "forward")
    assert (s.transfers, s.hidden, s.matmuls, s.exposed) == (2, 2, 3, 1)  # the last step
    assert s.bytes == 2 * 8 * 8 * 2  # two f16[8,8] blocks sent
    assert s.verdict.startswith("overlapped")
    assert r.transfers[0].matmuls == ("gemm",)
    assert "| ag_rows | ring | forward | 2 / 2 |" in r.markdown()


def test_serialised_schedule():
    # The same program with every transfer done before the matmul that follows it.
    moved = []
    for line in OVERLAPPED.splitlines():
        if "collective-permute-done" in line:
            moved.insert(len(moved) - 1, line)  # before the matmul just written
        else:
            moved.append(line)
    r = aot.overlap("\n".join(moved))
    s = r.op("ag_rows", "ring", "forward")
    assert (s.transfers, s.hidden, s.matmuls, s.exposed) == (2, 0, 3, 3)
    assert s.verdict.startswith("NOT overlapped")


# A weight gathered once and multiplied twice (every matmul needs it: no schedule can
# hide it), and an all-reduce of the first product that the second matmul, independent
# of it, could hide but is scheduled after.
DEPENDENT = """\
HloModule fsdp, is_scheduled=true

ENTRY %main (x: f16[8,8], w: f16[4,8]) -> (f16[8,8], f16[8,8]) {
  %x = f16[8,8]{1,0} parameter(0)
  %w = f16[4,8]{1,0} parameter(1)
  %ag-start = (f16[4,8]{1,0}, f16[8,8]{1,0}) all-gather-start(%w), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %ag-done = f16[8,8]{1,0} all-gather-done(%ag-start)
  %gemm = (f16[8,8]{1,0}, s8[0]{0}) custom-call(%x, %ag-done), custom_call_target="__cublas$gemm"
  %gte = f16[8,8]{1,0} get-tuple-element(%gemm), index=0
  %ar-start = f16[8,8]{1,0} all-reduce-start(%gte), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %ar-done = f16[8,8]{1,0} all-reduce-done(%ar-start)
  %gemm.1 = (f16[8,8]{1,0}, s8[0]{0}) custom-call(%x, %ag-done), custom_call_target="__cublas$gemm"
  %gte.1 = f16[8,8]{1,0} get-tuple-element(%gemm.1), index=0
  ROOT %out = (f16[8,8]{1,0}, f16[8,8]{1,0}) tuple(%ar-done, %gte.1)
}
"""


# XLA's all-reduce combiner: the loss's 4-byte psum (forward) and a bias gradient
# (backward, behind an unnamed copy) in one all-reduce of their concatenation, with no
# name of its own; its reduction region carries the loss's.
MERGED = """\
HloModule merged, is_scheduled=true

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b), metadata={op_name="jit(step)/jvp()/psum"}
}

ENTRY %main (loss: f32[1], db: f32[64]) -> f32[65] {
  %loss = f32[1]{0} parameter(0)
  %db = f32[64]{0} parameter(1)
  %l = f32[1]{0} negate(%loss), metadata={op_name="jit(step)/jvp()/neg"}
  %g = f32[64]{0} negate(%db), metadata={op_name="jit(step)/transpose(jvp())/reduce_sum"}
  %gb = f32[64]{0} copy(%g)
  %cat = f32[65]{0} concatenate(%l, %gb), dimensions={0}
  %ar-start = f32[65]{0} all-reduce-start(%cat), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%sum, backend_config={"operation_queue_id":"0"}
  ROOT %ar-done = f32[65]{0} all-reduce-done(%ar-start)
}
"""


def test_a_merged_collective_goes_with_its_largest_part():
    (t,) = aot.overlap(MERGED).transfers
    assert t.op == ("other", "", "backward") and (t.bytes, t.sent) == (260, 390)


def test_hideable_transfers_are_those_with_an_independent_matmul():
    r = aot.overlap(DEPENDENT)
    gather, reduce = r.transfers
    assert (gather.kind, gather.hidden, gather.hideable) == ("all-gather", False, False)
    assert (reduce.kind, reduce.hidden, reduce.hideable) == ("all-reduce", False, True)
    assert (r.total, r.hidden, r.hideable) == (2, 0, 1)
    # What a device sends over 2 devices: the other's block; half of a reduce-scatter
    # and of an all-gather of its f16[8,8].
    assert (gather.bytes, gather.sent, reduce.bytes, reduce.sent) == (64, 64, 128, 128)
    assert "1 have no matmul independent of them" in r.markdown()
    # In the overlapped ring every transfer is hideable (and hidden).
    ring = aot.overlap(OVERLAPPED)
    assert ring.hideable == ring.hidden == ring.total == 2
    ancestors, descendants = _hlo.dataflow(_hlo.parse(DEPENDENT).computations["main"])
    bits = lambda *ks: sum(1 << k for k in ks)  # noqa: E731 - instructions by position
    # gemm (4): fed by x, w and the gather (0-3); feeds its gte, the all-reduce, the root.
    assert (ancestors[4], descendants[4]) == (bits(0, 1, 2, 3), bits(5, 6, 7, 10))


def test_tpu_dialect_and_backward_attribution():
    r = aot.overlap(TPU)
    s = r.op("rs_rows", "ring", "backward")  # the innermost fusedpar scope names the op
    assert (s.transfers, s.hidden, s.matmuls, s.exposed) == (1, 1, 2, 1)
    assert s.bytes == 16 * 128 * 2
    assert _hlo.shape_bytes("(bf16[16,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)})") == 16 * 128 * 2 + 4


def test_predict_refuses_a_target_of_another_platform():
    """A TPU program replayed as an H100's (or a GPU one as a TPU's) would be timed with
    the other's numbers: refused, naming both."""
    with pytest.raises(ValueError, match=r"compiled for a TPU .* the target is a GPU"):
        aot.predict(TPU, "h100x8")
    with pytest.raises(ValueError, match=r"compiled for a GPU .* the target is a TPU"):
        aot.predict(DEPENDENT, "v5e:2x4")
    assert aot.predict(TPU, "v5e:2x4").seconds > 0


def test_a_mesh_of_one_axis_named_by_a_str():
    assert aot.mesh("h100x4", (4,), "tp").axis_names == ("tp",)  # not ('t', 'p')


def test_a_user_s_mesh_may_split_the_slice_s_axes():
    """`--compare`'s FSDP x TP mesh of 16 chips is 2 x 8, which `jax.make_mesh` cannot lay
    on a 4x4 slice (it raised NotImplementedError); built as JAX's message says a user
    would, with the slice's axes split, every device once."""
    m = aot.mesh("v6e:4x4", (2, 8), ("fsdp", "tp"), make_mesh=True)
    assert dict(m.shape) == {"fsdp": 2, "tp": 8}
    assert sorted(d.id for d in m.devices.flat) == sorted(d.id for d in aot.devices("v6e:4x4"))


def test_cpu_program_has_synchronous_transfers():
    m = mesh((4,), ("x",))
    f = jax.jit(jax.shard_map(
        lambda x, w: fusedpar.all_gather_matmul(x, w, "x", backend="ring", bidirectional=False),
        mesh=m, in_specs=(P("x"), P()), out_specs=P("x")))
    compiled = f.lower(jax.ShapeDtypeStruct((64, 32), jnp.float32),
                       jax.ShapeDtypeStruct((32, 16), jnp.float32)).compile()
    s = aot.overlap(compiled).op("ag_rows", "ring", "forward")
    assert (s.transfers, s.hidden, s.matmuls, s.exposed) == (3, 0, 4, 4)
    assert s.bytes == 3 * 16 * 32 * 4


def test_bad_input():
    with pytest.raises(TypeError, match=r"overlap: program must be a compiled program"):
        aot.overlap(42)
    with pytest.raises(ValueError, match=r"unknown target 'v9x:2x2'; valid: h100x8, v4:2x2x2, v5e:2x4"):
        aot.devices("v9x:2x2")
    with pytest.raises(ValueError, match=r"'h100x16'.*'h100xN' with N from 1 to 8"):
        aot.mesh("h100x16")


# The TPU compiler's asynchronous collective: a fusion named async-collective-start whose
# computation holds the all-gather, finished by an async-collective-done fusion of the
# start's tuple elements; neither carries an op_name (the collective inside does).
TPU_ASYNC = """\
HloModule ref, is_scheduled=true

%inner_ag (p: bf16[16,128]) -> bf16[128,128] {
  %p = bf16[16,128]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %all-gather.1 = bf16[128,128]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(f)/shard_map/fusedpar.ag_rows.reference/all_gather"}
}

%start_comp (p0: bf16[16,128]) -> (bf16[16,128], bf16[128,128]) {
  %p0 = bf16[16,128]{1,0:T(8,128)(2,1)} parameter(0)
  %ag = bf16[128,128]{1,0:T(8,128)(2,1)} fusion(%p0), kind=kCustom, calls=%inner_ag
  ROOT %t = (bf16[16,128]{1,0:T(8,128)(2,1)}, bf16[128,128]{1,0:T(8,128)(2,1)}) tuple(%p0, %ag)
}

%done_comp (q: bf16[128,128]) -> bf16[128,128] {
  ROOT %q = bf16[128,128]{1,0:T(8,128)(2,1)} parameter(0)
}

ENTRY %main (x: bf16[16,128], w: bf16[128,128]) -> f32[16,128] {
  %x = bf16[16,128]{1,0:T(8,128)(2,1)} parameter(0)
  %w = bf16[128,128]{1,0:T(8,128)(2,1)} parameter(1)
  %async-collective-start = (bf16[16,128]{1,0:T(8,128)(2,1)}, bf16[128,128]{1,0:T(8,128)(2,1)}) fusion(%x), kind=kCustom, calls=%start_comp
  %convolution = f32[16,128]{1,0:T(8,128)} convolution(%x, %w), dim_labels=bf_io->bf, metadata={op_name="jit(f)/transpose(jvp(fusedpar.ag_rows.reference))/dot_general"}
  %get-tuple-element = bf16[128,128]{1,0:T(8,128)(2,1)} get-tuple-element(%async-collective-start), index=1
  %async-collective-done = bf16[128,128]{1,0:T(8,128)(2,1)} fusion(%get-tuple-element), kind=kCustom, calls=%done_comp
  ROOT %c2 = f32[16,128]{1,0:T(8,128)} convolution(%async-collective-done, %w), dim_labels=bf_io->bf
}
"""


def test_tpu_async_collective_fusion():
    r = aot.overlap(TPU_ASYNC)
    (t,) = r.transfers
    assert (t.kind, t.op, t.bytes, t.matmuls) == (
        "all-gather", ("ag_rows", "reference", "forward"), 16 * 128 * 2, ("convolution",))
    assert t.sent == 7 * t.bytes  # the 7 other devices' blocks pass through each device
    from fusedpar._compile import _simulate
    from fusedpar import cost_model

    p = _simulate.predict(TPU_ASYNC, cost_model.get_hardware("v5e"))
    assert p.communication > 0 and p.seconds >= p.compute


SLICED = """\
HloModule sliced, is_scheduled=true

%fused_slice (p0: bf16[64,128], p1: s32[]) -> bf16[8,128] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[8,128]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={8,128}
}

%fused_matmul (p0: bf16[64,128], p1: s32[], p2: bf16[8,8]) -> f32[8,128] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[8,8]{1,0} parameter(2)
  %win = bf16[8,128]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_slice
  ROOT %c = f32[8,128]{1,0} convolution(%p2, %win), dim_labels=bf_io->bf
}

%fused_add (p0: bf16[64,128], p1: bf16[64,128]) -> bf16[64,128] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[64,128]{1,0} parameter(1)
  ROOT %a = bf16[64,128]{1,0} add(%p0, %p1)
}

ENTRY %main (x: bf16[64,128], i: s32[], y: bf16[8,8]) -> bf16[8,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %window = bf16[8,128]{1,0} fusion(%x, %i), kind=kLoop, calls=%fused_slice
  %sum = bf16[64,128]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_add
  %y = bf16[8,8]{1,0} parameter(2)
  %step = f32[8,128]{1,0} fusion(%x, %i, %y), kind=kOutput, calls=%fused_matmul
  ROOT %plain = bf16[8,128]{1,0} dynamic-slice(%x, %i, %i), dynamic_slice_sizes={8,128}
}
"""


def test_a_slice_reads_its_window_not_the_buffer():
    # Slicing one ring block out of a gathered buffer moves the block: the replay charges
    # a (dynamic-)slice, alone or fused, for the window it reads, other operands in full.
    module = _hlo.parse(SLICED)
    entry = module.computations[module.entry]
    by_name = {i.name: i for i in entry}
    window = 8 * 128 * 2
    assert _hlo.read_bytes(module, by_name["window"], by_name) == window + 4
    assert _hlo.read_bytes(module, by_name["plain"], by_name) == window + 4 + 4
    assert _hlo.read_bytes(module, by_name["sum"], by_name) == 2 * 64 * 128 * 2
    # The TPU compiler's step matmul: its window cut by a loop fusion nested inside the
    # matmul's own fusion. It reads the window, the index and the other operand.
    assert _hlo.read_bytes(module, by_name["step"], by_name) == window + 4 + 8 * 8 * 2


# XLA's GPU programs: a ring step's block of `gelu(buffer + bias)` sliced out of the
# buffer the step updated (the loop emitter computes, and reads, only the window), the same
# through a reduce (which reads everything), and a cuBLAS GEMM with its scratch workspace.
WINDOWED = """\
HloModule windowed, is_scheduled=true

%fused_block (p0: bf16[64,128], p1: bf16[16,128], p2: bf16[128], p3: s32[]) -> bf16[8,128] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[16,128]{1,0} parameter(1)
  %update = bf16[16,128]{1,0} bitcast(%p1)
  %z = s32[] constant(0)
  %at = s32[] constant(16)
  %dus = bf16[64,128]{1,0} dynamic-update-slice(%p0, %update, %at, %z)
  %p2 = bf16[128]{0} parameter(2)
  %b = bf16[64,128]{1,0} broadcast(%p2), dimensions={1}
  %sum = bf16[64,128]{1,0} add(%dus, %b)
  %act = bf16[64,128]{1,0} tanh(%sum)
  %p3 = s32[] parameter(3)
  ROOT %ds = bf16[8,128]{1,0} dynamic-slice(%act, %p3, %z), dynamic_slice_sizes={8,128}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_reduced (p0: bf16[64,128], p1: f32[64]) -> f32[8] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %f = f32[64,128]{1,0} convert(%p0)
  %zero = f32[] constant(0)
  %r = f32[64]{0} reduce(%f, %zero), dimensions={1}, to_apply=%add
  %p1 = f32[64]{0} parameter(1)
  %m = f32[64]{0} multiply(%r, %p1)
  ROOT %sl = f32[8]{0} slice(%m), slice={[0:8]}
}

ENTRY %main (x: bf16[64,128], u: bf16[16,128], bias: bf16[128], i: s32[], v: f32[64], w: bf16[128,128]) -> (bf16[8,128], f32[8], (f32[64,128], s8[33554432])) {
  %x = bf16[64,128]{1,0} parameter(0)
  %u = bf16[16,128]{1,0} parameter(1)
  %bias = bf16[128]{0} parameter(2)
  %i = s32[] parameter(3)
  %block = bf16[8,128]{1,0} fusion(%x, %u, %bias, %i), kind=kLoop, calls=%fused_block
  %v = f32[64]{0} parameter(4)
  %reduced = f32[8]{0} fusion(%x, %v), kind=kInput, calls=%fused_reduced
  %w = bf16[128,128]{1,0} parameter(5)
  %gemm = (f32[64,128]{1,0}, s8[33554432]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul"
  ROOT %t = (bf16[8,128]{1,0}, f32[8]{0}, (f32[64,128]{1,0}, s8[33554432]{0})) tuple(%block, %reduced, %gemm)
}
"""


def test_a_window_of_an_elementwise_fusion_reads_its_share():
    # A ring step's block sliced out of `gelu(buffer + bias)` (XLA fuses the activation
    # into the slice): charged for the whole buffer, each such block of an H100 prefill
    # took 33.6 us in the replay and 9 us on the GPU.
    module = _hlo.parse(WINDOWED)
    entry = module.computations[module.entry]
    by_name = {i.name: i for i in entry}
    share = 8 / 64
    expected = round(64 * 128 * 2 * share) + round(16 * 128 * 2 * share) + round(
        128 * 2 * share) + round(4 * share)
    assert _hlo.read_bytes(module, by_name["block"], by_name) == expected
    # A reduce inside reads every element, whatever the root keeps.
    assert _hlo.read_bytes(module, by_name["reduced"], by_name) == 64 * 128 * 2 + 64 * 4


def test_a_library_gemm_writes_its_result_not_its_workspace():
    # cuBLAS's scratch workspace (32 MiB once autotuned on an H100) is no HBM traffic of
    # the GEMM: charged, a 512-row step GEMM took 26.9 us in the replay, 15 on the GPU.
    module = _hlo.parse(WINDOWED)
    entry = module.computations[module.entry]
    assert _hlo.written_bytes(module, {i.name: i for i in entry}["gemm"]) == 64 * 128 * 4


# The TPU compiler's asynchronous collective fusion (continuation fusion, with
# `fusedpar.tpu_overlap_flags()`): a matmul fusion also runs a step of an all-gather and
# threads the collective's buffers through its tuple result, aliased to its operands.
CONTINUATION = """\
HloModule continuation, is_scheduled=true

%fused_step (p0: bf16[64,128], p1: bf16[128,128], p2: bf16[8,128], p3: bf16[128,128]) -> (f32[8,128], bf16[64,128], bf16[128,128], bf16[128,128]) {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,128]{1,0} parameter(1)
  %p2 = bf16[8,128]{1,0} parameter(2)
  %p3 = bf16[128,128]{1,0} parameter(3)
  %c = f32[8,128]{1,0} convolution(%p2, %p3), dim_labels=bf_io->bf
  %ag = bf16[128,128]{1,0} all-gather(%p0), replica_groups={{0,1}}, dimensions={0}
  ROOT %t = (f32[8,128]{1,0}, bf16[64,128]{1,0}, bf16[128,128]{1,0}, bf16[128,128]{1,0}) tuple(%c, %p0, %p1, %ag)
}

ENTRY %main (x: bf16[64,128], b: bf16[128,128], y: bf16[8,128], w: bf16[128,128]) -> (f32[8,128], bf16[64,128], bf16[128,128], bf16[128,128]) {
  %x = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,128]{1,0} parameter(1)
  %y = bf16[8,128]{1,0} parameter(2)
  %w = bf16[128,128]{1,0} parameter(3)
  ROOT %step = (f32[8,128]{1,0}, bf16[64,128]{1,0}, bf16[128,128]{1,0}, bf16[128,128]{1,0}) fusion(%x, %b, %y, %w), kind=kOutput, output_to_operand_aliasing={{1}: (0, {}), {2}: (1, {}), {3}: (1, {})}, calls=%fused_step
}
"""


def test_a_continuation_fusion_moves_only_its_matmuls_bytes():
    # The buffers a fusion passes through (to its root tuple, or to a collective the DMA
    # engines run) are neither read nor written by it: charged in full, the step matmuls
    # of an FSDP x TP block on v6e took 109 us each instead of 20 (a 32 MB weight buffer
    # threaded through each).
    module = _hlo.parse(CONTINUATION)
    entry = module.computations[module.entry]
    by_name = {i.name: i for i in entry}
    step = by_name["step"]
    assert _hlo.read_bytes(module, step, by_name) == 8 * 128 * 2 + 128 * 128 * 2
    assert _hlo.written_bytes(module, step) == 8 * 128 * 4
    assert step.bytes > 10 * _hlo.written_bytes(module, step)  # what it was charged


# The TPU compiler's reduce-scatter of a reference `matmul_reduce_scatter`: a fusion
# (`%all-reduce-scatter`) holding an all-reduce of the padded input and the slice each
# device keeps, without a name of its own.
FUSED_REDUCE_SCATTER = """\
HloModule fused_rs, is_scheduled=true

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%fused_matmul (p0: bf16[64,32], p1: bf16[32,128]) -> f32[64,128] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,128]{1,0} parameter(1)
  ROOT %c = f32[64,128]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%all-reduce-scatter (input: f32[64,128]) -> f32[16,128] {
  %input = f32[64,128]{1,0} parameter(0)
  %all-reduce.1 = f32[64,128]{1,0} all-reduce(%input), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%sum
  %partition-id = u32[] partition-id()
  %sixteen = u32[] constant(16)
  %offset = u32[] multiply(%partition-id, %sixteen)
  %zero = u32[] constant(0)
  ROOT %dynamic-slice.1 = f32[16,128]{1,0} dynamic-slice(%all-reduce.1, %offset, %zero), dynamic_slice_sizes={16,128}
}

ENTRY %main (x: bf16[64,32], w: bf16[32,128]) -> f32[16,128] {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,128]{1,0} parameter(1)
  %product = f32[64,128]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul, metadata={op_name="jit(f)/shard_map/fusedpar.rs_rows.reference/dot_general"}
  ROOT %fusion = f32[16,128]{1,0} fusion(%product), kind=kCustom, calls=%all-reduce-scatter
}
"""


def test_a_fused_tpu_reduce_scatter_is_a_synchronous_transfer():
    # Read as a memory-bound kernel, the reference's reduce-scatter cost nothing on the
    # links: the replay put v5e's reference rs_rows (mlp sizes) at 1.26 ms, 2.26 with it.
    r = aot.overlap(FUSED_REDUCE_SCATTER)
    (t,) = r.transfers
    assert (t.kind, t.op, t.bytes, t.hidden) == (
        "reduce-scatter", ("rs_rows", "reference", "forward"), 64 * 128 * 4, False)
    assert t.sent == 3 * t.bytes // 4  # its all-reduce's group of 4 read inside the fusion
    from fusedpar._compile import _simulate
    from fusedpar import cost_model

    hw = cost_model.get_hardware("v5e")
    p = _simulate.predict(FUSED_REDUCE_SCATTER, hw)
    link = 3 * (64 * 128 * 4 / 4) / max(hw.send_bandwidth(1), 2 * hw.send_bandwidth(2))
    assert p.exposed >= link and p.communication > 0


CONCAT_BITCAST = """\
HloModule concat_bitcast, is_scheduled=true

ENTRY %main (x: bf16[64,128]) -> bf16[64,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %a = bf16[32,128]{1,0} slice(%x), slice={[0:32], [0:128]}
  %b = bf16[32,128]{1,0} slice(%x), slice={[32:64], [0:128]}
  ROOT %joined = bf16[64,128]{1,0} custom-call(%a, %b), custom_call_target="ConcatBitcast"
}
"""


def test_a_concatenation_that_is_a_bitcast_moves_nothing():
    # The TPU compiler places slices side by side and joins them with a `ConcatBitcast`
    # custom call, a view of their buffers: charged as a copy, it cost a v5e FSDP x TP
    # block's step 330 us (reference) and 850 us (auto).
    from fusedpar._compile import _simulate
    from fusedpar import cost_model

    hw = cost_model.get_hardware("v5e")
    slices = 2 * (2 * 32 * 128 * 2) / hw.hbm_bandwidth  # each reads and writes its window
    p = _simulate.predict(CONCAT_BITCAST, hw)
    assert p.compute == pytest.approx(slices, rel=1e-6)
