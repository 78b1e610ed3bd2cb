"""Reading a scheduled HLO module (`compiled.as_text()`): computations, instructions, bytes.

The text of a compiled program lists each computation's instructions in the order the
scheduler chose, so it says what runs while a transfer is in flight. This module only
parses; `fusedpar.aot` decides what overlaps. It reads both dialects this package is
compiled for:

- GPU: matmuls are `kCustom` fusions around a `dot` (Triton GEMMs), `__cublas$...`
  custom calls, and the Pallas kernels' `mosaic_gpu` / Triton custom calls;
- TPU: matmuls are `convolution`s (usually inside fusions), Pallas kernels are
  `tpu_custom_call`s; shapes carry layouts like `{1,0:T(8,128)(2,1)}` and long operand
  lists carry `/*index=5*/` comments.

Asynchronous collectives are `<kind>-start` ... `<kind>-done` pairs (or `async-start` /
`async-done` around a computation holding the collective). It also reads what XLA's own
programs (GSPMD, Shardy, its collective matmul) are made of: `while` loops whose trip
count is in their condition (`trip_count`), and replica groups in each syntax XLA prints
(`replica_groups`: listed, iota, mesh axes).

Where each part lives: parsing and shape sizes in `_hlo_parse`; what an instruction is
(collective, async start/done, matmul) and the dataflow in `_hlo_kinds`; the bytes it
reads and writes in `_hlo_bytes`; loops in `_hlo_loops`; pairs and replica groups in
`_hlo_groups`. This module gathers them, so `_hlo.<name>` serves every caller.
"""

from ._hlo_bytes import (dma_bytes as dma_bytes, host_transfer as host_transfer,
                         in_place_bytes as in_place_bytes,
                         operand_bytes as operand_bytes, read_bytes as read_bytes,
                         sent_operands as sent_operands,
                         written_bytes as written_bytes)
from ._hlo_groups import (group_size as group_size, replica_groups as replica_groups,
                          source_target_pairs as source_target_pairs)
from ._hlo_kinds import (collective_inside as collective_inside,
                         collective_kind as collective_kind, dataflow as dataflow,
                         is_async_start as is_async_start, is_collective as is_collective,
                         is_matmul as is_matmul, matmul_computations as matmul_computations,
                         op_name as op_name, ring_factor as ring_factor,
                         scheduled_computations as scheduled_computations,
                         started_by as started_by, tpu_kernel as tpu_kernel)
from ._hlo_loops import (element_index as element_index, loop_parts as loop_parts,
                         trip_count as trip_count)
from ._hlo_parse import (COLLECTIVES as COLLECTIVES, MATMUL_TARGETS as MATMUL_TARGETS,
                         Instruction as Instruction, Module as Module,
                         array_shapes as array_shapes, laid_out_bytes as laid_out_bytes,
                         parse as parse, parse_instruction as parse_instruction,
                         shape_bytes as shape_bytes)
