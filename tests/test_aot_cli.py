"""`python -m fusedpar.aot`: your own program is lowered under `jax.set_mesh(mesh)` (the
documented example, a step whose layers run on global arrays, compiles through the
CLI), `--help` states the mesh each program gets, and a --mesh that does not fit the
target exits with status 2 and a message, as other bad arguments do."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from fusedpar._compile import _aot_cli

from helpers import needs_aot

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.aot
@needs_aot
@pytest.mark.timeout(200)
def test_the_documented_program_compiles_through_the_cli(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, "-m", "fusedpar.aot", "--target", "h100x8", "--program",
         "examples/aot_program.py:train_step", "--backend", "ring", "--json", str(out),
         "--breakdown"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    ops = {(o["op"], o["direction"]): o for o in row["ops"]}
    # The layers ran sharded on the global arrays: their rings, every transfer hidden.
    for key in (("ag_rows", "forward"), ("rs_rows", "forward"), ("ag_rows", "backward")):
        assert ops[key]["backend"] == "ring" and ops[key]["transfers"] > 0, row["ops"]
        assert ops[key]["hidden"] == ops[key]["transfers"], row["ops"]
    # --breakdown: the compute stream by kind, its matmuls first (a training step).
    table = run.stdout[run.stdout.index("| compute stream: kind | count | us |"):]
    assert table.splitlines()[2].startswith("| matmul | "), table
    assert "| waited for: transfer | kind | bytes | us waited |" in table


def test_help_states_the_default_mesh_each_program_gets():
    text = _aot_cli._parser().format_help().replace("\n", " ")
    text = " ".join(text.split())
    assert ("default: x for ops, tp for mlp, fsdp,tp for block, block-qkv, prefill, decode, "
            "demo and your own program") in text
    assert "default: all devices on one axis for one axis name, 2 x n/2 for two" in text
    for program, axes in (("ops", ("x",)), ("mlp", ("tp",)), ("block", ("fsdp", "tp")),
                          ("decode", ("fsdp", "tp")), ("my.py:step", ("fsdp", "tp"))):
        args = _aot_cli._parse(["--target", "h100x8", "--program", program])
        assert _aot_cli._axes(args) == axes, program


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "2by4"], "--mesh: '2by4' must be positive sizes separated by x"),
    (["--mesh", "2x4"], "--mesh: '2x4' has 2 sizes but the mesh's axis names are ('tp',) "
                        "(the default of --program mlp)"),
    (["--axes", "a,b,c"], "--axes: 3 names ('a', 'b', 'c') need --mesh"),
    (["--axes", "fsdp,fsdp"], "--axes: 'fsdp,fsdp' must be distinct names"),
])
def test_bad_mesh_or_axes_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _aot_cli._parse(["--target", "h100x8"] + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.aot
@needs_aot
def test_a_mesh_that_does_not_use_every_device_exits_2(capsys):
    args = _aot_cli._parse(["--target", "h100x8", "--program", "block", "--mesh", "2x2"])
    with pytest.raises(SystemExit) as e:
        _aot_cli._mesh(args)
    assert e.value.code == 2
    assert "has 8 devices; shape (2, 2)" in capsys.readouterr().err


@pytest.mark.aot
@needs_aot
def test_a_tpu_slice_the_compiler_cannot_lay_out_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        _aot_cli._parse(["--target", "v5e:3x3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--target: 'v5e:3x3' is not a slice the TPU compiler lays out" in err, err
    assert "e.g. " in err and "v5e:2x4" in err, err


USER_PROGRAMS = '''
def two_args(mesh):
    pass

def junk(mesh, backend):
    return 42

def concrete(mesh, backend):
    import jax
    return jax.device_put(1.0, mesh.devices.flat[0])

not_fn = 3

def args_not_tuple(mesh, backend):
    import jax
    return jax.jit(lambda x: x), jax.ShapeDtypeStruct((8,), "float32")

def computes_on_the_mesh(mesh, backend):
    import jax
    with jax.set_mesh(mesh):
        return jax.random.normal(jax.random.key(0), (8,))
'''


@pytest.mark.aot
@needs_aot
@pytest.mark.parametrize("name, message", [
    ("two_args", "cannot be called as fn(mesh, backend)"),
    ("junk", "returned int '42'"),
    ("concrete", "made arrays on the target's compile-only devices"),
    ("computes_on_the_mesh", "made arrays on the target's compile-only devices"),
    ("missing", "has no function 'missing'"),
    ("not_fn", "has 'not_fn', which is not callable (a int)"),
    ("args_not_tuple", "returned (jitted, ShapeDtypeStruct): the arguments must be a tuple"),
])
def test_a_program_of_your_own_that_breaks_the_contract_exits_2(tmp_path, name, message,
                                                                 capsys):
    """Each says what the function must be: (mesh, backend) -> (jitted, args)."""
    path = tmp_path / "mine.py"
    path.write_text(USER_PROGRAMS)
    args = _aot_cli._parse(["--target", "h100x8", "--program", f"{path}:{name}"])
    with pytest.raises(SystemExit) as e:
        list(_aot_cli._programs(args))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "(mesh, backend) -> (jitted, args)" in err, err


@pytest.mark.aot
@needs_aot
@pytest.mark.parametrize("spec, message", [
    ("nosuchmodule_xyz:step", "cannot import 'nosuchmodule_xyz': ModuleNotFoundError"),
    ("{dir}:step", "is not a .py file"),
    (":step", "names no file or module"),
    ("{syntax}:step", "cannot import '{syntax}': SyntaxError"),
    ("{other_axis}:step", "uses a mesh axis that the mesh {{'fsdp': 2, 'tp': 4}} lacks"),
])
def test_a_program_that_cannot_be_imported_or_meshed_exits_2(tmp_path, spec, message,
                                                             capsys):
    """A file or module that is not there or not Python, or a program whose specs name an
    axis the mesh lacks: a bad argument that says so, not a traceback."""
    (tmp_path / "bad.py").write_text("def step(mesh, backend:\n")
    (tmp_path / "axis.py").write_text(
        "import jax\nfrom jax.sharding import NamedSharding, PartitionSpec as P\n"
        "def step(mesh, backend):\n"
        "    return jax.jit(lambda x: x), (jax.ShapeDtypeStruct((8,), 'float32', "
        "sharding=NamedSharding(mesh, P('data'))),)\n")
    names = dict(dir=tmp_path, syntax=tmp_path / "bad.py", other_axis=tmp_path / "axis.py")
    args = _aot_cli._parse(["--target", "h100x8", "--program", spec.format(**names)])
    with pytest.raises(SystemExit) as e:
        list(_aot_cli._programs(args))
    assert e.value.code == 2
    assert message.format(**names) in capsys.readouterr().err


@pytest.mark.aot
@needs_aot
def test_a_program_whose_layers_do_not_fit_the_mesh_exits_2(tmp_path, capsys):
    """A layer's own check (features the mesh does not divide), raised while lowering:
    its message as a bad argument, not a traceback."""
    path = tmp_path / "odd.py"
    path.write_text(
        "import equinox as eqx, jax, fusedpar\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "def step(mesh, backend):\n"
        "    lin = eqx.filter_eval_shape(lambda: fusedpar.ColumnLinear(8, 6, "
        "key=jax.random.key(0)))\n"
        "    return jax.jit(lambda l, x: l(x)), (lin, jax.ShapeDtypeStruct((4, 8), "
        "'float32', sharding=NamedSharding(mesh, P())))\n")
    with pytest.raises(SystemExit) as e:
        _aot_cli.main(["--target", "h100x8", "--program", f"{path}:step"])
    assert e.value.code == 2
    assert ("cannot run on the mesh {'fsdp': 2, 'tp': 4}: ColumnLinear.weight: parameter "
            "dim 0 has size 6, not divisible by 4") in capsys.readouterr().err


ELSEWHERE = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fusedpar import aot

def _arg(mesh):
    return jax.ShapeDtypeStruct((8, 8), "float32", sharding=NamedSharding(mesh, P("fsdp")))

def other_target(mesh, backend):
    return jax.jit(lambda x: x * 2), (_arg(aot.mesh("h200x8", (2, 4), ("fsdp", "tp"))),)

def other_shape(mesh, backend):
    devices = np.array(mesh.devices).reshape(4, 2)
    return jax.jit(lambda x: x * 2), (_arg(Mesh(devices, ("fsdp", "tp"))),)

def one_device(mesh, backend):
    sharding = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
    return jax.jit(lambda x: x * 2), (jax.ShapeDtypeStruct((8, 8), "float32",
                                                           sharding=sharding),)

def cudnn_attention(mesh, backend):
    q = jax.ShapeDtypeStruct((8, 128, 4, 64), "bfloat16", sharding=NamedSharding(mesh, P("fsdp")))
    attend = lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn")
    return jax.jit(attend), (q,)
"""


