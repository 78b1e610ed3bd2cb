"""Reading a scheduled HLO module (`compiled.as_text()`): computations, instructions, bytes.

The text of a compiled program lists each computation's instructions in the order the
scheduler chose, so it says what runs while a transfer is in flight. This module only
parses; `fusedpar.aot` decides what overlaps. It reads both dialects this package is
compiled for:

- GPU: matmuls are `kCustom` fusions around a `dot` (Triton GEMMs), `__cublas$...`
  custom calls, and the Pallas kernels' `mosaic_gpu` / Triton custom calls;
- TPU: matmuls are `convolution`s (usually inside fusions), Pallas kernels are
  `tpu_custom_call`s; shapes carry layouts like `{1,0:T(8,128)(2,1)}` and long operand
  lists carry `/*index=5*/` comments.

Asynchronous collectives are `<kind>-start` ... `<kind>-done` pairs (or `async-start` /
`async-done` around a computation holding the collective). It also reads what XLA's own
programs (GSPMD, Shardy, its collective matmul) are made of: `while` loops whose trip
count is in their condition (`trip_count`), and replica groups in each syntax XLA prints
(`replica_groups`: listed, iota, mesh axes).
"""

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
                  "__gpu$xla.gpu.triton", "__triton", "tpu_custom_call")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2,
                "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
                "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-$]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
# `calls=%f`, `body=%b`, `condition=%c`, `to_apply=%r`, and the braced lists of
# `calls={%a, %b}` / `branch_computations={%t, %f}`: one name, or a list in braces (a
# plain comma after a name starts the next attribute: `condition=%c, body=%b`).
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|branch_computations)="
                    r"(\{[^{}]*\}|%?[\w.\-$]+)")
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


def parse(text: str) -> Module:
    """Parse a scheduled HLO module's text."""
    computations, roots, entry, current, devices = {}, {}, None, None, 1
    for line in text.splitlines():
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
        if line.strip() == "}":
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            computations[current].append(instruction)
            if line.lstrip().startswith("ROOT "):
                roots[current] = instruction
    return Module(computations, entry, roots, devices)


def in_place_bytes(module: Module, i: Instruction, by_name: dict) -> Optional[int]:
    """The bytes of the update when `i` updates a buffer in place (a dynamic-update-slice,
    alone or as the root of its fusion), else None: it moves the update, not the buffer."""
    if i.opcode == "dynamic-update-slice":
        update = by_name.get(i.operands[1]) if len(i.operands) > 1 else None
        return None if update is None else update.bytes
    if i.opcode not in ("fusion", "fusion-start"):  # fusion-start: XLA's asynchronous fusion
        return None
    for c in i.calls:
        root = module.roots.get(c)
        if root is not None and root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
            inner = {j.name: j for j in module.computations.get(c, ())}
            update = inner.get(root.operands[1])
            if update is not None:
                return update.bytes
    return None


_WINDOWS = ("slice", "dynamic-slice")
_PARAMETER = re.compile(r"\bparameter\((\d+)\)")


def read_bytes(module: Module, i: Instruction, by_name: dict) -> int:
    """The bytes `i` reads from memory: each operand's, except that an operand only
    sliced (a `slice` or `dynamic-slice`, alone or inside the fusion) is read only
    where the windows are: slicing one block out of a gathered buffer reads the block;
    and an operand a fusion only passes through (to its root tuple, or to a collective
    whose transfer the DMA engines make) is not read by the fusion at all."""
    operands = [by_name.get(o) for o in i.operands]
    if i.opcode in _WINDOWS:
        return i.bytes + sum(o.bytes for o in operands[1:] if o is not None)
    windows = {}  # fused parameter number -> bytes its slices read (only-sliced ones)
    for c in i.calls if i.opcode == "fusion" else ():
        windows.update(_sliced_parameters(module, c))
    return sum(windows.get(n, o.bytes) for n, o in enumerate(operands) if o is not None)


