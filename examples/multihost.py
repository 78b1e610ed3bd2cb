"""Running fusedpar on several processes (JAX's multi-controller runtime, `jax.distributed`).

Every process runs this same script. The fusedpar code does not change between one
process and many: a multi-host program differs only in how it starts and how it places
its inputs.

1. **Start.** Each process calls, before anything else touches devices,

       jax.distributed.initialize(coordinator_address="host0:PORT",
                                  num_processes=P, process_id=i)

   (on TPU pods, Slurm or Open MPI the arguments are found automatically). On CPU the
   cross-process collectives need `jax.config.update("jax_cpu_collectives_implementation",
   "gloo")` first. Afterwards `jax.devices()` lists the devices of *all* processes and
   `jax.local_devices()` those of this one.

2. **One global mesh.** Every process builds the same mesh from `jax.devices()`, so a
   mesh axis may span processes: here the 8-device axis `"tp"` has 4 devices in each of
   2 processes, so every ring crosses the process boundary twice.

3. **Inputs.** A global array lives in pieces on the devices of all processes; no process
   holds it whole. `jax.make_array_from_callback(shape, sharding, cb)` asks `cb(index)`
   for the piece each *local* device holds (`index` is a tuple of slices into the global
   array). Here every process can compute any piece from a seed; a real program would
   read its pieces from storage.

4. **Run.** `jax.jit(jax.shard_map(...))` over the global mesh, exactly as in one process.
   Results that should be read on every host are returned replicated
   (`out_shardings=NamedSharding(mesh, P())`), so each process has the whole value.

5. **Layers.** A model of fusedpar layers is created already sharded with
   `fusedpar.init_sharded(make, mesh, key)` (each process computes only its shards of
   every parameter) and called on global arrays under `jax.set_mesh(mesh)`. Here a
   sequence-parallel MLP (`ColumnLinear` -> gelu -> `RowLinear`, both also FSDP-sharded)
   and an `FSDPLinear` head run on a `("fsdp", "tp")` = (2, 4) mesh: tensor parallelism
   inside each process, FSDP across the two.

Usage (two processes with 4 CPU devices each, on one machine):

    python examples/multihost.py --process-id 0 --num-processes 2 \
        --coordinator 127.0.0.1:12345 --local-devices 4 --out results.npz &
    python examples/multihost.py --process-id 1 --num-processes 2 \
        --coordinator 127.0.0.1:12345 --local-devices 4

and the same computation in one process with 8 devices, to compare:

    python examples/multihost.py --local-devices 8 --out single.npz

The arguments may also come from the environment: `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`. Process 0 writes `--out` (an `.npz` of every
result, keyed `"<case>/<output>"`); `tests/test_multihost.py` runs this script and
compares that file with the single-process run (`results(mesh)` below, called in the
test process itself).
"""

from __future__ import annotations

import argparse
import os
import sys

AXIS = "tp"
GLOBAL_DEVICES = 8

# (name, op, keyword arguments, global x shape, x spec, global w shape, w spec, out spec).
# The layouts are the ones a tensor-parallel or FSDP layer uses the op with.
#   - column (sequence-parallel in): rows of x gathered, w split by output columns;
#   - fsdp: the weight gathered along its output columns, each device its own batch;
#   - contract: the weight gathered along its contracting rows;
#   - row (sequence-parallel out): partial products summed and scattered by rows / columns.
M, K, N_OUT = 32, 48, 64


def _cases():
    import jax.sharding as shd

    P = shd.PartitionSpec
    return (
        ("column", "all_gather_matmul", dict(gather="lhs", dim=0),
         (M, K), P(AXIS), (K, N_OUT), P(None, AXIS), P(None, AXIS)),
        ("fsdp", "all_gather_matmul", dict(gather="rhs", dim=1),
         (M, K), P(AXIS), (K, N_OUT), P(None, AXIS), P(AXIS)),
        ("contract", "all_gather_matmul", dict(gather="rhs", dim=0),
         (M, K), P(AXIS), (K, N_OUT), P(AXIS), P(AXIS)),
        ("row", "matmul_reduce_scatter", dict(dim=0),
         (M, K), P(None, AXIS), (K, N_OUT), P(AXIS), P(AXIS)),
        ("row_cols", "matmul_reduce_scatter", dict(dim=-1),
         (M, K), P(None, AXIS), (K, N_OUT), P(AXIS), P(None, AXIS)),
    )


