"""Host values cast to a dtype keep their value or are refused: the `dtype` of
`LoDTensor.from_sequences` (NumPy's `astype` would wrap 300 to 44 in int8),
the sequences' inferred dtype, and float64 rows that JAX stores as float32."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod import Buckets, LoDTensor
from jaxlod._host import as_array
from jaxlod.data import Batcher

INT64 = np.iinfo(np.int64)
UINT64 = np.iinfo(np.uint64)
# The integer dtypes JAX stores as they are with x64 off.
INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32"]


def test_an_int_out_of_range_of_dtype_is_refused():
  """The issue's reproduction: int8 wrapped 300 to 44."""
  assert np.array([300]).astype(np.int8).tolist() == [44]  # NumPy's cast wraps
  with pytest.raises(
    ValueError,
    match=r"Expected every value of `seqs` to survive the cast to `dtype` int8 "
    r"\(an integer in \[-128, 127\]\), got 300 at `seqs\[0\]\[0\]`\.",
  ):
    LoDTensor.from_sequences([[300, 1]], dtype=np.int8)


# seqs, dtype, what the dtype holds (a regex) and the value and place refused.
CHANGED = {
  "negative into unsigned": (
    [[1, 2], [3, -1]],
    "uint8",
    r"an integer in \[0, 255\]",
    r"-1 at `seqs\[1\]\[1\]`",
  ),
  "fraction into int": ([[1.0, 1.5]], "int32", r"an integer in \[", r"1\.5 at"),
  "nan into int": ([[np.nan]], "int32", r"an integer in \[", r"nan at"),
  "inf into int": ([[-np.inf]], "int16", r"an integer in \[", r"-inf at"),
  "float beyond int32": ([[2.0**31]], "int32", r"2147483647\]", r"2147483648\.0 at"),
  "2 into bool": ([[0, 1, 2]], "bool", r"0, 1 or a bool", r"2 at `seqs\[0\]\[2\]`"),
  "fraction into bool": ([[0.5]], "bool", r"0, 1 or a bool", r"0\.5 at"),
  "int4": ([[7, 8]], "int4", r"an integer in \[-8, 7\]", r"8 at `seqs\[0\]\[1\]`"),
  "imaginary part": (
    [np.array([1 + 0j, 1 + 1j])],
    "float32",
    r"a real number: the cast drops the imaginary part",
    r"\(1\+1j\) at `seqs\[0\]\[1\]`",
  ),
  "finite into float16 inf": (
    [[1.0, -1e5]],
    "float16",
    r"finite values up to 65504 in magnitude; a larger one would become -inf",
    r"-100000\.0 at `seqs\[0\]\[1\]`",
  ),
  "int into float16 inf": ([[70000]], "float16", r"65504", r"70000 at"),
  "finite into bfloat16 inf": ([[1e39]], "bfloat16", r"3\.38953e\+38", r"1e\+39 at"),
  "finite into float8 nan": (
    [[500.0]],
    "float8_e4m3fn",
    r"up to 448 in magnitude; a larger one would become nan",
    r"500\.0 at",
  ),
  "two levels": (
    [[[1, 2]], [[3], [4, 5, 300]]],
    "int8",
    r"an integer in \[-128, 127\]",
    r"300 at `seqs\[1\]\[1\]\[2\]`",
  ),
  "a row of features": (
    [np.array([[1, 2], [3, 256]])],
    "uint8",
    r"an integer in \[0, 255\]",
    r"256 at `seqs\[0\]\[1\]\[1\]`",
  ),
}


@pytest.mark.parametrize("case", sorted(CHANGED))
def test_a_value_the_cast_would_change_is_refused(case):
  seqs, dtype, holds, got = CHANGED[case]
  with pytest.raises(
    ValueError,
    match=rf"Expected every value of `seqs` to survive the cast to `dtype` "
    rf"{dtype} \([^)]*{holds}.*\), got {got}",
  ):
    LoDTensor.from_sequences(seqs, dtype=dtype)


# seqs, dtype and the values stored: a float rounds to its nearest value.
KEPT = {
  "float64 rounds to float16": ([[0.1, 1 / 3]], "float16", [0.1, 1 / 3]),
  "a tiny float underflows to 0": ([[1e-10]], "float16", [0.0]),
  "nan and inf stay": ([[np.nan, np.inf, -np.inf]], "float16", None),
  "a large int rounds in float32": ([[2**24 + 1]], "float32", [2.0**24]),
  "an integral float into int": ([[3.0, -128.0]], "int8", [3, -128]),
  "bools into int": ([np.array([True, False])], "int32", [1, 0]),
  "0 and 1 into bool": ([[0, 1.0]], "bool", [0.0, 1.0]),
  "a real complex into float": ([np.array([2 + 0j])], "float32", [2.0]),
  "float16 max": ([[65504.0, -65504.0]], "float16", [65504.0, -65504.0]),
  "into bfloat16": ([[1e38]], "bfloat16", [float(jnp.bfloat16(1e38))]),
}


