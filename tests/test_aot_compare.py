"""The `xla` baseline (`fusedpar._compile._aot_baseline`) and `python -m fusedpar.aot --compare`:
XLA's own partitioning of the layer programs computes the dense model's loss and
gradients; one small comparison per dialect compiles every row, replays it within the
program's own bounds, with nothing unread; --compare refuses what it cannot compare."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from fusedpar._compile import _aot_baseline as baseline, _aot_cli, _aot_compare as compare
from fusedpar._compile import _aot_programs as progs
from fusedpar._core import _primitives as prims

from helpers import needs_aot

SMALL = {"mlp": dict(dim=64, hidden=256, tokens=4),
         "block": dict(dim=32, hidden=64, heads=4, seq=4)}


def _dense(model, x):
    """The model's forward in plain matmuls on one device (the oracle)."""
    def linear(layer, a):
        y = a @ layer.weight.T
        return y if layer.bias is None else y + layer.bias

    def mlp(m, a):
        return a + linear(m.down, jax.nn.gelu(linear(m.up, a)))

    if isinstance(model, progs._MLP):
        return mlp(model, x)
    b, s, _ = x.shape
    q, k, v = (linear(f, x).reshape(b, s, model.heads, -1)
               for f in (model.q, model.k, model.v))
    return mlp(model.mlp, x + linear(model.out, progs._attention(x, q, k, v)))


@pytest.mark.parametrize("program", ["mlp", "block"])
def test_xla_baseline_computes_the_dense_loss_and_gradients(program):
    """On 8 CPU devices, the training step XLA partitions from the sharding constraints
    gives the loss and gradients of the same model computed densely on one device."""
    shape, axes = ((8,), ("tp",)) if program == "mlp" else ((2, 4), ("fsdp", "tp"))
    mesh = jax.make_mesh(shape, axes, devices=jax.devices("cpu")[:8],
                         axis_types=(AxisType.Auto,) * len(shape))
    fn, (p_spec, x_spec, _) = baseline.layer_program(mesh, program, dtype=jnp.float32,
                                                     **SMALL[program])
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    if program == "mlp":
        model = progs._MLP(SMALL["mlp"]["dim"], SMALL["mlp"]["hidden"], jnp.float32, k1)
    else:
        s = SMALL["block"]
        model = progs._Block(s["dim"], s["hidden"], s["heads"], jnp.float32, k1)
    params = jax.tree.map(lambda a, s: jax.device_put(a, s.sharding),
                          eqx.filter(model, eqx.is_array), p_spec)
    x = jax.random.normal(k2, x_spec.shape, jnp.float32)
    y = jax.random.normal(k3, x_spec.shape, jnp.float32)
    with jax.set_mesh(mesh):
        loss, grads = fn.jitted(params, jax.device_put(x, x_spec.sharding),
                                jax.device_put(y, x_spec.sharding))
    static = eqx.filter(model, eqx.is_array, inverse=True)
    want, want_grads = jax.value_and_grad(
        lambda p: jnp.mean(jnp.square(_dense(eqx.combine(p, static), x) - y)))(
            eqx.filter(model, eqx.is_array))
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)


def _check(rows):
    for r in rows:
        assert not r.error, r
        assert r.bounds, f"{r.label}: the replay is below the program's own bounds"
        assert not r.unread, r.unread
        assert r.seconds > 0 and r.communication > 0, r
        assert r.temp_mib is not None and r.temp_mib >= 0, r  # memory_analysis() read
    assert max(r.speedup for r in rows if r.backend == "xla") == pytest.approx(1.0)


ROWS = (("xla", compare.DEFAULT), ("xla", compare.CM), ("reference", compare.CM),
        ("ring", compare.DEFAULT))


@pytest.mark.aot
@needs_aot
@pytest.mark.timeout(120)
def test_compare_gpu_small():
    """8 x H100, a small MLP. The GPU windowed einsum cannot fire in a deviceless
    compile (no fast-interconnect domain: `_aot_baseline`), so XLA's program under the
    collective-matmul settings has no loop; if one appears, the docs must change."""
    texts = {}
    rows = compare.compare("h100x8", "mlp", rows=ROWS, texts=texts, dim=512, hidden=2048,
                           tokens=256)
    _check(rows)
    assert " while(" not in texts["xla", compare.CM]
    ring = rows[-1]
    assert ring.hidden == ring.transfers, ring
    assert f"| {compare.mib(ring.temp_mib)} | " in compare.markdown(rows)


def test_the_table_says_why_auto_may_be_behind():
    """Behind the best xla row by more than 2%, the table names fusedpar's float32 sums
    and the argument that sums as XLA does; level or ahead, it says nothing of them."""
    def table(auto_speedup):
        return compare.markdown([
            compare.Row("xla", compare.DEFAULT, seconds=1e-3, speedup=1.0),
            compare.Row("auto", compare.DEFAULT, seconds=1e-3 / auto_speedup,
                        speedup=auto_speedup)])

    assert "auto is 0.93x the best xla row here" in table(0.93)
    assert "reduce_dtype=jnp.bfloat16" in table(0.93)
    assert "reduce_dtype" not in table(0.99) and "reduce_dtype" not in table(1.2)


