"""Data-parallel steps over 4 devices against one device on the same examples.

Run by tests/parallel/test_parallel.py in a child process with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (it must precede
JAX's start); collected only there (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlod import Buckets, LoDTensor
from jaxlod.data import Batcher
from jaxlod.nn import (
  AdditiveAttention,
  AttentionDecoder,
  Bidirectional,
  DynamicRNN,
  Seq2Seq,
  ensemble_generate,
  ensemble_generate_corpus,
)
from jaxlod.ops import DecodeSettings
from jaxlod.parallel import (
  data_parallel,
  generate,
  generate_corpus,
  shard_batch,
  unstack,
)
from tests.helpers import assert_close
from tests.nn.test_rngs import SETTINGS as DROP_SETTINGS
from tests.nn.test_rngs import drop_seq2seq

SHARDS = 4
HIDDEN = 6
FEATURES = 3
VOCAB = 7
TOLERANCES = {"float32": dict(rtol=1e-5, atol=1e-6), "float64": dict(rtol=1e-10)}


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == SHARDS, "run with 4 forced host devices"
  return jax.make_mesh((SHARDS,), ("data",))


def _features(rng, n):
  return rng.normal(size=(n, FEATURES)).astype(np.float32)


def _examples(seed=0, count=26):
  """Examples of a feature sequence, source ids, target input and output ids;
  lengths 0-9, so some sequences are empty."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    n, m = int(rng.integers(0, 10)), int(rng.integers(1, 8))
    tgt = rng.integers(2, VOCAB, size=m)
    out.append(
      (
        _features(rng, n),
        rng.integers(0, VOCAB, size=max(n, 1)),
        np.concatenate([[0], tgt[:-1]]),
        tgt,
      )
    )
  return out


BUCKETS = Buckets.fixed(tokens=40, sequences=8, time=10)


def _global_batch(examples, dtype):
  """The first batch of a 4-shard Batcher, stacked, cast to `dtype`."""
  batcher = Batcher(
    examples, BUCKETS, shards=SHARDS, shuffle=False, window=len(examples), prefetch=0
  )
  batch = next(batcher.iterate())
  leaves, treedef = jax.tree.flatten(batch.fields[0])  # values come first
  x = jax.tree.unflatten(treedef, [np.asarray(leaves[0], dtype), *leaves[1:]])
  return batch._replace(fields=(x, *batch.fields[1:]))


def _one_device(examples, indices, dtype):
  """The same examples as one LoDTensor per field, exact capacities."""
  fields = []
  for f in range(4):
    seqs = [np.asarray(examples[i][f]) for i in indices]
    lod = LoDTensor.from_sequences(seqs, dtype=dtype if f == 0 else np.int32)
    fields.append(lod)
  return tuple(fields)


def _rnn_loss(model):
  def loss(params, fields):
    x = fields[0]
    carry, ys = model.apply(params, x, return_carry=True)
    real = x.row_mask()
    total = jnp.sum(jnp.where(real[:, None], ys.values, 0.0) ** 2)
    total += sum(jnp.sum(jnp.tanh(c)) for c in jax.tree.leaves(carry))
    return total, x.num_rows

  return loss


def _seq2seq_loss(model):
  def loss(params, fields):
    _, src, tgt_in, tgt_out = fields
    logits = model.apply(params, src, tgt_in)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.values, tgt_out.values)
    real = tgt_out.row_mask()
    return jnp.sum(jnp.where(real, ce, 0.0)), tgt_out.num_rows

  return loss


def _lstm(dtype, reverse=False):
  return DynamicRNN(nn.LSTMCell(HIDDEN, param_dtype=dtype), reverse=reverse)


def _bidirectional(dtype):
  return Bidirectional(_lstm(dtype), _lstm(dtype, reverse=True))


def _seq2seq(dtype="float32"):
  return Seq2Seq(
    src_vocab=VOCAB,
    tgt_vocab=VOCAB,
    embed_dim=5,
    encoder=_bidirectional(dtype),
    decoder=AttentionDecoder(
      nn.LSTMCell(HIDDEN, param_dtype=dtype), AdditiveAttention(HIDDEN)
    ),
  )


