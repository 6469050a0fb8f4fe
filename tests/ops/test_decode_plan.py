"""`DecodeSettings.plan`: beam search and greedy decoding under every plan.

A plan changes how the decoding loop runs (its phases, and the steps per
`lax.while_loop` iteration), never what it finds: the accelerator plans are
forced on the CPU here and must give the hypotheses of `LoopPlan()`, with
per-source max lengths, a length penalty, padding sources and under `jit`.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.timing import xla_compiles
from jaxlod.ops import DecodeSettings, LoopPlan, beam_search, default_plan
from tests.ops.test_decode import BOS, EOS, eos_shy, sources, step

ACCELERATOR = default_plan("gpu")
PLANS = {
  "one_body": LoopPlan(bodies=1),
  "one_body_chunk4": LoopPlan(bodies=1, chunk=4),
  "ladder_chunk3": LoopPlan(chunk=3),
  "two_bodies_chunk8": LoopPlan(bodies=2, chunk=8),
  "accelerator": ACCELERATOR,
}
COUNT, CAPACITY = 8, 6


def settings(k=3, plan=None, ladder=None, num_results=None):
  return DecodeSettings(
    bos_id=BOS,
    eos_id=EOS,
    max_length=CAPACITY,
    beam_size=k,
    length_penalty=0.6,
    num_results=num_results,
    ladder=ladder,
    plan=plan,
  )


@functools.partial(jax.jit, static_argnames=("settings",))
def search(init, bias, max_lengths, settings):
  # `eos_shy`: hypotheses of every length, ended by eos or at their limit.
  return beam_search(
    eos_shy, init, settings, static_inputs=bias, max_lengths=max_lengths, num_sources=7
  )


def _batch(seed=1):
  init, bias = sources(COUNT, seed=seed)
  lengths = np.random.default_rng(seed).integers(1, CAPACITY + 1, size=COUNT)
  return init, bias, jnp.asarray(lengths, jnp.int32)


def _same(got, want):
  """Identical hypotheses (ids and LoD), scores equal up to rounding (the
  steps of other ladders run at other batch sizes)."""
  assert got.ids.recursive_lengths() == want.ids.recursive_lengths()
  np.testing.assert_array_equal(np.asarray(got.ids.values), np.asarray(want.ids.values))
  np.testing.assert_allclose(
    np.asarray(got.scores.values), np.asarray(want.scores.values), rtol=1e-6
  )


@pytest.mark.parametrize(("k", "num_results"), [(1, None), (3, 2)])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_every_plan_gives_the_hypotheses_of_the_cpu_plan(plan, k, num_results):
  init, bias, lengths = _batch()
  want = search(init, bias, lengths, settings(k, LoopPlan(), num_results=num_results))
  got = search(init, bias, lengths, settings(k, PLANS[plan], num_results=num_results))
  _same(got, want)
  # Hypotheses of several lengths: ended by eos, or at their source's limit.
  ids = got.ids.to_list()
  assert {1, 2, 3, 4, 5} <= {len(h) for source in ids for h in source}
  assert [len(source) for source in ids] == [num_results or k] * 7  # 7 real sources


def _traced(decode_settings):
  """``(step calls, batch sizes, while loops, scans)`` of tracing
  `beam_search` (each phase: one `while`, with an inner loop of static trip
  count, a `scan`, per chunk of steps)."""
  sizes = []

  def recording(h, tokens, static):
    sizes.append(tokens.shape[0])
    return step(h, tokens, static)

  init, bias, _ = _batch()
  jaxpr = str(
    jax.make_jaxpr(
      lambda init, bias: (
        beam_search(recording, init, decode_settings, static_inputs=bias).ids.values
      )
    )(init, bias)
  )
  distinct = sorted(set(sizes[1:]), reverse=True)  # past the probe
  # One `scan` outside the loop, whatever the plan.
  return len(sizes) - 1, distinct, jaxpr.count("while["), jaxpr.count("scan[") - 1


@pytest.mark.parametrize(
  ("ladder", "plan", "sizes"),
  [
    (None, LoopPlan(), [16, 8, 4, 2]),  # halvings of 8 sources, beam 2
    (None, LoopPlan(bodies=1, chunk=4), [16]),
    (None, LoopPlan(bodies=2, chunk=3), [16, 8]),  # not rounded to 8 sources
    (None, LoopPlan(bodies=9), [16, 8, 4, 2]),  # at most the halvings
    ((8, 2), LoopPlan(chunk=2), [16, 4]),  # an explicit ladder wins
    ((), LoopPlan(chunk=5), [16]),
  ],
)
def test_the_plan_sets_the_phases_and_the_steps_per_iteration(ladder, plan, sizes):
  # The step is traced once per phase, chunks or not.
  phases = len(sizes)
  chunks = phases if plan.chunk > 1 else 0
  assert _traced(settings(2, plan, ladder)) == (phases, sizes, phases, chunks)


def test_no_plan_is_the_backends_plan():
  for ladder in (None, (8, 2)):
    default = _traced(settings(2, None, ladder))
    backend = default_plan()
    if ladder is not None:
      backend = LoopPlan(chunk=backend.chunk)
    assert default == _traced(settings(2, backend, ladder))


def test_settings_with_a_plan_are_static_and_hashable():
  a, b = settings(plan=LoopPlan(bodies=1, chunk=4)), settings(plan=ACCELERATOR)
  assert a == settings(plan=LoopPlan(bodies=1, chunk=4))
  assert hash(a) == hash(settings(plan=LoopPlan(bodies=1, chunk=4)))
  assert len({a, b, settings()}) == 3
  assert settings(ladder=[8, 2], plan=LoopPlan(chunk=2)).ladder == (8, 2)


@pytest.mark.parametrize(
  ("changes", "error", "match"),
  [
    (
      dict(plan="gpu"),
      TypeError,
      r"Expected `plan` to be a jaxlod.ops.LoopPlan or None, got str\.",
    ),
    (
      dict(plan=3),
      TypeError,
      r"Expected `plan` to be a jaxlod.ops.LoopPlan or None, got int\.",
    ),
    (
      dict(plan=LoopPlan(bodies=2), ladder=(8, 4)),
      ValueError,
      r"Got both `ladder` \(8, 4\) and `plan` with bodies=2; pass one",
    ),
    (
      dict(plan=LoopPlan(bodies=1), ladder=()),
      ValueError,
      r"Got both `ladder` \(\) and `plan` with bodies=1",
    ),
  ],
)
def test_decode_settings_rejects_bad_plans(changes, error, match):
  fields = dict(bos_id=1, eos_id=2, max_length=5)
  with pytest.raises(error, match=match):
    DecodeSettings(**(fields | changes))


def test_an_accelerator_plan_compiles_once_per_capacity():
  traces = []
  decode_settings = settings(2, ACCELERATOR)

  @jax.jit
  def decode(init, bias, lengths):
    traces.append(1)
    return beam_search(
      step, init, decode_settings, static_inputs=bias, max_lengths=lengths
    )

  compiles = collections.Counter()  # XLA compilations after the first call
  for seed in range(3):
    init, bias, lengths = _batch(seed)
    with xla_compiles() as counted:
      decode(init, bias, lengths).ids.values.block_until_ready()
    if seed:
      compiles.update(counted)
  assert len(traces) == 1
  assert sum(compiles.values()) == 0, compiles  # none after the first call
