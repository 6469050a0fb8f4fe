"""`jaxlod.nn.RNN`, `jaxlod.nn.Bidirectional` and their NNX twins against
Flax's on the same padded batches and parameters: the outputs at real steps
and the final carries, for every Flax cell (``ConvLSTMCell`` included), both
directions and orders, both layouts and two batch axes; gradients; one trace
per padded shape; NNX cells drawing from broadcast RNG streams; the errors."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import jaxlod.nn as linen
import jaxlod.nn.nnx as twin
from jaxlod import Buckets, LoDTensor
from jaxlod.ops import LoopPlan, rank_table
from tests.helpers import LINEN_CELLS, NNX_CELLS

B1, B2, TIME, FEATURES, HIDDEN = 2, 3, 5, 3, 4
TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64: the same sums in another order
# (reverse, keep_order) of each direction compared.
DIRECTIONS = ((False, False), (True, False), (True, True))
LENGTHS = st.lists(st.integers(0, TIME), min_size=B1 * B2, max_size=B1 * B2)
# The packed loop and the padded scan, plain and hoisted (more of the
# padded plans: tests/nn/test_padded_plan.py).
PLANS = {
  "default": None,
  "padded": LoopPlan(padded=True),
  "padded_hoist": LoopPlan(padded=True, hoist=True),
  "padded_chunk3": LoopPlan(padded=True, chunk=3),
}


def _inputs(seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return rng.normal(size=(B1, B2, TIME, FEATURES))


def _layout(x: jax.Array, time_major: bool) -> jax.Array:
  """``[*batch, time, f]`` as the layer's layout (time first if time-major)."""
  return jnp.moveaxis(x, -2, 0) if time_major else x


def _real(y: jax.Array, lengths: jax.Array, time_major: bool) -> np.ndarray:
  """``y`` batch-major, the steps past each length zeroed (Flax computes the
  cell there; jaxlod returns zeros)."""
  y = np.asarray(jnp.moveaxis(y, 0, -2) if time_major else y)
  mask = np.arange(y.shape[-2]) < np.asarray(lengths)[..., None]
  return np.where(mask[..., None], y, 0.0)


def _check(theirs, ours, lengths, time_major) -> None:
  """Outputs at real steps equal and zero past them; final carries equal for
  the nonempty sequences (Flax's for an empty one is its last padded step)."""
  (carry_ref, y_ref), (carry, y) = theirs, ours
  y_ref = np.asarray(y_ref).reshape(y.shape)  # Flax ran one batch axis
  batch_major = np.asarray(jnp.moveaxis(y, 0, -2) if time_major else y)
  np.testing.assert_allclose(_real(y, lengths, time_major), batch_major, **TOL)
  np.testing.assert_allclose(
    _real(y_ref, lengths, time_major), _real(y, lengths, time_major), **TOL
  )
  nonempty = np.asarray(lengths).reshape(-1) > 0
  for a, b in zip(jax.tree.leaves(carry_ref), jax.tree.leaves(carry), strict=True):
    a, b = np.asarray(a), np.asarray(b).reshape(-1, b.shape[-1])
    np.testing.assert_allclose(a[nonempty], b[nonempty], **TOL)


def _flat_batch(x: jax.Array, time_major: bool) -> jax.Array:
  """``[B1, B2, time, f]`` as Flax's one batch axis in the layer's layout
  (Flax's carry selection takes one batch axis)."""
  return _layout(x.reshape(B1 * B2, TIME, FEATURES), time_major)


# -- Linen ----------------------------------------------------------------------------


# Every cell in both layouts under the default plan, and under each padded
# plan in one layout (GRU and MGU time-major).
LINEN_CASES = [
  (name, time_major, "default") for name in LINEN_CELLS for time_major in (False, True)
] + [
  (name, name in ("GRUCell", "MGUCell"), plan)
  for name in LINEN_CELLS
  for plan in ("padded", "padded_hoist", "padded_chunk3")
]


