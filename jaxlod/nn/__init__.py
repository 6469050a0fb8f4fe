"""Flax (Linen) layers over `jaxlod.ops`: recurrent layers (with `RNN`,
a drop-in for ``flax.linen.RNN`` over padded arrays, and `MinGRU` and
`RGLRU`, linear recurrences run as one scan), attention over LoD memories,
Transformer layers (`MultiHeadAttention` inside each sequence, and
`TransformerEncoder`) and encoder-decoders (with `Seq2Seq.generate_corpus`,
a corpus decoded with continuous refill). NNX twins with the same names,
arguments and errors live in `jaxlod.nn.nnx`."""

from jaxlod.nn._attention import (
  AdditiveAttention,
  Attention,
  CosineAttention,
  DotAttention,
  GeneralAttention,
)
from jaxlod.nn._decoder import AttentionDecoder
from jaxlod.nn._rnn import (
  RGLRU,
  RNN,
  Bidirectional,
  DynamicRNN,
  HierarchicalEncoder,
  MinGRU,
  StackedRNN,
)
from jaxlod.nn._seq2seq import Seq2Seq, ensemble_generate, ensemble_generate_corpus
from jaxlod.nn._transformer import (
  MultiHeadAttention,
  TransformerEncoder,
  TransformerEncoderLayer,
)

__all__ = [
  "AdditiveAttention",
  "Attention",
  "AttentionDecoder",
  "Bidirectional",
  "CosineAttention",
  "DotAttention",
  "DynamicRNN",
  "GeneralAttention",
  "HierarchicalEncoder",
  "MinGRU",
  "MultiHeadAttention",
  "RGLRU",
  "RNN",
  "Seq2Seq",
  "StackedRNN",
  "TransformerEncoder",
  "TransformerEncoderLayer",
  "ensemble_generate",
  "ensemble_generate_corpus",
]
