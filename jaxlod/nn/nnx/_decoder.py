"""NNX AttentionDecoder: a DynamicRNN whose step attends over a LoD memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import checkify

from jaxlod._lod import LoDTensor, is_concrete
from jaxlod.nn.nnx._rnn import functional_call, initialize_carry
from jaxlod.ops._rank import RankTable
from jaxlod.ops._rnn import dynamic_rnn
from jaxlod.ops._segment import check_lod


def _memory_shape(memory: Any) -> tuple[int, int, Any]:
  """``(count, features, dtype)`` of a LoDTensor or padded ``[b, S, F]`` memory."""
  if isinstance(memory, LoDTensor):
    values = memory.values
    if values.ndim != 2:
      raise ValueError(
        "Expected `memory` values of shape [source_tokens, features], got "
        f"{values.shape}."
      )
    return memory.capacity.sequences[-1], values.shape[-1], values.dtype
  memory = jnp.asarray(memory)
  if memory.ndim != 3:
    raise ValueError(
      "Expected `memory` to have shape [b, source_capacity, features], got "
      f"{memory.shape}."
    )
  return memory.shape[0], memory.shape[-1], memory.dtype


def _check_counts(tgt: LoDTensor, memory: LoDTensor) -> None:
  count, source = tgt.capacity.sequences[-1], memory.capacity.sequences[-1]
  if count != source:
    raise ValueError(
      f"Expected `memory` to hold one sequence per `tgt` sequence: `tgt` has "
      f"count capacity {count}, `memory` has {source}."
    )
  real, real_source = tgt.num_sequences(-1), memory.num_sequences(-1)
  if is_concrete(real, real_source):
    if int(real) != int(real_source):
      raise ValueError(
        f"Expected `memory` to hold one sequence per `tgt` sequence: `tgt` has "
        f"{int(real)} sequences, `memory` has {int(real_source)}."
      )
  else:
    checkify.debug_check(
      real == real_source,
      "AttentionDecoder: `memory` and `tgt` have different numbers of sequences.",
    )


class AttentionDecoder(nnx.Module):
  """A recurrent decoder attending over an encoder's LoD outputs at every step.

  The NNX twin of `jaxlod.nn.AttentionDecoder`. A `jaxlod.ops.dynamic_rnn`
  over the target sequences whose step reads the memory as a static input
  (reordered by rank and shrunk to the phase's batch, never expanded to
  every target step), with the attention's precomputed `keys` as another
  static input. One step (see `step`)::

    x = concat(x_t, prev_context) if input_feeding else x_t
    carry, h = cell(carry, x)
    context, weights = attention(h, memory, lengths, keys)
    y = concat(h, context)

  With input feeding the carry is ``(cell_carry, prev_context)``, the
  context starting at zeros.

  Args:
    cell: an NNX recurrent cell (see `DynamicRNN`); its input width is the
      target's features, plus the memory's with `input_feeding`.
    attention: `DotAttention`, `GeneralAttention`, `AdditiveAttention`,
      `CosineAttention`, or a module ``attention(query [b, hidden], memory
      [b, source_capacity, features], lengths [b]) -> (context [b,
      features], weights [b, source_capacity])``, optionally with
      ``keys(memory)`` (whose result it then takes as ``keys=``).
    input_feeding: feed the previous context to the cell with the input.
    remat: recompute each step in the backward pass (the default): saving
      its residuals would keep per-step attention tensors ``[b,
      source_capacity, units]`` for every step, the expansion this layer
      avoids.
    ladder: static batch sizes of the loop's phases (see `rank_table`);
      `None`: the target rank table's, by default `default_ladder`.

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
  ):
    self.cell = cell
    self.attention = attention
    self.input_feeding = input_feeding
    self.remat = remat
    self.ladder = None if ladder is None else tuple(ladder)

  def precompute(self, memory: LoDTensor | jax.typing.ArrayLike) -> Any:
    """The attention's keys for `memory`: ``attention.keys(memory)``.

    Args:
      memory: a LoDTensor ``values [source_tokens, features]`` or a padded
        array ``[b, source_capacity, features]``.

    Returns:
      What the attention precomputes (a LoDTensor with `memory`'s LoD, or an
      array, for `AdditiveAttention`), or `None` (also for an attention
      without a ``keys`` method).
    """
    keys = getattr(self.attention, "keys", None)
    return None if keys is None else keys(memory)

  def initial_state(
    self,
    memory: LoDTensor | jax.typing.ArrayLike,
    input_features: int | None = None,
    initial_carry: Any = None,
    *,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
  ) -> Any:
    """The carry of the first `step`, one row per memory sequence.

    Args:
      memory: a LoDTensor ``values [source_tokens, features]`` or a padded
        array ``[b, source_capacity, features]``.
      input_features: width of ``x_t`` (the target rows, before input
        feeding adds the context), for the input shape given to
        ``cell.initialize_carry``; by default the cell's ``in_features``
        less the fed-back context.
      initial_carry: the cell's carry, leaves ``[count, ...]``; by default
        ``cell.initialize_carry((count, step input width), rngs)``.
      rngs: the RNGs for `initialize_carry` (default ``nnx.Rngs(0)``).

    Returns:
      The cell's carry, or ``(cell_carry, zeros [count, features])`` with
      input feeding.

    Raises:
      ValueError: if a carry must be initialized for a cell without
        ``in_features`` and `input_features` is not given.
    """
    count, features, dtype = _memory_shape(memory)
    fed = features if self.input_feeding else 0
    if initial_carry is None:
      if input_features is not None:
        width = input_features + fed
      elif getattr(self.cell, "in_features", None) is not None:
        width = self.cell.in_features
      else:
        raise ValueError(
          "Expected `input_features` (the width of `x_t`) to initialize the "
          "carry of a cell without `in_features`."
        )
      initial_carry = initialize_carry(self.cell, (count, width), rngs)
    if not self.input_feeding:
      return initial_carry
    return initial_carry, jnp.zeros((count, features), dtype)

  def step(
    self,
    carry: Any,
    x_t: jax.typing.ArrayLike,
    memory_padded: jax.typing.ArrayLike,
    lengths: jax.typing.ArrayLike,
    keys: jax.typing.ArrayLike | None = None,
  ) -> tuple[Any, jax.Array, jax.Array]:
    """One decoder step (also the body of `__call__`'s loop).

    Args:
      carry: the cell's carry (leaves ``[b, ...]``), or ``(cell_carry,
        prev_context [b, features])`` with input feeding (see
        `initial_state`).
      x_t: ``[b, input_features]`` inputs of this step.
      memory_padded: ``[b, source_capacity, features]`` memory.
      lengths: ``[b]`` real lengths of the memory.
      keys: the padded `precompute` result ``[b, source_capacity, units]``,
        or `None`.

    Returns:
      ``(carry, y [b, hidden + features], weights [b, source_capacity])``.
    """
    x_t = jnp.asarray(x_t)
    if self.input_feeding:
      cell_carry, prev_context = carry
      x = jnp.concatenate([x_t, prev_context.astype(x_t.dtype)], axis=-1)
    else:
      cell_carry, x = carry, x_t
    cell_carry, h = self.cell(cell_carry, x)
    if keys is None:
      context, weights = self.attention(h, memory_padded, lengths)
    else:
      context, weights = self.attention(h, memory_padded, lengths, keys=keys)
    y = jnp.concatenate([h, context.astype(h.dtype)], axis=-1)
    if self.input_feeding:
      return (cell_carry, context.astype(prev_context.dtype)), y, weights
    return cell_carry, y, weights

  def _check_input_width(self, tgt: LoDTensor, features: int) -> None:
    if len(tgt.feature_shape) != 1:
      raise ValueError(
        f"Expected `tgt` values of shape [tokens, features], got {tgt.values.shape}."
      )
    cell_width = getattr(self.cell, "in_features", None)
    if cell_width is None:
      return
    fed = features if self.input_feeding else 0
    if tgt.feature_shape[0] + fed != cell_width:
      source = (
        f"the cell's `in_features` {cell_width} less the {fed} memory features fed back"
        if self.input_feeding
        else "the cell's `in_features`"
      )
      raise ValueError(
        f"Expected `tgt` rows of width {cell_width - fed} ({source}), got width "
        f"{tgt.feature_shape[0]}."
      )

  def __call__(
    self,
    tgt: LoDTensor,
    memory: LoDTensor,
    initial_carry: Any = None,
    *,
    return_weights: bool = False,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    table: RankTable | None = None,
  ) -> LoDTensor | tuple[LoDTensor, LoDTensor]:
    """Decodes every target sequence, teacher-forced, attending over its memory.

    Args:
      tgt: a LoDTensor ``values [tokens, input_features]`` (the embedded
        target inputs).
      memory: a LoDTensor ``values [source_tokens, features]`` holding one
        sequence per `tgt` sequence, in the same order (an encoder's outputs).
      initial_carry: the cell's carry, leaves ``[count_capacity, ...]`` in
        `tgt`'s order; zeros from the cell's `initialize_carry` by default.
        With input feeding the previous context starts at zeros.
      return_weights: also return the attention weights.
      rngs: the RNGs for `initialize_carry` (default ``nnx.Rngs(0)``).
      table: `tgt`'s rank table, e.g. built on the host by `jaxlod.data`
        beside the batch; `None`: built here (see `dynamic_rnn`).

    Returns:
      A LoDTensor with `tgt`'s LoD and values ``[tokens, hidden + features]``
      (``concat(h_t, context_t)``); with `return_weights`, also a LoDTensor
      of the weights ``[tokens, source_capacity]``.

    Raises:
      TypeError: if `tgt` or `memory` is not a LoDTensor.
      ValueError: for a memory with a different count capacity than `tgt`
        (or, eagerly, a different number of sequences), a cell whose input
        width does not match, attention widths that do not match, or (from
        `dynamic_rnn`) a `table` of other lengths or whose ladder is not
        `ladder`.
    """
    tgt = check_lod(tgt, "tgt")
    memory = check_lod(memory, "memory")
    _check_counts(tgt, memory)
    _, features, _ = _memory_shape(memory)
    self._check_input_width(tgt, features)
    carry = self.initial_state(memory, tgt.feature_shape[0], initial_carry, rngs=rngs)
    keys = self.precompute(memory)
    keys_are_lod = isinstance(keys, LoDTensor)
    step = functional_call(self, "step")

    def step_fn(c, x_t, static):
      padded, lengths = static["memory"]
      keys = static["keys"][0] if keys_are_lod else static["keys"]
      c, y, weights = step(c, x_t, padded, lengths, keys)
      return c, ((y, weights) if return_weights else y)

    outputs, _ = dynamic_rnn(
      step_fn,
      tgt,
      init_carry=carry,
      static_inputs={"memory": memory, "keys": keys},
      table=table,
      ladder=self.ladder,
      remat=self.remat,
    )
    return outputs
