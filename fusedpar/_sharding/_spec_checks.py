"""Checks of a layer's sharding against a mesh, with errors that say what to change.

Errors name the parameter path, dimension, size and axes, and the fix (for a vocabulary,
the padding that makes it divide).
"""

from __future__ import annotations

from typing import Optional

from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from ._rules import Rule, axes_of, axes_product


def check_fsdp_dim(where: str, fsdp_axis, fsdp_dim) -> None:
    """Raise if `fsdp_dim` is given without the `fsdp_axis` it would apply to."""
    if fsdp_dim is not None and fsdp_axis is None:
        raise ValueError(f"{where}: fsdp_dim={fsdp_dim!r} without fsdp_axis does nothing; "
                         "pass fsdp_axis (e.g. 'fsdp') to shard the weight with FSDP, or "
                         "drop fsdp_dim.")


def check_mesh(where: str, mesh, *, concrete: bool = False, first: str = "model") -> None:
    """Refuse a `mesh` that is not a `jax.sharding.Mesh` (or, unless `concrete`, an
    `AbstractMesh`): a model passed where the mesh goes, a dict of sizes, None (which
    failed inside as "'dict' object has no attribute 'axis_names'"). An AbstractMesh has
    no devices to build arrays on (`concrete`). `first`: the argument before the mesh."""
    kinds = (Mesh,) if concrete else (Mesh, AbstractMesh)
    if isinstance(mesh, kinds):
        return
    if isinstance(mesh, AbstractMesh):
        raise ValueError(f"{where}: an AbstractMesh has no devices to build arrays on; pass "
                         "a jax.sharding.Mesh (jax.make_mesh), or shard the model's shapes: "
                         "fusedpar.shard(eqx.filter_eval_shape(make, ...), abstract_mesh).")
    want = "jax.sharding.Mesh" if concrete else "jax.sharding.Mesh or AbstractMesh"
    raise TypeError(f"{where}: mesh must be a {want} (e.g. jax.make_mesh((2, 4), ('fsdp', "
                    f"'tp'))), got {type(mesh).__name__}; the arguments are ({first}, mesh).")


def mesh_sizes(mesh) -> dict:
    """`{axis name: size}` of a `Mesh` or `AbstractMesh`."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def check_scalar(where: str, rule: Rule, in_features, out_features) -> None:
    """Refuse a rule that shards a "scalar" feature dimension of a linear layer.

    `eqx.nn.Linear` takes `"scalar"` features (a weight dimension of length 1); a layer
    with them computes as it does with no mesh, but no mesh axis can split that dimension.
    """
    names = {0: ("out_features", out_features), 1: ("in_features", in_features)}
    for pl in rule.placements(use_bias=False):
        name, value = names[pl.dim]
        if value == "scalar":
            style = "FSDP" if pl.role == "fsdp" else type(rule.tp).__name__
            raise ValueError(
                f"{where}: {name}='scalar' is a weight dimension of length 1, which its "
                f"{style} style shards over mesh axis {pl.axis!r}; keep this layer an "
                "eqx.nn.Linear (leave it out of the parallelize plan), or use a style "
                "that shards the other dimension.")


def length(features) -> int:
    """The length of a linear layer's features dimension (`"scalar"` is 1)."""
    return 1 if features == "scalar" else features


def check_param_shapes(where: str, layer) -> None:
    """Raise unless `layer`'s weight (trailing two dims: a stacked weight has more) and
    bias have the shapes its features give: a weight replaced with `eqx.tree_at` or read
    from a checkpoint must keep them, or the error comes later, about local shards."""
    if hasattr(layer, "in_features"):
        want = (length(layer.out_features), length(layer.in_features))
        names = "(out_features, in_features)"
    else:
        want, names = (layer.num_embeddings, layer.embedding_size), \
            "(num_embeddings, embedding_size)"
    w = getattr(layer, "weight", None)
    if hasattr(w, "shape") and tuple(w.shape[-2:]) != want:
        t = " (it is that shape transposed)" if tuple(w.shape[-2:]) == want[::-1] else ""
        raise ValueError(f"{where}.weight has shape {tuple(w.shape)}, but the layer's "
                         f"{names} is {want}{t}: a replaced weight must keep that shape.")
    b = getattr(layer, "bias", None)
    if b is not None and tuple(b.shape[-1:]) != want[:1]:
        raise ValueError(f"{where}.bias has shape {tuple(b.shape)}, but the layer's "
                         f"out_features is {want[0]}: a replaced bias must keep the shape "
                         f"({want[0]},).")


