"""`jaxlod.ops.fused_rnn` (the fused Pallas recurrence, in interpret mode on
the CPU) against `jaxlod.ops.dynamic_rnn` with the same Flax cell: values,
final carries and gradients (inputs, parameters, initial carries), float64
tight and float32 at a stated tolerance, random LoDs with empty sequences,
both directions, several tiles and capacities; bfloat16 products against
float32; the layers' ``LoopPlan(fused=True)``; the errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxlod.nn as linen
import jaxlod.nn.nnx as twin
from jaxlod import Buckets, Fault, LoDTensor
from jaxlod.nn import _hoist
from jaxlod.ops import LoopPlan, Separable, dynamic_rnn, fused_rnn, rank_table
from tests.helpers import LINEN_CELLS, NNX_CELLS

FEATURES, HIDDEN, COUNT, TIME = 3, 4, 6, 7
CAPACITY = Buckets.fixed(tokens=COUNT * TIME, sequences=COUNT, time=TIME)
FUSED, LOOP = LoopPlan(fused=True), LoopPlan()
TIGHT = {"rtol": 1e-12, "atol": 1e-12}  # float64: the same sums in another order
FLOAT32 = {"rtol": 2e-5, "atol": 2e-5}  # float32: products summed in another order
LENGTHS = st.lists(st.integers(0, TIME), min_size=1, max_size=COUNT)


def _batch(lengths, dtype, seed=0) -> LoDTensor:
  rng = np.random.default_rng(seed)
  seqs = [rng.normal(size=(n, FEATURES)) for n in lengths]
  x = LoDTensor.from_sequences(seqs, buckets=CAPACITY)
  return x.with_values(x.values.astype(dtype))


def _loss(outputs, carry):
  """Every output row and final carry leaf reaches the loss, nonlinearly."""
  total = jnp.sum(jnp.sin(outputs.values))
  return total + sum(jnp.sum(jnp.cos(leaf)) for leaf in jax.tree.leaves(carry))


def _assert_close(a, b, tol) -> None:
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tol)


def _linen_pair(name, dtype, reverse):
  """The jitted value-and-gradient of a Linen `DynamicRNN` under the fused
  plan and under the loop's, w.r.t. parameters, inputs and initial carry."""
  cell = LINEN_CELLS[name](HIDDEN, param_dtype=dtype)

  def run(plan):
    layer = linen.DynamicRNN(cell, reverse=reverse, return_carry=True, plan=plan)

    def loss(params, values, carry, x):
      final, y = layer.apply(params, x.with_values(values), initial_carry=carry)
      return _loss(y, final), (y, final)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  x = _batch([1] * COUNT, dtype)
  params = linen.DynamicRNN(cell).init(jax.random.key(0), x)
  return run(FUSED), run(LOOP), params, cell


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("name", LINEN_CELLS)
def test_linen_cells_equal_dynamic_rnn_float64(name, reverse):
  with jax.enable_x64(True):
    fused, loop, params, cell = _linen_pair(name, jnp.float64, reverse)

    @settings(max_examples=4, deadline=None)
    @given(LENGTHS, st.integers(0, 2**16))
    def check(lengths, seed):
      x = _batch(lengths, jnp.float64, seed)
      carry = cell.initialize_carry(jax.random.key(seed), (COUNT, FEATURES))
      carry = jax.tree.map(lambda a: a + 0.5, carry)  # a nonzero initial carry
      _assert_close(
        fused(params, x.values, carry, x), loop(params, x.values, carry, x), TIGHT
      )

    check()


@pytest.mark.parametrize("name", ["LSTMCell", "GRUCell"])
def test_linen_cells_equal_dynamic_rnn_float32(name):
  fused, loop, params, cell = _linen_pair(name, jnp.float32, True)
  x = _batch([7, 0, 3, 5, 1, 7], jnp.float32)
  carry = cell.initialize_carry(jax.random.key(1), (COUNT, FEATURES))
  _assert_close(
    fused(params, x.values, carry, x), loop(params, x.values, carry, x), FLOAT32
  )


