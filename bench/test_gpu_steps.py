"""The GPU ring-step kernels side by side with `jnp.dot`.

Three sections, each a pytest-benchmark group per row of its table:

- `kernel`: one step kernel on a square `S x S x S` problem against `jnp.dot` (cuBLAS on
  a GPU): `matmul_into` (an all-gather step, product written into its slice of the output
  in place) against `jnp.dot`, and `matmul_acc` (a reduce-scatter step, `acc + x @ w`
  into a float32 accumulator) against `acc + jnp.dot`. Reported as TFLOP/s and ratio.
- `ring1`: each of the five primitives through the public ops on a ring of ONE device,
  for the `ring` and `pallas_gpu` backends against `reference` (the cost of the machinery
  when there is nothing to overlap).
- `decomp`: the compute cost of cutting one `S x S x S` matmul into N = 2, 4, 8 ring steps:
  the backend's own step function (`gather_step` / `scatter_step`, what its ring runs at
  every step) called N times back to back on one device, with no transfers, as a ratio to
  one `jnp.dot` of the whole problem. Every step multiplies a DISTINCT block (its own
  input array, or its own rows of `x`): XLA merges identical dots, so steps that reused
  one block would time fewer matmuls than the ring runs.

`FUSEDPAR_BENCH_SIZES=cpu` (default): tiny shapes, Pallas interpret mode on CPU (a smoke
test of the bench itself; the numbers mean nothing). `accelerator`: S = 1024..8192 in
bfloat16 and float32, for a GPU:

    FUSEDPAR_BENCH_SIZES=accelerator python -m pytest bench/test_gpu_steps.py \
        --benchmark-only --benchmark-json=bench/results-gpu-steps.json
    python bench/test_gpu_steps.py bench/results-gpu-steps.json   # Markdown tables

float32 runs with the default precision, which both XLA and the kernels run in TF32 on
tensor cores.
"""

import functools
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _primitives as prims
from fusedpar._core._backends import _ring_loop
from fusedpar._core._primitives import Config

SIZES = os.environ.get("FUSEDPAR_BENCH_SIZES", "cpu")  # validated in bench/conftest.py
ON_CPU = jax.default_backend() == "cpu"

pytestmark = pytest.mark.timeout(600)

# The kernel families measured: on a GPU both (Mosaic needs Hopper: elsewhere it is
# skipped); on CPU only Triton, which Pallas interpret mode runs at any small shape (jax's
# Mosaic GPU interpreter lacks the TMA reduce-add store the accumulating kernel uses).
if SIZES == "cpu":
    KERNEL = [(s, d) for s in (64,) for d in (jnp.float32, jnp.bfloat16)]
    RING1 = [(64, jnp.float32)]
    DECOMP = [(128, jnp.float32)]
    RINGS = [4]
    RING1_RUN = ["ag_rows", "rs_cols"]
    FAMILIES = ["triton"]
    # Interpret mode: blocks of 16 so that even tiny problems have several tiles.
    TILES = {"triton": {"block_m": 16, "block_n": 16, "block_k": 16}}
else:
    DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
    KERNEL = [(s, d) for d in DTYPES for s in (1024, 2048, 4096, 8192)]
    RING1 = [(s, d) for d in DTYPES for s in (4096, 8192)]
    DECOMP = [(s, d) for d in DTYPES for s in (4096, 8192)]
    RINGS = [2, 4, 8]
    RING1_RUN = ["ag_rows", "ag_cols", "ag_contract", "rs_rows", "rs_cols"]
    FAMILIES = ["mosaic", "triton"]
    TILES = {"mosaic": {}, "triton": {}}  # the heuristics


def _options(family):
    """The pallas_gpu options that run `family`'s kernels (interpreted on CPU)."""
    return {"kernels": family, "interpret": ON_CPU, **TILES[family]}


def _skip_unless_runs(family):
    from fusedpar._hw import _target
    from fusedpar._core._backends import pallas_gpu

    if family == "mosaic" and not ON_CPU and pallas_gpu.default_family(
            _target.local()) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need Hopper (compute capability 9.0)")


# Seconds of timed calls per benchmark (FUSEDPAR_BENCH_BUDGET shortens a run on a GPU
# whose time is rationed).
BUDGET = float(os.environ.get("FUSEDPAR_BENCH_BUDGET") or (0.02 if SIZES == "cpu" else 0.4))


