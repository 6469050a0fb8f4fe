"""masked_attention and the Linen attentions against NumPy references."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jaxlod import Buckets, LoDTensor, ops
from jaxlod.nn import AdditiveAttention, CosineAttention, DotAttention, GeneralAttention
from jaxlod.ops import masked_attention
from tests.helpers import assert_close

HIDDEN, FEATURES, UNITS = 3, 4, 5
# Memory lengths with an empty memory, a full one and padding sequences.
LENGTHS = [3, 0, 5, 1]
SOURCE = 6
COUNT = 5  # count capacity: one padding sequence past the real ones

ATTENTIONS = {
  "dot": lambda: DotAttention(),
  "general": lambda: GeneralAttention(),
  "additive": lambda: AdditiveAttention(UNITS),
  "cosine": lambda: CosineAttention(),
}
# Dot and cosine scores need a query as wide as the memory.
QUERY_WIDTH = {
  "dot": FEATURES,
  "general": HIDDEN,
  "additive": HIDDEN,
  "cosine": FEATURES,
}


# -- NumPy reference: a loop over rows, real slots only ---------------------------


def _scores(kind: str, params, q: np.ndarray, m: np.ndarray) -> np.ndarray:
  """Scores of one query ``[hidden]`` against its real memory ``[n, F]``."""
  if kind == "dot":
    return m @ q
  if kind == "general":
    return m @ (q @ params["query"]["kernel"])
  if kind == "additive":
    keys = m @ params["key"]["kernel"]
    query = q @ params["query"]["kernel"] + params["query"]["bias"]
    return np.tanh(keys + query) @ params["energy"]["kernel"][:, 0]
  norms = np.sqrt(q @ q + 1e-8) * np.sqrt(np.sum(m * m, axis=-1) + 1e-8)
  return (m @ q) / norms


def reference_attention(kind, params, query, memory, lengths):
  """``(context [b, F], weights [b, S])`` in float64, row by row."""
  params = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  query, memory = np.asarray(query, np.float64), np.asarray(memory, np.float64)
  count, source, features = memory.shape
  context, weights = np.zeros((count, features)), np.zeros((count, source))
  for i, n in enumerate(np.asarray(lengths)):
    if n == 0:
      continue
    real = memory[i, :n]
    scores = _scores(kind, params, query[i], real)
    e = np.exp(scores - scores.max())
    weights[i, :n] = e / e.sum()
    context[i] = weights[i, :n] @ real
  return context, weights


# -- data --------------------------------------------------------------------------


def _memory(seed: int = 0) -> tuple[np.ndarray, np.ndarray, LoDTensor]:
  """Padded memory with garbage in its padding slots, its lengths, and the
  same memory as a LoDTensor."""
  rng = np.random.default_rng(seed)
  lengths = np.array([*LENGTHS, 0] + [0] * (COUNT - len(LENGTHS) - 1), np.int32)
  padded = rng.normal(size=(COUNT, SOURCE, FEATURES)).astype(np.float32)
  lod = LoDTensor.from_sequences(
    [padded[i, :n] for i, n in enumerate(LENGTHS)],
    buckets=Buckets.fixed(tokens=16, sequences=COUNT, time=SOURCE),
  )
  # Garbage (large values) past each length: masking must ignore it.
  slots = np.arange(SOURCE)[None, :] >= lengths[:, None]
  padded[slots] = 50.0
  return padded, lengths, lod


def _query(kind: str, seed: int = 1) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return rng.normal(size=(COUNT, QUERY_WIDTH[kind])).astype(np.float32)


def _init(kind: str):
  attention = ATTENTIONS[kind]()
  memory, lengths, _ = _memory()
  params = attention.init(jax.random.key(0), _query(kind), memory, lengths)
  return attention, params


# -- masked_attention ----------------------------------------------------------------


def test_masked_attention_matches_reference():
  memory, lengths, _ = _memory()
  scores = np.random.default_rng(2).normal(size=(COUNT, SOURCE)).astype(np.float32)
  context, weights = jax.jit(masked_attention)(scores, memory, lengths)
  want_weights = np.zeros((COUNT, SOURCE))
  for i, n in enumerate(lengths):
    if n:
      e = np.exp(scores[i, :n] - scores[i, :n].max())
      want_weights[i, :n] = e / e.sum()
  want_context = np.einsum("bs,bsf->bf", want_weights, memory)
  assert_close(weights, want_weights)
  assert_close(context, want_context)
  # Padding slots get exactly zero; empty rows a zero context.
  slots = np.arange(SOURCE)[None, :] >= lengths[:, None]
  assert np.all(np.asarray(weights)[slots] == 0.0)
  assert np.all(np.asarray(context)[lengths == 0] == 0.0)


def test_masked_attention_empty_memory_gradients_are_finite():
  """Empty rows (and a zero source capacity) give zeros and no NaN gradients."""
  for source in (0, 3):
    scores = jnp.full((2, source), -jnp.inf).at[:, :1].set(1.0)
    memory = jnp.ones((2, source, 2))
    lengths = jnp.array([0, min(source, 1)])

    def loss(scores, memory, lengths=lengths):
      context, weights = masked_attention(scores, memory, lengths)
      return jnp.sum(context**2) + jnp.sum(jnp.sin(weights))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(scores, memory)
    context, weights = masked_attention(scores, memory, lengths)
    assert np.all(np.asarray(context)[0] == 0.0)
    assert np.all(np.asarray(weights)[0] == 0.0)
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0])[0] == 0.0)


@pytest.mark.parametrize(
  ("scores", "memory", "lengths", "error", "match"),
  [
    ((2,), (2, 3, 1), (2,), ValueError, r"`scores` to have shape \[b, source_capa"),
    ((2, 3), (2, 4, 1), (2,), ValueError, r"= \[2, 3, features\] \(from `scores`\)"),
    ((2, 3), (2, 3, 1), (3,), ValueError, r"`lengths` to have shape \(2,\) \(one per"),
    ((2, 3), (2, 3, 1), "float", TypeError, r"`lengths` to have an integer dtype"),
  ],
)
def test_masked_attention_errors(scores, memory, lengths, error, match):
  lengths = np.ones(2, np.float32) if lengths == "float" else np.ones(lengths, int)
  with pytest.raises(error, match=match):
    masked_attention(np.zeros(scores), np.zeros(memory), lengths)


# -- the four attentions against the NumPy reference ---------------------------------


def _run(attention, params, query, memory, lengths, use_jit=True, **kwargs):
  def fn(params, query, memory, lengths):
    return attention.apply(params, query, memory, lengths, **kwargs)

  return (jax.jit(fn) if use_jit else fn)(params, query, memory, lengths)


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
@pytest.mark.parametrize("form", ["array", "lod"])
def test_attention_matches_numpy(kind, form):
  attention, params = _init(kind)
  padded, lengths, lod = _memory()
  query = _query(kind)
  memory, given = (padded, lengths) if form == "array" else (lod, None)
  context, weights = _run(attention, params, query, memory, given)
  want_context, want_weights = reference_attention(
    kind, params["params"] if params else {}, query, padded, lengths
  )
  assert context.shape == (COUNT, FEATURES) and weights.shape == (COUNT, SOURCE)
  # float32 exp and tanh against a float64 reference.
  assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
  assert_close(context, want_context, rtol=1e-5, atol=1e-5)
  slots = np.arange(SOURCE)[None, :] >= lengths[:, None]
  assert np.all(np.asarray(weights)[slots] == 0.0)
  assert np.all(np.asarray(context)[lengths == 0] == 0.0)


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_attention_without_jit(kind):
  attention, params = _init(kind)
  padded, lengths, _ = _memory()
  query = _query(kind)
  got = _run(attention, params, query, padded, lengths, use_jit=False)
  want = _run(attention, params, query, padded, lengths)
  assert_close(got, want)


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_attention_gradients_are_finite_and_skip_padding(kind):
  attention, params = _init(kind)
  padded, lengths, _ = _memory()
  query = _query(kind)

  def loss(params, query, memory):
    context, weights = attention.apply(params, query, memory, lengths)
    return jnp.sum(jnp.sin(context)) + jnp.sum(weights * jnp.arange(SOURCE))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, query, padded)
  for leaf in jax.tree.leaves(grads):
    assert np.all(np.isfinite(np.asarray(leaf)))
  grad_query, grad_memory = (np.asarray(g) for g in grads[1:])
  slots = np.arange(SOURCE)[None, :] >= lengths[:, None]
  assert np.all(grad_memory[slots] == 0.0)
  assert np.all(grad_query[lengths == 0] == 0.0)
  assert np.any(grad_query != 0.0)


# Absolute tolerance per dtype, against float32, for values of order 1.
DTYPE_ATOL = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-6}


@functools.cache
def _values_and_grads(kind: str, dtype: str):
  """Jitted ``(context, weights), (grad query, grad memory)`` of `kind` with
  its parameters cast to `dtype`."""
  attention, params = _init(kind)
  params = jax.tree.map(lambda p: p.astype(dtype), params)

  def loss(query, memory, lengths):
    context, weights = attention.apply(params, query, memory, lengths)
    total = jnp.sum(jnp.sin(context.astype(jnp.float32)))
    return total + jnp.sum(weights.astype(jnp.float32) * jnp.arange(SOURCE)), (
      context,
      weights,
    )

  return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
@pytest.mark.parametrize("dtype", sorted(DTYPE_ATOL))
@settings(max_examples=8)
@given(data=st.data())
def test_zero_vectors_are_finite_in_every_dtype(kind, dtype, data):
  """Zero queries, zero memory rows and zero padding slots give finite
  values and gradients in every float dtype, as in float32 (cosine scores
  in float16 divided by norms whose `eps` had rounded to 0)."""
  lengths = np.asarray(
    data.draw(st.lists(st.integers(0, SOURCE), min_size=COUNT, max_size=COUNT)),
    np.int32,
  )
  zero_rows = np.asarray(
    data.draw(st.lists(st.booleans(), min_size=COUNT * SOURCE, max_size=COUNT * SOURCE))
  ).reshape(COUNT, SOURCE)
  zero_queries = np.asarray(
    data.draw(st.lists(st.booleans(), min_size=COUNT, max_size=COUNT))
  )
  rng = np.random.default_rng(0)
  memory = rng.normal(size=(COUNT, SOURCE, FEATURES)).astype(np.float32)
  padding = np.arange(SOURCE)[None, :] >= lengths[:, None]
  memory[zero_rows | padding] = 0.0  # a LoDTensor's padding slots are zeros
  query = np.where(zero_queries[:, None], 0.0, _query(kind)).astype(np.float32)
  (grad_query, grad_memory), outputs = _values_and_grads(kind, dtype)(
    jnp.asarray(query, dtype), jnp.asarray(memory, dtype), lengths
  )
  for leaf in (grad_query, grad_memory, *outputs):
    assert leaf.dtype == jnp.dtype(dtype)
    assert np.all(np.isfinite(np.asarray(leaf, np.float32))), (kind, dtype)
  assert np.all(np.asarray(grad_memory, np.float32)[padding] == 0.0)
  _, want = _values_and_grads(kind, "float32")(query, memory, lengths)
  for got, expected in zip(outputs, want, strict=True):
    np.testing.assert_allclose(
      np.asarray(got, np.float32), expected, rtol=0, atol=DTYPE_ATOL[dtype]
    )


# -- parameters and precomputed keys ----------------------------------------------


def test_parameter_names_and_shapes():
  shapes = {kind: jax.tree.map(np.shape, _init(kind)[1]) for kind in sorted(ATTENTIONS)}
  assert shapes["dot"] == {} and shapes["cosine"] == {}
  assert shapes["general"] == {"params": {"query": {"kernel": (HIDDEN, FEATURES)}}}
  assert shapes["additive"] == {
    "params": {
      "key": {"kernel": (FEATURES, UNITS)},
      "query": {"kernel": (HIDDEN, UNITS), "bias": (UNITS,)},
      "energy": {"kernel": (UNITS, 1)},
    }
  }


def test_additive_precomputed_keys():
  attention, params = _init("additive")
  padded, lengths, lod = _memory()
  query = _query("additive")
  want = _run(attention, params, query, padded, lengths)
  keys = attention.apply(params, padded, method="keys")
  assert keys.shape == (COUNT, SOURCE, UNITS)
  assert_close(_run(attention, params, query, padded, lengths, keys=keys), want)
  # LoD keys are computed on the packed rows: padding rows stay zero.
  lod_keys = attention.apply(params, lod, method="keys")
  assert lod_keys.values.shape == (lod.capacity.tokens, UNITS)
  assert np.all(np.asarray(lod_keys.values)[int(lod.num_rows) :] == 0.0)
  got = _run(attention, params, query, lod, None, keys=lod_keys)
  assert_close(got, want, rtol=1e-5, atol=1e-5)
  # Initializing with keys still creates the key layer.
  init_params = attention.init(jax.random.key(0), query, padded, lengths, keys=keys)
  assert set(init_params["params"]) == {"key", "query", "energy"}


# -- bad input ---------------------------------------------------------------------


def test_width_errors():
  padded, lengths, _ = _memory()
  wide = np.ones((COUNT, FEATURES + 2), np.float32)
  for attention in (DotAttention(), CosineAttention()):
    with pytest.raises(
      ValueError,
      match=rf"Expected `query` of width {FEATURES} \(memory features\), got "
      rf"{FEATURES + 2}\.",
    ):
      attention.apply({}, wide, padded, lengths)


@pytest.mark.parametrize(
  "name", ["DotAttention", "GeneralAttention", "CosineAttention"]
)
def test_keys_only_for_additive_attention(name):
  padded, lengths, _ = _memory()
  attention = {
    "DotAttention": DotAttention,
    "GeneralAttention": GeneralAttention,
    "CosineAttention": CosineAttention,
  }[name]()
  query = np.ones((COUNT, FEATURES), np.float32)
  variables = attention.init(jax.random.key(0), query, padded, lengths)
  assert attention.apply(variables, padded, method="keys") is None
  with pytest.raises(ValueError, match=rf"{name} precomputes no keys .*got `keys`"):
    attention.apply(variables, query, padded, lengths, keys=padded)


@pytest.mark.parametrize(
  ("case", "match"),
  [
    ("lod_with_lengths", r"Got `lengths` with a LoDTensor `memory`"),
    ("array_without_lengths", r"Expected `lengths` \[b\] \(real slots"),
    ("memory_rank", r"`memory` to have shape \[b, source_capacity, features\], got"),
    ("query_rank", r"`query` to have shape \[b, hidden\], got \(5,\)"),
    ("rows", r"`query` has 3 rows, `memory` has 5 sequences \(count capacity\)"),
    ("two_levels", r"one LoD level and values \[src_tokens, features\], got 2 lev"),
    ("keys_shape", r"`keys` to have shape \[b, source_capacity, units\] = \(5, 6, 5"),
  ],
)
def test_input_errors(case, match):
  attention, params = _init("additive")
  padded, lengths, lod = _memory()
  query = _query("additive")
  args = {
    "lod_with_lengths": (query, lod, lengths),
    "array_without_lengths": (query, padded),
    "memory_rank": (query, padded[:, 0], lengths),
    "query_rank": (query[:, 0], padded, lengths),
    "rows": (query[:3], padded, lengths),
    "two_levels": (
      query,
      LoDTensor.from_lengths(np.ones((3, FEATURES)), [[1, 1], [2, 1]]),
    ),
    "keys_shape": (query, padded, lengths, np.ones((COUNT, SOURCE, 2))),
  }[case]
  with pytest.raises(ValueError, match=match):
    attention.apply(params, *args)


def test_a_tree_map_cast_of_a_memory_raises_naming_its_lengths():
  x = LoDTensor.from_lengths(np.ones((5, 2), np.float32), [[2, 3]])
  memory = ops.lod_memory(x)
  cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), memory)
  scores = jnp.zeros(memory.values.shape[:2])
  with pytest.raises(TypeError, match=r"Expected integer `memory.lengths`, got bf"):
    ops.attend(scores, cast)
  ops.attend(scores, memory)


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"param_dtype": jnp.int32}, r"`param_dtype` to be a float dtype, got int32\."),
    ({"param_dtype": None}, r"`param_dtype` to be a float dtype, got None\."),
    ({"dtype": jnp.bool_}, r"`dtype` to be a float dtype, got bool\."),
  ],
)
@pytest.mark.parametrize("layer", ["general", "additive"])
def test_layer_dtypes_must_be_float(layer, kwargs, match):
  memory = LoDTensor.from_lengths(np.ones((5, 3), np.float32), [[3, 2]])
  module = (
    GeneralAttention(**kwargs) if layer == "general" else AdditiveAttention(3, **kwargs)
  )
  with pytest.raises(TypeError, match=match):
    module.init(jax.random.key(0), jnp.ones((2, 3)), memory)


@pytest.mark.parametrize("poison", [np.inf, -np.inf, np.nan, 1e30])
@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_values_past_the_lengths_never_reach_the_results(kind, poison):
  """A padded memory holding inf, NaN or 1e30 past its lengths gives the
  results and the gradients on its real slots of zeros there (a zero weight
  times NaN was NaN)."""
  attention, params = _init(kind)
  padded, lengths, _ = _memory()
  query = _query(kind)
  past = np.arange(SOURCE)[None, :] >= np.asarray(lengths)[:, None]
  poisoned = np.where(past[:, :, None], poison, np.asarray(padded)).astype(np.float32)

  def loss(memory):
    context, weights = attention.apply(params, query, memory, lengths)
    return jnp.sum(jnp.sin(context)) + jnp.sum(jnp.cos(weights)), (context, weights)

  run = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, want), want_grad = run(jnp.asarray(padded))
  (_, got), got_grad = run(jnp.asarray(poisoned))
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  real = ~past
  np.testing.assert_array_equal(np.asarray(got_grad)[real], np.asarray(want_grad)[real])
  scores = np.zeros(past.shape, np.float32)
  context, weights = masked_attention(scores, poisoned, lengths)
  assert np.all(np.isfinite(np.asarray(context)))
  assert np.all(np.asarray(weights)[past] == 0.0)
