"""Compile time against step time: the frontier of jaxlod's schedules.

`dynamic_rnn` compiles a forward and a backward loop body for each ladder
size, so its ladder trades compile time against step time. For workloads W1
and W3 of ``benchmarks/rnn.py`` (same batches, same cell weights), one
process measures side by side the training step (value and gradient) of:

  * ``floor`` and ``flax_capacity``: the dense floor and padded
    `flax.linen.RNN`, as in ``rnn.py`` (the compile-time yardsticks);
  * ``ladder_*``: `dynamic_rnn` with the rank table's ladder set to the
    default, the powers of two, every fourth power of two, two sizes and one
    size (one loop body);
  * ``lanes``: a one-body design through the public API, measured to see
    whether sharing one body beats the ladder. The host packs the sequences
    into ``token_capacity // time_capacity`` lanes (longest first, each onto
    the least loaded lane), a lane runs its sequences back to back with the
    carry reset at each start, and `dynamic_rnn` runs the lanes with the
    one-size ladder. Its loss matches jaxlod's up to float32 summation
    order (``lanes_loss_abs_diff``).

``step_cost`` is why: the training step's time per step of a dense
`lax.scan` of the workload's cell at batch sizes 4 to the count capacity
(``per_step_s`` and ``per_row_s``). A step's cost has a large part that does
not shrink with its batch, so every design pays for the longest sequence's
steps, and the fewer rows a step has, the more it pays per row.

Each arm reports ``compile_s`` (first call less the median), ``step_s`` (the
median of ``--repeats`` interleaved rounds), ``ratio_to_floor`` and its
schedule's token-steps. ``compilation_cache`` times the first call of W1's
jaxlod training step in two fresh processes sharing an empty
`jaxlod.enable_compilation_cache` directory: the first compiles and stores,
the second loads.

Run:
  python -m benchmarks.compile [--workloads W1,W3] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxlod
import jaxlod.ops
from benchmarks import rnn  # the workloads, batches and arms of benchmarks/rnn.py
from benchmarks.timing import machine_info, measure_interleaved, write_report


def ladders(count: int) -> dict[str, tuple[int, ...] | None]:
  """The ladders measured for a count capacity."""
  pow2 = [count] + [2**k for k in range(count.bit_length() - 1, 1, -1) if 2**k < count]
  return {
    "ladder_default": None,
    "ladder_pow2": tuple(pow2),
    "ladder_pow4": tuple(pow2[::2]),
    "ladder_two": (count, count // 4),
    "ladder_one": (count,),
  }


# -- the one-body lanes design ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Lanes:
  """A batch packed into lanes: inputs, reset flags, and each sequence's end row."""

  inputs: tuple[jaxlod.LoDTensor, jaxlod.LoDTensor]  # rows, reset flag [rows, 1]
  table: jaxlod.ops.RankTable
  ends: jax.Array  # [batch] lane row of each sequence's last step
  count: int  # lanes
  makespan: int  # steps of the longest lane


