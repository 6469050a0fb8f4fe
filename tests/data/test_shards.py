"""jaxlod.data.Batcher with shards: dealing, stacking, processes and resuming."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings

from jaxlod import Buckets, LoDTensor
from jaxlod.data import Batcher
from jaxlod.ops import rank_table
from tests.helpers import assert_lod_equal

SMALL = Buckets.fixed(tokens=24, sequences=4, time=8)
WIDE = Buckets.fixed(tokens=20, sequences=5, time=8)


def random_examples(n: int, seed: int = 0, longest: int = 8) -> list[tuple]:
  """`n` examples of two fields: int32 ids ``[l0]`` and float32 ``[l1, 3]``."""
  rng = np.random.default_rng(seed)
  examples = []
  for _ in range(n):
    l0, l1 = rng.integers(0, longest + 1, size=2)
    ids = rng.integers(1, 50, size=l0).astype(np.int32)
    vectors = rng.normal(size=(l1, 3)).astype(np.float32)
    examples.append((ids, vectors))
  return examples


def shard(tree, s: int):
  """Shard `s` of a stacked pytree."""
  return jax.tree.map(lambda a: a[s], tree)


def processes(examples, buckets, shards: int, count: int, **kwargs) -> list[Batcher]:
  """One `Batcher` per simulated process."""
  return [
    Batcher(
      examples,
      buckets,
      shards=shards,
      process_index=p,
      process_count=count,
      prefetch=0,
      **kwargs,
    )
    for p in range(count)
  ]


# -- the plan ------------------------------------------------------------------


@st.composite
def sharded_plans(draw):
  """Lengths [n, F], per-field buckets, shards, processes and settings."""
  num_fields = draw(st.integers(1, 2))
  time = draw(st.integers(1, 6))
  buckets = [
    Buckets.fixed(
      tokens=draw(st.integers(time, 3 * time)),
      sequences=draw(st.integers(1, 5)),
      time=time,
    )
    for _ in range(num_fields)
  ]
  n = draw(st.integers(1, 40))
  row = st.lists(st.integers(0, time), min_size=num_fields, max_size=num_fields)
  lengths = np.array(draw(st.lists(row, min_size=n, max_size=n)), np.int64)
  tokens = min(b.capacity(0, "tokens") for b in buckets)
  budget = draw(st.none() | st.integers(max(int(lengths.max()), 1), tokens))
  count = draw(st.integers(1, 3))
  shards = count * draw(st.integers(1, 3))
  settings_ = dict(
    token_budget=budget,
    window=draw(st.integers(1, 12)),
    shuffle=draw(st.booleans()),
    seed=draw(st.integers(0, 3)),
  )
  return lengths, buckets, shards, count, settings_


def examples_of(lengths: np.ndarray) -> list[tuple]:
  return [tuple(np.arange(n, dtype=np.int32) for n in row) for row in lengths]


@settings(max_examples=80)
@given(sharded_plans(), st.integers(0, 2))
def test_plan_invariants(case, epoch):
  lengths, buckets, shards, count, kwargs = case
  batcher = Batcher(
    examples_of(lengths),
    buckets,
    shards=shards,
    process_index=0,
    process_count=count,
    **kwargs,
  )
  plan, dealt = batcher.plan(epoch), batcher.plan_shards(epoch)
  assert batcher.batches_per_epoch(epoch) == len(plan) == len(dealt)
  np.testing.assert_array_equal(np.sort(np.concatenate(plan)), np.arange(len(lengths)))
  costs = lengths.max(axis=1)
  sequences = min(b.capacity(0, "sequences") for b in buckets)
  for indices, parts in zip(plan, dealt, strict=True):
    assert len(parts) == shards
    np.testing.assert_array_equal(indices, np.concatenate(parts))
    for part in parts:
      assert part.dtype == np.int64
      # Within every capacity of a shard.
      assert part.size <= sequences
      for f, b in enumerate(buckets):
        assert lengths[part, f].sum() <= b.capacity(0, "tokens")
      assert costs[part].sum() <= batcher.token_budget
      # Packed in plan order: ascending cost.
      assert np.all(np.diff(costs[part]) >= 0)
    # A shard is empty only in a batch of fewer than `shards` examples.
    if indices.size >= shards:
      assert all(part.size for part in parts)
    # Unshuffled windows are runs of the given order; no batch spans two.
    if not kwargs["shuffle"]:
      assert np.unique(indices // kwargs["window"]).size == 1
  # The same plan whatever the process.
  other = Batcher(
    examples_of(lengths),
    buckets,
    shards=shards,
    process_index=count - 1,
    process_count=count,
    **kwargs,
  )
  for a, b in zip(dealt, other.plan_shards(epoch), strict=True):
    for x, y in zip(a, b, strict=True):
      np.testing.assert_array_equal(x, y)


@settings(max_examples=30)
@given(sharded_plans())
def test_processes_cover_the_epoch_once(case):
  lengths, buckets, shards, count, kwargs = case
  batchers = processes(examples_of(lengths), buckets, shards, count, **kwargs)
  local = shards // count
  streams = [list(b.epoch(0)) for b in batchers]
  plan = batchers[0].plan_shards(0)
  assert all(len(stream) == len(plan) for stream in streams)
  seen = []
  for step, parts in enumerate(plan):
    batches = [stream[step] for stream in streams]
    assert {b.step for b in batches} == {step}
    for p, (batcher, batch) in enumerate(zip(batchers, batches, strict=True)):
      assert batcher.local_shards == range(p * local, (p + 1) * local)
      mine = parts[p * local : (p + 1) * local]
      np.testing.assert_array_equal(batch.indices, np.concatenate(mine))
      np.testing.assert_array_equal(
        np.asarray(batch.fields[0].num_outer), [part.size for part in mine]
      )
      seen.extend(batch.indices.tolist())
    # Together the processes hold the global batch.
    together = np.concatenate([b.indices for b in batches])
    assert sorted(together.tolist()) == sorted(np.concatenate(parts).tolist())
  assert sorted(seen) == list(range(len(lengths)))


def test_one_shard_plans_like_no_shards():
  examples = random_examples(60)
  for kwargs in ({}, {"shuffle": False}, {"window": 7, "seed": 3}):
    plain = Batcher(examples, [SMALL, WIDE], prefetch=0, **kwargs)
    one = Batcher(
      examples,
      [SMALL, WIDE],
      prefetch=0,
      shards=1,
      process_index=0,
      process_count=1,
      **kwargs,
    )
    for e in range(2):
      plan = plain.plan(e)
      assert len(one.plan_shards(e)) == len(plan)
      for a, b, parts in zip(plan, one.plan(e), one.plan_shards(e), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, parts[0])
    for x, y in zip(plain.epoch(0), one.epoch(0), strict=True):
      np.testing.assert_array_equal(x.indices, y.indices)
      assert (x.epoch, x.step, x.num_tokens) == (y.epoch, y.step, y.num_tokens)
      for fx, fy in zip(x.fields, y.fields, strict=True):
        assert_lod_equal(shard(fy, 0), jax.device_get(fx))


def test_plan_shards_without_shards_is_one_shard_per_batch():
  batcher = Batcher(random_examples(30), SMALL)
  assert batcher.shards is None and batcher.local_shards is None
  for indices, parts in zip(batcher.plan(0), batcher.plan_shards(0), strict=True):
    assert len(parts) == 1
    np.testing.assert_array_equal(indices, parts[0])


# -- balance -------------------------------------------------------------------


@pytest.mark.parametrize("shards", [2, 4, 8])
@pytest.mark.parametrize("bound", ["tokens", "sequences"])
def test_shards_of_full_batches_hold_equal_work(shards, bound):
  """Words of 5-15 letters, about 64 a shard: real tokens within 5%."""
  rng = np.random.default_rng(shards)
  lengths = rng.integers(5, 16, size=64 * shards * 6)
  examples = [(np.ones(n, np.int32),) for n in lengths]
  if bound == "tokens":  # 64 words of mean length 10, room for more.
    buckets = Buckets.fixed(tokens=640, sequences=96, time=16)
  else:  # 64 words, whatever their lengths.
    buckets = Buckets.fixed(tokens=64 * 15, sequences=64, time=16)
  window = 64 * shards * 2
  batcher = Batcher(examples, buckets, shuffle=False, window=window, shards=shards)
  plan = batcher.plan_shards(0)
  windows = [np.concatenate(parts).min() // window for parts in plan]
  ratios = []
  for parts, here, after in zip(plan, windows, windows[1:], strict=False):
    if here != after:
      continue  # The last batch of a window holds what is left.
    tokens = np.array([lengths[part].sum() for part in parts])
    assert tokens.min() > 0
    ratios.append(tokens.max() / tokens.mean())
  assert len(ratios) >= 3
  assert max(ratios) <= 1.05, max(ratios)


def test_lpt_dealing_balances_mixed_lengths():
  # One window holds one global batch: unsorted lengths 1-40 dealt to 4
  # shards; the greedy run alone would leave the shards far apart.
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 41, size=64)
  examples = [(np.ones(n, np.int32),) for n in lengths]
  buckets = Buckets.fixed(tokens=1000, sequences=16, time=40)
  batcher = Batcher(examples, buckets, shuffle=False, window=64, shards=4)
  (parts,) = batcher.plan_shards(0)
  tokens = np.array([lengths[part].sum() for part in parts])
  assert [part.size for part in parts] == [16] * 4
  assert tokens.max() - tokens.min() <= 40


# -- building batches ----------------------------------------------------------


def test_stacked_shapes_and_capacities():
  examples = random_examples(80)
  batchers = processes(examples, [SMALL, WIDE], 4, 2)
  assert batchers[1].shards == 4
  for batch in batchers[1].epoch(0):
    ids, vectors = batch.fields
    assert ids.values.shape == (2, 24) and vectors.values.shape == (2, 20, 3)
    assert ids.offsets[0].shape == (2, 5) and vectors.offsets[0].shape == (2, 6)
    assert ids.num_outer.shape == vectors.num_outer.shape == (2,)
    assert ids.time_capacity == vectors.time_capacity == (8,)
    counts = np.asarray(ids.num_outer)
    np.testing.assert_array_equal(counts, np.asarray(vectors.num_outer))
    assert batch.indices.dtype == np.int64 and batch.indices.size == counts.sum()
    assert batch.num_tokens == sum(
      examples[i][0].shape[0] + examples[i][1].shape[0] for i in batch.indices
    )
    for table, capacity in zip(batch.tables, (4, 5), strict=True):
      assert table.order.shape == (2, capacity) and table.count.shape == (2,)
    leaves = jax.tree.leaves((batch.fields, batch.tables))
    assert all(isinstance(a, np.ndarray) for a in leaves)


def test_shards_decode_to_their_examples_and_tables():
  examples = random_examples(50, seed=1)
  buckets = [SMALL, WIDE]
  ladder = (4, 2)
  (batcher,) = processes(examples, buckets, 3, 1, ladder=ladder, tables=(True, False))
  for batch in batcher.epoch(1):
    counts = np.asarray(batch.fields[0].num_outer)
    assert counts.shape == (3,)
    starts = np.concatenate([[0], np.cumsum(counts)])
    assert batch.tables[1] is None
    for s in range(3):
      mine = batch.indices[starts[s] : starts[s + 1]]
      for f, (field, b) in enumerate(zip(batch.fields, buckets, strict=True)):
        x = shard(field, s)
        rows = [examples[i][f] for i in mine]
        assert len(x.to_list()) == len(rows)
        for got, want in zip(x.to_list(), rows, strict=True):
          np.testing.assert_array_equal(got, want)
        expected = LoDTensor.from_sequences(
          rows or [examples[0][f][:0]], buckets=b, dtype=examples[0][f].dtype
        )
        if rows:
          assert_lod_equal(x, expected)
      want = rank_table(shard(batch.fields[0], s), ladder=ladder)
      got = shard(batch.tables[0], s)
      assert got.ladder == want.ladder == (4, 2)
      for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, e)


def test_a_few_examples_leave_shards_empty():
  examples = [(np.arange(n),) for n in (3, 1, 2)]
  (batcher,) = processes(examples, SMALL, 4, 1, shuffle=False)
  # LPT: the longest first, each to an empty shard.
  assert [p.tolist() for p in batcher.plan_shards(0)[0]] == [[0], [2], [1], []]
  (batch,) = batcher.epoch(0)
  assert np.asarray(batch.fields[0].num_outer).tolist() == [1, 1, 1, 0]
  assert batch.indices.tolist() == [0, 2, 1]
  assert shard(batch.fields[0], 3).to_list() == []
  assert int(batch.tables[0].count[3]) == 0


def test_default_process_is_this_one():
  batcher = Batcher(random_examples(20), SMALL, shards=jax.process_count() * 2)
  assert batcher.local_shards == range(
    2 * jax.process_index(), 2 * jax.process_index() + 2
  )
  batch = next(iter(batcher.epoch(0)))
  assert isinstance(batch.fields[0].values, np.ndarray)  # No device_put.
  explicit = Batcher(random_examples(20), SMALL, shards=2, device_put=False)
  assert isinstance(next(iter(explicit.epoch(0))).fields[0].values, np.ndarray)
  # Without shards, device_put=None puts the batch on the device as before.
  plain = Batcher(random_examples(20), SMALL, device_put=None)
  assert isinstance(next(iter(plain.epoch(0))).fields[0].values, jax.Array)


# -- epochs, steps and resuming ------------------------------------------------


def test_iterate_resumes_every_process():
  examples = random_examples(60)
  for batcher in processes(examples, SMALL, 4, 2, window=16):
    counts = [batcher.batches_per_epoch(e) for e in range(3)]
    stream = list(itertools.islice(batcher.iterate(), sum(counts)))
    assert [b.step for b in stream] == list(range(sum(counts)))
    for start in (1, counts[0] - 1, counts[0], counts[0] + counts[1] + 1):
      resumed = list(itertools.islice(batcher.iterate(start_step=start), 3))
      for x, y in zip(resumed, stream[start : start + 3], strict=True):
        np.testing.assert_array_equal(x.indices, y.indices)
        assert (x.epoch, x.step, x.num_tokens) == (y.epoch, y.step, y.num_tokens)
        for a, b in zip(
          jax.tree.leaves((x.fields, x.tables)),
          jax.tree.leaves((y.fields, y.tables)),
          strict=True,
        ):
          np.testing.assert_array_equal(a, b)
  # Prefetching on a thread gives the same batches.
  threaded = Batcher(
    examples, SMALL, shards=4, process_index=1, process_count=2, window=16
  )
  plain = processes(examples, SMALL, 4, 2, window=16)[1]
  for x, y in zip(
    itertools.islice(threaded.iterate(3), 8),
    itertools.islice(plain.iterate(3), 8),
    strict=True,
  ):
    np.testing.assert_array_equal(x.indices, y.indices)


# -- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"shards": 0}, ValueError, r"^Expected `shards` to be an int >= 1, got 0\.$"),
    ({"shards": 2.0}, TypeError, "`shards` to be an int >= 1, got 2.0"),
    ({"shards": True}, TypeError, "`shards` to be an int >= 1, got True"),
    (
      {"shards": 3, "process_index": 0, "process_count": 2},
      ValueError,
      r"^Expected `shards` \(3\) to be a multiple of the process count \(2\)\.$",
    ),
    (
      {"shards": 4, "process_index": 2, "process_count": 2},
      ValueError,
      r"`process_index` in \[0, 2\) \(the process count\), got 2",
    ),
    (
      {"shards": 4, "process_index": -1, "process_count": 2},
      ValueError,
      "`process_index` to be an int >= 0, got -1",
    ),
    (
      {"shards": 4, "process_index": 0, "process_count": 0},
      ValueError,
      "`process_count` to be an int >= 1, got 0",
    ),
    (
      {"shards": 4, "process_index": "0", "process_count": 2},
      TypeError,
      "`process_index` to be an int >= 0, got '0'",
    ),
    (
      {"shards": 4, "process_index": 0, "process_count": 2.0},
      TypeError,
      "`process_count` to be an int >= 1, got 2.0",
    ),
    (
      {"process_index": 0},
      ValueError,
      "`process_index` to be None without `shards`, got 0; set `shards`",
    ),
    (
      {"process_count": 2},
      ValueError,
      "`process_count` to be None without `shards`, got 2; set `shards`",
    ),
    (
      {"shards": 2, "device_put": True},
      ValueError,
      r"`device_put` to be False or None with `shards`, got True: .* use "
      r"jaxlod\.parallel\.shard_batch",
    ),
  ],
)
def test_argument_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    Batcher(random_examples(5), SMALL, **kwargs)


def test_method_argument_errors():
  (batcher,) = processes(random_examples(5), SMALL, 2, 1)
  with pytest.raises(ValueError, match="`epoch` to be an int >= 0, got -1"):
    batcher.plan_shards(-1)
  with pytest.raises(TypeError, match="`epoch` to be an int >= 0, got 0.5"):
    batcher.plan(0.5)
