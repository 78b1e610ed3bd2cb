"""The `"pallas_gpu"` backend: the shared ring loops (`_ring_loop.py`) with Pallas GPU
step kernels.

The ring loops, and which block is where at each step (`fusedpar._core._schedule.Ring`), are
the ones the lax ring (`ring.py`) runs too: `lax.ppermute` moves the blocks, so XLA runs
the transfers on its collective stream and overlaps them with the kernels. Only each
step's compute is a kernel (`fusedpar.kernels.gpu`):

| primitive     | step                                               | kernel         |
|---------------|----------------------------------------------------|----------------|
| `ag_rows`     | `out[rows of seg] = piece @ w`                     | `matmul_into` ² |
| `ag_cols`     | `out[:, cols of seg] = x @ piece` (FSDP gather)    | `matmul_into` ² |
| `ag_contract` | `out += x[:, cols of seg] @ piece` (FSDP gather)   | `matmul_acc`   |
| `rs_rows`     | `acc += x[rows of seg] @ w`                        | `matmul_acc` ¹ |
| `rs_cols`     | `acc += x @ w[:, cols of seg]`                     | `matmul_acc` ¹ |

¹ The ring asks for the product alone (`acc=None`) and adds the accumulator that
arrived itself: a kernel that read it would wait for the transfer (`_ring_loop.py`).
² Where the gathered operand is kept (for the backward), the kernel also writes each
piece into it, from the blocks it loads to multiply anyway (`gather_keeping_step`); the
lax ring copies each piece in with a dynamic-update-slice, a pass over the piece of its
own (16 of them, 98 us per device in the 8-H100 MLP's training step, replayed).

Two kernel families compute these steps (option `kernels`): `"mosaic"` (Mosaic GPU:
TMA, wgmma, warp specialisation), the default on Hopper (compute capability 9.0);
`"triton"` (Pallas Triton, deprecated by jax 0.11 in favour of Mosaic GPU), the
default before Hopper, where wgmma and TMA do not exist, on Blackwell (whose tensor cores
have no wgmma: the Mosaic kernels refuse it until a Blackwell family exists), and on CPU,
where Pallas interpret mode runs it at any small shape. Which GPU it is, and which
families it runs, comes from the target (the mesh's devices, `fusedpar._hw._target`) and its
entry in the hardware registry (`fusedpar._hw._registry`), so a program compiled on a CPU
host for H100s gets the Mosaic kernels. On a CPU mesh the kernels run in interpret mode;
`options={"interpret": False}` forces the GPU lowering there (to lower for CUDA from a
CPU mesh).
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import _batching, _primitives as prims
from ..._hw import _registry
from ._backend import Backend
from ._ring_loop import Steps, run_steps

MOSAIC, TRITON = "mosaic", "triton"
_DTYPES = ("float32", "bfloat16", "float16")


def _kernels():
    # Imported on first use: importing fusedpar does not import Pallas.
    from ...kernels import gpu

    return gpu


def _family_options(family):
    gpu = _kernels()
    return frozenset(gpu.mosaic.CONFIG_OPTIONS if family == MOSAIC
                     else gpu.triton.TILE_OPTIONS)


def options(platform: str) -> frozenset:
    # `kernels` (the family), `interpret`, and either family's tile settings (checked
    # against the family that runs, when the kernels are built).
    return _family_options(MOSAIC) | _family_options(TRITON) | {"kernels", "interpret"}


def _families(target) -> tuple:
    """`(families, refused)` of the step kernels on `target`: its registry entry's
    (`fusedpar._hw._registry`), else what its compute capability runs; on CPU both run
    interpreted, Triton first."""
    if target.platform != "gpu":
        return (TRITON, MOSAIC), {}
    kind = target.kind
    if kind is not None:
        return kind.families, kind.refused
    return _registry.gpu_families(target.compute_capability)


def default_family(target) -> str:
    """The kernels that run on `target` (a `fusedpar._hw._target.Target`) unless
    `options["kernels"]` says otherwise: the first its registry entry runs (Mosaic GPU
    on Hopper, Triton before it and on Blackwell, whose wgmma-less tensor cores the
    Mosaic kernels cannot use)."""
    runs = [f for f in _families(target)[0] if f in (MOSAIC, TRITON)]
    return runs[0] if runs else TRITON


def _family(cfg, target) -> str:
    """The family `cfg` (a `Config` or a `Call`: anything with `option`) runs on."""
    family = cfg.option("kernels")
    if family is None:
        return default_family(target)
    if family not in (MOSAIC, TRITON):
        raise ValueError(f"options['kernels'] must be {MOSAIC!r} or {TRITON!r}, got "
                         f"{family!r}.")
    return family


def _refused(family, target):
    """Why `family` cannot run on `target`'s GPUs, or None."""
    if target.kind is not None:
        return target.kind.why_not(family)
    families, refused = _families(target)
    if family in families:
        return None
    return refused.get(family, f"the {family} step kernels do not run on "
                               f"{target.device_kind} GPUs")


