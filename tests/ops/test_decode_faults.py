"""Decoding's fault record: under `jit` without checkify, a check that would
raise eagerly (and fails under checkify) sets `Fault.INPUT` in both
LoDTensors of the `Hypotheses`, so host reads of them raise; sound
decodings stay at 0."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify

from jaxlod import Buckets, Fault, LoDTensor
from jaxlod.ops import DecodeSettings, beam_search
from tests.ops.test_decode_inputs import model_and_params as decode_inputs_model

VOCAB, COUNT = 5, 4
SETTINGS = DecodeSettings(bos_id=0, eos_id=4, max_length=3, beam_size=2)
FAULTED = r"This LoDTensor is faulted \(INPUT\)"


def step(carry, tokens, statics):
  """Fixed log-probabilities, the same after every token."""
  del tokens, statics
  scores = jnp.tile(jnp.arange(VOCAB, dtype=jnp.float32), (carry.shape[0], 1))
  return carry, jax.nn.log_softmax(scores)


@functools.partial(jax.jit, static_argnames=("checked",))
def decode(max_lengths, num_sources, checked=False):
  """`beam_search` of `COUNT` sources, checkified when `checked`."""

  def run(max_lengths, num_sources):
    init = jnp.zeros((COUNT, 1))
    return beam_search(
      step, init, SETTINGS, max_lengths=max_lengths, num_sources=num_sources
    )

  return (checkify.checkify(run) if checked else run)(max_lengths, num_sources)


def assert_faulted(hyps):
  for tensor in hyps:
    assert int(tensor.faults) == Fault.INPUT
    with pytest.raises(ValueError, match=FAULTED):
      tensor.to_list()


def test_a_max_length_above_the_settings_is_a_fault_under_jit():
  """The issue's case: ``max_lengths`` 5 above ``settings.max_length`` 3 was
  clipped to 3, with `faults` 0."""
  hyps = decode(jnp.array([3, 5, 2, 1]), jnp.int32(COUNT))
  assert_faulted(hyps)
  err, _ = decode(jnp.array([3, 5, 2, 1]), jnp.int32(COUNT), checked=True)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"every `max_lengths` <= `settings.max_length` \(3\); source 1 has 5\.",
  ):
    err.throw()


def test_a_max_length_below_one_is_a_fault_under_jit():
  assert_faulted(decode(jnp.array([3, 0, 2, 1]), jnp.int32(COUNT)))


def test_num_sources_outside_the_count_is_a_fault_under_jit():
  lengths = jnp.full((COUNT,), 3)
  for n in (-1, COUNT + 1):
    assert_faulted(decode(lengths, jnp.int32(n)))
  err, _ = decode(lengths, jnp.int32(COUNT + 1), checked=True)
  with pytest.raises(checkify.JaxRuntimeError, match=r"`num_sources` in \[0, 4\]"):
    err.throw()


def test_static_inputs_of_different_counts_are_a_fault_under_jit():
  buckets = Buckets.fixed(tokens=4, sequences=2, time=3)
  a = LoDTensor.from_lengths(np.ones(3, np.float32), [[2, 1]], buckets=buckets)
  b = LoDTensor.from_lengths(np.ones(3, np.float32), [[3]], buckets=buckets)

  def run(a, b):
    return beam_search(step, jnp.zeros((2, 1)), SETTINGS, static_inputs=(a, b))

  assert_faulted(jax.jit(run)(a, b))
  with pytest.raises(ValueError, match=r"LoDTensor 1 differs from LoDTensor 0\."):
    run(a, b)


def test_sound_decodings_are_not_faulted():
  hyps = decode(jnp.array([3, 1, 2, 3]), jnp.int32(3))
  assert int(hyps.ids.faults) == 0 and int(hyps.scores.faults) == 0
  assert hyps.ids.recursive_lengths()[0] == [2, 2, 2]


@settings(max_examples=25)
@given(
  lengths=st.lists(st.integers(-2, 6), min_size=COUNT, max_size=COUNT),
  num_sources=st.integers(-1, COUNT + 1),
)
def test_faults_exactly_when_checkify_reports(lengths, num_sources):
  """Whatever `max_lengths` and `num_sources`: the results are faulted
  exactly when a check fails (only real sources' max lengths are checked),
  and checkify changes nothing else."""
  lengths, n = jnp.array(lengths, jnp.int32), jnp.int32(num_sources)
  err, checked = decode(lengths, n, checked=True)
  hyps = decode(lengths, n)
  real = min(max(num_sources, 0), COUNT)
  bad = not 0 <= num_sources <= COUNT or any(
    not 1 <= m <= SETTINGS.max_length for m in np.asarray(lengths)[:real]
  )
  assert (err.get() is not None) == bad
  assert int(hyps.ids.faults) == int(hyps.scores.faults) == (Fault.INPUT if bad else 0)
  assert int(checked.ids.faults) == int(hyps.ids.faults)
  if not bad:
    assert hyps.ids.recursive_lengths() == checked.ids.recursive_lengths()
    np.testing.assert_array_equal(hyps.scores.values, checked.scores.values)


# -- Seq2Seq.generate ----------------------------------------------------------------


@functools.cache
def model_and_params():
  """The model and parameters of tests/ops/test_decode_inputs.py, made once
  and eagerly (`generate` reads them under `jit`)."""
  model, params, _ = decode_inputs_model()
  return model, params


MODEL_SETTINGS = DecodeSettings(bos_id=0, eos_id=1, max_length=4, beam_size=2)


def generate(src, max_lengths):
  """`Seq2Seq.generate` under `jit`, the parameters made eagerly."""
  return _generate(model_and_params()[1], src, max_lengths)


@jax.jit
def _generate(params, src, max_lengths):
  model, _ = model_and_params()
  return model.apply(
    params,
    src,
    method=model.generate,
    settings=MODEL_SETTINGS,
    max_lengths=max_lengths,
  )


def test_generate_records_a_max_length_above_the_settings():
  src = LoDTensor.from_sequences([np.array([3, 1, 4]), np.array([1, 5])])
  assert_faulted(generate(src, jnp.array([4, 9])))
  sound = generate(src, jnp.array([4, 2]))
  assert int(sound.ids.faults) == 0
  assert [len(h) for h in sound.ids.to_list()] == [2, 2]


@pytest.mark.parametrize("bad", [8, -1])
def test_generate_records_a_source_id_outside_the_vocabulary(bad):
  """The issue's case: an id outside ``[0, src_vocab)`` gave a floor-score
  hypothesis (8: NaN embeddings) or an ordinary-looking one (-1: the last
  embedding), with `faults` 0."""
  src = LoDTensor.from_sequences([np.array([3, 1, bad]), np.array([1, 5])])
  assert_faulted(generate(src, jnp.array([4, 4])))


@pytest.mark.parametrize("where", ["src", "tgt_in"])
def test_teacher_forcing_records_an_id_outside_the_vocabulary(where):
  """The same check on the teacher-forced path: the logits carry the fault."""
  model, params = model_and_params()
  ids = {
    "src": LoDTensor.from_sequences([np.array([3, 1, 4]), np.array([1, 5])]),
    "tgt_in": LoDTensor.from_sequences([np.array([0, 2]), np.array([0, 6, 2])]),
  }
  logits = jax.jit(model.apply)(params, ids["src"], ids["tgt_in"])
  assert int(logits.faults) == 0
  bad = ids[where].values.at[1].set(-1)
  ids[where] = ids[where].with_values(bad)
  logits = jax.jit(model.apply)(params, ids["src"], ids["tgt_in"])
  assert int(logits.faults) == Fault.INPUT
  with pytest.raises(ValueError, match=FAULTED):
    logits.to_list()
