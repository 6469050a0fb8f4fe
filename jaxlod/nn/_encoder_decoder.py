"""What the encoder-decoders of both twins run, free of either Flax API.

`Seq2Seq` (Linen and NNX) differ only in how they hold their parameters:
their methods call the functions here with the layers they need (the
embeddings, the encoder, the decoder's methods, the output layer). An
ensemble decodes through `decode_members`, each model one `Member` of pure
functions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh
from jax.tree_util import Partial

from jaxlod import _checks
from jaxlod._buckets import Buckets
from jaxlod._checks import check_integer, static_int
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.nn._decoding import decoder_zero_carry, start_state
from jaxlod.nn._layer_checks import check_encoded, check_tokens
from jaxlod.nn._recurrent import count_steps, counted_carry, counted_step, zero_padding
from jaxlod.ops import _decode
from jaxlod.ops._corpus import corpus_slots, decode_corpus, source_iterator
from jaxlod.ops._decode import check_settings
from jaxlod.ops._memory_attention import Memory
from jaxlod.ops._pool import pool_rows
from jaxlod.ops._rank import RankTable, check_table


def embed_ids(
  embed: Callable[[jax.Array], jax.Array], ids: Any, name: str, vocab: int
) -> LoDTensor:
  """Embeds a LoDTensor of ids ``[tokens]`` or ``[tokens, 1]``.

  An id outside ``[0, vocab)`` on a real row raises (eagerly a `ValueError`,
  under `jit` a `jax.experimental.checkify` check): an embedding lookup
  would give NaN rows (or clamp), and decoding would then drop the source.
  Under `jit` without checkify the embedded tensor records `Fault.INPUT`,
  which the encoder, the decoder and `beam_search` pass on to their results.
  """
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
  in_vocab = _checks.require_each(
    ids.row_mask() & ((values < 0) | (values >= vocab)),
    f"Expected every id of `{name}` in [0, {vocab}) (the vocabulary); row "
    "{i} holds {value}.",
    value=values,
  )
  return with_faults(
    zero_padding(ids, embed(values)), fault_unless(in_vocab, Fault.INPUT)
  )


def encode_ids(
  encoder: Callable[..., Any],
  embed: Callable[[jax.Array], jax.Array],
  vocab: int,
  src: LoDTensor,
  table: RankTable | None,
) -> LoDTensor:
  """`Seq2Seq.encode`: `encoder` over the embedded ids of `src`, given
  ``table=`` only when there is one (an encoder need not take it)."""
  table = check_table(table, optional=True)
  extra = {} if table is None else {"table": table}
  src = embed_ids(embed, src, "src", vocab)
  return check_encoded(encoder(src, **extra))


def bridged_carry(model: Any, memory: LoDTensor) -> Any:
  """`Seq2Seq.cell_carry` of a checked `memory`: ``model.carry_bridge(
  average of each memory sequence, the decoder's zero carry)``, or `None`
  without a bridge (the cell's zeros)."""
  bridge, decoder = model.carry_bridge, model.decoder
  if bridge is None:
    return None
  pooled = pool_rows(memory, "average")
  return bridge(pooled, decoder_zero_carry(decoder, memory, model.embed_dim))


def start_carry(model: Any, memory: LoDTensor) -> Any:
  """`Seq2Seq.initial_state` of a checked `memory`: the decoder's first
  carry from `bridged_carry`."""
  carry = bridged_carry(model, memory)
  return start_state(model.decoder, memory, model.embed_dim, carry)


def decode_tokens(
  embed: Callable[[jax.Array], jax.Array],
  step: Callable[[Any, jax.Array, Memory], tuple[Any, jax.Array, jax.Array]],
  output: Callable[[jax.Array], jax.Array],
  carry: Any,
  tokens: jax.typing.ArrayLike,
  memory: Memory,
) -> tuple[Any, jax.Array, jax.Array]:
  """`Seq2Seq.decode_step`: the decoder's `step` on the embedded `tokens`
  ``[b]``, its outputs mapped to logits by `output`."""
  embedded = embed(check_tokens(tokens))
  carry, y, weights = step(carry, embedded, memory)
  return carry, output(y), weights


def forced_logits(
  model: Any,
  src: LoDTensor,
  tgt_in: LoDTensor,
  return_weights: bool,
  src_table: RankTable | None,
  tgt_table: RankTable | None,
) -> LoDTensor | tuple[LoDTensor, LoDTensor]:
  """`Seq2Seq.__call__`: ``model.encode``, then ``model.decoder`` over the
  embedded `tgt_in` from `bridged_carry`, then ``model.output``, with
  ``model.dropout_rows`` on the decoder's inputs and outputs."""
  check_table(src_table, "src_table", optional=True)
  check_table(tgt_table, "tgt_table", optional=True)
  _checks.check_bool(return_weights, "return_weights")
  memory = model.encode(src, src_table)
  tgt = embed_ids(model.tgt_embed, tgt_in, "tgt_in", model.tgt_vocab)
  # Dropout keeps zero padding rows at zero.
  tgt = tgt.with_values(model.dropout_rows(tgt.values))
  # `encode` checked the memory's structure and the decoder's call checks its
  # LoD: the bridge takes it as it is (one check of the memory per call).
  outputs = model.decoder(
    tgt,
    memory,
    bridged_carry(model, memory),
    return_weights=return_weights,
    table=tgt_table,
  )
  weights = None
  if return_weights:
    outputs, weights = outputs
  logits = zero_padding(outputs, model.output(model.dropout_rows(outputs.values)))
  return logits if weights is None else (logits, weights)


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


def decode_members(
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
  check_lod(src, "src")
  check_settings(settings)
  check_table(src_table, "src_table", optional=True)
  steps, carries, memories, encoded = [], [], [], []
  for member in members:
    memory = member.encode(src, src_table)
    encoded.append(memory)
    # A step with RNG streams draws afresh at every step (a counter in the carry).
    step, carry, _ = count_steps(member.decode_step, member.initial_state(memory))
    carries.append(carry)
    memories.append(member.precompute(memory))
    steps.append(lambda c, t, m, f=step: f(c, t, m)[:2])
  hyps = _decode.beam_search(
    _decode.ensemble_step(steps),
    tuple(carries),
    settings,
    static_inputs=tuple(memories),
    max_lengths=max_lengths,
    num_sources=check_lod(src, "src").num_sequences(-1),
  )
  return _decode.faulted_by(hyps, encoded)


def _checked_sources(
  iterator: Iterator, capacity: int, vocab: int
) -> Iterator[np.ndarray]:
  """The sources of `iterator` read one by one as int32 ``[length]`` ids,
  each checked on the host: 1-D (or ``[length, 1]``) integers, at most
  `capacity` of them, each in ``[0, vocab)``, an error naming the source's
  index in the corpus."""
  for i, source in enumerate(iterator):
    ids = np.asarray(source)
    if ids.ndim == 2 and ids.shape[1] == 1:
      ids = ids[:, 0]
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
      raise ValueError(
        f"Expected every source to be int ids [length], got {ids.dtype.name}"
        f"{list(ids.shape)} for source {i} of the corpus."
      )
    if ids.size > capacity:
      raise ValueError(
        f"Expected every source to hold at most {capacity} ids (`src_capacity`), "
        f"got {ids.size} for source {i} of the corpus."
      )
    outside = (ids < 0) | (ids >= vocab)
    if outside.any():
      raise ValueError(
        f"Expected every id of source {i} of the corpus in [0, {vocab}) (the "
        f"source vocabulary), got {int(ids[np.argmax(outside)])}."
      )
    yield ids.astype(np.int32)


def _max_length(value: Any, cap: int, source: int) -> int:
  """`max_length_fn`'s value for source `source` of the corpus: an int (not
  a bool, a float or an array) in ``[1, cap]``, `cap` being
  ``settings.max_length``.

  Raises:
    TypeError, ValueError: naming `max_length_fn`, the source and the value.
  """
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(
      f"Expected `max_length_fn` to return an int, got {value!r} for source "
      f"{source} of the corpus."
    )
  if not 1 <= value <= cap:
    raise ValueError(
      f"Expected `max_length_fn` to return a max length in [1, {cap}] "
      f"(settings.max_length, the capacity of the results), got {int(value)} "
      f"for source {source} of the corpus."
    )
  return int(value)


@dataclasses.dataclass(frozen=True)
class CorpusStep:
  """The ensemble's decoding step of `decode_members_corpus`, a hashable function
  of the members' parameters: equal members compile once across calls.

  Attributes:
    rebuild: ``rebuild(params) -> list[Member]``, hashable (its equality
      says when two ensembles are the same programs).
  """

  rebuild: Callable[[Any], list[Member]]

  def __call__(self, params: Any, carries: tuple, tokens: jax.Array, memories: tuple):
    """`jaxlod.ops.ensemble_step` of the rebuilt members' steps."""
    steps = [counted_step(member.decode_step) for member in self.rebuild(params)]
    return _decode.ensemble_step([lambda c, t, m, f=f: f(c, t, m)[:2] for f in steps])(
      carries, tokens, memories
    )


@functools.partial(jax.jit, static_argnums=0)
def _encode_corpus(rebuild: Callable, params: Any, src: LoDTensor) -> tuple:
  """Every member's initial carry and precomputed memory of `src`."""
  carries, memories = [], []
  for member in rebuild(params):
    memory = member.encode(src, None)
    carry = member.initial_state(memory)
    if counted_step(member.decode_step) is not member.decode_step:
      carry = counted_carry(carry)
    carries.append(carry)
    memories.append(member.precompute(memory))
  return tuple(carries), tuple(memories)


def decode_members_corpus(
  rebuild: Callable[[Any], list[Member]],
  params: Any,
  src_vocab: int,
  sources: Iterable,
  settings: _decode.DecodeSettings,
  *,
  src_capacity: int,
  slots: int,
  max_length_fn: Callable[[np.ndarray], int] | None,
  refill: int | None,
  chunk: int,
  stats: dict | None,
  mesh: Mesh | None = None,
  axis: str = "data",
) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
  """`jaxlod.ops.decode_corpus` over the mean of the members'
  log-probabilities: `decode_members` of a corpus, with continuous refill.

  The members are ``rebuild(params)``, `rebuild` hashable and `params` their
  arrays, so that the programs take the arrays as arguments and compile
  once per `rebuild`, settings and sizes, across calls. Each refill of
  ``refill`` sources is packed on the host into a LoDTensor of fixed
  capacities (`refill` sequences of at most `src_capacity` ids) and encoded
  by one jitted program, every member's memory and initial carry.
  """
  check_settings(settings)
  src_capacity = static_int(src_capacity, "src_capacity", minimum=1)
  if max_length_fn is not None:
    _checks.check_callable(max_length_fn, "max_length_fn")
  _, refill = corpus_slots(slots, refill, mesh, axis)
  buckets = Buckets.fixed(
    tokens=refill * src_capacity, sequences=refill, time=src_capacity
  )

  read = 0  # the corpus index of the next batch's first source

  def encode_fn(batch: list[np.ndarray]) -> tuple[Any, Any, Any]:
    nonlocal read
    lengths = None
    if max_length_fn is not None:
      lengths = np.ones((refill,), np.int32)
      for k, ids in enumerate(batch):
        lengths[k] = _max_length(max_length_fn(ids), settings.max_length, read + k)
    read += len(batch)
    src = LoDTensor.from_sequences(batch, buckets=buckets, dtype=np.int32)
    carries, memories = _encode_corpus(rebuild, params, src)
    return carries, memories, lengths

  return decode_corpus(
    Partial(CorpusStep(rebuild), params),
    encode_fn,
    _checked_sources(source_iterator(sources), src_capacity, src_vocab),
    settings,
    slots=slots,
    refill=refill,
    chunk=chunk,
    stats=stats,
    mesh=mesh,
    axis=axis,
  )
