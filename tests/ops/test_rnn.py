"""dynamic_rnn against a masked `lax.scan` over the padded batch."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify
from jax.test_util import check_grads

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import _packed, default_plan, dynamic_rnn, rank_table
from tests.helpers import assert_close

FEATURES, HIDDEN = 3, 4

# -- cells -----------------------------------------------------------------------


def _flax_cell(cell, dtype):
  """A step function over a Flax cell, its params and an init-carry maker."""
  x = jnp.zeros((1, FEATURES), dtype)
  carry = cell.initialize_carry(jax.random.key(0), x.shape)
  params = cell.init(jax.random.key(1), carry, x)
  params = jax.tree.map(lambda p: p.astype(dtype), params)

  def step(params, carry, x_t, static):
    del static
    return cell.apply(params, carry, x_t)

  def init(key, count):
    leaves, tree = jax.tree.flatten(
      cell.initialize_carry(jax.random.key(0), (count, FEATURES))
    )
    keys = jax.random.split(key, len(leaves))
    noise = [
      jax.random.normal(k, a.shape, dtype) for k, a in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(tree, noise)

  return step, params, init


def _custom_cell(dtype):
  """A cell with a pytree carry (a dict with a nested tuple) and two outputs."""
  rng = np.random.default_rng(3)
  params = {
    "w": jnp.asarray(rng.normal(size=(FEATURES, HIDDEN)) * 0.5, dtype),
    "u": jnp.asarray(rng.normal(size=(HIDDEN, HIDDEN)) * 0.5, dtype),
    "v": jnp.asarray(rng.normal(size=(HIDDEN,)), dtype),
  }

  def step(params, carry, x_t, static):
    del static
    h, (acc, scale) = carry["h"], carry["stats"]
    h = jnp.tanh(x_t @ params["w"] + h @ params["u"]) * scale[:, None]
    acc = acc + jnp.sum(h * params["v"], axis=-1)
    return {"h": h, "stats": (acc, scale)}, {"h": h, "score": acc[:, None]}

  def init(key, count):
    k1, k2 = jax.random.split(key)
    return {
      "h": jax.random.normal(k1, (count, HIDDEN), dtype),
      "stats": (
        jnp.zeros((count,), dtype),
        1 + jax.random.uniform(k2, (count,), dtype),
      ),
    }

  return step, params, init


CELLS = {
  "lstm": lambda dtype: _flax_cell(nn.LSTMCell(HIDDEN, param_dtype=dtype), dtype),
  "gru": lambda dtype: _flax_cell(nn.GRUCell(HIDDEN, param_dtype=dtype), dtype),
  "custom": _custom_cell,
}

# -- the reference ---------------------------------------------------------------


def _reverse_within(padded, lengths):
  """Reverses the first ``lengths[i]`` steps of each row (time axis 1)."""
  time = padded.shape[1]
  steps = jnp.arange(time)[None, :]
  index = jnp.where(steps < lengths[:, None], lengths[:, None] - 1 - steps, steps)
  index = index.reshape(index.shape + (1,) * (padded.ndim - 2))
  return jnp.take_along_axis(padded, index, axis=1)


def masked_scan(step, params, x, init_carry, reverse=False, static=None):
  """The padded reference: a `lax.scan` over the time capacity with masks."""
  padded, lengths = x.to_padded()
  if reverse:
    padded = _reverse_within(padded, lengths)

  def body(carry, inputs):
    x_t, t = inputs
    new_carry, y = step(params, carry, x_t, static)
    active = t < lengths

    def keep(new, old):
      return jnp.where(active.reshape(active.shape + (1,) * (new.ndim - 1)), new, old)

    y = jax.tree.map(lambda a: keep(a, jnp.zeros_like(a)), y)
    return jax.tree.map(keep, new_carry, carry), y

  steps = jnp.arange(padded.shape[1])
  final, ys = jax.lax.scan(body, init_carry, (jnp.swapaxes(padded, 0, 1), steps))
  ys = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), ys)
  if reverse:
    ys = jax.tree.map(lambda a: _reverse_within(a, lengths), ys)
  return ys, final, lengths


def _padded_outputs(outputs):
  return jax.tree.map(lambda y: y.to_padded()[0], outputs, is_leaf=_is_lod)


def _is_lod(x):
  return isinstance(x, LoDTensor)


def _batch(lengths, dtype, buckets=None, seed=0):
  rng = np.random.default_rng(seed)
  seqs = [rng.normal(size=(n, FEATURES)).astype(dtype) for n in lengths]
  if not seqs:
    return LoDTensor.from_lengths(
      np.zeros((0, FEATURES), dtype), [[]], buckets=buckets or Buckets.exact()
    )
  return LoDTensor.from_sequences(seqs, buckets=buckets, dtype=dtype)


BATCHES = {
  "mixed_with_empty": ([4, 0, 7, 1, 3, 7, 2, 0, 5], None),
  "all_equal": ([5, 5, 5, 5], None),
  "one_sequence": ([6], None),
  "larger_capacities": ([3, 1, 4], Buckets.fixed(tokens=40, sequences=16, time=12)),
  "pow2": ([9, 2, 2, 6, 1, 1, 3, 8, 4, 4, 2], Buckets.pow2(minimum=8)),
}


def _losses(step, params, x, init_carry, reverse, remat, ladder, plan=None, table=None):
  """jaxlod (with `ladder`, or `plan` and `table`) and reference losses over
  outputs and final carry, same weights.

  Each returns ``(loss, (padded outputs, final carry))``.
  """

  def jaxlod_loss(params, values, init_carry):
    outputs, final = dynamic_rnn(
      lambda c, x_t, s: step(params, c, x_t, s),
      x.with_values(values),
      init_carry=init_carry,
      reverse=reverse,
      remat=remat,
      ladder=ladder,
      plan=plan,
      table=table,
    )
    ys = _padded_outputs(outputs)
    return _loss(ys, final), (ys, final)

  def reference_loss(params, values, init_carry):
    ys, final, _ = masked_scan(step, params, x.with_values(values), init_carry, reverse)
    return _loss(ys, final), (ys, final)

  return jaxlod_loss, reference_loss


def _loss(ys, final):
  terms = [
    jnp.sum(jnp.sin(a) * (1 + jnp.arange(a.size).reshape(a.shape) % 3))
    for a in jax.tree.leaves(ys)
  ]
  terms += [jnp.sum(a**2) for a in jax.tree.leaves(final)]
  return sum(terms)


def _value_and_grads(loss):
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


# -- values and gradients against the reference ----------------------------------


@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("reverse", [False, True])
def test_matches_masked_scan_float32(cell, batch, reverse):
  step, params, init = CELLS[cell](jnp.float32)
  lengths, buckets = BATCHES[batch]
  x = _batch(lengths, np.float32, buckets)
  init_carry = init(jax.random.key(2), x.capacity.sequences[-1])
  ladder = (8, 4) if x.capacity.sequences[-1] >= 8 else None
  jaxlod_loss, reference_loss = _losses(
    step, params, x, init_carry, reverse, False, ladder
  )
  args = (params, x.values, init_carry)
  (loss, (ys, final)), grads = _value_and_grads(jaxlod_loss)(*args)
  (ref_loss, (ref_ys, ref_final)), ref_grads = _value_and_grads(reference_loss)(*args)

  assert_close(final, ref_final, rtol=1e-5, atol=1e-5)
  assert_close(ys, ref_ys, rtol=1e-5, atol=1e-5)
  assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
  # Empty sequences keep their initial carry exactly.
  empty = np.asarray(x.lengths()) == 0
  pairs = zip(jax.tree.leaves(final), jax.tree.leaves(init_carry), strict=True)
  for got, want in pairs:
    np.testing.assert_array_equal(np.asarray(got)[empty], np.asarray(want)[empty])
  # Gradients sum over up to a few dozen steps: float32 round-off.
  assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize(
  ("reverse", "remat"), [(False, False), (True, True)], ids=["forward", "reverse-remat"]
)
def test_gradients_float64(cell, reverse, remat):
  with jax.enable_x64(True):
    step, params, init = CELLS[cell](jnp.float64)
    x = _batch(
      [4, 0, 6, 1, 3, 6], np.float64, Buckets.fixed(tokens=24, sequences=8, time=8)
    )
    init_carry = init(jax.random.key(2), 8)
    jaxlod_loss, reference_loss = _losses(
      step, params, x, init_carry, reverse, remat, (8, 4, 2)
    )
    args = (params, x.values, init_carry)
    (_, outputs), grads = _value_and_grads(jaxlod_loss)(*args)
    (_, ref_outputs), ref_grads = _value_and_grads(reference_loss)(*args)
    assert_close(outputs, ref_outputs, rtol=1e-12, atol=1e-12)
    assert_close(grads, ref_grads, rtol=1e-10, atol=1e-10)
    check_grads(jax.jit(lambda *a: jaxlod_loss(*a)[0]), args, order=1, modes=("rev",))


def test_remat_gives_the_same_gradients():
  step, params, init = CELLS["lstm"](jnp.float32)
  x = _batch([5, 2, 7, 0, 3], np.float32, Buckets.pow2(minimum=8))
  init_carry = init(jax.random.key(2), 8)
  grads = []
  for remat in (False, True):
    loss, _ = _losses(step, params, x, init_carry, False, remat, (8, 4))
    grads.append(_value_and_grads(loss)(params, x.values, init_carry)[1])
  assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  ("remat", "stored"),
  # Saved residuals: c and h, and the activations of the four gates and of
  # tanh(c); sums, products and ``1 - y`` are recomputed. Remat: c and h.
  [(False, 7), (True, 2)],
)
def test_stored_rows_of_an_lstm_share_one_buffer(remat, stored):
  """What the backward pass keeps per row, in one ``[n, rows, hidden]`` buffer."""
  step, params, init = CELLS["lstm"](jnp.float32)
  x = _batch([5, 2, 7, 0, 3], np.float32, Buckets.pow2(minimum=8))
  table = rank_table(x, ladder=(8, 4))
  rows = _packed.schedule_rows(x.capacity.tokens, table.time_capacity, table.ladder)
  init_carry = init(jax.random.key(2), 8)
  loss, _ = _losses(step, params, x, init_carry, False, remat, (8, 4))
  grad = jax.grad(lambda *args: loss(*args)[0], argnums=(0, 1, 2))
  jaxpr = str(jax.make_jaxpr(grad)(params, x.values, init_carry))
  buffers = re.findall(rf"f32\[(\d+),{rows},{HIDDEN}\]", jaxpr)
  assert set(buffers) == {str(stored)}
  # x_t ([b, FEATURES]), a residual too, is read again from the inputs.
  assert f",{rows},{FEATURES}]" not in jaxpr


# -- static inputs, several inputs, return_sequences -------------------------------


def test_static_inputs_arrays_and_lod_memory():
  """Static inputs reach the step in rank order, shrunk; gradients flow to them."""
  rng = np.random.default_rng(5)
  x = _batch([3, 5, 0, 2], np.float32, Buckets.fixed(tokens=16, sequences=4, time=6))
  memory = LoDTensor.from_sequences(
    [rng.normal(size=(n, HIDDEN)).astype(np.float32) for n in (2, 4, 1, 0)],
    buckets=Buckets.fixed(tokens=8, sequences=4, time=5),
  )
  bias = jnp.asarray(rng.normal(size=(4, HIDDEN)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(FEATURES, HIDDEN)), jnp.float32)

  def step(h, x_t, static):
    bias, (mem, mem_len) = static["bias"], static["memory"]
    mask = jnp.arange(mem.shape[1])[None, :] < mem_len[:, None]
    score = jnp.where(mask, jnp.einsum("bh,bsh->bs", h, mem), -jnp.inf)
    weights = jnp.where(mask, jax.nn.softmax(score, axis=-1), 0.0)
    context = jnp.einsum("bs,bsh->bh", jnp.nan_to_num(weights), mem)
    h = jnp.tanh(x_t @ w + bias + context)
    return h, h

  def reference_step(params, h, x_t, static):
    del params
    return step(h, x_t, static)

  def loss(values, bias, memory_values):
    statics = {"bias": bias, "memory": memory.with_values(memory_values)}
    ys, h = dynamic_rnn(
      step,
      x.with_values(values),
      init_carry=jnp.zeros((4, HIDDEN)),
      static_inputs=statics,
    )
    return _loss(ys.to_padded()[0], h)

  def reference_loss(values, bias, memory_values):
    statics = {"bias": bias, "memory": memory.with_values(memory_values).to_padded()}
    ys, h, _ = masked_scan(
      reference_step,
      None,
      x.with_values(values),
      jnp.zeros((4, HIDDEN)),
      static=statics,
    )
    return _loss(ys, h)

  args = (x.values, bias, memory.values)
  assert_close(jax.jit(loss)(*args), reference_loss(*args), rtol=1e-5, atol=1e-5)
  assert_close(
    jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args),
    jax.grad(reference_loss, argnums=(0, 1, 2))(*args),
    rtol=1e-4,
    atol=1e-5,
  )


def test_pytree_of_inputs_and_integer_carry():
  x = _batch([3, 1, 4], np.float32)
  ids = LoDTensor.from_lengths(np.arange(8, dtype=np.int32), [[3, 1, 4]])

  def step(carry, inputs, _):
    h, count = carry
    h = h + inputs["x"].sum(-1) * inputs["ids"]
    return (h, count + 1), {"h": h, "count": count}

  outputs, (h, count) = dynamic_rnn(
    step, {"x": x, "ids": ids}, init_carry=(jnp.zeros(3), jnp.zeros(3, jnp.int32))
  )
  assert count.tolist() == [3, 1, 4]
  values = np.asarray(x.values).sum(-1) * np.arange(8)
  expected = [np.cumsum(values[a:b]) for a, b in ((0, 3), (3, 4), (4, 8))]
  for got, want in zip(outputs["h"].to_list(), expected, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  assert [c.tolist() for c in outputs["count"].to_list()] == [
    [0, 1, 2],
    [0],
    [0, 1, 2, 3],
  ]
  np.testing.assert_allclose(h, [e[-1] for e in expected], rtol=1e-6)


def test_return_sequences_false_returns_only_final_carry():
  step, params, init = CELLS["gru"](jnp.float32)
  x = _batch([2, 6, 3], np.float32)
  init_carry = init(jax.random.key(0), 3)
  final = dynamic_rnn(
    lambda c, x_t, s: step(params, c, x_t, s),
    x,
    init_carry=init_carry,
    return_sequences=False,
  )
  _, ref_final, _ = masked_scan(step, params, x, init_carry)
  assert_close(final, ref_final, rtol=1e-5, atol=1e-6)

  def loss(values):
    final = dynamic_rnn(
      lambda c, x_t, s: step(params, c, x_t, s),
      x.with_values(values),
      init_carry=init_carry,
      return_sequences=False,
    )
    return jnp.sum(final**2)

  def reference_loss(values):
    return jnp.sum(masked_scan(step, params, x.with_values(values), init_carry)[1] ** 2)

  assert_close(
    jax.grad(loss)(x.values), jax.grad(reference_loss)(x.values), rtol=1e-4, atol=1e-6
  )


def test_precomputed_table_and_ladder_conflict():
  x = _batch([3, 1, 4], np.float32, Buckets.pow2(minimum=8))
  table = rank_table(x, ladder=(8, 4))

  def step(h, x_t, _):
    return h + x_t.sum(-1), h

  ys, h = dynamic_rnn(step, x, init_carry=jnp.zeros(8), table=table)
  np.testing.assert_allclose(h[:3], [s.sum() for s in x.to_list()], rtol=1e-6)
  with pytest.raises(
    ValueError, match=r"Got both `table` \(ladder \(8, 4\)\) and `ladder`"
  ):
    dynamic_rnn(step, x, init_carry=jnp.zeros(8), table=table, ladder=(8, 2))


# -- compilation ---------------------------------------------------------------------


# The CPU's plan, and the accelerators' forced (tests/ops/test_plan.py).
@pytest.mark.parametrize("plan", [None, default_plan("gpu")], ids=["default", "gpu"])
def test_one_compilation_under_a_fixed_capacity(plan):
  step, params, init = CELLS["lstm"](jnp.float32)
  buckets = Buckets.fixed(tokens=64, sequences=8, time=16)
  traces = []

  @jax.jit
  def train_step(params, x, table, init_carry):
    traces.append(1)

    def loss(params):
      outputs, final = dynamic_rnn(
        lambda c, x_t, s: step(params, c, x_t, s),
        x,
        init_carry=init_carry,
        table=table,
        plan=plan,
      )
      return jnp.sum(outputs.values**2) + jnp.sum(final[1])

    return jax.value_and_grad(loss)(params)

  rng = np.random.default_rng(0)
  init_carry = init(jax.random.key(0), 8)
  for _ in range(12):
    lengths = rng.integers(0, 9, size=rng.integers(1, 9))
    x = _batch(lengths.tolist(), np.float32, buckets, seed=int(rng.integers(1 << 30)))
    jax.block_until_ready(train_step(params, x, rank_table(x), init_carry))
  assert len(traces) == 1
  assert train_step._cache_size() == 1


# -- errors ----------------------------------------------------------------------------


def _simple_step(h, x_t, _):
  return h + x_t.sum(-1, keepdims=True), h


def test_error_init_carry_leading_dimension():
  x = _batch([3, 1], np.float32, Buckets.fixed(tokens=8, sequences=4, time=4))
  with pytest.raises(
    ValueError,
    match=r"Expected `init_carry` leaf \[1\] to have leading dimension 4 \(count "
    r"capacity\), got shape \(2, 5\)\.",
  ):
    dynamic_rnn(_simple_step, x, init_carry=(jnp.zeros((4, 1)), jnp.zeros((2, 5))))


def test_error_step_changes_carry_shape_and_dtype():
  x = _batch([3, 1], np.float32)

  def grows(h, x_t, _):
    return jnp.concatenate([h, h], axis=-1), h

  with pytest.raises(
    ValueError,
    match=r"keep carry leaf \['h'\] as float32\[2, 5\], got float32\[2, 10\]",
  ):
    dynamic_rnn(
      lambda c, x_t, s: ({"h": grows(c["h"], x_t, s)[0]}, c["h"]),
      x,
      init_carry={"h": jnp.zeros((2, 5))},
    )
  with pytest.raises(
    ValueError, match=r"keep carry leaf \(root\) as float32\[2, 5\], got int32\[2, 5\]"
  ):
    dynamic_rnn(
      lambda h, x_t, s: (h.astype(jnp.int32), h), x, init_carry=jnp.zeros((2, 5))
    )
  with pytest.raises(ValueError, match=r"with the structure of `init_carry`"):
    dynamic_rnn(lambda h, x_t, s: ((h, h), h), x, init_carry=jnp.zeros((2, 5)))


def test_error_output_shapes():
  x = _batch([3, 1, 5, 2, 2, 4, 1, 1, 6], np.float32, Buckets.pow2(minimum=16))

  def not_batched(h, x_t, _):
    return h, jnp.zeros((3,))

  with pytest.raises(
    ValueError, match=r"output leaf \(root\) to have leading dimension 16"
  ):
    dynamic_rnn(not_batched, x, init_carry=jnp.zeros((16, 1)))

  def changes_with_batch(h, x_t, _):
    return h, jnp.zeros((h.shape[0], h.shape[0]))

  with pytest.raises(
    ValueError, match=r"outputs of the same shape at every batch size"
  ):
    dynamic_rnn(changes_with_batch, x, init_carry=jnp.zeros((16, 1)), ladder=(16, 8))
  with pytest.raises(TypeError, match=r"return a pair \(new_carry, output\)"):
    dynamic_rnn(lambda h, x_t, s: h, x, init_carry=jnp.zeros((16, 1)))


def test_error_inputs_with_different_lods():
  a = _batch([3, 1], np.float32, Buckets.fixed(tokens=8, sequences=4, time=4))
  b = _batch([2, 2], np.float32, Buckets.fixed(tokens=8, sequences=4, time=4))
  c = _batch([3, 1], np.float32, Buckets.fixed(tokens=16, sequences=4, time=4))

  def step(h, x_t, _):
    return h, h

  with pytest.raises(
    ValueError,
    match=r"Expected `inputs\[1\]` to have the LoD of `inputs\[0\]`; at level 0 "
    r"`inputs\[1\]` has offsets \[0, 2, 4, 4, 4\], `inputs\[0\]` \[0, 3, 4, 4, 4\]",
  ):
    dynamic_rnn(step, (a, b), init_carry=jnp.zeros((4, 1)))
  with pytest.raises(
    ValueError,
    match=r"`inputs\[0\]` has capacity .*tokens=8.* `inputs\[1\]` .*tokens=16",
  ):
    dynamic_rnn(step, [a, c], init_carry=jnp.zeros((4, 1)))

  @jax.jit
  @checkify.checkify
  def under_jit(a, b):
    return dynamic_rnn(step, (a, b), init_carry=jnp.zeros((4, 1)))

  err, _ = under_jit(a, b)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"dynamic_rnn: Expected `inputs\[1\]` to have the LoD of `inputs\[0\]`",
  ):
    err.throw()


def test_error_static_input_rows_and_inputs():
  x = _batch([3, 1], np.float32, Buckets.fixed(tokens=8, sequences=4, time=4))
  with pytest.raises(
    ValueError, match=r"`static_inputs` leaf \['w'\] to have leading dimension 4"
  ):
    dynamic_rnn(
      _simple_step,
      x,
      init_carry=jnp.zeros((4, 1)),
      static_inputs={"w": jnp.zeros((3, 2))},
    )
  memory = _batch([1, 2, 3], np.float32)
  with pytest.raises(
    ValueError, match=r"one sequence per input sequence: count capacity 4, got 3"
  ):
    dynamic_rnn(_simple_step, x, init_carry=jnp.zeros((4, 1)), static_inputs=memory)
  # `level` is gone: dynamic_rnn always runs over the last level.
  nested = LoDTensor.from_lengths(np.zeros((4, FEATURES), np.float32), [[2], [3, 1]])
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'level'"):
    dynamic_rnn(_simple_step, nested, init_carry=jnp.zeros((2, 1)), level=0)
  with pytest.raises(TypeError, match=r"Expected `inputs` to be a LoDTensor"):
    dynamic_rnn(_simple_step, jnp.zeros((4, 3)), init_carry=jnp.zeros((4, 1)))


def test_forward_mode_is_refused():
  x = _batch([3, 1], np.float32)

  def f(h0):
    return dynamic_rnn(_simple_step, x, init_carry=h0)[1]

  with pytest.raises(
    TypeError, match=r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp"
  ):
    jax.jvp(f, (jnp.zeros((2, 1)),), (jnp.ones((2, 1)),))


def test_residuals_without_a_batch_axis_are_stacked_by_step():
  """A step whose residuals are not ``[b, ...]`` (a reshape to ``[2b, ...]``)."""
  rng = np.random.default_rng(7)
  w = jnp.asarray(rng.normal(size=(FEATURES, HIDDEN)), jnp.float32)
  x = _batch([4, 0, 6, 1, 3], np.float32, Buckets.fixed(tokens=16, sequences=8, time=8))

  def step(params, h, x_t, _):
    b = h.shape[0]
    z = (x_t @ params + h).reshape(2 * b, HIDDEN // 2)
    h = jnp.tanh(z).reshape(b, HIDDEN) * jnp.cos(h)
    return h, h

  init_carry = jnp.asarray(rng.normal(size=(8, HIDDEN)), jnp.float32)
  jaxlod_loss, reference_loss = _losses(step, w, x, init_carry, False, False, (8, 4))
  args = (w, x.values, init_carry)
  (_, outputs), grads = _value_and_grads(jaxlod_loss)(*args)
  (_, ref_outputs), ref_grads = _value_and_grads(reference_loss)(*args)
  assert_close(outputs, ref_outputs, rtol=1e-5, atol=1e-5)
  assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)


def test_a_table_of_another_batch_is_caught_under_checkify():
  """Same capacities, other lengths: eagerly a ValueError, jitted a checkify
  error (without it the carries would silently be wrong)."""
  buckets = Buckets.fixed(tokens=8, sequences=2, time=4)
  x = LoDTensor.from_lengths(np.ones((5, 1), np.float32), [[3, 2]], buckets=buckets)
  other = LoDTensor.from_lengths(np.ones((5, 1), np.float32), [[1, 4]], buckets=buckets)

  def run(x, table):
    step = lambda c, x_t, _: (c + x_t, c)  # noqa: E731
    return dynamic_rnn(step, x, init_carry=jnp.zeros((2, 1)), table=table)[1]

  with pytest.raises(ValueError, match="The rank table does not describe `inputs`"):
    run(x, rank_table(other))
  err, _ = checkify.checkify(jax.jit(run))(x, rank_table(other))
  with pytest.raises(checkify.JaxRuntimeError, match="a table of another batch"):
    err.throw()
  err, carry = checkify.checkify(jax.jit(run))(x, rank_table(x))
  err.throw()
  np.testing.assert_array_equal(carry, [[3.0], [2.0]])


@settings(max_examples=15, deadline=None)
@given(
  st.lists(st.integers(0, 5), min_size=1, max_size=4),
  st.booleans(),
)
def test_padding_rows_never_reach_the_gradients(lengths, remat):
  """A step whose parameter gradient is NaN at zero input (``sqrt(w * x)``):
  the gradient equals the unpadded per-sequence one, padding rows (zeros past
  the data, and the next step's rows inside a phase) never reach it."""
  buckets = Buckets.fixed(tokens=24, sequences=4, time=6)
  rows = np.linspace(0.5, 2.0, sum(lengths), dtype=np.float32)[:, None]
  x = LoDTensor.from_lengths(rows, [lengths], buckets=buckets)
  step = lambda w: lambda c, x_t, _: (c + jnp.sqrt(w * x_t), c)  # noqa: E731

  def loss(w, x):
    _, carry = dynamic_rnn(step(w), x, init_carry=jnp.zeros((4, 1)), remat=remat)
    return jnp.sum(carry)

  def reference(w):
    return sum(jnp.sum(jnp.sqrt(w * jnp.asarray(s))) for s in x.to_list())

  got = _padding_grad(loss, remat)(jnp.float32(1.5), x)
  np.testing.assert_allclose(got, jax.grad(reference)(1.5), rtol=1e-5)


_PADDING_GRADS: dict = {}


def _padding_grad(loss, remat):
  """One jitted gradient per mode: the fixed capacity compiles once."""
  if remat not in _PADDING_GRADS:
    _PADDING_GRADS[remat] = jax.jit(jax.grad(loss))
  return _PADDING_GRADS[remat]


@pytest.mark.parametrize("return_sequences", [True, False])
def test_a_count_capacity_of_zero_runs_and_gives_empty_results(return_sequences):
  x = LoDTensor.from_lengths(np.zeros((0, 3), np.float32), [[]])

  def step(h, x_t, _):
    h = jnp.tanh(h + x_t.sum(-1, keepdims=True))
    return h, h * 2

  def run(x):
    return dynamic_rnn(
      step, x, init_carry=jnp.zeros((0, 1)), return_sequences=return_sequences
    )

  for call in (run, jax.jit(run)):
    out = call(x)
    if return_sequences:
      ys, h = out
      assert ys.values.shape == (0, 1) and ys.recursive_lengths() == [[]]
    else:
      h = out
    assert h.shape == (0, 1)
