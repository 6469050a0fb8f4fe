"""`jaxlod.ops.dynamic_rnn` as the recurrent engine's one front door: a
`Separable` step runs hoisted, or through the fused kernel under a fused
plan, and equals the same cell written as a step function (values and
gradients, float64); its own errors name the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlod import LoDTensor
from jaxlod.ops import LoopPlan, Separable, dynamic_rnn


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


FEATURES, HIDDEN = 3, 4
LENGTHS = [3, 0, 5, 1]


def _weights(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "w_in": jnp.asarray(rng.normal(size=(FEATURES, HIDDEN))),
    "b_in": jnp.asarray(rng.normal(size=(HIDDEN,))),
    "w_rec": jnp.asarray(rng.normal(size=(HIDDEN, HIDDEN)) * 0.5),
  }


def _cell(p):
  """A simple tanh cell as a `Separable`: ``h = tanh(x @ w_in + b_in + h @ w_rec)``."""

  def gates(h, xp, hp):
    h = jnp.tanh(xp[0] + hp[0])
    return h, h

  return Separable(
    w_in=p["w_in"],
    b_in=p["b_in"],
    w_rec=p["w_rec"],
    gates=gates,
    hidden=lambda h: h,
    parts=1,
  )


def _step(p):
  def step(h, x_t, _):
    h = jnp.tanh(x_t @ p["w_in"] + p["b_in"] + h @ p["w_rec"])
    return h, h

  return step


def _batch():
  rng = np.random.default_rng(1)
  return LoDTensor.from_lengths(rng.normal(size=(sum(LENGTHS), FEATURES)), [LENGTHS])


@pytest.mark.parametrize("plan", [None, LoopPlan(fused=True)], ids=["hoisted", "fused"])
@pytest.mark.parametrize("reverse", [False, True])
def test_a_separable_step_equals_its_step_function(plan, reverse):
  x, h0 = _batch(), jnp.asarray(np.random.default_rng(2).normal(size=(4, HIDDEN)))

  def loss(p, values, h0, make):
    ys, h = dynamic_rnn(
      make(p), x.with_values(values), init_carry=h0, reverse=reverse, plan=plan
    )
    return jnp.sum(ys.values**2) + jnp.sum(jnp.sin(h)), (ys.values, h)

  run = jax.jit(
    jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3
  )
  (_, got), got_grads = run(_weights(), x.values, h0, _cell)
  (_, want), want_grads = run(_weights(), x.values, h0, _step)
  assert got[0].dtype == jnp.float64
  for g, w in zip(
    jax.tree.leaves((got, got_grads)), jax.tree.leaves((want, want_grads)), strict=True
  ):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_a_separable_step_returns_only_the_carry_without_sequences():
  x, h0 = _batch(), jnp.zeros((4, HIDDEN))
  h = dynamic_rnn(_cell(_weights()), x, init_carry=h0, return_sequences=False)
  _, want = dynamic_rnn(_step(_weights()), x, init_carry=h0)
  np.testing.assert_allclose(h, want, rtol=1e-12, atol=1e-12)


def test_a_separable_step_takes_no_static_inputs():
  x, h0 = _batch(), jnp.zeros((4, HIDDEN))
  with pytest.raises(
    ValueError, match=r"no `static_inputs` with a Separable `step_fn`"
  ):
    dynamic_rnn(_cell(_weights()), x, init_carry=h0, static_inputs=jnp.zeros((4, 2)))


def test_a_separable_step_takes_one_lodtensor():
  x, h0 = _batch(), jnp.zeros((4, HIDDEN))
  with pytest.raises(
    TypeError, match=r"Expected `inputs` to be a LoDTensor, got tuple"
  ):
    dynamic_rnn(_cell(_weights()), (x, x), init_carry=h0)


def test_a_step_fn_neither_callable_nor_separable_is_named():
  x, h0 = _batch(), jnp.zeros((4, HIDDEN))
  with pytest.raises(TypeError, match=r"`step_fn`"):
    dynamic_rnn(3, x, init_carry=h0)
