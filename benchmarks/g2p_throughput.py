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

``--plan`` sets the `jaxlod.ops.LoopPlan` of the step's loops (passed to
`m.train_step`): ``default`` passes none (the backend's
`jaxlod.ops.default_plan`; on a GPU one body, so the step gives its loops
no ladder, `m.step_ladder`), ``cpu`` is ``LoopPlan()`` (the ladder and one
step per ``while`` iteration: the step as it ran before plans) and
``accelerator`` ``default_plan("gpu")``, forced on any backend. Several,
comma-separated (``--plan cpu,default``: before and after), run every arm
once per plan, in the same rounds; an arm's name then ends with its plan
(as it does for a single plan other than ``default``), and
``plan_ratios`` gives, per shape, each later plan's words a second over
the first plan's (median of the per-round ratios). ``--arms`` keeps some
of the shapes (indices into `ARMS`, 0 the ``fast`` shape).

Usage: ``python -m benchmarks.g2p_throughput [--rounds N] [--steps N]
[--json PATH] [--plan {default,cpu,accelerator}[,...]] [--arms 0,3]``.
Progress goes to stderr.
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
from jaxlod.ops import LoopPlan, default_plan

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
# `--plan`: the `LoopPlan` of the step's loops (`None`: pass none, the
# backend's).
PLANS: dict[str, LoopPlan | None] = {
  "default": None,
  "cpu": LoopPlan(),
  "accelerator": default_plan("gpu"),
}


def _arm(corpus, hidden, layers, words, tokens, cell, plan=None):
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
  step_fn = m.train_step(config, num_phones, cell=CELLS[cell], plan=plan)
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


def _names(parser, value, choices, what):
  """The comma-separated entries of `value`, each in `choices`, once."""
  names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
  unknown = [n for n in names if n not in choices]
  if unknown or not names:
    parser.error(f"{what}: choose from {list(choices)}, got {value!r}")
  return names


def _per_round_ratio(rounds, reference):
  """Median over the rounds of words a second over `reference`'s."""
  return round(
    statistics.median(
      (w / s) / (w0 / s0)
      for (s, w, _), (s0, w0, _) in zip(rounds, reference, strict=True)
    ),
    3,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument(
    "--plan",
    default="default",
    help=f"the LoopPlan of the step's loops, one of {', '.join(PLANS)}, or "
    "several comma-separated, run side by side (default: default, which "
    "passes none)",
  )
  parser.add_argument(
    "--arms",
    default=",".join(str(k) for k in range(len(ARMS))),
    help="the shapes to run, indices into ARMS (default: all; 0 is `fast`)",
  )
  args = parser.parse_args(argv)
  plans = _names(parser, args.plan, PLANS, "--plan")
  shapes = [
    ARMS[int(k)]
    for k in _names(parser, args.arms, [str(k) for k in range(len(ARMS))], "--arms")
  ]
  if args.rounds < 1 or args.steps < 1:
    parser.error("--rounds and --steps must be >= 1")
  enable_compilation_cache()
  machine = machine_info()
  corpus = data.load_corpus(m.PRESETS["full"])
  arms, shape_of = {}, {}
  for plan in plans:
    for hidden, layers, words, tokens, cell in shapes:
      shape = f"width {hidden}, {layers} encoder layers, {words} words/{tokens} tokens"
      if cell != "LSTMCell":
        shape += f", {cell}"
      name = shape if plans == ["default"] else f"{shape}, plan {plan}"
      config, params, run = _arm(
        corpus, hidden, layers, words, tokens, cell, PLANS[plan]
      )
      began = time.perf_counter()
      run(1)
      arms[name] = dict(
        run=run,
        params=params,
        compile_s=time.perf_counter() - began,
        plan=plan,
        ladder=m.step_ladder(config, PLANS[plan]),
      )
      shape_of[name] = shape
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
    given = PLANS[arm["plan"]]
    results[name] = {
      "parameters": arm["params"],
      "compile_s": round(arm["compile_s"], 2),
      "steps_per_s": round(
        statistics.median(args.steps / s for s, _, _ in per_round), 3
      ),
      "words_per_s": round(statistics.median(w / s for s, w, _ in per_round), 1),
      "tokens_per_s": round(statistics.median(t / s for s, _, t in per_round), 1),
      "words_ratio": _per_round_ratio(per_round, rounds[first]),
      "plan": arm["plan"],
      "loop_plan": given and dataclasses.asdict(given),
      "ladder": arm["ladder"] and list(arm["ladder"]),
    }
  # Per shape, each later plan against the first plan, in the same rounds.
  plan_ratios = {}
  for name, arm in arms.items():
    if arm["plan"] == plans[0]:
      continue
    base = next(n for n in arms if shape_of[n] == shape_of[name])
    plan_ratios.setdefault(shape_of[name], {})[arm["plan"]] = _per_round_ratio(
      rounds[name], rounds[base]
    )
  write_report(
    {
      "benchmark": "g2p_throughput",
      "machine": machine,
      "rounds": args.rounds,
      "steps_per_round": args.steps,
      "plans": plans,
      "reference_arm": first,
      "arms": results,
      "plan_ratios": plan_ratios,
    },
    args.json,
  )


if __name__ == "__main__":
  main()
