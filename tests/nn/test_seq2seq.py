"""AttentionDecoder and Seq2Seq against padded references with the same weights."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxlod import Buckets, LoDTensor
from jaxlod.nn import (
  AdditiveAttention,
  AttentionDecoder,
  DotAttention,
  DynamicRNN,
  GeneralAttention,
  Seq2Seq,
)
from jaxlod.ops import Memory, rank_table
from tests.helpers import assert_close

HIDDEN, FEATURES, INPUTS, UNITS = 4, 4, 3, 5
SRC_VOCAB, TGT_VOCAB, EMBED = 7, 6, 3
# Decoder batches: an empty source (zero context), an empty target and one
# padding sequence. Count capacity 7 gives the ladder (7, 4): step 0 runs at
# batch 7 (5 targets are active), the later steps at batch 4, so the memory
# is shrunk to the phase.
SRC_LENGTHS = [3, 0, 5, 2, 1, 4]
TGT_LENGTHS = [2, 4, 0, 3, 1, 5]
SRC_BUCKETS = Buckets.fixed(tokens=16, sequences=7, time=6)
TGT_BUCKETS = Buckets.fixed(tokens=16, sequences=7, time=5)
COUNT = 7
# Seq2Seq batches: one phase (a smaller program to compile, twice: encoder and
# decoder), still with an empty source and an empty target.
S2S_SRC_LENGTHS = [3, 0, 5, 2]
S2S_TGT_LENGTHS = [2, 4, 0, 3]
S2S_SRC_BUCKETS = Buckets.fixed(tokens=12, sequences=4, time=6)
S2S_TGT_BUCKETS = Buckets.fixed(tokens=10, sequences=4, time=5)

CELLS = {"lstm": lambda: nn.LSTMCell(HIDDEN), "gru": lambda: nn.GRUCell(HIDDEN)}
ATTENTIONS = {
  "dot": DotAttention,
  "general": GeneralAttention,
  "additive": lambda: AdditiveAttention(UNITS),
}


def _lod(lengths, width, buckets, seed):
  rng = np.random.default_rng(seed)
  seqs = [rng.normal(size=(n, width)).astype(np.float32) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=buckets, dtype=np.float32)


def _ids(lengths, vocab, buckets, seed):
  rng = np.random.default_rng(seed)
  seqs = [rng.integers(0, vocab, size=n).astype(np.int32) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=buckets, dtype=np.int32)


# -- the padded reference: a masked lax.scan over the target ----------------------


def reference_attend(kind, params, h, memory, lengths):
  """Dot, general or additive attention on a padded batch (masked with a large
  negative score)."""
  if kind == "dot":
    scores = jnp.einsum("bh,bsh->bs", h, memory)
  elif kind == "general":
    scores = jnp.einsum("bf,bsf->bs", h @ params["query"]["kernel"], memory)
  else:
    query = h @ params["query"]["kernel"] + params["query"]["bias"]
    hidden = jnp.tanh(memory @ params["key"]["kernel"] + query[:, None, :])
    scores = (hidden @ params["energy"]["kernel"])[..., 0]
  real = jnp.arange(memory.shape[1])[None, :] < lengths[:, None]
  weights = jax.nn.softmax(jnp.where(real, scores, -1e30), axis=-1)
  weights = jnp.where(real, weights, 0.0)
  return jnp.einsum("bs,bsf->bf", weights, memory), weights


def reference_decode(cell, kind, input_feeding, params, tgt, memory, carry):
  """``(outputs [b, T, hidden + F], weights [b, T, S])``, zeros past each end.

  `tgt` and `memory` are ``(padded, lengths)`` pairs; `carry` the cell carry.
  """
  x, x_lengths = tgt
  memory, memory_lengths = memory
  if input_feeding:
    carry = (carry, jnp.zeros((x.shape[0], memory.shape[-1])))

  def body(carry, inputs):
    x_t, t = inputs
    cell_carry, context = carry if input_feeding else (carry, None)
    if input_feeding:
      x_t = jnp.concatenate([x_t, context], -1)
    new_cell, h = cell.apply({"params": params["cell"]}, cell_carry, x_t)
    context, weights = reference_attend(
      kind, params.get("attention"), h, memory, memory_lengths
    )
    new = (new_cell, context) if input_feeding else new_cell
    active = t < x_lengths
    new = jax.tree.map(
      lambda a, b: jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
      new,
      carry,
    )
    y = jnp.concatenate([h, context], -1)
    return new, (y * active[:, None], weights * active[:, None])

  steps = jnp.arange(x.shape[1])
  _, (ys, ws) = jax.lax.scan(body, carry, (jnp.swapaxes(x, 0, 1), steps))
  return jnp.swapaxes(ys, 0, 1), jnp.swapaxes(ws, 0, 1)


def _loss_terms(ys, ws):
  scale = 1 + jnp.arange(ys.size).reshape(ys.shape) % 3
  return jnp.sum(jnp.sin(ys) * scale) + jnp.sum(ws * jnp.arange(ws.shape[-1]))


# -- AttentionDecoder ---------------------------------------------------------------

DECODER_CASES = {
  # name: (cell, attention, input_feeding, remat)
  "lstm-dot": ("lstm", "dot", False, True),
  "lstm-additive-feeding": ("lstm", "additive", True, True),
  "gru-general-feeding-no-remat": ("gru", "general", True, False),
}


@functools.cache
def _decoder_setup(name):
  """The decoder of a case, its parameters (jitted init) and its inputs."""
  cell, kind, input_feeding, remat = DECODER_CASES[name]
  decoder = AttentionDecoder(
    CELLS[cell](), ATTENTIONS[kind](), input_feeding=input_feeding, remat=remat
  )
  tgt = _lod(TGT_LENGTHS, INPUTS, TGT_BUCKETS, seed=1)
  memory = _lod(SRC_LENGTHS, FEATURES, SRC_BUCKETS, seed=2)
  params = jax.jit(decoder.init)(jax.random.key(0), tgt, memory)
  return decoder, params, tgt, memory


@pytest.mark.parametrize("name", sorted(DECODER_CASES))
def test_decoder_matches_padded_reference(name):
  decoder, params, tgt, memory = _decoder_setup(name)
  cell, kind, input_feeding, _ = DECODER_CASES[name]
  count = tgt.capacity.sequences[0]

  def loss(params, tgt_values, memory_values):
    ys, ws = decoder.apply(
      params,
      tgt.with_values(tgt_values),
      memory.with_values(memory_values),
      return_weights=True,
    )
    ys, ws = ys.to_padded()[0], ws.to_padded()[0]
    return _loss_terms(ys, ws), (ys, ws)

  def reference_loss(params, tgt_values, memory_values):
    carry = CELLS[cell]().initialize_carry(jax.random.key(0), (count, INPUTS))
    ys, ws = reference_decode(
      CELLS[cell](),
      kind,
      input_feeding,
      params["params"],
      tgt.with_values(tgt_values).to_padded(),
      memory.with_values(memory_values).to_padded(),
      carry,
    )
    return _loss_terms(ys, ws), (ys, ws)

  args = (params, tgt.values, memory.values)
  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  ref_grad = jax.value_and_grad(reference_loss, argnums=(0, 1, 2), has_aux=True)
  (value, (ys, ws)), grads = jax.jit(grad)(*args)
  (ref_value, (ref_ys, ref_ws)), ref_grads = jax.jit(ref_grad)(*args)
  assert ys.shape == (count, TGT_BUCKETS.capacity(5, "time"), HIDDEN + FEATURES)
  assert_close(ys, ref_ys, rtol=1e-5, atol=1e-5)
  assert_close(ws, ref_ws, rtol=1e-5, atol=1e-5)
  assert_close(value, ref_value, rtol=1e-5, atol=1e-5)
  # Gradients sum over the steps: float32 round-off.
  assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
  for leaf in jax.tree.leaves(grads):
    assert np.all(np.isfinite(np.asarray(leaf)))
  # The empty source gets a zero context and zero weights.
  empty = np.asarray(memory.lengths()) == 0
  assert np.all(np.asarray(ys)[empty, :, HIDDEN:] == 0.0)
  assert np.all(np.asarray(ws)[empty] == 0.0)


def test_decoder_step_is_one_step_of_the_loop():
  decoder, params, tgt, memory = _decoder_setup("lstm-additive-feeding")
  apply = jax.jit(functools.partial(decoder.apply, return_weights=True))
  outputs, weights = apply(params, tgt, memory)
  carry = decoder.apply(params, memory, INPUTS, method="initial_state")
  padded = decoder.apply(params, memory, method="precompute")
  assert padded.keys.shape == (*padded.values.shape[:2], UNITS)
  x0 = tgt.to_padded()[0][:, 0]
  _, y, w = decoder.apply(params, carry, x0, padded, method="step")
  started = np.asarray(tgt.lengths()) > 0
  assert_close(
    np.asarray(y)[started], np.asarray(outputs.to_padded()[0][:, 0])[started]
  )
  assert_close(
    np.asarray(w)[started], np.asarray(weights.to_padded()[0][:, 0])[started]
  )
  # Without input feeding or keys: the plain cell carry and `None`.
  plain, plain_params, _, _ = _decoder_setup("lstm-dot")
  carry = plain.apply(plain_params, memory, INPUTS, method="initial_state")
  assert jax.tree.map(np.shape, carry) == ((COUNT, HIDDEN), (COUNT, HIDDEN))
  assert plain.apply(plain_params, memory, method="precompute").keys is None


def test_decoder_without_jit_and_parameter_tree():
  decoder, params, tgt, memory = _decoder_setup("lstm-dot")
  eager = decoder.apply(params, tgt, memory)
  carry = nn.LSTMCell(HIDDEN).initialize_carry(jax.random.key(0), (COUNT, INPUTS))
  reference, _ = reference_decode(
    nn.LSTMCell(HIDDEN),
    "dot",
    False,
    params["params"],
    tgt.to_padded(),
    memory.to_padded(),
    carry,
  )
  assert eager.recursive_lengths() == [TGT_LENGTHS]
  assert_close(eager.to_padded()[0], reference, rtol=1e-5, atol=1e-5)
  # The cell's parameters have the tree of `flax.linen.RNN(cell)`.
  rnn = nn.RNN(nn.LSTMCell(HIDDEN))
  rnn_params = jax.eval_shape(rnn.init, jax.random.key(0), jnp.zeros((1, 2, INPUTS)))
  assert jax.tree.map(np.shape, params["params"]["cell"]) == jax.tree.map(
    np.shape, rnn_params["params"]["cell"]
  )


def test_decoder_ladder_and_table_reach_the_loop():
  """`ladder` and a host-built target `table` set the phases, change nothing."""
  decoder, params, tgt, memory = _decoder_setup("lstm-dot")
  ladder = (7, 3, 1)
  table = rank_table(tgt, ladder=ladder)
  assert len(rank_table(tgt).ladder) != len(ladder)
  want = jax.jit(decoder.apply)(params, tgt, memory)
  for module, table_arg in (
    (decoder.clone(ladder=ladder), None),
    (decoder.clone(ladder=ladder), table),
    (decoder, table),  # The table's own ladder.
  ):

    def f(params, tgt, memory, table, module=module):
      return module.apply(params, tgt, memory, table=table)

    jaxpr = str(jax.make_jaxpr(f)(params, tgt, memory, table_arg))
    assert jaxpr.count("while[") == len(ladder)
    got = jax.jit(f)(params, tgt, memory, table_arg)
    assert_close(got.values, want.values, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r"Got both `table` \(ladder \(7, 3, 1\)\)"):
    decoder.clone(ladder=(7, 2)).apply(params, tgt, memory, table=table)
  with pytest.raises(ValueError, match="The rank table does not describe `inputs`"):
    decoder.apply(params, tgt, memory, table=rank_table(memory))


# -- Seq2Seq ----------------------------------------------------------------------


def _seq2seq(bridge=True, kind="additive", input_feeding=True, hidden=HIDDEN, **kw):
  return Seq2Seq(
    src_vocab=SRC_VOCAB,
    tgt_vocab=TGT_VOCAB,
    embed_dim=EMBED,
    encoder=DynamicRNN(nn.LSTMCell(HIDDEN)),
    decoder=AttentionDecoder(
      nn.LSTMCell(hidden), ATTENTIONS[kind](), input_feeding=input_feeding
    ),
    bridge=bridge,
    **kw,
  )


def _seq2seq_batch():
  src = _ids(S2S_SRC_LENGTHS, SRC_VOCAB, S2S_SRC_BUCKETS, seed=3)
  tgt_in = _ids(S2S_TGT_LENGTHS, TGT_VOCAB, S2S_TGT_BUCKETS, seed=4)
  tgt_out = _ids(S2S_TGT_LENGTHS, TGT_VOCAB, S2S_TGT_BUCKETS, seed=5)
  return src, tgt_in, tgt_out


@functools.cache
def _seq2seq_params(bridge=True):
  """Parameters of `_seq2seq(bridge)`: one jitted init; the model without the
  bridge takes the same ones less ``carry_bridge``."""
  if not bridge:
    params = _seq2seq_params()["params"]
    return {"params": {k: v for k, v in params.items() if k != "carry_bridge"}}
  src, tgt_in, _ = _seq2seq_batch()
  return jax.jit(_seq2seq().init)(jax.random.key(0), src, tgt_in)


def reference_logits(params, src, tgt_in, kind, input_feeding, bridge):
  """The padded model: `flax.linen.RNN` encoder, scan decoder, same weights."""
  p = params["params"]
  src_ids, src_lengths = src.to_padded()
  embedded = p["src_embed"]["embedding"][src_ids]
  encoder = nn.RNN(nn.LSTMCell(HIDDEN))
  memory = encoder.apply({"params": p["encoder"]}, embedded, seq_lengths=src_lengths)
  real = jnp.arange(memory.shape[1])[None, :] < src_lengths[:, None]
  memory = jnp.where(real[..., None], memory, 0.0)
  count = memory.shape[0]
  if bridge:
    pooled = memory.sum(1) / jnp.maximum(src_lengths, 1)[:, None]
    leaf = p["carry_bridge"]
    carry = tuple(
      jnp.tanh(pooled @ leaf[f"leaf_{i}"]["kernel"] + leaf[f"leaf_{i}"]["bias"])
      for i in range(2)
    )
  else:
    carry = (jnp.zeros((count, HIDDEN)),) * 2
  tgt_ids, tgt_lengths = tgt_in.to_padded()
  x = p["tgt_embed"]["embedding"][tgt_ids]
  ys, _ = reference_decode(
    nn.LSTMCell(HIDDEN),
    kind,
    input_feeding,
    p["decoder"],
    (x, tgt_lengths),
    (memory, src_lengths),
    carry,
  )
  return ys @ p["output"]["kernel"] + p["output"]["bias"], tgt_lengths


def _cross_entropy(logits, labels, real):
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(real, nll, 0.0)) / jnp.maximum(jnp.sum(real), 1)


@pytest.mark.parametrize(
  ("bridge", "use_jit"), [(True, True), (False, False)], ids=["bridge", "no-bridge"]
)
def test_seq2seq_loss_gradients_match_padded_model(bridge, use_jit):
  model = _seq2seq(bridge)
  params = _seq2seq_params(bridge)
  src, tgt_in, tgt_out = _seq2seq_batch()

  def loss(params):
    logits = model.apply(params, src, tgt_in)
    real = jnp.arange(logits.capacity.tokens) < logits.num_rows
    return _cross_entropy(logits.values, tgt_out.values, real), logits

  def reference_loss(params):
    logits, lengths = reference_logits(params, src, tgt_in, "additive", True, bridge)
    real = jnp.arange(logits.shape[1])[None, :] < lengths[:, None]
    loss = _cross_entropy(logits, tgt_out.to_padded()[0], real)
    return loss, jnp.where(real[..., None], logits, 0.0)

  grad = jax.value_and_grad(loss, has_aux=True)
  (value, logits), grads = (jax.jit(grad) if use_jit else grad)(params)
  (ref_value, ref_logits), ref_grads = jax.jit(
    jax.value_and_grad(reference_loss, has_aux=True)
  )(params)
  assert logits.recursive_lengths() == [S2S_TGT_LENGTHS]
  assert logits.values.shape == (S2S_TGT_BUCKETS.capacity(9, "tokens"), TGT_VOCAB)
  assert np.all(np.asarray(logits.values)[int(logits.num_rows) :] == 0.0)
  assert_close(logits.to_padded()[0], ref_logits, rtol=1e-5, atol=1e-5)
  assert_close(value, ref_value, rtol=1e-5, atol=1e-6)
  names = {"src_embed", "tgt_embed", "encoder", "decoder", "output"}
  assert set(grads["params"]) == names | ({"carry_bridge"} if bridge else set())
  assert_close(grads, ref_grads, rtol=1e-4, atol=1e-6)


def _apply_capturing(model, params, src, tgt_in, rng=None):
  """Jitted logits, and the rows entering and leaving the decoder and entering
  the output layer (`nn.intercept_methods`); `rng` the dropout key."""

  def run(params, src, tgt_in, rng):
    seen = {}

    def interceptor(next_fun, args, call_kwargs, context):
      out = next_fun(*args, **call_kwargs)
      if context.method_name == "__call__":
        if isinstance(context.module, AttentionDecoder):
          seen["decoder_in"], seen["decoder_out"] = args[0].values, out.values
        elif context.module.name == "output":
          seen["output_in"] = args[0]
      return out

    rngs = None if rng is None else {"dropout": rng}
    with nn.intercept_methods(interceptor):
      logits = model.apply(params, src, tgt_in, rngs=rngs)
    return logits, seen

  logits, seen = jax.jit(run)(params, src, tgt_in, rng)
  return logits, {k: np.asarray(v) for k, v in seen.items()}


def _assert_dropped(got, want, rate):
  """Each entry of `got` is 0 or ``want / (1 - rate)``, about `rate` of them 0."""
  kept = got != 0
  np.testing.assert_allclose(got[kept], want[kept] / (1 - rate), rtol=1e-5)
  assert 0.25 < 1 - kept.mean() < 0.75, 1 - kept.mean()


def test_seq2seq_tables_reach_the_encoder_and_the_decoder():
  """Host-built rank tables set both loops' phases and change nothing."""
  model, params = _seq2seq(), _seq2seq_params()
  src, tgt_in, _ = _seq2seq_batch()
  want = jax.jit(model.apply)(params, src, tgt_in)
  src_table = rank_table(src, ladder=(4, 2, 1))
  tgt_table = rank_table(tgt_in, ladder=(4, 1))
  assert rank_table(src).ladder == rank_table(tgt_in).ladder == (4,)

  def f(params, src, tgt_in, src_table, tgt_table):
    return model.apply(params, src, tgt_in, src_table=src_table, tgt_table=tgt_table)

  for tables, loops in (
    ((src_table, tgt_table), 3 + 2),
    ((src_table, None), 3 + 1),
    ((None, tgt_table), 1 + 2),
  ):
    jaxpr = str(jax.make_jaxpr(f)(params, src, tgt_in, *tables))
    assert jaxpr.count("while[") == loops
    got = jax.jit(f)(params, src, tgt_in, *tables)
    assert_close(got.values, want.values, rtol=1e-6, atol=1e-6)
  memory = model.apply(params, src, src_table, method="encode")
  assert_close(memory.values, model.apply(params, src, method="encode").values)
  # Tables of other lengths, at the same capacities.
  other_src = rank_table(_ids([1, 2, 3, 4], SRC_VOCAB, S2S_SRC_BUCKETS, seed=0))
  other_tgt = rank_table(_ids([1, 1, 1, 1], TGT_VOCAB, S2S_TGT_BUCKETS, seed=0))
  for tables in ({"src_table": other_src}, {"tgt_table": other_tgt}):
    with pytest.raises(ValueError, match="The rank table does not describe `inputs`"):
      model.apply(params, src, tgt_in, **tables)
  with pytest.raises(ValueError, match="time capacity 5 to be at least the time"):
    model.apply(params, src, tgt_in, src_table=tgt_table)


