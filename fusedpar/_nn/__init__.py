"""The layers and plans a model is built from: the ParallelLinear family, Embedding,
cross_entropy, parallelize, describe, quantize, and the calling contexts. Imports
_sharding, _core and _hw below it.
"""
