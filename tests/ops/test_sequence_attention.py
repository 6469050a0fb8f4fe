"""`jaxlod.ops.sequence_attention` against a dense softmax attention of each
sequence alone (NumPy, float64): values and gradients of the query, the key
and the value at 1e-12, self- and cross-attention, causal or not, on random
LoDs (hypothesis) with empty sequences, 2-level LoDs and all-empty batches,
for every plan (the default, tiles of one and of three rows, and the
`jax.nn.dot_product_attention` kernel in float32); `check_grads`; no
sequence reaching another, nor a padding row a real one; bfloat16; one
compilation per capacity; the errors, eager and under `jit`; the plans'
tiles and the work they do."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from jaxlod import Buckets, Fault, LoDTensor
from jaxlod.ops import AttentionPlan, default_attention_plan, sequence_attention
from jaxlod.testing import check_independent
from tests.helpers import ATOL, RTOL, TWO_LEVEL, assert_close, recursive_lengths

HEADS, DIM = 2, 3
# The query's and the key's capacities: as many sequences, other tokens and
# times (cross-attention between tensors of different shapes).
SEQUENCES, K_TOKENS = 5, 24
Q_BUCKETS = Buckets.fixed(tokens=20, sequences=SEQUENCES, time=4)
K_BUCKETS = Buckets.fixed(tokens=K_TOKENS, sequences=SEQUENCES, time=6)
# Another last-level count capacity than the query's.
OTHER_COUNT = Buckets.fixed(tokens=20, sequences=4, time=4)
# A 2-level key of the helpers' 2-level query's sequences.
K_TWO_LEVEL = Buckets.fixed(tokens=40, sequences=(6, 12), time=(4, 6))
# float64 against NumPy: the same sums in another order.
F64 = {"rtol": 1e-12, "atol": 1e-12}
# bfloat16 keeps 8 significant bits (a relative step of 2**-8, 0.4%): the
# result and the gradients round to it (with the fused kernel the weights and
# the products too), against float32 from the same operands, values and
# gradients of order 1. Measured: at most 1.2e-2 apart over six seeds.
BF16 = {"rtol": 2e-2, "atol": 3e-2}

PLANS = {
  "default": AttentionPlan(),
  "tiles-of-1": AttentionPlan(tile_tokens=1, minimum=1, multiple=1, ratio=1.5),
  "tiles-of-3": AttentionPlan(tile_tokens=3, minimum=1, multiple=1, ratio=1.5),
  # Tiles run their heads one at a time (a tile of one cell, both at once).
  "heads-in-groups": AttentionPlan(weights=2),
}
FUSED = AttentionPlan(kernel="dot_product_attention")


@pytest.fixture
def float64():
  with jax.enable_x64(True):
    yield


# -- the reference ---------------------------------------------------------------


def _spans(offsets) -> list[tuple[int, int]]:
  offsets = np.asarray(offsets)
  return list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))


def _weights(q, k, causal: bool, scale: float) -> np.ndarray:
  """One sequence's softmax weights ``[heads, lq, lk]``; 0 in a row with
  no key (at or before it, `causal`)."""
  scores = scale * np.einsum("qhd,khd->hqk", q, k)
  keep = np.ones(scores.shape[1:], bool)
  if causal:
    keep = np.arange(k.shape[0])[None, :] <= np.arange(q.shape[0])[:, None]
  scores = np.where(keep, scores, -np.inf)
  top = scores.max(axis=-1, keepdims=True, initial=-np.inf)
  e = np.where(keep, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
  total = e.sum(axis=-1, keepdims=True)
  return e / np.where(total > 0, total, 1)


def kept(rng, n: int, heads: int, lq: int, lk: int, rate: float) -> np.ndarray:
  """The dropout's multiplier of sequence `n`'s weights ``[heads, lq, lk]``,
  as `sequence_attention` documents it: weight ``(i, j)`` of head ``h`` is
  kept, times ``1 / (1 - rate)``, where element ``j`` of the bits of
  ``fold_in(fold_in(fold_in(rng, n), h), i)`` is at least ``rate * 2**32``."""
  bits = np.zeros((heads, lq, lk), np.uint64)
  for h in range(heads):
    for i in range(lq):
      key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, n), h), i)
      bits[h, i] = np.asarray(jax.random.bits(key, (lk,), jnp.uint32))
  return (bits >= int(rate * 2**32)) / (1 - rate)


def reference(q, k, v, q_offsets, k_offsets, causal, g, rate=0.0, rng=None):
  """Each sequence alone (NumPy, float64): the attention's values and the
  gradients of ``sum(out * g)`` with respect to `q`, `k` and `v`; with a
  `rate`, the weights dropped by `kept`."""
  q, k, v, g = (np.asarray(a, np.float64) for a in (q, k, v, g))
  scale = 1 / np.sqrt(q.shape[-1])
  out, gq, gk, gv = (
    np.zeros_like(q),
    np.zeros_like(q),
    np.zeros_like(k),
    np.zeros_like(v),
  )
  spans = zip(_spans(q_offsets), _spans(k_offsets), strict=True)
  for n, ((a, b), (c, d)) in enumerate(spans):
    p = _weights(q[a:b], k[c:d], causal, scale)
    m = kept(rng, n, q.shape[1], b - a, d - c, rate) if rate else 1.0
    out[a:b] = np.einsum("hqk,khd->qhd", p * m, v[c:d])
    gv[c:d] = np.einsum("hqk,qhd->khd", p * m, g[a:b])
    dp = m * np.einsum("qhd,khd->hqk", g[a:b], v[c:d])
    ds = scale * p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    gq[a:b] = np.einsum("hqk,khd->qhd", ds, k[c:d])
    gk[c:d] = np.einsum("hqk,qhd->khd", ds, q[a:b])
  return out, (gq, gk, gv)


def _tensor(lengths, buckets, seed, dtype=np.float64) -> LoDTensor:
  """Normal random rows ``[tokens, HEADS, DIM]`` with this LoD."""
  rng = np.random.default_rng(seed)
  rows = rng.normal(size=(sum(lengths[-1]), HEADS, DIM)).astype(dtype)
  return LoDTensor.from_lengths(rows, lengths, buckets=buckets)


def _case(q_lengths, k_lengths, seed, *, q_buckets=Q_BUCKETS, k_buckets=K_BUCKETS):
  """Query, key and value (the key's LoD) and random cotangents, float64."""
  q = _tensor(q_lengths, q_buckets, seed)
  k = _tensor(k_lengths, k_buckets, seed + 1)
  v = _tensor(k_lengths, k_buckets, seed + 2)
  g = np.random.default_rng(seed + 3).normal(size=q.values.shape)
  return q, k, v, g


@functools.partial(jax.jit, static_argnames=("causal", "plan", "rate"))
def _attend_and_grads(q, k, v, g, *, causal, plan, rate=0.0, rng=None):
  """The attention and the gradients of ``sum(out.values * g)``."""

  def loss(qv, kv, vv):
    out = sequence_attention(
      q.with_values(qv),
      k.with_values(kv),
      v.with_values(vv),
      causal=causal,
      dropout_rate=rate,
      dropout_rng=rng,
      plan=plan,
    )
    return jnp.sum(out.values * g), out

  grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(
    q.values, k.values, v.values
  )
  return out, grads


def _check(q, k, v, g, causal, plan, tol=F64, rate=0.0, rng=None) -> None:
  """The op against `reference`, and its LoD, padding and faults."""
  drop = {"rate": rate, "rng": rng}
  out, grads = _attend_and_grads(q, k, v, g, causal=causal, plan=plan, **drop)
  offsets = (q.offsets[-1], k.offsets[-1])
  want, want_grads = reference(
    q.values, k.values, v.values, *offsets, causal, g, **drop
  )
  assert_close(out.values, want, **tol)
  assert_close(grads, want_grads, **tol)
  assert out.values.dtype == q.values.dtype
  assert out.capacity == q.capacity
  assert out.recursive_lengths() == q.recursive_lengths()
  assert int(out.faults) == 0
  real = int(q.offsets[-1][-1])
  assert not np.any(np.asarray(out.values)[real:])
  for x in (out.values, *grads):
    assert np.all(np.isfinite(np.asarray(x)))


@st.composite
def _pairs(draw):
  """Query and key lengths of one number of sequences (the key's the
  query's, self-attention's LoD, or others), with empty sequences."""
  n = draw(st.integers(0, SEQUENCES))
  q = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
  if draw(st.booleans()):
    return q, q, draw(st.integers(0, 2**16))
  k = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n).filter(_fits_keys))
  return q, k, draw(st.integers(0, 2**16))


