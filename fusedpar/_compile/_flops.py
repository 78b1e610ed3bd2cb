"""The floating-point operations of a matmul instruction of a scheduled HLO module, read
from its shapes: a `dot`, a `convolution` (the TPU compiler writes matmuls as
convolutions, some with a window: only the taps that land on the input count, not those
on its padding), a fusion or call around them, a cuBLAS GEMM, a cuDNN convolution
(forward or either gradient), or a Pallas kernel (its cost estimate, or a guess from its
operands when the lowering dropped it).
"""

from __future__ import annotations

import math
import re

from . import _hlo

_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^{}]*)\}")
_GROUPS = re.compile(r"feature_group_count=(\d+)")
_FLOPS = re.compile(r'"flops":\s*"?(\d+)')
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
# A float32 matmul's precision: `operand_precision={default,highest}` on a dot or
# convolution, `"operand_precision":["DEFAULT","HIGHEST"]` in a cuBLAS call's backend
# config (the higher of the two operands' is the matmul's), or a dot algorithm
# (`algorithm=dot_bf16_bf16_f32_x6`: six bf16 passes, as HIGHEST on a TPU).
_PRECISION = re.compile(r'operand_precision"?[=:]\s*[\{\[]([^\}\]]*)[\}\]]')
_ALGORITHM = re.compile(r'algorithm"?[=:]\s*"?(?:ALG_)?(dot_\w+)', re.I)
_ALGORITHMS = {"dot_bf16_bf16_f32_x3": "high", "dot_bf16_bf16_f32_x6": "highest",
               "dot_bf16_bf16_f32_x9": "highest", "dot_f32_f32_f32": "highest"}
_LEVELS = ("default", "high", "highest")


def _at_precision(dtype: str, line: str) -> str:
    """`dtype`, or for a float32 matmul at a precision above the default `"f32@high"` /
    `"f32@highest"` (a TPU runs those as three and six bf16 passes; a GPU "highest"
    without tensor cores)."""
    if dtype != "f32":
        return dtype
    algorithm = _ALGORITHM.search(line)
    level = _ALGORITHMS.get(algorithm.group(1).lower(), "") if algorithm else ""
    found = _PRECISION.search(line)
    if found and not level:
        named = [p.strip(' "').lower() for p in found.group(1).split(",")]
        level = max((p for p in named if p in _LEVELS), key=_LEVELS.index, default="")
    return f"{dtype}@{level}" if level in ("high", "highest") else dtype


def matmul_flops(module, i, by_name) -> tuple[float, str]:
    """`(flops, operand dtype)` of matmul instruction `i` (or of the matmuls inside it);
    `by_name`: the instructions of `i`'s computation."""
    if i.opcode in ("dot", "convolution"):
        return dot_flops(i, by_name)
    if i.opcode in ("fusion", "call"):
        total, dtype = 0.0, "f32"
        for c in i.calls:
            inner = {j.name: j for j in module.computations.get(c, ())}
            for j in module.computations.get(c, ()):
                if j.opcode in ("dot", "convolution"):
                    f, dtype = dot_flops(j, inner)
                    total += f
                elif (j.opcode == "custom-call" and j.target == "tpu_custom_call") or (
                        j.opcode in ("fusion", "call") and j.calls):
                    # A Mosaic call XLA moved into a collective's continuation fusion, or
                    # a fusion nested in this one (the TPU compiler nests a matmul's
                    # fusion inside another's: a transposed operand's, say).
                    f, d = matmul_flops(module, j, inner)
                    if f:
                        total, dtype = total + f, d
        return total, dtype
    if i.opcode == "custom-call" and i.target.startswith("__cudnn$conv"):
        return _cudnn_conv_flops(i, by_name)
    contracting = _GEMM_CONTRACT.search(i.line)
    if contracting and i.operands and i.operands[0] in by_name:  # a cuBLAS GEMM
        (dtype, lhs), = _hlo.array_shapes(by_name[i.operands[0]].shape)[:1]
        out = _hlo.array_shapes(i.shape)[0][1]
        k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", contracting.group(1)))
        return 2.0 * math.prod(out) * k, _at_precision(dtype, i.line)
    found = _FLOPS.search(i.line)
    if found:  # a Pallas kernel's cost estimate
        arrays = [_hlo.array_shapes(by_name[o].shape) for o in i.operands if o in by_name]
        dtype = arrays[0][0][0] if arrays and arrays[0] else "bf16"
        return float(found.group(1)), dtype
    return _guessed_kernel_flops(i, by_name)


# Which of a cuDNN convolution call's operands (and its result, "out") is the forward
# convolution's input, kernel and output: its gradients are convolutions too, written
# with the forward's window and dim_labels (XLA's GPU convolution rewriter).
_CUDNN_ROLES = {"__cudnn$convBackwardInput": ("out", 1, 0),
                "__cudnn$convBackwardFilter": (0, "out", 1)}


