"""`length_normalized` checks `steps` as `beam_search` checks its settings: a
negative count, or a length penalty inf in the scores' dtype (every score
-0.0, above every real one), raises eagerly naming `steps`; under `jit` it
is a checkify check and those entries score -inf, never above a real score."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from jax.experimental import checkify

from jaxlod.ops import DecodeSettings, beam_search, length_normalized

NEGATIVE = r"Expected every `steps` >= 0 \(a hypothesis' tokens, `eos` included\)"
OVERFLOW = (
  r"Expected `length_penalty` \(400\.0\) and `steps` \(7\) to keep the length "
  r"penalty \(\(5 \+ length\) / 6\) \*\* length_penalty finite in the scores' "
  r"dtype float32 \(at most 3\.403e\+38\), got about 1e120: lower "
  r"`length_penalty` or `steps`\."
)


@functools.partial(jax.jit, static_argnames=("alpha",))
def checked(logp, steps, alpha):
  return checkify.checkify(length_normalized)(logp, steps, alpha)


@functools.partial(jax.jit, static_argnames=("alpha",))
def jitted(logp, steps, alpha):
  return length_normalized(logp, steps, alpha)


@pytest.mark.parametrize("steps", [-5, -6, -7])
def test_negative_steps_raise(steps):
  """The issue's case: -5 gave -inf (a zero penalty), -6 and -7 NaN."""
  with pytest.raises(ValueError, match=NEGATIVE + rf"; item 0 has {steps}\."):
    length_normalized([-6.0], [steps], 0.6)
  with pytest.raises(ValueError, match=NEGATIVE + r"; item 1 has -1\."):
    length_normalized([-6.0, -1.0], [2, -1], 0.0)  # a count, whatever the penalty


def test_negative_steps_under_jit_rank_last_and_fail_under_checkify():
  logp, steps = jnp.array([-6.0, -6.0, -1.0]), jnp.array([7, -7, -5])
  got = jitted(logp, steps, 0.6)
  np.testing.assert_allclose(got[0], length_normalized(-6.0, 7, 0.6), rtol=1e-6)
  assert got[1] == got[2] == -jnp.inf
  err, out = checked(logp, steps, 0.6)
  with pytest.raises(checkify.JaxRuntimeError, match=NEGATIVE + r"; item 1 has -7\."):
    err.throw()
  np.testing.assert_array_equal(out, got)


def test_a_penalty_past_float32_raises():
  """The issue's case: ``(12 / 6) ** 400`` is inf in float32, and the score
  was -0.0, above every real score; `beam_search` refuses the same settings
  (max_length 7), naming `max_length` where this names `steps`."""
  with pytest.raises(ValueError, match=OVERFLOW):
    length_normalized([-6.0], [7], 400.0)
  search = DecodeSettings(
    bos_id=0, eos_id=1, max_length=7, beam_size=2, length_penalty=400.0
  )
  with pytest.raises(ValueError, match=OVERFLOW.replace("`steps`", "`max_length`")):
    beam_search(
      lambda c, t, s: (c, jnp.zeros((t.shape[0], 3))), jnp.zeros((1, 1)), search
    )


def test_a_penalty_past_float32_under_jit_ranks_last_and_fails_under_checkify():
  logp, steps = jnp.array([-6.0, -6.0]), jnp.array([7, 2])
  got = jitted(logp, steps, 400.0)
  assert got[0] == -jnp.inf
  # float32 rounds the base 7 / 6, which a power of 400 makes 4e-5 apart.
  np.testing.assert_allclose(got[1], length_normalized(-6.0, 2, 400.0), rtol=1e-4)
  assert got[1] < 0
  err, _ = checked(logp, steps, 400.0)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"every `steps` <= 2 \(with `length_penalty` 400\.0, .* float32, at "
    r"most 3\.403e\+38\); item 0 has 7\.",
  ):
    err.throw()


def test_the_largest_finite_steps_pass():
  """``(7 / 6) ** 400`` is finite in float32, ``(8 / 6) ** 400`` is not."""
  assert np.isfinite(length_normalized(-6.0, 2, 400.0))
  with pytest.raises(ValueError, match=r"`steps` \(3\)"):
    length_normalized(-6.0, 3, 400.0)
  assert np.isfinite(length_normalized(-6.0, 2**31 - 1, 0.6))  # no int32 overflows


def test_narrow_scores_are_computed_as_the_search_scores():
  """bfloat16 and float16 scores are computed in float32 (the search's
  scores) and rounded once: float16's own penalty at 70,000 steps is inf."""
  for dtype in (jnp.bfloat16, jnp.float16):
    got = length_normalized(jnp.asarray([-6.0, -6.0], dtype), [7, 70_000], 0.6)
    want = np.float32(-6.0) / ((np.float32([12, 70_005]) / 6) ** np.float32(0.6))
    assert got.dtype == dtype
    np.testing.assert_allclose(
      np.float32(got), np.float32(jnp.asarray(want).astype(dtype)), rtol=1e-2
    )


ALPHAS = st.sampled_from([0.0, 0.6, 1.0, 2.0, 50.0, 400.0])


@settings(max_examples=40)
@given(
  alpha=ALPHAS,
  logp=st.lists(st.floats(-100, 0, width=32), min_size=4, max_size=4),
  steps=st.lists(st.integers(-8, 40), min_size=4, max_size=4),
)
@example(alpha=0.6, logp=[0.0, 0.0, 0.0, 0.0], steps=[0, 0, 0, -6])
@example(alpha=400.0, logp=[0.0, 0.0, 0.0, -1.401298464324817e-45], steps=[0, 0, 0, 0])
def test_never_above_a_real_score(alpha, logp, steps):
  """Eagerly a bad entry raises; under `jit` it scores -inf and checkify
  reports it; a good one is the formula, finite, never above 0."""
  logp, steps = np.float32(logp), np.int32(steps)
  # XLA on a CPU flushes float32 subnormals to zero: so does the reference.
  logp = np.where(np.abs(logp) < np.finfo(np.float32).tiny, np.float32(0), logp)
  # A negative base (steps below -5) has no real power: NaN, a bad entry.
  with np.errstate(over="ignore", invalid="ignore"):
    penalty = ((5.0 + steps.astype(np.float64)) / 6.0) ** alpha
  bad = (steps < 0) | ~(penalty <= float(np.finfo(np.float32).max))
  err, got = checked(jnp.asarray(logp), jnp.asarray(steps), alpha)
  assert (err.get() is not None) == bool(bad.any())
  np.testing.assert_array_equal(got[bad], -np.inf)
  good = ~bad
  # float32 rounds the base 5 / 6 by 6e-8, which a power of 400 makes 3e-5.
  want = (logp[good] / penalty[good]).astype(np.float32)
  np.testing.assert_allclose(got[good], want, rtol=1e-4, atol=1e-30)
  assert np.all(got[good] <= 0) and np.all(np.isfinite(got[good]))
  if bad.any():
    with pytest.raises(ValueError, match=r"`steps`"):
      length_normalized(logp, steps, alpha)
  else:  # eager rounds apart from jit
    eager = length_normalized(logp, steps, alpha)
    np.testing.assert_allclose(eager, got, rtol=1e-4, atol=1e-30)
