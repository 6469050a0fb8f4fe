"""The G2P example's model, presets, training step and beam-search decoder.

A bidirectional LSTM reads the letters (or, with ``encoder="transformer"``,
a Transformer encoder); an LSTM decoder with additive attention over its
outputs writes the phonemes (`jaxlod.nn.Seq2Seq`), built from library
pieces: the encoder is a `jaxlod.nn.StackedRNN` (or a
`jaxlod.nn.TransformerEncoder`), the loss
`jaxlod.ops.sequence_cross_entropy`, the schedule and the parameter average
optax's. Each function that returns a jitted function builds a new one: a
run builds it once and calls it on every batch.
"""

from __future__ import annotations

import dataclasses
import functools
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
  StackedRNN,
  TransformerEncoder,
  ensemble_generate,
)
from jaxlod.ops import (
  DecodeSettings,
  LoopPlan,
  default_plan,
  sequence_cross_entropy,
  sequence_pool,
)
from jaxlod.parallel import data_parallel, generate, shard_batch

# Ids of the target vocabulary's markers (see `data.phone_vocab`).
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
# `Config.encoder`: what reads the letters.
ENCODERS = ("bilstm", "transformer")


@dataclasses.dataclass(frozen=True)
class Config:
  """Settings of a run; `MODEL_FIELDS` must match to resume a checkpoint.

  Attributes:
    stress: keep the vowels' stress digits (69 phonemes instead of 39).
    encoder: what reads the letters, one of `ENCODERS`: ``"bilstm"``,
      `encoder_layers` bidirectional LSTMs of `hidden` each way (the
      decoder attends over rows of ``2 * hidden``), or ``"transformer"``, a
      `jaxlod.nn.TransformerEncoder` of `encoder_layers` pre-norm
      self-attention layers as wide as the embeddings (`embed_dim`, which
      is then also the width the decoder attends over), with `heads` heads,
      an MLP of `mlp_features` and sinusoidal positions that restart at
      every word.
    embed_dim: width of the letter and phoneme embeddings.
    hidden: LSTM width of each encoder direction and of the decoder.
    attention_units: width of the additive attention's scoring layer.
    encoder_layers: stacked bidirectional LSTM layers, or Transformer layers.
    heads: attention heads of each Transformer layer (they divide
      `embed_dim`); unused by the BiLSTM.
    mlp_features: width of each Transformer layer's MLP; unused by the
      BiLSTM.
    input_feeding: the decoder's cell takes the previous step's attention
      context with the phoneme's embedding (`jaxlod.nn.AttentionDecoder`'s
      ``input_feeding``), a wider cell input of ``embed_dim + 2 * hidden``.
    right_to_left: the decoder writes each pronunciation last phoneme first
      (it trains on reversed pronunciations; its hypotheses are turned back
      before they are scored or printed).
    both_directions: with several members, the odd ones write in the other
      direction than `right_to_left` (`member_config`); such an ensemble
      decodes by rescoring the members' n-best lists, not by one beam search.
    dropout: dropout rate on the encoder's inputs, between its layers and on
      its outputs (0 disables it); in a Transformer, after the positions are
      added and on each layer's two residual branches.
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
      Unused where the backend's loop plan sets its own sizes (a GPU's:
      `step_ladder`).
    batch_tokens: token capacity of each field of a training batch; a batch
      of long words holds fewer than `batch_words` words.
    steps: training steps in all (a resumed run continues to this count).
    learning_rate: peak Adam learning rate.
    warmup_steps: linear warm-up from 0 at step 0 to the peak at this step
      (`learning_rate`).
    final_lr_fraction: the cosine decay ends at this fraction of the peak,
      at step `steps`.
    clip_norm: gradient clipping by global norm.
    eval_every: steps between dev evaluations and checkpoints.
    dev_words: dev words scored at each periodic evaluation (evenly spaced
      in sorted order; `None`: all). The final table uses every word.
    beam: beam size of the evaluations.
    decode_words: the most words in a decoding batch (count capacity).
    seed: initialization, dropout and batch order.
  """

  stress: bool = False
  encoder: str = "bilstm"
  embed_dim: int = 64
  hidden: int = 128
  attention_units: int = 128
  encoder_layers: int = 1
  heads: int = 4
  mlp_features: int = 256
  input_feeding: bool = False
  right_to_left: bool = False
  both_directions: bool = False
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
  "encoder",
  "embed_dim",
  "hidden",
  "attention_units",
  "encoder_layers",
  "heads",
  "mlp_features",
  "input_feeding",
  "right_to_left",
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
  # The best single model within an hour on 2 CPU cores: width 256, two
  # encoder layers, batches of 128 words (more words a second than 64, and
  # twice the updates of 256: benchmarks/g2p_throughput.py), about 11
  # epochs. Its run: 2,739 s of training, test PER 6.76%, WER 28.05%.
  "fast": Config(
    embed_dim=128,
    hidden=256,
    attention_units=256,
    encoder_layers=2,
    dropout=0.2,
    decoder_dropout=0.2,
    label_smoothing=0.1,
    batch_words=128,
    batch_tokens=1280,
    steps=9600,
    learning_rate=3e-3,
    warmup_steps=500,
    eval_every=2000,
    dev_words=1000,
  ),
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