@pytest.mark.parametrize(("name", "time_major", "plan"), LINEN_CASES)
def test_linen_matches_flax(name, time_major, plan):
  cell = LINEN_CELLS[name](HIDDEN, param_dtype=jnp.float64)
  kw = {"time_major": time_major, "return_carry": True}
  with jax.enable_x64(True):
    x = jnp.asarray(_inputs())
    params = nn.RNN(cell, **kw).init(jax.random.key(1), _flat_batch(x, time_major))

    @jax.jit
    def run(lengths):
      out = []
      for reverse, keep_order in DIRECTIONS:
        d = {"reverse": reverse, "keep_order": keep_order}
        flat = lengths.reshape(-1)
        theirs = nn.RNN(cell, **kw, **d).apply(
          params, _flat_batch(x, time_major), seq_lengths=flat
        )
        ours = linen.RNN(cell, plan=PLANS[plan], **kw, **d).apply(
          params, _layout(x, time_major), seq_lengths=lengths
        )
        out.append((theirs, ours))
      return out

    @settings(max_examples=4, deadline=None)
    @given(LENGTHS)
    def check(lengths):
      lengths = jnp.asarray(lengths, jnp.int32).reshape(B1, B2)
      for theirs, ours in run(lengths):
        _check(theirs, ours, lengths, time_major)

    check()


def test_linen_params_tree_is_flax():
  x = jnp.ones((2, TIME, FEATURES))
  ours = jax.eval_shape(linen.RNN(nn.LSTMCell(HIDDEN)).init, jax.random.key(0), x)
  theirs = jax.eval_shape(nn.RNN(nn.LSTMCell(HIDDEN)).init, jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, ours) == jax.tree.map(jnp.shape, theirs)
  assert list(ours["params"]) == ["cell"]


def test_linen_defaults_match_flax_without_lengths():
  """No `seq_lengths`: every sequence is the whole time axis; one batch axis
  and none."""
  with jax.enable_x64(True):
    cell = nn.GRUCell(HIDDEN, param_dtype=jnp.float64)

    @jax.jit
    def run(x):
      params = nn.RNN(cell).init(jax.random.key(0), x)
      kw = {"reverse": True, "return_carry": True}
      return [
        (nn.RNN(cell, **kw).apply(params, x), linen.RNN(cell, **kw).apply(params, x)),
        (nn.RNN(cell).apply(params, x), linen.RNN(cell).apply(params, x)),
      ]

    for x in (jnp.asarray(_inputs()[0]), jnp.asarray(_inputs()[0, 0])):
      for theirs, ours in run(x):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), theirs, ours)


def test_linen_gradients_match_flax():
  cell = nn.LSTMCell(HIDDEN, param_dtype=jnp.float64)
  lengths = jnp.array([[5, 2, 1], [3, 5, 4]], jnp.int32)
  mask = (jnp.arange(TIME) < lengths.reshape(-1, 1))[..., None]

  def loss(layer, params, x, flat):
    carry, y = layer.apply(
      params, x, seq_lengths=lengths.reshape(-1) if flat else lengths
    )
    y = y.reshape(B1 * B2, TIME, HIDDEN)
    c, h = (a.reshape(B1 * B2, HIDDEN) for a in carry)
    return jnp.sum(jnp.where(mask, y, 0.0) ** 2) + jnp.sum(c * h)

  with jax.enable_x64(True):
    x = jnp.asarray(_inputs())
    theirs = nn.RNN(cell, return_carry=True, reverse=True)
    ours = linen.RNN(cell, return_carry=True, reverse=True)
    params = theirs.init(jax.random.key(1), x.reshape(B1 * B2, TIME, FEATURES))
    want = jax.grad(loss, argnums=(1, 2))(
      theirs, params, x.reshape(B1 * B2, TIME, FEATURES), True
    )
    got = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=(0, 3))(
      ours, params, x, False
    )
    np.testing.assert_allclose(want[1].reshape(x.shape), got[1], **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), want[0], got[0])


