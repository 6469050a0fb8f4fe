"""`jaxlod.ops.linear_scan` against a per-sequence sequential NumPy
recurrence: values, final states and gradients (`a`, `b`, `init`), float64
tight and float32 at 1e-5, on random LoDs (hypothesis) with empty
sequences, both directions, 2-level LoDs and every broadcast of `a`; one
compilation per capacity; the errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod import Buckets, Fault, LoDTensor
from jaxlod.ops import linear_scan

BUCKETS = Buckets.fixed(tokens=24, sequences=6, time=10)
FEATURES = 3
TOLERANCE = {
  np.float64: dict(rtol=1e-12, atol=1e-12),
  np.float32: dict(rtol=1e-5, atol=1e-5),
}


def reference(a, b, init, lengths, reverse):
  """The recurrence one sequence and one row at a time (NumPy)."""
  out, start = np.zeros_like(b), 0
  for i, n in enumerate(lengths):
    h = init[i]
    rows = range(start, start + n)
    for t in reversed(rows) if reverse else rows:
      h = a[t] * h + b[t]
      out[t] = h
    start += n
  return out


def _case(lengths, dtype, a_shape, seed=0):
  rng = np.random.default_rng(seed)
  b = LoDTensor.from_lengths(
    rng.normal(size=(sum(lengths), FEATURES)).astype(dtype), [lengths], buckets=BUCKETS
  )
  rows = b.capacity.tokens
  shape = {"rows": (rows,), "column": (rows, 1), "full": (rows, FEATURES)}[a_shape]
  a = rng.uniform(0.3, 1.1, size=shape).astype(dtype)
  init = rng.normal(size=(b.capacity.sequences[-1], FEATURES)).astype(dtype)
  return a, b, init


def _full(a):
  return a.reshape(a.shape + (1,) * (2 - a.ndim))


LENGTHS = st.lists(st.integers(0, 6), max_size=6).filter(lambda n: sum(n) <= 24)


def reference_grads(a, b, init, lengths, reverse, weights):
  """The gradients of ``sum(h * weights)`` with respect to `a` (full),
  `b` and `init`, by the adjoint recurrence run backwards (NumPy)."""
  h = reference(a, b, init, lengths, reverse)
  ga, gb, ginit = np.zeros_like(h), np.zeros_like(h), np.zeros_like(init)
  start = 0
  for i, n in enumerate(lengths):
    order = list(range(start, start + n))[:: -1 if reverse else 1]
    g = np.zeros(h.shape[1:])
    for k in reversed(range(n)):
      t = order[k]
      g = weights[t] + g
      gb[t] = g
      ga[t] = g * (h[order[k - 1]] if k else init[i])
      g = a[t] * g
    ginit[i] = g
    start += n
  return ga, gb, ginit


_scan = jax.jit(linear_scan, static_argnames="reverse")


@functools.partial(jax.jit, static_argnames="reverse")
def _scan_and_grads(a, b, init, weights, *, reverse):
  def loss(a, values, init):
    out = linear_scan(a, b.with_values(values), init=init, reverse=reverse)
    return jnp.sum(out.values * weights)

  got = linear_scan(a, b, init=init, reverse=reverse)
  return got.values, jax.grad(loss, argnums=(0, 1, 2))(a, b.values, init)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("a_shape", ["rows", "column", "full"])
def test_values_and_gradients_equal_the_sequential_recurrence(reverse, a_shape):
  @settings(max_examples=8, deadline=None)
  @given(LENGTHS)
  def check(lengths):
    with jax.enable_x64(True):
      a, b, init = _case(lengths, np.float64, a_shape)
      values = np.asarray(b.values)
      weights = np.random.default_rng(1).normal(size=values.shape)
      got, got_grads = _scan_and_grads(a, b, init, weights, reverse=reverse)
      want = reference(_full(a), values, init, lengths, reverse)
      np.testing.assert_allclose(np.asarray(got), want, **TOLERANCE[np.float64])
      ga, gb, ginit = reference_grads(_full(a), values, init, lengths, reverse, weights)
      ga = ga.sum(axis=1).reshape(a.shape) if a.ndim == 1 or a.shape[1] == 1 else ga
      for g, w in zip(got_grads, (ga, gb, ginit), strict=True):
        np.testing.assert_allclose(np.asarray(g), w, **TOLERANCE[np.float64])

  check()


@pytest.mark.parametrize("reverse", [False, True])
def test_float32_and_default_zero_init(reverse):
  lengths = [3, 0, 6, 1, 5]
  a, b, _ = _case(lengths, np.float32, "full", seed=2)
  got = jax.jit(lambda a, b: linear_scan(a, b, reverse=reverse))(a, b)
  zeros = np.zeros((6, FEATURES), np.float32)
  want = reference(a, np.asarray(b.values), zeros, lengths, reverse)
  np.testing.assert_allclose(np.asarray(got.values), want, **TOLERANCE[np.float32])
  assert got.recursive_lengths() == b.recursive_lengths()


def test_a_as_a_lod_tensor_and_a_two_level_lod():
  """The scan restarts at every last-level sequence of a 2-level LoD."""
  rng = np.random.default_rng(3)
  outer, inner = [2, 0, 1], [3, 2, 4]
  values = rng.normal(size=(9, FEATURES)).astype(np.float32)
  b = LoDTensor.from_lengths(values, [outer, inner])
  a = b.with_values(rng.uniform(0.5, 1.0, size=(9, 1)).astype(np.float32))
  init = rng.normal(size=(3, FEATURES)).astype(np.float32)
  got = linear_scan(a, b, init=init)
  want = reference(np.asarray(a.values), values, init, inner, False)
  np.testing.assert_allclose(np.asarray(got.values), want, rtol=1e-5, atol=1e-6)
  assert got.recursive_lengths() == [outer, inner]


def test_one_compilation_per_capacity():
  traces = []

  @jax.jit
  def scan(a, b):
    traces.append(1)
    return linear_scan(a, b).values

  rng = np.random.default_rng(4)
  for _ in range(10):
    lengths = list(rng.integers(0, 5, size=5))
    a, b, _ = _case(lengths, np.float32, "rows")
    scan(a, b)
  assert len(traces) == 1


def test_padding_rows_are_zero_whatever_their_values():
  a, b, init = _case([2, 3], np.float32, "rows")
  values = np.asarray(b.values).copy()
  values[5:] = np.inf
  a = a.copy()
  a[5:] = np.nan
  got = np.asarray(linear_scan(a, b.with_values(values), init=init).values)
  assert np.all(got[5:] == 0) and np.all(np.isfinite(got))


def test_errors():
  a, b, init = _case([2, 3], np.float32, "rows")
  with pytest.raises(TypeError, match="`b` to be a LoDTensor"):
    linear_scan(a, np.zeros(3))
  with pytest.raises(TypeError, match="`b.values` to have a float dtype"):
    linear_scan(a, b.with_values(np.zeros(24, np.int32)))
  with pytest.raises(ValueError, match=r"broadcast to `b.values` \(24, 3\)"):
    linear_scan(np.ones((24, 2), np.float32), b)
  with pytest.raises(ValueError, match=r"`init` to have shape \(6, 3\)"):
    linear_scan(a, b, init=np.zeros((5, 3), np.float32))
  with pytest.raises(TypeError, match="`reverse`"):
    linear_scan(a, b, reverse=1)
  other = LoDTensor.from_lengths(np.ones(5, np.float32), [[3, 2]], buckets=BUCKETS)
  with pytest.raises(ValueError, match="`a` to have the LoD of `b`"):
    linear_scan(other, b.with_values(np.ones(24, np.float32)))
  # Under jit another LoD poisons the states and records the fault.
  out = jax.jit(linear_scan)(other, b.with_values(np.ones(24, np.float32)))
  assert np.isnan(np.asarray(out.values)).all()
  assert int(out.faults) & Fault.INPUT


# -- no leak between sequences, no overflow the sequential recurrence lacks ----------

LEAK_CASES = [
  # (a, b, want): the reproductions, the states of two sequences of 4.
  ([1e30] * 4 + [0.5] * 4, [1.0] * 8, [1, 1e30, np.inf, np.inf, 1, 1.5, 1.75, 1.875]),
  ([1e30] * 4 + [0.5] * 4, [0.0] * 4 + [1.0] * 4, [0, 0, 0, 0, 1, 1.5, 1.75, 1.875]),
]


@pytest.mark.parametrize("a, b, want", LEAK_CASES)
@pytest.mark.parametrize("jit", [False, True])
def test_an_overflow_stays_in_its_sequence(a, b, want, jit):
  x = LoDTensor.from_lengths(np.array(b, np.float32), [[4, 4]])
  scan = jax.jit(linear_scan) if jit else linear_scan
  got = np.asarray(scan(np.array(a, np.float32), x).values)
  np.testing.assert_array_equal(got, np.array(want, np.float32))


def test_an_overflow_stays_in_its_sequence_in_float64_and_reverse():
  with jax.enable_x64(True):
    x = LoDTensor.from_lengths(np.ones(8), [[4, 4]])
    a = np.array([1e200] * 4 + [0.5] * 4)
    got = np.asarray(linear_scan(a, x).values)
    np.testing.assert_array_equal(got, [1, 1e200, np.inf, np.inf, 1, 1.5, 1.75, 1.875])
  x = LoDTensor.from_lengths(np.ones(8, np.float32), [[4, 4]])
  a = np.array([0.5] * 4 + [1e30] * 4, np.float32)
  got = np.asarray(linear_scan(a, x, reverse=True).values)
  want = np.array([1.875, 1.75, 1.5, 1, np.inf, np.inf, 1e30, 1], np.float32)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("poison", [np.inf, -np.inf, np.nan, 1e30])
@pytest.mark.parametrize("reverse", [False, True])
def test_no_value_or_gradient_crosses_a_boundary(poison, reverse):
  """Poisoning the middle sequence (in `a`, `b` and `init`) leaves the
  other sequences' states and gradients bitwise as they were."""
  lengths = [3, 4, 2]
  a, b, init = _case(lengths, np.float32, "full", seed=5)
  other = np.asarray(b.segment_ids()) != 1
  other &= np.asarray(b.row_mask())
  weights = np.where(other[:, None], 1.0, 0.0).astype(np.float32)

  def loss(a, values, init):
    out = linear_scan(a, b.with_values(values), init=init, reverse=reverse)
    return jnp.sum(out.values * weights), out.values

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
  clean_grads, clean = grad(a, b.values, init)
  a2, values2, init2 = a.copy(), np.asarray(b.values).copy(), init.copy()
  a2[3:7], values2[3:7], init2[1] = poison, poison, poison
  grads, got = grad(a2, values2, init2)
  np.testing.assert_array_equal(np.asarray(got)[other], np.asarray(clean)[other])
  for g, want in zip(grads[:2], clean_grads[:2], strict=True):
    np.testing.assert_array_equal(np.asarray(g)[other], np.asarray(want)[other])
  keep = np.arange(6) != 1
  np.testing.assert_array_equal(np.asarray(grads[2])[keep], clean_grads[2][keep])


