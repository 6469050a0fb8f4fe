"""`tune_plan`: the fastest candidate plan whose results are the reference's.

Which plan is fastest on the CPU is not a fact to test; the tests that
choose by speed make it one, with steps that sleep (inside a
`jax.pure_callback`) for a time that depends on the plan.
"""

from __future__ import annotations

import collections
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlod.nn import DynamicRNN
from jaxlod.ops import LoopPlan, default_plan, dynamic_rnn, tune_plan
from jaxlod.ops._loop._tune import default_candidates
from tests.helpers import assert_close
from tests.ops.test_rnn import CELLS, _batch

LADDER, ONE, TWO = LoopPlan(), LoopPlan(bodies=1), LoopPlan(bodies=2)
X = jnp.arange(4.0, dtype=jnp.float32)


def _sleeping(seconds: float, x: jax.Array) -> jax.Array:
  """`x`, returned by the host after `seconds` asleep."""

  def host(x):
    time.sleep(seconds)
    return np.asarray(x)

  return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _counting(counts: collections.Counter, plan: LoopPlan, x: jax.Array):
  """`x`, counting in `counts` each run of `plan`'s program."""

  def host(x):
    counts[plan] += 1
    return np.asarray(x)

  return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


# -- a real step ------------------------------------------------------------------


def test_an_lstm_step_gets_a_candidate_with_the_default_plans_results():
  step, params, init = CELLS["lstm"](jnp.float32)
  x = _batch([4, 0, 7, 1, 3], np.float32)
  init_carry = init(jax.random.key(2), x.capacity.sequences[-1])

  def train_step(plan, params, x, init_carry):
    def loss(params):
      ys, (c, h) = dynamic_rnn(
        lambda carry, x_t, s: step(params, carry, x_t, s),
        x,
        init_carry=init_carry,
        plan=plan,
      )
      return jnp.sum(ys.values**2) + jnp.sum(h * c)

    return jax.value_and_grad(loss)(params)

  plans = (default_plan(), LoopPlan(bodies=2, chunk=4))
  args = (params, x, init_carry)
  plan = tune_plan(train_step, *args, candidates=plans, repeats=2)
  assert plan in plans
  want = jax.jit(train_step, static_argnums=0)(default_plan(), *args)
  got = jax.jit(train_step, static_argnums=0)(plan, *args)
  assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_layer_whose_cell_cannot_hoist_skips_the_hoisted_plan():
  class Cell(nn.SimpleCell):  # a subclass may change the math: not hoisted
    pass

  x = _batch([3, 1, 2], np.float32)
  layer = DynamicRNN(Cell(4))
  params = layer.init(jax.random.key(0), x)

  def apply(plan, params, x):
    return DynamicRNN(Cell(4), plan=plan).apply(params, x).values

  hoisted = LoopPlan(hoist=True)
  with pytest.raises(TypeError, match="separable cells"):
    apply(hoisted, params, x)
  assert tune_plan(apply, params, x, candidates=(LADDER, hoisted), repeats=1) == LADDER


# -- which candidate wins ---------------------------------------------------------


@pytest.mark.parametrize(
  "wrong",
  [
    lambda x: x + 1e-3,
    lambda x: x[:2],
    lambda x: (x,),
    lambda x: jnp.full_like(x, jnp.nan),
  ],
  ids=["values", "shape", "structure", "nan"],
)
def test_a_candidate_with_other_results_is_never_chosen(wrong):
  def fn(plan, x):
    # The reference is slow; the wrong plan is fast and differs.
    return wrong(x) if plan == ONE else _sleeping(0.02, x)

  assert tune_plan(fn, X, candidates=(LADDER, ONE), repeats=2) == LADDER


def test_results_within_the_tolerances_match():
  def fn(plan, x):
    return x * (1 + 1e-7) if plan == ONE else _sleeping(0.02, x)

  assert tune_plan(fn, X, candidates=(LADDER, ONE), repeats=2) == ONE
  assert tune_plan(fn, X, candidates=(LADDER, ONE), repeats=2, rtol=0.0, atol=0.0) == (
    LADDER
  )


def test_the_tolerance_scales_with_each_results_largest_value():
  # Rounding under another plan moves a near-zero entry by a fraction of
  # the leaf's scale: within rtol of 1000, the candidate matches.
  big = jnp.array([1000.0, 0.0])

  def fn(plan, x):
    return x + jnp.array([0.0, 0.05]) if plan == ONE else _sleeping(0.02, x)

  assert tune_plan(fn, big, candidates=(LADDER, ONE), repeats=2) == ONE
  assert tune_plan(fn, big, candidates=(LADDER, ONE), repeats=2, rtol=1e-5) == LADDER


