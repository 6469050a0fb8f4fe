"""Ops whose data checks failed under plain `jit` (no `checkify`) and returned
silently wrong results: each now raises eagerly and, under `jit`, records a
`Fault` in its LoDTensor result or turns its float results NaN."""

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jaxlod import Buckets, Fault, LoDTensor
from jaxlod.ops import (
  Memory,
  as_memory,
  attend,
  dynamic_rnn,
  masked_attention,
  rank_table,
  sequence_cross_entropy,
  sequence_scatter,
  shrink_memory,
)

FAULTED = "This LoDTensor is faulted"
BATCH = Buckets.fixed(tokens=8, sequences=3, time=4)

# -- sequence_cross_entropy ---------------------------------------------------------


def _logits(lengths, classes=4):
  rows = sum(lengths)
  values = np.linspace(-1.0, 1.0, rows * classes, dtype=np.float32)
  return LoDTensor.from_lengths(values.reshape(rows, classes), [lengths], buckets=BATCH)


def _labels(ids, lengths):
  return LoDTensor.from_lengths(np.asarray(ids, np.int32), [lengths], buckets=BATCH)


_cross_entropy = jax.jit(sequence_cross_entropy, static_argnames="label_smoothing")


@pytest.mark.parametrize("bad", [4, 9, -1])
def test_cross_entropy_label_outside_the_classes_raises_eagerly(bad):
  logits, labels = _logits([2, 1]), _labels([1, bad, 0], [2, 1])
  with pytest.raises(
    ValueError,
    match=rf"Expected `labels` in \[0, 4\) \(the classes of `logits`\), got {bad} at "
    r"row 1\.",
  ):
    sequence_cross_entropy(logits, labels)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bad", [4, 9, -1])
def test_cross_entropy_label_outside_the_classes_is_a_fault_under_jit(bad, smoothing):
  logits = _logits([2, 1])
  good = _cross_entropy(logits, _labels([1, 3, 0], [2, 1]), label_smoothing=smoothing)
  assert int(good.faults) == 0
  assert np.all(np.isfinite(good.to_list()[0]))
  out = _cross_entropy(logits, _labels([1, bad, 0], [2, 1]), label_smoothing=smoothing)
  assert int(out.faults) == Fault.INPUT
  with pytest.raises(ValueError, match=FAULTED):
    out.to_list()


def test_cross_entropy_lod_mismatch_is_a_fault_under_jit():
  logits, labels = _logits([2, 1]), _labels([1, 3, 0], [1, 2])
  with pytest.raises(ValueError, match="Expected `labels` to have the LoD of `logits`"):
    sequence_cross_entropy(logits, labels)
  out = _cross_entropy(logits, labels)
  assert int(out.faults) == Fault.INPUT
  with pytest.raises(ValueError, match=r"faulted \(INPUT\)"):
    out.to_list()


def test_cross_entropy_ignores_padding_labels():
  logits = _logits([2, 1])
  labels = _labels([1, 3, 0], [2, 1])
  padded = np.asarray(labels.values).copy()
  padded[3:] = -7  # padding rows: never read
  labels = labels.with_values(padded)
  assert int(sequence_cross_entropy(logits, labels).faults) == 0
  assert int(_cross_entropy(logits, labels).faults) == 0


def test_cross_entropy_passes_on_the_faults_of_labels():
  logits, labels = _logits([2, 1]), _labels([1, 3, 0], [2, 1])
  labels = dataclasses.replace(labels, faults=jnp.int32(Fault.TABLE))
  out = _cross_entropy(logits, labels)
  assert int(out.faults) == Fault.TABLE


@settings(max_examples=30, deadline=None)
@given(
  lengths=st.lists(st.integers(0, 3), min_size=1, max_size=3).filter(
    lambda n: sum(n) <= 8
  ),
  data=st.data(),
)
def test_cross_entropy_faults_iff_a_real_label_is_outside(lengths, data):
  ids = data.draw(st.lists(st.integers(-2, 5), min_size=sum(lengths), max_size=8))
  ids = ids[: sum(lengths)]
  logits, labels = _logits(lengths), _labels(ids, lengths)
  outside = [i for i, v in enumerate(ids) if not 0 <= v < 4]
  out = _cross_entropy(logits, labels)
  if outside:
    with pytest.raises(ValueError, match=f"got {ids[outside[0]]} at row {outside[0]}"):
      sequence_cross_entropy(logits, labels)
    assert int(out.faults) == Fault.INPUT
  else:
    eager = sequence_cross_entropy(logits, labels)
    assert int(out.faults) == 0
    np.testing.assert_allclose(out.values, eager.values, rtol=1e-5, atol=1e-6)


# -- sequence_scatter -----------------------------------------------------------------


_scatter = jax.jit(sequence_scatter)


def _scatter_args(ids, index_lengths=(2, 2), update_lengths=(2, 2)):
  index = LoDTensor.from_lengths(np.asarray(ids, np.int32), [list(index_lengths)])
  updates = LoDTensor.from_lengths(
    np.arange(1.0, 5.0, dtype=np.float32), [list(update_lengths)]
  )
  return jnp.zeros((index.capacity.sequences[0], 3), jnp.float32), index, updates


