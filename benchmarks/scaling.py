"""Data parallelism of the G2P example: shard balance, and step time on 1 and 2 devices.

Two measurements:

  (1) ``balance`` (host only, NumPy): a sharded `jaxlod.data.Batcher` deals
      each global batch to N = 2, 4 and 8 shards (``process_index=0,
      process_count=1``, so no devices are needed). Over the full global
      batches of epoch 0 (every shard non-empty), it reports the max/mean
      ratio over the shards of their real tokens and of their longest
      length, each as its worst batch and its mean over the batches (and
      the 95th percentile), and the same over the half-full global batches
      (at least half the global count capacity). Two corpora:

      * ``g2p``: the G2P training split as the example builds it
        (`examples.g2p.data.load_corpus` of the default `Config`), batched
        as `examples.g2p.train.train` builds its Batcher (capacities of
        `batch_buckets`, the default token budget, ``seed=config.seed``,
        ``tables=False``), plus ``shards=N``. Tokens are the letters plus
        the phonemes with ``</s>`` (``tgt_out``), as the example counts
        them; ``tgt_in`` has the same lengths as ``tgt_out`` and is not
        counted twice. A shard's longest length is that of its longest
        field of any example (the Batcher's cost); each field is also
        reported alone.
      * ``w1``: lengths drawn as `benchmarks/rnn.py`'s W1 workload draws them
        (its sampler and its fixed capacities: 64 sequences, 3,072 tokens,
        time 128, per shard), one field, `W1_EXAMPLES` examples.

  (2) ``step``: the G2P training step of the default `Config`'s model on 1
      and 2 forced host devices, each count in a child process (this script
      with ``--child K``, under
      ``XLA_FLAGS=--xla_force_host_platform_device_count=K``, which must be
      set before JAX starts). Each device runs the teacher-forced model on
      its shard inside `jaxlod.parallel.data_parallel` and returns the
      gradient of its summed cross-entropy, the sum and its token count;
      the step divides by the summed count (a token-weighted mean over the
      global batch) and applies the example's optimizer in the same `jit`,
      on parameters replicated over the mesh. The batches come from a
      ``Batcher(shards=K)`` on the default per-shard capacities, so 2
      devices process twice the examples of 1 per step; they are built and
      placed (`jaxlod.parallel.shard_batch`) before the timing. On one
      device this step gives the example's own `train_step` (same loss,
      same parameters to float rounding). Reported per
      K: the first call (trace, compile, one step), the median step over
      ``--repeats`` steps after a warm-up step, real source + target tokens
      per step, tokens per second, and the 2-device over 1-device ratio of
      tokens per second. On the 2-core CPU machine both forced devices
      share the same 2 cores, so the ratio says little about real devices.

Run:
  python -m benchmarks.scaling [--repeats N] [--json PATH]

The JSON report goes to stdout (and to ``--json PATH``); progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import rnn
from benchmarks.timing import machine_info, measure_interleaved, write_report
from examples.g2p import data
from examples.g2p import model as m
from jaxlod.data import Batcher
from jaxlod.parallel import shard_batch

SHARD_COUNTS = (2, 4, 8)
DEVICE_COUNTS = (1, 2)
# W1 examples of the balance check: 128 global batches of 8 full shards.
W1_EXAMPLES = 64 * 8 * 128
BALANCE_TARGET = 1.05
NOTE = (
  "Step times are from forced host devices (XLA_FLAGS="
  "--xla_force_host_platform_device_count=K) on a 2-core CPU machine: both "
  "forced devices share the same 2 CPU cores, so the 2-device run is not "
  "twice the hardware and its tokens/s ratio is no measure of scaling on "
  "real devices. The machine is shared, so timings are noisy."
)


# -- balance ----------------------------------------------------------------------


def _max_over_mean(per_shard: np.ndarray, half_full: np.ndarray) -> dict[str, float]:
  """Statistics over batches of the max/mean ratio over shards.

  Args:
    per_shard: ``[batches, shards]`` sizes.
    half_full: bool ``[batches]``, the batches of at least half the global
      count capacity.

  Returns:
    The worst ratio, the mean and the 95th percentile over all the batches;
    the worst and the mean over the half-full ones.
  """
  ratios = per_shard.max(axis=1) / per_shard.mean(axis=1)
  large = ratios[half_full] if half_full.any() else np.full(1, np.nan)
  return {
    "worst": float(ratios.max()),
    "mean": float(ratios.mean()),
    "p95": float(np.percentile(ratios, 95)),
    "worst_half_full": float(large.max()),
    "mean_half_full": float(large.mean()),
  }


def shard_balance(
  batcher: Batcher, lengths: dict[str, np.ndarray], sequences: int
) -> dict[str, Any]:
  """Balance of the shards of `batcher`'s epoch 0.

  Args:
    batcher: a sharded Batcher.
    lengths: field name -> ``[num_examples]`` lengths of the fields counted.
    sequences: the count capacity of a shard.

  Returns:
    Counts of global batches and the max/mean ratios (`_max_over_mean`) of
    the full global batches (every shard non-empty): of tokens (the fields'
    lengths summed) and of the longest length (the longest field of any
    example of the shard), in all and, with several fields, per field.
    Half-full batches hold at least ``shards * sequences / 2`` examples; the
    others are mostly the last batch cut from a sorting window, too few
    examples to share evenly.
  """
  names = list(lengths)
  table = np.stack([lengths[name] for name in names], axis=1)  # [n, F]
  plan = batcher.plan_shards(0)
  full = [batch for batch in plan if all(shard.size for shard in batch)]
  sizes = np.array([[shard.size for shard in batch] for batch in full])
  half_full = sizes.sum(axis=1) * 2 >= batcher.shards * sequences
  tokens = np.array([[table[s].sum(axis=0) for s in batch] for batch in full])
  longest = np.array([[table[s].max(axis=0) for s in batch] for batch in full])
  tokens_ratio = _max_over_mean(tokens.sum(axis=2), half_full)
  result = {
    "global_batches": len(plan),
    "full_global_batches": len(full),
    "half_full_global_batches": int(half_full.sum()),
    "examples_per_shard_mean": float(sizes.mean()),
    "tokens_per_shard_mean": float(tokens.sum(axis=2).mean()),
    "tokens_max_over_mean": tokens_ratio,
    "longest_max_over_mean": _max_over_mean(longest.max(axis=2), half_full),
    "tokens_worst_within_target": tokens_ratio["worst"] <= BALANCE_TARGET,
    "tokens_worst_half_full_within_target": (
      tokens_ratio["worst_half_full"] <= BALANCE_TARGET
    ),
  }
  if len(names) > 1:
    result["tokens_max_over_mean_per_field"] = {
      name: _max_over_mean(tokens[:, :, f], half_full) for f, name in enumerate(names)
    }
    result["longest_max_over_mean_per_field"] = {
      name: _max_over_mean(longest[:, :, f], half_full) for f, name in enumerate(names)
    }
  return result


def _sharded(examples: list, buckets: Any, shards: int, **kwargs: Any) -> Batcher:
  return Batcher(
    examples, buckets, shards=shards, process_index=0, process_count=1, **kwargs
  )


def g2p_balance() -> dict[str, Any]:
  config = m.Config()
  corpus = data.load_corpus(config)
  buckets = m.batch_buckets(config.batch_words, config.batch_tokens)
  lengths = {
    "letters": np.array([len(src) for src, _, _ in corpus.train]),
    "phonemes": np.array([len(tgt_out) for _, _, tgt_out in corpus.train]),
  }
  assert all(len(i) == len(o) for _, i, o in corpus.train)  # tgt_in, tgt_out
  result = {
    "examples": len(corpus.train),
    "capacity_per_shard": {
      "tokens": config.batch_tokens,
      "sequences": config.batch_words,
      "time": m.TIME_CAPACITY,
    },
    "shards": {},
  }
  for n in SHARD_COUNTS:
    # As examples.g2p.train builds its Batcher, with shards.
    batcher = _sharded(corpus.train, buckets, n, seed=config.seed, tables=False)
    result["token_budget"] = batcher.token_budget
    result["shards"][str(n)] = shard_balance(batcher, lengths, config.batch_words)
  return result


def w1_balance() -> dict[str, Any]:
  workload = rnn.WORKLOADS["W1"]
  lengths = workload.sample_lengths(np.random.default_rng(0), W1_EXAMPLES)
  examples = [(np.zeros(n, np.int32),) for n in lengths]
  result = {
    "examples": W1_EXAMPLES,
    "lengths_mean": float(lengths.mean()),
    "lengths_max": int(lengths.max()),
    "sampler": "benchmarks/rnn.py WORKLOADS['W1'].sample_lengths (log-normal, "
    "mean 30, sigma 0.6, in [1, 128]), np.random.default_rng(0)",
    "capacity_per_shard": {
      "tokens": workload.token_capacity,
      "sequences": workload.batch,
      "time": workload.time_capacity,
    },
    "shards": {},
  }
  for n in SHARD_COUNTS:
    batcher = _sharded(examples, workload.buckets, n)
    result["window"] = 1024  # the Batcher's default
    result["shards"][str(n)] = shard_balance(
      batcher, {"tokens": lengths}, workload.batch
    )
  return result


# -- step time (child process) ----------------------------------------------------


def step_time(devices: int, repeats: int) -> dict[str, Any]:
  """Times the data-parallel G2P step on `devices` devices (this process's)."""
  if jax.device_count() != devices:
    raise RuntimeError(
      f"Expected {devices} devices (XLA_FLAGS), got {jax.device_count()}."
    )
  config = m.Config()
  corpus = data.load_corpus(config)
  mesh = jax.make_mesh((devices,), ("data",))
  replicated = NamedSharding(mesh, P())
  # The example's own data-parallel step (`--devices`).
  step = m.train_step(config, len(corpus.phones), mesh)
  params, opt_state = jax.device_put(
    m.init_state(config, len(corpus.phones)), replicated
  )
  buckets = m.batch_buckets(config.batch_words, config.batch_tokens)
  batcher = _sharded(corpus.train, buckets, devices, seed=config.seed, tables=False)
  tokens_of = np.array([len(s) + len(t) for s, _, t in corpus.train])
  calls = repeats + 2  # the first call, the warm-up, the timed steps
  with contextlib.closing(batcher.iterate()) as stream:
    batches = [next(stream) for _ in range(calls)]
  tokens = [int(tokens_of[b.indices].sum()) for b in batches]
  placed = [shard_batch(b, mesh).fields for b in batches]
  rng = jax.random.key(config.seed + 1)
  state = {"params": params, "opt_state": opt_state, "step": 0, "losses": []}

  def call():
    k = state["step"]
    lr = np.float32(m.learning_rate(config, k))
    out = step(
      state["params"], state["opt_state"], lr, jax.random.fold_in(rng, k), placed[k]
    )
    state["params"], state["opt_state"], loss = out
    state["step"] += 1
    state["losses"].append(loss)
    return out

  timing = measure_interleaved({"step": (call, jax.block_until_ready)}, repeats)["step"]
  timed_tokens = tokens[2:]
  tokens_per_step = statistics.mean(timed_tokens)
  losses = [float(loss) for loss in state["losses"]]
  return {
    "devices": jax.device_count(),
    "examples_per_step_mean": statistics.mean(b.indices.size for b in batches[2:]),
    "first_call_s": timing["first_call_s"],
    "compile_s": timing["compile_s"],
    "median_step_s": timing["median_s"],
    "step_times_s": timing["times_s"],
    "tokens_per_step": tokens_per_step,
    "tokens_per_s": tokens_per_step / timing["median_s"],
    "tokens_per_s_over_timed_steps": sum(timed_tokens) / sum(timing["times_s"]),
    "loss_first_last": [losses[0], losses[-1]],
    "losses_finite": bool(np.all(np.isfinite(losses))),
    "load_average_at_end": list(os.getloadavg()),
  }


def run_child(devices: int, repeats: int) -> dict[str, Any]:
  """`step_time` in a child process with `devices` forced host devices."""
  flags = os.environ.get("XLA_FLAGS", "")
  flags = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  command = [sys.executable, "-m", "benchmarks.scaling", "--child", str(devices)]
  command += ["--repeats", str(repeats)]
  done = subprocess.run(
    command,
    env={**os.environ, "XLA_FLAGS": flags},
    stdout=subprocess.PIPE,
    text=True,
    check=True,
  )
  return json.loads(done.stdout)


# -- command line -----------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--json", type=Path, default=None, help="also write here")
  parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  return args


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  if args.child is not None:
    print(json.dumps(step_time(args.child, args.repeats)))
    return
  start = time.perf_counter()
  report = {"machine": machine_info(), "repeats": args.repeats, "note": NOTE}
  print("balance: g2p", file=sys.stderr)
  report["balance"] = {"target_max_over_mean": BALANCE_TARGET, "g2p": g2p_balance()}
  print("balance: w1", file=sys.stderr)
  report["balance"]["w1"] = w1_balance()
  runs = {}
  for devices in DEVICE_COUNTS:
    print(f"step: {devices} device(s)", file=sys.stderr)
    runs[str(devices)] = result = run_child(devices, args.repeats)
    print(
      f"  first call {result['first_call_s']:.1f} s, median step "
      f"{result['median_step_s']:.4f} s, {result['tokens_per_s']:,.0f} tokens/s",
      file=sys.stderr,
    )
  one, two = runs["1"], runs["2"]
  report["step"] = {
    "devices": runs,
    "tokens_per_s_ratio_2_over_1": two["tokens_per_s"] / one["tokens_per_s"],
    "median_step_ratio_2_over_1": two["median_step_s"] / one["median_step_s"],
  }
  report["wall_s"] = time.perf_counter() - start
  write_report(report, args.json)


if __name__ == "__main__":
  main()
