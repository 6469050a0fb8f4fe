"""Side-by-side benchmark of the drop-in `jaxlod.nn.RNN` against `flax.linen.RNN`.

Issue 53 ("A Flax drop-in"): the same padded batches through
``flax.linen.RNN`` and `jaxlod.nn.RNN`. For each workload (`rnn.py`'s W1
sentences and W3 words by default: their cells, weights, batch sizes and
lengths) one process runs, on the same cell weights and the same padded
batch ``x [batch, time_capacity, features]`` with ``seq_lengths [batch]``:

  (a) ``dropin``: `jaxlod.nn.RNN(cell, return_carry=True)` on the padded
      array and the lengths, as a Flax user calls it: the packing into a
      LoDTensor (capacity the padded shape, the layer's default), the rank
      table, the padding-free loop and the unpacking all run inside the
      jitted step, so their cost is in its time;
  (b) ``flax_capacity``: ``flax.linen.RNN(cell, return_carry=True)`` with
      ``seq_lengths`` over the same arrays (time = the capacity);
  (c) ``flax_longest``: the same over each batch sliced to its own longest
      length (one shape, so one compilation, per distinct longest length);
  (d) ``jaxlod_lod``: for reference, `rnn.py`'s ``jaxlod`` arm,
      `jaxlod.ops.dynamic_rnn` on a LoDTensor under the workload's token
      capacity with the rank table built on the host: ``dropin`` over it is
      what the drop-in's packing, its on-device rank table, its capacity
      (the padded shape's tokens) and its unpacking cost.

Each arm's training step is the value and gradient, w.r.t. the cell
parameters, of the same loss: the sum of squares of the outputs at real
positions plus the sum of the final hidden state. Timings are as `rnn.py`'s
(`benchmarks.timing.measure_interleaved`): one first call (trace and
compile, ``first_call_s``; ``compile_s`` is that less the median), one
warm-up call, then ``--repeats`` rounds in which the arms take turns, and
each arm's median; the ratios are of medians from the same rounds.

``equality`` compares ``dropin`` with ``flax_capacity`` on the timed batch:
outputs at real positions, final carry, loss and gradients (max abs
differences; the gradient's also relative to its largest entry), and checks
the drop-in's outputs are zero past each length.

``compiles``: each padded arm's training step is then called on
``--batches`` (default 100) distinct padded batches of fresh random lengths
(the timed batch first), ``flax_longest`` on each sliced to its longest.
Per arm: the traces of the step in the whole run (a counter inside the
traced function, which runs once per trace; the timed batch, first, was
traced by the timing), its ``_cache_size()``, the XLA compilations during
the pass, the distinct input shapes and the pass's wall time (the
compilations of shapes the timing had not compiled included). An arm
whose pass would take over ``CALL_BUDGET_S`` (estimated from its median and
compile time) is only lowered on each batch, and ``method`` says so.

Run:
  python -m benchmarks.dropin [--workloads W1,W3] [--repeats N] [--batches N]
                              [--out PATH]

``--workloads S --repeats 1 --batches 20`` checks the script end to end in
seconds (`rnn.py`'s tiny workload). The JSON report goes to stdout (and to
``--out PATH``, rewritten after each workload); progress to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxlod.nn
from benchmarks import rnn
from benchmarks.timing import write_report, xla_compiles

DEFAULT_WORKLOADS = ("W1", "W3")
# The targets, reported beside the figures (not asserted here).
TARGET_SPEEDUP_VS_FLAX_CAPACITY = 2.0
# Call each arm's step on every compile-check batch when the pass is
# estimated (compile time per distinct shape plus the median per batch) to
# take at most this long; otherwise only lower it on each batch.
CALL_BUDGET_S = 240.0


# -- arms -------------------------------------------------------------------------


def _train_step(loss: Any, traces: dict) -> Any:
  """Jitted value_and_grad of `loss` w.r.t. its first argument, counting traces."""

  def step(params, *inputs):
    traces["train"] += 1  # Runs once per trace, i.e. once per compilation.
    return jax.value_and_grad(loss)(params, *inputs)

  return jax.jit(step)


def layer_functions(layer: nn.Module, cell: nn.RNNCellBase) -> tuple[Any, Any]:
  """``(forward, loss)`` of `layer` (``flax.linen.RNN(cell,
  return_carry=True)`` or `jaxlod.nn.RNN` of the same attributes, call and
  parameter tree), each of ``(params, x, lengths)``: the loss is the sum of
  squares of the outputs at real steps plus the final hidden state's sum."""

  def forward(params, x, lengths):
    init = rnn.zero_carry(cell, x.shape[0], x.shape[-1])
    variables = {"params": {"cell": params}}
    return layer.apply(variables, x, initial_carry=init, seq_lengths=lengths)

  def loss(params, x, lengths):
    carry, y = forward(params, x, lengths)
    real = jnp.arange(y.shape[1])[None, :] < lengths[:, None]
    return rnn.masked_square_sum(y, real) + jnp.sum(rnn.final_hidden(carry))

  return forward, loss


