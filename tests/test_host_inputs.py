"""Host inputs never lose data: integers that JAX would wrap, generators read
twice, empty integer sequences, strings and objects are caught at the boundary
with a message naming the argument."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlod import LoDTensor, ops
from jaxlod.ops import sequence_erase, sequence_mask, sequence_slice

INT32 = np.iinfo(np.int32)
INT64 = np.iinfo(np.int64)
WIDE = 2**32 + 5  # int32 would keep 5


@given(st.lists(st.integers(INT64.min, INT64.max), min_size=1, max_size=6))
def test_integer_values_are_stored_exactly_or_refused(ints):
  values = np.asarray(ints, np.int64)
  fits = bool(np.all((values >= INT32.min) & (values <= INT32.max)))
  if fits:
    x = LoDTensor.from_lengths(values, [[len(ints)]])
    assert np.asarray(x.values).tolist() == ints
  else:
    with pytest.raises(ValueError, match=r"Expected `values` to fit int32"):
      LoDTensor.from_lengths(values, [[len(ints)]])
  with jax.enable_x64(True):
    x = LoDTensor.from_lengths(values, [[len(ints)]])
    assert np.asarray(x.values).tolist() == ints


@given(
  st.lists(st.integers(0, 5), min_size=1, max_size=6),
  st.data(),
)
def test_a_bool_among_numbers_is_refused_where_it_stands(lengths, data):
  """NumPy reads ``[True, 4]`` as ``[1, 4]``: every host array argument
  refuses a bool among numbers, naming the argument and the place."""
  at = data.draw(st.integers(0, len(lengths) - 1))
  mixed = [*lengths[:at], data.draw(st.booleans()), *lengths[at + 1 :]]
  if all(isinstance(v, bool) for v in mixed):
    return  # an array of bools, refused by its dtype
  calls = [
    ("lengths", lambda: sequence_mask(mixed, maxlen=6)),
    ("lengths", lambda: ops.sequence_unpad(np.ones((len(mixed), 6)), mixed)),
    ("values", lambda: LoDTensor.from_lengths(mixed, [[len(mixed)]])),
  ]
  for name, call in calls:
    with pytest.raises(
      TypeError, match=rf"`{name}` to hold numbers, got the bool .* at `{name}\[{at}\]`"
    ):
      call()


def test_from_sequences_refuses_wide_python_ints():
  with pytest.raises(ValueError, match=r"`values` to fit int32 .* got 1099511627783"):
    LoDTensor.from_sequences([[2**40 + 7, 1]])


def test_lengths_whose_sum_wraps_are_refused():
  with pytest.raises(
    ValueError, match=r"LoD level 0: the lengths sum to 1383505805528"
  ):
    LoDTensor.from_lengths(np.zeros(3), [[2**62, 2**62, 2**62]])
  with pytest.raises(ValueError, match=r"over the int32 offsets' limit 2147483647"):
    LoDTensor.from_lengths(np.zeros(3), [[2**31, 0, 0]])


@pytest.mark.parametrize(
  "values, dtype",
  [(np.array(["a", "b"]), "<U1"), (np.array([1, None], dtype=object), "object")],
)
def test_strings_and_objects_are_refused(values, dtype):
  with pytest.raises(TypeError, match=rf"`values` to hold numbers, got dtype {dtype}"):
    LoDTensor.from_lengths(values, [[2]])
  with pytest.raises(TypeError, match=r"`values` to hold numbers"):
    LoDTensor.from_sequences([values])


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int4", "bool"])
def test_numbers_numpy_files_as_void_are_accepted(dtype):
  """ml_dtypes arrays (NumPy's kind 'V') are numbers to JAX."""
  values = np.ones((3, 2), jax.numpy.dtype(dtype))
  x = LoDTensor.from_lengths(values, [[2, 1]])
  assert x.values.dtype == jax.numpy.dtype(dtype)
  y = LoDTensor.from_sequences([values[:2], values[2:]])
  assert y.values.dtype == x.values.dtype


def test_from_sequences_reads_a_generator_once():
  seqs = [np.ones((2, 3)), np.zeros((0, 3)), np.full((1, 3), 2.0)]
  x = LoDTensor.from_sequences(s for s in seqs)
  assert x.recursive_lengths() == [[2, 0, 1]]
  np.testing.assert_array_equal(x.values, LoDTensor.from_sequences(seqs).values)


def test_from_sequences_refuses_a_non_iterable():
  with pytest.raises(TypeError, match=r"`seqs` to be a list of sequences, got int"):
    LoDTensor.from_sequences(5)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.bool_])
