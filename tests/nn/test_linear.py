"""`MinGRU` and `RGLRU` against `jaxlod.ops.dynamic_rnn` with their step
written out (the reference steps): outputs, final states and gradients
(parameters, inputs, initial states), float64 tight, both directions, with
empty sequences and a 2-level LoD; inside `Bidirectional` and
`StackedRNN`; one compilation over lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlod.nn as linen
from jaxlod import Buckets, LoDTensor
from jaxlod.ops import dynamic_rnn

FEATURES, HIDDEN = 3, 5
BUCKETS = Buckets.fixed(tokens=24, sequences=6, time=9)
TIGHT = {"rtol": 1e-11, "atol": 1e-11}


def _dense(params, x):
  return x @ params["kernel"] + params["bias"]


def min_gru_step(params):
  def step(h, x_t, _):
    g = _dense(params["gates"], x_t)
    z = jax.nn.sigmoid(g[:, :HIDDEN])
    h = (1 - z) * h + z * g[:, HIDDEN:]
    return h, h

  return step


def rg_lru_step(params, c=8.0):
  def step(h, x_t, _):
    g = _dense(params["gates"], x_t)
    u, r, i = g[:, :HIDDEN], g[:, HIDDEN : 2 * HIDDEN], g[:, 2 * HIDDEN :]
    a = jax.nn.sigmoid(params["a_param"]) ** (c * jax.nn.sigmoid(r))
    h = a * h + jnp.sqrt(1 - a**2) * (jax.nn.sigmoid(i) * u)
    return h, h

  return step


LAYERS = {"min_gru": (linen.MinGRU, min_gru_step), "rg_lru": (linen.RGLRU, rg_lru_step)}


def _x(lengths, dtype, seed=0, lod=None):
  rng = np.random.default_rng(seed)
  values = rng.normal(size=(sum(lengths), FEATURES)).astype(dtype)
  return LoDTensor.from_lengths(values, lod or [lengths], buckets=BUCKETS)


def _both(name, reverse, x, carry):
  cls, step_of = LAYERS[name]
  layer = cls(HIDDEN, reverse=reverse, return_carry=True)
  params = layer.init(jax.random.key(1), x)
  # Perturb the biases, so that every parameter matters.
  params = jax.tree.map(
    lambda p: p + 0.1 * jnp.cos(jnp.arange(p.size)).reshape(p.shape), params
  )

  def ours(params, values, carry):
    final, out = layer.apply(params, x.with_values(values), carry)
    return final, out.values

  def reference(params, values, carry):
    out, final = dynamic_rnn(
      step_of(params["params"]),
      x.with_values(values),
      init_carry=carry,
      reverse=reverse,
    )
    return final, out.values

  return ours, reference, params


def _loss(fn):
  def loss(*args):
    final, values = fn(*args)
    return jnp.sum(jnp.sin(final)) + jnp.sum(
      values * jnp.cos(jnp.arange(values.size)).reshape(values.shape)
    )

  return loss


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("name", LAYERS)
def test_layers_equal_their_dynamic_rnn_reference_steps(name, reverse):
  with jax.enable_x64(True):
    for lengths, lod in (
      ([4, 0, 6, 1, 0, 5], None),
      ([3, 2, 4], [[2, 0, 1], [3, 2, 4]]),
    ):
      x = _x(lengths, np.float64, lod=lod)
      count = x.capacity.sequences[-1]
      carry = np.random.default_rng(2).normal(size=(count, HIDDEN))
      ours, reference, params = _both(name, reverse, x, carry)
      args = (params, x.values, carry)
      got, want = jax.jit(ours)(*args), jax.jit(reference)(*args)
      for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TIGHT)
      grads = [
        jax.jit(jax.grad(_loss(fn), argnums=(0, 1, 2)))(
          params, x.values, jnp.asarray(carry)
        )
        for fn in (ours, reference)
      ]
      for g, w in zip(*(jax.tree.leaves(gr) for gr in grads), strict=True):
        np.testing.assert_allclose(g, w, **TIGHT)


@pytest.mark.parametrize("name", LAYERS)
def test_float32_default_zero_carry_and_padding_rows(name):
  x = _x([2, 5, 0, 3], np.float32)
  cls, step_of = LAYERS[name]
  params = cls(HIDDEN).init(jax.random.key(0), x)
  out = jax.jit(cls(HIDDEN).apply)(params, x)
  zeros = np.zeros((x.capacity.sequences[-1], HIDDEN), np.float32)
  want, _ = jax.jit(
    lambda p, x: dynamic_rnn(step_of(p["params"]), x, init_carry=zeros)
  )(params, x)
  # float32: the reference's sqrt(1 - a**2) cancels near a = 1 (the layer's
  # expm1 does not), about 2e-5 apart.
  np.testing.assert_allclose(out.values, want.values, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(out.values)[10:] == 0)


def test_inside_bidirectional_and_stacked_rnn():
  x = _x([2, 5, 0, 3], np.float32)
  bidirectional = linen.Bidirectional(linen.MinGRU(HIDDEN), linen.RGLRU(HIDDEN + 1))
  params = bidirectional.init(jax.random.key(0), x)
  out = bidirectional.apply(params, x)
  forward = linen.MinGRU(HIDDEN).apply({"params": params["params"]["forward_rnn"]}, x)
  backward = linen.RGLRU(HIDDEN + 1, reverse=True).apply(
    {"params": params["params"]["backward_rnn"]}, x
  )
  np.testing.assert_allclose(
    out.values, np.concatenate([forward.values, backward.values], -1), rtol=1e-6
  )
  stacked = linen.StackedRNN([linen.RGLRU(HIDDEN), linen.MinGRU(HIDDEN)])
  params = stacked.init(jax.random.key(1), x)
  carries, out = stacked.apply(params, x, return_carry=True)
  assert out.values.shape == (24, HIDDEN) and len(carries) == 2


def test_one_compilation_over_lengths():
  layer = linen.RGLRU(HIDDEN)
  params = layer.init(jax.random.key(0), _x([1], np.float32))
  traces = []

  @jax.jit
  def run(params, x):
    traces.append(1)
    return layer.apply(params, x).values

  rng = np.random.default_rng(5)
  for _ in range(8):
    run(params, _x(list(rng.integers(0, 5, size=5)), np.float32))
  assert len(traces) == 1


def test_errors():
  x = _x([2, 1], np.float32)
  layer = linen.MinGRU(HIDDEN)
  params = layer.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"`initial_carry` to have shape \(6, 5\)"):
    layer.apply(params, x, np.zeros((6, 4), np.float32))
  with pytest.raises(TypeError, match="`reverse`"):
    layer.apply(params, x, reverse=1)
  with pytest.raises(ValueError, match="`c`"):
    linen.RGLRU(HIDDEN, c=0.0).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"\[tokens, features\]"):
    layer.init(jax.random.key(0), x.with_values(np.zeros((24, 2, 2), np.float32)))


def test_rg_lru_coefficients_derivative_finite_at_saturated_gate():
  from jaxlod.nn._recurrent import rg_lru_coefficients

  jac = jax.jacobian(lambda g: rg_lru_coefficients(g, jnp.array([3.0]), 8.0)[1])(
    jnp.array([[1.0, -200.0, 0.0]])
  )
  assert np.all(np.isfinite(jac))
  np.testing.assert_array_equal(jac[0, 0, 0, 1], 0.0)


def test_rg_lru_coefficients_gradients_away_from_edge():
  from jax.test_util import check_grads

  from jaxlod.nn._recurrent import rg_lru_coefficients

  with jax.enable_x64(True):
    g = jnp.array([[0.5, -1.0, 0.3], [1.2, 2.0, -0.4]], jnp.float64)
    a = jnp.array([1.5], jnp.float64)
    check_grads(
      lambda g, a: rg_lru_coefficients(g, a, 8.0)[1], (g, a), order=2, modes=("rev",)
    )


@pytest.mark.parametrize("scale", [60.0, 200.0])
def test_rg_lru_gradients_are_finite_where_the_gate_saturates(scale):
  """float32 inputs of scale 60 and 200 saturate the recurrence gate (its
  sigmoid underflows to 0): outputs and every gradient stay finite, in
  both twins."""
  from flax import nnx

  import jaxlod.nn.nnx as twin

  x = _x([5, 0, 3, 4], np.float32, seed=2)
  x = x.with_values(x.values * scale)
  weights = jnp.cos(jnp.arange(x.capacity.tokens * HIDDEN)).reshape(-1, HIDDEN)

  layer = linen.RGLRU(HIDDEN)
  params = layer.init(jax.random.key(0), x)

  def linen_loss(params, values):
    return jnp.sum(layer.apply(params, x.with_values(values)).values * weights)

  model = twin.RGLRU(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def nnx_loss(state, values):
    out = nnx.merge(graphdef, state)(x.with_values(values))
    return jnp.sum(out.values * weights)

  for loss, variables in ((linen_loss, params), (nnx_loss, state)):
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
      variables, x.values
    )
    assert np.isfinite(value)
    for leaf in jax.tree.leaves(grads):
      assert np.all(np.isfinite(np.asarray(leaf)))
