"""The bytes an HLO instruction reads and writes: windows of sliced operands, in-place
updates, and what a fusion only passes through (to its root tuple or a collective)."""

from __future__ import annotations

import math
import re
from typing import Optional

from ._hlo_kinds import is_collective
from ._hlo_parse import Instruction, Module, array_shapes, shape_bytes, tuple_elements

_SLICE = re.compile(r"\bslice=\{([^{}]*)\}")
# Library calls (cuBLAS, cuDNN) return their result and an s8 scratch workspace, which the
# library uses as it likes (the autotuner gave XLA's GEMMs 32 MiB on an H100, a deviceless
# compile 4 MiB): not bytes the kernel writes to HBM.
_LIBRARY_CALLS = ("__cublas$", "__cudnn$")


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
    fraction = 1.0
    for c in i.calls if i.opcode == "fusion" else ():
        windows.update(_sliced_parameters(module, c))
        windows.update((n, 0) for n, _ in _updated_in_place(module, c).values())
        fraction = _window_fraction(module, c)
    return sum(windows.get(n, round(o.bytes * fraction))
               for n, o in enumerate(operands) if o is not None)


_NOT_ELEMENTWISE = ("transpose", "reduce", "slice", "dynamic-slice", "gather",
                    "concatenate", "pad", "reverse")


def _elements(shape: str) -> int:
    return sum(math.prod(dims) for _, dims in array_shapes(shape))


def _window_fraction(module: Module, computation: str) -> float:
    """The fraction of the fused values a fused computation reads when its root is a
    window (`slice`, `dynamic-slice`) of a value computed elementwise from its parameters
    (a step's block of `gelu(buffer + bias)`, say): XLA's loop emitter computes, and so
    reads, only the window's elements. 1 when anything in the fusion is not elementwise
    over the window's operand (a reduce, a transpose, an inner slice)."""
    root = module.roots.get(computation)
    if root is None or root.opcode not in _WINDOWS:
        return 1.0
    inner = module.computations.get(computation, ())
    source = next((j for j in inner if j.name == root.operands[0]), None)
    if source is None or source.opcode == "parameter":  # `_sliced_parameters`' case
        return 1.0
    size = _elements(source.shape)
    parameters = {j.name for j in inner if j.opcode == "parameter"}
    for j in inner:
        if j is root or j.opcode in ("parameter", "constant"):
            continue
        if j.opcode in ("bitcast", "reshape") and j.operands[0] in parameters:
            continue  # a parameter's view (a dynamic-update-slice's update)
        if j.opcode in _NOT_ELEMENTWISE or _elements(j.shape) not in (size, 1):
            return 1.0
    return min(1.0, _elements(root.shape) / size) if size else 1.0


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


def _updated_in_place(module: Module, computation: str) -> dict:
    """`{root tuple element: (its buffer's parameter number, the update's bytes)}` for the
    elements of a fused computation's root tuple that are a dynamic-update-slice of a
    parameter used nowhere else: XLA updates that buffer in place (a loop's stacked
    residuals, one layer's slice an iteration), so the fusion neither reads it nor writes
    more than the update."""
    inner = module.computations.get(computation, ())
    root = module.roots.get(computation)
    if root is None or root.opcode != "tuple":
        return {}
    by_name = {j.name: j for j in inner}
    found = {}
    for u in inner:
        buffer = by_name.get(u.operands[0]) if u.operands else None
        update = by_name.get(u.operands[1]) if len(u.operands) > 1 else None
        if (u.opcode != "dynamic-update-slice" or u.name not in root.operands
                or update is None or buffer is None or buffer.opcode != "parameter"):
            continue
        number = _PARAMETER.search(buffer.line)
        if number and sum(buffer.name in j.operands for j in inner) == 1:
            found[u.name] = (int(number.group(1)), update.bytes)
    return found


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
    if i.opcode == "custom-call" and i.target.startswith(_LIBRARY_CALLS):
        arrays = array_shapes(i.shape)
        if len(arrays) > 1 and arrays[-1][0] == "s8":  # the library's scratch workspace
            return sum(shape_bytes(f"{dtype}[{','.join(map(str, dims))}]")
                       for dtype, dims in arrays[:-1])
    for c in i.calls if i.opcode == "fusion" else ():
        root = module.roots.get(c)
        if root is None or root.opcode != "tuple":
            continue
        inner = {j.name: j for j in module.computations.get(c, ())}
        in_place = _updated_in_place(module, c)  # these write their update only
        return sum(in_place[o][1] if o in in_place else inner[o].bytes
                   for o in root.operands if o in inner
                   and inner[o].opcode != "parameter" and not is_collective(inner[o]))
    return i.bytes


