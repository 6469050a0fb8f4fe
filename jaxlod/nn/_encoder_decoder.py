"""What the encoder-decoders of both twins run, free of either Flax API.

`Seq2Seq` (Linen and NNX) differ only in how they hold their parameters:
their methods call the functions here with the layers they need (the
embeddings, the encoder, the decoder's methods, the output layer). An
ensemble decodes through `generate`, each model one `Member` of pure
functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jaxlod import _checks
from jaxlod._checks import check_integer
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.nn._checks import check_encoded, check_tokens
from jaxlod.nn._recurrent import count_steps, zero_padding
from jaxlod.ops import _decode
from jaxlod.ops._attention import Memory, check_memory_lod
from jaxlod.ops._decode import check_settings
from jaxlod.ops._pool import sequence_pool
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


def bridged_carry(
  memory: LoDTensor,
  bridge: Callable[[jax.Array, Any], Any] | None,
  zero_carry: Callable[[LoDTensor, int], Any],
  embed_dim: int,
) -> Any:
  """`Seq2Seq.cell_carry`: ``bridge(average of each memory sequence,
  zero_carry(memory, embed_dim))``, or `None` without a bridge (the cell's
  zeros)."""
  if bridge is None:
    return None
  pooled = sequence_pool(check_memory_lod(memory), "average")
  return bridge(pooled, zero_carry(memory, embed_dim))


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
  embedded `tgt_in` from ``model.cell_carry``, then ``model.output``, with
  ``model.dropout_rows`` on the decoder's inputs and outputs."""
  check_table(src_table, "src_table", optional=True)
  check_table(tgt_table, "tgt_table", optional=True)
  _checks.check_bool(return_weights, "return_weights")
  memory = model.encode(src, src_table)
  tgt = embed_ids(model.tgt_embed, tgt_in, "tgt_in", model.tgt_vocab)
  # Dropout keeps zero padding rows at zero.
  tgt = tgt.with_values(model.dropout_rows(tgt.values))
  outputs = model.decoder(
    tgt,
    memory,
    model.cell_carry(memory),
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