def test_all_empty_sequences_keep_their_dtype(dtype):
  x = LoDTensor.from_sequences([np.zeros((0,), dtype), np.zeros((0,), dtype)])
  assert x.values.dtype == np.dtype(dtype)
  assert x.recursive_lengths() == [[0, 0]]


def test_erase_tokens_that_would_wrap_are_refused():
  x = LoDTensor.from_lengths(np.arange(5), [[3, 2]])
  with pytest.raises(ValueError, match=r"`tokens\[0\]` to fit int32"):
    sequence_erase(x, [2**40 + 1])
  with pytest.raises(ValueError, match=r"`tokens` to fit int32 .* at index \(0,\)"):
    sequence_erase(x, np.array([2**40 + 1]))
  with pytest.raises(ValueError, match=r"`tokens\[0\]` to fit int64, got"):
    sequence_erase(x, [2**70])


def test_slice_offsets_that_would_wrap_are_refused():
  x = LoDTensor.from_lengths(np.arange(5.0), [[3, 2]])
  with pytest.raises(ValueError, match=r"`offset` to fit int32"):
    sequence_slice(x, np.array([2**40, 0]), np.array([1, 1]))
  # int32 values whose sum wraps: the range check must not overflow.
  with pytest.raises(
    ValueError, match=r"sequence 0 has length 3, got offset 2147483647"
  ):
    sequence_slice(x, np.array([INT32.max, 0]), np.array([5, 1]))


def test_mask_lengths_that_would_wrap_are_refused():
  with pytest.raises(ValueError, match=r"`lengths` to fit int32"):
    sequence_mask(np.array([2**33]), maxlen=4)


# -- the ops' array inputs: host integers beyond int32 ------------------------------


def _x():
  return LoDTensor.from_lengths(np.arange(5.0), [[3, 0, 2]])


# op(wide) for a host array `wide`, the argument's name and the bad index.
WIDE_INPUTS = {
  "sequence_expand": (lambda v: ops.sequence_expand(v, _x()), "x", [WIDE, 6, 7]),
  "sequence_expand_as": (
    lambda v: ops.sequence_expand_as(v, _x()),
    "x",
    [WIDE, 6, 7],
  ),
  "sequence_unpad": (
    lambda v: ops.sequence_unpad(v, np.array([2])),
    "padded",
    [[WIDE, 2]],
  ),
  "reorder_by_rank": (
    lambda v: ops.reorder_by_rank(v, ops.rank_table(_x())),
    "x",
    [WIDE, 6, 7],
  ),
  "shrink_memory": (
    lambda v: ops.shrink_memory(v, ops.rank_table(_x()), 0, 2),
    "memory",
    [WIDE, 6, 7],
  ),
  "lod_reset": (lambda v: ops.lod_reset(v, [[2]]), "x", [WIDE, 1]),
  "sequence_scatter": (
    lambda v: ops.sequence_scatter(
      v,
      LoDTensor.from_lengths(np.array([0, 1]), [[1, 1]]),
      LoDTensor.from_lengths(np.ones(2, np.int32), [[1, 1]]),
    ),
    "x",
    [[WIDE, 1], [2, 3]],
  ),
  "with_values": (lambda v: _x().with_values(v), "values", [WIDE, 1, 2, 3, 4]),
  "from_padded": (
    lambda v: LoDTensor.from_padded(v, np.array([2])),
    "padded",
    [[WIDE, 2]],
  ),
}


PYTREES = {"reorder_by_rank", "shrink_memory"}  # their inputs are pytrees of arrays


@pytest.mark.parametrize("host", [np.array, list], ids=["numpy", "list"])
@pytest.mark.parametrize("op", sorted(WIDE_INPUTS))
def test_host_integers_beyond_int32_are_refused_by_the_ops(op, host):
  call, name, value = WIDE_INPUTS[op]
  at = r" at index \(0, 0\)" if isinstance(value[0], list) else r" at index \(0,\)"
  if host is list and op in PYTREES:  # a list is a pytree of scalar leaves
    name, at = rf"{name}\[0\]", ""
  match = rf"Expected `{name}` to fit int32 .* got {WIDE}{at}"
  with pytest.raises(ValueError, match=match):
    call(host(value))


