"""Tests of `LoDTensor`: builders, validation, padding, accessors, round trips."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

from jaxlod import Buckets, Capacity, LoDTensor
from tests.helpers import (
  FEATURES,
  ONE_LEVEL,
  TWO_LEVEL,
  assert_close,
  assert_lod_equal,
  assert_nested_equal,
  lod_tensors,
  recursive_lengths,
)

# -- builders -------------------------------------------------------------------


def test_from_lengths_one_level():
  values = np.arange(12.0, dtype=np.float32).reshape(6, 2)
  x = LoDTensor.from_lengths(values, [[2, 0, 4]])
  assert x.num_levels == 1
  assert x.capacity == Capacity(tokens=6, sequences=(3,), time=(4,))
  assert x.feature_shape == (2,)
  assert x.values.dtype == jnp.float32
  assert [o.tolist() for o in x.offsets] == [[0, 2, 2, 6]]
  assert x.offsets[0].dtype == jnp.int32
  assert x.lengths().tolist() == [2, 0, 4]
  assert x.recursive_lengths() == [[2, 0, 4]]
  assert int(x.num_sequences()) == 3
  assert int(x.num_rows) == 6
  assert_nested_equal(x.to_list(), [values[:2], values[2:2], values[2:]])


def test_from_lengths_two_levels():
  values = np.arange(9.0, dtype=np.float32)
  x = LoDTensor.from_lengths(values, [[2, 1], [3, 2, 4]])
  assert x.num_levels == 2
  assert [o.tolist() for o in x.offsets] == [[0, 2, 3], [0, 3, 5, 9]]
  assert x.lengths(0).tolist() == [2, 1]
  assert x.lengths(1).tolist() == [3, 2, 4]
  assert x.lengths(-1).tolist() == [3, 2, 4]
  assert x.lengths(-2).tolist() == [2, 1]
  assert x.capacity == Capacity(tokens=9, sequences=(2, 3), time=(2, 4))
  assert int(x.num_sequences(0)) == 2
  assert int(x.num_sequences(1)) == 3
  # Every level argument defaults to the last level.
  assert int(x.num_sequences()) == 3
  assert x.lengths().tolist() == [3, 2, 4]
  assert_nested_equal(x.to_list(), [[values[:3], values[3:5]], [values[5:]]])


def test_from_offsets_matches_from_lengths():
  values = np.random.default_rng(0).normal(size=(9, 3)).astype(np.float32)
  buckets = Buckets.pow2(minimum=4)
  a = LoDTensor.from_offsets(values, [[0, 2, 3], [0, 3, 5, 9]], buckets=buckets)
  b = LoDTensor.from_lengths(values, [[2, 1], [3, 2, 4]], buckets=buckets)
  assert_lod_equal(a, b)
  assert a.recursive_lengths() == [[2, 1], [3, 2, 4]]


def test_from_offsets_accepts_numpy_and_jax_offsets():
  values = np.ones((4, 1), np.float32)
  a = LoDTensor.from_offsets(values, [np.array([0, 1, 4], np.int64)])
  b = LoDTensor.from_offsets(values, [jnp.array([0, 1, 4], jnp.int32)])
  assert_lod_equal(a, b)
  assert a.recursive_lengths() == [[1, 3]]


def test_zero_length_sequences_at_every_level():
  values = np.arange(3.0, dtype=np.float32)
  x = LoDTensor.from_lengths(values, [[2, 0, 1, 0], [0, 3, 0]])
  assert [o.tolist() for o in x.offsets] == [[0, 2, 2, 3, 3], [0, 0, 3, 3]]
  assert x.recursive_lengths() == [[2, 0, 1, 0], [0, 3, 0]]
  empty = values[:0]
  assert_nested_equal(x.to_list(), [[empty, values], [], [empty], []])


@pytest.mark.parametrize(
  "lengths",
  [[[]], [[0]], [[0, 0, 0]], [[0, 0], []], [[2], [0, 0]]],
  ids=["no-sequences", "one-empty", "three-empty", "empty-outer", "empty-inner"],
)
def test_all_empty(lengths):
  x = LoDTensor.from_lengths(np.zeros((0, 2), np.float32), lengths)
  assert x.recursive_lengths() == lengths
  assert x.capacity.tokens == 0
  assert int(x.num_rows) == 0
  padded, padded_lengths = x.to_padded()
  assert padded.shape == (len(lengths[-1]), 0, 2)
  assert padded_lengths.tolist() == lengths[-1]


def test_padding_sequences_are_empty_and_padding_rows_zero():
  values = np.arange(1.0, 11.0, dtype=np.float32).reshape(5, 2)
  buckets = Buckets.fixed(tokens=8, sequences=(4, 6), time=(5, 7))
  x = LoDTensor.from_lengths(values, [[1, 2], [2, 0, 3]], buckets=buckets)
  assert x.capacity == Capacity(tokens=8, sequences=(4, 6), time=(5, 7))
  assert [o.tolist() for o in x.offsets] == [[0, 1, 3, 3, 3], [0, 2, 2, 5, 5, 5, 5]]
  np.testing.assert_array_equal(np.asarray(x.values)[:5], values)
  np.testing.assert_array_equal(np.asarray(x.values)[5:], np.zeros((3, 2)))
  assert x.lengths(0).tolist() == [1, 2, 0, 0]
  assert x.lengths(1).tolist() == [2, 0, 3, 0, 0, 0]
  assert int(x.num_outer) == 2
  # Host views show the real sequences only.
  assert x.recursive_lengths() == [[1, 2], [2, 0, 3]]
  assert_nested_equal(x.to_list(), [[values[:2]], [values[2:2], values[2:]]])


def test_pow2_buckets_capacity():
  x = LoDTensor.from_sequences([np.ones(3), np.ones(5)], buckets=Buckets.pow2())
  assert x.capacity == Capacity(tokens=8, sequences=(8,), time=(8,))
  y = LoDTensor.from_sequences([np.ones(9)], buckets=Buckets.pow2(minimum=2))
  assert y.capacity == Capacity(tokens=16, sequences=(2,), time=(16,))


def test_from_sequences_one_level():
  seqs = [np.ones((2, 3)), np.zeros((0, 3)), np.full((1, 3), 2.0)]
  x = LoDTensor.from_sequences(seqs, dtype=np.float32)
  assert x.recursive_lengths() == [[2, 0, 1]]
  assert x.values.dtype == jnp.float32
  assert x.feature_shape == (3,)
  assert_nested_equal(x.to_list(), [s.astype(np.float32) for s in seqs])


def test_from_sequences_lists_of_numbers():
  x = LoDTensor.from_sequences([[1, 2, 3], [4]])
  assert x.num_levels == 1
  assert x.recursive_lengths() == [[3, 1]]
  assert x.values.tolist() == [1, 2, 3, 4]
  assert jnp.issubdtype(x.values.dtype, jnp.integer)


def test_from_sequences_two_levels():
  a, b, c = np.ones((2, 2)), np.zeros((3, 2)), np.full((1, 2), 5.0)
  x = LoDTensor.from_sequences([[a, b], [], [c]], dtype=np.float32)
  assert x.num_levels == 2
  assert x.recursive_lengths() == [[2, 0, 1], [2, 3, 1]]
  assert_nested_equal(x.to_list(), [[a, b], [], [c]])


def test_from_sequences_dtype_is_inferred_and_overridable():
  assert LoDTensor.from_sequences([np.ones(2, np.float32)]).values.dtype == jnp.float32
  x = LoDTensor.from_sequences([np.arange(3)], dtype=np.float32)
  assert x.values.dtype == jnp.float32
  assert LoDTensor.from_sequences([]).values.dtype == jnp.float32


def test_from_sequences_empty_feature_shape_from_nonempty_sequences():
  # An empty sequence's feature shape does not have to match.
  x = LoDTensor.from_sequences([np.zeros((0,)), np.ones((2, 3))], dtype=np.float32)
  assert x.feature_shape == (3,)
  assert x.recursive_lengths() == [[0, 2]]


def test_from_sequences_buckets():
  buckets = Buckets.fixed(tokens=10, sequences=(3, 5), time=(4, 6))
  x = LoDTensor.from_sequences(
    [[np.ones(2)], [np.ones(3), np.ones(1)]], buckets=buckets
  )
  assert x.capacity == Capacity(tokens=10, sequences=(3, 5), time=(4, 6))


def test_from_padded():
  padded = np.arange(24.0, dtype=np.float32).reshape(3, 4, 2)
  x = LoDTensor.from_padded(padded, [2, 0, 4])
  assert x.recursive_lengths() == [[2, 0, 4]]
  assert_nested_equal(x.to_list(), [padded[0, :2], padded[1, :0], padded[2]])
  y = LoDTensor.from_padded(padded, np.array([1, 1, 1]), buckets=Buckets.pow2(4))
  assert y.capacity == Capacity(tokens=4, sequences=(4,), time=(4,))
  assert_nested_equal(y.to_list(), [padded[0, :1], padded[1, :1], padded[2, :1]])


def test_to_padded():
  values = np.arange(1.0, 7.0, dtype=np.float32).reshape(3, 2)
  buckets = Buckets.fixed(tokens=4, sequences=4, time=3)
  x = LoDTensor.from_lengths(values, [[2, 0, 1]], buckets=buckets)
  padded, lengths = x.to_padded(pad_value=-1)
  assert padded.shape == (4, 3, 2)
  assert padded.dtype == jnp.float32
  assert lengths.tolist() == [2, 0, 1, 0]
  expected = np.full((4, 3, 2), -1.0, np.float32)
  expected[0, :2] = values[:2]
  expected[2, :1] = values[2:]
  np.testing.assert_array_equal(padded, expected)
  default, _ = x.to_padded()
  np.testing.assert_array_equal(default, np.where(expected == -1, 0, expected))


@pytest.mark.parametrize("time_capacity", [2, 3, 6])
def test_to_padded_time_capacity(time_capacity):
  values = np.arange(1.0, 4.0, dtype=np.float32)
  x = LoDTensor.from_lengths(values, [[2, 1]], buckets=Buckets.pow2(minimum=4))
  padded, lengths = jax.jit(lambda x: x.to_padded(time_capacity=time_capacity))(x)
  assert padded.shape == (4, time_capacity)
  assert lengths.tolist() == [2, 1, 0, 0]
  np.testing.assert_array_equal(padded[:2, :2], [[1, 2], [3, 0]])
  np.testing.assert_array_equal(padded[:, 2:], 0)
  np.testing.assert_array_equal(padded[2:], 0)


def test_to_padded_too_small_time_capacity_eager():
  x = LoDTensor.from_lengths(np.ones(5, np.float32), [[3, 2]])
  with pytest.raises(
    ValueError,
    match=r"to_padded\(time_capacity=\.\.\.\): the longest sequence has 3 rows, "
    r"more than the requested time capacity 2; data is never truncated\.",
  ):
    x.to_padded(time_capacity=2)


def test_to_padded_too_small_time_capacity_checkify():
  x = LoDTensor.from_lengths(np.ones(5, np.float32), [[3, 2]])
  checked = checkify.checkify(jax.jit(lambda x: x.to_padded(time_capacity=2)))
  err, _ = checked(x)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"to_padded\(time_capacity=\.\.\.\): a sequence is longer than the "
    r"requested time capacity 2; data is never truncated\.",
  ):
    err.throw()
  # The same function on data that fits passes the check.
  err, (padded, _) = checked(LoDTensor.from_lengths(np.ones(4, np.float32), [[2, 2]]))
  err.throw()
  assert padded.shape == (2, 2)


def test_lengths_is_jittable():
  buckets = Buckets.fixed(tokens=8, sequences=(3, 4), time=(3, 5))
  x = LoDTensor.from_lengths(
    np.ones(6, np.float32), [[1, 2], [5, 0, 1]], buckets=buckets
  )
  lengths = jax.jit(lambda x: (x.lengths(), x.lengths(0), x.num_rows))(x)
  assert lengths[0].tolist() == [5, 0, 1, 0]
  assert lengths[1].tolist() == [1, 2, 0]
  assert int(lengths[2]) == 6
  assert lengths[0].dtype == jnp.int32


def test_host_only_views_fail_under_jit():
  x = LoDTensor.from_lengths(np.ones(3, np.float32), [[1, 2]])
  match = r"This method reads data on the host; it cannot run under jit\."
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda x: len(x.recursive_lengths()))(x)
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda x: len(x.to_list()))(x)


def test_level_out_of_range():
  x = LoDTensor.from_lengths(np.ones(3, np.float32), [[1], [3]])
  levels = r"Expected `level` in \[-2, 2\) \(the LoD levels of the tensor\)"
  with pytest.raises(ValueError, match=rf"{levels}, got 2\."):
    x.lengths(2)
  with pytest.raises(ValueError, match=rf"{levels}, got -3\."):
    x.num_sequences(-3)


def test_with_values():
  x = LoDTensor.from_lengths(np.ones(3, np.float32), [[1, 2]], buckets=Buckets.pow2(4))
  y = x.with_values(jnp.arange(8.0).reshape(4, 2))
  assert y.feature_shape == (2,)
  assert y.offsets is x.offsets
  assert y.capacity == Capacity(tokens=4, sequences=(4,), time=(4,))
  with pytest.raises(
    ValueError,
    match=r"Expected `values` to have leading dimension 4 \(token capacity\), got "
    r"shape \(3, 2\)\.",
  ):
    x.with_values(jnp.zeros((3, 2)))


def test_repr():
  x = LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[1, 2]])
  assert repr(x) == (
    "LoDTensor(values=float32[3, 2], lod=[[1, 2]], "
    "capacity=Capacity(tokens=3, sequences=(2,), time=(2,)))"
  )
  seen = []
  jax.jit(lambda x: seen.append(repr(x)))(x)
  # Under jit the LoD is data: the repr leaves it out instead of failing.
  assert seen == [
    "LoDTensor(values=float32[3, 2], "
    "capacity=Capacity(tokens=3, sequences=(2,), time=(2,)))"
  ]


# -- the pytree ----------------------------------------------------------------------


def test_pytree_structure():
  buckets = Buckets.fixed(tokens=8, sequences=(3, 4), time=(2, 5))
  x = LoDTensor.from_lengths(
    np.ones(6, np.float32), [[1, 2], [5, 0, 1]], buckets=buckets
  )
  leaves, treedef = jax.tree.flatten(x)
  assert len(leaves) == 5  # values, two offsets, num_outer, faults
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(x)]
  assert paths == [".values", ".offsets[0]", ".offsets[1]", ".num_outer", ".faults"]
  y = jax.tree.unflatten(treedef, leaves)
  assert_lod_equal(y, x)
  # The time capacity is static: it is part of the treedef.
  other = LoDTensor.from_lengths(
    np.ones(6, np.float32),
    [[1, 2], [5, 0, 1]],
    buckets=Buckets.fixed(tokens=8, sequences=(3, 4), time=(2, 6)),
  )
  assert jax.tree.structure(other) != treedef


def test_jit_identity_and_tree_map():
  x = LoDTensor.from_lengths(
    np.arange(5.0, dtype=np.float32), [[2, 3]], buckets=Buckets.pow2(4)
  )
  assert_lod_equal(jax.jit(lambda x: x)(x), x)
  doubled = jax.tree.map(lambda a: a * 2, x)
  np.testing.assert_array_equal(doubled.values, np.asarray(x.values) * 2)


def test_frozen_dataclass_with_identity_equality():
  x = LoDTensor.from_lengths(np.ones(3, np.float32), [[1, 2]])
  assert dataclasses.is_dataclass(x)
  names = [f.name for f in dataclasses.fields(x)]
  assert names == ["values", "offsets", "num_outer", "time_capacity", "faults"]
  with pytest.raises(dataclasses.FrozenInstanceError):
    x.values = x.values * 2
  y = jax.tree.map(lambda a: a, x)
  assert x == x and x != y  # identity: arrays are never compared
  assert {x: 1}[x] == 1
  z = dataclasses.replace(x, values=x.values * 2)
  assert z.values.tolist() == [2.0, 2.0, 2.0] and z.offsets is x.offsets


def test_constructor_stores_tuples():
  x = LoDTensor(jnp.zeros(3), [jnp.array([0, 3])], jnp.int32(1), [np.int64(3)])
  assert isinstance(x.offsets, tuple) and x.time_capacity == (3,)
  assert type(x.time_capacity[0]) is int
  assert jax.tree.structure(x) == jax.tree.structure(
    LoDTensor(jnp.ones(3), (jnp.array([0, 3]),), jnp.int32(1), (3,))
  )


def test_transformations_rebuild_it_with_other_leaves():
  x = LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[1, 2]])
  # Shards stacked on a leading axis (the Batcher's and jaxlod.parallel's form).
  stacked = jax.tree.map(lambda *a: np.stack(a), x, x, x)
  assert stacked.offsets[0].shape == (3, 3) and stacked.values.shape == (3, 3, 2)
  counts = jax.vmap(lambda x: x.segment_ids())(stacked)
  assert counts.tolist() == [[0, 1, 1]] * 3
  assert jax.eval_shape(lambda x: x, x).values.shape == (3, 2)
  assert jax.tree.map(lambda a: None, x).values is None
  spec = jax.vmap(lambda x: x.values, in_axes=(0,))(stacked)
  assert spec.shape == (3, 3, 2)


def test_row_mask_and_segment_ids():
  buckets = Buckets.fixed(tokens=8, sequences=(3, 4), time=(2, 5))
  x = LoDTensor.from_lengths(
    np.ones(6, np.float32), [[1, 2], [5, 0, 1]], buckets=buckets
  )

  @jax.jit
  def both(x):
    return x.row_mask(), x.segment_ids()

  mask, ids = both(x)
  assert mask.dtype == jnp.bool_ and mask.tolist() == [True] * 6 + [False] * 2
  assert ids.dtype == jnp.int32 and ids.tolist() == [0, 0, 0, 0, 0, 2, 4, 4]
  sums = jax.ops.segment_sum(jnp.arange(8.0), ids, num_segments=4)
  assert sums.tolist() == [10.0, 0.0, 5.0, 0.0]  # padding rows dropped
  empty = LoDTensor.from_lengths(
    np.ones(0, np.float32), [[]], buckets=Buckets.fixed(tokens=2, sequences=0, time=0)
  )
  assert empty.row_mask().tolist() == [False, False]
  assert empty.segment_ids().tolist() == [0, 0]


# -- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
  ("rows", "offsets", "match"),
  [
    (3, [[1, 3]], r"LoD level 0, index 0: offsets must start at 0, got 1\."),
    (
      3,
      [[0, 2], [2, 3, 3]],
      r"LoD level 1, index 0: offsets must start at 0, got 2\.",
    ),
    (
      3,
      [[0, 2, 1, 3]],
      r"LoD level 0, index 2: offsets must be non-decreasing, got 2 at index 1 "
      r"then 1\.",
    ),
    (
      5,
      [[0, 1, 2], [0, 3, 2, 5]],
      r"LoD level 1, index 2: offsets must be non-decreasing, got 3 at index 1 "
      r"then 2\.",
    ),
    (
      3,
      [[0, 1, 3], [0, 1, 3]],
      r"LoD level 0: last offset 3 must equal the number of sequences at level "
      r"1, which is 2\.",
    ),
    (
      4,
      [[0, 3]],
      r"LoD level 0 \(last\): last offset 3 must equal the number of rows of "
      r"`values`, which is 4\.",
    ),
    (
      2,
      [[0, 1], [0, 3]],
      r"LoD level 1 \(last\): last offset 3 must equal the number of rows of "
      r"`values`, which is 2\.",
    ),
    (3, [], r"Expected at least one LoD level, got none\."),
    (3, [[]], r"LoD level 0 has no offsets; expected at least \[0\]\."),
    (
      3,
      [[[0, 3]]],
      r"Expected LoD level 0 \(offsets\) to be 1-D, got shape \(1, 2\)\.",
    ),
    (
      3,
      [[0, 3], ["0", "3"]],
      r"Expected integer offsets at LoD level 1, got dtype <U1 \(index 0: "
      r"np\.str_\('0'\)\)\.",
    ),
    (
      3,
      [np.array([False, True])],
      r"Expected integer offsets at LoD level 0, got dtype bool",
    ),
  ],
)
def test_from_offsets_errors(rows, offsets, match):
  with pytest.raises(ValueError, match=match):
    LoDTensor.from_offsets(np.zeros(rows, np.float32), offsets)


@pytest.mark.parametrize(
  ("rows", "lengths", "match"),
  [
    (3, [[2, -1, 2]], r"LoD level 0, index 1: length -1 is negative\."),
    (3, [[1, 1], [1, 3, -1]], r"LoD level 1, index 2: length -1 is negative\."),
    (
      3,
      [[2, 2], [1, 2]],
      r"LoD level 0: last offset 4 must equal the number of sequences at level "
      r"1, which is 2\.",
    ),
    (
      4,
      [[1, 2]],
      r"LoD level 0 \(last\): last offset 3 must equal the number of rows of "
      r"`values`, which is 4\.",
    ),
    (3, [], r"Expected at least one LoD level, got none\."),
    (
      3,
      [[1, 2], [1.0, 2.0]],
      r"Expected integer lengths at LoD level 1, got dtype float64 \(index 0: "
      r"np\.float64\(1\.0\)\)\.",
    ),
    (
      3,
      [[1.0, 1.5, 0.5]],
      r"Expected integer lengths at LoD level 0, got dtype float64 \(index 1: "
      r"np\.float64\(1\.5\)\)\.",
    ),
  ],
  ids=[
    "negative",
    "negative-level-1",
    "level-sum",
    "rows",
    "no-levels",
    "integral-floats",
    "fractional-floats",
  ],
)
def test_from_lengths_errors(rows, lengths, match):
  with pytest.raises(ValueError, match=match):
    LoDTensor.from_lengths(np.zeros(rows, np.float32), lengths)


@pytest.mark.parametrize("build", ["from_lengths", "from_offsets"])
def test_scalar_values_error(build):
  with pytest.raises(
    ValueError,
    match=r"Expected `values` to have rank >= 1 \(\[rows, \*features\]\), got a "
    r"scalar of dtype float32\.",
  ):
    getattr(LoDTensor, build)(np.float32(1.0), [[0]])


@pytest.mark.parametrize(
  ("seqs", "error", "match"),
  [
    (
      [np.ones((2, 3)), np.ones((1, 2))],
      ValueError,
      r"Expected every sequence to have the same feature shape, got "
      r"\[\(2,\), \(3,\)\]: `seqs\[1\]` has \(2,\), `seqs\[0\]` \(3,\)\.",
    ),
    (
      [np.ones(2), np.float32(1.0)],
      ValueError,
      r"Expected sequence 1 to have rank >= 1 \(\[length, \*features\]\), got a "
      r"scalar\.",
    ),
    (
      [[np.ones(2)], np.ones(3)],
      ValueError,
      r"Expected item 1 of a two-level `seqs` to be a list of sequences, got "
      r"ndarray\.",
    ),
    (
      np.ones((2, 3)),
      TypeError,
      r"Expected `seqs` to be a list of sequences, got an array; use "
      r"`from_padded` or `from_lengths` for arrays\.",
    ),
  ],
)
def test_from_sequences_errors(seqs, error, match):
  with pytest.raises(error, match=match):
    LoDTensor.from_sequences(seqs)


@pytest.mark.parametrize(
  ("padded", "lengths", "match"),
  [
    (
      np.ones(3),
      [3],
      r"Expected `padded` to have rank >= 2 \(\[count, time, \*features\]\), got "
      r"shape \(3,\)\.",
    ),
    (
      np.ones((2, 3)),
      [1, 1, 1],
      r"Expected `lengths` to have shape \(2,\) \(one per sequence of `padded`\), "
      r"got \(3,\)\.",
    ),
    (
      np.ones((2, 3)),
      [1, 4],
      r"LoD level 0, index 1: length 4 is outside \[0, 3\] \(the time dimension "
      r"of `padded`\)\.",
    ),
    (
      np.ones((2, 3)),
      [-1, 1],
      r"LoD level 0, index 0: length -1 is outside \[0, 3\]",
    ),
    (
      np.ones((2, 3)),
      [1.5, 1],
      r"Expected integer lengths at LoD level 0, got dtype float64",
    ),
  ],
)
def test_from_padded_errors(padded, lengths, match):
  with pytest.raises(ValueError, match=match):
    LoDTensor.from_padded(padded, lengths)


@pytest.mark.parametrize(
  ("args", "match"),
  [
    (
      (jnp.zeros(3), [], jnp.int32(0), []),
      r"Expected at least one LoD level, got none\.",
    ),
    (
      (jnp.zeros(3), [jnp.array([0, 3])], jnp.int32(1), [3, 3]),
      r"Expected one time capacity per level \(1\), got \(3, 3\)\.",
    ),
    (
      (jnp.float32(0), [jnp.array([0])], jnp.int32(0), [0]),
      r"Expected `values` to have rank >= 1 \(\[rows, \*features\]\), got a scalar\.",
    ),
    (
      (jnp.zeros(3), [jnp.array([[0, 3]])], jnp.int32(1), [3]),
      r"Expected offsets of level 0 to have shape \[count_capacity \+ 1\], got "
      r"\(1, 2\)\.",
    ),
  ],
)
def test_low_level_constructor_errors(args, match):
  with pytest.raises(ValueError, match=match):
    LoDTensor(*args)


# -- round trips (hypothesis) --------------------------------------------------------


@settings(max_examples=40)
@given(lengths=recursive_lengths(), seed=st.integers(0, 2**16))
def test_from_lengths_offsets_and_host_views_agree(lengths, seed):
  rng = np.random.default_rng(seed)
  values = rng.normal(size=(sum(lengths[-1]), FEATURES)).astype(np.float32)
  x = LoDTensor.from_lengths(values, lengths)
  assert x.recursive_lengths() == lengths
  y = LoDTensor.from_offsets(values, [np.cumsum([0, *lv]) for lv in lengths])
  assert_lod_equal(y, x)
  # to_list splits `values` at the offsets.
  flat = x.to_list() if len(lengths) == 1 else [s for g in x.to_list() for s in g]
  assert [s.shape[0] for s in flat] == lengths[-1]
  if flat:
    np.testing.assert_array_equal(np.concatenate(flat), values)


_SLACK = st.sampled_from([0, 1, 3])


@settings(max_examples=30)
@given(
  lengths=recursive_lengths(),
  slack=st.tuples(_SLACK, _SLACK, _SLACK, _SLACK, _SLACK),
)
def test_random_fixed_capacities(lengths, slack):
  # Capacities larger than the data: padding only, never a change of content.
  values = np.arange(sum(lengths[-1]), dtype=np.float32) + 1
  sequences = [len(lv) + s for lv, s in zip(lengths, slack[1:3], strict=False)]
  time = [max(lv, default=0) + s for lv, s in zip(lengths, slack[3:], strict=False)]
  buckets = Buckets.fixed(tokens=values.size + slack[0], sequences=sequences, time=time)
  x = LoDTensor.from_lengths(values, lengths, buckets=buckets)
  exact = LoDTensor.from_lengths(values, lengths)
  assert x.capacity == Capacity(values.size + slack[0], tuple(sequences), tuple(time))
  assert x.recursive_lengths() == lengths
  assert_nested_equal(x.to_list(), exact.to_list())
  for level, o in enumerate(x.offsets):
    o = np.asarray(o)
    real = len(lengths[level])
    np.testing.assert_array_equal(o[: real + 1], np.cumsum([0, *lengths[level]]))
    np.testing.assert_array_equal(o[real:], o[real])  # padding sequences are empty
  np.testing.assert_array_equal(np.asarray(x.values)[values.size :], 0)


def _from_sequences_round_trips(x: LoDTensor) -> bool:
  # `to_list` of a batch without sequences at the last level is `[]` or
  # `[[], ...]`: it holds neither the feature shape nor the number of levels
  # (`[[], []]` reads as one level of two empty 1-D sequences).
  return (
    any(x.recursive_lengths()[0])
    if x.num_levels == 2
    else x.recursive_lengths() != [[]]
  )


@settings(max_examples=40)
@given(x=lod_tensors())
def test_from_sequences_round_trip(x):
  assume(_from_sequences_round_trips(x))
  buckets = ONE_LEVEL if x.num_levels == 1 else TWO_LEVEL
  y = LoDTensor.from_sequences(x.to_list(), buckets=buckets)
  assert y.recursive_lengths() == x.recursive_lengths()
  assert_lod_equal(y, x)


_to_padded = jax.jit(lambda x: x.to_padded())


# Exact capacities compile to_padded once per shape: few examples.
@settings(max_examples=8)
@given(x=lod_tensors(num_levels=1, buckets=Buckets.exact()))
def test_from_padded_round_trip_exact(x):
  padded, lengths = x.to_padded()
  y = LoDTensor.from_padded(padded, lengths)
  assert y.recursive_lengths() == x.recursive_lengths()
  assert_nested_equal(y.to_list(), x.to_list())
  assert_lod_equal(y, x)


@settings(max_examples=30)
@given(x=lod_tensors())
def test_from_padded_round_trip_bucketed(x):
  # to_padded gives every sequence slot of the last level, so the padding
  # slots come back as real empty sequences after the real ones.
  padded, lengths = _to_padded(x)
  capacity = x.capacity.sequences[-1]
  assert padded.shape == (capacity, x.time_capacity[-1], FEATURES)
  y = LoDTensor.from_padded(padded, lengths)
  real = x.recursive_lengths()[-1]
  assert y.recursive_lengths() == [real + [0] * (capacity - len(real))]
  flat = x.to_list() if x.num_levels == 1 else [s for g in x.to_list() for s in g]
  assert_nested_equal(y.to_list()[: len(real)], flat)
  # Cells past each sequence's end hold the pad value.
  mask = np.arange(padded.shape[1])[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_array_equal(np.asarray(padded)[~mask], 0)


@settings(max_examples=20)
@given(x=lod_tensors())
def test_jit_lengths_match_host(x):
  lengths = jax.jit(lambda x: [x.lengths(level) for level in range(x.num_levels)])(x)
  for level, host in enumerate(x.recursive_lengths()):
    got = np.asarray(lengths[level])
    assert got[: len(host)].tolist() == host
    np.testing.assert_array_equal(got[len(host) :], 0)


def test_to_padded_pad_value_under_jit():
  x = LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[1, 2]])
  padded, _ = jax.jit(lambda x: x.to_padded(pad_value=-5.0))(x)
  assert_close(padded[0, 1], np.full(2, -5.0))
  assert_close(padded[1], np.ones((2, 2)))


def test_a_tree_map_that_casts_the_offsets_raises():
  """The LoD is integer data: a float tree map over a batch must not corrupt
  it silently; `astype` casts only the rows."""
  x = LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[2, 1]])
  match = r"Expected integer offsets of level 0, got bfloat16"
  with pytest.raises(TypeError, match=match):
    jax.tree.map(lambda a: a.astype(jnp.bfloat16), x)
  y = x.astype(jnp.bfloat16)
  assert y.values.dtype == jnp.bfloat16
  assert y.recursive_lengths() == x.recursive_lengths()
  # Integer tree maps and autodiff's float0 cotangents keep working.
  assert jax.tree.map(jnp.zeros_like, x).offsets[0].dtype == jnp.int32
  grad = jax.grad(lambda x: jnp.sum(x.values), allow_int=True)(x)
  assert grad.offsets[0].dtype == jax.dtypes.float0


# -- Python values at the builders: bools, ragged rows, flat levels -----------------


@settings(max_examples=30, deadline=None)
@given(
  lengths=st.lists(st.integers(0, 3), min_size=1, max_size=5),
  data=st.data(),
)
def test_a_bool_among_lengths_or_offsets_raises_naming_the_argument(lengths, data):
  # NumPy reads [True, 4] as [1, 4]: a bool anywhere in a level is refused.
  i = data.draw(st.integers(0, len(lengths) - 1))
  offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
  rows = np.ones(offsets[-1], np.float32)
  flag = data.draw(st.booleans())
  lengths[i] = flag
  with pytest.raises(TypeError, match=rf"got the bool {flag} at index {i}\. Check "):
    LoDTensor.from_lengths(rows, [lengths])
  offsets[i] = flag
  with pytest.raises(TypeError, match=r"Check `offsets`"):
    LoDTensor.from_offsets(rows, [offsets])
  with pytest.raises(TypeError, match=r"Check `row_splits`"):
    LoDTensor.from_row_splits(rows, offsets)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 3), max_size=5))
def test_one_level_of_row_splits_in_any_container_is_the_same_tensor(lengths):
  splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  rows = np.arange(splits[-1], dtype=np.float32)
  forms = [
    splits,
    [splits],
    splits.tolist(),
    tuple(splits.tolist()),
    (int(s) for s in splits),
    [np.int64(s) for s in splits],
    [[int(s) for s in splits]],
  ]
  for form in forms:
    x = LoDTensor.from_row_splits(rows, form)
    assert x.recursive_lengths() == [lengths]
    np.testing.assert_array_equal(x.row_splits()[0], splits)


def test_a_generator_level_is_read_once():
  rows = np.ones(5)
  x = LoDTensor.from_lengths(rows, [(n for n in (2, 3))])
  y = LoDTensor.from_offsets(rows, [(n for n in (0, 2, 5))])
  assert x.recursive_lengths() == y.recursive_lengths() == [[2, 3]]


@pytest.mark.parametrize(
  ("build", "error", "match"),
  [
    (
      lambda: LoDTensor.from_lengths(np.ones(5), [2, 3]),
      ValueError,
      r"LoD level 0 \(lengths\) to be a 1-D sequence of ints, got the scalar 2; "
      r"pass one sequence per level, e.g. \[\[2, 1\]\]\. Check `recursive_lengths`",
    ),
    (
      lambda: LoDTensor.from_offsets(np.ones(5), [[0, [2], 5]]),
      ValueError,
      r"LoD level 0 \(offsets\) to be 1-D, got items of different shapes\. Check "
      r"`offsets`",
    ),
    (
      lambda: LoDTensor.from_lengths([[1, 2], [3]], [[2]]),
      ValueError,
      r"Expected `values` to be a rectangular array of numbers \(\[rows, "
      r"\*features\]\), got ragged rows: `values\[1\]` has shape \(1,\), "
      r"`values\[0\]` \(2,\)\.",
    ),
    (
      lambda: LoDTensor.from_offsets([[[1], [2]], [[3]]], [[0, 2]]),
      ValueError,
      r"`values\[1\]` has shape \(1, 1\), `values\[0\]` \(2, 1\)",
    ),
    (
      lambda: LoDTensor.from_sequences([[[[1, 2], [3]]]]),
      ValueError,
      r"Expected `seqs\[0\]\[0\]` to be a rectangular array .* `seqs\[0\]\[0\]\[1\]` "
      r"has shape \(1,\)",
    ),
    (
      lambda: LoDTensor.from_sequences(
        [np.ones((2, 2)), np.ones((0, 3)), np.ones((1, 3))]
      ),
      ValueError,
      r"same feature shape, got \[\(2,\), \(3,\)\]: `seqs\[2\]` has \(3,\), "
      r"`seqs\[0\]` \(2,\)\.",
    ),
  ],
)
def test_scalar_levels_and_ragged_rows_raise_naming_the_argument(build, error, match):
  with pytest.raises(error, match=match):
    build()


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    (
      {"segment_ids": [1, True, 2]},
      r"Expected `segment_ids` to hold ints, got the bool True at index 1\.",
    ),
    (
      {"segment_ids": [1, 1, 2], "positions": [0, True, 0]},
      r"Expected `positions` to hold ints, got the bool True at index 1\.",
    ),
  ],
)
def test_a_bool_among_segment_ids_or_positions_raises(kwargs, match):
  # [1, True, 2] would read as [1, 1, 2]: two sequences, not three.
  with pytest.raises(TypeError, match=match):
    LoDTensor.from_segment_ids(np.ones(3), **kwargs)


def test_to_padded_too_small_time_capacity_under_plain_jit_is_nan():
  """Under plain `jit` the cut sequence comes back all NaN, the others as
  they are; int values come back as they are (checked eagerly or under
  checkify)."""
  x = LoDTensor.from_lengths(np.arange(5.0, dtype=np.float32), [[3, 2]])
  padded, lengths = jax.jit(lambda x: x.to_padded(time_capacity=2))(x)
  assert np.isnan(np.asarray(padded[0])).all()
  np.testing.assert_array_equal(padded[1], [3, 4])
  assert lengths.tolist() == [3, 2]
  ids = LoDTensor.from_lengths(np.arange(5, dtype=np.int32), [[3, 2]])
  padded, _ = jax.jit(lambda x: x.to_padded(time_capacity=2))(ids)
  np.testing.assert_array_equal(padded, [[0, 1], [3, 4]])
