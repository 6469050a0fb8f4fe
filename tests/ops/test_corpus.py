"""`jaxlod.ops.decode_corpus` (continuous refill) against `beam_search` of
each source alone: the same hypotheses (ids identical, scores equal up to
the rounding of another batch size) for greedy and beam search, with
per-source max lengths and length penalties, on random corpora (empty
sources, a corpus smaller than one refill, one many times the slots); the
order of the results; slot occupancy; one compilation per program; the
errors."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod.ops import DecodeSettings, _corpus, beam_search, decode_corpus

VOCAB, HIDDEN, BOS, EOS, CAP = 7, 8, 0, 1, 12
RNG = np.random.default_rng(0)
A = jnp.asarray(RNG.normal(size=(HIDDEN, HIDDEN)) / 3, jnp.float32)
E = jnp.asarray(RNG.normal(size=(VOCAB, HIDDEN)), jnp.float32)
M = jnp.asarray(RNG.normal(size=(VOCAB, HIDDEN)) / 2, jnp.float32)
OUT = jnp.asarray(RNG.normal(size=(HIDDEN, VOCAB)), jnp.float32)


def step(carry, tokens, memory):
  """A small recurrent model attending to nothing but its source's summary."""
  carry = jnp.tanh(carry @ A + E[tokens] + memory)
  return carry, jax.nn.log_softmax(carry @ OUT)


def encoder(refill):
  def encode(batch):
    """Sources are int arrays: the initial carry is their mean embedding, the
    memory their summed embeddings, the max length twice their length."""
    carry = np.zeros((refill, HIDDEN), np.float32)
    memory = np.zeros((refill, HIDDEN), np.float32)
    lengths = np.ones((refill,), np.int32)
    for i, src in enumerate(batch):
      if len(src):
        carry[i] = np.asarray(E)[src].mean(0)
        memory[i] = np.asarray(M)[src].sum(0)
      lengths[i] = min(CAP, 2 * len(src) + 1)
    return carry, memory, lengths

  return encode


@functools.partial(jax.jit, static_argnames="config")
def _search_one(carry, memory, lengths, config):
  return beam_search(step, carry, config, static_inputs=memory, max_lengths=lengths)


def alone(src, config):
  """`beam_search` of one source alone (one compilation for every source)."""
  hyps = _search_one(*encoder(1)([src]), config)
  return [np.asarray(h) for h in hyps.ids.to_list()[0]], np.asarray(
    hyps.scores.to_list()[0]
  )