@pytest.mark.parametrize("plan", ["default", "padded"])
def test_linen_one_trace_per_padded_shape(plan):
  rnn = linen.RNN(nn.GRUCell(HIDDEN), plan=PLANS[plan])
  x = jnp.asarray(_inputs(), jnp.float32)
  params = jax.jit(rnn.init)(jax.random.key(0), x)
  traces = []

  @jax.jit
  def run(x, lengths):
    traces.append(None)
    return rnn.apply(params, x, seq_lengths=lengths)

  rng = np.random.default_rng(0)
  for _ in range(4):
    lengths = jnp.asarray(rng.integers(0, TIME + 1, size=(B1, B2)), jnp.int32)
    y = run(x, lengths)
    assert y.shape == (B1, B2, TIME, HIDDEN)
  assert len(traces) == 1


def test_linen_lod_input_runs_as_dynamic_rnn():
  x = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((1, 2))], dtype="f4")
  params = linen.DynamicRNN(nn.GRUCell(HIDDEN)).init(jax.random.key(0), x)
  want = linen.DynamicRNN(nn.GRUCell(HIDDEN), reverse=True).apply(params, x)
  got = linen.RNN(nn.GRUCell(HIDDEN), reverse=True).apply(params, x)
  np.testing.assert_array_equal(want.values, got.values)
  assert got.recursive_lengths() == x.recursive_lengths()


def test_linen_unroll_sets_the_chunk():
  with jax.enable_x64(True):
    x = jnp.asarray(_inputs())
    lengths = jnp.array([[5, 0, 1], [3, 2, 4]], jnp.int32)
    cell = nn.SimpleCell(HIDDEN, param_dtype=jnp.float64)

    @jax.jit
    def run(x, lengths):
      params = linen.RNN(cell).init(jax.random.key(0), x)
      want = linen.RNN(cell).apply(params, x, seq_lengths=lengths)
      return want, linen.RNN(cell, unroll=3).apply(params, x, seq_lengths=lengths)

    np.testing.assert_allclose(*run(x, lengths), **TOL)


def test_linen_conv_lstm_matches_flax():
  """Three feature axes (``num_feature_axes``): images ``[h, w, c]`` per step."""
  lengths = jnp.array([5, 0, 2], jnp.int32)
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, TIME, 4, 4, 2)))
    cell = nn.ConvLSTMCell(3, (3, 3), param_dtype=jnp.float64)
    params = nn.RNN(cell).init(jax.random.key(0), x)

    @jax.jit
    def run(x, lengths):
      out = []
      for reverse, keep_order in DIRECTIONS:
        kw = {"return_carry": True, "reverse": reverse, "keep_order": keep_order}
        theirs = nn.RNN(cell, **kw).apply(params, x, seq_lengths=lengths)
        ours = linen.RNN(cell, **kw).apply(params, x, seq_lengths=lengths)
        out.append((theirs, ours))
      return out

    real = (np.arange(TIME) < np.asarray(lengths)[:, None])[..., None, None, None]
    for (carry_ref, y_ref), (carry, y) in run(x, lengths):
      assert y.shape == (3, TIME, 4, 4, 3)
      np.testing.assert_allclose(np.where(real, y_ref, 0.0), y, **TOL)
      for a, b in zip(jax.tree.leaves(carry_ref), jax.tree.leaves(carry), strict=True):
        np.testing.assert_allclose(np.asarray(a)[[0, 2]], np.asarray(b)[[0, 2]], **TOL)


def _check_bidirectional(theirs, ours, lengths, time_major) -> None:
  """`_check` for ``((forward, backward), outputs)``, both carries."""
  (carry_ref, y_ref), (carry, y) = theirs, ours
  _check((carry_ref[0], y_ref), (carry[0], y), lengths, time_major)
  _check((carry_ref[1], y_ref), (carry[1], y), lengths, time_major)


