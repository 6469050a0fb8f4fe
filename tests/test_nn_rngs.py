"""RNG streams passed to `apply` (``dropout``) reach cells inside the loop,
and every step draws afresh, as ``flax.linen.RNN`` splits its RNGs per step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.errors import InvalidRngError

from jaxlod import LoDTensor
from jaxlod.nn import AttentionDecoder, DotAttention, DynamicRNN


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
