"""Linen encoder-decoders over LoDTensors: AttentionDecoder and Seq2Seq.

The decoder is a `dynamic_rnn` whose step attends over the encoder's outputs,
a static input: the loop reorders them by rank once and shrinks them to each
phase's batch, and with ``remat`` the backward pass recomputes each step's
attention from the saved carries, so nothing of size ``target x source`` is
kept (old PaddlePaddle expanded the decoder states to every source position).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxlod._lod import LoDTensor, is_concrete
from jaxlod.nn._attention import check_memory_lod
from jaxlod.nn._rnn import _zero_padding
from jaxlod.ops._decode import Hypotheses, beam_search, greedy_decode
from jaxlod.ops._pool import sequence_pool
from jaxlod.ops._rank import RankTable
from jaxlod.ops._rnn import dynamic_rnn
from jaxlod.ops._segment import check_integer, check_lod


def _check_vectors(x: LoDTensor, name: str, doc: str) -> None:
  if len(x.feature_shape) != 1:
    raise ValueError(
      f"Expected `{name}.values` to have shape {doc}, got {tuple(x.values.shape)}."
    )


def _check_memory(memory: Any, tgt: LoDTensor) -> LoDTensor:
  """`memory` must hold one sequence per `tgt` sequence, as vectors."""
  memory = check_memory_lod(check_lod(memory, "memory"))
  count, wanted = memory.capacity.sequences[0], tgt.capacity.sequences[-1]
  if count != wanted:
    raise ValueError(
      f"Expected `memory` to hold one sequence per `tgt` sequence: memory count "
      f"capacity {count}, tgt count capacity {wanted}."
    )
  real, real_tgt = memory.num_sequences(0), tgt.num_sequences(-1)
  if is_concrete(real, real_tgt):
    if int(real) != int(real_tgt):
      raise ValueError(
        f"Expected `memory` to hold one sequence per `tgt` sequence: memory has "
        f"{int(real)} sequences, tgt has {int(real_tgt)}."
      )
  else:
    checkify.debug_check(
      real == real_tgt,
      "AttentionDecoder: `memory` and `tgt` have different numbers of sequences.",
    )
  return memory


def _embed(embed: nn.Module, ids: Any, name: str) -> LoDTensor:
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
  return _zero_padding(ids, embed(values))


def _pure_method(module: nn.Module, method: str, *example: Any) -> Callable:
  """A bound module's `method` as a pure function over its variables.

  While initializing, the method is called once on `example` so that the
  parameters exist. The returned function applies an unbound copy, so
  `dynamic_rnn` can trace it inside its loop and send gradients to the
  parameters (as `cell_step` does for a cell).
  """
  if module.is_initializing():
    getattr(module, method)(*example)
  variables = module.variables
  unbound = module.clone(parent=None)

  def apply(*args):
    return unbound.apply(variables, *args, method=method)

  return apply


def _check_search(method: str, bos_id: Any, eos_id: Any, tgt_vocab: int) -> None:
  """Eager checks of `generate`'s decoding method and special ids."""
  if method not in ("beam", "greedy"):
    raise ValueError(f'Expected `method` to be "beam" or "greedy", got {method!r}.')
  for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
    # `nn.Embed` would give NaN rows for an id past the table, silently.
    if isinstance(value, int | np.integer) and not 0 <= value < tgt_vocab:
      raise ValueError(
        f"Expected `{name}` in [0, {tgt_vocab}) (`tgt_vocab`), got {value}."
      )


