"""Seq2Seq.generate_corpus and ensemble_generate_corpus (Linen and NNX):
continuous refill over a corpus equals `Seq2Seq.generate` (and
`ensemble_generate`) of each source alone, for greedy and beam search with
per-source max lengths and a length penalty, on random corpora with empty
sources; one compilation per program across calls; the errors."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.timing import xla_compiles
from jaxlod import Buckets, LoDTensor
from jaxlod.nn import ensemble_generate, ensemble_generate_corpus
from jaxlod.nn import nnx as twin
from tests.nn.test_generate import BEAM, GREEDY, MAX_LENGTH
from tests.nn.test_seq2seq import SRC_VOCAB, TGT_VOCAB, _seq2seq, _seq2seq_params

CAPACITY = 6
ONE = Buckets.fixed(tokens=CAPACITY, sequences=1, time=CAPACITY)
SEARCHES = {"greedy": GREEDY, "beam": BEAM}
SOURCES = st.lists(
  st.lists(st.integers(0, SRC_VOCAB - 1), max_size=CAPACITY), max_size=9
)


def max_length(ids):
  return min(MAX_LENGTH, len(ids) + 2)


@functools.partial(jax.jit, static_argnames="search")
def _alone(members, src, limits, search):
  models = [_seq2seq(hidden=h) for h in (4, 6)][: len(members)]
  return ensemble_generate(
    list(zip(models, members, strict=True)), src, search, max_lengths=limits
  )


def alone(members, source, search):
  """`ensemble_generate` of one source alone (one compilation per search)."""
  src = LoDTensor.from_sequences(
    [np.asarray(source, np.int32)], buckets=ONE, dtype=np.int32
  )
  hyps = _alone(tuple(members), src, np.array([max_length(source)], np.int32), search)
  return hyps.ids.to_list()[0], np.asarray(hyps.scores.to_list()[0])


def assert_same(got, want):
  assert len(got) == len(want)
  for (ids, scores), (want_ids, want_scores) in zip(got, want, strict=True):
    assert [h.tolist() for h in ids] == [list(h) for h in want_ids]
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


@functools.cache
def params(hidden):
  if hidden == 4:
    return _seq2seq_params()
  src = LoDTensor.from_sequences([np.array([1, 2], np.int32)], dtype=np.int32)
  tgt = LoDTensor.from_sequences([np.array([0, 2], np.int32)], dtype=np.int32)
  return jax.jit(_seq2seq(hidden=hidden).init)(jax.random.key(1), src, tgt)


def linen_corpus(corpus, search, **kw):
  return list(
    _seq2seq().apply(
      params(4),
      corpus,
      search,
      method="generate_corpus",
      src_capacity=CAPACITY,
      max_length_fn=max_length,
      **kw,
    )
  )


@pytest.mark.parametrize("name", SEARCHES)
def test_refill_equals_generate_of_each_source_alone(name):
  search = SEARCHES[name]

  @settings(max_examples=4, deadline=None)
  @given(SOURCES)
  def check(corpus):
    got = linen_corpus(corpus, search, slots=3, refill=2, chunk=2)
    assert_same(got, [alone([params(4)], s, search) for s in corpus])

  check()


def test_a_corpus_far_larger_than_the_slots():
  rng = np.random.default_rng(0)
  corpus = [rng.integers(0, SRC_VOCAB, size=n) for n in rng.integers(0, 7, size=40)]
  stats = {}
  got = linen_corpus(corpus, BEAM, slots=4, refill=1, chunk=1, stats=stats)
  assert_same(got, [alone([params(4)], s, BEAM) for s in corpus])
  assert stats["occupancy"] > 0.8, stats


def test_the_programs_compile_once_across_calls():
  """A second corpus of the same sizes, with other parameters, compiles
  nothing: not the encoder, nor the decoder's four programs."""
  corpus = [[1, 2, 3], [], [4]]
  linen_corpus(corpus, BEAM, slots=2, refill=1, chunk=2)
  other = jax.tree.map(lambda a: a * 1.5, params(4))
  loaded = []  # programs another worker compiled, read from the disk cache

  def listener(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
      loaded.append(event)

  jax.monitoring.register_event_listener(listener)
  try:
    with xla_compiles() as compiles:
      list(
        _seq2seq().apply(
          other,
          corpus[::-1],
          BEAM,
          method="generate_corpus",
          src_capacity=CAPACITY,
          slots=2,
          refill=1,
          chunk=2,
          max_length_fn=max_length,
        )
      )
  finally:
    jax.monitoring.unregister_event_listener(listener)
  assert not compiles and not loaded, (compiles, loaded)


def test_an_ensemble_of_two_members():
  corpus = [[1, 2, 3], [], [4, 4, 5, 6, 1, 2], [0]]
  members = [(_seq2seq(hidden=h), params(h)) for h in (4, 6)]
  got = list(
    ensemble_generate_corpus(
      members,
      corpus,
      BEAM,
      src_capacity=CAPACITY,
      slots=2,
      refill=1,
      max_length_fn=max_length,
    )
  )
  assert_same(got, [alone([params(4), params(6)], s, BEAM) for s in corpus])


def _nnx_model(hidden, seed):
  rngs = nnx.Rngs(seed)
  return twin.Seq2Seq(
    SRC_VOCAB,
    TGT_VOCAB,
    3,
    twin.DynamicRNN(nnx.LSTMCell(3, 4, rngs=rngs)),
    twin.AttentionDecoder(nnx.LSTMCell(3, hidden, rngs=rngs), twin.DotAttention()),
    features=4,
    rngs=rngs,
  )


def test_nnx_equals_each_source_alone_and_an_ensemble():
  corpus = [[1, 2, 3], [], [4, 4, 5, 6, 1, 2], [0], [5, 5]]
  members = [_nnx_model(4, 0), _nnx_model(4, 1)]
  got = list(
    members[0].generate_corpus(
      corpus, BEAM, src_capacity=CAPACITY, slots=2, refill=1, max_length_fn=max_length
    )
  )
  pair = list(
    twin.ensemble_generate_corpus(
      members, corpus, BEAM, src_capacity=CAPACITY, slots=3, max_length_fn=max_length
    )
  )
  for search, one in ((got, members[:1]), (pair, members)):
    want = []
    for s in corpus:
      src = LoDTensor.from_sequences(
        [np.asarray(s, np.int32)], buckets=ONE, dtype=np.int32
      )
      hyps = twin.ensemble_generate(
        one, src, BEAM, max_lengths=np.array([max_length(s)], np.int32)
      )
      want.append((hyps.ids.to_list()[0], np.asarray(hyps.scores.to_list()[0])))
    assert_same(search, want)


def test_an_empty_corpus_yields_nothing():
  assert linen_corpus([], BEAM, slots=2) == []


@pytest.mark.parametrize(
  ("source", "match"),
  [
    ([1] * (CAPACITY + 1), r"at most 6 ids \(`src_capacity`\), got 7 for source 2"),
    ([1, SRC_VOCAB], rf"source 2 of the corpus in \[0, {SRC_VOCAB}\).*got {SRC_VOCAB}"),
    ([[1, 2]], r"int ids \[length\], got int64\[1, 2\] for source 2"),
    ([0.5], r"int ids \[length\], got float64\[1\] for source 2"),
  ],
)
def test_a_bad_source_raises_naming_its_index(source, match):
  corpus = iter([[1], [2], source, [3]])
  with pytest.raises(ValueError, match=match):
    linen_corpus(corpus, GREEDY, slots=1)


def test_bad_arguments_raise_before_reading():
  def never():
    raise AssertionError("read")
    yield

  model = _seq2seq()
  for kw, error, match in [
    ({"slots": 0}, ValueError, "slots"),
    ({"src_capacity": 0}, ValueError, "src_capacity"),
    ({"max_length_fn": 3}, TypeError, "max_length_fn"),
    ({"refill": 5}, ValueError, "refill"),
  ]:
    args = {"src_capacity": CAPACITY, "slots": 2, **kw}
    with pytest.raises(error, match=match):
      model.apply(params(4), never(), BEAM, method="generate_corpus", **args)
  with pytest.raises(TypeError, match="sources"):
    model.apply(params(4), 3, BEAM, method="generate_corpus", src_capacity=2, slots=1)
  with pytest.raises(ValueError, match="src_vocab"):
    other = _seq2seq().clone(src_vocab=SRC_VOCAB + 1)
    ensemble_generate_corpus(
      [(model, params(4)), (other, params(4))], [], BEAM, src_capacity=2, slots=1
    )
  with pytest.raises(ValueError, match="needs parameters"):
    model.init(
      jax.random.key(0), [], BEAM, method="generate_corpus", src_capacity=2, slots=1
    )


BAD_MAX_LENGTHS = [
  (2.7, TypeError, r"`max_length_fn` to return an int, got 2\.7 for source 2 "),
  (None, TypeError, r"`max_length_fn` to return an int, got None for source 2 "),
  ([3], TypeError, r"`max_length_fn` to return an int, got \[3\] for source 2 "),
  (True, TypeError, r"`max_length_fn` to return an int, got True for source 2 "),
  (np.float32(3), TypeError, r"to return an int, got np\.float32\(3\.0\) for source 2"),
  (0, ValueError, rf"`max_length_fn`.* in \[1, {MAX_LENGTH}\].*got 0 for source 2 "),
  (2**40, ValueError, rf"in \[1, {MAX_LENGTH}\].*got {2**40} for source 2 "),
  (MAX_LENGTH + 1, ValueError, rf"got {MAX_LENGTH + 1} for source 2 of the corpus"),
]


def _bad_at_source_2(value):
  return lambda ids: value if ids.tolist() == [3] else 2


@pytest.mark.parametrize(("value", "error", "match"), BAD_MAX_LENGTHS)
def test_a_bad_max_length_raises_naming_max_length_fn_and_the_source(
  value, error, match
):
  corpus = [[1], [2], [3], [4]]
  bad = _bad_at_source_2(value)
  with pytest.raises(error, match=match):
    list(
      _seq2seq().apply(
        params(4),
        corpus,
        GREEDY,
        method="generate_corpus",
        src_capacity=CAPACITY,
        slots=1,
        max_length_fn=bad,
      )
    )
  with pytest.raises(error, match=match):
    list(
      _nnx_model(4, 0).generate_corpus(
        corpus, GREEDY, src_capacity=CAPACITY, slots=2, refill=2, max_length_fn=bad
      )
    )


def test_nnx_decodes_with_the_state_at_the_call():
  corpus = [[1, 2, 3], [4]]
  want = list(
    _nnx_model(4, 0).generate_corpus(corpus, GREEDY, src_capacity=CAPACITY, slots=2)
  )
  model = _nnx_model(4, 0)
  corpus_iter = model.generate_corpus(corpus, GREEDY, src_capacity=CAPACITY, slots=2)
  # An optimizer step in place, after the call and before the first read.
  model.output.bias[...] = model.output.bias[...].at[1].set(1e3)
  got = list(corpus_iter)
  assert_same(got, want)
  changed = list(model.generate_corpus(corpus, GREEDY, src_capacity=CAPACITY, slots=2))
  assert [ids[0].tolist() for ids, _ in changed] != [ids[0].tolist() for ids, _ in want]

  pair = [_nnx_model(4, 0), _nnx_model(4, 1)]
  want = list(
    twin.ensemble_generate_corpus(pair, corpus, GREEDY, src_capacity=CAPACITY, slots=2)
  )
  corpus_iter = twin.ensemble_generate_corpus(
    pair, corpus, GREEDY, src_capacity=CAPACITY, slots=2
  )
  for member in pair:
    member.output.bias[...] = member.output.bias[...].at[1].set(1e3)
  assert_same(list(corpus_iter), want)
