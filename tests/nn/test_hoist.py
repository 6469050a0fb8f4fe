"""Hoisting (`LoopPlan(hoist=True)`) in `DynamicRNN`, Linen and NNX, against a
masked `lax.scan` of the same Flax cell over the padded batch and against
the layer without hoisting."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

import jaxlod.nn.nnx as twin
from jaxlod import Buckets, LoDTensor
from jaxlod.nn import DynamicRNN
from jaxlod.ops import LoopPlan
from jaxlod.ops._loop._hoisted import previous_hidden
from tests.helpers import assert_close
from tests.ops.test_rnn import masked_scan

FEATURES, HIDDEN = 3, 4
# An empty sequence and a count slot past the data (5 sequences, capacity 6).
LENGTHS = [4, 0, 2, 5, 1]
BUCKETS = Buckets.fixed(tokens=16, sequences=6, time=7)
# Two levels; the loop runs over level 1: [3, 0, 4, 2] and a spare slot.
NESTED_LENGTHS = [[2, 0, 2], [3, 0, 4, 2]]
NESTED_BUCKETS = Buckets.fixed(tokens=12, sequences=(4, 5), time=(3, 6))
HOIST = LoopPlan(hoist=True)
ACCELERATOR = LoopPlan(bodies=1, chunk=4, hoist=True)
# float32: outputs, carries and the loss at the house tolerances; gradients
# are sums over steps and rows whose order hoisting changes (one product
# over all rows in place of a sum of per-step products).
TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}
TOL64 = {"rtol": 1e-10, "atol": 1e-10}

# Each cell with a non-default attribute where Flax has one to read.
LINEN_CELLS = {
  "lstm": lambda dtype: nn.LSTMCell(HIDDEN, param_dtype=dtype),
  "optimized_lstm": lambda dtype: nn.OptimizedLSTMCell(
    HIDDEN, gate_fn=jax.nn.hard_sigmoid, param_dtype=dtype
  ),
  "gru": lambda dtype: nn.GRUCell(
    HIDDEN, activation_fn=jax.nn.soft_sign, param_dtype=dtype
  ),
  "simple_residual": lambda dtype: nn.SimpleCell(
    HIDDEN, residual=True, param_dtype=dtype
  ),
  "mgu": lambda dtype: nn.MGUCell(HIDDEN, activation_fn=jax.nn.gelu, param_dtype=dtype),
  "mgu_no_reset": lambda dtype: nn.MGUCell(HIDDEN, reset_gate=False, param_dtype=dtype),
}
# flax 0.12.8 has no nnx.MGUCell. nnx.SimpleCell computes in float32 by
# default (`dtype=jnp.float32`): the dtype is given.
NNX_CELLS = {
  "lstm": lambda dtype, rngs: nnx.LSTMCell(
    FEATURES, HIDDEN, activation_fn=jax.nn.soft_sign, param_dtype=dtype, rngs=rngs
  ),
  "optimized_lstm": lambda dtype, rngs: nnx.OptimizedLSTMCell(
    FEATURES, HIDDEN, param_dtype=dtype, rngs=rngs
  ),
  "gru": lambda dtype, rngs: nnx.GRUCell(
    FEATURES, HIDDEN, gate_fn=jax.nn.hard_sigmoid, param_dtype=dtype, rngs=rngs
  ),
  "simple": lambda dtype, rngs: nnx.SimpleCell(
    FEATURES, HIDDEN, dtype=dtype, param_dtype=dtype, rngs=rngs
  ),
}


def _batch(dtype, nested=False, seed=0) -> LoDTensor:
  rng = np.random.default_rng(seed)
  if nested:
    values = rng.normal(size=(9, FEATURES)).astype(dtype)
    return LoDTensor.from_lengths(values, NESTED_LENGTHS, buckets=NESTED_BUCKETS)
  seqs = [rng.normal(size=(n, FEATURES)).astype(dtype) for n in LENGTHS]
  return LoDTensor.from_sequences(seqs, buckets=BUCKETS, dtype=dtype)


def _random_carry(cell_carry, seed=2):
  """Random leaves with the structure and dtypes of the cell's carry."""
  leaves, tree = jax.tree.flatten(cell_carry)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noise = [
    jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves, strict=True)
  ]
  return jax.tree.unflatten(tree, noise)


def _loss(padded, carry):
  """Weights every output position differently; adds the final carry."""
  weights = 1 + jnp.arange(padded.size).reshape(padded.shape) % 3
  total = jnp.sum(jnp.sin(padded) * weights)
  return total + sum(jnp.sum(a**2) for a in jax.tree.leaves(carry))


