"""jaxlod.data.LoDBatchDataset: the Batcher's policy in a Grain pipeline.

Grain's tests skip only where Grain is not installed (``pip install
'jaxlod[grain]'``; `.ci/run` installs it with the `test` extra).
"""

from __future__ import annotations

import itertools
import json
import sys

import jax
import numpy as np
import pytest

import jaxlod.data
from examples.g2p import data
from examples.g2p import model as m
from jaxlod import Buckets
from jaxlod.data import Batch, Batcher, _extras

grain = pytest.importorskip("grain")
LoDBatchDataset = jaxlod.data.LoDBatchDataset

BUCKETS = [
  Buckets.fixed(tokens=96, sequences=16, time=12),
  Buckets.fixed(tokens=128, sequences=16, time=14),
]
# The G2P example's training batches (`train.training_batcher`), on about 11,700 of the
# lexicon's words, evenly spaced: every example of two epochs is checked.
G2P = m.Config(max_words=13_000)


def random_examples(n: int = 300, seed: int = 0) -> list[tuple]:
  """`n` (source, target) id pairs, the target two ids longer."""
  rng = np.random.default_rng(seed)
  return [
    (rng.integers(1, 30, size=k), rng.integers(1, 40, size=k + 2))
    for k in rng.integers(1, 12, size=n)
  ]


EXAMPLES = random_examples()


def g2p_settings(config: m.Config) -> dict:
  """The Batcher's settings in `train.training_batcher`, beyond the examples."""
  return dict(
    buckets=m.batch_buckets(config.batch_words, config.batch_tokens),
    seed=config.seed,
    ladder=m.training_ladder(config),
    tables=(True, True, False),
  )


@pytest.fixture(scope="module")
def g2p_train():
  return data.load_corpus(G2P).train


def assert_same_batches(got: list[Batch], expected: list[Batch]) -> None:
  assert len(got) == len(expected)
  for a, b in zip(got, expected, strict=True):
    assert (a.epoch, a.step, a.num_tokens) == (b.epoch, b.step, b.num_tokens)
    np.testing.assert_array_equal(a.indices, b.indices)
    jax.tree.map(
      np.testing.assert_array_equal, (a.fields, a.tables), (b.fields, b.tables)
    )


def by_epoch(batches: list[Batch]) -> dict[int, list[Batch]]:
  return {e: list(group) for e, group in itertools.groupby(batches, lambda b: b.epoch)}


def indices_of(batches: list[Batch]) -> list[int]:
  return sorted(i for b in batches for i in b.indices.tolist())


def assert_batchers_batches(batches: list[Batch], batcher: Batcher, epoch: int):
  """`batches` are epoch `epoch` of `batcher`, in another order: the same
  examples, LoDTensors and rank tables."""
  built = {tuple(b.indices.tolist()): b for b in batcher.epoch(epoch)}
  assert sorted(built) == sorted(tuple(b.indices.tolist()) for b in batches)
  for batch in batches:
    expected = built[tuple(batch.indices.tolist())]
    assert (batch.epoch, batch.num_tokens) == (epoch, expected.num_tokens)
    jax.tree.map(
      np.testing.assert_array_equal,
      (batch.fields, batch.tables),
      (expected.fields, expected.tables),
    )


def json_round_trip(state: dict) -> dict:
  """The state as Grain's checkpoint handler saves and reads it."""
  return json.loads(json.dumps(state))


# -- the policy: the Batcher's batches -----------------------------------------


@pytest.mark.parametrize(
  "settings",
  [
    dict(window=64, seed=3),
    dict(window=300, shuffle=False),
    dict(window=64, seed=1, shards=2),
    dict(window=50, token_budget=40, tables=(False, True), ladder=(16, 4)),
  ],
  ids=["shuffled", "in_order", "two_shards", "budget_tables_ladder"],
)
def test_each_epoch_is_the_batchers(settings):
  source = grain.MapDataset.source(EXAMPLES)
  batches = list(LoDBatchDataset(source, BUCKETS, num_epochs=2, **settings))
  batcher = Batcher(EXAMPLES, BUCKETS, prefetch=0, device_put=False, **settings)
  epochs = by_epoch(batches)
  assert sorted(epochs) == [0, 1]
  for epoch, group in epochs.items():
    assert indices_of(group) == list(range(len(EXAMPLES)))
    assert_batchers_batches(group, batcher, epoch)
  assert [b.step for b in batches] == list(range(len(batches)))


