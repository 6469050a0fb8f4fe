"""Tests of plan_capacities: its figures against the Batcher's own batches."""

import numpy as np
import pytest

from jaxlod import Buckets, LoDTensor
from jaxlod.data import Batcher, plan_capacities

RNG = np.random.default_rng(0)
SRC = RNG.integers(0, 20, size=300)  # zero lengths included
TGT = SRC + RNG.integers(1, 4, size=300)


def _examples(*fields):
  return [
    tuple(np.ones(int(k), np.int32) for k in row) for row in zip(*fields, strict=True)
  ]


@pytest.mark.parametrize("fields", [(SRC,), (SRC, TGT)])
def test_fixed_candidate_is_what_the_batcher_pads(fields):
  plan = plan_capacities(
    list(fields) if len(fields) > 1 else fields[0], token_budget=96, batch_size=12
  )
  fixed = next(c for c in plan.candidates if c.name == "fixed")
  assert fixed.capacities == 1
  batcher = Batcher(
    _examples(*fields),
    list(fixed.buckets),
    token_budget=96,
    prefetch=0,
    tables=False,
    device_put=False,
  )
  batches = list(batcher.epoch(0))
  assert len(batches) == fixed.batches
  assert max(b.indices.size for b in batches) == fixed.batch_size
  real = sum(b.num_tokens for b in batches)
  tokens = sum(x.capacity.tokens for b in batches for x in b.fields)
  assert (fixed.real_rows, fixed.padded_rows) == (real, tokens - real)


def test_bucketed_candidates_count_the_capacities_of_each_batch():
  plan = plan_capacities([SRC, TGT], token_budget=64, ratios=(1.25,))
  batcher = Batcher(
    _examples(SRC, TGT),
    Buckets.fixed(tokens=64, sequences=64, time=32),
    token_budget=64,
    prefetch=0,
    tables=False,
    device_put=False,
  )
  for candidate in plan.candidates[1:]:
    seen, padded = set(), 0
    for indices in batcher.plan(0):
      tensors = [
        LoDTensor.from_sequences(
          [np.ones(int(f[i]), np.int32) for i in indices], buckets=b
        )
        for f, b in zip((SRC, TGT), candidate.buckets, strict=True)
      ]
      seen.add(tuple(x.capacity for x in tensors))
      padded += sum(x.capacity.tokens - int(x.num_rows) for x in tensors)
    assert (candidate.capacities, candidate.padded_rows) == (len(seen), padded)


def test_choice_is_the_fewest_capacities_within_the_padding():
  plan = plan_capacities(SRC, token_budget=[48, 96], max_padding=0.3)
  within = [c for c in plan.candidates if c.padding <= 0.3]
  assert plan.choice in within
  assert plan.choice.capacities == min(c.capacities for c in within)
  strict = plan_capacities(SRC, token_budget=96, max_padding=0.0)
  assert strict.choice.padding == min(c.padding for c in strict.candidates)
  assert f"token_budget={plan.choice.token_budget}" in str(plan)


@pytest.mark.parametrize(
  "lengths, kwargs, error, match",
  [
    ([], {"token_budget": 8}, ValueError, "at least one example"),
    ([3, -1], {"token_budget": 8}, ValueError, "got -1 at example 1"),
    ([1.5, 2.0], {"token_budget": 8}, TypeError, "integer `lengths`"),
    ([[1, 2], [3]], {"token_budget": 8}, ValueError, "shapes"),
    ([4, 9], {"token_budget": 8}, ValueError, r"longest example \(9\), got 8"),
    ([4], {"token_budget": 8, "max_padding": 1.5}, ValueError, "`max_padding`"),
    ([4], {"token_budget": 8, "batch_size": 0}, ValueError, "`batch_size`"),
    ([4], {"token_budget": []}, ValueError, "at least one `token_budget`"),
    ([4], {"token_budget": "8"}, TypeError, "`token_budget"),
    (
      [4],
      {"token_budget": 2**40},
      ValueError,
      r"Expected `token_budget` in \[1, 2147483647\] .*, got 1099511627776\.",
    ),
    ([4], {"token_budget": [8, 2**31]}, ValueError, r"`token_budget\[1\]` in \["),
    (
      [4],
      {"token_budget": 8, "ratios": (1.25, 1e300)},
      ValueError,
      r"Expected `ratios\[1\]` to be a geometric ratio: Expected `ratio` <= "
      r"2147483647 .*, got 1e\+300\.",
    ),
  ],
)
def test_bad_input(lengths, kwargs, error, match):
  with pytest.raises(error, match=match):
    plan_capacities(lengths, **kwargs)
