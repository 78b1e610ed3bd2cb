"""`jax.vmap` over a primitive call: fold the mapped dimension into the 2-D problem.

`jax.vmap(layer)(x)` reaches the backends through the ops' custom_vjp, whose forward and
backward JAX batches by vmapping them. A lax ring batches by itself, but a Pallas kernel's
`pallas_call` does not (its blocks are laid out for 2-D operands). `vmappable(run)` gives
`run` a `custom_vmap` rule that turns the batched call back into one 2-D call:

- only `x` mapped, `x (b, M, K)`: its rows are interleaved, `(M, b) -> M*b` rows, so each
  device's row block stays contiguous for the `*_rows` primitives; the result's rows are
  un-interleaved the same way;
- only `w` mapped, `w (b, K, n)`: its columns are interleaved, `(n, b) -> n*b` columns,
  likewise for the `*_cols` primitives' column blocks;
- both mapped (the weight gradient in the backward pass, where each example has its own
  `x` and cotangent): per-example products cannot be folded into one matmul, so the same
  backend runs once per example (`lax.map`) — slower, but never a different backend.

Only the Pallas backends need this (the `pallas_gpu` and `pallas_tpu` backends apply it); the lax ring batches itself.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from . import _primitives as P


def _fold_rows(x):  # (b, M, K) -> (M*b, K), row m*b + i is x[i, m]
    b, m, k = x.shape
    return jnp.swapaxes(x, 0, 1).reshape(m * b, k)


def _unfold_rows(y, b):  # (R*b, n) -> (b, R, n)
    return jnp.swapaxes(y.reshape(y.shape[0] // b, b, y.shape[1]), 0, 1)


def _fold_cols(w):  # (b, K, n) -> (K, n*b), column j*b + i is w[i, :, j]
    b, k, n = w.shape
    return jnp.moveaxis(w, 0, 2).reshape(k, n * b)


def _unfold_cols(y, b):  # (R, C*b) -> (b, R, C)
    return jnp.moveaxis(y.reshape(y.shape[0], y.shape[1] // b, b), 2, 0)


def vmappable(run):
    """`run(prim, cfg, x, w, return_gathered=False)` with the vmap rule described above."""

    @functools.wraps(run)
    def wrapped(prim, cfg, x, w, return_gathered=False):
        gathers = return_gathered and P.of(prim).gathers
        travels_x = gathers and P.of(prim).traveller == "x"

        @custom_vmap
        def call(x, w):
            return run(prim, cfg, x, w, return_gathered)

        @call.def_vmap
        def rule(axis_size, in_batched, x, w):
            xb, wb = in_batched
            b = axis_size
            if xb and wb:
                out = lax.map(lambda xw: run(prim, cfg, *xw, return_gathered), (x, w))
                return out, ((True, True) if gathers else True)
            if xb:
                res = wrapped(prim, cfg, _fold_rows(x), w, return_gathered)
                if not gathers:
                    return _unfold_rows(res, b), True
                out, g = res
                return ((_unfold_rows(out, b), _unfold_rows(g, b) if travels_x else g),
                        (True, travels_x))
            res = wrapped(prim, cfg, x, _fold_cols(w), return_gathered)
            if not gathers:
                return _unfold_cols(res, b), True
            out, g = res
            return ((_unfold_cols(out, b), g if travels_x else _unfold_cols(g, b)),
                    (True, not travels_x))

        return call(x, w)

    wrapped._fusedpar_vmappable = True
    return wrapped