def pack_lanes(w: rnn.Workload, batch: rnn.Batch) -> Lanes:
  """Longest first, each sequence onto the least loaded lane (ties: lowest)."""
  count = max(1, w.token_capacity // w.time_capacity)
  lengths = batch.lengths
  heap = [(0, lane) for lane in range(count)]
  members: list[list[int]] = [[] for _ in range(count)]
  for seq in np.argsort(-lengths, kind="stable"):
    load, lane = heapq.heappop(heap)
    members[lane].append(int(seq))
    heapq.heappush(heap, (load + int(lengths[seq]), lane))
  starts = np.concatenate([[0], np.cumsum(lengths)])
  rows, reset, ends, lane_lengths = [], [], np.zeros(len(lengths), np.int32), []
  for lane in members:
    for seq in lane:
      rows.extend(range(starts[seq], starts[seq + 1]))
      reset.extend([1.0] + [0.0] * (int(lengths[seq]) - 1))
      ends[seq] = len(rows) - 1
    lane_lengths.append(sum(int(lengths[seq]) for seq in lane))
  buckets = jaxlod.Buckets.fixed(
    tokens=w.token_capacity,
    sequences=count,
    time=-(-w.token_capacity // count) + w.time_capacity,
  )
  values = np.asarray(batch.lod.values)[np.asarray(rows)]
  flags = np.asarray(reset, np.float32)[:, None]
  inputs = tuple(
    jaxlod.LoDTensor.from_lengths(v, [lane_lengths], buckets=buckets)
    for v in (values, flags)
  )
  table = jaxlod.ops.rank_table(inputs[0], ladder=(count,))
  return Lanes(inputs, table, jnp.asarray(ends), count, max(lane_lengths))


def lanes_arm(w: rnn.Workload, cell: Any, lanes: Lanes) -> rnn.Arm:
  def forward(params, inputs, table, ends):
    def step(carry, x_t, static):
      del static
      x, reset = x_t
      carry = jax.tree.map(lambda c: c * (1 - reset), carry)
      return cell.apply({"params": params}, carry, x)

    init = rnn.zero_carry(cell, lanes.count, w.features)
    outputs, _ = jaxlod.ops.dynamic_rnn(step, inputs, init_carry=init, table=table)
    return outputs

  def loss(params, inputs, table, ends):
    y = forward(params, inputs, table, ends)
    real = jnp.arange(y.capacity.tokens) < y.num_rows
    # The final hidden state of each sequence is its output at its last row.
    return rnn.masked_square_sum(y.values, real) + jnp.sum(y.values[ends])

  inputs = (lanes.inputs, jax.device_put(lanes.table), lanes.ends)
  return rnn.Arm(jax.jit(forward), jax.jit(jax.value_and_grad(loss)), inputs, None)


# -- what a step costs at each batch size -------------------------------------------


def step_cost(w: rnn.Workload, cell: Any, params: Any, repeats: int) -> dict:
  """Training-step seconds per step of a dense scan over 32 steps, per batch."""
  steps, sizes = 32, [b for b in (4, 8, 16, 32, 64, 128, 256) if b <= w.batch]

  def loss(params, x):
    def step(carry, x_t):
      return cell.apply({"params": params}, carry, x_t)

    carry, y = jax.lax.scan(step, rnn.zero_carry(cell, x.shape[1], x.shape[2]), x)
    return jnp.sum(jnp.square(y)) + jnp.sum(rnn.final_hidden(carry))

  train = jax.jit(jax.value_and_grad(loss))
  rng = np.random.default_rng(3)
  inputs = {
    b: jnp.asarray(rng.standard_normal((steps, b, w.features), np.float32))
    for b in sizes
  }
  calls = {
    str(b): (lambda b=b: train(params, inputs[b]), jax.block_until_ready) for b in sizes
  }
  measured = measure_interleaved(calls, repeats)
  return {
    str(b): {
      "per_step_s": measured[str(b)]["median_s"] / steps,
      "per_row_s": measured[str(b)]["median_s"] / steps / b,
    }
    for b in sizes
  }


# -- one workload -------------------------------------------------------------------


def run_workload(w: rnn.Workload, repeats: int) -> dict[str, Any]:
  batch = rnn.make_batch(w, np.random.default_rng(0))
  cell = rnn.make_cell(w)
  params = rnn.init_params(cell, w)
  arms = {
    "floor": rnn.floor_arm(cell, batch),
    "flax_capacity": rnn.flax_arm(cell, batch, w.time_capacity),
  }
  schedule = {}
  for name, ladder in ladders(w.batch).items():
    table = jaxlod.ops.rank_table(batch.lod, ladder=ladder)
    arms[name] = rnn.jaxlod_arm(cell, dataclasses.replace(batch, table=table), False)
    schedule[name] = {
      "ladder": list(table.ladder),
      "token_steps": int(table.schedule_steps()),
    }
  lanes = pack_lanes(w, batch)
  arms["lanes"] = lanes_arm(w, cell, lanes)
  schedule["lanes"] = {
    "lanes": lanes.count,
    "makespan": lanes.makespan,
    "token_steps": lanes.count * lanes.makespan,
  }
  measured = rnn.time_arms(arms, params, "train", repeats)
  floor_s = measured["floor"]["median_s"]
  result = {
    name: {
      "compile_s": t["compile_s"],
      "step_s": t["median_s"],
      "ratio_to_floor": t["median_s"] / floor_s,
      "minor_faults_per_call": t["minor_faults_per_call"],
      **schedule.get(name, {}),
    }
    for name, t in measured.items()
  }
  for name, t in result.items():
    print(
      f"  {name:15s} compile {t['compile_s']:6.2f} s  step {t['step_s']:.4f} s  "
      f"x{t['ratio_to_floor']:.2f} floor",
      file=sys.stderr,
    )
  reference = arms["ladder_default"].train(params, *arms["ladder_default"].inputs)[0]
  packed = arms["lanes"].train(params, *arms["lanes"].inputs)[0]
  return {
    "config": {k: v for k, v in dataclasses.asdict(w).items() if k != "sample_lengths"},
    "lengths": {"real_tokens": int(batch.lengths.sum()), "longest": batch.longest},
    "arms": result,
    "loss": float(reference),
    "lanes_loss_abs_diff": float(abs(packed - reference)),
    "step_cost": step_cost(w, cell, params, repeats),
  }


# -- the persistent compilation cache -----------------------------------------------


def first_call_child() -> None:
  """In a fresh process: the first call of W1's jaxlod training step."""
  began = time.perf_counter()
  jaxlod.enable_compilation_cache(min_compile_time_s=0.0)
  w = rnn.WORKLOADS["W1"]
  batch = rnn.make_batch(w, np.random.default_rng(0))
  cell = rnn.make_cell(w)
  params = rnn.init_params(cell, w)
  arm = rnn.jaxlod_arm(cell, batch, remat=False)
  start = time.perf_counter()
  jax.block_until_ready(arm.train(params, *arm.inputs))
  first = time.perf_counter() - start
  print(json.dumps({"first_call_s": first, "process_s": time.perf_counter() - began}))


def cache_effect() -> dict[str, Any]:
  runs = []
  with tempfile.TemporaryDirectory() as cache:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAXLOD_COMPILATION_CACHE"] = cache
    for _ in range(2):
      done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compile", "--first-call-child"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
      )
      runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
  cold, warm = runs
  print(
    f"  cache: first call {cold['first_call_s']:.2f} s cold, "
    f"{warm['first_call_s']:.2f} s warm",
    file=sys.stderr,
  )
  return {"W1_jaxlod_train": {"cold": cold, "warm": warm}}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default="W1,W3")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", type=Path, default=None, help="also write here")
  parser.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.first_call_child:
    first_call_child()
    return
  names = rnn.workload_names(parser, args)
  start = time.perf_counter()
  report = {"machine": machine_info(), "repeats": args.repeats, "workloads": {}}
  for name in names:
    print(f"{name}: {rnn.WORKLOADS[name].description}", file=sys.stderr)
    report["workloads"][name] = run_workload(rnn.WORKLOADS[name], args.repeats)
  report["compilation_cache"] = cache_effect()
  report["wall_s"] = time.perf_counter() - start
  write_report(report, args.json)


if __name__ == "__main__":
  main()