def _decays():
  """Decays over ``[0, 1e30]``: zeros, ones, and values of every scale."""
  exact = st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e10, 1e20, 1e30])
  spread = st.floats(-30, 30).map(lambda e: 10.0**e)
  return st.one_of(exact, spread, st.floats(0, 1e30))


def _inputs():
  exact = st.sampled_from([0.0, 1.0, -1.0])
  return st.one_of(exact, st.floats(-1e20, 1e20))


@st.composite
def _overflow_case(draw):
  sizes = st.lists(st.integers(0, 10), max_size=6)
  lengths = draw(sizes.filter(lambda n: sum(n) <= 24))
  a = draw(st.lists(_decays(), min_size=24, max_size=24))
  b = draw(st.lists(_inputs(), min_size=24, max_size=24))
  return lengths, np.array(a), np.array(b), draw(st.booleans())


def _bound(a, b, lengths, reverse):
  """The states of ``|a|`` and ``|b|`` in float64: the scale of each
  state's rounding error."""
  with np.errstate(all="ignore"):
    return reference(np.abs(a), np.abs(b), np.zeros(len(lengths)), lengths, reverse)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_equals_the_sequential_recurrence_where_it_is_finite_and_its_overflow(dtype):
  """On decays spanning ``[0, 1e30]``: where the sequential recurrence is
  finite the scan is too and agrees up to rounding; where it is not, the
  scan's values are its inf and NaN exactly."""
  tol = TOLERANCE[dtype]

  @settings(max_examples=60, deadline=None)
  @given(_overflow_case())
  def check(case):
    lengths, a, b, reverse = case
    with jax.enable_x64(dtype == np.float64):
      a, b = a.astype(dtype), b.astype(dtype)
      rows = sum(lengths)
      b[rows:] = 0
      x = LoDTensor.from_lengths(b[:rows], [lengths], buckets=BUCKETS)
      got = np.asarray(_scan(a, x, reverse=reverse).values)[:rows]
      with np.errstate(all="ignore"):
        zeros = np.zeros(len(lengths), dtype)
        want = reference(a, b, zeros, lengths, reverse)[:rows]
      finite = np.isfinite(want)
      np.testing.assert_array_equal(got[~finite], want[~finite])
      bound = _bound(a.astype(np.float64), b.astype(np.float64), lengths, reverse)
      error = np.abs(got[finite].astype(np.float64) - want[finite])
      assert np.all(error <= tol["atol"] + tol["rtol"] * bound[:rows][finite])

  check()