def _run_layer(layer, x, carry, call):
  """Loss and ``(padded outputs, final carry)`` of a DynamicRNN."""
  carry, y = call(layer, x, carry)
  padded = y.to_padded()[0]
  return _loss(padded, carry), (padded, carry)


def _run_scan(step, params, x, carry, reverse):
  """The reference: the Flax cell in a masked `lax.scan` over the padded batch."""
  padded, final, _ = masked_scan(
    lambda p, c, x_t, _: step(p, c, x_t), params, x, carry, reverse
  )
  return _loss(padded, final), (padded, final)


# -- one compiled program per cell and dtype: every run's loss, results, grads ----


def _linen_runs(make, dtype, nested):
  """``(layer_fn, scan_fn, args)``: ``layer_fn(reverse, plan)`` and
  ``scan_fn(reverse)`` are functions of ``args = (params, input values,
  initial carry)`` giving ``(loss, (padded outputs, final carry))``, of the
  layer and of the reference."""
  x = _batch(dtype, nested)
  cell = make(dtype)
  count = x.capacity.sequences[-1]
  carry = _random_carry(cell.initialize_carry(jax.random.key(0), (count, FEATURES)))
  params = DynamicRNN(cell).init(jax.random.key(1), x)

  def layer_fn(reverse, plan):
    rnn = DynamicRNN(cell, reverse=reverse, return_carry=True, plan=plan)

    def f(params, values, carry):
      call = lambda m, x, c: m.apply(params, x, c)  # noqa: E731
      return _run_layer(rnn, x.with_values(values), carry, call)

    return f

  def scan_fn(reverse):
    def f(params, values, carry):
      step = lambda p, c, x_t: cell.apply({"params": p["params"]["cell"]}, c, x_t)  # noqa: E731
      return _run_scan(step, params, x.with_values(values), carry, reverse)

    return f

  return layer_fn, scan_fn, (params, x.values, carry)


def _nnx_runs(make, dtype, nested):
  """As `_linen_runs`, over the NNX cell's state."""
  x = _batch(dtype, nested)
  cell = make(dtype, nnx.Rngs(1))
  count = x.capacity.sequences[-1]
  carry = _random_carry(cell.initialize_carry((count, FEATURES), nnx.Rngs(0)))
  graphdef, state = nnx.split(cell)

  def layer_fn(reverse, plan):
    def f(state, values, carry):
      rnn = twin.DynamicRNN(
        nnx.merge(graphdef, state), reverse=reverse, return_carry=True, plan=plan
      )
      call = lambda m, x, c: m(x, c)  # noqa: E731
      return _run_layer(rnn, x.with_values(values), carry, call)

    return f

  def scan_fn(reverse):
    def f(state, values, carry):
      step = lambda s, c, x_t: nnx.merge(graphdef, s)(c, x_t)  # noqa: E731
      return _run_scan(step, state, x.with_values(values), carry, reverse)

    return f

  return layer_fn, scan_fn, (state, x.values, carry)


def _check_against_scan(runs, make, dtype, plan, nested, plain, tol, grad_tol):
  """Both directions of the hoisted layer against the scan: outputs at real
  rows, final carries, loss, and gradients w.r.t. the parameters, the input
  values and the initial carry; with `plain`, its outputs, carries and loss
  against the layer without hoisting too."""
  layer_fn, scan_fn, args = runs(make, dtype, nested)
  grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)  # noqa: E731
  plain_plan = dataclasses.replace(plan, hoist=False)

  @jax.jit
  def all_runs(*args):
    out = {}
    for reverse in (False, True):
      out[reverse, "hoisted"] = grad(layer_fn(reverse, plan))(*args)
      out[reverse, "scan"] = grad(scan_fn(reverse))(*args)
      if plain:
        out[reverse, "plain"] = layer_fn(reverse, plain_plan)(*args)
    return out

  out = all_runs(*args)
  for reverse in (False, True):
    (loss, (padded, carry)), grads = out[reverse, "hoisted"]
    (want_loss, (want_padded, want_carry)), want_grads = out[reverse, "scan"]
    assert_close(padded, want_padded, **tol)
    assert_close(carry, want_carry, **tol)
    assert_close(loss, want_loss, **tol)
    assert_close(grads, want_grads, **grad_tol)
    if plain:
      assert_close((loss, (padded, carry)), out[reverse, "plain"], **tol)


# float32: the default plan's ladder (one body per size) and every check
# against the plain layer too; float64: the accelerator's plan (one body,
# chunks of 4 steps) over a 2-level input.


