"""DecodeSettings, beam_search (greedy for a beam of one) and ensemble_step:
against exhaustive search, a plain-Python reference of the beam rule and a
hand-written argmax loop; early exit, compaction, jit, and bad inputs."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from benchmarks.timing import xla_compiles
from jaxlod import Buckets, LoDTensor
from jaxlod.ops import (
  DecodeSettings,
  Hypotheses,
  beam_search,
  ensemble_step,
  length_normalized,
)

# -- a tiny recurrent model: vocab 4 (eos 0, bos 3), one row per source ------------

# `bos` must lie in the step's vocabulary; it differs from `eos`, so a loop that
# fed `eos` as the first input would decode other hypotheses than the references.
VOCAB, EOS, BOS, HIDDEN = 4, 0, 3, 3
_rng = np.random.default_rng(0)
EMBED = jnp.asarray(_rng.normal(size=(VOCAB, HIDDEN)), jnp.float32)
RECUR = jnp.asarray(_rng.normal(size=(HIDDEN, HIDDEN)), jnp.float32)
OUT = jnp.asarray(1.5 * _rng.normal(size=(HIDDEN, VOCAB)), jnp.float32)


def logits_step(h, tokens, static):
  """The model's unnormalized step: ``(h [b, HIDDEN], logits [b, VOCAB])``."""
  h = jnp.tanh(EMBED[tokens] + h @ RECUR + static)
  return h, h @ OUT


def step(h, tokens, static):
  h, logits = logits_step(h, tokens, static)
  return h, jax.nn.log_softmax(logits, axis=-1)


def sources(count: int, seed: int = 1):
  """``(init_carry [count, HIDDEN], static bias [count, HIDDEN])``."""
  rng = np.random.default_rng(seed)
  init = rng.normal(size=(count, HIDDEN)).astype(np.float32)
  bias = rng.normal(size=(count, HIDDEN)).astype(np.float32)
  return jnp.asarray(init), jnp.asarray(bias)


_step1 = jax.jit(step)


def prefix_table(h0, bias, max_length: int) -> dict[tuple, np.ndarray]:
  """Exhaustive: the next-token log-probs after every prefix of non-eos tokens
  shorter than `max_length`, for one source."""
  table, frontier = {}, [((), np.asarray(h0)[None])]
  while frontier:
    prefix, h = frontier.pop()
    last = prefix[-1] if prefix else BOS
    h, lp = _step1(h, jnp.array([last]), bias[None])
    table[prefix] = np.asarray(lp[0], np.float32)
    if len(prefix) + 1 < max_length:
      frontier += [(prefix + (v,), h) for v in range(VOCAB) if v != EOS]
  return table


def penalty(steps: int, alpha: float) -> np.float32:
  if alpha == 0:
    return np.float32(1)
  return np.float32(((np.float32(5) + np.float32(steps)) / np.float32(6)) ** alpha)


def every_logp(table, max_length: int):
  """Every hypothesis as (tokens, steps, logp)."""
  out = []
  for n in range(max_length + 1):
    for tokens in itertools.product(range(1, VOCAB), repeat=n):
      logp = np.float32(0)
      for i, v in enumerate(tokens):
        logp = np.float32(logp + table[tokens[:i]][v])
      if n < max_length:  # ended by eos
        logp, steps = np.float32(logp + table[tokens][EOS]), n + 1
      else:  # truncated
        steps = n
      out.append((tokens, steps, logp))
  return out


def every_hypothesis(table, max_length: int, alpha: float):
  """Every hypothesis as (tokens, its normalized score)."""
  return [
    (tokens, np.float32(logp / penalty(steps, alpha)))
    for tokens, steps, logp in every_logp(table, max_length)
  ]


def reference_beam(table, k, max_length, alpha, num_results, early_exit=True):
  """The beam rule of `beam_search`, on the exhaustive table, in plain Python.

  A slot is ``[logp, tokens, ended, eos]``; candidates are the ended slots
  (index = slot position) then every token after each live slot (index
  ``k + slot * VOCAB + token``); the best k by (value desc, index asc) stay.
  """
  slots = [[np.float32(0), (), False, False]]
  t = 0
  while True:
    candidates = [(s[0], i, s) for i, s in enumerate(slots) if s[2]]
    for i, (logp, tokens, ended, _) in enumerate(slots):
      if not ended:
        lp = table[tokens]
        for v in range(VOCAB):
          value = np.float32(logp + lp[v])
          if v == EOS:
            new = [value, tokens, True, True]
          else:
            new = [value, tokens + (v,), t + 1 >= max_length, False]
          candidates.append((value, k + i * VOCAB + v, new))
    candidates.sort(key=lambda c: (-c[0], c[1]))
    slots = [list(c[2]) for c in candidates[:k]]
    t += 1

    def score(s):
      return np.float32(s[0] / penalty(len(s[1]) + s[3], alpha))

    ended = sorted(
      [(score(s), i, s[1]) for i, s in enumerate(slots) if s[2]],
      key=lambda e: (-e[0], e[1]),
    )
    live = [s[0] for s in slots if not s[2]]
    if not live:
      break
    if early_exit and len(ended) >= num_results:
      bound = np.float32(max(live) / penalty(max_length, alpha))
      if bound < ended[num_results - 1][0]:
        break
  return [(tokens, value) for value, _, tokens in ended[:num_results]]


