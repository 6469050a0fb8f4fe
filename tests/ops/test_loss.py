"""sequence_cross_entropy against NumPy, with its gradients and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import sequence_cross_entropy
from tests.helpers import assert_close

BUCKETS = Buckets.fixed(tokens=12, sequences=4, time=5)
LENGTHS = [3, 0, 5, 1]
VOCAB = 6


def _pair(seed=0, lengths=LENGTHS):
  rng = np.random.default_rng(seed)
  logits = [rng.normal(size=(n, VOCAB)).astype(np.float32) for n in lengths]
  labels = [rng.integers(0, VOCAB, size=n) for n in lengths]
  return (
    LoDTensor.from_sequences(logits, buckets=BUCKETS),
    LoDTensor.from_sequences(labels, buckets=BUCKETS, dtype=np.int32),
  )


def _reference(logits, labels, smoothing):
  x = np.asarray(logits.values, np.float64)[: int(logits.num_rows)]
  y = np.asarray(labels.values)[: int(labels.num_rows)]
  logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
  target = np.eye(VOCAB)[y] * (1 - smoothing) + smoothing / VOCAB
  return -(target * logp).sum(-1)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_matches_numpy_and_zeroes_padding_rows(smoothing):
  logits, labels = _pair()
  losses = jax.jit(sequence_cross_entropy, static_argnames="label_smoothing")(
    logits, labels, label_smoothing=smoothing
  )
  rows = int(logits.num_rows)
  assert losses.recursive_lengths() == [LENGTHS]
  assert_close(losses.values[:rows], _reference(logits, labels, smoothing), rtol=1e-5)
  assert np.all(np.asarray(losses.values)[rows:] == 0.0)


def test_gradient_is_softmax_minus_target_on_real_rows_only():
  logits, labels = _pair(seed=1)
  grads = jax.grad(
    lambda v: sequence_cross_entropy(logits.with_values(v), labels).values.sum()
  )(logits.values)
  rows = int(logits.num_rows)
  probs = jax.nn.softmax(logits.values[:rows])
  expected = probs - jax.nn.one_hot(labels.values[:rows], VOCAB)
  assert_close(grads[:rows], expected, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(grads)[rows:] == 0.0)


def test_column_labels_and_bfloat16_logits():
  logits, labels = _pair(seed=2)
  want = sequence_cross_entropy(logits, labels)
  column = labels.with_values(labels.values[:, None])
  assert_close(sequence_cross_entropy(logits, column).values, want.values)
  half = sequence_cross_entropy(
    logits.with_values(logits.values.astype(jnp.bfloat16)), labels
  )
  assert half.values.dtype == jnp.float32


def test_errors():
  logits, labels = _pair()
  with pytest.raises(TypeError, match=r"Expected `logits` to be a LoDTensor"):
    sequence_cross_entropy(logits.values, labels)
  with pytest.raises(TypeError, match=r"`labels.values` to have an integer dtype"):
    sequence_cross_entropy(logits, labels.with_values(labels.values.astype(float)))
  with pytest.raises(TypeError, match=r"`logits.values` to have a float dtype"):
    sequence_cross_entropy(labels.with_values(jnp.zeros((12, VOCAB), int)), labels)
  with pytest.raises(ValueError, match=r"`logits.values` to have shape"):
    sequence_cross_entropy(logits.with_values(logits.values[:, :, None]), labels)
  other = LoDTensor.from_sequences(
    [np.zeros(n, np.int32) for n in LENGTHS],
    buckets=Buckets.fixed(tokens=16, sequences=4, time=5),
  )
  with pytest.raises(ValueError, match=r"Expected `labels` with the capacities"):
    sequence_cross_entropy(logits, other)
  with pytest.raises(ValueError, match=r"`label_smoothing` in \[0, 1\], got 1.5"):
    sequence_cross_entropy(logits, labels, label_smoothing=1.5)
  shifted = _pair(lengths=[2, 1, 5, 1])[1]
  with pytest.raises(
    ValueError, match=r"Expected `labels` to have the LoD of `logits`"
  ):
    sequence_cross_entropy(logits, shifted)
  err, _ = checkify.checkify(jax.jit(sequence_cross_entropy))(logits, shifted)
  with pytest.raises(checkify.JaxRuntimeError, match=r"the LoD of `logits`"):
    err.throw()