# The presets of ``encoder="transformer"`` (`preset`): `PRESETS`' of the same
# name with a Transformer encoder in place of the BiLSTM.
TRANSFORMER_PRESETS = {
  # The tiny preset's run with two Transformer layers (the tests).
  "tiny": dataclasses.replace(
    PRESETS["tiny"], encoder="transformer", encoder_layers=2, heads=2, mlp_features=16
  ),
  # The default preset's parameter budget: 449,065 parameters against the
  # BiLSTM's 431,721 (+4.0%). Two layers of width 128 (4 heads of 32, an MLP
  # of 192) hold 232,320 against the BiLSTM's 197,632; the wider embeddings
  # widen the decoder's cell input (64 -> 128), and the memory the decoder
  # attends over narrows (256 -> 128), which shrinks the carry bridge and the
  # attention's memory projection. The same schedule, batches and seed as
  # the default; benchmarks/g2p_encoders.py trains both side by side.
  "default": dataclasses.replace(
    PRESETS["default"],
    encoder="transformer",
    embed_dim=128,
    encoder_layers=2,
    heads=4,
    mlp_features=192,
  ),
}


def preset(name: str, encoder: str = "bilstm") -> Config:
  """The config of preset `name` with `encoder` (one of `ENCODERS`):
  ``PRESETS[name]``, or for a Transformer ``TRANSFORMER_PRESETS[name]``.

  Raises:
    ValueError: for an unknown encoder, or a preset the encoder lacks.
  """
  check_encoder(encoder)
  presets = TRANSFORMER_PRESETS if encoder == "transformer" else PRESETS
  if name not in presets:
    raise ValueError(
      f"The {encoder} encoder has no preset {name!r}; its presets are "
      f"{sorted(presets)}."
    )
  return presets[name]


def build_model(
  config: Config,
  num_phones: int,
  train: bool = False,
  ladder: tuple[int, ...] | None = None,
  cell: Callable[[int], nn.RNNCellBase] = nn.LSTMCell,
  plan: LoopPlan | None = None,
) -> Seq2Seq:
  """The model of `config`; `train` turns dropout on (same parameters).

  The encoder (parameters ``encoder/layers_0``, ...) is `config.encoder`'s:
  a `jaxlod.nn.StackedRNN` of `encoder_layers` bidirectional LSTMs, with
  `dropout` on its inputs, between its layers and on its outputs, or a
  `jaxlod.nn.TransformerEncoder` (`transformer_encoder`).

  `ladder` sets the static batch sizes of the recurrent encoder's and the
  teacher-forced decoder's loops (`training_ladder`); `None`: each batch's
  default (or its rank table's). The parameters do not depend on it.

  `cell` makes the LSTM cells (the BiLSTM encoder's and the decoder's) from
  the width: ``flax.linen.LSTMCell``, or a cell with the same parameters
  (``OptimizedLSTMCell``, a ``dtype`` of computation), which
  `benchmarks/g2p_throughput.py` times against it.

  `plan` runs the recurrent encoder's and the teacher-forced decoder's
  loops (a `jaxlod.ops.LoopPlan`); `None`: the layers' default, the
  backend's `jaxlod.ops.default_plan`. A plan whose `bodies` is set takes
  no `ladder`. A Transformer's attention keeps the backend's
  `jaxlod.ops.AttentionPlan`.

  Raises:
    ValueError: for an `encoder` not in `ENCODERS`.
  """
  check_encoder(config.encoder)
  # Only a given plan is passed: `None` leaves the layers' own default.
  planned = {} if plan is None else {"plan": plan}
  if config.encoder == "transformer":
    encoder = transformer_encoder(config, train)
  else:
    encoder = bilstm_encoder(config, train, ladder, cell, plan)
  return Seq2Seq(
    dropout=config.decoder_dropout,
    deterministic=not train,
    src_vocab=NUM_LETTERS,
    tgt_vocab=num_phones,
    embed_dim=config.embed_dim,
    encoder=encoder,
    decoder=AttentionDecoder(
      cell(config.hidden),
      AdditiveAttention(config.attention_units),
      input_feeding=config.input_feeding,
      ladder=ladder,
      **planned,
    ),
  )


