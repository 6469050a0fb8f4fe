"""Pure functions on LoDTensors: rank tables, the array ops and dynamic_rnn.

Fluid's LoDRankTable, lod_tensor_to_array, array_to_lod_tensor,
reorder_lod_tensor_by_rank and shrink_rnn_memory, with static shapes and
gather-only backward passes; and DynamicRNN (``while`` + ``while_grad``) as
`dynamic_rnn`, a phased loop with a custom VJP.
"""

from jaxlod.ops._array import array_to_lod, lod_to_array, reorder_by_rank, shrink_memory
from jaxlod.ops._rank import RankTable, default_ladder, normalize_ladder, rank_table
from jaxlod.ops._rnn import dynamic_rnn

__all__ = [
  "RankTable",
  "array_to_lod",
  "default_ladder",
  "dynamic_rnn",
  "lod_to_array",
  "normalize_ladder",
  "rank_table",
  "reorder_by_rank",
  "shrink_memory",
]