def _fits_keys(lengths) -> bool:
  return sum(lengths) <= K_TOKENS


# No sequence, only empty ones, queries with no key, keys with no query.
EMPTY = [
  ([], [], 0),
  ([0, 0, 0], [0, 0, 0], 1),
  ([0, 0], [2, 3], 2),
  ([3, 1], [0, 0], 3),
]


def _with_empty(test):
  for case in EMPTY:
    test = example(case)(test)
  return test


# -- values and gradients ----------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
def test_values_and_gradients_equal_the_dense_reference(float64, plan, causal):
  @settings(max_examples=10, deadline=None)
  @_with_empty
  @given(_pairs())
  def check(case):
    q_lengths, k_lengths, seed = case
    _check(*_case([q_lengths], [k_lengths], seed), causal, PLANS[plan])

  check()


@pytest.mark.parametrize(("plan", "causal"), [("default", False), ("tiles-of-3", True)])
def test_a_two_level_lod_attends_within_its_innermost_sequences(float64, plan, causal):
  """Self-attention (the key's and the value's LoD the query's, the same
  capacities) and cross-attention with a 2-level key of other lengths."""

  @settings(max_examples=6, deadline=None)
  @given(recursive_lengths(num_levels=2), st.booleans(), st.integers(0, 2**16))
  def check(lengths, cross, seed):
    if cross:
      inner = np.random.default_rng(seed).integers(0, 7, size=len(lengths[1]))
      keys, k_buckets = [lengths[0], inner.tolist()], K_TWO_LEVEL
    else:
      keys, k_buckets = lengths, TWO_LEVEL
    case = _case(lengths, keys, seed, q_buckets=TWO_LEVEL, k_buckets=k_buckets)
    _check(*case, causal, PLANS[plan])

  check()


