"""`AttentionDecoder.plan` (Linen and NNX) and `Seq2Seq.generate` under forced
accelerator plans.

A plan changes how the loops run (their bodies, and the steps per
`lax.while_loop` iteration), never their results: the teacher-forced
outputs and gradients of every plan are those of `LoopPlan()` (float32 to
round-off, float64 tightly), and decoding under the accelerator's plan
finds the hypotheses of the CPU's, with one compile per capacity.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlod.nn as linen
import jaxlod.nn.nnx as twin
from jaxlod import Buckets, LoDTensor
from jaxlod.ops import DecodeSettings, LoopPlan, default_plan
from tests.helpers import assert_close
from tests.nn.test_twins import SRC, SRC_VOCAB, TGT_IN, TGT_VOCAB, _copy, _ids

ACCELERATOR = default_plan("gpu")
# One body with the last iteration's extra steps masked; the rank table's
# ladder (7, 4) with three steps per iteration in each phase.
PLANS = {"one_body_chunk4": LoopPlan(bodies=1, chunk=4), "chunk3": LoopPlan(chunk=3)}
HIDDEN, FEATURES, INPUTS, UNITS = 4, 4, 3, 5
TGT_LENGTHS, SRC_LENGTHS = [2, 4, 0, 3, 1, 5], [3, 0, 5, 2, 1, 4]
TGT_BUCKETS = Buckets.fixed(tokens=16, sequences=7, time=5)
SRC_BUCKETS = Buckets.fixed(tokens=16, sequences=7, time=6)
# float32: the outputs to round-off, the gradients (sums over steps) looser.
F32 = ({"rtol": 1e-5, "atol": 1e-5}, {"rtol": 1e-4, "atol": 1e-5})
F64 = ({"rtol": 1e-12, "atol": 1e-12}, {"rtol": 1e-10, "atol": 1e-10})


def _lod(lengths, width, buckets, seed, dtype):
  rng = np.random.default_rng(seed)
  seqs = [rng.normal(size=(n, width)) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=buckets, dtype=dtype)


def _inputs(dtype):
  tgt = _lod(TGT_LENGTHS, INPUTS, TGT_BUCKETS, 1, dtype)
  return tgt, _lod(SRC_LENGTHS, FEATURES, SRC_BUCKETS, 2, dtype)


def _loss(ys, ws):
  scale = 1 + jnp.arange(ys.size).reshape(ys.shape) % 3
  return jnp.sum(jnp.sin(ys) * scale) + jnp.sum(ws * jnp.arange(ws.shape[-1]))


def _value_and_grads(call, state, tgt, memory):
  """``((loss, (ys, ws)), grads)`` of ``call(state, tgt, memory)`` as a
  function of `state` and both inputs' values, jitted."""

  def loss(state, tgt_values, memory_values):
    ys, ws = call(state, tgt.with_values(tgt_values), memory.with_values(memory_values))
    return _loss(ys.values, ws.values), (ys.values, ws.values)

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  return jax.jit(grad)(state, tgt.values, memory.values)


def _linen_runs(dtype):
  """Per plan (`LoopPlan()` first): the Linen decoder's values and grads."""
  decoder = linen.AttentionDecoder(
    nn.GRUCell(HIDDEN, param_dtype=dtype),
    linen.AdditiveAttention(UNITS, param_dtype=dtype),
    input_feeding=True,
  )
  tgt, memory = _inputs(dtype)
  params = jax.jit(decoder.init)(jax.random.key(0), tgt, memory)
  runs = []
  for plan in (LoopPlan(), *PLANS.values()):
    module = decoder.clone(plan=plan)

    def call(params, tgt, memory, module=module):
      return module.apply(params, tgt, memory, return_weights=True)

    runs.append(_value_and_grads(call, params, tgt, memory))
  return runs


def _nnx_runs(dtype):
  """Per plan (`LoopPlan()` first): the NNX decoder's values and grads, the
  decoders sharing one cell and one attention."""
  rngs = nnx.Rngs(0)
  cell = nnx.GRUCell(INPUTS + FEATURES, HIDDEN, param_dtype=dtype, rngs=rngs)
  attention = twin.AdditiveAttention(
    HIDDEN, FEATURES, UNITS, param_dtype=dtype, rngs=rngs
  )
  tgt, memory = _inputs(dtype)
  runs = []
  for plan in (LoopPlan(), *PLANS.values()):
    decoder = twin.AttentionDecoder(cell, attention, input_feeding=True, plan=plan)
    graphdef, state = nnx.split(decoder)

    def call(state, tgt, memory, graphdef=graphdef):
      return nnx.merge(graphdef, state)(tgt, memory, return_weights=True)

    runs.append(_value_and_grads(call, state, tgt, memory))
  return runs


def _assert_same_runs(runs, tolerances):
  values, grads = tolerances
  ((want_loss, want_outputs), want_grads), *others = runs
  for (loss, outputs), grads_ in others:
    assert_close(outputs, want_outputs, **values)
    assert_close(loss, want_loss, **values)
    assert_close(jax.tree.leaves(grads_), jax.tree.leaves(want_grads), **grads)


@pytest.mark.parametrize("runs", [_linen_runs, _nnx_runs], ids=["linen", "nnx"])
def test_every_plan_gives_the_decoders_outputs_and_gradients_float32(runs):
  _assert_same_runs(runs(jnp.float32), F32)


