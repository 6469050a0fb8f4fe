"""Saving and restoring LoDTensors and rank tables: `flax.serialization` state
dicts and msgpack bytes, orbax checkpoints, and `LoDTensor.validate`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from hypothesis import given, settings

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import RankTable, rank_table
from tests.helpers import assert_lod_equal, lod_tensors

ONE = Buckets.fixed(tokens=8, sequences=4, time=6)
TWO = Buckets.fixed(tokens=10, sequences=(3, 5), time=(3, 4))


def one_level(lengths=(5, 0, 1), buckets=ONE) -> LoDTensor:
  rows = np.arange(2.0 * sum(lengths), dtype=np.float32).reshape(-1, 2)
  return LoDTensor.from_lengths(rows, [list(lengths)], buckets=buckets)


def two_level() -> LoDTensor:
  rows = np.arange(7.0, dtype=np.float32)
  return LoDTensor.from_lengths(rows, [[2, 0, 1], [3, 0, 4]], buckets=TWO)


def blank(x: LoDTensor) -> LoDTensor:
  """A target of `x`'s capacities and dtypes holding zeros."""
  return jax.tree.map(jnp.zeros_like, x)


def assert_tables_equal(actual: RankTable, expected: RankTable) -> None:
  assert (actual.ladder, actual.level) == (expected.ladder, expected.level)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(a, e)


# -- flax.serialization ------------------------------------------------------------


@pytest.mark.parametrize("make", [one_level, two_level], ids=["one", "two"])
def test_bytes_round_trip(make):
  x = make()
  y = serialization.from_bytes(blank(x), serialization.to_bytes(x))
  assert isinstance(y, LoDTensor)
  assert_lod_equal(y, x)
  assert y.time_capacity == x.time_capacity
  assert y.offsets[0].dtype == np.int32


def test_state_dict_holds_the_time_capacity():
  x = two_level()
  state = serialization.to_state_dict(x)
  assert state["time_capacity"] == {"0": 3, "1": 4}
  assert sorted(state["offsets"]) == ["0", "1"]
  y = serialization.from_state_dict(blank(x), state)
  assert_lod_equal(y, x)


def test_round_trip_inside_a_tree_with_params():
  x, params = one_level(), {"w": jnp.arange(3.0)}
  tree = {"batch": x, "params": params, "pair": (x, 7)}
  target = {"batch": blank(x), "params": {"w": jnp.zeros(3)}, "pair": (blank(x), 0)}
  y = serialization.from_bytes(target, serialization.to_bytes(tree))
  assert_lod_equal(y["batch"], x)
  assert_lod_equal(y["pair"][0], x)
  np.testing.assert_array_equal(y["params"]["w"], params["w"])
  assert y["pair"][1] == 7


def test_round_trip_of_empty_sequences():
  x = one_level(lengths=(0, 0, 0))
  y = serialization.from_bytes(one_level(), serialization.to_bytes(x))
  assert y.recursive_lengths() == [[0, 0, 0]]
  assert int(y.num_rows) == 0


def test_restore_into_an_abstract_target():
  x = two_level()
  y = serialization.from_bytes(jax.eval_shape(lambda: x), serialization.to_bytes(x))
  assert_lod_equal(y, x)


def test_restore_into_a_larger_time_capacity_takes_the_targets():
  x = one_level()
  wide = Buckets.fixed(tokens=8, sequences=4, time=7)
  y = serialization.from_bytes(one_level(buckets=wide), serialization.to_bytes(x))
  assert y.time_capacity == (7,)
  assert y.recursive_lengths() == x.recursive_lengths()


@settings(max_examples=20)
@given(lod_tensors())
def test_bytes_round_trip_of_random_lods(x):
  assert_lod_equal(serialization.from_bytes(x, serialization.to_bytes(x)), x)