@pytest.mark.parametrize("name", NNX_CELLS)
def test_nnx_cells_equal_dynamic_rnn_float64(name):
  with jax.enable_x64(True):
    f64 = {"dtype": jnp.float64, "param_dtype": jnp.float64}
    cell = NNX_CELLS[name](FEATURES, HIDDEN, **f64, rngs=nnx.Rngs(0))
    x = _batch([7, 0, 3, 5, 1], jnp.float64)

    def grads(plan, reverse):
      @nnx.jit
      def run(cell, x):
        layer = twin.DynamicRNN(cell, reverse=reverse, return_carry=True, plan=plan)

        def loss(layer, values):
          final, y = layer(x.with_values(values))
          return _loss(y, final), (y, final)

        return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x.values)

      return run(cell, x)

    for reverse in (False, True):
      want = grads(LOOP, reverse)
      got = grads(FUSED, reverse)
      _assert_close(got, want, TIGHT)


@pytest.mark.parametrize("tile", [1, 4, 16])
def test_every_tile_and_capacity(tile):
  """Tiles that divide the count capacity and tiles that do not, a batch of
  empty sequences, and no sequences at all."""
  with jax.enable_x64(True):
    cell = _lstm(jnp.float64)
    for lengths, buckets in (
      ([5, 0, 2, 5, 1, 3, 4], Buckets.fixed(tokens=30, sequences=9, time=6)),
      ([0, 0, 0], Buckets.fixed(tokens=4, sequences=3, time=2)),
      ([], Buckets.fixed(tokens=4, sequences=2, time=2)),
    ):
      rng = np.random.default_rng(tile)
      rows = rng.normal(size=(sum(lengths), FEATURES))
      x = LoDTensor.from_lengths(rows, [lengths], buckets=buckets)
      carry = jnp.asarray(rng.normal(size=(2, x.capacity.sequences[-1], HIDDEN)))
      carry = (carry[0], carry[1])
      for reverse in (False, True):
        got = fused_rnn(cell, x, init_carry=carry, reverse=reverse, tile=tile)
        want = dynamic_rnn(_step(cell), x, init_carry=carry, reverse=reverse)
        _assert_close(got, want, TIGHT)


def _step(cell: Separable):
  """`cell` as a `dynamic_rnn` step: the projections inside the loop."""

  def step(carry, x_t, _):
    xp, hp = x_t @ cell.w_in + cell.b_in, carry[1] @ cell.w_rec
    return cell.gates(carry, cell.split(xp), cell.split(hp))

  return step


def _lstm(dtype) -> Separable:
  """An LSTM written out as a `Separable` (Flax's gate order i, f, g, o)."""
  rng = np.random.default_rng(7)

  def gates(carry, xp, hp):
    c, _ = carry
    i, f, g, o = (a + b for a, b in zip(xp, hp, strict=True))
    new_c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    new_h = jax.nn.sigmoid(o) * jnp.tanh(new_c)
    return (new_c, new_h), new_h

  return Separable(
    w_in=jnp.asarray(rng.normal(size=(FEATURES, 4 * HIDDEN)), dtype),
    b_in=jnp.asarray(rng.normal(size=(4 * HIDDEN,)), dtype),
    w_rec=jnp.asarray(rng.normal(size=(HIDDEN, 4 * HIDDEN)) / 2, dtype),
    b_rec=None,
    probe=0,
    gates=gates,
    hidden=lambda carry: carry[1],
    parts=4,
  )