def check_encoder(encoder: str) -> None:
  """`Config.encoder` is one of `ENCODERS`.

  Raises:
    ValueError: for another value.
  """
  if encoder not in ENCODERS:
    raise ValueError(
      f"Expected `encoder` to be one of {list(ENCODERS)}, got {encoder!r}."
    )


def bilstm_encoder(
  config: Config,
  train: bool = False,
  ladder: tuple[int, ...] | None = None,
  cell: Callable[[int], nn.RNNCellBase] = nn.LSTMCell,
  plan: LoopPlan | None = None,
) -> StackedRNN:
  """The ``encoder="bilstm"`` encoder of `config`: `encoder_layers`
  bidirectional LSTMs of `hidden` each way, `dropout` on the inputs, between
  the layers and on the outputs (`train` turns it on); `ladder`, `cell` and
  `plan` as `build_model`'s."""
  planned = {} if plan is None else {"plan": plan}

  def lstm() -> DynamicRNN:
    return DynamicRNN(cell(config.hidden), ladder=ladder, **planned)

  return StackedRNN(
    tuple(Bidirectional(lstm(), lstm()) for _ in range(config.encoder_layers)),
    dropout_rate=config.dropout,
    input_dropout=config.dropout,
    output_dropout=config.dropout,
    deterministic=not train,
  )


def transformer_encoder(config: Config, train: bool = False) -> TransformerEncoder:
  """The ``encoder="transformer"`` encoder of `config`: `encoder_layers`
  pre-norm layers of `heads` heads and an MLP of `mlp_features`, as wide as
  the letter embeddings (`embed_dim`), sinusoidal positions restarting at
  every word, `dropout` after the positions and on each residual branch
  (`train` turns it on)."""
  return TransformerEncoder(
    num_layers=config.encoder_layers,
    num_heads=config.heads,
    mlp_features=config.mlp_features,
    dropout_rate=config.dropout,
    deterministic=not train,
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


def step_ladder(config: Config, plan: LoopPlan | None = None) -> tuple[int, ...] | None:
  """The ladder the training step gives its loops under `plan` (`None`: the
  backend's `jaxlod.ops.default_plan`, as the layers take it).

  `training_ladder` where the plan leaves the batch sizes to a ladder (its
  `bodies` is `None`: a CPU's), else `None`. A plan with `bodies` set (a
  GPU's or TPU's default) runs one or a few sizes, the right choice where
  rows are nearly free, and a ladder passed beside it would take the place
  of its bodies (`jaxlod.ops.dynamic_rnn`); so on such a backend the step
  keeps the plan's bodies. The host rank tables of
  `train.training_batcher` keep `training_ladder` either way: a loop with
  bodies recomputes its phases from a table's lengths.
  """
  resolved = default_plan() if plan is None else plan
  return training_ladder(config) if resolved.bodies is None else None


def batch_buckets(words: int, tokens: int | None = None) -> Buckets:
  """Fixed capacities of one field of a batch (default: 10 tokens a word)."""
  tokens = 10 * words if tokens is None else tokens
  return Buckets.fixed(tokens=tokens, sequences=words, time=TIME_CAPACITY)


def learning_rate(config: Config, step: jax.typing.ArrayLike) -> jax.Array:
  """The learning rate of step `step` (an int, or an int array of steps).

  `optax.warmup_cosine_decay_schedule`: linear warm-up from 0 at step 0 to
  the peak at `warmup_steps`, then cosine decay to ``final_lr_fraction`` of
  the peak at `steps` (a run of `warmup_steps` steps or fewer only warms
  up).
  """
  peak = config.learning_rate
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=peak,
    warmup_steps=config.warmup_steps,
    # optax needs at least one step of decay.
    decay_steps=max(config.steps, config.warmup_steps + 1),
    end_value=config.final_lr_fraction * peak,
  )
  return schedule(step)