def test_seq2seq_dropout_on_target_embeddings_and_decoder_outputs():
  params = _seq2seq_params()
  src, tgt_in, _ = _seq2seq_batch()
  rows = int(tgt_in.num_rows)
  plain, clean = _apply_capturing(_seq2seq(), params, src, tgt_in)
  # Deterministic (the default): no rng needed, the same logits.
  same, _ = _apply_capturing(_seq2seq(dropout=0.5), params, src, tgt_in)
  np.testing.assert_array_equal(same.values, plain.values)

  model = _seq2seq(dropout=0.5, deterministic=False)
  logits, seen = _apply_capturing(model, params, src, tgt_in, jax.random.key(3))
  _assert_dropped(seen["decoder_in"][:rows], clean["decoder_in"][:rows], 0.5)
  _assert_dropped(seen["output_in"][:rows], seen["decoder_out"][:rows], 0.5)
  for name in ("decoder_in", "output_in"):
    assert np.all(seen[name][rows:] == 0), name
  assert np.all(np.asarray(logits.values)[rows:] == 0.0)
  assert not np.allclose(logits.values[:rows], plain.values[:rows])
  # Decoding never drops: the decode step (all `generate` runs) needs no rng
  # and gives the dropout-free logits.
  rng = np.random.default_rng(0)
  values = rng.normal(size=(4, 6, HIDDEN)).astype(np.float32)
  keys = rng.normal(size=(4, 6, UNITS)).astype(np.float32)
  memory = Memory(values, np.array([3, 0, 5, 2]), keys)
  carry = (np.ones((4, HIDDEN), np.float32),) * 2, np.ones((4, HIDDEN), np.float32)
  args = (carry, np.array([0, 2, 3, 5]), memory)
  steps = [m.apply(params, *args, method="decode_step") for m in (model, _seq2seq())]
  np.testing.assert_array_equal(steps[0][1], steps[1][1])