def test_a_pytree_names_the_leaf_that_would_wrap():
  table = ops.rank_table(_x())
  memory = {"c": np.zeros(3, np.int32), "h": np.array([1, 2, WIDE])}
  with pytest.raises(
    ValueError, match=rf"`memory\['h'\]` to fit int32 .* got {WIDE} at index \(2,\)"
  ):
    ops.shrink_memory(memory, table, 0, 2)
  with pytest.raises(ValueError, match=r"`x\['h'\]` to fit int32"):
    ops.reorder_by_rank(memory, table)


def test_traced_and_device_inputs_are_not_read():
  """Under jit the values are JAX's already (stored as int32): nothing to check."""
  x = _x()
  expand = jax.jit(lambda v: ops.sequence_expand_as(v, x).values)
  assert expand(jnp.array([5, 6, 7])).tolist() == [5, 5, 5, 7, 7]
  assert ops.reorder_by_rank(jnp.array([5, 6, 7]), ops.rank_table(x)).tolist() == [
    5,
    7,
    6,
  ]


@given(st.lists(st.integers(INT64.min, INT64.max), min_size=3, max_size=3))
def test_per_sequence_rows_are_kept_exactly_or_refused(ints):
  table = ops.rank_table(_x())
  rows = np.asarray(ints, np.int64)
  if np.all((rows >= INT32.min) & (rows <= INT32.max)):
    out = ops.reorder_by_rank(rows, table)
    assert np.asarray(out).tolist() == [ints[i] for i in np.asarray(table.order)]
  else:
    with pytest.raises(ValueError, match=r"Expected `x` to fit int32"):
      ops.reorder_by_rank(rows, table)


# -- pad values of integer rows ---------------------------------------------------


def _ids(dtype=np.int32):
  return LoDTensor.from_lengths(np.array([7, 2, 7, 4, 9], dtype), [[3, 2]])


PADS = {
  "to_padded": lambda x, pad: x.to_padded(pad_value=pad),
  "sequence_pad": lambda x, pad: ops.sequence_pad(x, pad),
  "sequence_enumerate": lambda x, pad: ops.sequence_enumerate(x, 2, pad),
  "sequence_pool_first": lambda x, pad: ops.sequence_pool(
    LoDTensor.from_lengths(np.asarray(x.values), [[3, 0, 2]]), "first", pad
  ),
}
INT32_RANGE = r"an integer in \[-2147483648, 2147483647\]"


@pytest.mark.parametrize(
  "pad, got",
  [
    (2.5, "2.5"),
    (np.nan, "nan"),
    (-np.inf, "-inf"),
    (np.int64(2**40), "1099511627776"),
    (WIDE, str(WIDE)),
    (np.array(2.5, np.float32), "2.5"),
    (jnp.float32(0.5), "0.5"),
  ],
)
@pytest.mark.parametrize("op", sorted(PADS))
def test_pad_values_int_rows_cannot_hold_are_refused(op, pad, got):
  with pytest.raises(
    ValueError,
    match=rf"Expected `pad_value` to be {INT32_RANGE} \(exactly representable in "
    rf"the values' dtype int32\), got {got}\.",
  ):
    PADS[op](_ids(), pad)


@pytest.mark.parametrize("op", sorted(PADS))
def test_integral_pad_values_are_kept(op):
  """A float without a fraction is exact; an int beyond int32 fits uint32."""
  PADS[op](_ids(), 2.0)
  big = PADS[op](_ids(np.uint32), 2**32 - 1)
  values = big[0] if isinstance(big, tuple) else getattr(big, "values", big)
  assert 2**32 - 1 in np.asarray(values).reshape(-1).tolist()


