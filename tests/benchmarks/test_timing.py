"""`measure_interleaved`: the side-by-side timer of the benchmarks."""

from __future__ import annotations

import itertools
import mmap
import time

import numpy as np
import pytest

from benchmarks.timing import MAX_ROUNDS, measure_interleaved


def _recording_calls(names, order):
  def call(name):
    def fn():
      order.append(name)
      return name

    return fn, lambda result: result

  return {name: call(name) for name in names}


def test_every_call_runs_once_per_round_after_compile_and_warm_up():
  order = []
  result = measure_interleaved(_recording_calls("abcd", order), repeats=6)
  assert order[:8] == list("abcdabcd")  # first calls, then warm-ups
  rounds = [order[8 + 4 * r : 12 + 4 * r] for r in range(6)]
  assert all(sorted(r) == list("abcd") for r in rounds)
  assert len(order) == 8 + 24
  for name in "abcd":
    assert len(result[name]["times_s"]) == 6
    assert result[name]["median_s"] >= 0.0


def test_no_call_always_follows_the_same_one():
  # A call that leaves threads spinning or caches cold (another framework's)
  # must not always slow the same neighbour: predecessors vary by round.
  order = []
  measure_interleaved(_recording_calls("abcde", order), repeats=20)
  timed = order[10:]
  before = {name: set() for name in "abcde"}
  for prev, name in itertools.pairwise(timed):
    before[name].add(prev)
  for name in "abcde":
    assert before[name] >= set("abcde") - {name}, (name, before[name])


def test_the_order_is_the_same_in_every_run():
  first, second = [], []
  measure_interleaved(_recording_calls("abc", first), repeats=5)
  measure_interleaved(_recording_calls("abc", second), repeats=5)
  assert first == second


def _sleeping_calls(seconds):
  return {name: (lambda: time.sleep(seconds), lambda result: result) for name in "ab"}


def test_min_seconds_adds_rounds_to_fill_it_up_to_the_cap():
  # Two calls of at least 10 ms: a round takes 20 ms or more, so 0.4 s
  # wants at most 20 rounds (more than 3 unless a round took 100 ms).
  result = measure_interleaved(_sleeping_calls(0.01), repeats=3, min_seconds=0.4)
  assert 3 < len(result["a"]["times_s"]) <= 20
  assert len(result["a"]["times_s"]) == len(result["b"]["times_s"])
  fast = measure_interleaved(_recording_calls("ab", []), repeats=3, min_seconds=1.0)
  assert len(fast["a"]["times_s"]) == MAX_ROUNDS


def test_min_seconds_never_takes_rounds_away():
  result = measure_interleaved(_sleeping_calls(0.01), repeats=4, min_seconds=0.001)
  assert len(result["a"]["times_s"]) == 4


def test_repeats_must_be_positive():
  with pytest.raises(ValueError, match="repeats must be at least 1, got 0"):
    measure_interleaved(_recording_calls("ab", []), repeats=0)


def _write_fresh_pages(size):
  pages = mmap.mmap(-1, size)
  np.frombuffer(pages, np.uint8)[:] = 1
  return pages


def test_page_faults_are_counted_per_call():
  # A call that writes fresh memory takes a fault per page; one that does
  # not takes (almost) none.
  calls = {
    "fresh": (lambda: _write_fresh_pages(16 << 20), lambda pages: pages.close()),
    "none": (lambda: 1, lambda x: x),
  }
  result = measure_interleaved(calls, repeats=3)
  assert result["fresh"]["minor_faults_per_call"] > 1000  # 4,096 pages
  assert result["none"]["minor_faults_per_call"] < 100
