"""Linen recurrent layers against flax.linen.RNN on the same weights."""

from __future__ import annotations

import re

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlod.nn.nnx as nnx_layers
from jaxlod import Buckets, LoDTensor
from jaxlod.nn import Bidirectional, DynamicRNN, HierarchicalEncoder, StackedRNN
from jaxlod.ops import rank_table
from tests.helpers import assert_close

FEATURES, HIDDEN = 3, 4
# Zero-length sequences, and capacities above the data (tokens 12, 5 sequences,
# longest 5).
LENGTHS = [4, 0, 2, 5, 1]
BUCKETS = Buckets.fixed(tokens=16, sequences=6, time=7)
COUNT = 6


class PairCell(nn.RNNCellBase):
  """A user cell whose carry is a pytree: a dict holding a nested tuple."""

  features: int

  @nn.compact
  def __call__(self, carry, x):
    h, (total, steps) = carry["h"], carry["stats"]
    h = jnp.tanh(
      nn.Dense(self.features, name="input")(x)
      + nn.Dense(self.features, use_bias=False, name="hidden")(h)
    )
    return {"h": h, "stats": (total + h.sum(-1), steps + 1.0)}, h

  @nn.nowrap
  def initialize_carry(self, rng, input_shape):
    del rng
    batch = input_shape[:-1]
    zeros = jnp.zeros(batch)
    return {"h": jnp.zeros((*batch, self.features)), "stats": (zeros, zeros)}

  @property
  def num_feature_axes(self) -> int:
    return 1


CELLS = {
  "lstm": lambda: nn.LSTMCell(HIDDEN),
  "optimized_lstm": lambda: nn.OptimizedLSTMCell(HIDDEN),
  "gru": lambda: nn.GRUCell(HIDDEN),
  "simple": lambda: nn.SimpleCell(HIDDEN),
  "mgu": lambda: nn.MGUCell(HIDDEN),
  "pytree_carry": lambda: PairCell(HIDDEN),
}


def _batch(lengths=LENGTHS, buckets=BUCKETS, seed=0) -> LoDTensor:
  rng = np.random.default_rng(seed)
  seqs = [rng.normal(size=(n, FEATURES)).astype(np.float32) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=buckets)


def _random_carry(cell, count, seed=2):
  """A random carry ``[count, ...]`` with the structure the cell starts from."""
  leaves, tree = jax.tree.flatten(
    cell.initialize_carry(jax.random.key(0), (count, FEATURES))
  )
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noise = [jax.random.normal(k, a.shape) for k, a in zip(keys, leaves, strict=True)]
  return jax.tree.unflatten(tree, noise)


def _real_mask(lengths, time):
  return jnp.arange(time)[None, :] < lengths[:, None]


def _loss(padded_outputs, carry):
  """Weights every output position differently; adds the final carry."""
  weights = 1 + jnp.arange(padded_outputs.size).reshape(padded_outputs.shape) % 3
  total = jnp.sum(jnp.sin(padded_outputs) * weights)
  return total + sum(jnp.sum(a**2) for a in jax.tree.leaves(carry))


def _jaxlod_run(cell, reverse):
  """Loss and results of DynamicRNN: padded outputs and final carry."""
  rnn = DynamicRNN(cell, reverse=reverse, return_carry=True)

  def run(params, x, carry):
    carry, y = rnn.apply(params, x, carry)
    padded = y.to_padded()[0]
    return _loss(padded, carry), (padded, carry)

  return run


def _flax_run(cell, reverse):
  """The reference: flax.linen.RNN over the padded batch with `seq_lengths`."""
  rnn = nn.RNN(cell, reverse=reverse, keep_order=True, return_carry=True)

  def run(params, x, carry):
    padded, lengths = x.to_padded()
    final, y = rnn.apply(params, padded, initial_carry=carry, seq_lengths=lengths)
    mask = _real_mask(lengths, padded.shape[1])[..., None]
    y = jnp.where(mask, y, 0.0)
    # flax.linen.RNN has no final carry for an empty sequence: its initial one.
    empty = lengths == 0

    def keep(new, old):
      return jnp.where(empty.reshape(empty.shape + (1,) * (new.ndim - 1)), old, new)

    final = jax.tree.map(keep, final, carry)
    return _loss(y, final), (y, final)

  return run