def step_args(config: Config, step: int) -> tuple[np.float32, jax.Array]:
  """The learning rate and dropout key of training step `step` (from 0),
  `train_step`'s ``lr`` and ``rng``: `learning_rate`, and the key of
  ``config.seed + 1`` folded with `step`. A run stopped and resumed passes
  each step what an uninterrupted one does."""
  rng = jax.random.fold_in(jax.random.key(config.seed + 1), step)
  return np.float32(learning_rate(config, step)), rng


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
  ``seed + k``, and with `both_directions` the other direction than
  `right_to_left` when `k` is odd; a run of it is that member's training.

  Raises:
    ValueError: for `k` outside ``[0, members)``.
  """
  if not 0 <= k < config.members:
    raise ValueError(f"Expected a member in [0, {config.members}), got {k}.")
  flipped = config.both_directions and k % 2 == 1
  return dataclasses.replace(
    config,
    seed=config.seed + k,
    members=1,
    right_to_left=config.right_to_left != flipped,
    both_directions=False,
  )


def optimizer(config: Config) -> optax.GradientTransformation:
  """Clipping and Adam's scaling; the step multiplies by ``-learning_rate``."""
  return optax.chain(optax.clip_by_global_norm(config.clip_norm), optax.scale_by_adam())


def _example_batch() -> tuple[LoDTensor, LoDTensor]:
  """Two words' source and decoder-input ids, on the capacities of a small
  batch: what `init_state` traces the model on."""
  buckets = batch_buckets(2, 2 * TIME_CAPACITY)
  src = LoDTensor.from_sequences([[0, 1], [2]], buckets=buckets)
  tgt = LoDTensor.from_sequences([[BOS_ID, 2], [BOS_ID]], buckets=buckets)
  return src, tgt


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
  model = build_model(config, num_phones)

  def init(rng: jax.Array) -> tuple[Any, Any]:
    params = model.init(rng, *_example_batch())
    opt_state = optimizer(config).init(params)
    if config.ema_decay:
      opt_state = Averaged(opt_state, params)
    return params, opt_state

  rng = jax.random.key(config.seed)
  return jax.eval_shape(init, rng) if abstract else jax.jit(init)(rng)


def _update(
  config: Config,
  tx: optax.GradientTransformation,
  params: Any,
  opt_state: Any,
  grads: Any,
  lr: jax.Array,
) -> tuple[Any, Any]:
  """One optimizer step: new ``(params, opt_state)``, the average kept
  (`optax.incremental_update`)."""
  decay = config.ema_decay
  inner = opt_state.inner if decay else opt_state
  updates, inner = tx.update(grads, inner, params)
  updates = jax.tree.map(lambda u: -lr * u, updates)
  params = optax.apply_updates(params, updates)
  if not decay:
    return params, inner
  ema = optax.incremental_update(params, opt_state.ema, step_size=1 - decay)
  return params, Averaged(inner, ema)


# The mesh axis of data-parallel runs (`--devices`).
AXIS = "data"


