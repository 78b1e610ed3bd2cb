"""Loops in a scheduled HLO module: a `while`'s condition and body, and its trip count
(XLA's `known_trip_count`, or read from the counter its condition compares)."""

from __future__ import annotations

import re
from typing import Optional

from ._hlo_parse import Instruction, Module

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
