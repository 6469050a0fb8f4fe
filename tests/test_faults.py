"""Faults: under `jit` without `checkify`, an op that cannot honour its contract
returns a valid LoDTensor, clamped to its capacities, with a `Fault` set; every
op passes faults on, and host reads of a faulted tensor raise."""

import dataclasses
import functools

import flax.linen
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify

import jaxlod
from jaxlod import Buckets, Fault, LoDTensor
from jaxlod import nn as lnn
from jaxlod.ops import (
  DecodeSettings,
  array_to_lod,
  beam_search,
  dynamic_rnn,
  lod_reset,
  lod_to_array,
  rank_table,
  reorder_by_rank,
  sequence_concat,
  sequence_enumerate,
  sequence_erase,
  sequence_expand,
  sequence_expand_as,
  sequence_pool,
  sequence_reshape,
  sequence_slice,
  sequence_unpad,
)
from tests.helpers import assert_nested_equal, assert_valid

FAULTED = "This LoDTensor is faulted"

# A few output capacities (tokens, sequences, time), small enough that most
# drawn batches overflow one of them: one compile per capacity and op.
CAPACITIES = [
  Buckets.fixed(tokens=4, sequences=3, time=3),
  Buckets.fixed(tokens=8, sequences=6, time=2),
  Buckets.fixed(tokens=12, sequences=4, time=5),
]


def _ones(lengths, features=()):
  rows = sum(lengths)
  return LoDTensor.from_lengths(
    np.arange(1, rows + 1, dtype=np.float32).reshape(rows, *features)
    if features
    else np.arange(1, rows + 1, dtype=np.float32),
    [lengths],
    buckets=Buckets.fixed(tokens=16, sequences=4, time=6),
  )


def _ids(lengths):
  rows = sum(lengths)
  values = (np.arange(rows) % 5).astype(np.int32)
  return LoDTensor.from_lengths(
    values, [lengths], buckets=Buckets.fixed(tokens=16, sequences=4, time=6)
  )


# Each case: its inputs from the lengths, and the op on them with a `capacity`.
# The inputs are arguments of the jitted call, so that its checks are traced.
_Y2 = Buckets.fixed(tokens=8, sequences=(4, 8), time=(2, 1))
OPS = {
  "sequence_expand(array)": (
    lambda lengths: (np.arange(4.0, dtype=np.float32), _ones(lengths)),
    lambda x, y, capacity: sequence_expand(x, y, capacity=capacity),
  ),
  "sequence_expand(LoDTensor)": (
    lambda lengths: (
      _ones(lengths),
      LoDTensor.from_lengths(
        np.zeros(len(lengths) * 2),
        [[2] * len(lengths), [1] * (2 * len(lengths))],
        buckets=_Y2,
      ),
    ),
    lambda x, y, capacity: sequence_expand(x, y, ref_level=0, capacity=capacity),
  ),
  "sequence_expand_as": (
    lambda lengths: (np.arange(4.0, dtype=np.float32), _ones(lengths)),
    lambda x, y, capacity: sequence_expand_as(x, y, capacity=capacity),
  ),
  "sequence_concat": (
    lambda lengths: (_ones(lengths), _ones(lengths[::-1])),
    lambda a, b, capacity: sequence_concat([a, b], capacity=capacity),
  ),
  "sequence_erase": (
    lambda lengths: (_ids(lengths),),
    lambda x, capacity: sequence_erase(x, [4], capacity=capacity),
  ),
  "sequence_enumerate": (
    lambda lengths: (_ids(lengths),),
    lambda x, capacity: sequence_enumerate(x, 2, capacity=capacity),
  ),
  "sequence_unpad": (
    lambda lengths: (
      np.ones((4, 6, 2), np.float32),
      np.asarray(lengths + [0] * (4 - len(lengths)), np.int32),
      np.int32(len(lengths)),
    ),
    lambda padded, lengths, num, capacity: sequence_unpad(
      padded, lengths, num_sequences=num, capacity=capacity
    ),
  ),
}