def layer_arm(
  layer: nn.Module, cell: nn.RNNCellBase, x: Any, lengths: Any, compare: Any = None
) -> rnn.Arm:
  """An arm of `layer` (see `layer_functions`) on the padded ``x [batch,
  time, features]`` and ``lengths [batch]``; `rnn.flax_arm`'s functions,
  for either."""
  forward, loss = layer_functions(layer, cell)
  traces = {"train": 0}
  inputs = (jnp.asarray(x), jnp.asarray(lengths, jnp.int32))
  return rnn.Arm(jax.jit(forward), _train_step(loss, traces), inputs, compare, traces)


def padded_arm(layer_type: type, cell: nn.RNNCellBase, batch: rnn.Batch, time: int):
  """`layer_arm` of ``layer_type(cell, return_carry=True)`` on the batch
  padded to `time` steps, its real rows compared."""

  def compare(result):
    carry, y = result
    return rnn.real_rows_of_padded(y, batch.lengths), carry

  layer = layer_type(cell, return_carry=True)
  return layer_arm(layer, cell, batch.padded[:, :time], batch.lengths, compare)


def build_arms(w: rnn.Workload, batch: rnn.Batch) -> dict[str, rnn.Arm]:
  cell = rnn.make_cell(w)
  return {
    "dropin": padded_arm(jaxlod.nn.RNN, cell, batch, w.time_capacity),
    "flax_capacity": padded_arm(nn.RNN, cell, batch, w.time_capacity),
    "flax_longest": padded_arm(nn.RNN, cell, batch, batch.longest),
    "jaxlod_lod": rnn.jaxlod_arm(cell, batch, remat=False),
  }


# -- equality ---------------------------------------------------------------------


def _max_abs_diff(a: Any, b: Any) -> float:
  diffs = jax.tree.map(lambda x, y: np.max(np.abs(np.asarray(x) - np.asarray(y))), a, b)
  return float(max(jax.tree.leaves(diffs)))


def equality(dropin: rnn.Arm, flax: rnn.Arm, params: Any, lengths: np.ndarray):
  """The drop-in against Flax padded to the capacity, on the timed batch."""
  result = {}
  rows, carry = {}, {}
  for name, arm in (("dropin", dropin), ("flax", flax)):
    out = arm.forward(params, *arm.inputs)
    rows[name], carry[name] = arm.compare(out)
    result.setdefault("loss", {})[name], result.setdefault("grads", {})[name] = (
      arm.train(params, *arm.inputs)
    )
  _, y = dropin.forward(params, *dropin.inputs)
  past = np.arange(y.shape[1])[None, :] >= lengths[:, None]
  grads = result["grads"]
  grad_diff = _max_abs_diff(grads["dropin"], grads["flax"])
  grad_scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads["flax"]))
  loss = {name: float(value) for name, value in result["loss"].items()}
  return {
    "outputs_max_abs_diff": float(np.max(np.abs(rows["dropin"] - rows["flax"]))),
    "final_carry_max_abs_diff": _max_abs_diff(carry["dropin"], carry["flax"]),
    "loss_dropin": loss["dropin"],
    "loss_flax_capacity": loss["flax"],
    "loss_abs_diff": abs(loss["dropin"] - loss["flax"]),
    "loss_rel_diff": abs(loss["dropin"] / loss["flax"] - 1.0),
    "grad_max_abs_diff": grad_diff,
    "grad_max_rel_diff": grad_diff / grad_scale,
    "dropin_zero_past_lengths": bool(np.all(np.asarray(y)[past] == 0.0)),
  }


# -- compile count ----------------------------------------------------------------


def padded_batches(w: rnn.Workload, batch: rnn.Batch, count: int) -> list[tuple]:
  """`count` distinct ``(padded x, lengths)`` on the host, the timed batch
  first; the others share its rows and draw fresh lengths."""
  rng = np.random.default_rng(1)
  rows = batch.padded[np.arange(w.time_capacity)[None, :] < batch.lengths[:, None]]
  out, seen = [(batch.padded, batch.lengths)], {tuple(batch.lengths)}
  while len(out) < count:
    lengths = w.sample_lengths(rng, w.batch)
    if tuple(lengths) in seen:
      continue
    seen.add(tuple(lengths))
    mask = np.arange(w.time_capacity)[None, :] < lengths[:, None]
    x = np.zeros((w.batch, w.time_capacity, w.features), np.float32)
    x[mask] = np.resize(rows, (int(lengths.sum()), w.features))
    out.append((x, lengths))
  return out