@pytest.mark.parametrize("time_major", [False, True], ids=["batch-major", "time-major"])
def test_linen_bidirectional_matches_flax(time_major):
  lengths = jnp.array([5, 0, 2, 4], jnp.int32)
  with jax.enable_x64(True):
    x = jnp.asarray(_inputs()).reshape(-1, TIME, FEATURES)[:4]
    x = _layout(x, time_major)
    f64 = {"param_dtype": jnp.float64}

    def layer(api, **kw):
      return api.Bidirectional(
        api.RNN(nn.LSTMCell(HIDDEN, **f64)),
        api.RNN(nn.GRUCell(HIDDEN + 1, **f64)),
        time_major=time_major,
        return_carry=True,
        **kw,
      )

    params = layer(nn).init(jax.random.key(0), x, seq_lengths=lengths)

    @jax.jit
    def run(x, lengths):
      out = []
      for kw in ({}, {"merge_fn": lambda a, b: a[..., :HIDDEN] * b[..., :HIDDEN]}):
        theirs = layer(nn, **kw).apply(params, x, seq_lengths=lengths)
        ours = layer(linen, **kw).apply(params, x, seq_lengths=lengths)
        out.append((theirs, ours))
      return out

    outs = run(x, lengths)
    assert outs[0][1][1].shape[-1] == 2 * HIDDEN + 1
    for theirs, ours in outs:
      _check_bidirectional(theirs, ours, lengths, time_major)


# -- NNX ------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", ["default", "padded", "padded_hoist"])
@pytest.mark.parametrize("name", NNX_CELLS)
def test_nnx_matches_flax(name, plan):
  time_major = name in ("GRUCell", "SimpleCell")  # both layouts, fewer compiles
  kw = {"time_major": time_major, "return_carry": True}
  with jax.enable_x64(True):
    f64 = {"dtype": jnp.float64, "param_dtype": jnp.float64}
    cell = NNX_CELLS[name](FEATURES, HIDDEN, **f64, rngs=nnx.Rngs(1))
    x = jnp.asarray(_inputs())

    @nnx.jit
    def run(cell, lengths):
      out = []
      for reverse, keep_order in DIRECTIONS:
        d = {"reverse": reverse, "keep_order": keep_order}
        theirs = nnx.RNN(cell, **kw, **d)(
          _flat_batch(x, time_major), seq_lengths=lengths.reshape(-1)
        )
        ours = twin.RNN(cell, plan=PLANS[plan], **kw, **d)(
          _layout(x, time_major), seq_lengths=lengths
        )
        out.append((theirs, ours))
      return out

    @settings(max_examples=3, deadline=None)
    @given(LENGTHS)
    def check(lengths):
      lengths = jnp.asarray(lengths, jnp.int32).reshape(B1, B2)
      for theirs, ours in run(cell, lengths):
        _check(theirs, ours, lengths, time_major)

    check()


def test_nnx_lod_input_runs_as_dynamic_rnn():
  x = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((1, 2))], dtype="f4")
  cell = nnx.GRUCell(2, HIDDEN, rngs=nnx.Rngs(0))
  want = twin.DynamicRNN(cell)(x)
  got = twin.RNN(cell)(x)
  np.testing.assert_array_equal(want.values, got.values)


def test_nnx_bidirectional_matches_flax():
  lengths = jnp.array([5, 0, 2, 4], jnp.int32)
  with jax.enable_x64(True):
    x = jnp.asarray(_inputs()).reshape(-1, TIME, FEATURES)[:4]
    f64 = {"dtype": jnp.float64, "param_dtype": jnp.float64}
    forward = nnx.LSTMCell(FEATURES, HIDDEN, **f64, rngs=nnx.Rngs(0))
    backward = nnx.GRUCell(FEATURES, HIDDEN + 1, **f64, rngs=nnx.Rngs(1))

    @nnx.jit
    def run(forward, backward, x, lengths):
      return [
        api.Bidirectional(api.RNN(forward), api.RNN(backward), return_carry=True)(
          x, seq_lengths=lengths
        )
        for api in (nnx, twin)
      ]

    _check_bidirectional(*run(forward, backward, x, lengths), lengths, False)


