"""Compile and predict (beside the layers, under `fusedpar.aot`): compiling for
hardware that is not here, reading the scheduled HLO, replaying it with a cost preset,
the programs the CLI compiles and XLA's own baseline. Nothing below imports it.
"""
