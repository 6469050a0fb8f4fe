"""Beam-search decoding time: per-source early exit against a batch-wide stop.

One attention encoder-decoder, one batch, decoded twice by
`jaxlod.nn.Seq2Seq.generate` (beam 4, one result per source):

* ``jaxlod``: the default ladder (``DecodeSettings(ladder=None)``). A source
  leaves the loop when it is done; between phases the live sources are
  compacted to a prefix and the loop moves to a smaller static size (64, 32,
  16, ... sources), so the cost follows the live sources.
* ``batchwide``: ``ladder=()``, one phase at full size: every source is
  stepped until all are done (the batch-wide stop of Flax's ``examples/wmt``
  loop), done sources frozen so the results are the same.

Both arms share every other setting (one `jaxlod.ops.DecodeSettings`, a
static argument of the jitted call) and differ only in ``ladder``.

``--plan`` sets the `jaxlod.ops.LoopPlan` of both arms' settings and of the
encoder: ``default`` passes none (the backend's `jaxlod.ops.default_plan`:
on a CPU the ladder of halvings and one step per ``while`` iteration, on a
GPU one phase and 8 steps), ``cpu`` is ``LoopPlan()`` and ``accelerator``
``default_plan("gpu")``, forced on any backend. Under a plan whose
``bodies`` is set, the ``batchwide`` arm runs that plan with one body
(``ladder=()`` and such a plan exclude each other), so with one body the
two arms run the same schedule. Several plans, comma-separated
(``--plan default,cpu``), are timed side by side in the same rounds: the
first one's arms are ``jaxlod`` and ``batchwide`` (the keys above), each
other's ``jaxlod_<plan>`` and ``batchwide_<plan>``, and ``plans`` gives
every plan's settings, times, compile times, ratios to the first plan's
``jaxlod`` and whether its hypotheses are identical to them.

The model: embeddings (256), an LSTM encoder (256), an LSTM decoder (256)
with additive (Bahdanau) attention over the encoder outputs, its initial
carry bridged from the pooled encoder outputs, an output projection,
vocabularies of 1000; random weights from ``init`` (seed 0), untrained.
The batch: 64 sources, 58 short (6 to 10 tokens) and 6 five times longer
(30 to 50 tokens), in random order, at a fixed capacity so each arm compiles
once.

Output lengths are set, not learned. Each source may generate twice its
length (``max_lengths`` per source, under a length capacity
``settings.max_length`` of 100), and the ``eos`` logit of the random model
is lowered by 100 (its bias in the ``output`` layer), so eos is never chosen
and every hypothesis runs to its source's max length: output lengths are
skewed like the sources (most 12 to 20 tokens, a few 60 to 100). The JSON
reports them (``output_lengths``, of the best hypotheses). (At this seed the
unshifted random model never picks eos either; the shift makes it certain.)
A trained model would end at data-dependent places; the timing depends only
on where each source stops.

Time: the median of interleaved runs of both arms in one process, each a
jitted call blocked on its results; compile (lower and compile, ahead of
time) is timed separately (an arm whose settings equal an earlier arm's
runs that arm's program, compiled once: ``same_program_as`` names it, and
its ``compile_s`` is that program's).
``identical``: token ids and offsets exactly
equal and scores within 1e-5 (absolute); ``met``: a speedup of at least
1.5 and identical results. ``decode_steps``: from a separate run of the
same model whose decoder step reports its batch size through
`jax.debug.callback` (not timed).

Usage: ``python -m benchmarks.decode [--repeats N] [--json PATH]
[--plan {default,cpu,accelerator}[,...]]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import machine_info, measure_interleaved, write_report
from jaxlod import Buckets, LoDTensor
from jaxlod.nn import AdditiveAttention, AttentionDecoder, DynamicRNN, Seq2Seq
from jaxlod.ops import DecodeSettings, LoopPlan, default_plan

HIDDEN = 256
EMBED = 256
UNITS = 256
VOCAB = 1000
BOS, EOS = 1, 2  # source tokens are drawn from [3, VOCAB)
EOS_SHIFT = -100.0  # added to the eos bias of the output layer
BATCH = 64
NUM_LONG = 6
SHORT = (6, 10)  # source lengths, inclusive
LONG_FACTOR = 5
OUTPUT_FACTOR = 2  # max_lengths = OUTPUT_FACTOR * source length
BEAM = 4
LENGTH_CAPACITY = OUTPUT_FACTOR * LONG_FACTOR * SHORT[1]
BUCKETS = Buckets.fixed(tokens=1024, sequences=BATCH, time=LONG_FACTOR * SHORT[1])
SCORE_TOLERANCE = 1e-5
TARGET = 1.5
# `--plan`: the `LoopPlan` of both arms (`None`: pass none, the backend's).
PLANS: dict[str, LoopPlan | None] = {
  "default": None,
  "cpu": LoopPlan(),
  "accelerator": default_plan("gpu"),
}

# -- the batch and the model --------------------------------------------------------


def source_lengths(seed: int = 0) -> np.ndarray:
  """Skewed lengths: most short, `NUM_LONG` of them `LONG_FACTOR` times longer."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(SHORT[0], SHORT[1] + 1, BATCH)
  long = rng.choice(BATCH, NUM_LONG, replace=False)
  lengths[long] *= LONG_FACTOR
  return lengths


