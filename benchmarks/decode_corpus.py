"""Decoding a whole corpus: continuous refill against per-batch decoding.

The G2P example's default model (`examples.g2p.model.Config()`), trained
here for ``--train-steps`` steps (default 200, seed 0; ``test_per`` and
``test_wer`` say how far), decodes every word of the test split with beam
4 (`m.search_settings`: per-word max lengths of the letters plus
`m.LENGTH_MARGIN`, the length penalty 0.6) in three arms, in one process:

* ``compaction``: today's per-batch decoding, `Seq2Seq.generate` over the
  example's batches of ``config.decode_words`` words with their host rank
  tables (`examples.g2p.decoding.predict`), the default ladder compacting
  the live words between phases;
* ``batchwide``: the same with ``ladder=()``, every step at the batch's
  full count until its last word is done;
* ``refill``: `Seq2Seq.generate_corpus`, ``--slots`` words in flight,
  ``--refill`` new words encoded into freed slots between chunks of
  ``--chunk`` steps.

One call of an arm decodes the whole test set. Times are medians of
interleaved calls (`benchmarks.timing.measure_interleaved`), and
``words_per_s`` is the words over the median; ``speedup`` is refill's
words per second over an arm's, ``paired_speedup`` the median over the
rounds of the per-round ratio. ``compile_s`` is an arm's first call less
its median (every arm compiles on its first call); ``compile_ratio`` is
refill's over ``compaction``'s (`Seq2Seq.generate` at the same
capacities). ``programs`` counts the compilations of each of refill's
jitted programs over its first call (one per program: one per capacity
for the whole corpus), ``xla_compiles`` every XLA compilation during it,
small eager conversions included (by name in ``xla_compiles_by_name``),
and ``second_call_xla_compiles`` those of a second call (none: the programs
are cached across calls). ``occupancy`` is refill's
real source-steps over its slot-steps. ``identical``: each arm's ids equal
``compaction``'s exactly and its scores within 1e-5 (absolute).

Usage: ``python -m benchmarks.decode_corpus [--train-steps N] [--repeats N]
[--slots N] [--refill N] [--chunk N] [--json PATH]``. Progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

from benchmarks.g2p_options import per_batch_decoder, pretrain
from benchmarks.timing import (
  machine_info,
  measure_interleaved,
  write_report,
  xla_compiles,
)
from examples.g2p import data
from examples.g2p import model as m
from jaxlod.data import Batcher

SCORE_TOLERANCE = 1e-5
# The jitted programs of `Seq2Seq.generate_corpus`, by the names XLA compiles.
PROGRAMS = tuple(
  f"jit({name})" for name in ("_encode_corpus", "start", "insert", "advance", "harvest")
)
TARGETS = {"speedup_over_compaction": 1.3, "occupancy": 0.9, "compile_ratio": 1.5}


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _hypotheses(batches: list, outputs: list, words: int) -> list:
  """Per word, ``(ids, scores)`` of the per-batch outputs, in word order."""
  out: list = [None] * words
  for batch, hyps in zip(batches, jax.device_get(outputs), strict=True):
    ids, scores = hyps.ids.to_list(), hyps.scores.to_list()
    for i, word_ids, word_scores in zip(batch.indices, ids, scores, strict=True):
      out[i] = ([np.asarray(h) for h in word_ids], np.asarray(word_scores))
  return out


def compare(a: list, b: list) -> dict[str, Any]:
  """Exact ids per word, scores within `SCORE_TOLERANCE`."""
  ids_equal, diff = True, 0.0
  for (ids_a, scores_a), (ids_b, scores_b) in zip(a, b, strict=True):
    ids_equal &= len(ids_a) == len(ids_b) and all(
      np.array_equal(x, y) for x, y in zip(ids_a, ids_b, strict=True)
    )
    if len(scores_a) == len(scores_b) and len(scores_a):
      diff = max(diff, float(np.max(np.abs(scores_a - scores_b))))
  return {
    "identical": ids_equal and diff <= SCORE_TOLERANCE,
    "ids_equal": ids_equal,
    "score_max_abs_diff": diff,
  }


def _paired(timing: dict[str, Any], arm: str, other: str) -> float:
  """The median over the rounds of ``other``'s time over ``arm``'s."""
  pairs = zip(timing[other]["times_s"], timing[arm]["times_s"], strict=True)
  return statistics.median(o / a for o, a in pairs)


def run(
  train_steps: int, repeats: int, slots: int, refill: int, chunk: int
) -> dict[str, Any]:
  start = time.perf_counter()
  machine = machine_info()
  config = m.Config()
  corpus = data.load_corpus(config)
  num_phones = len(corpus.phones)
  _log(f"training {train_steps} steps")
  params = m.eval_params(config, *pretrain(config, corpus, train_steps))
  pairs = corpus.splits["test"]
  sources = [corpus.letters.encode(w) for w, _ in pairs]
  batcher = Batcher(
    [(s,) for s in sources],
    m.batch_buckets(config.decode_words),
    shuffle=False,
    window=len(sources),
    tables=data.HOST_TABLES,
  )
  batches = list(batcher.epoch(0))
  model = m.build_model(config, num_phones)
  settings = m.search_settings(config.beam, m.TIME_CAPACITY, None)
  per_batch = {
    "compaction": per_batch_decoder(config, num_phones, None, None),
    "batchwide": per_batch_decoder(config, num_phones, (), None),
  }
  stats: dict[str, Any] = {}

  def decode_batches(arm: str) -> list:
    return [per_batch[arm](params, b.fields[0], b.tables[0]) for b in batches]

  def decode_refill() -> list:
    return list(
      model.apply(
        params,
        sources,
        settings,
        method="generate_corpus",
        src_capacity=m.TIME_CAPACITY,
        slots=slots,
        refill=refill,
        chunk=chunk,
        max_length_fn=lambda ids: len(ids) + m.LENGTH_MARGIN,
        stats=stats,
      )
    )

  _log("refill: first call (compiling)")
  with xla_compiles() as first:
    tic = time.perf_counter()
    decode_refill()
    refill_first_s = time.perf_counter() - tic
  with xla_compiles() as second:
    decode_refill()
  programs = {name: first[name] for name in PROGRAMS}
  _log(f"refill compiled {dict(first)}; a second call compiled {dict(second)}")
  calls = {
    "compaction": (lambda: decode_batches("compaction"), jax.block_until_ready),
    "batchwide": (lambda: decode_batches("batchwide"), jax.block_until_ready),
    "refill": (decode_refill, lambda out: out),
  }
  timing = measure_interleaved(calls, repeats)
  # The refill arm compiled above: its first call is the one before.
  timing["refill"]["first_call_s"] = refill_first_s
  timing["refill"]["compile_s"] = max(refill_first_s - timing["refill"]["median_s"], 0)
  words = len(sources)
  results = {
    "compaction": _hypotheses(batches, decode_batches("compaction"), words),
    "batchwide": _hypotheses(batches, decode_batches("batchwide"), words),
    "refill": decode_refill(),
  }
  best = [corpus.phones.decode(ids[0]) for ids, _ in results["compaction"]]
  per, wer = data.error_rates([p for _, p in pairs], best)
  arms = {}
  for arm in calls:
    arms[arm] = {
      "median_s": timing[arm]["median_s"],
      "words_per_s": words / timing[arm]["median_s"],
      "compile_s": timing[arm]["compile_s"],
      "times_s": timing[arm]["times_s"],
    }
  speedup = {
    other: arms["refill"]["words_per_s"] / arms[other]["words_per_s"]
    for other in per_batch
  }
  paired = {other: _paired(timing, "refill", other) for other in per_batch}
  same = {
    arm: compare(results["compaction"], results[arm]) for arm in ("batchwide", "refill")
  }
  compile_ratio = arms["refill"]["compile_s"] / arms["compaction"]["compile_s"]
  measured = {
    "speedup_over_compaction": speedup["compaction"],
    "occupancy": stats["occupancy"],
    "compile_ratio": compile_ratio,
  }
  return {
    "arms": arms,
    "speedup": speedup,
    "paired_speedup": paired,
    "occupancy": stats["occupancy"],
    "refill_stats": dict(stats),
    "compile_ratio": compile_ratio,
    "programs": programs,
    "xla_compiles": sum(first.values()),
    "xla_compiles_by_name": dict(first),
    "second_call_xla_compiles": sum(second.values()),
    "same_as_compaction": same,
    "identical": all(s["identical"] for s in same.values()),
    "targets": TARGETS,
    "meets_targets": {
      "speedup_over_compaction": measured["speedup_over_compaction"]
      >= TARGETS["speedup_over_compaction"],
      "occupancy": measured["occupancy"] >= TARGETS["occupancy"],
      "compile_ratio": measured["compile_ratio"] <= TARGETS["compile_ratio"],
      "one_program_each": all(n == 1 for n in programs.values())
      and not sum(second.values()),
      "identical": all(s["identical"] for s in same.values()),
    },
    "setup": {
      "config": "examples.g2p.model.Config() (the default preset)",
      "train_steps": train_steps,
      "split": "test",
      "words": words,
      "batches": len(batches),
      "batch_words": config.decode_words,
      "beam": config.beam,
      "slots": slots,
      "refill": refill,
      "chunk": chunk,
      "test_per": per,
      "test_wer": wer,
    },
    "score_tolerance": SCORE_TOLERANCE,
    "repeats": repeats,
    "machine": machine,
    "wall_s": time.perf_counter() - start,
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--train-steps", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=7, help="timed rounds")
  parser.add_argument("--slots", type=int, default=128, help="refill's slots")
  parser.add_argument("--refill", type=int, default=64, help="refill's batch")
  parser.add_argument("--chunk", type=int, default=2, help="refill's steps a chunk")
  parser.add_argument("--json", help="also write the report here")
  args = parser.parse_args(argv)
  for name in ("train_steps", "repeats", "slots", "refill", "chunk"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1")
  report = run(args.train_steps, args.repeats, args.slots, args.refill, args.chunk)
  write_report(report, args.json)


if __name__ == "__main__":
  main()
