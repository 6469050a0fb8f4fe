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
from jaxlod.nn._decoding import (
  decoder_zero_carry,
  precompute_memory,
  start_state,
  teacher_forced,
)
from jaxlod.nn._layer_checks import check_cell
from jaxlod.nn._recurrent import example_row
from jaxlod.nn._rnn import pure_method
from jaxlod.ops import _memory_attention as core
from jaxlod.ops._loop._plan import LoopPlan
from jaxlod.ops._rank import RankTable


class AttentionDecoder(nn.Module):
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
    plan: how the teacher-forced loop runs on the backend, a
      `jaxlod.ops.LoopPlan` (its bodies and steps per `lax.while_loop`
      iteration, see `jaxlod.ops.dynamic_rnn`); `None`:
      `jaxlod.ops.default_plan()` at trace time, with a given `ladder`
      taking the place of its `bodies`. Every plan gives the same outputs
      and gradients up to rounding; decoding (`jaxlod.nn.Seq2Seq.generate`)
      takes its plan from `jaxlod.ops.DecodeSettings`.

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
  plan: LoopPlan | None = None

  def precompute(self, memory: LoDTensor) -> core.Memory:
    """The `jaxlod.ops.Memory` that `step` reads: `memory` padded, with what
    the attention precomputes (``attention.keys(memory)`` on the packed
    rows, or `None`).

    Args:
      memory: a one-level LoDTensor ``values [src_token_capacity, features]``.

    Returns:
      ``Memory(values [count_capacity, time_capacity, features], lengths
      [count_capacity], keys [count_capacity, time_capacity, units] |
      None)``.
    """
    return precompute_memory(self.attention, core.check_memory_lod(memory))

  def step(
    self, carry: Any, x_t: jax.typing.ArrayLike, memory: core.Memory
  ) -> tuple[Any, jax.Array, jax.Array]:
    """One decoder step over a batch of rows (`jaxlod.ops.decoder_step`).

    Args:
      carry: the carry, leaves ``[b, ...]`` (see `initial_state`).
      x_t: ``[b, input_features]`` this step's inputs.
      memory: the `jaxlod.ops.Memory` of ``b`` rows (see `precompute`).

    Returns:
      ``(carry, y_t [b, hidden + features], weights [b, source_capacity])``
      where ``y_t = concat(h_t, context_t)``.
    """
    return core.decoder_step(
      self.cell, self.attention, carry, x_t, memory, input_feeding=self.input_feeding
    )

  def zero_carry(self, memory: LoDTensor, input_features: int) -> Any:
    """The cell's default carry for ``(count capacity, step input width)``:
    the step input is ``x_t`` (`input_features` wide), with the memory's
    features added under input feeding (``cell.initialize_carry`` with a
    fixed key: Flax's cells start from zeros)."""
    return decoder_zero_carry(self, core.check_memory_lod(memory), input_features)

  def initial_state(
    self, memory: LoDTensor, input_features: int, initial_carry: Any = None
  ) -> Any:
    """The carry `step` starts from, one row per memory sequence.

    Args:
      memory: a one-level LoDTensor ``values [src_token_capacity,
        features]``.
      input_features: width of ``x_t`` (the target rows, before input
        feeding adds the context).
      initial_carry: the cell's carry, leaves ``[count_capacity, ...]`` in
        `memory`'s order; by default `zero_carry`.

    Returns:
      `initial_carry` (or the default), paired with a zero context
      ``[count_capacity, features]`` when `input_feeding`.
    """
    memory = core.check_memory_lod(memory)
    return start_state(self, memory, input_features, initial_carry)

  def __call__(
    self,
    tgt: LoDTensor,
    memory: LoDTensor,
    initial_carry: Any = None,
    *,
    return_weights: bool = False,
    table: RankTable | None = None,
  ) -> LoDTensor | tuple[LoDTensor, LoDTensor]:
    """Decodes every target sequence against its memory (teacher forcing).

    Args:
      tgt: a LoDTensor ``values [token_capacity, input_features]``, the
        decoder inputs (e.g. embedded target tokens).
      memory: a one-level LoDTensor ``values [src_token_capacity,
        features]`` with one sequence per `tgt` sequence (the encoder's
        outputs), in `tgt`'s order.
      initial_carry: the cell's carry, leaves ``[count_capacity, ...]`` in
        `tgt`'s order (see `initial_state`).
      return_weights: also return the attention weights.
      table: `tgt`'s rank table, e.g. built on the host by `jaxlod.data`
        beside the batch; `None`: built here (see `dynamic_rnn`).

    Returns:
      A LoDTensor with `tgt`'s LoD and values ``[token_capacity, hidden +
      features]`` = ``concat(h_t, context_t)``; with `return_weights`, the
      pair ``(outputs, weights)``, weights a LoDTensor with `tgt`'s LoD and
      values ``[token_capacity, source_capacity]``.

    Raises:
      ValueError: at trace time if `memory`'s count capacity differs from
        `tgt`'s, or eagerly if their real numbers of sequences differ (under
        `jit` through `jax.experimental.checkify`); for rows that are not
        vectors, or widths the attention (or a cell with ``in_features``)
        rejects; for a `ladder` with a `plan` whose `bodies` is set; from
        `dynamic_rnn`, for a `table` of other lengths or whose ladder is not
        `ladder`.
      TypeError: for a `plan` that is not a `jaxlod.ops.LoopPlan` or `None`.
    """
    return teacher_forced(self, tgt, memory, initial_carry, return_weights, table)

  def check_input_width(self, tgt: LoDTensor, memory: LoDTensor) -> None:
    """Nothing to check: a Linen cell takes its input width from its first
    call."""
    del tgt, memory

  def initialize_carry(self, shape: tuple[int, int]) -> Any:
    """``cell.initialize_carry(key(0), shape)``."""
    check_cell(self.cell, "initialize_carry(rng, input_shape)")
    return self.cell.initialize_carry(jax.random.key(0), shape)

  def pure_step(self, carry: Any, tgt: LoDTensor, memory: core.Memory) -> Any:
    """`step` as a pure function of the variables, for `dynamic_rnn`."""
    first = example_row((carry, tgt.values, memory))
    return pure_method(self, "step", *first)