class _RecurrentDropoutLSTM(nnx.LSTMCell):
  """An LSTM drawing a dropout mask on its hidden state at every step (the
  cell of Flax's ``test_recurrent_dropout``)."""

  def __init__(self, rngs: nnx.Rngs):
    super().__init__(FEATURES, HIDDEN, rngs=rngs)
    self.drop = nnx.Dropout(0.5, deterministic=False, rng_collection="rd", rngs=rngs)

  def __call__(self, carry, x):
    (c, h), _ = super().__call__(carry, x)
    h = self.drop(h)
    return (c, h), h


def test_nnx_broadcast_rngs_as_flax():
  """A cell drawing from a broadcast stream: one fresh key per call (the
  stream's count moves as Flax's), the same draws at every step."""
  x = jnp.ones((3, TIME, FEATURES))
  lengths = jnp.array([5, 2, 4])
  counts, outputs = [], []
  for api in (nnx, twin):
    cell = _RecurrentDropoutLSTM(nnx.Rngs(0, rd=1))
    rnn = api.RNN(cell, broadcast_rngs="rd")
    ys = [rnn(x, seq_lengths=lengths), nnx.jit(lambda r, x: r(x))(rnn, x)]
    counts.append(int(cell.drop.rngs.count[...]))
    outputs.append(ys)
  assert counts == [2, 2]
  ours = outputs[1][0]
  assert np.any(np.asarray(ours) != np.asarray(outputs[1][1]))  # fresh key per call
  # Every step drops the same units of a sequence (one key for all steps).
  dropped = np.asarray(ours) == 0.0
  for i, n in enumerate(np.asarray(lengths)):
    assert dropped[i, :n].any()
    assert (dropped[i, :n] == dropped[i, :1]).all()


def test_nnx_cell_updating_its_state_raises():
  cell = _RecurrentDropoutLSTM(nnx.Rngs(0, rd=1))
  with pytest.raises(
    ValueError,
    match=r"Expected _RecurrentDropoutLSTM.__call__ to leave its state unchanged "
    r"inside the loop, but it updates \['drop'\]\['rngs'\]\['count'\].*"
    r"`broadcast_rngs`",
  ):
    twin.RNN(cell)(jnp.ones((2, TIME, FEATURES)))


# -- errors ---------------------------------------------------------------------------

LAYERS = {
  "linen": lambda **kw: (
    lambda x, **call: linen.RNN(nn.GRUCell(HIDDEN), **kw).init_with_output(
      jax.random.key(0), x, **call
    )[0]
  ),
  "nnx": lambda **kw: twin.RNN(nnx.GRUCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0)), **kw),
}


@pytest.mark.parametrize("api", LAYERS)
def test_time_axis_not_where_the_arguments_say(api):
  x = jnp.ones((2, TIME, FEATURES))  # batch-major
  with pytest.raises(
    ValueError,
    match=r"Expected `seq_lengths` to have the batch shape \(5,\) \(time is axis 0 "
    r"of `inputs` \(2, 5, 3\) with time_major=True\), got shape \(2,\)\.",
  ):
    LAYERS[api](time_major=True)(x, seq_lengths=jnp.array([5, 3]))
  with pytest.raises(ValueError, match=r"batch shape \(2,\).*got shape \(2, 1\)"):
    LAYERS[api]()(x, seq_lengths=jnp.ones((2, 1), jnp.int32))


@pytest.mark.parametrize("api", LAYERS)
def test_lengths_longer_than_time(api):
  x = jnp.ones((2, TIME, FEATURES))
  with pytest.raises(
    ValueError,
    match=r"Expected `seq_lengths` in \[0, 5\] \(the time axis, axis 1 of `inputs` "
    r"\(2, 5, 3\) with time_major=False\), got seq_lengths\[1\] = 7\.",
  ):
    LAYERS[api]()(x, seq_lengths=jnp.array([2, 7]))