@pytest.mark.parametrize("case", sorted(KEPT))
def test_a_cast_that_only_rounds_is_kept(case):
  seqs, dtype, stored = KEPT[case]
  x = LoDTensor.from_sequences(seqs, dtype=dtype)
  assert x.values.dtype == jnp.dtype(dtype)
  rows = np.real(np.concatenate([np.asarray(s) for s in seqs]))  # drops 0j only
  expected = rows.astype(jnp.dtype(dtype))
  np.testing.assert_array_equal(np.asarray(x.values), expected)
  if stored is not None:
    assert np.asarray(x.values, np.float64).tolist() == pytest.approx(stored, rel=1e-3)


@settings(max_examples=60)
@given(
  st.sampled_from(INT_DTYPES),
  st.lists(st.integers(INT64.min, INT64.max), min_size=1, max_size=5),
)
def test_integers_cast_to_an_int_dtype_are_kept_exactly_or_refused(dtype, ints):
  info = np.iinfo(dtype)
  outside = [i for i, v in enumerate(ints) if not info.min <= v <= info.max]
  if not outside:
    x = LoDTensor.from_sequences([ints], dtype=dtype)
    assert x.values.dtype == np.dtype(dtype)
    assert np.asarray(x.values).tolist() == ints
    return
  i = outside[0]
  with pytest.raises(
    ValueError,
    match=rf"cast to `dtype` {dtype} \(an integer in \[{info.min}, {info.max}\]\), "
    rf"got {ints[i]} at `seqs\[0\]\[{i}\]`\.",
  ):
    LoDTensor.from_sequences([ints], dtype=dtype)


@settings(max_examples=60)
@given(
  st.sampled_from([*INT_DTYPES, "int64", "uint64"]),
  st.lists(
    st.one_of(
      st.floats(allow_nan=True, allow_infinity=True),
      st.integers(-(2**64), 2**64).map(float),
    ),
    min_size=1,
    max_size=5,
  ),
)
def test_floats_cast_to_an_int_dtype_are_kept_exactly_or_refused(dtype, floats):
  info = np.iinfo(dtype)

  def exact(v):
    return math.isfinite(v) and v == int(v) and info.min <= int(v) <= info.max

  outside = [i for i, v in enumerate(floats) if not exact(v)]
  with jax.enable_x64(True):  # int64 and uint64 stored as they are
    if not outside:
      x = LoDTensor.from_sequences([floats], dtype=dtype)
      assert x.values.dtype == np.dtype(dtype)
      assert np.asarray(x.values).tolist() == [int(v) for v in floats]
      return
    i = outside[0]
    with pytest.raises(
      ValueError,
      match=rf"cast to `dtype` {dtype} \(an integer in \[{info.min}, {info.max}\]\), "
      rf"got {re_float(floats[i])} at `seqs\[0\]\[{i}\]`\.",
    ):
      LoDTensor.from_sequences([floats], dtype=dtype)


def re_float(value: float) -> str:
  """`value` as the message prints it, escaped for a regex."""
  return re.escape(str(value))


@settings(max_examples=60)
@given(st.lists(st.integers(INT64.min, INT64.max), min_size=1, max_size=5))
def test_int64_values_into_int64_need_x64_to_be_stored(ints):
  """dtype int64 is kept on the host; with x64 off JAX stores int32, and
  `values` beyond it are refused by the builder (as for any int64 rows)."""
  with jax.enable_x64(True):
    x = LoDTensor.from_sequences([ints], dtype=np.int64)
    assert np.asarray(x.values).tolist() == ints
  if all(np.iinfo(np.int32).min <= v <= np.iinfo(np.int32).max for v in ints):
    assert (
      np.asarray(LoDTensor.from_sequences([ints], dtype="int64").values).tolist()
      == ints
    )
  else:
    with pytest.raises(ValueError, match=r"Expected `values` to fit int32"):
      LoDTensor.from_sequences([ints], dtype=np.int64)


def test_uint64_max_is_refused_by_int64():
  with pytest.raises(
    ValueError,
    match=rf"int64 \(an integer in \[{INT64.min}, {INT64.max}\]\), got "
    rf"{UINT64.max} at `seqs\[1\]\[0\]`",
  ):
    LoDTensor.from_sequences([[1], [UINT64.max]], dtype=np.int64)


def test_signed_and_uint64_sequences_are_not_promoted_to_float():
  """NumPy promotes int64 with uint64 to float64: 2**64 - 1 would round."""
  assert np.result_type(np.int64, np.uint64) == np.float64
  with pytest.raises(
    TypeError,
    match=r"Expected the integer sequences of `seqs` to promote to an integer "
    r"dtype, got int64 at `seqs\[0\]` and uint64 at `seqs\[1\]`, which NumPy "
    r"promotes to float64 \(rounding integers beyond 2\*\*53\); pass `dtype`",
  ):
    LoDTensor.from_sequences([[-1], [UINT64.max]])
  with jax.enable_x64(True):
    x = LoDTensor.from_sequences([[1], [UINT64.max]], dtype=np.uint64)
    assert np.asarray(x.values).tolist() == [1, UINT64.max]


