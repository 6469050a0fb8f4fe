"""Tests of `rank_table`, `RankTable` and the ladders."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import (
  RankTable,
  default_ladder,
  lod_to_array,
  normalize_ladder,
  rank_table,
)
from tests.helpers import lod_tensors

FIELDS = (
  "order",
  "ranks",
  "lengths",
  "batch_sizes",
  "max_length",
  "count",
  "phase_starts",
  "phase_ends",
)


def _lod(lengths, buckets=None):
  return LoDTensor.from_lengths(
    np.zeros(sum(lengths[-1]), np.float32), lengths, buckets=buckets
  )


def _as_numpy(table: RankTable) -> dict:
  return {name: np.asarray(getattr(table, name)) for name in FIELDS}


def _assert_tables_equal(actual: RankTable, expected: RankTable) -> None:
  assert actual.ladder == expected.ladder
  assert actual.level == expected.level
  for name in FIELDS:
    a, e = np.asarray(getattr(actual, name)), np.asarray(getattr(expected, name))
    assert a.dtype == np.int32, (name, a.dtype)
    assert a.shape == e.shape, name
    np.testing.assert_array_equal(a, e, err_msg=name)


# -- worked examples -----------------------------------------------------------------


def test_paddle_example_level_1():
  x = _lod([[1, 2], [5, 1, 1]])
  table = rank_table(x, level=1)
  assert table.items() == [(0, 5), (1, 1), (2, 1)]
  assert table.level == 1
  assert table.order.tolist() == [0, 1, 2]
  assert table.lengths.tolist() == [5, 1, 1]
  assert table.batch_sizes.tolist() == [3, 1, 1, 1, 1]
  assert int(table.max_length) == 5
  assert int(table.count) == 3


def test_paddle_example_level_0_ranks_by_number_of_subsequences():
  x = _lod([[1, 2], [5, 1, 1]])
  table = rank_table(x, level=0)
  assert table.items() == [(1, 2), (0, 1)]
  assert table.level == 0
  assert table.ranks.tolist() == [1, 0]
  assert table.batch_sizes.tolist() == [2, 1]
  # Negative levels count from the last.
  _assert_tables_equal(rank_table(x, level=-2), table)
  _assert_tables_equal(rank_table(x, level=-1), rank_table(x, level=1))
  # The default is the last level, as for dynamic_rnn and LoDTensor.lengths.
  _assert_tables_equal(rank_table(x), rank_table(x, level=1))
  assert rank_table(x).level == 1


def test_ties_keep_original_order():
  x = _lod([[2, 3, 2, 0, 3, 2]])
  table = rank_table(x)
  assert table.items() == [(1, 3), (4, 3), (0, 2), (2, 2), (5, 2), (3, 0)]
  assert table.order.tolist() == [1, 4, 0, 2, 5, 3]
  assert table.ranks.tolist() == [2, 0, 3, 5, 1, 4]
  assert table.lengths.tolist() == [3, 3, 2, 2, 2, 0]
  assert table.batch_sizes.tolist() == [5, 5, 2]


def test_padding_sequences_rank_last_and_empty_real_ones_before_them():
  x = _lod([[0, 2, 0]], buckets=Buckets.fixed(tokens=4, sequences=5, time=4))
  table = rank_table(x)
  assert table.count_capacity == 5
  assert table.time_capacity == 4
  assert table.order.tolist() == [1, 0, 2, 3, 4]
  assert table.lengths.tolist() == [2, 0, 0, 0, 0]
  assert table.batch_sizes.tolist() == [1, 1, 0, 0]
  assert int(table.count) == 3
  assert table.items() == [(1, 2), (0, 0), (2, 0)]


def test_phase_plan_worked_example():
  x = _lod([[1, 5, 0, 4, 1]], buckets=Buckets.fixed(tokens=16, sequences=8, time=6))
  table = rank_table(x, ladder=[4, 2])
  assert table.ladder == (8, 4, 2)
  assert table.batch_sizes.tolist() == [4, 2, 2, 2, 1, 0]
  # Size 8: steps where 4 < bs <= 8 (none); size 4: 2 < bs <= 4 (t = 0);
  # size 2: 0 < bs <= 2 (t = 1..4).
  assert table.phase_starts.tolist() == [0, 0, 1]
  assert table.phase_ends.tolist() == [0, 1, 5]
  assert int(table.schedule_steps()) == 4 * 1 + 2 * 4
  assert int(table.schedule_steps()) >= int(np.sum(table.lengths))


def test_default_ladder_used_when_none():
  x = _lod([[3] * 20], buckets=Buckets.pow2(minimum=8))
  table = rank_table(x)
  assert table.ladder == default_ladder(32) == (32, 28, 24, 20, 16, 12, 8, 4)
  # All 20 sequences are active for 3 steps: the phase of size 20 runs them.
  assert table.phase_starts.tolist() == [0, 0, 0, 0, 3, 3, 3, 3]
  assert table.phase_ends.tolist() == [0, 0, 0, 3, 3, 3, 3, 3]


def test_empty_batch():
  x = _lod([[]])
  table = rank_table(x)
  assert table.count_capacity == 0
  assert table.time_capacity == 0
  assert table.ladder == (0,)
  assert table.items() == []
  assert int(table.max_length) == 0
  assert table.phase_starts.tolist() == table.phase_ends.tolist() == [0]


def test_rank_table_under_jit_matches_paddle_example():
  x = _lod([[1, 2], [5, 1, 1]])
  table = jax.jit(rank_table, static_argnums=1)(x, 1)
  assert isinstance(table.order, jax.Array)
  _assert_tables_equal(table, rank_table(x, level=1))


def test_host_table_is_numpy_and_jit_table_is_jax():
  x = _lod([[1, 2]])
  assert isinstance(rank_table(x).order, np.ndarray)
  assert isinstance(jax.jit(rank_table)(x).order, jax.Array)


@pytest.mark.parametrize("level", [0, 1])
def test_host_table_moves_nothing_to_the_device(level):
  """A table of NumPy LoD (the data pipeline's) is NumPy work only, and one of
  device LoD only reads it back: no host-to-device transfer either way."""
  x = _lod([[1, 2], [5, 1, 1]])
  host = LoDTensor(
    np.asarray(x.values),
    tuple(np.asarray(o) for o in x.offsets),
    np.asarray(x.num_outer),
    x.time_capacity,
  )
  want = rank_table(x, level=level)
  with jax.transfer_guard("disallow"):
    table = rank_table(host, level=level)
  with jax.transfer_guard_host_to_device("disallow"):
    again = rank_table(x, level=level)
  numpy = np.ndarray | np.generic
  assert all(isinstance(getattr(table, name), numpy) for name in FIELDS)
  _assert_tables_equal(table, want)
  _assert_tables_equal(again, want)


def test_rank_table_is_a_pytree_with_static_ladder_and_level():
  x = _lod([[1, 2], [3, 0, 1]])
  table = rank_table(x, level=1, ladder=[2])
  leaves, treedef = jax.tree.flatten(table)
  assert len(leaves) == len(FIELDS)
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert rebuilt.ladder == (3, 2)
  assert rebuilt.level == 1
  other = rank_table(x, level=1)
  assert jax.tree.structure(other) != treedef
  # A host table passes through jit as data.
  doubled = jax.jit(lambda t: jax.tree.map(lambda a: a * 2, t))(table)
  np.testing.assert_array_equal(doubled.lengths, np.asarray(table.lengths) * 2)
  assert doubled.ladder == (3, 2)


def test_items_fails_under_jit():
  x = _lod([[1, 2]])
  with pytest.raises(
    ValueError, match=r"RankTable\.items\(\) reads data on the host; not under jit\."
  ):
    jax.jit(lambda x: len(rank_table(x).items()))(x)


# -- errors --------------------------------------------------------------------------


def test_level_errors():
  x = _lod([[1, 2], [5, 1, 1]])
  with pytest.raises(
    ValueError,
    match=r"Expected `level` in \[-2, 2\) \(the LoD levels of the tensor\), got 2\.",
  ):
    rank_table(x, level=2)
  with pytest.raises(
    ValueError,
    match=r"Expected `level` in \[-2, 2\) \(the LoD levels of the tensor\), got -3\.",
  ):
    rank_table(x, level=-3)


def test_rank_table_type_error():
  with pytest.raises(TypeError, match=r"Expected `x` to be a LoDTensor, got ndarray\."):
    rank_table(np.zeros(3))


@pytest.mark.parametrize(
  ("ladder", "match"),
  [
    ([0], r"Expected `ladder\[0\]` in \[1, 8\] \(the count capacity\), got 0\."),
    ([4, 9], r"Expected `ladder\[1\]` in \[1, 8\] \(the count capacity\), got 9\."),
    ([4, -2], r"Expected `ladder\[1\]` in \[1, 8\] \(the count capacity\), got -2\."),
    ([2.0], r"Expected `ladder\[0\]` to be an int, got 2\.0\."),
    ([4, True], r"Expected `ladder\[1\]` to be an int, got True\."),
    (["4"], r"Expected `ladder\[0\]` to be an int, got '4'\."),
  ],
)
def test_ladder_errors(ladder, match):
  with pytest.raises(ValueError, match=match):
    normalize_ladder(8, ladder)
  with pytest.raises(ValueError, match=match):
    rank_table(_lod([[1]], Buckets.fixed(tokens=1, sequences=8, time=1)), ladder=ladder)


@pytest.mark.parametrize(
  ("ladder", "expected"),
  [
    (None, (8, 4)),
    ([], (8,)),
    ([8], (8,)),
    ([2, 4], (8, 4, 2)),
    ([4, 2, 4, 1], (8, 4, 2, 1)),
    ((np.int64(3),), (8, 3)),
  ],
)
def test_normalize_ladder(ladder, expected):
  assert normalize_ladder(8, ladder) == expected


@pytest.mark.parametrize(
  ("args", "kwargs", "expected"),
  [
    ((64,), {}, (64, 52, 44, 36, 32, 28, 24, 20, 16, 12, 8, 4)),
    ((8,), {}, (8, 4)),
    ((4,), {}, (4,)),
    ((5,), {}, (5, 4)),
    ((10,), {}, (10, 8, 4)),
    ((64,), {"ratio": 1.5, "minimum": 8, "multiple": 8}, (64, 48, 32, 24, 16, 8)),
    ((100,), {"ratio": 2.0}, (100, 52, 28, 16, 8, 4)),
    ((100,), {"ratio": 2.0, "minimum": 8, "multiple": 8}, (100, 56, 32, 16, 8)),
    ((32,), {"ratio": 2.0, "minimum": 1, "multiple": 1}, (32, 16, 8, 4, 2, 1)),
    ((16,), {"ratio": 1.01, "minimum": 4, "multiple": 4}, (16, 12, 8, 4)),
  ],
)
def test_default_ladder(args, kwargs, expected):
  ladder = default_ladder(*args, **kwargs)
  assert ladder == expected
  assert all(a > b for a, b in zip(ladder, ladder[1:], strict=False))


def test_default_ladder_ratio_error():
  with pytest.raises(ValueError, match=r"Expected `ratio` > 1, got 1\.0\."):
    default_ladder(64, ratio=1.0)


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"multiple": 0}, r"Expected `multiple` to be an int >= 1, got 0\."),
    ({"minimum": -8}, r"Expected `minimum` to be an int >= 1, got -8\."),
    ({"minimum": 2.5}, r"Expected `minimum` to be an int >= 1, got 2\.5\."),
  ],
)
def test_default_ladder_size_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    default_ladder(16, **kwargs)


# -- host vs jit and invariants (hypothesis) ----------------------------------------

LADDERS = [None, (1,), (5, 2), (3, 2, 1), (12, 6, 3)]


def _ladder_for(x: LoDTensor, level: int, choice: int):
  capacity = x.capacity.sequences[level]
  ladder = LADDERS[choice]
  return None if ladder is None else [s for s in ladder if s <= capacity]


_jit_rank_table = jax.jit(rank_table, static_argnums=1, static_argnames="ladder")


def _check_invariants(x: LoDTensor, level: int, table: RankTable) -> None:
  t = _as_numpy(table)
  real = x.recursive_lengths()[level]
  lengths = np.asarray(x.lengths(level))
  capacity = x.capacity.sequences[level]
  # order is a permutation, ranks its inverse.
  np.testing.assert_array_equal(np.sort(t["order"]), np.arange(capacity))
  np.testing.assert_array_equal(t["ranks"][t["order"]], np.arange(capacity))
  # lengths sorted descending, ties in original order (stable).
  np.testing.assert_array_equal(t["lengths"], lengths[t["order"]])
  assert np.all(np.diff(t["lengths"]) <= 0)
  for r in range(capacity - 1):
    if t["lengths"][r] == t["lengths"][r + 1]:
      assert t["order"][r] < t["order"][r + 1]
  # batch sizes.
  bs = t["batch_sizes"]
  assert bs.shape == (x.time_capacity[level],)
  assert np.all(np.diff(bs) <= 0)
  if bs.size:
    assert bs[0] == np.count_nonzero(lengths)
  assert bs.sum() == sum(real)
  for step in range(bs.size):
    assert bs[step] == sum(length > step for length in real)
  assert t["max_length"] == max(real, default=0)
  assert t["count"] == len(real)
  assert table.items() == sorted(enumerate(real), key=lambda item: -item[1])
  # Phases: contiguous, in ladder order, covering [0, max_length).
  ladder = (*table.ladder, 0)
  assert t["phase_starts"][0] == 0
  np.testing.assert_array_equal(t["phase_ends"][:-1], t["phase_starts"][1:])
  assert t["phase_ends"][-1] == t["max_length"]
  for k in range(len(table.ladder)):
    steps = [s for s in range(bs.size) if ladder[k + 1] < bs[s] <= ladder[k]]
    assert list(range(t["phase_starts"][k], t["phase_ends"][k])) == steps
  assert int(table.schedule_steps()) == sum(
    size * (end - start)
    for size, start, end in zip(
      table.ladder, t["phase_starts"], t["phase_ends"], strict=True
    )
  )
  assert int(table.schedule_steps()) >= bs.sum()


@settings(max_examples=40)
@given(x=lod_tensors(), level=st.sampled_from([0, -1]), choice=st.integers(0, 4))
def test_host_and_jit_tables_agree(x, level, choice):
  level = level % x.num_levels
  ladder = _ladder_for(x, level, choice)
  host = rank_table(x, level, ladder=ladder)
  assert isinstance(host.order, np.ndarray)
  ladder = None if ladder is None else tuple(ladder)
  jitted = _jit_rank_table(x, level, ladder=ladder)
  assert isinstance(jitted.order, jax.Array)
  _assert_tables_equal(jitted, host)
  _check_invariants(x, level, host)


@settings(max_examples=30)
@given(
  lengths=st.lists(st.integers(0, 9), max_size=12),
  slack=st.tuples(st.integers(0, 4), st.integers(0, 4)),
)
def test_invariants_with_random_capacities(lengths, slack):
  buckets = Buckets.fixed(
    tokens=sum(lengths),
    sequences=len(lengths) + slack[0],
    time=max(lengths, default=0) + slack[1],
  )
  x = _lod([lengths], buckets)
  ladder = sorted({max(1, x.capacity.sequences[0] // d) for d in (2, 3)})
  if x.capacity.sequences[0] == 0:
    ladder = []
  _check_invariants(x, 0, rank_table(x, ladder=ladder))


def test_jit_table_of_jnp_batch_sizes_dtype():
  x = _lod([[1, 2]])
  table = jax.jit(rank_table)(x)
  assert table.batch_sizes.dtype == jnp.int32
  assert table.max_length.shape == ()


# -- the integer leaves stay integer ----------------------------------------------

LEAVES = ("order", "ranks", "lengths", "batch_sizes", "max_length", "count")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.bool_])
def test_a_tree_map_cast_of_a_table_raises_naming_the_leaf(dtype):
  # 299 in bfloat16 is 300: a cast table would reorder the rows wrongly.
  x = LoDTensor.from_lengths(np.arange(600.0), [[1] * 299 + [2, 299]])
  table = rank_table(x)
  with pytest.raises(TypeError, match=r"Expected integer `order`, got \w+: a rank"):
    jax.tree.map(lambda a: a.astype(dtype), table)
  for name in LEAVES:
    with pytest.raises(TypeError, match=f"Expected integer `{name}`"):
      dataclasses.replace(table, **{name: np.asarray(getattr(table, name), dtype)})


def test_a_table_keeps_float0_cotangents_and_transformation_leaves():
  x = LoDTensor.from_lengths(np.arange(5.0, dtype=np.float32), [[2, 3]])
  table = rank_table(x)

  def loss(values, table):
    return lod_to_array(x.with_values(values), table).sum()

  _, grad = jax.grad(loss, argnums=(0, 1), allow_int=True)(x.values, table)
  assert grad.order.dtype == jax.dtypes.float0
  assert jax.eval_shape(rank_table, x).order.dtype == jnp.int32
  stacked = jax.tree.map(lambda a: a[None], table)
  assert jax.vmap(lambda t: t.count)(stacked).tolist() == [2]