def train_step(
  config: Config,
  num_phones: int,
  mesh: Mesh | None = None,
  cell: Callable[[int], nn.RNNCellBase] = nn.LSTMCell,
  plan: LoopPlan | None = None,
) -> Callable:
  """A new jitted step ``(params, opt_state, lr, rng, fields, tables=None)
  -> (params, opt_state, loss)``; build it once a run (it compiles on its
  first call).

  `fields` are a batch's ``(src, tgt_in, tgt_out)`` and `tables` its rank
  tables (``Batch.tables`` of a `jaxlod.data.Batcher` with the ladder
  `training_ladder`; the first two are used) or `None`, and then the model
  ranks the batch itself. `lr` is a float scalar (`learning_rate`) and
  `rng` a key for dropout. The loss is the mean over the real target tokens
  of `jaxlod.ops.sequence_cross_entropy` (with `label_smoothing`). With
  `config.ema_decay`, `opt_state` is an `Averaged` whose average takes in
  the new parameters.

  With a `mesh`, the data-parallel step of the same signature: `fields` and
  `tables` are those of a sharded batch placed by
  `jaxlod.parallel.shard_batch` along `AXIS`, one shard a device
  (`jaxlod.parallel.data_parallel`); the loss is the mean over every real
  target token of every shard, each device draws its own dropout masks,
  and the parameters stay replicated (`jaxlod.parallel.replicate`).
  `cell`: as `build_model`'s. `plan`: the `jaxlod.ops.LoopPlan` of the
  model's loops (`None`: the backend's); their ladder is `step_ladder`'s
  (`training_ladder` on a CPU).
  """
  model = build_model(
    config,
    num_phones,
    train=True,
    ladder=step_ladder(config, plan),
    cell=cell,
    plan=plan,
  )
  tx = optimizer(config)

  def sums(params, rng, batch):
    """The summed loss and the number of real target tokens, and the
    gradient of the sum."""
    (src, tgt_in, tgt_out), tables = batch
    src_table, tgt_table = (None, None) if tables is None else tables[:2]

    def total(params):
      logits = model.apply(
        params,
        src,
        tgt_in,
        src_table=src_table,
        tgt_table=tgt_table,
        rngs={"dropout": rng},
      )
      losses = sequence_cross_entropy(
        logits, tgt_out, label_smoothing=config.label_smoothing
      )
      return jnp.sum(losses.values), losses.num_rows

    (loss_sum, count), grads = jax.value_and_grad(total, has_aux=True)(params)
    return loss_sum, count, grads

  if mesh is None:
    grads_of, jit = sums, jax.jit
  else:

    def per_device(params, rng, batch):
      # Each device its own dropout masks.
      return sums(params, jax.random.fold_in(rng, jax.lax.axis_index(AXIS)), batch)

    grads_of = data_parallel(per_device, mesh, AXIS)
    jit = functools.partial(jax.jit, out_shardings=NamedSharding(mesh, P()))

  @jit
  def step(params, opt_state, lr, rng, fields, tables=None):
    loss_sum, count, grads = grads_of(params, rng, (fields, tables))
    count = jnp.maximum(count, 1)
    grads = jax.tree.map(lambda g: g / count, grads)
    return (*_update(config, tx, params, opt_state, grads, lr), loss_sum / count)

  return step


def search_settings(
  beam: int, time_capacity: int, num_results: int | None = 1
) -> DecodeSettings:
  """The beam search's settings for words of at most `time_capacity` letters.

  A hypothesis holds at most `time_capacity` plus `LENGTH_MARGIN` tokens
  (`max_lengths` lowers it per word), scored with `LENGTH_PENALTY`. The
  default ladder compacts the live words between phases: on 2 CPU cores the
  dev set decoded about 10% faster than with ``ladder=()`` (the same
  hypotheses), for about 12 s more compilation
  (benchmarks/results/g2p_options.json).
  """
  return DecodeSettings(
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    max_length=time_capacity + LENGTH_MARGIN,
    beam_size=beam,
    length_penalty=LENGTH_PENALTY,
    num_results=num_results,
  )


def scoring_buckets(words: int) -> tuple[Buckets, Buckets, Buckets]:
  """Capacities of a `forced_scorer` batch's ``(src, tgt_in, tgt_out)``:
  at most `words` words, and pronunciations as long as a hypothesis of the
  beam search can be, with ``<s>`` or ``</s>``."""
  tgt = Buckets.fixed(
    tokens=10 * words, sequences=words, time=TIME_CAPACITY + LENGTH_MARGIN + 1
  )
  return batch_buckets(words), tgt, tgt


@functools.cache
def forced_scorer(config: Config, num_phones: int) -> Callable:
  """The jitted teacher-forced scorer ``(params, src, tgt_in, tgt_out,
  src_table=None, tgt_table=None) -> logp``, ``logp [count_capacity]``
  float32: each word's summed log-probability of its `tgt_out` (``</s>``
  included) under `config`'s model, dropout off; empty slots score 0.

  The fields are those of `jaxlod.ops.sequence_cross_entropy`'s loss
  (``tgt_in`` is ``<s>`` and the phonemes, ``tgt_out`` the phonemes and
  ``</s>``), on `scoring_buckets`; the tables are the rank tables of `src`
  and `tgt_in`, or `None`. One scorer per set of arguments in a process
  (cached), as `searcher`.
  """
  model = build_model(config, num_phones)

  @jax.jit
  def score(params, src, tgt_in, tgt_out, src_table=None, tgt_table=None):
    logits = model.apply(params, src, tgt_in, src_table=src_table, tgt_table=tgt_table)
    return -sequence_pool(sequence_cross_entropy(logits, tgt_out), "sum")

  return score


