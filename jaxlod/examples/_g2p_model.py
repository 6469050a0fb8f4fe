"""The G2P example's model, presets, training step and beam-search decoder.

A bidirectional LSTM reads the letters; an LSTM decoder with additive
attention over its outputs writes the phonemes (`jaxlod.nn.Seq2Seq`). The
jitted functions are cached per setting, so a run and its resumption in
one process (the tests) compile once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlod import Buckets, LoDTensor
from jaxlod.nn import (
  AdditiveAttention,
  AttentionDecoder,
  Bidirectional,
  DynamicRNN,
  Seq2Seq,
  ensemble_generate,
)
from jaxlod.parallel import data_parallel, generate, shard_batch

# Ids of the target vocabulary's markers (see `_g2p_data.phone_vocab`).
BOS_ID, EOS_ID = 0, 1
NUM_LETTERS = 26
# Longest CMUdict word kept (28 letters) and pronunciation plus `</s>` (29).
TIME_CAPACITY = 32
# A hypothesis may hold its word's letter count plus this many tokens: the
# largest excess of phonemes over letters in CMUdict is 12 ("fyi", 15
# phonemes), plus one for `</s>`.
LENGTH_MARGIN = 13
# The beam search's length penalty (`Seq2Seq.generate`'s default).
LENGTH_PENALTY = 0.6


@dataclasses.dataclass(frozen=True)
class Config:
  """Settings of a run; `MODEL_FIELDS` must match to resume a checkpoint.

  Attributes:
    stress: keep the vowels' stress digits (69 phonemes instead of 39).
    embed_dim: width of the letter and phoneme embeddings.
    hidden: LSTM width of each encoder direction and of the decoder.
    attention_units: width of the additive attention's scoring layer.
    encoder_layers: stacked bidirectional LSTM layers.
    dropout: dropout rate on the encoder's inputs, between its layers and on
      its outputs (0 disables it).
    decoder_dropout: dropout rate on the target embeddings and the decoder's
      outputs (`jaxlod.nn.Seq2Seq`'s ``dropout``; 0 disables it).
    label_smoothing: the training loss's target puts this much probability
      evenly over all phonemes (0: the one-hot target).
    ema_decay: after each step, ``ema = ema_decay * ema + (1 - ema_decay) *
      params``, from the initial parameters; the evaluations decode with
      ``ema`` (0: no average, they decode with the parameters).
    members: models trained one after another, member ``k`` with seed
      ``seed + k`` (`member_config`); the final scores decode with all of
      them, beam search over the mean of their log-probabilities.
    max_words: keep only this many words of the lexicon, evenly spaced in
      sorted order (`None`: all of them).
    batch_words: the most words in a training batch (count capacity).
    loop_sizes: static batch sizes of the training step's recurrent loops
      (the ladder of `jaxlod.ops.rank_table`): `batch_words` halved
      ``loop_sizes - 1`` times. A batch holds words of similar lengths, so
      few sizes waste little, and each size is one more loop to compile.
    batch_tokens: token capacity of each field of a training batch; a batch
      of long words holds fewer than `batch_words` words.
    steps: training steps in all (a resumed run continues to this count).
    learning_rate: peak Adam learning rate.
    warmup_steps: linear warm-up from 0 to the peak.
    final_lr_fraction: the cosine decay ends at this fraction of the peak.
    clip_norm: gradient clipping by global norm.
    eval_every: steps between dev evaluations and checkpoints.
    dev_words: dev words scored at each periodic evaluation (evenly spaced
      in sorted order; `None`: all). The final table uses every word.
    beam: beam size of the evaluations.
    decode_words: the most words in a decoding batch (count capacity).
    seed: initialization, dropout and batch order.
  """

  stress: bool = False
  embed_dim: int = 64
  hidden: int = 128
  attention_units: int = 128
  encoder_layers: int = 1
  dropout: float = 0.0
  decoder_dropout: float = 0.0
  label_smoothing: float = 0.0
  ema_decay: float = 0.0
  members: int = 1
  max_words: int | None = None
  batch_words: int = 64
  loop_sizes: int = 4
  batch_tokens: int = 640
  steps: int = 5000
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  final_lr_fraction: float = 0.02
  clip_norm: float = 5.0
  eval_every: int = 1000
  dev_words: int | None = None
  beam: int = 4
  decode_words: int = 128
  seed: int = 0


# The fields a checkpoint's parameters and batch order depend on.
MODEL_FIELDS = (
  "stress",
  "embed_dim",
  "hidden",
  "attention_units",
  "encoder_layers",
  "ema_decay",
  "max_words",
  "batch_words",
  "batch_tokens",
  "seed",
)

PRESETS = {
  # A few hundred words, a dozen steps, a small model (the tests): the run is
  # mostly compilation. Both dropouts, label smoothing and the average are on,
  # so the tests take every path of the training step.
  "tiny": Config(
    dropout=0.1,
    decoder_dropout=0.1,
    label_smoothing=0.1,
    ema_decay=0.9,
    embed_dim=8,
    hidden=16,
    attention_units=16,
    max_words=400,
    batch_words=4,
    batch_tokens=48,
    steps=12,
    warmup_steps=2,
    eval_every=6,
    beam=2,
    decode_words=8,
  ),
  # About 4 minutes on 2 CPU cores, data to table: 2.8 epochs of the 1,759
  # batches of the train split.
  "default": Config(),
  # The best quality the model reaches: wider, two encoder layers, dropout in
  # the encoder and the decoder, label smoothing, 23 epochs, and an ensemble
  # of two such models (seeds 0 and 1): one model alone scored test WER
  # 25.82% and 25.54%, the two together 24.81%.
  "full": Config(
    embed_dim=128,
    hidden=384,
    attention_units=384,
    encoder_layers=2,
    dropout=0.3,
    decoder_dropout=0.3,
    label_smoothing=0.1,
    steps=40000,
    learning_rate=2e-3,
    warmup_steps=500,
    eval_every=2000,
    members=2,
  ),
}


class Encoder(nn.Module):
  """Stacked bidirectional LSTMs over a LoDTensor, with dropout on the rows.

  Dropout (rate `dropout`, the ``'dropout'`` rng) hits the inputs, the rows
  between layers and the outputs; zero padding rows stay zero.

  Attributes:
    hidden: LSTM width of each direction (outputs are ``2 * hidden`` wide).
    layers: number of bidirectional layers.
    dropout: the dropout rate.
    deterministic: no dropout (evaluation).
    ladder: the loops' static batch sizes (`jaxlod.nn.DynamicRNN`).
  """

  hidden: int
  layers: int = 1
  dropout: float = 0.0
  deterministic: bool = True
  ladder: tuple[int, ...] | None = None

  @nn.compact
  def __call__(self, x: LoDTensor) -> LoDTensor:
    """Encodes `x` (values ``[tokens, features]``) to ``[tokens, 2 * hidden]``."""
    drop = nn.Dropout(self.dropout, deterministic=self.deterministic)
    for i in range(self.layers):
      x = x.with_values(drop(x.values))
      x = Bidirectional(
        DynamicRNN(nn.LSTMCell(self.hidden), ladder=self.ladder),
        DynamicRNN(nn.LSTMCell(self.hidden), ladder=self.ladder),
        name=f"layer_{i}",
      )(x)
    return x.with_values(drop(x.values))


def build_model(
  config: Config,
  num_phones: int,
  train: bool = False,
  ladder: tuple[int, ...] | None = None,
) -> Seq2Seq:
  """The model of `config`; `train` turns dropout on (same parameters).

  `ladder` sets the static batch sizes of the encoder's and the
  teacher-forced decoder's loops (`training_ladder`); `None`: each batch's
  default. The parameters do not depend on it.
  """
  return Seq2Seq(
    dropout=config.decoder_dropout,
    deterministic=not train,
    src_vocab=NUM_LETTERS,
    tgt_vocab=num_phones,
    embed_dim=config.embed_dim,
    encoder=Encoder(
      config.hidden,
      config.encoder_layers,
      config.dropout,
      deterministic=not train,
      ladder=ladder,
    ),
    decoder=AttentionDecoder(
      nn.LSTMCell(config.hidden),
      AdditiveAttention(config.attention_units),
      ladder=ladder,
    ),
  )


def training_ladder(config: Config) -> tuple[int, ...]:
  """The training step's ladder: `batch_words` halved ``loop_sizes - 1`` times.

  Raises:
    ValueError: for `loop_sizes` below 1.
  """
  if config.loop_sizes < 1:
    raise ValueError(f"Expected `loop_sizes` of at least 1, got {config.loop_sizes}.")
  sizes = {max(config.batch_words >> k, 1) for k in range(config.loop_sizes)}
  return tuple(sorted(sizes, reverse=True))


def batch_buckets(words: int, tokens: int | None = None) -> Buckets:
  """Fixed capacities of one field of a batch (default: 10 tokens a word)."""
  tokens = 10 * words if tokens is None else tokens
  return Buckets.fixed(tokens=tokens, sequences=words, time=TIME_CAPACITY)


def learning_rate(config: Config, step: int) -> float:
  """Linear warm-up, then cosine decay to ``final_lr_fraction`` of the peak."""
  peak = config.learning_rate
  if step < config.warmup_steps:
    return peak * (step + 1) / config.warmup_steps
  span = max(config.steps - config.warmup_steps, 1)
  progress = min((step - config.warmup_steps) / span, 1.0)
  floor = config.final_lr_fraction
  return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class Averaged(NamedTuple):
  """The training state's second part with `Config.ema_decay`.

  Attributes:
    inner: the optimizer's state (`optimizer`).
    ema: the moving average of the parameters (their tree).
  """

  inner: optax.OptState
  ema: Any


def eval_params(config: Config, params: Any, opt_state: Any) -> Any:
  """The parameters to decode with: the average with `config.ema_decay`
  (``opt_state.ema``), else `params`."""
  return opt_state.ema if config.ema_decay else params


def member_config(config: Config, k: int) -> Config:
  """The one-model config of member `k` of `config`'s ensemble: seed
  ``seed + k``; a run of it is that member's training.

  Raises:
    ValueError: for `k` outside ``[0, members)``.
  """
  if not 0 <= k < config.members:
    raise ValueError(f"Expected a member in [0, {config.members}), got {k}.")
  return dataclasses.replace(config, seed=config.seed + k, members=1)


def optimizer(config: Config) -> optax.GradientTransformation:
  """Clipping and Adam's scaling; the step multiplies by ``-learning_rate``."""
  return optax.chain(optax.clip_by_global_norm(config.clip_norm), optax.scale_by_adam())


def token_loss(
  logits: LoDTensor, targets: LoDTensor, label_smoothing: float = 0.0
) -> jax.Array:
  """Mean cross-entropy over the real target tokens: `token_loss_sum` over
  the count (at least 1)."""
  total, count = token_loss_sum(logits, targets, label_smoothing)
  return total / jnp.maximum(count, 1)


def token_loss_sum(
  logits: LoDTensor, targets: LoDTensor, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array]:
  """Summed cross-entropy over the real target tokens, and their number.

  Args:
    logits: values ``[token_capacity, vocab]``, the teacher-forced logits.
    targets: int values ``[token_capacity]`` with the LoD of `logits`.
    label_smoothing: the target distribution is ``1 - label_smoothing`` on
      the label plus ``label_smoothing / vocab`` on every id.

  Returns:
    ``(total, count)``: a float32 scalar, the summed cross-entropy of the
    real rows (padding rows count for nothing), and their int32 number.
  """
  values = logits.values.astype(jnp.float32)
  if label_smoothing:
    labels = jax.nn.one_hot(targets.values, values.shape[-1], dtype=jnp.float32)
    labels = optax.smooth_labels(labels, label_smoothing)
    loss = optax.softmax_cross_entropy(values, labels)
  else:
    loss = optax.softmax_cross_entropy_with_integer_labels(values, targets.values)
  real = jnp.arange(targets.capacity.tokens) < targets.num_rows
  return jnp.sum(jnp.where(real, loss, 0.0)), targets.num_rows


# The settings the compiled functions depend on.
_COMPILED_FIELDS = (
  "batch_words",
  "loop_sizes",
  "embed_dim",
  "hidden",
  "attention_units",
  "encoder_layers",
  "dropout",
  "decoder_dropout",
  "label_smoothing",
  "ema_decay",
  "clip_norm",
)


def _compiled_key(config: Config) -> tuple:
  """A cache key: ``(name, value)`` of the `_COMPILED_FIELDS`."""
  return tuple((name, getattr(config, name)) for name in _COMPILED_FIELDS)


@functools.lru_cache(maxsize=8)
def _init(key: tuple, num_phones: int) -> Callable:
  config = Config(**dict(key))
  model = build_model(config, num_phones)
  buckets = batch_buckets(2, 2 * TIME_CAPACITY)
  src = LoDTensor.from_sequences([[0, 1], [2]], buckets=buckets)
  tgt = LoDTensor.from_sequences([[BOS_ID, 2], [BOS_ID]], buckets=buckets)

  @jax.jit
  def init(rng):
    params = model.init(rng, src, tgt)
    opt_state = optimizer(config).init(params)
    if config.ema_decay:
      opt_state = Averaged(opt_state, params)
    return params, opt_state

  return init


def init_state(config: Config, num_phones: int, abstract: bool = False) -> tuple:
  """Initial ``(params, opt_state)`` from `config.seed`.

  `opt_state` is the optimizer's state, or with `config.ema_decay` an
  `Averaged` of it and the average (the initial parameters). With
  `abstract`, their shapes and dtypes only (``jax.ShapeDtypeStruct``
  leaves, nothing compiled or computed): a template to restore into.

  Raises:
    ValueError: for `ema_decay` outside ``[0, 1)``.
  """
  if not 0.0 <= config.ema_decay < 1.0:
    raise ValueError(f"Expected `ema_decay` in [0, 1), got {config.ema_decay}.")
  init = _init(_compiled_key(config), num_phones)
  rng = jax.random.key(config.seed)
  return jax.eval_shape(init, rng) if abstract else init(rng)


@functools.lru_cache(maxsize=8)
def _train_step(key: tuple, num_phones: int) -> Callable:
  config = Config(**dict(key))
  model = build_model(config, num_phones, train=True, ladder=training_ladder(config))
  tx = optimizer(config)

  def loss_fn(params, rng, src, tgt_in, tgt_out):
    logits = model.apply(params, src, tgt_in, rngs={"dropout": rng})
    return token_loss(logits, tgt_out, config.label_smoothing)

  @jax.jit
  def step(params, opt_state, lr, rng, src, tgt_in, tgt_out):
    loss, grads = jax.value_and_grad(loss_fn)(params, rng, src, tgt_in, tgt_out)
    return (*_update(config, tx, params, opt_state, grads, lr), loss)

  return step


def _update(config: Config, tx, params, opt_state, grads, lr) -> tuple[Any, Any]:
  """One optimizer step: new ``(params, opt_state)``, the average kept."""
  decay = config.ema_decay
  inner = opt_state.inner if decay else opt_state
  updates, inner = tx.update(grads, inner, params)
  updates = jax.tree.map(lambda u: -lr * u, updates)
  params = optax.apply_updates(params, updates)
  if not decay:
    return params, inner
  ema = jax.tree.map(lambda a, p: a + (1 - decay) * (p - a), opt_state.ema, params)
  return params, Averaged(inner, ema)


@functools.lru_cache(maxsize=8)
def _parallel_train_step(key: tuple, num_phones: int, mesh: Mesh) -> Callable:
  config = Config(**dict(key))
  model = build_model(config, num_phones, train=True, ladder=training_ladder(config))
  tx = optimizer(config)

  def sums(params, rng, fields):
    src, tgt_in, tgt_out = fields
    rng = jax.random.fold_in(rng, jax.lax.axis_index(AXIS))  # masks per device

    def loss(params):
      logits = model.apply(params, src, tgt_in, rngs={"dropout": rng})
      return token_loss_sum(logits, tgt_out, config.label_smoothing)

    (total, count), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return total, count, grads

  grads_of = data_parallel(sums, mesh, AXIS)

  @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, P()))
  def step(params, opt_state, lr, rng, fields):
    total, count, grads = grads_of(params, rng, fields)
    count = jnp.maximum(count, 1)
    grads = jax.tree.map(lambda g: g / count, grads)
    return (*_update(config, tx, params, opt_state, grads, lr), total / count)

  return step