def reference_greedy(table, max_length):
  tokens, logp = (), np.float32(0)
  while True:
    lp = table[tokens]
    v = int(np.argmax(lp))
    logp = np.float32(logp + lp[v])
    if v == EOS:
      return tokens, logp
    tokens += (v,)
    if len(tokens) >= max_length:
      return tokens, logp


def argmax_loop(step_fn, init, bias, max_lengths, alpha: float):
  """Greedy decoding written out over the whole batch: every source feeds
  back its most likely token until `eos` or its max length. Per source:
  ``[(tokens, logp / penalty(steps, alpha))]``."""
  step_fn = jax.jit(step_fn)
  count = init.shape[0]
  h, last = init, jnp.full((count,), BOS, jnp.int32)
  tokens, logp = [() for _ in range(count)], np.zeros(count, np.float32)
  steps, done = np.zeros(count, int), np.zeros(count, bool)
  for _ in range(int(np.max(max_lengths))):
    h, lp = step_fn(h, last, bias)
    lp = np.asarray(lp)
    best = lp.argmax(-1)
    for i in np.flatnonzero(~done):
      logp[i] = np.float32(logp[i] + lp[i, best[i]])
      steps[i] += 1
      if best[i] == EOS:
        done[i] = True
      else:
        tokens[i] += (int(best[i]),)
        done[i] = len(tokens[i]) >= max_lengths[i]
    if done.all():
      break
    last = jnp.asarray(best, jnp.int32)
  return [
    [(tokens[i], np.float32(logp[i] / penalty(steps[i], alpha)))] for i in range(count)
  ]


def as_lists(result: Hypotheses):
  """Per source: a list of (tokens tuple, score)."""
  ids, scores = result.ids.to_list(), result.scores.to_list()
  return [
    [(tuple(int(v) for v in h), np.float32(s)) for h, s in zip(hs, ss, strict=True)]
    for hs, ss in zip(ids, scores, strict=True)
  ]


def assert_same(actual, expected, rtol=1e-5):
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected, strict=True):
    assert [h for h, _ in a] == [h for h, _ in e]
    np.testing.assert_allclose([s for _, s in a], [s for _, s in e], rtol=rtol)


def tokens_of(lists):
  return [[h for h, _ in source] for source in lists]


COUNT = 3
MAX_LENGTHS = (4, 2, 3)
INIT, BIAS = sources(COUNT)
TABLES = [prefix_table(INIT[i], BIAS[i], 4) for i in range(COUNT)]


def beam(k=2, alpha=0.6, num_results=None, ladder=None, max_length=4):
  """The settings of this file's model (length capacity 4 by default)."""
  return DecodeSettings(
    bos_id=BOS,
    eos_id=EOS,
    max_length=max_length,
    beam_size=k,
    length_penalty=alpha,
    num_results=num_results,
    ladder=ladder,
  )


@functools.partial(jax.jit, static_argnames=("step_fn", "settings"))
def search(step_fn, init, settings, static_inputs=None, max_lengths=None):
  """`beam_search` jitted (one program a step and settings, where eager calls
  would compile every op of the search on its own)."""
  return beam_search(
    step_fn, init, settings, static_inputs=static_inputs, max_lengths=max_lengths
  )


def run_beam(init, bias, max_lengths, settings):
  """`search` with this file's model."""
  return search(step, init, settings, static_inputs=bias, max_lengths=max_lengths)


# -- DecodeSettings -------------------------------------------------------------------