def compile_check(arm: rnn.Arm, params: Any, batches: list, longest: bool, timing):
  """The traces and compilations of `arm`'s step over `batches` (each sliced
  to its longest length when `longest`), called or only lowered (see
  `CALL_BUDGET_S`)."""
  inputs = [
    (jnp.asarray(x[:, : lengths.max()] if longest else x), jnp.asarray(lengths))
    for x, lengths in batches
  ]
  shapes = {x.shape for x, _ in inputs}
  estimate = len(shapes) * timing["compile_s"] + len(inputs) * timing["median_s"]
  call = estimate <= CALL_BUDGET_S
  start = time.perf_counter()
  with xla_compiles() as xla:
    for x, lengths in inputs:
      if call:
        jax.block_until_ready(arm.train(params, x, lengths.astype(jnp.int32)))
      else:
        arm.train.lower(params, x, lengths.astype(jnp.int32))
  return {
    "batches": len(inputs),
    "distinct_shapes": len(shapes),
    # Every trace of the step in the run: the timed batch is the first.
    "traces": arm.traces["train"],
    "cache_size": arm.train._cache_size(),
    "xla_compiles": sum(xla.values()),
    "method": "jit call on each batch" if call else "lower() on each batch",
    "estimated_s": estimate,
    "wall_s": time.perf_counter() - start,
  }


# -- one workload -----------------------------------------------------------------


def summarize(timings: dict) -> dict[str, Any]:
  m = {name: t["median_s"] for name, t in timings.items()}
  summary = {f"{name}_s": s for name, s in m.items()}
  summary["speedup_vs_flax_capacity"] = m["flax_capacity"] / m["dropin"]
  summary["speedup_vs_flax_longest"] = m["flax_longest"] / m["dropin"]
  summary["dropin_over_flax_capacity"] = m["dropin"] / m["flax_capacity"]
  summary["dropin_over_flax_longest"] = m["dropin"] / m["flax_longest"]
  summary["dropin_over_jaxlod_lod"] = m["dropin"] / m["jaxlod_lod"]
  summary["meets_target_vs_flax_capacity"] = (
    summary["speedup_vs_flax_capacity"] >= TARGET_SPEEDUP_VS_FLAX_CAPACITY
  )
  for key in ("first_call_s", "compile_s", "times_s", "minor_faults_per_call"):
    summary[key] = {name: t[key] for name, t in timings.items()}
  return summary


def run_workload(w: rnn.Workload, repeats: int, count: int) -> dict[str, Any]:
  batch = rnn.make_batch(w, np.random.default_rng(0))
  params = rnn.init_params(rnn.make_cell(w), w)
  arms = build_arms(w, batch)
  timings = rnn.time_arms(arms, params, "train", repeats)
  batches = padded_batches(w, batch, count)
  compiles = {}
  for name in ("dropin", "flax_capacity", "flax_longest"):
    longest = name == "flax_longest"
    compiles[name] = compile_check(arms[name], params, batches, longest, timings[name])
    print(f"  compiles {name:14s} {compiles[name]}", file=sys.stderr)
  lengths = batch.lengths
  return {
    "config": {k: v for k, v in dataclasses.asdict(w).items() if k != "sample_lengths"},
    "batch": {
      "lengths_mean": float(lengths.mean()),
      "lengths_max": batch.longest,
      "token_steps": {
        "real": int(lengths.sum()),
        "flax_capacity": w.batch * w.time_capacity,
        "flax_longest": w.batch * batch.longest,
      },
      "dropin_capacity": {
        "tokens": w.batch * w.time_capacity,
        "sequences": w.batch,
        "time": w.time_capacity,
      },
      "jaxlod_lod_capacity": batch.lod.capacity._asdict(),
    },
    "train": summarize(timings),
    "equality": equality(arms["dropin"], arms["flax_capacity"], params, lengths),
    "compiles": compiles,
  }


# -- command line -----------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument(
    "--batches", type=int, default=100, help="batches of the compile count"
  )
  parser.add_argument("--out", type=Path, default=None, help="also write here")
  args = parser.parse_args(argv)
  args.workloads = rnn.workload_names(parser, args)
  if args.batches < 1:
    parser.error(f"--batches must be >= 1, got {args.batches}")
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  start = time.perf_counter()
  report = {
    "machine": rnn.machine_info(),
    "repeats": args.repeats,
    "target_speedup_vs_flax_capacity": TARGET_SPEEDUP_VS_FLAX_CAPACITY,
    "workloads": {},
  }
  for name in args.workloads:
    print(f"{name}: {rnn.WORKLOADS[name].description}", file=sys.stderr)
    report["workloads"][name] = run_workload(
      rnn.WORKLOADS[name], args.repeats, args.batches
    )
    report["wall_s"] = time.perf_counter() - start
    if args.out is not None:  # what is done so far, should the run stop
      args.out.write_text(json.dumps(report, indent=2) + "\n")
  report["wall_s"] = time.perf_counter() - start
  write_report(report, args.out)
  return report


if __name__ == "__main__":
  main()
