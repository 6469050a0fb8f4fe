"""Decoding never drops a source silently: NaN and +inf scores and rows of -inf rank
last (and fail a checkify check), ids outside the vocabulary raise."""

import functools

import flax.linen as nn
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify

from jaxlod import LoDTensor
from jaxlod.nn import AttentionDecoder, DotAttention, DynamicRNN, Seq2Seq
from jaxlod.ops import DecodeSettings, beam_search

VOCAB = 5
SETTINGS = DecodeSettings(bos_id=0, eos_id=4, max_length=3, beam_size=2)


def step(carry, tokens, statics):
  """Fixed scores; rows whose static flag is set score NaN everywhere."""
  del tokens
  scores = jnp.tile(jnp.arange(VOCAB, dtype=jnp.float32), (carry.shape[0], 1))
  log_probs = jax.nn.log_softmax(scores)
  return carry, jnp.where(statics[:, :1] > 0, jnp.nan, log_probs)


def decode(flags):
  statics = jnp.asarray(flags, jnp.float32)[:, None]
  return beam_search(step, jnp.zeros((len(flags), 1)), SETTINGS, static_inputs=statics)


def test_a_nan_source_keeps_its_hypotheses():
  hyps = decode([1, 0])
  counts = [len(h) for h in hyps.ids.to_list()]
  assert counts == [SETTINGS.results, SETTINGS.results]
  scores = hyps.scores.to_list()
  assert np.all(np.isfinite(scores[0])) and np.all(scores[0] < -1e30)
  clean = decode([0, 0])  # the other source is unaffected
  np.testing.assert_array_equal(scores[1], clean.scores.to_list()[1])
  assert [h.tolist() for h in hyps.ids.to_list()[1]] == [
    h.tolist() for h in clean.ids.to_list()[1]
  ]


def test_nan_scores_fail_under_checkify():
  err, _ = checkify.checkify(jax.jit(decode))(jnp.asarray([1.0, 0.0]))
  with pytest.raises(checkify.JaxRuntimeError, match="log_probs without NaN"):
    err.throw()
  err, _ = checkify.checkify(jax.jit(decode))(jnp.asarray([0.0, 0.0]))
  err.throw()


def inf_step(carry, tokens, statics):
  """As `step`, with +inf (no log-probability) where the flag is set."""
  carry, log_probs = step(carry, tokens, jnp.zeros_like(statics))
  return carry, jnp.where(statics[:, :1] > 0, jnp.inf, log_probs)


def test_inf_scores_rank_last_and_fail_under_checkify():
  def run(flags):
    statics = jnp.asarray(flags, jnp.float32)[:, None]
    init = jnp.zeros((2, 1))
    return beam_search(inf_step, init, SETTINGS, static_inputs=statics)

  err, hyps = checkify.checkify(jax.jit(run))(jnp.asarray([1.0, 0.0]))
  with pytest.raises(checkify.JaxRuntimeError, match=r"without NaN or \+inf"):
    err.throw()
  scores = hyps.scores.to_list()
  assert np.all(np.isfinite(scores[0])) and np.all(scores[0] < -1e30)
  assert int(hyps.ids.faults) == 0
  clean = decode([0, 0]).scores.to_list()[1]  # eager: rounds apart from jit
  np.testing.assert_allclose(scores[1], clean, rtol=1e-5, atol=1e-6)


def model_and_params():
  src = LoDTensor.from_sequences([np.array([3, 1, 4]), np.array([1, 5])])
  tgt = LoDTensor.from_sequences([np.array([0, 2]), np.array([0, 6, 2])])
  model = Seq2Seq(
    src_vocab=8,
    tgt_vocab=9,
    embed_dim=5,
    encoder=DynamicRNN(nn.GRUCell(4)),
    decoder=AttentionDecoder(nn.GRUCell(4), DotAttention()),
  )
  return model, model.init(jax.random.key(0), src, tgt), tgt


