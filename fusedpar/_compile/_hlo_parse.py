"""Parsing a scheduled HLO module's text into computations of `Instruction`s, and the
sizes of the shapes it prints (layouts and TPU tiles included)."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

COLLECTIVES = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce",
               "all-to-all", "collective-broadcast", "ragged-all-to-all")
# Custom calls that are matmuls: cuBLAS, and Pallas kernels (every kernel this package
# builds multiplies).
MATMUL_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt", "mosaic_gpu",
                  "__gpu$xla.gpu.triton", "__triton", "tpu_custom_call", "__cudnn$conv")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2,
                "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
                "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-$]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
# `calls=%f`, `body=%b`, `condition=%c`, `to_apply=%r`, a predicated conditional's
# `true_computation=%t, false_computation=%f`, and the braced lists of `calls={%a, %b}` /
# `branch_computations={%t, %f}`: one name, or a list in braces (a plain comma after a
# name starts the next attribute: `condition=%c, body=%b`).
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|true_computation"
                    r"|false_computation)=(\{[^{}]*\}|%?[\w.\-$]+)")
_DEVICE_COUNTS = re.compile(r"\b(?:num_partitions|replica_count)=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `name = shape opcode(operands), attributes`."""

    name: str
    opcode: str
    shape: str
    operands: tuple
    calls: tuple
    op_name: str
    target: str
    line: str

    @property
    def bytes(self) -> int:
        """Bytes of the result (every array of a tuple)."""
        return shape_bytes(self.shape)


@dataclasses.dataclass
class Module:
    """A parsed HLO module: computations by name, each its instructions in order, and
    the name of each computation's ROOT instruction."""

    computations: dict
    entry: Optional[str]
    roots: dict = dataclasses.field(default_factory=dict)
    # Devices the program runs on (`num_partitions` x `replica_count` of its header): the
    # members of a collective whose replica groups are `{}` (all of them).
    devices: int = 1

    def instruction(self, name: str) -> Optional[Instruction]:
        for instructions in self.computations.values():
            for i in instructions:
                if i.name == name:
                    return i
        return None


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (`bf16[8,128]{1,0}` or a tuple of them)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(_strip_layouts(shape)):
        if dtype not in _DTYPE_BYTES:
            continue
        total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return int(total)


_LAID_OUT = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](?:\{([^{}]*)\})?")
_TILE = re.compile(r"T\(([\d,]+)\)")


def laid_out_bytes(shape: str) -> int:
    """Bytes of every array of an HLO shape as laid out in memory: a tiled layout
    (`{1,0:T(8,128)}`, TPU) pads the most minor dimensions to whole tiles (an f32[512,1]
    laid out `{1,0:T(8,128)}` takes 128 lanes a row; `{0,1:T(1,128)}` takes none). No
    tile (GPU, CPU): the logical bytes, as `shape_bytes`."""
    total = 0.0
    for dtype, dims, layout in _LAID_OUT.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        dims = [int(d) for d in dims.split(",") if d]
        minor_to_major, _, tiling = (layout or "").partition(":")
        tile = _TILE.search(tiling)
        if tile and minor_to_major:
            order = [int(d) for d in minor_to_major.split(",")]
            tile_dims = [int(t) for t in tile.group(1).split(",")]
            for dim, t in zip(order, reversed(tile_dims)):  # the tile's last dim is minor
                dims[dim] = -(-dims[dim] // t) * t
        total += _DTYPE_BYTES[dtype] * int(np.prod(dims))
    return int(total)


def array_shapes(shape: str) -> list:
    """The arrays of an HLO shape as `(dtype, dims)` pairs, in order."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(_strip_layouts(shape))]


def _strip_layouts(text: str) -> str:
    """Drop `{...}` layouts (their `T(8,128)` tiles look like dims otherwise)."""
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def tuple_elements(shape: str) -> list:
    """The elements of a tuple shape `(a, (b, c), d)`, each as written (a shape that is not
    a tuple: itself)."""
    parts, depth, start = [], 0, 1
    for k, ch in enumerate(shape):
        depth += ch in "({["
        depth -= ch in ")}]"
        if ch == "," and depth == 1:
            parts.append(shape[start:k].strip())
            start = k + 1
    return parts + [shape[start:-1].strip()] if shape.startswith("(") else [shape]


def _split_shape(rest: str) -> tuple[str, str]:
    """`(shape, the text after it)` from the right-hand side of an instruction."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch in "({"
            depth -= ch in ")}"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    # A shape with a layout can hold spaces only inside braces: find the first space
    # outside them.
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "{"
        depth -= ch == "}"
        if ch == " " and depth == 0:
            return rest[:i], rest[i + 1:].lstrip()
    return rest, ""


def _operands(text: str) -> tuple[tuple, str]:
    """`(operand names, the attributes after the closing parenthesis)` of `op(...)...`."""
    depth, i = 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and ch == ")":
            break
    inner = re.sub(r"/\*.*?\*/", "", text[1:i])
    names = tuple(m.group(1) for m in re.finditer(r"%([\w.\-$]+)", inner))
    return names, text[i + 1:]


def parse_instruction(line: str) -> Optional[Instruction]:
    body = line.strip()
    if body.startswith("ROOT "):
        body = body[5:]
    if " = " not in body or not body.startswith("%"):
        return None
    name, rest = body.split(" = ", 1)
    shape, rest = _split_shape(rest)
    m = re.match(r"([\w\-]+)(\(.*)$", rest)
    if not m:
        return None
    opcode = m.group(1)
    operands, attributes = _operands(m.group(2))
    calls = tuple(c.strip().lstrip("%") for _, group in _CALLS.findall(attributes)
                  for c in group.strip("{}").split(",") if c.strip())
    op_name = _OP_NAME.search(attributes)
    target = _TARGET.search(attributes)
    return Instruction(name.lstrip("%"), opcode, shape, operands, calls,
                       op_name.group(1) if op_name else "",
                       target.group(1) if target else "", line)


# A quoted attribute value: no raw quote inside (MLIR prints one as `\22`), any escape.
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def _unclosed(line: str) -> bool:
    """Whether instruction text `line` goes on past its end: a brace it opened is not
    closed, or a quoted string is. Braces inside quoted strings do not count: a Mosaic GPU
    call carries its kernel as MLIR bytecode in a string (`module = "ML\\EFR..."`), whose
    bytes print as they are where printable, `{` and `}` among them, unbalanced as often
    as not (which bytes come out depends even on where the package is installed)."""
    bare = _QUOTED.sub('""', line)
    return bare.count('"') % 2 == 1 or bare.count("{") > bare.count("}")


def parse(text: str) -> Module:
    """Parse a scheduled HLO module's text."""
    computations, roots, entry, current, devices = {}, {}, None, None, 1
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("HloModule "):
            for count in _DEVICE_COUNTS.findall(line):
                devices *= int(count)
            continue
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
            continue
        # A computation ends at a brace in the first column; one run on another
        # execution thread says which after it (`}, execution_thread="sparsecore"`: the
        # TPU compiler's collectives offloaded to the SparseCores).
        if line.startswith("}"):
            current = None
            continue
        # An attribute can hold line breaks (a Pallas TPU call's `kernel_metadata`): the
        # instruction goes on until its braces close.
        while _unclosed(line):
            more = next(lines, None)
            if more is None:
                break
            line += " " + more.strip()
        instruction = parse_instruction(line)
        if instruction is not None:
            computations[current].append(instruction)
            if line.lstrip().startswith("ROOT "):
                roots[current] = instruction
    return Module(computations, entry, roots, devices)
