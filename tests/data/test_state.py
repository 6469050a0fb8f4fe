"""jaxlod.data.Batcher.get_state / set_state: resuming from a saved state."""

from __future__ import annotations

import itertools
import json
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxlod import Buckets
from jaxlod.data import Batcher
from tests.data.test_batcher import SMALL, random_examples, same_batches

EXAMPLES = random_examples(30)


def stream(batcher: Batcher, count: int) -> list:
  return list(itertools.islice(batcher.iterate(), count))


def same_sharded_batches(a: list, b: list) -> None:
  """Sharded batches (`same_batches` reads one shard) leaf by leaf."""
  assert len(a) == len(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def consumed_then_state(batcher: Batcher, count: int) -> dict:
  """The state after taking `count` batches from a new `iterate()`."""
  batches = batcher.iterate()
  for _ in range(count):
    next(batches)
  state = batcher.get_state()
  batches.close()
  return state


@pytest.mark.parametrize("prefetch, shuffle", [(0, True), (2, True), (2, False)])
def test_a_restored_state_resumes_like_an_uninterrupted_run(prefetch, shuffle):
  def make():
    return Batcher(EXAMPLES, SMALL, window=8, prefetch=prefetch, shuffle=shuffle)

  counts = [make().batches_per_epoch(e) for e in range(2)]
  whole = stream(make(), sum(counts) + 3)
  # The last batch of epoch 0, the first of epoch 1, and within epoch 1.
  for stop in (0, 1, counts[0] - 1, counts[0], counts[0] + 2):
    state = consumed_then_state(make(), stop)
    assert state["step"] == stop
    resumed = make()
    resumed.set_state(json.loads(json.dumps(state)))
    assert resumed.get_state() == state
    same_batches(stream(resumed, 3), whole[stop : stop + 3])
    assert resumed.get_state()["step"] == stop + 3


def test_a_sharded_state_resumes_in_every_process():
  def make(p):
    return Batcher(
      EXAMPLES, SMALL, window=8, shards=4, process_index=p, process_count=2
    )

  counts = make(0).batches_per_epoch(0)
  whole = [stream(make(p), counts + 2) for p in (0, 1)]
  state = consumed_then_state(make(0), counts - 1)
  assert state["shards"] == 4 and state == consumed_then_state(make(1), counts - 1)
  for p in (0, 1):
    resumed = make(p)
    resumed.set_state(state)
    batches = stream(resumed, 3)
    assert [b.epoch for b in batches] == [0, 1, 1]
    same_sharded_batches(batches, whole[p][counts - 1 :])


def test_the_state_counts_batches_handed_over_not_built_ahead():
  batcher = Batcher(EXAMPLES, SMALL, prefetch=3)
  built = []
  build = batcher._build

  def counting_build(epoch, step, indices):
    built.append(step)
    return build(epoch, step, indices)

  batcher._build = counting_build
  batches = batcher.iterate(start_step=2)
  assert batcher.get_state()["step"] == 2
  assert next(batches).step == 2
  deadline = time.monotonic() + 30
  while len(built) < 4 and time.monotonic() < deadline:  # 1 taken, 3 ahead
    time.sleep(0.01)
  assert built[:4] == [2, 3, 4, 5]
  assert batcher.get_state()["step"] == 3
  batches.close()


def test_which_iterator_the_state_follows():
  batcher = Batcher(EXAMPLES, SMALL, prefetch=0)
  assert batcher.get_state()["step"] == 0
  first = batcher.iterate()
  next(first)
  assert batcher.get_state()["step"] == 1
  # `epoch` iterators neither move nor read it.
  assert next(batcher.epoch(1)).step > 1
  assert batcher.get_state()["step"] == 1
  # A new `iterate` starts at 0 (no state was set) and is the one followed.
  second = batcher.iterate()
  assert batcher.get_state()["step"] == 0
  next(first), next(first)
  assert batcher.get_state()["step"] == 0
  next(second)
  assert batcher.get_state()["step"] == 1
  # After `set_state`, no earlier iterator moves it; the next `iterate` starts
  # there, once; an explicit `start_step` wins.
  state = {**batcher.get_state(), "step": 5}
  batcher.set_state(state)
  next(second)
  assert batcher.get_state() == state
  assert next(batcher.iterate()).step == 5
  assert next(batcher.iterate()).step == 0
  batcher.set_state(state)
  assert next(batcher.iterate(start_step=2)).step == 2
  assert next(batcher.iterate()).step == 0


def test_the_state_is_json_and_leaves_out_what_the_plan_ignores():
  examples = random_examples(20)
  batcher = Batcher(examples, [SMALL, Buckets.fixed(tokens=30, sequences=3, time=9)])
  state = batcher.get_state()
  assert json.loads(json.dumps(state)) == state
  assert state == {
    "version": 1,
    "step": 0,
    "num_examples": 20,
    "lengths_sha256": state["lengths_sha256"],
    "token_capacities": [24, 30],
    "sequence_capacity": 3,
    "token_budget": 24,
    "window": 1024,
    "shuffle": True,
    "seed": 0,
    "shards": None,
  }
  assert len(state["lengths_sha256"]) == 64
  # Settings that leave the plan alone, and other values of the same lengths.
  other = [(a + 1, b * 2) for a, b in examples]
  wider = Buckets.fixed(tokens=30, sequences=3, time=12)
  kwargs = dict(prefetch=0, ladder=(3, 1), device_put=False, tables=False)
  Batcher(other, [SMALL, wider], **kwargs).set_state(state)
  state["step"] = 1
  batcher.set_state(state)
  state["step"] = 2  # The Batcher keeps its own copy, and hands out new ones.
  batcher.get_state()["token_capacities"].append(8)
  assert batcher.get_state()["step"] == 1
  assert batcher.get_state()["token_capacities"] == [24, 30]


def test_orbax_json_round_trip(tmp_path):
  batcher = Batcher(EXAMPLES, SMALL, window=8, shards=2, process_index=0)
  state = consumed_then_state(batcher, 3)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    manager.save(3, args=ocp.args.Composite(batcher=ocp.args.JsonSave(state)))
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    args = ocp.args.Composite(batcher=ocp.args.JsonRestore())
    restored = manager.restore(3, args=args).batcher
  assert restored == state
  resumed = Batcher(EXAMPLES, SMALL, window=8, shards=2, process_index=0)
  resumed.set_state(restored)
  same_sharded_batches(stream(resumed, 2), stream(batcher, 5)[3:])


def _replaced(**changes):
  return {**Batcher(EXAMPLES, SMALL).get_state(), **changes}


def _without(key):
  state = Batcher(EXAMPLES, SMALL).get_state()
  del state[key]
  return state


@pytest.mark.parametrize(
  "state, error, match",
  [
    ([("step", 0)], TypeError, r"`state` to be a dict from Batcher.get_state\(\), "),
    (_without("step"), ValueError, r"missing key 'step'; a state from .* has keys "),
    (_without("seed"), ValueError, "missing key 'seed'"),
    (_replaced(version=2), ValueError, "'version' is 2, but this jaxlod reads .* 1"),
    (_replaced(epoch=1), ValueError, "unknown key 'epoch'"),
    (_replaced(step=-1), ValueError, "key 'step' to be >= 0, got -1"),
    (_replaced(step="3"), TypeError, "key 'step' to be an int, got '3'"),
    (_replaced(step=True), TypeError, "key 'step' to be an int, got True"),
    (_replaced(step=1.0), TypeError, "key 'step' to be an int, got 1.0"),
    (_replaced(shuffle=1), TypeError, "key 'shuffle' to be a bool, got 1"),
    (_replaced(shards="2"), TypeError, "key 'shards' to be an int or None, got '2'"),
    (
      _replaced(token_capacities=24),
      TypeError,
      "key 'token_capacities' to be a list of ints, got 24",
    ),
    (
      _replaced(seed=1),
      ValueError,
      r"key 'seed' is 1, but this Batcher's is 0: the state comes from a Batcher "
      r"with another plan \(examples' lengths, capacities, token_budget, window, "
      r"shuffle, seed or shards\)",
    ),
    (_replaced(num_examples=31), ValueError, "'num_examples' is 31, but .* is 30"),
    (_replaced(lengths_sha256="0" * 64), ValueError, "'lengths_sha256' is '0000"),
    (_replaced(token_capacities=[48]), ValueError, r"is \[48\], but .* is \[24, 24\]"),
    (_replaced(sequence_capacity=8), ValueError, "'sequence_capacity' is 8, but"),
    (_replaced(token_budget=12), ValueError, "'token_budget' is 12, but .* is 24"),
    (_replaced(window=8), ValueError, "'window' is 8, but .* is 1024"),
    (_replaced(shuffle=False), ValueError, "'shuffle' is False, but .* is True"),
    (_replaced(shards=2), ValueError, "'shards' is 2, but .* is None"),
  ],
)
def test_bad_states(state, error, match):
  batcher = Batcher(EXAMPLES, SMALL)
  with pytest.raises(error, match=match):
    batcher.set_state(state)
  assert batcher.get_state()["step"] == 0


def test_a_state_of_other_examples_of_the_same_count():
  state = Batcher(EXAMPLES, SMALL).get_state()
  with pytest.raises(ValueError, match="'lengths_sha256' is '[0-9a-f]{64}', but"):
    Batcher(random_examples(30, seed=1), SMALL).set_state(state)
