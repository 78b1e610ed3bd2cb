"""Every subpackage ships: fusedpar's, and kernels/ as fusedpar.kernels (never a top-level
`kernels`). setuptools installs only the packages pyproject.toml lists."""

import importlib
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["fusedpar.kernels"] == "kernels"
    listed = set(config["packages"])
    on_disk = {"fusedpar." + ".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "kernels").rglob("__init__.py")}
    on_disk |= {".".join(p.parent.relative_to(ROOT).parts)
                for p in (ROOT / "fusedpar").rglob("__init__.py")}
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to packages in pyproject.toml"
    assert not any(name == "kernels" or name.startswith("kernels.") for name in listed)
    for name in on_disk:
        importlib.import_module(name)


def test_public_names():
    import fusedpar

    for name in ("all_gather_matmul", "matmul_reduce_scatter", "explain", "backend_names",
                 "Ring"):
        assert hasattr(fusedpar, name), name
    assert {"reference", "ring", "pallas"} <= set(fusedpar.backend_names())
