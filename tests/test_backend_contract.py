"""The backend contract, run by every registered backend and by a made-up one.

Every name in `fusedpar._core._backends.names()` (read when the tests are collected) and
`toy` — a backend defined here (all_gather + dot, dot + psum_scatter), registered with
`_backends.register` for its tests and removed after — runs the same tests unedited:

- each primitive's value and both gradients equal dense math on the global operands
  (`x @ w`), on a ring of 2 of the CPU devices, and ag_rows on a ring of 4 (its
  gradient runs the dual primitive, rs_rows, on it too);
- an all-gather and a reduce-scatter under `jax.vmap` over a leading batch axis of x;
- bad input (a contraction that does not match, an option it does not read) is a clear
  error naming what is wrong.

A case the backend says it cannot run (`fusedpar.explain` raises NotImplementedError, with
its `unavailable` reason) is skipped with that reason; a backend that runs another's very
kernels here ("pallas" on CPU is pallas_tpu) is tested as that one. Pallas backends run
their kernels in interpret mode here, as the other tests do. The file takes about 30 s of
one CPU core.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _backends, _primitives as prims
from fusedpar import cost_model
from helpers import assert_close, mesh, normal, same_kernels_as

pytestmark = pytest.mark.timeout(300)


# -- a made-up backend: one file's worth, registered through the registry ----------------


def _toy_run(prim, cfg, x, w, return_gathered=False):
    """all_gather then dot, or dot then psum_scatter, on the 2-D primitive's operands."""
    axis = prims.of(prim).gather_axis
    if prim in prims.GATHERS:
        if prims.of(prim).traveller == "x":
            gathered = lax.all_gather(x, cfg.axis_name, axis=axis, tiled=True)
            out = jnp.dot(gathered, w, preferred_element_type=jnp.float32)
        else:
            gathered = lax.all_gather(w, cfg.axis_name, axis=axis, tiled=True)
            out = jnp.dot(x, gathered, preferred_element_type=jnp.float32)
        out = out.astype(cfg.out_dtype)
        return (out, gathered) if return_gathered else out
    partial = jnp.dot(x, w, preferred_element_type=cfg.reduce_dtype)
    return lax.psum_scatter(partial, cfg.axis_name, scatter_dimension=axis,
                            tiled=True).astype(cfg.out_dtype)


def _toy_unavailable(call):
    if call.comm_dtype is not None:
        return "toy sends the inputs' own dtype only"
    return None


TOY = _backends.Backend(
    name="toy", description="all_gather + dot; dot + psum_scatter (a test's backend)",
    run=_toy_run, unavailable=_toy_unavailable, cost="reference", ring=False)

# Kernel backends run interpreted here: slow, as the other tests mark them.
BACKENDS = [pytest.param(name, marks=[pytest.mark.slow] if _backends.get(name).kernels else [])
            for name in _backends.names()] + [TOY.name]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A backend's name; the made-up one is registered for the test and removed after."""
    if request.param != TOY.name:
        yield request.param
        return
    _backends.register(TOY)
    try:
        yield TOY.name
    finally:
        _backends.unregister(TOY.name)


# -- the cases: each primitive once, global result x @ w -------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One primitive through its public op: local shapes on a ring of `n` (functions of
    n), specs over axis "x", and the op's keyword arguments."""

    prim: str
    op: str
    kwargs: dict
    x_local: object  # n -> local shape of x
    w_local: object
    x_spec: P
    w_spec: P
    out_spec: P

    def shapes(self, n):
        return self.x_local(n), self.w_local(n)

    def global_shapes(self, n):
        return tuple(tuple(s * n if name == "x" else s for s, name in
                           zip(shape, tuple(spec) + (None,) * (2 - len(spec))))
                     for shape, spec in zip(self.shapes(n), (self.x_spec, self.w_spec)))