def sent_operands(i: Instruction, by_name: dict) -> list:
    """The operands collective `i` sends (None where one is not in `by_name`): all of a
    collective XLA merged from several (`all-reduce(a, b)`; on GPU the values and scales
    of a quantized ppermute in one collective-permute of two arrays), only the input of
    an in-place collective-permute (input, output buffer, and two tuples of integer
    offsets) or of a send (its token), and of a fusion wrapping a collective (the TPU
    compiler's: its other operands feed the work beside it)."""
    operands = [by_name.get(name) for name in i.operands]
    if i.opcode.startswith(("send", "fusion")):
        return operands[:1]
    if (i.opcode.startswith("collective-permute") and len(operands) == 4
            and all(o is not None and {d for d, _ in array_shapes(o.shape)}
                    <= {"s32", "u32", "s64"} for o in operands[2:])):
        return operands[:1]
    return operands


def operand_bytes(i: Instruction, by_name: dict) -> int:
    """Bytes collective `i` sends per device (`sent_operands`); its own first array's
    where an operand is not in `by_name` (a parameter of another computation)."""
    operands = sent_operands(i, by_name)
    if operands and all(o is not None for o in operands):
        return sum(o.bytes for o in operands)
    arrays = array_shapes(i.shape)
    if not arrays:
        return 0
    dtype, dims = arrays[0]
    return shape_bytes(f"{dtype}[{','.join(map(str, dims))}]")


def dma_bytes(i: Instruction, by_name: dict) -> int:
    """Bytes an asynchronous copy or slice moves: its operand, or the slice's window."""
    operand = by_name.get(i.operands[0]) if i.operands else None
    arrays = array_shapes(operand.shape if operand is not None else i.shape)
    if not arrays:
        return 0
    dtype, dims = arrays[0]
    window = _SLICE.search(i.line) if i.opcode == "slice-start" else None
    if window:
        ranges = re.findall(r"\[(\d+):(\d+)(?::(\d+))?\]", window.group(1))
        dims = [-(-(int(hi) - int(lo)) // int(step or 1)) for lo, hi, step in ranges]
    return shape_bytes(f"{dtype}[{','.join(map(str, dims))}]")


# Host memory in a layout (`{1,0:S(5)}`): arrays a program offloads (activations saved for
# the backward pass in pinned host memory).
_HOST = re.compile(r"\bS\(5\)")


def host_transfer(i: Instruction, by_name: dict) -> Optional[tuple]:
    """`(bytes, "to host" or "from host")` of an asynchronous start that moves data
    between device memory and host memory (an offloaded array, an update of one, or a
    slice read back of it), else None. A `copy-start`'s tuple is (destination, source,
    context); any other start's (operands, result, context)."""
    if not i.opcode.endswith("-start") or is_collective(i) or not _HOST.search(i.shape):
        return None
    elements = tuple_elements(i.shape)
    if i.opcode == "copy-start" and len(elements) > 2:
        to_host = bool(_HOST.search(elements[0]))
        return shape_bytes(elements[1 if to_host else 0]), "to host" if to_host else "from host"
    result = elements[1] if len(elements) > 2 else i.shape
    if _HOST.search(result):  # written to host memory: the operands not already there
        moved = [by_name[o].shape for o in i.operands if o in by_name
                 and not _HOST.search(by_name[o].shape)]
        nbytes = sum(shape_bytes(s) for s in moved if array_shapes(s)
                     and array_shapes(s)[0][1])
        return nbytes, "to host"
    return shape_bytes(result), "from host"