def _grad_both_directions(run):
  """One jitted function: values and gradients, forward and reverse."""

  def both(params, x, carry):
    grad = jax.value_and_grad(run(False), argnums=(0, 2), has_aux=True)
    grad_reverse = jax.value_and_grad(run(True), argnums=(0, 2), has_aux=True)
    return grad(params, x, carry), grad_reverse(params, x, carry)

  return jax.jit(both)


# -- DynamicRNN against flax.linen.RNN ---------------------------------------------


@pytest.mark.parametrize("name", sorted(CELLS))
def test_dynamic_rnn_matches_flax_rnn(name):
  cell = CELLS[name]()
  x = _batch()
  params = DynamicRNN(cell).init(jax.random.key(1), x)
  flax_params = nn.RNN(cell).init(jax.random.key(1), jnp.zeros((COUNT, 7, FEATURES)))
  # Same tree, same initial values: weights move between the two.
  assert_close(params, flax_params, rtol=0, atol=0)
  carry = _random_carry(cell, COUNT)

  got = _grad_both_directions(lambda r: _jaxlod_run(cell, r))(params, x, carry)
  want = _grad_both_directions(lambda r: _flax_run(cell, r))(params, x, carry)
  for (value, grads), (ref_value, ref_grads) in zip(got, want, strict=True):
    loss, (outputs, final) = value
    ref_loss, (ref_outputs, ref_final) = ref_value
    assert_close(outputs, ref_outputs, rtol=1e-5, atol=1e-5)
    assert_close(final, ref_final, rtol=1e-5, atol=1e-5)
    assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    # Gradients sum over the steps of every sequence: float32 round-off.
    assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
  # The empty sequence keeps its initial carry exactly, in both directions.
  for (_, (_, final)), _ in got:
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(carry), strict=True):
      np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])


def test_dynamic_rnn_without_jit_default_carry_and_padding():
  """Eager call, the cell's own initial carry; padding rows and slots stay zero."""
  cell = nn.LSTMCell(HIDDEN)
  x = _batch()
  rnn = DynamicRNN(cell, return_carry=True)
  params = rnn.init(jax.random.key(1), x)
  final, y = rnn.apply(params, x)
  padded, lengths = x.to_padded()
  ref_final, ref_y = nn.RNN(cell, return_carry=True).apply(
    params, padded, seq_lengths=lengths
  )
  assert isinstance(y, LoDTensor)
  assert y.capacity == x.capacity
  assert y.recursive_lengths() == [LENGTHS]
  mask = np.asarray(_real_mask(lengths, padded.shape[1]))
  assert_close(y.to_padded()[0][mask], ref_y[mask], rtol=1e-5, atol=1e-6)
  real = [0, 2, 3, 4]
  assert_close(
    jax.tree.map(lambda a: a[np.asarray(real)], final),
    jax.tree.map(lambda a: a[np.asarray(real)], ref_final),
  )
  np.testing.assert_array_equal(np.asarray(y.values)[sum(LENGTHS) :], 0.0)
  # The empty sequence and the padding slot keep the zero initial carry.
  for leaf in final:
    np.testing.assert_array_equal(np.asarray(leaf)[[1, 5]], 0.0)


# -- Bidirectional ---------------------------------------------------------------


def _num_phases(fn, *args) -> int:
  """The `while` loops in the jaxpr of `fn`: one per phase of each loop."""
  return str(jax.make_jaxpr(fn)(*args)).count("while[")


def test_dynamic_rnn_ladder_and_table_reach_the_loop():
  """`ladder` and a host-built `table` set the phases and change no value."""
  cell = nn.GRUCell(HIDDEN)
  x = _batch()
  carry = _random_carry(cell, COUNT)
  params = DynamicRNN(cell).init(jax.random.key(1), x)
  ladder = (6, 3, 1)
  table = rank_table(x, ladder=ladder)  # On the host, as a data pipeline does.

  def run(rnn, table=None):
    def f(params, x, carry, table):
      return rnn.apply(params, x, carry, table=table)

    return jax.jit(f)(params, x, carry, table), _num_phases(f, params, x, carry, table)

  (want_carry, want), default_phases = run(DynamicRNN(cell, return_carry=True))
  assert default_phases == len(rank_table(x).ladder) != len(ladder)
  for rnn, table_arg in (
    (DynamicRNN(cell, ladder=ladder, return_carry=True), None),
    (DynamicRNN(cell, ladder=ladder, return_carry=True), table),
    (DynamicRNN(cell, return_carry=True), table),  # The table's own ladder.
  ):
    (got_carry, got), phases = run(rnn, table_arg)
    assert phases == len(ladder)
    assert_close(got.values, want.values, rtol=1e-6, atol=1e-6)
    assert_close(got_carry, want_carry, rtol=1e-6, atol=1e-6)