def test_bools_with_uint64_still_promote_to_an_integer():
  x = LoDTensor.from_sequences([np.array([True]), np.array([5], np.uint32)])
  assert np.asarray(x.values).tolist() == [1, 5]


@pytest.mark.parametrize("dtype", [str, object, "U3"])
def test_a_dtype_that_is_not_a_number_is_refused(dtype):
  with pytest.raises(
    TypeError, match=r"Expected `dtype` to be a number or bool dtype, got "
  ):
    LoDTensor.from_sequences([[1, 2]], dtype=dtype)


def test_a_dtype_given_by_name_is_understood():
  x = LoDTensor.from_sequences([[1.5, 2]], dtype="bfloat16")
  assert x.values.dtype == jnp.bfloat16


# -- float64 rows that JAX stores as float32 (x64 off) -----------------------------


@pytest.mark.parametrize(
  "build, name, at",
  [
    (lambda v: LoDTensor.from_lengths(v, [[2]]), "values", r"\(1,\)"),
    (lambda v: LoDTensor.from_offsets(v, [[0, 2]]), "values", r"\(1,\)"),
    (lambda v: LoDTensor.from_padded(v[None], [2]), "padded", r"\(0, 1\)"),
    (lambda v: LoDTensor.from_sequences([v]), "values", r"\(1,\)"),
    (
      lambda v: LoDTensor.from_sequences([v], dtype=np.float64),
      "values",
      r"\(1,\)",
    ),
  ],
)
def test_float64_rows_beyond_float32_are_refused(build, name, at):
  rows = np.array([1.0, -1e300])
  with pytest.raises(
    ValueError,
    match=rf"Expected `{name}` to fit float32 \(the dtype JAX stores it in with "
    rf"jax_enable_x64 off\), got -1e\+300 at index {at}; enable x64 or use "
    r"smaller values\.",
  ):
    build(rows)
  with jax.enable_x64(True):
    assert np.asarray(build(rows).values).tolist()[:2] == [1.0, -1e300]


def test_float64_rows_that_only_round_in_float32_are_kept():
  rows = np.array([0.1, np.nan, np.inf, 1e-300, 3e38])
  x = LoDTensor.from_lengths(rows, [[5]])
  np.testing.assert_array_equal(np.asarray(x.values), rows.astype(np.float32))


def test_complex128_rows_beyond_complex64_are_refused():
  with pytest.raises(
    ValueError, match=r"`values` to fit complex64 .* got \(1\+1e\+300j\) at index"
  ):
    LoDTensor.from_lengths(np.array([1 + 1e300j]), [[1]])


# -- uint64 integers beyond int64 (the host checks' dtype) -------------------------


def test_uint64_segment_ids_beyond_int64_are_refused():
  """int64 would read 2**64 - 1 as -1: the padding row (id 2**64 - 1) became
  a sequence."""
  ids = np.array([1, 1, UINT64.max], np.uint64)
  with pytest.raises(
    ValueError,
    match=rf"Expected `segment_ids` to fit int64, got {UINT64.max} at index \(2,\)\.",
  ):
    LoDTensor.from_segment_ids(np.arange(3.0), ids, padding_id=int(UINT64.max))


@pytest.mark.parametrize(
  "build, name",
  [
    (
      lambda v: LoDTensor.from_lengths(np.zeros(2), [np.array([3, v], np.uint64)]),
      r"lengths at LoD level 0 .* \(1,\)\. Check `recursive_lengths`\.",
    ),
    (
      lambda v: LoDTensor.from_offsets(np.zeros(2), [np.array([0, v, 2], np.uint64)]),
      r"offsets at LoD level 0 .* \(1,\)\. Check `offsets`\.",
    ),
  ],
)
def test_uint64_levels_beyond_int64_are_refused(build, name):
  """int64 would read 2**64 - 1 as -1: "length -1 is negative"."""
  with pytest.raises(ValueError, match=rf"Expected {name}") as info:
    build(UINT64.max)
  assert f"to fit int64, got {UINT64.max} at index (1,)." in str(info.value)


@pytest.mark.parametrize(
  ("build", "name"),
  [
    (
      lambda rows: LoDTensor.from_lengths(np.ones(2), [[2]]).with_values(rows),
      "values",
    ),
    (
      lambda rows: next(
        Batcher(
          [(rows,)], Buckets.fixed(tokens=4, sequences=2, time=2), shuffle=False
        ).iterate()
      ),
      "examples[0][0]",
    ),
    (lambda rows: as_array(rows, "x"), "x"),
  ],
  ids=["with_values", "Batcher", "as_array"],
)
def test_every_host_array_keeps_its_floats_or_is_refused(build, name):
  """The builders' check of float64 rows holds wherever host floats enter:
  1e300 would become inf in float32 with x64 off."""
  with pytest.raises(ValueError, match=rf"`{re.escape(name)}` to fit float32.*1e\+300"):
    build(np.array([1e300, 1.0]))
  build(np.array([1e30, 1.0]))  # rounds, and is kept
