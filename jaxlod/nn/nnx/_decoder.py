"""NNX AttentionDecoder: a DynamicRNN whose step attends over a LoD memory,
the twin of `jaxlod.nn.AttentionDecoder` over the same `jaxlod.ops` core."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxlod import _checks
from jaxlod._checks import check_width
from jaxlod._lod import LoDTensor
from jaxlod.nn._decoding import (
  check_plan,
  decoder_zero_carry,
  precompute_memory,
  start_state,
  teacher_forced,
)
from jaxlod.nn._layer_checks import check_cell
from jaxlod.nn.nnx._rnn import functional_call, initialize_carry
from jaxlod.ops import _memory_attention as core
from jaxlod.ops._loop._plan import LoopPlan
from jaxlod.ops._rank import RankTable, check_ladder


class AttentionDecoder(nnx.Module):
  """A recurrent decoder attending over an encoder's LoD outputs at every step.

  The NNX twin of `jaxlod.nn.AttentionDecoder`: the same step
  (`jaxlod.ops.decoder_step`), memory (`jaxlod.ops.Memory`), methods and
  errors. The cell runs functionally inside the loop (see `DynamicRNN`).

  Args:
    cell: an NNX recurrent cell; its input width is the target's features,
      plus the memory's with `input_feeding`.
    attention: an attention of `jaxlod.nn.nnx`, or a module with the same
      call protocol.
    input_feeding: feed the previous context to the cell with the input.
    remat: recompute each step in the backward pass (the default).
    ladder: static batch sizes of the loop's phases; `None`: the target
      rank table's.
    plan: how the teacher-forced loop runs (a `jaxlod.ops.LoopPlan`);
      `None`: the backend's `jaxlod.ops.default_plan()` at trace time. As
      `jaxlod.nn.AttentionDecoder.plan`.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import AttentionDecoder, DotAttention
    >>> rng = np.random.default_rng(0)
    >>> memory = LoDTensor.from_sequences(
    ...   [rng.normal(size=(n, 4)) for n in (5, 2)], dtype=np.float32
    ... )
    >>> tgt = LoDTensor.from_sequences(
    ...   [rng.normal(size=(n, 3)) for n in (2, 3)], dtype=np.float32
    ... )
    >>> cell = nnx.GRUCell(3, 4, rngs=nnx.Rngs(0))
    >>> decoder = AttentionDecoder(cell, DotAttention())
    >>> outputs, weights = decoder(tgt, memory, return_weights=True)
    >>> outputs.values.shape, weights.values.shape, outputs.recursive_lengths()
    ((5, 8), (5, 5), [[2, 3]])
  """

  def __init__(
    self,
    cell: nnx.Module,
    attention: nnx.Module,
    *,
    input_feeding: bool = False,
    remat: bool = True,
    ladder: Sequence[int] | None = None,
    plan: LoopPlan | None = None,
  ):
    check_cell(cell)
    _checks.check_callable(attention, "attention")
    _checks.check_bools(input_feeding=input_feeding, remat=remat)
    self.cell, self.attention = cell, attention
    self.input_feeding, self.remat = input_feeding, remat
    self.ladder = check_ladder(ladder)
    self.plan = check_plan(plan, self.ladder)

  def precompute(self, memory: LoDTensor) -> core.Memory:
    """The `jaxlod.ops.Memory` that `step` reads: as
    `jaxlod.nn.AttentionDecoder.precompute`."""
    return precompute_memory(self.attention, core.check_memory_lod(memory))

  def step(
    self, carry: Any, x_t: jax.typing.ArrayLike, memory: core.Memory
  ) -> tuple[Any, jax.Array, jax.Array]:
    """One decoder step over a batch of rows: as
    `jaxlod.nn.AttentionDecoder.step`."""
    return core.decoder_step(
      self.cell, self.attention, carry, x_t, memory, input_feeding=self.input_feeding
    )

  def zero_carry(self, memory: LoDTensor, input_features: int) -> Any:
    """The cell's default carry: as `jaxlod.nn.AttentionDecoder.zero_carry`."""
    return decoder_zero_carry(self, core.check_memory_lod(memory), input_features)

  def initial_state(
    self, memory: LoDTensor, input_features: int, initial_carry: Any = None
  ) -> Any:
    """The carry `step` starts from, one row per memory sequence: as
    `jaxlod.nn.AttentionDecoder.initial_state`."""
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
    """Decodes every target sequence against its memory (teacher forcing):
    as `jaxlod.nn.AttentionDecoder.__call__`."""
    return teacher_forced(self, tgt, memory, initial_carry, return_weights, table)

  def check_input_width(self, tgt: LoDTensor, memory: LoDTensor) -> None:
    """The target rows and the fed-back context fill the cell's
    ``in_features``, where the cell has one."""
    features = memory.feature_shape[-1]
    cell_width = getattr(self.cell, "in_features", None)
    if cell_width is None:
      return
    fed = features if self.input_feeding else 0
    what = "the cell's `in_features`"
    if fed:
      what += f" {cell_width} less the {fed} memory features fed back"
    check_width("tgt", tgt.feature_shape[0], cell_width - fed, what)

  def initialize_carry(self, shape: tuple[int, int]) -> Any:
    """``cell.initialize_carry(shape, nnx.Rngs(0))``."""
    return initialize_carry(self.cell, shape)

  def pure_step(self, carry: Any, tgt: LoDTensor, memory: core.Memory) -> Any:
    """`step` over a snapshot of the layer's state, for `dynamic_rnn`."""
    del carry, tgt, memory
    return functional_call(self, "step")