def test_dynamic_rnn_rejects_a_table_of_other_data():
  cell = nn.GRUCell(HIDDEN)
  x = _batch()
  params = DynamicRNN(cell).init(jax.random.key(1), x)
  with pytest.raises(ValueError, match=r"Got both `table` \(ladder \(6, 3, 1\)\) and "):
    DynamicRNN(cell, ladder=(6, 2)).apply(
      params, x, table=rank_table(x, ladder=(6, 3, 1))
    )
  other = rank_table(_batch(lengths=[1, 2, 3, 4, 5]))
  with pytest.raises(ValueError, match="The rank table does not describe `inputs`"):
    DynamicRNN(cell).apply(params, x, table=other)
  with pytest.raises(TypeError, match="Expected `table` to be a RankTable, got dict"):
    DynamicRNN(cell).apply(params, x, table={})


def _per_sequence_bidirectional(forward_cell, backward_cell, params, seqs):
  """Each sequence alone, at its exact length, through flax.linen.Bidirectional."""
  layer = nn.Bidirectional(
    nn.RNN(forward_cell), nn.RNN(backward_cell), return_carry=True
  )
  outputs, carries = [], []
  for seq in seqs:
    carry, y = jax.jit(layer.apply)(params, jnp.asarray(seq)[None])
    outputs.append(np.asarray(y[0]))
    carries.append(jax.tree.map(lambda a: a[0], carry))
  return outputs, carries


def _gru_lstm_bidirectional(x):
  """A GRU forward, an LSTM backward (other widths), and their parameters."""
  forward_cell, backward_cell = nn.GRUCell(HIDDEN), nn.LSTMCell(HIDDEN + 1)
  birnn = Bidirectional(
    DynamicRNN(forward_cell), DynamicRNN(backward_cell), return_carry=True
  )
  return birnn, birnn.init(jax.random.key(1), x)


def test_bidirectional_matches_per_sequence_runs():
  """No padding leaks into either direction: each sequence as if run alone."""
  x = _batch()
  birnn, params = _gru_lstm_bidirectional(x)
  forward_cell, backward_cell = birnn.forward_rnn.cell, birnn.backward_rnn.cell
  (carry_forward, carry_backward), y = jax.jit(birnn.apply)(params, x)
  assert y.values.shape == (16, 2 * HIDDEN + 1)
  assert y.recursive_lengths() == [LENGTHS]
  np.testing.assert_array_equal(np.asarray(y.values)[sum(LENGTHS) :], 0.0)

  seqs = x.to_list()
  real = [i for i, seq in enumerate(seqs) if len(seq)]
  outputs, carries = _per_sequence_bidirectional(
    forward_cell, backward_cell, params, [seqs[i] for i in real]
  )
  got = y.to_list()
  for k, i in enumerate(real):
    assert_close(got[i], outputs[k], rtol=1e-5, atol=1e-6)
    assert_close(
      jax.tree.map(lambda a, i=i: a[i], (carry_forward, carry_backward)),
      carries[k],
      rtol=1e-5,
      atol=1e-6,
    )
  assert got[1].shape == (0, 2 * HIDDEN + 1)


def test_bidirectional_passes_the_table_to_both_directions():
  x = _batch()
  birnn, params = _gru_lstm_bidirectional(x)
  ladder = (6, 3, 1)
  table = rank_table(x, ladder=ladder)

  def f(params, x, table):
    return birnn.apply(params, x, table=table)

  assert _num_phases(f, params, x, table) == 2 * len(ladder)
  assert _num_phases(f, params, x, None) == 2 * len(rank_table(x).ladder)
  assert_close(jax.jit(f)(params, x, table), jax.jit(f)(params, x, None), atol=1e-6)


