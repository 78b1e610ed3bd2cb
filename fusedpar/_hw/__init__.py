"""The hardware a call is for and what is known of it: the target, the registry of
device kinds, the JAX platforms started on import, the XLA overlap flags. Imports
nothing else of fusedpar.
"""
