"""What the attentions and the attention decoders of both twins run, free of
either Flax API.

The Linen and NNX layers differ only in how they hold their parameters;
each of their methods is a short call to a function here (or straight to
`jaxlod.ops`), given the values and callables it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxlod import _checks
from jaxlod._faults import with_faults
from jaxlod._host import as_array, check_leaves
from jaxlod._lod import LoDTensor, is_lod
from jaxlod.nn._layer_checks import check_attention_layer, check_counts, check_targets
from jaxlod.nn._recurrent import count_steps
from jaxlod.ops import _memory_attention as core
from jaxlod.ops._loop._plan import LoopPlan, plan_with_ladder, resolve_plan
from jaxlod.ops._memory_attention import Memory, check_memory_lod
from jaxlod.ops._rank import RankTable, nan_unless


def attend_query(
  scores: Callable[[jax.Array, Memory], jax.Array],
  query: jax.typing.ArrayLike,
  memory: Any,
  lengths: Any,
  keys: Any,
) -> tuple[jax.Array, jax.Array]:
  """An attention's call: `query` ``[b, hidden]`` scored by `scores` over
  `memory` (an array with `lengths`, a one-level LoDTensor or a
  `jaxlod.ops.Memory`, with `keys`), then `jaxlod.ops.attend`."""
  query = as_array(query, "query")
  memory, fits = core.memory_and_fits(memory, lengths, keys)
  return nan_unless(fits, core.attend(scores(query, memory), memory))


def precompute_memory(attention: Any, memory: LoDTensor) -> Memory:
  """`memory` (checked by `check_memory_lod`) padded, with what `attention`
  precomputes from it (``attention.keys(memory)`` on the packed rows; `None`
  if it has no `keys`)."""
  keys = getattr(attention, "keys", None)
  return core.padded_memory(memory, None if keys is None else keys(memory))


def carry_shape(
  memory: LoDTensor, input_features: int, input_feeding: bool
) -> tuple[int, int]:
  """``(count capacity, step input width)`` of a decoder's cell over a
  checked `memory`: the step input is ``x_t`` (`input_features` wide), with
  the memory's features added under input feeding."""
  fed = memory.feature_shape[-1] if input_feeding else 0
  return memory.capacity.sequences[-1], input_features + fed


def decoder_zero_carry(decoder: Any, memory: LoDTensor, input_features: int) -> Any:
  """A decoder's default cell carry over a checked `memory`:
  ``decoder.initialize_carry`` of `carry_shape`."""
  shape = carry_shape(memory, input_features, decoder.input_feeding)
  return decoder.initialize_carry(shape)


def start_state(
  decoder: Any, memory: LoDTensor, input_features: int, initial_carry: Any
) -> Any:
  """A decoder's first carry over a checked `memory`: `initial_carry` (by
  default `decoder_zero_carry`), paired with a zero context ``[count_capacity,
  features]`` under input feeding."""
  if initial_carry is None:
    initial_carry = decoder_zero_carry(decoder, memory, input_features)
  if not decoder.input_feeding:
    return initial_carry
  shape = (memory.capacity.sequences[-1], memory.feature_shape[-1])
  return initial_carry, jnp.zeros(shape, memory.values.dtype)


def check_plan(plan: Any, ladder: Any = None) -> LoopPlan | None:
  """A decoder's `plan`: a `jaxlod.ops.LoopPlan`, or `None` (the backend's
  `jaxlod.ops.default_plan` at trace time), beside its `ladder`.

  Raises:
    TypeError: for anything else, naming `plan`.
    ValueError: for a `ladder` with a plan whose `bodies` is set.
  """
  if plan is None:
    return None
  plan = resolve_plan(plan)
  if ladder is not None:
    plan_with_ladder(plan, ladder)
  return plan


def check_decoder_call(
  decoder: Any,
  tgt: LoDTensor,
  memory: LoDTensor,
  initial_carry: Any,
  return_weights: Any,
) -> None:
  """The rest of a decoder's teacher-forced call, with `tgt` and `memory`
  checked: its cell, attention, flags, the carry's leaves, the numbers of
  sequences and the input width."""
  _checks.check_callable(decoder.cell, "cell")
  check_attention_layer(decoder.attention, decoder)
  _checks.check_bools(
    input_feeding=decoder.input_feeding,
    remat=decoder.remat,
    return_weights=return_weights,
  )
  check_plan(decoder.plan, decoder.ladder)
  # `dynamic_rnn` checks the carry's leading dimensions (naming `init_carry`).
  check_leaves(initial_carry, "initial_carry")
  check_counts(tgt, memory)
  decoder.check_input_width(tgt, memory)


def teacher_forced(
  decoder: Any,
  tgt: Any,
  memory: Any,
  initial_carry: Any,
  return_weights: bool,
  table: RankTable | None,
) -> LoDTensor | tuple[LoDTensor, LoDTensor]:
  """`AttentionDecoder`'s call: `tgt` and `memory` checked, then
  `forced_outputs`."""
  tgt, memory = check_targets(tgt), check_memory_lod(memory)
  return forced_outputs(decoder, tgt, memory, initial_carry, return_weights, table)


def forced_outputs(
  decoder: Any,
  tgt: LoDTensor,
  memory: LoDTensor,
  initial_carry: Any,
  return_weights: bool,
  table: RankTable | None,
) -> LoDTensor | tuple[LoDTensor, LoDTensor]:
  """A decoder's teacher-forced outputs over a checked `tgt` and `memory`
  (`check_decoder_call` checks the rest): its `step` over every target
  sequence (`jaxlod.ops._memory_attention.run_decoder`) from `start_state`, over
  `precompute_memory`, the step made pure by ``decoder.pure_step``."""
  check_decoder_call(decoder, tgt, memory, initial_carry, return_weights)
  carry = start_state(decoder, memory, tgt.feature_shape[-1], initial_carry)
  padded = precompute_memory(decoder.attention, memory)
  step, carry, _ = count_steps(decoder.pure_step(carry, tgt, padded), carry)
  outputs = core.run_decoder(
    step,
    tgt,
    padded,
    carry,
    return_weights=return_weights,
    table=table,
    ladder=decoder.ladder,
    remat=decoder.remat,
    plan=decoder.plan,
  )
  # The outputs read the memory: its faults (an encoder's) are theirs too.
  return jax.tree.map(lambda x: with_faults(x, memory), outputs, is_leaf=is_lod)