def test_self_attention_of_one_tensor(float64):
  """`query`, `key` and `value` the same LoDTensor."""
  x = _tensor([[3, 0, 4, 1]], Q_BUCKETS, 0)
  g = np.random.default_rng(1).normal(size=x.values.shape)
  _check(x, x, x, g, False, PLANS["default"])


@pytest.mark.parametrize("grouped", [False, True], ids=["together", "in-groups"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_fused_kernel_in_float32(causal, grouped):
  """`jax.nn.dot_product_attention` computes its softmax in float32:
  float32 operands, against the float64 reference at float32's tolerances,
  with every tile's heads together or one at a time."""
  plan = dataclasses.replace(FUSED, weights=2) if grouped else FUSED

  @settings(max_examples=8, deadline=None)
  @_with_empty
  @given(_pairs())
  def check(case):
    q_lengths, k_lengths, seed = case
    q, k, v, g = _case([q_lengths], [k_lengths], seed)
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    tol = {"rtol": RTOL, "atol": ATOL}
    _check(q, k, v, g.astype(np.float32), causal, plan, tol=tol)

  check()


def test_check_grads(float64):
  q, k, v, _ = _case([[3, 0, 4, 2]], [[2, 5, 0, 3]], seed=4)
  plan = PLANS["tiles-of-3"]

  @jax.jit
  def attend(qv, kv, vv):
    out = sequence_attention(
      q.with_values(qv), k.with_values(kv), v.with_values(vv), causal=True, plan=plan
    )
    return out.values

  check_grads(attend, (q.values, k.values, v.values), order=1, modes=("rev",))


def test_scale(float64):
  """An explicit `scale` multiplies the scores (here 1, not 1/sqrt(DIM))."""
  q, k, v, g = _case([[2, 3, 0]], [[3, 1, 2]], seed=5)
  got = jax.jit(functools.partial(sequence_attention, scale=1.0))(q, k, v)
  offsets = (q.offsets[-1], k.offsets[-1])
  want, _ = reference(q.values * np.sqrt(DIM), k.values, v.values, *offsets, False, g)
  assert_close(got.values, want, **F64)


# -- dropout on the weights --------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("plan", [*PLANS, "fused"])
def test_dropout_equals_the_reference_with_the_documented_weights(
  float64, plan, causal
):
  """Values and gradients with the weights that `kept` drops, on every plan
  (the fused kernel's tiles run `"xla"`'s forward pass with dropout): which
  weights drop depends on the key, the sequence, the head and the cell,
  not on the plan or on the other sequences."""
  plan = FUSED if plan == "fused" else PLANS[plan]

  @settings(max_examples=4, deadline=None)
  @example(([3, 0, 4, 2], [2, 5, 0, 3], 9))
  @given(_pairs())
  def check(case):
    q_lengths, k_lengths, seed = case
    q, k, v, g = _case([q_lengths], [k_lengths], seed)
    _check(q, k, v, g, causal, plan, rate=0.4, rng=jax.random.key(seed))

  check()


def test_dropout_keys_and_rates():
  """A raw key is its typed key; rate 0 ignores the key; rate 1 drops every
  weight (zeros, and zero gradients); another key drops other weights."""
  q, k, v, g = _case([[3, 2, 4]], [[3, 2, 4]], seed=11)
  q, k, v = (x.astype(np.float32) for x in (q, k, v))
  g = g.astype(np.float32)
  run = functools.partial(_attend_and_grads, q, k, v, g, causal=False, plan=None)
  typed = run(rate=0.5, rng=jax.random.key(3))
  raw = run(rate=0.5, rng=jax.random.PRNGKey(3))
  for a, b in zip(jax.tree.leaves(typed), jax.tree.leaves(raw), strict=True):
    np.testing.assert_array_equal(a, b)
  plain, ignored = run(), run(rate=0.0, rng=jax.random.key(3))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(ignored), strict=True):
    np.testing.assert_array_equal(a, b)
  other = run(rate=0.5, rng=jax.random.key(4))
  assert not np.array_equal(other[0].values, typed[0].values)
  out, grads = run(rate=1.0, rng=jax.random.key(3))
  for x in (out.values, *grads):
    np.testing.assert_array_equal(x, np.zeros_like(x))


def test_dropout_reaches_no_other_sequence():
  """`check_independent` with dropout: a sequence's kept weights and rows
  depend on its own rows only."""
  x = _tensor([[3, 0, 4, 2, 1]], Q_BUCKETS, 6, np.float32)

  def attend(x):
    rng = jax.random.key(5)
    return sequence_attention(x, x, x, dropout_rate=0.3, dropout_rng=rng)

  check_independent(attend, x, jit=True)


# -- no sequence reaches another ---------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_no_sequence_reaches_another(causal):
  """`check_independent`: a change of one sequence's rows (random, 1e30,
  inf, NaN) in the query, the key and the value at once changes no other
  sequence's values or gradients."""
  x = _tensor([[3, 0, 4, 2, 1]], Q_BUCKETS, 6, np.float32)

  def attend(x):
    k = x.with_values(x.values[:, ::-1])
    return sequence_attention(x, k, x.with_values(jnp.tanh(x.values)), causal=causal)

  check_independent(attend, x, jit=True)


@st.composite
def _leaks(draw):
  q_lengths, k_lengths, seed = draw(_pairs().filter(lambda c: len(c[0]) >= 2))
  side = draw(st.sampled_from(["query", "key", "value"]))
  lengths = q_lengths if side == "query" else k_lengths
  i = draw(st.sampled_from(range(len(lengths))))
  kind = draw(st.sampled_from(["random", "inf", "nan"]))
  return q_lengths, k_lengths, seed, side, i, kind


def _perturbed(x: LoDTensor, i: int, kind: str, seed: int) -> LoDTensor:
  offsets = np.asarray(x.offsets[-1])
  values = np.array(x.values)
  rows = slice(int(offsets[i]), int(offsets[i + 1]))
  if kind == "random":
    values[rows] = np.random.default_rng(seed).normal(size=values[rows].shape)
  else:
    values[rows] = {"inf": np.inf, "nan": np.nan}[kind]
  return x.with_values(values)


def _others(x: LoDTensor, i: int) -> np.ndarray:
  """The real rows of `x` outside its last-level sequence `i`."""
  ids = np.asarray(x.segment_ids())
  return np.asarray(x.row_mask()) & (ids != i)


@pytest.mark.parametrize("causal", [False, True])
def test_a_changed_sequence_changes_no_other(float64, causal):
  """Random, inf or NaN rows in one sequence of the query, the key or the
  value: every other sequence's values and gradients bitwise as they were
  (the cotangent is nonzero on every row, the changed sequence's too)."""

  @settings(max_examples=10, deadline=None)
  @given(_leaks())
  def check(case):
    q_lengths, k_lengths, seed, side, i, kind = case
    q, k, v, g = _case([q_lengths], [k_lengths], seed)
    tensors = {"query": q, "key": k, "value": v}
    tensors[side] = _perturbed(tensors[side], i, kind, seed)
    plan = PLANS["default"]
    clean, clean_grads = _attend_and_grads(q, k, v, g, causal=causal, plan=plan)
    got, grads = _attend_and_grads(*tensors.values(), g, causal=causal, plan=plan)
    rows = [_others(q, i), _others(k, i), _others(k, i)]
    keep = rows[0]
    np.testing.assert_array_equal(np.asarray(got.values)[keep], clean.values[keep])
    for a, b, keep in zip(grads, clean_grads, rows, strict=True):
      np.testing.assert_array_equal(np.asarray(a)[keep], np.asarray(b)[keep])

  check()


@pytest.mark.parametrize("causal", [False, True])
def test_padding_rows_never_reach_real_rows(float64, causal):
  """NaN in the padding rows of the query, the key and the value: the real
  rows' values and gradients as with zeros there, the padding rows zero."""
  q, k, v, g = _case([[3, 0, 2, 4]], [[1, 5, 0, 3]], seed=7)

  def garbage(x: LoDTensor) -> LoDTensor:
    values = np.array(x.values)
    values[int(x.offsets[-1][-1]) :] = np.nan
    return x.with_values(values)

  plan = PLANS["default"]
  clean, clean_grads = _attend_and_grads(q, k, v, g, causal=causal, plan=plan)
  got, grads = _attend_and_grads(
    garbage(q), garbage(k), garbage(v), g, causal=causal, plan=plan
  )
  np.testing.assert_array_equal(np.asarray(got.values), np.asarray(clean.values))
  for a, b in zip(grads, clean_grads, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for x, grad in zip((q, k, v), grads, strict=True):
    assert not np.any(np.asarray(grad)[int(x.offsets[-1][-1]) :])


# -- bfloat16 ----------------------------------------------------------------------


@pytest.mark.parametrize("plan", ["default", "fused"])
def test_bfloat16_is_close_to_float32(plan):
  plan = FUSED if plan == "fused" else PLANS["default"]
  q, k, v, g = _case([[3, 0, 4, 2]], [[2, 5, 0, 3]], seed=8)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  g = g.astype(jnp.bfloat16)
  out, grads = _attend_and_grads(q, k, v, g, causal=True, plan=plan)
  wide = [x.astype(np.float32) for x in (q, k, v)]
  want, want_grads = _attend_and_grads(
    *wide, g.astype(np.float32), causal=True, plan=plan
  )
  assert out.values.dtype == jnp.bfloat16
  assert all(x.dtype == jnp.bfloat16 for x in grads)
  assert_close(out.values.astype(np.float32), want.values, **BF16)
  assert_close([x.astype(np.float32) for x in grads], list(want_grads), **BF16)


# -- one compilation per capacity ----------------------------------------------------


def test_one_compilation_per_capacity():
  """Batches of one capacity, any lengths, forward and training step."""
  traces = []
  rng = np.random.default_rng(9)
  w = rng.normal(size=(DIM, DIM)).astype(np.float32)

  @jax.jit
  def step(w, x, k):
    traces.append(1)

    def loss(w):
      q = x.with_values(x.values @ w)
      out = sequence_attention(q, k, k, causal=True)
      return jnp.sum(out.values**2)

    return jax.value_and_grad(loss)(w)

  for seed in range(8):
    n = int(rng.integers(0, 6))
    q_lengths = rng.integers(0, 5, size=n).tolist()
    k_lengths = rng.integers(0, 5, size=n).tolist()
    x = _tensor([q_lengths], Q_BUCKETS, seed, np.float32)
    k = _tensor([k_lengths], K_BUCKETS, seed + 1, np.float32)
    loss, grad = step(w, x, k)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
  assert len(traces) == 1


# -- in place --------------------------------------------------------------------


def _copies_in_loops(hlo: str, shapes: tuple[str, ...]) -> list[str]:
  """The copies of arrays of `shapes` (HLO shapes, ``"f32[20,2,3]"``) in
  the bodies of a compiled program's while loops."""
  bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
  copies, name = [], None
  for line in hlo.splitlines():
    if line and not line[0].isspace():  # a computation's header (or its end)
      name = line.split()[0].lstrip("%")
    elif name in bodies and " copy(" in line and any(s in line for s in shapes):
      copies.append(line.strip())
  return copies


@pytest.mark.parametrize("plan", ["default", "heads-in-groups"])
def test_the_backward_pass_writes_in_place(plan):
  """Each tile writes its gradients over saved rows that it has read: XLA
  copies no query, key or value buffer in the loops (a copy there is one
  per tile, of every row)."""
  q, k, v, g = _case([[3, 0, 4, 2]], [[2, 5, 0, 3]], seed=10)
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  w = np.random.default_rng(11).normal(size=(DIM, DIM)).astype(np.float32)

  def loss(w):
    rows = [x.with_values(x.values @ w) for x in (q, k, v)]
    out = sequence_attention(*rows, causal=True, plan=PLANS[plan])
    return jnp.sum(out.values * g)

  hlo = jax.jit(jax.grad(loss)).lower(w).compile().as_text()
  shapes = tuple(f"f32[{n},{HEADS},{DIM}]" for n in (20, K_TOKENS))
  assert re.search(r"body=%", hlo)
  assert _copies_in_loops(hlo, shapes) == []


# -- errors ------------------------------------------------------------------------


def _small(lengths=(2, 1), buckets=None, dtype=np.float32, shape=(HEADS, DIM)):
  values = np.ones((sum(lengths), *shape), dtype)
  return LoDTensor.from_lengths(values, [list(lengths)], buckets=buckets)


ERRORS = [
  # (name, query, key, value, keyword arguments, error, match)
  ("query-array", np.ones((3, 2, 3)), _small(), _small(), {}, TypeError,
   "Expected `query` to be a LoDTensor, got ndarray"),
  ("key-array", _small(), np.ones((3, 2, 3)), _small(), {}, TypeError,
   "Expected `key` to be a LoDTensor"),
  ("value-none", _small(), _small(), None, {}, TypeError,
   "Expected `value` to be a LoDTensor, got NoneType"),
  ("query-2d", _small(shape=(6,)), _small(), _small(), {}, ValueError,
   r"`query.values` to be \[token_capacity, heads, head_dim\], got shape \(3, 6\)"),
  ("value-4d", _small(), _small(), _small(shape=(2, 3, 1)), {}, ValueError,
   r"`value.values` to be \[token_capacity, heads, head_dim\]"),
  ("int", _small(dtype=np.int32), _small(dtype=np.int32), _small(dtype=np.int32), {},
   TypeError, "Expected `query` to have a float dtype, got int32"),
  ("dtypes", _small(), _small(dtype=np.float16), _small(), {}, TypeError,
   "Expected `key` to have the dtype of `query`, float32, got float16"),
  ("heads", _small(), _small(shape=(3, 3)), _small(shape=(3, 3)), {}, ValueError,
   r"`key` to have the heads and head_dim of `query`, \(2, 3\), got \(3, 3\)"),
  ("head-dim", _small(), _small(), _small(shape=(2, 4)), {}, ValueError,
   r"`value` to have the heads and head_dim of `query`, \(2, 3\), got \(2, 4\)"),
  ("value-lod", _small(), _small(), _small((1, 2)), {}, ValueError,
   "Expected `value` to have the LoD of `key`; at level 0"),
  ("value-capacity", _small(), _small(), _small(buckets=Q_BUCKETS), {}, ValueError,
   "Expected `value` to have the LoD of `key`; `key` has capacity"),
  ("count", _small(buckets=Q_BUCKETS), _small((2, 1, 1), buckets=Q_BUCKETS),
   _small((2, 1, 1), buckets=Q_BUCKETS), {}, ValueError,
   "Expected `key` to have as many last-level sequences as `query`; `query` has 2, "
   "`key` 3"),
  ("count-capacity", _small(buckets=Q_BUCKETS), _small(buckets=OTHER_COUNT),
   _small(buckets=OTHER_COUNT), {}, ValueError,
   "Expected `key` to have the last-level count capacity of `query`, 5, got 4"),
  ("plan", _small(), _small(), _small(), {"plan": "xla"}, TypeError,
   "Expected `plan` to be a jaxlod.ops.AttentionPlan or None, got str"),
  ("causal", _small(), _small(), _small(), {"causal": 1}, TypeError,
   "Expected `causal` to be a bool, got 1"),
  ("scale", _small(), _small(), _small(), {"scale": "1"}, TypeError,
   "Expected `scale` to be a static float"),
  ("rate", _small(), _small(), _small(), {"dropout_rate": 1.5}, ValueError,
   r"Expected `dropout_rate` in \[0, 1\], got 1.5"),
  ("rate-negative", _small(), _small(), _small(), {"dropout_rate": -0.1}, ValueError,
   r"Expected `dropout_rate` in \[0, 1\], got -0.1"),
  ("no-rng", _small(), _small(), _small(), {"dropout_rate": 0.1}, ValueError,
   "Expected a `dropout_rng` with `dropout_rate` 0.1, got None"),
  ("rng", _small(), _small(), _small(),
   {"dropout_rate": 0.1, "dropout_rng": np.ones(3, np.uint32)}, TypeError,
   r"Expected `dropout_rng` to be a JAX key \(jax.random.key\(0\)\) or None, got "
   r"ndarray of shape \(3,\)"),
]  # fmt: skip


@pytest.mark.parametrize(
  ("query", "key", "value", "kwargs", "error", "match"),
  [pytest.param(*case[1:], id=case[0]) for case in ERRORS],
)
def test_errors(query, key, value, kwargs, error, match):
  with pytest.raises(error, match=match):
    sequence_attention(query, key, value, **kwargs)


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"ratio": 1.0}, ValueError, r"Expected `ratio` > 1, got 1.0"),
    ({"ratio": float("nan")}, ValueError, r"Expected `ratio` > 1, got nan"),
    ({"ratio": "a"}, TypeError, "Expected `ratio` to be a static float"),
    ({"tile_tokens": 0}, ValueError, "Expected `tile_tokens` >= 1, got 0"),
    ({"tile_tokens": 2.0}, TypeError, "Expected `tile_tokens` to be a static int"),
    ({"minimum": 0}, ValueError, "Expected `minimum` >= 1, got 0"),
    ({"multiple": -1}, ValueError, "Expected `multiple` >= 1, got -1"),
    ({"weights": 0}, ValueError, "Expected `weights` >= 1, got 0"),
    ({"kernel": "flash"}, ValueError, r"`kernel` to be one of \['dot_product_att"),
  ],
)
def test_plan_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    AttentionPlan(**kwargs)