def make_batch(seed: int = 0) -> tuple[LoDTensor, jax.Array]:
  """Source ids and each source's max output length ``[BATCH]``."""
  lengths = source_lengths(seed)
  rng = np.random.default_rng(seed + 1)
  seqs = [rng.integers(EOS + 1, VOCAB, n).astype(np.int32) for n in lengths]
  src = LoDTensor.from_sequences(seqs, buckets=BUCKETS, dtype=np.int32)
  return src, jnp.asarray(OUTPUT_FACTOR * lengths, jnp.int32)


def _plan_field(plan: LoopPlan | None) -> dict[str, LoopPlan]:
  """`plan` as a keyword argument, or none for `None` (the default)."""
  return {} if plan is None else {"plan": plan}


def make_model(cls: type[Seq2Seq] = Seq2Seq, plan: LoopPlan | None = None) -> Seq2Seq:
  """The model; `plan` runs its encoder (the parameters do not depend on it)."""
  return cls(
    src_vocab=VOCAB,
    tgt_vocab=VOCAB,
    embed_dim=EMBED,
    encoder=DynamicRNN(nn.LSTMCell(HIDDEN), **_plan_field(plan)),
    decoder=AttentionDecoder(nn.LSTMCell(HIDDEN), AdditiveAttention(UNITS)),
  )


def init_params(src: LoDTensor) -> Any:
  """Random weights, with the eos logit lowered by `EOS_SHIFT`."""
  params = make_model().init(jax.random.key(0), src, src)
  bias = params["params"]["output"]["bias"]
  params["params"]["output"]["bias"] = bias.at[EOS].add(EOS_SHIFT)
  return params


def settings(
  ladder: tuple[int, ...] | None, plan: LoopPlan | None = None
) -> DecodeSettings:
  """One arm's settings: beam `BEAM`, one result, length capacity
  `LENGTH_CAPACITY`; `ladder` ``None`` (compaction) or ``()`` (batch-wide),
  under `plan` (`None`: the backend's). A batch-wide arm under a plan with
  `bodies` set runs it with one body (the plan's batch-wide stop), since
  `DecodeSettings` takes a ladder or such a plan, not both."""
  if plan is not None and plan.bodies is not None and ladder == ():
    ladder, plan = None, dataclasses.replace(plan, bodies=1)
  return DecodeSettings(
    bos_id=BOS,
    eos_id=EOS,
    max_length=LENGTH_CAPACITY,
    beam_size=BEAM,
    num_results=1,
    ladder=ladder,
    **_plan_field(plan),
  )


def decoder(
  ladder: tuple[int, ...] | None,
  cls: type[Seq2Seq] = Seq2Seq,
  plan: LoopPlan | None = None,
):
  """The jitted decoding call of one arm: ``(params, src, max_lengths) -> ids``."""
  model = make_model(cls, plan)
  arm = settings(ladder, plan)

  def generate(params, src, max_lengths):
    return model.apply(params, src, arm, method="generate", max_lengths=max_lengths)

  return jax.jit(generate)