def _sizes(x: LoDTensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
  """The real sizes of a sound tensor: tokens, per-level counts and longest."""
  lengths = x.recursive_lengths()
  return (
    sum(lengths[-1]),
    tuple(len(level) for level in lengths),
    tuple(max(level, default=0) for level in lengths),
  )


def _fits(sizes, capacity: Buckets) -> bool:
  tokens, counts, longest = sizes
  levels = range(len(counts))
  return (
    tokens <= capacity.capacity(0, "tokens")
    and all(counts[i] <= capacity.capacity(0, "sequences", i) for i in levels)
    and all(longest[i] <= capacity.capacity(0, "time", i) for i in levels)
  )


@functools.cache
def _jitted(name, which):
  """The op `name` on output capacity `which`, jitted, and jitted under
  checkify: built once, so that the examples of a test share its programs."""
  op, capacity = OPS[name][1], CAPACITIES[which]
  run = lambda *a: op(*a, capacity)  # noqa: E731
  return jax.jit(run), jax.jit(checkify.checkify(run))


@pytest.mark.parametrize("name", sorted(OPS))
@settings(max_examples=12)
@given(
  lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4).filter(
    lambda ls: sum(ls) <= 16
  ),
  which=st.integers(0, len(CAPACITIES) - 1),
)
def test_overflow_under_jit_is_valid_flagged_and_never_read(name, lengths, which):
  make, op = OPS[name]
  capacity = CAPACITIES[which]
  inputs = make(lengths)
  want = op(*inputs, None)  # eager, on the bound: the real output
  fits = _fits(_sizes(want), capacity)
  run, checked = _jitted(name, which)
  got = run(*inputs)
  assert_valid(got)
  assert int(got.faults) == (0 if fits else Fault.CAPACITY)
  if fits:
    assert_nested_equal(got.to_list(), want.to_list())
  else:
    with pytest.raises(ValueError, match=f"{FAULTED} \\(CAPACITY\\)"):
      got.to_list()
    with pytest.raises(ValueError, match=FAULTED):
      got.recursive_lengths()
    assert "faults=CAPACITY" in repr(got)
    # checkify reports the same overflow.
    err, _ = checked(*inputs)
    with pytest.raises(checkify.JaxRuntimeError, match="more .* than its capacity"):
      err.throw()


def test_faults_pass_through_every_op():
  x = jax.jit(lambda x: sequence_expand(np.ones(2, np.float32), x, capacity=2))(
    LoDTensor.from_lengths(np.zeros(5), [[3, 2]])
  )
  assert int(x.faults) == Fault.CAPACITY
  two = LoDTensor.from_lengths(np.ones(2, np.float32), [[1, 1], [1, 1]])
  two = dataclasses.replace(two, faults=np.int32(Fault.TABLE))
  step = lambda h, x_t, _: (h + x_t, h)  # noqa: E731
  zeros = np.zeros(2, np.int32)
  # Under jit: eagerly, the ops that read the LoD raise for a faulted input.
  outputs = {
    "astype": x.astype(jnp.float16),
    "with_values": x.with_values(x.values * 2),
    "sequence_pool (2 levels)": jax.jit(lambda t: sequence_pool(t, "sum"))(two),
    "sequence_slice": jax.jit(lambda x: sequence_slice(x, zeros, zeros))(x),
    "sequence_concat": jax.jit(lambda x: sequence_concat([x, x]))(x),
    "reorder_by_rank": jax.jit(lambda x: reorder_by_rank(x, rank_table(x)))(x),
    "lod_reset": jax.jit(lambda x: lod_reset(x.values, y=x))(x),
    "dynamic_rnn": jax.jit(lambda x: dynamic_rnn(step, x, init_carry=jnp.zeros(2)))(x)[
      0
    ],
  }
  for name, out in outputs.items():
    assert int(out.faults) & int(jnp.asarray(x.faults) | Fault.TABLE) != 0, name
    with pytest.raises(ValueError, match=FAULTED):
      out.to_list()


