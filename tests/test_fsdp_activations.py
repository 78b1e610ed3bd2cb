"""FSDP moving the activations instead of the weight (`FSDP(gather="activations")`, and
"auto" for few tokens): the sequence-parallel Column -> Row pair against dense math,
values and gradients, with the FSDP split on either weight dimension; what "auto"
chooses; and the collectives the compiled step runs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fusedpar
from fusedpar._nn import _fsdp_activations
from fusedpar._sharding import _specs
from helpers import assert_close, equations, mesh, normal

pytestmark = pytest.mark.timeout(300)

F32 = jnp.float32
IN, HID = 16, 32


def _pair(backend, gather, column_dim=None, row_dim=None, sp=True):
    k1, k2 = jax.random.split(jax.random.key(0))
    kw = dict(sequence_parallel=sp, fsdp_axis="fsdp", backend=backend, fsdp_gather=gather)
    layers = (fusedpar.ColumnLinear(IN, HID, key=k1, fsdp_dim=column_dim, **kw),
              fusedpar.RowLinear(HID, IN, key=k2, fsdp_dim=row_dim, **kw))
    dense = (eqx.nn.Linear(IN, HID, key=k1), eqx.nn.Linear(HID, IN, key=k2))
    return layers, dense


def _loss(model, x, apply):
    up, down = model
    return jnp.sum(jnp.sin(apply(down, jnp.tanh(apply(up, x)))))


def _dense(lin, x):
    return x @ lin.weight.T + lin.bias


def _collectives(jaxpr):
    """(primitive, mesh axes, operand ranks) of every collective in `jaxpr`, nested
    ones too."""
    out = []
    for eqn in equations(jaxpr):
        if eqn.primitive.name in ("all_gather", "all_to_all", "reduce_scatter", "psum",
                                  "ppermute"):
            axes = eqn.params.get("axis_name", eqn.params.get("axes", ()))
            axes = axes if isinstance(axes, tuple) else (axes,)
            out.append((eqn.primitive.name, axes, tuple(v.aval.ndim for v in eqn.invars)))
    return out


def _step(layers, x, m):
    with jax.set_mesh(m):
        model = fusedpar.shard(layers, m)
        f = eqx.filter_value_and_grad(lambda mx: _loss(mx[0], mx[1], lambda lin, v: lin(v)))
        params, static = eqx.partition((model, x), eqx.is_array)
        g = jax.jit(lambda p: f(eqx.combine(p, static)))
        return g(params), _collectives(jax.make_jaxpr(g)(params))


@pytest.mark.parametrize("backend", ["reference", "ring"])
@pytest.mark.parametrize("dims", [(None, None), (0, 1)], ids=["in,out", "out,in"])
def test_activations_route_matches_dense(backend, dims):
    """Column then Row with the FSDP split on the contracting features (partial sums
    reduce-scattered over the batch) or on the output features (all_to_all): loss, both
    weight and bias gradients and dx, against the dense layers; the step sends
    activations over fsdp (all_to_all) and no weight-sized reduce-scatter."""
    layers, dense = _pair(backend, "activations", *dims)
    x = normal(1, (4, 8, IN), F32)  # (batch, seq, features) on fsdp=2 x tp=4
    m = mesh((2, 4), ("fsdp", "tp"))
    moved = _over_fsdp(_check_against_dense(layers, dense, x, m))
    assert ("all_to_all", (3,)) in moved and all(r == (3,) for _, r in moved), moved
    _, by_weights = _step(_pair(backend, "weights", *dims)[0], x, m)
    assert _over_fsdp(by_weights) == {("all_gather", (2,)), ("reduce_scatter", (2,))}


def _over_fsdp(ops):
    """(primitive, operand ranks) of the collectives over fsdp but the bias gradients'
    psums: the activations route moves (batch, seq, features) arrays, never a 2-D weight
    shard or its gradient; the weights route those and no activation."""
    return {(name, ranks) for name, axes, ranks in ops if "fsdp" in axes and name != "psum"}


def _check_against_dense(layers, dense, x, m):
    (got, grads), ops = _step(layers, x, m)
    want, wgrads = eqx.filter_value_and_grad(
        lambda mx: _loss(mx[0], mx[1], _dense))((dense, x))
    assert_close(got, want, F32, "loss")
    for g, w, name in zip(grads[0], wgrads[0], ("up", "down")):
        assert_close(g.weight, w.weight, F32, f"d{name}.weight")
        assert_close(g.bias, w.bias, F32, f"d{name}.bias")
    assert_close(grads[1], wgrads[1], F32, "dx")
    return ops


@pytest.mark.parametrize("backend", ["reference", "ring"])
def test_activations_route_without_sequence_parallelism(backend):
    """A Column -> Row pair without sequence parallelism (the Row's psum over tp), and
    two FSDPLinear layers on an 8-device FSDP mesh: against the dense layers, no
    collective over the FSDP axis on a 2-D weight or a ring over it."""
    x = normal(2, (8, 4, IN), F32)
    for layers, m in (
            (_pair(backend, "activations", sp=False)[0], mesh((2, 4), ("fsdp", "tp"))),
            (tuple(fusedpar.FSDPLinear(a, b, key=k, backend=backend, gather="activations")
                   for (a, b), k in zip(((IN, HID), (HID, IN)),
                                        jax.random.split(jax.random.key(0)))),
             mesh((8,), ("fsdp",)))):
        moved = _over_fsdp(_check_against_dense(layers, _pair(backend, "weights")[1], x, m))
        assert ("all_to_all", (3,)) in moved and all(r == (3,) for _, r in moved), moved


def test_auto_moves_the_activations_only_where_the_cost_numbers_say():
    """"auto" times the activations' two collectives against the weight gather, with
    the target's cost numbers (latency and bytes over a link): a decode-sized input
    moves its tokens and a training-sized one the weight, on a TPU v5e and on H100s;
    on H100s (7.5 us per collective, 450 GB/s) a small weight is gathered even then."""
    from fusedpar.cost_model import PRESETS

    rule = _specs.compose(fusedpar.Column("tp", sequence_parallel=True), fusedpar.FSDP("fsdp"))
    sizes = {"fsdp": 2, "tp": 4}

    def moves(tokens, dim, hardware):
        w = rule.local_weight_shape((dim, dim), sizes)  # (dim / 4, dim / 2)
        return _fsdp_activations.moves_activations(
            "ColumnLinear", rule, (1, tokens, dim), jnp.bfloat16, dim, dim, sizes,
            w[0] * w[1] * 2, PRESETS[hardware])

    for hardware in ("tpu_v5e", "h100_sxm"):
        assert moves(4, 4096, hardware) and not moves(1024, 4096, hardware), hardware
    assert moves(4, 1024, "tpu_v5e") and not moves(4, 1024, "h100_sxm")
    # The bytes: an all_to_all of x's half (bf16) and the float32 partial sums.
    assert _fsdp_activations.activation_bytes(rule, (1, 4, 4096), 4096, 4096, sizes,
                                              jnp.bfloat16) == 4 * 2048 * 2 + 16 * 1024 * 4
    weights = fusedpar.compose(rule.tp, fusedpar.FSDP("fsdp", gather="weights"))
    assert not _fsdp_activations.moves_activations(
        "ColumnLinear", weights, (1, 4, 4096), jnp.bfloat16, 4096, 4096, sizes,
        1024 * 2048 * 2, PRESETS["tpu_v5e"])


def test_describe_names_the_activation_collectives():
    layers, _ = _pair("reference", "activations")
    fwd, bwd = layers[0].collectives()
    assert fwd == ["all_to_all x over fsdp", "all_gather_matmul x(seq) over tp",
                   "reduce_scatter y(batch) over fsdp"]
    assert "reduce_scatter dW over fsdp" not in bwd
    assert "gather='activations'" in fusedpar.describe(layers)


def test_a_quantized_weight_stays_home_and_trains_its_master():
    """A weight stored quantized (`fusedpar.quantize(..., master=True)` inside the loss)
    is dequantized where it lies: loss, dx and the master's gradient (straight through)
    as the same quantized layers with no mesh."""
    layers, _ = _pair("reference", "activations")
    x = normal(4, (4, 8, IN), F32)
    m = mesh((2, 4), ("fsdp", "tp"))

    def run(layers, x):
        return eqx.filter_value_and_grad(lambda mx: _loss(
            fusedpar.quantize(mx[0], master=True), mx[1], lambda lin, v: lin(v)))((layers, x))

    want, wgrads = run(layers, x)
    with jax.set_mesh(m):
        got, grads = jax.jit(run)(fusedpar.shard(layers, m), x)
    assert_close(got, want, F32, "loss")
    assert_close(grads[1], wgrads[1], F32, "dx")
    for g, w, name in zip(grads[0], wgrads[0], ("up", "down")):
        assert_close(g.weight, w.weight, F32, f"d{name}.weight (its master's)")
