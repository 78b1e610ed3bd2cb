"""Where a layer is called from: inside shard_map, on global arrays under a mesh, or no mesh.

- `LOCAL`: an enclosing `shard_map` binds the layer's axes; arrays are per-device shards.
- `GLOBAL`: `jax.set_mesh(mesh)` is active and the axes are not manual; the layer wraps
  itself in `shard_map` (`layouts`: a linear layer's is manual over every mesh axis).
- `DENSE`: no mesh; plain single-device math.

A layer whose weight already lives on a mesh (placed by `fusedpar.shard`, or traced
from such an array) but is called with no mesh set would compute dense math on the
gathered weight: correct numbers without a single fused collective. That is refused
(`check_no_stray_mesh`), as is the deprecated `with mesh:` context, which sets no mesh
that `jax.sharding.get_abstract_mesh` (and so `shard_map` without `mesh=`) sees, and a
weight placed on a mesh of another shape than the one set (`check_same_mesh`).
"""

from __future__ import annotations

import math

import jax
from jax import lax
from jax.sharding import AxisType

from .._core import _folding, _validate
from .._sharding import _specs, _whole_model
from ._layer_checks import check_not_quaxified

LOCAL, GLOBAL, DENSE = "local", "global", "dense"


def _legacy_mesh():
    """The mesh of an enclosing `with mesh:` (deprecated by JAX), or None."""
    try:
        from jax._src import mesh as mesh_lib

        physical = mesh_lib.thread_resources.env.physical_mesh
    except (ImportError, AttributeError):  # a JAX without the old context
        return None
    return None if physical.empty else physical


