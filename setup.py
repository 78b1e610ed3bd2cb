"""The package list, found rather than kept by hand (everything else is in pyproject.toml).

kernels/ lives at the repository root but installs as fusedpar.kernels (pyproject.toml's
package-dir maps it). setuptools' `packages.find` cannot search a mapped directory under
another name, so each subpackage found under kernels/ is named here as fusedpar.kernels.*.
"""

import pathlib

from setuptools import find_packages, setup

ROOT = pathlib.Path(__file__).resolve().parent


def packages() -> list:
    """fusedpar's packages (its data-only `targets` too), and kernels/'s as fusedpar.kernels,
    fusedpar.kernels.tpu, ..."""
    kernels = find_packages(ROOT, include=["kernels", "kernels.*"])
    # fusedpar.targets holds data only (the GPU target descriptions): no __init__.py for
    # find_packages to see, so it is named here.
    return (find_packages(ROOT, include=["fusedpar", "fusedpar.*"]) + ["fusedpar.targets"]
            + ["fusedpar." + name for name in kernels])


if __name__ == "__main__":
    setup(packages=packages())
