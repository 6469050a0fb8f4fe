"""`jaxlod.testing.check_independent`: it passes independent functions and
names the sequence, the perturbation and the output of a leak, eagerly and
under `jit`; and the ops that once leaked pass it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlod.nn as linen
from jaxlod import LoDTensor, ops
from jaxlod.testing import IndependenceError, check_independent


def _x() -> LoDTensor:
  values = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
  return LoDTensor.from_lengths(values, [[3, 0, 2, 2]])


@pytest.mark.parametrize("jit", [False, True])
def test_independent_functions_pass(jit):
  x = _x()
  check_independent(lambda x: ops.sequence_pool(x, "sum"), x, jit=jit)
  column = x.with_values(np.asarray(x.values)[:, :1])
  check_independent(ops.sequence_softmax, column, jit=jit)

  def rnn(x):
    step = lambda h, x_t, _: (jnp.tanh(x_t + h),) * 2  # noqa: E731
    outputs, final = ops.dynamic_rnn(step, x, init_carry=jnp.zeros((4, 3)))
    return outputs, final

  check_independent(rnn, x, jit=jit)


def test_linear_scan_and_the_layers_over_it_pass():
  x = _x()
  a = x.with_values(np.full((7, 3), 0.5, np.float32))
  check_independent(lambda b: ops.linear_scan(a, b), x, jit=True)
  check_independent(lambda a_: ops.linear_scan(a_, x), a, jit=True)
  layer = linen.MinGRU(4)
  params = layer.init(jax.random.key(0), x)
  check_independent(lambda x: layer.apply(params, x), x, jit=True)


@pytest.mark.parametrize("jit", [False, True])
def test_a_batch_wide_mean_is_named(jit):
  def leaky(x):
    return x.with_values(x.values + x.values.mean())

  with pytest.raises(
    IndependenceError,
    match=r"Perturbing sequence 0 \(level -1\) with 'random' changed output "
    r"<root> of sequence 2",
  ):
    check_independent(leaky, _x(), jit=jit)


def test_a_masked_multiply_across_the_batch_is_found_by_nan():
  """``0 * nan`` survives a mask: the leak shows only under NaN."""

  def leaky(x):
    total = jnp.sum(x.values * 0.0)  # 0 for finite rows, NaN for any NaN
    return x.with_values(x.values + total)

  check_independent(leaky, _x(), perturbations=("random", "large"))
  with pytest.raises(IndependenceError, match=r"with 'inf' changed output <root>"):
    check_independent(leaky, _x())


def test_a_gradient_only_leak_is_found():
  @jax.custom_vjp
  def ident(v):
    return v

  def fwd(v):
    return v, v

  def bwd(v, g):
    return (g + jnp.sum(v) * 0 + jnp.sum(v[:3]),)  # every row's gradient reads
    # the first sequence's values

  ident.defvjp(fwd, bwd)

  with pytest.raises(IndependenceError, match="changed the gradient of `x.values`"):
    check_independent(lambda x: x.with_values(ident(x.values)), _x())
  check_independent(lambda x: x.with_values(ident(x.values)), _x(), grads=False)


def test_the_drop_in_rnn_passes_over_a_lod_tensor():
  x = _x()
  layer = linen.RNN(nn.GRUCell(4))
  params = layer.init(jax.random.key(0), x)
  check_independent(lambda x: layer.apply(params, x), x, jit=True)


def test_bad_arguments():
  with pytest.raises(TypeError, match="Expected `x` to be a LoDTensor, got ndarray"):
    check_independent(lambda x: x, np.zeros(3))
  with pytest.raises(ValueError, match=r"`perturbations` in .*got 'huge'"):
    check_independent(lambda x: x, _x(), perturbations=("huge",))
  with pytest.raises(TypeError, match="Expected `fn` to be callable, got int"):
    check_independent(3, _x())
  with pytest.raises(TypeError, match="`perturbations` to be a sequence of str"):
    check_independent(lambda x: x, _x(), perturbations="inf")
  with pytest.raises(ValueError, match=r"`level` in \[-1, 1\).*got 1"):
    check_independent(lambda x: x, _x(), level=1)
  ids = LoDTensor.from_lengths(np.arange(3, dtype=np.int32), [[2, 1]])
  with pytest.raises(ValueError, match="`grads` False or None for `x.values` of int32"):
    check_independent(lambda x: x, ids, grads=True)
  check_independent(lambda x: x, ids)  # no gradients of integers by default
  with pytest.raises(ValueError, match=r"`rtol` >= 0, got -1"):
    check_independent(lambda x: x, _x(), rtol=-1)
  with pytest.raises(ValueError, match=r"`seed` >= 0, got -2"):
    check_independent(lambda x: x, _x(), seed=-2)
