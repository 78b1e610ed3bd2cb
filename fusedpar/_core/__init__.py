"""The ops and what runs them: the five primitives and their definition, validation,
custom VJP, vmap rules, quantized payloads, the ring arithmetic, dispatch and the
backends (`_backends/`). Imports _hw below it and the cost model.
"""
