"""What the Linen layers and their NNX twins share, free of either API.

The twins differ only in how they hold parameters; the bodies of their
calls (the mixins below), the embedding of id LoDTensors and the decoding of
encoder-decoder members live here once (the recurrent layers' bodies in
`jaxlod.nn._recurrent`), and their argument checks in `jaxlod.nn._checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlod import _checks
from jaxlod._checks import check_integer, check_rate, check_sizes
from jaxlod._host import check_leaves
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.nn._checks import (
  check_attention_layer,
  check_counts,
  check_encoded,
  check_rnn_layer,
  check_targets,
  check_tokens,
  check_twin,
)
from jaxlod.nn._recurrent import count_steps, zero_padding
from jaxlod.ops import _attention as core
from jaxlod.ops import _decode
from jaxlod.ops._attention import Memory, check_memory_lod
from jaxlod.ops._decode import check_settings
from jaxlod.ops._pool import sequence_pool
from jaxlod.ops._rank import RankTable, check_table


def check_seq2seq(
  src_vocab: Any,
  tgt_vocab: Any,
  embed_dim: Any,
  encoder: Any,
  decoder: Any,
  bridge: Any,
  dropout: Any,
  deterministic: Any,
  owner: Any,
) -> None:
  """The arguments `Seq2Seq`'s twins (`owner`) check before building their
  layers."""
  check_sizes(src_vocab=src_vocab, tgt_vocab=tgt_vocab, embed_dim=embed_dim)
  check_rnn_layer(encoder, "encoder", owner)
  check_decoder(decoder, owner)
  _checks.check_bools(bridge=bridge, deterministic=deterministic)
  check_rate(dropout, "dropout", closed=False)


def embed_ids(
  embed: Callable[[jax.Array], jax.Array], ids: Any, name: str, vocab: int
) -> LoDTensor:
  """Embeds a LoDTensor of ids ``[tokens]`` or ``[tokens, 1]``.

  An id outside ``[0, vocab)`` on a real row raises (eagerly a `ValueError`,
  under `jit` a `jax.experimental.checkify` check): an embedding lookup
  would give NaN rows (or clamp), and decoding would then drop the source.
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
  _checks.require_each(
    ids.row_mask() & ((values < 0) | (values >= vocab)),
    f"Expected every id of `{name}` in [0, {vocab}) (the vocabulary); row "
    "{i} holds {value}.",
    value=values,
  )
  return zero_padding(ids, embed(values))


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


# -- the methods the twins share -----------------------------------------------------