def test_bfloat16_products_against_float32():
  """bfloat16 operands of the recurrent products (accumulated in float32):
  within 3e-2 of float32 on values and final carries, within 5% of the
  largest gradient entry on gradients."""
  cell = _lstm(jnp.float32)
  x = _batch([7, 0, 3, 5, 1, 7], jnp.float32)
  carry = (jnp.zeros((COUNT, HIDDEN)), jnp.zeros((COUNT, HIDDEN)))

  def run(compute):
    def loss(values, carry):
      y, final = fused_rnn(
        cell, x.with_values(values), init_carry=carry, compute_dtype=compute
      )
      return _loss(y, final), (y.values, final)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      x.values, carry
    )

  (_, want), want_grads = run(None)
  (_, got), got_grads = run(jnp.bfloat16)
  _assert_close(got, want, {"rtol": 0, "atol": 3e-2})
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * scale)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_combinators_take_the_fused_plan(api):
  """Bidirectional and StackedRNN under the fused plan equal the loop's, with
  the same parameter tree."""
  x = _batch([7, 0, 3, 5, 1, 7], jnp.float32)
  if api == "linen":

    def build(plan):
      rnn = lambda: linen.DynamicRNN(nn.GRUCell(HIDDEN), plan=plan)  # noqa: E731
      return linen.StackedRNN([linen.Bidirectional(rnn(), rnn()), rnn()])

    params = build(LOOP).init(jax.random.key(0), x)
    assert jax.tree.structure(params) == jax.tree.structure(
      build(FUSED).init(jax.random.key(0), x)
    )
    got = jax.jit(build(FUSED).apply)(params, x)
    want = jax.jit(build(LOOP).apply)(params, x)
  else:

    def build(plan):
      rngs = nnx.Rngs(0)
      rnn = lambda f: twin.DynamicRNN(nnx.GRUCell(f, HIDDEN, rngs=rngs), plan=plan)  # noqa: E731
      return twin.StackedRNN(
        [twin.Bidirectional(rnn(FEATURES), rnn(FEATURES)), rnn(2 * HIDDEN)], rngs=rngs
      )

    fused, loop = build(FUSED), build(LOOP)
    assert jax.tree.structure(nnx.state(fused)) == jax.tree.structure(nnx.state(loop))
    got, want = nnx.jit(lambda m: m(x))(fused), nnx.jit(lambda m: m(x))(loop)
  np.testing.assert_allclose(got.values, want.values, **FLOAT32)


def test_one_compile_over_lengths():
  cell = _lstm(jnp.float32)
  traces = []

  @jax.jit
  def run(x, carry):
    traces.append(None)
    return fused_rnn(cell, x, init_carry=carry)

  carry = (jnp.zeros((COUNT, HIDDEN)), jnp.zeros((COUNT, HIDDEN)))
  for lengths in ([7, 0, 3], [1, 1, 1, 1, 1, 1], [7, 7, 7, 7, 7, 7]):
    run(_batch(lengths, jnp.float32), carry)
  assert len(traces) == 1


def test_the_gradient_of_a_jitted_call():
  """`jax.vjp` of a jitted `fused_rnn` (the differentiation outside `jit`):
  the layout's arrays are the custom VJP's arguments, so no tracer of the
  jitted trace is left in the linearized program."""
  cell = _lstm(jnp.float32)
  x = _batch([7, 0, 3, 1], jnp.float32)
  carry = (jnp.zeros((COUNT, HIDDEN)), jnp.zeros((COUNT, HIDDEN)))

  def loss(values):
    y, final = fused_rnn(cell, x.with_values(values), init_carry=carry)
    return _loss(y, final)

  want = jax.grad(loss)(x.values)
  np.testing.assert_allclose(jax.grad(jax.jit(loss))(x.values), want, **FLOAT32)
  _, pullback = jax.vjp(jax.jit(loss), x.values)
  np.testing.assert_allclose(pullback(jnp.ones(()))[0], want, **FLOAT32)


# -- errors ---------------------------------------------------------------------------


def test_unsupported_cells_name_dynamic_rnn():
  class Cell(nn.GRUCell):
    pass

  x = _batch([3, 1], jnp.float32)
  with pytest.raises(
    TypeError, match=r"got Cell; .*\(jaxlod\.ops\.dynamic_rnn runs any cell\)"
  ):
    linen.DynamicRNN(Cell(HIDDEN), plan=FUSED).init(jax.random.key(0), x)


def test_unsupported_inputs_name_dynamic_rnn():
  cell = _lstm(jnp.float32)
  carry = (jnp.zeros((COUNT, HIDDEN)), jnp.zeros((COUNT, HIDDEN)))
  x = _batch([3, 1], jnp.float32)
  with pytest.raises(
    TypeError,
    match=r"Expected the fused kernel's values and weights in \('float32', "
    r"'float64'\), got \['float16', 'float32'\]; use jaxlod\.ops\.dynamic_rnn "
    r"for other dtypes\.",
  ):
    fused_rnn(cell, x.with_values(x.values.astype(jnp.float16)), init_carry=carry)
  wide = x.with_values(jnp.zeros((x.capacity.tokens, 2, FEATURES)))
  with pytest.raises(ValueError, match=r"\[token_capacity, features\] .*dynamic_rnn"):
    fused_rnn(cell, wide, init_carry=carry)
  with pytest.raises(ValueError, match=r"Expected `tile` .*got 0"):
    fused_rnn(cell, x, init_carry=carry, tile=0)
  with pytest.raises(
    TypeError, match=r"Expected `compute_dtype` to be None or bfloat16"
  ):
    fused_rnn(cell, x, init_carry=carry, compute_dtype=jnp.float16)
  with pytest.raises(ValueError, match=r"init_carry"):
    fused_rnn(cell, x, init_carry=(jnp.zeros((2, HIDDEN)),) * 2)