def _sliced_parameters(module: Module, computation: str, depth: int = 0) -> dict:
    """`{parameter number: bytes read}` for the parameters of a fused computation that
    are only read through slices: by `slice` / `dynamic-slice` instructions, or as the
    operand of a nested fusion that only slices it (the TPU compiler wraps a step's
    dynamic-slice in a loop fusion inside the matmul's fusion)."""
    inner = module.computations.get(computation, ())
    root = module.roots.get(computation)
    found = {}
    for j in inner:
        number = _PARAMETER.search(j.line) if j.opcode == "parameter" else None
        users = [u for u in inner if j.name in u.operands]
        if not number or not users:
            continue
        read = 0
        for u in users:
            if _passes_through(u, root):
                continue
            if u.opcode in _WINDOWS and u.operands[0] == j.name:
                read += u.bytes
                continue
            nested = (_sliced_parameters(module, u.calls[0], depth + 1)
                      if u.opcode == "fusion" and u.calls and depth < 4 else {})
            positions = [k for k, o in enumerate(u.operands) if o == j.name]
            if positions and all(k in nested for k in positions):
                read += sum(nested[k] for k in positions)
                continue
            read = None
            break
        if read is not None:
            found[int(number.group(1))] = read
    return found


def is_collective(i: Instruction) -> bool:
    """Whether `i` is a collective (`COLLECTIVES`) or the start of one."""
    return i.opcode.replace("-start", "") in COLLECTIVES


def _passes_through(user: Instruction, root: Optional[Instruction]) -> bool:
    """Whether a fused computation's `user` of a value moves it without the compute
    units: the root tuple returning it as it is (an output aliased to the operand, as
    in the TPU compiler's asynchronous collective fusions, which thread the
    collective's buffers through the matmuls running beside it), or a collective,
    whose bytes the DMA engines move and the replay counts as a transfer."""
    return ((user is root and user.opcode == "tuple")
            or is_collective(user))


def written_bytes(module: Module, i: Instruction) -> int:
    """The bytes `i` writes: its result's, less the parts of a fusion's tuple result that
    its computation passes through from a parameter or takes from a collective (see
    `_passes_through`)."""
    for c in i.calls if i.opcode == "fusion" else ():
        root = module.roots.get(c)
        if root is None or root.opcode != "tuple":
            continue
        inner = {j.name: j for j in module.computations.get(c, ())}
        return sum(inner[o].bytes for o in root.operands if o in inner
                   and inner[o].opcode != "parameter" and not is_collective(inner[o]))
    return i.bytes


def collective_kind(module: Module, instruction: Instruction) -> Optional[str]:
    """The collective an instruction starts or is (`COLLECTIVES`), else None."""
    op = instruction.opcode
    for kind in COLLECTIVES:
        if op in (kind, kind + "-start"):
            return kind
    if op == "async-start" or is_async_start(instruction):
        inner = collective_inside(module, instruction)
        return None if inner is None else inner.opcode.replace("-start", "")
    if op == "fusion" and not instruction.name.startswith("async-collective-done"):
        return _fused_collective(module, instruction)
    return None


def _fused_collective(module: Module, fusion: Instruction) -> Optional[str]:
    """The synchronous collective a fusion is, else None. The TPU compiler wraps a
    reduce-scatter in a fusion (`%all-reduce-scatter`: an all-reduce of the padded input
    and the slice each device keeps); a fusion with a matmul beside its collective is a
    step of an asynchronous collective fusion (its transfer is the start's)."""
    inner = list(_inside(module, fusion))
    collective = next((j for j in inner if j.opcode in COLLECTIVES), None)
    if collective is None or any(_is_matmul_itself(j) for j in inner):
        return None
    root = module.roots.get(fusion.calls[0]) if fusion.calls else None
    if collective.opcode == "all-reduce" and root is not None and root.opcode == "dynamic-slice":
        return "reduce-scatter"
    return collective.opcode


def _inside(module: Module, instruction: Instruction):
    """The instructions of the computations `instruction` calls, and of those they call,
    breadth first (each computation once)."""
    stack, seen = list(instruction.calls), set()
    while stack:
        c = stack.pop(0)
        if c in seen:
            continue
        seen.add(c)
        for inner in module.computations.get(c, ()):
            yield inner
            stack.extend(inner.calls)