class DecoderCalls:
  """The methods of the attention decoders that both twins share."""

  def precompute(self, memory: LoDTensor) -> Memory:
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
    memory = check_memory_lod(memory)
    keys = getattr(self.attention, "keys", None)
    return core.lod_memory(memory, None if keys is None else keys(memory))

  def step(
    self, carry: Any, x_t: jax.typing.ArrayLike, memory: Memory
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
    feeding = self.input_feeding
    return core.decoder_step(
      self.cell, self.attention, carry, x_t, memory, input_feeding=feeding
    )

  def zero_carry(self, memory: LoDTensor, input_features: int) -> Any:
    """The cell's default carry for ``(count capacity, step input width)``:
    the step input is ``x_t`` (`input_features` wide), with the memory's
    features added under input feeding (``cell.initialize_carry`` with a
    fixed key: Flax's cells start from zeros)."""
    memory = check_memory_lod(memory)
    fed = memory.feature_shape[-1] if self.input_feeding else 0
    shape = (memory.capacity.sequences[-1], input_features + fed)
    return self.initialize_carry(shape)

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
    memory = check_memory_lod(memory)
    if initial_carry is None:
      initial_carry = self.zero_carry(memory, input_features)
    if not self.input_feeding:
      return initial_carry
    shape = (memory.capacity.sequences[-1], memory.feature_shape[-1])
    return initial_carry, jnp.zeros(shape, memory.values.dtype)

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
        rejects; from `dynamic_rnn`, for a `table` of other lengths or whose
        ladder is not `ladder`.
    """
    tgt = check_targets(tgt)
    memory = check_memory_lod(memory)
    _checks.check_callable(self.cell, "cell")
    check_attention_layer(self.attention, self)
    _checks.check_bools(
      input_feeding=self.input_feeding,
      remat=self.remat,
      return_weights=return_weights,
    )
    # `dynamic_rnn` checks the carry's leading dimensions (naming `init_carry`).
    check_leaves(initial_carry, "initial_carry")
    check_counts(tgt, memory)
    self.check_input_width(tgt, memory)
    carry = self.initial_state(memory, tgt.feature_shape[-1], initial_carry)
    padded = self.precompute(memory)
    step, carry, _ = count_steps(self.pure_step(carry, tgt, padded), carry)
    return core.run_decoder(
      step,
      tgt,
      padded,
      carry,
      return_weights=return_weights,
      table=table,
      ladder=self.ladder,
      remat=self.remat,
    )

  def check_input_width(self, tgt: LoDTensor, memory: LoDTensor) -> None:
    """Checks the target rows' width against the cell's, where it is known."""
    del tgt, memory


class Seq2SeqCalls:
  """The methods of the encoder-decoders that both twins share; a twin
  defines `dropout` (identity when deterministic)."""

  def encode(self, src: LoDTensor, table: RankTable | None = None) -> LoDTensor:
    """The encoder's outputs over the embedded source: the decoder's memory.

    Args:
      src: a LoDTensor of int ids, values ``[src_token_capacity]`` or
        ``[src_token_capacity, 1]``.
      table: `src`'s rank table (e.g. built on the host by `jaxlod.data`),
        given to the encoder as ``table=``; `None`: not passed, the encoder
        builds its own (an encoder given one must take ``table=``, as
        `DynamicRNN`, `Bidirectional` and `StackedRNN` do).

    Returns:
      A LoDTensor with `src`'s LoD, values ``[src_token_capacity,
      features]``.
    """
    # Only a given table is passed on: an encoder need not take one.
    table = check_table(table, optional=True)
    extra = {} if table is None else {"table": table}
    src = embed_ids(self.src_embed, src, "src", self.src_vocab)
    return check_encoded(self.encoder(src, **extra))

  def initial_state(self, memory: LoDTensor) -> Any:
    """The decoder's starting carry for `memory` (bridged or zeros).

    Args:
      memory: `encode`'s result, values ``[src_token_capacity, features]``.

    Returns:
      The carry of `decode_step`, leaves ``[count_capacity, ...]`` in
      `memory`'s order (see `AttentionDecoder.initial_state`).
    """
    return self.decoder.initial_state(memory, self.embed_dim, self.cell_carry(memory))

  def cell_carry(self, memory: LoDTensor) -> Any:
    """The bridged initial cell carry, or `None` (the cell's zeros)."""
    if not self.bridge:
      return None
    pooled = sequence_pool(check_memory_lod(memory), "average")
    template = self.decoder.zero_carry(memory, self.embed_dim)
    return self.carry_bridge(pooled, template)

  def precompute(self, memory: LoDTensor) -> Memory:
    """The `jaxlod.ops.Memory` of `memory` for `decode_step` (see
    `AttentionDecoder.precompute`)."""
    return self.decoder.precompute(memory)

  def decode_step(
    self, carry: Any, tokens: jax.typing.ArrayLike, memory: Memory
  ) -> tuple[Any, jax.Array, jax.Array]:
    """One decoding step from token ids to next-token logits.

    Args:
      carry: the decoder carry, leaves ``[b, ...]``.
      tokens: ``[b]`` int ids of the previous tokens.
      memory: the `jaxlod.ops.Memory` of ``b`` rows (see `precompute`).

    Returns:
      ``(carry, logits [b, tgt_vocab], weights [b, source_capacity])``.
    """
    embedded = self.tgt_embed(check_tokens(tokens))
    carry, y, weights = self.decoder.step(carry, embedded, memory)
    return carry, self.output(y), weights

  def generate(
    self,
    src: LoDTensor,
    settings: _decode.DecodeSettings,
    *,
    max_lengths: jax.typing.ArrayLike | None = None,
    src_table: RankTable | None = None,
  ) -> _decode.Hypotheses:
    """Decodes every source with `jaxlod.ops.beam_search`, each source
    stopping early: `ensemble_generate` with this model as the one member.

    Args:
      src: a LoDTensor of int source ids, values ``[src_token_capacity]``
        or ``[src_token_capacity, 1]``; its padding sequences get no
        hypotheses.
      settings: the `jaxlod.ops.DecodeSettings` (``beam_size=1``: greedy).
      max_lengths: int ``[count_capacity]`` per-source limits (see
        `jaxlod.ops.beam_search`), or `None`.
      src_table: `src`'s rank table for the encoder (see `encode`); `None`:
        the encoder builds its own.

    Layers that draw (a Linen cell with ``nn.Dropout``, in the encoder or
    the decoder) take the RNG streams of ``apply(..., rngs=...)``, the
    decoding step afresh at every step.

    Returns:
      `jaxlod.ops.Hypotheses` in `src`'s order: token ids as a 2-level
      LoDTensor (source -> hypotheses -> tokens, `eos` excluded) and one
      score per hypothesis.

    Raises:
      ValueError: for `bos_id` or `eos_id` outside ``[0, tgt_vocab)``, and
        as `beam_search` does.
    """
    return generate(
      [self.member()], src, settings, max_lengths=max_lengths, src_table=src_table
    )

  def __call__(
    self,
    src: LoDTensor,
    tgt_in: LoDTensor,
    *,
    return_weights: bool = False,
    src_table: RankTable | None = None,
    tgt_table: RankTable | None = None,
  ) -> LoDTensor | tuple[LoDTensor, LoDTensor]:
    """Teacher-forced logits of every target position.

    Args:
      src: a LoDTensor of int source ids, values ``[src_token_capacity]`` or
        ``[src_token_capacity, 1]``.
      tgt_in: a LoDTensor of int decoder input ids (the target shifted
        right), values ``[token_capacity]`` or ``[token_capacity, 1]``, one
        sequence per `src` sequence.
      return_weights: also return the decoder's attention weights (e.g. to
        draw which letters each output step attends to).
      src_table: `src`'s rank table for the encoder (see `encode`); `None`:
        the encoder builds its own.
      tgt_table: `tgt_in`'s rank table for the decoder's loop (see
        `AttentionDecoder`); `None`: built there. `jaxlod.data.Batcher`
        builds both on the host with each batch (``Batch.tables``).

    Returns:
      A LoDTensor with `tgt_in`'s LoD and values ``[token_capacity,
      tgt_vocab]``; padding rows are zeros. With `return_weights`, the pair
      ``(logits, weights)``, weights a LoDTensor with `tgt_in`'s LoD and
      values ``[token_capacity, src_time_capacity]`` (row ``t`` of a target
      sequence: its weights over the source positions).

    Raises:
      TypeError: for ids that are not LoDTensors of integers.
      ValueError: at trace time for ids of the wrong shape, `src` and
        `tgt_in` with different count capacities (eagerly, different
        numbers of sequences), widths the attention rejects, or a table
        that does not describe its ids (other lengths or capacities) or
        whose ladder is not its loop's.
    """
    check_table(src_table, "src_table", optional=True)
    check_table(tgt_table, "tgt_table", optional=True)
    _checks.check_bool(return_weights, "return_weights")
    memory = self.encode(src, src_table)
    tgt = embed_ids(self.tgt_embed, tgt_in, "tgt_in", self.tgt_vocab)
    # Dropout keeps zero padding rows at zero.
    tgt = tgt.with_values(self.dropout_rows(tgt.values))
    outputs = self.decoder(
      tgt,
      memory,
      self.cell_carry(memory),
      return_weights=return_weights,
      table=tgt_table,
    )
    weights = None
    if return_weights:
      outputs, weights = outputs
    logits = zero_padding(outputs, self.output(self.dropout_rows(outputs.values)))
    return logits if weights is None else (logits, weights)


# -- decoders --------------------------------------------------------------------


def check_decoder(decoder: Any, owner: Any) -> Any:
  """A `Seq2Seq`'s `decoder` is an `AttentionDecoder` of `owner`'s API."""
  check_twin(decoder, "decoder", owner)
  if not isinstance(decoder, DecoderCalls):
    raise TypeError(
      f"Expected `decoder` to be an AttentionDecoder, got {type(decoder).__name__}."
    )
  return decoder