@pytest.mark.parametrize(
  ("changes", "error", "match"),
  [
    (dict(bos_id=-1), ValueError, r"Expected `bos_id` >= 0, got -1\."),
    (dict(bos_id=1.0), TypeError, r"Expected `bos_id` to be a static int, got 1\.0\."),
    (dict(eos_id=-2), ValueError, r"Expected `eos_id` >= 0, got -2\."),
    (dict(eos_id=jnp.array(0)), TypeError, r"`eos_id` to be a static int, got Array"),
    (dict(max_length=0), ValueError, r"Expected `max_length` >= 1, got 0\."),
    (
      dict(max_length=jnp.array([2, 3])),
      TypeError,
      r"`max_length` to be a static int, got Array",
    ),
    (dict(beam_size=0), ValueError, r"Expected `beam_size` >= 1, got 0\."),
    (dict(beam_size=2.0), TypeError, r"`beam_size` to be a static int, got 2\.0\."),
    (dict(beam_size=True), TypeError, r"`beam_size` to be a static int, got True\."),
    (dict(num_results=0), ValueError, r"Expected `num_results` >= 1, got 0\."),
    (
      dict(num_results=5),
      ValueError,
      r"Expected `num_results` <= `beam_size` \(4\), got 5\.",
    ),
    (
      dict(beam_size=2, num_results=3),
      ValueError,
      r"`num_results` <= `beam_size` \(2\), got 3\.",
    ),
    (dict(num_results=1.0), TypeError, r"`num_results` to be a static int, got 1\.0"),
    (
      dict(length_penalty=-0.5),
      ValueError,
      r"Expected a finite `length_penalty` >= 0 \(the early exit's bound needs a "
      r"penalty that grows with the length\), got -0\.5\.",
    ),
    (dict(length_penalty=float("nan")), ValueError, r"`length_penalty` >= 0 .*nan"),
    (dict(length_penalty=float("inf")), ValueError, r"finite `length_penalty` .*inf"),
    (
      dict(length_penalty=1e300),
      ValueError,
      r"Expected `length_penalty` to be finite in float32 .*, got 1e\+300\.",
    ),
    (
      dict(length_penalty=jnp.array(0.6)),
      TypeError,
      r"Expected `length_penalty` to be a static float, got Array\(0\.6",
    ),
    (dict(length_penalty=True), TypeError, r"`length_penalty` to be a static float"),
    (dict(length_penalty="0.6"), TypeError, r"static float, got '0\.6'\."),
    (
      dict(ladder="8,4"),
      TypeError,
      r"Expected `ladder` to be a sequence of ints or None, got '8,4'\.",
    ),
    (dict(ladder=4), TypeError, r"`ladder` to be a sequence of ints or None, got 4\."),
  ],
)
def test_decode_settings_rejects_bad_fields(changes, error, match):
  fields = dict(bos_id=1, eos_id=2, max_length=5)
  with pytest.raises(error, match=match):
    DecodeSettings(**(fields | changes))


def test_decode_settings_normalizes_its_fields():
  settings = DecodeSettings(
    bos_id=np.int64(1),
    eos_id=np.int32(0),
    max_length=np.int16(5),
    beam_size=np.int8(3),
    length_penalty=1,
    ladder=[8, 2],
  )
  assert settings == DecodeSettings(1, 0, 5, 3, 1.0, None, (8, 2))
  for name in ("bos_id", "eos_id", "max_length", "beam_size"):
    assert type(getattr(settings, name)) is int
  assert type(settings.length_penalty) is float
  assert settings.ladder == (8, 2)
  assert settings.results == 3
  assert dataclasses.replace(settings, num_results=2).results == 2
  assert DecodeSettings(bos_id=1, eos_id=2, max_length=5).results == 4
  with pytest.raises(dataclasses.FrozenInstanceError):
    settings.beam_size = 2


def test_decode_settings_is_a_static_argument_of_jit():
  a, b = beam(k=2, ladder=[8, 2]), beam(k=2, ladder=(8, 2))
  assert a == b and a is not b and hash(a) == hash(b)
  assert len({a, b, beam(k=3)}) == 2
  traces = []

  @functools.partial(jax.jit, static_argnames=("settings",))
  def decode(init, bias, settings):
    traces.append(settings)
    return beam_search(step, init, settings, static_inputs=bias)

  init, bias = sources(8, seed=3)
  first = decode(init, bias, a)
  again = decode(init, bias, b)  # equal settings: the same compiled program
  assert len(traces) == 1
  assert_same(as_lists(again), as_lists(first))
  wider = decode(init, bias, dataclasses.replace(a, beam_size=3))
  assert len(traces) == 2
  assert wider.ids.capacity.sequences == (8, 24)


