"""jaxlod.data.Batcher: plans, packing, capacities, resuming and prefetch."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import traceback

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jaxlod import Buckets, LoDTensor
from jaxlod.data import Batch, Batcher
from jaxlod.data._batcher import _THREAD_NAME
from jaxlod.ops import normalize_ladder, rank_table
from tests.helpers import assert_lod_equal

SMALL = Buckets.fixed(tokens=24, sequences=4, time=8)


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


def live_workers() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == _THREAD_NAME]


def same_batches(a: list[Batch], b: list[Batch]) -> None:
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x.indices, y.indices)
    assert (x.epoch, x.step, x.num_tokens) == (y.epoch, y.step, y.num_tokens)
    for fx, fy in zip(x.fields, y.fields, strict=True):
      assert_lod_equal(fx, fy)


# -- the plan ------------------------------------------------------------------


@st.composite
def plans(draw):
  """Lengths [n, F], per-field buckets, and Batcher settings."""
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
  n = draw(st.integers(1, 30))
  row = st.lists(st.integers(0, time), min_size=num_fields, max_size=num_fields)
  lengths = np.array(draw(st.lists(row, min_size=n, max_size=n)), np.int64)
  longest = int(lengths.max())
  tokens = min(b.capacity(0, "tokens") for b in buckets)
  budget = draw(st.none() | st.integers(max(longest, 1), tokens))
  settings_ = dict(
    token_budget=budget,
    window=draw(st.integers(1, 8)),
    shuffle=draw(st.booleans()),
    seed=draw(st.integers(0, 3)),
  )
  return lengths, buckets, settings_


def examples_of(lengths: np.ndarray) -> list[tuple]:
  return [tuple(np.arange(n, dtype=np.int32) for n in row) for row in lengths]


@settings(max_examples=100)
@given(plans(), st.integers(0, 2))
def test_plan_invariants(case, epoch):
  lengths, buckets, kwargs = case
  batcher = Batcher(examples_of(lengths), buckets, prefetch=0, **kwargs)
  plan = batcher.plan(epoch)
  assert batcher.batches_per_epoch(epoch) == len(plan)
  # Every example exactly once.
  np.testing.assert_array_equal(np.sort(np.concatenate(plan)), np.arange(len(lengths)))
  costs = lengths.max(axis=1)
  budget = kwargs["token_budget"] or min(b.capacity(0, "tokens") for b in buckets)
  assert batcher.token_budget == budget
  for indices in plan:
    assert indices.dtype == np.int64
    assert 1 <= indices.size <= min(b.capacity(0, "sequences") for b in buckets)
    for f, b in enumerate(buckets):
      assert lengths[indices, f].sum() <= b.capacity(0, "tokens")
    assert costs[indices].sum() <= budget
  # Deterministic: a second batcher with other prefetch settings agrees.
  again = Batcher(examples_of(lengths), buckets, prefetch=3, **kwargs)
  for a, b in zip(plan, again.plan(epoch), strict=True):
    np.testing.assert_array_equal(a, b)


@settings(max_examples=60)
@given(plans())
def test_unshuffled_plan_is_sorted_windows_cut_greedily(case):
  lengths, buckets, kwargs = case
  kwargs["shuffle"] = False
  batcher = Batcher(examples_of(lengths), buckets, prefetch=0, **kwargs)
  plan = batcher.plan(0)
  costs, window, n = lengths.max(axis=1), kwargs["window"], len(lengths)
  expected = np.concatenate(
    [
      start + np.argsort(costs[start : start + window], stable=True)
      for start in range(0, n, window)
    ]
  )
  np.testing.assert_array_equal(np.concatenate(plan), expected)
  # No batch spans two windows.
  stops = np.cumsum([p.size for p in plan])
  starts = stops - [p.size for p in plan]
  np.testing.assert_array_equal(starts // window, (stops - 1) // window)
  # Greedy: a batch ends at a window boundary or where the next example does
  # not fit.
  budget = batcher.token_budget
  for indices, stop in zip(plan[:-1], stops[:-1], strict=True):
    if stop % window == 0:
      continue
    grown = np.append(indices, expected[stop])
    over_tokens = any(
      lengths[grown, f].sum() > b.capacity(0, "tokens") for f, b in enumerate(buckets)
    )
    over_count = grown.size > min(b.capacity(0, "sequences") for b in buckets)
    assert over_tokens or over_count or costs[grown].sum() > budget
  # Every epoch and every seed has the same unshuffled plan.
  other = Batcher(examples_of(lengths), buckets, prefetch=0, **{**kwargs, "seed": 9})
  for a, b in zip(plan, other.plan(5), strict=True):
    np.testing.assert_array_equal(a, b)


def test_seed_and_epoch_change_the_plan():
  examples = random_examples(200)
  plan = Batcher(examples, SMALL, seed=0).plan(0)

  def same(a, b):
    return len(a) == len(b) and all(
      np.array_equal(x, y) for x, y in zip(a, b, strict=True)
    )

  assert same(plan, Batcher(examples, SMALL, seed=0).plan(0))
  assert not same(plan, Batcher(examples, SMALL, seed=1).plan(0))
  assert not same(plan, Batcher(examples, SMALL, seed=0).plan(1))


def test_sorting_groups_similar_lengths():
  rng = np.random.default_rng(0)
  examples = [(np.ones(n, np.int32),) for n in rng.integers(1, 31, size=512)]
  buckets = Buckets.fixed(tokens=256, sequences=8, time=32)

  def mean_spread(window):
    plan = Batcher(examples, buckets, window=window).plan(0)
    spreads = [np.ptp([examples[i][0].size for i in p]) for p in plan]
    return float(np.mean(spreads))

  # Windows of 8 hold one batch each: unsorted examples, a spread near the
  # expected range of 8 draws from 1..30 (about 23).
  sorted_spread, unsorted_spread = mean_spread(512), mean_spread(8)
  assert unsorted_spread > 15
  assert sorted_spread < 0.1 * unsorted_spread


def test_token_budget_caps_batches_below_the_capacity():
  examples = [(np.ones(n, np.int32), np.ones(2 * n, np.int32)) for n in range(1, 9)]
  buckets = [
    Buckets.fixed(tokens=40, sequences=8, time=8),
    Buckets.fixed(tokens=60, sequences=8, time=16),
  ]
  default = Batcher(examples, buckets, shuffle=False)
  assert default.token_budget == 40
  capped = Batcher(examples, buckets, shuffle=False, token_budget=20)
  # Costs are the second field's lengths 2, 4, ..., 16.
  assert [p.tolist() for p in capped.plan(0)] == [[0, 1, 2, 3], [4], [5], [6], [7]]
  assert [p.tolist() for p in default.plan(0)] == [[0, 1, 2, 3, 4], [5, 6], [7]]


# -- building batches ----------------------------------------------------------


@pytest.mark.parametrize("device_put", [True, False])
def test_batches_round_trip_to_the_examples(device_put):
  examples = random_examples(40)
  buckets = [SMALL, Buckets.fixed(tokens=20, sequences=5, time=8)]
  batcher = Batcher(examples, buckets, prefetch=0, device_put=device_put)
  seen = []
  for batch in batcher.epoch(0):
    assert isinstance(batch, Batch)
    seen.extend(batch.indices.tolist())
    assert batch.num_tokens == sum(
      examples[i][0].shape[0] + examples[i][1].shape[0] for i in batch.indices
    )
    for f, (field, b) in enumerate(zip(batch.fields, buckets, strict=True)):
      assert isinstance(field.values, jax.Array if device_put else np.ndarray)
      rows = [examples[i][f] for i in batch.indices]
      expected = LoDTensor.from_sequences(rows, buckets=b, dtype=rows[0].dtype)
      assert_lod_equal(field, expected)
      assert field.values.dtype == (np.int32 if f == 0 else np.float32)
      for got, want in zip(field.to_list(), rows, strict=True):
        np.testing.assert_array_equal(got, want)
  assert sorted(seen) == list(range(40))


def test_without_device_put_batches_are_host_work_only():
  """``device_put=False``: fields and tables built with NumPy, no transfer."""
  batcher = Batcher(random_examples(30), SMALL, prefetch=0, device_put=False)
  with jax.transfer_guard("disallow"):
    batches = list(batcher.epoch(0))
  leaves = jax.tree.leaves([(b.fields, b.tables) for b in batches])
  assert leaves and all(isinstance(a, np.ndarray | np.generic) for a in leaves)


def test_tables_are_the_rank_tables_of_the_fields():
  ladder = (4, 2)
  batcher = Batcher(random_examples(30), SMALL, ladder=ladder, prefetch=0)
  for batch in batcher.epoch(1):
    for field, table in zip(batch.fields, batch.tables, strict=True):
      assert table.ladder == normalize_ladder(4, ladder) == (4, 2)
      expected = rank_table(field, ladder=ladder)
      for got, want in zip(
        jax.tree.leaves(table), jax.tree.leaves(expected), strict=True
      ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tables_only_for_the_chosen_fields():
  """`tables` skips fields nothing ranks: their entries are None, no work."""
  examples = random_examples(30)
  everything = list(Batcher(examples, SMALL, prefetch=0).epoch(0))
  for tables, kept in (((True, False), (0,)), ([False, True], (1,)), (False, ())):
    batcher = Batcher(examples, SMALL, prefetch=0, tables=tables)
    for batch, full in zip(batcher.epoch(0), everything, strict=True):
      assert_lod_equal(batch.fields[0], full.fields[0])
      for f in range(2):
        if f not in kept:
          assert batch.tables[f] is None
          continue
        for got, want in zip(
          jax.tree.leaves(batch.tables[f]), jax.tree.leaves(full.tables[f]), strict=True
        ):
          np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_field_dtype_ignores_empty_examples():
  # `np.asarray([])` is float64; it must not turn integer ids into floats.
  examples = [([], [1, 2]), ([3], []), ([], [4])]
  batch = next(iter(Batcher(examples, SMALL, shuffle=False, prefetch=0).epoch(0)))
  assert batch.fields[0].values.dtype == batch.fields[1].values.dtype == jnp.int32
  # Sorted by cost (the longest field): example 1 and 2 cost 1, example 0 costs 2.
  assert batch.indices.tolist() == [1, 2, 0]
  assert batch.fields[0].recursive_lengths() == [[1, 0, 0]]
  assert batch.fields[1].to_list()[2].tolist() == [1, 2]


def test_zero_width_fields():
  # `reshape(-1, *features)` of an example [length, 0] divided by zero.
  examples = [(np.zeros((2, 0)),), (np.zeros((1, 0)),), (np.zeros(0),)]
  batch = next(iter(Batcher(examples, SMALL, shuffle=False, prefetch=0).epoch(0)))
  assert batch.fields[0].values.shape == (SMALL.capacity(0, "tokens"), 0)
  assert sorted(batch.fields[0].recursive_lengths()[0]) == [0, 1, 2]


def test_a_jitted_step_compiles_once():
  @jax.jit
  def step(fields, tables):
    return sum(jnp.sum(x.values) for x in fields) + sum(t.max_length for t in tables)

  examples = random_examples(60, longest=8)
  batcher = Batcher(examples, [SMALL, Buckets.fixed(tokens=30, sequences=6, time=8)])
  lengths = set()
  for batch in batcher.epoch(0):
    step(batch.fields, batch.tables)
    lengths.add(tuple(batch.fields[0].recursive_lengths()[0]))
  assert len(lengths) > 5
  assert step._cache_size() == 1


# -- epochs, steps and resuming ------------------------------------------------


def test_iterate_resumes_across_epoch_boundaries():
  batcher = Batcher(random_examples(30), SMALL, prefetch=0, window=8)
  counts = [batcher.batches_per_epoch(e) for e in range(3)]
  stream = list(itertools.islice(batcher.iterate(), sum(counts)))
  assert [b.step for b in stream] == list(range(sum(counts)))
  assert [b.epoch for b in stream] == [
    e for e, c in enumerate(counts) for _ in range(c)
  ]
  for start in (0, 1, counts[0] - 1, counts[0], counts[0] + counts[1] - 2):
    resumed = list(itertools.islice(batcher.iterate(start_step=start), 4))
    same_batches(resumed, stream[start : start + 4])
  # epoch(e) yields the same batches, with the same global steps.
  same_batches(list(batcher.epoch(1)), stream[counts[0] : counts[0] + counts[1]])
  # Every example once per epoch.
  for e in range(3):
    indices = np.concatenate([b.indices for b in stream if b.epoch == e])
    np.testing.assert_array_equal(np.sort(indices), np.arange(30))


def test_unshuffled_iterate_resumes():
  batcher = Batcher(random_examples(20), SMALL, shuffle=False, prefetch=0)
  count = batcher.batches_per_epoch(0)
  stream = list(itertools.islice(batcher.iterate(), 3 * count))
  assert stream[2 * count].epoch == 2
  same_batches(
    list(itertools.islice(batcher.iterate(count + 1), count + 1)),
    stream[count + 1 : 2 * count + 2],
  )
  # Every epoch is epoch 0: a far epoch or step is planned at once.
  same_batches(list(batcher.epoch(2)), stream[2 * count : 3 * count])
  far = 2**40
  assert next(batcher.epoch(far)).step == far * count
  first = next(batcher.iterate(start_step=far * count + 1))
  assert (first.epoch, first.step) == (far, far * count + 1)


def test_prefetch_gives_the_same_batches():
  examples = random_examples(40)
  batches = {}
  for prefetch in (0, 2):
    batcher = Batcher(examples, SMALL, prefetch=prefetch, seed=3)
    batches[prefetch] = list(itertools.islice(batcher.iterate(start_step=5), 25))
  same_batches(batches[0], batches[2])


# -- the worker thread ---------------------------------------------------------


def test_worker_errors_reach_the_consumer(monkeypatch):
  batcher = Batcher(random_examples(40), SMALL, prefetch=2)
  build = batcher._build

  def failing_build(epoch, step, indices):
    if step == 3:
      raise RuntimeError(f"cannot build step {step}")
    return build(epoch, step, indices)

  monkeypatch.setattr(batcher, "_build", failing_build)
  steps = []
  with pytest.raises(RuntimeError, match="cannot build step 3") as info:
    for batch in batcher.iterate():
      steps.append(batch.step)
  assert steps == [0, 1, 2]
  # The traceback still shows where the worker failed.
  frames = traceback.extract_tb(info.value.__traceback__)
  assert "failing_build" in [frame.name for frame in frames]
  assert not live_workers()


def test_leaving_early_stops_the_worker():
  batcher = Batcher(random_examples(200), SMALL, prefetch=2)
  for _ in batcher.iterate():
    break
  assert not live_workers()

  held = batcher.epoch(0)
  next(held)
  assert len(live_workers()) == 1
  held.close()
  assert not live_workers()

  held = batcher.iterate(7)
  assert next(held).step == 7
  del held  # Garbage collection closes the generator.
  assert not live_workers()


EXIT_WITH_BUSY_WORKERS = """
import numpy as np
from jaxlod import Buckets
from jaxlod.data import Batcher
examples = [(np.arange(1 + i % 7),) for i in range(2000)]
buckets = Buckets.fixed(tokens=64, sequences=16, time=8)
batcher = Batcher(examples, buckets, prefetch=10**5)
held = [batcher.iterate() for _ in range(4)]
for iterator in held:
  next(iterator)
