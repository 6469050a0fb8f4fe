"""Tests of sequence_conv and sequence_enumerate."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify
from jax.test_util import check_grads

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import sequence_conv, sequence_enumerate
from tests.helpers import (
  ONE_LEVEL,
  TWO_LEVEL,
  assert_close,
  assert_nested_equal,
  last_level,
  lod_tensors,
  recursive_lengths,
)

# -- NumPy references ---------------------------------------------------------------


def _context(seq: np.ndarray, shifts) -> np.ndarray:
  """``[len, len(shifts) * D]``: rows ``r + s`` of the sequence, zeros outside."""
  n, dim = seq.shape
  out = np.zeros((n, len(shifts) * dim), seq.dtype)
  for r in range(n):
    for k, s in enumerate(shifts):
      if 0 <= r + s < n:
        out[r, k * dim : (k + 1) * dim] = seq[r + s]
  return out


def _shifts(start, length, stride):
  start = -(length // 2) if start is None else start
  return [start + k * stride for k in range(length)]


def conv_reference(x, filter, bias, start, length, stride):
  """``[token_capacity, out]``: each sequence's context times `filter`."""
  rows = [
    _context(seq, _shifts(start, length, stride)) @ filter + bias
    for seq in last_level(x)
  ]
  out = np.zeros((x.capacity.tokens, filter.shape[1]), np.float64)
  real = np.concatenate(rows) if rows else np.zeros((0, filter.shape[1]))
  out[: real.shape[0]] = real
  return out


def conv_grad_reference(x, filter, cotangent, start, length, stride):
  """Gradients of ``sum(sequence_conv(...).values * cotangent)``."""
  shifts = _shifts(start, length, stride)
  offsets = np.asarray(x.offsets[-1])
  dim = x.feature_shape[0]
  d_values = np.zeros(x.values.shape)
  d_filter = np.zeros(filter.shape)
  for i, seq in enumerate(last_level(x)):
    first = offsets[i]
    ct = cotangent[first : first + seq.shape[0]]
    d_filter += _context(seq, shifts).T @ ct
    d_context = ct @ filter.T
    for r in range(seq.shape[0]):
      for k, s in enumerate(shifts):
        if 0 <= r + s < seq.shape[0]:
          d_values[first + r + s] += d_context[r, k * dim : (k + 1) * dim]
  rows = int(x.num_rows)
  return d_values, d_filter, cotangent[:rows].sum(axis=0)


def enumerate_reference(x, win_size, pad_value):
  """Per sequence, ``[len, win_size]`` windows of the ids."""
  out = []
  for seq in last_level(x):
    seq = seq.reshape(-1)
    windows = np.full((seq.size, win_size), pad_value, seq.dtype)
    for r in range(seq.size):
      window = seq[r : r + win_size]
      windows[r, : window.size] = window
    out.append(windows)
  return out


def _last_level_list(y: LoDTensor) -> list[np.ndarray]:
  return [np.asarray(s) for s in last_level(y)]


# -- sequence_conv -------------------------------------------------------------------

CONV_SETTINGS = [(None, 3, 1), (-1, 2, 2), (0, 1, 1), (-3, 4, 1), (1, 3, 3)]
_jit_conv = jax.jit(sequence_conv, static_argnums=(2, 3, 4))


def test_conv_worked_example():
  x = LoDTensor.from_lengths(
    np.arange(1.0, 6.0, dtype=np.float32)[:, None],
    [[3, 0, 2]],
    buckets=Buckets.fixed(tokens=7, sequences=4, time=4),
  )
  filter = np.array([[1.0], [10.0], [100.0]], np.float32)
  y = _jit_conv(x, filter, None, 3, 1)
  # Row r sees [r - 1, r, r + 1] of its own sequence.
  np.testing.assert_array_equal(y.values[:, 0], [210, 321, 32, 540, 54, 0, 0])
  assert y.recursive_lengths() == [[3, 0, 2]]
  assert y.capacity == x.capacity


@settings(max_examples=25)
@given(
  x=lod_tensors(),
  setting=st.sampled_from(CONV_SETTINGS),
  seed=st.integers(0, 2**16),
)
def test_conv_matches_reference(x, setting, seed):
  start, length, stride = setting
  rng = np.random.default_rng(seed)
  filter = rng.normal(size=(length * 2, 3)).astype(np.float32)
  bias = rng.normal(size=3).astype(np.float32)
  y = _jit_conv(x, filter, start, length, stride, bias)
  expected = conv_reference(x, filter, bias, start, length, stride)
  assert_close(y.values, expected, rtol=1e-5, atol=1e-5)  # sums of products
  assert y.recursive_lengths() == x.recursive_lengths()
  assert y.capacity == x.capacity


