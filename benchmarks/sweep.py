"""Never slower than padding (issue 66): the drop-in `jaxlod.nn.RNN` over a
grid of shapes and length profiles, side by side with the padded arms.

Every cell of the grid is a batch of ``batch`` sequences padded to ``time``
steps, an LSTM (``flax.linen.OptimizedLSTMCell``) of ``hidden`` units over
``hidden`` input features, and a length profile whose longest sequence is
exactly ``time`` (so "padded to the longest" is padded to ``time``):

  * ``full``: every sequence ``time`` steps (nothing to skip);
  * ``even``: lengths spread evenly from 1 to ``time`` (half the padded
    cells are padding);
  * ``lognormal``: log-normal lengths (sigma 1) scaled so the longest is
    ``time``: a long tail of few long sequences over many short ones.

In one process and the same interleaved rounds (`measure_interleaved`),
each cell times the training step (value and gradient, w.r.t. the cell's
parameters, of the squared outputs at real steps plus the final hidden
state) and, with ``--modes train,forward``, the forward pass of:

  * ``dropin``: `jaxlod.nn.RNN(cell, return_carry=True)` on the padded
    array and the lengths, as a Flax user calls it, under the plan it
    picks for the padded shape (`jaxlod.ops.default_plan` of the batch and
    the steps, recorded per cell as ``dropin_plan``), the packing, the rank
    table and the unpacking inside the step;
  * ``plan_<name>``: the same under each plan of ``--plans`` (`PLANS`):
    what a per-shape rule could choose;
  * ``flax``: ``flax.linen.RNN(cell, return_carry=True)`` with
    ``seq_lengths`` on the padded array;
  * ``torch_padded``: PyTorch's ``nn.LSTM`` over the padded batch, the
    loss masked to the real steps (its final state is the last padded
    step's: the time is what counts here);
  * ``torch_packed``: ``pack_padded_sequence`` (inside the step, as the
    drop-in packs inside its own) and ``nn.LSTM`` over the packed batch,
    where batch x time is at most ``TORCH_PACKED_MAX_CELLS``.

The torch arms run when torch is installed. ``ideal`` is the padding's
cost, padded cells over real ones: the speed-up skipping every padded cell
would give at the same cost per cell. Per cell the report gives each
arm's median, ``speedup_vs_best_padded`` (the fastest of ``flax`` and
``torch_padded`` over ``dropin``), ``fraction_of_ideal`` (``flax`` over
``dropin``, divided by ``ideal``), the fastest plan and the differences
of the drop-in's and each plan's results from Flax's. The summary gives
the worst cell and the median fraction of the ideal over the cells where
the ideal is at least 1.5, against the issue's goals.

Run:
  python -m benchmarks.sweep [--batches 8,32,128] [--times 8,16,64,256,1024]
      [--hiddens 64,256] [--profiles full,even,lognormal] [--repeats N]
      [--min-seconds S] [--plans ladder,bodies1,...] [--modes train[,forward]]
      [--budget-s S] [--json PATH] [--picture PATH]

``--repeats`` rounds time every cell; ``--min-seconds`` adds rounds to a
cell whose round is short, up to as many as fill that long (at most
`benchmarks.timing.MAX_ROUNDS`; each cell's ``rounds`` records them):
a cell of a few milliseconds moves with the machine's noise over a few
rounds. ``--json`` is rewritten after every cell, so a stopped run keeps what it
measured; ``--budget-s`` skips the cells left once the run has taken that
long (each skipped cell is listed). ``--picture`` draws the grid
(matplotlib): per cell, the training step's speed-up over the fastest
padded arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxlod.nn
import jaxlod.ops
from benchmarks import dropin, rnn
from benchmarks.timing import write_report

try:
  import torch
except ImportError:
  torch = None

BATCHES = (8, 32, 128)
TIMES = (8, 16, 64, 256, 1024)
HIDDENS = (64, 256)
PROFILES = ("full", "even", "lognormal")
# The plans a per-shape rule chooses among (`--plans`).
PLANS: dict[str, jaxlod.ops.LoopPlan] = {
  "ladder": jaxlod.ops.LoopPlan(),
  "bodies1": jaxlod.ops.LoopPlan(bodies=1),
  "bodies2": jaxlod.ops.LoopPlan(bodies=2),
  "bodies4": jaxlod.ops.LoopPlan(bodies=4),
  "hoist": jaxlod.ops.LoopPlan(hoist=True),
  "padded": jaxlod.ops.LoopPlan(padded=True),
  "padded_hoist": jaxlod.ops.LoopPlan(padded=True, hoist=True),
}
DEFAULT_PLANS = ("ladder", "bodies1", "hoist", "padded", "padded_hoist")
# The goals, reported beside the figures (not asserted here).
GOALS = {"worst_speedup_vs_best_padded": 1.0, "median_fraction_of_ideal": 0.8}
IDEAL_AT_LEAST = 1.5
CELL_KEYS = ("batch", "time", "hidden", "profile")
# PyTorch's packed LSTM runs one small kernel per step and sequence length
# on a CPU: at batch 128, time 1,024 and hidden 256 (evenly spread lengths)
# its training step took 113 s against 6.6 s padded. It runs where the
# padded batch has at most this many steps (batch x time).
TORCH_PACKED_MAX_CELLS = 8192
# The results of a plan equal Flax's to float32's rounding over this many
# steps (relative to the largest gradient).
MATCH_RTOL = 1e-3


# -- one cell -------------------------------------------------------------------


def profile_lengths(profile: str, batch: int, time_: int) -> np.ndarray:
  """The lengths ``[batch]`` of `profile`, the longest exactly `time_`."""
  if profile == "full":
    return np.full(batch, time_, np.int64)
  if profile == "even":
    return np.rint(np.linspace(1, time_, batch)).astype(np.int64)
  if profile == "lognormal":
    draws = np.random.default_rng(0).lognormal(0.0, 1.0, batch)
    lengths = np.ceil(draws / draws.max() * time_).astype(np.int64)
    return np.clip(lengths, 1, time_)
  raise ValueError(f"unknown profile {profile!r}; choose from {PROFILES}")


def padded_batch(lengths: np.ndarray, time_: int, features: int) -> np.ndarray:
  """``[batch, time_, features]`` rows of N(0, 1) at real steps, zeros past."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((lengths.size, time_, features), dtype=np.float32)
  x[np.arange(time_)[None, :] >= lengths[:, None]] = 0.0
  return x


