"""Tests of sequence_pool, sequence_first_step, sequence_last_step and
sequence_softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.test_util import check_grads

from jaxlod import Buckets, Capacity, LoDTensor
from jaxlod.ops import (
  sequence_first_step,
  sequence_last_step,
  sequence_pool,
  sequence_softmax,
)
from tests.helpers import (
  CASES,
  assert_close,
  assert_nested_equal,
  lod_tensors,
  lod_tensors_with_slack,
  make_case,
)

POOL_TYPES = ["sum", "average", "sqrt", "max", "min", "first", "last"]
PAD = -3.0

# -- cases ---------------------------------------------------------------------------


def _make(name: str, dtype=np.float32, seed: int = 0) -> LoDTensor:
  return make_case(*CASES[name], dtype=dtype, seed=seed)


# -- NumPy references (loops over `to_list`) -----------------------------------------


def pool_row(seq: np.ndarray, pool: str, pad) -> np.ndarray:
  """Paddle's pooling of one sequence ``[length, *features]``."""
  if seq.shape[0] == 0:
    return np.broadcast_to(np.asarray(pad, seq.dtype), seq.shape[1:])
  return {
    "sum": lambda: seq.sum(0),
    "average": lambda: seq.mean(0),
    "sqrt": lambda: seq.sum(0) / np.sqrt(seq.shape[0]),
    "max": lambda: seq.max(0),
    "min": lambda: seq.min(0),
    "first": lambda: seq[0],
    "last": lambda: seq[-1],
  }[pool]()


def pool_reference(x: LoDTensor, pool: str, pad=0.0):
  """One-level: ``[count_capacity, *features]``; deeper: nested lists."""
  seqs = x.to_list()
  if x.num_levels == 1:
    out = np.empty((x.capacity.sequences[-1], *x.feature_shape), x.values.dtype)
    out[:] = np.asarray(pad, x.values.dtype)
    for i, seq in enumerate(seqs):
      out[i] = pool_row(seq, pool, pad)
    return out
  shape = x.feature_shape
  return [
    np.array([pool_row(s, pool, pad) for s in group]).reshape(len(group), *shape)
    for group in seqs
  ]


def softmax_reference(x: LoDTensor) -> np.ndarray:
  """Expected values ``[token_capacity, ...]``, zeros in padding rows."""
  values = np.asarray(x.values, np.float64)
  out = np.zeros_like(values)
  offsets = np.asarray(x.offsets[-1])
  for start, stop in zip(offsets[:-1], offsets[1:], strict=True):
    if stop > start:
      e = np.exp(values[start:stop] - values[start:stop].max())
      out[start:stop] = e / e.sum()
  return out


def check_pool(got, x: LoDTensor, pool: str, pad=0.0, **tol) -> None:
  expected = pool_reference(x, pool, pad)
  if x.num_levels == 1:
    assert got.shape == (x.capacity.sequences[-1], *x.feature_shape)
    assert got.dtype == x.values.dtype
    assert_close(got, expected, **tol)
    return
  assert isinstance(got, LoDTensor)
  assert got.capacity == Capacity(
    x.capacity.sequences[-1], x.capacity.sequences[:-1], x.time_capacity[:-1]
  )
  assert got.recursive_lengths() == x.recursive_lengths()[:-1]
  assert int(got.num_outer) == int(x.num_outer)
  for a, e in zip(got.to_list(), expected, strict=True):
    assert_close(a, e, **tol)
  # Rows past the real number of inner sequences stay zeros.
  np.testing.assert_array_equal(np.asarray(got.values)[int(x.num_sequences(-1)) :], 0)


# -- padded references, for gradients ------------------------------------------------


def _padded_index(x: LoDTensor):
  """Host index ``[count, time]`` into the rows of `x`, and its mask."""
  offsets = np.asarray(x.offsets[-1])
  lengths = np.diff(offsets)
  time = max(x.time_capacity[-1], 1)
  steps = np.arange(time)[None, :]
  mask = steps < lengths[:, None]
  index = np.where(mask, offsets[:-1, None] + steps, 0)
  return index, mask, lengths