def test_each_window_shuffles_its_own_batches():
  source = grain.MapDataset.source(EXAMPLES)
  batches = list(LoDBatchDataset(source, BUCKETS, window=64, seed=3, num_epochs=1))
  order = np.random.default_rng([3, 0]).permutation(len(EXAMPLES))
  window_of = dict(zip(order.tolist(), np.arange(order.size) // 64, strict=True))
  windows = [{window_of[i] for i in b.indices.tolist()} for b in batches]
  assert all(len(w) == 1 for w in windows)
  windows = [w.pop() for w in windows]
  assert windows == sorted(windows)  # Window by window, in the epoch's order.
  # The greedy cut of a window sorted by cost gives batches of rising cost;
  # they come shuffled.
  costs = [
    max(len(EXAMPLES[i][1]) for i in b.indices)
    for b, w in zip(batches, windows, strict=True)
    if w == 0
  ]
  assert len(costs) > 3 and costs != sorted(costs)


def test_g2p_epochs_hold_every_example_once_on_the_batchers_capacities(g2p_train):
  settings = g2p_settings(G2P)
  ds = LoDBatchDataset(grain.MapDataset.source(g2p_train), num_epochs=2, **settings)
  batches = list(ds)
  batcher = Batcher(g2p_train, prefetch=0, device_put=False, **settings)
  reference = next(iter(batcher.epoch(0)))
  structure = jax.tree.structure(reference[:2])  # Capacities and ladders.
  shapes = [(a.shape, a.dtype) for a in jax.tree.leaves(reference[:2])]
  epochs = by_epoch(batches)
  assert sorted(epochs) == [0, 1]
  for epoch, group in epochs.items():
    assert indices_of(group) == list(range(len(g2p_train)))
    plan = sorted(p.tolist() for p in batcher.plan(epoch))
    assert sorted(b.indices.tolist() for b in group) == plan
  for batch in batches:
    assert [f.capacity for f in batch.fields] == [f.capacity for f in reference.fields]
    assert jax.tree.structure(batch[:2]) == structure
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(batch[:2])] == shapes
    assert batch.tables[2] is None
  for batch in batches[:: len(batches) // 10]:
    letters = batch.fields[0].to_list()
    for i, x in zip(batch.indices, letters, strict=True):
      np.testing.assert_array_equal(x, g2p_train[i][0])


# -- checkpoints ---------------------------------------------------------------


def _map_pipeline(num_epochs: int | None = 2) -> LoDBatchDataset:
  return LoDBatchDataset(
    grain.MapDataset.source(EXAMPLES), BUCKETS, window=64, seed=5, num_epochs=num_epochs
  )


@pytest.mark.parametrize("k", [0, 1, 3, 5, 6, "epoch_end", "epoch_end+2"])
def test_state_at_step_k_restores_the_uninterrupted_run(k):
  ds = _map_pipeline()
  uninterrupted = list(ds)
  first_epoch = sum(b.epoch == 0 for b in uninterrupted)
  k = {"epoch_end": first_epoch, "epoch_end+2": first_epoch + 2}.get(k, k)
  iterator = iter(ds)
  assert_same_batches(list(itertools.islice(iterator, k)), uninterrupted[:k])
  state = json_round_trip(iterator.get_state())
  restored = iter(_map_pipeline())
  restored.set_state(state)
  assert_same_batches(list(restored), uninterrupted[k:])


def test_state_is_small():
  iterator = iter(_map_pipeline())
  next(iterator)
  assert iterator.get_state() == {"epoch": 0, "window": 0, "batch": 1, "step": 1}


def test_orbax_checkpoint_manager_restores_the_iterator(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  ds = _map_pipeline(num_epochs=None)
  uninterrupted = list(itertools.islice(ds, 30))
  iterator = iter(ds)
  for _ in range(17):
    next(iterator)
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(17, args=grain.checkpoint.CheckpointSave(iterator))
    manager.wait_until_finished()
  restored = iter(_map_pipeline(num_epochs=None))
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.restore(17, args=grain.checkpoint.CheckpointRestore(restored))
  assert_same_batches(list(itertools.islice(restored, 13)), uninterrupted[17:])


# -- sharding ------------------------------------------------------------------


def test_process_slices_cover_each_epoch_once():
  source = grain.MapDataset.source(EXAMPLES)
  processes = 2
  seen = {0: [], 1: []}
  for p in range(processes):
    ds = LoDBatchDataset(source[p::processes], BUCKETS, window=64, num_epochs=2)
    for batch in ds:
      # Positions in the process's slice, as indices of the whole source.
      seen[batch.epoch].append((p + processes * batch.indices).tolist())
  for per_process in seen.values():
    flat = sorted(i for indices in per_process for i in indices)
    assert flat == list(range(len(EXAMPLES)))


@pytest.mark.parametrize("sequential", [False, True])
def test_worker_slices_cover_each_epoch_once(sequential):
  # What `mp_prefetch` does in each of W workers, in place on a copy.
  workers, seen = 3, []
  for w in range(workers):
    ds = LoDBatchDataset(grain.MapDataset.source(EXAMPLES), BUCKETS, num_epochs=1)
    ds.parents[0].set_slice(slice(w, None, workers), sequential)
    seen += [i for b in ds for i in b.indices.tolist()]
  assert sorted(seen) == list(range(len(EXAMPLES)))


@pytest.fixture
def absl_flags_parsed():
  # Grain 0.2.18's worker processes read an absl flag, which raises unless
  # flags are parsed when JAX is imported (google/grain#1355).
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


@pytest.mark.slow
@pytest.mark.usefixtures("absl_flags_parsed")
def test_two_worker_processes_cover_epochs_and_restore(g2p_train):
  settings = g2p_settings(G2P)
  ds = LoDBatchDataset(grain.MapDataset.source(g2p_train), num_epochs=2, **settings)
  # A batch's few dozen small arrays go through the workers' queues, not a
  # shared-memory block each (Grain's default `min_shm_size=0`).
  options = grain.experimental.DatasetOptions(min_shm_size=1 << 20)
  ds = grain.experimental.WithOptionsIterDataset(ds, options)
  workers = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
  k = 150
  iterator = iter(workers)
  try:
    batches = list(itertools.islice(iterator, k))
    state = json_round_trip(iterator.get_state())
    batches += list(iterator)
  finally:
    iterator.close()
  epochs = by_epoch(sorted(batches, key=lambda b: b.epoch))
  assert sorted(epochs) == [0, 1]
  for group in epochs.values():
    assert indices_of(group) == list(range(len(g2p_train)))
  # Each worker counts its own steps: two processes, one interleaved stream.
  assert [b.step for b in batches[:6]] == [0, 0, 1, 1, 2, 2]
  restored = iter(workers)
  try:
    restored.set_state(state)
    assert_same_batches(list(restored), batches[k:])
  finally:
    restored.close()


# -- over an IterDataset -------------------------------------------------------


def test_iter_dataset_parent_batches_consecutive_windows():
  parent = grain.MapDataset.source(EXAMPLES).to_iter_dataset()
  batches = list(LoDBatchDataset(parent, BUCKETS, window=64, seed=2))
  assert indices_of(batches) == list(range(len(EXAMPLES)))
  assert {b.epoch for b in batches} == {0}
  batcher = Batcher(EXAMPLES, BUCKETS, window=64, shuffle=False)
  assert sorted(b.indices.tolist() for b in batches) == sorted(
    p.tolist() for p in batcher.plan(0)
  )


@pytest.mark.parametrize("k", [0, 2, 5, 9])
def test_iter_dataset_parent_restores(k):
  def pipeline():
    parent = grain.MapDataset.source(EXAMPLES).shuffle(seed=4).to_iter_dataset()
    return LoDBatchDataset(parent, BUCKETS, window=64, seed=2)

  uninterrupted = list(pipeline())
  iterator = iter(pipeline())
  list(itertools.islice(iterator, k))
  restored = iter(pipeline())
  restored.set_state(json_round_trip(iterator.get_state()))
  assert_same_batches(list(restored), uninterrupted[k:])


# -- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
  ("parent", "kwargs", "error", "match"),
  [
    ("list", {}, TypeError, "Expected `parent` to be a grain.MapDataset or"),
    ("empty", {}, ValueError, "Expected `parent` to hold at least one example"),
    ("endless", {}, ValueError, "Expected `parent` to be a finite grain.MapDataset"),
    (
      "iter",
      dict(num_epochs=2),
      ValueError,
      "Expected `num_epochs` to be None with a grain.IterDataset parent, got 2",
    ),
    ("map", dict(num_epochs=0), ValueError, r"`num_epochs` to be an int >= 1, got 0"),
    ("map", dict(window=0), ValueError, r"`window` to be an int >= 1, got 0"),
    ("map", dict(shards=0), ValueError, r"`shards` to be an int >= 1, got 0"),
    ("map", dict(seed=-1), ValueError, r"`seed` to be an int >= 0, got -1"),
    ("map", dict(token_budget=1.5), TypeError, r"`token_budget` to be an int"),
    (
      "map",
      dict(buckets=Buckets.pow2()),
      ValueError,
      r"Expected `buckets` to be Buckets.fixed\(...\)",
    ),
    (
      "map",
      dict(tables=(True,)),
      ValueError,
      r"one bool per field \(2\), got 1 entries",
    ),
  ],
  ids=lambda v: v if isinstance(v, str) else None,
)
def test_constructor_errors(parent, kwargs, error, match):
  source = grain.MapDataset.source(EXAMPLES)
  parent = {
    "empty": grain.MapDataset.source([]),
    "endless": source.repeat(),
    "iter": source.to_iter_dataset(),
    "map": source,
    "list": EXAMPLES,
  }[parent]
  kwargs = {"buckets": BUCKETS} | kwargs
  with pytest.raises(error, match=match):
    LoDBatchDataset(parent, **kwargs)


def test_an_example_no_batch_holds_raises_with_its_index():
  examples = list(EXAMPLES)
  examples[123] = (np.ones(5, int), np.ones(20, int))
  ds = LoDBatchDataset(grain.MapDataset.source(examples), BUCKETS, window=400)
  with pytest.raises(
    ValueError, match="Example 123 has length 20 in field 1, more than its time"
  ):
    next(iter(ds))


def test_fields_that_differ_raise_with_the_example_index():
  examples = list(EXAMPLES)
  examples[7] = (np.ones(3, int),)
  ds = LoDBatchDataset(grain.MapDataset.source(examples), BUCKETS, shuffle=False)
  with pytest.raises(ValueError, match="got 1 in example 7"):
    next(iter(ds))


def test_a_foreign_state_raises():
  iterator = iter(_map_pipeline())
  with pytest.raises(ValueError, match=r"state with keys \['batch', 'epoch'"):
    iterator.set_state({"next_index": 3})


def test_filtered_examples_are_skipped():
  source = grain.MapDataset.source(EXAMPLES).filter(lambda e: len(e[0]) > 3)
  batches = list(LoDBatchDataset(source, BUCKETS, window=64, num_epochs=1))
  kept = [i for i, e in enumerate(EXAMPLES) if len(e[0]) > 3]
  assert indices_of(batches) == kept


def test_filtering_everything_ends_the_stream():
  source = grain.MapDataset.source(EXAMPLES).filter(lambda e: False)
  assert list(LoDBatchDataset(source, BUCKETS)) == []


def test_without_grain_the_name_raises_an_import_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "grain", None)
  monkeypatch.delitem(sys.modules, "jaxlod.data._grain")
  monkeypatch.delattr(jaxlod.data, "_grain")
  stand_in = _extras.grain_dataset()
  assert stand_in is not LoDBatchDataset
  with pytest.raises(ImportError, match=r"pip install 'jaxlod\[grain\]'"):
    stand_in(None, BUCKETS)


@pytest.mark.parametrize(
  ("value", "error", "match"),
  [
    (np.array([2**32 + 5]), ValueError, r"example 7: Expected `examples\[7\]\[0\]` to"),
    (np.array([1.5]), TypeError, r"int64 in example 0 .* float64 in example 7"),
    ([[1, 2], [3]], ValueError, r"example 7: Expected `examples\[7\]\[0\]` to be a"),
  ],
)
def test_examples_that_would_be_stored_wrongly_raise(value, error, match):
  examples = list(EXAMPLES)
  examples[7] = (value, examples[7][1])
  ds = LoDBatchDataset(grain.MapDataset.source(examples), BUCKETS, shuffle=False)
  with pytest.raises(error, match=match):
    next(iter(ds))