def test_conv_eager_matches_jit():
  x = LoDTensor.from_lengths(
    np.random.default_rng(0).normal(size=(9, 2)).astype(np.float32),
    [[2, 1], [4, 0, 5]],
    buckets=TWO_LEVEL,
  )
  filter = np.random.default_rng(1).normal(size=(6, 4)).astype(np.float32)
  eager = sequence_conv(x, filter)
  assert_close(eager.values, _jit_conv(x, filter, None, 3, 1).values)
  assert_close(eager.values, conv_reference(x, filter, 0.0, None, 3, 1), atol=1e-5)
  assert eager.recursive_lengths() == [[2, 1], [4, 0, 5]]


def test_conv_default_start_is_centred():
  x = LoDTensor.from_lengths(np.eye(5, dtype=np.float32)[:, :1], [[5]])
  # context_length 4: rows r - 2 .. r + 1, so row 2 sees row 0 in slot 0.
  filter = np.eye(4, dtype=np.float32)
  y = _jit_conv(x, filter, None, 4, 1)
  np.testing.assert_array_equal(y.values[:, 0], [0, 0, 1, 0, 0])
  assert_close(y.values, _jit_conv(x, filter, -2, 4, 1).values)


def _conv_loss_parts(x, setting):
  start, length, stride = setting

  def fn(values, filter, bias):
    y = sequence_conv(x.with_values(values), filter, start, length, stride, bias)
    return y.values

  return fn, length


@pytest.mark.parametrize("setting", CONV_SETTINGS[:3])
@pytest.mark.parametrize("lengths", [[[3, 0, 2]], [[2, 1], [1, 3, 0]]])
def test_conv_check_grads_float64(setting, lengths):
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    x = LoDTensor.from_lengths(
      rng.normal(size=(sum(lengths[-1]), 2)), lengths, buckets=Buckets.pow2(8)
    )
    fn, length = _conv_loss_parts(x, setting)
    filter = rng.normal(size=(2 * length, 3))
    bias = rng.normal(size=3)
    check_grads(jax.jit(fn), (x.values, filter, bias), order=1, modes=("rev",))


@functools.partial(jax.jit, static_argnums=4)
def _conv_vjp(x, filter, bias, cotangent, setting):
  fn, _ = _conv_loss_parts(x, setting)
  _, vjp = jax.vjp(fn, x.values, filter, bias)
  return vjp(cotangent)


@settings(max_examples=20)
@given(x=lod_tensors(), setting=st.sampled_from(CONV_SETTINGS))
def test_conv_grads_match_reference(x, setting):
  length = setting[1]
  rng = np.random.default_rng(1)
  filter = rng.normal(size=(2 * length, 3)).astype(np.float32)
  bias = rng.normal(size=3).astype(np.float32)
  cotangent = rng.normal(size=(x.capacity.tokens, 3)).astype(np.float32)
  grads = _conv_vjp(x, filter, bias, cotangent, setting)
  expected = conv_grad_reference(x, filter, cotangent, *setting)
  assert_close(grads, expected, rtol=1e-5, atol=1e-5)  # sums of products
  # Padding rows get exactly zero gradient.
  np.testing.assert_array_equal(np.asarray(grads[0])[int(x.num_rows) :], 0)
  assert np.all(np.isfinite(np.asarray(grads[0])))


def test_conv_padding_rows_stay_zero():
  # Even padding rows holding data (not the LoDTensor invariant) give zeros.
  x = LoDTensor.from_lengths(np.ones((2, 1), np.float32), [[2]], buckets=ONE_LEVEL)
  y = _jit_conv(x.with_values(jnp.ones((32, 1))), np.ones((3, 1)), None, 3, 1, [5.0])
  np.testing.assert_array_equal(y.values[:4, 0], [7, 7, 0, 0])
  np.testing.assert_array_equal(y.values[2:], 0)


