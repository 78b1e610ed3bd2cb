"""bfloat16 inputs with a large contraction: every backend accumulates in float32.

Stated bound. For bf16 inputs a backend must compute each output element as the float32
sum of exact products (a bf16 x bf16 product has at most 16 significant bits, so it is
exact in f32), sum partial results across the ring in f32 (`reduce_dtype` default), and
round once to bf16 at the end. With `u = 2^-8` (bf16 unit roundoff), `K` the contraction
length and `N` the ring size, the error against the exact result `y` is then at most

    |y_bf16 - y| <= u |y| + (1 + u) * gamma(K + N) * sum_k |x_k w_k|,
    gamma(n) = n 2^-24 / (1 - n 2^-24)                       (float32 summation, Higham)

one rounding of the output plus the f32 rounding of at most K + N additions. The same
holds for both gradients (contraction over the output's rows or columns).

`test_bf16_accumulates_in_f32` checks it two ways, for every case and backend:

- exact sums: small-integer inputs make every partial sum an integer
  below 2^24, exact in f32 in any order; the second term is then 0 and the result must be
  *bitwise* the exact product rounded once to bf16, values and gradients. A bf16
  accumulator anywhere fails it (`test_bf16_reduction_is_visible`: `reduce_dtype=bf16`).
- random inputs: normal inputs, the inequality elementwise, and the
  same bound (x3 for the f32 term) against an f32 computation of the same values.

The `"reference"` backend meets the same bound: its gradients come from the shared
custom VJP, whose reduce-scatter of the gathered operand's gradient sums in float32
(JAX's own autodiff of a bf16 `all_gather` would sum the N partials in bf16 — an earlier
version did, and failed `test_exact_sums_round_once` at ~540 of 1M elements).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fusedpar
from fusedpar._core import _backends
from helpers import mesh, same_kernels_as

pytestmark = pytest.mark.timeout(300)

N = 4
AX = "x"
K = 4096  # global contraction length
U_BF16 = 2.0 ** -8
U_F32 = 2.0 ** -24

# (name, op, kwargs, local x shape, x spec, local w shape, w spec, out spec); each call
# contracts over K in total. Rows/columns are multiples of 32 so that every kernel
# (Triton needs multiples of 16 per bidirectional half-step) can run them.
CASES = (
    ("ag_rows", "all_gather_matmul", dict(gather="lhs", dim=0),
     (32, K), P(AX), (K, 32), P(None, AX), P(None, AX)),
    ("ag_cols", "all_gather_matmul", dict(gather="rhs", dim=1),
     (32, K), P(AX), (K, 32), P(None, AX), P(AX)),
    ("ag_contract", "all_gather_matmul", dict(gather="rhs", dim=0),
     (32, K), P(AX), (K // N, 32), P(AX), P(AX)),
    ("rs_rows", "matmul_reduce_scatter", dict(dim=0),
     (128, K // N), P(None, AX), (K // N, 32), P(AX), P(AX)),
    ("rs_cols", "matmul_reduce_scatter", dict(dim=1),
     (32, K // N), P(None, AX), (K // N, 128), P(AX), P(None, AX)),
)


# Three cases whose forward and backward passes run all five primitives (the backward of
# ag_cols is rs_cols, of ag_contract rs_rows, of rs_rows ag_rows): what the interpreted
# kernels, slow on CPU, are run on.
KERNEL_CASES = ("ag_cols", "ag_contract", "rs_rows")


def _params():
    """(case, backend) pytest params: every case on every registered backend that can run
    it here (one that runs another's very kernels is tested as that one)."""
    out = []
    for name in _backends.names():
        kernel = _backends.get(name).kernels is not None
        for case in CASES:
            if kernel and case[0] not in KERNEL_CASES:
                continue
            _, op, kw, xs, _, ws, _, _ = case
            marks = [pytest.mark.slow] if kernel else []
            try:
                other = same_kernels_as(name, op, jax.ShapeDtypeStruct(xs, jnp.bfloat16),
                                        jax.ShapeDtypeStruct(ws, jnp.bfloat16), N, **kw)
                if other is not None:
                    marks.append(pytest.mark.skip(reason=f"runs {other}'s kernels here"))
            except NotImplementedError as e:
                marks.append(pytest.mark.skip(reason=str(e)))
            except Exception:  # noqa: BLE001 - e.g. a kernel package that fails to import:
                pass  # the test itself then fails with it (collection stays intact)
            out.append(pytest.param(case, name, marks=marks, id=f"{case[0]}-{name}"))
    return out


def _global(shape, spec):
    """The global shape of an operand whose local shape is `shape` under `spec`."""
    return tuple(n * (N if (spec[i] if i < len(spec) else None) else 1)
                 for i, n in enumerate(shape))


@functools.lru_cache(maxsize=None)
def _compiled(backend, name, extra=()):
    """jit(value and gradients) of one case; cached so both tests share the compile."""
    _, op, kw, _, xspec, _, wspec, ospec = next(c for c in CASES if c[0] == name)

    def local(x, w):
        return getattr(fusedpar, op)(x, w, AX, backend=backend, **kw, **dict(extra))

    f = jax.shard_map(local, mesh=mesh((N,), (AX,)), in_specs=(xspec, wspec),
                      out_specs=ospec, check_vma=not backend.startswith("pallas"))

    @jax.jit
    def value_and_grads(x, w, ct):
        y, vjp = jax.vjp(f, x, w)
        return y, *vjp(ct)

    return value_and_grads


def _run(backend, case, x, w, ct, **extra):
    """Value and gradients of one case on `backend`, as float64 numpy arrays."""
    out = _compiled(backend, case[0], tuple(sorted(extra.items())))(x, w, ct)
    return [np.asarray(a.astype(jnp.float32), np.float64) for a in out]


def _operands(case, kind):
    """Global x, w, and a cotangent for the output, as bf16 arrays, plus exact f64 copies."""
    _, op, kw, xs, xspec, ws, wspec, ospec = case
    rng = np.random.default_rng(0)
    xg, wg = _global(xs, xspec), _global(ws, wspec)

    def draw(shape, scale):
        if kind == "integers":
            return rng.integers(-scale, scale + 1, shape).astype(np.float64)
        return rng.standard_normal(shape)

    x64, w64 = draw(xg, 8), draw(wg, 8)
    x64 = np.asarray(x64.astype(jnp.bfloat16), np.float64)  # the values bf16 holds
    w64 = np.asarray(w64.astype(jnp.bfloat16), np.float64)
    y_local = jax.eval_shape(jax.shard_map(
        lambda x, w: getattr(fusedpar, op)(x, w, AX, backend="reference", **kw),
        mesh=mesh((N,), (AX,)), in_specs=(xspec, wspec), out_specs=ospec),
        jax.ShapeDtypeStruct(xg, jnp.bfloat16), jax.ShapeDtypeStruct(wg, jnp.bfloat16))
    ct64 = np.asarray(draw(y_local.shape, 4).astype(jnp.bfloat16), np.float64)
    as_bf16 = lambda a: jnp.asarray(a.astype(jnp.bfloat16))  # noqa: E731
    return (as_bf16(x64), as_bf16(w64), as_bf16(ct64)), (x64, w64, ct64)


def _exact(x64, w64, ct64):
    """The exact value and gradients: every case's layouts compose to `x @ w` globally."""
    return x64 @ w64, ct64 @ w64.T, x64.T @ ct64


def _sum_abs(x64, w64, ct64):
    """sum_k |a_k b_k| for each element of the value and both gradients."""
    return _exact(np.abs(x64), np.abs(w64), np.abs(ct64))


OUTPUTS = ("value", "dx", "dw")  # what `_run` returns, in order


def _gamma(n, u=U_F32):
    return n * u / (1 - n * u)


def _assert_rounded_once(got, exact, what):
    rounded = np.asarray(exact.astype(jnp.bfloat16), np.float64)
    bad = np.flatnonzero(got != rounded)
    assert bad.size == 0, (
        f"{what} is not the exact result rounded once to bf16 at {bad.size} of "
        f"{got.size} elements, e.g. got {got.flat[bad[0]]} for exact {exact.flat[bad[0]]} "
        f"(bf16: {rounded.flat[bad[0]]})")


@pytest.mark.parametrize("case,backend", _params())
def test_bf16_accumulates_in_f32(case, backend):
    """Both tests of the module docstring on one compiled program."""
    _check_exact(case, backend)
    _check_random(case, backend)


def _check_exact(case, backend):
    (x, w, ct), (x64, w64, ct64) = _operands(case, "integers")
    got = _run(backend, case, x, w, ct)
    want = _exact(x64, w64, ct64)
    assert max(np.max(np.abs(e)) for e in want) < 2 ** 24  # every partial sum is exact
    for i, (g, e, what) in enumerate(zip(got, want, OUTPUTS)):
        _assert_rounded_once(g, e, f"{case[0]} on {backend}: {what}")


def _check_random(case, backend):
    (x, w, ct), (x64, w64, ct64) = _operands(case, "normal")
    got = _run(backend, case, x, w, ct)
    want = _exact(x64, w64, ct64)
    sums = _sum_abs(x64, w64, ct64)
    # Contraction lengths: K for the value; the output's global columns / rows for dx / dw.
    lengths = (x64.shape[1], w64.shape[1], x64.shape[0])
    # "An f32 computation": the same bf16 values multiplied in float32 (BLAS).
    f32 = _exact(*(a.astype(np.float32) for a in (x64, w64, ct64)))
    for i, (g, e, s, k, y32, what) in enumerate(zip(got, want, sums, lengths, f32, OUTPUTS)):
        acc = (1 + U_BF16) * _gamma(k + N) * s
        bound = U_BF16 * np.abs(e) + acc
        err = np.abs(g - e)
        worst = np.argmax(err - bound)
        assert np.all(err <= bound), (
            f"{case[0]} on {backend}: {what} error {err.flat[worst]:.3g} > bound "
            f"{bound.flat[worst]:.3g} (exact {e.flat[worst]:.6g}, got {g.flat[worst]:.6g})")
        # Against the f32 computation, which is itself within the f32 term of exact.
        assert np.all(np.abs(g - y32) <= U_BF16 * np.abs(y32) + 3 * acc), (
            f"{case[0]} on {backend}: {what} further from the f32 result than the bound")


def test_bf16_reduction_is_visible():
    """The exact test catches a bf16 accumulator: `reduce_dtype=bfloat16` rounds each
    device's partial sum before the ring adds them, so some results differ from the
    once-rounded exact value (the price of halving the reduce-scatter's bytes)."""
    case = CASES[3]  # rs_rows
    (x, w, ct), (x64, w64, ct64) = _operands(case, "integers")
    y = _run("ring", case, x, w, ct, reduce_dtype=jnp.bfloat16)[0]
    exact = _exact(x64, w64, ct64)[0]
    rounded = np.asarray(exact.astype(jnp.bfloat16), np.float64)
    assert np.count_nonzero(y != rounded) > 0
    # Within the bf16 bound for N partial sums: u per partial, gamma_bf16(N) for the sum.
    s = _sum_abs(x64, w64, ct64)[0]
    assert np.all(np.abs(y - exact) <= U_BF16 * np.abs(exact)
                  + (U_BF16 + _gamma(N, U_BF16)) * (1 + U_BF16) * s)