@pytest.mark.parametrize("name", sorted(LINEN_CELLS))
def test_linen_hoisting_matches_the_scan_float32(name):
  args = (LINEN_CELLS[name], jnp.float32, HOIST, False, True, TOL, GRAD_TOL)
  _check_against_scan(_linen_runs, *args)


@pytest.mark.parametrize("name", sorted(NNX_CELLS))
def test_nnx_hoisting_matches_the_scan_float32(name):
  args = (NNX_CELLS[name], jnp.float32, HOIST, False, True, TOL, GRAD_TOL)
  _check_against_scan(_nnx_runs, *args)


@pytest.mark.parametrize("name", sorted(LINEN_CELLS))
def test_linen_hoisting_matches_the_scan_float64(name):
  with jax.enable_x64(True):
    args = (LINEN_CELLS[name], jnp.float64, ACCELERATOR, True, False, TOL64, TOL64)
    _check_against_scan(_linen_runs, *args)


@pytest.mark.parametrize("name", sorted(NNX_CELLS))
def test_nnx_hoisting_matches_the_scan_float64(name):
  with jax.enable_x64(True):
    args = (NNX_CELLS[name], jnp.float64, ACCELERATOR, True, False, TOL64, TOL64)
    _check_against_scan(_nnx_runs, *args)


def test_hoisted_gradients_against_finite_differences():
  # The custom VJP's recurrent kernel and bias gradients (a GRU's candidate
  # goes through the probe), in reverse, numerically.
  with jax.enable_x64(True):
    layer_fn, _, args = _linen_runs(LINEN_CELLS["gru"], jnp.float64, False)
    loss = jax.jit(lambda *args: layer_fn(True, HOIST)(*args)[0])
    check_grads(loss, args, order=1, modes=("rev",))


def _loop_products(jaxpr, inside=False):
  """The ``dot_general`` equations of `jaxpr` inside a ``while`` loop's body,
  at any depth."""
  for eqn in jaxpr.eqns:
    if inside and eqn.primitive.name == "dot_general":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _loop_products(sub, inside or eqn.primitive.name == "while")


@pytest.mark.parametrize("name", ["optimized_lstm", "gru"])
def test_hoisted_backward_loop_reads_the_recurrent_kernel_row_major(name):
  # Each step's backward multiplies by a transposed copy of the kernel made
  # before the loop (``g @ w_t``), never by the kernel's transpose (``g @
  # w.T``), which XLA's CPU product runs slower with few rows.
  layer_fn, _, args = _linen_runs(LINEN_CELLS[name], jnp.float32, False)
  loss = lambda *args: layer_fn(False, HOIST)(*args)[0]  # noqa: E731
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr
  products = list(_loop_products(jaxpr))
  assert products  # the forward's ``h @ w`` and the backward's ``g @ w_t``
  for eqn in products:
    (_, rhs_contracting), _ = eqn.params["dimension_numbers"]
    assert tuple(rhs_contracting) == (0,), eqn


# -- the previous hidden state of each row -------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
def test_previous_hidden_is_the_neighbour_row_or_the_initial_state(reverse):
  # Sequences of 2, 0 and 3 rows, then a padding row; a spare count slot.
  offsets = jnp.array([0, 2, 2, 5, 5])
  y = jnp.arange(1.0, 7.0)[:, None]
  init = -jnp.arange(1.0, 5.0)[:, None]
  got = previous_hidden(y, offsets, init, reverse)[:, 0].tolist()
  if reverse:
    assert got == [2.0, -1.0, 4.0, 5.0, -3.0, 0.0]
  else:
    assert got == [-1.0, 1.0, -3.0, 3.0, 4.0, 0.0]


# -- parameters ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LINEN_CELLS))
def test_linen_parameters_are_the_cells_with_and_without_hoisting(name):
  # Shapes only (nothing compiles); the tests above run the plain layer's
  # parameters with hoisting.
  x = _batch(np.float32)
  cell = LINEN_CELLS[name](jnp.float32)
  key = jax.random.key(0)
  init = lambda module, x: jax.eval_shape(module.init, key, x)  # noqa: E731
  hoisted = init(DynamicRNN(cell, plan=HOIST), x)
  assert hoisted == init(DynamicRNN(cell, plan=LoopPlan()), x)
  assert hoisted == init(nn.RNN(cell), x.to_padded()[0])