def _search(
  steps: Sequence[Callable],
  carries: Sequence[Any],
  statics: Sequence[tuple[LoDTensor, LoDTensor | None]],
  method: str,
  *,
  beam_size: int,
  length_penalty: float,
  num_results: int | None,
  **common: Any,
) -> Hypotheses:
  """Beam search or greedy decoding over the mean of the members' next-token
  log-probabilities.

  Member ``k`` has the pure decode step ``steps[k]`` (`Seq2Seq.decode_step`
  over its variables), starting carry ``carries[k]`` and external memory
  ``statics[k] = (encoder outputs, attention keys or None)``. One member
  decodes with its own log-probabilities (no averaging in the step).
  """

  def member(step, carry, tokens, static):
    (memory, lengths), keys = static
    keys = None if keys is None else keys[0]
    carry, logits, _ = step(carry, tokens, memory, lengths, keys)
    return carry, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

  if len(steps) == 1:
    step_fn = functools.partial(member, steps[0])
    carry, static = carries[0], statics[0]
  else:

    def step_fn(carry, tokens, static):
      out = [
        member(*args, tokens, s)
        for args, s in zip(zip(steps, carry, strict=True), static, strict=True)
      ]
      return tuple(c for c, _ in out), jnp.mean(jnp.stack([lp for _, lp in out]), 0)

    carry, static = tuple(carries), tuple(statics)
  common = dict(common, static_inputs=static)
  if method == "greedy":
    return greedy_decode(step_fn, carry, **common)
  return beam_search(
    step_fn,
    carry,
    beam_size=beam_size,
    length_penalty=length_penalty,
    num_results=num_results,
    **common,
  )