# Backend settings each case runs with: the reference, and the ring, bidirectional and
# rolled into a fori_loop (the model below uses the default, unrolled ring).
BACKENDS = (
    ("reference", dict(backend="reference")),
    ("ring", dict(backend="ring", bidirectional=True, unroll=False)),
)


def global_value(shape, seed):
    """The global array `seed` names; every process can compute any slice of it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=np.float32)


def place(shape, spec, mesh, seed):
    """A global array sharded by `spec` over `mesh`, built from the pieces this process holds."""
    import jax
    from jax.sharding import NamedSharding

    full = global_value(shape, seed)  # a real program would load only the pieces it needs
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec),
                                        lambda index: full[index])


def _global_devices(devices=None):
    """Every process's devices (default: the default platform's), process 0's first."""
    import jax

    return sorted(jax.devices() if devices is None else devices,
                  key=lambda d: (d.process_index, d.id))


def build_mesh(devices=None):
    """One mesh over the devices of every process, process 0's devices first."""
    import jax
    from jax.sharding import AxisType

    devices = _global_devices(devices)
    if len(devices) != GLOBAL_DEVICES:
        raise ValueError(f"this example needs {GLOBAL_DEVICES} devices in all, "
                         f"found {len(devices)}")
    return jax.make_mesh((GLOBAL_DEVICES,), (AXIS,), axis_types=(AxisType.Auto,),
                         devices=devices)


