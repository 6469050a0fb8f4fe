"""A stacked batch (a `Batcher(shards=S)` field: shards on a leading axis) is a
LoDTensor state that every method and op recognises: the shape answers are
each shard's, `validate` checks every shard, and the reads of one LoD and the
ops raise, saying to take a shard. Every op's argument is covered by the
catalogue of tests/test_api_inputs.py (the "stacked" wrong input)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod import Buckets, LoDTensor, ops
from jaxlod.data import Batcher
from jaxlod.parallel import unstack

STACKED = r"This LoDTensor holds {} shards stacked on leading axes \({},\)"
ARGUMENT = r"Expected `x` to be one LoDTensor, got {} shards stacked on leading axes"

# Answers of each shard, equal to taking each shard first.
PER_SHARD = {
  "capacity": lambda x: x.capacity,
  "feature_shape": lambda x: x.feature_shape,
  "num_levels": lambda x: x.num_levels,
  "time_capacity": lambda x: x.time_capacity,
  "astype": lambda x: x.astype(jnp.float16),
  "with_values": lambda x: x.with_values(np.asarray(x.values) * 2),
  "validate": lambda x: x.validate(),
}
# Reads of one LoD: they raise for stacked shards.
READS = {
  "lengths": lambda x: x.lengths(),
  "num_sequences": lambda x: x.num_sequences(),
  "num_rows": lambda x: x.num_rows,
  "row_mask": lambda x: x.row_mask(),
  "segment_ids": lambda x: x.segment_ids(),
  "to_padded": lambda x: x.to_padded(),
  "to_segment_ids": lambda x: x.to_segment_ids(),
  "recursive_lengths": lambda x: x.recursive_lengths(),
  "row_splits": lambda x: x.row_splits(),
  "to_list": lambda x: x.to_list(),
}
FIELDS = {"values", "offsets", "num_outer", "faults", "stack_shape"}
BUILDERS = {
  "from_lengths",
  "from_offsets",
  "from_padded",
  "from_row_splits",
  "from_segment_ids",
  "from_sequences",
}
OPS = {
  "sequence_pool": lambda x: ops.sequence_pool(x, "sum"),
  "sequence_softmax": ops.sequence_softmax,
  "sequence_reverse": ops.sequence_reverse,
  "sequence_first_step": ops.sequence_first_step,
  "sequence_last_step": ops.sequence_last_step,
  "sequence_pad": lambda x: ops.sequence_pad(x, 0.0),
  "sequence_enumerate": lambda x: ops.sequence_enumerate(x.astype(jnp.int32), 2),
  "rank_table": ops.rank_table,
}


def _stacked(shards: int, lengths: list[int]) -> LoDTensor:
  examples = [(np.arange(1, n + 1, dtype=np.float32),) for n in lengths]
  buckets = Buckets.fixed(
    tokens=max(sum(lengths), 1), sequences=len(lengths), time=max(max(lengths), 1)
  )
  batcher = Batcher(examples, buckets, shards=shards, shuffle=False, prefetch=0)
  return next(batcher.iterate()).fields[0]


def _same(a, b) -> None:
  if isinstance(a, LoDTensor):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
      assert np.asarray(u).dtype == np.asarray(v).dtype
  else:
    assert a == b


def test_every_public_member_is_classified():
  x = LoDTensor.from_lengths(np.ones(3), [[2, 1]])
  members = {n for n in dir(x) if not n.startswith("_")}
  assert members == set(PER_SHARD) | set(READS) | FIELDS | BUILDERS


def test_the_issue_reproductions():
  """A `Batcher(shards=4)` field: `capacity` reported the shard count as its
  tokens, `num_rows` another shard's offsets, `sequence_pool` and `to_list`
  bare NumPy and JAX errors."""
  x = _stacked(4, [5, 5, 5, 5])
  assert x.stack_shape == (4,)
  assert x.capacity == unstack(x)[0].capacity
  assert x.capacity.tokens == 20
  with pytest.raises(ValueError, match=STACKED.format(4, 4)):
    x.num_rows  # noqa: B018
  with pytest.raises(ValueError, match=STACKED.format(4, 4)):
    x.to_list()
  with pytest.raises(ValueError, match=ARGUMENT.format(4)):
    ops.sequence_pool(x, "sum")
  assert "shards=(4,)" in repr(x)


def test_validate_checks_every_shard():
  x = _stacked(2, [3, 1, 2, 2])
  x.validate()
  offsets = np.array(x.offsets[0])
  offsets[1, -1] = x.capacity.tokens + 1  # shard 1: a last offset past the rows
  broken = dataclasses.replace(x, offsets=(offsets,))
  with pytest.raises(ValueError, match=r"shard \(1,\): LoD level 0"):
    broken.validate()


@settings(max_examples=8, deadline=None)
@given(
  shards=st.integers(1, 4),
  lengths=st.lists(st.integers(0, 6), min_size=4, max_size=9),
)
def test_a_stacked_batch_gives_per_shard_answers_or_the_clear_error(shards, lengths):
  x = _stacked(shards, lengths)
  parts = unstack(x)
  assert x.stack_shape == (shards,) and len(parts) == shards
  for name, read in PER_SHARD.items():
    whole = read(x)
    if name == "validate":
      continue  # passed for the whole: every shard is valid
    if isinstance(whole, LoDTensor):
      for s, part in enumerate(unstack(whole)):
        _same(part, read(parts[s]))
    else:
      for part in parts:
        _same(whole, read(part))
  for read in READS.values():
    with pytest.raises(ValueError, match=STACKED.format(shards, shards)):
      read(x)
    read(parts[0])  # each shard answers
  for op in OPS.values():
    with pytest.raises(ValueError, match=ARGUMENT.format(shards)):
      op(x)
    op(parts[0])


@pytest.mark.parametrize("name", sorted(OPS))
def test_under_jit_a_stacked_batch_raises_at_trace_time(name):
  x = _stacked(2, [3, 1, 2, 2])
  with pytest.raises(ValueError, match=ARGUMENT.format(2)):
    jax.jit(OPS[name])(x)
  with pytest.raises(ValueError, match=STACKED.format(2, 2)):
    jax.jit(lambda x: x.num_rows)(x)


def test_a_tree_map_that_breaks_the_lod_raises_on_reads():
  """An integer tree map doubles the offsets: host reads and eager ops run
  `validate`'s check instead of reporting lengths past the rows."""
  x = LoDTensor.from_lengths(np.arange(1, 6), [[3, 2]])
  doubled = jax.tree.map(lambda a: a * 2, x)
  message = r"LoD level 0: `num_outer` is 4, outside \[0, 2\]"
  for read in READS.values():
    with pytest.raises(ValueError, match=message):
      read(doubled)
  for op in OPS.values():
    with pytest.raises(ValueError, match="`x`: " + message):
      op(doubled)
  # The LoD alone doubled (num_outer kept): offsets past the rows.
  offsets = dataclasses.replace(x, offsets=(np.asarray(x.offsets[0]) * 2,))
  with pytest.raises(ValueError, match=r"a sequence of length 6, more than the time"):
    offsets.recursive_lengths()
  with pytest.raises(ValueError, match=r"`x`: LoD level 0"):
    ops.rank_table(offsets)
