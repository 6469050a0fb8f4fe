"""Seq2Seq.generate: the decoding ops over the encoder's outputs as external
memory, checked against teacher-forced scoring of the same hypotheses."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlod import Buckets, LoDTensor
from jaxlod.nn import ensemble_generate
from jaxlod.ops import DecodeSettings, beam_search, ensemble_step, rank_table
from tests.nn.test_seq2seq import (
  S2S_SRC_BUCKETS,
  SRC_VOCAB,
  _ids,
  _seq2seq,
  _seq2seq_batch,
  _seq2seq_params,
)

BOS, EOS, MAX_LENGTH = 0, 1, 5
TGT_BUCKETS = Buckets.fixed(tokens=24, sequences=4, time=6)


def settings(beam_size=3, alpha=0.6, **kwargs):
  return DecodeSettings(
    bos_id=BOS,
    eos_id=EOS,
    max_length=MAX_LENGTH,
    beam_size=beam_size,
    length_penalty=alpha,
    **kwargs,
  )


BEAM = settings()
GREEDY = settings(beam_size=1, alpha=0.0)


@functools.partial(jax.jit, static_argnames=("search",))
def generate(params, src, search=BEAM):
  return _seq2seq().apply(params, src, search, method="generate")


def teacher_forced_logps(members, src, hyps):
  """``logps[i][r]``: ``[len(tokens), vocab]`` mean over `members` (``(model,
  params)`` pairs) of the teacher-forced log-probs of hypothesis
  ``hyps[i][r]`` with `eos` appended when it ended before the max length,
  and those target ids."""
  out = [[] for _ in hyps]
  applies = [(jax.jit(m.apply), p) for m, p in members]
  for rank in range(len(hyps[0])):
    tgt_in, tgt_out = [], []
    for source in hyps:
      tokens = source[rank]
      ended = len(tokens) < MAX_LENGTH
      tgt_out.append(np.array(tokens + [EOS] if ended else tokens, np.int32))
      tgt_in.append(np.array([BOS] + tokens[: len(tgt_out[-1]) - 1], np.int32))
    batch = LoDTensor.from_sequences(tgt_in, buckets=TGT_BUCKETS, dtype=np.int32)
    logps = [
      [np.asarray(jax.nn.log_softmax(x, axis=-1)) for x in logits.to_list()]
      for logits in (apply(p, src, batch) for apply, p in applies)
    ]
    for i, target in enumerate(tgt_out):
      out[i].append((np.mean([lp[i] for lp in logps], axis=0), target))
  return out


def teacher_forced_scores(members, src, hyps, alpha):
  """``scores[i][r]`` of hypothesis ``hyps[i][r]`` by teacher forcing: the
  sum of the mean over `members` (``(model, params)`` pairs) of its log-probs
  (with `eos` when it ended before the max length), length-penalized."""
  scores = []
  for source in teacher_forced_logps(members, src, hyps):
    scores.append([])
    for logp, target in source:
      total = logp[np.arange(len(target)), target].sum()
      scores[-1].append(total / ((5 + len(target)) / 6) ** alpha)
  return scores


def _assert_greedy(members, src, out):
  """Each hypothesis of `out` takes the argmax of the members' mean
  teacher-forced log-probs at every step, and scores their sum."""
  hyps = [[h.tolist() for h in source] for source in out.ids.to_list()]
  for source, score in zip(
    teacher_forced_logps(members, src, hyps), out.scores.to_list(), strict=True
  ):
    ((logp, target),) = source
    np.testing.assert_array_equal(logp.argmax(-1), target)
    np.testing.assert_allclose(
      score, [logp[np.arange(len(target)), target].sum()], rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_beam_scores_are_the_teacher_forced_scores():
  params = _seq2seq_params()
  src, _, _ = _seq2seq_batch()
  out = generate(params, src)
  hyps = [[h.tolist() for h in source] for source in out.ids.to_list()]
  scores = out.scores.to_list()
  # Every source gets beam_size hypotheses, the empty source included.
  assert [len(h) for h in hyps] == [3, 3, 3, 3]
  expected = teacher_forced_scores([(_seq2seq(), params)], src, hyps, 0.6)
  np.testing.assert_allclose(np.array(scores), np.array(expected), rtol=1e-5, atol=1e-5)


def test_generate_is_beam_search_over_the_decode_step():
  params = _seq2seq_params()
  src, _, _ = _seq2seq_batch()
  model = _seq2seq()
  num_sources = src.num_sequences(-1)

  @jax.jit
  def reference(params, src):
    memory = model.apply(params, src, method="encode")
    padded = model.apply(params, memory, method="precompute")
    assert padded.keys is not None  # additive attention: keys computed once
    carry = model.apply(params, memory, method="initial_state")

    def step(carry, tokens, memory):
      carry, logits, _ = model.apply(
        params, carry, tokens, memory, method="decode_step"
      )
      return carry, jax.nn.log_softmax(logits, axis=-1)

    return beam_search(
      step, carry, settings(), static_inputs=padded, num_sources=num_sources
    )

  expected = reference(params, src)
  out = generate(params, src)
  assert out.ids.recursive_lengths() == expected.ids.recursive_lengths()
  np.testing.assert_array_equal(out.ids.values, expected.ids.values)
  for a, e in zip(out.scores.to_list(), expected.scores.to_list(), strict=True):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def test_greedy_takes_the_argmax_of_the_log_probs():
  params = _seq2seq_params()
  src, _, _ = _seq2seq_batch()
  out = generate(params, src, GREEDY)
  _assert_greedy([(_seq2seq(), params)], src, out)


def test_compaction_off_gives_the_same_hypotheses():
  params = _seq2seq_params()
  src, _, _ = _seq2seq_batch()
  _same(generate(params, src, settings(ladder=())), generate(params, src))


def test_generate_compiles_once_per_capacity():
  params = _seq2seq_params()
  src, _, _ = _seq2seq_batch()
  rng = np.random.default_rng(0)
  other = src.with_values(
    jnp.asarray(rng.integers(0, 7, size=src.values.shape), jnp.int32)
  )
  before = generate._cache_size()
  generate(params, src, settings(beam_size=2))
  generate(params, other, settings(beam_size=2))
  assert generate._cache_size() == before + 1


def test_generate_takes_a_host_source_table():
  """`src_table` sets the encoder's phases and changes no hypothesis."""
  params, model = _seq2seq_params(), _seq2seq()
  src, _, _ = _seq2seq_batch()
  table = rank_table(src, ladder=(4, 2, 1))
  assert rank_table(src).ladder == (4,)
  search = settings(beam_size=2)

  def f(params, src, table):
    return model.apply(params, src, search, method="generate", src_table=table)

  want = jax.jit(f)(params, src, None)
  got = jax.jit(f)(params, src, table)
  assert got.ids.recursive_lengths() == want.ids.recursive_lengths()
  np.testing.assert_array_equal(got.ids.values, want.ids.values)
  np.testing.assert_allclose(got.scores.values, want.scores.values, rtol=1e-6)
  # Three encoder phases instead of one (the decoding loop is the same).
  with_table = str(jax.make_jaxpr(f)(params, src, table)).count("while[")
  assert with_table == str(jax.make_jaxpr(f)(params, src, None)).count("while[") + 2
  # A table of other lengths, at the same capacities.
  other = rank_table(_ids([1, 2, 3, 4], SRC_VOCAB, S2S_SRC_BUCKETS, seed=0))
  with pytest.raises(ValueError, match="The rank table does not describe `inputs`"):
    model.apply(params, src, search, method="generate", src_table=other)


