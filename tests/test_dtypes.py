"""Every float op and layer takes float16, bfloat16, float32 and float64, and
batches whose every sequence is empty (token and time capacities 0).

The reference is the same call in float64 (x64 on); the result keeps the
input's dtype and agrees within that dtype's resolution.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlod
from jaxlod import LoDTensor
from jaxlod import ops as jo
from jaxlod.nn import AttentionDecoder, DotAttention, DynamicRNN, Seq2Seq
from jaxlod.nn import nnx as nnx_nn

DTYPES = ["float16", "bfloat16", "float32", "float64"]
# Relative tolerance per dtype: a few units of its resolution over sums of
# a handful of rows.
RTOL = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-5, "float64": 1e-12}
LENGTHS = [3, 0, 2, 4]


def lod(dtype, features=(3,)) -> LoDTensor:
  rng = np.random.default_rng(0)
  rows = rng.uniform(-1, 1, (sum(LENGTHS), *features)).astype(np.float64)
  x = LoDTensor.from_lengths(rows, [LENGTHS])
  return x.with_values(jnp.asarray(x.values, dtype))


def conv_filter(dtype):
  return jnp.asarray(np.random.default_rng(1).uniform(-1, 1, (9, 2)), dtype)


def dynamic_rnn_layer(x):
  """The Linen layer with a GRU whose parameters and math use `x`'s dtype."""
  dtype = x.values.dtype
  layer = DynamicRNN(nn.GRUCell(3, dtype=dtype, param_dtype=dtype))
  with jax.enable_x64(True):
    params = DynamicRNN(nn.GRUCell(3, param_dtype=jnp.float64)).init(
      jax.random.key(0), x.with_values(x.values.astype(jnp.float64))
    )
  return layer.apply(jax.tree.map(lambda a: a.astype(dtype), params), x)


def scatter(x):
  index = LoDTensor.from_lengths(np.array([0, 2, 1, 2, 0, 1, 1, 2, 0]), [LENGTHS])
  base = jnp.zeros((4, 3, 3), x.values.dtype)
  return jo.sequence_scatter(base, index, x)


def attention(x, scores):
  """Attention over `x` as memory from a query of ones (zero rows: padding)."""
  memory = jo.lod_memory(x)
  query = jnp.ones((x.capacity.sequences[-1], 3), x.values.dtype)
  return jnp.concatenate(jo.attend(scores(query, memory), memory), axis=1)


OPS = {
  "cosine_scores": lambda x: jo.cosine_scores(
    jnp.ones((x.capacity.sequences[-1], 3), x.values.dtype), jo.lod_memory(x)
  ),
  "cosine_attention": lambda x: attention(x, jo.cosine_scores),
  "dot_attention": lambda x: attention(x, jo.dot_scores),
  "pool_sum": lambda x: jo.sequence_pool(x, "sum"),
  "pool_average": lambda x: jo.sequence_pool(x, "average"),
  "pool_sqrt": lambda x: jo.sequence_pool(x, "sqrt"),
  "pool_max": lambda x: jo.sequence_pool(x, "max"),
  "first_step": jo.sequence_first_step,
  "last_step": jo.sequence_last_step,
  "softmax": lambda x: jo.sequence_softmax(x.with_values(x.values[:, :1])),
  "conv": lambda x: jo.sequence_conv(x, conv_filter(x.values.dtype)),
  "scatter": scatter,
  "reverse": jo.sequence_reverse,
  "pad": lambda x: jo.sequence_pad(x, 0.0)[0],
  "expand_as": lambda x: jo.sequence_expand_as(
    jo.sequence_pool(x, "sum"), LoDTensor.from_lengths(np.zeros(4), [[1, 1, 1, 1]])
  ),
  "dynamic_rnn": lambda x: jo.dynamic_rnn(
    lambda c, x_t, _: (jnp.tanh(c + x_t), jnp.tanh(c + x_t)),
    x,
    init_carry=jnp.zeros((4, 3), x.values.dtype),
  )[0],
  "DynamicRNN": lambda x: dynamic_rnn_layer(x),
}


def as_array(out):
  return out.values if isinstance(out, LoDTensor) else out


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_float_ops_take_every_float_dtype(name, dtype):
  with jax.enable_x64(True):
    reference = np.asarray(as_array(OPS[name](lod("float64"))), np.float64)
    got = as_array(OPS[name](lod(dtype)))
  assert got.dtype == jnp.dtype(dtype), (name, got.dtype)
  scale = max(1.0, float(np.max(np.abs(reference))))
  np.testing.assert_allclose(
    np.asarray(got, np.float64), reference, rtol=0, atol=RTOL[dtype] * scale
  )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_integer_only_ops_refuse_floats_by_jax_dtype(dtype):
  x = lod(dtype)
  with pytest.raises(
    TypeError, match=rf"`x.values` to have an integer dtype, got {dtype}"
  ):
    jo.sequence_erase(x, [1])


# -- capacities 0 -------------------------------------------------------------------

