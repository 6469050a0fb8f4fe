"""Tests of lod_to_array, array_to_lod, reorder_by_rank and shrink_memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify
from jax.test_util import check_grads

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import (
  array_to_lod,
  lod_to_array,
  rank_table,
  reorder_by_rank,
  shrink_memory,
)
from tests.helpers import (
  assert_close,
  assert_lod_equal,
  assert_nested_equal,
  buffer_reference,
  lod_tensors,
  lod_tensors_with_slack,
  make_case,
)

# -- cases -------------------------------------------------------------------------

CASES = {
  # name: (recursive lengths, feature shape, buckets)
  "one-level": ([[3, 0, 2, 4]], (2,), None),
  "scalar-rows": ([[1, 4, 2]], (), None),
  "bucketed": ([[2, 5, 0, 1]], (3,), Buckets.pow2(minimum=8)),
  "two-level": (
    [[2, 0, 3], [1, 3, 0, 2, 2]],
    (2,),
    Buckets.fixed(tokens=12, sequences=(4, 7), time=(4, 5)),
  ),
  "features-2d": ([[2, 3]], (2, 2), Buckets.fixed(tokens=6, sequences=3, time=4)),
}


def _make(name: str, dtype=np.float32, seed: int = 0) -> LoDTensor:
  return make_case(*CASES[name], dtype=dtype, seed=seed)


def _lod(lengths, buckets=None):
  return LoDTensor.from_lengths(
    np.zeros(sum(lengths[-1]), np.float32), lengths, buckets=buckets
  )


def _host(table) -> tuple[list[int], list[int]]:
  return np.asarray(table.order).tolist(), np.asarray(table.lengths).tolist()


# -- naive references (plain jnp indexing, Python loops) ----------------------------


def naive_lod_to_array(values, x: LoDTensor, table):
  offsets = np.asarray(x.offsets[-1])
  order, lengths = _host(table)
  buffer = jnp.zeros(
    (table.time_capacity, table.count_capacity, *values.shape[1:]), values.dtype
  )
  for rank, (i, length) in enumerate(zip(order, lengths, strict=True)):
    for t in range(length):
      buffer = buffer.at[t, rank].set(values[offsets[i] + t])
  return buffer


def naive_array_to_lod(array, x: LoDTensor, table):
  offsets = np.asarray(x.offsets[-1])
  order, lengths = _host(table)
  values = jnp.zeros((x.capacity.tokens, *array.shape[2:]), array.dtype)
  for rank, (i, length) in enumerate(zip(order, lengths, strict=True)):
    for t in range(length):
      values = values.at[offsets[i] + t].set(array[t, rank])
  return values


def _level0_rows(x: LoDTensor, i: int) -> range:
  """Rows of `values` inside level-0 sequence `i`."""
  start, stop = i, i + 1
  for o in x.offsets:
    o = np.asarray(o)
    start, stop = int(o[start]), int(o[stop])
  return range(start, stop)


def naive_reorder_values(values, x: LoDTensor, table):
  out = jnp.zeros_like(values)
  position = 0
  for i in _host(table)[0]:
    for row in _level0_rows(x, i):
      out = out.at[position].set(values[row])
      position += 1
  # Padding rows belong to no sequence: the permutation leaves them in place.
  for row in range(position, values.shape[0]):
    out = out.at[row].set(values[row])
  return out


def naive_reorder_rows(rows, table):
  return jnp.stack([rows[i] for i in _host(table)[0]])


# -- lod_to_array --------------------------------------------------------------------


def test_lod_to_array_worked_example():
  values = np.arange(1.0, 8.0, dtype=np.float32)
  x = LoDTensor.from_lengths(values, [[2, 0, 4, 1]])
  table = rank_table(x)
  buffer = jax.jit(lod_to_array)(x, table)
  assert buffer.shape == (4, 4)
  # Rank order: sequence 2 (4 rows), 0 (2 rows), 3 (1 row), 1 (empty).
  np.testing.assert_array_equal(
    buffer,
    [
      [3.0, 1.0, 7.0, 0.0],
      [4.0, 2.0, 0.0, 0.0],
      [5.0, 0.0, 0.0, 0.0],
      [6.0, 0.0, 0.0, 0.0],
    ],
  )
  # The batch active at step t is the prefix [:batch_sizes[t]].
  for t, size in enumerate(np.asarray(table.batch_sizes)):
    assert np.all(np.asarray(buffer[t, size:]) == 0)
    assert np.all(np.asarray(buffer[t, :size]) != 0)


@pytest.mark.parametrize("name", list(CASES))
def test_lod_to_array_matches_reference(name):
  x = _make(name)
  table = rank_table(x, level=-1)
  buffer = jax.jit(lod_to_array)(x, table)
  expected = buffer_reference(x, table.order)
  assert buffer.shape == (
    x.time_capacity[-1],
    x.capacity.sequences[-1],
    *x.feature_shape,
  )
  assert buffer.dtype == x.values.dtype
  np.testing.assert_array_equal(buffer, expected)
  np.testing.assert_array_equal(buffer, naive_lod_to_array(x.values, x, table))


def test_lod_to_array_with_table_built_under_jit():
  x = _make("two-level")
  buffer = jax.jit(lambda x: lod_to_array(x, rank_table(x, level=1)))(x)
  np.testing.assert_array_equal(buffer, buffer_reference(x, rank_table(x, 1).order))


def test_lod_to_array_with_longer_table():
  # A table with a larger time capacity gives a longer buffer of zeros.
  x = LoDTensor.from_lengths(np.arange(1.0, 4.0, dtype=np.float32), [[2, 1]])
  longer = LoDTensor.from_lengths(
    np.zeros(3, np.float32),
    [[2, 1]],
    buckets=Buckets.fixed(tokens=3, sequences=2, time=4),
  )
  buffer = lod_to_array(x, rank_table(longer))
  np.testing.assert_array_equal(buffer, [[1, 3], [2, 0], [0, 0], [0, 0]])


# -- array_to_lod --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_array_to_lod_inverts_lod_to_array(name):
  x = _make(name)
  table = rank_table(x, level=-1)
  y = jax.jit(lambda x, t: array_to_lod(lod_to_array(x, t), t, like=x))(x, table)
  assert_lod_equal(y, x)


@pytest.mark.parametrize("name", list(CASES))
def test_array_to_lod_ignores_inactive_cells(name):
  x = _make(name)
  table = rank_table(x, level=-1)
  shape = (table.time_capacity, table.count_capacity, 3)
  array = jax.random.normal(jax.random.key(0), shape)
  y = jax.jit(lambda a, t: array_to_lod(a, t, like=x))(array, table)
  assert y.feature_shape == (3,)
  for got, expected in zip(y.offsets, x.offsets, strict=True):
    np.testing.assert_array_equal(got, expected)
  np.testing.assert_array_equal(y.values, naive_array_to_lod(array, x, table))
  rows = int(x.num_rows)
  np.testing.assert_array_equal(np.asarray(y.values)[rows:], 0)
  # Every real row comes from an active cell.
  active = np.arange(shape[0])[:, None] < np.asarray(table.lengths)[None, :]
  got = np.sort(np.asarray(y.values)[:rows], axis=0)
  np.testing.assert_array_equal(got, np.sort(np.asarray(array)[active], axis=0))


# -- reorder_by_rank -----------------------------------------------------------------


def test_reorder_rows():
  x = LoDTensor.from_lengths(np.zeros(6, np.float32), [[1, 3, 0, 2]])
  table = rank_table(x)
  rows = jnp.arange(8.0).reshape(4, 2)
  out = jax.jit(reorder_by_rank)(rows, table)
  np.testing.assert_array_equal(out, [[2, 3], [6, 7], [0, 1], [4, 5]])


def test_reorder_pytree():
  x = LoDTensor.from_lengths(np.zeros(6, np.float32), [[1, 3, 0, 2]])
  table = rank_table(x)
  tree = {"h": jnp.arange(4.0), "c": (jnp.arange(12).reshape(4, 3),)}
  out = jax.jit(reorder_by_rank)(tree, table)
  order = [1, 3, 0, 2]
  np.testing.assert_array_equal(out["h"], np.arange(4.0)[order])
  np.testing.assert_array_equal(out["c"][0], np.arange(12).reshape(4, 3)[order])
  assert out["c"][0].dtype == tree["c"][0].dtype


@pytest.mark.parametrize("name", ["one-level", "bucketed", "two-level"])
def test_reorder_lod_tensor(name):
  x = _make(name)
  table = rank_table(x, level=0)
  y = jax.jit(reorder_by_rank)(x, table)
  order = np.asarray(table.order)[: int(table.count)]
  assert_nested_equal(y.to_list(), [x.to_list()[i] for i in order])
  assert y.capacity == x.capacity
  assert int(y.num_outer) == int(x.num_outer)
  np.testing.assert_array_equal(y.lengths(0), table.lengths)
  for o in y.offsets:  # padding sequences stay empty at the end
    o = np.asarray(o)
    assert np.all(np.diff(o) >= 0)
  np.testing.assert_array_equal(np.asarray(y.values)[int(x.num_rows) :], 0)
  np.testing.assert_array_equal(y.values, naive_reorder_values(x.values, x, table))
  # Ranked again, the reordered tensor is already in rank order.
  np.testing.assert_array_equal(
    rank_table(y, level=0).order, np.arange(table.count_capacity)
  )


_jit_reorder = jax.jit(reorder_by_rank)


@settings(max_examples=40)
@given(x=lod_tensors())
def test_reorder_lod_tensor_property(x):
  table = rank_table(x, level=0)
  y = _jit_reorder(x, table)
  order = np.asarray(table.order)[: int(table.count)]
  assert_nested_equal(y.to_list(), [x.to_list()[i] for i in order])
  assert y.recursive_lengths()[0] == sorted(x.recursive_lengths()[0], reverse=True)
  np.testing.assert_array_equal(np.asarray(y.values)[int(x.num_rows) :], 0)


# -- shrink_memory -------------------------------------------------------------------


def _shrink_case():
  x = LoDTensor.from_lengths(
    np.zeros(7, np.float32),
    [[3, 1, 3]],
    buckets=Buckets.fixed(tokens=8, sequences=4, time=3),
  )
  table = rank_table(x)
  assert table.batch_sizes.tolist() == [3, 2, 2]
  return table


@pytest.mark.parametrize(("step", "size"), [(0, 3), (0, 4), (1, 2), (2, 2), (2, 3)])
def test_shrink_memory(step, size):
  table = _shrink_case()
  memory = {"h": jnp.arange(8.0).reshape(4, 2), "c": jnp.arange(4)}
  out = shrink_memory(memory, table, step, size)
  np.testing.assert_array_equal(out["h"], np.arange(8.0).reshape(4, 2)[:size])
  np.testing.assert_array_equal(out["c"], np.arange(4)[:size])
  jitted = jax.jit(shrink_memory, static_argnums=3)(memory, table, step, size)
  assert_close(jitted, out)


def test_shrink_memory_traced_step():
  table = _shrink_case()
  fn = jax.jit(lambda m, t, s: shrink_memory(m, t, s, 2))
  out = fn(jnp.arange(4.0), table, jnp.int32(1))
  np.testing.assert_array_equal(out, [0.0, 1.0])


@pytest.mark.parametrize(
  ("memory", "step", "size", "error", "match"),
  [
    (
      jnp.zeros(4),
      0,
      2,
      ValueError,
      r"shrink_memory: 3 sequences are active at step 0, more than `size` 2; data "
      r"is never dropped\.",
    ),
    (
      jnp.zeros(4),
      3,
      2,
      ValueError,
      r"Expected `step` in \[0, 3\) \(time capacity\), got 3\.",
    ),
    (
      jnp.zeros(4),
      -1,
      4,
      ValueError,
      r"Expected `step` in \[0, 3\) \(time capacity\), got -1\.",
    ),
    (
      jnp.zeros(4),
      0,
      5,
      ValueError,
      r"Expected `size` in \[0, 4\] \(count capacity\), got 5\.",
    ),
    (
      jnp.zeros(4),
      0,
      3.0,
      TypeError,
      r"Expected `size` to be a static int, got 3\.0\.",
    ),
    (
      jnp.zeros(4),
      0,
      jnp.int32(3),
      TypeError,
      r"Expected `size` to be a static int, got",
    ),
    (
      {"h": jnp.zeros(4), "c": jnp.zeros(3)},
      0,
      3,
      ValueError,
      r"Expected `memory` leaf \['c'\] to have leading dimension 4 \(count "
      r"capacity\), got shape \(3,\)\.",
    ),
    (
      jnp.float32(0),
      0,
      3,
      ValueError,
      r"Expected `memory` leaf \(root\) to have leading dimension 4 \(count "
      r"capacity\), got shape \(\)\.",
    ),
  ],
)
def test_shrink_memory_errors(memory, step, size, error, match):
  with pytest.raises(error, match=match):
    shrink_memory(memory, _shrink_case(), step, size)


def test_shrink_memory_step_error_on_empty_time_axis():
  # All sequences empty: the time capacity is 0, so no step is valid.
  table = rank_table(_lod([[0, 0]]))
  assert table.time_capacity == 0
  with pytest.raises(
    ValueError, match=r"Expected `step` in \[0, 0\) \(time capacity\), got 0\."
  ):
    shrink_memory(jnp.zeros((2, 3)), table, 0, 2)


def test_shrink_memory_checkify():
  table = _shrink_case()
  fn = checkify.checkify(jax.jit(lambda m, t, s: shrink_memory(m, t, s, 2)))
  err, _ = fn(jnp.zeros(4), table, jnp.int32(0))
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"shrink_memory: more sequences are active at the step than `size`\.",
  ):
    err.throw()
  err, out = fn(jnp.zeros(4), table, jnp.int32(1))
  err.throw()
  assert out.shape == (2,)


# -- errors of mismatched tables -----------------------------------------------------


@pytest.mark.parametrize("op", ["lod_to_array", "array_to_lod"])
@pytest.mark.parametrize(
  ("table_lengths", "table_buckets", "match"),
  [
    (
      [[2, 1, 0, 0]],
      None,
      r"Expected the rank table's count capacity 4 to equal the count capacity "
      r"of `{name}`'s last level, got 3\.",
    ),
    (
      [[2, 1, 1]],
      None,
      r"Expected the rank table's time capacity 2 to be at least the time "
      r"capacity of `{name}`'s last level, got 3\.",
    ),
    (
      [[1, 3, 0]],
      None,
      r"The rank table does not describe `{name}`'s last level: at rank 0 it has "
      r"length 3, `{name}` has 2\.",
    ),
  ],
  ids=["count-capacity", "time-capacity", "lengths"],
)
def test_mismatched_table(op, table_lengths, table_buckets, match):
  x = _lod([[3, 2, 0]])
  table = rank_table(_lod(table_lengths, table_buckets))
  name = "x" if op == "lod_to_array" else "like"
  with pytest.raises(ValueError, match=match.format(name=name)):
    if op == "lod_to_array":
      lod_to_array(x, table)
    else:
      array_to_lod(jnp.zeros((table.time_capacity, 3)), table, like=x)


def test_level_0_table_of_a_two_level_tensor_is_rejected():
  x = _lod([[2, 1], [1, 1, 1]])
  with pytest.raises(
    ValueError,
    match=r"Expected the rank table's count capacity 2 to equal the count capacity "
    r"of `x`'s last level, got 3\.",
  ):
    lod_to_array(x, rank_table(x, level=0))


@pytest.mark.parametrize(
  ("shape", "match"),
  [
    (
      (3, 2),
      r"Expected `array` to have shape \[3, 3, \*features\] \(time capacity, count "
      r"capacity\), got \(3, 2\)\.",
    ),
    ((3,), r"Expected `array` to have shape \[3, 3, \*features\].*got \(3,\)\."),
    (
      (2, 3, 4),
      r"Expected `array` to have shape \[3, 3, \*features\].*got \(2, 3, 4\)",
    ),
  ],
)
def test_array_to_lod_shape_error(shape, match):
  x = _lod([[3, 2, 0]])
  with pytest.raises(ValueError, match=match):
    array_to_lod(jnp.zeros(shape), rank_table(x), like=x)


def test_type_errors():
  x = _lod([[3, 2, 0]])
  table = rank_table(x)
  with pytest.raises(TypeError, match=r"Expected `x` to be a LoDTensor, got ndarray\."):
    lod_to_array(np.zeros(3), table)
  with pytest.raises(TypeError, match=r"Expected `like` to be a LoDTensor, got dict\."):
    array_to_lod(jnp.zeros((3, 3)), table, like={})
  for call in (
    lambda: lod_to_array(x, {}),
    lambda: array_to_lod(jnp.zeros((3, 3)), {}, like=x),
    lambda: reorder_by_rank(jnp.zeros(3), {}),
  ):
    with pytest.raises(
      TypeError, match=r"Expected `table` to be a RankTable, got dict\."
    ):
      call()


@pytest.mark.parametrize(
  ("x", "match"),
  [
    (
      jnp.zeros((4, 2)),
      r"Expected `x` leaf \(root\) to have leading dimension 3 \(count capacity\), "
      r"got shape \(4, 2\)\.",
    ),
    (
      {"a": jnp.zeros(3), "b": [jnp.zeros(3), jnp.zeros(())]},
      r"Expected `x` leaf \['b'\]\[1\] to have leading dimension 3 \(count "
      r"capacity\), got shape \(\)\.",
    ),
    (
      _lod([[1, 2, 0, 1]]),
      r"Expected `x` to have level-0 count capacity 3 \(the rank table's\), got 4\.",
    ),
  ],
  ids=["array", "pytree", "lod"],
)
def test_reorder_by_rank_errors(x, match):
  with pytest.raises(ValueError, match=match):
    reorder_by_rank(x, rank_table(_lod([[3, 2, 0]])))


def test_reorder_by_rank_checks_lengths_when_asked():
  """A level-1 table has the right count capacity but ranks other sequences."""
  x = LoDTensor.from_lengths(np.arange(7.0), [[0, 2], [2, 5]])
  with pytest.raises(
    ValueError,
    match=r"The rank table does not describe `x`'s level 0: at rank 0 it has length "
    r"5, `x` has 2\.",
  ):
    reorder_by_rank(x, rank_table(x, level=1), check_lengths=True)


def _fluid_reorder(seqs: list, table_lengths: list) -> list:
  """Fluid's reorder_lod_tensor_by_rank: whole level-0 sequences into the
  order of a rank table of *other* lengths (a stable sort, longest first)."""
  order = sorted(range(len(table_lengths)), key=lambda i: -table_lengths[i])
  return [seqs[i] for i in order]


# One capacity for every example below, so that one program serves them all.
_SMALL = Buckets.fixed(tokens=20, sequences=5, time=4)
_checked_reorder = jax.jit(checkify.checkify(reorder_by_rank))


@given(
  st.lists(st.integers(0, 4), min_size=1, max_size=5).flatmap(
    lambda src: st.tuples(
      st.just(src), st.lists(st.integers(0, 4), min_size=len(src), max_size=len(src))
    )
  )
)
def test_reorder_by_rank_follows_another_tensors_table(lengths):
  """Encoder states reordered by the target's ranks, as Fluid's DynamicRNN
  does: the counts agree, the lengths need not."""
  src_lengths, tgt_lengths = lengths
  src = LoDTensor.from_lengths(
    np.arange(float(sum(src_lengths))), [src_lengths], buckets=_SMALL
  )
  tgt = LoDTensor.from_lengths(
    np.zeros(sum(tgt_lengths)), [tgt_lengths], buckets=_SMALL
  )
  moved = reorder_by_rank(src, rank_table(tgt))
  expected = _fluid_reorder([s.tolist() for s in src.to_list()], tgt_lengths)
  assert [s.tolist() for s in moved.to_list()] == expected
  # Jitted, and checked under checkify: the same.
  err, jitted = _checked_reorder(src, rank_table(tgt))
  err.throw()
  assert [s.tolist() for s in jitted.to_list()] == expected


def test_reorder_by_rank_needs_equal_counts():
  buckets = Buckets.fixed(tokens=8, sequences=3, time=4)
  src = LoDTensor.from_lengths(np.arange(5.0), [[3, 2]], buckets=buckets)
  tgt = LoDTensor.from_lengths(np.zeros(3), [[1, 1, 1]], buckets=buckets)
  match = r"as many level-0 sequences as the rank table ranks \(3\), got 2"
  with pytest.raises(ValueError, match=match):
    reorder_by_rank(src, rank_table(tgt))
  err, _ = checkify.checkify(jax.jit(reorder_by_rank))(src, rank_table(tgt))
  with pytest.raises(checkify.JaxRuntimeError, match="as many level-0 sequences"):
    err.throw()


@pytest.mark.parametrize(
  "lengths", [[[]], [[], []], [[0], []]], ids=["one-level", "two-level", "empty-outer"]
)
def test_empty_batch_with_padding_capacity(lengths):
  # An empty batch (the end of an epoch) on fixed capacities: no sequence
  # slots at some level, but padding rows in `values`.
  sequences = [0] * len(lengths) if lengths[0] == [] else [1, 0]
  buckets = Buckets.fixed(tokens=4, sequences=sequences, time=[0] * len(lengths))
  x = LoDTensor.from_lengths(np.zeros((0, 2), np.float32), lengths, buckets=buckets)
  assert x.capacity.tokens == 4
  table = rank_table(x, level=-1)
  buffer = lod_to_array(x, table)
  assert buffer.shape == (0, 0, 2)
  assert_lod_equal(array_to_lod(buffer, table, like=x), x)
  assert_lod_equal(reorder_by_rank(x, rank_table(x, level=0)), x)


def test_zero_width_features_round_trip():
  # `reshape(-1, *features)` of a buffer [time, count, 0] divided by zero.
  x = LoDTensor.from_lengths(np.zeros((3, 0), np.float32), [[2, 0, 1]])
  table = rank_table(x)
  buffer = lod_to_array(x, table)
  assert buffer.shape == (2, 3, 0)
  assert_lod_equal(array_to_lod(buffer, table, like=x), x)


# -- gradients -----------------------------------------------------------------------


def _ops(x: LoDTensor):
  """Each op as a function of one array, with its naive reference."""
  last = rank_table(x, level=-1)
  outer = rank_table(x, level=0)
  rows = (x.capacity.sequences[0], 3)
  buffer = (last.time_capacity, last.count_capacity, 2)
  return {
    "lod_to_array": (
      lambda v: lod_to_array(x.with_values(v), last),
      lambda v: naive_lod_to_array(v, x, last),
      x.values.shape,
    ),
    "array_to_lod": (
      lambda a: array_to_lod(a, last, like=x).values,
      lambda a: naive_array_to_lod(a, x, last),
      buffer,
    ),
    "reorder_rows": (
      lambda r: reorder_by_rank(r, outer),
      lambda r: naive_reorder_rows(r, outer),
      rows,
    ),
    "reorder_lod": (
      lambda v: reorder_by_rank(x.with_values(v), outer).values,
      lambda v: naive_reorder_values(v, x, outer),
      x.values.shape,
    ),
    "shrink_memory": (
      lambda m: shrink_memory(m, outer, 0, int(np.asarray(outer.batch_sizes)[0])),
      lambda m: m[: int(np.asarray(outer.batch_sizes)[0])],
      rows,
    ),
  }


OPS = ["lod_to_array", "array_to_lod", "reorder_rows", "reorder_lod", "shrink_memory"]
GRAD_CASES = ["one-level", "bucketed", "two-level"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", GRAD_CASES)
def test_check_grads_float64(op, name):
  with jax.enable_x64(True):
    x = _make(name, dtype=np.float64)
    assert x.values.dtype == jnp.float64
    fn, _, shape = _ops(x)[op]
    arg = jax.random.normal(jax.random.key(1), shape, jnp.float64)
    check_grads(jax.jit(fn), (arg,), order=1, modes=("rev",))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", GRAD_CASES)
def test_vjp_matches_naive_reference(op, name):
  x = _make(name)
  fn, naive, shape = _ops(x)[op]
  key_arg, key_ct = jax.random.split(jax.random.key(2))
  arg = jax.random.normal(key_arg, shape)
  out, vjp = jax.vjp(jax.jit(fn), arg)
  expected_out, naive_vjp = jax.vjp(jax.jit(naive), arg)
  assert_close(out, expected_out)
  cotangent = jax.random.normal(key_ct, out.shape)
  assert_close(vjp(cotangent), naive_vjp(cotangent))


def test_gradients_skip_padding():
  x = _make("bucketed")
  table = rank_table(x)
  rows = int(x.num_rows)
  grad = jax.jit(
    jax.grad(lambda v: jnp.sum(lod_to_array(x.with_values(v), table) ** 2))
  )
  g = grad(x.values)
  assert_close(g[:rows], 2 * x.values[:rows])
  np.testing.assert_array_equal(g[rows:], 0)
  array = jnp.ones((table.time_capacity, table.count_capacity, 3))
  g = jax.jit(jax.grad(lambda a: jnp.sum(array_to_lod(a, table, like=x).values)))(array)
  active = np.arange(table.time_capacity)[:, None] < np.asarray(table.lengths)
  np.testing.assert_array_equal(g, np.broadcast_to(active[..., None], g.shape))


def test_shrink_memory_gradient_pads_with_zeros():
  table = _shrink_case()
  g = jax.grad(lambda m: jnp.sum(shrink_memory(m, table, 1, 2) * jnp.array([3.0, 4.0])))
  np.testing.assert_array_equal(g(jnp.ones(4)), [3.0, 4.0, 0.0, 0.0])


# -- round trips (hypothesis) --------------------------------------------------------


@jax.jit
def _round_trip(x):
  table = rank_table(x, level=-1)
  buffer = lod_to_array(x, table)
  return buffer, array_to_lod(buffer, table, like=x)


@settings(max_examples=50)
@given(x=lod_tensors())
def test_round_trip_property(x):
  buffer, y = _round_trip(x)
  assert_lod_equal(y, x)
  table = rank_table(x, level=-1)
  np.testing.assert_array_equal(buffer, buffer_reference(x, table.order))
  # Per-step batch sizes: the active prefix is exactly batch_sizes[t] long.
  nonzero = np.abs(np.asarray(buffer)).sum(axis=-1) > 0
  assert np.all(nonzero.sum(axis=1) <= np.asarray(table.batch_sizes))


@settings(max_examples=25)
@given(x=lod_tensors_with_slack())
def test_round_trip_random_capacities(x):
  buffer, y = _round_trip(x)
  assert_lod_equal(y, x)
  table = rank_table(x, level=-1)
  np.testing.assert_array_equal(buffer, buffer_reference(x, table.order))
  outer = rank_table(x, level=0)
  order = np.asarray(outer.order)[: len(x.recursive_lengths()[0])]
  reordered = _jit_reorder(x, outer)
  assert_nested_equal(reordered.to_list(), [x.to_list()[i] for i in order])
