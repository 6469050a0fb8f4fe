"""Ensemble members side by side: one process per core against one process.

An ensemble's members are independent trainings, so they can run at once,
one process each (``python -m examples.g2p --member K``). This
measures what that buys on the machine's cores. Each worker process runs the
G2P example's jitted training step (`model.train_step`) on its batches
(`train.training_batcher`) for a preset (default ``full``: width 384, 64
words a step). Two arms, each round in alternating order:

* ``one process``: one worker on every core (XLA's default threads);
* ``one process per core``: as many workers as cores at once, each pinned
  to its core (`os.sched_setaffinity`) with XLA's CPU thread pool of one
  thread (``--xla_cpu_multi_thread_eigen=false
  intra_op_parallelism_threads=1``).

A worker compiles (the persistent cache helps), takes ``--warmup`` steps,
reports that it is ready and waits; when every worker of the arm is ready,
all time ``--steps`` steps at once (each step waits for its loss, as the
example does). Reported per arm: the median over the rounds of the steps a
second of each worker and of all of them together, and ``ratio``: the
median over the rounds of the per-core arm's steps a second, all workers
together, over the one process's in the same round: how many more
member-steps an hour buys.

Usage: ``python -m benchmarks.g2p_members [--rounds N] [--steps N]
[--warmup N] [--preset NAME] [--json PATH]``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def worker(preset: str, core: int | None, warmup: int, steps: int) -> None:
  """One worker (a child process): pinned to `core` when given; prints
  ``ready``, waits for a line on stdin, then prints its timing as JSON."""
  if core is not None:
    os.sched_setaffinity(0, {core})

  from examples.g2p import data, train
  from examples.g2p import model as m
  from jaxlod import enable_compilation_cache

  enable_compilation_cache()
  config = m.PRESETS[preset]
  corpus = data.load_corpus(config)
  step_fn = m.train_step(config, len(corpus.phones))
  params, opt_state = m.init_state(config, len(corpus.phones))
  batches = train.training_batcher(config, corpus).iterate()

  def run(count: int, first: int) -> None:
    nonlocal params, opt_state
    for i in range(first, first + count):
      batch = next(batches)
      params, opt_state, loss = step_fn(
        params, opt_state, *m.step_args(config, i), batch.fields, batch.tables
      )
      float(loss)

  began = time.perf_counter()
  run(warmup, 0)
  print(json.dumps({"ready": time.perf_counter() - began}), flush=True)
  sys.stdin.readline()
  began = time.perf_counter()
  run(steps, warmup)
  seconds = time.perf_counter() - began
  print(json.dumps({"seconds": seconds, "steps_per_s": steps / seconds}), flush=True)


def _message(proc: subprocess.Popen, key: str) -> dict[str, Any]:
  """The next JSON line of `proc`'s stdout that holds `key` (other lines, if
  a library prints any, are skipped)."""
  for line in proc.stdout:
    if line.startswith("{") and key in (message := json.loads(line)):
      return message
  raise RuntimeError(f"a worker exited with {proc.wait()} before sending {key!r}")


def run_arm(cores: list[int | None], args: argparse.Namespace) -> list[float]:
  """Starts one worker per entry of `cores` (`None`: unpinned, XLA's
  default threads), times them together: their steps a second."""
  command = [sys.executable, "-m", "benchmarks.g2p_members", "--preset", args.preset]
  command += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
  procs = []
  try:
    for core in cores:
      env = dict(os.environ)
      if core is not None:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SINGLE_THREAD}".strip()
      worker_flag = ["--worker", "all" if core is None else str(core)]
      procs.append(
        subprocess.Popen(
          command + worker_flag,
          env=env,
          stdin=subprocess.PIPE,
          stdout=subprocess.PIPE,
          text=True,
        )
      )
    for proc in procs:
      _message(proc, "ready")
    for proc in procs:
      proc.stdin.write("go\n")
      proc.stdin.flush()
    rates = [_message(proc, "steps_per_s")["steps_per_s"] for proc in procs]
    for proc in procs:
      proc.wait(timeout=60)
    return rates
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--warmup", type=int, default=20)
  parser.add_argument("--preset", default="full")
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker is not None:
    core = None if args.worker == "all" else int(args.worker)
    worker(args.preset, core, args.warmup, args.steps)
    return
  from benchmarks.timing import machine_info, write_report
  from examples.g2p import model as m

  if args.preset not in m.PRESETS:
    parser.error(f"--preset must be one of {sorted(m.PRESETS)}, got {args.preset!r}")
  machine = machine_info()
  cores = sorted(os.sched_getaffinity(0))
  arms = {"one process": [None], "one process per core": cores}
  rounds: dict[str, list[list[float]]] = {name: [] for name in arms}
  for r in range(args.rounds):
    order = list(arms) if r % 2 == 0 else list(arms)[::-1]
    for name in order:
      rounds[name].append(run_arm(arms[name], args))
    print(f"round {r + 1}/{args.rounds}: {rounds}", file=sys.stderr)
  results: dict[str, Any] = {}
  for name, per_round in rounds.items():
    results[name] = {
      "processes": len(arms[name]),
      "steps_per_s_each": [
        round(statistics.median(rates[i] for rates in per_round), 3)
        for i in range(len(arms[name]))
      ],
      "steps_per_s_together": round(statistics.median(map(sum, per_round)), 3),
      "per_round_together": [round(sum(rates), 3) for rates in per_round],
    }
  ratio = statistics.median(
    sum(apart) / sum(one)
    for apart, one in zip(
      rounds["one process per core"], rounds["one process"], strict=True
    )
  )
  write_report(
    {
      "benchmark": "g2p_members",
      "machine": machine,
      "preset": args.preset,
      "cores": cores,
      "rounds": args.rounds,
      "steps": args.steps,
      "warmup_steps": args.warmup,
      "arms": results,
      "ratio": round(ratio, 3),
    },
    args.json,
  )


if __name__ == "__main__":
  main()
