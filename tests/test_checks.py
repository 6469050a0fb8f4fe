"""Tests of the argument and value checks (jaxlod/_checks.py, _host_checks.py and
_layer_checks.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import export
from jax.experimental import checkify

from jaxlod import Buckets, Capacity, LoDTensor, _checks, ops, unchecked
from jaxlod._buckets import check_fits
from jaxlod._host import check_rows
from jaxlod._lod import check_lod, is_lod
from jaxlod._lod_checks import (
  check_integer_level,
  check_lengths_fit,
  check_level,
  check_offsets,
  check_pad_value,
  per_sequence,
)
from jaxlod.interop._torch import check_batch_sizes, check_sort_indices
from jaxlod.ops import rank_table
from jaxlod.ops._pool import check_pool_dtype, check_pool_type
from jaxlod.ops._rank import check_pair


def _x():
  buckets = Buckets.fixed(tokens=8, sequences=4, time=5)
  return LoDTensor.from_lengths(np.arange(6.0), [[2, 0, 4]], buckets=buckets)


def test_per_sequence_pads_the_real_count_eagerly():
  out = per_sequence(np.array([5, 6, 7]), "offset", 4, 3, fill=-1)
  assert out.tolist() == [5, 6, 7, -1]
  with pytest.raises(ValueError, match=r"`offset` .* 4 \(count capacity\) or 3"):
    per_sequence(np.array([5, 6]), "offset", 4, 3)
  with pytest.raises(ValueError, match="got a scalar"):
    per_sequence(np.int32(5), "offset", 4, 3)


def test_checks_name_the_argument():
  with pytest.raises(TypeError, match="`x` to be a LoDTensor, got ndarray"):
    check_lod(np.zeros(3), "x")
  with pytest.raises(ValueError, match="`x` to have 1 LoD level"):
    check_lod(LoDTensor.from_lengths(np.zeros(3), [[1], [3]]), "x", levels=(1,))
  with pytest.raises(TypeError, match="`ids` to have an integer dtype, got float32"):
    _checks.check_integer(np.float32, "ids")
  with pytest.raises(TypeError, match="`ids` to have an integer dtype, got bool"):
    _checks.check_integer(np.bool_, "ids")
  with pytest.raises(TypeError, match="`x` to have a float dtype, got int32"):
    _checks.check_float(np.int32, "x")
  with pytest.raises(ValueError, match=r"`x` to have shape \[rows\] \(rank 1\)"):
    _checks.check_rank((2, 3), "x", (1,), "[rows]")
  with pytest.raises(ValueError, match=r"`ref_level` in \[-1, 1\) .* got 1"):
    check_level(_x(), 1, "ref_level")


def test_require():
  _checks.require(np.array([True, True]), "fine")
  with pytest.raises(ValueError, match="broken"):
    _checks.require(np.array([True, False]), "broken")
  err, _ = checkify.checkify(jax.jit(lambda v: _checks.require(v > 0, "neg")))(
    jnp.array([1, -1])
  )
  with pytest.raises(checkify.JaxRuntimeError, match="neg"):
    err.throw()


def test_unchecked_drops_the_checks_so_jax_export_serializes():
  def halve(v, *, scale):
    ok = _checks.require(v > 0, "neg")
    return jnp.where(ok, v * scale, jnp.nan)

  v = jnp.array([2.0, -1.0])
  quiet = unchecked(halve)
  assert quiet.__name__ == "halve"
  err, out = checkify.checkify(jax.jit(quiet, static_argnames="scale"))(v, scale=0.5)
  assert err.get() is None
  assert np.isnan(out).all()  # what the op does with a failed check stays
  exported = export.export(jax.jit(quiet, static_argnames="scale"))(
    jnp.array([2.0, 4.0]), scale=0.5
  )
  call = export.deserialize(exported.serialize())
  assert call.call(jnp.array([2.0, 4.0])).tolist() == [1.0, 2.0]


def test_static_int():
  assert _checks.static_int(np.int32(3), "n", minimum=1) == 3
  with pytest.raises(TypeError, match="`n` to be a static int, got 3.0"):
    _checks.static_int(3.0, "n")
  with pytest.raises(TypeError, match="`n` to be a static int"):
    _checks.static_int(jnp.int32(3), "n")
  with pytest.raises(ValueError, match="`n` >= 1, got 0"):
    _checks.static_int(0, "n", minimum=1)


@given(st.integers(-(2**70), 2**70), st.sampled_from([None, 0, 1]))
def test_static_ints_fit_int32(value, minimum):
  """Static ints become int32 shapes and indices: they fit int32 or raise."""
  low = -(2**31) if minimum is None else minimum
  if low <= value < 2**31:
    assert _checks.static_int(value, "n", minimum=minimum) == value
  elif value < low and minimum is not None:
    with pytest.raises(ValueError, match=rf"`n` >= {minimum}, got {value}\."):
      _checks.static_int(value, "n", minimum=minimum)
  else:
    with pytest.raises(
      ValueError,
      match=rf"`n` in \[{low}, 2147483647\] \(it becomes an int32 shape or index "
      rf"on the device\), got {value}\.",
    ):
      _checks.static_int(value, "n", minimum=minimum)


def test_an_output_bound_beyond_int32_is_refused():
  """`capacity=None` takes the bound of the inputs' capacities: 4096 copies of
  sequences of time capacity 2**20 would need 2**32 rows."""
  x = LoDTensor.from_lengths(
    np.ones(2, np.float32),
    [[2]],
    buckets=Buckets.fixed(tokens=2, sequences=1, time=2**20),
  )
  y = LoDTensor.from_lengths(np.zeros(4096), [[4096]])
  with pytest.raises(
    ValueError,
    match=r"sequence_expand: the output's token capacity 4294967296 does not fit "
    r"int32 \(the dtype of its shapes and offsets\); pass a smaller `capacity`\.",
  ):
    ops.sequence_expand(x, y, 0)


def test_host_only_ints_keep_the_int64_range():
  """Segment ids are read on the host only: int64 ids and padding id stay."""
  x = LoDTensor.from_segment_ids(
    np.arange(3.0), np.array([2**40, 2**40, 2**41]), padding_id=2**41
  )
  assert x.recursive_lengths() == [[2]]


@pytest.mark.parametrize(
  "call, name",
  [
    (lambda x, i: ops.sequence_erase(i, [7], capacity=2**31), "capacity"),
    (lambda x, i: ops.sequence_expand(np.ones(2), x, capacity=2**31), "capacity"),
    (lambda x, i: ops.sequence_expand_as(np.ones(2), x, capacity=2**31), "capacity"),
    (lambda x, i: ops.sequence_concat([x, x], capacity=2**31), "capacity"),
    (lambda x, i: ops.sequence_enumerate(i, 2, capacity=2**31), "capacity"),
    (lambda x, i: ops.sequence_reshape(x, 2**31), "new_dim"),
    (lambda x, i: x.to_padded(time_capacity=2**31), "time_capacity"),
    (lambda x, i: ops.sequence_pad(x, 0.0, maxlen=2**31), "maxlen"),
    (lambda x, i: ops.shrink_memory(np.ones(2), ops.rank_table(x), 2**31, 1), "step"),
    (lambda x, i: ops.default_ladder(8, minimum=2**31), "minimum"),
    (lambda x, i: ops.rank_table(x, ladder=[2**31]), "ladder\\[0\\]"),
  ],
)
def test_static_ints_beyond_int32_name_the_argument(call, name):
  x = LoDTensor.from_lengths(np.ones((4, 2), np.float32), [[3, 1]])
  ids = LoDTensor.from_lengths(np.array([7, 2, 7, 4, 9], np.int32), [[3, 2]])
  with pytest.raises(ValueError, match=rf"`{name}` .*2147483648"):
    call(x, ids)


def test_require_each_names_the_first_bad_item():
  message = "item {i}: value {value} is negative"
  _checks.require_each(np.array([False, False]), message, value=np.array([1, 2]))
  _checks.require_each(np.zeros((0,), bool), message)
  with pytest.raises(ValueError, match="item 1: value -2 is negative"):
    _checks.require_each(
      np.array([False, True, True]), message, value=np.array([1, -2, -3])
    )

  def f(v):
    _checks.require_each(v < 0, message, value=v)
    return v

  err, _ = checkify.checkify(jax.jit(f))(jnp.array([1, -2, -3]))
  with pytest.raises(checkify.JaxRuntimeError, match="item 1: value -2 is negative"):
    err.throw()


def _throw(f, *args):
  err, _ = checkify.checkify(jax.jit(f))(*args)
  err.throw()


def test_require_formats_fields_eagerly_and_under_jit():
  message = "{n} rows, more than {limit}; got {rows}"
  _checks.require(np.int32(3) <= 4, message, n=3, limit=4, rows=np.arange(2))
  with pytest.raises(ValueError, match=r"^5 rows, more than 4; got \[0, 1\]$"):
    _checks.require(np.int32(5) <= 4, message, n=np.int32(5), limit=4, rows=[0, 1])

  def f(n):
    _checks.require(n <= 4, "{n} rows, more than 4", n=n)
    return n

  with pytest.raises(checkify.JaxRuntimeError, match="5 rows, more than 4"):
    _throw(f, jnp.int32(5))
  _throw(f, jnp.int32(4))


def test_require_traced_message():
  def f(n):
    _checks.require(n <= 4, "{n} rows, more than 4", traced="too many rows", n=n)
    return n

  with pytest.raises(ValueError, match="^5 rows, more than 4$"):
    f(jnp.int32(5))
  with pytest.raises(checkify.JaxRuntimeError, match="too many rows"):
    _throw(f, jnp.int32(5))


def test_require_each_traced_message_and_scalar_values():
  message = "item {i}: value {value} is past {limit}"

  def f(v, limit):
    _checks.require_each(
      v > limit, message, traced="a value is past", value=v, limit=limit
    )
    return v

  with pytest.raises(ValueError, match="item 2: value 7 is past 5"):
    f(np.array([1, 2, 7, 9]), 5)
  with pytest.raises(checkify.JaxRuntimeError, match="a value is past"):
    _throw(f, jnp.array([1, 2, 7, 9]), jnp.int32(5))
  _throw(f, jnp.array([1, 2]), jnp.int32(5))


def test_check_lengths_fit():
  lengths = jnp.array([3, 0, 5])
  check_lengths_fit(lengths, 5, "op")
  with pytest.raises(
    ValueError,
    match=r"op: the longest sequence has 5 rows, more than `maxlen` 4; data is "
    r"never truncated\.",
  ):
    check_lengths_fit(lengths, 4, "op", "`maxlen`")

  def f(lengths):
    check_lengths_fit(lengths, 4, "op")
    return lengths

  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"op: a sequence is longer than the requested time capacity 4",
  ):
    _throw(f, lengths)


def test_check_fits_names_the_size():
  real = Capacity(tokens=6, sequences=(3,), time=(5,))
  check_fits(real, Capacity(6, (3,), (5,)), "op")
  with pytest.raises(
    ValueError,
    match=r"op: the output needs time \(longest sequence\) at level 0 5, more than "
    r"its capacity 4",
  ):
    check_fits(real, Capacity(6, (3,), (4,)), "op")


def test_check_offsets_is_paddles_check_lod():
  assert [o.tolist() for o in check_offsets([[0, 2], [0, 1, 3]], 3)] == [
    [0, 2],
    [0, 1, 3],
  ]
  with pytest.raises(ValueError, match=r"LoD level 1, index 2: offsets must be"):
    check_offsets([[0, 2], [0, 3, 1]], 1)
  with pytest.raises(ValueError, match=r"must equal the number of rows of `values`"):
    check_offsets([[0, 2]], 3)
  with pytest.raises(ValueError, match=r"Expected integer offsets at LoD level 0"):
    check_integer_level("offsets", 0, [0.0, 1.5])


def test_pool_and_pad_value_checks():
  assert check_pool_type("MAX") == "max"
  with pytest.raises(ValueError, match=r"`pool_type` to be one of 'sum'"):
    check_pool_type("median")
  with pytest.raises(TypeError, match=r"`pool_type` to be a str"):
    check_pool_type(1)
  with pytest.raises(TypeError, match=r"float dtype for pool_type 'sum'"):
    check_pool_dtype(np.int32, "sum")
  check_pool_dtype(np.int32, "last")
  x = _x().with_values(jnp.zeros((8, 2)))
  assert check_pad_value(1.0, x).tolist() == [1.0, 1.0]
  with pytest.raises(ValueError, match=r"broadcast to the feature shape \(2,\)"):
    check_pad_value(jnp.zeros(3), x)


def test_check_pair_and_ranked():
  x = _x()
  table = rank_table(x)
  check_pair(x, table, "x")
  with pytest.raises(TypeError, match="Expected `table` to be a RankTable"):
    check_pair(x, None, "x")
  buckets = Buckets.fixed(tokens=8, sequences=4, time=5)
  other = LoDTensor.from_lengths(np.arange(6.0), [[4, 0, 2]], buckets=buckets)
  with pytest.raises(ValueError, match=r"does not describe `x`'s last level"):
    check_pair(other, table, "x")


def test_check_rows_and_step_out():
  assert is_lod(_x()) and not is_lod(np.zeros(3))
  check_rows({"h": jnp.zeros((4, 2))}, 4, "init_carry")
  with pytest.raises(
    ValueError,
    match=r"`init_carry` leaf \['h'\] to have leading dimension 4 \(count "
    r"capacity\), got shape \(3, 2\)\.",
  ):
    check_rows({"h": jnp.zeros((3, 2))}, 4, "init_carry")
  carry = jnp.zeros((2, 3))
  assert _checks.check_step_out((carry, carry), carry, 2)[0] is carry
  with pytest.raises(TypeError, match="to return a pair"):
    _checks.check_step_out(carry, carry, 2)
  with pytest.raises(ValueError, match=r"keep carry leaf \(root\) as float32\[2, 3\]"):
    _checks.check_step_out((carry[:, :1], carry), carry, 2)
  with pytest.raises(ValueError, match=r"output leaf \(root\) to have leading"):
    _checks.check_step_out((carry, carry[:1]), carry, 2)


def test_a_bool_among_batch_sizes_or_sort_indices_raises():
  with pytest.raises(TypeError, match=r"`batch_sizes` to hold ints, got the bool True"):
    check_batch_sizes([2, True], 3)
  with pytest.raises(TypeError, match=r"`sorted_indices` to hold ints, got the bool"):
    check_sort_indices([1, False], None, 2)


@given(st.floats(min_value=0.0, max_value=1e30, allow_subnormal=True))
def test_cosine_eps_is_refused_or_gives_finite_scores_and_gradients(eps):
  """`eps` 0 or below float32's smallest normal gave NaN at padding slots."""
  memory = ops.lod_memory(LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[2, 1]]))
  query = jnp.ones((2, 2))
  if eps < np.finfo(np.float32).tiny:
    with pytest.raises(ValueError, match=r"Expected `eps` > 0 and at least"):
      ops.cosine_scores(query, memory, eps)
    return
  scores = jax.jit(ops.cosine_scores, static_argnums=2)(query, memory, eps)
  grads = jax.grad(lambda q: ops.cosine_scores(q, memory, eps).sum())(query)
  assert np.all(np.isfinite(scores)) and np.all(np.isfinite(grads))


