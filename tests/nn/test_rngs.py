"""RNG streams passed to `apply` (``dropout``) reach cells inside the loop,
and every step draws afresh, as ``flax.linen.RNN`` splits its RNGs per step;
in decoding too (`generate`, `ensemble_generate`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.errors import InvalidRngError

import jaxlod.nn.nnx as nnx_layers
from jaxlod import LoDTensor
from jaxlod.nn import (
  AttentionDecoder,
  DotAttention,
  DynamicRNN,
  Seq2Seq,
  ensemble_generate,
)
from jaxlod.ops import DecodeSettings


class DropCell(nn.Module):
  """Outputs its dropped-out input; the carry counts nothing."""

  @nn.compact
  def __call__(self, carry, x):
    return carry, nn.Dropout(0.5, deterministic=False)(x)

  def initialize_carry(self, rng, shape):
    del rng
    return jnp.zeros(shape)


X = LoDTensor.from_sequences([np.ones((3, 64)), np.ones((1, 64)), np.ones((2, 64))])


def run(key):
  rnn = DynamicRNN(DropCell())
  params = rnn.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, X)
  return np.asarray(rnn.apply(params, X, rngs={"dropout": key}).values)


def test_dropout_inside_the_loop_gets_the_apply_rngs():
  a, b, c = run(jax.random.key(2)), run(jax.random.key(2)), run(jax.random.key(3))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert set(np.unique(a)) <= {0.0, 2.0}  # inverted dropout of ones


def test_every_step_draws_a_fresh_mask():
  rows = run(jax.random.key(2))[:3]  # the three steps of sequence 0
  for i in range(3):
    for j in range(i):
      assert not np.array_equal(rows[i], rows[j]), (i, j)


def test_without_the_stream_flax_says_which_is_missing():
  rnn = DynamicRNN(DropCell())
  params = rnn.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, X)
  with pytest.raises(InvalidRngError, match=r'needs PRNG for "dropout"'):
    rnn.apply(params, X)


class DropGRU(nn.Module):
  features: int = 8

  @nn.compact
  def __call__(self, carry, x):
    return nn.GRUCell(self.features)(carry, nn.Dropout(0.5, deterministic=False)(x))

  def initialize_carry(self, rng, shape):
    del rng
    return jnp.zeros((*shape[:-1], self.features))


def test_attention_decoder_cells_get_the_rngs_too():
  memory = LoDTensor.from_sequences([np.ones((4, 8)), np.ones((2, 8))])
  tgt = LoDTensor.from_sequences([np.ones((3, 5)), np.ones((2, 5))])
  decoder = AttentionDecoder(DropGRU(), DotAttention())
  params = decoder.init(
    {"params": jax.random.key(0), "dropout": jax.random.key(1)}, tgt, memory
  )
  outs = [
    np.asarray(decoder.apply(params, tgt, memory, rngs={"dropout": k}).values)
    for k in (jax.random.key(2), jax.random.key(2), jax.random.key(3))
  ]
  np.testing.assert_array_equal(outs[0], outs[1])
  assert not np.array_equal(outs[0], outs[2])


# -- decoding: generate and ensemble_generate ---------------------------------------


class DropLSTM(nn.Module):
  """An LSTM cell whose input goes through dropout (the issue's cell)."""

  @nn.compact
  def __call__(self, carry, x):
    return nn.LSTMCell(4)(carry, nn.Dropout(0.5, deterministic=False)(x))

  def initialize_carry(self, rng, shape):
    return nn.LSTMCell(4, parent=None).initialize_carry(rng, shape)

  num_feature_axes = 1


SRC = LoDTensor.from_sequences([np.array([3, 1, 4]), np.array([1, 5])])
TGT = LoDTensor.from_sequences([np.array([0, 2]), np.array([0, 6, 2])])
SETTINGS = DecodeSettings(bos_id=0, eos_id=1, max_length=4, beam_size=2)


def drop_seq2seq():
  model = Seq2Seq(
    src_vocab=8,
    tgt_vocab=9,
    embed_dim=5,
    encoder=DynamicRNN(DropLSTM()),
    decoder=AttentionDecoder(DropLSTM(), DotAttention()),
  )
  keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  return model, model.init(keys, SRC, TGT)


def as_lists(hyps):
  ids = [[h.tolist() for h in hs] for hs in hyps.ids.to_list()]
  return ids, [s.tolist() for s in hyps.scores.to_list()]


@jax.jit
def generate(params, key):
  model, _ = drop_seq2seq()
  return model.apply(params, SRC, SETTINGS, method="generate", rngs={"dropout": key})


def test_generate_gets_the_apply_rngs():
  # Before: `Seq2Seq.member()` applied the model with its variables only.
  _, params = drop_seq2seq()
  a, b, c = (as_lists(generate(params, jax.random.key(k))) for k in (2, 2, 3))
  assert a == b
  assert a != c
  assert [len(h) for h in a[0]] == [SETTINGS.results] * 2


def test_generate_without_the_stream_flax_says_which_is_missing():
  model, params = drop_seq2seq()
  with pytest.raises(InvalidRngError, match=r'needs PRNG for "dropout"'):
    model.apply(params, SRC, SETTINGS, method="generate")


def test_ensemble_generate_takes_rngs():
  model, params = drop_seq2seq()
  key = jax.random.key(2)
  alone = ensemble_generate([(model, params)], SRC, SETTINGS, rngs={"dropout": key})
  # One member is `generate` (eager here, jitted there: scores up to rounding).
  ids, scores = as_lists(alone)
  want_ids, want_scores = as_lists(generate(params, key))
  assert ids == want_ids
  np.testing.assert_allclose(sum(scores, []), sum(want_scores, []), rtol=1e-5)
  pair = ensemble_generate([(model, params)] * 2, SRC, SETTINGS, rngs={"dropout": key})
  assert [len(h) for h in pair.ids.to_list()] == [SETTINGS.results] * 2
  with pytest.raises(InvalidRngError, match=r'needs PRNG for "dropout"'):
    ensemble_generate([(model, params)], SRC, SETTINGS)


@pytest.mark.parametrize(
  "rngs",
  [jax.random.key(0), {"dropout": 3}, {"dropout": np.zeros(2, np.float32)}],
  ids=["a key", "an int", "floats"],
)
def test_ensemble_rngs_must_be_a_dict_of_keys(rngs):
  model, params = drop_seq2seq()
  with pytest.raises(TypeError, match=r"Expected `rngs` to (be a dict|map stream)"):
    ensemble_generate([(model, params)], SRC, SETTINGS, rngs=rngs)


def test_nnx_ensemble_generate_takes_no_rngs():
  rngs = nnx.Rngs(0)
  encoder = nnx_layers.DynamicRNN(nnx.LSTMCell(5, 4, rngs=rngs))
  cell = nnx.LSTMCell(5, 4, rngs=rngs)
  decoder = nnx_layers.AttentionDecoder(cell, nnx_layers.DotAttention())
  model = nnx_layers.Seq2Seq(8, 9, 5, encoder, decoder, features=4, rngs=rngs)
  with pytest.raises(ValueError, match=r"Expected `rngs` to be None: NNX members"):
    nnx_layers.ensemble_generate([model], SRC, SETTINGS, rngs={"dropout": 0})
