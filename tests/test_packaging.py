"""Every subpackage ships: fusedpar's, and kernels/ as fusedpar.kernels (never a top-level
`kernels`). setup.py finds the package list; pyproject.toml maps kernels/ to
fusedpar.kernels."""

import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["fusedpar.kernels"] == "kernels"
    assert "packages" not in config, "setup.py finds the packages: no list in pyproject.toml"
    spec = importlib.util.spec_from_file_location("fusedpar_setup", ROOT / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # defines packages(); setup() runs only as __main__
    listed = set(setup_py.packages())
    on_disk = {"fusedpar." + ".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "kernels").rglob("__init__.py")}
    on_disk |= {".".join(p.parent.relative_to(ROOT).parts)
                for p in (ROOT / "fusedpar").rglob("__init__.py")}
    # Data only: the package-data its pyproject.toml entry names, and nothing to import.
    data = {name: globs for name, globs in config["package-data"].items()
            if not (ROOT / name.replace(".", "/") / "__init__.py").exists()}
    assert data == {"fusedpar.targets": ["*.txtpb"]}, data
    assert list((ROOT / "fusedpar" / "targets").glob("*.txtpb"))
    on_disk |= set(data)
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))
    assert not any(name == "kernels" or name.startswith("kernels.") for name in listed)
    for name in on_disk - set(data):
        importlib.import_module(name)


def test_public_names():
    import fusedpar

    for name in ("all_gather_matmul", "matmul_reduce_scatter", "explain", "backend_names",
                 "Ring"):
        assert hasattr(fusedpar, name), name
    assert {"reference", "ring", "pallas"} <= set(fusedpar.backend_names())


def test_aot_after_a_plain_import():
    """`fusedpar.aot.mesh(...)`, as the docs and the errors write it, after `import
    fusedpar` alone (in a fresh process: this one may have imported fusedpar.aot)."""
    code = ("import fusedpar, jax.numpy as jnp; jnp.ones(2).sum(); "
            "print(fusedpar.aot.mesh('h100x8').devices.size); fusedpar.no_such_name")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.stdout.strip() == "8", run.stderr[-2000:]
    assert "module 'fusedpar' has no attribute 'no_such_name'" in run.stderr


def _imports(path: pathlib.Path):
    """`(line, module)` of every import in `path`, relative ones resolved to absolute names
    as the installed package sees them (kernels/ is fusedpar.kernels)."""
    import ast

    package = list(path.parent.relative_to(ROOT).parts)
    if package[0] == "kernels":
        package.insert(0, "fusedpar")  # kernels -> fusedpar.kernels
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            for name in names:
                yield node.lineno, name


def test_kernels_import_nothing_of_fusedpar_outside_kernels():
    # The kernels are the bottom layer: refs in, refs out, their ring given as a value.
    outside = [f"{p.relative_to(ROOT)}:{line}: {name}"
               for p in sorted((ROOT / "kernels").rglob("*.py"))
               for line, name in _imports(p)
               if (name == "fusedpar" or name.startswith("fusedpar."))
               and not (name == "fusedpar.kernels" or name.startswith("fusedpar.kernels."))
               or name == "kernels" or name.startswith("kernels.")]
    assert not outside, "kernels/ imports the package above it:\n" + "\n".join(outside)


def test_the_package_ring_is_what_the_kernels_ask_for():
    from fusedpar import Ring
    from fusedpar.kernels._ring import RingSchedule

    assert isinstance(Ring(4, bidirectional=True), RingSchedule)
    assert not isinstance(object(), RingSchedule)


# fusedpar's private subpackages, top to bottom (docs/architecture.md): each imports only
# the ones after it; the public modules (cost_model, demo, aot) are not layers.
LAYERS = ["_compile", "_nn", "_sharding", "_core", "_hw"]


def test_subpackages_import_only_the_layers_below():
    on_disk = sorted(p.parent.name for p in (ROOT / "fusedpar").glob("_*/__init__.py"))
    assert on_disk == sorted(LAYERS), "a new subpackage needs its place in LAYERS"
    upward = [f"{p.relative_to(ROOT)}:{line}: {name}"
              for i, layer in enumerate(LAYERS)
              for p in sorted((ROOT / "fusedpar" / layer).rglob("*.py"))
              for line, name in _imports(p)
              if name.split(".")[:1] == ["fusedpar"] and name.split(".")[1:2] in
              [[above] for above in LAYERS[:i]]]
    assert not upward, "a layer imports one above it:\n" + "\n".join(upward)