def test_time_capacity_smaller_than_the_data_raises():
  short = Buckets.fixed(tokens=8, sequences=4, time=3)
  data = serialization.to_bytes({"x": one_level()})
  with pytest.raises(
    ValueError,
    match=r"LoDTensor at state-dict path '\./x': time capacity \(6,\) saved, \(3,\) "
    r"in the target; LoD level 0, index 0: a sequence of length 5, more than the "
    r"time capacity 3\.",
  ):
    serialization.from_bytes({"x": one_level((1,), buckets=short)}, data)


def test_a_smaller_time_capacity_that_fits_the_data_restores():
  wide = Buckets.fixed(tokens=8, sequences=4, time=9)
  x = one_level(lengths=(5, 0, 1), buckets=wide)
  y = serialization.from_bytes(one_level(), serialization.to_bytes(x))
  assert y.time_capacity == (6,)
  assert y.recursive_lengths() == [[5, 0, 1]]


@pytest.mark.parametrize(
  "buckets, match",
  [
    (
      Buckets.fixed(tokens=12, sequences=4, time=6),
      r"the state's leaf \.values has shape \(8, 2\), the target's \(12, 2\)",
    ),
    (
      Buckets.fixed(tokens=8, sequences=5, time=6),
      r"the state's leaf \.offsets\[0\] has shape \(5,\), the target's \(6,\)",
    ),
  ],
  ids=["tokens", "sequences"],
)
def test_other_capacities_raise(buckets, match):
  data = serialization.to_bytes(one_level())
  with pytest.raises(ValueError, match=match):
    serialization.from_bytes(one_level(buckets=buckets), data)


def test_other_feature_shape_raises():
  x = one_level()
  target = x.with_values(jnp.zeros((8, 3)))
  with pytest.raises(ValueError, match=r"\.values has shape \(8, 2\), the target's"):
    serialization.from_bytes(target, serialization.to_bytes(x))


def test_other_level_count_raises():
  with pytest.raises(
    ValueError,
    match=r"the state has 1 LoD level\(s\) \(time capacity \(6,\)\), the target 2 "
    r"\(time capacity \(3, 4\)\)",
  ):
    serialization.from_bytes(two_level(), serialization.to_bytes(one_level()))


def test_missing_field_raises():
  state = serialization.to_state_dict(one_level())
  del state["num_outer"]
  with pytest.raises(ValueError, match=r"expected the fields \[.*'num_outer'.*\], got"):
    serialization.from_state_dict(one_level(), state)


@pytest.mark.parametrize(
  "offsets, match",
  [
    ([0, 5, 4, 6, 6], r"index 2: offsets must be non-decreasing, got 5 at index 1"),
    ([1, 5, 5, 6, 6], r"index 0: offsets must start at 0, got 1"),
    ([0, 5, 5, 6, 7], r"index 4: padding sequences \(past the 3 real ones\) must be"),
    ([0, 5, 5, 9, 9], r"last offset 9 must be at most the token capacity 8"),
  ],
  ids=["decreasing", "start", "padding", "tokens"],
)
def test_a_corrupt_state_raises(offsets, match):
  state = serialization.to_state_dict(one_level())
  state["offsets"]["0"] = np.asarray(offsets, np.int32)
  with pytest.raises(ValueError, match=r"Restoring a LoDTensor at state-dict path "):
    serialization.from_state_dict(one_level(), state)
  with pytest.raises(ValueError, match=match):
    serialization.from_state_dict(one_level(), state)


def test_float_offsets_in_a_state_raise():
  state = serialization.to_state_dict(one_level())
  state["offsets"]["0"] = np.zeros(5, np.float32)
  with pytest.raises(TypeError, match="Expected integer offsets of level 0, got float"):
    serialization.from_state_dict(one_level(), state)


def test_rank_table_round_trip():
  x = two_level()
  table = rank_table(x)
  target = jax.tree.map(jnp.zeros_like, table)
  restored = serialization.from_bytes(target, serialization.to_bytes(table))
  assert isinstance(restored, RankTable)
  assert_tables_equal(restored, table)
  pair = serialization.from_bytes(
    (blank(x), target), serialization.to_bytes((x, table))
  )
  assert_lod_equal(pair[0], x)
  assert_tables_equal(pair[1], table)