def _conv_x(dtype=np.float32, shape=(4, 2)):
  return LoDTensor.from_lengths(np.zeros(shape, dtype), [[1, 3]])


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (
      {"x": np.zeros((4, 2))},
      TypeError,
      r"Expected `x` to be a LoDTensor, got ndarray\.",
    ),
    (
      {"x": _conv_x(shape=(4,))},
      ValueError,
      r"Expected `x.values` to have shape \[rows, D\] \(rank 2\), got \(4,\)\.",
    ),
    (
      {"x": _conv_x(np.int32)},
      TypeError,
      r"Expected `x.values` to have a float dtype, got int32\.",
    ),
    (
      {"filter": np.zeros((5, 3))},
      ValueError,
      r"Expected `filter` to have shape \[context_length \* D, out\] = \[6, out\] "
      r"\(context_length 3, `x.values` of shape \(4, 2\)\), got \(5, 3\)\.",
    ),
    (
      {"filter": np.zeros(6)},
      ValueError,
      r"Expected `filter` to have shape .* = \[6, out\] .*, got \(6,\)\.",
    ),
    (
      {"filter": np.zeros((6, 3), np.int32)},
      TypeError,
      r"Expected `filter` to have a float dtype, got int32\.",
    ),
    (
      {"bias": np.zeros(4)},
      ValueError,
      r"Expected `bias` to have shape \(3,\) \(\[out\], from `filter` of shape "
      r"\(6, 3\)\), got \(4,\)\.",
    ),
    (
      {"bias": np.zeros(3, np.int32)},
      TypeError,
      r"Expected `bias` to have a float dtype, got int32\.",
    ),
    (
      {"context_length": 0},
      ValueError,
      r"Expected `context_length` >= 1, got 0\.",
    ),
    (
      {"context_stride": 0},
      ValueError,
      r"Expected `context_stride` >= 1, got 0\.",
    ),
    (
      {"context_length": 3.0},
      TypeError,
      r"Expected `context_length` to be a static int, got 3\.0\.",
    ),
    (
      {"context_start": jnp.int32(-1)},
      TypeError,
      r"Expected `context_start` to be a static int, got",
    ),
    (
      {"context_start": -(2**31) - 1},
      ValueError,
      r"Expected `context_start` in \[-2147483648, 2147483647\] \(it becomes an "
      r"int32 shape or index on the device\), got -2147483649\.",
    ),
    (
      {"context_stride": 2**31},
      ValueError,
      r"Expected `context_stride` in \[1, 2147483647\] .*, got 2147483648\.",
    ),
  ],
)
def test_conv_errors(kwargs, error, match):
  args = {"x": _conv_x(), "filter": np.zeros((6, 3), np.float32), **kwargs}
  with pytest.raises(error, match=match):
    sequence_conv(**args)


@pytest.mark.parametrize(
  "start, stride",
  [(-(2**31), 1), (2**31 - 1, 1), (2**31 - 3, 1), (-1, 2**31 - 1), (None, 2**30)],
)
def test_conv_shifts_past_every_row_are_zero_windows(start, stride):
  """Shifts of int32 size leave every sequence: zero windows, computed without
  padding billions of rows or wrapping int32."""
  x = LoDTensor.from_lengths(np.arange(8.0).reshape(4, 2), [[3, 1]])
  filter = np.arange(12.0).reshape(6, 2) / 10
  out = sequence_conv(
    x, filter.astype(np.float32), context_start=start, context_stride=stride
  )
  expected = conv_reference(x, filter, 0.0, start, 3, stride)
  np.testing.assert_allclose(out.values, expected, rtol=1e-5, atol=1e-6)


# -- sequence_enumerate -------------------------------------------------------------


def test_enumerate_paddle_example():
  # Paddle's documented example: x.lod [[0, 3, 5]], x.data [1, 2, 3, 4, 5].
  x = LoDTensor.from_offsets(np.array([[1], [2], [3], [4], [5]]), [[0, 3, 5]])
  expected = [[1, 2], [2, 3], [3, 0], [4, 5], [5, 0]]
  for fn in (sequence_enumerate, jax.jit(sequence_enumerate, static_argnums=1)):
    y = fn(x, 2, 0)
    assert y.values.tolist() == expected
    assert y.values.dtype == x.values.dtype
    assert y.recursive_lengths() == [[3, 2]]


@st.composite
def _id_tensors(draw):
  lengths = draw(recursive_lengths())
  seed = draw(st.integers(0, 2**31 - 1))
  ids = np.random.default_rng(seed).integers(1, 100, size=sum(lengths[-1]))
  if draw(st.booleans()):
    ids = ids[:, None]
  buckets = ONE_LEVEL if len(lengths) == 1 else TWO_LEVEL
  return LoDTensor.from_lengths(ids.astype(np.int32), lengths, buckets=buckets)


_jit_enumerate = jax.jit(sequence_enumerate, static_argnums=1)


