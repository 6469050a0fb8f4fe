"""Decoding never drops a source silently: NaN scores rank last (and fail a
checkify check), ids outside the vocabulary raise."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
