"""jaxlod.nn.nnx: NNX layers against flax.nnx.RNN, padded references, NumPy and
the Linen layers on the same weights."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import checkify

import jaxlod.nn as linen
from jaxlod import Buckets, LoDTensor
from jaxlod.nn.nnx import (
  AdditiveAttention,
  AttentionDecoder,
  Bidirectional,
  CosineAttention,
  DotAttention,
  DynamicRNN,
  GeneralAttention,
  HierarchicalEncoder,
  Seq2Seq,
  StackedRNN,
)
from jaxlod.ops import rank_table
from tests.helpers import assert_close

FEATURES, HIDDEN, UNITS = 3, 4, 6
# Gradients sum over several steps and rows: float32 round-off.
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}


def _lod(lengths, features, buckets=None, seed=0) -> LoDTensor:
  rng = np.random.default_rng(seed)
  seqs = [rng.normal(size=(n, features)).astype(np.float32) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=buckets)


X = _lod([4, 0, 5, 1, 3], FEATURES, Buckets.fixed(tokens=16, sequences=6, time=6))


def _mask(lengths, time):
  return np.arange(time)[None, :] < np.asarray(lengths)[:, None]


def _real(padded, lengths):
  """Rows of a padded ``[count, time, ...]`` batch at real positions."""
  padded = np.asarray(padded)
  return padded[_mask(lengths, padded.shape[1])]


def _loss_weights(shape):
  return 1.0 + jnp.arange(np.prod(shape)).reshape(shape) % 3


def _maybe_jit(fn, jit: bool):
  return nnx.jit(fn) if jit else fn


# -- cells --------------------------------------------------------------------------


class PairCell(nnx.Module):
  """A user cell with a dict carry and no `in_features`."""

  def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(features + hidden, hidden, rngs=rngs)
    self.hidden = hidden

  def initialize_carry(self, input_shape, rngs=None):
    del rngs
    batch = input_shape[:-1]
    return {"h": jnp.zeros((*batch, self.hidden)), "n": jnp.zeros(batch)}

  @property
  def num_feature_axes(self) -> int:
    return 1

  def __call__(self, carry, x):
    h = jnp.tanh(self.dense(jnp.concatenate([x, carry["h"]], axis=-1)))
    return {"h": h, "n": carry["n"] + jnp.sum(h, axis=-1)}, h


CELLS = {
  "lstm": lambda rngs: nnx.LSTMCell(FEATURES, HIDDEN, rngs=rngs),
  "optimized_lstm": lambda rngs: nnx.OptimizedLSTMCell(FEATURES, HIDDEN, rngs=rngs),
  "gru": lambda rngs: nnx.GRUCell(FEATURES, HIDDEN, rngs=rngs),
  "simple": lambda rngs: nnx.SimpleCell(FEATURES, HIDDEN, rngs=rngs),
  "user": lambda rngs: PairCell(FEATURES, HIDDEN, rngs=rngs),
}


def _random_carry(cell, count, seed=1):
  leaves, tree = jax.tree.flatten(cell.initialize_carry((count, 1), nnx.Rngs(0)))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noise = [jax.random.normal(k, a.shape) for k, a in zip(keys, leaves, strict=True)]
  return jax.tree.unflatten(tree, noise)


# -- DynamicRNN against flax.nnx.RNN, values and gradients -----------------------------


def _rnn_loss(outputs_padded, carry, lengths):
  """A loss over real output positions and the final carry of non-empty rows."""
  mask = jnp.asarray(_mask(lengths, outputs_padded.shape[1]))[..., None]
  ys = jnp.where(mask, outputs_padded, 0.0)
  loss = jnp.sum(jnp.sin(ys) * _loss_weights(ys.shape))
  nonempty = jnp.asarray(lengths) > 0
  for leaf in jax.tree.leaves(carry):
    loss += jnp.sum(
      jnp.where(nonempty[:, None] if leaf.ndim > 1 else nonempty, leaf, 0) ** 2
    )
  return loss


@pytest.mark.parametrize(
  ("cell_name", "reverse"),
  [(name, False) for name in sorted(CELLS)] + [("lstm", True), ("user", True)],
)
def test_dynamic_rnn_matches_nnx_rnn_with_the_same_cell(cell_name, reverse):
  cell = CELLS[cell_name](nnx.Rngs(0))
  count = X.capacity.sequences[-1]
  init = _random_carry(cell, count)
  padded, lengths = X.to_padded()

  def loss(cell, x, init):
    carry, outputs = DynamicRNN(cell, reverse=reverse, return_carry=True)(x, init)
    return _rnn_loss(outputs.to_padded()[0], carry, lengths), (outputs, carry)

  def reference_loss(cell, padded, init):
    rnn = nnx.RNN(cell, return_carry=True, reverse=reverse, keep_order=True)
    carry, outputs = rnn(padded, initial_carry=init, seq_lengths=lengths)
    return _rnn_loss(outputs, carry, lengths), (outputs, carry)

  grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
  reference_grad = nnx.jit(nnx.value_and_grad(reference_loss, has_aux=True))
  (value, (outputs, carry)), grads = grad(cell, X, init)
  (ref_value, (ref_outputs, ref_carry)), ref_grads = reference_grad(cell, padded, init)

  assert outputs.recursive_lengths() == X.recursive_lengths()
  assert_close(
    _real(outputs.to_padded()[0], lengths), _real(ref_outputs, lengths), atol=1e-5
  )
  nonempty = np.asarray(lengths) > 0
  assert_close(
    jax.tree.map(lambda a: np.asarray(a)[nonempty], carry),
    jax.tree.map(lambda a: np.asarray(a)[nonempty], ref_carry),
    atol=1e-5,
  )
  # An empty sequence keeps its initial carry.
  assert_close(
    jax.tree.map(lambda a: np.asarray(a)[~nonempty], carry),
    jax.tree.map(lambda a: np.asarray(a)[~nonempty], init),
  )
  assert_close(value, ref_value, rtol=1e-5, atol=1e-5)
  assert_close(nnx.state(grads), nnx.state(ref_grads), **GRAD_TOL)


def test_dynamic_rnn_eager_equals_jit_and_default_carry():
  cell = nnx.LSTMCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
  rnn = DynamicRNN(cell, remat=True)
  eager = rnn(X)
  jitted = nnx.jit(lambda rnn, x: rnn(x))(rnn, X)
  assert_close(eager.values, jitted.values)
  padded, lengths = X.to_padded()
  reference = nnx.jit(lambda rnn, x: rnn(x, seq_lengths=lengths))(nnx.RNN(cell), padded)
  assert_close(
    _real(eager.to_padded()[0], lengths), _real(reference, lengths), atol=1e-5
  )
  # Padding rows stay zero.
  assert not np.any(np.asarray(eager.values)[int(X.num_rows) :])


def test_dynamic_rnn_state_is_the_cells_under_cell():
  cell = nnx.GRUCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
  ours = jax.tree_util.tree_leaves_with_path(nnx.state(DynamicRNN(cell), nnx.Param))
  theirs = jax.tree_util.tree_leaves_with_path(nnx.state(nnx.RNN(cell), nnx.Param))
  assert [p for p, _ in ours] == [p for p, _ in theirs]
  assert all(a is b for (_, a), (_, b) in zip(ours, theirs, strict=True))


def test_optimizer_step_updates_parameters_and_lowers_the_loss():
  model = DynamicRNN(nnx.LSTMCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0)))
  target = jnp.asarray(np.random.default_rng(1).normal(size=(16, HIDDEN)), jnp.float32)
  real = (np.arange(16) < int(X.num_rows))[:, None]
  optimizer = nnx.Optimizer(model, optax.adam(5e-2), wrt=nnx.Param)

  def loss_fn(model, x):
    return jnp.sum(jnp.where(real, model(x).values - target, 0.0) ** 2)

  @nnx.jit
  def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x)
    optimizer.update(model, grads)
    return loss

  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  losses = [float(train_step(model, optimizer, X)) for _ in range(5)]
  after = nnx.state(model, nnx.Param)
  changed = jax.tree.map(lambda a, b: not np.allclose(a, b), before, after)
  assert all(jax.tree.leaves(changed))
  assert losses[-1] < losses[0]
  assert float(loss_fn(model, X)) < losses[0]


# -- Linen and NNX on equal weights -------------------------------------------------


def _perturbed(variables):
  """Non-zero biases, so that their placement is checked too."""
  return jax.tree.map(
    lambda a: a + 0.1 * jnp.cos(jnp.arange(a.size).reshape(a.shape)), variables
  )


def _copy_linen_lstm(params, cell: nnx.LSTMCell) -> None:
  for name in ("ii", "if", "ig", "io", "hi", "hf", "hg", "ho"):
    layer = getattr(cell, "if_" if name == "if" else name)
    layer.kernel[...] = params[name]["kernel"]
    if "bias" in params[name]:
      layer.bias[...] = params[name]["bias"]


def _copy_linen_simple(params, cell: nnx.SimpleCell) -> None:
  cell.dense_i.kernel[...] = params["i"]["kernel"]
  cell.dense_i.bias[...] = params["i"]["bias"]
  cell.dense_h.kernel[...] = params["h"]["kernel"]


@pytest.mark.parametrize(
  ("linen_cell", "nnx_cell", "copy", "reverse"),
  [
    (nn.LSTMCell, nnx.LSTMCell, _copy_linen_lstm, False),
    (nn.LSTMCell, nnx.LSTMCell, _copy_linen_lstm, True),
    (nn.SimpleCell, nnx.SimpleCell, _copy_linen_simple, False),
  ],
  ids=["lstm", "lstm-reverse", "simple"],
)
def test_linen_and_nnx_dynamic_rnn_agree_on_equal_weights(
  linen_cell, nnx_cell, copy, reverse
):
  module = linen.DynamicRNN(linen_cell(HIDDEN), reverse=reverse, return_carry=True)
  variables = _perturbed(module.init(jax.random.key(3), X))
  cell = nnx_cell(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
  copy(variables["params"]["cell"], cell)
  ours = DynamicRNN(cell, reverse=reverse, return_carry=True)
  carry, outputs = nnx.jit(lambda m, x: m(x))(ours, X)
  ref_carry, ref_outputs = jax.jit(module.apply)(variables, X)
  assert_close(outputs.values, ref_outputs.values, atol=1e-5)
  assert_close(carry, ref_carry, atol=1e-5)


# -- Bidirectional -------------------------------------------------------------------


def test_bidirectional_matches_unpadded_runs_of_each_sequence():
  rngs = nnx.Rngs(0)
  forward_cell = nnx.LSTMCell(FEATURES, HIDDEN, rngs=rngs)
  backward_cell = nnx.GRUCell(FEATURES, HIDDEN + 1, rngs=rngs)
  layer = Bidirectional(
    DynamicRNN(forward_cell), DynamicRNN(backward_cell), return_carry=True
  )
  (forward_carry, backward_carry), outputs = nnx.jit(lambda m, x: m(x))(layer, X)
  assert outputs.recursive_lengths() == X.recursive_lengths()
  assert outputs.values.shape == (16, 2 * HIDDEN + 1)
  assert not np.any(np.asarray(outputs.values)[int(X.num_rows) :])
  for i, (seq, got) in enumerate(zip(X.to_list(), outputs.to_list(), strict=True)):
    if len(seq) == 0:
      assert got.shape == (0, 2 * HIDDEN + 1)
      continue
    fwd_carry, fwd = nnx.RNN(forward_cell, return_carry=True)(seq[None])
    bwd_carry, bwd = nnx.RNN(
      backward_cell, return_carry=True, reverse=True, keep_order=True
    )(seq[None])
    assert_close(got, np.concatenate([fwd[0], bwd[0]], axis=-1), atol=1e-5)
    assert_close(
      jax.tree.map(lambda a, i=i: a[i], forward_carry),
      jax.tree.map(lambda a: a[0], fwd_carry),
      atol=1e-5,
    )
    assert_close(backward_carry[i], bwd_carry[0], atol=1e-5)


def test_bidirectional_merge_fn_and_initial_carry():
  rngs = nnx.Rngs(0)
  forward = DynamicRNN(nnx.GRUCell(FEATURES, HIDDEN, rngs=rngs))
  backward = DynamicRNN(nnx.GRUCell(FEATURES, HIDDEN, rngs=rngs))
  init = (_random_carry(forward.cell, 6, 1), _random_carry(backward.cell, 6, 2))
  summed = Bidirectional(forward, backward, merge_fn=lambda a, b: a + b + 1.0)(X, init)
  expected = forward(X, init[0]).values + backward(X, init[1], reverse=True).values + 1
  real = (np.arange(16) < int(X.num_rows))[:, None]
  assert_close(summed.values, np.where(real, expected, 0.0))


def _num_phases(fn, *args) -> int:
  """The `while` loops in the jaxpr of `fn`: one per phase of each loop."""
  return str(jax.make_jaxpr(fn)(*args)).count("while[")


def test_dynamic_rnn_and_bidirectional_ladder_and_table():
  """`ladder` and a host-built `table` set the phases and change no value."""
  rngs = nnx.Rngs(0)
  cell = nnx.GRUCell(FEATURES, HIDDEN, rngs=rngs)
  ladder = (6, 3, 1)
  table = rank_table(X, ladder=ladder)  # On the host, as a data pipeline does.
  default = len(rank_table(X).ladder)
  assert default != len(ladder)

  def call(layer, x, table):
    return layer(x, table=table)

  want = DynamicRNN(cell)(X).values
  for layer, table_arg in (
    (DynamicRNN(cell, ladder=ladder), None),
    (DynamicRNN(cell, ladder=ladder), table),
    (DynamicRNN(cell), table),  # The table's own ladder.
  ):
    got = nnx.jit(call)(layer, X, table_arg)
    assert_close(got.values, want, rtol=1e-6, atol=1e-6)
    assert _num_phases(lambda x, t, layer=layer: call(layer, x, t), X, table_arg) == 3
  with pytest.raises(ValueError, match=r"Got both `table` \(ladder \(6, 3, 1\)\)"):
    DynamicRNN(cell, ladder=(6, 2))(X, table=table)

  backward = DynamicRNN(nnx.LSTMCell(FEATURES, 2, rngs=rngs))
  both = Bidirectional(DynamicRNN(cell), backward)
  assert _num_phases(lambda x, t: call(both, x, t), X, table) == 2 * len(ladder)
  assert _num_phases(lambda x, t: call(both, x, t), X, None) == 2 * default
  assert_close(nnx.jit(call)(both, X, table).values, both(X).values, atol=1e-6)


# -- attentions against NumPy ----------------------------------------------------------

MEMORY_LENGTHS = [3, 0, 5, 1, 2]
MEMORY_BUCKETS = Buckets.fixed(tokens=16, sequences=6, time=6)


def _attention(kind: str, hidden: int, features: int, rngs: nnx.Rngs):
  if kind == "dot":
    return DotAttention()
  if kind == "general":
    return GeneralAttention(hidden, features, rngs=rngs)
  if kind == "additive":
    return AdditiveAttention(hidden, features, UNITS, rngs=rngs)
  return CosineAttention()


def _width(kind: str) -> int:
  """Memory features: the query's width where the score needs it."""
  return HIDDEN if kind in ("dot", "cosine") else 5


