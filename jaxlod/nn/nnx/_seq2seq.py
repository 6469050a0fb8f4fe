"""NNX encoder-decoders over LoDTensors of token ids: Seq2Seq and
ensemble_generate, the twins of `jaxlod.nn`'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlod import _checks
from jaxlod._checks import check_sizes
from jaxlod._lod import LoDTensor
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
from jaxlod.nn._layer_checks import check_seq2seq, check_vocabs
from jaxlod.nn.nnx._decoder import AttentionDecoder
from jaxlod.nn.nnx._rnn import functional_call, initialize_carry
from jaxlod.ops._decode import DecodeSettings, Hypotheses
from jaxlod.ops._memory_attention import Memory, check_memory_lod
from jaxlod.ops._rank import RankTable


class CarryBridge(nnx.Module):
  """``tanh(Linear(pooled))`` per carry leaf: the twin of
  `jaxlod.nn._seq2seq.CarryBridge`, with one ``nnx.LinearGeneral(features,
  leaf.shape[1:])`` named ``leaf_i`` per leaf of `template`."""

  def __init__(self, features: int, template: Any, *, rngs: nnx.Rngs):
    leaves = jax.tree.leaves(template)
    for i, leaf in enumerate(leaves):
      layer = nnx.LinearGeneral(features, tuple(leaf.shape[1:]), rngs=rngs)
      setattr(self, f"leaf_{i}", layer)

  def __call__(self, pooled: jax.Array, template: Any) -> Any:
    """Maps ``pooled [b, features]`` to a carry shaped like `template`."""
    leaves, tree = jax.tree.flatten(template)
    out = [
      jnp.tanh(getattr(self, f"leaf_{i}")(pooled)).astype(leaf.dtype)
      for i, leaf in enumerate(leaves)
    ]
    return jax.tree.unflatten(tree, out)


class Seq2Seq(nnx.Module):
  """An attention encoder-decoder over LoDTensors of token ids.

  The NNX twin of `jaxlod.nn.Seq2Seq`: the same layers under the same names
  (``src_embed``, ``tgt_embed``, ``encoder``, ``decoder``, ``carry_bridge``,
  ``output``), methods and errors. The constructor adds the width of the
  encoder's outputs (`features`) and `rngs`; the decoder cell's output width
  is its ``hidden_features``. ``nnx.Module.train()`` and ``eval()`` switch
  `deterministic`.

  Args:
    src_vocab, tgt_vocab, embed_dim, encoder, decoder, bridge: as
      `jaxlod.nn.Seq2Seq`'s attributes (`encoder` and `decoder` NNX layers).
    dropout, deterministic: as `jaxlod.nn.Seq2Seq`'s attributes.
    features: width of the encoder's output rows (the memory).
    rngs: the RNGs of the initializers and of dropout.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import AttentionDecoder, DotAttention, DynamicRNN, Seq2Seq
    >>> from jaxlod.ops import DecodeSettings
    >>> src = LoDTensor.from_sequences([np.array([3, 1, 4]), np.array([1, 5])])
    >>> tgt_in = LoDTensor.from_sequences([np.array([0, 2]), np.array([0, 6, 2, 2])])
    >>> rngs = nnx.Rngs(0)
    >>> model = Seq2Seq(
    ...   8, 9, 5,
    ...   DynamicRNN(nnx.LSTMCell(5, 4, rngs=rngs)),
    ...   AttentionDecoder(nnx.LSTMCell(5, 4, rngs=rngs), DotAttention()),
    ...   features=4, rngs=rngs,
    ... )
    >>> logits = model(src, tgt_in)
    >>> logits.values.shape, logits.recursive_lengths()
    ((6, 9), [[2, 4]])
    >>> settings = DecodeSettings(bos_id=0, eos_id=1, max_length=4, beam_size=2)
    >>> [len(h) for h in model.generate(src, settings).ids.to_list()]
    [2, 2]
  """

  def __init__(
    self,
    src_vocab: int,
    tgt_vocab: int,
    embed_dim: int,
    encoder: nnx.Module,
    decoder: AttentionDecoder,
    *,
    features: int,
    bridge: bool = True,
    dropout: float = 0.0,
    deterministic: bool = True,
    rngs: nnx.Rngs,
  ):
    """Checks the arguments (see the class docstring) and builds the
    layers: the dropout, the source and target embeddings, the carry
    bridge (with `bridge`; from the encoder's `features` to the decoder
    cell's carry) and the output projection from the decoder's outputs and
    attention context (``hidden_features + features``) to `tgt_vocab`.

    Raises:
      TypeError, ValueError: for sizes that are not ints >= 1, an `encoder`
        that is not an NNX layer over LoDTensors, a `decoder` that is not an
        NNX `AttentionDecoder`, a non-bool `bridge` or `deterministic`, a
        `dropout` outside ``[0, 1)``, or a decoder cell without an int
        ``hidden_features``.
    """
    check_seq2seq(
      src_vocab,
      tgt_vocab,
      embed_dim,
      encoder,
      decoder,
      bridge,
      dropout,
      deterministic,
      self,
      AttentionDecoder,
    )
    check_sizes(features=features)
    self.src_vocab, self.tgt_vocab, self.embed_dim = src_vocab, tgt_vocab, embed_dim
    self.encoder, self.decoder = encoder, decoder
    self.bridge, self.deterministic = bridge, deterministic
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.src_embed = nnx.Embed(src_vocab, embed_dim, rngs=rngs)
    self.tgt_embed = nnx.Embed(tgt_vocab, embed_dim, rngs=rngs)
    fed = features if decoder.input_feeding else 0
    template = initialize_carry(decoder.cell, (1, embed_dim + fed))
    self.carry_bridge = CarryBridge(features, template, rngs=rngs) if bridge else None
    hidden = getattr(decoder.cell, "hidden_features", None)
    if not isinstance(hidden, int):
      raise TypeError(
        "Expected `decoder.cell` to have an int `hidden_features` (the width of "
        f"its outputs, as Flax's NNX cells have), got {type(decoder.cell).__name__} "
        f"with {hidden!r}."
      )
    self.output = nnx.Linear(hidden + features, tgt_vocab, rngs=rngs)

  def encode(self, src: LoDTensor, table: RankTable | None = None) -> LoDTensor:
    """The encoder's outputs over the embedded source: as
    `jaxlod.nn.Seq2Seq.encode`."""
    return encode_ids(self.encoder, self.src_embed, self.src_vocab, src, table)

  def initial_state(self, memory: LoDTensor) -> Any:
    """The decoder's starting carry for `memory`: as
    `jaxlod.nn.Seq2Seq.initial_state`."""
    return start_carry(self, check_memory_lod(memory))

  def cell_carry(self, memory: LoDTensor) -> Any:
    """The bridged initial cell carry, or `None` (the cell's zeros)."""
    return bridged_carry(self, check_memory_lod(memory))

  def precompute(self, memory: LoDTensor) -> Memory:
    """The `jaxlod.ops.Memory` of `memory` for `decode_step`: as
    `jaxlod.nn.Seq2Seq.precompute`."""
    return self.decoder.precompute(memory)

  def decode_step(
    self, carry: Any, tokens: jax.typing.ArrayLike, memory: Memory
  ) -> tuple[Any, jax.Array, jax.Array]:
    """One decoding step from token ids to next-token logits: as
    `jaxlod.nn.Seq2Seq.decode_step`."""
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
    """Decodes every source with `jaxlod.ops.beam_search`: as
    `jaxlod.nn.Seq2Seq.generate`, with this model as the one member of
    `ensemble_generate`."""
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
    """Decodes a corpus with continuous refill: as
    `jaxlod.nn.Seq2Seq.generate_corpus`, with this model as the one member
    of `ensemble_generate_corpus`. Call it outside `nnx.jit`; it decodes
    with the model's state at the call."""
    rebuild, states, vocab = corpus_members([self], None)
    return decode_members_corpus(
      rebuild,
      states,
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
    """Teacher-forced logits of every target position: as
    `jaxlod.nn.Seq2Seq.__call__`."""
    return forced_logits(self, src, tgt_in, return_weights, src_table, tgt_table)

  def dropout_rows(self, values: jax.Array) -> jax.Array:
    """``nnx.Dropout(dropout)`` of packed rows unless `deterministic`."""
    return self.drop(values, deterministic=self.deterministic)

  def member(self) -> Member:
    """This model as a `Member` of pure functions (its decoding step over a
    snapshot of its state)."""
    step = functional_call(self, "decode_step")
    return Member(self.encode, self.initial_state, self.precompute, step)


def ensemble_generate(
  members: Sequence[Seq2Seq],
  src: LoDTensor,
  settings: DecodeSettings,
  *,
  max_lengths: jax.typing.ArrayLike | None = None,
  src_table: RankTable | None = None,
  rngs: None = None,
) -> Hypotheses:
  """Decodes every source with an ensemble of encoder-decoders.

  The NNX twin of `jaxlod.nn.ensemble_generate`, with the members given as
  `Seq2Seq` modules (their parameters are their state). Works under
  `nnx.jit` with `settings` static. `rngs` must be `None`: NNX members hold
  their own `nnx.Rngs`, and the loops refuse layers that draw from them
  (see `jaxlod.nn.nnx.DynamicRNN`); the argument is the Linen twin's.

  Raises:
    TypeError: for a member that is not a `Seq2Seq`.
    ValueError: for no members, members with different ``tgt_vocab``,
      `rngs` other than `None`, and as `Seq2Seq.generate` does.
  """
  pure = [model.member() for model in _ensemble(members, rngs)]
  return decode_members(
    pure, src, settings, max_lengths=max_lengths, src_table=src_table
  )


def ensemble_generate_corpus(
  members: Sequence[Seq2Seq],
  sources: Iterable,
  settings: DecodeSettings,
  *,
  src_capacity: int,
  slots: int,
  max_length_fn: Callable[[np.ndarray], int] | None = None,
  refill: int | None = None,
  chunk: int = 4,
  stats: dict | None = None,
  rngs: None = None,
) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
  """Decodes a corpus with an ensemble of encoder-decoders and continuous
  refill: the NNX twin of `jaxlod.nn.ensemble_generate_corpus`, with the
  members given as `Seq2Seq` modules (`rngs` as in `ensemble_generate`)."""
  rebuild, states, vocab = corpus_members(members, rngs)
  return decode_members_corpus(
    rebuild,
    states,
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
  """An ensemble's graph definitions, hashable: ``Members(graphdefs)(
  states)`` merges each with its state as a `Member`."""

  graphdefs: tuple[Any, ...]

  def __call__(self, states: tuple) -> list[Member]:
    return [
      nnx.merge(graphdef, state).member()
      for graphdef, state in zip(self.graphdefs, states, strict=True)
    ]


def corpus_members(members: Any, rngs: None) -> tuple[Members, tuple, int]:
  """An ensemble's checked `Seq2Seq` members as `decode_members_corpus` takes them:
  ``(Members(graphdefs), states, src_vocab)``, with the states' arrays as
  they are at the call, the twin of
  `jaxlod.nn._seq2seq.corpus_members`.

  Raises:
    TypeError, ValueError: as `ensemble_generate`, and for members with
      different ``src_vocab``.
  """
  members = _ensemble(members, rngs)
  vocab = check_vocabs([model.src_vocab for model in members], "src_vocab")
  graphdefs, states = zip(*(nnx.split(model) for model in members), strict=True)
  # `nnx.split` hands out the models' own variables, which an optimizer step
  # after the call updates in place; the iterator reads its states lazily, so
  # it takes new variables holding the arrays of the call.
  states = tuple(jax.tree.map(lambda leaf: leaf, state) for state in states)
  return Members(graphdefs), states, vocab


def _ensemble(members: Any, rngs: Any) -> list[Seq2Seq]:
  """An ensemble's checked members (`rngs` must be `None`)."""
  if rngs is not None:
    raise ValueError(
      "Expected `rngs` to be None: NNX members draw from the nnx.Rngs they "
      "were built with (`rngs` is for the Linen twin, jaxlod.nn.ensemble_generate)."
    )
  members = _checks.check_sequence(members, "members", "a sequence of Seq2Seq")
  for k, model in enumerate(members):
    if not isinstance(model, Seq2Seq):
      raise TypeError(
        f"Expected `members[{k}]` to be a Seq2Seq, got {type(model).__name__}."
      )
  check_vocabs([model.tgt_vocab for model in members])
  return list(members)
