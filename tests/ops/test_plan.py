"""`LoopPlan`: every plan's `dynamic_rnn` against the padded masked scan.

The accelerator plans (one or two bodies, several steps per `while`
iteration) are forced on the CPU here: their values and gradients must be
those of the masked `lax.scan`, in float32 and float64, with empty
sequences, both directions, both backward modes and every capacity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import LoopPlan, default_plan, dynamic_rnn, rank_table
from tests.helpers import assert_close
from tests.ops.test_rnn import CELLS, _batch
from tests.ops.test_rnn import _losses as rnn_losses

ACCELERATOR = default_plan("gpu")
PLANS = {
  "cpu": LoopPlan(),
  "accelerator": ACCELERATOR,
  "one_body": LoopPlan(bodies=1),
  "one_body_chunk3": LoopPlan(bodies=1, chunk=3),
  "two_bodies_chunk8": LoopPlan(bodies=2, chunk=8),
  "ladder_chunk4": LoopPlan(chunk=4),
  "padded": LoopPlan(padded=True),
}
PADDED = PLANS["padded"]


def _losses(step, params, x, init_carry, reverse, remat, plan, table=None):
  """jaxlod under `plan` and the masked scan: ``(loss, (outputs, carry))``."""
  return rnn_losses(step, params, x, init_carry, reverse, remat, None, plan, table)


def _both(loss, args):
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)


# -- values and gradients ---------------------------------------------------------


# The CPU's plan is `dynamic_rnn`'s default there: tests/ops/test_rnn.py.
@pytest.mark.parametrize("plan", sorted(set(PLANS) - {"cpu", "one_body"}))
@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize(
  ("reverse", "remat"), [(False, False), (True, True)], ids=["forward", "reverse-remat"]
)
def test_every_plan_matches_the_masked_scan_float32(plan, cell, reverse, remat):
  step, params, init = CELLS[cell](jnp.float32)
  x = _batch([4, 0, 7, 1, 3, 7, 2, 0, 5], np.float32, Buckets.pow2(minimum=8))
  init_carry = init(jax.random.key(2), x.capacity.sequences[-1])
  got_loss, ref_loss = _losses(step, params, x, init_carry, reverse, remat, PLANS[plan])
  args = (params, x.values, init_carry)
  (loss, outputs), grads = _both(got_loss, args)
  (want, ref_outputs), ref_grads = _both(ref_loss, args)
  assert_close(outputs, ref_outputs, rtol=1e-5, atol=1e-5)
  assert_close(loss, want, rtol=1e-5, atol=1e-5)
  # Gradients sum over up to a few dozen steps: float32 round-off.
  assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
  "plan", sorted(set(PLANS) - {"cpu", "one_body", "one_body_chunk3", "padded"})
)
@pytest.mark.parametrize("cell", ["custom", "lstm"])
@pytest.mark.parametrize(
  ("reverse", "remat"), [(False, True), (True, False)], ids=["forward-remat", "reverse"]
)
def test_accelerator_plans_match_the_masked_scan_float64(plan, cell, reverse, remat):
  with jax.enable_x64(True):
    step, params, init = CELLS[cell](jnp.float64)
    x = _batch(
      [4, 0, 6, 1, 3, 6], np.float64, Buckets.fixed(tokens=24, sequences=8, time=8)
    )
    init_carry = init(jax.random.key(2), 8)
    got_loss, ref_loss = _losses(
      step, params, x, init_carry, reverse, remat, PLANS[plan]
    )
    args = (params, x.values, init_carry)
    (_, outputs), grads = _both(got_loss, args)
    (_, ref_outputs), ref_grads = _both(ref_loss, args)
    assert_close(outputs, ref_outputs, rtol=1e-12, atol=1e-12)
    assert_close(grads, ref_grads, rtol=1e-10, atol=1e-10)


@settings(max_examples=10, deadline=None)
@given(
  lengths=st.lists(st.integers(0, 9), min_size=1, max_size=8),
  chunk=st.sampled_from([2, 3, 5, 16]),
  bodies=st.sampled_from([None, 1, 2]),
  reverse=st.booleans(),
)
def test_random_lods_under_every_chunk(lengths, chunk, bodies, reverse):
  """Steps past a phase's end (the last iteration's extra ones) change no
  value and no gradient, whatever the lengths, including all-empty batches."""
  with jax.enable_x64(True):
    step, params, init = CELLS["gru"](jnp.float64)
    x = _batch(lengths, np.float64, Buckets.fixed(tokens=72, sequences=8, time=9))
    init_carry = init(jax.random.key(2), 8)
    plan = LoopPlan(bodies=bodies, chunk=chunk)
    got_loss, ref_loss = _losses(step, params, x, init_carry, reverse, False, plan)
    args = (params, x.values, init_carry)
    (_, outputs), grads = _both(got_loss, args)
    (_, ref_outputs), ref_grads = _both(ref_loss, args)
    assert_close(outputs, ref_outputs, rtol=1e-12, atol=1e-12)
    assert_close(grads, ref_grads, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("plan", ["accelerator", "ladder_chunk4"])
def test_masked_steps_never_reach_the_gradients(plan):
  """A step whose gradient is NaN at zero input (``sqrt(w * x)``): the masked
  steps past a phase's end read real rows, so nothing turns NaN."""
  lengths = [5, 1, 0, 3]
  rows = np.linspace(0.5, 2.0, sum(lengths), dtype=np.float32)[:, None]
  x = LoDTensor.from_lengths(
    rows, [lengths], buckets=Buckets.fixed(tokens=24, sequences=4, time=6)
  )

  def loss(w):
    step = lambda c, x_t, _: (c + jnp.sqrt(w * x_t), c)  # noqa: E731
    _, carry = dynamic_rnn(step, x, init_carry=jnp.zeros((4, 1)), plan=PLANS[plan])
    return jnp.sum(carry)

  def reference(w):
    return sum(jnp.sum(jnp.sqrt(w * jnp.asarray(s))) for s in x.to_list())

  got = jax.jit(jax.grad(loss))(jnp.float32(1.5))
  np.testing.assert_allclose(got, jax.grad(reference)(1.5), rtol=1e-5)