def _numpy_scores(attention, q: np.ndarray, m: np.ndarray) -> np.ndarray:
  """Scores of one query ``[hidden]`` against real memory rows ``[n, F]``."""
  q, m = q.astype(np.float64), m.astype(np.float64)
  if isinstance(attention, DotAttention):
    return m @ q
  if isinstance(attention, GeneralAttention):
    return m @ (q @ np.asarray(attention.query.kernel[...]))
  if isinstance(attention, AdditiveAttention):
    keys = m @ np.asarray(attention.key.kernel[...])
    query = q @ np.asarray(attention.query.kernel[...]) + np.asarray(
      attention.query.bias[...]
    )
    return (np.tanh(keys + query) @ np.asarray(attention.energy.kernel[...]))[:, 0]
  norms = np.sqrt(np.sum(m * m, axis=-1) + 1e-8) * np.sqrt(np.sum(q * q) + 1e-8)
  return (m @ q) / norms


def _numpy_attention(attention, query, memory: LoDTensor):
  """Context and weights row by row over the real memory rows only."""
  count, source = memory.capacity.sequences[-1], memory.capacity.time[-1]
  seqs = memory.to_list()
  seqs += [np.zeros((0, memory.feature_shape[0]))] * (count - len(seqs))
  contexts, weights = [], []
  for q, m in zip(np.asarray(query), seqs, strict=True):
    w = np.zeros(source)
    if len(m):
      s = _numpy_scores(attention, q, m)
      e = np.exp(s - s.max())
      w[: len(m)] = e / e.sum()
    contexts.append(w[: len(m)] @ m)
    weights.append(w)
  return np.stack(contexts), np.stack(weights)