MODELS = {
  "lstm": (_lstm, _rnn_loss, "x"),
  "bidirectional": (_bidirectional, _rnn_loss, "x"),
  "seq2seq": (_seq2seq, _seq2seq_loss, "seq2seq"),
}


def _mean_step(loss):
  """A token-weighted mean loss and its gradients from sums and counts."""

  def sums(params, fields):
    (total, count), grads = jax.value_and_grad(loss, has_aux=True)(params, fields)
    return total, count, grads

  return sums


def _init(model, kind, fields, dtype):
  args = (fields[0],) if kind == "x" else (fields[1], fields[2])
  params = jax.jit(model.init)(jax.random.key(1), *args)
  return jax.tree.map(lambda a: a.astype(dtype), params)


@pytest.mark.parametrize(
  ("name", "dtype", "check_vma"),
  [
    # float64 tells a wrong reduction from rounding; float32 with the vma
    # check is what the G2P example trains with (test_g2p_devices.py).
    ("lstm", "float32", False),
    ("lstm", "float64", True),
    ("lstm", "float64", False),
    ("bidirectional", "float64", True),
    ("seq2seq", "float64", True),
  ],
)
def test_step_equals_one_device(mesh, name, dtype, check_vma):
  make, make_loss, kind = MODELS[name]
  with jax.enable_x64(dtype == "float64"):
    examples = _examples()
    batch = _global_batch(examples, dtype)
    assert np.all(np.asarray(batch.fields[0].num_outer) > 0)  # every shard holds data
    model = make(dtype)
    reference = _one_device(examples, batch.indices, dtype)
    params = _init(model, kind, reference, dtype)
    sums = _mean_step(make_loss(model))

    total, count, grads = jax.jit(sums)(params, reference)
    placed = shard_batch(batch, mesh)
    dp = jax.jit(data_parallel(sums, mesh, check_vma=check_vma))
    dp_total, dp_count, dp_grads = dp(params, placed.fields)

    assert int(dp_count) == int(count) > 0
    tolerance = TOLERANCES[dtype]
    assert_close(dp_total / dp_count, total / count, **tolerance)
    assert jax.tree.structure(dp_grads) == jax.tree.structure(grads)
    for a, e in zip(jax.tree.leaves(dp_grads), jax.tree.leaves(grads), strict=True):
      assert a.dtype == e.dtype == jnp.dtype(dtype)
    assert_close(
      jax.tree.map(lambda g: g / dp_count, dp_grads),
      jax.tree.map(lambda g: g / count, grads),
      **tolerance,
    )


def test_invariant_parameters_raise_under_check_vma(mesh):
  """Inside a user's own shard_map, parameters that do not vary over the
  data's axis would be reduced at every step: a clear error, not a hang."""
  host = _global_batch(_examples(), "float32")
  batch = shard_batch(host, mesh)
  model = _lstm("float32")
  params = model.init(jax.random.key(1), jax.tree.map(lambda a: a[0], host.fields[0]))
  loss = _rnn_loss(model)

  def grads(params, fields):
    fields = jax.tree.map(lambda a: a[0], fields)
    return jax.lax.psum(jax.grad(lambda p: loss(p, fields)[0])(params), "data")

  P = jax.sharding.PartitionSpec
  run = jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  with pytest.raises(ValueError, match=r"does not vary over \['data'\].*pcast"):
    jax.jit(run)(params, batch.fields)
  # Without differentiation the same loop runs (no reduction in the loop).
  forward = jax.shard_map(
    lambda p, f: loss(p, jax.tree.map(lambda a: a[0], f))[0][None],
    mesh=mesh,
    in_specs=(P(), P("data")),
    out_specs=P("data"),
  )
  np.testing.assert_allclose(
    float(jnp.sum(jax.jit(forward)(params, batch.fields))),
    float(
      sum(
        loss(params, jax.tree.map(lambda a, s=s: a[s], host.fields))[0]
        for s in range(SHARDS)
      )
    ),
    rtol=1e-5,
  )


