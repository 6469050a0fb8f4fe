"""The drop-in RNNs' plans: the rule that picks one per padded shape, and
the padded plan (``LoopPlan(padded=True)``), the masked `lax.scan` over
the padded batch with no packing. Here: the rule's choices; gradients
against Flax's own padded scan in float64 and float32, remat, a LoDTensor
under the plan, bad lengths and the errors. Values for every Flax cell
under each padded plan, the NNX twin, one trace per padded shape, empty
batches and NaN for bad lengths under `jit`: tests/nn/test_dropin.py, per
plan."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlod.nn as linen
import jaxlod.nn.nnx as twin
from jaxlod import LoDTensor
from jaxlod.ops import LoopPlan
from tests.nn.test_dropin import (
  B1,
  B2,
  FEATURES,
  HIDDEN,
  TIME,
  _inputs,
)
from tests.nn.test_hoist import LINEN_CELLS

PLANS = {
  "padded": LoopPlan(padded=True),
  "padded_hoist": LoopPlan(padded=True, hoist=True),
  "padded_chunk3": LoopPlan(padded=True, chunk=3),
}


def _gradients(layer, params, x, lengths, flat):
  """Gradients w.r.t. the parameters and the inputs of a loss over the real
  steps' outputs and the final carries of the nonempty sequences (Flax's
  carry for an empty one is its last padded step's)."""
  mask = (jnp.arange(TIME) < lengths.reshape(-1, 1))[..., None]
  nonempty = lengths.reshape(-1, 1) > 0

  def loss(params, x):
    carry, y = layer.apply(
      params, x, seq_lengths=lengths.reshape(-1) if flat else lengths
    )
    y = y.reshape(B1 * B2, TIME, HIDDEN)
    c, h = (a.reshape(B1 * B2, HIDDEN) for a in carry)
    return jnp.sum(jnp.where(mask, y, 0.0) ** 2) + jnp.sum(
      jnp.where(nonempty, c * h, 0)
    )

  return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