@pytest.mark.parametrize("kind", ["dot", "general", "additive", "cosine"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_attention_matches_numpy(kind, jit):
  memory = _lod(MEMORY_LENGTHS, _width(kind), MEMORY_BUCKETS, seed=4)
  query = jnp.asarray(np.random.default_rng(5).normal(size=(6, HIDDEN)), jnp.float32)
  attention = _attention(kind, HIDDEN, _width(kind), nnx.Rngs(1))
  call = _maybe_jit(lambda a, q, m: a(q, m, keys=a.keys(m)), jit)
  context, weights = call(attention, query, memory)
  ref_context, ref_weights = _numpy_attention(attention, np.asarray(query), memory)
  assert_close(context, ref_context, atol=1e-5)
  assert_close(weights, ref_weights, atol=1e-6)
  # Padding gets exactly zero weight; the empty memories a zero context.
  padded, lengths = memory.to_padded()
  assert not np.any(np.asarray(weights)[~_mask(lengths, padded.shape[1])])
  assert not np.any(np.asarray(context)[np.asarray(lengths) == 0])
  # The padded form and computing the keys inside give the same result.
  again = _maybe_jit(lambda a, q, m, n: a(q, m, n), jit)(
    attention, query, padded, lengths
  )
  assert_close(again, (context, weights), atol=1e-6)


@pytest.mark.parametrize("kind", ["general", "additive", "cosine"])
def test_attention_gradients_are_finite_with_empty_memories(kind):
  memory = _lod(MEMORY_LENGTHS, _width(kind), MEMORY_BUCKETS, seed=4)
  query = jnp.asarray(np.random.default_rng(5).normal(size=(6, HIDDEN)), jnp.float32)
  attention = _attention(kind, HIDDEN, _width(kind), nnx.Rngs(1))

  def loss(attention, query, memory_values):
    context, weights = attention(query, memory.with_values(memory_values))
    return jnp.sum(jnp.sin(context)) + jnp.sum(weights**2)

  grads = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2)))(attention, query, memory.values)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  query_grad = np.asarray(grads[1])
  assert not np.any(query_grad[np.asarray(memory.lengths()) == 0])


