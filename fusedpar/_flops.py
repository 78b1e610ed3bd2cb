"""The floating-point operations of a matmul instruction of a scheduled HLO module, read
from its shapes: a `dot`, a `convolution` (the TPU compiler writes matmuls as
convolutions, some with a window: only the taps that land on the input count, not those
on its padding), a fusion or call around them, a cuBLAS GEMM, or a Pallas kernel (its
cost estimate, or a guess from its operands when the lowering dropped it).
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
        return total, dtype
    contracting = _GEMM_CONTRACT.search(i.line)
    if contracting and i.operands and i.operands[0] in by_name:  # a cuBLAS GEMM
        (dtype, lhs), = _hlo.array_shapes(by_name[i.operands[0]].shape)[:1]
        out = _hlo.array_shapes(i.shape)[0][1]
        k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", contracting.group(1)))
        return 2.0 * math.prod(out) * k, dtype
    found = _FLOPS.search(i.line)
    if found:  # a Pallas kernel's cost estimate
        arrays = [_hlo.array_shapes(by_name[o].shape) for o in i.operands if o in by_name]
        dtype = arrays[0][0][0] if arrays and arrays[0] else "bf16"
        return float(found.group(1)), dtype
    return _guessed_kernel_flops(i, by_name)


def _guessed_kernel_flops(i, by_name) -> tuple[float, str]:
    """A Pallas kernel whose estimate the lowering dropped (jax 0.10's Mosaic GPU and
    Triton lowerings do): the step multiplies the smallest product its operands chain
    into (a window of the left one's columns allowed), once per operand of that shape (a
    bidirectional step's two pieces), and no more than its result's rows x columns x a
    matching contraction (a kernel writing into a slice of an aliased buffer has the
    whole buffer as its result)."""
    shapes = [s for o in i.operands if o in by_name
              for s in _hlo.array_shapes(by_name[o].shape) if len(s[1]) == 2]
    dtype = shapes[0][0] if shapes else "bf16"
    pairs = [(2.0 * a[1][0] * b[1][0] * b[1][1], a) for a in shapes for b in shapes
             if a is not b and b[1][0] and a[1][1] % b[1][0] == 0]
    if not pairs:
        return 0.0, dtype
    flops, piece = min(pairs, key=lambda p: p[0])
    flops *= sum(s[1] == piece[1] for s in shapes)
    out = [s for s in _hlo.array_shapes(i.shape) if len(s[1]) == 2]
    if out:
        m, n = out[0][1]
        bounds = [2.0 * m * n * b[1][0] for b in shapes if b[1][1] == n]
        flops = min([flops] + bounds)
    return flops, dtype


def dot_flops(i, by_name) -> tuple[float, str]:
    """`(flops, lhs dtype)` of a `dot` or `convolution`: 2 x output elements x the
    contraction (a convolution's input features over its groups, times the window taps
    that fall on the input, on average per output position)."""
    out = _hlo.array_shapes(i.shape)
    lhs = by_name.get(i.operands[0]) if i.operands else None
    if not out or lhs is None:
        return 0.0, "f32"
    (ldtype, ldims), = _hlo.array_shapes(lhs.shape)[:1]
    if i.opcode == "dot":
        m = _CONTRACT.search(i.line)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else [len(ldims) - 1]
        return 2.0 * math.prod(out[0][1]) * math.prod(ldims[d] for d in dims), ldtype
    labels = _LABELS.search(i.line)
    lhs_labels = labels.group(1) if labels else ""
    k = ldims[lhs_labels.index("f")] if "f" in lhs_labels else ldims[-1]
    groups = _GROUPS.search(i.line)
    k /= int(groups.group(1)) if groups else 1
    window = _WINDOW.search(i.line)
    if window and labels:
        out_labels = labels.group(3)
        out_spatial = [out[0][1][out_labels.index(d)] for d in sorted(c for c in out_labels
                                                                      if c.isdigit())]
        spatial = [ldims[lhs_labels.index(d)] for d in sorted(c for c in lhs_labels
                                                              if c.isdigit())]
        k *= _taps(window.group(1), spatial, out_spatial)
    return 2.0 * math.prod(out[0][1]) * k, ldtype


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