def check_spec(path: str, shape, spec: P, sizes: dict, what="parameter",
               vocab_dim: Optional[int] = None, fixes: Optional[dict] = None):
    """Raise unless every axis of `spec` is in the mesh and divides its dimension.

    `vocab_dim`: the dimension that is a vocabulary, which the message says to pad.
    `fixes`: {dim: what to do when it does not divide}, in place of the general advice.
    """
    for d, entry in enumerate(spec):
        axes = axes_of(entry)
        missing = [a for a in axes if a not in sizes]
        if missing:
            raise ValueError(
                f"{path}: mesh axis {missing[0]!r} (sharding dim {d}) is not in the mesh, "
                f"whose axes are {tuple(sizes)}.")
        n = axes_product(axes, sizes)
        if axes and shape[d] % n:
            sz = ", ".join(f"{a}={sizes[a]}" for a in axes)
            relaxed = ("relaxed=True (an argument of fusedpar.shard, init_sharded and "
                       "validate) to replicate")
            fix = (f"change the size, the mesh, or use {relaxed} this dimension"
                   if what == "parameter" else "change the size or the mesh")
            if d == vocab_dim:
                fix = pad_vocab_hint(shape[d], n) + f", or use {relaxed} it"
            fix = (fixes or {}).get(d, fix)
            raise ValueError(
                f"{path}: {what} dim {d} has size {shape[d]}, not divisible by {n}, the "
                f"product of mesh axes {axes} ({sz}); {fix}.")


def decoding_fixes(rule: Rule, data: bool, seq_dim: Optional[int],
                   batch: Optional[int] = None) -> dict:
    """`check_spec`'s `fixes` for an input whose batch (dim 0, over the FSDP axis where
    `data`; `batch` its size) or sequence (`seq_dim`, over tp in a sequence-parallel
    layer) does not divide: what decoding one sequence, a few tokens at a time, runs
    into."""
    fixes = {}
    if data:
        # (An FSDP-only layer has no plan without FSDP to be re-planned to.)
        replan = (", run those steps under a plan without FSDP (fusedpar.parallelize("
                  "model, plan) re-plans a parallel model)" if rule.tp is not None else "")
        # x[0] is the whole batch only for a batch of one.
        one = ("can go without one: call the layer on x[0] (no batch dimension: the layer "
               "gathers its weight whole)" if batch == 1 else
               "can be called without a batch dimension, one sequence at a time (x[i]: the "
               "layer gathers its weight whole)")
        fixes[0] = (f"a batch that {rule.fsdp.axis!r} does not divide (one sequence while "
                    f"decoding, say) {one}{replan}, or pad the batch")
    if rule.sequence_parallel and seq_dim is not None:
        fixes[seq_dim] = (f"a sequence that {rule.tp.axis!r} does not divide (a few tokens "
                          "while decoding, say) needs no sequence parallelism: run those "
                          "steps with the same weights under a plan with "
                          "sequence_parallel=False (fusedpar.parallelize(model, plan) "
                          "re-plans a parallel model), or pad the sequence")
    return fixes


def pad_vocab_hint(vocab: int, n: int) -> str:
    """How to make a vocabulary of `vocab` entries shard over `n` devices."""
    padded = -(-vocab // n) * n
    return (f"pad the vocabulary to a multiple of {n} (e.g. {padded}: the embedding's "
            f"num_embeddings and the LM head's out_features), and pass "
            f"vocab_size={vocab} to fusedpar.cross_entropy so the padding gets no "
            "probability")
