"""Tests of sequence_expand, sequence_expand_as, sequence_concat, sequence_erase
and sequence_slice."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify
from jax.test_util import check_grads

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import (
  sequence_concat,
  sequence_erase,
  sequence_expand,
  sequence_expand_as,
  sequence_slice,
)
from tests.helpers import (
  FEATURES,
  assert_close,
  assert_nested_equal,
  lod_tensors,
  recursive_lengths,
)

# Shared jitted ops: one compile per distinct capacity and static argument.
_expand = jax.jit(sequence_expand, static_argnames=("ref_level", "capacity"))
_expand_as = jax.jit(sequence_expand_as, static_argnames=("capacity",))
_concat = jax.jit(sequence_concat, static_argnames=("capacity",))
_erase = jax.jit(sequence_erase, static_argnames=("capacity",))
_slice = jax.jit(sequence_slice)

# -- NumPy references (loops over `to_list()`) ------------------------------------


def ref_expand_rows(rows, lengths):
  """Sequence i is row i repeated lengths[i] times."""
  return [
    np.repeat(np.asarray(rows)[i : i + 1], n, axis=0) for i, n in enumerate(lengths)
  ]


def ref_expand_sequences(seqs, lengths):
  """lengths[i] copies of sequence i, each its own sequence."""
  return [seq for seq, n in zip(seqs, lengths, strict=True) for _ in range(n)]


def ref_concat(lists):
  return [np.concatenate(parts, axis=0) for parts in zip(*lists, strict=True)]


def _map_last(nested, fn, counter=None):
  """Applies ``fn(k, seq)`` to the k-th last-level sequence of a nested list."""
  counter = [0] if counter is None else counter
  out = []
  for item in nested:
    if isinstance(item, list):
      out.append(_map_last(item, fn, counter))
    else:
      out.append(fn(counter[0], item))
      counter[0] += 1
  return out


def ref_erase(nested, tokens):
  return _map_last(nested, lambda k, s: s[~np.isin(s.reshape(-1), tokens)])


def ref_slice(nested, offset, length):
  return _map_last(nested, lambda k, s: s[offset[k] : offset[k] + length[k]])


def _source_gather(src, values):
  """Rows ``values[src]``, zeros where ``src < 0``: the plain padded reference."""
  src = np.asarray(src)
  rows = values[np.maximum(src, 0)]
  mask = (src >= 0).reshape(src.shape + (1,) * (values.ndim - 1))
  return jnp.where(mask, rows, jnp.zeros((), values.dtype))


def _pad_index(src, size):
  assert len(src) <= size
  return np.array(list(src) + [-1] * (size - len(src)), np.int64)


def _offsets(x, level=-1):
  return np.asarray(x.offsets[level])


def _check_padding(out: LoDTensor):
  """Rows past the data are zeros; sequences past the count are empty."""
  np.testing.assert_array_equal(np.asarray(out.values)[int(out.num_rows) :], 0)
  for o, lengths in zip(out.offsets, out.recursive_lengths(), strict=True):
    o = np.asarray(o)
    assert np.all(np.diff(o) >= 0)
    np.testing.assert_array_equal(o[len(lengths) :], o[-1])


def _lod(lengths, buckets=None, features=(FEATURES,), dtype=np.float32, seed=0):
  rows = sum(lengths[-1])
  values = np.random.default_rng(seed).normal(size=(rows, *features)).astype(dtype)
  return LoDTensor.from_lengths(values, lengths, buckets=buckets)


def _ids(lengths, ids, buckets=None):
  return LoDTensor.from_lengths(np.asarray(ids, np.int32), lengths, buckets=buckets)


# -- sequence_expand ---------------------------------------------------------------


def test_expand_paddle_case_1():
  # x.lod [[2, 2]] = [a, b | c, d]; y.lod [[2, 2], [3, 3, 1, 1]]; ref_level 0.
  x = LoDTensor.from_lengths(np.array([[1.0], [2.0], [3.0], [4.0]]), [[2, 2]])
  y = _lod([[2, 2], [3, 3, 1, 1]])
  for out in (_expand(x, y, ref_level=0), sequence_expand(x, y, 0)):
    assert out.recursive_lengths() == [[2, 2, 2, 2]]
    np.testing.assert_array_equal(out.to_list()[0][:, 0], [1.0, 2.0])
    np.testing.assert_array_equal(
      np.asarray(out.values)[: int(out.num_rows), 0], [1, 2, 1, 2, 3, 4, 3, 4]
    )
    _check_padding(out)


def test_expand_paddle_case_2():
  # x = [a, b, c] without LoD; y.lod [[2, 0, 3]]; ref_level -1.
  x = np.array([[1.0], [2.0], [3.0]], np.float32)
  y = _lod([[2, 0, 3]])
  for out in (_expand(x, y), sequence_expand(x, y)):
    np.testing.assert_array_equal(np.asarray(out.values)[:, 0], [1, 1, 3, 3, 3])
    assert out.recursive_lengths() == [[2, 0, 3]]


def test_expand_paddle_ref_level_1():
  # An array x and a 2-level y at its last level: one sequence per sub-sequence.
  x = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
  y = _lod([[2, 2], [3, 3, 1, 1]])
  out = _expand(x, y, ref_level=1)
  assert out.recursive_lengths() == [[3, 3, 1, 1]]
  np.testing.assert_array_equal(np.asarray(out.values)[:8, 0], [1, 1, 1, 2, 2, 2, 3, 4])


def test_expand_default_capacities():
  y = _lod(
    [[2, 0, 3], [1, 3, 0, 2, 2]],
    Buckets.fixed(tokens=12, sequences=(4, 7), time=(4, 5)),
  )
  rows = _expand(jnp.ones((4, 2)), y, ref_level=0)
  assert rows.capacity == (7, (4,), (4,))
  assert int(rows.num_outer) == 3
  x = _lod([[2, 1, 0]], Buckets.fixed(tokens=6, sequences=4, time=3))
  copies = _expand(x, y, ref_level=0)
  assert copies.capacity == (21, (7,), (3,))
  assert int(copies.num_outer) == 5
  assert copies.recursive_lengths() == [[2, 2, 0, 0, 0]]


@st.composite
def _expand_case(draw):
  """y, a level of y, and x (array or one-level LoDTensor) matching it."""
  y = draw(lod_tensors())
  level = draw(st.sampled_from(range(y.num_levels)))
  count = y.capacity.sequences[level]
  real = len(y.recursive_lengths()[level])
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  if draw(st.booleans()):
    return y, level, rng.normal(size=(count, FEATURES)).astype(np.float32)
  lengths = draw(st.lists(st.integers(0, 3), min_size=real, max_size=real))
  buckets = Buckets.fixed(tokens=3 * count, sequences=count, time=3)
  return y, level, _lod([lengths], buckets, seed=seed)


@settings(max_examples=30)
@given(case=_expand_case())
def test_expand_matches_reference(case):
  y, level, x = case
  repeats = y.recursive_lengths()[level]
  out = _expand(x, y, ref_level=level)
  if isinstance(x, LoDTensor):
    expected = ref_expand_sequences(x.to_list(), repeats)
    assert out.time_capacity == x.time_capacity
  else:
    expected = ref_expand_rows(x, repeats)
    assert out.capacity.sequences == (y.capacity.sequences[level],)
  assert_nested_equal(out.to_list(), expected)
  _check_padding(out)


def test_expand_eager_real_counts():
  # Eagerly, x may have the real number of rows (or another count capacity).
  y = _lod([[2, 0, 3]], Buckets.fixed(tokens=8, sequences=5, time=4))
  rows = np.arange(6.0, dtype=np.float32).reshape(3, 2)
  out = sequence_expand(rows, y)
  assert_nested_equal(out.to_list(), ref_expand_rows(rows, [2, 0, 3]))
  assert out.capacity.sequences == (5,)
  for buckets in (None, Buckets.fixed(tokens=9, sequences=7, time=3)):
    x = _lod([[1, 0, 2]], buckets)
    out = sequence_expand(x, y)
    assert_nested_equal(out.to_list(), ref_expand_sequences(x.to_list(), [2, 0, 3]))
    _check_padding(out)


def test_expand_integer_rows():
  y = _lod([[1, 2]])
  out = _expand(jnp.array([7, 9], jnp.int32), y)
  assert out.values.dtype == jnp.int32
  np.testing.assert_array_equal(out.values, [7, 9, 9])


# -- sequence_expand_as ------------------------------------------------------------


def test_expand_as_paddle_example():
  # x = [a, b, c, d]; y.lod [[3, 3, 1, 1]] -> [a a a b b b c d], LoD of y.
  x = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
  y = _lod([[3, 3, 1, 1]])
  for out in (_expand_as(x, y), sequence_expand_as(x, y)):
    assert out.recursive_lengths() == [[3, 3, 1, 1]]
    np.testing.assert_array_equal(out.values[:, 0], [1, 1, 1, 2, 2, 2, 3, 4])


@settings(max_examples=25)
@given(y=lod_tensors(), seed=st.integers(0, 2**31 - 1))
def test_expand_as_matches_reference(y, seed):
  count = y.capacity.sequences[0]
  x = np.random.default_rng(seed).normal(size=(count, FEATURES)).astype(np.float32)
  out = _expand_as(x, y)
  assert out.recursive_lengths() == y.recursive_lengths()[:1]
  assert out.capacity.time == (y.time_capacity[0],)
  bound = y.capacity.tokens if y.num_levels == 1 else y.capacity.sequences[1]
  assert out.capacity.tokens == bound
  assert_nested_equal(out.to_list(), ref_expand_rows(x, y.recursive_lengths()[0]))
  _check_padding(out)
  # Eagerly with the real number of rows.
  real = len(y.recursive_lengths()[0])
  eager = sequence_expand_as(x[:real], y)
  assert_nested_equal(eager.to_list(), out.to_list())


# -- sequence_concat ---------------------------------------------------------------

CONCAT = Buckets.fixed(tokens=20, sequences=6, time=4)


@st.composite
def _concat_inputs(draw):
  count = draw(st.integers(0, 5))
  inputs = draw(st.integers(1, 3))
  seed = draw(st.integers(0, 2**31 - 1))
  xs = []
  for k in range(inputs):
    lengths = draw(st.lists(st.integers(0, 4), min_size=count, max_size=count))
    xs.append(_lod([lengths], CONCAT, seed=seed + k))
  return xs


@settings(max_examples=30)
@given(xs=_concat_inputs())
def test_concat_matches_reference(xs):
  out = _concat(xs)
  assert out.capacity == (20 * len(xs), (6,), (4 * len(xs),))
  assert_nested_equal(out.to_list(), ref_concat([x.to_list() for x in xs]))
  _check_padding(out)


def test_concat_eager_and_tuple():
  a = _lod([[2, 0, 1]])
  b = _lod([[0, 3, 1]], seed=1)
  out = sequence_concat((a, b))
  assert out.recursive_lengths() == [[2, 3, 2]]
  assert_nested_equal(out.to_list(), ref_concat([a.to_list(), b.to_list()]))


def test_concat_paddle_example():
  # x1.lod [[0, 3, 5]] = [1 2 3 | 4 5], x2.lod [[0, 2, 4]] = [6 7 | 8 9].
  x1 = LoDTensor.from_lengths(np.arange(1.0, 6.0), [[3, 2]])
  x2 = LoDTensor.from_lengths(np.arange(6.0, 10.0), [[2, 2]])
  out = _concat([x1, x2])
  assert out.recursive_lengths() == [[5, 4]]
  np.testing.assert_array_equal(out.values, [1, 2, 3, 6, 7, 4, 5, 8, 9])


# -- sequence_erase ----------------------------------------------------------------

ERASE_ONE = Buckets.fixed(tokens=32, sequences=8, time=6)
ERASE_TWO = Buckets.fixed(tokens=48, sequences=(6, 12), time=(4, 5))


@st.composite
def _erase_case(draw):
  lengths = draw(recursive_lengths())
  rows = sum(lengths[-1])
  ids = draw(st.lists(st.integers(0, 5), min_size=rows, max_size=rows))
  buckets = ERASE_ONE if len(lengths) == 1 else ERASE_TWO
  x = _ids(lengths, ids, buckets)
  if draw(st.booleans()):
    x = x.with_values(x.values[:, None])
  tokens = draw(st.lists(st.integers(0, 6), max_size=3))
  return x, tokens, draw(st.booleans())


@settings(max_examples=30)
@given(case=_erase_case())
def test_erase_matches_reference(case):
  x, tokens, eager = case
  expected = ref_erase(x.to_list(), tokens)
  # Padded with an id that never occurs: one shape of `tokens`, one compile.
  padded = tokens + [-1] * (3 - len(tokens))
  outs = [_erase(x, jnp.asarray(padded, jnp.int32))]
  if eager:
    outs.append(sequence_erase(x, padded))
  for out in outs:
    assert out.capacity == x.capacity
    assert out.values.dtype == x.values.dtype
    assert out.recursive_lengths()[:-1] == x.recursive_lengths()[:-1]
    assert_nested_equal(out.to_list(), expected)
    _check_padding(out)


def test_erase_paddle_example():
  x = _ids([[3, 3, 4]], [2, 2, 6, 1, 3, 9, 6, 1, 0, 1])
  out = _erase(x, (2, 3, 5))
  assert out.recursive_lengths() == [[1, 2, 4]]
  np.testing.assert_array_equal(out.values[:7], [6, 1, 9, 6, 1, 0, 1])


@pytest.mark.parametrize(
  "tokens",
  [[], [2], (2, 7), 2, np.int64(2), np.array([2, 7]), jnp.array(2, jnp.int8)],
  ids=["empty", "list", "tuple", "int", "numpy-int", "array", "scalar-array"],
)
def test_erase_token_forms(tokens):
  x = _ids([[2, 1], [2, 0, 1]], [2, 1, 2])
  out = sequence_erase(x, tokens)
  expected = ref_erase(x.to_list(), np.atleast_1d(np.asarray(tokens, np.int64)))
  assert_nested_equal(out.to_list(), expected)


# -- sequence_slice ----------------------------------------------------------------


def test_slice_paddle_example():
  x = LoDTensor.from_lengths(np.arange(10.0).reshape(5, 2), [[3, 2]])
  offset, length = np.array([[0], [1]]), np.array([[2], [1]])
  for out in (_slice(x, offset, length), sequence_slice(x, offset, length)):
    assert out.recursive_lengths() == [[2, 1]]
    np.testing.assert_array_equal(out.values[:3], [[0, 1], [2, 3], [8, 9]])
    assert out.capacity == x.capacity
    _check_padding(out)


@st.composite
def _slice_case(draw):
  x = draw(lod_tensors())
  sizes = np.diff(np.asarray(x.offsets[-1]))
  offset = [draw(st.integers(0, int(n))) for n in sizes]
  length = [
    draw(st.integers(0, int(n) - o)) for n, o in zip(sizes, offset, strict=True)
  ]
  return x, np.array(offset, np.int32), np.array(length, np.int32)


@settings(max_examples=30)
@given(case=_slice_case())
def test_slice_matches_reference(case):
  x, offset, length = case
  expected = ref_slice(x.to_list(), offset, length)
  out = _slice(x, offset, length)
  assert out.capacity == x.capacity
  assert out.recursive_lengths()[:-1] == x.recursive_lengths()[:-1]
  assert_nested_equal(out.to_list(), expected)
  _check_padding(out)
  real = int(x.num_sequences(-1))
  eager = sequence_slice(x, offset[:real, None], length[:real, None])
  assert_nested_equal(eager.to_list(), expected)


# -- capacities: overflow, checkify, Buckets ----------------------------------------

Y_BUCKETS = Buckets.fixed(tokens=12, sequences=(4, 7), time=(4, 5))
X_BUCKETS = Buckets.fixed(tokens=6, sequences=4, time=3)
AB_BUCKETS = Buckets.fixed(tokens=6, sequences=4, time=4)
_Y = _lod([[2, 0, 3], [1, 3, 0, 2, 2]], Y_BUCKETS)
_XLOD = _lod([[2, 1, 1]], X_BUCKETS)
_ROWS = np.arange(8.0, dtype=np.float32).reshape(4, 2)
_A = _lod([[2, 0, 3]], AB_BUCKETS)
_B = _lod([[1, 2, 1]], AB_BUCKETS, seed=1)
_IDS = _ids([[3, 2]], [1, 2, 3, 2, 5], Buckets.fixed(tokens=8, sequences=4, time=4))


def _with_capacity(op, *static):
  """``capacity -> f(*arrays)`` calling `op` with `static` trailing arguments."""
  return lambda capacity: lambda *a: op(*a, *static, capacity=capacity)


# name: (op name, capacity -> function of arrays, arrays, output tokens)
CAPACITY_CASES = {
  "expand-rows": (
    "sequence_expand",
    _with_capacity(sequence_expand, 0),
    (_ROWS, _Y),
    5,
  ),
  "expand-lod": ("sequence_expand", _with_capacity(sequence_expand, 0), (_XLOD, _Y), 7),
  "expand_as": (
    "sequence_expand_as",
    _with_capacity(sequence_expand_as),
    (_ROWS, _Y),
    5,
  ),
  "concat": (
    "sequence_concat",
    lambda c: lambda a, b: sequence_concat([a, b], capacity=c),
    (_A, _B),
    9,
  ),
  "erase": (
    "sequence_erase",
    _with_capacity(sequence_erase),
    (_IDS, np.array([2], np.int32)),
    3,
  ),
}


def _reference_list(name):
  _, make, args, _ = CAPACITY_CASES[name]
  return make(None)(*args).to_list()


def _policy_capacity(policy, out):
  """The capacity a `Buckets` policy gives the real sizes of `out`."""
  lengths = out.recursive_lengths()
  return (
    policy.capacity(sum(lengths[-1]), "tokens"),
    tuple(policy.capacity(len(n), "sequences", i) for i, n in enumerate(lengths)),
    tuple(policy.capacity(max(n, default=0), "time", i) for i, n in enumerate(lengths)),
  )


@pytest.mark.parametrize("name", list(CAPACITY_CASES))
def test_capacity_overflow_eager(name):
  where, make, args, tokens = CAPACITY_CASES[name]
  match = (
    rf"{where}: the output needs tokens {tokens}, more than its capacity "
    rf"{tokens - 1}; data is never truncated\. Pass a larger `capacity`\."
  )
  with pytest.raises(ValueError, match=match):
    make(tokens - 1)(*args)
  out = make(tokens)(*args)  # exactly enough
  assert out.capacity.tokens == tokens
  assert_nested_equal(out.to_list(), _reference_list(name))
  _check_padding(out)


@pytest.mark.parametrize("name", list(CAPACITY_CASES))
def test_capacity_overflow_checkify(name):
  where, make, args, tokens = CAPACITY_CASES[name]
  checked = checkify.checkify(jax.jit(make(tokens - 1)))
  err, _ = checked(*args)
  match = (
    rf"{where}: the output needs more tokens than its capacity {tokens - 1}; "
    r"pass a larger `capacity`\."
  )
  with pytest.raises(checkify.JaxRuntimeError, match=match):
    err.throw()


@pytest.mark.parametrize("name", list(CAPACITY_CASES))
def test_capacity_buckets_eager(name):
  _, make, args, _ = CAPACITY_CASES[name]
  policy = Buckets.pow2(minimum=2)
  out = make(policy)(*args)
  assert out.capacity == _policy_capacity(policy, out)
  assert_nested_equal(out.to_list(), _reference_list(name))
  _check_padding(out)


@pytest.mark.parametrize("name", list(CAPACITY_CASES))
def test_capacity_buckets_fixed_under_jit(name):
  _, make, args, _ = CAPACITY_CASES[name]
  levels = make(None)(*args).num_levels
  policy = Buckets.fixed(tokens=16, sequences=8, time=8)
  out = jax.jit(make(policy))(*args)
  assert out.capacity == (16, (8,) * levels, (8,) * levels)
  assert_nested_equal(out.to_list(), _reference_list(name))
  _check_padding(out)


def test_capacity_buckets_fixed_too_small_under_jit():
  _, make, args, _ = CAPACITY_CASES["concat"]
  policy = Buckets.fixed(tokens=16, sequences=8, time=3)
  err, _ = checkify.checkify(jax.jit(make(policy)))(*args)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"sequence_concat: the output needs more time \(longest sequence\) at "
    r"level 0 than its capacity 3",
  ):
    err.throw()
  with pytest.raises(
    ValueError,
    match=r"Batch time size at level 0 is 4, more than the fixed capacity 3; data is "
    r"never truncated\.",
  ):
    make(policy)(*args)


# -- errors -------------------------------------------------------------------------

_ONE = _lod([[2, 0, 3]])  # count capacity 3, real count 3
_TWO = _lod([[2, 1], [1, 0, 2]])
_PADDED = _lod([[2, 0, 3]], Buckets.fixed(tokens=6, sequences=5, time=4))


ERRORS = {
  # name: (call, exception, message)
  "expand-y-type": (
    lambda: sequence_expand(_ROWS, np.zeros(3)),
    TypeError,
    r"Expected `y` to be a LoDTensor, got ndarray\.",
  ),
  "expand-ref-level-type": (
    lambda: sequence_expand(_ROWS, _TWO, 0.5),
    TypeError,
    r"Expected `ref_level` to be an int, got 0\.5\.",
  ),
  "expand-ref-level-range": (
    lambda: sequence_expand(_ROWS, _TWO, 2),
    ValueError,
    r"Expected `ref_level` in \[-2, 2\) \(the LoD levels of the tensor\), got 2\.",
  ),
  "expand-ref-level-negative": (
    lambda: sequence_expand(_ROWS, _ONE, -2),
    ValueError,
    r"Expected `ref_level` in \[-1, 1\) \(the LoD levels of the tensor\), got -2\.",
  ),
  "expand-x-two-levels": (
    lambda: sequence_expand(_TWO, _TWO, 0),
    ValueError,
    r"Expected `x` to have 1 LoD level\(s\), got 2\.",
  ),
  "expand-x-rows": (
    lambda: sequence_expand(np.zeros((4, 2)), _PADDED),
    ValueError,
    r"Expected `x` to have leading dimension 5 \(count capacity\) or 3 "
    r"\(sequences\), got shape \(4, 2\)\.",
  ),
  "expand-x-scalar": (
    lambda: sequence_expand(1.0, _ONE),
    ValueError,
    r"Expected `x` to have leading dimension 3 \(count capacity\), got a scalar\.",
  ),
  "expand-x-count": (
    lambda: sequence_expand(_lod([[1, 1]]), _ONE),
    ValueError,
    r"sequence_expand: expected `x` to have 3 sequences \(those of `y` at level "
    r"0\), got 2\.",
  ),
  "expand-x-count-capacity-jit": (
    lambda: jax.jit(sequence_expand)(_lod([[1, 1]]), _ONE),
    ValueError,
    r"Expected `x` to have count capacity 3 \(the count capacity of `y` at level "
    r"0\), got 2\.",
  ),
  "expand-capacity-type": (
    lambda: sequence_expand(_ROWS[:3], _ONE, capacity=2.5),
    TypeError,
    r"sequence_expand: expected `capacity` to be None, an int or a Buckets "
    r"policy, got 2\.5\.",
  ),
  "expand-capacity-negative": (
    lambda: sequence_expand(_ROWS[:3], _ONE, capacity=-1),
    ValueError,
    r"sequence_expand: expected `capacity` >= 0, got -1\.",
  ),
  "expand_as-x-lod": (
    lambda: sequence_expand_as(_ONE, _ONE),
    TypeError,
    r"Expected `x` to be an array \[count, \*features\] \(one row per sequence of "
    r"`y`\), got LoDTensor\.",
  ),
  "expand_as-y-type": (
    lambda: sequence_expand_as(_ROWS, [1, 2]),
    TypeError,
    r"Expected `y` to be a LoDTensor, got list\.",
  ),
  "expand_as-x-rows": (
    lambda: sequence_expand_as(np.zeros((3, 2)), _TWO),
    ValueError,
    r"Expected `x` to have leading dimension 2 \(count capacity\) or 2 "
    r"\(sequences\), got shape \(3, 2\)\.",
  ),
  "expand_as-x-rows-jit": (
    lambda: jax.jit(sequence_expand_as)(np.zeros((3, 2)), _PADDED),
    ValueError,
    r"Expected `x` to have leading dimension 5 \(count capacity\), got shape "
    r"\(3, 2\)\.",
  ),
  "concat-type": (
    lambda: sequence_concat(_ONE),
    TypeError,
    r"Expected `xs` to be a list or tuple, got LoDTensor\.",
  ),
  "concat-empty": (
    lambda: sequence_concat([]),
    ValueError,
    r"Expected `xs` to hold at least one LoDTensor, got none\.",
  ),
  "concat-item-type": (
    lambda: sequence_concat([_ONE, np.zeros(3)]),
    TypeError,
    r"Expected `xs\[1\]` to be a LoDTensor, got ndarray\.",
  ),
  "concat-two-levels": (
    lambda: sequence_concat([_ONE, _TWO]),
    ValueError,
    r"Expected `xs\[1\]` to have 1 LoD level\(s\), got 2\.",
  ),
  "concat-count-capacity": (
    lambda: sequence_concat([_ONE, _PADDED]),
    ValueError,
    r"Expected `xs\[1\]` to have count capacity 3 \(that of `xs\[0\]`\), got 5\.",
  ),
  "concat-features": (
    lambda: sequence_concat([_ONE, _ONE, _lod([[1, 1, 1]], features=(3,))]),
    ValueError,
    r"Expected `xs\[2\]` to have feature shape \(2,\) \(that of `xs\[0\]`\), got "
    r"\(3,\)\.",
  ),
  "concat-dtype": (
    lambda: sequence_concat([_ONE, _lod([[1, 1, 1]], dtype=np.float16)]),
    TypeError,
    r"Expected `xs\[1\]` to have dtype float32 \(that of `xs\[0\]`\), got "
    r"float16\.",
  ),
  "concat-real-count": (
    lambda: sequence_concat(
      [_ONE, _lod([[1, 1]], Buckets.fixed(tokens=2, sequences=3, time=1))]
    ),
    ValueError,
    r"sequence_concat: `xs\[1\]` has 2 sequences, `xs\[0\]` has 3; expected the "
    r"same number\.",
  ),
  "erase-x-type": (
    lambda: sequence_erase(_ROWS, [1]),
    TypeError,
    r"Expected `x` to be a LoDTensor, got ndarray\.",
  ),
  "erase-float": (
    lambda: sequence_erase(_ONE, [1]),
    TypeError,
    r"Expected `x\.values` to have an integer dtype, got float32\.",
  ),
  "erase-features": (
    lambda: sequence_erase(_ids([[2]], [[1, 2], [3, 4]]), [1]),
    ValueError,
    r"Expected `x\.values` to have shape \[token_capacity\] or \[token_capacity, "
    r"1\], got \(2, 2\)\.",
  ),
  "erase-rank": (
    lambda: sequence_erase(_ids([[2]], np.zeros((2, 1, 1))), [1]),
    ValueError,
    r"Expected `x\.values` to have shape \[token_capacity\] or \[token_capacity, "
    r"1\] \(rank 1 or 2\), got \(2, 1, 1\)\.",
  ),
  "erase-token-item": (
    lambda: sequence_erase(_ids([[2]], [1, 2]), [1, 2.5]),
    TypeError,
    r"Expected `tokens\[1\]` to be an int, got 2\.5\.",
  ),
  "erase-token-bool": (
    lambda: sequence_erase(_ids([[2]], [1, 2]), [True]),
    TypeError,
    r"Expected `tokens\[0\]` to be an int, got True\.",
  ),
  "erase-tokens-float": (
    lambda: sequence_erase(_ids([[2]], [1, 2]), np.array([1.0])),
    TypeError,
    r"Expected `tokens` to have an integer dtype, got float64\.",
  ),
  "erase-tokens-rank": (
    lambda: sequence_erase(_ids([[2]], [1, 2]), np.zeros((2, 2), np.int32)),
    ValueError,
    r"Expected `tokens` to have shape \[\] or \[n\] \(rank 0 or 1\), got \(2, 2\)\.",
  ),
  "erase-tokens-type": (
    lambda: sequence_erase(_ids([[2]], [1, 2]), "12"),
    TypeError,
    r"Expected `tokens` to be an int, a list or tuple of ints or an integer "
    r"array, got str\.",
  ),
  "slice-x-type": (
    lambda: sequence_slice(_ROWS, [0], [1]),
    TypeError,
    r"Expected `x` to be a LoDTensor, got ndarray\.",
  ),
  "slice-offset-float": (
    lambda: sequence_slice(_ONE, np.zeros(3), np.zeros(3, np.int32)),
    TypeError,
    r"Expected `offset` to have an integer dtype, got float64\.",
  ),
  "slice-length-float": (
    lambda: sequence_slice(_ONE, np.zeros(3, np.int32), np.ones(3, np.float32)),
    TypeError,
    r"Expected `length` to have an integer dtype, got float32\.",
  ),
  "slice-length-list-of-floats": (
    lambda: sequence_slice(_ONE, [0, 0, 0], [1.0, 0.0, 1.0]),
    TypeError,
    r"Expected `length` to have an integer dtype, got float64\.",
  ),
  "slice-offset-columns": (
    lambda: sequence_slice(_ONE, np.zeros((3, 2), np.int32), np.zeros(3, np.int32)),
    ValueError,
    r"Expected `offset` to have shape \[count\] or \[count, 1\], got \(3, 2\)\.",
  ),
  "slice-offset-scalar": (
    lambda: sequence_slice(_ONE, 0, np.zeros(3, np.int32)),
    ValueError,
    r"Expected `offset` to have shape \[count\] or \[count, 1\] \(rank 1 or 2\), "
    r"got \(\)\.",
  ),
  "slice-length-rows": (
    lambda: sequence_slice(_PADDED, np.zeros(5, np.int32), np.zeros(4, np.int32)),
    ValueError,
    r"Expected `length` to have leading dimension 5 \(count capacity\) or 3 "
    r"\(sequences\), got shape \(4,\)\.",
  ),
  "slice-past-end": (
    lambda: sequence_slice(_ONE, np.array([0, 0, 2]), np.array([2, 0, 2])),
    ValueError,
    r"sequence_slice: sequence 2 has length 3, got offset 2 and length 2; expected "
    r"offset >= 0, length >= 0 and offset \+ length <= 3\.",
  ),
  "slice-negative-offset": (
    lambda: sequence_slice(_TWO, np.array([0, -1, 0]), np.array([1, 0, 0])),
    ValueError,
    r"sequence_slice: sequence 1 has length 0, got offset -1 and length 0; "
    r"expected offset >= 0, length >= 0 and offset \+ length <= 0\.",
  ),
  "slice-negative-length": (
    lambda: sequence_slice(_ONE, np.array([[1], [0], [0]]), np.array([[-1], [0], [0]])),
    ValueError,
    r"sequence_slice: sequence 0 has length 2, got offset 1 and length -1; "
    r"expected offset >= 0, length >= 0 and offset \+ length <= 2\.",
  ),
  "slice-padding-sequence": (
    lambda: sequence_slice(_PADDED, np.zeros(5, np.int32), np.array([0, 0, 0, 0, 1])),
    ValueError,
    r"sequence_slice: sequence 4 has length 0, got offset 0 and length 1; expected "
    r"offset >= 0, length >= 0 and offset \+ length <= 0\.",
  ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(name):
  call, error, match = ERRORS[name]
  with pytest.raises(error, match=match):
    call()


def test_expand_real_count_checkify():
  x = _lod([[1, 1]], Buckets.fixed(tokens=2, sequences=3, time=1))
  err, _ = checkify.checkify(_expand)(x, _ONE)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"sequence_expand: expected `x` to have 3 sequences \(those of `y` at "
    r"level 0\), got 2\.",
  ):
    err.throw()


def test_concat_real_count_checkify():
  other = _lod([[1, 1]], Buckets.fixed(tokens=2, sequences=3, time=1))
  err, _ = checkify.checkify(_concat)([_ONE, other])
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"sequence_concat: `xs\[1\]` has 2 sequences, `xs\[0\]` has 3; expected "
    r"the same number\.",
  ):
    err.throw()


def test_slice_out_of_range_checkify():
  checked = checkify.checkify(_slice)
  err, _ = checked(_ONE, np.array([0, 0, 2]), np.array([2, 0, 2]))
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"sequence_slice: sequence 2 has length 3, got offset 2 and length 2; "
    r"expected offset >= 0, length >= 0 and offset \+ length <= 3\.",
  ):
    err.throw()
  err, out = checked(_ONE, np.array([0, 0, 1]), np.array([2, 0, 2]))
  err.throw()
  assert out.recursive_lengths() == [[2, 0, 2]]


# -- gradients ----------------------------------------------------------------------


def _grad_cases(dtype):
  """name: (function of one array, its argument, NumPy source row of each output
  row, -1 for padding)."""
  y = _lod([[2, 0, 3], [1, 3, 0, 2, 2]], Y_BUCKETS, dtype=dtype)
  x = _lod([[2, 0, 1]], X_BUCKETS, dtype=dtype)
  a = _lod([[2, 0, 3]], AB_BUCKETS, dtype=dtype)
  b = _lod([[1, 2, 0]], AB_BUCKETS, dtype=dtype, seed=1)
  s = _lod([[2, 1], [3, 0, 4]], Buckets.fixed(tokens=9, sequences=(3, 4), time=(2, 5)))
  s = s.with_values(s.values.astype(dtype))
  rows = np.random.default_rng(3).normal(size=(4, FEATURES)).astype(dtype)
  last = np.random.default_rng(4).normal(size=(7, FEATURES)).astype(dtype)
  xo, ao, bo, so = _offsets(x), _offsets(a), _offsets(b), _offsets(s)
  offset, length = np.array([1, 0, 1, 0]), np.array([2, 0, 2, 0])
  sources = {
    "expand-rows": [i for i, n in enumerate([2, 0, 3]) for _ in range(n)],
    "expand-last": [i for i, n in enumerate([1, 3, 0, 2, 2]) for _ in range(n)],
    "expand-lod": [
      r
      for i, n in enumerate([2, 0, 3])
      for _ in range(n)
      for r in range(xo[i], xo[i + 1])
    ],
    "concat": [
      r
      for i in range(3)
      for r in [*range(ao[i], ao[i + 1]), *range(6 + bo[i], 6 + bo[i + 1])]
    ],
    "slice": [
      r
      for k in range(3)
      for r in range(so[k] + offset[k], so[k] + offset[k] + length[k])
    ],
  }
  cases = {
    "expand-rows": (lambda v: sequence_expand(v, y, 0).values, rows, 7),
    "expand-last": (lambda v: sequence_expand(v, y).values, last, 12),
    "expand-lod": (
      lambda v: sequence_expand(x.with_values(v), y, 0).values,
      x.values,
      21,
    ),
    "expand_as": (lambda v: sequence_expand_as(v, y).values, rows, 7),
    "concat": (
      lambda v: sequence_concat([a.with_values(v[:6]), b.with_values(v[6:])]).values,
      jnp.concatenate([a.values, b.values]),
      12,
    ),
    "slice": (
      lambda v: sequence_slice(s.with_values(v), offset, length).values,
      s.values,
      9,
    ),
  }
  sources["expand_as"] = sources["expand-rows"]
  return {
    name: (fn, arg, _pad_index(sources[name], size))
    for name, (fn, arg, size) in cases.items()
  }


GRAD_CASES = [
  "expand-rows",
  "expand-last",
  "expand-lod",
  "expand_as",
  "concat",
  "slice",
]


@pytest.mark.parametrize("name", GRAD_CASES)
def test_check_grads_float64(name):
  with jax.enable_x64(True):
    fn, arg, _ = _grad_cases(np.float64)[name]
    arg = jnp.asarray(arg)
    assert arg.dtype == jnp.float64
    check_grads(jax.jit(fn), (arg,), order=1, modes=("rev",))


@pytest.mark.parametrize("name", GRAD_CASES)
def test_vjp_matches_padded_reference(name):
  fn, arg, source = _grad_cases(np.float32)[name]
  out, vjp = jax.vjp(jax.jit(fn), arg)
  expected, reference_vjp = jax.vjp(lambda v: _source_gather(source, v), arg)
  np.testing.assert_array_equal(out, expected)
  cotangent = np.random.default_rng(0).normal(size=out.shape).astype(np.float32)
  (grad,) = vjp(cotangent)
  assert_close(grad, reference_vjp(cotangent)[0])
  # Rows that no output copies (padding, unselected) get exactly zero.
  unused = np.setdiff1d(np.arange(arg.shape[0]), source)
  assert np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_array_equal(np.asarray(grad)[unused], 0)
