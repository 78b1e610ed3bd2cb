"""Layouts: rules -> every PartitionSpec, their checks, a whole model's specs from a
trace, placing a model (or a checkpoint) on a mesh. Imports _core and _hw below it.
"""
