"""What a jitted call costs besides its work: the drop-in `jaxlod.nn.RNN`'s
training step timed call by call and back to back, beside
`flax.linen.RNN`'s (issue 66), and whether each traced step has an effect.

A `checkify` check is an effect of the traced program, and JAX dispatches
a program with an effect on its Python path rather than its C++ fast
path: a fixed cost per call, a share of the sweep's smallest cells
(`sweep.py`: a few milliseconds a step). The drop-in checks its lengths
under `jit` by making bad sequences NaN, with no such check, so that its
steps dispatch as Flax's do; ``effects`` records it for every arm. Here, on
cells of the sweep's grid (`sweep.cell_inputs`), in one process and the
same interleaved rounds:

  * ``flax``: ``flax.linen.RNN`` on the padded batch;
  * ``dropin``: `jaxlod.nn.RNN` under the plan it picks for the shape;
  * ``padded``: `jaxlod.nn.RNN` under ``LoopPlan(padded=True)``, Flax's
    own loop.

Each arm runs ``sync`` (one call, then wait for its result: what the
sweep times) and ``pipelined`` (``--calls`` calls dispatched back to
back, then one wait: a training loop that does not read its loss each
step), reported per call.

Usage: ``python -m benchmarks.dispatch [--cells B8_T8_H64_even,...]
[--repeats N] [--calls K] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import numpy as np

import jaxlod.nn
import jaxlod.ops
from benchmarks import dropin, sweep
from benchmarks.timing import machine_info, measure_interleaved, write_report

CELLS = ("B8_T8_H64_even", "B32_T16_H64_even", "B8_T64_H256_full")


def _parse_cell(name: str) -> tuple[int, int, int, str]:
  batch, time_, hidden, profile = name.split("_")
  return int(batch[1:]), int(time_[1:]), int(hidden[1:]), profile


def _arms(cell, x, lengths, params) -> tuple[dict, dict]:
  """The arms, each traced and compiled, and whether each traced step has
  an effect."""
  padded = jaxlod.ops.LoopPlan(padded=True)
  layers = {
    "flax": nn.RNN(cell, return_carry=True),
    "dropin": jaxlod.nn.RNN(cell, return_carry=True),
    "padded": jaxlod.nn.RNN(cell, return_carry=True, plan=padded),
  }
  arms, effects = {}, {}
  for name, layer in layers.items():
    arm = dropin.layer_arm(layer, cell, x, lengths)
    effects[name] = bool(arm.train.trace(params, *arm.inputs).jaxpr.effects)
    arm.sync(arm.train(params, *arm.inputs))
    arms[name] = arm
  return arms, effects


def _calls(arms: dict, params: Any, calls: int) -> dict:
  def sync(arm):
    return lambda: arm.train(params, *arm.inputs)

  def pipelined(arm):
    def run():
      for _ in range(calls - 1):
        arm.train(params, *arm.inputs)
      return arm.train(params, *arm.inputs)

    return run

  timed = {}
  for name, arm in arms.items():
    timed[f"{name}/sync"] = (sync(arm), jax.block_until_ready)
    timed[f"{name}/pipelined"] = (pipelined(arm), jax.block_until_ready)
  return timed


def _difference(arms: dict, params: Any) -> float:
  """The largest difference of a jaxlod arm's loss and gradients from
  Flax's."""
  want = arms["flax"].train(params, *arms["flax"].inputs)
  worst = 0.0
  for name in ("dropin", "padded"):
    got = arms[name].train(params, *arms[name].inputs)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      worst = max(worst, float(np.max(np.abs(np.asarray(u) - np.asarray(v)))))
  return worst


def run_cell(name: str, repeats: int, calls: int) -> dict[str, Any]:
  lengths, x, cell, params = sweep.cell_inputs(*_parse_cell(name))
  arms, effects = _arms(cell, x, lengths, params)
  measured = measure_interleaved(_calls(arms, params, calls), repeats)
  per_call = {}
  for label, t in measured.items():
    arm, mode = label.split("/")
    per_call.setdefault(arm, {})[f"{mode}_ms"] = (
      1e3 * t["median_s"] / (calls if mode == "pipelined" else 1)
    )
  ratios = {}
  for mode in ("sync", "pipelined"):
    for arm in ("dropin", "padded"):
      ms = per_call[arm][f"{mode}_ms"]
      ratios[f"flax_{mode}_speedup_of_{arm}"] = per_call["flax"][f"{mode}_ms"] / ms
  for arm, t in per_call.items():
    print(
      f"  {name} {arm:8s} {t['sync_ms']:.3f} {t['pipelined_ms']:.3f} ms",
      file=sys.stderr,
    )
  return {
    "dropin_plan": repr(jaxlod.ops.default_plan(sequences=x.shape[0], time=x.shape[1])),
    "effects": effects,
    "per_call_ms": per_call,
    "ratios": ratios,
    "max_abs_diff_vs_flax": _difference(arms, params),
  }


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells", default=",".join(CELLS))
  parser.add_argument("--repeats", type=int, default=50)
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  if args.repeats < 1 or args.calls < 1:
    parser.error(
      f"--repeats and --calls must be >= 1, got {args.repeats}, {args.calls}"
    )
  start = time.perf_counter()
  report = {
    "machine": machine_info(),
    "repeats": args.repeats,
    "calls": args.calls,
    "cells": {
      name: run_cell(name, args.repeats, args.calls)
      for name in args.cells.split(",")
      if name
    },
  }
  report["wall_s"] = time.perf_counter() - start
  write_report(report, args.json)
  return report


if __name__ == "__main__":
  main()
