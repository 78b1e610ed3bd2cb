"""Fused Pallas TPU ring kernels."""
