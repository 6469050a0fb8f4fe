"""The G2P example's two encoders trained side by side: BiLSTM and Transformer.

Two arms, the default preset of each encoder (`examples.g2p.model.preset`):
``bilstm`` (``python -m examples.g2p``) and ``transformer`` (``python -m
examples.g2p --encoder transformer``, about the same number of parameters),
both with ``steps`` set to ``--steps`` (default 4,000), so that both
schedules warm up and decay over the same budget. Each arm is the example's
jitted training step (`m.train_step`) from its own `m.init_state` (seed 0),
and both take the same batches (one `train.training_batcher`: the two
presets agree on the batch settings and the seed, which is checked) with the
same learning rates and dropout keys (`m.step_args`).

The arms alternate step by step: each round takes the next batch and runs
every arm's step on it, in an order shuffled each round (the same shuffles
in every run), each waiting for its loss as the example's loop does
(``float(loss)``), so a change in the machine's load touches both alike.
An arm's ``steps_per_s`` is its timed steps over their summed time (the
step call and the wait for its loss; not the batches, which both share):
every step but the first, whose time is ``first_step_s`` (compilation
included). ``median_step_ms`` is the median step, and ``paired_ratio``
the median over the rounds of the Transformer's step time over the
BiLSTM's in the same round. ``final_loss`` is an arm's mean training loss
over the last 100 steps.

Then each arm scores dev and test as the example's final table does:
`examples.g2p.decoding.evaluate`, beam search (beam 4) over every word of
the split, with the parameters at the last step (the default presets keep
no average). ``decode_s``: the time of each split, the first (dev) with the
decoder's compilation.

Usage: ``python -m benchmarks.g2p_encoders [--steps N] [--json PATH]``
(default PATH: benchmarks/results/g2p_encoders.json; ``--json ''`` writes
none). Progress goes to stderr. At the default 4,000 steps the committed
run took 271 s on 2 idle CPU cores; with other work on those cores, each
step of a smaller run took 2.7 to 2.9 times as long.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import sys
import time
from typing import Any

import jax

from benchmarks.timing import machine_info, write_report
from examples.g2p import data, decoding, train
from examples.g2p import model as m

ARMS = ("bilstm", "transformer")
# The settings both arms' batches depend on: equal, one Batcher serves both.
BATCH_FIELDS = ("max_words", "stress", "batch_words", "batch_tokens", "loop_sizes")
LOSS_STEPS = 100
DEFAULT_JSON = "benchmarks/results/g2p_encoders.json"


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def arm_configs(steps: int) -> dict[str, m.Config]:
  """Each encoder's default preset, trained for `steps` steps.

  Raises:
    ValueError: when the presets differ in a setting of the batches or the
      seed (they would not train on the same batches).
  """
  configs = {e: dataclasses.replace(m.preset("default", e), steps=steps) for e in ARMS}
  for name in (*BATCH_FIELDS, "seed"):
    values = {getattr(c, name) for c in configs.values()}
    if len(values) > 1:
      raise ValueError(f"The arms differ in `{name}`: {sorted(values)}.")
  return configs


def train_side_by_side(
  configs: dict[str, m.Config], corpus: data.Corpus, steps: int
) -> tuple[dict[str, Any], dict[str, dict[str, list[float]]]]:
  """Trains every arm for `steps` steps on the same batches, alternating
  (see the module): the final parameters of each arm, and ``{"times",
  "losses"}``, each arm's step times (seconds) and losses in step order."""
  num_phones = len(corpus.phones)
  step_fns = {a: m.train_step(c, num_phones) for a, c in configs.items()}
  states = {a: m.init_state(c, num_phones) for a, c in configs.items()}
  times: dict[str, list[float]] = {a: [] for a in configs}
  losses: dict[str, list[float]] = {a: [] for a in configs}
  shuffler = random.Random(0)
  batcher = train.training_batcher(configs[ARMS[0]], corpus)
  with contextlib.closing(batcher.iterate()) as batches:
    for step, batch in zip(range(steps), batches, strict=False):  # endless
      order = list(configs)
      shuffler.shuffle(order)
      for arm in order:
        lr, rng = m.step_args(configs[arm], step)
        tic = time.perf_counter()
        params, opt_state, loss = step_fns[arm](
          *states[arm], lr, rng, batch.fields, batch.tables
        )
        losses[arm].append(float(loss))
        times[arm].append(time.perf_counter() - tic)
        states[arm] = (params, opt_state)
      if (step + 1) % max(steps // 10, 1) == 0:
        rates = ", ".join(f"{a} {_rate(times[a]):.2f}" for a in configs)
        _log(f"step {step + 1}/{steps}: steps a second {rates}")
  params = {a: m.eval_params(configs[a], *states[a]) for a in configs}
  return params, {"times": times, "losses": losses}


def _rate(times: list[float]) -> float:
  """Steps a second over `times`, the first (compiling) step left out."""
  timed = times[1:] or times
  return len(timed) / sum(timed)


def score(config: m.Config, corpus: data.Corpus, params: Any) -> dict[str, Any]:
  """Dev and test PER and WER by beam search, as the example's final table."""
  out: dict[str, Any] = {"decode_s": {}}
  for split in ("dev", "test"):
    tic = time.perf_counter()
    per, wer, rows = decoding.evaluate(params, config, corpus, split)
    out["decode_s"][split] = time.perf_counter() - tic
    out[f"{split}_per"], out[f"{split}_wer"] = per, wer
    out[f"{split}_words"] = len(rows)
  return out


def run(steps: int) -> dict[str, Any]:
  began = time.perf_counter()
  machine = machine_info()
  configs = arm_configs(steps)
  corpus = data.load_corpus(configs[ARMS[0]])
  _log(f"training {', '.join(configs)} side by side, {steps} steps each")
  params, trace = train_side_by_side(configs, corpus, steps)
  times, losses = trace["times"], trace["losses"]
  arms: dict[str, Any] = {}
  for arm, config in configs.items():
    _log(f"scoring {arm}")
    arms[arm] = {
      "parameters": sum(x.size for x in jax.tree.leaves(params[arm])),
      "steps_per_s": _rate(times[arm]),
      "median_step_ms": 1e3 * statistics.median(times[arm][1:] or times[arm]),
      "first_step_s": times[arm][0],
      "training_s": sum(times[arm]),
      "final_loss": statistics.mean(losses[arm][-LOSS_STEPS:]),
      **score(config, corpus, params[arm]),
      "config": dataclasses.asdict(config),
    }
  pairs = zip(times["transformer"][1:], times["bilstm"][1:], strict=True)
  return {
    "arms": arms,
    "paired_ratio": statistics.median(t / b for t, b in pairs),
    "parameter_ratio": arms["transformer"]["parameters"] / arms["bilstm"]["parameters"],
    "setup": {
      "steps": steps,
      "train_words": len(corpus.train),
      "batch_words": configs["bilstm"].batch_words,
      "batch_tokens": configs["bilstm"].batch_tokens,
      "seed": configs["bilstm"].seed,
      "beam": configs["bilstm"].beam,
      "command": f"python -m benchmarks.g2p_encoders --steps {steps}",
    },
    "machine": machine,
    "wall_s": time.perf_counter() - began,
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=4000, help="training steps")
  parser.add_argument(
    "--json",
    default=DEFAULT_JSON,
    help="also write the report here ('' for nowhere; default: %(default)s)",
  )
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error(f"--steps must be >= 2, got {args.steps}")
  write_report(run(args.steps), args.json or None)


if __name__ == "__main__":
  main()