def _faulted() -> LoDTensor:
  """A tensor whose op overflowed its capacity under jit: rows [3, 3] cut to 4."""
  x = LoDTensor.from_lengths(np.zeros(6, np.float32), [[3, 3]])
  return jax.jit(lambda y: sequence_expand(jnp.ones(2), y, capacity=4))(x)


HOST_READS = {
  "to_list": lambda x: x.to_list(),
  "recursive_lengths": lambda x: x.recursive_lengths(),
  "row_splits": lambda x: x.row_splits(),
  "validate": lambda x: x.validate(),
  "lengths": lambda x: x.lengths(),
  "lengths(0)": lambda x: x.lengths(0),
  "num_sequences": lambda x: x.num_sequences(),
  "num_rows": lambda x: x.num_rows,
  "row_mask": lambda x: x.row_mask(),
  "segment_ids": lambda x: x.segment_ids(),
  "to_padded": lambda x: x.to_padded(),
  "to_segment_ids": lambda x: x.to_segment_ids(),
  "rank_table": rank_table,
  "lod_to_array": lambda x: lod_to_array(x, rank_table(x)),
  "sequence_pool": lambda x: sequence_pool(x, "sum"),
}


@pytest.mark.parametrize("read", sorted(HOST_READS))
def test_every_host_read_of_a_faulted_tensor_raises(read):
  x = _faulted()
  assert int(x.faults) == Fault.CAPACITY
  with pytest.raises(ValueError, match=f"{FAULTED} \\(CAPACITY\\)"):
    HOST_READS[read](x)


@pytest.mark.parametrize("read", ["lengths", "to_padded", "segment_ids", "row_mask"])
def test_the_jittable_reads_of_a_faulted_tensor_work_under_jit(read):
  x = _faulted()
  out = jax.jit(HOST_READS[read])(x)
  sound = dataclasses.replace(x, faults=np.int32(0))
  want = HOST_READS[read](sound)
  for got, expected in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(got, expected)


def test_host_tensors_are_sound_and_faults_are_integer_leaves():
  x = LoDTensor.from_lengths(np.ones((3, 2)), [[2, 1]])
  assert int(x.faults) == 0
  assert jnp.asarray(x.faults).dtype == jnp.int32
  leaves = jax.tree.leaves(x)
  assert len(leaves) == 4  # values, one offsets array, num_outer, faults
  with pytest.raises(TypeError, match="Expected integer faults, got float32"):
    dataclasses.replace(x, faults=np.float32(0))
  assert jaxlod.Fault is Fault
  assert str(x).startswith("LoDTensor(values=float32[3, 2], lod=[[2, 1]]")


# -- rank tables of another batch ---------------------------------------------------

BATCH = Buckets.fixed(tokens=8, sequences=3, time=4)


def _batch(lengths):
  rows = sum(lengths)
  values = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) / 10
  return LoDTensor.from_lengths(values, [lengths], buckets=BATCH)


def _step(h, x_t, _):
  h = jnp.tanh(h + x_t.sum(-1))
  return h, h


@pytest.mark.parametrize("return_sequences", [True, False])
def test_swapped_table_under_jit_is_loud(return_sequences):
  src, tgt = _batch([4, 1, 2]), _batch([1, 4, 2])  # same capacities
  run = jax.jit(
    lambda x, table: dynamic_rnn(
      _step,
      x,
      init_carry=jnp.zeros(3),
      table=table,
      return_sequences=return_sequences,
    )
  )
  good = run(src, rank_table(src))
  bad = run(src, rank_table(tgt))
  carry = good[1] if return_sequences else good
  assert np.all(np.isfinite(carry))
  bad_carry = bad[1] if return_sequences else bad
  assert np.all(np.isnan(bad_carry))
  if return_sequences:
    assert int(good[0].faults) == 0
    assert int(bad[0].faults) == Fault.TABLE
    assert np.all(np.isnan(np.asarray(bad[0].values)))
    with pytest.raises(ValueError, match=r"faulted \(TABLE\)"):
      bad[0].to_list()