def test_the_fastest_matching_candidate_wins():
  sleeps = {LADDER: 0.03, ONE: 0.015, TWO: 0.0, LoopPlan(bodies=4): 0.0}

  def fn(plan, x):
    y = _sleeping(sleeps[plan], x)
    return y + 1 if plan.bodies == 4 else y  # fastest, and wrong

  candidates = tuple(sleeps)
  assert tune_plan(fn, X, candidates=candidates, repeats=3) == TWO


def test_each_plan_traces_once_runs_twice_then_once_a_round():
  traced, counts = [], collections.Counter()
  wrong = LoopPlan(bodies=4)

  def fn(plan, x):
    traced.append(plan)
    y = _counting(counts, plan, x)
    return y + 1 if plan == wrong else y

  tune_plan(fn, X, candidates=[LADDER, ONE, LADDER, wrong, TWO, ONE], repeats=3)
  assert traced == [LADDER, ONE, wrong, TWO]
  # Results and a warm-up, then the rounds; a plan that differs runs once.
  assert counts == {LADDER: 5, ONE: 5, TWO: 5, wrong: 1}


@pytest.mark.parametrize("error", [TypeError, ValueError])
def test_a_candidate_that_fails_to_trace_is_skipped(error):
  def fn(plan, x):
    if plan == ONE:
      raise error("this step cannot run under one body")
    return x * 2

  assert tune_plan(fn, X, candidates=(LADDER, ONE, TWO), repeats=1) in (LADDER, TWO)


def test_other_errors_and_the_references_errors_propagate():
  def fn(plan, x):
    if plan == ONE:
      raise RuntimeError("not a plan the step refuses")
    if plan == TWO:
      raise TypeError("the reference's own error")
    return x

  with pytest.raises(RuntimeError, match="not a plan the step refuses"):
    tune_plan(fn, X, candidates=(LADDER, ONE), repeats=1)
  with pytest.raises(TypeError, match="the reference's own error"):
    tune_plan(fn, X, candidates=(TWO, LADDER), repeats=1)


# -- the default candidates ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_default_candidates_start_with_the_default_plan_once_each(backend):
  plans = default_candidates(backend)
  assert plans[0] == default_plan(backend)
  assert len(set(plans)) == len(plans)
  assert {
    LADDER,
    ONE,
    TWO,
    LoopPlan(bodies=1, chunk=8),
    LoopPlan(hoist=True),
    LoopPlan(padded=True),
    LoopPlan(padded=True, hoist=True),
  } <= set(plans)
  fused = [plan for plan in plans if plan.fused]
  assert fused == ([] if backend == "cpu" else [LoopPlan(fused=True)])


def test_no_candidates_means_the_backends_defaults():
  traced = []

  def fn(plan, x):
    traced.append(plan)
    return x

  plan = tune_plan(fn, X, repeats=1)
  assert traced == list(default_candidates())
  assert plan in traced


# -- wrong inputs -----------------------------------------------------------------


def _never(plan, x):
  raise AssertionError("called with a wrong input")


@pytest.mark.parametrize(
  ("fn", "kwargs", "error", "match"),
  [
    (3, {}, TypeError, "Expected `fn` to be callable, got int"),
    (_never, {"candidates": ()}, ValueError, r"`candidates` .* at least one .* \(\)"),
    (
      _never,
      {"candidates": [LADDER, "fast"]},
      TypeError,
      r"each of `candidates` to be a jaxlod.ops.LoopPlan, got 'fast' at index 1",
    ),
    (_never, {"candidates": LADDER}, TypeError, "`candidates` to be a sequence"),
    (_never, {"repeats": 0}, ValueError, r"Expected `repeats` >= 1, got 0\."),
    (_never, {"repeats": 2.0}, TypeError, "`repeats` to be a static int, got 2.0"),
    (_never, {"rtol": -1e-3}, ValueError, r"Expected `rtol` >= 0, got -0\.001\."),
    (_never, {"atol": float("nan")}, ValueError, r"Expected `atol` >= 0, got nan\."),
    (_never, {"atol": "1e-6"}, TypeError, "`atol` to be a static float, got '1e-6'"),
  ],
  ids=[
    "fn",
    "empty_candidates",
    "candidate",
    "one_plan",
    "repeats",
    "float_repeats",
    "rtol",
    "atol",
    "string_atol",
  ],
)
def test_wrong_inputs(fn, kwargs, error, match):
  with pytest.raises(error, match=match):
    tune_plan(fn, X, **kwargs)