def _inputs(s, dtype, *shapes):
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [jax.random.normal(k, shape, jnp.float32).astype(dtype)
            for k, shape in zip(keys, shapes)]


def _donating(f, state, *args):
    """A no-argument callable running `state = f(state, *args)` with `state` donated.

    The step kernels update their output in place; donating it (as the ring does, whose
    buffer is a loop carry) keeps XLA from copying it before every call.
    """
    f = jax.jit(f, donate_argnums=0)
    box = [state]

    def call():
        box[0] = f(box[0], *args)
        return box[0]

    return call


def _name(dtype):
    return jnp.dtype(dtype).name


def _id(v):
    return str(v) if isinstance(v, int) else _name(v)


# -- kernel: one step kernel vs jnp.dot --------------------------------------------------


def _check(got, want, what):
    """`got` equals `want` (float32) to a 16-bit input's rounding (TF32's for float32
    inputs), relative to the largest element; NaN (an element never written) fails."""
    got = jnp.asarray(got, jnp.float32)
    assert not bool(jnp.isnan(got).any()), f"{what}: elements left unwritten (NaN)"
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 1e-2, f"{what} differs from jnp.dot by {err:.3g} of the largest element"


# matmul_into+kept: the gather step that also writes its piece into the kept gathered
# operand (a training step's), beside matmul_into alone: what the kept store costs.
KERNEL_VARIANTS = ["jnp.dot", "acc+jnp.dot"] + [
    f"{kernel} ({family})" for family in FAMILIES
    for kernel in ("matmul_into", "matmul_into+kept", "matmul_acc")]
if SIZES != "cpu":
    # JAX's own Hopper matmul (Mosaic GPU, warp-specialised): what a Pallas GEMM reaches.
    KERNEL_VARIANTS.append("hopper_matmul_mgpu")