# Rows and columns of 32 so that every kernel family can tile them.
CASES = [
    Case(prims.AG_ROWS, "all_gather_matmul", dict(gather="lhs", dim=0),
         lambda n: (32, 64), lambda n: (64, 32), P("x"), P(None, "x"), P(None, "x")),
    Case(prims.AG_COLS, "all_gather_matmul", dict(gather="rhs", dim=1),
         lambda n: (32, 64), lambda n: (64, 32), P("x"), P(None, "x"), P("x")),
    Case(prims.AG_CONTRACT, "all_gather_matmul", dict(gather="rhs", dim=0),
         lambda n: (32, 64 * n), lambda n: (64, 32), P("x"), P("x"), P("x")),
    Case(prims.RS_ROWS, "matmul_reduce_scatter", dict(dim=0),
         lambda n: (32 * n, 64), lambda n: (64, 32), P(None, "x"), P("x"), P("x")),
    Case(prims.RS_COLS, "matmul_reduce_scatter", dict(dim=1),
         lambda n: (32, 64), lambda n: (64, 32 * n), P(None, "x"), P("x"), P(None, "x")),
]


def _skip_unless_runs(backend, case, n):
    """Skip with the backend's own reason where it cannot run `case` here, and where it
    runs the very kernels a backend after it in the table runs (here "pallas" runs
    pallas_tpu's interpreted kernels), which that one's tests cover."""
    x, w = (jax.ShapeDtypeStruct(s, jnp.float32) for s in case.shapes(n))
    try:
        other = same_kernels_as(backend, case.op, x, w, n, platform="cpu", **case.kwargs)
    except NotImplementedError as e:
        pytest.skip(str(e)[:300])
    if other is not None:
        pytest.skip(f"{backend} runs {other}'s kernels here, tested as {other}")


def _program(backend, case, n, batched=False):
    """The op under shard_map on a ring of `n`, jitted: `(x, w) -> out` (global arrays);
    with `batched`, x has a leading batch axis the op is vmapped over."""
    def local(x, w):
        f = lambda x: getattr(fusedpar, case.op)(x, w, "x", backend=backend, **case.kwargs)
        return jax.vmap(f)(x) if batched else f(x)

    lead = (None,) if batched else ()
    return jax.shard_map(local, mesh=mesh((n,), ("x",)),
                         in_specs=(P(*lead, *case.x_spec), case.w_spec),
                         out_specs=P(*lead, *case.out_spec),
                         check_vma=_backends.get(backend).check_vma)


# -- the contract ------------------------------------------------------------------------


# Kept small (the kernels are interpreted here): every primitive on a ring of 2; on a
# ring of 4 ag_rows, whose gradient runs rs_rows there; an all-gather and a
# reduce-scatter under vmap.
SIZED = [(c, 2) for c in CASES] + [(c, 4) for c in CASES if c.prim == "ag_rows"]
VMAPPED = [c for c in CASES if c.prim in ("ag_cols", "rs_rows")]


@pytest.mark.parametrize("case, n", SIZED, ids=[f"{c.prim}-{n}" for c, n in SIZED])
def test_values_and_gradients_match_dense_math(backend, case, n):
    _skip_unless_runs(backend, case, n)
    xs, ws = case.global_shapes(n)
    x, w = normal(0, xs, jnp.float32), normal(1, ws, jnp.float32)
    ct = normal(2, (xs[0], ws[1]), jnp.float32)
    f = _program(backend, case, n)

    def loss(f):
        return lambda x, w: jnp.vdot(f(x, w), ct)

    dense = lambda x, w: jnp.dot(x, w, precision=lax.Precision.HIGHEST)
    got = jax.jit(lambda x, w: (f(x, w), jax.grad(loss(f), (0, 1))(x, w)))(x, w)
    want = (dense(x, w), jax.grad(loss(dense), (0, 1))(x, w))
    assert_close(got[0], want[0], jnp.float32, f"{backend} {case.prim} n={n} value")
    for name, g, d in zip(("dx", "dw"), got[1], want[1]):
        assert_close(g, d, jnp.float32, f"{backend} {case.prim} n={n} {name}")


@pytest.mark.parametrize("case", VMAPPED, ids=[c.prim for c in VMAPPED])
def test_vmap_over_a_leading_batch_axis(backend, case):
    n, batch = 2, 2
    _skip_unless_runs(backend, case, n)
    xs, ws = case.global_shapes(n)
    x, w = normal(3, (batch,) + xs, jnp.float32), normal(4, ws, jnp.float32)
    got = jax.jit(_program(backend, case, n, batched=True))(x, w)
    want = jnp.einsum("bmk,kn->bmn", x, w, precision=lax.Precision.HIGHEST)
    assert_close(got, want, jnp.float32, f"{backend} {case.prim} vmapped")


