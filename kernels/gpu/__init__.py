"""Pallas GPU kernels for the per-step compute of the ring."""
