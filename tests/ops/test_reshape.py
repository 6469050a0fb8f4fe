"""Tests of sequence_reshape, sequence_scatter and lod_reset."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify
from jax.test_util import check_grads

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import lod_reset, sequence_reshape, sequence_scatter
from tests.helpers import (
  ONE_LEVEL,
  assert_close,
  assert_nested_equal,
  last_level,
  lod_tensors,
  recursive_lengths,
)

# -- NumPy references ---------------------------------------------------------------


def reshape_reference(x: LoDTensor, new_dim: int) -> list[np.ndarray]:
  return [seq.reshape(-1, new_dim) for seq in last_level(x)]


def scatter_reference(x, index: LoDTensor, updates: LoDTensor) -> np.ndarray:
  out = np.array(x, copy=True)
  pairs = zip(last_level(index), last_level(updates), strict=True)
  for i, (ids, rows) in enumerate(pairs):
    rows = rows.reshape(ids.shape[0], *out.shape[2:])
    for j, id_ in enumerate(ids.reshape(-1)):
      out[i, id_] += rows[j]
  return out


def scatter_grad_reference(index: LoDTensor, cotangent: np.ndarray) -> np.ndarray:
  """Gradient of ``sum(out * cotangent)`` in ``updates.values``."""
  offsets = np.asarray(index.offsets[0])
  ids = np.asarray(index.values).reshape(-1)
  grad = np.zeros((index.capacity.tokens, *cotangent.shape[2:]), cotangent.dtype)
  for i in range(int(index.num_outer)):
    for row in range(offsets[i], offsets[i + 1]):
      grad[row] = cotangent[i, ids[row]]
  return grad


# -- sequence_reshape ----------------------------------------------------------------

_jit_reshape = jax.jit(sequence_reshape, static_argnums=1)


def test_reshape_paddle_example():
  # Paddle's documented example: lod [[0, 2, 6]], dim 2 -> new_dim 4.
  x = LoDTensor.from_offsets(np.arange(1, 13).reshape(6, 2), [[0, 2, 6]])
  for fn in (sequence_reshape, _jit_reshape):
    y = fn(x, 4)
    assert y.recursive_lengths() == [[1, 2]]
    assert y.values.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert y.values.dtype == x.values.dtype


@st.composite
def _even_tensors(draw):
  """``[rows, 2]`` LoDTensors whose last-level lengths are even."""
  lengths = draw(recursive_lengths())
  lengths[-1] = [2 * n for n in lengths[-1]]
  values = np.random.default_rng(draw(st.integers(0, 2**31 - 1))).normal(
    size=(sum(lengths[-1]), 2)
  )
  buckets = (
    Buckets.fixed(tokens=64, sequences=8, time=12)
    if len(lengths) == 1
    else Buckets.fixed(tokens=96, sequences=(6, 12), time=(4, 10))
  )
  return LoDTensor.from_lengths(values.astype(np.float32), lengths, buckets=buckets)


@settings(max_examples=30)
@given(x=_even_tensors(), new_dim=st.sampled_from([1, 2, 4]))
def test_reshape_matches_reference(x, new_dim):
  y = _jit_reshape(x, new_dim)
  assert_nested_equal(last_level(y), reshape_reference(x, new_dim))
  expected_lengths = x.recursive_lengths()
  expected_lengths[-1] = [n * 2 // new_dim for n in expected_lengths[-1]]
  assert y.recursive_lengths() == expected_lengths
  tokens, time = x.capacity.tokens, x.time_capacity
  assert y.capacity.tokens == -(-tokens * 2 // new_dim)
  assert y.capacity.sequences == x.capacity.sequences
  assert y.time_capacity == (*time[:-1], time[-1] * 2 // new_dim)
  assert max(expected_lengths[-1], default=0) <= y.time_capacity[-1]
  np.testing.assert_array_equal(np.asarray(y.values)[int(y.num_rows) :], 0)


@pytest.mark.parametrize(
  ("lengths", "dim", "new_dim"),
  [
    ([[2, 0, 4]], 3, 2),
    ([[4, 8]], 1, 4),
    ([[3, 0, 6]], 6, 9),
    ([[2, 1], [3, 0, 3]], 2, 3),
  ],
)
def test_reshape_other_widths(lengths, dim, new_dim):
  values = np.arange(sum(lengths[-1]) * dim, dtype=np.int32).reshape(-1, dim)
  x = LoDTensor.from_lengths(values, lengths, buckets=Buckets.pow2(minimum=4))
  y = sequence_reshape(x, new_dim)
  assert_nested_equal(last_level(y), reshape_reference(x, new_dim))
  assert y.recursive_lengths()[:-1] == lengths[:-1]
  assert y.capacity.tokens == -(-x.capacity.tokens * dim // new_dim)
  np.testing.assert_array_equal(np.asarray(y.values)[int(y.num_rows) :], 0)


def test_reshape_grads():
  with jax.enable_x64(True):
    x = LoDTensor.from_lengths(
      np.random.default_rng(0).normal(size=(6, 2)), [[2, 0, 4]], buckets=ONE_LEVEL
    )

    def fn(values):
      return sequence_reshape(x.with_values(values), 4).values

    check_grads(jax.jit(fn), (x.values,), order=1, modes=("rev",))
    cotangent = np.random.default_rng(1).normal(size=(16, 4))
    (grad,) = jax.jit(lambda v, c: jax.vjp(fn, v)[1](c))(x.values, cotangent)
    # Real rows get the cotangent read back row-major; padding rows get zero.
    np.testing.assert_array_equal(grad[:6], cotangent.reshape(32, 2)[:6])
    np.testing.assert_array_equal(grad[6:], 0)


def test_reshape_indivisible_errors():
  x = LoDTensor.from_lengths(np.zeros((6, 2)), [[2, 3, 1]], buckets=ONE_LEVEL)
  with pytest.raises(
    ValueError,
    match=r"sequence_reshape: sequence 1 has 3 rows of dim 2 \(6 numbers\), not a "
    r"multiple of `new_dim` 4\.",
  ):
    sequence_reshape(x, 4)
  err, _ = checkify.checkify(_jit_reshape, errors=checkify.user_checks)(x, 4)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"sequence_reshape: sequence 1 has 3 rows of dim 2 \(6 numbers\), not a "
    r"multiple of `new_dim` 4\.",
  ):
    err.throw()
  err, _ = checkify.checkify(_jit_reshape)(x, 2)
  err.throw()


@pytest.mark.parametrize(
  ("x", "new_dim", "error", "match"),
  [
    (np.zeros((4, 2)), 2, TypeError, r"Expected `x` to be a LoDTensor, got ndarray\."),
    (
      LoDTensor.from_lengths(np.zeros(4), [[4]]),
      2,
      ValueError,
      r"Expected `x.values` to have shape \[rows, dim\] \(rank 2\), got \(4,\)\.",
    ),
    (
      LoDTensor.from_lengths(np.zeros((4, 2)), [[4]]),
      0,
      ValueError,
      r"Expected `new_dim` >= 1, got 0\.",
    ),
    (
      LoDTensor.from_lengths(np.zeros((4, 2)), [[4]]),
      2.0,
      TypeError,
      r"Expected `new_dim` to be a static int, got 2\.0\.",
    ),
  ],
)
def test_reshape_errors(x, new_dim, error, match):
  with pytest.raises(error, match=match):
    sequence_reshape(x, new_dim)


# -- sequence_scatter ----------------------------------------------------------------

_jit_scatter = jax.jit(sequence_scatter)


def test_scatter_paddle_example():
  # Paddle's documented example (sequence_scatter, Case 1).
  buckets = Buckets.fixed(tokens=16, sequences=4, time=8)
  ids = np.array([0, 1, 2, 5, 4, 3, 2, 1, 3, 2, 5, 4])[:, None]
  index = LoDTensor.from_offsets(ids, [[0, 3, 8, 12]], buckets=buckets)
  data = [0.3, 0.3, 0.4, 0.1, 0.2, 0.3, 0.4, 0.0, 0.2, 0.3, 0.1, 0.4]
  updates = LoDTensor.from_offsets(
    np.array(data, np.float32)[:, None], [[0, 3, 8, 12]], buckets=buckets
  )
  expected = [
    [1.3, 1.3, 1.4, 1.0, 1.0, 1.0],
    [1.0, 1.0, 1.4, 1.3, 1.2, 1.1],
    [1.0, 1.0, 1.3, 1.2, 1.4, 1.1],
  ]
  # The count capacity (4 rows, the last a padding sequence) under jit.
  out = _jit_scatter(np.ones((4, 6), np.float32), index, updates)
  assert_close(out[:3], np.asarray(expected, np.float32))
  np.testing.assert_array_equal(out[3], 1.0)
  # The real count (3 rows) eagerly.
  eager = sequence_scatter(np.ones((3, 6), np.float32), index, updates)
  assert_close(eager, np.asarray(expected, np.float32))


@st.composite
def _scatter_case(draw, features=(2,)):
  (lengths,) = draw(recursive_lengths(1))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  rows = sum(lengths)
  ids = rng.integers(0, 5, size=rows).astype(np.int32)
  index = LoDTensor.from_lengths(ids, [lengths], buckets=ONE_LEVEL)
  values = rng.normal(size=(rows, *features)).astype(np.float32)
  updates = LoDTensor.from_lengths(values, [lengths], buckets=ONE_LEVEL)
  x = rng.normal(size=(8, 5, *features)).astype(np.float32)
  return x, index, updates


@settings(max_examples=25)
@given(case=_scatter_case())
def test_scatter_matches_reference(case):
  x, index, updates = case
  out = _jit_scatter(x, index, updates)
  assert_close(out, scatter_reference(x, index, updates))
  real = int(index.num_outer)
  eager = sequence_scatter(x[:real], index, updates)
  assert_close(eager, scatter_reference(x[:real], index, updates))


@jax.jit
def _scatter_vjp(x, index, updates, cotangent):
  def fn(x, values):
    return sequence_scatter(x, index, updates.with_values(values))

  return jax.vjp(fn, x, updates.values)[1](cotangent)


@settings(max_examples=20)
@given(case=_scatter_case())
def test_scatter_grads_match_reference(case):
  x, index, updates = case
  cotangent = np.random.default_rng(0).normal(size=x.shape).astype(np.float32)
  d_x, d_values = _scatter_vjp(x, index, updates, cotangent)
  assert_close(d_x, cotangent)
  assert_close(d_values, scatter_grad_reference(index, cotangent))
  np.testing.assert_array_equal(np.asarray(d_values)[int(index.num_rows) :], 0)


@pytest.mark.parametrize("features", [(), (3,)])
def test_scatter_check_grads_float64(features):
  with jax.enable_x64(True):
    buckets = Buckets.fixed(tokens=8, sequences=4, time=4)
    ids = np.array([1, 1, 0, 3, 2])
    index = LoDTensor.from_lengths(ids, [[2, 0, 3]], buckets=buckets)
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(5, *features) if features else (5, 1))
    updates = LoDTensor.from_lengths(rows, [[2, 0, 3]], buckets=buckets)
    x = rng.normal(size=(4, 4, *features))

    def fn(x, values):
      return sequence_scatter(x, index, updates.with_values(values))

    check_grads(jax.jit(fn), (x, updates.values), order=1, modes=("rev",))


def _scatter_args(**kwargs):
  buckets = Buckets.fixed(tokens=6, sequences=3, time=4)
  args = {
    "x": np.zeros((3, 4), np.float32),
    "index": LoDTensor.from_lengths(np.array([0, 1, 3]), [[2, 1]], buckets=buckets),
    "updates": LoDTensor.from_lengths(
      np.ones(3, np.float32), [[2, 1]], buckets=buckets
    ),
  }
  return {**args, **kwargs}


def test_scatter_value_errors_eager_and_checkify():
  buckets = Buckets.fixed(tokens=6, sequences=3, time=4)
  cases = [
    (
      {"index": LoDTensor.from_lengths(np.array([0, 4, 3]), [[2, 1]], buckets=buckets)},
      r"sequence_scatter: sequence 0, position 1: id 4 is outside \[0, 4\) \(the "
      r"width of `x`\)\.",
    ),
    (
      {
        "index": LoDTensor.from_lengths(np.array([0, 1, -1]), [[2, 1]], buckets=buckets)
      },
      r"sequence_scatter: sequence 1, position 0: id -1 is outside \[0, 4\)",
    ),
    (
      {
        "updates": LoDTensor.from_lengths(
          np.ones(3, np.float32), [[1, 2]], buckets=buckets
        )
      },
      r"Expected `updates` to have the LoD of `index`",
    ),
  ]
  fn = checkify.checkify(_jit_scatter)
  for kwargs, match in cases:
    args = _scatter_args(**kwargs)
    with pytest.raises(ValueError, match=match):
      sequence_scatter(**args)
    err, _ = fn(**args)
    with pytest.raises(checkify.JaxRuntimeError, match=match):
      err.throw()
  err, _ = fn(**_scatter_args())
  err.throw()


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (
      {"x": np.zeros(4, np.float32)},
      ValueError,
      r"Expected `x` to have shape \[n, width, \*features\] \(rank >= 2\), got "
      r"\(4,\)\.",
    ),
    ({"x": {}}, TypeError, r"Expected `x` to be an array, got dict\."),
    (
      {"x": np.zeros((3, 4), np.int32)},
      TypeError,
      r"Expected `x` to have a float dtype, got int32\.",
    ),
    (
      {"x": np.zeros((1, 4), np.float32)},
      ValueError,
      r"Expected `x` to have leading dimension 3 \(count capacity of `index`\) or 2 "
      r"\(sequences of `index`\), got shape \(1, 4\)\.",
    ),
    (
      {"index": np.array([0, 1, 3])},
      TypeError,
      r"Expected `index` to be a LoDTensor, got ndarray\.",
    ),
    (
      {"index": LoDTensor.from_lengths(np.array([0, 1, 3]), [[1, 1], [2, 1]])},
      ValueError,
      r"Expected `index` to have 1 LoD level\(s\), got 2\.",
    ),
    (
      {"index": LoDTensor.from_lengths(np.zeros(3, np.float32), [[2, 1]])},
      TypeError,
      r"Expected `index.values` to have an integer dtype, got float32\.",
    ),
    (
      {"index": LoDTensor.from_lengths(np.zeros((3, 2), np.int32), [[2, 1]])},
      ValueError,
      r"Expected `index.values` to have shape \[rows\] or \[rows, 1\], got \(3, 2\)\.",
    ),
    (
      {"updates": LoDTensor.from_lengths(np.ones(3, np.float32), [[2, 1]])},
      ValueError,
      r"Expected `updates` to have the token and count capacities of `index` "
      r"\(6, \(3,\)\), got \(3, \(2,\)\)\.",
    ),
    (
      {"x": np.zeros((3, 4, 2), np.float32)},
      ValueError,
      r"Expected `updates.values` to have shape \[rows, \*features\] = \[6, 2\] "
      r"\(features from `x` of shape \(3, 4, 2\)\), got \(6,\)\.",
    ),
    (
      {"x": np.zeros((3, 4), np.float16)},
      TypeError,
      r"Expected `updates.values` to have the dtype of `x` \(float16\), got "
      r"float32\.",
    ),
  ],
)
def test_scatter_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    sequence_scatter(**_scatter_args(**kwargs))


# -- lod_reset -------------------------------------------------------------------------

_jit_reset_like = jax.jit(lambda x, y: lod_reset(x, y=y))
# Capacities of the LoD that `y=` passes: any sequence of up to 30 rows.
OTHER = Buckets.fixed(tokens=32, sequences=8, time=32)


def test_lod_reset_paddle_example():
  # Paddle's documented example: lengths [[2, 3, 1]] reset to [4, 2].
  x = LoDTensor.from_lengths(np.arange(1.0, 7.0), [[2, 3, 1]], buckets=ONE_LEVEL)
  y = lod_reset(x, [4, 2])
  assert y.recursive_lengths() == [[4, 2]]
  assert y.capacity.tokens == 32 and y.capacity.sequences == (2,)
  assert y.time_capacity == (4,)
  assert y.values is x.values
  assert_nested_equal(y.to_list(), [np.arange(1.0, 5.0), np.arange(5.0, 7.0)])
  z = jax.jit(lambda x: lod_reset(x, [[4, 2]]))(x)
  assert z.recursive_lengths() == [[4, 2]]


def test_lod_reset_two_levels_and_arrays():
  x = LoDTensor.from_lengths(np.arange(6.0), [[2, 3, 1]])
  y = lod_reset(x, [[2, 0, 1], [1, 0, 5]])
  assert y.recursive_lengths() == [[2, 0, 1], [1, 0, 5]]
  assert y.time_capacity == (2, 5)
  assert int(y.num_outer) == 3
  # A NumPy array of lengths is one level; a plain array is all real rows.
  assert lod_reset(np.arange(6.0), np.array([6, 0])).recursive_lengths() == [[6, 0]]
  # A flat empty list is one level without sequences.
  empty = LoDTensor.from_lengths(np.zeros((0, 2)), [[0, 0]])
  assert lod_reset(empty, []).recursive_lengths() == [[]]


@st.composite
def _reset_case(draw):
  x = draw(lod_tensors())
  rows = int(x.num_rows)
  cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=5)))
  lengths = np.diff([0, *cuts, rows]).tolist()
  return x, lengths


@settings(max_examples=25)
@given(case=_reset_case())
def test_lod_reset_matches_reference(case):
  x, lengths = case
  y = lod_reset(x, lengths)
  assert y.recursive_lengths() == [lengths]
  values = np.asarray(x.values)
  starts = np.cumsum([0, *lengths])
  expected = [values[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
  assert_nested_equal(y.to_list(), expected)
  # `y=` under jit takes the LoD of another tensor, whatever its capacities.
  other = LoDTensor.from_lengths(np.zeros(int(x.num_rows)), [lengths], buckets=OTHER)
  z = _jit_reset_like(x, other)
  assert z.recursive_lengths() == [lengths]
  assert z.capacity == other.capacity._replace(tokens=x.capacity.tokens)
  np.testing.assert_array_equal(z.values, x.values)


def test_lod_reset_gradient_passes_through():
  with jax.enable_x64(True):
    x = LoDTensor.from_lengths(np.arange(6.0), [[2, 3, 1]])

    def fn(values):
      return lod_reset(x.with_values(values), [4, 2]).to_padded()[0]

    check_grads(jax.jit(fn), (x.values,), order=1, modes=("rev",))


def test_lod_reset_mismatched_totals():
  x = LoDTensor.from_lengths(np.arange(6.0), [[2, 3, 1]], buckets=ONE_LEVEL)
  match = (
    r"lod_reset: mismatched totals: the new LoD covers 5 rows, `x` has 6 real rows\."
  )
  with pytest.raises(ValueError, match=match):
    lod_reset(x, [4, 1])
  err, _ = checkify.checkify(jax.jit(lambda x: lod_reset(x, [4, 1])))(x)
  with pytest.raises(checkify.JaxRuntimeError, match=match):
    err.throw()
  other = LoDTensor.from_lengths(np.zeros(5), [[4, 1]], buckets=ONE_LEVEL)
  with pytest.raises(ValueError, match=match):
    lod_reset(x, y=other)
  err, _ = checkify.checkify(_jit_reset_like)(x, other)
  with pytest.raises(checkify.JaxRuntimeError, match=match):
    err.throw()
  err, _ = checkify.checkify(_jit_reset_like)(x, lod_reset(x, [6]))
  err.throw()


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (
      {},
      ValueError,
      r"lod_reset: expected exactly one of `lengths` and `y`, got neither\.",
    ),
    (
      {"lengths": [6], "y": "y"},
      ValueError,
      r"lod_reset: expected exactly one of `lengths` and `y`, got both\.",
    ),
    ({"y": [6]}, TypeError, r"Expected `y` to be a LoDTensor, got list\."),
    (
      {"lengths": [7, -1]},
      ValueError,
      r"LoD level 0, index 1: length -1 is negative\.",
    ),
    (
      {"lengths": [4.5, 1.5]},
      ValueError,
      r"Expected integer lengths at LoD level 0, got dtype float64 \(index 0: "
      r"np.float64\(4.5\)\)\.",
    ),
    (
      {"lengths": [[1, 2], [4, 2]]},
      ValueError,
      r"LoD level 0: last offset 3 must equal the number of sequences at level 1, "
      r"which is 2\.",
    ),
    (
      {"lengths": [[4, 2], 1]},
      ValueError,
      r"Expected `lengths` to be a list of ints \(one level\) or a list of lists of "
      r"ints, got a mix: \[\[4, 2\], 1\]\.",
    ),
    (
      {"lengths": "42"},
      TypeError,
      r"Expected `lengths` to be a list of lists of ints \(Paddle's recursive "
      r"lengths\), got str\.",
    ),
    (
      {"lengths": np.zeros((0, 2), np.int32)},
      ValueError,
      r"Expected `lengths` to name at least one LoD level, got none\.",
    ),
    (
      {"lengths": [30, 3]},
      ValueError,
      r"lod_reset: the new LoD covers 33 rows, more than the token capacity 32 of "
      r"`x`\.",
    ),
  ],
)
def test_lod_reset_errors(kwargs, error, match):
  x = LoDTensor.from_lengths(np.arange(6.0), [[2, 3, 1]], buckets=ONE_LEVEL)
  with pytest.raises(error, match=match):
    lod_reset(x, **kwargs)


def test_lod_reset_errors_on_traced_lengths_and_bad_x():
  x = LoDTensor.from_lengths(np.arange(6.0), [[2, 3, 1]])
  with pytest.raises(
    TypeError,
    match=r"Expected `lengths` to be host data \(lists of ints\), got a traced "
    r"array; pass `y=` to take a LoD computed under jit\.",
  ):
    jax.jit(lambda x, n: lod_reset(x, n))(x, jnp.array([6]))
  with pytest.raises(
    TypeError, match=r"Expected `x` to be a LoDTensor or an array, got dict\."
  ):
    lod_reset({}, [6])
  with pytest.raises(
    ValueError,
    match=r"Expected `x` to be a LoDTensor or an array \[rows, \*features\] \(rank "
    r">= 1\), got a scalar\.",
  ):
    lod_reset(1.0, [1])