@settings(max_examples=30)
@given(x=_id_tensors(), win_size=st.sampled_from([1, 3]), pad=st.sampled_from([0, -1]))
def test_enumerate_matches_reference(x, win_size, pad):
  y = _jit_enumerate(x, win_size, pad)
  assert y.capacity == x.capacity
  assert y.recursive_lengths() == x.recursive_lengths()
  assert y.feature_shape == (win_size,)
  assert_nested_equal(_last_level_list(y), enumerate_reference(x, win_size, pad))
  np.testing.assert_array_equal(np.asarray(y.values)[int(x.num_rows) :], 0)


def _ids(buckets=None):
  return LoDTensor.from_lengths(
    np.arange(1, 8, dtype=np.int32), [[3, 0, 4]], buckets=buckets
  )


def test_enumerate_eager_and_zero_length():
  x = _ids(Buckets.fixed(tokens=10, sequences=5, time=6))
  y = sequence_enumerate(x, 3, pad_value=-1)
  assert_nested_equal(_last_level_list(y), enumerate_reference(x, 3, -1))
  assert y.recursive_lengths() == [[3, 0, 4]]
  np.testing.assert_array_equal(np.asarray(y.values)[7:], 0)


def test_enumerate_capacity():
  x = _ids(Buckets.fixed(tokens=10, sequences=5, time=6))
  expected = enumerate_reference(x, 2, 0)
  # An int is the token capacity; rows past the data are zeros.
  for capacity in (7, 12):
    y = sequence_enumerate(x, 2, capacity=capacity)
    assert y.capacity == x.capacity._replace(tokens=capacity)
    assert_nested_equal(_last_level_list(y), expected)
  # A policy maps the real sizes eagerly.
  y = sequence_enumerate(x, 2, capacity=Buckets.pow2(minimum=2))
  assert y.capacity.tokens == 8 and y.capacity.sequences == (4,)
  assert_nested_equal(_last_level_list(y), expected)
  # Under jit a fixed policy names the capacities.
  fixed = Buckets.fixed(tokens=16, sequences=3, time=4)
  y = jax.jit(lambda x: sequence_enumerate(x, 2, capacity=fixed))(x)
  assert y.capacity.tokens == 16 and y.capacity.sequences == (3,)
  assert_nested_equal(_last_level_list(y), expected)


def test_enumerate_capacity_overflow():
  x = _ids(Buckets.fixed(tokens=10, sequences=5, time=6))
  with pytest.raises(
    ValueError,
    match=r"sequence_enumerate: the output needs tokens 7, more than its capacity "
    r"6; data is never truncated\. Pass a larger `capacity`\.",
  ):
    sequence_enumerate(x, 2, capacity=6)
  fn = checkify.checkify(jax.jit(lambda x: sequence_enumerate(x, 2, capacity=6)))
  err, _ = fn(x)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"sequence_enumerate: the output needs more tokens than its capacity 6",
  ):
    err.throw()
  # Data that fits passes the same check.
  fits = LoDTensor.from_lengths(
    np.arange(6), [[6]], buckets=Buckets.fixed(tokens=10, sequences=5, time=6)
  )
  err, y = fn(fits)
  err.throw()
  assert y.capacity.tokens == 6


@pytest.mark.parametrize(
  ("x", "args", "error", "match"),
  [
    (
      [1, 2],
      (2,),
      TypeError,
      r"Expected `x` to be a LoDTensor, got list\.",
    ),
    (
      LoDTensor.from_lengths(np.zeros(3, np.float32), [[3]]),
      (2,),
      TypeError,
      r"Expected `x.values` to have an integer dtype, got float32\.",
    ),
    (
      LoDTensor.from_lengths(np.zeros((3, 2), np.int32), [[3]]),
      (2,),
      ValueError,
      r"Expected `x.values` to have shape \[rows\] or \[rows, 1\], got \(3, 2\)\.",
    ),
    (_ids(), (0,), ValueError, r"Expected `win_size` >= 1, got 0\."),
    (
      _ids(),
      (2.0,),
      TypeError,
      r"Expected `win_size` to be a static int, got 2\.0\.",
    ),
    (
      _ids(),
      (2, 0.5),
      ValueError,
      r"Expected `pad_value` to be an integer in \[-2147483648, 2147483647\] "
      r"\(exactly representable in the values' dtype int32\), got 0\.5\.",
    ),
    (
      _ids(),
      (2, [0, 0]),
      ValueError,
      r"Expected `pad_value` to be a scalar, got shape \(2,\)\.",
    ),
  ],
)
def test_enumerate_errors(x, args, error, match):
  with pytest.raises(error, match=match):
    sequence_enumerate(x, *args)