@pytest.mark.parametrize(
  "other, match",
  [
    (dict(ladder=(5,)), r"the state has ladder=\(5, 4\), the target ladder=\(5,\)"),
    (dict(level=0), r"the state has level=1, the target level=0"),
  ],
  ids=["ladder", "level"],
)
def test_rank_table_of_other_static_fields_raises(other, match):
  table = rank_table(two_level())
  target = dataclasses.replace(table, **other)
  with pytest.raises(ValueError, match=match):
    serialization.from_bytes(target, serialization.to_bytes(table))


# -- LoDTensor.validate --------------------------------------------------------------


@pytest.mark.parametrize("make", [one_level, two_level], ids=["one", "two"])
def test_validate_accepts_built_tensors(make):
  make().validate()


@pytest.mark.parametrize(
  "edit, match",
  [
    (
      dict(time_capacity=(3, 3)),
      r"LoD level 1, index 2: a sequence of length 4, more ",
    ),
    (
      dict(num_outer=jnp.int32(4)),
      r"LoD level 0: `num_outer` is 4, outside \[0, 3\] \(the level's count",
    ),
    (
      dict(offsets=(jnp.array([0, 3, 3, 6]), jnp.array([0, 3, 3, 7, 7, 7]))),
      r"LoD level 1: the last offset of level 0 is 6, outside \[0, 5\]",
    ),
  ],
  ids=["time", "num_outer", "count"],
)
def test_validate_raises(edit, match):
  x = dataclasses.replace(two_level(), **edit)
  with pytest.raises(ValueError, match=match):
    x.validate()


def test_validate_checks_each_stacked_shard():
  x = one_level()
  bad = one_level(lengths=(1, 1))
  bad = dataclasses.replace(bad, offsets=(jnp.array([0, 1, 2, 2, 3]),))
  stacked = jax.tree.map(lambda *a: jnp.stack(a), x, bad)
  with pytest.raises(ValueError, match=r"shard \(1,\): LoD level 0, index 4: padding"):
    stacked.validate()


def test_validate_under_jit_raises():
  with pytest.raises(ValueError, match="reads its LoD on the host"):
    jax.jit(LoDTensor.validate)(one_level())


# -- orbax -------------------------------------------------------------------------


def save(path, tree) -> None:
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)


def restore(path, target):
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, target)


def restore_with_args(path, target):
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
    return checkpointer.restore(path, args=ocp.args.StandardRestore(target))


def test_orbax_round_trip(tmp_path):
  x = two_level()
  tree = {"batch": x, "table": rank_table(x), "w": jnp.arange(3.0)}
  save(tmp_path / "ckpt", tree)
  target = jax.eval_shape(lambda: tree)
  restored = restore(tmp_path / "ckpt", target)
  restored["batch"].validate()
  assert_lod_equal(restored["batch"], x)
  assert_tables_equal(restored["table"], tree["table"])
  np.testing.assert_array_equal(restored["w"], tree["w"])


@pytest.mark.parametrize("load", [restore, restore_with_args], ids=["target", "args"])
def test_orbax_takes_the_time_capacity_from_the_target(tmp_path, load):
  # Orbax stores the leaves only (values, offsets.0, num_outer): the restored
  # tensor gets its static time capacity from the target, unchecked, and
  # `validate` is the check, and every host read of the LoD runs it.
  save(tmp_path / "ckpt", one_level())
  short = one_level((1,), buckets=Buckets.fixed(tokens=8, sequences=4, time=3))
  restored = load(tmp_path / "ckpt", short)
  assert restored.time_capacity == (3,)
  for read in (restored.validate, restored.recursive_lengths, restored.lengths):
    with pytest.raises(
      ValueError,
      match=r"LoD level 0, index 0: a sequence of length 5, more than the time "
      r"capacity 3\.",
    ):
      read()
