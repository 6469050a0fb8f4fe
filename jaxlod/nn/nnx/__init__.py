"""Flax NNX layers over `jaxlod.ops`: the `flax.nnx.Module` twins of
`jaxlod.nn`'s recurrent layers, attentions and attention decoder.

They work with `nnx.jit`, `nnx.grad` and `nnx.Optimizer`; the recurrent
layers run a cell inside `jaxlod.ops.dynamic_rnn` by splitting it into its
graph definition and state, so the same cell object can also run in
``flax.nnx.RNN``.
"""

from jaxlod.nn.nnx._attention import (
  AdditiveAttention,
  CosineAttention,
  DotAttention,
  GeneralAttention,
)
from jaxlod.nn.nnx._decoder import AttentionDecoder
from jaxlod.nn.nnx._rnn import Bidirectional, DynamicRNN

__all__ = [
  "AdditiveAttention",
  "AttentionDecoder",
  "Bidirectional",
  "CosineAttention",
  "DotAttention",
  "DynamicRNN",
  "GeneralAttention",
]