def _limits(family, target) -> dict:
    """The GPU's limits a family's tile heuristic needs, as plain kernel options: the
    Mosaic kernels' SM count (the devices' own, else their registry entry's) and shared
    memory per block (the entry's). Nothing on CPU, nor what the registry does not know
    (the kernels then assume an H100's)."""
    if family != MOSAIC or target.platform != "gpu":
        return {}
    kind = target.kind
    limits = {}
    sms = target.num_cores or (kind.cores if kind is not None and kind.cores > 1 else None)
    if sms:
        limits["num_sms"] = sms
    if kind is not None and kind.smem_bytes:
        limits["smem_limit"] = kind.smem_bytes
    return limits


def unavailable(call):
    """Why the step kernels of the family `call` runs cannot run it, or None."""
    if call.platform not in ("cpu", "gpu"):
        return (f"the Pallas GPU kernels run on NVIDIA GPUs (and interpreted on CPU), "
                f"not on {call.platform!r}")
    if call.platform == "gpu" and call.target.compute_capability is None:
        return (f"the Pallas GPU kernels need an NVIDIA GPU of a known compute capability; "
                f"{call.target.devices_are()}")
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} is not supported (only {', '.join(_DTYPES)})"
    if call.option("interpret") and call.platform != "cpu":
        return (f"options['interpret']=True runs the kernels in Pallas interpret mode on CPU "
                f"devices, but {call.target.devices_are()}")
    directions = 2 if call.runs_bidirectional else 1
    rows, k, cols = call.primitive.step_matmul(call.x_shape, call.w_shape, call.axis_size,
                                               directions)
    gpu = _kernels()
    try:
        family = _family(call, call.target)
    except ValueError as e:
        return str(e)
    if call.platform == "gpu" and _refused(family, call.target):
        return _refused(family, call.target)
    if family == MOSAIC:
        why = gpu.mosaic.unsupported_reason(call.dtype, call.precision)
        if why is not None:
            return why
        try:
            gpu.mosaic.choose_config(rows, cols, (k,), call.dtype, "float32",
                                     _limits(family, call.target))
        except ValueError as e:
            return (f"{e}; options={{'kernels': 'triton'}} runs the Triton kernels, "
                    "backend='ring' the lax ring")
        return None
    try:
        gpu.triton.choose_tiles(rows, cols, k, call.dtype)
    except ValueError as e:
        return str(e)
    return None


def kernels(call) -> str:
    """Which kernels run `call` and how (what `fusedpar.explain` says of them)."""
    family = _family(call, call.target)
    interpret = call.option("interpret")
    cc = call.target.compute_capability
    if call.target.interpret if interpret is None else interpret:
        mode = "in Pallas interpret mode on the CPU devices"
    elif cc is None:  # options={"interpret": False} on a CPU mesh: lowered for CUDA there
        mode = "lowered for CUDA from the CPU devices"
    else:
        mode = "compiled for compute capability {}.{}".format(*cc)
    name = "Mosaic GPU (TMA, wgmma)" if family == MOSAIC else "Pallas Triton"
    return f"pallas_gpu: a lax ring with {name} step kernels, {mode}"