class AttentionDecoder(nn.Module):
  """A recurrent decoder attending over a LoD memory at every step.

  A `dynamic_rnn` over the target sequences whose step reads the encoder's
  outputs (the memory, one sequence per target sequence) as a static input,
  reordered by rank and shrunk to each phase's batch. One step (`step`):

  * ``x = concat(x_t, prev_context)`` with `input_feeding`, else ``x_t``;
  * ``carry, h = cell(carry, x)``;
  * ``context, weights = attention(h, memory, lengths[, keys])``;
  * ``y_t = concat(h, context)``.

  An attention with a ``keys(memory)`` method (`AdditiveAttention`) gets its
  keys computed once per source, on the packed memory rows, outside the loop
  (`precompute`), and passed to each step as ``keys=``.

  Parameters live under ``cell`` (the same tree as ``flax.linen.RNN(cell)``)
  and ``attention``.

  Attributes:
    cell: a Flax recurrent cell (see `DynamicRNN`).
    attention: an attention module ``attention(query [b, hidden], memory
      [b, source_capacity, features], lengths [b]) -> (context [b,
      features], weights [b, source_capacity])``, e.g. `DotAttention`,
      `GeneralAttention`, `AdditiveAttention` or `CosineAttention`.
    input_feeding: feed the previous context into the cell with the input
      (Luong's input feeding); the carry is then ``(cell_carry,
      prev_context [b, features])`` with a zero first context.
    remat: recompute each step in the backward pass, saving only the carries
      (default). Otherwise every step's attention residuals (``[b,
      source_capacity, units]`` for additive attention) are stored, which is
      the target x source expansion this decoder avoids.
    ladder: static batch sizes of the loop's phases (see `rank_table`);
      `None`: the target rank table's, by default `default_ladder`.

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

  @nn.nowrap
  def _zero_cell_carry(self, memory: LoDTensor, input_features: int) -> Any:
    """``cell.initialize_carry`` for the step input ``[count, x width]``."""
    width = input_features + (memory.feature_shape[-1] if self.input_feeding else 0)
    shape = (memory.capacity.sequences[0], width)
    return self.cell.initialize_carry(jax.random.key(0), shape)

  def precompute(self, memory: LoDTensor) -> LoDTensor | None:
    """What the attention computes once per source: its keys, or `None`.

    Args:
      memory: a one-level LoDTensor ``values [src_token_capacity, features]``.

    Returns:
      ``attention.keys(memory)`` as a LoDTensor with `memory`'s LoD (values
      ``[src_token_capacity, units]``) when the attention has a ``keys``
      method, else `None`. Pass it, padded, as ``keys`` to `step`.
    """
    keys = getattr(self.attention, "keys", None)
    if keys is None:
      return None
    return memory.with_values(keys(memory.values))

  def initial_state(
    self, memory: LoDTensor, input_features: int, initial_carry: Any = None
  ) -> Any:
    """The carry `step` starts from, one row per memory sequence.

    Args:
      memory: a one-level LoDTensor ``values [src_token_capacity,
        features]``.
      input_features: width of ``x_t`` (the target rows, before input
        feeding adds the context); sets the input shape given to
        ``cell.initialize_carry``.
      initial_carry: the cell's carry, leaves ``[count_capacity, ...]`` in
        `memory`'s order; by default ``cell.initialize_carry(key(0),
        (count_capacity, step input width))``.

    Returns:
      `initial_carry` (or the default), paired with a zero context
      ``[count_capacity, features]`` when `input_feeding`.
    """
    memory = check_memory_lod(check_lod(memory, "memory"))
    if initial_carry is None:
      initial_carry = self._zero_cell_carry(memory, input_features)
    if not self.input_feeding:
      return initial_carry
    shape = (memory.capacity.sequences[0], memory.feature_shape[-1])
    return initial_carry, jnp.zeros(shape, memory.values.dtype)

  def step(
    self,
    carry: Any,
    x_t: jax.typing.ArrayLike,
    memory: jax.typing.ArrayLike,
    lengths: jax.typing.ArrayLike,
    keys: jax.typing.ArrayLike | None = None,
  ) -> tuple[Any, jax.Array, jax.Array]:
    """One decoder step over a batch of rows, for decoding loops.

    Call it with ``decoder.apply(variables, carry, x_t, memory, lengths,
    keys, method="step")``; the batch ``b`` is any number of rows (e.g.
    live hypotheses), each with its own memory row.

    Args:
      carry: the carry, leaves ``[b, ...]`` (see `initial_state`).
      x_t: ``[b, input_features]`` this step's inputs.
      memory: ``[b, source_capacity, features]`` padded memory.
      lengths: ``[b]`` int real memory lengths.
      keys: ``[b, source_capacity, units]`` the padded `precompute` result,
        or `None`.

    Returns:
      ``(carry, y_t [b, hidden + features], weights [b, source_capacity])``
      where ``y_t = concat(h_t, context_t)``.
    """
    x_t = jnp.asarray(x_t)
    if self.input_feeding:
      carry, fed = carry
      x_t = jnp.concatenate([x_t, fed.astype(x_t.dtype)], axis=-1)
    carry, h = self.cell(carry, x_t)
    if keys is None:
      context, weights = self.attention(h, memory, lengths)
    else:
      context, weights = self.attention(h, memory, lengths, keys=keys)
    y = jnp.concatenate([h, context.astype(h.dtype)], axis=-1)
    if self.input_feeding:
      carry = (carry, context.astype(fed.dtype))
    return carry, y, weights

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
        vectors, or widths the attention rejects; from `dynamic_rnn`, for a
        `table` of other lengths or whose ladder is not `ladder`.
    """
    tgt = check_lod(tgt, "tgt")
    _check_vectors(tgt, "tgt", "[token_capacity, input_features]")
    memory = _check_memory(memory, tgt)
    keys = self.precompute(memory)
    carry = self.initial_state(memory, tgt.feature_shape[-1], initial_carry)
    example = ()
    if self.is_initializing():
      padded, lengths = memory.to_padded()
      padded_keys = None if keys is None else keys.to_padded()[0][:1]
      first = jax.tree.map(lambda a: a[:1], carry)
      example = (first, tgt.values[:1], padded[:1], lengths[:1], padded_keys)
    step = _pure_method(self, "step", *example)

    def step_fn(carry, x_t, static):
      (memory, lengths), keys = static
      keys = None if keys is None else keys[0]
      carry, y, weights = step(carry, x_t, memory, lengths, keys)
      return carry, ((y, weights) if return_weights else y)

    outputs, _ = dynamic_rnn(
      step_fn,
      tgt,
      init_carry=carry,
      static_inputs=(memory, keys),
      table=table,
      ladder=self.ladder,
      remat=self.remat,
    )
    return outputs