def test_additive_keys_of_a_lod_memory_keep_its_lod():
  memory = _lod(MEMORY_LENGTHS, 5, MEMORY_BUCKETS, seed=4)
  attention = AdditiveAttention(HIDDEN, 5, UNITS, rngs=nnx.Rngs(0))
  keys = attention.keys(memory)
  assert isinstance(keys, LoDTensor)
  assert keys.recursive_lengths() == memory.recursive_lengths()
  assert keys.values.shape == (16, UNITS)
  assert not np.any(np.asarray(keys.values)[int(memory.num_rows) :])
  padded = attention.keys(memory.to_padded()[0])
  assert_close(padded, keys.to_padded()[0], atol=1e-6)


# -- AttentionDecoder against a padded reference ---------------------------------------

TGT = _lod([2, 3, 0, 4, 1], FEATURES, Buckets.fixed(tokens=12, sequences=6, time=5), 6)


def _reference_scores(attention, h, memory):
  """The score formulas, written out over the padded memory ``[b, S, F]``."""
  if isinstance(attention, DotAttention):
    return jnp.einsum("bh,bsh->bs", h, memory)
  if isinstance(attention, GeneralAttention):
    return jnp.einsum("bf,bsf->bs", h @ attention.query.kernel[...], memory)
  if isinstance(attention, AdditiveAttention):
    keys = memory @ attention.key.kernel[...]
    query = h @ attention.query.kernel[...] + attention.query.bias[...]
    return (jnp.tanh(keys + query[:, None, :]) @ attention.energy.kernel[...])[..., 0]
  norms = (
    jnp.sqrt(jnp.sum(memory**2, -1) + 1e-8)
    * jnp.sqrt(jnp.sum(h**2, -1) + 1e-8)[:, None]
  )
  return jnp.einsum("bh,bsh->bs", h, memory) / norms


def _reference_decoder(decoder, tgt, memory, init, input_feeding):
  """A masked `lax.scan` over the padded target; the memory padded, in order."""
  x, lengths = tgt.to_padded()
  mem, mem_lengths = memory.to_padded()
  real = jnp.arange(mem.shape[1])[None, :] < mem_lengths[:, None]

  def body(state, inputs):
    carry, prev = state
    x_t, t = inputs
    active = (t < lengths)[:, None]
    x_t = jnp.concatenate([x_t, prev], -1) if input_feeding else x_t
    new_carry, h = decoder.cell(carry, x_t)
    scores = jnp.where(real, _reference_scores(decoder.attention, h, mem), -1e30)
    w = jnp.where(real, jax.nn.softmax(scores, axis=-1), 0.0)
    context = jnp.einsum("bs,bsf->bf", w, mem)
    carry = jax.tree.map(lambda n, o: jnp.where(active, n, o), new_carry, carry)
    prev = jnp.where(active, context, prev)
    y = jnp.where(active, jnp.concatenate([h, context], -1), 0.0)
    return (carry, prev), (y, jnp.where(active, w, 0.0))

  state = (init, jnp.zeros((x.shape[0], mem.shape[-1])))
  steps = (jnp.swapaxes(x, 0, 1), jnp.arange(x.shape[1]))
  _, (ys, ws) = jax.lax.scan(body, state, steps)
  return jnp.swapaxes(ys, 0, 1), jnp.swapaxes(ws, 0, 1)