def _placed_mesh(array):
    """The mesh `array` is placed on (a concrete array's sharding, or the sharding in a
    traced array's type), or None."""
    if array is None:
        return None
    sharding = getattr(array, "sharding", None) if not isinstance(
        array, jax.core.Tracer) else getattr(jax.typeof(array), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def check_no_stray_mesh(where: str, axes: tuple, weight) -> None:
    """Raise if a layer over `axes` runs with no mesh set although a mesh is in sight:
    an enclosing `with mesh:`, or its `weight` placed on a mesh with those axes."""
    legacy = _legacy_mesh()
    if legacy is not None and any(a in legacy.axis_names for a in axes):
        raise ValueError(
            f"{where}: called inside `with mesh:` (mesh axes "
            f"{dict(legacy.shape)}), which JAX has deprecated and which sets no mesh that "
            "shard_map sees, so the layer cannot run its collective ops; use "
            "`with jax.set_mesh(mesh):` instead.")
    placed = _placed_mesh(weight)
    # shard_map_specs traces the model with no mesh only to read its layouts.
    if placed is None or _whole_model.tracing():
        return
    sizes = _shape(placed)
    used = [a for a in axes if sizes.get(a, 1) > 1]
    if used:
        raise ValueError(
            f"{where}: its weight is placed on a mesh {sizes} that has the layer's axes "
            f"{tuple(used)}, but no mesh is set, so the layer would compute dense math "
            "on the gathered weight without any fused collective; call it (and "
            "jax.jit it) inside `with jax.set_mesh(mesh):`, or inside jax.shard_map.")


def _shape(mesh) -> dict:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def check_same_mesh(where: str, weight, mesh) -> None:
    """Raise if the layer's `weight` is placed on a mesh of another shape than `mesh`, the
    one set, its axes in another order included: JAX cannot use an array of one mesh in a
    program on another (a (2, 4) and a (4, 2) mesh with the same axis names even abort
    the process, in its Shardy pass), and two meshes of equal sizes whose names differ
    in order moved every weight on every call."""
    placed = _placed_mesh(weight)
    if placed is None or list(_shape(placed).items()) == list(_shape(mesh).items()):
        return
    raise ValueError(
        f"{where}: its weight is placed on a mesh {_shape(placed)}, but it is called under "
        f"jax.set_mesh of a mesh {_shape(mesh)}; a program runs on one mesh. Place the "
        "model on the mesh you set (fusedpar.shard(model, mesh) inside "
        "`with jax.set_mesh(mesh):`), or set the mesh it was placed on.")


def detect(where: str, axes: tuple, weight=None, rule=None):
    """`(kind, abstract_mesh)` for a layer named `where` that uses mesh `axes`.

    `rule`: the layer's (`_rules.Rule`), whose styles an error names.
    `weight`: the layer's sharded parameter, to refuse running it densely when it was
    placed on a mesh but none is set (`check_no_stray_mesh`), or under a mesh other than
    the one it was placed on (`check_same_mesh`).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not axes:
        if mesh.empty and axes:
            check_no_stray_mesh(where, axes, weight)
        return DENSE, None
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    bound = [a for a in axes if a in manual]
    if bound:
        if len(bound) < len(axes):
            raise ValueError(
                f"{where}: uses mesh axes {axes} but the enclosing shard_map binds only "
                f"{tuple(sorted(manual))}; bind all of them, or none (then call the layer "
                "on global arrays under jax.set_mesh).")
        return LOCAL, mesh
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        names = (rule.missing_axes(mesh.axis_names) if rule is not None
                 else [repr(a) for a in missing])
        raise ValueError(f"{where}: mesh axis {', '.join(names)} is not in the current mesh, "
                         f"whose axes are {tuple(mesh.axis_names)}. Name one of them, or "
                         "set a mesh with that axis.")
    check_same_mesh(where, weight, mesh)
    return GLOBAL, mesh


def shard_map_sizes(axes) -> str:
    """The axes (and sizes) the enclosing `shard_map` binds, for an error message of a
    layer over `axes`: every bound axis, not only the layer's, e.g. `{'fsdp': 2, 'tp': 4}
    (the layer's: ('tp',))`."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    sizes = {a: n for a, n in zip(mesh.axis_names, mesh.axis_sizes) if a in manual}
    if not sizes:
        sizes = {a: lax.axis_size(a) for a in axes}
    extra = set(sizes) - set(axes)
    return f"{sizes}" + (f" (the layer's: {tuple(axes)})" if extra else "")


def is_explicit(mesh, axes) -> bool:
    """Whether any of `axes` is an Explicit axis of `mesh` (inputs must be resharded)."""
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return any(types[a] == AxisType.Explicit for a in axes)


def current_spec(x):
    """The PartitionSpec in `x`'s type (Explicit axes), or `P()` when it has none."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return getattr(sharding, "spec", None) or jax.sharding.PartitionSpec()


def place(x, spec, explicit: bool):
    """`x` laid out as `spec` on the current mesh."""
    if explicit:
        return jax.sharding.reshard(x, spec)
    return lax.with_sharding_constraint(x, spec)


def gather_invariant(x, axis_name, axis):
    """`all_gather(x, tiled=True)` typed invariant over `axis_name`.

    An output identical on every device can then leave `shard_map` replicated
    (out_specs without the axis, with check_vma=True); its transpose slices the
    cotangent instead of reduce-scattering it. In a `shard_map(check_vma=False)` (the
    fused kernels' own, or a user's) it is the plain `all_gather`: there JAX hands a
    replicated output's cotangent to each device divided by the axis size, which the
    plain gather's transpose (a reduce-scatter) sums back; a slice would keep 1/n of it.
    """
    from .._core import _vma

    if not _vma.checked(axis_name):
        return lax.all_gather(x, axis_name, axis=axis, tiled=True)
    try:
        from jax._src.lax.parallel import all_gather_invariant
    except ImportError:  # public fallback: sum one-hot placements (twice the traffic)
        n = lax.axis_size(axis_name)
        i = lax.axis_index(axis_name)
        shape = list(x.shape)
        shape[axis] *= n
        big = lax.dynamic_update_slice_in_dim(
            jax.numpy.zeros(shape, x.dtype), x, i * x.shape[axis], axis)
        return lax.psum(big, axis_name)
    return all_gather_invariant(x, axis_name, axis=axis, tiled=True)


def layouts(where, mesh, axes, x, x_spec, y_spec, every_axis: bool = True,
            batched: bool = False) -> tuple:
    """`(x_spec, y_spec, manual axes)` of a layer's `shard_map` over `axes` on the global
    `x`; `batched`: `x` has a batch (dim 0 of `(batch, seq, ...)`); `where` names the
    layer in the error for Explicit axes the input carries that do not divide with the
    layer's (JAX's reshard said only "partitioned 4 times").

    With `every_axis` (a layer whose ops may run Pallas kernels), or with Auto axes and
    `batched`, it is manual over every
    axis of `mesh`, not only the layer's: a fused TPU kernel addresses its neighbours by
    their coordinates on every mesh axis, and interpret-mode kernels (host callbacks) run
    only where every axis is manual. It also makes the ops inside see the per-device
    shapes `fusedpar.explain` is asked about. The other axes go on the dimensions the
    layer keeps from input to output: with Explicit axes where the input carries them
    (`_specs.with_other_axes`, e.g. "data" on the batch); with Auto axes, whose layout
    the input's type does not say, on dim 0 where it divides (`_specs.with_unknown_axes`:
    a data-parallel batch; dim 0's axes in mesh order), else replicated.

    Left to XLA, a batch sharded over another Auto axis ("data") was lost where the ops
    put the sequence before it (their 2-D form), and the whole batch gathered onto every
    device: twice the matmuls on a (2, 4) data x tensor mesh; an FSDP embedding looked
    its ids up on every "data" replica; the loss exchanged "data" and "fsdp".

    Otherwise (lax collectives only, no batch: one example `(seq, ...)` under a
    per-example vmap with a checkpoint or scan inside, whose batch is sharded outside
    the layer's view, where the other axes on dim 0 would move the batch onto the
    sequence) it is manual over `axes` and XLA lays out the other
    Auto axes; Explicit ones the input carries are kept as above. Where every one of
    `axes` has size 1 it is manual over every axis all the same: XLA's partitioner
    refuses a collective over axes of size 1 beside automatic ones ("Cross-partition
    allreduce must be in (partial) manual partitioning mode", jax 0.10 and 0.11).
    """
    every = set(mesh.axis_names)
    if is_explicit(mesh, axes):
        x2, y2 = _specs.with_other_axes(current_spec(x), x_spec, y_spec, axes)
        _specs.check_spec(f"{where}: input of shape {x.shape} (with the mesh axes its "
                          f"layout {current_spec(x)} carries beside the layer's)",
                          x.shape + (1,) * (len(x2) - x.ndim), x2, _specs.mesh_sizes(mesh),
                          what="input")
        return x2, y2, every if every_axis or (x2, y2) != (x_spec, y_spec) else set(axes)
    sizes = _specs.mesh_sizes(mesh)
    if not (every_axis or batched) and any(sizes[a] > 1 for a in axes):
        return x_spec, y_spec, set(axes)
    others = tuple(a for a in mesh.axis_names if a not in axes)
    x_spec, y_spec = _specs.with_unknown_axes(x.shape, x_spec, y_spec, others, sizes,
                                              order=tuple(mesh.axis_names))
    return x_spec, y_spec, every


def shard_mapped(fn, mesh, axes, manual, params, param_specs, args, arg_specs, out_spec,
                 check_vma: bool, where: str):
    """`fn(params, *args)` in a `shard_map` over `manual` axes of `mesh`, on global arrays
    (placed first when `axes` are Explicit), for `where` (the caller's name in errors)."""
    check_not_quaxified(where)
    if is_explicit(mesh, axes):
        params = jax.tree.map(lambda a, s: place(a, s, True), params, param_specs)
        args = [place(a, s, True) for a, s in zip(args, arg_specs)]
    with _folding.explicit_vmap_kept():
        return jax.shard_map(fn, mesh=mesh, in_specs=(param_specs, *arg_specs),
                             out_specs=out_spec, axis_names=manual, check_vma=check_vma)(
            params, *args)


def local_size(n: int, axis) -> int:
    """The length a dimension of global length `n` sharded over mesh `axis` has here.

    `n // size of axis` inside a `jax.shard_map` that binds `axis` (the arrays are
    per-device shards), `n` anywhere else (global arrays under `jax.set_mesh`, or no
    mesh). E.g. the attention heads a device computes:
    `fusedpar.local_size(num_heads, "tp")`; `axis` may be a tuple of axes (a dimension
    sharded over several: their sizes multiply). Raises if `n` does not divide, or, inside a
    `shard_map`, if its mesh lacks `axis` (where a typo would give the global `n` for a
    per-device shard); on global arrays a mesh without `axis` (a model written for
    tensor parallelism on a mesh without it) gives `n`.
    """
    if not _validate.is_int(n):
        raise TypeError(f"local_size: n must be an int (a global dimension's length), got "
                        f"{n!r}.")
    names = axis if isinstance(axis, tuple) else (axis,)
    if not names or not all(isinstance(a, str) and a for a in names):
        raise TypeError(f"local_size: axis must be a mesh axis name (a str such as 'tp') or "
                        f"a tuple of them, got {axis!r}.")
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(getattr(mesh, "manual_axes", ()) or ()) if not mesh.empty else ()
    unknown = [a for a in names if a not in mesh.axis_names]
    if manual and unknown:
        raise ValueError(
            f"local_size: axis {unknown[0]!r} is not an axis of the mesh of the enclosing "
            f"shard_map (its axes are {tuple(mesh.axis_names)}): name the axis the layers "
            "shard the dimension over, or use n where nothing shards it on this mesh.")
    bound = [a for a in names if a in manual]
    if not bound:
        return int(n)
    size = math.prod(lax.axis_size(a) for a in bound)
    if n % size:
        raise ValueError(f"local_size: {n} does not divide over mesh axis {axis!r} of size "
                         f"{size}; make it a multiple of {size}.")
    return int(n) // size