def train_step(config: Config, num_phones: int, mesh: Mesh | None = None) -> Callable:
  """The jitted step ``(params, opt_state, lr, rng, src, tgt_in, tgt_out) ->
  (params, opt_state, loss)``; `lr` a float scalar, `rng` a key for dropout.
  With `config.ema_decay`, `opt_state` is an `Averaged` whose average takes
  in the new parameters.

  With a `mesh`, the data-parallel step ``(params, opt_state, lr, rng,
  fields) -> (params, opt_state, loss)``: `fields` the three stacked fields
  of a sharded batch placed by `jaxlod.parallel.shard_batch` along `AXIS`,
  one shard a device (`jaxlod.parallel.data_parallel`); the loss is the
  mean over every real target token of every shard, each device draws its
  own dropout masks, and the parameters stay replicated
  (`jaxlod.parallel.replicate`)."""
  if mesh is None:
    return _train_step(_compiled_key(config), num_phones)
  return _parallel_train_step(_compiled_key(config), num_phones, mesh)


# The mesh axis of data-parallel runs (`--devices`).
AXIS = "data"


def _search_settings(src: LoDTensor, beam: int) -> dict:
  """The beam search's settings for source words `src` (model or ensemble)."""
  return dict(
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    max_length=src.lengths() + LENGTH_MARGIN,
    length_capacity=src.capacity.time[0] + LENGTH_MARGIN,
    beam_size=beam,
    length_penalty=LENGTH_PENALTY,
    # One phase at the full count (no compaction): each extra phase is another
    # copy of the step to compile, and a batch holds words of similar lengths.
    ladder=(src.capacity.sequences[0],),
  )