def _step_kernels(cfg):
    """The kernel module of the family that runs `cfg`, and the arguments it takes."""
    target = cfg.on
    family = _family(cfg, target)
    own = _family_options(family)
    other = sorted(k for k in dict(cfg.options) if k in _family_options(
        TRITON if family == MOSAIC else MOSAIC) and k not in own)
    if other:
        raise ValueError(
            f"options {other} set the {TRITON if family == MOSAIC else MOSAIC} kernels' "
            f"tiles, but this call runs the {family} kernels (its settings: "
            f"{', '.join(sorted(own))}; options={{'kernels': ...}} picks the family).")
    interpret = cfg.option("interpret")
    if interpret is None:
        interpret = target.interpret
    config = tuple({**_limits(family, target),
                    **{k: v for k, v in cfg.options if k in own}}.items())
    gpu = _kernels()
    module = gpu.mosaic if family == MOSAIC else gpu.triton
    return module, dict(precision=cfg.precision, config=config, interpret=bool(interpret))


def gather_step(prim, cfg, x, w):
    """One all-gather step: every direction's piece in one kernel launch."""
    kernels, kw = _step_kernels(cfg)
    Term = _kernels().Term
    p = prims.of(prim)

    def step(out, pieces, segs):
        if p.sums_steps:  # ag_contract: x's columns matching each row block of w in hand
            k = pieces[0].shape[0]
            terms = [Term(x, piece, k, a_col=s * k) for piece, s in zip(pieces, segs)]
            return kernels.matmul_acc(out, terms, out.shape, out.dtype, **kw)
        resident = w if p.traveller == "x" else x
        return kernels.matmul_into(out, pieces, resident, jnp.stack(segs),
                                   axis=p.gather_axis, **kw)

    return step


def gather_keeping_step(prim, cfg, x, w):
    """`gather_step`'s step that also writes the pieces into the gathered operand, in the
    same launch (from the blocks it loads to multiply: no copy of its own); None where it
    cannot (ag_contract's sum, mixed dtypes, the Mosaic kernels' float32 column pieces)."""
    kernels, kw = _step_kernels(cfg)
    p = prims.of(prim)
    if p.sums_steps or x.dtype != w.dtype or not kernels.can_keep(x.dtype, p.gather_axis):
        return None
    resident = w if p.traveller == "x" else x

    def step(out, gathered, pieces, segs):
        return kernels.matmul_into(out, pieces, resident, jnp.stack(segs),
                                   axis=p.gather_axis, kept=gathered, **kw)

    return step


def scatter_step(prim, cfg, x, w):
    """One reduce-scatter step: `acc + x_block @ w` (or `x @ w_block`) in one pass."""
    kernels, kw = _step_kernels(cfg)
    Term = _kernels().Term
    rows = prims.of(prim).ring_dim == "m"

    def accumulate(acc, seg, length):
        if rows:
            term, shape = Term(x, w, x.shape[1], a_row=seg * length), (length, w.shape[1])
        else:
            term, shape = Term(x, w, x.shape[1], b_col=seg * length), (x.shape[0], length)
        return kernels.matmul_acc(acc, [term], shape, cfg.reduce_dtype, **kw)

    return accumulate


STEPS = Steps(gather_step, scatter_step, gather_keeping=gather_keeping_step)


def _run(prim, cfg, x, w, return_gathered=False):
    """Run primitive `prim` (`_primitives.py`) on the ring loops with GPU step kernels."""
    return run_steps(STEPS, prim, cfg, x, w, return_gathered)


# pallas_call cannot be batched by jax.vmap on these 2-D layouts: fold the mapped
# dimension into the problem instead (see _batching.py).
run = _batching.vmappable(_run)

# check_vma: the kernels type their results for shard_map's varying-axes check, but a
# layer wraps every Pallas backend in shard_map(check_vma=False), as it always has.
# Interpreted on CPU its kernels are per-device (the ring is lax's), so no thread pool
# hazard: `interprets` stays False.
BACKEND = Backend(
    name="pallas_gpu",
    description="a lax ppermute ring whose per-step compute is Pallas GPU kernels",
    run=run, unavailable=unavailable, options=options, check_vma=False, kernels=kernels,
    cost="kernel")
