"""The layers' `reduce_dtype`: what their reduce-scatters sum and send partial sums in."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fusedpar
from helpers import assert_close, equations, mesh, needs_aot, normal

pytestmark = pytest.mark.timeout(120)

BF16 = jnp.bfloat16


def _layers(kind, reduce_dtype):
    """Sequence-parallel Column and Row over "tp" (Row's forward reduce-scatters, Column's
    backward), or two FSDPLinear over "fsdp" (their weight gradients)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    kw = dict(reduce_dtype=reduce_dtype, dtype=BF16)
    if kind == "fsdp":
        return (fusedpar.FSDPLinear(16, 32, key=k1, **kw),
                fusedpar.FSDPLinear(32, 16, key=k2, **kw))
    return (fusedpar.ColumnLinear(16, 32, key=k1, sequence_parallel=True, **kw),
            fusedpar.RowLinear(32, 16, key=k2, sequence_parallel=True, **kw))


def _loss(model, x):
    up, down = model
    return jnp.sum(jnp.sin(down(jnp.tanh(up(x))).astype(jnp.float32)))


def _scattered_dtypes(fn, *args):
    """The dtypes of every array the program reduce-scatters (forward and backward)."""
    return {jnp.dtype(e.invars[0].aval.dtype).name
            for e in equations(jax.make_jaxpr(fn)(*args))
            if e.primitive.name == "reduce_scatter"}


@pytest.mark.parametrize("reduce_dtype", [None, BF16], ids=["default", "bf16"])
@pytest.mark.parametrize("kind", ["tp", "fsdp"])
def test_layers_reduce_in_reduce_dtype(kind, reduce_dtype):
    x = normal(0, (4, 8, 16), BF16)
    layers = _layers(kind, reduce_dtype)
    grad = eqx.filter_value_and_grad(lambda mx: _loss(*mx))
    want = grad((layers, x))
    m = mesh((4,), (kind,))
    with jax.set_mesh(m):
        model = fusedpar.shard(layers, m)
        got = eqx.filter_jit(grad)((model, x))
        dtypes = _scattered_dtypes(lambda mx: grad(mx)[1], (model, x))
    assert dtypes == {"float32" if reduce_dtype is None else "bfloat16"}
    assert_close(got[0], want[0], BF16, "loss")
    for i in range(2):
        assert_close(got[1][0][i].weight, want[1][0][i].weight, BF16, f"d{i}.weight")
    assert "reduce_dtype=bfloat16" in fusedpar.describe(layers) or reduce_dtype is None


def test_reduce_dtype_must_be_floating():
    with pytest.raises(TypeError, match="reduce_dtype must be a floating dtype"):
        fusedpar.RowLinear(32, 16, key=jax.random.key(0), reduce_dtype=jnp.int8)
    assert "reduce_dtype=jnp.bfloat16" in repr(fusedpar.Row(reduce_dtype=BF16))


@pytest.mark.aot
@needs_aot
@pytest.mark.parametrize("backend", ["reference", "ring"])
def test_bfloat16_sums_are_what_the_dot_writes(backend):
    """Compiled for 8 x H100 with cuBLAS GEMMs, a bfloat16 reduce-scatter's partial
    products come out of the GEMM in bfloat16 (it accumulates in float32 inside), with
    no float32 product and a convert after it: that pass cost rs_rows 4% there."""
    from fusedpar import aot
    from fusedpar._compile import _aot_programs as progs
    from fusedpar._core import _primitives as prims

    mesh = aot.mesh("h100x8", (8,), ("x",))
    program, args = progs.op_program(mesh, prims.RS_ROWS, backend, backward=False,
                                     rows=256, k=512, cols=512, reduce_dtype=BF16)
    text = program.lower(*args).compile(
        compiler_options=aot.gpu_compiler_options(cublas=True)).as_text()
    assert "cublas" in text
    assert not re.findall(r"f32\[\d+,\d+\]", text), re.findall(r".*f32\[\d+,\d+\].*", text)[:3]