def torch_arm(params: Any, x: np.ndarray, lengths: np.ndarray, packed: bool):
  """PyTorch's LSTM on the padded batch, or packed inside the step, on the
  GPU (cuDNN) when JAX runs on one and torch sees it."""
  hidden, device = x.shape[-1], rnn.default_torch_device()
  module = torch.nn.LSTM(hidden, hidden, batch_first=True)
  weights = rnn._flax_to_torch_weights(_lstm_workload(hidden), params)
  module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
  module.to(device)
  tx, tl = torch.from_numpy(x).to(device), torch.from_numpy(lengths)
  mask = (torch.arange(x.shape[1])[None, :] < tl[:, None]).unsqueeze(-1).to(device)

  def run():
    if not packed:
      outputs, (h, _) = module(tx)
      return (outputs * mask).square().sum(), h
    seqs = torch.nn.utils.rnn.pack_padded_sequence(
      tx, tl, batch_first=True, enforce_sorted=False
    )
    outputs, (h, _) = module(seqs)
    return outputs.data.square().sum(), h

  def forward(params):
    del params  # copied into `module` above
    with torch.no_grad():
      return run()

  def train(params):
    del params
    module.zero_grad(set_to_none=True)
    squares, h = run()
    loss = squares + h.sum()
    loss.backward()
    return loss.item()  # waits for the GPU

  def sync(result):
    if device != "cpu":
      torch.cuda.synchronize(device)
    return result

  return rnn.Arm(forward, train, (), None, {}, sync)


def _lstm_workload(hidden: int) -> rnn.Workload:
  """The `rnn.Workload` fields the weight converter reads (cell, hidden)."""
  return rnn.Workload("sweep", "lstm", 0, hidden, hidden, 0, 0, None)


def build_arms(cell, params, x, lengths, plans: list[str]) -> dict[str, rnn.Arm]:
  layers = {
    "dropin": jaxlod.nn.RNN(cell, return_carry=True),
    "flax": nn.RNN(cell, return_carry=True),
  }
  arms = {
    name: dropin.layer_arm(layer, cell, x, lengths) for name, layer in layers.items()
  }
  for name in plans:
    layer = jaxlod.nn.RNN(cell, return_carry=True, plan=PLANS[name])
    arms[f"plan_{name}"] = dropin.layer_arm(layer, cell, x, lengths)
  if torch is not None:
    arms["torch_padded"] = torch_arm(params, x, lengths, packed=False)
    if x.shape[0] * x.shape[1] <= TORCH_PACKED_MAX_CELLS:
      arms["torch_packed"] = torch_arm(params, x, lengths, packed=True)
  return arms