def padded_pool(values, x: LoDTensor, pool: str, pad):
  """`sequence_pool` on a padded batch with masked jnp reductions."""
  index, mask, lengths = _padded_index(x)
  extra = (1,) * (values.ndim - 1)
  p = values[index]
  m = mask.reshape(mask.shape + extra)
  size = np.maximum(lengths, 1).reshape((-1,) + extra)
  out = {
    "sum": lambda: jnp.sum(jnp.where(m, p, 0), 1),
    "average": lambda: jnp.sum(jnp.where(m, p, 0), 1) / size,
    "sqrt": lambda: jnp.sum(jnp.where(m, p, 0), 1) / np.sqrt(size),
    "max": lambda: jnp.max(jnp.where(m, p, -jnp.inf), 1),
    "min": lambda: jnp.min(jnp.where(m, p, jnp.inf), 1),
    "first": lambda: p[:, 0],
    "last": lambda: p[np.arange(p.shape[0]), np.maximum(lengths - 1, 0)],
  }[pool]()
  out = jnp.where((lengths == 0).reshape((-1,) + extra), pad, out)
  if x.num_levels > 1:
    inner = np.asarray(x.offsets[-2])[-1]
    real = (np.arange(lengths.size) < inner).reshape((-1,) + extra)
    out = jnp.where(real, out, 0)
  return out


def padded_softmax(values, x: LoDTensor):
  index, mask, _ = _padded_index(x)
  p = values.reshape(-1)[index]
  top = jnp.max(jnp.where(mask, p, -jnp.inf), 1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0)  # empty rows: no NaN gradient
  e = jnp.where(mask, jnp.exp(jnp.where(mask, p - top, 0)), 0)
  soft = e / jnp.maximum(jnp.sum(e, 1, keepdims=True), 1e-30)
  out = jnp.zeros(values.shape[0], values.dtype).at[index[mask]].set(soft[mask])
  return out.reshape(values.shape)


def _values_of(out):
  return out.values if isinstance(out, LoDTensor) else out


# -- sequence_pool -------------------------------------------------------------------

_pool = jax.jit(sequence_pool, static_argnums=1)


@pytest.mark.parametrize("pool", POOL_TYPES)
@settings(max_examples=20)
@given(x=lod_tensors())
def test_pool_matches_reference(pool, x):
  check_pool(_pool(x, pool, PAD), x, pool, PAD)


@settings(max_examples=10)
@given(x=lod_tensors_with_slack())
def test_pool_random_capacities(x):
  check_pool(_pool(x, "max", PAD), x, "max", PAD)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("pool", POOL_TYPES)
def test_pool_cases(name, pool):
  x = _make(name)
  check_pool(_pool(x, pool, 1.5), x, pool, 1.5)


@pytest.mark.parametrize("pool", POOL_TYPES)
def test_pool_eager(pool):
  x = _make("two-level")
  check_pool(sequence_pool(x, pool, pad_value=1.5), x, pool, 1.5)


def test_pool_worked_example():
  x = LoDTensor.from_lengths(
    np.array([1.0, 3.0, 2.0, 5.0, 4.0], np.float32),
    [[3, 0, 2]],
    buckets=Buckets.fixed(tokens=6, sequences=4, time=3),
  )
  expected = {
    "sum": [6.0, -1.0, 9.0, -1.0],
    "average": [2.0, -1.0, 4.5, -1.0],
    "sqrt": [6.0 / np.sqrt(3.0), -1.0, 9.0 / np.sqrt(2.0), -1.0],
    "max": [3.0, -1.0, 5.0, -1.0],
    "min": [1.0, -1.0, 4.0, -1.0],
    "first": [1.0, -1.0, 5.0, -1.0],
    "last": [2.0, -1.0, 4.0, -1.0],
  }
  for pool, want in expected.items():
    assert_close(_pool(x, pool, -1.0), np.asarray(want, np.float32))


def test_pool_type_is_case_insensitive():
  x = _make("one-level")
  assert_close(sequence_pool(x, "MAX"), sequence_pool(x, "max"))
  assert_close(sequence_pool(x, "Average"), sequence_pool(x, "average"))


def test_pool_pad_value_per_feature():
  x = _make("one-level")
  pad = np.array([7.0, -7.0], np.float32)
  got = _pool(x, "max", pad)
  check_pool(got, x, "max", pad)
  np.testing.assert_array_equal(np.asarray(got)[1], pad)
  np.testing.assert_array_equal(np.asarray(got)[4:], np.broadcast_to(pad, (2, 2)))


def test_pool_two_level_real_empty_inner_sequences_get_pad_value():
  x = _make("two-level")
  got = _pool(x, "sum", 9.0)
  # Inner sequence 2 is real and empty: pad value; slots 5 and 6 are padding.
  np.testing.assert_array_equal(np.asarray(got.values)[2], [9.0, 9.0])
  np.testing.assert_array_equal(np.asarray(got.values)[5:], 0.0)
  assert got.recursive_lengths() == [[2, 0, 3]]