def test_generate_errors():
  params = _seq2seq_params()
  src, tgt_in, _ = _seq2seq_batch()
  model = _seq2seq()
  with pytest.raises(TypeError, match=r"`settings` to be a DecodeSettings, got dict"):
    model.apply(params, src, {"beam_size": 2}, method="generate")
  with pytest.raises(ValueError, match=r"generate needs parameters"):
    model.init(jax.random.key(0), src, settings(), method="generate")
  for name in ("bos_id", "eos_id"):
    bad = dataclasses.replace(BEAM, **{name: 6})
    with pytest.raises(
      ValueError,
      match=rf"`{name}` in \[0, 6\) \(the vocabulary of `step_fn`\), got 6",
    ):
      model.apply(params, src, bad, method="generate")


def _two_members():
  """Two models of different decoder widths, with their parameters."""
  src, tgt_in, _ = _seq2seq_batch()
  wide = _seq2seq(hidden=7)
  return [
    (_seq2seq(), _seq2seq_params()),
    (wide, jax.jit(wide.init)(jax.random.key(1), src, tgt_in)),
  ]


@functools.partial(jax.jit, static_argnames=("models", "search"))
def ensemble(models, variables, src, search=BEAM):
  return ensemble_generate(list(zip(models, variables, strict=True)), src, search)