def test_one_compilation_across_50_batches(mesh):
  examples = _examples(seed=3, count=400)
  batcher = Batcher(examples, BUCKETS, shards=SHARDS, seed=0, prefetch=0)
  model = _lstm("float32")
  first = next(batcher.iterate())
  params = model.init(jax.random.key(0), jax.tree.map(lambda a: a[0], first.fields[0]))
  traces = []
  loss = _rnn_loss(model)

  def sums(params, fields):
    traces.append(1)
    (total, count), grads = jax.value_and_grad(loss, has_aux=True)(params, fields)
    return total, count, grads

  tx = optax.sgd(1e-3)
  grads_of = data_parallel(sums, mesh)

  # Replicated in and out (spelled P() both ways): one cache entry.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  @functools.partial(jax.jit, out_shardings=replicated)
  def step(params, opt_state, fields):
    total, count, grads = grads_of(params, fields)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, total / count

  params = jax.device_put(params, replicated)
  opt_state = jax.device_put(tx.init(params), replicated)
  batches = batcher.iterate()
  seen = set()
  for _ in range(50):
    batch = next(batches)
    seen.update(batch.indices.tolist())
    params, opt_state, loss = step(params, opt_state, shard_batch(batch, mesh).fields)
  assert np.isfinite(float(loss))
  assert len(traces) == 1
  assert step._cache_size() == 1
  assert len(seen) == len(examples)  # 50 batches cover more than an epoch


def test_beam_search_equals_one_device(mesh):
  examples = _examples(seed=5)
  batch = _global_batch(examples, "float32")
  model = _seq2seq()
  reference = _one_device(examples, batch.indices, np.float32)
  params = jax.jit(model.init)(jax.random.key(2), reference[1], reference[2])
  settings = DecodeSettings(
    bos_id=0, eos_id=1, max_length=8, beam_size=3, num_results=2
  )
  expected = jax.jit(lambda p, src: ensemble_generate([(model, p)], src, settings))(
    params, reference[1]
  )
  placed = shard_batch(batch, mesh)
  shards = generate((model, params), placed.fields[1], mesh, settings=settings)
  assert len(shards) == SHARDS
  got_ids = [h for hyps in shards for h in hyps.ids.to_list()]
  got_scores = [s for hyps in shards for s in hyps.scores.to_list()]
  want_ids = expected.ids.to_list()
  assert len(got_ids) == len(want_ids) == len(batch.indices)
  for got, want in zip(got_ids, want_ids, strict=True):
    assert [h.tolist() for h in got] == [h.tolist() for h in want]
  assert_close(got_scores, expected.scores.to_list())
  # Per-source limits stacked like the batch give the same as the int.
  count = BUCKETS.capacity(0, "sequences")
  limits = np.full((SHARDS, count), 8)
  per_source = generate(
    (model, params),
    placed.fields[1],
    mesh,
    settings=dataclasses.replace(settings, max_length=9),
    max_lengths=shard_batch(limits, mesh),
  )
  flat = [h.tolist() for hyps in per_source for hs in hyps.ids.to_list() for h in hs]
  assert flat == [h.tolist() for hs in got_ids for h in hs]


def test_generate_corpus_equals_one_device(mesh):
  """Continuous refill with 2 slots on each of 4 devices gives each source
  what 8 slots on one device give it (ids identical, scores close)."""
  rng = np.random.default_rng(7)
  corpus = [rng.integers(0, VOCAB, size=n) for n in rng.integers(0, 8, size=30)]
  model = _seq2seq()
  src = LoDTensor.from_sequences([np.array([1, 2], np.int32)], dtype=np.int32)
  params = jax.jit(model.init)(jax.random.key(3), src, src)
  settings = DecodeSettings(
    bos_id=0, eos_id=1, max_length=8, beam_size=3, length_penalty=0.6
  )
  options = dict(
    src_capacity=8, refill=3, chunk=2, max_length_fn=lambda ids: min(8, len(ids) + 3)
  )
  want = list(
    ensemble_generate_corpus([(model, params)], corpus, settings, slots=8, **options)
  )
  stats = {}
  got = list(
    generate_corpus(
      (model, params), corpus, mesh, settings=settings, slots=2, stats=stats, **options
    )
  )
  assert len(got) == len(want) == len(corpus)
  for (ids, scores), (want_ids, want_scores) in zip(got, want, strict=True):
    assert [h.tolist() for h in ids] == [h.tolist() for h in want_ids]
    assert_close(scores, want_scores)
  assert stats["slot_steps"] % (SHARDS * 2) == 0