def test_plan_function_errors():
  with pytest.raises(TypeError, match="Expected `backend` to be a string, got 3"):
    default_attention_plan(3)
  with pytest.raises(ValueError, match="Expected `time_capacity` >= 0, got -1"):
    AttentionPlan().tiles(-1)


def test_under_jit_other_lods_give_nan_and_an_input_fault():
  """The key's and the value's offsets, and the numbers of sequences, are
  data under `jit`: LoDs that disagree poison the values and set
  `Fault.INPUT` (eagerly they raise, `test_errors`)."""
  q = _small((2, 1, 3), Q_BUCKETS)
  k = _small((2, 2, 1), K_BUCKETS)
  attend = jax.jit(sequence_attention)
  ok = attend(q, k, k)
  assert int(ok.faults) == 0 and np.all(np.isfinite(np.asarray(ok.values)))
  for key, value in [
    (k, _small((1, 3, 1), K_BUCKETS)),  # the value's LoD is not the key's
    (_small((2, 2), K_BUCKETS), _small((2, 2), K_BUCKETS)),  # 2 sequences, not 3
  ]:
    out = attend(q, key, value)
    assert np.all(np.isnan(np.asarray(out.values)))
    assert int(out.faults) & Fault.INPUT
    with pytest.raises(ValueError, match=r"This LoDTensor is faulted \(INPUT\)"):
      out.to_list()