def results(mesh) -> dict:
    """Every case's value and gradients, as numpy arrays keyed "<case>/<output>".

    One jit over everything: each process compiles a single program.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import fusedpar

    args, fns = {}, {}
    for i, (name, op, kw, xs, xspec, ws, wspec, ospec) in enumerate(_cases()):
        args[name] = (place(xs, xspec, mesh, 100 + i), place(ws, wspec, mesh, 200 + i))
        for bname, bkw in BACKENDS:
            def local(x, w, op=op, kw={**kw, **bkw}):
                return getattr(fusedpar, op)(x, w, AXIS, **kw)

            fns[f"{name}/{bname}"] = (name, jax.shard_map(
                local, mesh=mesh, in_specs=(xspec, wspec), out_specs=ospec))

    def everything(args):
        out = {}
        for key, (name, f) in fns.items():
            x, w = args[name]
            y, vjp = jax.vjp(f, x, w)
            # A fixed, non-uniform cotangent: every output element gets its own weight.
            ct = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))
            dx, dw = vjp(ct)
            out.update({f"{key}/y": y, f"{key}/dx": dx, f"{key}/dw": dw})
        return out

    # Replicated outputs: every process ends up with every value (the all-gather that
    # makes them so is part of this one program).
    replicated = NamedSharding(mesh, P())
    out = jax.jit(everything, out_shardings=replicated)(args)
    return {k: np.asarray(v.addressable_data(0)) for k, v in out.items()}


MODEL_AXES, MODEL_MESH = ("fsdp", "tp"), (2, 4)
BATCH, SEQ, D_MODEL, D_HIDDEN, D_OUT = 4, 16, 32, 64, 16


def make_model(key, backend):
    """The MLP + head of point 5: every fusedpar layer type, all sharded."""
    import equinox as eqx
    import jax

    import fusedpar

    k1, k2, k3 = jax.random.split(key, 3)
    return eqx.nn.Sequential([
        fusedpar.ColumnLinear(D_MODEL, D_HIDDEN, key=k1, axis="tp", sequence_parallel=True,
                              fsdp_axis="fsdp", backend=backend),
        eqx.nn.Lambda(jax.nn.gelu),
        fusedpar.RowLinear(D_HIDDEN, D_MODEL, key=k2, axis="tp", sequence_parallel=True,
                           fsdp_axis="fsdp", backend=backend),
        fusedpar.FSDPLinear(D_MODEL, D_OUT, key=k3, axis="fsdp", backend=backend),
    ])


def build_model_mesh(devices=None):
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh(MODEL_MESH, MODEL_AXES, axis_types=(AxisType.Auto,) * 2,
                         devices=_global_devices(devices))


def model_results(mesh) -> dict:
    """The model's output and the gradients of every parameter and of the input, per
    backend, keyed "model/<backend>/<output>"."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import fusedpar

    x = place((BATCH, SEQ, D_MODEL), P("fsdp", "tp", None), mesh, 300)
    out = {}
    for bname, bkw in BACKENDS:
        # The same key gives the same parameters for every backend; the layers use the
        # backend's default ring shape.
        model = fusedpar.init_sharded(make_model, mesh, jax.random.key(0), bkw["backend"])
        params, static = eqx.partition(model, eqx.is_array)

        def forward_backward(params, x):
            def loss(params, x):
                y = eqx.combine(params, static)(x)
                ct = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))
                return jnp.sum(y * ct), y

            (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
            return y, grads

        with jax.set_mesh(mesh):
            y, (dparams, dx) = jax.jit(forward_backward, out_shardings=NamedSharding(
                mesh, P()))(params, x)
        leaves = jax.tree_util.tree_leaves_with_path(dparams)
        named = {f"d{jax.tree_util.keystr(path)}": g for path, g in leaves}
        for k, v in {"y": y, "dx": dx, **named}.items():
            out[f"model/{bname}/{k}"] = np.asarray(v.addressable_data(0))
    return out


def _arguments(argv):
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", default=env("JAX_COORDINATOR_ADDRESS"),
                   help="host:port of process 0 (env JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=int(env("JAX_NUM_PROCESSES", "1")),
                   help="number of processes (env JAX_NUM_PROCESSES; default 1)")
    p.add_argument("--process-id", type=int, default=int(env("JAX_PROCESS_ID", "0")),
                   help="this process's id, 0..num_processes-1 (env JAX_PROCESS_ID)")
    p.add_argument("--local-devices", type=int, default=None,
                   help="CPU devices to simulate in this process (default: "
                   f"{GLOBAL_DEVICES} // num_processes)")
    p.add_argument("--init-timeout", type=int, default=120,
                   help="seconds to wait for the other processes to connect")
    p.add_argument("--out", default=None, help="process 0 writes the results here (.npz)")
    a = p.parse_args(argv)
    if a.num_processes > 1 and not a.coordinator:
        p.error("--coordinator (or JAX_COORDINATOR_ADDRESS) is needed with several processes")
    if not 0 <= a.process_id < a.num_processes:
        p.error(f"--process-id must be in [0, {a.num_processes}), got {a.process_id}")
    if a.local_devices is None:
        a.local_devices = GLOBAL_DEVICES // a.num_processes
    return a


def main(argv=None):
    a = _arguments(sys.argv[1:] if argv is None else argv)
    import jax

    # On CPU: simulated devices, and gloo for collectives that cross processes. Both must
    # be set before JAX initialises its backends.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", a.local_devices)
    if a.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(a.coordinator, num_processes=a.num_processes,
                                   process_id=a.process_id,
                                   initialization_timeout=a.init_timeout)
    print(f"process {jax.process_index()}/{jax.process_count()}: "
          f"{jax.local_device_count()} local of {jax.device_count()} devices", flush=True)

    import numpy as np

    out = results(build_mesh())
    out.update(model_results(build_model_mesh()))
    if a.out and jax.process_index() == 0:
        np.savez(a.out, **out)
    print(f"process {jax.process_index()}: {len(out)} results"
          + (f" written to {a.out}" if a.out and jax.process_index() == 0 else ""), flush=True)
    if a.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