@pytest.mark.aot
@needs_aot
@pytest.mark.parametrize("name, message", [
    ("other_target", "argument [0] is laid out on devices that are not the mesh's "
                     "(8 x NVIDIA H200"),
    ("other_shape", "argument [0] is laid out on the mesh {'fsdp': 4, 'tp': 2}, not the "
                    "one it is given {'fsdp': 2, 'tp': 4}"),
    ("one_device", "argument [0] is on one device"),
])
def test_arguments_laid_out_off_the_mesh_exit_2(tmp_path, name, message, capsys):
    """Arguments built on another target's devices, another mesh shape or one device:
    said before JAX's own message (which names neither mesh)."""
    path = tmp_path / "elsewhere.py"
    path.write_text(ELSEWHERE)
    with pytest.raises(SystemExit) as e:
        _aot_cli.main(["--target", "h100x8", "--program", f"{path}:{name}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "the mesh" in err, err


@pytest.mark.aot
@needs_aot
def test_a_cudnn_kernel_exits_2(tmp_path, capsys):
    """cuDNN attention: JAX asks the cuDNN library (absent without a GPU) while lowering;
    the CLI says so and what compiles deviceless."""
    path = tmp_path / "elsewhere.py"
    path.write_text(ELSEWHERE)
    with pytest.raises(SystemExit) as e:
        _aot_cli.main(["--target", "h100x8", "--program", f"{path}:cudnn_attention"])
    assert e.value.code == 2
    assert "compile it deviceless with implementation='xla'" in capsys.readouterr().err


@pytest.mark.aot
@needs_aot
def test_a_backend_that_cannot_run_a_program_exits_2(capsys):
    """decode's 4 rows a device have no Mosaic GPU tile: the backend's reason, no
    traceback."""
    with pytest.raises(SystemExit) as e:
        _aot_cli.main(["--target", "h100x8", "--program", "decode", "--backend", "pallas"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--backend: decode cannot run with backend 'pallas'" in err, err
    assert "no Mosaic GPU tile fits" in err, err


@pytest.mark.parametrize("extra", [["--backend", "ring"], ["--breakdown"]])
def test_compare_refuses_what_it_would_ignore(extra, capsys):
    with pytest.raises(SystemExit) as e:
        _aot_cli._parse(["--target", "h100x8", "--program", "mlp", "--compare"] + extra)
    assert e.value.code == 2
    assert "--compare compiles every backend and prints one table: leave out " + extra[0] \
        in capsys.readouterr().err


def test_breakdown_sums_the_waits_it_does_not_list():
    """Past its `top` rows the waited-for table says how many more and how long."""
    from types import SimpleNamespace as T

    waits = [T(name=f"cp{i}", kind="collective-permute", bytes=100, waited=(i + 1) * 1e-6)
             for i in range(15)]
    text = _aot_cli.breakdown(T(kernels=[], transfers=waits), top=12)
    assert "| cp14 | collective-permute | 100 | 15.0 |" in text
    assert "| 3 others | | 300 | 6.0 |" in text  # cp0-cp2: 1 + 2 + 3 us