def collective_inside(module: Module, instruction: Instruction) -> Optional[Instruction]:
    """The collective instruction an async wrapper runs (its replica groups, its
    op_name), found through the computations it calls; None if there is none."""
    return next((inner for inner in _inside(module, instruction) if is_collective(inner)),
                None)


def op_name(module: Module, i: Instruction) -> str:
    """`i`'s op_name, or (a wrapper without one, like a TPU async collective fusion) the
    op_name of the first instruction inside it that has one."""
    if i.op_name:
        return i.op_name
    return next((inner.op_name for inner in _inside(module, i) if inner.op_name and
                 inner.opcode not in ("parameter", "get-tuple-element", "tuple", "bitcast")),
                "")


def is_async_start(i: Instruction) -> bool:
    """Whether `i` starts an asynchronous operation: `<op>-start`, or the TPU compiler's
    `async-collective-start` fusion (whose computation holds the collective)."""
    return i.opcode.endswith("-start") or (
        i.opcode == "fusion" and i.name.startswith("async-collective-start"))


def started_by(i: Instruction, by_name: dict) -> Optional[str]:
    """The name of the start an asynchronous done `i` finishes (`<op>-done(start)`, or a
    TPU `async-collective-done` fusion of the start's tuple elements), else None."""
    if i.opcode.endswith("-done") and i.operands:
        return i.operands[0]
    if i.opcode == "fusion" and i.name.startswith("async-collective-done"):
        for name in i.operands:
            source = by_name.get(name)
            while source is not None and source.opcode == "get-tuple-element":
                name = source.operands[0] if source.operands else None
                source = by_name.get(name)
            if source is not None and is_async_start(source):
                return source.name
    return None


def matmul_computations(module: Module) -> set:
    """Names of the computations that multiply, directly or through what they call."""
    direct = {name for name, instructions in module.computations.items()
              if any(_is_matmul_itself(i) for i in instructions)}
    changed = True
    while changed:
        changed = False
        for name, instructions in module.computations.items():
            if name not in direct and any(c in direct for i in instructions for c in i.calls):
                direct.add(name)
                changed = True
    return direct


def _is_matmul_itself(i: Instruction) -> bool:
    if i.opcode in ("dot", "convolution", "ragged-dot"):
        return True
    return i.opcode == "custom-call" and any(t in i.target for t in MATMUL_TARGETS)


def is_matmul(i: Instruction, multiplying: set) -> bool:
    """Whether instruction `i` runs a matmul (itself, or inside a fusion/call/loop it
    runs); `multiplying` is `matmul_computations(module)`."""
    if _is_matmul_itself(i):
        return True
    if i.opcode in ("fusion", "call", "while", "conditional"):
        return any(c in multiplying for c in i.calls)
    return False


def scheduled_computations(module: Module) -> list:
    """The computations that have a schedule of their own: the entry, loop bodies and
    conditions, called computations and branches — not fusion bodies (they run inside
    their fusion's kernel) nor the bodies of async wrappers and reductions."""
    inside = set()
    for instructions in module.computations.values():
        for i in instructions:
            if i.opcode not in ("while", "call", "conditional"):
                inside.update(i.calls)
    return [name for name in module.computations if name not in inside]


def dataflow(instructions) -> tuple[list, list]:
    """Each instruction's ancestors and descendants in its computation's dataflow, as
    bitsets (Python ints, bit `k` for `instructions[k]`). The instructions of a
    scheduled computation are listed in an order where operands come first."""
    index = {i.name: k for k, i in enumerate(instructions)}
    operands = [[index[o] for o in i.operands if o in index] for i in instructions]
    ancestors = [0] * len(instructions)
    for k, ops in enumerate(operands):
        for o in ops:
            ancestors[k] |= ancestors[o] | (1 << o)
    descendants = [0] * len(instructions)
    for k in range(len(instructions) - 1, -1, -1):
        for o in operands[k]:
            descendants[o] |= descendants[k] | (1 << k)
    return ancestors, descendants


