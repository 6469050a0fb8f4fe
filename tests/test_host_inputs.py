"""Host inputs never lose data: integers that JAX would wrap, generators read
twice, empty integer sequences, strings and objects are caught at the boundary
with a message naming the argument."""

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