@pytest.mark.parametrize("bad", [8, -1])
def test_source_ids_outside_the_vocabulary_raise(bad):
  model, params, tgt = model_and_params()
  src = LoDTensor.from_sequences([np.array([3, 1, bad]), np.array([1, 5])])
  settings = DecodeSettings(bos_id=0, eos_id=1, max_length=4, beam_size=2)
  match = rf"every id of `src` in \[0, 8\) \(the vocabulary\); row 2 holds {bad}\."
  with pytest.raises(ValueError, match=match):
    model.apply(params, src, method=model.generate, settings=settings)
  with pytest.raises(ValueError, match=match):
    model.apply(params, src, tgt)

  def generate(src):
    return model.apply(params, src, method=model.generate, settings=settings)

  err, _ = checkify.checkify(jax.jit(generate))(src)
  with pytest.raises(checkify.JaxRuntimeError, match=r"every id of `src` in \[0, 8\)"):
    err.throw()


def test_target_ids_outside_the_vocabulary_raise():
  model, params, _ = model_and_params()
  src = LoDTensor.from_sequences([np.array([3, 1]), np.array([1, 5])])
  tgt = LoDTensor.from_sequences([np.array([0, 9]), np.array([0])])
  with pytest.raises(ValueError, match=r"`tgt_in` in \[0, 9\) .* row 1 holds 9\."):
    model.apply(params, src, tgt)


# -- rows of -inf ----------------------------------------------------------------

FLOOR = -1e30  # scores below it are floor scores


def bigram_step(carry, tokens, tables):
  """Source ``s``'s next-token log-probs after `tokens`: ``tables[s, tokens]``."""
  return carry, jnp.take_along_axis(tables, tokens[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("search",))
def bigram_search(tables, search):
  """`beam_search` of `bigram_step` (tables ``[count, VOCAB, VOCAB]``),
  checkified."""
  count = tables.shape[0]
  return checkify.checkify(beam_search)(
    bigram_step, jnp.zeros((count, 1)), search, static_inputs=tables
  )


def tables_of(logits, masked):
  """Normalized bigram tables with the `masked` entries at -inf."""
  table = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  return jnp.where(jnp.asarray(masked), -jnp.inf, table)


@pytest.mark.parametrize("beam_size", [1, 2, 4])
@pytest.mark.parametrize("jit", [False, True])
def test_a_source_scored_all_minus_inf_keeps_its_hypotheses(beam_size, jit):
  def minus_inf(carry, tokens, statics):
    del statics
    return carry, jnp.full((tokens.shape[0], VOCAB), -jnp.inf)

  search = DecodeSettings(bos_id=0, eos_id=4, max_length=3, beam_size=beam_size)

  def decode(init):
    return beam_search(minus_inf, init, search)

  hyps = (jax.jit(decode) if jit else decode)(jnp.zeros((2, 1)))
  assert hyps.ids.recursive_lengths()[0] == [beam_size, beam_size]
  assert int(hyps.ids.faults) == 0
  for scores in hyps.scores.to_list():
    assert np.all(np.isfinite(scores)) and np.all(scores < FLOOR)
  err, _ = checkify.checkify(jax.jit(decode))(jnp.zeros((2, 1)))
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"log_probs with an entry above -inf for every live hypothesis",
  ):
    err.throw()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_sums_of_huge_finite_scores_never_reach_minus_inf(dtype):
  # Three steps of half the float32 minimum sum past it: -inf, a dead slot.
  def huge(carry, tokens, statics):
    del statics
    low = jnp.finfo(dtype).min / 2
    return carry, jnp.full((tokens.shape[0], VOCAB), low, dtype)

  def decode(init):
    return beam_search(huge, init, SETTINGS)

  err, hyps = checkify.checkify(jax.jit(decode))(jnp.zeros((2, 1)))
  err.throw()  # finite scores: nothing to report
  assert hyps.ids.recursive_lengths()[0] == [SETTINGS.results] * 2
  for scores in hyps.scores.to_list():
    assert np.all(np.isfinite(scores))