class _CarryBridge(nn.Module):
  """``tanh(Dense(pooled))`` per carry leaf, shaped like `template`'s leaves."""

  @nn.compact
  def __call__(self, pooled: jax.Array, template: Any) -> Any:
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

  `generate` decodes sources with `jaxlod.ops.beam_search` or
  `jaxlod.ops.greedy_decode`, and `jaxlod.nn.ensemble_generate` with several
  models at once. For other decoding loops: `encode`,
  `initial_state`, `precompute` and `decode_step` (one step from token ids
  to logits), each through ``model.apply(variables, ..., method=...)``.

  Attributes:
    src_vocab: number of source token ids.
    tgt_vocab: number of target token ids.
    embed_dim: width of both embeddings.
    encoder: a module ``LoDTensor [src_tokens, embed_dim] -> LoDTensor
      [src_tokens, features]`` keeping the LoD (e.g. `DynamicRNN`).
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
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"Expected `dropout` in [0, 1), got {self.dropout}.")
    self.drop = nn.Dropout(self.dropout, deterministic=self.deterministic)
    self.src_embed = nn.Embed(self.src_vocab, self.embed_dim)
    self.tgt_embed = nn.Embed(self.tgt_vocab, self.embed_dim)
    if self.bridge:
      self.carry_bridge = _CarryBridge()
    self.output = nn.Dense(self.tgt_vocab)

  def encode(self, src: LoDTensor, table: RankTable | None = None) -> LoDTensor:
    """The encoder's outputs over the embedded source: the decoder's memory.

    Args:
      src: a LoDTensor of int ids, values ``[src_token_capacity]`` or
        ``[src_token_capacity, 1]``.
      table: `src`'s rank table (e.g. built on the host by `jaxlod.data`),
        given to the encoder as ``table=``; `None`: not passed, the encoder
        builds its own (an encoder given one must take ``table=``, as
        `DynamicRNN` and `Bidirectional` do).

    Returns:
      A LoDTensor with `src`'s LoD, values ``[src_token_capacity,
      features]``.
    """
    # Only a given table is passed on: an encoder need not take one.
    extra = {} if table is None else {"table": table}
    memory = self.encoder(_embed(self.src_embed, src, "src"), **extra)
    if not isinstance(memory, LoDTensor):
      raise TypeError(
        f"Expected `encoder` to return a LoDTensor, got {type(memory).__name__}."
      )
    return memory

  def _cell_carry(self, memory: LoDTensor) -> Any:
    """The bridged initial cell carry, or `None` (the cell's zeros)."""
    if not self.bridge:
      return None
    pooled = sequence_pool(check_memory_lod(memory), "average")
    template = self.decoder._zero_cell_carry(memory, self.embed_dim)
    return self.carry_bridge(pooled, template)

  def initial_state(self, memory: LoDTensor) -> Any:
    """The decoder's starting carry for `memory` (bridged or zeros).

    Args:
      memory: `encode`'s result, values ``[src_token_capacity, features]``.

    Returns:
      The carry of `decode_step`, leaves ``[count_capacity, ...]`` in
      `memory`'s order (see `AttentionDecoder.initial_state`).
    """
    return self.decoder.initial_state(memory, self.embed_dim, self._cell_carry(memory))

  def precompute(self, memory: LoDTensor) -> LoDTensor | None:
    """The attention's keys of `memory`, or `None` (see
    `AttentionDecoder.precompute`)."""
    return self.decoder.precompute(memory)

  def decode_step(
    self,
    carry: Any,
    tokens: jax.typing.ArrayLike,
    memory: jax.typing.ArrayLike,
    lengths: jax.typing.ArrayLike,
    keys: jax.typing.ArrayLike | None = None,
  ) -> tuple[Any, jax.Array, jax.Array]:
    """One decoding step from token ids to next-token logits.

    Args:
      carry: the decoder carry, leaves ``[b, ...]``.
      tokens: ``[b]`` int ids of the previous tokens.
      memory: ``[b, source_capacity, features]`` padded `encode` result.
      lengths: ``[b]`` int real source lengths.
      keys: ``[b, source_capacity, units]`` padded `precompute` result, or
        `None`.

    Returns:
      ``(carry, logits [b, tgt_vocab], weights [b, source_capacity])``.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 1:
      raise ValueError(f"Expected `tokens` to have shape [b], got {tokens.shape}.")
    check_integer(tokens.dtype, "tokens")
    carry, y, weights = self.decoder.step(
      carry, self.tgt_embed(tokens), memory, lengths, keys
    )
    return carry, self.output(y), weights

  def generate(
    self,
    src: LoDTensor,
    method: str = "beam",
    *,
    bos_id: int,
    eos_id: int,
    max_length: int | jax.typing.ArrayLike,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    num_results: int | None = None,
    length_capacity: int | None = None,
    ladder: Any = None,
    compact: bool = True,
    src_table: RankTable | None = None,
  ) -> Hypotheses:
    """Decodes every source: beam search or greedy, each source stopping early.

    The encoder's outputs (and the attention's keys) are a static input of
    the decoder step, the external memory; each step maps the previous
    tokens to ``log_softmax`` of the logits. Call it on bound variables:
    ``model.apply(variables, src, "beam", method="generate", bos_id=...,
    ...)`` (`method` is positional there: `apply` has its own).

    Args:
      src: a LoDTensor of int source ids, values ``[src_token_capacity]``
        or ``[src_token_capacity, 1]``; its padding sequences get no
        hypotheses.
      method: ``"beam"`` (`jaxlod.ops.beam_search`) or ``"greedy"``
        (`jaxlod.ops.greedy_decode`).
      bos_id, eos_id, max_length, length_capacity, ladder, compact: see
        `jaxlod.ops.beam_search`.
      beam_size, length_penalty, num_results: beam search only (greedy
        decoding keeps one hypothesis scored by its summed
        log-probability).
      src_table: `src`'s rank table for the encoder (see `encode`); `None`:
        the encoder builds its own. The decoding loop's phases are set by
        `ladder`.

    Returns:
      `jaxlod.ops.Hypotheses` in `src`'s order: token ids as a 2-level
      LoDTensor (source -> hypotheses -> tokens, `eos` excluded) and one
      score per hypothesis.

    Raises:
      ValueError: for an unknown `method`, `bos_id` or `eos_id` outside
        ``[0, tgt_vocab)``, and as `beam_search` does.
    """
    _check_search(method, bos_id, eos_id, self.tgt_vocab)
    if self.is_initializing():
      raise ValueError(
        "Seq2Seq.generate needs parameters: initialize the model with `init` on "
        "(src, tgt_in), then call `apply(variables, src, method='generate', ...)`."
      )
    memory = self.encode(src, src_table)
    return _search(
      [_pure_method(self, "decode_step")],
      [self.initial_state(memory)],
      [(memory, self.precompute(memory))],
      method,
      bos_id=bos_id,
      eos_id=eos_id,
      max_length=max_length,
      beam_size=beam_size,
      length_penalty=length_penalty,
      num_results=num_results,
      length_capacity=length_capacity,
      ladder=ladder,
      compact=compact,
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
    memory = self.encode(src, src_table)
    tgt = _embed(self.tgt_embed, tgt_in, "tgt_in")
    # Dropout keeps zero padding rows at zero.
    tgt = tgt.with_values(self.drop(tgt.values))
    outputs = self.decoder(
      tgt,
      memory,
      self._cell_carry(memory),
      return_weights=return_weights,
      table=tgt_table,
    )
    weights = None
    if return_weights:
      outputs, weights = outputs
    logits = _zero_padding(outputs, self.output(self.drop(outputs.values)))
    return logits if weights is None else (logits, weights)


def ensemble_generate(
  members: Sequence[tuple[Seq2Seq, Any]],
  src: LoDTensor,
  method: str = "beam",
  *,
  bos_id: int,
  eos_id: int,
  max_length: int | jax.typing.ArrayLike,
  beam_size: int = 4,
  length_penalty: float = 0.6,
  num_results: int | None = None,
  length_capacity: int | None = None,
  ladder: Any = None,
  compact: bool = True,
  src_table: RankTable | None = None,
) -> Hypotheses:
  """Decodes every source with an ensemble of encoder-decoders.

  Each step scores the next token by the mean of the members'
  ``log_softmax`` outputs; every member encodes the source once and keeps
  its own decoder carry over the same hypotheses. The members may differ in
  architecture (widths, layers, attention) but share the target vocabulary.
  One member decodes as ``model.apply(variables, src, method="generate",
  ...)`` does. Works under `jax.jit` with the variables as traced
  arguments.

  Args:
    members: ``(model, variables)`` pairs, each model an unbound `Seq2Seq`
      and its variables (e.g. from ``model.init``).
    src: a LoDTensor of int source ids, values ``[src_token_capacity]`` or
      ``[src_token_capacity, 1]``, in every member's source vocabulary.
    method, bos_id, eos_id, max_length, beam_size, length_penalty,
      num_results, length_capacity, ladder, compact, src_table: as in
      `Seq2Seq.generate`.

  Returns:
    `jaxlod.ops.Hypotheses` in `src`'s order, scored by the mean
    log-probabilities (length-penalized for beam search).

  Raises:
    TypeError: for a member that is not a ``(Seq2Seq, variables)`` pair.
    ValueError: for no members, members with different ``tgt_vocab``, and
      as `Seq2Seq.generate` does.

  Example:
    >>> import numpy as np, jax, flax.linen as nn
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import (
    ...   AttentionDecoder, DotAttention, DynamicRNN, Seq2Seq, ensemble_generate)
    >>> def model(width):
    ...   return Seq2Seq(
    ...     src_vocab=8, tgt_vocab=9, embed_dim=5,
    ...     encoder=DynamicRNN(nn.LSTMCell(width)),
    ...     decoder=AttentionDecoder(nn.LSTMCell(width), DotAttention()))
    >>> src = LoDTensor.from_sequences([np.array([3, 1, 4]), np.array([1, 5])])
    >>> tgt_in = LoDTensor.from_sequences([np.array([0, 2]), np.array([0, 6])])
    >>> members = [(model(w), model(w).init(jax.random.key(w), src, tgt_in))
    ...            for w in (4, 6)]
    >>> hyps = ensemble_generate(members, src, bos_id=0, eos_id=1, max_length=4,
    ...                          beam_size=2, num_results=2)
    >>> [len(h) for h in hyps.ids.to_list()]
    [2, 2]
  """
  members = list(members)
  if not members:
    raise ValueError("Expected at least one `(model, variables)` member, got none.")
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
  vocabs = [model.tgt_vocab for model, _ in members]
  if len(set(vocabs)) != 1:
    raise ValueError(
      f"Expected the members to share `tgt_vocab`, got {vocabs} (member order)."
    )
  _check_search(method, bos_id, eos_id, vocabs[0])
  steps, carries, statics = [], [], []
  for model, variables in members:
    memory = model.apply(variables, src, src_table, method="encode")
    steps.append(functools.partial(model.apply, variables, method="decode_step"))
    carries.append(model.apply(variables, memory, method="initial_state"))
    statics.append((memory, model.apply(variables, memory, method="precompute")))
  return _search(
    steps,
    carries,
    statics,
    method,
    bos_id=bos_id,
    eos_id=eos_id,
    max_length=max_length,
    beam_size=beam_size,
    length_penalty=length_penalty,
    num_results=num_results,
    length_capacity=length_capacity,
    ladder=ladder,
    compact=compact,
  )