def test_negative_pad_values_for_unsigned_rows_are_refused():
  x = LoDTensor.from_lengths(np.array([1, 2, 3], np.uint8), [[2, 1]])
  with pytest.raises(
    ValueError,
    match=r"`pad_value` to be an integer in \[0, 255\] \(exactly representable in "
    r"the values' dtype uint8\), got -1\.",
  ):
    x.to_padded(pad_value=-1)
  with pytest.raises(ValueError, match=r"`pad_value` to be 0, 1 or a bool .* got 2"):
    LoDTensor.from_lengths(np.array([True, False]), [[2]]).to_padded(pad_value=2)


def test_traced_pad_values_of_int_rows_must_be_integers():
  pad = jax.jit(lambda x, p: x.to_padded(pad_value=p)[0])
  assert pad(_ids(), jnp.int32(-3))[1].tolist() == [4, 9, -3]
  with pytest.raises(
    TypeError,
    match=r"`pad_value` to have an integer dtype under jit \(the values' dtype is "
    r"int32; a traced value cannot be checked\), got float32\.",
  ):
    pad(_ids(), jnp.float32(-3.0))


def test_float_rows_take_any_pad_value():
  x = LoDTensor.from_lengths(np.ones(3, np.float32), [[2, 1]])
  assert np.isnan(x.to_padded(pad_value=np.nan)[0][1, 1])
  assert x.to_padded(pad_value=np.int64(2**40))[0][1, 1] == 2.0**40


INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.bool_]


@given(
  st.sampled_from(INT_DTYPES),
  st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-300.0, 300.0).map(lambda f: round(f * 2) / 2),  # halves
  ),
)
def test_int_pad_values_are_kept_exactly_or_refused(dtype, pad):
  x = LoDTensor.from_lengths(np.zeros(3, dtype), [[2, 1]])
  info = np.iinfo(np.uint8 if dtype == np.bool_ else dtype)
  low, high = (0, 1) if dtype == np.bool_ else (int(info.min), int(info.max))
  exact = math.isfinite(pad) and pad == int(pad) and low <= int(pad) <= high
  if exact:
    padded, _ = x.to_padded(pad_value=pad)
    assert np.asarray(padded)[1, 1].item() == (bool(pad) if dtype == np.bool_ else pad)
  else:
    name = np.dtype(dtype).name
    with pytest.raises(ValueError, match=rf"`pad_value` to be .* dtype {name}"):
      x.to_padded(pad_value=pad)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("pad", [1j, np.complex64(2 + 0j), np.array([1j])])
@pytest.mark.parametrize("op", sorted(PADS))
def test_complex_pad_values_of_real_rows_are_refused(op, pad, jit):
  """A cast dropped the imaginary part (a ComplexWarning at most)."""
  x = LoDTensor.from_lengths(np.array([7.0, 2, 7, 4, 9], np.float32), [[3, 2]])
  if op == "sequence_enumerate":  # int ids only
    x = _ids(np.int32)
  call = jax.jit(lambda p: PADS[op](x, p)) if jit else lambda p: PADS[op](x, p)
  with pytest.raises(
    TypeError,
    match=r"Expected `pad_value` to be a real number for values of dtype \w+ "
    r"\(the imaginary part would be dropped\), got complex",
  ):
    call(jnp.asarray(pad) if jit else pad)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("pad", [True, np.bool_(False), np.array([True])])
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float32])
@pytest.mark.parametrize("op", sorted(PADS))
def test_bool_pad_values_of_number_rows_are_refused(op, dtype, pad, jit):
  """NumPy reads True as 1: int ids were padded with 1."""
  if op == "sequence_enumerate" and dtype == np.float32:
    pytest.skip("sequence_enumerate takes int ids only")
  x = _ids(dtype)
  call = jax.jit(lambda p: PADS[op](x, p)) if jit else lambda p: PADS[op](x, p)
  name = np.dtype(dtype).name
  with pytest.raises(
    TypeError,
    match=rf"Expected `pad_value` to be a number for values of dtype {name} \(a "
    r"bool would pad with 0 or 1\), got bool\.",
  ):
    call(jnp.asarray(pad) if jit else pad)


def test_bool_rows_take_bool_pad_values():
  x = LoDTensor.from_lengths(np.array([True, False, True]), [[2, 1]])
  assert x.to_padded(pad_value=True)[0].tolist() == [[True, False], [True, True]]
  assert ops.sequence_pad(x, np.bool_(False))[0].dtype == np.bool_