def _decoder(kind, input_feeding, seed=0, **kwargs):
  rngs = nnx.Rngs(seed)
  features = _width(kind)
  width = FEATURES + (features if input_feeding else 0)
  return AttentionDecoder(
    nnx.LSTMCell(width, HIDDEN, rngs=rngs),
    _attention(kind, HIDDEN, features, rngs),
    input_feeding=input_feeding,
    **kwargs,
  )


def _decoder_loss(ys, ws, lengths):
  mask = jnp.asarray(_mask(lengths, ys.shape[1]))[..., None]
  ys, ws = jnp.where(mask, ys, 0.0), jnp.where(mask, ws, 0.0)
  return jnp.sum(jnp.sin(ys) * _loss_weights(ys.shape)) + jnp.sum(ws**2)


@pytest.mark.parametrize(
  ("kind", "input_feeding"),
  [("dot", False), ("additive", True)],
)
def test_attention_decoder_matches_padded_reference(kind, input_feeding):
  decoder = _decoder(kind, input_feeding)
  memory = _lod(MEMORY_LENGTHS, _width(kind), MEMORY_BUCKETS, seed=7)
  init = _random_carry(decoder.cell, 6)
  lengths = TGT.lengths()

  def loss(decoder, tgt_values, memory_values):
    outputs, weights = decoder(
      TGT.with_values(tgt_values),
      memory.with_values(memory_values),
      init,
      return_weights=True,
    )
    ys, ws = outputs.to_padded()[0], weights.to_padded()[0]
    return _decoder_loss(ys, ws, lengths), (ys, ws)

  def reference_loss(decoder, tgt_values, memory_values):
    ys, ws = _reference_decoder(
      decoder,
      TGT.with_values(tgt_values),
      memory.with_values(memory_values),
      init,
      input_feeding,
    )
    return _decoder_loss(ys, ws, lengths), (ys, ws)

  argnums = (0, 1, 2)
  args = (decoder, TGT.values, memory.values)
  grad = nnx.jit(nnx.value_and_grad(loss, argnums=argnums, has_aux=True))
  (value, (ys, ws)), grads = grad(*args)
  reference_grad = nnx.jit(
    nnx.value_and_grad(reference_loss, argnums=argnums, has_aux=True)
  )
  (ref_value, (ref_ys, ref_ws)), ref_grads = reference_grad(*args)
  assert_close(_real(ys, lengths), _real(ref_ys, lengths), atol=1e-5)
  assert_close(_real(ws, lengths), _real(ref_ws, lengths), atol=1e-6)
  assert_close(value, ref_value, rtol=1e-5, atol=1e-5)
  assert_close(nnx.state(grads[0]), nnx.state(ref_grads[0]), **GRAD_TOL)
  assert_close(grads[1:], ref_grads[1:], **GRAD_TOL)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_attention_decoder_eager_equals_decoding_with_step():
  decoder = _decoder("additive", True)
  memory = _lod(MEMORY_LENGTHS, 5, MEMORY_BUCKETS, seed=7)
  outputs, weights = decoder(TGT, memory, return_weights=True)
  assert outputs.values.shape == (12, HIDDEN + 5)
  assert weights.values.shape == (12, 6)
  # Decoding by hand, step by step over the padded batch in the caller's order.
  carry = decoder.initial_state(memory, FEATURES)
  padded = decoder.precompute(memory)
  assert padded.keys.shape == (6, 6, UNITS)
  x, tgt_lengths = TGT.to_padded()
  ys, ws = [], []
  for t in range(x.shape[1]):
    carry, y, w = decoder.step(carry, x[:, t], padded)
    ys.append(y)
    ws.append(w)
  assert_close(
    _real(outputs.to_padded()[0], tgt_lengths),
    _real(jnp.stack(ys, 1), tgt_lengths),
    atol=1e-6,
  )
  assert_close(
    _real(weights.to_padded()[0], tgt_lengths),
    _real(jnp.stack(ws, 1), tgt_lengths),
    atol=1e-6,
  )


def test_attention_decoder_ladder_and_table():
  """`ladder` and a host-built target `table` set the phases, change nothing."""
  memory = _lod(MEMORY_LENGTHS, _width("dot"), MEMORY_BUCKETS, seed=7)
  decoder = _decoder("dot", False)
  ladder = (6, 3, 1)
  table = rank_table(TGT, ladder=ladder)
  assert len(rank_table(TGT).ladder) != len(ladder)
  want = decoder(TGT, memory).values

  def call(decoder, tgt, memory, table):
    return decoder(tgt, memory, table=table)

  for ladder_arg, table_arg in ((ladder, None), (ladder, table), (None, table)):
    decoder.ladder = ladder_arg
    got = nnx.jit(call)(decoder, TGT, memory, table_arg)
    assert_close(got.values, want, rtol=1e-6, atol=1e-6)
    jaxpr = jax.make_jaxpr(lambda t, d=decoder: call(d, TGT, memory, t))(table_arg)
    assert str(jaxpr).count("while[") == len(ladder)
  decoder.ladder = (6, 2)
  with pytest.raises(ValueError, match=r"Got both `table` \(ladder \(6, 3, 1\)\)"):
    decoder(TGT, memory, table=table)
  assert _decoder("dot", False, ladder=[6, 2]).ladder == (6, 2)