def _check(corpus, config, **kw):
  stats = {}
  got = list(
    decode_corpus(
      step,
      encoder(kw.get("refill") or max(1, kw["slots"] // 4)),
      corpus,
      config,
      stats=stats,
      **kw,
    )
  )
  assert len(got) == len(corpus)
  for src, (ids, scores) in zip(corpus, got, strict=True):
    want_ids, want_scores = alone(src, config)
    assert [h.tolist() for h in ids] == [h.tolist() for h in want_ids], src
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
  return stats


SOURCES = st.lists(st.lists(st.integers(2, VOCAB - 1), max_size=5), max_size=14)
CONFIGS = {
  "greedy": DecodeSettings(bos_id=BOS, eos_id=EOS, max_length=CAP),
  "beam": DecodeSettings(
    bos_id=BOS, eos_id=EOS, max_length=CAP, beam_size=3, length_penalty=0.6
  ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_refill_equals_each_source_alone(name):
  @settings(max_examples=5, deadline=None)
  @given(SOURCES)
  def check(corpus):
    _check(
      [np.asarray(s, np.int32) for s in corpus],
      CONFIGS[name],
      slots=4,
      refill=2,
      chunk=3,
    )

  check()


def test_a_corpus_many_times_the_slots_keeps_them_full():
  lengths = RNG.integers(0, 6, size=60)
  corpus = [RNG.integers(2, VOCAB, size=n).astype(np.int32) for n in lengths]
  stats = _check(corpus, CONFIGS["beam"], slots=8, refill=2, chunk=2)
  assert stats["occupancy"] > 0.7, stats


def test_an_empty_corpus_yields_nothing():
  stats = {}
  assert (
    list(decode_corpus(step, encoder(1), [], CONFIGS["greedy"], slots=2, stats=stats))
    == []
  )
  assert stats["chunks"] == 0


def test_a_source_beyond_the_capacity_names_its_index():
  def encode(batch):
    carry, memory, lengths = encoder(2)(batch)
    lengths[: len(batch)] = [3 if len(s) < 4 else CAP + 1 for s in batch]
    return carry, memory, lengths

  corpus = [np.asarray([2], np.int32)] * 3 + [np.asarray([2] * 5, np.int32)]
  results = decode_corpus(step, encode, corpus, CONFIGS["greedy"], slots=2, refill=2)
  with pytest.raises(ValueError, match=r"got 13 for source 3 of the corpus"):
    list(results)


def test_bad_arguments_raise_before_reading():
  def never():
    raise AssertionError("read")
    yield

  with pytest.raises(ValueError, match=r"Expected `refill` in \[1, 2\]"):
    decode_corpus(step, encoder(3), never(), CONFIGS["greedy"], slots=2, refill=3)
  with pytest.raises(ValueError, match=r"Expected `slots` .*got 0"):
    decode_corpus(step, encoder(1), never(), CONFIGS["greedy"], slots=0)


def test_a_step_without_static_inputs_and_a_partial_step():
  """No static inputs (``None``); a `jax.tree_util.Partial` step passes its
  arrays as arguments: new arrays compile nothing new."""

  def bare(carry, tokens, static, out):
    del static
    carry = jnp.tanh(carry @ A + E[tokens])
    return carry, jax.nn.log_softmax(carry @ out)

  def encode(batch):
    carry = np.zeros((2, HIDDEN), np.float32)
    for i, src in enumerate(batch):
      carry[i] = np.asarray(E)[src].sum(0)
    return carry, None, None

  corpus = [np.asarray(s, np.int32) for s in ([2, 3], [4], [], [5, 6, 2])]
  config = CONFIGS["beam"]
  advance = _corpus._programs(config, 4, None, "data").advance
  runs, sizes = [], []
  for out in (OUT, OUT * 2):
    step_fn = jax.tree_util.Partial(bare, out=out)
    runs.append(list(decode_corpus(step_fn, encode, corpus, config, slots=2, refill=2)))
    sizes.append(advance._cache_size())
  assert sizes[0] == sizes[1]
  for src, (ids, scores) in zip(corpus, runs[0], strict=True):
    carry, _, _ = encode([src])
    hyps = beam_search(
      functools.partial(bare, out=OUT), carry[:1], config, static_inputs=None
    )
    assert [h.tolist() for h in ids] == [h.tolist() for h in hyps.ids.to_list()[0]]
    np.testing.assert_allclose(scores, hyps.scores.to_list()[0], rtol=1e-5, atol=1e-5)


def test_a_mesh_of_other_processes_or_axes_raises():
  mesh = jax.make_mesh((1,), ("data",))
  with pytest.raises(ValueError, match="Expected `axis` to name an axis of `mesh`"):
    decode_corpus(step, encoder(1), [], CONFIGS["greedy"], slots=1, mesh=mesh, axis="x")
  with pytest.raises(TypeError, match="Expected `mesh` to be a jax.sharding.Mesh"):
    decode_corpus(step, encoder(1), [], CONFIGS["greedy"], slots=1, mesh="data")


def test_sources_are_read_as_slots_free_up():
  """A long corpus streams: when a source's results come out, at most the
  slots, one refill and the finished sources waiting for an earlier one
  have been read past it (bounded memory for any corpus length)."""
  read = [0]

  def corpus():
    for n in itertools.cycle([0, 3, 1, 5, 2]):
      read[0] += 1
      yield np.full((n,), 2, np.int32)

  results = decode_corpus(
    step, encoder(2), corpus(), CONFIGS["greedy"], slots=4, refill=2
  )
  ahead = []
  for i, _ in zip(range(300), results, strict=False):
    ahead.append(read[0] - (i + 1))
  assert max(ahead) <= 4 + 2 + 4, max(ahead)