@pytest.mark.parametrize(
  "lengths", [[[]], [[0, 0]]], ids=["no-sequences", "empty-sequences"]
)
@pytest.mark.parametrize("pool", POOL_TYPES)
def test_pool_without_rows(lengths, pool):
  x = LoDTensor.from_lengths(np.zeros((0, 2), np.float32), lengths)
  assert x.capacity.tokens == 0
  got = _pool(x, pool, 2.0)
  np.testing.assert_array_equal(got, np.full((len(lengths[0]), 2), 2.0, np.float32))


def test_first_and_last_step_any_dtype():
  for dtype in (np.int32, np.bool_):
    x = _make("two-level")
    x = x.with_values((np.asarray(x.values) > 0).astype(dtype))
    assert sequence_first_step(x).values.dtype == dtype
    check_pool(sequence_first_step(x), x, "first")
    check_pool(jax.jit(sequence_last_step)(x), x, "last")
  x = _make("one-level")
  x = x.with_values(jnp.round(x.values * 10).astype(jnp.int32))
  np.testing.assert_array_equal(sequence_first_step(x), sequence_pool(x, "first"))
  np.testing.assert_array_equal(sequence_last_step(x), pool_reference(x, "last"))


# -- gradients -----------------------------------------------------------------------


def _pool_fn(x: LoDTensor, pool: str):
  return jax.jit(lambda v: _values_of(sequence_pool(x.with_values(v), pool, PAD)))


@pytest.mark.parametrize("pool", POOL_TYPES)
def test_pool_check_grads_float64(pool):
  # Two levels: empty inner sequences, padding inner sequences and padding rows.
  with jax.enable_x64(True):
    x = _make("two-level", dtype=np.float64)
    check_grads(_pool_fn(x, pool), (x.values,), order=1, modes=("rev",))


def compare_vjps(fn, reference, values, seed: int) -> jax.Array:
  """Values and VJPs of `fn` and of its `reference`, in one jit compile."""

  @jax.jit
  def both(v, g):
    out, vjp = jax.vjp(fn, v)
    expected, reference_vjp = jax.vjp(reference, v)
    return out, vjp(g)[0], expected, reference_vjp(g)[0]

  g = jax.random.normal(jax.random.key(seed), jax.eval_shape(fn, values).shape)
  out, grad, expected, expected_grad = both(values, g)
  assert_close(out, expected)
  assert_close(grad, expected_grad)
  assert np.all(np.isfinite(grad))
  return grad


@pytest.mark.parametrize("name", ["one-level", "two-level"])
@pytest.mark.parametrize("pool", POOL_TYPES)
def test_pool_vjp_matches_padded_reference(name, pool):
  x = _make(name, seed=1)
  grad = compare_vjps(
    _pool_fn(x, pool), lambda v: padded_pool(v, x, pool, PAD), x.values, seed=3
  )
  # Padding rows get no gradient.
  np.testing.assert_array_equal(np.asarray(grad)[int(x.num_rows) :], 0)


@pytest.mark.parametrize("pool", ["max", "min"])
def test_pool_extreme_gradient_goes_to_first_tie(pool):
  values = np.array([[1.0, 4.0], [3.0, 4.0], [3.0, 0.0], [3.0, 0.0]], np.float32)
  if pool == "min":
    values = -values
  x = LoDTensor.from_lengths(values, [[3, 1, 0]])
  grad = jax.grad(lambda v: jnp.sum(_pool_fn(x, pool)(v)))(x.values)
  # Sequence 0: feature 0 ties at rows 1 and 2, feature 1 at rows 0 and 1.
  np.testing.assert_array_equal(grad, [[0, 1], [1, 0], [0, 0], [1, 1]])


@pytest.mark.parametrize("pool", POOL_TYPES)
def test_pool_gradient_of_pad_value(pool):
  x = _make("one-level")
  grad = jax.grad(lambda p: jnp.sum(sequence_pool(x, pool, p)))(jnp.float32(0.0))
  assert float(grad) == 2 * 3  # 3 empty slots (1 real, 2 padding), 2 features


