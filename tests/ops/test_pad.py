"""Tests of sequence_pad, sequence_unpad, sequence_mask and sequence_reverse."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify
from jax.test_util import check_grads

from jaxlod import Buckets, Capacity, LoDTensor
from jaxlod.ops import sequence_mask, sequence_pad, sequence_reverse, sequence_unpad
from tests.helpers import (
  CASES,
  assert_close,
  assert_lod_equal,
  assert_nested_equal,
  lod_tensors,
  make_case,
)

PAD = -3.0


def _make(name: str, dtype=np.float32, seed: int = 0) -> LoDTensor:
  return make_case(*CASES[name], dtype=dtype, seed=seed)


# -- NumPy references (loops over `to_list`) -----------------------------------------


def last_level(x: LoDTensor) -> list[np.ndarray]:
  """The real last-level sequences of `x`, in order."""
  seqs = x.to_list()
  for _ in range(x.num_levels - 1):
    seqs = [s for group in seqs for s in group]
  return seqs


def pad_reference(x: LoDTensor, pad, maxlen: int):
  count = x.capacity.sequences[-1]
  padded = np.empty((count, maxlen, *x.feature_shape), x.values.dtype)
  padded[:] = np.asarray(pad, x.values.dtype)
  lengths = np.zeros(count, np.int32)
  for i, seq in enumerate(last_level(x)):
    padded[i, : seq.shape[0]] = seq
    lengths[i] = seq.shape[0]
  return padded, lengths


def pad_grad_reference(x: LoDTensor, g: np.ndarray):
  """VJP of `sequence_pad` by hand: cells go back to their rows or to the pad."""
  grad_values = np.zeros(np.shape(x.values), g.dtype)
  grad_pad = g.sum(axis=(0, 1))
  offsets = np.asarray(x.offsets[-1])
  for i, length in enumerate(np.diff(offsets)):
    grad_values[offsets[i] : offsets[i] + length] = g[i, :length]
    grad_pad = grad_pad - g[i, :length].sum(axis=0)
  return grad_values, grad_pad


def unpad_reference(padded: np.ndarray, lengths) -> list[np.ndarray]:
  return [padded[i, :n] for i, n in enumerate(lengths)]


def reverse_reference(x: LoDTensor) -> list:
  seqs = x.to_list()
  if x.num_levels == 1:
    return [s[::-1] for s in seqs]
  return [[s[::-1] for s in group] for group in seqs]


# -- sequence_pad --------------------------------------------------------------------

_pad = jax.jit(sequence_pad, static_argnums=2)


def check_pad(got, x: LoDTensor, pad, maxlen: int) -> None:
  padded, lengths = got
  expected, expected_lengths = pad_reference(x, pad, maxlen)
  assert padded.shape == expected.shape
  assert padded.dtype == x.values.dtype
  assert lengths.dtype == jnp.int32
  np.testing.assert_array_equal(padded, expected)
  np.testing.assert_array_equal(lengths, expected_lengths)


@settings(max_examples=25)
@given(x=lod_tensors())
def test_pad_matches_reference(x):
  check_pad(_pad(x, PAD, None), x, PAD, x.time_capacity[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_pad_cases_eager_and_jit(name):
  x = _make(name)
  longest = max(max(x.recursive_lengths()[-1]), 1)
  for maxlen in (None, longest, x.time_capacity[-1] + 2):
    size = x.time_capacity[-1] if maxlen is None else maxlen
    check_pad(_pad(x, 1.5, maxlen), x, 1.5, size)
  check_pad(sequence_pad(x, 1.5, longest), x, 1.5, longest)


def test_pad_worked_example():
  x = LoDTensor.from_lengths(
    np.array([1, 2, 3], np.int32),
    [[2, 0, 1]],
    buckets=Buckets.fixed(tokens=4, sequences=4, time=3),
  )
  padded, lengths = _pad(x, 9, 2)
  np.testing.assert_array_equal(padded, [[1, 2], [9, 9], [3, 9], [9, 9]])
  np.testing.assert_array_equal(lengths, [2, 0, 1, 0])
  assert padded.dtype == jnp.int32


def test_pad_value_per_feature():
  x = _make("one-level")
  pad = np.array([7.0, -7.0], np.float32)
  check_pad(_pad(x, pad, None), x, pad, 5)


def test_pad_without_rows():
  for lengths in ([[]], [[0, 0]]):
    x = LoDTensor.from_lengths(np.zeros((0, 2), np.float32), lengths)
    padded, got = _pad(x, 1.0, 3)
    np.testing.assert_array_equal(padded, np.ones((len(lengths[0]), 3, 2)))
    np.testing.assert_array_equal(got, np.zeros(len(lengths[0])))


def test_pad_maxlen_too_small():
  x = _make("one-level")
  with pytest.raises(
    ValueError,
    match=r"sequence_pad: the longest sequence has 4 rows, more than `maxlen` 3; "
    r"data is never truncated\.",
  ):
    sequence_pad(x, 0.0, maxlen=3)
  checked = checkify.checkify(_pad)
  err, _ = checked(x, 0.0, 3)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"sequence_pad: a sequence is longer than `maxlen` 3; data is never "
    r"truncated\.",
  ):
    err.throw()
  err, (padded, _) = checked(x, 0.0, 4)
  err.throw()
  check_pad((padded, x.lengths()), x, 0.0, 4)


@pytest.mark.parametrize(
  ("x", "pad", "maxlen", "error", "match"),
  [
    ([1.0], 0.0, None, TypeError, r"Expected `x` to be a LoDTensor, got list\."),
    (None, 0.0, 3.0, TypeError, r"Expected `maxlen` to be a static int, got 3\.0\."),
    (
      None,
      0.0,
      jnp.int32(3),
      TypeError,
      r"Expected `maxlen` to be a static int, got Array\(3",
    ),
    (None, 0.0, -1, ValueError, r"Expected `maxlen` >= 0, got -1\."),
    (
      None,
      np.zeros((2, 2)),
      None,
      ValueError,
      r"Expected `pad_value` to be a scalar or to broadcast to the feature shape "
      r"\(2,\), got shape \(2, 2\)\.",
    ),
  ],
  ids=["not-lod", "float-maxlen", "array-maxlen", "negative-maxlen", "pad-shape"],
)
def test_pad_errors(x, pad, maxlen, error, match):
  x = _make("one-level") if x is None else x
  with pytest.raises(error, match=match):
    sequence_pad(x, pad, maxlen)


@pytest.mark.parametrize("name", ["one-level", "two-level", "features-2d"])
def test_pad_check_grads_float64(name):
  with jax.enable_x64(True):
    x = _make(name, dtype=np.float64)
    pad = jnp.full(x.feature_shape, 0.5, jnp.float64)
    fn = jax.jit(lambda v, p: sequence_pad(x.with_values(v), p, 6)[0])
    check_grads(fn, (x.values, pad), order=1, modes=("rev",))


@pytest.mark.parametrize("name", ["one-level", "two-level", "scalar-rows"])
def test_pad_vjp_matches_reference(name):
  x = _make(name)
  pad = jnp.zeros(x.feature_shape)
  fn = jax.jit(lambda v, p: sequence_pad(x.with_values(v), p, 6)[0])
  out, vjp = jax.vjp(fn, x.values, pad)
  g = jax.random.normal(jax.random.key(1), out.shape)
  grad_values, grad_pad = vjp(g)
  expected_values, expected_pad = pad_grad_reference(x, np.asarray(g))
  assert_close(grad_values, expected_values)
  assert_close(grad_pad, expected_pad, rtol=1e-5, atol=1e-5)  # sums of ~30 cells


# -- sequence_unpad ------------------------------------------------------------------

_unpad = jax.jit(sequence_unpad, static_argnames="capacity")


@settings(max_examples=25)
@given(x=lod_tensors())
def test_unpad_inverts_pad(x):
  padded, lengths = _pad(x, PAD, None)
  count, time = padded.shape[:2]
  num = x.num_sequences(-1)
  y = _unpad(padded, lengths, num_sequences=num)
  assert y.capacity == Capacity(count * time, (count,), (time,))
  assert_nested_equal(y.to_list(), last_level(x))
  if x.num_levels == 1:
    y = _unpad(padded, lengths, num_sequences=x.num_outer, capacity=x.capacity.tokens)
    assert_lod_equal(y, x)


def test_unpad_inverts_pad_eagerly():
  x = _make("one-level")
  y = sequence_unpad(*sequence_pad(x, 0.0), num_sequences=x.num_outer)
  assert_nested_equal(y.to_list(), x.to_list())
  assert y.capacity == Capacity(30, (6,), (5,))
  y = sequence_unpad(*sequence_pad(x, 0.0), num_sequences=4, capacity=12)
  assert_lod_equal(y, x)


_COUNT, _TIME = 5, 4


@settings(max_examples=25)
@given(
  lengths=st.lists(st.integers(0, _TIME), min_size=_COUNT, max_size=_COUNT),
  seed=st.integers(0, 2**31 - 1),
)
def test_unpad_matches_reference(lengths, seed):
  rng = np.random.default_rng(seed)
  padded = rng.normal(size=(_COUNT, _TIME, 3)).astype(np.float32)
  y = _unpad(padded, np.asarray(lengths, np.int32))
  assert_nested_equal(y.to_list(), unpad_reference(padded, lengths))
  assert int(y.num_outer) == _COUNT
  np.testing.assert_array_equal(np.asarray(y.values)[sum(lengths) :], 0)


def test_unpad_real_count_and_short_lengths():
  padded = np.arange(24.0, dtype=np.float32).reshape(4, 3, 2)
  # Eagerly, `lengths` may hold just the real sequences.
  y = sequence_unpad(padded, np.array([2, 0, 3]), num_sequences=3)
  assert y.recursive_lengths() == [[2, 0, 3]]
  assert_nested_equal(y.to_list(), unpad_reference(padded, [2, 0, 3]))
  assert y.capacity == Capacity(12, (4,), (3,))
  np.testing.assert_array_equal(y.lengths(), [2, 0, 3, 0])


def test_unpad_bucketed_capacity():
  padded = np.ones((8, 6, 2), np.float32)
  lengths = np.array([3, 1, 2, 0, 0, 0, 0, 0])
  y = sequence_unpad(padded, lengths, num_sequences=3, capacity=Buckets.pow2(4))
  assert y.capacity == Capacity(8, (4,), (4,))
  assert y.recursive_lengths() == [[3, 1, 2]]
  fixed = Buckets.fixed(tokens=10, sequences=8, time=5)
  y = _unpad(padded, lengths, num_sequences=3, capacity=fixed)
  assert y.capacity == Capacity(10, (8,), (5,))
  assert y.recursive_lengths() == [[3, 1, 2]]


def test_unpad_worked_example_scalar_rows():
  y = _unpad(jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([1, 3]))
  assert y.values.dtype == jnp.int32
  np.testing.assert_array_equal(y.values, [1, 4, 5, 6, 0, 0])
  assert y.recursive_lengths() == [[1, 3]]


@pytest.mark.parametrize(
  ("padded", "lengths", "kwargs", "error", "match"),
  [
    (
      np.zeros(3),
      np.zeros(3, int),
      {},
      ValueError,
      r"Expected `padded` to have shape \[count, time, \*features\] \(rank >= 2\), "
      r"got \(3,\)\.",
    ),
    (
      np.zeros((3, 2)),
      np.zeros(3),
      {},
      TypeError,
      r"Expected `lengths` to have an integer dtype, got float32\.",
    ),
    (
      np.zeros((3, 2)),
      np.zeros((3, 1), int),
      {},
      ValueError,
      r"Expected `lengths` to have shape \[count\] \(3,\), got \(3, 1\)\.",
    ),
    (
      np.zeros((3, 2)),
      np.zeros(4, int),
      {},
      ValueError,
      r"Expected `lengths` to have leading dimension 3 \(count capacity\) or 3 "
      r"\(sequences\), got shape \(4,\)\.",
    ),
    (
      np.zeros((3, 2)),
      np.array([1, 3, 0]),
      {},
      ValueError,
      r"sequence_unpad: lengths\[1\] = 3 is outside \[0, 2\] \(the time dimension "
      r"of `padded`\)\.",
    ),
    (
      np.zeros((3, 2)),
      np.array([1, 0, -1]),
      {},
      ValueError,
      r"sequence_unpad: lengths\[2\] = -1 is outside \[0, 2\]",
    ),
    (
      np.zeros((3, 2)),
      np.array([1, 0, 2]),
      {"num_sequences": 2},
      ValueError,
      r"sequence_unpad: lengths\[2\] = 2, but sequence 2 is past `num_sequences` 2; "
      r"padding sequences must be empty\.",
    ),
    (
      np.zeros((3, 2)),
      np.array([1, 0, 2]),
      {"num_sequences": 4},
      ValueError,
      r"Expected `num_sequences` in \[0, 3\] \(the count of `padded`\), got 4\.",
    ),
    (
      np.zeros((3, 2)),
      np.array([1, 0, 2]),
      {"num_sequences": 2.0},
      TypeError,
      r"Expected `num_sequences` to be an int or an integer scalar, got "
      r"float32\[\]\.",
    ),
    (
      np.zeros((3, 2)),
      np.array([1, 0, 2]),
      {"capacity": 2},
      ValueError,
      r"sequence_unpad: the output needs tokens 3, more than its capacity 2; data "
      r"is never truncated\. Pass a larger `capacity`\.",
    ),
    (
      np.zeros((3, 2)),
      np.array([1, 0, 2]),
      {"capacity": 2.5},
      TypeError,
      r"sequence_unpad: expected `capacity` to be None, an int or a Buckets "
      r"policy, got 2\.5\.",
    ),
  ],
  ids=[
    "padded-rank",
    "float-lengths",
    "lengths-rank",
    "lengths-count",
    "too-long",
    "negative",
    "past-num-sequences",
    "num-sequences-range",
    "num-sequences-type",
    "capacity-overflow",
    "capacity-type",
  ],
)
def test_unpad_errors(padded, lengths, kwargs, error, match):
  with pytest.raises(error, match=match):
    sequence_unpad(padded, lengths, **kwargs)


_checked_unpad = checkify.checkify(_unpad)


@pytest.mark.parametrize(
  ("lengths", "num", "capacity", "match"),
  [
    (
      [1, 3, 0],
      3,
      None,
      r"sequence_unpad: a length is outside \[0, 2\] \(the time dimension of "
      r"`padded`\)\.",
    ),
    (
      [1, 0, 2],
      2,
      None,
      r"sequence_unpad: a sequence past `num_sequences` has a nonzero length; "
      r"padding sequences must be empty\.",
    ),
    (
      [2, 2, 1],
      3,
      4,
      r"sequence_unpad: the output needs more tokens than its capacity 4; pass a "
      r"larger `capacity`\.",
    ),
  ],
  ids=["too-long", "past-num-sequences", "capacity-overflow"],
)
def test_unpad_checkify(lengths, num, capacity, match):
  padded = jnp.zeros((3, 2))
  err, _ = _checked_unpad(
    padded, jnp.array(lengths), num_sequences=jnp.int32(num), capacity=capacity
  )
  with pytest.raises(checkify.JaxRuntimeError, match=match):
    err.throw()
  err, y = _checked_unpad(
    padded, jnp.array([2, 1, 0]), num_sequences=jnp.int32(2), capacity=capacity
  )
  err.throw()
  assert y.recursive_lengths() == [[2, 1]]


def test_unpad_check_grads_float64():
  with jax.enable_x64(True):
    padded = jax.random.normal(jax.random.key(0), (4, 3, 2), jnp.float64)
    lengths = jnp.array([2, 0, 3, 1])
    fn = jax.jit(lambda p: sequence_unpad(p, lengths).values)
    check_grads(fn, (padded,), order=1, modes=("rev",))


def test_unpad_vjp_matches_reference():
  padded = jax.random.normal(jax.random.key(0), (4, 3, 2))
  lengths = np.array([2, 0, 3, 0])
  fn = jax.jit(lambda p: sequence_unpad(p, lengths, num_sequences=3).values)
  out, vjp = jax.vjp(fn, padded)
  g = np.asarray(jax.random.normal(jax.random.key(1), out.shape))
  (grad,) = vjp(jnp.asarray(g))
  expected = np.zeros((4, 3, 2), np.float32)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  for i, n in enumerate(lengths):
    expected[i, :n] = g[offsets[i] : offsets[i] + n]
  assert_close(grad, expected)


# -- sequence_mask -------------------------------------------------------------------

_mask = jax.jit(sequence_mask, static_argnums=(1, 2))


@pytest.mark.parametrize(
  "lengths",
  [np.array(2), np.array([3, 0, 1]), np.array([[1, 4], [0, 2]], np.int64)],
  ids=["scalar", "vector", "matrix"],
)
@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int32, jnp.float32])
def test_mask_matches_numpy(lengths, dtype):
  expected = np.arange(5) < lengths[..., None]
  got = _mask(lengths, 5, dtype)
  assert got.shape == lengths.shape + (5,)
  assert got.dtype == dtype
  np.testing.assert_array_equal(got, expected.astype(dtype))
  np.testing.assert_array_equal(sequence_mask(lengths, 5, dtype), got)


def test_mask_default_maxlen_eager():
  got = sequence_mask(np.array([[1, 4], [0, 2]]))
  assert got.shape == (2, 2, 4)
  assert got.dtype == jnp.bool_
  np.testing.assert_array_equal(
    got, np.arange(4) < np.array([[1, 4], [0, 2]])[..., None]
  )
  assert sequence_mask(np.zeros((0,), np.int32)).shape == (0, 0)
  assert sequence_mask(np.array([3]), maxlen=np.int64(2)).shape == (1, 2)


def test_mask_errors():
  with pytest.raises(
    TypeError, match=r"Expected `lengths` to have an integer dtype, got float32\."
  ):
    sequence_mask(np.array([1.0, 2.0], np.float32), 3)
  with pytest.raises(
    TypeError, match=r"Expected `lengths` to have an integer dtype, got bool\."
  ):
    sequence_mask(np.array([True]), 3)
  with pytest.raises(
    TypeError, match=r"Expected `maxlen` to be a static int, got 3\.0"
  ):
    sequence_mask(np.array([1, 2]), 3.0)
  with pytest.raises(ValueError, match=r"Expected `maxlen` >= 0, got -2\."):
    sequence_mask(np.array([1, 2]), -2)
  with pytest.raises(
    ValueError,
    match=r"sequence_mask: `maxlen` must be given as a static int under jit \(the "
    r"mask's shape cannot depend on the values of `lengths`\), got None\.",
  ):
    jax.jit(sequence_mask)(np.array([1, 2]))


# -- sequence_reverse ----------------------------------------------------------------

_reverse = jax.jit(sequence_reverse)


def check_reverse(y: LoDTensor, x: LoDTensor) -> None:
  assert y.capacity == x.capacity
  for a, e in zip(y.offsets, x.offsets, strict=True):
    np.testing.assert_array_equal(a, e)
  assert int(y.num_outer) == int(x.num_outer)
  assert y.values.dtype == x.values.dtype
  assert_nested_equal(y.to_list(), reverse_reference(x))
  np.testing.assert_array_equal(np.asarray(y.values)[int(x.num_rows) :], 0)


@settings(max_examples=25)
@given(x=lod_tensors())
def test_reverse_matches_reference(x):
  check_reverse(_reverse(x), x)


@pytest.mark.parametrize("name", list(CASES))
def test_reverse_cases_eager_and_jit(name):
  x = _make(name)
  check_reverse(_reverse(x), x)
  check_reverse(sequence_reverse(x), x)
  # Twice is the identity.
  assert_lod_equal(_reverse(_reverse(x)), x)


def test_reverse_any_dtype():
  x = _make("two-level")
  for dtype in (np.int32, np.bool_):
    y = x.with_values((np.asarray(x.values) > 0).astype(dtype))
    check_reverse(sequence_reverse(y), y)


def test_reverse_without_rows():
  for lengths in ([[]], [[0, 0]]):
    x = LoDTensor.from_lengths(np.zeros((0, 2), np.float32), lengths)
    assert_lod_equal(_reverse(x), x)


def test_reverse_check_grads_float64():
  with jax.enable_x64(True):
    x = _make("two-level", dtype=np.float64)
    fn = jax.jit(lambda v: sequence_reverse(x.with_values(v)).values)
    check_grads(fn, (x.values,), order=1, modes=("rev",))


@pytest.mark.parametrize("name", ["one-level", "two-level"])
def test_reverse_vjp_is_the_reverse(name):
  x = _make(name)
  fn = jax.jit(lambda v: sequence_reverse(x.with_values(v)).values)
  g = jax.random.normal(jax.random.key(2), x.values.shape)
  (grad,) = jax.vjp(fn, x.values)[1](g)
  expected = np.asarray(sequence_reverse(x.with_values(g)).values)
  np.testing.assert_array_equal(grad, expected)
  # Padding rows get no gradient.
  np.testing.assert_array_equal(np.asarray(grad)[int(x.num_rows) :], 0)


def test_reverse_errors():
  with pytest.raises(TypeError, match=r"Expected `x` to be a LoDTensor, got ndarray\."):
    sequence_reverse(np.zeros(3))


def test_pad_maxlen_too_small_under_plain_jit_is_nan():
  x = LoDTensor.from_lengths(np.arange(5.0, dtype=np.float32), [[3, 2]])
  padded, lengths = jax.jit(lambda x: sequence_pad(x, 0.0, maxlen=2))(x)
  assert np.isnan(np.asarray(padded[0])).all()
  np.testing.assert_array_equal(padded[1], [3, 4])
  assert lengths.tolist() == [3, 2]
  # The gradient reaches the rows that fit.
  grad = jax.grad(lambda v: jnp.nansum(sequence_pad(x.with_values(v), 0.0, 2)[0]))
  np.testing.assert_array_equal(jax.jit(grad)(x.values), [0, 0, 0, 1, 1])
