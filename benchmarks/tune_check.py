"""`jaxlod.ops.tune_plan` against the sweep (issue 66): on cells of
`benchmarks/sweep.py`'s grid, the plan `tune_plan` picks for the drop-in's
training step, beside the plan the committed sweep measured fastest there.

Each cell (``B<batch>_T<time>_H<hidden>_<profile>``) is built as the sweep
builds it (the same lengths, inputs and parameters). The step is the
sweep's: the value and gradient of `dropin.layer_functions`'s loss under
``jaxlod.nn.RNN(cell, return_carry=True, plan=plan)``, written as
``step(plan, params, x, lengths)``. The candidates are the drop-in's own
plan for the shape (`jaxlod.ops.default_plan`, first: the reference whose
results the others must equal) and the sweep's plan arms (its ``plans``).
Per cell the report gives the plan picked, the sweep's fastest, whether
they agree, the largest difference of the picked plan's results from the
reference's (relative to each result's largest magnitude) and the time
`tune_plan` took.

Run:
  python -m benchmarks.tune_check [--cells B8_T256_H64_even,...]
      [--sweep benchmarks/results/sweep.json] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxlod.nn
import jaxlod.ops
from benchmarks import dropin, rnn, sweep
from benchmarks.timing import write_report

SWEEP = Path(__file__).resolve().parent / "results" / "sweep.json"
# Cells where the committed sweep's fastest plan led the next by a clear
# margin: the hoisted ladder at 8 sequences, the ladder at 128.
CELLS = ("B8_T256_H64_even", "B128_T64_H64_lognormal", "B128_T16_H256_lognormal")


def parse_cell(name: str) -> tuple[int, int, int, str]:
  """``B8_T256_H64_even`` as ``(8, 256, 64, "even")``.

  Raises:
    ValueError: for a name not of that form.
  """
  try:
    b, t, h, profile = name.split("_")
    if (b[0], t[0], h[0]) != ("B", "T", "H") or profile not in sweep.PROFILES:
      raise ValueError
    return int(b[1:]), int(t[1:]), int(h[1:]), profile
  except ValueError:
    raise ValueError(
      f"Expected a cell such as B8_T256_H64_even (profile one of "
      f"{sweep.PROFILES}), got {name!r}."
    ) from None


def cell_step(batch: int, time_: int, hidden: int, profile: str) -> tuple:
  """The sweep's cell: ``(step, params, x, lengths)``, ``step(plan, params,
  x, lengths)`` the drop-in's training step under `plan`."""
  lengths, x, cell, params = sweep.cell_inputs(batch, time_, hidden, profile)

  def step(plan, params, x, lengths):
    layer = jaxlod.nn.RNN(cell, return_carry=True, plan=plan)
    return jax.value_and_grad(dropin.layer_functions(layer, cell)[1])(
      params, x, lengths
    )

  return step, params, jnp.asarray(x), jnp.asarray(lengths, jnp.int32)


def largest_difference(step, plan, reference, args) -> float:
  """The largest difference of `plan`'s results from `reference`'s, each
  leaf's relative to its largest magnitude."""
  run = jax.jit(step, static_argnums=0)
  got, want = run(plan, *args), run(reference, *args)
  worst = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-30)
    worst = max(worst, float(np.abs(a - b).max(initial=0.0)) / scale)
  return worst


def check_cell(name: str, report: dict, repeats: int) -> dict[str, Any]:
  """`tune_plan` on the cell `name` of the sweep `report`."""
  batch, time_, hidden, profile = parse_cell(name)
  measured = {sweep.cell_key(c): c for c in report["cells"]}
  if name not in measured:
    raise ValueError(f"Expected a cell of the sweep, got {name!r}.")
  names = list(report["plans"])
  reference = jaxlod.ops.default_plan(sequences=batch, time=time_)
  candidates = [reference, *(sweep.PLANS[n] for n in names)]
  step, *args = cell_step(batch, time_, hidden, profile)
  start = time.perf_counter()
  picked = jaxlod.ops.tune_plan(step, *args, candidates=candidates, repeats=repeats)
  elapsed = time.perf_counter() - start
  name_of = {sweep.PLANS[n]: n for n in names}
  fastest = measured[name]["train"]["fastest_plan"]
  return {
    "reference": repr(reference),
    "picked": name_of.get(picked, repr(picked)),
    "sweep_fastest": fastest,
    "agrees": picked == sweep.PLANS[fastest],
    "max_rel_diff_vs_reference": largest_difference(step, picked, reference, args),
    "tune_s": elapsed,
  }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells", default=",".join(CELLS))
  parser.add_argument("--sweep", type=Path, default=SWEEP)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", type=Path, default=None)
  args = parser.parse_args(argv)
  args.cells = [c for c in args.cells.split(",") if c]
  for cell in args.cells:
    parse_cell(cell)
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  report = json.loads(args.sweep.read_text())
  out = {
    "machine": rnn.machine_info(),
    "sweep": str(args.sweep),
    "repeats": args.repeats,
    "cells": {},
  }
  for name in args.cells:
    out["cells"][name] = check_cell(name, report, args.repeats)
    print(name, out["cells"][name], flush=True)
  out["agree_everywhere"] = all(c["agrees"] for c in out["cells"].values())
  write_report(out, args.json)
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