# -- loops --------------------------------------------------------------------------------

_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_INDEX = re.compile(r"\bindex=(\d+)")
_CONSTANT = re.compile(r"\bconstant\((-?\d+)\)")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
# Instructions that pass a scalar counter on unchanged.
_SAME_VALUE = ("copy", "convert", "bitcast", "bitcast-convert", "reshape")


def loop_parts(loop: Instruction) -> tuple[Optional[str], Optional[str]]:
    """`(condition, body)`: the computations a `while` instruction names."""
    found = dict(re.findall(r"\b(condition|body)=%?([\w.\-$]+)", loop.line))
    return found.get("condition"), found.get("body")


def trip_count(module: Module, loop: Instruction, by_name: dict) -> Optional[int]:
    """How many times `loop` (a `while` of the computation whose instructions are
    `by_name`) runs its body: XLA's `known_trip_count` when it says, else read from the
    loop itself — the condition's compare of a counter in the loop's tuple with a
    constant (`counter < 4`), the counter's initial value in the tuple the loop starts
    from, and its step in the body (`counter + 2` in a loop XLA widened to run two
    iterations at once). None when the loop is not of that form."""
    known = _TRIP.search(loop.line)
    if known:
        return int(known.group(1))
    condition, body = loop_parts(loop)
    compare = module.roots.get(condition)
    if compare is None or compare.opcode != "compare" or len(compare.operands) != 2:
        return None
    inner = {i.name: i for i in module.computations.get(condition, ())}
    direction = _DIRECTION.search(compare.line)
    direction = direction.group(1) if direction else ""
    a, b = compare.operands
    index, limit = _tuple_index(inner, a), _constant_value(inner, b)
    if index is None or limit is None:  # `limit > counter`: the same compare mirrored
        index, limit = _tuple_index(inner, b), _constant_value(inner, a)
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    start = by_name.get(loop.operands[0]) if loop.operands else None
    if index is None or limit is None or start is None or start.opcode != "tuple" \
            or index >= len(start.operands):
        return None
    first = _constant_value(by_name, start.operands[index])
    step = _step(module, body, index)
    if first is None or not step:
        return None
    span = limit - first
    if direction == "LT" and step > 0:
        return max(0, -(-span // step))
    if direction == "LE" and step > 0:
        return max(0, span // step + 1)
    if direction == "GT" and step < 0:
        return max(0, -(-span // step))
    if direction == "GE" and step < 0:
        return max(0, span // step + 1)
    if direction == "NE" and span % step == 0 and span // step >= 0:
        return span // step
    return None


def _through(by_name: dict, name: str) -> Optional[Instruction]:
    """The instruction `name` is, looking through copies and conversions of a scalar."""
    i = by_name.get(name)
    while i is not None and i.opcode in _SAME_VALUE and i.operands:
        i = by_name.get(i.operands[0])
    return i


def _constant_value(by_name: dict, name: str) -> Optional[int]:
    i = _through(by_name, name)
    m = _CONSTANT.search(i.line) if i is not None and i.opcode == "constant" else None
    return int(m.group(1)) if m else None


def element_index(i: Instruction) -> Optional[int]:
    """The tuple element a `get-tuple-element` reads."""
    m = _INDEX.search(i.line) if i.opcode == "get-tuple-element" else None
    return int(m.group(1)) if m else None


def _tuple_index(by_name: dict, name: str) -> Optional[int]:
    """`k` when `name` is element `k` of the computation's parameter tuple."""
    i = _through(by_name, name)
    if i is None or i.opcode != "get-tuple-element" or not i.operands:
        return None
    source = by_name.get(i.operands[0])
    return element_index(i) if source is not None and source.opcode == "parameter" else None


def _step(module: Module, body: Optional[str], index: int) -> Optional[int]:
    """What the loop body adds to element `index` of its tuple each iteration."""
    root = module.roots.get(body)
    inner = {i.name: i for i in module.computations.get(body, ())}
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    update = _through(inner, root.operands[index])
    if update is None or update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None
    x, y = update.operands
    sign = 1 if update.opcode == "add" else -1
    if _tuple_index(inner, x) == index and _constant_value(inner, y) is not None:
        return sign * _constant_value(inner, y)
    if update.opcode == "add" and _tuple_index(inner, y) == index:
        return _constant_value(inner, x)
    return None


# -- who talks to whom --------------------------------------------------------------------

# A collective-permute's pairs, or those of a send / recv (a frontend attribute).
_PAIRS = re.compile(r"(?:_xla_send_recv_)?source_target_pairs=\"?\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\(([^)]*)\))?\s*\{([^{}]*)\}")


def source_target_pairs(i: Instruction) -> Optional[list]:
    """The `(source, target)` device pairs of a collective-permute (or of a send or recv
    XLA split one into), None if it names none."""
    m = _PAIRS.search(i.line)
    if not m:
        return None
    return [(int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]


def replica_groups(i: Instruction, devices: int) -> Optional[list]:
    """The groups of devices a collective runs over, each a list of device ids, from
    any of the forms XLA prints: listed (`{{0,1},{2,3}}`; `{}` is all `devices`),
    iota (`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`: the iota reshaped, transposed, cut into
    groups) or mesh axes (`mesh['x'=2,'y'=4] {'y'}`, as GSPMD and Shardy print them: the
    devices that differ only along the named axes; `'y':(1)2` names a sub-axis).
    None when the instruction has no groups XLA prints in these forms."""
    m = _GROUPS_LISTED.search(i.line)
    if m:
        groups = [[int(d) for d in g.split(",") if d]
                  for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return groups or [list(range(devices))]
    m = _GROUPS_IOTA.search(i.line)
    if m:
        count, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        perm = [int(d) for d in m.group(4).split(",")] if m.group(4) else range(len(dims))
        ids = np.arange(int(np.prod(dims))).reshape(dims).transpose(list(perm))
        return ids.reshape(count, size).tolist()
    m = _GROUPS_MESH.search(i.line)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    return None


def _mesh_groups(axes_text: str, ids_text: Optional[str], grouped_text: str) -> list:
    """The groups of a mesh-form device list (`xla/hlo/ir/replica_group.cc`): the mesh's
    device array reshaped so that each named (sub-)axis is a dimension of its own, those
    dimensions moved last in the order named, then cut into groups."""
    axes = [(name, int(size)) for name, size in re.findall(r"'?([^',=\s]+)'?=(\d+)", axes_text)]
    names = [name for name, _ in axes]
    total = int(np.prod([size for _, size in axes]))
    ids = ([int(d) for d in re.findall(r"\d+", ids_text)] if ids_text else list(range(total)))
    grouped = [(name, int(pre) if pre else None, int(size) if size else None)
               for name, pre, size in re.findall(r"'?([^',:\s]+)'?(?::\((\d+)\)(\d+))?",
                                                 grouped_text)]
    dims, keep = [], []  # the reshaped array's dims; dims (by position) grouped, in order
    order = {}
    for axis, (name, size) in enumerate(axes):
        refs = sorted((g for g in grouped if g[0] == name), key=lambda g: g[1] or 0)
        if not refs:
            dims.append(size)
            continue
        if refs[0][1] is None:  # the whole axis
            order[(name, None)] = len(dims)
            dims.append(size)
            continue
        covered = 1
        for _, pre, sub in refs:
            if pre != covered:  # a part of the axis no reference names
                dims.append(pre // covered)
                covered = pre
            order[(name, pre)] = len(dims)
            dims.append(sub)
            covered *= sub
        if covered != size:
            dims.append(size // covered)
    for name, pre, _ in grouped:
        keep.append(order[(name, pre)])
    rest = [d for d in range(len(dims)) if d not in keep]
    array = np.array(ids).reshape(dims).transpose(rest + keep)
    size = int(np.prod([dims[d] for d in keep]))
    return array.reshape(-1, size).tolist()