def test_attention_decoder_trains_with_an_optimizer():
  decoder = _decoder("general", True)
  memory = _lod(MEMORY_LENGTHS, 5, MEMORY_BUCKETS, seed=7)
  optimizer = nnx.Optimizer(decoder, optax.adam(5e-2), wrt=nnx.Param)

  def loss_fn(decoder):
    return jnp.sum(decoder(TGT, memory).values ** 2)

  @nnx.jit
  def train_step(decoder, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(decoder)
    optimizer.update(decoder, grads)
    return loss

  losses = [float(train_step(decoder, optimizer)) for _ in range(4)]
  assert losses[-1] < losses[0]


# -- Linen attentions and AttentionDecoder on equal weights ---------------------------

LINEN_ATTENTIONS = {
  "dot": lambda: linen.DotAttention(),
  "general": lambda: linen.GeneralAttention(),
  "additive": lambda: linen.AdditiveAttention(UNITS),
  "cosine": lambda: linen.CosineAttention(),
}


def _as_nnx_state(params) -> dict:
  """Linen parameters (dense layers named as the NNX attributes) as NNX state."""
  return {
    name: {leaf: nnx.Param(jnp.asarray(value)) for leaf, value in layer.items()}
    for name, layer in params.items()
  }


@pytest.mark.parametrize("kind", ["dot", "general", "additive", "cosine"])
def test_linen_and_nnx_attentions_agree_on_equal_weights(kind):
  module = LINEN_ATTENTIONS[kind]()
  memory = _lod(MEMORY_LENGTHS, _width(kind), MEMORY_BUCKETS, seed=4)
  query = jnp.asarray(np.random.default_rng(5).normal(size=(6, HIDDEN)), jnp.float32)
  variables = _perturbed(module.init(jax.random.key(2), query, memory))
  ours = _attention(kind, HIDDEN, _width(kind), nnx.Rngs(0))
  nnx.update(ours, _as_nnx_state(variables.get("params", {})))
  assert_close(
    nnx.jit(lambda a, q, m: a(q, m))(ours, query, memory),
    jax.jit(module.apply)(variables, query, memory),
    atol=1e-6,
  )


@pytest.mark.parametrize(("kind", "input_feeding"), [("general", True)])
def test_linen_and_nnx_attention_decoders_agree_on_equal_weights(kind, input_feeding):
  memory = _lod(MEMORY_LENGTHS, _width(kind), MEMORY_BUCKETS, seed=7)
  module = linen.AttentionDecoder(
    nn.LSTMCell(HIDDEN), LINEN_ATTENTIONS[kind](), input_feeding=input_feeding
  )
  variables = _perturbed(module.init(jax.random.key(2), TGT, memory))
  ours = _decoder(kind, input_feeding)
  _copy_linen_lstm(variables["params"]["cell"], ours.cell)
  nnx.update(ours.attention, _as_nnx_state(variables["params"].get("attention", {})))
  outputs, weights = nnx.jit(lambda d, t, m: d(t, m, return_weights=True))(
    ours, TGT, memory
  )
  ref_outputs, ref_weights = jax.jit(
    lambda v, t, m: module.apply(v, t, m, return_weights=True)
  )(variables, TGT, memory)
  assert_close(outputs.values, ref_outputs.values, atol=1e-5)
  assert_close(weights.values, ref_weights.values, atol=1e-6)


# -- errors --------------------------------------------------------------------------


def test_errors_non_lod_inputs():
  cell = nnx.GRUCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
  padded = X.to_padded()[0]
  with pytest.raises(
    TypeError, match=r"Expected `x` to be a LoDTensor, got ArrayImpl\."
  ):
    DynamicRNN(cell)(padded)
  with pytest.raises(
    TypeError,
    match=r"Expected `inputs` to be a LoDTensor: `forward_rnn` is a DynamicRNN, "
    r"which takes LoDTensors, not padded arrays with `seq_lengths` "
    r"\(jaxlod.nn.RNN takes both\), got ArrayImpl\.",
  ):
    Bidirectional(DynamicRNN(cell), DynamicRNN(cell))(padded)
  with pytest.raises(
    TypeError,
    match=r"Expected `initial_carry` to be a pair \(forward_carry, backward_carry\), "
    r"got ArrayImpl\.",
  ):
    Bidirectional(DynamicRNN(cell), DynamicRNN(cell))(X, jnp.zeros((6, HIDDEN)))
  decoder = _decoder("dot", False)
  memory = _lod(MEMORY_LENGTHS, HIDDEN, MEMORY_BUCKETS)
  with pytest.raises(
    TypeError, match=r"Expected `tgt` to be a LoDTensor, got ArrayImpl"
  ):
    decoder(TGT.values, memory)
  with pytest.raises(
    TypeError, match=r"Expected `memory` to be a LoDTensor, got tuple"
  ):
    decoder(TGT, memory.to_padded())


class DropoutCell(nnx.Module):
  """A cell drawing a dropout mask from its own RNG stream at every step."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.cell = nnx.GRUCell(FEATURES, HIDDEN, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def initialize_carry(self, input_shape, rngs=None):
    return self.cell.initialize_carry(input_shape, rngs)

  def __call__(self, carry, x):
    return self.cell(carry, self.dropout(x))


def test_errors_cell_that_updates_its_state():
  rnn = DynamicRNN(DropoutCell(rngs=nnx.Rngs(0)))
  with pytest.raises(
    ValueError,
    match=r"Expected DropoutCell.__call__ to leave its state unchanged inside the "
    r"loop, but it updates \['dropout'\]\['rngs'\]\['count'\]",
  ):
    rnn(X)
  # Deterministic dropout updates nothing.
  rnn.cell.dropout.deterministic = True
  assert rnn(X).values.shape == (16, HIDDEN)


def test_errors_dynamic_rnn_initial_carry():
  cell = nnx.GRUCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError,
    match=r"Expected `init_carry` leaf \(root\) to have leading dimension 6 \(count "
    r"capacity\), got shape \(5, 4\)\.",
  ):
    DynamicRNN(cell)(X, jnp.zeros((5, HIDDEN)))


def test_errors_attention_widths():
  rngs = nnx.Rngs(0)
  memory = _lod(MEMORY_LENGTHS, 5, MEMORY_BUCKETS)
  query = jnp.zeros((6, HIDDEN))
  for attention in (DotAttention(), CosineAttention()):
    with pytest.raises(
      ValueError,
      match=r"Expected `query` of width 5 \(memory features\), got 4\.",
    ):
      attention(query, memory)
  with pytest.raises(
    ValueError, match=r"Expected `query` of width 3 \(`hidden`\), got 4\."
  ):
    GeneralAttention(3, 5, rngs=rngs)(query, memory)
  with pytest.raises(
    ValueError,
    match=r"Expected `memory` of width 7 \(`features`\), got 5\.",
  ):
    GeneralAttention(HIDDEN, 7, rngs=rngs)(query, memory)
  additive = AdditiveAttention(HIDDEN, 7, UNITS, rngs=rngs)
  with pytest.raises(ValueError, match=r"Expected `memory` of width 7"):
    additive(query, memory)
  with pytest.raises(ValueError, match=r"Expected `memory` of width 7"):
    additive.keys(memory)
  additive = AdditiveAttention(HIDDEN, 5, UNITS, rngs=rngs)
  with pytest.raises(
    ValueError,
    match=r"Expected `keys` to have shape \[b, source_capacity, units\] = "
    r"\(6, 6, 6\), got \(6, 6, 5\)\.",
  ):
    additive(query, memory, keys=jnp.zeros((6, 6, 5)))


def test_errors_attention_memory_forms():
  attention = DotAttention()
  memory = _lod(MEMORY_LENGTHS, HIDDEN, MEMORY_BUCKETS)
  padded, lengths = memory.to_padded()
  with pytest.raises(ValueError, match=r"Got `lengths` with a LoDTensor `memory`"):
    attention(jnp.zeros((6, HIDDEN)), memory, lengths)
  with pytest.raises(
    ValueError, match=r"Expected `lengths` \[b\] \(real slots of each memory row\)"
  ):
    attention(jnp.zeros((6, HIDDEN)), padded)
  with pytest.raises(
    ValueError,
    match=r"Expected `memory` to have shape \[b, source_capacity, features\], got "
    r"\(6, 24\)\.",
  ):
    attention(jnp.zeros((6, HIDDEN)), padded.reshape(6, -1), lengths)
  with pytest.raises(
    ValueError,
    match=r"Expected one memory sequence per query row: `query` has 5 rows, "
    r"`memory` has 6 sequences \(count capacity\)\.",
  ):
    attention(jnp.zeros((5, HIDDEN)), memory)
  with pytest.raises(
    ValueError, match=r"Expected `query` to have shape \[b, hidden\], got \(6,\)\."
  ):
    attention(jnp.zeros((6,)), memory)


def test_errors_attention_decoder_memory_and_widths():
  decoder = _decoder("dot", False)
  wrong_capacity = _lod(
    MEMORY_LENGTHS, HIDDEN, Buckets.fixed(tokens=12, sequences=8, time=6)
  )
  with pytest.raises(
    ValueError,
    match=r"Expected `memory` to hold one sequence per `tgt` sequence: memory "
    r"count capacity 8, tgt count capacity 6\.",
  ):
    decoder(TGT, wrong_capacity)
  four = _lod(MEMORY_LENGTHS[:4], HIDDEN, MEMORY_BUCKETS)
  with pytest.raises(
    ValueError,
    match=r"memory has 4 sequences, tgt has 5\.",
  ):
    decoder(TGT, four)
  memory = _lod(MEMORY_LENGTHS, HIDDEN, MEMORY_BUCKETS)
  wide = _lod(
    [2, 3, 0, 4, 1], FEATURES + 1, Buckets.fixed(tokens=12, sequences=6, time=5)
  )
  with pytest.raises(
    ValueError,
    match=r"Expected `tgt` of width 3 \(the cell's `in_features`\), got 4\.",
  ):
    decoder(wide, memory)
  feeding = _decoder("dot", True)
  with pytest.raises(
    ValueError,
    match=r"Expected `tgt` of width 3 \(the cell's `in_features` 7 less the 4 "
    r"memory features fed back\), got 4\.",
  ):
    feeding(wide, memory)
  matrices = LoDTensor.from_lengths(
    np.zeros((11, 2, 2), np.float32), [MEMORY_LENGTHS], buckets=MEMORY_BUCKETS
  )
  with pytest.raises(
    ValueError,
    match=r"Expected a LoDTensor `memory` with one LoD level and values "
    r"\[src_tokens, features\], got 1 level\(s\) and values of shape \(16, 2, 2\)\.",
  ):
    decoder(TGT, matrices)
  with pytest.raises(
    TypeError, match=r"Expected `memory` to be a LoDTensor, got ArrayImpl\."
  ):
    decoder.initial_state(jnp.zeros((6, 6)), FEATURES)
  # Dot attention needs hidden == memory features.
  narrow = _lod(MEMORY_LENGTHS, 5, MEMORY_BUCKETS)
  with pytest.raises(ValueError, match=r"Expected `query` of width 5"):
    decoder(TGT, narrow)


def test_errors_attention_decoder_counts_under_jit():
  decoder = _decoder("dot", False)
  four = _lod(MEMORY_LENGTHS[:4], HIDDEN, MEMORY_BUCKETS)
  graphdef, state = nnx.split(decoder)

  @jax.jit
  @checkify.checkify
  def run(state, tgt, memory):
    return nnx.merge(graphdef, state)(tgt, memory).values

  err, _ = run(state, TGT, four)
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"Expected `memory` to hold one sequence per `tgt` sequence: memory has "
    r"4 sequences, tgt has 5\.",
  ):
    err.throw()


def test_initial_state_of_a_cell_without_in_features():
  decoder = AttentionDecoder(
    PairCell(FEATURES, HIDDEN, rngs=nnx.Rngs(0)), DotAttention()
  )
  memory = _lod(MEMORY_LENGTHS, HIDDEN, MEMORY_BUCKETS)
  carry = decoder.initial_state(memory, input_features=FEATURES)
  assert carry["h"].shape == (6, HIDDEN)
  assert decoder(TGT, memory).values.shape == (12, 2 * HIDDEN)


def test_errors_layers_that_take_arrays_or_are_linen():
  """The twin of tests/nn/test_rnn.py's: a layer over LoDTensors is never one
  of Flax's layers over arrays, nor a Linen module."""
  rngs = nnx.Rngs(0)
  gru = lambda: DynamicRNN(nnx.GRUCell(FEATURES, HIDDEN, rngs=rngs))  # noqa: E731
  linear = nnx.Linear(FEATURES, FEATURES, rngs=rngs)
  array_layer = (
    r"got Flax's {}, which takes arrays \(a recurrent cell goes in a DynamicRNN\)"
  )
  cases = [
    (lambda: StackedRNN([linear]), "layers[0]", "Linear"),
    (
      lambda: StackedRNN([gru(), nnx.GRUCell(HIDDEN, HIDDEN, rngs=rngs)]),
      "layers[1]",
      "GRUCell",
    ),
    (lambda: HierarchicalEncoder(linear, gru()), "inner", "Linear"),
    (lambda: HierarchicalEncoder(gru(), linear), "outer", "Linear"),
    (lambda: Bidirectional(gru(), linear), "backward_rnn", "Linear"),
  ]
  for build, name, given in cases:
    with pytest.raises(
      TypeError,
      match=rf"`{re.escape(name)}` to be a jaxlod RNN layer .*"
      + array_layer.format(given),
    ):
      build()
  with pytest.raises(
    TypeError,
    match=r"Expected `layers\[0\]` to be an NNX module \(a jaxlod.nn.nnx layer\), got "
    r"the Linen module DynamicRNN\.",
  ):
    StackedRNN([linen.DynamicRNN(nn.GRUCell(HIDDEN))])


def test_errors_seq2seq_decoder_must_be_an_attention_decoder():
  rngs = nnx.Rngs(0)
  with pytest.raises(
    TypeError, match=r"Expected `decoder` to be an AttentionDecoder, got DynamicRNN\."
  ):
    Seq2Seq(
      src_vocab=8,
      tgt_vocab=9,
      embed_dim=5,
      encoder=DynamicRNN(nnx.LSTMCell(5, 4, rngs=rngs)),
      decoder=DynamicRNN(nnx.LSTMCell(5, 4, rngs=rngs)),
      features=4,
      rngs=rngs,
    )


def test_errors_seq2seq_decoder_cell_needs_its_width():
  """The output layer's width comes from the decoder cell's `hidden_features`:
  a cell of yours without it is named, not a bare AttributeError."""

  class Wrapped(nnx.Module):  # a cell without `hidden_features`
    def __init__(self, cell):
      self.cell = cell

    def __call__(self, carry, x):
      return self.cell(carry, x)

    def initialize_carry(self, shape, rngs=None):
      return self.cell.initialize_carry(shape, rngs)

  rngs = nnx.Rngs(0)
  with pytest.raises(
    TypeError,
    match=r"`decoder.cell` to have an int `hidden_features` .* got Wrapped with None\.",
  ):
    Seq2Seq(
      src_vocab=8,
      tgt_vocab=9,
      embed_dim=5,
      encoder=DynamicRNN(nnx.LSTMCell(5, 4, rngs=rngs)),
      decoder=AttentionDecoder(Wrapped(nnx.LSTMCell(5, 4, rngs=rngs)), DotAttention()),
      features=4,
      rngs=rngs,
    )


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"param_dtype": jnp.int32}, r"`param_dtype` to be a float dtype, got int32\."),
    ({"dtype": jnp.int8}, r"`dtype` to be a float dtype, got int8\."),
  ],
)
def test_errors_layer_dtypes_must_be_float(kwargs, match):
  rngs = nnx.Rngs(0)
  with pytest.raises(TypeError, match=match):
    GeneralAttention(HIDDEN, FEATURES, rngs=rngs, **kwargs)
  with pytest.raises(TypeError, match=match):
    AdditiveAttention(HIDDEN, FEATURES, UNITS, rngs=rngs, **kwargs)