# -- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("x", "pool", "pad", "error", "match"),
  [
    (
      np.zeros(3),
      "sum",
      0.0,
      TypeError,
      r"Expected `x` to be a LoDTensor, got ndarray\.",
    ),
    (None, 3, 0.0, TypeError, r"Expected `pool_type` to be a str, got 3\."),
    (
      None,
      "mean",
      0.0,
      ValueError,
      r"Expected `pool_type` to be one of 'sum', 'average', 'sqrt', 'max', 'min', "
      r"'first', 'last' \(case-insensitive\), got 'mean'\.",
    ),
    (
      "int",
      "average",
      0.0,
      TypeError,
      r"Expected `x.values` to have a float dtype for pool_type 'average', got "
      r"int32; only 'first' and 'last' accept any dtype\.",
    ),
    (
      None,
      "sum",
      np.zeros(3),
      ValueError,
      r"Expected `pad_value` to be a scalar or to broadcast to the feature shape "
      r"\(2,\), got shape \(3,\)\.",
    ),
  ],
  ids=["not-lod", "pool-type", "unknown-pool", "int-values", "pad-shape"],
)
def test_pool_errors(x, pool, pad, error, match):
  if x is None:
    x = _make("one-level")
  elif isinstance(x, str):
    x = _make("one-level")
    x = x.with_values(x.values.astype(jnp.int32))
  with pytest.raises(error, match=match):
    sequence_pool(x, pool, pad)
  if isinstance(x, LoDTensor):
    with pytest.raises(error, match=match):
      _pool(x, pool, pad)


# -- sequence_softmax ----------------------------------------------------------------

_softmax = jax.jit(sequence_softmax)


def _column(x: LoDTensor, scalar_rows: bool = False) -> LoDTensor:
  """`x` with one value per row: ``[rows, 1]``, or ``[rows]``."""
  column = x.values[:, :1]
  return x.with_values(column[:, 0] if scalar_rows else column)


@pytest.mark.parametrize("scalar_rows", [False, True])
@settings(max_examples=25)
@given(x=lod_tensors())
def test_softmax_matches_reference(scalar_rows, x):
  x = _column(x, scalar_rows)
  y = _softmax(x)
  for a, e in zip(y.offsets, x.offsets, strict=True):
    np.testing.assert_array_equal(a, e)
  assert y.values.shape == x.values.shape
  assert_close(y.values, softmax_reference(x))


def test_softmax_eager_two_level():
  x = _column(_make("two-level"))
  y = sequence_softmax(x)
  assert_close(y.values, softmax_reference(x))
  assert y.recursive_lengths() == x.recursive_lengths()
  sums = [float(np.sum(s)) for group in y.to_list() for s in group if s.size]
  assert_close(np.asarray(sums), np.ones(len(sums)))


def test_softmax_is_stable():
  values = np.array([1000.0, 999.0, -1000.0, 0.0, 88.0, 89.0], np.float32)
  x = LoDTensor.from_lengths(values, [[2, 1, 0, 3]])
  y = _softmax(x)
  assert np.all(np.isfinite(y.values))
  assert_close(y.values, softmax_reference(x))


def test_softmax_without_rows():
  x = LoDTensor.from_lengths(np.zeros((0,), np.float32), [[0, 0]])
  np.testing.assert_array_equal(_softmax(x).values, np.zeros(0))
  x = LoDTensor.from_lengths(np.zeros((0,), np.float32), [[]])
  np.testing.assert_array_equal(sequence_softmax(x).values, np.zeros(0))


@pytest.mark.parametrize("name", ["one-level", "two-level", "scalar-rows"])
def test_softmax_check_grads_float64(name):
  with jax.enable_x64(True):
    x = _make(name, dtype=np.float64)
    x = x if name == "scalar-rows" else _column(x)
    fn = jax.jit(lambda v: sequence_softmax(x.with_values(v)).values)
    check_grads(fn, (x.values,), order=1, modes=("rev",))


@pytest.mark.parametrize("name", ["one-level", "two-level", "scalar-rows"])
def test_softmax_vjp_matches_padded_reference(name):
  x = _make(name, seed=2)
  x = x if name == "scalar-rows" else _column(x)
  grad = compare_vjps(
    lambda v: sequence_softmax(x.with_values(v)).values,
    lambda v: padded_softmax(v, x),
    x.values,
    seed=4,
  )
  np.testing.assert_array_equal(np.asarray(grad)[int(x.num_rows) :], 0)


def test_softmax_errors():
  x = _make("one-level")
  with pytest.raises(TypeError, match=r"Expected `x` to be a LoDTensor, got list\."):
    sequence_softmax([1.0])
  with pytest.raises(
    ValueError,
    match=r"Expected `x.values` to have shape \[rows\] or \[rows, 1\], got "
    r"\(12, 2\)\.",
  ):
    _softmax(x)
  with pytest.raises(
    TypeError, match=r"Expected `x.values` to have a float dtype, got int32\."
  ):
    _softmax(_column(x).with_values(jnp.zeros((12, 1), jnp.int32)))


def test_nested_lists_of_reference():
  # The reference itself on a hand-made two-level case.
  x = LoDTensor.from_lengths(np.arange(5.0), [[1, 2], [2, 0, 3]])
  assert_nested_equal(
    pool_reference(x, "sum", -1.0), [np.array([1.0]), np.array([-1.0, 9.0])]
  )