@pytest.mark.parametrize("runs", [_linen_runs, _nnx_runs], ids=["linen", "nnx"])
def test_every_plan_gives_the_decoders_outputs_and_gradients_float64(runs):
  with jax.enable_x64(True):
    results = runs(jnp.float64)
    assert results[0][0][1][0].dtype == jnp.float64
    _assert_same_runs(results, F64)


def test_the_plan_reaches_the_loop():
  """One body: one `while` forward (and one backward), where the table's
  ladder has two."""
  tgt, memory = _inputs(np.float32)
  decoder = linen.AttentionDecoder(nn.GRUCell(HIDDEN), linen.DotAttention())
  params = jax.jit(decoder.init)(jax.random.key(0), tgt, memory)
  for plan, whiles in ((LoopPlan(), 2), (PLANS["one_body_chunk4"], 1)):
    apply = decoder.clone(plan=plan).apply
    assert str(jax.make_jaxpr(apply)(params, tgt, memory)).count("while[") == whiles


# -- bad plans ----------------------------------------------------------------------


def test_a_decoder_plan_must_be_a_loop_plan():
  tgt, memory = _inputs(np.float32)
  match = r"Expected `plan` to be a jaxlod.ops.LoopPlan or None, got int\."
  decoder = linen.AttentionDecoder(nn.GRUCell(HIDDEN), linen.DotAttention(), plan=3)
  with pytest.raises(TypeError, match=match):
    decoder.init(jax.random.key(0), tgt, memory)
  cell = nnx.GRUCell(INPUTS, HIDDEN, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=match):
    twin.AttentionDecoder(cell, twin.DotAttention(), plan=3)


def test_a_decoder_ladder_and_a_plan_with_bodies_conflict():
  tgt, memory = _inputs(np.float32)
  match = r"Got both `ladder` \(7, 3\) and `plan` with bodies=1; pass one"
  plan, ladder = LoopPlan(bodies=1), (7, 3)
  decoder = linen.AttentionDecoder(
    nn.GRUCell(HIDDEN), linen.DotAttention(), ladder=ladder, plan=plan
  )
  with pytest.raises(ValueError, match=match):
    decoder.init(jax.random.key(0), tgt, memory)
  cell = nnx.GRUCell(INPUTS, HIDDEN, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    twin.AttentionDecoder(cell, twin.DotAttention(), ladder=ladder, plan=plan)


# -- Seq2Seq.generate ------------------------------------------------------------------


def settings(beam_size=3, plan=None):
  return DecodeSettings(
    bos_id=0, eos_id=1, max_length=5, beam_size=beam_size, plan=plan
  )


@functools.cache
def _models():
  """A small Linen `Seq2Seq` (LSTMs, whose parameters the twins name alike;
  dot attention), its variables, and its NNX twin on the same parameters."""
  module = linen.Seq2Seq(
    SRC_VOCAB,
    TGT_VOCAB,
    INPUTS,
    linen.DynamicRNN(nn.LSTMCell(HIDDEN)),
    linen.AttentionDecoder(nn.LSTMCell(HIDDEN), linen.DotAttention()),
  )
  rngs = nnx.Rngs(0)
  ours = twin.Seq2Seq(
    SRC_VOCAB,
    TGT_VOCAB,
    INPUTS,
    twin.DynamicRNN(nnx.LSTMCell(INPUTS, HIDDEN, rngs=rngs)),
    twin.AttentionDecoder(nnx.LSTMCell(INPUTS, HIDDEN, rngs=rngs), twin.DotAttention()),
    features=HIDDEN,
    rngs=rngs,
  )
  variables = jax.jit(module.init)(jax.random.key(0), SRC, TGT_IN)
  _copy(variables["params"], ours)
  return module, variables, ours


TRACES = []


@functools.partial(jax.jit, static_argnames=("search",))
def linen_generate(variables, src, search):
  TRACES.append(search)
  return _models()[0].apply(variables, src, search, method="generate")


def _same_hypotheses(got, want):
  assert got.ids.recursive_lengths() == want.ids.recursive_lengths()
  np.testing.assert_array_equal(np.asarray(got.ids.values), np.asarray(want.ids.values))
  assert_close(got.scores.values, want.scores.values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beam_size", [3, 1], ids=["beam", "greedy"])
def test_generate_under_the_accelerator_plan_finds_the_same_hypotheses(beam_size):
  _, variables, ours = _models()
  want = linen_generate(variables, SRC, settings(beam_size, LoopPlan()))
  assert [len(h) for h in want.ids.to_list()] == [beam_size] * 4
  got = linen_generate(variables, SRC, settings(beam_size, ACCELERATOR))
  _same_hypotheses(got, want)
  if beam_size == 1:
    return
  search = settings(beam_size, ACCELERATOR)
  _same_hypotheses(nnx.jit(lambda m: m.generate(SRC, search))(ours), want)


def test_generate_under_the_accelerator_plan_compiles_once_per_capacity():
  _, variables, _ = _models()
  search = settings(3, ACCELERATOR)
  batches = [SRC] + [
    _ids(lengths, SRC_VOCAB, seed)
    for seed, lengths in enumerate([[1, 5, 2, 4], [5, 5, 0, 3], [2, 2]])
  ]
  linen_generate(variables, batches[0], search)
  traces, programs = len(TRACES), linen_generate._cache_size()
  for src in batches[1:]:
    out = linen_generate(variables, src, search)
    assert len(out.ids.to_list()) == src.num_sequences(-1)
  assert len(TRACES) == traces
  assert linen_generate._cache_size() == programs