def test_swapped_table_in_the_linen_layer_is_loud():
  src, tgt = _batch([4, 1, 2]), _batch([1, 4, 2])
  layer = lnn.DynamicRNN(flax.linen.GRUCell(3))
  params = layer.init(jax.random.key(0), src, table=rank_table(src))
  apply = jax.jit(lambda x, t: layer.apply(params, x, table=t))
  assert int(apply(src, rank_table(src)).faults) == 0
  outputs = apply(src, rank_table(tgt))
  assert int(outputs.faults) == Fault.TABLE
  assert np.all(np.isnan(np.asarray(outputs.values)))


def test_swapped_table_in_the_array_ops_is_loud():
  src, tgt = _batch([4, 1, 2]), _batch([1, 4, 2])
  to_array = jax.jit(lod_to_array)
  assert np.all(np.isfinite(to_array(src, rank_table(src))))
  assert np.all(np.isnan(to_array(src, rank_table(tgt))))
  buffer = to_array(src, rank_table(src))
  back = jax.jit(lambda a, t: array_to_lod(a, t, like=src))(buffer, rank_table(tgt))
  assert int(back.faults) == Fault.TABLE
  reordered = jax.jit(lambda x, t: reorder_by_rank(x, t, check_lengths=True))(
    src, rank_table(tgt)
  )
  assert int(reordered.faults) == Fault.TABLE
  assert_valid(reordered)


# -- other data checks under jit ----------------------------------------------------


def test_reorder_with_another_count_stays_valid():
  x = _batch([4, 1, 0])  # 3 real sequences
  table = rank_table(LoDTensor.from_lengths(np.zeros(3), [[1, 2]], buckets=BATCH))
  out = jax.jit(reorder_by_rank)(x, table)
  assert_valid(out)
  assert int(out.faults) == Fault.INPUT


def test_slice_out_of_range_is_flagged():
  x = _batch([4, 1, 2])
  out = jax.jit(sequence_slice)(
    x, np.array([0, 0, 1], np.int32), np.array([2, 3, 1], np.int32)
  )
  assert_valid(out)
  assert int(out.faults) == Fault.INPUT
  ok = jax.jit(sequence_slice)(
    x, np.array([0, 0, 1], np.int32), np.array([2, 1, 1], np.int32)
  )
  assert int(ok.faults) == 0


def test_lod_reset_with_other_totals_stays_valid():
  x = _batch([1, 1, 1])  # 3 rows of capacity 8
  y = _batch([4, 4, 0])  # 8 rows
  out = jax.jit(lambda x, y: lod_reset(x, y=y))(x, y)
  assert_valid(out)
  assert int(out.faults) == Fault.INPUT


def test_reshape_that_does_not_divide_stays_valid():
  x = LoDTensor.from_lengths(np.ones((5, 2), np.float32), [[3, 2]])
  out = jax.jit(lambda x: sequence_reshape(x, 4))(x)
  assert_valid(out)
  assert int(out.faults) == Fault.INPUT
  assert int(jax.jit(lambda x: sequence_reshape(x, 1))(x).faults) == 0


def test_decoding_from_a_faulted_memory_is_faulted():
  table = jnp.log(jnp.array([[0.1, 0.5, 0.4], [0.6, 0.3, 0.1], [0.5, 0.2, 0.3]]))

  def step(carry, tokens, memory):
    del memory
    return carry, table[tokens]

  settings = DecodeSettings(bos_id=0, eos_id=0, max_length=3, beam_size=2)
  memory = LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[2, 1]])
  run = jax.jit(
    lambda memory: beam_search(step, jnp.zeros(2), settings, static_inputs=memory)
  )
  assert int(run(memory).ids.faults) == 0
  faulted = dataclasses.replace(memory, faults=np.int32(Fault.TABLE))
  ids, scores = run(faulted)
  assert int(ids.faults) == int(scores.faults) == Fault.TABLE
  with pytest.raises(ValueError, match=r"faulted \(TABLE\)"):
    ids.to_list()