# -- against exhaustive search ------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("results", ["one", "all"])
def test_beam_search_follows_the_rule_on_the_exhaustive_table(k, alpha, results):
  num_results = 1 if results == "one" else k
  out = run_beam(INIT, BIAS, jnp.array(MAX_LENGTHS), beam(k, alpha, num_results))
  expected = [
    reference_beam(TABLES[i], k, MAX_LENGTHS[i], alpha, num_results)
    for i in range(COUNT)
  ]
  assert_same(as_lists(out), expected)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_every_returned_score_is_the_exhaustive_score(alpha):
  out = as_lists(run_beam(INIT, BIAS, jnp.array(MAX_LENGTHS), beam(4, alpha)))
  for i in range(COUNT):
    exhaustive = dict(every_hypothesis(TABLES[i], MAX_LENGTHS[i], alpha))
    for tokens, score in out[i]:
      np.testing.assert_allclose(score, exhaustive[tokens], rtol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_length_normalized_is_the_reference_score(alpha):
  logp = np.array([[-1.5, 0.0, -7.25], [-0.5, -3.0, -40.0]], np.float32)
  steps = np.array([1, 4, 9])
  got = length_normalized(logp, steps, alpha)
  assert got.shape == (2, 3) and got.dtype == jnp.float32
  want = [[logp[r, c] / penalty(steps[c], alpha) for c in range(3)] for r in range(2)]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # NumPy's float64 scores in float32 (x64 off); bfloat16 stays bfloat16.
  assert length_normalized(logp.astype(np.float64), 3, alpha).dtype == jnp.float32
  half = length_normalized(jnp.asarray(logp, jnp.bfloat16), steps, alpha)
  assert half.dtype == jnp.bfloat16


@pytest.mark.parametrize(
  "alpha, error, match",
  [
    (-0.5, ValueError, r"finite `length_penalty` >= 0 .*got -0.5"),
    (float("inf"), ValueError, r"finite `length_penalty` >= 0 .*got inf"),
    (1e300, ValueError, r"length_penalty"),
    (True, TypeError, r"`length_penalty` to be a static float, got True"),
    (jnp.float32(0.6), TypeError, r"`length_penalty` to be a static float"),
  ],
)
def test_length_normalized_rejects_bad_penalties(alpha, error, match):
  with pytest.raises(error, match=match):
    length_normalized(np.float32(-1.0), 2, alpha)


def test_length_normalized_rejects_bad_arrays():
  with pytest.raises(TypeError, match=r"`logp` to have a float dtype, got int32"):
    length_normalized(np.array([-2, 0], np.int32), 3, 0.6)
  with pytest.raises(TypeError, match=r"`steps` to have an integer dtype, got float"):
    length_normalized(np.zeros(2, np.float32), np.array([1.0, 2.0]), 0.6)
  with pytest.raises(ValueError, match=r"`logp` \(2, 3\) and `steps` \(2,\)"):
    length_normalized(np.zeros((2, 3), np.float32), np.array([1, 2]), 0.6)


def test_length_normalized_ranks_as_beam_search():
  out = as_lists(run_beam(INIT, BIAS, jnp.array(MAX_LENGTHS), beam(4, 0.6, 4)))
  for i in range(COUNT):
    exhaustive = {t: (lp, n) for t, n, lp in every_logp(TABLES[i], MAX_LENGTHS[i])}
    for tokens, score in out[i]:
      logp, steps = exhaustive[tokens]
      np.testing.assert_allclose(length_normalized(logp, steps, 0.6), score, rtol=1e-5)


@pytest.mark.parametrize("num_results", [3, 121])
def test_a_beam_as_wide_as_the_search_space_is_exhaustive(num_results):
  # Vocab 4, length 4: 1 + 3 + 9 + 27 hypotheses end with eos, 81 are
  # truncated; a beam of 121 keeps every one of them.
  settings = beam(121, 0.6, num_results)
  out = as_lists(run_beam(INIT, BIAS, jnp.array([4, 4, 4]), settings))
  for i in range(COUNT):
    everything = every_hypothesis(TABLES[i], 4, 0.6)
    assert len(everything) == 121
    best = sorted(everything, key=lambda h: -h[1])[:num_results]
    assert_same([out[i]], [best])


def test_a_beam_of_one_is_greedy_on_the_exhaustive_table():
  # Without a length penalty the scores are the summed log-probabilities.
  out = run_beam(INIT, BIAS, jnp.array(MAX_LENGTHS), beam(1, 0.0))
  expected = [[reference_greedy(TABLES[i], MAX_LENGTHS[i])] for i in range(COUNT)]
  assert_same(as_lists(out), expected)


def eos_shy(h, tokens, static):
  """`step` with the eos logit lowered by 1: greedy runs of every length."""
  h, logits = logits_step(h, tokens, static)
  return h, jax.nn.log_softmax(logits.at[:, EOS].add(-1.0), axis=-1)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_a_beam_of_one_is_the_argmax_loop(alpha):
  # The tokens never depend on the length penalty; the scores are the summed
  # log-probabilities (alpha 0) or those divided by the penalty (0.6, default).
  init, bias = sources(16, seed=7)
  lengths = np.random.default_rng(2).integers(1, 5, size=16)
  out = search(eos_shy, init, beam(1, alpha), static_inputs=bias, max_lengths=lengths)
  expected = argmax_loop(eos_shy, init, bias, lengths, alpha)
  assert_same(as_lists(out), expected)
  got = [len(source[0][0]) for source in expected]
  assert set(got) == {0, 1, 2, 3, 4}
  assert any(0 < n < m for n, m in zip(got, lengths, strict=True))  # ended by eos
  assert any(n == m > 1 for n, m in zip(got, lengths, strict=True))  # truncated


# -- early exit and compaction ------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_the_early_exit_bound_never_changes_results(k, alpha):
  for i in range(COUNT):
    for num_results in range(1, k + 1):
      early = reference_beam(TABLES[i], k, MAX_LENGTHS[i], alpha, num_results)
      full = reference_beam(TABLES[i], k, MAX_LENGTHS[i], alpha, num_results, False)
      assert early == full


@pytest.mark.parametrize("k", [1, 3])
def test_compaction_never_changes_results(k):
  # `ladder=()`: one phase at the full count capacity, a batch-wide stop.
  init, bias = sources(8, seed=3)
  lengths = jnp.asarray(np.random.default_rng(4).integers(1, 5, size=8))
  batchwide = as_lists(run_beam(init, bias, lengths, beam(k, ladder=())))
  for ladder in [None, (8, 7, 6, 5, 4, 3, 2, 1), (8, 2)]:
    compacted = as_lists(run_beam(init, bias, lengths, beam(k, ladder=ladder)))
    assert tokens_of(compacted) == tokens_of(batchwide)
    assert_same(compacted, batchwide, rtol=1e-6)


def test_decoded_together_or_one_by_one():
  init, bias = sources(6, seed=5)
  lengths = np.random.default_rng(6).integers(1, 5, size=6)
  settings = beam(3, 0.6, 2)
  together = as_lists(run_beam(init, bias, jnp.asarray(lengths), settings))
  alone = [
    as_lists(
      run_beam(
        init[i : i + 1], bias[i : i + 1], jnp.asarray(lengths[i : i + 1]), settings
      )
    )[0]
    for i in range(6)
  ]
  assert_same(together, alone)


def recorded_sizes(settings: DecodeSettings) -> list[int]:
  """The distinct batch sizes the step is traced at, largest first."""
  sizes = []

  def recording(h, tokens, static):
    sizes.append(tokens.shape[0])
    return step(h, tokens, static)

  init, bias = sources(8, seed=3)
  # Tracing is enough: each phase traces the step once, at its static size.
  jax.eval_shape(
    functools.partial(beam_search, recording, settings=settings),
    init,
    static_inputs=bias,
  )
  return sorted(set(sizes), reverse=True)


def test_the_step_runs_on_shrinking_prefixes():
  # A probe at the full size, then one trace per phase: 8, 4, 2, 1 sources.
  assert recorded_sizes(beam(2)) == [16, 8, 4, 2]


def test_an_empty_ladder_runs_one_phase_at_full_size():
  assert recorded_sizes(beam(2, ladder=())) == [16]
  assert recorded_sizes(beam(2, ladder=(8, 2))) == [16, 4]


def test_sources_stop_at_their_own_length():
  # A model that never emits eos: every hypothesis runs to its max length.
  def no_eos(h, tokens, static):
    h, lp = step(h, tokens, static)
    return h, jax.nn.log_softmax(lp.at[:, EOS].set(-1e9), axis=-1)

  init, bias = sources(5, seed=8)
  lengths = jnp.array([1, 4, 2, 3, 1])
  for settings in [beam(1), beam(3)]:
    out = search(no_eos, init, settings, static_inputs=bias, max_lengths=lengths)
    for hyps, n in zip(out.ids.to_list(), lengths.tolist(), strict=True):
      assert hyps and all(len(h) == n for h in hyps)


# -- sources: padding, empty inputs, LoD static inputs ----------------------------


def lod_step(h, tokens, static):
  memory, lengths = static  # [b, source, HIDDEN], [b]
  mask = jnp.arange(memory.shape[1])[None, :] < lengths[:, None]
  pooled = jnp.sum(jnp.where(mask[..., None], memory, 0.0), axis=1)
  return step(h, tokens, pooled)


def test_lod_static_inputs_padding_and_empty_sources():
  rng = np.random.default_rng(9)
  seqs = [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in (2, 0, 3)]
  memory = LoDTensor.from_sequences(
    seqs, buckets=Buckets.fixed(tokens=8, sequences=5, time=4)
  )
  init = jnp.asarray(rng.normal(size=(5, HIDDEN)), jnp.float32)
  settings = beam(2, max_length=3)
  out = search(lod_step, init, settings, static_inputs=memory)
  lengths = out.ids.recursive_lengths()
  assert lengths[0] == [2, 2, 2]  # padding sources 3 and 4 get nothing
  assert out.ids.capacity.sequences == (5, 10)
  assert out.scores.recursive_lengths() == [[2, 2, 2]]
  # The empty source decodes from its init carry with a zero pooled memory.
  alone = search(step, init[1:2], settings, static_inputs=jnp.zeros((1, HIDDEN)))
  assert_same([as_lists(out)[1]], as_lists(alone))


def zero_time_step(h, tokens, static):
  bias, memory = static  # memory [b, 0, HIDDEN] or [b, 2, 0]: no cells
  return step(h, tokens, bias + jnp.sum(memory))


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("shape", [(0, HIDDEN), (2, 0), (0,)])
def test_zero_size_static_inputs_decode_like_none(k, shape):
  # A source capacity of 0 (every source empty) gives statics [count, 0, ...];
  # flattening their beams with `reshape(-1, ...)` divided by zero.
  init, bias = sources(COUNT)
  memory = jnp.zeros((COUNT, *shape), jnp.float32)
  settings = beam(k)
  got = search(zero_time_step, init, settings, static_inputs=(bias, memory))
  assert_same(as_lists(got), as_lists(search(step, init, settings, bias)))
  assert got.ids.recursive_lengths()[0] == [settings.results] * COUNT


def test_num_sources_marks_padding_rows():
  init, bias = sources(4)
  out = beam_search(step, init, beam(1), static_inputs=bias, num_sources=2)
  assert out.ids.recursive_lengths()[0] == [1, 1]
  assert int(out.ids.num_outer) == 2


def test_max_lengths_of_padding_rows_are_not_checked():
  init, bias = sources(4)
  out = beam_search(
    step,
    init,
    beam(1, max_length=3),
    static_inputs=bias,
    max_lengths=np.array([3, 2, 0, 99]),  # rows 2 and 3 are padding
    num_sources=2,
  )
  assert out.ids.capacity.time == (1, 3)  # from `settings.max_length`
  assert all(len(h[0]) <= n for h, n in zip(out.ids.to_list(), [3, 2], strict=True))


def test_results_are_sorted_and_never_hold_eos():
  init, bias = sources(8, seed=11)
  out = run_beam(init, bias, jnp.full((8,), 4), beam(4))
  for hyps, scores in zip(out.ids.to_list(), out.scores.to_list(), strict=True):
    assert np.all(np.diff(scores) <= 0)
    assert all(EOS not in h.tolist() for h in hyps)
  assert out.ids.values.dtype == jnp.int32
  assert out.ids.capacity.tokens == 8 * 4 * 4


def test_compiles_once_under_jit():
  traces = []
  settings = beam(2)

  @jax.jit
  def decode(init, bias, lengths):
    traces.append(1)
    return beam_search(step, init, settings, static_inputs=bias, max_lengths=lengths)

  compiles = collections.Counter()  # XLA compilations after the first call
  for seed in range(4):
    init, bias = sources(6, seed=seed)
    lengths = np.random.default_rng(seed).integers(1, 5, size=6)
    with xla_compiles() as counted:
      decode(init, bias, jnp.asarray(lengths)).ids.values.block_until_ready()
    if seed:
      compiles.update(counted)
  assert len(traces) == 1
  assert sum(compiles.values()) == 0, compiles  # none after the first call


# -- ensemble_step --------------------------------------------------------------------

TOKENS = jnp.array([BOS, 1, 2], jnp.int32)


BIGRAM = jnp.asarray(np.random.default_rng(12).normal(size=(VOCAB, VOCAB)), jnp.float32)


def bigram_step(count, tokens, scale):
  """A second member with another carry and static input: ``(count [b],
  logits [b, VOCAB])`` from a bigram table, scaled per row."""
  return count + 1, BIGRAM[tokens] * scale[:, None]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_ensemble_of_one_is_its_log_softmax(dtype):
  def member(h, tokens, static):
    h, logits = logits_step(h, tokens, static)
    return h, logits.astype(dtype)

  (h,), log_probs = jax.jit(ensemble_step([member]))((INIT,), TOKENS, (BIAS,))
  want_h, logits = jax.jit(member)(INIT, TOKENS, BIAS)
  want = jax.jit(jax.nn.log_softmax)(logits.astype(jnp.float32))
  assert log_probs.dtype == jnp.float32
  np.testing.assert_array_equal(log_probs, want)
  np.testing.assert_array_equal(h, want_h)


def test_an_ensemble_of_two_is_the_mean_of_their_log_softmax():
  carries = (INIT, jnp.zeros(3, jnp.int32))
  statics = (BIAS, jnp.array([1.0, 2.0, 0.5]))
  ensemble = jax.jit(ensemble_step([logits_step, bigram_step]))
  (h, count), log_probs = ensemble(carries, TOKENS, statics)
  want_h, a = logits_step(INIT, TOKENS, BIAS)
  _, b = bigram_step(carries[1], TOKENS, statics[1])
  want = (jax.nn.log_softmax(a) + jax.nn.log_softmax(b)) / 2
  np.testing.assert_allclose(log_probs, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(count, [1, 1, 1])


def test_an_ensemble_of_identical_members_decodes_as_one():
  settings = beam(3)
  lengths = jnp.array(MAX_LENGTHS)
  one = run_beam(INIT, BIAS, lengths, settings)

  @jax.jit
  def decode(init, bias, lengths):
    return beam_search(
      ensemble_step([logits_step, logits_step]),
      (init, init),
      settings,
      static_inputs=(bias, bias),
      max_lengths=lengths,
    )

  assert_same(as_lists(decode(INIT, BIAS, lengths)), as_lists(one))


def test_ensemble_step_rejects_no_members_and_other_vocabularies():
  with pytest.raises(ValueError, match=r"at least one member step, got none\."):
    ensemble_step([])

  def wider(h, tokens, static):
    return h, jnp.zeros((tokens.shape[0], VOCAB + 1))

  with pytest.raises(
    ValueError,
    match=r"Expected every member to share the vocabulary: member 0 gives 4 "
    r"log-probabilities, member 1 gives 5\.",
  ):
    ensemble_step([logits_step, wider])((INIT, INIT), TOKENS, (BIAS, BIAS))
  with pytest.raises(ValueError, match=r"member 1 gives 5\."):
    beam_search(
      ensemble_step([logits_step, wider]),
      (INIT, INIT),
      beam(2),
      static_inputs=(BIAS, BIAS),
    )


@pytest.mark.parametrize(
  "member, error, match",
  [
    (
      lambda h, t, s: logits_step(h, t, s)[1],
      TypeError,
      r"Expected `steps\[1\]` to return a pair \(new_carry, logits\), got Array",
    ),
    (
      lambda h, t, s: (h, jnp.float32(0)),
      ValueError,
      r"Expected `steps\[1\]` to return logits of shape \[3, vocab\], got "
      r"float32\[\]\.",
    ),
    (
      lambda h, t, s: (h, jnp.zeros((t.shape[0],))),
      ValueError,
      r"`steps\[1\]` to return logits of shape \[3, vocab\], got float32\[3\]\.",
    ),
    (
      lambda h, t, s: (h, jnp.zeros((1, VOCAB))),
      ValueError,
      r"`steps\[1\]` to return logits of shape \[3, vocab\], got float32\[1, 4\]\.",
    ),
  ],
)
def test_ensemble_step_checks_each_members_outputs(member, error, match):
  """As `beam_search` checks its `step_fn`'s (before: a bare IndexError, an
  unpacking error or a concatenation error from inside JAX)."""
  with pytest.raises(error, match=match):
    ensemble_step([logits_step, member])((INIT, INIT), TOKENS, (BIAS, BIAS))


# -- bad inputs -----------------------------------------------------------------------


def _beam(step_fn=step, settings=None, **kwargs):
  settings = beam(2) if settings is None else settings
  return beam_search(step_fn, INIT, settings, **(dict(static_inputs=BIAS) | kwargs))


@pytest.mark.parametrize(
  ("changes", "kwargs", "error", "match"),
  [
    (
      dict(eos_id=4),
      {},
      ValueError,
      r"Expected `eos_id` in \[0, 4\) \(the vocabulary of `step_fn`\), got 4\.",
    ),
    (
      dict(bos_id=4),
      {},
      ValueError,
      r"Expected `bos_id` in \[0, 4\) \(the vocabulary of `step_fn`\), got 4\.",
    ),
    (dict(ladder=(5,)), {}, ValueError, r"`ladder\[0\]` in \[1, 3\]"),
    (dict(ladder=(2.0,)), {}, ValueError, r"`ladder\[0\]` to be an int, got 2\.0"),
    (
      {},
      dict(max_lengths=jnp.array([1, 2])),
      ValueError,
      r"`max_lengths` to have shape \(3,\) \(count capacity\), got shape \(2,\)",
    ),
    ({}, dict(max_lengths=3), ValueError, r"shape \(3,\) .*got shape \(\)"),
    (
      {},
      dict(max_lengths=jnp.array([1.0, 2.0, 3.0])),
      TypeError,
      r"`max_lengths` to have an integer dtype",
    ),
    (
      {},
      dict(max_lengths=jnp.array([2, 0, 3])),
      ValueError,
      r"every `max_lengths` >= 1 .*source 1 has 0",
    ),
    (
      {},
      dict(max_lengths=jnp.array([2, 6, 3])),
      ValueError,
      r"<= `settings.max_length` \(4\); source 1 has 6",
    ),
    (
      {},
      dict(static_inputs=BIAS[:2]),
      ValueError,
      r"`static_inputs` leaf .* leading dimension 3",
    ),
    ({}, dict(num_sources=4), ValueError, r"`num_sources` in \[0, 3\]"),
    (
      {},
      dict(num_sources=jnp.array([1])),
      ValueError,
      r"`num_sources` to be a scalar",
    ),
  ],
)
def test_bad_arguments(changes, kwargs, error, match):
  with pytest.raises(error, match=match):
    _beam(settings=dataclasses.replace(beam(2), **changes), **kwargs)


def test_settings_must_be_decode_settings():
  with pytest.raises(
    TypeError, match=r"Expected `settings` to be a DecodeSettings, got dict\."
  ):
    _beam(settings=dict(bos_id=BOS, eos_id=EOS, max_length=4))


def test_bad_step_outputs():
  with pytest.raises(
    ValueError, match=r"log_probs of shape \[6, vocab\] \(float\), got float32\[6\]"
  ):
    _beam(step_fn=lambda h, t, s: (h, jnp.zeros(t.shape)))
  with pytest.raises(
    ValueError, match=r"log_probs of shape \[6, vocab\] \(float\), got int32\[6, 4\]"
  ):
    _beam(step_fn=lambda h, t, s: (h, jnp.zeros((t.shape[0], 4), jnp.int32)))
  with pytest.raises(
    ValueError,
    match=r"keep carry leaf \(root\) as float32\[6, 3\], got float32\[6, 2\]",
  ):
    _beam(step_fn=lambda h, t, s: (h[:, :2], step(h, t, s)[1]))
  with pytest.raises(TypeError, match=r"return a pair \(new_carry, output\)"):
    _beam(step_fn=lambda h, t, s: step(h, t, s)[1])


def test_bad_carry_and_missing_rows():
  with pytest.raises(
    ValueError, match=r"`init_carry` leaf \[1\] to have leading dimension 3"
  ):
    beam_search(
      lambda c, t, s: (c, step(c[0], t, s)[1]),
      (INIT, INIT[:2]),
      beam(2, max_length=3),
      static_inputs=BIAS,
    )
  with pytest.raises(ValueError, match=r"at least one array \(one row per source\)"):
    beam_search(
      lambda c, t, s: (c, t),
      (),
      DecodeSettings(bos_id=0, eos_id=0, max_length=2, beam_size=1),
    )


def test_max_lengths_are_checked_under_jit_with_checkify():
  settings = beam(1, max_length=3)

  def decode(lengths):
    return beam_search(step, INIT, settings, static_inputs=BIAS, max_lengths=lengths)

  checked = jax.jit(checkify.checkify(decode))
  err, _ = checked(jnp.array([1, 5, 2]))
  with pytest.raises(checkify.JaxRuntimeError, match=r"source 1 has 5"):
    err.throw()
  err, out = checked(jnp.array([1, 3, 2]))
  err.throw()
  eager = decode(jnp.array([1, 3, 2]))
  assert_same(as_lists(out), as_lists(eager))


def test_not_differentiable_through_the_loop():
  def loss(bias):
    out = beam_search(step, INIT, beam(1, max_length=3), static_inputs=bias)
    return out.scores.values.sum()

  with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
    jax.grad(loss)(BIAS)
