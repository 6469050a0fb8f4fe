"""Flax NNX layers over `jaxlod.ops`: the `flax.nnx.Module` twins of every
layer of `jaxlod.nn`, with the same names, arguments (plus ``rngs`` and
input widths, as Flax's NNX layers), defaults and errors.

They work with `nnx.jit`, `nnx.grad` and `nnx.Optimizer`; the recurrent
layers run a cell inside `jaxlod.ops.dynamic_rnn` by splitting it into its
graph definition and state, so the same cell object can also run in
``flax.nnx.RNN``.
"""

from jaxlod.nn.nnx._attention import (
  AdditiveAttention,
  Attention,
  CosineAttention,
  DotAttention,
  GeneralAttention,
)
from jaxlod.nn.nnx._decoder import AttentionDecoder
from jaxlod.nn.nnx._rnn import (
  RGLRU,
  RNN,
  Bidirectional,
  DynamicRNN,
  HierarchicalEncoder,
  MinGRU,
  StackedRNN,
)
from jaxlod.nn.nnx._seq2seq import (
  Seq2Seq,
  ensemble_generate,
  ensemble_generate_corpus,
)
from jaxlod.nn.nnx._transformer import (
  MultiHeadAttention,
  TransformerEncoder,
  TransformerEncoderLayer,
)

# The names of `jaxlod.nn`, one twin each (tests/nn/test_twins.py holds them equal).
__all__ = sorted(name for name in dir() if not name.startswith("_"))