@pytest.mark.aot
@needs_aot
@pytest.mark.timeout(120)
def test_compare_tpu_small():
    """A v5e 2x4 slice, a small MLP: every row compiles and replays within its bounds."""
    _check(compare.compare("v5e:2x4", "mlp", rows=ROWS, dim=512, hidden=2048,
                           tokens=256))


@pytest.mark.aot
@needs_aot
@pytest.mark.timeout(180)
def test_compare_offloads_xlas_collectives_to_the_sparsecores():
    """v6e: the `(SparseCore offload)` row compiles the plain block with XLA's FSDP
    collectives on the SparseCores (`call-start`s on the "sparsecore" thread), which the
    replay reads within the program's bounds; the default row has none."""
    texts = {}
    rows = compare.compare("v6e:2x4", "block", rows=(("xla", compare.DEFAULT),
                                                     ("xla", compare.OFFLOAD)),
                           texts=texts, dim=512, hidden=2048, heads=4, seq=128)
    _check(rows)
    offloaded = 'async_execution_thread="sparsecore"'
    assert offloaded not in texts["xla", compare.DEFAULT]
    assert offloaded in texts["xla", compare.OFFLOAD]


@needs_aot  # the targets' meshes are the compilers' devices
def test_offload_rows_only_where_there_are_sparsecores(monkeypatch):
    """v5e and the GPUs have no SparseCores: no offload rows there (nothing compiled for
    them); on v5p and v6e the xla rows get the offload's flags."""
    compiled = []

    def row(target, mesh_, program, backend, settings, *rest):
        compiled.append((backend, settings))
        return compare.Row(backend, settings, seconds=1e-3)

    monkeypatch.setattr(compare, "_row", row)
    xla = [("xla", s) for s in (compare.DEFAULT, compare.CM, compare.OFFLOAD,
                                compare.CM_OFFLOAD)]
    for target, want in (("v5e:2x4", xla[:2]), ("h100x8", xla[:2]), ("v6e:2x4", xla)):
        compiled.clear()
        rows = compare.compare(target, "mlp", rows=xla)
        assert compiled == want and [(r.backend, r.settings) for r in rows] == want
    assert compare.has_sparsecores("v5p:2x2x2") and not compare.has_sparsecores("v5e:2x4")
    sc = "xla_tpu_enable_sparse_core_collective_offload_all_gather"
    assert compare.options("v6e:2x4", "xla", compare.CM_OFFLOAD)[sc] is True
    assert sc not in compare.options("v6e:2x4", "xla", compare.CM)


@pytest.mark.parametrize("argv,message", [
    (["--program", "demo"], "--compare: --program must be one of ops, mlp, block, prefill, decode,"),
    (["--program", "mlp", "--mesh", "8"], "leave out --mesh and --axes"),
])
def test_compare_refuses_what_it_cannot_compare(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _aot_cli.main(["--target", "h100x8", "--compare"] + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_collective_matmul_flags_name_the_platform():
    assert "xla_gpu_threshold_for_windowed_einsum_mib=0" in baseline.collective_matmul_flags(
        "gpu")
    with pytest.raises(ValueError, match="platform must be one of"):
        baseline.collective_matmul_flags("cuda")


def test_prefill_and_decode_are_the_blocks_forward():
    """prefill and decode: the block's forward alone (no target argument, no gradients),
    its output laid out as its input; an unknown size names the valid ones."""
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), devices=jax.devices("cpu")[:8],
                         axis_types=(AxisType.Auto,) * 2)
    for program in ("prefill", "decode"):
        fn, args = progs.block_program(mesh, "reference", program=program, dim=32,
                                       hidden=64, heads=4, seq=2)
        assert len(args) == 2
        with jax.set_mesh(mesh):
            out = jax.eval_shape(fn.jitted, *args)
        assert out.shape == args[1].shape == (2, 8, 32)
    with pytest.raises(TypeError, match="valid: .*'tokens'"):
        progs.mlp_program(mesh, "reference", seq=3)


@pytest.mark.parametrize("prim", prims.PRIMITIVES)
def test_xla_op_is_the_ops_math(prim):
    """Each op's xla program (x @ w under jax.jit, the op's layouts) gives x @ w (ag_rows:
    each of the 8 devices' copy of it, stacked) and the vjp of the cotangent `ct * y`, on
    8 CPU devices."""
    mesh = jax.make_mesh((8,), ("x",), devices=jax.devices("cpu")[:8],
                         axis_types=(AxisType.Auto,))
    fn, specs = baseline.op_program(mesh, prim, rows=8, k=16, cols=16, dtype=jnp.float32)
    arrays = [jax.random.normal(key, s.shape, jnp.float32)
              for key, s in zip(jax.random.split(jax.random.key(2), 3), specs)]
    with jax.set_mesh(mesh):
        y, dx, dw = fn.jitted(*(jax.device_put(a, s.sharding) for a, s in zip(arrays, specs)))
    x, w, ct = arrays
    copies = 8 if prim == prims.AG_ROWS else 1
    want, vjp = jax.vjp(lambda x, w: jnp.tile(x @ w, (copies, 1)), x, w)
    for got, ref in zip((y, dx, dw), (want,) + vjp(ct * want)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