# -- the plans -----------------------------------------------------------------------


def test_tiles():
  assert AttentionPlan(tile_tokens=64).tiles(32) == (
    (32, 2), (28, 2), (24, 2), (20, 3), (16, 4), (12, 5), (8, 8), (4, 16)
  )  # fmt: skip
  assert AttentionPlan().tiles(0) == ()
  assert AttentionPlan().tiles(3) == ((3, 85),)
  assert PLANS["tiles-of-1"].tiles(5) == ((5, 1), (4, 1), (3, 1), (2, 1), (1, 1))
  for plan in [*PLANS.values(), FUSED, AttentionPlan(tile_tokens=1024)]:
    for time in [1, 4, 7, 33, 100]:
      tiles = plan.tiles(time)
      lengths = [n for n, _ in tiles]
      assert lengths[0] == time and lengths[-1] == min(time, plan.minimum)
      assert np.all(np.diff(lengths) < 0)
      assert all(s == max(1, plan.tile_tokens // n) for n, s in tiles)


def test_default_plans_per_backend():
  assert default_attention_plan("cpu") == AttentionPlan()
  assert default_attention_plan("gpu") == AttentionPlan(tile_tokens=1024)
  assert default_attention_plan("tpu") == default_attention_plan("gpu")
  assert default_attention_plan() == default_attention_plan(jax.default_backend())
  assert AttentionPlan().kernel == default_attention_plan("gpu").kernel == "xla"


def test_plans_are_hashable_and_static():
  plans = [AttentionPlan(), AttentionPlan(tile_tokens=256, ratio=1.25)]
  assert plans[0] == plans[1] and hash(plans[0]) == hash(plans[1])
  assert len({*plans, FUSED, *PLANS.values()}) == 5
  with pytest.raises(AttributeError):
    plans[0].tile_tokens = 3
  traces = []

  @functools.partial(jax.jit, static_argnames="plan")
  def attend(x, plan):
    traces.append(plan)
    return sequence_attention(x, x, x, plan=plan).values

  x = _small((2, 1))
  for plan in plans:
    attend(x, plan=plan)
  assert len(traces) == 1


# -- the work of the default plan -----------------------------------------------------


def _scheduled(plan: AttentionPlan, longest: list[int], time: int):
  """The tiles' cells, as the op schedules them (host): sequences by the
  longer of their query and key, longest first; per tile shape in order,
  tiles of `sequences` from the first sequence no tile took, while one
  remains longer than the next shape. Returns the cells and each
  sequence's tile length (in the rank order)."""
  ranked = sorted(longest, reverse=True)
  tiles = plan.tiles(time)
  below = [n for n, _ in tiles[1:]] + [0]
  cells, at, tile_of = 0, 0, [0] * len(ranked)
  for (length, sequences), next_length in zip(tiles, below, strict=True):
    end = sum(n > next_length for n in ranked)
    while at < end:
      cells += sequences * length * length
      for r in range(at, min(at + sequences, len(ranked))):
        tile_of[r] = length
      at += sequences
  return cells, ranked, tile_of


def _check_work(plan: AttentionPlan, time: int, longest: list[int]) -> None:
  """The bounds of the test below for the sequences' `longest` lengths."""
  cells, ranked, tile_of = _scheduled(plan, longest, time)
  ladder = [n for n, _ in plan.tiles(time)]
  own = []
  for n, tile in zip(ranked, tile_of, strict=True):
    if n == 0:
      continue
    fit = min(length for length in ladder if length >= n)
    assert tile >= fit >= n
    assert fit == plan.minimum or fit < max(plan.ratio * n, n + plan.multiple)
    own.append(fit * fit)
  slack = sum(s * n * n for n, s in plan.tiles(time))
  assert sum(n * n for n in ranked) <= cells <= sum(own) + slack


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_the_default_plans_waste_at_most_a_tile_per_shape(backend):
  """Each sequence (of length ``l``, the longer of its query's and key's)
  runs in a tile at least its length; its own shape, the shortest that
  holds it, is below ``max(ratio * l, l + multiple)`` or the shortest; the
  cells are at most those of each sequence in its own shape plus one tile
  per shape."""
  plan, time = default_attention_plan(backend), 64

  @settings(max_examples=50, deadline=None)
  @given(st.lists(st.integers(0, time), max_size=80))
  def check(longest):
    _check_work(plan, time, longest)

  check()
