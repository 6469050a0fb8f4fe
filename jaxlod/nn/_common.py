"""What the Linen layers and their NNX twins share, free of either API.

The twins differ only in how they hold parameters; the checks, the merging
of directions, the embedding of id LoDTensors and the decoding of
encoder-decoder members live here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlod._checks import check_integer, check_lod, check_pool_type, is_lod
from jaxlod._lod import LoDTensor
from jaxlod.ops import _decode
from jaxlod.ops._attention import Memory
from jaxlod.ops._pool import sequence_pool
from jaxlod.ops._rank import RankTable


def zero_padding(x: LoDTensor, values: jax.Array) -> LoDTensor:
  """`x`'s LoD over `values` ``[token_capacity, ...]``, padding rows set to 0."""
  real = x.row_mask().reshape((-1,) + (1,) * (jnp.ndim(values) - 1))
  return x.with_values(jnp.where(real, values, jnp.zeros((), values.dtype)))


def check_rate(rate: float, name: str, *, closed: bool = True) -> float:
  """A dropout rate in ``[0, 1]`` (``[0, 1)`` unless `closed`)."""
  ok = 0.0 <= rate <= 1.0 if closed else 0.0 <= rate < 1.0
  if not ok:
    interval = "[0, 1]" if closed else "[0, 1)"
    raise ValueError(f"Expected `{name}` in {interval}, got {rate!r}.")
  return rate


def split_pair(initial_carry: Any) -> tuple[Any, Any]:
  """``(forward, backward)`` carries of a `Bidirectional` (`None`: both None)."""
  if initial_carry is None:
    return None, None
  if not (isinstance(initial_carry, tuple | list) and len(initial_carry) == 2):
    raise TypeError(
      "Expected `initial_carry` to be a pair (forward_carry, backward_carry), "
      f"got {type(initial_carry).__name__}."
    )
  return tuple(initial_carry)


def merge_directions(
  x: LoDTensor,
  forward: Any,
  backward: Any,
  merge_fn: Callable[[jax.Array, jax.Array], jax.Array] | None,
) -> Any:
  """Both directions' outputs merged row by row (default: concatenated on the
  last axis), padding rows zero."""

  def merged(f: LoDTensor, b: LoDTensor) -> LoDTensor:
    if merge_fn is None:
      return zero_padding(x, jnp.concatenate([f.values, b.values], axis=-1))
    return zero_padding(x, merge_fn(f.values, b.values))

  return jax.tree.map(merged, forward, backward, is_leaf=is_lod)


def check_layers(layers: Sequence[Any]) -> None:
  """A `StackedRNN` has at least one layer."""
  if len(layers) == 0:
    raise ValueError("Expected `layers` to hold at least one layer, got none.")


def stack_rates(
  layers: int, input_dropout: float, dropout_rate: float, output_dropout: float
) -> list[float]:
  """`StackedRNN`'s dropout rates: before layer ``i`` for ``i < layers``, then
  after the last."""
  check_rate(input_dropout, "input_dropout")
  check_rate(dropout_rate, "dropout_rate")
  check_rate(output_dropout, "output_dropout")
  return [input_dropout] + [dropout_rate] * (layers - 1) + [output_dropout]


def pool_levels(x: Any, inner: Callable, pool_type: str) -> LoDTensor:
  """`HierarchicalEncoder`'s inner half: `inner` over the level-1 sequences
  of a 2-level `x`, each pooled to one row."""
  x = check_lod(x, "x")
  if x.num_levels != 2:
    raise ValueError(
      "Expected `x` to have 2 LoD levels (level 0: outer sequences of level-1 "
      f"sequences; level 1: sequences of rows), got {x.num_levels}."
    )
  check_pool_type(pool_type)
  return sequence_pool(check_lod(inner(x), "the inner output"), pool_type)


def embed_ids(
  embed: Callable[[jax.Array], jax.Array], ids: Any, name: str
) -> LoDTensor:
  """Embeds a LoDTensor of ids ``[tokens]`` or ``[tokens, 1]``."""
  ids = check_lod(ids, name)
  values = ids.values
  if values.ndim == 2 and values.shape[1] == 1:
    values = values[:, 0]
  if values.ndim != 1:
    raise ValueError(
      f"Expected `{name}.values` to have shape [tokens] or [tokens, 1] (token "
      f"ids), got {tuple(ids.values.shape)}."
    )
  check_integer(values.dtype, f"{name}.values")
  return zero_padding(ids, embed(values))


def check_tokens(tokens: jax.typing.ArrayLike) -> jax.Array:
  """A decoding step's previous tokens: int ``[b]``."""
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"Expected `tokens` to have shape [b], got {tokens.shape}.")
  check_integer(tokens.dtype, "tokens")
  return tokens


def check_encoded(memory: Any) -> LoDTensor:
  """An encoder's output must be a LoDTensor."""
  if not isinstance(memory, LoDTensor):
    raise TypeError(
      f"Expected `encoder` to return a LoDTensor, got {type(memory).__name__}."
    )
  return memory


class Member(NamedTuple):
  """One encoder-decoder of an ensemble, as four pure functions.

  Attributes:
    encode: ``encode(src, table) -> memory`` (a one-level LoDTensor).
    initial_state: ``initial_state(memory) -> carry``.
    precompute: ``precompute(memory) -> jaxlod.ops.Memory``.
    decode_step: ``decode_step(carry, tokens [b], memory: Memory) ->
      (carry, logits [b, vocab], weights)``.
  """

  encode: Callable[[LoDTensor, RankTable | None], LoDTensor]
  initial_state: Callable[[LoDTensor], Any]
  precompute: Callable[[LoDTensor], Memory]
  decode_step: Callable[[Any, jax.Array, Memory], tuple[Any, jax.Array, Any]]


def check_vocabs(vocabs: Sequence[int]) -> None:
  """An ensemble's members share the target vocabulary."""
  if not vocabs:
    raise ValueError("Expected at least one member, got none.")
  if len(set(vocabs)) != 1:
    raise ValueError(
      f"Expected the members to share `tgt_vocab`, got {list(vocabs)} (member order)."
    )


def generate(
  members: Sequence[Member],
  src: LoDTensor,
  settings: _decode.DecodeSettings,
  *,
  max_lengths: jax.typing.ArrayLike | None = None,
  src_table: RankTable | None = None,
) -> _decode.Hypotheses:
  """`jaxlod.ops.beam_search` over the mean of the members' log-probabilities.

  Each member encodes `src` once and keeps its own decoder carry over the
  same hypotheses; one member decodes with its own log-probabilities.
  """
  steps, carries, memories = [], [], []
  for member in members:
    memory = member.encode(src, src_table)
    carries.append(member.initial_state(memory))
    memories.append(member.precompute(memory))
    steps.append(lambda c, t, m, f=member.decode_step: f(c, t, m)[:2])
  return _decode.beam_search(
    _decode.ensemble_step(steps),
    tuple(carries),
    settings,
    static_inputs=tuple(memories),
    max_lengths=max_lengths,
    num_sources=check_lod(src, "src").num_sequences(-1),
  )
