"""The FLOPs the replay gives a Pallas kernel whose lowering dropped its cost estimate
(`fusedpar._compile._flops.kernel_product`), on hand-written kernels of each shape fusedpar's
backends make: a Mosaic GPU ring step writing into a slice of the output its result
aliases (one piece, or a bidirectional step's two), a step adding to an aliased f32
accumulator over a window of the contraction, a reduce-scatter step computing the rows
it sends, and a fused TPU kernel running the whole ring. Each must equal the step's
dense matmul: the guess had read x @ (the aliased output) as the product."""

import pytest

from fusedpar._compile import _hlo, _simulate
from fusedpar import cost_model

H100 = cost_model.get_hardware("h100_sxm")


def _kernel(params, result, operands, target="mosaic_gpu_v2", aliased=None):
    """A one-kernel module: `params` (name -> shape), the kernel on `operands`."""
    alias = f", output_to_operand_aliasing={{{{}}: ({aliased}, {{}})}}" if aliased else ""
    heads = ", ".join(f"{n}: {s}" for n, s in params.items())
    lines = [f"  %{n} = {s}{{1,0}} parameter({k})" for k, (n, s) in enumerate(params.items())]
    args = ", ".join(f"%{o}" for o in operands)
    lines.append(f"  ROOT %kernel = {result}{{1,0}} custom-call({args}), "
                 f'custom_call_target="{target}"{alias}')
    return ("HloModule k, is_scheduled=true\n\n"
            f"ENTRY %main ({heads}) -> {result} {{\n" + "\n".join(lines) + "\n}\n")


CASES = {
    # ag_rows on 2 devices: x (1024, 4096) @ w into rows of the (2048, 4096) output.
    "gather step": (dict(x="f16[1024,4096]", w="f16[4096,4096]", out="f16[2048,4096]"),
                    "f16[2048,4096]", ("x", "w", "out"), "mosaic_gpu_v2", 2,
                    2 * 1024 * 4096 * 4096),
    # Bidirectional: two (512, 4096) pieces, one from each neighbour.
    "two pieces": (dict(a="bf16[512,4096]", b="bf16[512,4096]", w="bf16[4096,4096]",
                        out="bf16[8192,4096]"), "bf16[8192,4096]", ("a", "b", "w", "out"),
                   "mosaic_gpu_v2", 3, 2 * 2 * 512 * 4096 * 4096),
    # ag_contract: x's window of 512 columns @ the (512, 4096) block, into an accumulator.
    "accumulator": (dict(x="bf16[1024,4096]", w="bf16[512,4096]", acc="f32[1024,4096]"),
                    "f32[1024,4096]", ("x", "w", "acc"), "mosaic_gpu_v2", 2,
                    2 * 1024 * 512 * 4096),
    # rs_rows: the 128 rows this step sends, of x (1024, 4096) @ w.
    "reduce-scatter step": (dict(x="bf16[1024,4096]", w="bf16[4096,4096]"),
                            "f32[128,4096]", ("x", "w"), "mosaic_gpu_v2", None,
                            2 * 128 * 4096 * 4096),
    # A fused TPU ag_rows kernel on 8 devices: every step's (256, 512) @ (512, 640).
    "fused TPU ring": (dict(x="bf16[256,512]", w="bf16[512,640]"), "bf16[2048,640]",
                       ("x", "w"), "tpu_custom_call", None, 2 * 2048 * 512 * 640),
}


@pytest.mark.parametrize("case", CASES)
def test_a_kernel_without_an_estimate_multiplies_its_step(case):
    params, result, operands, target, aliased, flops = CASES[case]
    p = _simulate.predict(_kernel(params, result, operands, target, aliased), H100)
    assert p.dot_flops == flops, (case, p.dot_flops, flops)


def test_a_step_moves_its_slice_of_the_aliased_output():
    """A ring step on 8 devices writes its (1024, 4096) rows of the (8192, 4096) output:
    compute-bound (its matmul at the preset's rate); with the output read and written
    whole, beside x and w, the kernel would be memory-bound."""
    params = dict(x="bf16[1024,4096]", w="bf16[4096,4096]", out="bf16[8192,4096]")
    p = _simulate.predict(_kernel(params, "bf16[8192,4096]", ("x", "w", "out"),
                                  aliased=2), H100)
    matmul = 2 * 1024 * 4096 * 4096 / H100.matmul_flops("bfloat16")
    whole = (1024 * 4096 + 4096 * 4096 + 2 * 8192 * 4096) * 2
    assert whole / H100.hbm_bandwidth > 1.2 * matmul
    assert p.compute == pytest.approx(matmul + H100.launch_overhead)


def test_a_step_keeping_its_pieces_writes_them_once():
    """A gather step that also writes its pieces into the gathered operand (a second
    output aliasing a second buffer, `matmul_into(kept=...)`): x and w read, the
    product's rows read and written, and x's rows written once into the gathered buffer:
    neither aliased buffer whole."""
    from fusedpar._compile import _flops

    text = ("HloModule k, is_scheduled=true\n\n"
            "ENTRY %main (x: bf16[1024,4096], w: bf16[4096,2048], out: bf16[8192,2048], "
            "kept: bf16[8192,4096]) -> (bf16[8192,2048], bf16[8192,4096]) {\n"
            "  %x = bf16[1024,4096]{1,0} parameter(0)\n"
            "  %w = bf16[4096,2048]{1,0} parameter(1)\n"
            "  %out = bf16[8192,2048]{1,0} parameter(2)\n"
            "  %kept = bf16[8192,4096]{1,0} parameter(3)\n"
            "  ROOT %kernel = (bf16[8192,2048]{1,0}, bf16[8192,4096]{1,0}) custom-call(%x, %w, "
            '%out, %kept), custom_call_target="mosaic_gpu_v2", '
            "output_to_operand_aliasing={{0}: (2, {}), {1}: (3, {})}\n}\n")
    module = _hlo.parse(text)
    by_name = {i.name: i for i in module.computations[module.entry]}
    moved = _flops.aliased_kernel_bytes(by_name["kernel"], by_name)
    x, w, rows = 1024 * 4096 * 2, 4096 * 2048 * 2, 1024 * 2048 * 2
    assert moved == x + w + 2 * rows + x