def _same(a, b):
  assert a.ids.recursive_lengths() == b.ids.recursive_lengths()
  np.testing.assert_array_equal(a.ids.values, b.ids.values)
  np.testing.assert_allclose(a.scores.values, b.scores.values, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("search", [settings(), GREEDY], ids=["beam", "greedy"])
def test_an_ensemble_of_one_member_is_generate(search):
  params = _seq2seq_params()
  src, _, _ = _seq2seq_batch()
  got = ensemble((_seq2seq(),), (params,), src, search)
  _same(got, generate(params, src, search))


def test_ensemble_beam_scores_are_the_mean_teacher_forced_scores():
  members = _two_members()
  src, _, _ = _seq2seq_batch()
  models, variables = zip(*members, strict=True)
  out = ensemble(models, variables, src)
  hyps = [[h.tolist() for h in source] for source in out.ids.to_list()]
  assert [len(h) for h in hyps] == [3, 3, 3, 3]
  expected = teacher_forced_scores(members, src, hyps, 0.6)
  np.testing.assert_allclose(
    np.array(out.scores.to_list()), np.array(expected), rtol=1e-5, atol=1e-5
  )
  # Not either member's own search.
  for model, params in members:
    alone = jax.jit(
      lambda p, s, model=model: model.apply(p, s, settings(), method="generate")
    )(params, src)
    assert not np.allclose(alone.scores.values, out.scores.values)


def test_ensemble_greedy_takes_the_argmax_of_the_mean_log_probs():
  members = _two_members()
  src, _, _ = _seq2seq_batch()
  models, variables = zip(*members, strict=True)
  out = ensemble(models, variables, src, GREEDY)
  _assert_greedy(members, src, out)


def test_ensemble_generate_errors():
  members = _two_members()
  src, _, _ = _seq2seq_batch()
  search = settings()
  with pytest.raises(ValueError, match=r"Expected at least one member, got none\."):
    ensemble_generate([], src, search)
  with pytest.raises(TypeError, match=r"`members\[1\]` to be a \(Seq2Seq, variables\)"):
    ensemble_generate([members[0], members[1][1]], src, search)
  with pytest.raises(TypeError, match=r"`members\[0\]` .* got \(Dense, dict\)\."):
    ensemble_generate([(nn.Dense(3), members[0][1])], src, search)
  other = _seq2seq().clone(tgt_vocab=9)
  with pytest.raises(ValueError, match=r"share `tgt_vocab`, got \[6, 9\]"):
    ensemble_generate([members[0], (other, members[0][1])], src, search)
  bad = DecodeSettings(bos_id=BOS, eos_id=6, max_length=MAX_LENGTH)
  with pytest.raises(ValueError, match=r"`eos_id` in \[0, 6\)"):
    ensemble_generate(members, src, bad)


def test_ensemble_step_is_the_mean_of_the_log_softmax():
  logits = [jnp.array([[1.0, 2.0, 0.5]]), jnp.array([[0.0, -1.0, 3.0]])]
  steps = [lambda c, t, s, x=x: (c + 1, x) for x in logits]
  carries, log_probs = ensemble_step(steps)((0, 5), jnp.zeros(1, int), (None, None))
  assert carries == (1, 6)
  expected = np.mean([jax.nn.log_softmax(x) for x in logits], axis=0)
  np.testing.assert_allclose(log_probs, expected, rtol=1e-6)
  _, alone = ensemble_step(steps[:1])((0,), jnp.zeros(1, int), (None,))
  np.testing.assert_array_equal(alone, jax.nn.log_softmax(logits[0]))
