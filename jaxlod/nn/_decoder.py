"""Linen AttentionDecoder: a DynamicRNN whose step attends over a LoD memory.

The decoder is a `dynamic_rnn` whose step (`jaxlod.ops.decoder_step`) reads
the encoder's outputs, a `jaxlod.ops.Memory` static input: the loop reorders
it by rank once and shrinks it to each phase's batch, and with ``remat`` the
backward pass recomputes each step's attention from the saved carries, so
nothing of size ``target x source`` is kept (old PaddlePaddle expanded the
decoder states to every source position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from jaxlod._lod import LoDTensor
from jaxlod.nn import _common
from jaxlod.nn._checks import check_cell
from jaxlod.nn._recurrent import example_row
from jaxlod.nn._rnn import pure_method
from jaxlod.ops import _attention as core


class AttentionDecoder(_common.DecoderCalls, nn.Module):
  """A recurrent decoder attending over a LoD memory at every step.

  A `dynamic_rnn` over the target sequences whose step reads the encoder's
  outputs (the memory, one sequence per target sequence) as a static input,
  reordered by rank and shrunk to each phase's batch. One step (`step`,
  `jaxlod.ops.decoder_step`):

  * ``x = concat(x_t, prev_context)`` with `input_feeding`, else ``x_t``;
  * ``carry, h = cell(carry, x)``;
  * ``context, weights = attention(h, memory, lengths[, keys])``;
  * ``y_t = concat(h, context)``.

  What the attention computes once per source (``attention.keys(memory)``,
  the keys of `AdditiveAttention`) is computed on the packed memory rows,
  outside the loop (`precompute`), and reaches each step in the
  `jaxlod.ops.Memory`.

  Parameters live under ``cell`` (the same tree as ``flax.linen.RNN(cell)``)
  and ``attention``. The NNX twin is `jaxlod.nn.nnx.AttentionDecoder`.

  Attributes:
    cell: a Flax recurrent cell (see `DynamicRNN`).
    attention: an attention of `jaxlod.nn` (`DotAttention`,
      `GeneralAttention`, `AdditiveAttention`, `CosineAttention`) or a
      module ``attention(query [b, hidden], memory [b, source_capacity,
      features], lengths [b]) -> (context [b, features], weights [b,
      source_capacity])``, with ``keys(memory)`` if it precomputes keys.
    input_feeding: feed the previous context into the cell with the input
      (Luong's input feeding); the carry is then ``(cell_carry,
      prev_context [b, features])`` with a zero first context.
    remat: recompute each step in the backward pass, saving only the carries
      (default). Otherwise every step's attention residuals (``[b,
      source_capacity, units]`` for additive attention) are stored, which is
      the target x source expansion this decoder avoids.
    ladder: static batch sizes of the loop's phases (see `rank_table`);
      `None`: the target rank table's, by default `default_ladder`.

  Example:
    >>> import numpy as np, jax, flax.linen as nn
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import AttentionDecoder, DotAttention
    >>> rng = np.random.default_rng(0)
    >>> memory = LoDTensor.from_sequences([rng.normal(size=(n, 4)) for n in (3, 2)])
    >>> tgt = LoDTensor.from_sequences([rng.normal(size=(n, 2)) for n in (2, 5)])
    >>> decoder = AttentionDecoder(nn.GRUCell(4), DotAttention())
    >>> (y, w), params = decoder.init_with_output(
    ...   jax.random.key(0), tgt, memory, return_weights=True
    ... )
    >>> y.values.shape, w.values.shape, y.recursive_lengths()
    ((7, 8), (7, 3), [[2, 5]])
  """

  cell: nn.Module
  attention: nn.Module
  input_feeding: bool = False
  remat: bool = True
  ladder: Sequence[int] | None = None

  # Flax manages module state in (and `nn.intercept_methods` sees) a class's
  # own methods only: the shared ones are taken into the class.
  shared = _common.DecoderCalls
  precompute, step, zero_carry = shared.precompute, shared.step, shared.zero_carry
  initial_state, __call__ = shared.initial_state, shared.__call__
  del shared

  def initialize_carry(self, shape: tuple[int, int]) -> Any:
    """``cell.initialize_carry(key(0), shape)``."""
    check_cell(self.cell, "initialize_carry(rng, input_shape)")
    return self.cell.initialize_carry(jax.random.key(0), shape)

  def pure_step(self, carry: Any, tgt: LoDTensor, memory: core.Memory) -> Any:
    """`step` as a pure function of the variables, for `dynamic_rnn`."""
    first = example_row((carry, tgt.values, memory))
    return pure_method(self, "step", *first)