"""


def test_interpreter_exit_with_busy_workers():
  # Workers still building (inside `jax.device_put`) when the interpreter
  # exits must be stopped first; a daemon thread killed inside a JAX call
  # aborts the process.
  result = subprocess.run(
    [sys.executable, "-c", EXIT_WITH_BUSY_WORKERS],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert (result.returncode, result.stderr) == (0, "")


def test_prefetch_zero_starts_no_thread():
  batcher = Batcher(random_examples(20), SMALL, prefetch=0)
  iterator = batcher.iterate()
  next(iterator)
  assert not live_workers()


# -- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
  ("examples", "buckets", "kwargs", "error", "match"),
  [
    ([], SMALL, {}, ValueError, "`examples` to hold at least one example, got none"),
    ((x for x in [([1],)]), SMALL, {}, TypeError, "a sequence of examples, got gen"),
    ([[1, 2]], SMALL, {}, ValueError, r"field 0 of example 0 to have rank >= 1"),
    ([np.ones(3)], SMALL, {}, TypeError, "example 0 to be a tuple of fields, got nd"),
    ([()], SMALL, {}, ValueError, "example 0 to have at least one field, got none"),
    (
      [([1], [2]), ([1], [2]), ([1],)],
      SMALL,
      {},
      ValueError,
      "every example to have 2 fields like example 0, got 1 in example 2",
    ),
    (
      [([1], [2])],
      [SMALL] * 3,
      {},
      ValueError,
      r"one Buckets per field \(2\) in `buckets`, got 3",
    ),
    ([([1],)], "fixed", {}, TypeError, "`buckets` to be a Buckets or a sequence"),
    ([([1],)], [None], {}, TypeError, r"`buckets\[0\]` to be a Buckets, got None"),
    (
      [([1], [2])],
      [SMALL, Buckets.pow2()],
      {},
      ValueError,
      r"`buckets\[1\]` to be Buckets.fixed\(...\), so that .* got policy 'pow2'",
    ),
    (
      [([1],)],
      Buckets.fixed(tokens=8, sequences=0, time=4),
      {},
      ValueError,
      "`buckets` to hold at least one sequence, got a sequences capacity of 0",
    ),
    ([([1],)], SMALL, {"window": 0}, ValueError, "`window` to be an int >= 1, got 0"),
    (
      [([1],)],
      SMALL,
      {"window": 2.0},
      TypeError,
      "`window` to be an int >= 1, got 2.0",
    ),
    ([([1],)], SMALL, {"prefetch": -1}, ValueError, "`prefetch` to be an int >= 0"),
    ([([1],)], SMALL, {"token_budget": 0}, ValueError, "`token_budget` to be an int"),
    ([([1],)], SMALL, {"seed": -1}, ValueError, "`seed` to be an int >= 0, got -1"),
    ([([1],)], SMALL, {"seed": True}, TypeError, "`seed` to be an int >= 0, got True"),
    ([([1],)], SMALL, {"ladder": [9]}, ValueError, r"`ladder\[0\]` in \[1, 4\]"),
    (
      [(np.ones((2, 3)),), (np.ones((0, 5)),), (np.ones((1, 2)),)],
      SMALL,
      {},
      ValueError,
      r"field 0 of example 2 to have feature shape \(3,\) like example 0, got \(2,\)",
    ),
    ([(["a", "b"],)], SMALL, {}, TypeError, "field 0 to hold numbers, got dtype <U1"),
    (
      [([1], [2])],
      SMALL,
      {"tables": (True,)},
      ValueError,
      r"`tables` to be a bool or one bool per field \(2\), got 1 entries",
    ),
    (
      [([1], [2])],
      SMALL,
      {"tables": (True, 1)},
      TypeError,
      r"`tables\[1\]` to be a bool, got 1",
    ),
    ([([1],)], SMALL, {"tables": "yes"}, TypeError, "`tables` to be a bool or a seq"),
  ],
)
def test_argument_errors(examples, buckets, kwargs, error, match):
  with pytest.raises(error, match=match):
    Batcher(examples, buckets, **kwargs)


def test_an_example_that_cannot_fit_raises():
  examples = random_examples(30, longest=8)
  examples[17] = (examples[17][0], np.zeros((300, 3), np.float32))
  buckets = [SMALL, Buckets.fixed(tokens=400, sequences=4, time=64)]
  with pytest.raises(
    ValueError,
    match=r"^Example 17 has length 300 in field 1, more than its time capacity 64\.$",
  ):
    Batcher(examples, buckets)
  examples[17] = (examples[17][0], np.zeros((30, 3), np.float32))
  buckets = [SMALL, Buckets.fixed(tokens=20, sequences=4, time=64)]
  with pytest.raises(
    ValueError, match="Example 17 has length 30 in field 1, more than its token capa"
  ):
    Batcher(examples, buckets)
  buckets = [SMALL, Buckets.fixed(tokens=40, sequences=4, time=64)]
  with pytest.raises(
    ValueError,
    match=r"Example 17 has cost 30 \(its longest field\), more than the token budget "
    "24",
  ):
    Batcher(examples, buckets)
  with pytest.raises(ValueError, match="the token budget 12"):
    Batcher(examples, buckets, token_budget=12)


def test_method_argument_errors():
  batcher = Batcher(random_examples(5), SMALL)
  with pytest.raises(ValueError, match="`epoch` to be an int >= 0, got -1"):
    batcher.plan(-1)
  with pytest.raises(ValueError, match="`epoch` to be an int >= 0, got -2"):
    batcher.epoch(-2)
  with pytest.raises(TypeError, match="`epoch` to be an int >= 0, got 1.5"):
    batcher.batches_per_epoch(1.5)
  with pytest.raises(ValueError, match="`start_step` to be an int >= 0, got -1"):
    batcher.iterate(start_step=-1)


# -- examples that would be stored wrongly ------------------------------------------

FIELD = Buckets.fixed(tokens=16, sequences=4, time=8)


@pytest.mark.parametrize(
  ("second", "error", "match"),
  [
    (
      np.array([2**32 + 5, 1]),
      ValueError,
      r"^Field 0 of example 1: Expected `examples\[1\]\[0\]` to fit int32 .*, got "
      r"4294967301 at index \(0,\)",
    ),
    (
      np.array([-(2**31) - 1]),
      ValueError,
      r"Field 0 of example 1: Expected `examples\[1\]\[0\]` to fit int32",
    ),
    (
      np.array([1.5]),
      TypeError,
      r"field 0 to share a kind of dtype, got int64 in example 0 \(`examples\[0\]\[0\]`"
      r"\) and float64 in example 1 \(`examples\[1\]\[0\]`\)",
    ),
    (np.array([1], np.uint64), TypeError, r"int64 in example 0 .* uint64 in example 1"),
    (np.array([True]), TypeError, r"int64 in example 0 .* bool in example 1"),
    (
      [[1, 2], [3]],
      ValueError,
      r"^Field 0 of example 1: Expected `examples\[1\]\[0\]` to be a rectangular "
      r"array of numbers .* `examples\[1\]\[0\]\[1\]` has shape \(1,\)",
    ),
  ],
)
def test_examples_that_would_be_stored_wrongly_raise(second, error, match):
  with pytest.raises(error, match=match):
    Batcher([(np.array([1, 2]),), (second,)], FIELD, prefetch=0)


def test_examples_of_one_kind_keep_their_values():
  examples = [(np.array([2**31 - 1, 1]),), (np.array([-(2**31)], np.int32),)]
  batch = next(Batcher(examples, FIELD, prefetch=0, shuffle=False).epoch(0))
  got = sorted(a.tolist() for a in batch.fields[0].to_list())
  assert got == [[-(2**31)], [2**31 - 1, 1]]
  examples = [(np.ones(2, np.float16),), (np.ones(1, np.float64),)]
  batch = next(Batcher(examples, FIELD, prefetch=0, shuffle=False).epoch(0))
  assert batch.fields[0].values.dtype == np.float32  # float64, as JAX stores it
