"""Host rank tables and decode compaction in the G2P example, side by side.

The default G2P config (`examples.g2p.model.Config()`) in one
process, each option timed against the run without it:

* ``train_step``: the example's jitted training step (`m.train_step`) on
  the same batches of a `jaxlod.data.Batcher` built as `train.train` builds
  it (the ladder `m.training_ladder`), called with the batch's host rank
  tables (``host_tables``: ``Batch.tables`` of the source and the decoder
  inputs) and without them (``device_ranks``: ``tables=None``, the model
  ranks each batch on the device). Both arms start from the same
  parameters and step through the same batches and learning rates; their
  losses are compared (``loss_max_abs_diff``). ``host_build_ms``: the
  Batcher's own time to build one batch (NumPy packing, ``device_put``,
  and with ``tables`` the two rank tables), in the caller's thread
  (``prefetch=0``), alternating between a Batcher with tables and one
  without over the same batches; in a run it happens on the prefetch
  thread.
* ``decode``: beam search (beam 4, the example's `m.search_settings` and
  per-word `m.max_lengths`) over every dev word in the example's batches of
  128 words (`decoding.predict`'s Batcher, with the sources' host rank tables),
  with compaction (``compaction``: the default ladder, live words moved to
  a prefix between phases of halving size) and without (``batchwide``:
  ``ladder=()``, one phase at the full count). A third arm,
  ``compaction_device_ranks``, is compaction without the host tables. One
  call of an arm decodes the whole dev set, batch after batch.
  ``identical``: the token ids and offsets of the two first arms are
  exactly equal and their scores within 1e-5 (absolute).

The parameters are those of the first ``--train-steps`` steps (default 200)
of the default run (seed 0), trained here with the host tables: the search
stops on ``</s>``, so its time depends on the model; ``dev_per`` and
``dev_wer`` show how far these parameters are trained. The training-step
arms then continue from them.

Time: the median of interleaved calls of the arms (shuffled order each
round; `benchmarks.timing.measure_interleaved`); ``compile_s`` is an
arm's first call less its median (the decoding arms: compiled ahead of time
on one batch). ``ratio`` is the option's median time over the median time
without it, ``paired_ratio`` the median over the rounds of the two arms'
ratio within a round (the same batch, in the training step; the machine's
load of the moment): below 1, the option is faster. ``decision`` turns an
option on unless its paired ratio exceeds ``slower_than`` (1.03):
``host_tables`` in training, ``compaction`` in decoding (with identical
hypotheses), ``host_tables_in_decoding`` (``compaction`` against
``compaction_device_ranks``).

Usage: ``python -m benchmarks.g2p_options [--train-steps N] [--repeats N]
[--decode-repeats N] [--json PATH]``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.timing import machine_info, measure_interleaved, write_report
from examples.g2p import data
from examples.g2p import model as m
from jaxlod.data import Batcher

SLOWER_THAN = 1.03
SCORE_TOLERANCE = 1e-5
HOST_BUILD_BATCHES = 200


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _train_batcher(config: m.Config, corpus: data.Corpus, **kwargs: Any) -> Batcher:
  """The training Batcher of `train.train` (`kwargs` override its settings)."""
  settings = dict(
    seed=config.seed,
    ladder=m.training_ladder(config),
    tables=(True, True, False),
  )
  buckets = m.batch_buckets(config.batch_words, config.batch_tokens)
  return Batcher(corpus.train, buckets, **{**settings, **kwargs})


def pretrain(config: m.Config, corpus: data.Corpus, steps: int) -> tuple[Any, Any]:
  """``(params, opt_state)`` after the first `steps` steps of the default run."""
  params, opt_state = m.init_state(config, len(corpus.phones))
  step_fn = m.train_step(config, len(corpus.phones))
  with contextlib.closing(_train_batcher(config, corpus).iterate()) as batches:
    for k, batch in zip(range(steps), batches, strict=False):
      lr, rng = m.step_args(config, k)
      params, opt_state, _ = step_fn(
        params, opt_state, lr, rng, batch.fields, batch.tables
      )
  return jax.block_until_ready((params, opt_state))


def train_step_times(
  config: m.Config, corpus: data.Corpus, state: tuple, start: int, repeats: int
) -> dict[str, Any]:
  """The training step with the host tables against without (see the module)."""
  step_fn = m.train_step(config, len(corpus.phones))
  calls = repeats + 2  # the first call, the warm-up, the timed steps
  batcher = _train_batcher(config, corpus)
  with contextlib.closing(batcher.iterate(start_step=start)) as stream:
    batches = list(itertools.islice(stream, calls))
  arms = {"host_tables": lambda b: b.tables, "device_ranks": lambda b: None}
  states = {arm: {"state": state, "k": 0, "losses": []} for arm in arms}

  def call(arm: str):
    s = states[arm]
    k = s["k"]
    lr, rng = m.step_args(config, start + k)
    batch = batches[k]
    params, opt_state, loss = step_fn(
      *s["state"], lr, rng, batch.fields, arms[arm](batch)
    )
    s["state"], s["k"] = (params, opt_state), k + 1
    s["losses"].append(loss)
    return loss

  timing = measure_interleaved(
    {arm: (lambda arm=arm: call(arm), jax.block_until_ready) for arm in arms},
    repeats,
  )
  losses = {arm: np.array([float(x) for x in states[arm]["losses"]]) for arm in arms}
  with_s = timing["host_tables"]["median_s"]
  without_s = timing["device_ranks"]["median_s"]
  return {
    "host_tables_s": with_s,
    "device_ranks_s": without_s,
    "ratio": with_s / without_s,
    "paired_ratio": paired_ratio(timing, "host_tables", "device_ranks"),
    "compile_s": {arm: timing[arm]["compile_s"] for arm in arms},
    "times_s": {arm: timing[arm]["times_s"] for arm in arms},
    "loss_max_abs_diff": float(
      np.max(np.abs(losses["host_tables"] - losses["device_ranks"]))
    ),
    "examples_per_step_mean": statistics.mean(b.indices.size for b in batches),
    "first_step": start,
    "host_build_ms": host_build_ms(config, corpus, start),
  }


def paired_ratio(timing: dict[str, Any], arm: str, other: str) -> float:
  """The median over the timed rounds of `arm`'s time over `other`'s."""
  pairs = zip(timing[arm]["times_s"], timing[other]["times_s"], strict=True)
  return statistics.median(a / b for a, b in pairs)


def host_build_ms(config: m.Config, corpus: data.Corpus, start: int) -> dict[str, Any]:
  """Milliseconds a batch takes the Batcher to build, with and without the
  tables, alternating over the same `HOST_BUILD_BATCHES` batches."""
  streams = {
    "tables": _train_batcher(config, corpus, prefetch=0).iterate(start_step=start),
    "no_tables": _train_batcher(config, corpus, prefetch=0, tables=False).iterate(
      start_step=start
    ),
  }
  times: dict[str, list[float]] = {name: [] for name in streams}
  with contextlib.ExitStack() as stack:
    for stream in streams.values():
      stack.enter_context(contextlib.closing(stream))
    for _ in range(HOST_BUILD_BATCHES):
      for name, stream in streams.items():
        tic = time.perf_counter()
        batch = next(stream)
        jax.block_until_ready((batch.fields, batch.tables))
        times[name].append(1e3 * (time.perf_counter() - tic))
  return {
    **{f"{name}_median": statistics.median(t) for name, t in times.items()},
    **{f"{name}_mean": statistics.mean(t) for name, t in times.items()},
    "batches": HOST_BUILD_BATCHES,
  }


def per_batch_decoder(
  config: m.Config,
  num_phones: int,
  ladder: tuple[int, ...] | None,
  num_results: int | None = 1,
):
  """`m.decoder`'s search (the example's jitted `Seq2Seq.generate`) with the
  ladder `ladder` and `num_results` hypotheses a word (`None`: the beam's),
  returning the hypotheses."""
  model = m.build_model(config, num_phones)

  def decode(params, src, src_table):
    settings = m.search_settings(config.beam, src.capacity.time[0], num_results)
    settings = dataclasses.replace(settings, ladder=ladder)
    return model.apply(
      params,
      src,
      settings,
      method="generate",
      max_lengths=m.max_lengths(src),
      src_table=src_table,
    )

  return jax.jit(decode)


def compare(a: list, b: list) -> dict[str, Any]:
  """Exact ids and offsets over every batch, scores within `SCORE_TOLERANCE`."""
  ids_equal, diff = True, 0.0
  for x, y in zip(a, b, strict=True):
    ids_equal &= bool(np.array_equal(x.ids.values, y.ids.values))
    ids_equal &= all(
      np.array_equal(p, q) for p, q in zip(x.ids.offsets, y.ids.offsets, strict=True)
    )
    diff = max(diff, float(np.max(np.abs(x.scores.values - y.scores.values))))
  return {
    "identical": ids_equal and diff <= SCORE_TOLERANCE,
    "ids_equal": ids_equal,
    "score_max_abs_diff": diff,
  }


def decode_times(
  config: m.Config, corpus: data.Corpus, params: Any, repeats: int
) -> dict[str, Any]:
  """Dev-set decoding with compaction against without (see the module)."""
  pairs = corpus.splits["dev"]
  examples = [(corpus.letters.encode(w),) for w, _ in pairs]
  batcher = Batcher(
    examples,
    m.batch_buckets(config.decode_words),
    shuffle=False,
    window=len(examples),
  )
  batches = list(batcher.epoch(0))
  arms = {
    "compaction": (None, True),
    "batchwide": ((), True),
    "compaction_device_ranks": (None, False),
  }
  compiled, compile_s = {}, {}
  for arm, (ladder, tables) in arms.items():
    tic = time.perf_counter()
    table = batches[0].tables[0] if tables else None
    compiled[arm] = (
      per_batch_decoder(config, len(corpus.phones), ladder)
      .lower(params, batches[0].fields[0], table)
      .compile()
    )
    compile_s[arm] = time.perf_counter() - tic
    _log(f"decode arm {arm}: compiled in {compile_s[arm]:.1f} s")

  def run(arm: str) -> list:
    tables = arms[arm][1]
    return [
      compiled[arm](params, b.fields[0], b.tables[0] if tables else None)
      for b in batches
    ]

  timing = measure_interleaved(
    {arm: (lambda arm=arm: run(arm), jax.block_until_ready) for arm in arms},
    repeats,
  )
  results = {arm: jax.device_get(run(arm)) for arm in arms}
  hyps = [()] * len(pairs)
  for batch, out in zip(batches, results["compaction"], strict=True):
    for i, (best, *_) in zip(batch.indices, out.ids.to_list(), strict=True):
      hyps[i] = corpus.phones.decode(best)
  per, wer = data.error_rates([p for _, p in pairs], hyps)
  with_s = timing["compaction"]["median_s"]
  without_s = timing["batchwide"]["median_s"]
  device_ranks_s = timing["compaction_device_ranks"]["median_s"]
  return {
    "compaction_s": with_s,
    "batchwide_s": without_s,
    "ratio": with_s / without_s,
    "paired_ratio": paired_ratio(timing, "compaction", "batchwide"),
    "compaction_device_ranks_s": device_ranks_s,
    "host_tables_ratio": with_s / device_ranks_s,
    "host_tables_paired_ratio": paired_ratio(
      timing, "compaction", "compaction_device_ranks"
    ),
    **compare(results["compaction"], results["batchwide"]),
    "device_ranks_same_hypotheses": compare(
      results["compaction"], results["compaction_device_ranks"]
    )["identical"],
    "score_tolerance": SCORE_TOLERANCE,
    "compile_s": compile_s,
    "times_s": {arm: timing[arm]["times_s"] for arm in arms},
    "words": len(pairs),
    "batches": len(batches),
    "dev_per": per,
    "dev_wer": wer,
  }


def run(train_steps: int, repeats: int, decode_repeats: int) -> dict[str, Any]:
  start = time.perf_counter()
  machine = machine_info()
  config = m.Config()
  corpus = data.load_corpus(config)
  _log(f"training {train_steps} steps")
  state = pretrain(config, corpus, train_steps)
  _log("timing the training step")
  train = train_step_times(config, corpus, state, train_steps, repeats)
  _log("timing dev decoding")
  decode = decode_times(config, corpus, m.eval_params(config, *state), decode_repeats)
  report: dict[str, Any] = {
    "train_step": train,
    "decode": decode,
    "slower_than": SLOWER_THAN,
    "decision": {
      "host_tables": train["paired_ratio"] <= SLOWER_THAN,
      "compaction": decode["paired_ratio"] <= SLOWER_THAN and decode["identical"],
      "host_tables_in_decoding": decode["host_tables_paired_ratio"] <= SLOWER_THAN,
    },
    "setup": {
      "config": "examples.g2p.model.Config() (the default preset)",
      "train_steps_before_timing": train_steps,
      "training_ladder": list(m.training_ladder(config)),
      "batch_words": config.batch_words,
      "batch_tokens": config.batch_tokens,
      "beam": config.beam,
      "decode_words": config.decode_words,
    },
    "machine": machine,
    "repeats": repeats,
    "decode_repeats": decode_repeats,
  }
  report["wall_s"] = time.perf_counter() - start
  return report


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--train-steps", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=30, help="training steps")
  parser.add_argument("--decode-repeats", type=int, default=9, help="dev decodes")
  parser.add_argument("--json", type=Path, default=None, help="also write here")
  args = parser.parse_args(argv)
  for name in ("train_steps", "repeats", "decode_repeats"):
    if getattr(args, name) < 1:
      flag = "--" + name.replace("_", "-")
      parser.error(f"{flag} must be >= 1, got {getattr(args, name)}")
  write_report(run(args.train_steps, args.repeats, args.decode_repeats), args.json)


if __name__ == "__main__":
  main()