def test_a_table_of_another_ladder_runs_the_plans_bodies():
  """A data pipeline's table (built with the CPU ladder) under a plan with
  `bodies`: the plan's phases come from the table's lengths."""
  step, params, init = CELLS["lstm"](jnp.float32)
  x = _batch([9, 2, 2, 6, 1, 1, 3, 8, 4, 4, 2], np.float32, Buckets.pow2(minimum=8))
  table = rank_table(x, ladder=(16, 8, 4, 2))
  init_carry = init(jax.random.key(2), 16)
  for plan in (ACCELERATOR, LoopPlan(bodies=2, chunk=3)):
    got_loss, ref_loss = _losses(step, params, x, init_carry, False, False, plan, table)
    args = (params, x.values, init_carry)
    (_, outputs), grads = _both(got_loss, args)
    (_, ref_outputs), ref_grads = _both(ref_loss, args)
    assert_close(outputs, ref_outputs, rtol=1e-5, atol=1e-5)
    assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)


# -- one compilation ----------------------------------------------------------------


def test_the_accelerator_plan_compiles_one_body():
  """One body: one forward and one backward `while` loop, where the CPU's
  ladder has one per size."""
  step, params, init = CELLS["lstm"](jnp.float32)
  x = _batch([5, 2, 7, 0, 3, 1, 1, 6], np.float32, Buckets.pow2(minimum=8))
  init_carry = init(jax.random.key(2), 8)

  def whiles(plan):
    loss, _ = _losses(step, params, x, init_carry, False, False, plan)
    grad = jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2))
    return str(jax.make_jaxpr(grad)(params, x.values, init_carry)).count("while[")

  assert whiles(ACCELERATOR) == 2
  assert whiles(LoopPlan()) == 2 * len(rank_table(x).ladder)


# -- the plan as data ---------------------------------------------------------------


def test_default_plan_per_backend():
  assert default_plan("cpu") == LoopPlan()
  assert default_plan("gpu") == default_plan("tpu") == LoopPlan(bodies=1, chunk=8)
  assert default_plan() == default_plan(jax.default_backend())
  assert not default_plan("gpu").hoist  # not the default before it is measured


def test_default_plan_per_shape():
  """On a CPU the padded shape picks the plan (benchmarks/sweep.py); on an
  accelerator, and without a shape, the backend alone."""
  hoisted, ladder = LoopPlan(hoist=True), LoopPlan()
  hoisted_shapes = [(1, 1), (8, 8), (8, 256), (8, 257), (8, 1024), (1, 4096), (0, 0)]
  for sequences, time in hoisted_shapes:
    assert default_plan("cpu", sequences=sequences, time=time) == hoisted
  ladder_shapes = [(9, 8), (9, 1024), (32, 8), (32, 64), (128, 1024)]
  for sequences, time in ladder_shapes:
    assert default_plan("cpu", sequences=sequences, time=time) == ladder
  assert default_plan("gpu", sequences=8, time=8) == ACCELERATOR
  assert default_plan("cpu") == ladder
  assert default_plan("cpu", sequences=np.int64(8), time=np.int32(8)) == hoisted


@pytest.mark.parametrize(
  ("kwargs", "error", "message"),
  [
    (
      dict(sequences=8),
      ValueError,
      r"Expected both `sequences` and `time` or neither, got sequences=8, "
      r"time=None\.",
    ),
    (dict(sequences=-1, time=8), ValueError, r"Expected `sequences` >= 0, got -1"),
    (dict(sequences=8, time=1.5), TypeError, r"Expected `time` to be a static int"),
  ],
)
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_default_plan_bad_shapes_raise(kwargs, error, message, backend):
  with pytest.raises(error, match=message):
    default_plan(backend, **kwargs)