@pytest.mark.parametrize("value", [1e300, -1e300, float("inf"), float("nan")])
def test_finite_float32_names_the_argument(value):
  with pytest.raises(ValueError, match=r"Expected `alpha` to be finite in float32"):
    _checks.finite_float32(value, "alpha")


# -- expand_rows and where_rows: a mask over the leading axes ----------------------


@pytest.mark.parametrize(
  ("shape", "ndim", "expected"),
  [((3,), 3, (3, 1, 1)), ((2, 3), 4, (2, 3, 1, 1)), ((4,), 1, (4,)), ((), 2, (1, 1))],
)
def test_expand_rows_appends_unit_axes(shape, ndim, expected):
  assert _checks.expand_rows(np.ones(shape, bool), ndim).shape == expected


def test_where_rows_takes_whole_rows_and_keeps_nan_of_dropped_rows_out():
  new = jnp.array([[1.0, 2.0], [jnp.nan, jnp.inf], [5.0, 6.0]])
  old = jnp.array([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]])
  mask = jnp.array([True, False, True])
  assert _checks.where_rows(mask, new, old).tolist() == [[1, 2], [-3, -4], [5, 6]]
  assert _checks.where_rows(mask, new, 0).tolist() == [[1, 2], [0, 0], [5, 6]]

  def loss(new):
    return jnp.sum(_checks.where_rows(mask, new, old) * 2.0)

  # The gradient of a dropped row is zero, not NaN, though its value is.
  assert jax.grad(loss)(new).tolist() == [[2, 2], [0, 0], [2, 2]]


def test_where_rows_masks_leading_axes_of_time_major_outputs():
  new = jnp.arange(24.0).reshape(3, 2, 4)  # [time, batch, features]
  mask = jnp.arange(3)[:, None] < jnp.array([1, 3])[None]  # [time, batch]
  out = _checks.where_rows(mask, new, 0)
  expected = np.where(np.asarray(mask)[..., None], np.asarray(new), 0)
  np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32, jnp.float64, jnp.bool_])
def test_where_rows_keeps_the_dtype_of_new_for_a_python_scalar(dtype):
  with jax.enable_x64(True):
    new = jnp.ones((2, 3), dtype)
    out = _checks.where_rows(jnp.array([True, False]), new, 0)
    assert out.dtype == dtype
    assert out.tolist() == [[1, 1, 1], [0, 0, 0]]