def test_bidirectional_merge_fn_initial_carry_and_gradients():
  """Against flax.linen.Bidirectional over the padded batch, gradients too."""
  cell = nn.SimpleCell(HIDDEN)
  x = _batch()

  def merge(a, b):
    return a - 2 * b + 1.0

  birnn = Bidirectional(DynamicRNN(cell), DynamicRNN(cell), merge_fn=merge)
  params = birnn.init(jax.random.key(1), x)
  initial = (_random_carry(cell, COUNT, seed=3), _random_carry(cell, COUNT, seed=4))

  def loss(params, x, initial):
    y = birnn.apply(params, x, initial)
    return _loss(y.to_padded()[0], ()), y.values

  def reference(params, x, initial):
    padded, lengths = x.to_padded()
    layer = nn.Bidirectional(nn.RNN(cell), nn.RNN(cell), merge_fn=merge)
    y = layer.apply(params, padded, initial_carry=initial, seq_lengths=lengths)
    return _loss(jnp.where(_real_mask(lengths, 7)[..., None], y, 0.0), ()), y

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))
  ref_grad = jax.jit(jax.value_and_grad(reference, argnums=(0, 2), has_aux=True))
  (value, values), grads = grad(params, x, initial)
  (ref_value, _), ref_grads = ref_grad(params, x, initial)
  assert_close(value, ref_value, rtol=1e-5, atol=1e-5)
  assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
  # The merge adds 1 everywhere; padding rows are set back to zero.
  np.testing.assert_array_equal(np.asarray(values)[sum(LENGTHS) :], 0.0)


# -- StackedRNN --------------------------------------------------------------------


class Identity(nn.Module):
  """A layer that returns its input: shows what the dropout did."""

  @nn.compact
  def __call__(self, x):
    return x


def test_stacked_rnn_deterministic_is_the_composition():
  cells = [nn.GRUCell(HIDDEN), nn.LSTMCell(HIDDEN)]
  x = _batch()
  layers = [
    Bidirectional(DynamicRNN(cells[0]), DynamicRNN(cells[0])),
    DynamicRNN(cells[1]),
  ]
  stacked = StackedRNN(layers, dropout_rate=0.5, return_carry=True)
  params = stacked.init(jax.random.key(1), x)
  assert set(params["params"]) == {"layers_0", "layers_1"}

  @jax.jit
  def run(params, x, key):
    rngs = {"dropout": key}
    deterministic = stacked.apply(params, x, rngs=rngs)
    dropped = stacked.apply(params, x, deterministic=False, rngs=rngs)
    first = layers[0].apply({"params": params["params"]["layers_0"]}, x)
    second = layers[1].apply({"params": params["params"]["layers_1"]}, first)
    return deterministic, dropped, second

  (carries, y), (_, y_dropped), y_manual = run(params, x, jax.random.key(7))
  assert len(carries) == 2 and len(carries[0]) == 2
  assert_close(y.values, y_manual.values)
  real = sum(LENGTHS)
  assert not np.allclose(
    np.asarray(y_dropped.values)[:real], np.asarray(y.values)[:real]
  )
  np.testing.assert_array_equal(np.asarray(y_dropped.values)[real:], 0.0)


def test_stacked_rnn_dropout_between_layers_only():
  x = _batch()
  rngs = {"dropout": jax.random.key(3)}
  y = StackedRNN([Identity(), Identity()], dropout_rate=0.5).apply(
    {}, x, deterministic=False, rngs=rngs
  )
  values, kept = np.asarray(y.values), np.asarray(x.values)
  dropped = values == 0.0
  assert 0 < dropped[: sum(LENGTHS)].sum() < dropped[: sum(LENGTHS)].size
  np.testing.assert_allclose(values[~dropped], 2 * kept[~dropped], rtol=1e-6)
  np.testing.assert_array_equal(values[sum(LENGTHS) :], 0.0)
  # Nothing after the last layer: one layer never drops.
  single = StackedRNN([Identity()], dropout_rate=0.5)
  y = single.apply({}, x, deterministic=False, rngs=rngs)
  np.testing.assert_array_equal(np.asarray(y.values), kept)
  # Without the 'dropout' rng, the non-deterministic call fails as in Flax.
  with pytest.raises(flax.errors.InvalidRngError, match="dropout"):
    StackedRNN([Identity(), Identity()], dropout_rate=0.5).apply(
      {}, x, deterministic=False
    )


# -- HierarchicalEncoder -------------------------------------------------------------


def _run_alone(step, params, carry, rows):
  """One sequence alone, a step per row: ``(final carry, [output per row])``."""
  outputs = []
  for row in rows:
    carry, y = step(params, carry, jnp.asarray(row)[None])
    outputs.append(np.asarray(y[0]))
  return carry, outputs