def differences(arms: dict[str, rnn.Arm], params: Any) -> dict[str, float]:
  """Each jaxlod arm's loss and gradients against Flax's (relative to the
  largest), on the timed batch."""
  ref_loss, ref_grads = arms["flax"].train(params, *arms["flax"].inputs)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
  out = {}
  for name, arm in arms.items():
    if name == "flax" or name.startswith("torch"):
      continue
    loss, grads = arm.train(params, *arm.inputs)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads, ref_grads)
    out[name] = max(
      abs(float(loss) / float(ref_loss) - 1.0), max(jax.tree.leaves(diff)) / scale
    )
  return out


def mode_summary(medians: dict[str, float], ideal: float) -> dict[str, Any]:
  """The ratios of one mode's medians."""
  dropin = medians["dropin"]
  padded = {k: medians[k] for k in ("flax", "torch_padded") if k in medians}
  best = min(padded, key=padded.get)
  plans = {k: v for k, v in medians.items() if k.startswith("plan_")}
  fastest = min(plans, key=plans.get) if plans else None
  return {
    "median_s": medians,
    "best_padded": best,
    "speedup_vs_best_padded": padded[best] / dropin,
    "speedup_vs_flax": medians["flax"] / dropin,
    "fraction_of_ideal": medians["flax"] / dropin / ideal,
    "speedup_vs_torch_packed": rnn._ratio(medians.get("torch_packed"), dropin),
    "fastest_plan": fastest and fastest.removeprefix("plan_"),
    "fastest_plan_speedup_vs_best_padded": fastest and padded[best] / plans[fastest],
  }


def cell_inputs(batch: int, time_: int, hidden: int, profile: str) -> tuple:
  """A cell's ``(lengths, x, cell, params)``: the profile's lengths, the
  padded inputs, the LSTM cell and its parameters."""
  lengths = profile_lengths(profile, batch, time_)
  x = padded_batch(lengths, time_, hidden)
  cell = nn.OptimizedLSTMCell(hidden)
  carry = rnn.zero_carry(cell, 1, hidden)
  params = cell.init(jax.random.key(1), carry, jnp.zeros((1, hidden)))["params"]
  return lengths, x, cell, params


def run_cell(
  batch, time_, hidden, profile, plans, modes, repeats, min_seconds=0.0
) -> dict:
  lengths, x, cell, params = cell_inputs(batch, time_, hidden, profile)
  arms = build_arms(cell, params, x, lengths, plans)
  ideal = batch * time_ / int(lengths.sum())
  report = {
    "batch": batch,
    "time": time_,
    "hidden": hidden,
    "profile": profile,
    "lengths": {"sum": int(lengths.sum()), "min": int(lengths.min())},
    "ideal": ideal,
    # What the drop-in ran: the backend's plan for this padded shape.
    "dropin_plan": repr(jaxlod.ops.default_plan(sequences=batch, time=time_)),
  }
  for mode in modes:
    timing = rnn.time_arms(arms, params, mode, repeats, min_seconds)
    medians = {name: t["median_s"] for name, t in timing.items()}
    report[mode] = mode_summary(medians, ideal)
    report[mode]["rounds"] = len(timing["dropin"]["times_s"])
    report[mode]["compile_s"] = {name: t["compile_s"] for name, t in timing.items()}
  report["max_rel_diff_vs_flax"] = differences(arms, params)
  report["results_match"] = max(report["max_rel_diff_vs_flax"].values()) <= MATCH_RTOL
  return report


# -- the grid ---------------------------------------------------------------------


def cell_key(cell: dict) -> str:
  """A cell's name, ``B<batch>_T<time>_H<hidden>_<profile>``."""
  return f"B{cell['batch']}_T{cell['time']}_H{cell['hidden']}_{cell['profile']}"


def summarize(cells: list[dict], mode: str = "train") -> dict[str, Any]:
  """The worst cell's speed-up over the fastest padded arm, and the median
  and worst fraction of the ideal where the ideal is at least 1.5."""
  done = [c for c in cells if mode in c]
  if not done:
    return {}
  key = cell_key
  worst = min(done, key=lambda c: c[mode]["speedup_vs_best_padded"])
  padded = [c for c in done if c["ideal"] >= IDEAL_AT_LEAST]
  fractions = [c[mode]["fraction_of_ideal"] for c in padded]
  low = min(padded, key=lambda c: c[mode]["fraction_of_ideal"]) if padded else None
  return {
    "cells": len(done),
    "worst_speedup_vs_best_padded": worst[mode]["speedup_vs_best_padded"],
    "worst_cell": key(worst),
    "cells_below_1": sorted(
      key(c) for c in done if c[mode]["speedup_vs_best_padded"] < 1.0
    ),
    "cells_with_ideal_at_least_1_5": len(padded),
    "median_fraction_of_ideal": statistics.median(fractions) if fractions else None,
    "worst_fraction_of_ideal": low and low[mode]["fraction_of_ideal"],
    "worst_fraction_cell": low and key(low),
    "results_match_everywhere": all(c["results_match"] for c in done),
    "goals": GOALS,
  }


