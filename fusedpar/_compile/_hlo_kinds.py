"""What an HLO instruction is: a collective (and which), the start or done of an
asynchronous one, a matmul; which computations have a schedule of their own, and the
dataflow within one."""

from __future__ import annotations

import re
from typing import Optional

from ._hlo_loops import element_index
from ._hlo_parse import COLLECTIVES, MATMUL_TARGETS, Instruction, Module


def ring_factor(kind: str, n: int) -> float:
    """The bytes one device of a ring of `n` sends for a collective of `kind`, per byte of
    its operands: an all-gather the n - 1 other blocks, an all-reduce a reduce-scatter
    and an all-gather of (n - 1) / n each, a reduce-scatter or an all-to-all (n - 1) / n
    (a collective-permute: its operands, 1)."""
    if kind == "collective-permute":
        return 1.0
    return {"all-gather": n - 1, "all-reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)


def is_collective(i: Instruction) -> bool:
    """Whether `i` is a collective (`COLLECTIVES`) or the start of one."""
    return i.opcode.replace("-start", "") in COLLECTIVES


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
    and the slice each device keeps); a fusion with a matmul beside its collective, or
    that XLA names a continuation, is a step of an asynchronous collective
    fusion (its transfer is the start's)."""
    inner = list(_inside(module, fusion))
    collective = next((j for j in inner if j.opcode in COLLECTIVES), None)
    if collective is None or any(_is_matmul_itself(j) for j in inner):
        return None
    if any(c.startswith("async_collective_fusion") for c in fusion.calls):
        # The TPU compiler's name for a continuation: a step of an asynchronous
        # collective fusion run inside a fusion of other work, which passes the state on
        # (an elementwise one with `xla_tpu_enable_async_collective_fusion_fuse_kloop_
        # fusions`).
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


def tpu_kernel(module: Module, i: Instruction) -> Optional[Instruction]:
    """The Pallas TPU call `i` runs: `i` itself, or the one in the fusion `i` is. With
    `xla_tpu_enable_async_collective_fusion_with_mosaic_custom_call` the TPU compiler
    moves a Mosaic call into the continuation fusion of one of its own asynchronous
    collectives, which then runs beside the kernel."""
    if i.opcode == "custom-call":
        return i if i.target == "tpu_custom_call" else None
    if i.opcode != "fusion" or not i.calls:
        return None
    return next((c for c in module.computations.get(i.calls[0], ())
                 if c.opcode == "custom-call" and c.target == "tpu_custom_call"), None)


def started_by(i: Instruction, by_name: dict, module: Optional[Module] = None
               ) -> Optional[str]:
    """The name of the start an asynchronous done `i` finishes (`<op>-done(start)`, or a
    TPU `async-collective-done` fusion of the start's tuple elements), else None.

    A TPU asynchronous collective fusion's state (its buffers and semaphores) does not
    always go from its start to its done directly: it goes through the continuation
    fusions that run the collective's steps beside their own work (an XLA fusion, or a
    Mosaic call), each taking the state in as operands and passing it on in its result
    tuple. With `module` (whose computations hold the continuations' bodies) the walk
    follows the state exactly: from a tuple element of a continuation to the parameter
    its body passes on in that element (through the collective's step), then to the
    continuation's operand at that parameter."""
    if i.opcode.endswith("-done") and i.operands:
        return i.operands[0]
    if not (i.opcode == "fusion" and i.name.startswith("async-collective-done")):
        return None
    for name in i.operands:
        for _ in range(len(by_name) + 1):  # each step goes one instruction back
            source = by_name.get(name)
            if source is None:
                break
            if source.opcode == "fusion" and source.name.startswith("async-collective-start"):
                return source.name
            if source.opcode != "get-tuple-element" or not source.operands:
                break
            tuple_of = by_name.get(source.operands[0])
            if tuple_of is None:
                break
            if not (tuple_of.opcode == "fusion" and module is not None and tuple_of.calls
                    and not tuple_of.name.startswith("async-collective-start")):
                name = tuple_of.name
                continue
            passed = _passed_parameter(module, tuple_of.calls[0], element_index(source))
            if passed is None or passed >= len(tuple_of.operands):
                break
            name = tuple_of.operands[passed]
    return None


_PARAMETER = re.compile(r"\bparameter\((\d+)\)")


def _passed_parameter(module: Module, computation: str, element: Optional[int]
                      ) -> Optional[int]:
    """The parameter number that `computation`'s root tuple passes on in `element`
    (through views, copies and the collective step that runs on it), else None."""
    root = module.roots.get(computation)
    if root is None or root.opcode != "tuple" or element is None or \
            element >= len(root.operands):
        return None
    inner = {j.name: j for j in module.computations.get(computation, ())}
    j = inner.get(root.operands[element])
    while j is not None and j.opcode != "parameter":
        if j.operands and (j.opcode in ("get-tuple-element", "bitcast", "copy")
                           or j.opcode in COLLECTIVES):
            j = inner.get(j.operands[0])
        else:
            return None
    found = _PARAMETER.search(j.line) if j is not None else None
    return int(found.group(1)) if found else None


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