def test_bad_input_is_a_clear_error(backend):
    case, n = CASES[0], 2
    _skip_unless_runs(backend, case, n)
    x, w = (jax.ShapeDtypeStruct(s, jnp.float32) for s in case.global_shapes(n))
    short_w = jax.ShapeDtypeStruct((w.shape[0] - 1, w.shape[1]), jnp.float32)
    with pytest.raises(ValueError, match="contracting dimensions differ: x has 64, w has 63"):
        jax.eval_shape(_program(backend, case, n), x, short_w)

    def unknown_option(x, w):
        return fusedpar.all_gather_matmul(x, w, "x", backend=backend,
                                          options={"no_such_option": 1})

    f = jax.shard_map(unknown_option, mesh=mesh((n,), ("x",)),
                      in_specs=(case.x_spec, case.w_spec), out_specs=case.out_spec,
                      check_vma=_backends.get(backend).check_vma)
    with pytest.raises(ValueError, match=rf"no_such_option.*not read by backend '{backend}'"):
        jax.eval_shape(f, x, w)


# -- what the rest of the package sees of a made-up backend -----------------------------


def test_a_registered_backend_is_seen_through_its_record():
    """Registered, `toy` is a valid `backend=`, listed after the built-ins; the cost model
    estimates it by its declared family; `auto` never weighs it (not a candidate);
    unregistered, it is gone, and registering a bad record is an error."""
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    assert "toy" not in fusedpar.backend_names()
    _backends.register(TOY)
    try:
        assert fusedpar.backend_names()[-1] == "toy"
        choice = fusedpar.explain("all_gather_matmul", x, w, 8, backend="toy", platform="gpu")
        assert choice.backend == "toy" and "bidirectional" not in str(choice)
        est = cost_model.breakdown("ag_rows", x.shape, w.shape, 8, "bfloat16", "h100_sxm",
                                   backends=("reference", "toy"))
        assert est["toy"].seconds == est["reference"].seconds > 0
        auto = fusedpar.explain("all_gather_matmul", x, w, 8, platform="gpu")
        assert auto.backend != "toy" and "toy" not in auto.reason
        assert set(cost_model.estimate("all_gather_matmul", x.shape, w.shape, 8)) == {
            b.name for b in _backends.candidates()} == {"reference", "ring", "pallas"}
        with pytest.raises(ValueError, match="'toy' is registered already"):
            _backends.register(TOY)
    finally:
        _backends.unregister("toy")
    assert "toy" not in fusedpar.backend_names()
    with pytest.raises(ValueError, match="unknown backend='toy'"):
        fusedpar.explain("all_gather_matmul", x, w, 8, backend="toy")
    with pytest.raises(ValueError, match="cost='roofline'"):
        _backends.register(dataclasses.replace(TOY, cost="roofline"))
    with pytest.raises(ValueError, match="name must be"):
        _backends.register(dataclasses.replace(TOY, name="auto"))
    assert np.all([b.name != "toy" for b in _backends.TABLE.values()])


def test_auto_weighs_a_registered_candidate():
    """A candidate is estimated by its cost family and weighed by `auto` beside the
    built-ins (here it ties with the lax ring, which, registered first, keeps the pick)."""
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    before = fusedpar.explain("all_gather_matmul", x, w, 8, platform="tpu")
    _backends.register(dataclasses.replace(TOY, name="toy_ring", cost="ring", candidate=True))
    try:
        auto = fusedpar.explain("all_gather_matmul", x, w, 8, platform="tpu")
        est = cost_model.estimate("all_gather_matmul", x.shape, w.shape, 8, "bfloat16",
                                  "tpu_v5e")
    finally:
        _backends.unregister("toy_ring")
    assert est["toy_ring"] == est["ring"]
    assert "toy_ring" in auto.reason and auto.backend == before.backend != "toy_ring"