@functools.lru_cache(maxsize=8)
def _decoder(key: tuple, num_phones: int, beam: int) -> Callable:
  model = build_model(Config(**dict(key)), num_phones)

  @jax.jit
  def decode(params, src):
    settings = _search_settings(src, beam)
    hyps = model.apply(
      params, src, "beam", method="generate", num_results=1, **settings
    )
    return hyps.ids

  return decode


@functools.lru_cache(maxsize=8)
def _ensemble_search(key: tuple, num_phones: int, beam: int, num_results: int):
  model = build_model(Config(**dict(key)), num_phones)

  @jax.jit
  def search(members, src):
    return ensemble_generate(
      [(model, params) for params in members],
      src,
      num_results=num_results,
      **_search_settings(src, beam),
    )

  return search


def ensemble_search(
  config: Config, num_phones: int, beam: int, num_results: int = 1
) -> Callable:
  """The jitted beam search of an ensemble, ``(members, src) -> Hypotheses``.

  `members` is a tuple of parameter trees of `config`'s model; each step
  scores the next phoneme by the mean of the members' log-probabilities
  (each member keeps its own decoder carry over the same hypotheses), with
  `LENGTH_PENALTY`. The result holds `num_results`
  hypotheses per source word (see `jaxlod.nn.ensemble_generate`).
  """
  return _ensemble_search(_compiled_key(config), num_phones, beam, num_results)


