"""Flax (Linen) layers over `jaxlod.ops`: recurrent layers, attention over LoD
memories and encoder-decoders. NNX versions live in `jaxlod.nn.nnx`."""

from jaxlod.nn._attention import (
  AdditiveAttention,
  CosineAttention,
  DotAttention,
  GeneralAttention,
)
from jaxlod.nn._rnn import Bidirectional, DynamicRNN, HierarchicalEncoder, StackedRNN
from jaxlod.nn._seq2seq import AttentionDecoder, Seq2Seq, ensemble_generate

__all__ = [
  "AdditiveAttention",
  "AttentionDecoder",
  "Bidirectional",
  "CosineAttention",
  "DotAttention",
  "DynamicRNN",
  "GeneralAttention",
  "HierarchicalEncoder",
  "Seq2Seq",
  "StackedRNN",
  "ensemble_generate",
]