def test_rows_of_minus_inf_outside_live_hypotheses_pass():
  """After `eos` (ended slots feed it back) and for padding sources, a row
  of -inf is no one's continuation: no check fails, nothing changes."""
  rng = np.random.default_rng(0)
  tables = tables_of(rng.normal(size=(3, VOCAB, VOCAB)), np.zeros((3, 1, 1), bool))
  after_eos = tables.at[:, SETTINGS.eos_id].set(-jnp.inf)
  err, got = bigram_search(after_eos, SETTINGS)
  err.throw()
  _, want = bigram_search(tables, SETTINGS)
  assert got.ids.recursive_lengths() == want.ids.recursive_lengths()
  np.testing.assert_array_equal(got.scores.values, want.scores.values)

  def padded(tables):
    return beam_search(
      bigram_step, jnp.zeros((3, 1)), SETTINGS, static_inputs=tables, num_sources=2
    )

  err, got = checkify.checkify(jax.jit(padded))(tables.at[2].set(-jnp.inf))
  err.throw()
  assert got.ids.recursive_lengths()[0] == [SETTINGS.results] * 2


@pytest.mark.parametrize("beam_size", [1, 2, 4])
@settings(max_examples=15)
@given(data=st.data())
def test_no_source_is_left_without_hypotheses(beam_size, data):
  """Whatever tokens are masked out (-inf), whole rows included: every source
  gets a hypothesis, every score is finite, and a hypothesis scored above
  the floor never takes a masked token."""
  count = 2
  logits = data.draw(
    st.lists(st.floats(-4, 4), min_size=count * VOCAB**2, max_size=count * VOCAB**2)
  )
  masked = data.draw(
    st.lists(st.booleans(), min_size=count * VOCAB**2, max_size=count * VOCAB**2)
  )
  shape = (count, VOCAB, VOCAB)
  tables = tables_of(np.reshape(logits, shape), np.reshape(masked, shape))
  search = DecodeSettings(bos_id=0, eos_id=4, max_length=3, beam_size=beam_size)
  _, hyps = bigram_search(tables, search)
  allowed = ~np.reshape(masked, shape)
  for s, (ids, scores) in enumerate(
    zip(hyps.ids.to_list(), hyps.scores.to_list(), strict=True)
  ):
    assert len(ids) >= 1 and np.all(np.isfinite(scores))
    assert np.all(np.diff(scores) <= 0)
    for tokens, score in zip(ids, scores, strict=True):
      path = [search.bos_id, *tokens.tolist()]
      if len(tokens) < search.max_length:
        path.append(search.eos_id)
      steps = list(zip(path[:-1], path[1:], strict=True))
      if score > FLOOR:
        assert all(allowed[s, a, b] for a, b in steps), (s, path, score)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_a_length_penalty_past_float32_raises(dtype):
  """The search scores in float32 (or wider) whatever the step's dtype. At
  ``max_length`` 3, ``(8 / 6) ** 400`` is inf there: a hypothesis of that
  length would score 0 and outrank every other; the search refuses it,
  naming both settings and the dtype."""
  settings = DecodeSettings(
    bos_id=0, eos_id=4, max_length=3, beam_size=2, length_penalty=400.0
  )

  def fixed(carry, tokens, statics):
    del statics
    scores = jnp.tile(jnp.arange(VOCAB, dtype=dtype), (tokens.shape[0], 1))
    return carry, jax.nn.log_softmax(scores)

  with pytest.raises(
    ValueError, match=r"`length_penalty` \(400.0\) and `max_length` \(3\).*float32"
  ):
    beam_search(fixed, jnp.zeros((2, 1)), settings)


def test_a_large_length_penalty_within_float32_passes():
  """``(8 / 6) ** 300`` is finite in float32: the search runs, scores finite."""
  settings = DecodeSettings(
    bos_id=0, eos_id=4, max_length=3, beam_size=2, length_penalty=300.0
  )
  hyps = beam_search(step, jnp.zeros((2, 1)), settings, static_inputs=jnp.zeros((2, 1)))
  for scores in hyps.scores.to_list():
    assert np.all(np.isfinite(scores)) and np.all(np.asarray(scores) < 0)