def parallel_decoder(
  config: Config, num_phones: int, beam: int, mesh: Mesh
) -> Callable:
  """The data-parallel beam search ``(params, src) -> ids``: `src` a sharded
  batch's stacked source field on the host (every process its own shards),
  `ids` one 2-level LoDTensor per shard of every process, as `decoder`'s.
  Each device searches its own words (`jaxlod.parallel.generate`)."""
  model = build_model(config, num_phones)

  def decode(params, src):
    lengths = np.diff(np.asarray(src.offsets[0]), axis=-1) + LENGTH_MARGIN
    local = jax.tree.map(lambda a: a[0], src)
    settings = _search_settings(local, beam)
    del settings["max_length"]
    placed, limits = shard_batch((src, lengths), mesh, AXIS)
    hyps = generate(
      (model, params), placed, mesh, AXIS, max_length=limits, num_results=1, **settings
    )
    return [h.ids for h in hyps]

  return decode


def decoder(config: Config, num_phones: int, beam: int) -> Callable:
  """The jitted beam search ``(params, src) -> ids``: the best hypothesis of
  each source word, a 2-level LoDTensor (word -> 1 hypothesis -> phoneme ids,
  `</s>` excluded). A hypothesis holds at most the word's letters plus
  `LENGTH_MARGIN` tokens.

  With ``config.members > 1``, `params` is a tuple of the members' parameter
  trees, decoded together (`ensemble_search`)."""
  if config.members > 1:
    search = ensemble_search(config, num_phones, beam)
    return lambda params, src: search(tuple(params), src).ids
  return _decoder(_compiled_key(config), num_phones, beam)
