"""Pure functions on LoDTensors: rank tables, array ops, dynamic_rnn and the
sequence ops.

Fluid's LoDRankTable, lod_tensor_to_array, array_to_lod_tensor,
reorder_lod_tensor_by_rank and shrink_rnn_memory, with static shapes and
gather-only backward passes; DynamicRNN (``while`` + ``while_grad``) as
`dynamic_rnn`, a phased loop with a custom VJP, and `fused_rnn`, a
separable cell's whole loop as one Pallas kernel launch, and
`linear_scan`, a linear recurrence over every sequence as one parallel
scan; Paddle's
``sequence_*`` ops on static capacities, jittable and differentiable; and
decoding (`beam_search`, greedy for a beam of one) as while loops with
per-source early exit, and `decode_corpus`, a corpus with continuous
refill; `sequence_attention`, softmax attention inside each sequence
in tiles that follow the lengths (no padding to the longest); the
attention-decoder core (`Memory`, the score functions,
`decoder_step`) that `jaxlod.nn`'s Linen and NNX layers call.
"""

from jaxlod.ops._array import array_to_lod, lod_to_array, reorder_by_rank, shrink_memory
from jaxlod.ops._corpus import decode_corpus
from jaxlod.ops._decode import DecodeSettings, Hypotheses, beam_search, ensemble_step
from jaxlod.ops._expand import (
  sequence_concat,
  sequence_erase,
  sequence_expand,
  sequence_expand_as,
  sequence_slice,
)
from jaxlod.ops._loop._dispatch import dynamic_rnn
from jaxlod.ops._loop._fused import fused_rnn
from jaxlod.ops._loop._hoisted import Separable
from jaxlod.ops._loop._plan import LoopPlan, default_plan
from jaxlod.ops._loop._tune import tune_plan
from jaxlod.ops._loss import sequence_cross_entropy
from jaxlod.ops._memory_attention import (
  Memory,
  additive_scores,
  as_memory,
  attend,
  cosine_scores,
  decoder_step,
  dot_scores,
  general_scores,
  lod_memory,
  masked_attention,
)
from jaxlod.ops._pad import (
  sequence_mask,
  sequence_pad,
  sequence_reverse,
  sequence_unpad,
)
from jaxlod.ops._pool import (
  sequence_first_step,
  sequence_last_step,
  sequence_pool,
  sequence_softmax,
)
from jaxlod.ops._rank import RankTable, default_ladder, normalize_ladder, rank_table
from jaxlod.ops._reshape import lod_reset, sequence_reshape, sequence_scatter
from jaxlod.ops._rows import default_chunk, map_rows
from jaxlod.ops._scan import linear_scan
from jaxlod.ops._search import length_normalized
from jaxlod.ops._sequence_attention import (
  AttentionPlan,
  default_attention_plan,
  sequence_attention,
)
from jaxlod.ops._window import sequence_conv, sequence_enumerate

__all__ = [
  "AttentionPlan",
  "DecodeSettings",
  "Hypotheses",
  "LoopPlan",
  "Memory",
  "additive_scores",
  "as_memory",
  "attend",
  "cosine_scores",
  "decode_corpus",
  "default_attention_plan",
  "decoder_step",
  "dot_scores",
  "ensemble_step",
  "general_scores",
  "length_normalized",
  "linear_scan",
  "lod_memory",
  "RankTable",
  "Separable",
  "array_to_lod",
  "beam_search",
  "default_chunk",
  "default_ladder",
  "default_plan",
  "dynamic_rnn",
  "fused_rnn",
  "lod_reset",
  "lod_to_array",
  "map_rows",
  "masked_attention",
  "normalize_ladder",
  "rank_table",
  "reorder_by_rank",
  "sequence_attention",
  "sequence_concat",
  "sequence_conv",
  "sequence_cross_entropy",
  "sequence_enumerate",
  "sequence_erase",
  "sequence_expand",
  "sequence_expand_as",
  "sequence_first_step",
  "sequence_last_step",
  "sequence_mask",
  "sequence_pad",
  "sequence_pool",
  "sequence_reshape",
  "sequence_reverse",
  "sequence_scatter",
  "sequence_slice",
  "sequence_softmax",
  "sequence_unpad",
  "shrink_memory",
  "tune_plan",
]