def test_nnx_hoisting_leaves_the_state_unchanged():
  cell = NNX_CELLS["gru"](jnp.float32, nnx.Rngs(0))
  before = nnx.state(cell)
  rnn = twin.DynamicRNN(cell, plan=HOIST)
  y = rnn(_batch(np.float32))
  assert y.values.shape == (16, HIDDEN)
  assert jax.tree.structure(nnx.state(rnn.cell)) == jax.tree.structure(before)
  assert_close(nnx.state(rnn.cell), before, rtol=0, atol=0)


# -- errors --------------------------------------------------------------------------


class LinenUserCell(nn.GRUCell):
  """A subclass may change the math: it is not hoisted."""


class NNXUserCell(nnx.GRUCell):
  """A subclass may change the math: it is not hoisted."""


def test_linen_unsupported_cell_is_refused():
  x = _batch(np.float32)
  rnn = DynamicRNN(LinenUserCell(HIDDEN), plan=HOIST)
  match = (
    r"Expected `cell` to be one of Flax's separable cells \(nn\.LSTMCell, "
    r"nn\.OptimizedLSTMCell, nn\.GRUCell, nn\.SimpleCell, nn\.MGUCell\) to hoist "
    r"its input projection \(a plan with hoist=True or fused=True\), got "
    r"LinenUserCell; use "
    r"a jaxlod\.ops\.LoopPlan with hoist=False and fused=False for other cells "
    r"\(jaxlod\.ops\.dynamic_rnn runs any cell\)\."
  )
  with pytest.raises(TypeError, match=match):
    rnn.init(jax.random.key(0), x)
  # The same cell runs without hoisting.
  DynamicRNN(LinenUserCell(HIDDEN), plan=LoopPlan()).init(jax.random.key(0), x)


def test_nnx_unsupported_cell_is_refused():
  rnn = twin.DynamicRNN(NNXUserCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0)), plan=HOIST)
  match = (
    r"Expected `cell` to be one of Flax's separable cells \(nnx\.LSTMCell, "
    r"nnx\.OptimizedLSTMCell, nnx\.GRUCell, nnx\.SimpleCell\) to hoist its input "
    r"projection \(a plan with hoist=True or fused=True\), got NNXUserCell; use "
    r"a jaxlod\.ops\.LoopPlan with hoist=False and fused=False for other cells "
    r"\(jaxlod\.ops\.dynamic_rnn runs any cell\)\."
  )
  with pytest.raises(TypeError, match=match):
    rnn(_batch(np.float32))


def _promote(args, dtype=None, inexact=True):
  return nnx.nn.dtypes.promote_dtype(args, dtype=dtype, inexact=inexact)


def test_nnx_cell_attributes_hoisting_cannot_honour_are_refused():
  x = _batch(np.float32)
  cell = nnx.GRUCell(FEATURES, HIDDEN, promote_dtype=_promote, rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError,
    match=(
      r"Cannot hoist nnx\.GRUCell: its Linear `dense_i` has `promote_dtype` "
      r"<function _promote at .*>, and hoisting computes with Flax's defaults "
      r"only; use jaxlod\.ops\.LoopPlan\(hoist=False\) for this cell\."
    ),
  ):
    twin.DynamicRNN(cell, plan=HOIST)(x)
  cell = nnx.LSTMCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
  cell.hf.precision = jax.lax.Precision.HIGHEST
  with pytest.raises(
    ValueError,
    match=(
      r"Cannot hoist nnx\.LSTMCell: its Linear layers ii, if_, ig, io, hi, hf, hg, "
      r"ho differ in `dtype` or `precision` \(.*\), and hoisting computes them "
      r"together; use jaxlod\.ops\.LoopPlan\(hoist=False\) for this cell\."
    ),
  ):
    twin.DynamicRNN(cell, plan=HOIST)(x)


def test_plan_must_be_a_loop_plan_and_agree_with_the_ladder():
  x = _batch(np.float32)
  match = r"Expected `plan` to be a jaxlod\.ops\.LoopPlan or None, got str\."
  with pytest.raises(TypeError, match=match):
    DynamicRNN(nn.GRUCell(HIDDEN), plan="hoist").init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=match):
    twin.DynamicRNN(nnx.GRUCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0)), plan="hoist")
  match = r"Got both `ladder` \(6, 3\) and `plan` with bodies=1; pass one"
  with pytest.raises(ValueError, match=match):
    DynamicRNN(nn.GRUCell(HIDDEN), ladder=(6, 3), plan=ACCELERATOR).init(
      jax.random.key(0), x
    )
  with pytest.raises(ValueError, match=match):
    twin.DynamicRNN(
      nnx.GRUCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0)), ladder=(6, 3), plan=ACCELERATOR
    )