def _hierarchical_reference(inner_cell, outer_cell, params, x):
  """Inner runs per level-1 sequence, their last rows, outer runs per level 0."""
  inner_step, outer_step = jax.jit(inner_cell.apply), jax.jit(outer_cell.apply)
  inner_params = {"params": params["params"]["inner"]["cell"]}
  outer_params = {"params": params["params"]["outer"]["cell"]}
  key = jax.random.key(0)
  outputs, carries = [], []
  for paragraph in x.to_list():
    pooled = []
    for sentence in paragraph:
      carry = inner_cell.initialize_carry(key, (1, FEATURES))
      _, ys = _run_alone(inner_step, inner_params, carry, sentence)
      pooled.append(ys[-1] if ys else np.zeros(HIDDEN, np.float32))
    carry = outer_cell.initialize_carry(key, (1, HIDDEN))
    carry, ys = _run_alone(outer_step, outer_params, carry, pooled)
    outputs.append(np.stack(ys) if ys else np.zeros((0, HIDDEN + 1), np.float32))
    carries.append(jax.tree.map(lambda a: a[0], carry))
  return outputs, carries


def test_hierarchical_encoder_matches_manual_composition():
  inner_cell, outer_cell = nn.GRUCell(HIDDEN), nn.LSTMCell(HIDDEN + 1)
  lengths = [[2, 0, 3], [3, 0, 1, 2, 4]]
  rng = np.random.default_rng(4)
  values = rng.normal(size=(10, FEATURES)).astype(np.float32)
  buckets = Buckets.fixed(tokens=12, sequences=(4, 6), time=(4, 5))
  x = LoDTensor.from_lengths(values, lengths, buckets=buckets)
  encoder = HierarchicalEncoder(
    DynamicRNN(inner_cell), DynamicRNN(outer_cell), return_carry=True
  )
  params = encoder.init(jax.random.key(1), x)
  carry, y = jax.jit(encoder.apply)(params, x)
  assert y.num_levels == 1
  assert y.recursive_lengths() == [[2, 0, 3]]
  assert y.values.shape == (6, HIDDEN + 1)

  outputs, carries = _hierarchical_reference(inner_cell, outer_cell, params, x)
  for i, (got, want) in enumerate(zip(y.to_list(), outputs, strict=True)):
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_close(jax.tree.map(lambda a, i=i: a[i], carry), carries[i])
  np.testing.assert_array_equal(np.asarray(y.values)[5:], 0.0)


def test_hierarchical_encoder_bidirectional_inner_gradients():
  """A Bidirectional inner RNN, average pooling; gradients reach every weight."""
  x = LoDTensor.from_lengths(
    np.random.default_rng(5).normal(size=(7, FEATURES)).astype(np.float32),
    [[1, 2], [3, 4, 0]],
  )
  cell = nn.GRUCell(HIDDEN)
  encoder = HierarchicalEncoder(
    Bidirectional(DynamicRNN(cell), DynamicRNN(cell)),
    DynamicRNN(nn.SimpleCell(HIDDEN)),
    pool_type="average",
  )
  params = encoder.init(jax.random.key(1), x)

  @jax.jit
  def run(params):
    def loss(params):
      y, state = encoder.apply(
        params,
        x,
        capture_intermediates=lambda module, _: module.name == "inner",
        mutable=["intermediates"],
      )
      return jnp.sum(y.values**2), (y, state["intermediates"]["inner"]["__call__"][0])

    (_, outputs), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return outputs, grads

  (y, inner), grads = run(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(np.asarray(g))), path
    assert np.any(np.asarray(g) != 0), path
  # The outer run over the average of each inner output sequence.
  rows = inner.to_list()[1]
  assert [len(r) for r in rows] == [4, 0]
  pooled = [np.mean(r, axis=0) if len(r) else np.zeros(2 * HIDDEN) for r in rows]
  outer = nn.RNN(nn.SimpleCell(HIDDEN))
  want = outer.apply({"params": params["params"]["outer"]}, np.stack(pooled)[None])
  assert_close(y.to_list()[1], want[0], rtol=1e-5, atol=1e-6)