ARMS: dict[str, tuple[int, ...] | None] = {"jaxlod": None, "batchwide": ()}

# -- measurements -------------------------------------------------------------------


class _CountingSeq2Seq(Seq2Seq):
  """`Seq2Seq` whose decoder step reports its batch size (rows: sources x beams)."""

  def decode_step(self, carry, tokens, memory):
    rows = jnp.shape(tokens)[0]
    jax.debug.callback(lambda: _STEP_ROWS.append(rows))
    return super().decode_step(carry, tokens, memory)


_STEP_ROWS: list[int] = []


def count_steps(
  params: Any, src: LoDTensor, max_lengths: jax.Array, plan: LoopPlan | None = None
) -> dict[str, Any]:
  """Loop steps and source steps of each arm, from an instrumented run (a
  step past a loop's end that its plan masks counts too)."""
  out = {}
  for arm, ladder in ARMS.items():
    _STEP_ROWS.clear()
    call = decoder(ladder, _CountingSeq2Seq, plan)
    jax.block_until_ready(call(params, src, max_lengths))
    jax.effects_barrier()
    out[arm] = {
      "loop_steps": len(_STEP_ROWS),
      "source_steps": sum(_STEP_ROWS) // BEAM,
      "step_sizes": sorted(set(r // BEAM for r in _STEP_ROWS), reverse=True),
    }
  return out


def compare(a: Any, b: Any) -> dict[str, Any]:
  """Exact ids and offsets, scores within `SCORE_TOLERANCE` (absolute)."""
  same_ids = bool(np.array_equal(a.ids.values, b.ids.values)) and all(
    np.array_equal(x, y) for x, y in zip(a.ids.offsets, b.ids.offsets, strict=True)
  )
  same_ids &= int(a.ids.num_outer) == int(b.ids.num_outer)
  diff = float(np.max(np.abs(np.asarray(a.scores.values - b.scores.values))))
  return {
    "identical": same_ids and diff <= SCORE_TOLERANCE,
    "ids_equal": same_ids,
    "score_max_abs_diff": diff,
    "score_max_abs": float(np.max(np.abs(np.asarray(a.scores.values)))),
  }


def summary(lengths: np.ndarray) -> dict[str, Any]:
  return {
    "mean": float(lengths.mean()),
    "p50": float(np.median(lengths)),
    "p90": float(np.percentile(lengths, 90)),
    "max": int(lengths.max()),
    "min": int(lengths.min()),
  }


def output_lengths(hyps: Any) -> dict[str, Any]:
  """Lengths of the best hypothesis of each source (eos excluded)."""
  return summary(np.asarray([len(h[0]) for h in hyps.ids.to_list()]))


def arm_name(arm: str, plan: str, first: str) -> str:
  """``jaxlod``/``batchwide`` for the first plan, else suffixed with the plan."""
  return arm if plan == first else f"{arm}_{plan}"


def plan_summary(
  plans: list[str], times: dict, compile_s: dict, results: dict
) -> dict[str, Any]:
  """Each plan's settings, times, compile times, ratios to the first plan's
  ``jaxlod`` and whether its hypotheses are identical to them."""
  reference = times["jaxlod"]["median_s"]
  out = {}
  for plan in plans:
    entry: dict[str, Any] = {}
    for arm, ladder in ARMS.items():
      name = arm_name(arm, plan, plans[0])
      arm_settings = settings(ladder, PLANS[plan])
      entry[arm] = {
        "arm": name,
        "ladder": arm_settings.ladder,
        "plan": _asdict(arm_settings.plan),
        "s": times[name]["median_s"],
        "compile_s": compile_s[name],
        "ratio_to_first_jaxlod": times[name]["median_s"] / reference,
        "identical_to_first_jaxlod": compare(results[name], results["jaxlod"])[
          "identical"
        ],
      }
    out[plan] = {"given": _asdict(PLANS[plan]), **entry}
  return out


def _asdict(plan: LoopPlan | None) -> dict[str, Any] | None:
  return None if plan is None else dataclasses.asdict(plan)


def run(repeats: int, plans: tuple[str, ...] = ("default",)) -> dict[str, Any]:
  start = time.perf_counter()
  machine = machine_info()
  src, max_lengths = make_batch()
  params = init_params(src)
  arms = {
    arm_name(arm, plan, plans[0]): (ladder, PLANS[plan])
    for plan in plans
    for arm, ladder in ARMS.items()
  }
  # Arms of equal settings and plan run one program, compiled once.
  compiled, compile_s, programs, shared = {}, {}, {}, {}
  for name, (ladder, plan) in arms.items():
    key = (settings(ladder, plan), plan)
    if key in programs:
      shared[name] = programs[key]
      compiled[name] = compiled[shared[name]]
      compile_s[name] = compile_s[shared[name]]
      continue
    tic = time.perf_counter()
    call = decoder(ladder, plan=plan)
    compiled[name] = call.lower(params, src, max_lengths).compile()
    compile_s[name] = time.perf_counter() - tic
    programs[key] = name
  calls = {
    name: (
      lambda name=name: compiled[name](params, src, max_lengths),
      jax.block_until_ready,
    )
    for name in arms
  }
  times = measure_interleaved(calls, repeats)
  results = {name: compiled[name](params, src, max_lengths) for name in arms}
  jaxlod_s = times["jaxlod"]["median_s"]
  batchwide_s = times["batchwide"]["median_s"]
  same = compare(results["jaxlod"], results["batchwide"])
  report: dict[str, Any] = {
    "jaxlod_s": jaxlod_s,
    "batchwide_s": batchwide_s,
    "speedup": batchwide_s / jaxlod_s,
    "identical": same["identical"],
    "target": TARGET,
    "met": batchwide_s / jaxlod_s >= TARGET and same["identical"],
    "ids_equal": same["ids_equal"],
    "score_max_abs_diff": same["score_max_abs_diff"],
    "score_max_abs": same["score_max_abs"],
    "score_tolerance": SCORE_TOLERANCE,
    "compile_s": compile_s,
    "same_program_as": shared,
    "times_s": {name: times[name]["times_s"] for name in arms},
    "decode_steps": count_steps(params, src, max_lengths, PLANS[plans[0]]),
    "output_lengths": output_lengths(results["jaxlod"]),
    "source_lengths": summary(source_lengths()),
    "plan": {"name": plans[0], "plan": _asdict(PLANS[plans[0]])},
    "plans": plan_summary(list(plans), times, compile_s, results),
    "setup": {
      "model": f"Seq2Seq LSTM {HIDDEN}, additive attention {UNITS}, embed {EMBED}, "
      f"vocab {VOCAB}/{VOCAB}, random weights (seed 0)",
      "eos_bias_shift": EOS_SHIFT,
      "batch": BATCH,
      "beam_size": BEAM,
      "num_results": 1,
      "max_length": f"{OUTPUT_FACTOR} x source length",
      "length_capacity": LENGTH_CAPACITY,
    },
    "machine": machine,
    "repeats": repeats,
  }
  report["wall_s"] = time.perf_counter() - start
  return report


def plan_names(parser: argparse.ArgumentParser, value: str) -> tuple[str, ...]:
  """The comma-separated names of ``--plan``, each a key of `PLANS`, once."""
  names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
  unknown = [n for n in names if n not in PLANS]
  if unknown or not names:
    parser.error(f"--plan: choose from {list(PLANS)}, got {value!r}")
  return names


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", type=Path, default=None, help="also write here")
  parser.add_argument(
    "--plan",
    default="default",
    help="the LoopPlan of the settings and the encoder, one of "
    f"{', '.join(PLANS)}, or several comma-separated, timed side by side "
    "(default: default, which passes none)",
  )
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  write_report(run(args.repeats, plan_names(parser, args.plan)), args.json)


if __name__ == "__main__":
  main()