@pytest.mark.parametrize("rate", [-0.1, 1.0])
def test_seq2seq_dropout_must_be_a_rate(rate):
  src, tgt_in, _ = _seq2seq_batch()
  with pytest.raises(ValueError, match=rf"Expected `dropout` in \[0, 1\), got {rate}"):
    _seq2seq(dropout=rate).init(jax.random.key(0), src, tgt_in)


def _jit_method(model, method):
  return jax.jit(functools.partial(model.apply, method=method))


def test_seq2seq_decode_step_path():
  """encode -> initial_state -> precompute -> decode_step gives the first
  teacher-forced logits; ids may also come as ``[tokens, 1]``."""
  model, params = _seq2seq(), _seq2seq_params()
  src, tgt_in, _ = _seq2seq_batch()
  column = tgt_in.with_values(tgt_in.values[:, None])
  logits = jax.jit(model.apply)(params, src, column)
  memory = _jit_method(model, "encode")(params, src)
  assert memory.recursive_lengths() == [S2S_SRC_LENGTHS]
  carry = model.apply(params, memory, method="initial_state")
  padded = model.apply(params, memory, method="precompute")
  tokens = tgt_in.to_padded()[0][:, 0]
  _, first, weights = model.apply(params, carry, tokens, padded, method="decode_step")
  started = np.asarray(tgt_in.lengths()) > 0
  assert first.shape == (4, TGT_VOCAB) and weights.shape == (4, 6)
  assert_close(
    np.asarray(first)[started], np.asarray(logits.to_padded()[0][:, 0])[started]
  )

  # With `return_weights`: the same logits, and each step's attention weights
  # (the first equal to the step's), a distribution over the real source rows.
  with_weights, all_weights = jax.jit(
    functools.partial(model.apply, return_weights=True)
  )(params, src, tgt_in)
  assert_close(with_weights.values, logits.values)
  assert all_weights.recursive_lengths() == [S2S_TGT_LENGTHS]
  padded_weights = np.asarray(all_weights.to_padded()[0])
  assert padded_weights.shape[2] == 6
  assert_close(padded_weights[started, 0], np.asarray(weights)[started])
  pairs = zip(S2S_SRC_LENGTHS, S2S_TGT_LENGTHS, strict=True)
  for i, (n_src, n_tgt) in enumerate(pairs):
    rows = padded_weights[i, :n_tgt]
    assert np.all(rows[:, n_src:] == 0.0)
    if n_src:
      assert_close(rows.sum(axis=1), np.ones(n_tgt), rtol=1e-5, atol=1e-6)


