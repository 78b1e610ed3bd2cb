"""Train a small transformer-style MLP stack with fusedpar layers, once per backend asked.

    python -m fusedpar.demo                      # 8 simulated CPU devices, fsdp=2 x tp=4
    python -m fusedpar.demo --backends reference,ring,pallas_tpu --steps 5
    python -m fusedpar.demo --profile-dir /tmp/trace   # then open it in Perfetto/TensorBoard

The model: `--blocks` residual blocks `x + RowLinear(gelu(ColumnLinear(rms_norm(x))))`,
both layers sequence parallel over the "tp" mesh axis and FSDP-sharded over "fsdp"
(activations `(batch, seq, dim)` are laid out `P("fsdp", "tp", None)`). It is trained
with plain SGD on a fixed batch towards a fixed random target:

- once densely on one device (the same layers with no mesh compute `eqx.nn.Linear`'s
  math), which is the baseline every parallel run is compared with;
- once on the mesh for each backend in `--backends` (default: reference and ring).

On simulated CPU devices `pallas_tpu` (and `pallas`) run the TPU kernels in TPU interpret
mode, a Python simulator of every DMA and semaphore. A run that includes them uses a
tensor-parallel-only mesh (`1x4`), 1 block and 4 steps unless `--blocks`/`--steps` say
otherwise, and refuses an FSDP axis (`--mesh 2x4`): there the interpreter can deadlock
with XLA's FSDP collectives (see `_fit_the_interpreter`).

The final table gives the median step time, the final loss, the largest difference of
any trained parameter from the dense run, and the bytes each device sends per training
step, counted by `fusedpar.cost_model.bytes_sent` for every collective matmul (forward and
the dual op of the backward) plus the FSDP weight all-gather and its gradient's
reduce-scatter (an analytic count). Without accelerators the devices are simulated on the
CPU (the demo sets `jax_num_cpu_devices` before JAX starts its backend), where timings
show overheads, not speed-ups.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time

# Options whose defaults a run with interpreted TPU kernels replaces (when not given).
DEFAULTS = dict(mesh="2x4", blocks=2, steps=8)
INTERPRETER = dict(blocks=1, steps=4)
# A step of interpreted kernels takes about a second here; one that has run this long has
# stopped (see _fit_the_interpreter), and the demo ends with a message instead of hanging.
STEP_LIMIT_S = 300


def _interpreted(backends) -> list:
    """The backends among `backends` that run collective kernels in TPU interpret mode
    on simulated CPU devices (what each declares: `_backends.Backend.interprets`)."""
    from ._core import _backends
    from ._hw import _target

    cpu = _target.of_platform("cpu")
    return [b for b in backends if b in _backends.TABLE and _backends.get(b).interprets(cpu, {})]


def _parser():
    p = argparse.ArgumentParser(prog="python -m fusedpar.demo", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--devices", type=int, default=None,
                   help="simulated CPU devices when the host has no accelerator (default: "
                   "the mesh's, 8 for 2x4); at least the mesh's")
    p.add_argument("--mesh", default=None, help="FSDPxTP mesh shape (default 2x4; 1x4 with "
                   "TPU kernels interpreted on CPU)")
    p.add_argument("--batch", type=int, default=8, help="examples per step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per example (default 64)")
    p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    p.add_argument("--hidden", type=int, default=256, help="MLP width (default 256)")
    p.add_argument("--blocks", type=int, default=None,
                   help="residual blocks (default 2; 1 with TPU kernels interpreted on CPU)")
    p.add_argument("--steps", type=int, default=None,
                   help="SGD steps (default 8; 4 with TPU kernels interpreted on CPU)")
    p.add_argument("--lr", type=float, default=0.3, help="SGD step size (default 0.3)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backends", default="reference,ring",
                   help="comma-separated backends (default reference,ring; also auto, "
                   "pallas, pallas_tpu, pallas_gpu)")
    p.add_argument("--profile-dir", default=None,
                   help="write a jax.profiler trace of the timed steps here")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    return p


def _parse(argv):
    p = _parser()
    args = p.parse_args(argv)
    args.given = {name for name in DEFAULTS if getattr(args, name) is not None}
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        fsdp, tp = (int(v) for v in args.mesh.lower().split("x"))
    except ValueError:
        p.error(f"--mesh must look like 2x4 (FSDP x TP), got {args.mesh!r}")
    if fsdp < 1 or tp < 1:
        p.error(f"--mesh axes must be positive, got {args.mesh!r}")
    args.fsdp, args.tp = fsdp, tp
    for name in ("devices", "batch", "seq", "dim", "hidden", "blocks", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if args.devices is not None and args.devices < fsdp * tp:
        p.error(f"--devices {args.devices} is fewer than the mesh {fsdp}x{tp} needs "
                f"({fsdp * tp}): pass --devices {fsdp * tp} or more, or a smaller --mesh.")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"--lr must be a positive finite number, got {args.lr}.")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    import fusedpar  # starts no JAX backend: the devices are still ours to set

    valid = ("auto",) + fusedpar.backend_names()
    bad = [b for b in args.backends if b not in valid]
    if bad or not args.backends:
        p.error(f"--backends: unknown {', '.join(bad) or '(none given)'}; valid: "
                f"{', '.join(valid)}")
    for name, v, by in (("--batch", args.batch, fsdp), ("--seq", args.seq, tp),
                        ("--hidden", args.hidden, tp), ("--dim", args.dim, fsdp)):
        if v % by:
            p.error(f"{name}={v} must divide by the mesh axis it is sharded over ({by}).")
    return args


def _start_jax(devices: int):
    """Simulate `devices` CPU devices, unless JAX's backends are already up.

    Before they start: threads enough for the TPU interpreter (`fusedpar._core._interpret`),
    and, with no accelerator plugin installed, a longer wait for the CPU collectives: the
    interpreted kernels of a slow (or busy) machine can keep some simulated devices away
    from an XLA collective for longer than its default 40 s, which aborts the run.
    """
    import jax
    from jax._src import xla_bridge

    from ._core import _interpret

    if not xla_bridge.backends_are_initialized():
        _interpret.setup_threads(devices)
        flag = "--xla_cpu_collective_call_terminate_timeout_seconds"
        flags = os.environ.get("XLA_FLAGS", "")
        if flag not in flags and not _accelerator_plugin():
            os.environ["XLA_FLAGS"] = f"{flags} {flag}=1200".strip()
        jax.config.update("jax_num_cpu_devices", devices)
    return jax


def _fit_the_interpreter(args, platform: str):
    """Shape a run whose TPU kernels would be interpreted so that it finishes; return the
    note to print (None when no kernel is interpreted).

    The TPU interpreter synchronises the simulated devices inside Python callbacks: semaphore
    waits during a kernel and a barrier over every device of the mesh after it. XLA's CPU
    runtime does not see them, and runs the independent parts of each device's program in
    an order of its own. On an FSDP x TP mesh one device can then enter the reduce-scatter
    of an FSDP gradient while its FSDP partner waits in the interpreter for it: a deadlock.
    Measured on 2 cores at the default work (2x4, 2 blocks, 8 steps): 8 of 22 runs stopped,
    with NPROC 9 or 33 and with synchronous dispatch alike, every device blocked and a
    thread of the pool free (so more threads do not help). On a TP-only mesh, 27 of 27 runs
    finished (17 at the default work on 1x4 and 1x8); its one cross-device XLA collective
    (the loss and a bias gradient, all-reduced together) could in principle race the same
    way, hence the step limit too (`STEP_LIMIT_S`). The interpreter's cost (about a second
    a step) sets the smaller default work.
    """
    interpreted = _interpreted(args.backends)
    if platform != "cpu" or not interpreted:
        return None
    names = ", ".join(interpreted)
    if args.fsdp > 1:
        if "mesh" in args.given:
            _parser().error(
                f"--backends {names} runs the TPU kernels in TPU interpret mode on these CPU "
                f"devices, where a training step on an FSDP x TP mesh (--mesh {args.mesh}) "
                "can deadlock: the interpreter synchronises the simulated devices in Python "
                "callbacks that XLA's CPU runtime may order differently from its FSDP "
                f"collectives on different devices. Use --mesh 1x{args.tp} (tensor parallel "
                f"only), or --backends ring (the same ring schedule in lax) on {args.mesh}; on "
                "a TPU host the kernels are compiled and any mesh runs.")
        args.fsdp, args.mesh = 1, f"1x{args.tp}"
    for name, value in INTERPRETER.items():
        if name not in args.given:
            setattr(args, name, value)
    return (f"{names}: the TPU kernels run in TPU interpret mode here (a Python simulator of "
            f"every DMA and semaphore), so this run uses mesh fsdp=1 x tp={args.tp} (an FSDP "
            f"axis can deadlock the interpreter with XLA's collectives), {args.blocks} "
            f"block(s) and {args.steps} steps; --mesh 1xN, --blocks and --steps choose.")


def _watchdog(label, step, seconds):
    """A started timer that ends the process with a message if the step has not finished
    within `seconds` (cancel it when it has)."""
    def stop():
        sys.stderr.write(
            f"\nfusedpar demo: step {step} of {label} has not finished after {seconds} s. The "
            "TPU kernels run in TPU interpret mode on these CPU devices, and the simulated "
            "devices have stopped waiting for each other (the interpreter's synchronisation "
            "against XLA's collectives). Run --backends ring instead, and report the command "
            "that stopped.\n")
        sys.stderr.flush()
        os._exit(3)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    return timer


def _accelerator_plugin() -> bool:
    """Whether a JAX GPU or TPU plugin is installed (whose XLA may know other flags)."""
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax_cuda", "jax-rocm", "libtpu")) for n in names)


def _model(args, backend, key):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import fusedpar

    dtype = jnp.dtype(args.dtype)

    class Block(eqx.Module):
        up: fusedpar.ColumnLinear
        down: fusedpar.RowLinear

        def __call__(self, x):
            h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1,
                                           keepdims=True) + 1e-6).astype(x.dtype)
            return x + self.down(jax.nn.gelu(self.up(h)))

    class Stack(eqx.Module):
        blocks: list

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    blocks = []
    for k in jax.random.split(key, args.blocks):
        k1, k2 = jax.random.split(k)
        blocks.append(Block(
            fusedpar.ColumnLinear(args.dim, args.hidden, dtype=dtype, key=k1, axis="tp",
                                  sequence_parallel=True, fsdp_axis="fsdp", backend=backend),
            fusedpar.RowLinear(args.hidden, args.dim, dtype=dtype, key=k2, axis="tp",
                               sequence_parallel=True, fsdp_axis="fsdp", backend=backend)))
    return Stack(blocks)


def _train_step(lr):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    @eqx.filter_jit
    def step(model, x, y):
        def loss_fn(m):
            return jnp.mean(jnp.square((m(x) - y).astype(jnp.float32)))

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        model = jax.tree.map(lambda p, g: p - lr * g.astype(p.dtype), model, grads)
        return model, loss

    return step


def _train(label, args, model, x, y, quiet, profile_dir=None, limit_s=None):
    """Run `args.steps` SGD steps; return (model, losses, step times in seconds). With
    `limit_s`, a step that has not finished by then ends the process (`_watchdog`)."""
    import jax

    step = _train_step(args.lr)
    losses, times = [], []
    for i in range(args.steps):
        if profile_dir and i == 1:  # after the compiling step
            jax.profiler.start_trace(profile_dir)
        start = time.perf_counter()
        guard = _watchdog(label, i + 1, limit_s) if limit_s else None
        model, loss = step(model, x, y)
        model, loss = jax.block_until_ready((model, loss))
        loss = float(loss)
        if guard:
            guard.cancel()
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if not quiet:
            note = " (includes compilation)" if i == 0 else ""
            print(f"  [{label}] step {i + 1}/{args.steps}  loss {loss:.6f}  "
                  f"{times[-1] * 1e3:.1f} ms{note}", flush=True)
    if profile_dir and args.steps > 1:
        jax.profiler.stop_trace()
    return model, losses, times


def bytes_per_step(args) -> int:
    """Bytes one device sends in one training step (forward + backward), any backend.

    The sequence-parallel collectives come from `cost_model.bytes_sent` per op call: the
    ColumnLinear's all-gather-matmul and, in its backward, the reduce-scatter of the input
    gradient; the RowLinear's matmul-reduce-scatter and the all-gather of its output
    gradient (with `keep_gathered`, the default, nothing is gathered twice). Reduce-
    scatters send float32 partial sums. The FSDP weight shards are all-gathered in the
    forward and their gradients reduce-scattered: `(fsdp - 1) * local weight bytes` each.
    """
    import numpy as np

    from . import cost_model

    b_l, s_l = args.batch // args.fsdp, args.seq // args.tp
    d, h, tp, fsdp = args.dim, args.hidden, args.tp, args.fsdp
    item = np.dtype(args.dtype).itemsize
    agm, mrs = "all_gather_matmul", "matmul_reduce_scatter"
    per_block = (
        # ColumnLinear: x (b, s/tp, d) gathered along seq; backward dx reduce-scatters.
        cost_model.bytes_sent(agm, (b_l, s_l, d), (d, h // tp), tp, args.dtype, dim=1)
        + cost_model.bytes_sent(mrs, (b_l, s_l * tp, h // tp), (h // tp, d), tp, args.dtype,
                                dim=1)
        # RowLinear: y reduce-scattered along seq; backward gathers dy.
        + cost_model.bytes_sent(mrs, (b_l, s_l * tp, h // tp), (h // tp, d), tp, args.dtype,
                                dim=1)
        + cost_model.bytes_sent(agm, (b_l, s_l, d), (d, h // tp), tp, args.dtype, dim=1))
    # FSDP: each layer's (h/tp, d) weight shard is gathered over fsdp, and its gradient
    # reduce-scattered (in the weight's dtype); biases are replicated (grads psum'd over
    # the batch: a small all-reduce, not counted).
    w_local = (h // tp) * (d // fsdp) * item
    fsdp_bytes = 2 * 2 * (fsdp - 1) * w_local
    return args.blocks * (per_block + fsdp_bytes)


def _max_diff(a, b) -> float:
    import equinox as eqx
    import jax
    import numpy as np

    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    return max(float(np.max(np.abs(np.asarray(p, np.float32) - np.asarray(q, np.float32))))
               for p, q in zip(la, lb))


def main(argv=None) -> list[dict]:
    """Run the demo; print the table; return its rows (dicts) for programmatic use."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    n = args.fsdp * args.tp
    jax = _start_jax(n if args.devices is None else args.devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import fusedpar

    platform = jax.default_backend()
    note = _fit_the_interpreter(args, platform)
    n = args.fsdp * args.tp
    if len(jax.devices()) < n:
        raise SystemExit(f"mesh {args.fsdp}x{args.tp} needs {n} devices; {platform} has "
                         f"{len(jax.devices())} (use --devices or --mesh).")
    where = (f"{n} simulated CPU devices" if platform == "cpu"
             else f"{n} x {jax.devices()[0].device_kind}")
    print(f"fusedpar demo: {args.blocks} blocks, batch {args.batch} x seq {args.seq} x dim "
          f"{args.dim} (hidden {args.hidden}), {args.dtype}, mesh fsdp={args.fsdp} x "
          f"tp={args.tp} on {where}, {args.steps} SGD steps", flush=True)
    if note:
        print(note, flush=True)
    dtype = jnp.dtype(args.dtype)
    kx, ky, km = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.batch, args.seq, args.dim), jnp.float32).astype(dtype)
    y = jax.random.normal(ky, (args.batch, args.seq, args.dim), jnp.float32).astype(dtype)

    # The baseline: the same layers with no mesh compute dense math on one device.
    dense = jax.device_put(_model(args, "reference", km), jax.devices()[0])
    dense, dense_losses, dense_times = _train("dense, 1 device", args, dense,
                                              jax.device_put(x, jax.devices()[0]),
                                              jax.device_put(y, jax.devices()[0]), args.quiet)
    rows = [dict(backend="dense (1 device)", step_s=float(np.median(dense_times[1:] or
                                                                     dense_times)),
                 final_loss=dense_losses[-1], max_diff=0.0, bytes_per_step=0)]

    mesh = jax.make_mesh((args.fsdp, args.tp), ("fsdp", "tp"),
                         axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:n])
    act = NamedSharding(mesh, P("fsdp", "tp", None))
    sent = bytes_per_step(args)
    for backend in args.backends:
        with jax.set_mesh(mesh):
            model = fusedpar.shard(_model(args, backend, km), mesh)
            profile = (os.path.join(args.profile_dir, backend) if args.profile_dir else None)
            model, losses, times = _train(
                backend, args, model, jax.device_put(x, act), jax.device_put(y, act),
                args.quiet, profile, STEP_LIMIT_S if note and _interpreted([backend]) else None)
        rows.append(dict(backend=backend, step_s=float(np.median(times[1:] or times)),
                         final_loss=losses[-1], max_diff=_max_diff(model, dense),
                         bytes_per_step=sent))
    print(_table(rows))
    print("step time: median over the steps after the first (which compiles). max |diff|: "
          "largest difference of any trained parameter from the dense run. bytes: "
          "cost_model.bytes_sent per collective matmul + analytic FSDP gather/scatter; the "
          "same for every backend (each sends the same blocks, overlapped or not)."
          + (" On simulated CPU devices the timings show overheads, not speed-ups."
             if platform == "cpu" else ""))
    if args.profile_dir:
        print(f"profiler traces: {args.profile_dir}/<backend> (open with Perfetto or "
              "TensorBoard's profile plugin)")
    return rows


def _table(rows) -> str:
    head = ("backend", "step time", "final loss", "max |diff| vs dense", "bytes sent/device/step")
    body = [(r["backend"], f"{r['step_s'] * 1e3:.1f} ms", f"{r['final_loss']:.6f}",
             f"{r['max_diff']:.2e}", f"{r['bytes_per_step']:,}") for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|-" + "-|-".join("-" * w for w in widths) + "-|"
    return "\n".join([line(head), sep] + [line(r) for r in body])


if __name__ == "__main__":
    main()