@pytest.mark.parametrize("plan", ["padded", "padded_hoist"])
@pytest.mark.parametrize(
  ("dtype", "tol"),
  [(jnp.float64, 1e-10), (jnp.float32, 1e-5)],
  ids=["float64", "float32"],
)
def test_linen_padded_plan_gradients_match_flax(plan, dtype, tol):
  with jax.enable_x64(dtype == jnp.float64):
    cell = nn.LSTMCell(HIDDEN, param_dtype=dtype)
    lengths = jnp.array([[5, 2, 1], [3, 0, 4]], jnp.int32)
    x = jnp.asarray(_inputs(), dtype)
    flat = x.reshape(B1 * B2, TIME, FEATURES)
    for reverse in (False, True):
      theirs = nn.RNN(cell, return_carry=True, reverse=reverse)
      params = theirs.init(jax.random.key(1), flat)
      want = _gradients(theirs, params, flat, lengths, True)
      ours = linen.RNN(cell, return_carry=True, reverse=reverse, plan=PLANS[plan])
      got = _gradients(ours, params, x, lengths, False)
      np.testing.assert_allclose(want[1].reshape(x.shape), got[1], rtol=tol, atol=tol)
      for a, b in zip(jax.tree.leaves(want[0]), jax.tree.leaves(got[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(LINEN_CELLS))
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_every_separable_cell_under_the_hoisted_padded_plan_has_flaxs_gradients(
  name, reverse
):
  """The hoisted padded plan takes the recurrent kernel's gradient as one
  product after the loop (and a gated cell's recurrent bias through its
  probe columns): float64 gradients of the parameters, the inputs and the
  initial carry equal Flax's, with an empty sequence and a full one."""
  lengths = jnp.array([5, 2, 0, 3], jnp.int32)
  mask = (jnp.arange(TIME) < lengths[:, None])[..., None]
  nonempty = (lengths > 0)[:, None]

  def loss(layer, params, x, carry):
    carry, y = layer.apply(params, x, initial_carry=carry, seq_lengths=lengths)
    ends = sum(jnp.sum(jnp.where(nonempty, c, 0) ** 2) for c in jax.tree.leaves(carry))
    return jnp.sum(jnp.where(mask, y, 0.0) ** 2) + ends

  with jax.enable_x64(True):
    cell = LINEN_CELLS[name](jnp.float64)
    x = jnp.asarray(_inputs()).reshape(-1, TIME, FEATURES)[:4]
    carry = jax.tree.map(
      lambda c: 0.5 * jnp.ones_like(c),
      cell.initialize_carry(jax.random.key(2), x[:, 0].shape),
    )
    theirs = nn.RNN(cell, return_carry=True, reverse=reverse)
    params = theirs.init(jax.random.key(1), x)
    ours = linen.RNN(
      cell, return_carry=True, reverse=reverse, plan=PLANS["padded_hoist"]
    )
    grad = jax.grad(loss, argnums=(1, 2, 3))
    want = grad(theirs, params, x, carry)
    got = jax.jit(grad, static_argnums=0)(ours, params, x, carry)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_linen_padded_plan_with_remat_matches_the_packed_plan():
  cell = nn.OptimizedLSTMCell(HIDDEN, param_dtype=jnp.float64)
  lengths = jnp.array([[5, 2, 1], [3, 0, 4]], jnp.int32)
  with jax.enable_x64(True):
    x = jnp.asarray(_inputs())
    packed = linen.RNN(cell, return_carry=True)
    params = packed.init(jax.random.key(1), x)
    want = _gradients(packed, params, x, lengths, False)
    padded = linen.RNN(cell, return_carry=True, remat=True, plan=PLANS["padded"])
    got = _gradients(padded, params, x, lengths, False)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_a_lod_under_the_padded_plan_runs_one_body():
  """A LoDTensor has no padding to keep: the padded plan runs its loop at
  one body, the full batch, with the results of the ladder's."""
  x = LoDTensor.from_sequences(
    [np.ones((3, 2)), np.ones((1, 2)), np.ones((0, 2))], dtype="f4"
  )
  cell = nn.GRUCell(HIDDEN)
  params = linen.DynamicRNN(cell).init(jax.random.key(0), x)
  want = linen.DynamicRNN(cell).apply(params, x)
  got = linen.RNN(cell, plan=PLANS["padded"]).apply(params, x)
  np.testing.assert_allclose(want.values, got.values, rtol=1e-6, atol=1e-6)
  assert got.recursive_lengths() == x.recursive_lengths()


def test_padded_plan_bad_lengths_eagerly_an_error():
  """Eagerly an error naming the length (under `jit`, NaN:
  tests/nn/test_dropin.py)."""
  x = jnp.ones((2, TIME, 3))
  layer = linen.RNN(nn.GRUCell(4), return_carry=True, plan=PLANS["padded"])
  params = layer.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"got seq_lengths\[1\] = 7\."):
    layer.apply(params, x, seq_lengths=jnp.array([2, 7]))


def test_padded_plan_with_a_ladder_raises():
  layer = linen.RNN(nn.GRUCell(4), plan=PLANS["padded"], ladder=(2, 1))
  x = jnp.ones((2, TIME, 3))
  with pytest.raises(ValueError, match=r"Got both `ladder` \(2, 1\) and `plan`"):
    layer.init(jax.random.key(0), x)


# -- the plan per shape -----------------------------------------------------------


@pytest.fixture
def hoisted_calls(monkeypatch):
  """The front door's calls of the hoisted loop, recorded at trace time."""
  from jaxlod.ops._loop import _dispatch

  calls = []

  def spy(cell, x, **settings):
    calls.append(settings["plan"])
    return hoisted(cell, x, **settings)

  hoisted = _dispatch.hoisted_rnn
  monkeypatch.setattr(_dispatch, "hoisted_rnn", spy)
  return calls


def _trace(layer, batch, time, **call):
  x = jnp.ones((batch, time, 3))
  lengths = jnp.full((batch,), time, jnp.int32)
  jax.eval_shape(
    lambda: layer.init_with_output(jax.random.key(0), x, seq_lengths=lengths, **call)
  )


@pytest.mark.parametrize(
  ("batch", "time", "hoist"),
  [(4, 16, True), (8, 256, True), (8, 1024, True), (9, 8, False), (32, 8, False)],
)
def test_the_drop_in_picks_its_plan_per_shape(hoisted_calls, batch, time, hoist):
  _trace(linen.RNN(nn.LSTMCell(HIDDEN)), batch, time)
  assert [plan.hoist for plan in hoisted_calls] == ([True] if hoist else [])


def test_the_nnx_drop_in_picks_its_plan_per_shape(hoisted_calls):
  cell = nnx.OptimizedLSTMCell(3, HIDDEN, rngs=nnx.Rngs(0))
  for batch, hoisted in ((4, 1), (64, 1)):
    twin.RNN(cell)(jnp.ones((batch, TIME, 3)))
    assert len(hoisted_calls) == hoisted


def test_an_explicit_plan_wins_over_the_shape(hoisted_calls):
  _trace(linen.RNN(nn.LSTMCell(HIDDEN), plan=LoopPlan()), 4, 16)
  assert hoisted_calls == []


def test_the_shape_plan_keeps_the_layers_ladder_and_unroll(hoisted_calls):
  _trace(linen.RNN(nn.LSTMCell(HIDDEN), ladder=(4, 2), unroll=3), 4, 16)
  assert hoisted_calls == [LoopPlan(chunk=3, hoist=True)]


def test_a_cell_that_is_not_separable_runs_unhoisted_at_any_shape(hoisted_calls):
  class Scaled(nn.GRUCell):  # a subclass may change the math: not hoisted
    pass

  cell = Scaled(HIDDEN, param_dtype=jnp.float64)
  lengths = jnp.array([5, 2, 0, 3], jnp.int32)
  with jax.enable_x64(True):
    x = jnp.asarray(_inputs()).reshape(-1, TIME, FEATURES)[:4]
    params = nn.RNN(cell).init(jax.random.key(0), x)
    want = nn.RNN(cell).apply(params, x, seq_lengths=lengths)
    got = linen.RNN(cell).apply(params, x, seq_lengths=lengths)
  mask = (np.arange(TIME) < np.asarray(lengths)[:, None])[..., None]
  np.testing.assert_allclose(np.where(mask, want, 0), got, rtol=1e-10, atol=1e-10)
  assert hoisted_calls == []