# -- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "module",
  [
    DynamicRNN(nn.GRUCell(HIDDEN)),
    Bidirectional(DynamicRNN(nn.GRUCell(HIDDEN)), DynamicRNN(nn.GRUCell(HIDDEN))),
    StackedRNN([Identity()]),
    HierarchicalEncoder(Identity(), Identity()),
  ],
  ids=lambda m: type(m).__name__,
)
def test_non_lod_input_is_a_type_error(module):
  if isinstance(module, Bidirectional):  # padded arrays go to RNNs that take them
    match = r"Expected `inputs` to be a LoDTensor: `forward_rnn` is a DynamicRNN.*"
  else:
    match = "Expected `x` to be a LoDTensor"
  with pytest.raises(TypeError, match=match + ", got ndarray"):
    module.init(jax.random.key(0), np.ones((3, FEATURES)))


def test_hierarchical_encoder_needs_two_levels():
  encoder = HierarchicalEncoder(Identity(), Identity())
  with pytest.raises(ValueError, match=r"Expected `x` to have 2 LoD levels .*got 1\."):
    encoder.init(jax.random.key(0), _batch())
  two_levels = LoDTensor.from_lengths(np.ones((3, FEATURES)), [[1], [3]])
  with pytest.raises(ValueError, match="Expected `pool_type` to be one of"):
    HierarchicalEncoder(Identity(), Identity(), pool_type="median").init(
      jax.random.key(0), two_levels
    )


def test_bad_carries():
  cell = nn.GRUCell(HIDDEN)
  rnn = DynamicRNN(cell)
  with pytest.raises(
    ValueError,
    match=r"`init_carry` leaf \(root\) to have leading dimension 6 \(count "
    r"capacity\), got shape \(5, 4\)",
  ):
    rnn.init(jax.random.key(0), _batch(), jnp.zeros((5, HIDDEN)))
  with pytest.raises(
    TypeError, match=r"`cell` \(Identity\) to have `initialize_carry\(rng, input"
  ):
    DynamicRNN(Identity()).init(jax.random.key(0), _batch())
  birnn = Bidirectional(DynamicRNN(cell), DynamicRNN(cell))
  with pytest.raises(TypeError, match=r"`initial_carry` to be a pair \(forward"):
    birnn.init(jax.random.key(0), _batch(), jnp.zeros((COUNT, HIDDEN)))


def test_stacked_rnn_bad_settings():
  x = _batch()
  with pytest.raises(ValueError, match="`layers` to hold at least one layer"):
    StackedRNN([]).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"`dropout_rate` in \[0, 1\], got 1.5"):
    StackedRNN([Identity()], dropout_rate=1.5).init(jax.random.key(0), x)


# A layer over LoDTensors is never one of Flax's layers over arrays.
ARRAY_LAYER = (
  r"got Flax's {}, which takes arrays \(a recurrent cell goes in a DynamicRNN\)"
)


@pytest.mark.parametrize(
  ("build", "name", "given"),
  [
    (
      lambda: StackedRNN([DynamicRNN(nn.GRUCell(HIDDEN)), nn.Dense(3)]),
      "layers[1]",
      "Dense",
    ),
    (lambda: StackedRNN([nn.GRUCell(HIDDEN)]), "layers[0]", "GRUCell"),
    (
      lambda: HierarchicalEncoder(nn.Dense(4), DynamicRNN(nn.GRUCell(4))),
      "inner",
      "Dense",
    ),
    (
      lambda: HierarchicalEncoder(DynamicRNN(nn.GRUCell(4)), nn.Dense(4)),
      "outer",
      "Dense",
    ),
    (
      lambda: Bidirectional(nn.RNN(nn.GRUCell(4)), DynamicRNN(nn.GRUCell(4))),
      "forward_rnn",
      "RNN",
    ),
  ],
  ids=["stacked", "stacked_cell", "inner", "outer", "bidirectional"],
)
def test_a_flax_array_layer_where_an_rnn_layer_goes_is_refused(build, name, given):
  x = LoDTensor.from_lengths(np.ones((3, FEATURES), np.float32), [[1, 1], [2, 1]])
  if not name.startswith(("inner", "outer")):
    x = _batch()
  with pytest.raises(
    TypeError,
    match=rf"`{re.escape(name)}` to be a jaxlod RNN layer .*"
    + ARRAY_LAYER.format(given),
  ):
    build().init(jax.random.key(0), x)


def test_an_nnx_layer_in_a_linen_layer_is_refused():
  layer = nnx_layers.DynamicRNN(nnx.GRUCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0)))
  with pytest.raises(
    TypeError,
    match=r"Expected `layers\[0\]` to be a Linen module \(a jaxlod.nn layer\), got the "
    r"NNX module DynamicRNN\.",
  ):
    StackedRNN([layer]).init(jax.random.key(0), _batch())