# -- bad input ---------------------------------------------------------------------


def test_decoder_memory_count_errors():
  decoder, params, tgt, memory = _decoder_setup("lstm-dot")
  other = _lod([2, 2], FEATURES, Buckets.fixed(tokens=12, sequences=8, time=6), 0)
  with pytest.raises(
    ValueError,
    match=r"one sequence per `tgt` sequence: memory count capacity 8, tgt count "
    r"capacity 7",
  ):
    jax.jit(decoder.apply)(params, tgt, other)
  fewer = _lod([2, 2, 1], FEATURES, SRC_BUCKETS, seed=0)
  with pytest.raises(ValueError, match=r"memory has 3 sequences, tgt has 6\."):
    decoder.apply(params, tgt, fewer)
  # Under jit the real counts go through checkify.
  checked = checkify.checkify(jax.jit(decoder.apply))
  err, _ = checked(params, tgt, fewer)
  with pytest.raises(
    checkify.JaxRuntimeError, match=r"memory has 3 sequences, tgt has 6\."
  ):
    err.throw()


@pytest.mark.parametrize(
  ("case", "error", "match"),
  [
    ("memory_array", TypeError, r"Expected `memory` to be a LoDTensor, got ndarray"),
    ("memory_levels", ValueError, r"one LoD level and values \[src_tokens, features"),
    ("tgt_rows", ValueError, r"`tgt.values` to have shape \[token_capacity, input_fe"),
  ],
)
def test_decoder_input_errors(case, error, match):
  decoder, params, tgt, memory = _decoder_setup("lstm-dot")
  if case == "memory_array":
    memory = np.asarray(memory.values)
  elif case == "memory_levels":
    memory = LoDTensor.from_lengths(
      np.ones((3, FEATURES), np.float32),
      [[1, 1, 1, 1], [1, 1, 1, 0]],
      buckets=Buckets.fixed(tokens=3, sequences=(5, 7), time=(2, 2)),
    )
  else:
    tgt = tgt.with_values(tgt.values[..., None])
  with pytest.raises(error, match=match):
    decoder.apply(params, tgt, memory)


