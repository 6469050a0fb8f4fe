"""The Transformer layers (Linen and NNX): `MultiHeadAttention` equals Flax's
``MultiHeadDotProductAttention`` on each sequence alone (float64; self,
cross, causal), the twins agree on copied parameters, no sequence reaches
another, padding rows stay zero, the errors, a `Seq2Seq` with a
`TransformerEncoder` (a training step, beam search, `generate_corpus`,
`jax.export`), and one compile per capacity."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import export

import jaxlod.nn as linen
import jaxlod.nn.nnx as twin
from jaxlod import Buckets, LoDTensor, unchecked
from jaxlod.ops import DecodeSettings, sequence_cross_entropy
from jaxlod.testing import check_independent
from tests.helpers import assert_close

FEATURES, KV_FEATURES, HEADS, QKV, OUT, MLP = 6, 5, 2, 4, 3, 8
BUCKETS = Buckets.fixed(tokens=16, sequences=4, time=6)
LENGTHS = [4, 0, 5, 2]  # an empty sequence, and 5 padding rows
KEY_LENGTHS = [3, 2, 1, 6]
# float64 against Flax: the same products in another order.
F64 = {"rtol": 1e-12, "atol": 1e-12}


@pytest.fixture
def float64():
  with jax.enable_x64(True):
    yield


def _lod(lengths, features, seed, dtype=np.float32, buckets=BUCKETS) -> LoDTensor:
  rng = np.random.default_rng(seed)
  seqs = [rng.normal(size=(n, features)) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=buckets, dtype=dtype)


def _perturbed(variables):
  """Non-zero biases and scales of every kind, so that placements show."""
  return jax.tree.map(
    lambda a: a + 0.1 * jnp.cos(jnp.arange(a.size).reshape(a.shape)).astype(a.dtype),
    variables,
  )


def _copy(params, module: nnx.Module) -> None:
  """Sets `module`'s parameters to the Linen `params`, every one used once
  (an NNX path ``("layers", 0, ...)`` is Linen's ``("layers_0", ...)``)."""
  flat = {
    tuple(k.key for k in path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }
  state = nnx.state(module, nnx.Param)
  variables = nnx.to_flat_state(state)
  assert len(variables) == len(flat), (sorted(flat), [p for p, _ in variables])
  for path, variable in variables:
    key: list[str] = []
    for part in path:
      if isinstance(part, int):
        key[-1] = f"{key[-1]}_{part}"
      else:
        key.append(part)
    assert variable.shape == flat[tuple(key)].shape, path
    variable[...] = flat[tuple(key)]
  nnx.update(module, state)


def _pair(name, cross=False, **common):
  """A Linen layer (``"attention"``, ``"layer"`` or ``"encoder"``) and its
  NNX twin with the same settings (`cross`: keys of another width)."""
  kv = {"in_kv_features": KV_FEATURES} if cross else {}
  rngs = nnx.Rngs(0)
  if name == "attention":
    return (
      linen.MultiHeadAttention(HEADS, QKV, OUT, **common),
      twin.MultiHeadAttention(HEADS, FEATURES, QKV, OUT, **kv, **common, rngs=rngs),
    )
  if name == "layer":
    return (
      linen.TransformerEncoderLayer(HEADS, MLP, **common),
      twin.TransformerEncoderLayer(HEADS, FEATURES, MLP, **common, rngs=rngs),
    )
  return (
    linen.TransformerEncoder(2, HEADS, MLP, **common),
    twin.TransformerEncoder(2, HEADS, FEATURES, MLP, **common, rngs=rngs),
  )


# -- (a) Flax's attention on each sequence alone ---------------------------------------


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_attention_equals_flax_on_each_sequence_alone(api, kind, causal):
  x = _lod(LENGTHS, FEATURES, 0, np.float64)
  keys = _lod(KEY_LENGTHS, KV_FEATURES, 1, np.float64) if kind == "cross" else None
  values = _lod(KEY_LENGTHS, KV_FEATURES, 2, np.float64) if kind == "cross" else None
  settings = {"param_dtype": jnp.float64, "cross": kind == "cross"}
  module, ours = _pair("attention", causal=causal, **settings)
  params = _perturbed(module.init(jax.random.key(0), x, keys, values))
  if api == "linen":
    y = jax.jit(module.apply)(params, x, keys, values)
  else:
    _copy(params["params"], ours)
    y = nnx.jit(lambda m, x, k, v: m(x, k, v))(ours, x, keys, values)
  flax_attention = nn.MultiHeadDotProductAttention(
    HEADS, qkv_features=QKV, out_features=OUT, param_dtype=jnp.float64
  )
  queries = x.to_list()
  keys = queries if keys is None else keys.to_list()
  values = keys if values is None else values.to_list()
  for i, (q, k, v) in enumerate(zip(queries, keys, values, strict=True)):
    if not len(q):
      continue
    mask = None
    if causal:
      steps = (jnp.arange(len(q))[None], jnp.arange(len(k))[None])
      mask = nn.make_attention_mask(*steps, jnp.greater_equal)
    want = flax_attention.apply(params, q[None], k[None], v[None], mask=mask)[0]
    assert_close(y.to_list()[i], want, **F64)
  assert y.recursive_lengths() == [LENGTHS]
  assert not np.asarray(y.values)[sum(LENGTHS) :].any()


def test_a_query_without_keys_gets_the_out_bias():
  keys = _lod([3, 0, 0, 6], KV_FEATURES, 1)  # none for the queries of sequence 2
  module, _ = _pair("attention", causal=True)
  params = _perturbed(module.init(jax.random.key(0), X, keys))
  y = jax.jit(module.apply)(params, X, keys).to_list()
  assert_close(y[2], np.broadcast_to(params["params"]["out"]["bias"], (5, OUT)))


def _vaswani(length: int, features: int) -> np.ndarray:
  """Vaswani et al.'s positions: sin in even columns, cos in odd ones."""
  p = np.arange(length)[:, None]
  rates = 10000.0 ** (-(np.arange(features) // 2 * 2) / features)
  return np.where(np.arange(features) % 2 == 0, np.sin(p * rates), np.cos(p * rates))


def test_positions_restart_at_every_sequence():
  """Two equal sequences at different offsets encode equally, and the
  sinusoidal encoder is the learned one holding Vaswani's table."""
  rng = np.random.default_rng(7)
  a, b = rng.normal(size=(5, FEATURES)), rng.normal(size=(3, FEATURES))
  x = LoDTensor.from_sequences([a, b, a], buckets=BUCKETS, dtype=np.float32)
  sinusoidal = linen.TransformerEncoder(1, HEADS, MLP)
  learned = linen.TransformerEncoder(1, HEADS, MLP, positions="learned", max_length=6)
  params = jax.jit(sinusoidal.init)(jax.random.key(0), x)
  table = {"embedding": jnp.asarray(_vaswani(6, FEATURES), jnp.float32)}
  with_table = {"params": {**params["params"], "position_embedding": table}}
  y = jax.jit(sinusoidal.apply)(params, x)
  assert_close(jax.jit(learned.apply)(with_table, x).values, y.values)
  first, _, last = y.to_list()
  assert_close(first, last)


# -- (b) the twins agree ---------------------------------------------------------------

X = _lod(LENGTHS, FEATURES, 0)
KEYS = _lod(KEY_LENGTHS, KV_FEATURES, 1)
VALUES = _lod(KEY_LENGTHS, KV_FEATURES, 2)
TWINS = {
  "attention-self": (("attention",), {"causal": True}, (X,)),
  "attention-cross": (("attention",), {"cross": True}, (X, KEYS, VALUES)),
  "layer": (("layer",), {"qkv_features": QKV}, (X,)),
  "encoder": (("encoder",), {}, (X,)),
  "encoder-learned-causal": (
    ("encoder",),
    {"positions": "learned", "max_length": 6, "causal": True},
    (X,),
  ),
}


def _loss(y: LoDTensor) -> jax.Array:
  v = y.values
  return jnp.sum(jnp.sin(v) * (1 + jnp.arange(v.size) % 3).reshape(v.shape))


@pytest.mark.parametrize("case", TWINS)
def test_twins_agree_on_copied_parameters(case):
  (name,), kwargs, inputs = TWINS[case]
  module, ours = _pair(name, **kwargs)
  variables = jax.jit(lambda key: _perturbed(module.init(key, *inputs)))(
    jax.random.key(0)
  )
  _copy(variables["params"], ours)

  def linen_loss(v):
    y = module.apply(v, *inputs)
    return _loss(y), y

  def nnx_loss(m):
    y = m(*inputs)
    return _loss(y), y

  (_, want), linen_grads = jax.jit(jax.value_and_grad(linen_loss, has_aux=True))(
    variables
  )
  (_, got), nnx_grads = nnx.jit(nnx.value_and_grad(nnx_loss, has_aux=True))(ours)
  assert_close(got.values, want.values)
  assert got.recursive_lengths() == [LENGTHS]
  _copy(linen_grads["params"], ours)  # the gradients, in NNX's tree
  assert_close(nnx.state(ours, nnx.Param), nnx_grads)


# -- (c) no leak, (d) padding rows -----------------------------------------------------


@pytest.mark.parametrize("case", ["attention-self", "attention-cross", "layer"])
def test_no_sequence_reaches_another(case):
  (name,), kwargs, inputs = TWINS[case]
  module, _ = _pair(name, **kwargs)
  params = _perturbed(module.init(jax.random.key(0), *inputs))
  check_independent(lambda x: module.apply(params, x, *inputs[1:]), X, jit=True)
  if case == "attention-cross":  # the keys and the values, sequence by sequence
    check_independent(lambda k: module.apply(params, X, k, k), KEYS, jit=True)


def test_no_sequence_reaches_another_in_the_nnx_encoder():
  _, ours = _pair("encoder", positions="learned", max_length=6, causal=True)
  graphdef, state = nnx.split(ours)
  check_independent(lambda x: nnx.merge(graphdef, state)(x), X, jit=True)


@pytest.mark.parametrize("name", ["attention", "layer", "encoder"])
def test_padding_rows_stay_zero_with_dropout(name):
  rates = {"dropout_rate": 0.5}
  if name != "attention":
    rates["attention_dropout_rate"] = 0.5
  module, ours = _pair(name, deterministic=False, **rates)
  params = _perturbed(module.init(jax.random.key(0), X))
  rngs = {"dropout": jax.random.key(1)}
  dropped = jax.jit(lambda p: module.apply(p, X, rngs=rngs))(params)
  kept = jax.jit(lambda p: module.apply(p, X, deterministic=True))(params)
  _copy(params["params"], ours)
  nnx_dropped = nnx.jit(lambda m: m(X))(ours)
  ours.eval()
  nnx_kept = nnx.jit(lambda m: m(X))(ours)
  assert_close(nnx_kept.values, kept.values)
  for y in (dropped, kept, nnx_dropped, nnx_kept):
    values = np.asarray(y.values)
    assert np.isfinite(values).all()
    assert not values[sum(LENGTHS) :].any()
  real = slice(0, sum(LENGTHS))
  assert not np.allclose(dropped.values[real], kept.values[real])
  assert not np.allclose(nnx_dropped.values[real], kept.values[real])


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_attention_dropout_drops_weights_not_output_entries(api):
  """Sequences of one row, identity value and output projections: a row's
  output is its value row, each head's slice kept whole (times ``1 / (1 -
  rate)``) or dropped whole, as a dropped weight does; dropping the
  output's entries would split heads."""
  rate, width, heads = 0.5, 8, 2
  buckets = Buckets.fixed(tokens=24, sequences=24, time=1)
  x = _lod([1] * 24, width, 7, buckets=buckets)
  module = linen.MultiHeadAttention(heads, dropout_rate=rate, deterministic=False)
  params = module.init(jax.random.key(0), x)
  eye = np.eye(width, dtype=np.float32)
  params["params"]["value"]["kernel"] = eye.reshape(width, heads, -1)
  params["params"]["out"]["kernel"] = eye.reshape(heads, -1, width)
  params = jax.tree.map(jnp.asarray, params)
  if api == "linen":
    y = module.apply(params, x, rngs={"dropout": jax.random.key(1)})
  else:
    ours = twin.MultiHeadAttention(
      heads, width, dropout_rate=rate, deterministic=False, rngs=nnx.Rngs(0)
    )
    _copy(params["params"], ours)
    y = ours(x)
  got = np.asarray(y.values).reshape(24, heads, -1)
  want = np.asarray(x.values).reshape(24, heads, -1) / (1 - rate)
  kept = np.all(np.isclose(got, want, rtol=1e-6, atol=1e-6), axis=-1)
  dropped = np.all(got == 0, axis=-1)
  assert np.all(kept | dropped), got
  assert kept.any() and dropped.any()


# -- (e) errors ------------------------------------------------------------------------

OTHER_COUNT = _lod([2, 3, 1], KV_FEATURES, 1)  # 3 sequences in 4 slots
FEWER_SLOTS = _lod(
  [2, 3, 1], KV_FEATURES, 1, buckets=Buckets.fixed(tokens=16, sequences=3, time=6)
)
LONG = Buckets.fixed(tokens=16, sequences=4, time=8)


def _linen_call(module, *args, **kwargs):
  return module.init(jax.random.key(0), *args, **kwargs)


# case: (Linen call, NNX call, error, message)
ERRORS = {
  "heads": (
    lambda: _linen_call(linen.MultiHeadAttention(3, 4), X),
    lambda: twin.MultiHeadAttention(3, FEATURES, 4, rngs=nnx.Rngs(0)),
    ValueError,
    r"Expected `qkv_features` to be a multiple of `num_heads`, 3, got 4\.",
  ),
  "heads_of_width": (
    lambda: _linen_call(linen.MultiHeadAttention(4), X),
    lambda: twin.MultiHeadAttention(4, FEATURES, rngs=nnx.Rngs(0)),
    ValueError,
    r"`qkv_features` \(the width of `inputs_q`, as it is None\) to be a multiple "
    r"of `num_heads`, 4, got 6\.",
  ),
  "values_without_keys": (
    lambda: _linen_call(linen.MultiHeadAttention(2), X, None, X),
    lambda: twin.MultiHeadAttention(2, FEATURES, rngs=nnx.Rngs(0))(X, None, X),
    ValueError,
    r"Expected `inputs_k` with `inputs_v` .* got `inputs_k` None\.",
  ),
  "key_slots": (
    lambda: _linen_call(linen.MultiHeadAttention(2), X, FEWER_SLOTS),
    lambda: twin.MultiHeadAttention(
      2, FEATURES, in_kv_features=KV_FEATURES, rngs=nnx.Rngs(0)
    )(X, FEWER_SLOTS),
    ValueError,
    r"Expected `inputs_k` to have the last-level count capacity of `inputs_q`, 4, "
    r"got 3\.",
  ),
  "key_count": (
    lambda: _linen_call(linen.MultiHeadAttention(2), X, OTHER_COUNT),
    lambda: twin.MultiHeadAttention(
      2, FEATURES, in_kv_features=KV_FEATURES, rngs=nnx.Rngs(0)
    )(X, OTHER_COUNT),
    ValueError,
    r"`inputs_k` to have as many last-level sequences as `inputs_q`; `inputs_q` "
    r"has 4, `inputs_k` 3\.",
  ),
  "value_lod": (
    lambda: _linen_call(linen.MultiHeadAttention(2), X, KEYS, OTHER_COUNT),
    lambda: twin.MultiHeadAttention(
      2, FEATURES, in_kv_features=KV_FEATURES, rngs=nnx.Rngs(0)
    )(X, KEYS, OTHER_COUNT),
    ValueError,
    r"Expected `inputs_v` to have the LoD of `inputs_k`; at level 0",
  ),
  "rank": (
    lambda: _linen_call(linen.MultiHeadAttention(2), X.with_values(X.values[:, None])),
    lambda: twin.MultiHeadAttention(2, FEATURES, rngs=nnx.Rngs(0))(
      X.with_values(X.values[:, None])
    ),
    ValueError,
    r"Expected `inputs_q.values` to have shape \[token_capacity, features\], got "
    r"\(16, 1, 6\)\.",
  ),
  "int_rows": (
    lambda: _linen_call(linen.TransformerEncoderLayer(2, MLP), X.astype(np.int32)),
    lambda: twin.TransformerEncoderLayer(2, FEATURES, MLP, rngs=nnx.Rngs(0))(
      X.astype(np.int32)
    ),
    TypeError,
    r"Expected `x.values` to have a float dtype, got int32\.",
  ),
  "rate": (
    lambda: _linen_call(linen.TransformerEncoderLayer(2, MLP, dropout_rate=1.5), X),
    lambda: twin.TransformerEncoderLayer(
      2, FEATURES, MLP, dropout_rate=1.5, rngs=nnx.Rngs(0)
    ),
    ValueError,
    r"Expected `dropout_rate` in \[0, 1\], got 1\.5\.",
  ),
  "positions": (
    lambda: _linen_call(linen.TransformerEncoder(1, 2, MLP, positions="rotary"), X),
    lambda: twin.TransformerEncoder(
      1, 2, FEATURES, MLP, positions="rotary", rngs=nnx.Rngs(0)
    ),
    ValueError,
    r"Expected `positions` to be one of \['learned', 'sinusoidal'\], got 'rotary'\.",
  ),
  "learned_without_max_length": (
    lambda: _linen_call(linen.TransformerEncoder(1, 2, MLP, positions="learned"), X),
    lambda: twin.TransformerEncoder(
      1, 2, FEATURES, MLP, positions="learned", rngs=nnx.Rngs(0)
    ),
    ValueError,
    r'Expected `max_length` \(an int >= 1\) with positions="learned", got None\.',
  ),
  "max_length": (
    lambda: _linen_call(
      linen.TransformerEncoder(1, 2, MLP, positions="learned", max_length=6),
      _lod(LENGTHS, FEATURES, 0, buckets=LONG),
    ),
    lambda: twin.TransformerEncoder(
      1, 2, FEATURES, MLP, positions="learned", max_length=6, rngs=nnx.Rngs(0)
    )(_lod(LENGTHS, FEATURES, 0, buckets=LONG)),
    ValueError,
    r"Expected `max_length` >= 8 \(the time capacity of `x`: its longest sequence "
    r"may have 8 rows\), got 6\.",
  ),
  "table": (
    lambda: _linen_call(linen.TransformerEncoder(1, 2, MLP), X, table=X),
    lambda: twin.TransformerEncoder(1, 2, FEATURES, MLP, rngs=nnx.Rngs(0))(X, table=X),
    TypeError,
    r"Expected `table` to be a RankTable, got LoDTensor\.",
  ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_twins_raise_the_same_errors(case):
  linen_call, nnx_call, error, match = ERRORS[case]
  with pytest.raises(error, match=match) as linen_info:
    linen_call()
  with pytest.raises(error, match=match) as nnx_info:
    nnx_call()
  assert str(linen_info.value) == str(nnx_info.value)


@pytest.mark.parametrize(
  ("call", "match"),
  [
    (
      lambda: twin.MultiHeadAttention(2, FEATURES, rngs=nnx.Rngs(0))(KEYS),
      r"Expected `inputs_q` of width 6 \(`in_features`\), got 5\.",
    ),
    (
      lambda: twin.MultiHeadAttention(2, FEATURES, rngs=nnx.Rngs(0))(X, KEYS),
      r"Expected `inputs_k` of width 6 \(`in_kv_features`\), got 5\.",
    ),
    (
      lambda: twin.TransformerEncoder(1, 1, KV_FEATURES, MLP, rngs=nnx.Rngs(0))(X),
      r"Expected `x` of width 5 \(`in_features`\), got 6\.",
    ),
  ],
)
def test_nnx_checks_the_input_widths(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# -- (f) a Seq2Seq with a TransformerEncoder -------------------------------------------

SRC_VOCAB, TGT_VOCAB, EMBED = 7, 8, 6
IDS = Buckets.fixed(tokens=12, sequences=3, time=6)
SETTINGS = DecodeSettings(bos_id=0, eos_id=1, max_length=4, beam_size=2)


def _ids(lengths, vocab, seed) -> LoDTensor:
  rng = np.random.default_rng(seed)
  seqs = [rng.integers(2, vocab, size=n) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=IDS, dtype=np.int32)


SRC = _ids([3, 1, 5], SRC_VOCAB, 3)
TGT_IN, TGT_OUT = _ids([2, 4, 3], TGT_VOCAB, 4), _ids([2, 4, 3], TGT_VOCAB, 5)
CORPUS = [ids.tolist() for ids in SRC.to_list()]  # the sources, one by one


def _linen_seq2seq(deterministic: bool) -> linen.Seq2Seq:
  encoder = linen.TransformerEncoder(
    2, HEADS, MLP, dropout_rate=0.1, deterministic=deterministic
  )
  decoder = linen.AttentionDecoder(nn.GRUCell(EMBED), linen.DotAttention())
  return linen.Seq2Seq(SRC_VOCAB, TGT_VOCAB, EMBED, encoder, decoder)


def _nnx_seq2seq() -> twin.Seq2Seq:
  rngs = nnx.Rngs(0)
  encoder = twin.TransformerEncoder(2, HEADS, EMBED, MLP, dropout_rate=0.1, rngs=rngs)
  decoder = twin.AttentionDecoder(
    nnx.GRUCell(EMBED, EMBED, rngs=rngs), twin.DotAttention()
  )
  return twin.Seq2Seq(
    SRC_VOCAB, TGT_VOCAB, EMBED, encoder, decoder, features=EMBED, rngs=rngs
  )


def _mean_loss(logits: LoDTensor) -> jax.Array:
  return sequence_cross_entropy(logits, TGT_OUT).values.sum() / logits.num_rows


def _check_decoded(hyps, corpus_results) -> None:
  """`generate`'s hypotheses of `SRC` are in the vocabulary, and
  `generate_corpus` of `CORPUS` (`SRC`'s sources, refilled into 2 slots)
  gives the same."""
  ids = hyps.ids.to_list()
  assert [len(h) for h in ids] == [SETTINGS.beam_size] * 3
  assert all(((h >= 0) & (h < TGT_VOCAB)).all() for hs in ids for h in hs)
  assert len(corpus_results) == len(CORPUS)
  for (got, scores), want, want_scores in zip(
    corpus_results, ids, hyps.scores.to_list(), strict=True
  ):
    assert [h.tolist() for h in got] == [h.tolist() for h in want]
    # Other batches: the attention's tiles hold other sequences (sums in
    # another order), as tests/nn/test_generate_corpus.py allows.
    assert_close(scores, want_scores, rtol=1e-5, atol=1e-5)


def test_a_linen_seq2seq_with_a_transformer_encoder_trains_decodes_and_exports():
  train, model = _linen_seq2seq(False), _linen_seq2seq(True)
  params = jax.jit(model.init)(jax.random.key(0), SRC, TGT_IN)
  rngs = {"dropout": jax.random.key(1)}

  def loss(params):
    return _mean_loss(train.apply(params, SRC, TGT_IN, rngs=rngs))

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  assert np.isfinite(value)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  attention = grads["params"]["encoder"]["layers_0"]["attention"]
  assert np.abs(attention["query"]["kernel"]).sum() > 0
  params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  assert jax.jit(loss)(params) < value

  def generate(params, src):
    return model.apply(params, src, SETTINGS, method="generate")

  hyps = jax.jit(generate)(params, SRC)
  corpus = model.apply(
    params, CORPUS, SETTINGS, method="generate_corpus", src_capacity=6, slots=2
  )
  _check_decoded(hyps, list(corpus))
  exported = export.export(jax.jit(unchecked(generate)))(params, SRC)
  call = export.deserialize(exported.serialize())
  got = call.call(params, SRC)
  assert got.ids.recursive_lengths() == hyps.ids.recursive_lengths()
  np.testing.assert_array_equal(got.ids.values, hyps.ids.values)
  np.testing.assert_array_equal(got.scores.values, hyps.scores.values)


def test_an_nnx_seq2seq_with_a_transformer_encoder_trains_decodes_and_exports():
  model = _nnx_seq2seq()
  model.train()
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    value, grads = nnx.value_and_grad(lambda m: _mean_loss(m(SRC, TGT_IN)))(model)
    optimizer.update(model, grads)
    return value, grads

  value, grads = step(model, optimizer)
  assert np.isfinite(value)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert np.abs(
    grads["encoder"]["layers"][0]["attention"]["query"]["kernel"][...]
  ).sum()
  model.eval()
  assert model.encoder.layers[0].attention.deterministic
  hyps = nnx.jit(lambda m: m.generate(SRC, SETTINGS))(model)
  corpus = model.generate_corpus(CORPUS, SETTINGS, src_capacity=6, slots=2)
  _check_decoded(hyps, list(corpus))
  graphdef, state = nnx.split(model)
  # The arrays as a list: `nnx.List`'s int keys do not serialize.
  leaves, tree = jax.tree.flatten(nnx.to_pure_dict(state))

  def encode(leaves, src):
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves)).encode(src)

  exported = export.export(jax.jit(unchecked(encode)))(leaves, SRC)
  call = export.deserialize(exported.serialize())
  want = jax.jit(encode)(leaves, SRC)
  np.testing.assert_array_equal(call.call(leaves, SRC).values, want.values)


# -- (g) one compile per capacity ------------------------------------------------------


def test_one_compile_serves_every_batch_of_one_capacity():
  module, ours = _pair("encoder", positions="learned", max_length=6, causal=True)
  params = jax.jit(module.init)(jax.random.key(0), X)
  traces = []

  @jax.jit
  def forward(params, x):
    traces.append("linen")
    return module.apply(params, x)

  @nnx.jit
  def nnx_forward(model, x):
    traces.append("nnx")
    return model(x)

  for seed, lengths in enumerate([LENGTHS, [6, 6, 1, 3], [1, 0, 0, 0], [0, 0, 0, 0]]):
    x = _lod(lengths, FEATURES, seed)
    for y in (forward(params, x), nnx_forward(ours, x)):
      assert y.recursive_lengths() == [lengths]
      assert np.isfinite(np.asarray(y.values)).all()
  assert traces == ["linen", "nnx"]