def test_separable_checks_its_weights():
  cell = _lstm(jnp.float32)
  fields = {
    f: getattr(cell, f)
    for f in ("w_in", "b_in", "w_rec", "b_rec", "probe", "gates", "hidden", "parts")
  }
  with pytest.raises(
    ValueError,
    match=r"Expected `w_rec` to have the width of `w_in` \(16 columns\), got "
    r"shape \(4, 12\)\.",
  ):
    Separable(**{**fields, "w_rec": jnp.zeros((HIDDEN, 12))})
  with pytest.raises(
    ValueError,
    match=r"Expected `w_in` to be a matrix \[features, width\], got shape \(16,\)\.",
  ):
    Separable(**{**fields, "w_in": jnp.zeros((16,))})
  with pytest.raises(
    ValueError, match=r"Expected `b_rec` to have shape \(0,\), got \(4,\) with probe=0"
  ):
    Separable(**{**fields, "b_rec": jnp.zeros((4,))})
  with pytest.raises(ValueError, match=r"Expected `probe` in \[0, 16\]"):
    Separable(**{**fields, "probe": 17})
  with pytest.raises(ValueError, match=r"Expected `parts` to divide the width 16 "):
    Separable(**{**fields, "parts": 3})
  with pytest.raises(TypeError, match=r"Expected `gates` to be callable"):
    Separable(**{**fields, "gates": 3})


@pytest.mark.slow
@pytest.mark.parametrize("name", LINEN_CELLS)
def test_kernels_lower_for_gpus(name):
  """The forward and backward kernels lower through Pallas's GPU (Triton)
  backend, no GPU needed: JAX lowers for ``cuda`` on any machine."""
  cell = LINEN_CELLS[name](16)
  carry = cell.initialize_carry(jax.random.key(0), (COUNT, FEATURES))
  params = cell.init(jax.random.key(1), carry, jnp.zeros((COUNT, FEATURES)))["params"]
  x = _batch([7, 0, 3, 5, 1, 7], jnp.float32)

  def loss(params, values, carry):
    separable = _hoist._LINEN[type(cell)](cell, params)
    y, final = fused_rnn(
      separable, x.with_values(values), init_carry=carry, interpret=False
    )
    return _loss(y, final)

  grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  lowered = grads.trace(params, x.values, carry).lower(lowering_platforms=("cuda",))
  # One forward kernel and one backward kernel, as Triton custom calls.
  assert lowered.as_text().count("__gpu$xla.gpu.triton") == 2


def test_gpu_sizes_are_powers_of_two():
  cell = _lstm(jnp.float32)
  carry = (jnp.zeros((COUNT, HIDDEN)), jnp.zeros((COUNT, HIDDEN)))
  x = _batch([3, 1], jnp.float32)
  with pytest.raises(
    ValueError,
    match=r"Expected the fused kernel's sizes to be powers of 2 on a GPU \(Pallas's "
    r"Triton backend\), got tile 12; use jaxlod\.ops\.dynamic_rnn for other sizes\.",
  ):
    fused_rnn(cell, x, init_carry=carry, interpret=False, tile=12)


def test_a_table_of_another_batch():
  """Eagerly an error; under `jit` NaN results and a faulted output, as
  `dynamic_rnn` gives them."""
  cell = _lstm(jnp.float32)
  carry = (jnp.zeros((COUNT, HIDDEN)), jnp.zeros((COUNT, HIDDEN)))
  x, other = _batch([3, 1], jnp.float32), _batch([1, 3], jnp.float32)
  table = rank_table(other)
  with pytest.raises(ValueError, match=r"rank"):
    fused_rnn(cell, x, init_carry=carry, table=table)
  y, final = jax.jit(lambda x, t: fused_rnn(cell, x, init_carry=carry, table=t))(
    x, table
  )
  assert np.isnan(np.asarray(y.values)).all()
  assert all(np.isnan(np.asarray(leaf)).all() for leaf in final)
  assert int(y.faults) & int(Fault.TABLE)