EMPTY = {
  "all empty, exact capacities (tokens 0, time 0)": dict(lengths=[0, 0]),
  "all empty under a fixed capacity (tokens 0, time 8)": dict(
    lengths=[0, 0], buckets=jaxlod.Buckets.fixed(tokens=0, sequences=4, time=8)
  ),
  "all empty, room for rows (tokens 16, time 0)": dict(
    lengths=[0, 0], buckets=jaxlod.Buckets.fixed(tokens=16, sequences=4, time=0)
  ),
}


def empty_lod(lengths, buckets=None, dtype=np.float32, features=(3,)) -> LoDTensor:
  rows = np.zeros((0, *features), dtype)
  return LoDTensor.from_lengths(rows, [lengths], buckets=buckets)


EMPTY_OPS = {
  **{k: v for k, v in OPS.items() if k not in ("scatter", "expand_as", "dynamic_rnn")},
  "dynamic_rnn": lambda x: jo.dynamic_rnn(
    lambda c, x_t, _: (jnp.tanh(c + x_t), jnp.tanh(c + x_t)),
    x,
    init_carry=jnp.ones((x.capacity.sequences[-1], 3), x.values.dtype),
  ),
}


@pytest.mark.parametrize("name", sorted(EMPTY_OPS))
@pytest.mark.parametrize("case", sorted(EMPTY))
def test_ops_take_all_empty_batches(name, case):
  x = empty_lod(**EMPTY[case])
  out = EMPTY_OPS[name](x)
  for leaf in jax.tree.leaves(out):
    assert np.all(np.isfinite(np.asarray(leaf, np.float64))), (name, case)
  if name == "dynamic_rnn":  # the carries stay as given, with a gradient of 1
    ys, carry = out
    np.testing.assert_array_equal(carry, 1.0)
    grad = jax.grad(
      lambda c: jnp.sum(
        jo.dynamic_rnn(lambda h, x_t, _: (h + x_t, h), x, init_carry=c)[1]
      )
    )(jnp.ones((x.capacity.sequences[-1], 3)))
    np.testing.assert_array_equal(grad, 1.0)


def seq2seq_twins() -> tuple[Seq2Seq, nnx_nn.Seq2Seq]:
  """A small Linen Seq2Seq (8 source and target ids, GRU 6) and its NNX twin."""
  model = Seq2Seq(
    src_vocab=8,
    tgt_vocab=8,
    embed_dim=4,
    encoder=DynamicRNN(nn.GRUCell(6)),
    decoder=AttentionDecoder(nn.GRUCell(6), DotAttention()),
  )
  rngs = nnx.Rngs(0)
  twin = nnx_nn.Seq2Seq(
    8,
    8,
    4,
    nnx_nn.DynamicRNN(nnx.GRUCell(4, 6, rngs=rngs)),
    nnx_nn.AttentionDecoder(nnx.GRUCell(4, 6, rngs=rngs), nnx_nn.DotAttention()),
    features=6,
    rngs=rngs,
  )
  return model, twin


@pytest.mark.parametrize("case", sorted(EMPTY))
def test_seq2seq_takes_all_empty_targets(case):
  tgt = empty_lod(**EMPTY[case], dtype=np.int32, features=())
  count = tgt.capacity.sequences[-1]
  src = LoDTensor.from_sequences(
    [np.array([3, 1, 4]), np.array([1, 5])],
    buckets=jaxlod.Buckets.fixed(tokens=8, sequences=count, time=4),
  )
  model, twin = seq2seq_twins()
  logits, params = model.init_with_output(jax.random.key(0), src, tgt)
  assert logits.values.shape == (tgt.capacity.tokens, 8)
  assert twin(src, tgt).values.shape == (tgt.capacity.tokens, 8)


def test_generate_takes_all_empty_sources():
  # A source capacity of 0 reached `beam_search` as static inputs [count, 0,
  # ...], which it could not flatten (a bare ZeroDivisionError).
  settings = jo.DecodeSettings(bos_id=0, eos_id=1, max_length=4, beam_size=2)
  src = LoDTensor.from_sequences([np.array([3, 1]), np.array([2])])
  tgt = LoDTensor.from_sequences([np.array([0, 2]), np.array([0])])
  model, twin = seq2seq_twins()
  params = model.init(jax.random.key(0), src, tgt)
  results = {}
  for case in sorted(EMPTY):
    empty = empty_lod(**EMPTY[case], dtype=np.int32, features=())
    linen = model.apply(params, empty, settings, method="generate")
    pair = jaxlod.nn.ensemble_generate([(model, params)] * 2, empty, settings)
    for hyps in (linen, pair, twin.generate(empty, settings)):
      # Every source gets its hypotheses, as from a nonzero capacity.
      assert hyps.ids.recursive_lengths()[0] == [settings.results] * 2, case
    results[case] = [[h.tolist() for h in hs] for hs in linen.ids.to_list()]
  assert len({repr(r) for r in results.values()}) == 1, results
