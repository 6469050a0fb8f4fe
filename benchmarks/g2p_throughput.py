"""Training throughput of G2P model shapes and batch sizes, side by side.

Each arm is the G2P example's jitted training step (`m.train_step`, the
``full`` preset's dropout and label smoothing) for one model width, encoder
depth, batch size (``batch_words`` words, ``batch_tokens`` tokens a field)
and LSTM cell (flax's ``LSTMCell``, which the example uses; its fused twin
``OptimizedLSTMCell``; or ``LSTMCell`` computing in bfloat16 from float32
parameters, which a CPU with bfloat16 matrix units might run faster),
stepping through the batches of its own `jaxlod.data.Batcher` (the
example's, `train.training_batcher`). The arms run in one process,
interleaved: each round, in a shuffled order, every arm takes ``--steps``
steps (each waits for its loss, as the example does), and the round's time
gives its steps, words and tokens a second. Reported per arm: the median over the
rounds, ``compile_s`` (its first call), and ``words_ratio``, its words a
second over the ``fast`` preset's shape's in the same rounds (median of the
per-round ratios): how many more training words an hour buys.

Usage: ``python -m benchmarks.g2p_throughput [--rounds N] [--steps N]
[--json PATH]``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import machine_info, write_report
from examples.g2p import data, train
from examples.g2p import model as m
from jaxlod import enable_compilation_cache

CELLS = {
  "LSTMCell": nn.LSTMCell,
  "OptimizedLSTMCell": nn.OptimizedLSTMCell,
  "LSTMCell, bfloat16 compute": functools.partial(nn.LSTMCell, dtype=jnp.bfloat16),
}
# (hidden, encoder layers, batch words, batch tokens, cell); the first is
# `fast`.
ARMS = [
  (256, 2, 128, 1280, "LSTMCell"),
  (256, 2, 64, 640, "LSTMCell"),
  (256, 2, 256, 2560, "LSTMCell"),
  (384, 2, 128, 1280, "LSTMCell"),
  (256, 2, 128, 1280, "OptimizedLSTMCell"),
  (256, 2, 128, 1280, "LSTMCell, bfloat16 compute"),
]


def _arm(corpus, hidden, layers, words, tokens, cell):
  config = dataclasses.replace(
    m.PRESETS["full"],
    hidden=hidden,
    attention_units=hidden,
    encoder_layers=layers,
    batch_words=words,
    batch_tokens=tokens,
    members=1,
  )
  num_phones = len(corpus.phones)
  step_fn = m.train_step(config, num_phones, cell=CELLS[cell])
  state = list(m.init_state(config, num_phones))
  batches = train.training_batcher(config, corpus).iterate()
  lengths = np.array([len(s) + len(t) for s, _, t in corpus.train])
  key = jax.random.key(1)
  count = [0]

  def run(steps):
    """`steps` steps: (seconds, words, tokens)."""
    words_done = tokens_done = 0
    began = time.perf_counter()
    for _ in range(steps):
      batch = next(batches)
      params, opt_state, loss = step_fn(
        *state,
        np.float32(1e-3),
        jax.random.fold_in(key, count[0]),
        batch.fields,
        batch.tables,
      )
      state[:] = [params, opt_state]
      float(loss)
      count[0] += 1
      words_done += batch.indices.size
      tokens_done += int(lengths[batch.indices].sum())
    return time.perf_counter() - began, words_done, tokens_done

  params = sum(x.size for x in jax.tree.leaves(state[0]))
  return config, params, run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args(argv)
  enable_compilation_cache()
  machine = machine_info()
  corpus = data.load_corpus(m.PRESETS["full"])
  arms = {}
  for hidden, layers, words, tokens, cell in ARMS:
    name = f"width {hidden}, {layers} encoder layers, {words} words/{tokens} tokens"
    if cell != "LSTMCell":
      name += f", {cell}"
    config, params, run = _arm(corpus, hidden, layers, words, tokens, cell)
    began = time.perf_counter()
    run(1)
    arms[name] = dict(run=run, params=params, compile_s=time.perf_counter() - began)
    print(f"{name}: compiled in {arms[name]['compile_s']:.1f} s", file=sys.stderr)
  rounds = {name: [] for name in arms}
  order = list(arms)
  rng = random.Random(0)
  for r in range(args.rounds):
    rng.shuffle(order)
    for name in order:
      rounds[name].append(arms[name]["run"](args.steps))
    print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
  first = next(iter(arms))
  results = {}
  for name, arm in arms.items():
    per_round = rounds[name]
    results[name] = {
      "parameters": arm["params"],
      "compile_s": round(arm["compile_s"], 2),
      "steps_per_s": round(
        statistics.median(args.steps / s for s, _, _ in per_round), 3
      ),
      "words_per_s": round(statistics.median(w / s for s, w, _ in per_round), 1),
      "tokens_per_s": round(statistics.median(t / s for s, _, t in per_round), 1),
      "words_ratio": round(
        statistics.median(
          (w / s) / (w0 / s0)
          for (s, w, _), (s0, w0, _) in zip(per_round, rounds[first], strict=True)
        ),
        3,
      ),
    }
  write_report(
    {
      "benchmark": "g2p_throughput",
      "machine": machine,
      "rounds": args.rounds,
      "steps_per_round": args.steps,
      "reference_arm": first,
      "arms": results,
    },
    args.json,
  )


if __name__ == "__main__":
  main()