def test_seq2seq_width_error_at_trace_time():
  model = _seq2seq(kind="dot", hidden=HIDDEN + 2)
  src, tgt_in, _ = _seq2seq_batch()
  with pytest.raises(
    ValueError,
    match=rf"Expected `query` of width {HIDDEN} \(memory features\), got "
    rf"{HIDDEN + 2}\.",
  ):
    jax.eval_shape(model.init, jax.random.key(0), src, tgt_in)


@pytest.mark.parametrize(
  ("case", "error", "match"),
  [
    ("float_ids", TypeError, r"`src.values` to have an integer dtype, got float32"),
    (
      "wide_ids",
      ValueError,
      r"`tgt_in.values` to have shape \[tokens\] or \[tokens, 1",
    ),
    ("not_lod", TypeError, r"Expected `src` to be a LoDTensor, got ndarray"),
    ("step_tokens", ValueError, r"Expected `tokens` to have shape \[b\], got \(4, 1\)"),
  ],
)
def test_seq2seq_input_errors(case, error, match):
  model, params = _seq2seq(), _seq2seq_params()
  src, tgt_in, _ = _seq2seq_batch()
  if case == "step_tokens":
    memory = Memory(np.zeros((4, 6, HIDDEN), np.float32), np.zeros(4, np.int32))
    carry = (np.zeros((4, HIDDEN), np.float32),) * 2, np.zeros((4, HIDDEN))
    args = (carry, np.zeros((4, 1), np.int32), memory)
    with pytest.raises(error, match=match):
      model.apply(params, *args, method="decode_step")
    return
  if case == "float_ids":
    src = src.with_values(src.values.astype(np.float32))
  elif case == "wide_ids":
    tgt_in = tgt_in.with_values(jnp.stack([tgt_in.values] * 2, axis=-1))
  else:
    src = np.asarray(src.values)
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda params: model.apply(params, src, tgt_in), params)


class _PackedEncoder(nn.Module):
  """An encoder that wrongly returns the packed rows instead of a LoDTensor."""

  def __call__(self, x):
    return x.values


def test_seq2seq_encoder_must_return_a_lod_tensor():
  model = _seq2seq().clone(encoder=_PackedEncoder())
  src, tgt_in, _ = _seq2seq_batch()
  with pytest.raises(TypeError, match=r"`encoder` to return a LoDTensor, got Array"):
    model.init(jax.random.key(0), src, tgt_in)


def test_seq2seq_decoder_must_be_an_attention_decoder():
  src = LoDTensor.from_sequences([np.array([3, 1])])
  tgt = LoDTensor.from_sequences([np.array([0, 2])])
  model = Seq2Seq(
    src_vocab=8,
    tgt_vocab=9,
    embed_dim=5,
    encoder=DynamicRNN(nn.LSTMCell(4)),
    decoder=DynamicRNN(nn.LSTMCell(4)),
  )
  with pytest.raises(
    TypeError, match=r"Expected `decoder` to be an AttentionDecoder, got DynamicRNN\."
  ):
    model.init(jax.random.key(0), src, tgt)
