"""Linen encoder-decoders over LoDTensors of token ids: Seq2Seq and
ensemble_generate. The NNX twins live in `jaxlod.nn.nnx`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlod import _checks
from jaxlod._lod import LoDTensor
from jaxlod.nn._decoder import AttentionDecoder
from jaxlod.nn._encoder_decoder import (
  Member,
  bridged_carry,
  decode_members,
  decode_members_corpus,
  decode_tokens,
  encode_ids,
  forced_logits,
  start_carry,
)
from jaxlod.nn._layer_checks import check_rngs, check_seq2seq, check_vocabs
from jaxlod.nn._rnn import pure_method
from jaxlod.ops._decode import DecodeSettings, Hypotheses
from jaxlod.ops._memory_attention import Memory, check_memory_lod
from jaxlod.ops._rank import RankTable


class CarryBridge(nn.Module):
  """``tanh(Dense(pooled))`` per carry leaf, shaped like `template`'s leaves.

  Parameters: ``leaf_i`` (a ``flax.linen.DenseGeneral`` to leaf ``i``'s
  shape without its leading dimension).
  """

  @nn.compact
  def __call__(self, pooled: jax.Array, template: Any) -> Any:
    """Maps ``pooled [b, features]`` to a carry shaped like `template`."""
    leaves, tree = jax.tree.flatten(template)
    out = [
      jnp.tanh(nn.DenseGeneral(leaf.shape[1:], name=f"leaf_{i}")(pooled)).astype(
        leaf.dtype
      )
      for i, leaf in enumerate(leaves)
    ]
    return jax.tree.unflatten(tree, out)


class Seq2Seq(nn.Module):
  """An attention encoder-decoder over LoDTensors of token ids.

  Source and target ids are embedded (``src_embed``, ``tgt_embed``), the
  encoder runs over the source embeddings, the decoder attends over the
  encoder's outputs, and a dense layer (``output``) maps its outputs to
  logits. With `bridge`, the decoder's initial cell carry is ``tanh(Dense(
  sequence_pool(encoder outputs, "average")))`` per carry leaf (parameters
  ``carry_bridge/leaf_i``); otherwise the cell's zero carry. With `dropout`
  and ``deterministic=False``, the teacher-forced pass (`__call__`) drops
  entries of the target embeddings and of the decoder's outputs before
  ``output`` (the ``'dropout'`` rng); the source side is the encoder's to
  regularize, and decoding (`generate`, `decode_step`) never drops.

  `generate` decodes sources with `jaxlod.ops.beam_search` (on bound
  variables: ``model.apply(variables, src, settings, method="generate")``),
  and `jaxlod.nn.ensemble_generate` with several models at once. For other
  decoding loops: `encode`, `initial_state`, `precompute` and `decode_step`
  (one step from token ids to logits), each through ``model.apply(
  variables, ..., method=...)``. The NNX twin is `jaxlod.nn.nnx.Seq2Seq`.

  Attributes:
    src_vocab: number of source token ids.
    tgt_vocab: number of target token ids.
    embed_dim: width of both embeddings.
    encoder: a module ``LoDTensor [src_tokens, embed_dim] -> LoDTensor
      [src_tokens, features]`` keeping the LoD (e.g. `DynamicRNN`,
      `StackedRNN`).
    decoder: an `AttentionDecoder`.
    bridge: initialize the decoder's carry from the pooled encoder outputs.
    dropout: dropout rate in ``[0, 1)`` on the target embeddings and the
      decoder's outputs in `__call__` (0 disables it).
    deterministic: no dropout (evaluation); with ``False`` and a nonzero
      `dropout`, `apply` needs ``rngs={'dropout': key}``.

  Example:
    >>> import numpy as np, jax, flax.linen as nn
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import AttentionDecoder, DotAttention, DynamicRNN, Seq2Seq
    >>> src = LoDTensor.from_sequences([np.array([3, 1, 4]), np.array([1, 5])])
    >>> tgt_in = LoDTensor.from_sequences([np.array([0, 2]), np.array([0, 6, 2, 2])])
    >>> model = Seq2Seq(
    ...   src_vocab=8, tgt_vocab=9, embed_dim=5,
    ...   encoder=DynamicRNN(nn.LSTMCell(4)),
    ...   decoder=AttentionDecoder(nn.LSTMCell(4), DotAttention()),
    ... )
    >>> logits, params = jax.jit(model.init_with_output)(jax.random.key(0), src, tgt_in)
    >>> logits.values.shape, logits.recursive_lengths()
    ((6, 9), [[2, 4]])
  """

  src_vocab: int
  tgt_vocab: int
  embed_dim: int
  encoder: nn.Module
  decoder: AttentionDecoder
  bridge: bool = True
  dropout: float = 0.0
  deterministic: bool = True

  def setup(self):
    check_seq2seq(
      self.src_vocab,
      self.tgt_vocab,
      self.embed_dim,
      self.encoder,
      self.decoder,
      self.bridge,
      self.dropout,
      self.deterministic,
      self,
      AttentionDecoder,
    )
    self.drop = nn.Dropout(self.dropout, deterministic=self.deterministic)
    self.src_embed = nn.Embed(self.src_vocab, self.embed_dim)
    self.tgt_embed = nn.Embed(self.tgt_vocab, self.embed_dim)
    self.carry_bridge = CarryBridge() if self.bridge else None
    self.output = nn.Dense(self.tgt_vocab)

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
    return encode_ids(self.encoder, self.src_embed, self.src_vocab, src, table)

  def initial_state(self, memory: LoDTensor) -> Any:
    """The decoder's starting carry for `memory` (bridged or zeros).

    Args:
      memory: `encode`'s result, values ``[src_token_capacity, features]``.

    Returns:
      The carry of `decode_step`, leaves ``[count_capacity, ...]`` in
      `memory`'s order (see `AttentionDecoder.initial_state`).
    """
    return start_carry(self, check_memory_lod(memory))

  def cell_carry(self, memory: LoDTensor) -> Any:
    """The bridged initial cell carry, or `None` (the cell's zeros)."""
    return bridged_carry(self, check_memory_lod(memory))

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
    return decode_tokens(
      self.tgt_embed, self.decoder.step, self.output, carry, tokens, memory
    )

  def generate(
    self,
    src: LoDTensor,
    settings: DecodeSettings,
    *,
    max_lengths: jax.typing.ArrayLike | None = None,
    src_table: RankTable | None = None,
  ) -> Hypotheses:
    """Decodes every source with `jaxlod.ops.beam_search`, each source
    stopping early: `ensemble_generate` with this model as the one member.

    Args:
      src: a LoDTensor of int source ids, values ``[src_token_capacity]``
        or ``[src_token_capacity, 1]``; its padding sequences get no
        hypotheses.
      settings: the `jaxlod.ops.DecodeSettings` (``beam_size=1``: greedy;
        its `plan` runs the decoding loop, the decoder's `plan` only the
        teacher-forced one of `__call__`).
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
    return decode_members(
      [self.member()], src, settings, max_lengths=max_lengths, src_table=src_table
    )

  def generate_corpus(
    self,
    sources: Iterable,
    settings: DecodeSettings,
    *,
    src_capacity: int,
    slots: int,
    max_length_fn: Callable[[np.ndarray], int] | None = None,
    refill: int | None = None,
    chunk: int = 4,
    stats: dict | None = None,
  ) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """Decodes a corpus with continuous refill (`jaxlod.ops.decode_corpus`):
    `slots` sources in flight, new ones encoded into the slots of finished
    ones; `ensemble_generate_corpus` with this model as the one member.

    Call it through ``model.apply(variables, sources, settings,
    method="generate_corpus", src_capacity=..., slots=...)``, not under
    `jax.jit`: it returns an iterator that runs its own jitted programs
    (compiled once per call, for the whole corpus) as it is read.

    Args:
      sources: an iterable of sources, each int ids ``[length]`` (a list or
        an array), read as slots free up: a file's lines stream through in
        bounded memory.
      settings: the `jaxlod.ops.DecodeSettings` (its `ladder` and `plan`
        do not apply: the slots stay full instead).
      src_capacity: the most ids of a source (the encoder's time capacity).
      slots: the sources in flight.
      max_length_fn: a source's ids to its max hypothesis length (at most
        ``settings.max_length``), e.g. ``lambda ids: len(ids) + 13``;
        `None`: ``settings.max_length``.
      refill, chunk, stats: as `jaxlod.ops.decode_corpus`'s.

    Yields:
      Per source, in the corpus's order, ``(ids, scores)``: up to
      `num_results` hypotheses best first (``ids[j]`` int32 ``[length]``,
      `eos` excluded), as `generate` gives them for that source alone.

    Layers that draw (a cell with ``nn.Dropout``) take the RNG streams of
    ``apply(..., rngs=...)`` as in `generate`, but a step's keys are folded
    with the furthest step in flight, not each source's own: the draws
    depend on which sources share the slots.

    Raises:
      ValueError: as `generate`, and while reading, for a source longer
        than `src_capacity`, not 1-D, or with an id outside ``[0,
        src_vocab)``, naming its index in the corpus.
    """
    self._require_parameters()
    rebuild, params, vocab = corpus_members([self.unbind()], _stream_keys(self))
    return decode_members_corpus(
      rebuild,
      params,
      vocab,
      sources,
      settings,
      src_capacity=src_capacity,
      slots=slots,
      max_length_fn=max_length_fn,
      refill=refill,
      chunk=chunk,
      stats=stats,
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
    return forced_logits(self, src, tgt_in, return_weights, src_table, tgt_table)

  def dropout_rows(self, values: jax.Array) -> jax.Array:
    """``Dropout(dropout)`` of packed rows (zero rows stay zero)."""
    return self.drop(values)

  def _require_parameters(self) -> None:
    """Raises `ValueError` while initializing: decoding needs parameters."""
    if self.is_initializing():
      raise ValueError(
        "Seq2Seq.generate needs parameters: initialize the model with `init` on "
        "(src, tgt_in), then call `apply(variables, src, settings, "
        "method='generate')`."
      )

  def member(self) -> Member:
    """This bound model as a `Member` of pure functions of its variables
    (`generate`, `ensemble_generate`).

    Each function gets the RNG streams of the call but ``params`` (those of
    ``apply(..., rngs=...)``, or of ``bind``), a key of its own per stream,
    so that a layer that draws (a cell with ``nn.Dropout``) works in the
    encoder and in the decoding step; the step draws afresh at every step
    (see `pure_method`).

    Raises:
      ValueError: while initializing: decoding needs parameters.
    """
    self._require_parameters()
    methods = ("encode", "initial_state", "precompute", "decode_step")
    return Member(*(pure_method(self, method) for method in methods))


def ensemble_generate(
  members: Sequence[tuple[Seq2Seq, Any]],
  src: LoDTensor,
  settings: DecodeSettings,
  *,
  max_lengths: jax.typing.ArrayLike | None = None,
  src_table: RankTable | None = None,
  rngs: dict[str, jax.Array] | None = None,
) -> Hypotheses:
  """Decodes every source with an ensemble of encoder-decoders.

  Each step scores the next token by the mean of the members'
  ``log_softmax`` outputs (`jaxlod.ops.ensemble_step`); every member
  encodes the source once and keeps its own decoder carry over the same
  hypotheses. The members may differ in architecture (widths, layers,
  attention) but share the target vocabulary. One member is
  `Seq2Seq.generate`. Works under `jax.jit` with the variables as traced
  arguments and `settings` static. The NNX twin is
  `jaxlod.nn.nnx.ensemble_generate`.

  Args:
    members: ``(model, variables)`` pairs, each model an unbound `Seq2Seq`
      and its variables (e.g. from ``model.init``).
    src: a LoDTensor of int source ids, values ``[src_token_capacity]`` or
      ``[src_token_capacity, 1]``, in every member's source vocabulary.
    settings, max_lengths, src_table: as in `Seq2Seq.generate`.
    rngs: RNG streams for layers that draw (a cell with ``nn.Dropout``), as
      ``apply(..., rngs=...)`` takes them: a dict of stream names to JAX
      keys. Member 0 draws as `Seq2Seq.generate` would with them, member
      ``k`` from each key folded with ``k``. `None`: no streams (a layer
      that draws raises Flax's `InvalidRngError`).

  Returns:
    `jaxlod.ops.Hypotheses` in `src`'s order, scored by the mean
    log-probabilities (length-penalized).

  Raises:
    TypeError: for a member that is not a ``(Seq2Seq, variables)`` pair, or
      `rngs` that is not a dict of JAX keys.
    ValueError: for no members, members with different ``tgt_vocab``, and
      as `Seq2Seq.generate` does.

  Example:
    >>> import numpy as np, jax, flax.linen as nn
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import (
    ...   AttentionDecoder, DotAttention, DynamicRNN, Seq2Seq, ensemble_generate)
    >>> from jaxlod.ops import DecodeSettings
    >>> def model(width):
    ...   return Seq2Seq(
    ...     src_vocab=8, tgt_vocab=9, embed_dim=5,
    ...     encoder=DynamicRNN(nn.LSTMCell(width)),
    ...     decoder=AttentionDecoder(nn.LSTMCell(width), DotAttention()))
    >>> src = LoDTensor.from_sequences([np.array([3, 1, 4]), np.array([1, 5])])
    >>> tgt_in = LoDTensor.from_sequences([np.array([0, 2]), np.array([0, 6])])
    >>> members = [(model(w), model(w).init(jax.random.key(w), src, tgt_in))
    ...            for w in (4, 6)]
    >>> settings = DecodeSettings(bos_id=0, eos_id=1, max_length=4, beam_size=2)
    >>> hyps = ensemble_generate(members, src, settings)
    >>> [len(h) for h in hyps.ids.to_list()]
    [2, 2]
  """
  rebuild, params = _ensemble(members, rngs)
  return decode_members(
    rebuild(params), src, settings, max_lengths=max_lengths, src_table=src_table
  )


def ensemble_generate_corpus(
  members: Sequence[tuple[Seq2Seq, Any]],
  sources: Iterable,
  settings: DecodeSettings,
  *,
  src_capacity: int,
  slots: int,
  max_length_fn: Callable[[np.ndarray], int] | None = None,
  refill: int | None = None,
  chunk: int = 4,
  stats: dict | None = None,
  rngs: dict[str, jax.Array] | None = None,
) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
  """Decodes a corpus with an ensemble of encoder-decoders and continuous
  refill: `ensemble_generate`'s search (the mean of the members'
  log-probabilities) run by `jaxlod.ops.decode_corpus`.

  Args:
    members, settings, rngs: as `ensemble_generate`'s; the members share
      the source vocabulary too.
    sources, src_capacity, slots, max_length_fn, refill, chunk, stats: as
      `Seq2Seq.generate_corpus`'s.

  Yields:
    Per source, in the corpus's order, ``(ids, scores)``, as
    `ensemble_generate` gives them for that source alone.

  Raises:
    TypeError, ValueError: as `ensemble_generate` and
      `Seq2Seq.generate_corpus`, and for members with different
      ``src_vocab``.
  """
  rebuild, params, vocab = corpus_members(members, rngs)
  return decode_members_corpus(
    rebuild,
    params,
    vocab,
    sources,
    settings,
    src_capacity=src_capacity,
    slots=slots,
    max_length_fn=max_length_fn,
    refill=refill,
    chunk=chunk,
    stats=stats,
  )


@dataclasses.dataclass(frozen=True)
class Members:
  """An ensemble's unbound models, hashable: ``Members(models)((variables,
  rngs))`` binds each to its variables and RNG streams (member ``k`` drawing
  from each key folded with ``k``) as `Member`s."""

  models: tuple[Seq2Seq, ...]

  def __call__(self, params: tuple[tuple, dict[str, jax.Array]]) -> list[Member]:
    variables, rngs = params
    return [
      model.bind(v, rngs=_member_rngs(rngs, k)).member()
      for k, (model, v) in enumerate(zip(self.models, variables, strict=True))
    ]


def corpus_members(
  members: Any, rngs: Any
) -> tuple[Members, tuple[tuple, dict[str, jax.Array]], int]:
  """An ensemble's checked ``(Seq2Seq, variables)`` pairs as `generate_corpus`
  takes them: ``(Members(models), (variables, rngs), src_vocab)``.

  Raises:
    TypeError, ValueError: as `ensemble_generate`, and for members with
      different ``src_vocab``.
  """
  rebuild, params = _ensemble(members, rngs)
  vocab = check_vocabs([model.src_vocab for model in rebuild.models], "src_vocab")
  return rebuild, params, vocab


def _stream_keys(module: nn.Module) -> dict[str, jax.Array]:
  """A bound module's RNG streams but ``params``, one key each."""
  return {name: module.make_rng(name) for name in module.scope.rngs if name != "params"}


def _ensemble(
  members: Any, rngs: Any
) -> tuple[Members, tuple[tuple, dict[str, jax.Array]]]:
  """An ensemble's checked ``(Seq2Seq, variables)`` pairs as ``(Members(
  models), (variables, rngs))``: calling the first on the second binds them."""
  members = _checks.check_sequence(
    members, "members", "a sequence of (Seq2Seq, variables) pairs"
  )
  for k, pair in enumerate(members):
    if not (
      isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], Seq2Seq)
    ):
      got = type(pair).__name__
      if isinstance(pair, tuple):
        got = "(" + ", ".join(type(x).__name__ for x in pair) + ")"
      raise TypeError(
        f"Expected `members[{k}]` to be a (Seq2Seq, variables) pair, got {got}."
      )
  check_vocabs([model.tgt_vocab for model, _ in members])
  models = tuple(model for model, _ in members)
  variables = tuple(variables for _, variables in members)
  return Members(models), (variables, check_rngs(rngs) or {})


def _member_rngs(rngs: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
  """Member `k`'s streams: `rngs` for member 0, each key folded with `k` for
  the others (so that members draw independently)."""
  if not k:
    return rngs
  return {name: jax.random.fold_in(key, k) for name, key in rngs.items()}