def grid(args: argparse.Namespace) -> list[tuple]:
  """The cells, cheapest padded step first (so a budget skips the costliest)."""
  cells = [
    (b, t, h, p)
    for b in args.batches
    for t in args.times
    for h in args.hiddens
    for p in args.profiles
  ]
  return sorted(cells, key=lambda c: (c[0] * c[1] * c[2] * (c[2] + 8), c))


def picture(report: dict, path: Path, mode: str = "train") -> None:
  """Per cell, the speed-up over the fastest padded arm: one panel per
  profile, hidden sizes and batches as rows, times as columns."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cells = [c for c in report["cells"] if mode in c]
  profiles = [p for p in PROFILES if any(c["profile"] == p for c in cells)]
  rows = sorted({(c["hidden"], c["batch"]) for c in cells})
  times = sorted({c["time"] for c in cells})
  fig, axes = plt.subplots(1, len(profiles), figsize=(4.2 * len(profiles), 4.5))
  for ax, profile in zip(np.atleast_1d(axes), profiles, strict=True):
    grid_ = np.full((len(rows), len(times)), np.nan)
    for c in cells:
      if c["profile"] == profile:
        i, j = rows.index((c["hidden"], c["batch"])), times.index(c["time"])
        grid_[i, j] = c[mode]["speedup_vs_best_padded"]
    image = ax.imshow(np.log2(grid_), cmap="RdYlGn", vmin=-2, vmax=2)
    for (i, j), value in np.ndenumerate(grid_):
      if not np.isnan(value):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(times)), [str(t) for t in times])
    labels = [f"H{h} B{b}" for h, b in rows] if profile == profiles[0] else []
    ax.set_yticks(range(len(rows)) if labels else [], labels)
    ax.set_xlabel("time (longest sequence)")
    ax.set_title(f"{profile} lengths")
  fig.colorbar(image, ax=axes, label="log2 speed-up over the fastest padded arm")
  fig.suptitle(
    f"jaxlod.nn.RNN {mode} step vs padding ({report['machine']['device_kind']})"
  )
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


# -- command line -----------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(v) for v in text.split(",") if v)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=_ints, default=BATCHES)
  parser.add_argument("--times", type=_ints, default=TIMES)
  parser.add_argument("--hiddens", type=_ints, default=HIDDENS)
  parser.add_argument("--profiles", default=",".join(PROFILES))
  parser.add_argument("--plans", default=",".join(DEFAULT_PLANS))
  parser.add_argument("--modes", default="train")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--min-seconds", type=float, default=0.0)
  parser.add_argument("--budget-s", type=float, default=None)
  parser.add_argument("--json", type=Path, default=None)
  parser.add_argument("--picture", type=Path, default=None)
  args = parser.parse_args(argv)
  args.profiles = [p for p in args.profiles.split(",") if p]
  args.plans = [p for p in args.plans.split(",") if p]
  args.modes = [m for m in args.modes.split(",") if m]
  checks = {
    "--profiles": (args.profiles, PROFILES),
    "--plans": (args.plans, tuple(PLANS)),
    "--modes": (args.modes, ("train", "forward")),
  }
  for flag, (given, known) in checks.items():
    if not set(given) <= set(known) or (flag != "--plans" and not given):
      parser.error(f"{flag}: got {given}, choose from {list(known)}")
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  if not args.min_seconds >= 0:
    parser.error(f"--min-seconds must be >= 0, got {args.min_seconds}")
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  start = time.perf_counter()
  report = {
    "machine": rnn.machine_info(rnn.default_torch_device()),
    "repeats": args.repeats,
    "min_seconds": args.min_seconds,
    "plans": {name: repr(PLANS[name]) for name in args.plans},
    "cells": [],
    "skipped": [],
  }
  for cell in grid(args):
    if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
      report["skipped"].append(dict(zip(CELL_KEYS, cell, strict=True)))
      continue
    print(f"cell B{cell[0]} T{cell[1]} H{cell[2]} {cell[3]}", file=sys.stderr)
    settings = (args.plans, args.modes, args.repeats, args.min_seconds)
    report["cells"].append(run_cell(*cell, *settings))
    report["summary"] = {mode: summarize(report["cells"], mode) for mode in args.modes}
    report["wall_s"] = time.perf_counter() - start
    if args.json is not None:  # what is done so far, should the run stop
      args.json.write_text(json.dumps(report, indent=2) + "\n")
  report["wall_s"] = time.perf_counter() - start
  write_report(report, args.json)
  if args.picture is not None and report["cells"]:
    picture(report, args.picture)
  return report


if __name__ == "__main__":
  main()