def max_lengths(src: LoDTensor) -> jax.Array:
  """Each word's most tokens, ``[count_capacity]``: its letters plus
  `LENGTH_MARGIN`."""
  return src.lengths() + LENGTH_MARGIN


def ensemble_search(
  config: Config, num_phones: int, beam: int, num_results: int = 1
) -> Callable:
  """A new jitted beam search of an ensemble, ``(members, src,
  src_table=None) -> Hypotheses``.

  `members` is a tuple of parameter trees of `config`'s model; each step
  scores the next phoneme by the mean of the members' log-probabilities
  (each member keeps its own decoder carry over the same hypotheses), with
  `search_settings`. The result holds `num_results` hypotheses per source
  word (see `jaxlod.nn.ensemble_generate`); `src_table` is `src`'s rank
  table, or `None`.
  """
  model = build_model(config, num_phones)

  @jax.jit
  def search(members, src, src_table=None):
    settings = search_settings(beam, src.capacity.time[0], num_results)
    return ensemble_generate(
      [(model, params) for params in members],
      src,
      settings,
      max_lengths=max_lengths(src),
      src_table=src_table,
    )

  return search


def parallel_decoder(
  config: Config, num_phones: int, beam: int, mesh: Mesh
) -> Callable:
  """The data-parallel beam search ``(params, src, src_table=None) -> ids``:
  `src` a sharded batch's stacked source field on the host (every process
  its own shards) and `src_table` its stacked rank tables or `None`, `ids`
  one 2-level LoDTensor per shard of every process, as `decoder`'s. Each
  device searches its own words (`jaxlod.parallel.generate`, which compiles
  once per model and settings)."""
  model = build_model(config, num_phones)

  def decode(params, src, src_table=None):
    limits = np.diff(np.asarray(src.offsets[0]), axis=-1) + LENGTH_MARGIN
    placed, table, limits = shard_batch((src, src_table, limits), mesh, AXIS)
    hyps = generate(
      (model, params),
      placed,
      mesh,
      AXIS,
      settings=search_settings(beam, src.capacity.time[0]),
      src_table=table,
      max_lengths=limits,
    )
    return [h.ids for h in hyps]

  return decode


@functools.cache
def searcher(
  config: Config, num_phones: int, beam: int, num_results: int = 1
) -> Callable:
  """The jitted beam search ``(params, src, src_table=None) ->
  Hypotheses``: the `num_results` best hypotheses of each source word, best
  first, with their scores (`jaxlod.ops.Hypotheses`: ids a 2-level
  LoDTensor word -> hypotheses -> phoneme ids, `</s>` excluded);
  `src_table` is `src`'s rank table, or `None`. A hypothesis holds at most
  the word's letters plus `LENGTH_MARGIN` tokens. One search per set of
  arguments in a process (cached): repeated predictions, in a notebook say,
  compile once per capacity.

  With ``config.members > 1``, `params` is a tuple of the members' parameter
  trees, decoded together (`ensemble_search`).

  Raises:
    ValueError: for an ensemble of both directions, which no one search
      decodes (``decoding.transcribe`` rescores its members' hypotheses).
  """
  if config.members > 1 and config.both_directions:
    raise ValueError(
      "An ensemble of both directions (`both_directions`) has no joint beam "
      "search: each member searches alone and all of them rescore the "
      "hypotheses (`examples.g2p.decoding.transcribe`)."
    )
  if config.members > 1:
    search = ensemble_search(config, num_phones, beam, num_results)
    return lambda params, src, src_table=None: search(tuple(params), src, src_table)
  model = build_model(config, num_phones)

  @jax.jit
  def search(params, src, src_table=None):
    settings = search_settings(beam, src.capacity.time[0], num_results)
    return model.apply(
      params,
      src,
      settings,
      method="generate",
      max_lengths=max_lengths(src),
      src_table=src_table,
    )

  return search


def decoder(config: Config, num_phones: int, beam: int) -> Callable:
  """A jitted beam search ``(params, src, src_table=None) -> ids``: the
  best hypothesis of each source word, the ids of `searcher`'s
  `Hypotheses` (word -> 1 hypothesis -> phoneme ids), whose compiled
  programs it shares."""
  search = searcher(config, num_phones, beam)
  return lambda params, src, src_table=None: search(params, src, src_table).ids