@pytest.mark.parametrize("plan", ["default", "padded"])
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_jitted_call_has_no_effect(kind, plan):
  """Under `jit` the layer checks lengths by making bad sequences NaN
  (below), not through `checkify`: a check is an effect, and JAX
  dispatches a jitted function with an effect on its slower path. Neither
  the calls (RNN and Bidirectional) nor a training step has one, and a
  `checkify` around them finds no check to fail: the NaN is the signal."""
  x = jnp.ones((2, 5, 3))
  for call in _bad_calls(kind, PLANS[plan], pure=True):
    assert not jax.make_jaxpr(call)(x, jnp.array([2, 5])).effects
    err, (_, out) = checkify.checkify(call)(x, jnp.array([2, 7]))
    assert err.get() is None and np.isnan(np.asarray(out[1])).all()
  rnn = linen.RNN(nn.GRUCell(HIDDEN), plan=PLANS[plan])
  params = rnn.init(jax.random.key(0), x)

  def loss(params, x, n):
    return jnp.sum(rnn.apply(params, x, seq_lengths=n) ** 2)

  assert not jax.make_jaxpr(jax.grad(loss))(params, x, jnp.array([2, 5])).effects


@pytest.mark.parametrize("api", LAYERS)
def test_other_errors(api):
  x = jnp.ones((2, TIME, FEATURES))
  with pytest.raises(TypeError, match=r"Expected `seq_lengths` .*integer"):
    LAYERS[api]()(x, seq_lengths=jnp.array([2.0, 1.0]))
  with pytest.raises(
    ValueError,
    match=r"Expected `initial_carry` leaf .* leading "
    r"dimensions \(2,\) \(the batch axes of `inputs`\), got shape \(3, 4\)",
  ):
    LAYERS[api]()(x, initial_carry=jnp.zeros((3, HIDDEN)))
  lod = LoDTensor.from_sequences([np.ones((3, FEATURES), np.float32)])
  with pytest.raises(
    ValueError, match=r"Expected `seq_lengths` to be None for a LoDTensor"
  ):
    LAYERS[api]()(lod, seq_lengths=jnp.array([3]))
  with pytest.raises(ValueError, match=r"Expected `unroll` .*got 0"):
    LAYERS[api](unroll=0)(x)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_bidirectional_errors(api):
  x = jnp.ones((2, TIME, FEATURES))
  lod = LoDTensor.from_sequences([np.ones((3, FEATURES), np.float32)])
  if api == "linen":
    layer = linen.Bidirectional(linen.RNN(nn.GRUCell(2)), linen.RNN(nn.GRUCell(2)))
    params = layer.init(jax.random.key(0), x)

    def call(x, **kw):
      return layer.apply(params, x, **kw)
  else:
    cells = [nnx.GRUCell(FEATURES, 2, rngs=nnx.Rngs(i)) for i in range(2)]
    call = twin.Bidirectional(*map(twin.RNN, cells))
  table = rank_table(lod)
  with pytest.raises(ValueError, match=r"Expected `table` to be None for a padded"):
    call(x, table=table)
  with pytest.raises(ValueError, match=r"Expected `seq_lengths` to be None for a"):
    call(lod, seq_lengths=jnp.array([3]))
  with pytest.raises(ValueError, match=r"Expected `seq_lengths` in \[0, 5\]"):
    call(x, seq_lengths=jnp.array([2, 6]))


@pytest.mark.parametrize("plan", ["default", "padded"])
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_batch_of_no_sequences_gives_empty_results_as_flax_does(kind, plan):
  """Inputs ``[0, 5, 3]``: outputs ``(0, 5, 4)`` and a carry ``(0, 4)``,
  eagerly and under `jit`."""
  x = jnp.zeros((0, 5, 3))
  want = nn.RNN(nn.GRUCell(4), return_carry=True)
  want_carry, want_out = want.apply(want.init(jax.random.key(0), x), x)
  plan = PLANS[plan]
  if kind == "linen":
    layer = linen.RNN(nn.GRUCell(4), return_carry=True, plan=plan)
    params = layer.init(jax.random.key(0), x)

    def run(x):
      return layer.apply(params, x)

    calls = (run, jax.jit(run))
  else:
    cell = nnx.GRUCell(3, 4, rngs=nnx.Rngs(0))
    layer = twin.RNN(cell, return_carry=True, plan=plan)

    jitted = nnx.jit(lambda layer, x: layer(x))
    calls = (layer, lambda x: jitted(layer, x))
  for call in calls:
    carry, out = call(x)
    assert carry.shape == want_carry.shape == (0, 4)
    assert out.shape == want_out.shape == (0, 5, 4)


