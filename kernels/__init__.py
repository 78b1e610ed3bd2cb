"""Pallas kernels for fusedpar (installed as ``fusedpar.kernels``)."""