def test_scatter_good_ids_stay_finite_under_jit():
  x, index, updates = _scatter_args([0, 2, 1, 1])
  out = _scatter(x, index, updates)
  np.testing.assert_array_equal(out[:2], [[1.0, 0.0, 2.0], [0.0, 7.0, 0.0]])


@pytest.mark.parametrize("bad", [3, -1])
def test_scatter_id_outside_the_width_is_nan_under_jit(bad):
  x, index, updates = _scatter_args([0, bad, 1, 1])
  with pytest.raises(ValueError, match=rf"position 1: id {bad} is outside \[0, 3\)"):
    sequence_scatter(x, index, updates)
  assert np.all(np.isnan(_scatter(x, index, updates)))


def test_scatter_lod_mismatch_is_nan_under_jit():
  x, index, updates = _scatter_args([0, 2, 1, 1], update_lengths=(1, 3))
  with pytest.raises(ValueError, match="Expected `updates` to have the LoD of `index`"):
    sequence_scatter(x, index, updates)
  assert np.all(np.isnan(_scatter(x, index, updates)))


# -- shrink_memory --------------------------------------------------------------------


def test_shrink_memory_dropping_active_rows_is_nan_under_jit():
  x = LoDTensor.from_lengths(np.zeros(6, np.float32), [[3, 2, 1]])
  table = rank_table(x)
  memory = {"h": jnp.ones((3, 2), jnp.float32), "ids": jnp.arange(3, dtype=jnp.int32)}
  with pytest.raises(ValueError, match="3 sequences are active at step 0"):
    shrink_memory(memory, table, 0, 2)
  run = jax.jit(shrink_memory, static_argnums=3)
  good = run(memory, table, 2, 2)
  np.testing.assert_array_equal(good["h"], np.ones((2, 2)))
  bad = run(memory, table, 0, 2)
  assert np.all(np.isnan(bad["h"]))
  np.testing.assert_array_equal(bad["ids"], [0, 1])  # ints pass unpoisoned


# -- dynamic_rnn ----------------------------------------------------------------------


def _step(h, x_t, _):
  h = jnp.tanh(h + x_t["a"].sum(-1) + x_t["b"].sum(-1))
  return h, h


def _rnn_input(lengths):
  rows = sum(lengths)
  values = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) / 10
  return LoDTensor.from_lengths(values, [lengths], buckets=BATCH)


@pytest.mark.parametrize("return_sequences", [False, True])
def test_dynamic_rnn_input_lod_mismatch_poisons_the_carry_under_jit(return_sequences):
  a, b = _rnn_input([3, 1, 2]), _rnn_input([1, 3, 2])
  run = jax.jit(
    lambda a, b: dynamic_rnn(
      _step,
      {"a": a, "b": b},
      init_carry=jnp.zeros(3),
      return_sequences=return_sequences,
    )
  )
  with pytest.raises(
    ValueError, match=r"Expected `inputs\[1\]` to have the LoD of `inputs\[0\]`"
  ):
    dynamic_rnn(_step, {"a": a, "b": b}, init_carry=jnp.zeros(3))
  good = run(a, a)
  bad = run(a, b)
  good_carry = good[1] if return_sequences else good
  bad_carry = bad[1] if return_sequences else bad
  assert np.all(np.isfinite(good_carry))
  assert np.all(np.isnan(bad_carry))
  if return_sequences:
    assert int(good[0].faults) == 0
    assert int(bad[0].faults) == Fault.INPUT


# -- masked_attention / attend --------------------------------------------------------


def _attention_args(lengths):
  scores = jnp.zeros((2, 2), jnp.float32)
  memory = jnp.arange(8.0, dtype=jnp.float32).reshape(2, 2, 2)
  return scores, memory, jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize(("lengths", "i", "bad"), [([5, 1], 0, 5), ([2, -1], 1, -1)])
def test_masked_attention_length_outside_the_capacity_raises_eagerly(lengths, i, bad):
  args = _attention_args(lengths)
  message = (
    rf"Expected `lengths` in \[0, 2\] \(the source capacity\), got {bad} at index {i}\."
  )
  with pytest.raises(ValueError, match=message):
    masked_attention(*args)
  with pytest.raises(ValueError, match=message):
    attend(args[0], Memory(args[1], args[2]))


@pytest.mark.parametrize("lengths", [[5, 1], [2, -1]])
def test_masked_attention_length_outside_the_capacity_is_nan_under_jit(lengths):
  scores, memory, good_lengths = _attention_args([2, 1])
  context, weights = jax.jit(masked_attention)(scores, memory, good_lengths)
  np.testing.assert_allclose(context, [[1.0, 2.0], [4.0, 5.0]], rtol=1e-5, atol=1e-6)
  bad = jnp.asarray(lengths, jnp.int32)
  context, weights = jax.jit(masked_attention)(scores, memory, bad)
  assert np.all(np.isnan(context))
  assert np.all(np.isnan(weights))
  # `attend`, at every decoder step, leaves the lengths to the Memory's
  # maker: `as_memory` turns its values NaN, and so the context.
  context, _ = jax.jit(lambda s, m, n: attend(s, as_memory(m, n)))(scores, memory, bad)
  assert np.all(np.isnan(context))