def test_generate_corpus_refuses_a_mesh_of_two_axes():
  two = jax.make_mesh((2, 2), ("data", "model"))
  with pytest.raises(ValueError, match="one axis 'data'"):
    generate_corpus(
      (_seq2seq(), {}),
      [],
      two,
      settings=DecodeSettings(bos_id=0, eos_id=1, max_length=4),
      src_capacity=2,
      slots=1,
    )


def test_generate_draws_per_shard_from_the_folded_keys(mesh):
  """With `rngs`, the device of shard ``s`` decodes as one device does with
  each key folded with ``s``: every shard holds the same two sources, and
  the shards' dropout masks, so their hypotheses, differ."""
  model, params = drop_seq2seq()
  examples = [(np.array([3, 1, 4]),), (np.array([1, 5]),)] * SHARDS
  buckets = Buckets.fixed(tokens=8, sequences=2, time=6)
  batcher = Batcher(examples, buckets, shards=SHARDS, shuffle=False, prefetch=0)
  batch = next(batcher.iterate())
  key = jax.random.key(7)
  shards = generate(
    (model, params),
    shard_batch(batch, mesh).fields[0],
    mesh,
    settings=DROP_SETTINGS,
    rngs={"dropout": key},
  )

  @jax.jit
  def one_device(src, key):
    return ensemble_generate(
      [(model, params)], src, DROP_SETTINGS, rngs={"dropout": key}
    )

  got = []
  for s, (hyps, src) in enumerate(zip(shards, unstack(batch.fields[0]), strict=True)):
    want = one_device(src, jax.random.fold_in(key, s))
    ids = [[h.tolist() for h in hs] for hs in hyps.ids.to_list()]
    assert ids == [[h.tolist() for h in hs] for hs in want.ids.to_list()]
    assert_close(hyps.scores.to_list(), want.scores.to_list())
    got.append(ids)
  assert len({str(ids) for ids in got}) > 1


def test_shards_must_match_the_devices(mesh):
  """A Batcher dealing 3 shards cannot go on 4 devices, nor 8 shards."""
  for shards in (3, 8):
    batcher = Batcher(_examples(), BUCKETS, shards=shards, prefetch=0)
    batch = next(batcher.iterate())
    with pytest.raises(
      ValueError,
      match=rf"Expected a batch of 4 shards \(the size of mesh axis 'data'\), "
      rf"got {shards} shards",
    ):
      shard_batch(batch, mesh)


def test_a_batch_of_more_shards_than_devices_raises(mesh):
  """4 shards put with `jax.device_put` on a 2-device mesh (not by
  `shard_batch`) would leave each device 2 shards, and `data_parallel` would
  count one of them: 10 of 20 rows. It raises at trace time instead."""
  small = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  examples = [(np.ones(n, np.float32),) for n in (5, 5, 5, 5)]
  buckets = Buckets.fixed(tokens=8, sequences=2, time=8)
  batch = next(
    Batcher(examples, buckets, shards=4, shuffle=False, prefetch=0).iterate()
  )
  fields = jax.device_put(batch.fields, NamedSharding(small, P("data")))
  rows = jax.jit(data_parallel(lambda fields: fields[0].num_rows, small))
  with pytest.raises(
    ValueError,
    match=r"one shard per device along mesh axis 'data' \(2\), got 4 shards",
  ):
    rows(fields)
  # On the mesh of 4, every row counts.
  assert (
    int(
      jax.jit(data_parallel(lambda f: f[0].num_rows, mesh))(
        shard_batch(batch, mesh).fields
      )
    )
    == 20
  )