def _bad_calls(kind, plan=None, pure=False):
  """The drop-in RNN and Bidirectional of `kind` under `plan`, each as
  ``call(x, lengths) -> (carry, outputs)`` under plain `jit` (with `pure`,
  NNX modules split, and merged inside the call, for tracing)."""
  x = jnp.ones((2, 5, 3))
  if kind == "linen":
    rnn = linen.RNN(nn.GRUCell(4), return_carry=True, plan=plan)
    pair = linen.Bidirectional(
      linen.RNN(nn.GRUCell(4), plan=plan),
      linen.RNN(nn.GRUCell(4), plan=plan),
      return_carry=True,
    )
    calls = []
    for layer in (rnn, pair):
      params = layer.init(jax.random.key(0), x)
      calls.append(
        jax.jit(lambda x, n, layer=layer, p=params: layer.apply(p, x, seq_lengths=n))
      )
    return calls
  rnn = twin.RNN(nnx.GRUCell(3, 4, rngs=nnx.Rngs(0)), return_carry=True, plan=plan)
  pair = twin.Bidirectional(
    twin.RNN(nnx.GRUCell(3, 4, rngs=nnx.Rngs(1)), plan=plan),
    twin.RNN(nnx.GRUCell(3, 4, rngs=nnx.Rngs(2)), plan=plan),
    return_carry=True,
  )
  if pure:
    calls = []
    for layer in (rnn, pair):
      graph, state = nnx.split(layer)
      call = jax.jit(lambda s, x, n, g=graph: nnx.merge(g, s)(x, seq_lengths=n))
      calls.append(functools.partial(call, state))
    return calls
  jitted = nnx.jit(lambda layer, x, n: layer(x, seq_lengths=n))
  return [lambda x, n, layer=layer: jitted(layer, x, n) for layer in (rnn, pair)]


@pytest.mark.parametrize("plan", ["default", "padded"])
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_bad_lengths_under_plain_jit_are_nan_in_their_sequences(kind, plan):
  """``seq_lengths=[8, -2]`` on a time axis of 5 gave the results of ``[5,
  0]``; each bad sequence is NaN, outputs and carry, and a good one beside
  it is finite."""
  x = jnp.ones((2, 5, 3))
  for call in _bad_calls(kind, PLANS[plan]):
    carry, out = call(x, jnp.array([8, -2]))
    assert np.isnan(np.asarray(out)).all()
    for leaf in jax.tree.leaves(carry):
      assert np.isnan(np.asarray(leaf)).all()
    carry, out = call(x, jnp.array([4, -2]))
    assert np.isnan(np.asarray(out[1])).all()
    assert np.isfinite(np.asarray(out[0])).all()
    for leaf in jax.tree.leaves(carry):
      assert np.isnan(np.asarray(leaf[1])).all()
      assert np.isfinite(np.asarray(leaf[0])).all()


def test_a_batch_over_its_buckets_under_plain_jit_is_nan():
  """A padded batch whose real steps overflow the layer's `buckets` came
  back with real steps zero; under plain `jit` it is NaN, eagerly an
  error."""
  buckets = Buckets.fixed(tokens=8, sequences=4, time=5)
  layer = linen.RNN(nn.GRUCell(4), buckets=buckets)
  x = jnp.ones((4, 5, 3))
  params = layer.init(jax.random.key(0), x[:, :2])
  out = jax.jit(layer.apply)(params, x)
  assert np.isnan(np.asarray(out)).all()
  with pytest.raises(ValueError, match="capacity"):
    layer.apply(params, x)
