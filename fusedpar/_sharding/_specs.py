"""Sharding rules, and every PartitionSpec the layers use, derived in one place.

A layer's sharding is a `Rule`: at most one tensor-parallel style (`Column` or `Row`) and
at most one `FSDP` style, composed by `compose` in any order. From the rule come

- the parameter specs (`Rule.param_specs`): which weight/bias dimension lies on which
  mesh axis. Several axes on one dimension form a tuple in the canonical order
  tensor-parallel first, FSDP second (`ROLES`), whatever order the styles were stacked
  in. That order is what the layers rely on: gathering a weight over the FSDP axis
  alone yields the tensor-parallel shard (the FSDP blocks are the minor ones);
- the activation specs (`Rule.activation_specs`): the layout of the layer's input and
  output, i.e. the `shard_map` in/out specs the layer wraps itself in;
- the local (per-device) weight shape, and validation against a mesh: the axis exists,
  the dimension divides, an axis shards an array once. Errors name the parameter path,
  dimension, size and axes. Relaxed validation drops the tensor-parallel or FSDP style
  whose axes do not divide, and reports what it dropped.

Whole-model functions (`param_specs`, `validate`) walk a model and apply these per layer;
non-parallel arrays are replicated (`PartitionSpec()`). An embedding table's rule is a
`TableRule`, the same styles on the transposed weight.

Where each part lives: the styles in `_styles`; `Rule`, `TableRule`, `compose` and the
parameter specs in `_rules`; the checks against a mesh in `_spec_checks`; whole models in
`_model_specs`; the axes an activation keeps through a layer in `_layouts`.
"""

# One job per module; this one gathers them, so `_specs.<name>` serves every caller.
from ._layouts import (axis_dims as axis_dims, has_data_dim as has_data_dim,
                       layout_axes as layout_axes, with_other_axes as with_other_axes,
                       with_unknown_axes as with_unknown_axes)
from ._model_specs import (PARAM_RANK as PARAM_RANK, check_patterns as check_patterns,
                           check_ties as check_ties,
                           is_layer as is_layer, is_param as is_param,
                           is_quantized as is_quantized, layer_name as layer_name,
                           layer_param_specs as layer_param_specs, param_specs as param_specs,
                           path_str as path_str, quantized_specs as quantized_specs,
                           stacked as stacked, validate as validate)
from ._rules import (ROLES as ROLES, Drop as Drop, Placement as Placement, Rule as Rule,
                     TableRule as TableRule, compose as compose, merge as merge,
                     transpose as transpose)
from ._spec_checks import (check_fsdp_dim as check_fsdp_dim,
                           check_param_shapes as check_param_shapes, check_scalar as check_scalar,
                           decoding_fixes as decoding_fixes,
                           check_spec as check_spec, mesh_sizes as mesh_sizes,
                           pad_vocab_hint as pad_vocab_hint)
from ._styles import FSDP as FSDP, Column as Column, Row as Row, Style as Style
