"""greedy_decode and beam_search: against exhaustive search and a plain-Python
reference of the beam rule, early exit, compaction, jit, and bad inputs."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import Hypotheses, beam_search, greedy_decode

# -- a tiny recurrent model: vocab 4 (eos 0), bos 4, one row per source -----------

VOCAB, EOS, BOS, HIDDEN = 4, 0, 4, 3
_rng = np.random.default_rng(0)
EMBED = jnp.asarray(_rng.normal(size=(VOCAB + 1, HIDDEN)), jnp.float32)
RECUR = jnp.asarray(_rng.normal(size=(HIDDEN, HIDDEN)), jnp.float32)
OUT = jnp.asarray(1.5 * _rng.normal(size=(HIDDEN, VOCAB)), jnp.float32)


def step(h, tokens, static):
  h = jnp.tanh(EMBED[tokens] + h @ RECUR + static)
  return h, jax.nn.log_softmax(h @ OUT, axis=-1)


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


def every_hypothesis(table, max_length: int, alpha: float):
  """Every hypothesis (tokens, steps, logp) and its normalized score."""
  out = []
  for n in range(max_length + 1):
    for tokens in itertools.product(range(1, VOCAB), repeat=n):
      logp = np.float32(0)
      for i, v in enumerate(tokens):
        logp = np.float32(logp + table[tokens[:i]][v])
      if n < max_length:  # ended by eos
        logp, steps = np.float32(logp + table[tokens][EOS]), n + 1
      elif n == max_length:  # truncated
        steps = n
      out.append((tokens, np.float32(logp / penalty(steps, alpha))))
  return out


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


COUNT = 3
MAX_LENGTHS = (4, 2, 3)
INIT, BIAS = sources(COUNT)
TABLES = [prefix_table(INIT[i], BIAS[i], 4) for i in range(COUNT)]


@functools.partial(
  jax.jit,
  static_argnames=("k", "alpha", "num_results", "compact", "ladder"),
)
def run_beam(init, bias, max_length, k, alpha, num_results, compact=True, ladder=None):
  return beam_search(
    step,
    init,
    beam_size=k,
    bos_id=BOS,
    eos_id=EOS,
    max_length=max_length,
    length_capacity=4,
    length_penalty=alpha,
    static_inputs=bias,
    num_results=num_results,
    compact=compact,
    ladder=ladder,
  )


# -- against exhaustive search ------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("results", ["one", "all"])
def test_beam_search_follows_the_rule_on_the_exhaustive_table(k, alpha, results):
  num_results = 1 if results == "one" else k
  out = run_beam(INIT, BIAS, jnp.array(MAX_LENGTHS), k, alpha, num_results)
  expected = [
    reference_beam(TABLES[i], k, MAX_LENGTHS[i], alpha, num_results)
    for i in range(COUNT)
  ]
  assert_same(as_lists(out), expected)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_every_returned_score_is_the_exhaustive_score(alpha):
  out = as_lists(run_beam(INIT, BIAS, jnp.array(MAX_LENGTHS), 4, alpha, 4))
  for i in range(COUNT):
    exhaustive = dict(every_hypothesis(TABLES[i], MAX_LENGTHS[i], alpha))
    for tokens, score in out[i]:
      np.testing.assert_allclose(score, exhaustive[tokens], rtol=1e-5)


@pytest.mark.parametrize("num_results", [3, 121])
def test_a_beam_as_wide_as_the_search_space_is_exhaustive(num_results):
  # Vocab 4, length 4: 1 + 3 + 9 + 27 hypotheses end with eos, 81 are
  # truncated; a beam of 121 keeps every one of them.
  out = as_lists(run_beam(INIT, BIAS, jnp.array([4, 4, 4]), 121, 0.6, num_results))
  for i in range(COUNT):
    everything = every_hypothesis(TABLES[i], 4, 0.6)
    assert len(everything) == 121
    best = sorted(everything, key=lambda h: -h[1])[:num_results]
    assert_same([out[i]], [best])


def test_greedy_matches_the_reference():
  out = greedy_decode(
    step,
    INIT,
    bos_id=BOS,
    eos_id=EOS,
    max_length=jnp.array(MAX_LENGTHS),
    static_inputs=BIAS,
  )
  expected = [[reference_greedy(TABLES[i], MAX_LENGTHS[i])] for i in range(COUNT)]
  assert_same(as_lists(out), expected)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_greedy_equals_beam_size_one(alpha):
  init, bias = sources(16, seed=7)
  lengths = jnp.asarray(np.random.default_rng(2).integers(1, 5, size=16))
  greedy = greedy_decode(
    step, init, bos_id=BOS, eos_id=EOS, max_length=lengths, static_inputs=bias
  )
  beam = beam_search(
    step,
    init,
    beam_size=1,
    bos_id=BOS,
    eos_id=EOS,
    max_length=lengths,
    length_penalty=alpha,
    static_inputs=bias,
  )
  g, b = as_lists(greedy), as_lists(beam)
  assert [[h for h, _ in s] for s in g] == [[h for h, _ in s] for s in b]
  if alpha == 0:
    assert_same(g, b)


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
  init, bias = sources(8, seed=3)
  lengths = jnp.asarray(np.random.default_rng(4).integers(1, 5, size=8))
  batchwide = run_beam(init, bias, lengths, k, 0.6, k, compact=False)
  for ladder in [None, (8, 7, 6, 5, 4, 3, 2, 1), (8, 2)]:
    compacted = run_beam(init, bias, lengths, k, 0.6, k, ladder=ladder)
    assert_same(as_lists(compacted), as_lists(batchwide), rtol=1e-6)


def test_decoded_together_or_one_by_one():
  init, bias = sources(6, seed=5)
  lengths = np.random.default_rng(6).integers(1, 5, size=6)
  together = as_lists(run_beam(init, bias, jnp.asarray(lengths), 3, 0.6, 2))
  alone = [
    as_lists(
      run_beam(
        init[i : i + 1], bias[i : i + 1], jnp.asarray(lengths[i : i + 1]), 3, 0.6, 2
      )
    )[0]
    for i in range(6)
  ]
  assert_same(together, alone)


def test_the_step_runs_on_shrinking_prefixes():
  sizes = []

  def recording(h, tokens, static):
    sizes.append(tokens.shape[0])
    return step(h, tokens, static)

  init, bias = sources(8, seed=3)
  beam_search(
    recording,
    init,
    beam_size=2,
    bos_id=BOS,
    eos_id=EOS,
    max_length=4,
    static_inputs=bias,
  )
  # A probe at the full size, then one trace per phase: 8, 4, 2, 1 sources.
  assert sorted(set(sizes), reverse=True) == [16, 8, 4, 2]


@pytest.mark.slow
def test_sources_stop_at_their_own_length():
  # A model that never emits eos: every hypothesis runs to its max length.
  def no_eos(h, tokens, static):
    h, lp = step(h, tokens, static)
    return h, jax.nn.log_softmax(lp.at[:, EOS].set(-1e9), axis=-1)

  init, bias = sources(5, seed=8)
  lengths = jnp.array([1, 4, 2, 3, 1])
  for out in [
    greedy_decode(
      no_eos, init, bos_id=BOS, eos_id=EOS, max_length=lengths, static_inputs=bias
    ),
    beam_search(
      no_eos,
      init,
      beam_size=3,
      bos_id=BOS,
      eos_id=EOS,
      max_length=lengths,
      static_inputs=bias,
    ),
  ]:
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
  out = beam_search(
    lod_step,
    init,
    beam_size=2,
    bos_id=BOS,
    eos_id=EOS,
    max_length=3,
    static_inputs=memory,
  )
  lengths = out.ids.recursive_lengths()
  assert lengths[0] == [2, 2, 2]  # padding sources 3 and 4 get nothing
  assert out.ids.capacity.sequences == (5, 10)
  assert out.scores.recursive_lengths() == [[2, 2, 2]]
  # The empty source decodes from its init carry with a zero pooled memory.
  alone = beam_search(
    step,
    init[1:2],
    beam_size=2,
    bos_id=BOS,
    eos_id=EOS,
    max_length=3,
    static_inputs=jnp.zeros((1, HIDDEN)),
  )
  assert_same([as_lists(out)[1]], as_lists(alone))


def test_num_sources_marks_padding_rows():
  init, bias = sources(4)
  out = greedy_decode(
    step,
    init,
    bos_id=BOS,
    eos_id=EOS,
    max_length=4,
    static_inputs=bias,
    num_sources=2,
  )
  assert out.ids.recursive_lengths()[0] == [1, 1]
  assert int(out.ids.num_outer) == 2


def test_inferred_length_capacity_ignores_padding_rows():
  init, bias = sources(4)
  out = greedy_decode(
    step,
    init,
    bos_id=BOS,
    eos_id=EOS,
    max_length=np.array([3, 2, 0, 99]),  # rows 2 and 3 are padding
    static_inputs=bias,
    num_sources=2,
  )
  assert out.ids.capacity.time == (1, 3)
  assert all(len(h[0]) <= n for h, n in zip(out.ids.to_list(), [3, 2], strict=True))


def test_results_are_sorted_and_never_hold_eos():
  init, bias = sources(8, seed=11)
  out = run_beam(init, bias, jnp.full((8,), 4), 4, 0.6, 4)
  for hyps, scores in zip(out.ids.to_list(), out.scores.to_list(), strict=True):
    assert np.all(np.diff(scores) <= 0)
    assert all(EOS not in h.tolist() for h in hyps)
  assert out.ids.values.dtype == jnp.int32
  assert out.ids.capacity.tokens == 8 * 4 * 4


def test_compiles_once_under_jit():
  traces = []

  @jax.jit
  def decode(init, bias, lengths):
    traces.append(1)
    return beam_search(
      step,
      init,
      beam_size=2,
      bos_id=BOS,
      eos_id=EOS,
      max_length=lengths,
      length_capacity=4,
      static_inputs=bias,
    )

  for seed in range(4):
    init, bias = sources(6, seed=seed)
    lengths = np.random.default_rng(seed).integers(1, 5, size=6)
    decode(init, bias, jnp.asarray(lengths)).ids.values.block_until_ready()
  assert len(traces) == 1
  assert decode._cache_size() == 1


# -- bad inputs -----------------------------------------------------------------------


def _beam(step_fn=step, **kwargs):
  args = dict(beam_size=2, bos_id=BOS, eos_id=EOS, max_length=4, static_inputs=BIAS)
  return beam_search(step_fn, INIT, **(args | kwargs))


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (dict(beam_size=0), ValueError, r"Expected `beam_size` >= 1, got 0"),
    (dict(beam_size=2.0), TypeError, r"`beam_size` to be a static int"),
    (dict(num_results=3), ValueError, r"`num_results` <= `beam_size` \(2\), got 3"),
    (dict(num_results=0), ValueError, r"`num_results` >= 1, got 0"),
    (dict(length_penalty=-0.5), ValueError, r"`length_penalty` >= 0 .*got -0.5"),
    (
      dict(length_penalty=jnp.array(0.6)),
      TypeError,
      r"`length_penalty` to be a static float",
    ),
    (dict(eos_id=4), ValueError, r"`eos_id` in \[0, 4\) \(the vocabulary"),
    (dict(bos_id=-1), ValueError, r"`bos_id` >= 0, got -1"),
    (dict(max_length=0), ValueError, r"`max_length` >= 1, got 0"),
    (
      dict(max_length=5, length_capacity=4),
      ValueError,
      r"`max_length` <= `length_capacity` \(4\), got 5",
    ),
    (
      dict(max_length=jnp.array([1, 2])),
      ValueError,
      r"shape \(3,\) \(count capacity\), got shape \(2,\)",
    ),
    (
      dict(max_length=jnp.array([1.0, 2.0, 3.0])),
      TypeError,
      r"`max_length` to have an integer dtype",
    ),
    (
      dict(max_length=jnp.array([2, 0, 3])),
      ValueError,
      r"every `max_length` >= 1 .*source 1 has 0",
    ),
    (
      dict(max_length=jnp.array([2, 6, 3]), length_capacity=4),
      ValueError,
      r"<= `length_capacity` \(4\); source 1 has 6",
    ),
    (
      dict(static_inputs=BIAS[:2]),
      ValueError,
      r"`static_inputs` leaf .* leading dimension 3",
    ),
    (dict(ladder=(3, 1), compact=False), ValueError, r"`ladder` with `compact=False`"),
    (dict(ladder=(5,)), ValueError, r"`ladder\[0\]` in \[1, 3\]"),
    (dict(num_sources=4), ValueError, r"`num_sources` in \[0, 3\]"),
    (dict(num_sources=jnp.array([1])), ValueError, r"`num_sources` to be a scalar"),
  ],
)
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    _beam(**kwargs)


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
      beam_size=2,
      bos_id=BOS,
      eos_id=EOS,
      max_length=3,
      static_inputs=BIAS,
    )
  with pytest.raises(ValueError, match=r"at least one array \(one row per source\)"):
    greedy_decode(lambda c, t, s: (c, t), (), bos_id=0, eos_id=0, max_length=2)


def test_per_source_max_length_under_jit_needs_a_capacity():
  @jax.jit
  def decode(lengths):
    return greedy_decode(
      step, INIT, bos_id=BOS, eos_id=EOS, max_length=lengths, static_inputs=BIAS
    )

  with pytest.raises(ValueError, match=r"needs a static `length_capacity`"):
    decode(jnp.array([1, 2, 3]))


def test_max_length_is_checked_under_jit_with_checkify():
  def decode(lengths):
    return greedy_decode(
      step,
      INIT,
      bos_id=BOS,
      eos_id=EOS,
      max_length=lengths,
      static_inputs=BIAS,
      length_capacity=3,
    )

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
    out = greedy_decode(
      step, INIT, bos_id=BOS, eos_id=EOS, max_length=3, static_inputs=bias
    )
    return out.scores.values.sum()

  with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
    jax.grad(loss)(BIAS)