def _cudnn_conv_flops(i, by_name) -> tuple[float, str]:
    """A cuDNN convolution's flops: the forward convolution's (as `dot_flops` counts a
    `convolution`), whichever of its three tensors the call computes."""
    result = _hlo.array_shapes(i.shape)[:1]
    tensors = []
    for r in _CUDNN_ROLES.get(i.target, (0, 1, "out")):
        o = None if r == "out" else by_name.get(i.operands[r]) if r < len(i.operands) else None
        shapes = result if r == "out" else _hlo.array_shapes(o.shape)[:1] if o else []
        tensors.append(shapes[0] if shapes else None)
    if not all(tensors) or _LABELS.search(i.line) is None:
        return 0.0, tensors[0][0] if tensors[0] else "f32"
    (dtype, lhs), _, (_, out) = tensors
    return _convolution_flops(lhs, out, i.line), _at_precision(dtype, i.line)


def _guessed_kernel_flops(i, by_name) -> tuple[float, str]:
    """A Pallas kernel whose estimate the lowering dropped (jax 0.10's Mosaic GPU and
    Triton lowerings do): `kernel_product`'s guess, or no matmul where it finds none."""
    found = kernel_product(i, by_name)
    if found is None:
        shapes = _pieces(i, by_name)
        return 0.0, shapes[0][0] if shapes else "bf16"
    m, n, k, count, dtype = found
    return 2.0 * m * n * k * count, dtype


def _pieces(i, by_name) -> list:
    """Kernel `i`'s 2-D operands as `(dtype, dims)`, less the buffer its result aliases
    and vectors of scales."""
    aliased = _aliased_operands(i.line)
    return [s for n, o in enumerate(i.operands) if o in by_name and n not in aliased
            for s in _hlo.array_shapes(by_name[o].shape) if len(s[1]) == 2
            and min(s[1]) > 1]


def kernel_product(i, by_name):
    """`(m, n, k, count, dtype)`: what a Pallas kernel with no cost estimate multiplies,
    guessed from its 2-D operands (`_pieces`: a step writing its product into a slice of
    the output, or adding it to an accumulator, reads that buffer but does not multiply
    it), or None.

    The step multiplies a left operand (m, k) by a right one (k', n), `count` times: k ==
    k', or one a multiple of the other (a step of a gather along the contraction
    multiplies a window of the longer one); m and n no more than the result's rows and
    columns (a step of a reduce-scatter multiplies the rows, or the columns, it sends).
    An exact contraction wins over a window, then the larger product; `count` is the
    number of operands of the left's (or the right's) shape, whichever is more (a
    bidirectional step's two pieces). A TPU kernel (fusedpar's runs a whole ring: every
    step, its transfers by remote DMA) multiplies for the whole result, and the whole
    contraction: the larger of each pair of sizes (a reduce-scatter's kernel multiplies
    every device's rows, and keeps its own)."""
    shapes = _pieces(i, by_name)
    out = [s for s in _hlo.array_shapes(i.shape) if len(s[1]) == 2]
    whole = i.target == "tpu_custom_call" and bool(out)
    rows, cols = out[0][1] if out else (math.inf, math.inf)
    best = None
    for a in shapes:
        for b in shapes:
            ka, kb = a[1][1], b[1][0]
            # Two pieces of one shape multiply each other only when square (k == k').
            if a is b or max(ka, kb) % min(ka, kb) or (a[1] == b[1] and ka != kb):
                continue
            same = [sum(s[1] == piece[1] for s in shapes) for piece in (a, b)]
            count = same[0] - 1 if a[1] == b[1] else max(same)
            m, n, k = ((max(a[1][0], rows), max(b[1][1], cols), max(ka, kb)) if whole
                       else (min(a[1][0], rows), min(b[1][1], cols), min(ka, kb)))
            # An 8-bit piece (a quantized block) is multiplied in the other's dtype.
            dtype = a[0] if a[0] == b[0] or not a[0][1:].startswith("8") else b[0]
            key = (ka == kb, m * n * k * count)
            if best is None or key > best[0]:
                best = (key, (m, n, k, count, dtype))
    return None if best is None else best[1]


def aliased_kernel_bytes(i, by_name):
    """The bytes a Pallas kernel moves when its result aliases an operand (a step that
    writes its product into a slice of the output, or adds it to an accumulator): its
    other operands, and its product read and written (an accumulator once, however
    many pieces add into it); None for any other instruction (its bytes are its
    operands' and its result's)."""
    if i.opcode != "custom-call" or not _aliased_operands(i.line):
        return None
    found = kernel_product(i, by_name)
    out = _hlo.array_shapes(i.shape)
    if found is None or not out:
        return None
    m, n, k, count, _ = found
    size = _hlo.shape_bytes(f"{out[0][0]}[1]")
    aliased = _aliased_operands(i.line)
    read = sum(_window_bytes(by_name[o], m * count, n * count, k)
               for j, o in enumerate(i.operands) if o in by_name and j not in aliased)
    # Pieces adding into one accumulator (the product covers the result) touch it once.
    whole = math.prod(out[0][1]) * size  # the product's buffer (not a kept one beside it)
    product = 2 * min(m * n * count * size, whole)
    return read + product + _kept_bytes(out[1:], m, n, k, count)