def _hopper_matmul(s, dtype):
    """JAX's `hopper_matmul_mgpu.matmul` at tiles from its own tuning range (128 x 128 x
    64, 4 stages); 16-bit inputs only."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    if jnp.dtype(dtype).itemsize != 2:
        pytest.skip("hopper_matmul_mgpu takes 16-bit inputs")
    if not ON_CPU and jax.devices()[0].device_kind.find("H") < 0:
        pytest.skip("hopper_matmul_mgpu needs Hopper")
    # 128 x 256 tiles with 4 stages overflow the shared memory on jax 0.11 (360 KB).
    config = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                             grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8,
                             wg_dimension=hm.MatmulDimension.N)
    return jax.jit(lambda x, w: hm.matmul(x, w, None, config=config))


@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("s,dtype", KERNEL, ids=_id)
def test_kernel(benchmark, timed, s, dtype, variant):
    from fusedpar.kernels import gpu

    x, w = _inputs(s, dtype, (s, s), (s, s))
    f32 = jnp.float32
    if variant == "jnp.dot":
        fn = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=f32).astype(dtype))
        args = (x, w)
    elif variant == "hopper_matmul_mgpu":
        fn, args = _hopper_matmul(s, dtype), (x, w)
        want = jnp.dot(x, w, preferred_element_type=f32)
        _check(fn(x, w), want, variant)
    elif variant == "acc+jnp.dot":
        fn, args = _donating(lambda acc, x, w: acc + jnp.dot(x, w, preferred_element_type=f32),
                             jnp.zeros((s, s), f32), x, w), ()
    else:
        kernel, family = variant.rstrip(")").split(" (")
        _skip_unless_runs(family)
        kernels = getattr(gpu, family)
        kw = dict(config=TILES[family], interpret=ON_CPU)
        # The kernel computes its product on the device that runs it: the output is
        # poisoned with NaN (every element must be written), the accumulator random.
        if kernel == "matmul_into+kept":
            seg = jnp.zeros((1,), jnp.int32)
            out, kept = jax.jit(lambda o, g, x, w: kernels.matmul_into(
                o, [x], w, seg, axis=0, kept=g, **kw))(
                jnp.full((s, s), jnp.nan, dtype), jnp.full((s, s), jnp.nan, dtype), x, w)
            _check(out, jnp.dot(x, w, preferred_element_type=f32), variant)
            assert bool((kept == x).all()), f"{variant}: the kept piece is not x"
            fn, args = _donating(lambda state, x, w: kernels.matmul_into(
                *state[:1], [x], w, seg, axis=0, kept=state[1], **kw),
                (jnp.zeros((s, s), dtype), jnp.zeros((s, s), dtype)), x, w), ()
        elif kernel == "matmul_into":
            seg = jnp.zeros((1,), jnp.int32)
            _check(jax.jit(lambda o, x, w: kernels.matmul_into(o, [x], w, seg, axis=0, **kw))(
                jnp.full((s, s), jnp.nan, dtype), x, w),
                jnp.dot(x, w, preferred_element_type=f32), variant)
            fn, args = _donating(lambda out, x, w: kernels.matmul_into(
                out, [x], w, seg, axis=0, **kw), jnp.zeros((s, s), dtype), x, w), ()
        else:
            (acc,) = _inputs(s, f32, (s, s))
            _check(jax.jit(lambda a, x, w: kernels.matmul_acc(
                a, [gpu.Term(x, w, s)], (s, s), f32, **kw))(acc, x, w),
                acc + jnp.dot(x, w, preferred_element_type=f32), variant)
            fn, args = _donating(lambda acc, x, w: kernels.matmul_acc(
                acc, [gpu.Term(x, w, s)], (s, s), f32, **kw), jnp.zeros((s, s), f32), x, w), ()
    timed(benchmark, fn, *args, group=f"kernel {_name(dtype)} {s}^3", budget=BUDGET,
          section="kernel", variant=variant, dtype=_name(dtype), size=s, flops=2 * s ** 3)


# -- ring1: the ops on a ring of one device ----------------------------------------------


RING1_OPS = {  # the public call reaching each primitive; x and w are S x S on one device
    "ag_rows": lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", **kw),
    "ag_cols": lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", gather="rhs", dim=1,
                                                             **kw),
    "ag_contract": lambda x, w, **kw: fusedpar.all_gather_matmul(x, w, "x", gather="rhs",
                                                                 dim=0, **kw),
    "rs_rows": lambda x, w, **kw: fusedpar.matmul_reduce_scatter(x, w, "x", dim=0, **kw),
    "rs_cols": lambda x, w, **kw: fusedpar.matmul_reduce_scatter(x, w, "x", dim=1, **kw),
}


RING1_BACKENDS = ["reference", "ring"] + [f"pallas_gpu ({family})" for family in FAMILIES]


@pytest.mark.parametrize("backend", RING1_BACKENDS)
@pytest.mark.parametrize("op", RING1_RUN)
@pytest.mark.parametrize("s,dtype", RING1, ids=_id)
def test_ring1(benchmark, timed, make_mesh, s, dtype, op, backend):
    call = RING1_OPS[op]
    kw = dict(backend=backend.split(" ")[0])
    if backend.startswith("pallas_gpu"):
        family = backend.rstrip(")").split(" (")[1]
        _skip_unless_runs(family)
        kw.update(options=_options(family))
    if backend != "reference":
        kw.update(bidirectional=False)
    fn = jax.jit(jax.shard_map(functools.partial(call, **kw), mesh=make_mesh(1),
                               in_specs=(P(), P()), out_specs=P("x")))
    x, w = _inputs(s, dtype, (s, s), (s, s))
    if backend != "reference":
        ref = jax.jit(jax.shard_map(functools.partial(call, backend="reference"),
                                    mesh=make_mesh(1), in_specs=(P(), P()), out_specs=P("x")))
        _check(fn(x, w), jnp.asarray(ref(x, w), jnp.float32), f"{op} {backend}")
    timed(benchmark, fn, x, w, group=f"ring1 {op} {_name(dtype)} {s}^3", budget=BUDGET,
          section="ring1", op=op, backend=backend, dtype=_name(dtype), size=s, flops=2 * s ** 3)


# -- decomp: N ring steps back to back vs one matmul --------------------------------------


DECOMP_PRIMS = (prims.AG_ROWS, prims.RS_ROWS)


def _decomposed(prim, backend, n, bidirectional, dtype, s):
    """(program, args, want): the N steps of `backend`'s ring for one S x S x S problem;
    `backend` is "ring" or "pallas_gpu (<kernel family>)"."""
    name, options = backend, {}
    if backend.startswith("pallas_gpu"):
        family = backend.rstrip(")").split(" (")[1]
        _skip_unless_runs(family)
        name, options = "pallas_gpu", _options(family)
    # The backend's step provider (`_ring_loop.Steps`): what its ring runs at each step.
    steps = importlib.import_module(f"fusedpar._core._backends.{name}").STEPS
    cfg = Config(backend=name, axis_name="x", axis_size=n, bidirectional=bidirectional,
                 unroll=True, out_dtype=np.dtype(dtype), reduce_dtype=np.dtype(jnp.float32),
                 options=tuple(sorted(options.items())))
    ring = fusedpar.Ring(n, bidirectional)
    me = 0  # the steps device 0 runs; every device runs the same work
    if prim == prims.AG_ROWS:
        # The gathered x arrives as N * directions distinct pieces of (S / N / dirs, S).
        pieces = _inputs(s, dtype, *[(s // n // ring.num_directions, s)] * ring.num_segments)
        (w,) = _inputs(s, dtype, (s, s))

        def program(pieces, w):
            step = steps.gather(prim, cfg, pieces[0], w)
            out = _ring_loop.gather_out(prim, cfg, jnp.zeros((s // n, s), dtype), w)
            for i in range(n):
                segs = tuple(ring.gather_segment(me, i, r) for r in ring.directions)
                out = step(out, tuple(pieces[g] for g in segs),
                           tuple(jnp.int32(g) for g in segs))
            return out.astype(dtype)

        def want(pieces, w):  # the gathered x is the pieces in segment order
            return jnp.dot(jnp.concatenate(pieces), w, preferred_element_type=jnp.float32)

        return jax.jit(program), (tuple(pieces), w), want
    # rs_rows: every step multiplies its own rows of x (distinct by construction).
    x, w = _inputs(s, dtype, (s, s), (s, s))
    length = s // n // ring.num_directions

    def program(x, w):
        accumulate = steps.scatter(prim, cfg, x, w)
        accs = [None] * ring.num_directions
        for i in range(n):
            accs = [accumulate(acc, jnp.int32(ring.scatter_segment(me, i, r)), length)
                    for r, acc in zip(ring.directions, accs)]
        return jnp.concatenate(accs).astype(dtype)

    def want(x, w):  # each direction's accumulator sums its segments' rows of x @ w
        parts = [sum(jnp.dot(x[g * length:(g + 1) * length], w,
                             preferred_element_type=jnp.float32)
                     for g in (ring.scatter_segment(me, i, r) for i in range(n)))
                 for r in ring.directions]
        return jnp.concatenate(parts)

    return jax.jit(program), (x, w), want


DECOMP_CASES = [("jnp.dot", 1, False)] + [
    (b, n, bidi) for n in RINGS for b in ["ring"] + [f"pallas_gpu ({f})" for f in FAMILIES]
    for bidi in (False, True)]


@pytest.mark.parametrize("backend,n,bidirectional", DECOMP_CASES,
                         ids=[f"{b.replace(' ', '')}{'-bidi' if d else ''}-{n}"
                              for b, n, d in DECOMP_CASES])
@pytest.mark.parametrize("prim", DECOMP_PRIMS)
@pytest.mark.parametrize("s,dtype", DECOMP, ids=_id)
def test_decomp(benchmark, timed, s, dtype, prim, backend, n, bidirectional):
    if backend == "jnp.dot":
        fn = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                     .astype(dtype))
        args = _inputs(s, dtype, (s, s), (s, s))
    else:
        fn, args, want = _decomposed(prim, backend, n, bidirectional, dtype, s)
        # The steps compute what they stand for (a bench that times wrong work is no bench).
        got, ref = fn(*args).astype(jnp.float32), want(*args)
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        assert err < 2e-2, f"{backend} steps differ from the dot they decompose: {err:.3g}"
    label = backend + ("-bidi" if bidirectional else "")
    timed(benchmark, fn, *args, group=f"decomp {prim} {_name(dtype)} {s}^3", budget=BUDGET,
          section="decomp",
          prim=prim, backend=label, steps=n, dtype=_name(dtype), size=s, flops=2 * s ** 3)


# -- Markdown tables from the JSON (python bench/test_gpu_steps.py results.json) ----------


def _tables(rows):
    out = []
    by = lambda sec: [r for r in rows if r["section"] == sec]  # noqa: E731
    tflops = lambda r: r["flops"] / r["seconds"] / 1e12  # noqa: E731
    kern = by("kernel")
    # The families the rows hold (a GPU run has both; this may run on a CPU).
    import re

    families = sorted({m.group(1) for r in rows for m in [re.search(
        r"\((mosaic|triton)\)", r.get("variant", r.get("backend", "")))] if m})
    if kern:
        present = {r["variant"] for r in kern}
        variants = [v for v in ["jnp.dot"] + [f"matmul_into ({f})" for f in families]
                    + ["hopper_matmul_mgpu", "acc+jnp.dot"]
                    + [f"matmul_acc ({f})" for f in families] if v in present]
        out += ["### Step kernels vs `jnp.dot` (TFLOP/s; ratio to the XLA counterpart)", "",
                "| dtype | S (S x S x S) | " + " | ".join(variants) + " |",
                "|---|---:|" + "---:|" * len(variants)]
        for key in sorted({(r["dtype"], r["size"]) for r in kern}):
            t = {r["variant"]: r for r in kern if (r["dtype"], r["size"]) == key}
            cells = []
            for v in variants:
                base = ("jnp.dot" if v.startswith(("matmul_into", "hopper")) else
                        "acc+jnp.dot" if v.startswith("matmul_acc") else None)
                if v not in t:
                    cells.append("—")
                    continue
                c = f"{tflops(t[v]):.3g}"
                if base in t:
                    c += f" (**{t[base]['seconds'] / t[v]['seconds']:.2f}x**)"
                cells.append(c)
            out.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
        out.append("")
    ring1 = by("ring1")
    if ring1:
        backends = ["reference", "ring"] + [f"pallas_gpu ({f})" for f in families]
        out += ["### Ops on a ring of 1 device (time; ratio to reference)", "",
                "| op | dtype | S | " + " | ".join(backends) + " |",
                "|---|---|---:|" + "---:|" * len(backends)]
        for key in sorted({(r["op"], r["dtype"], r["size"]) for r in ring1}):
            t = {r["backend"]: r["seconds"] for r in ring1
                 if (r["op"], r["dtype"], r["size"]) == key}
            ref = t.get("reference")
            cells = [("—" if b not in t else f"{t[b] * 1e3:.3g} ms" + (
                f" (**{t[b] / ref:.2f}x**)" if ref and b != "reference" else ""))
                for b in backends]
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
        out.append("")
    dec = by("decomp")
    if dec:
        labels = sorted({r["backend"] for r in dec if r["backend"] != "jnp.dot"})
        steps = sorted({r["steps"] for r in dec if r["backend"] != "jnp.dot"})
        out += ["### Decomposition: N ring steps back to back, transfers left out "
                "(time ratio to one `jnp.dot` of the whole problem)", "",
                "| primitive | dtype | S | " + " | ".join(
                    f"{b} N={n}" for b in labels for n in steps) + " |",
                "|---|---|---:|" + "---:|" * (len(labels) * len(steps))]
        for key in sorted({(r["prim"], r["dtype"], r["size"]) for r in dec}):
            sel = [r for r in dec if (r["prim"], r["dtype"], r["size"]) == key]
            one = next((r["seconds"] for r in sel if r["backend"] == "jnp.dot"), None)
            cells = []
            for b in labels:
                for n in steps:
                    r = next((r for r in sel if r["backend"] == b and r["steps"] == n), None)
                    cells.append("—" if r is None or one is None
                                 else f"{r['seconds'] / one:.2f}x")
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def markdown(paths) -> str:
    """The Markdown tables of one or more JSON files of this bench."""
    import json

    rows, header = [], None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for b in data["benchmarks"]:
            info = dict(b.get("extra_info") or {})
            if info.get("section") in ("kernel", "ring1", "decomp"):
                rows.append(dict(info, seconds=b["stats"]["min"]))
                header = header or (f"{info.get('device_kind')} ({info.get('platform')}), "
                                    f"JAX {info.get('jax_version')}, "
                                    f"{data.get('datetime', '')[:10]}")
    return "\n".join([f"## GPU step kernels — {header}", "",
                      "Times are the minimum over the rounds (pytest-benchmark).", ""]
                     + _tables(rows))


def main(paths):
    print(markdown(paths))


if __name__ == "__main__":
    main(sys.argv[1:])
