"""Who talks to whom in an HLO collective: a collective-permute's source-target pairs,
and replica groups in each syntax XLA prints (listed, iota, mesh axes)."""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from ._hlo_parse import Instruction

# A collective-permute's pairs, or those of a send / recv (a frontend attribute).
_PAIRS = re.compile(r"(?:_xla_send_recv_)?source_target_pairs=\"?\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^{}]*)\}")
# A mesh's device list given as an iota (`device_ids=([2,4]T(1,0))`).
_IOTA = re.compile(r"\[([\d,]+)\](?:T\(([\d,]+)\))?")


def source_target_pairs(i: Instruction) -> Optional[list]:
    """The `(source, target)` device pairs of a collective-permute (or of a send or recv
    XLA split one into), None if it names none."""
    m = _PAIRS.search(i.line)
    if not m:
        return None
    return [(int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]


def group_size(i: Instruction, devices: int) -> Optional[int]:
    """Devices in the largest replica group of collective `i` (`replica_groups`), None
    where its groups cannot be read."""
    groups = replica_groups(i, devices)
    return None if groups is None else max((len(g) for g in groups), default=1)


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
        return _iota(m.group(3), m.group(4)).reshape(count, size).tolist()
    m = _GROUPS_MESH.search(i.line)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    return None


def _device_ids(text: str, total: int) -> list:
    """A mesh-form device list: listed (`[[0,2,4,6],[1,3,5,7]]`, every device once) or an
    iota (`[2,4]T(1,0)`: the device ids counted up, reshaped, transposed, read out in
    order)."""
    listed = [int(d) for d in re.findall(r"\d+", text)]
    m = _IOTA.fullmatch(text.strip())
    if not m or (not m.group(2) and sorted(listed) == list(range(total))):
        return listed
    return _iota(m.group(1), m.group(2)).ravel().tolist()


def _iota(dims_text: str, perm_text: Optional[str]):
    """Device ids counted up, reshaped to `dims_text` (`2,4`) and transposed by
    `perm_text` (`1,0`, or None): XLA's iota tile assignment."""
    dims = [int(d) for d in dims_text.split(",")]
    perm = [int(d) for d in perm_text.split(",")] if perm_text else range(len(dims))
    return np.arange(int(np.prod(dims))).reshape(dims).transpose(list(perm))


def _mesh_groups(axes_text: str, ids_text: Optional[str], grouped_text: str) -> list:
    """The groups of a mesh-form device list (`xla/hlo/ir/replica_group.cc`): the mesh's
    device array reshaped so that each named (sub-)axis is a dimension of its own, those
    dimensions moved last in the order named, then cut into groups."""
    axes = [(name, int(size)) for name, size in re.findall(r"'?([^',=\s]+)'?=(\d+)", axes_text)]
    total = int(np.prod([size for _, size in axes]))
    ids = _device_ids(ids_text, total) if ids_text else list(range(total))
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