def _kept_bytes(kept, m, n, k, count) -> int:
    """The bytes a gather step writes into the further buffers its result aliases (the
    gathered operand, `matmul_into(kept=...)`): its pieces, `(m, k)` row blocks or `(k,
    n)` column blocks, each written once at its segment."""
    total = 0
    for dtype, dims in kept:
        size = _hlo.shape_bytes(f"{dtype}[1]")
        if len(dims) == 2 and dims[1] == k:
            total += m * k * count * size
        elif len(dims) == 2 and dims[0] == k:
            total += k * n * count * size
        else:  # not a gathered operand we know: all of it
            total += math.prod(dims) * size
    return total


def _window_bytes(operand, rows, cols, k) -> int:
    """The bytes a step kernel multiplying `rows` x `k` by `k` x `cols` reads of
    `operand`: a step of a reduce-scatter is handed the whole left (or right) operand and
    multiplies the rows (or columns) of its segment, a gather along the contraction a
    window of `k` of them; an operand of another shape is read whole."""
    arrays = _hlo.array_shapes(operand.shape)
    if len(arrays) != 1 or len(arrays[0][1]) != 2:
        return operand.bytes
    dtype, (r, c) = arrays[0]
    size = _hlo.shape_bytes(f"{dtype}[1]")
    windows = [operand.bytes]
    if c % k == 0:  # a left operand (r, k), or a wider one cut to a window of k columns
        windows.append(min(r, rows) * k * size)
    if r % k == 0:  # a right operand (k, c)
        windows.append(k * min(c, cols) * size)
    return min(windows)


# `output_to_operand_aliasing={{}: (3, {})}` (or `{{0}: (3, {}), {1}: (4, {})}`).
_ALIASING = re.compile(
    r"output_to_operand_aliasing=\{((?:\{[\d,]*\}:\s*\(\d+,\s*\{[\d,]*\}\),?\s*)*)\}")


def _aliased_operands(line: str) -> set:
    """Indices of the operands that instruction `line`'s result aliases."""
    found = _ALIASING.search(line)
    return {int(n) for n in re.findall(r"\((\d+),", found.group(1))} if found else set()


def dot_flops(i, by_name) -> tuple[float, str]:
    """`(flops, lhs dtype)` of a `dot` or `convolution` (`_convolution_flops`): 2 x output
    elements x the contraction."""
    out = _hlo.array_shapes(i.shape)
    lhs = by_name.get(i.operands[0]) if i.operands else None
    if not out or lhs is None:
        return 0.0, "f32"
    (ldtype, ldims), = _hlo.array_shapes(lhs.shape)[:1]
    if i.opcode == "dot":
        m = _CONTRACT.search(i.line)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else [len(ldims) - 1]
        return (2.0 * math.prod(out[0][1]) * math.prod(ldims[d] for d in dims),
                _at_precision(ldtype, i.line))
    return _convolution_flops(ldims, out[0][1], i.line), _at_precision(ldtype, i.line)


def _convolution_flops(lhs: list, out: list, line: str) -> float:
    """2 x output elements x the contraction of a convolution with input `lhs` and output
    `out` (dims as laid out in its `dim_labels`): its input features over its groups,
    times the window taps that fall on the input, on average per output position."""
    labels = _LABELS.search(line)
    lhs_labels = labels.group(1) if labels else ""
    k = lhs[lhs_labels.index("f")] if "f" in lhs_labels else lhs[-1]
    groups = _GROUPS.search(line)
    k /= int(groups.group(1)) if groups else 1
    window = _WINDOW.search(line)
    if window and labels:
        def spatial(labels, dims):
            return [dims[labels.index(d)] for d in sorted(c for c in labels if c.isdigit())]
        k *= _taps(window.group(1), spatial(lhs_labels, lhs), spatial(labels.group(3), out))
    return 2.0 * math.prod(out) * k


def _taps(window: str, inputs: list, outputs: list) -> float:
    """Window taps per output position that land on the input (not on its padding),
    averaged over the output positions, multiplied over the spatial dimensions."""
    fields = dict(re.findall(r"(\w+)=(\S+)", window))
    n = len(inputs)

    def field(name, default):
        values = fields.get(name)
        return [default] * n if values is None else values.split("x")

    sizes = [int(s) for s in field("size", "1")]
    strides = [int(s) for s in field("stride", "1")]
    pads = [tuple(int(p) for p in s.split("_")) for s in field("pad", "0_0")]
    lhs_dilation = [int(s) for s in field("lhs_dilate", "1")]
    rhs_dilation = [int(s) for s in field("rhs_dilate", "1")]
    total = 1.0
    for d in range(min(n, len(sizes), len(outputs))):
        extent = (inputs[d] - 1) * lhs_dilation[d] + 1  # the dilated input
        hits = 0
        for o in range(outputs[d]):
            for t in range(sizes[d]):
                at = o * strides[d] + t * rhs_dilation[d] - pads[d][0]
                hits += 0 <= at < extent and at % lhs_dilation[d] == 0
        total *= hits / max(outputs[d], 1)
    return total
