"""Compile for hardware that is not here, and read what overlaps in the compiled program.

JAX compiles for devices that are absent ("deviceless" ahead-of-time compiling): libtpu
compiles for TPU slices (Pallas TPU kernels go through Mosaic's real compiler) and the
CUDA plugin compiles for H100s (or H200s) from a GPU target description. Both come with
the `aot` extra (`pip install "fusedpar[aot]"`: libtpu and the CUDA compiler plugin
matching the installed jax, no CUDA runtime). fusedpar reads the hardware from the mesh's
devices (`fusedpar._hw._target`), so a program traced here for `"v5e:2x4"` makes the choices
it would make on that slice. Which targets exist, and what is known of their devices, is
the hardware registry's (`fusedpar._hw._registry`).

    mesh = fusedpar.aot.mesh("h100x8", (8,), ("tp",))      # compile-only devices
    compiled = jax.jit(f).lower(*structs_on(mesh)).compile()
    print(fusedpar.aot.overlap(compiled).markdown())        # what hides behind matmuls

or from the shell, for the programs this package ships or your own:

    python -m fusedpar.aot --target v5e:2x4 --program mlp
    python -m fusedpar.aot --target h100x8 --program my_model.py:aot_program

`predict` replays the schedule with the target's numbers (`fusedpar.cost_model` presets)
and gives the time per device and its lower bound, max(compute, communication).

`overlap` reads the scheduled HLO: each transfer (an asynchronous collective's start ...
done) with the matmuls scheduled while it is in flight, each op's (every fusedpar op runs
under a name scope `fusedpar.<primitive>.<backend>`, its backward under `transpose(...)`)
transfers hidden, matmuls exposed and a one-line verdict.
"""

from ._compile._aot import (
    TARGETS as TARGETS,
    TPU_GENERATIONS as TPU_GENERATIONS,
    OpSummary as OpSummary,
    Report as Report,
    Transfer as Transfer,
    compiler_options as compiler_options,
    devices as devices,
    gpu_compiler_options as gpu_compiler_options,
    mesh as mesh,
    overlap as overlap,
    predict as predict,
)


def main(argv=None):
    """`python -m fusedpar.aot`: compile a program for a target and print what overlaps."""
    from ._compile._aot_cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    main()