def test_a_plan_is_static_hashable_data():
  plan = LoopPlan(bodies=2, chunk=4)
  assert hash(plan) == hash(LoopPlan(bodies=2, chunk=4))
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.chunk = 1  # type: ignore[misc]
  # A jitted function with the plan as a static argument: one trace per plan.
  traces = []

  def f(x, plan):
    traces.append(plan)
    return x + plan.chunk

  f = jax.jit(f, static_argnums=1)
  f(1.0, plan), f(2.0, LoopPlan(bodies=2, chunk=4)), f(1.0, LoopPlan())
  assert len(traces) == 2


def test_ladders_of_bodies():
  assert LoopPlan().ladder(64, (64, 52, 44)) == (64, 52, 44)
  assert LoopPlan(bodies=1).ladder(64, (64, 52)) == (64,)
  assert LoopPlan(bodies=3).ladder(64, (64,)) == (64, 32, 16)
  assert LoopPlan(bodies=2).ladder(20, (20,)) == (20, 16)
  assert LoopPlan(bodies=4).ladder(2, (2,)) == (2, 1)
  # A padded plan runs a LoDTensor's loop at one body, its ladder aside.
  assert LoopPlan(padded=True).ladder(64, (64, 52, 44)) == (64,)
  assert LoopPlan(bodies=3, padded=True).ladder(64, (64,)) == (64,)


@pytest.mark.parametrize(
  ("kwargs", "error", "message"),
  [
    (dict(bodies=0), ValueError, r"Expected `bodies` >= 1, got 0"),
    (dict(bodies=True), TypeError, r"Expected `bodies` to be a static int, got True"),
    (dict(bodies=1.5), TypeError, r"Expected `bodies` to be a static int, got 1.5"),
    (dict(chunk=0), ValueError, r"Expected `chunk` >= 1, got 0"),
    (dict(chunk="8"), TypeError, r"Expected `chunk` to be a static int, got '8'"),
    (dict(chunk=2**31), ValueError, r"Expected `chunk` in \[1, 2147483647\]"),
    (dict(hoist=1), TypeError, r"Expected `hoist` to be a bool, got 1"),
    (dict(padded="yes"), TypeError, r"Expected `padded` to be a bool, got 'yes'"),
    (
      dict(padded=True, fused=True),
      ValueError,
      r"Expected at most one of `fused` and `padded` \(a padded scan runs no "
      r"kernel\), got both True\.",
    ),
  ],
)
def test_bad_plans_raise(kwargs, error, message):
  with pytest.raises(error, match=message):
    LoopPlan(**kwargs)


def test_numpy_values_make_the_same_plan():
  plan = LoopPlan(bodies=np.int64(2), chunk=np.int32(4), hoist=np.bool_(True))
  assert plan == LoopPlan(bodies=2, chunk=4, hoist=True)
  assert hash(plan) == hash(LoopPlan(bodies=2, chunk=4, hoist=True))


def test_bad_plan_arguments_raise():
  x = _batch([3, 1], np.float32)

  def step(h, x_t, _):
    return h + x_t.sum(-1), h

  with pytest.raises(TypeError, match=r"Expected `plan` to be a jaxlod.ops.LoopPlan"):
    dynamic_rnn(step, x, init_carry=jnp.zeros(2), plan="gpu")
  with pytest.raises(TypeError, match=r"Expected `backend` to be a string, got 3"):
    default_plan(3)
  with pytest.raises(
    ValueError, match=r"Got both `ladder` \(2,\) and `plan` with bodies=1"
  ):
    dynamic_rnn(step, x, init_carry=jnp.zeros(2), ladder=(2,), plan=ACCELERATOR)
  with pytest.raises(
    ValueError,
    match=r"Got both `ladder` \(2,\) and `plan` with bodies=None, padded=True; "
    r"pass one: a plan with `bodies` or `padded` chooses its own batch sizes\.",
  ):
    dynamic_rnn(step, x, init_carry=jnp.zeros(2), ladder=(2,), plan=PADDED)


def test_an_explicit_ladder_runs_under_the_default_plan():
  """A layer's or caller's ladder is honoured whatever the backend: the
  default plan's bodies give way to it."""
  from jaxlod.ops._loop._plan import plan_with_ladder

  assert plan_with_ladder(None, (8, 4)).bodies is None
  assert plan_with_ladder(None, (8, 4)).chunk == default_plan().chunk
  assert plan_with_ladder(ACCELERATOR, None) is ACCELERATOR
  assert plan_with_ladder(PADDED, None) is PADDED
