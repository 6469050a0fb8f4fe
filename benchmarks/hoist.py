"""Hoisting the input projection and the recurrent weight gradient, measured.

cuDNN's RNNs compute the input projection of every row as one matrix
product before the loop and the recurrent weights' gradient as one product
after it, so the loop keeps only the recurrent product. This script measures
that design on the workloads of ``benchmarks/rnn.py`` (same batches, cells
and loss; W1 and W3 are LSTMs, W2 a GRU), training step (value and
gradient), side by side in one process:

  * ``floor`` and ``jaxlod``: as in ``rnn.py`` (the cell as Flax defines it);
  * ``floor_hoisted``: the dense floor with the input projection of all rows
    as one product before the scan (gradients by autodiff);
  * ``jaxlod_hoisted``: the input projection of all packed rows as one
    product, `jaxlod.ops.dynamic_rnn` over the recurrent part only, and the
    recurrent kernel's gradient as one product over all rows after the loop
    (a `jax.custom_vjp`: the loop does no per-step weight-gradient work). The
    per-row cotangent of the recurrent product comes from a zero input added
    to it (for the LSTM, the projected input itself plays that part), and
    the previous hidden state of each row is the previous row's output.

Gradients are checked against jaxlod's (``max_abs_grad_diff``). The
parameter tree is Flax's: the hoisted arms read the per-gate kernels of
``nn.OptimizedLSTMCell`` and ``nn.GRUCell`` (default gate and activation
functions).

Run:
  python -m benchmarks.hoist [--workloads W1,W2,W3] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxlod
import jaxlod.ops
from benchmarks import rnn  # the workloads, batches and arms of benchmarks/rnn.py
from benchmarks.timing import machine_info, write_report

# -- the cells, split into an input projection and a recurrence ----------------------


@dataclasses.dataclass(frozen=True)
class Split:
  """A Flax cell as ``x @ w_in + b`` (hoisted) and a recurrent step."""

  gates: str  # gate names, Flax's order
  probe: bool  # the recurrent product needs its own cotangent (not the input's)

  def weights(self, p: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    w_in = jnp.concatenate([p["i" + g]["kernel"] for g in self.gates], 1)
    w_rec = jnp.concatenate([p["h" + g]["kernel"] for g in self.gates], 1)
    if self.probe:  # GRU: input biases; the recurrent bias of `n` stays inside
      bias = jnp.concatenate([p["i" + g]["bias"] for g in self.gates])
    else:  # LSTM: the recurrent biases, all summed with the input projection
      bias = jnp.concatenate([p["h" + g]["bias"] for g in self.gates])
    return w_in, w_rec, bias

  def step(self, p: dict, carry: Any, xp: jax.Array, hp: jax.Array) -> tuple:
    """One step from the projected input `xp` and recurrent product `hp`."""
    if not self.probe:
      c, h = carry
      i, f, g, o = jnp.split(xp + hp, 4, axis=-1)
      c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      h = jax.nn.sigmoid(o) * jnp.tanh(c)
      return (c, h), h
    h = carry
    xr, xz, xn = jnp.split(xp, 3, axis=-1)
    hr, hz, hn = jnp.split(hp, 3, axis=-1)
    r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * (hn + p["hn"]["bias"]))
    h = (1.0 - z) * n + z * h
    return h, h


SPLITS = {"lstm": Split("ifgo", probe=False), "gru": Split("rzn", probe=True)}


def hidden(carry: Any) -> jax.Array:
  return rnn.final_hidden(carry)


# -- arms ---------------------------------------------------------------------------


def floor_hoisted_arm(w: rnn.Workload, cell: Any, batch: rnn.Batch) -> rnn.Arm:
  split = SPLITS[w.cell]

  def loss(p, x):
    w_in, w_rec, bias = split.weights(p)
    xp = x @ w_in + bias  # every row at once

    def step(carry, xp_t):
      return split.step(p, carry, xp_t, hidden(carry) @ w_rec)

    carry, y = jax.lax.scan(step, rnn.zero_carry(cell, x.shape[1], x.shape[2]), xp)
    return jnp.sum(jnp.square(y)) + jnp.sum(hidden(carry))

  inputs = (jnp.asarray(batch.dense),)
  return rnn.Arm(None, jax.jit(jax.value_and_grad(loss)), inputs, None)


def previous_hidden(y: jaxlod.LoDTensor, init_h: jax.Array) -> jax.Array:
  """Per packed row, the hidden state the step started from: the previous
  row's output, or the sequence's initial state at its first row."""
  offsets = y.offsets[-1]
  rows = jnp.arange(y.capacity.tokens)
  count = offsets.shape[0] - 1
  seq = jnp.clip(jnp.searchsorted(offsets, rows, side="right") - 1, 0, count - 1)
  before = jnp.concatenate([jnp.zeros_like(y.values[:1]), y.values[:-1]])
  prev = jnp.where((rows == offsets[seq])[:, None], init_h[seq], before)
  return jnp.where((rows < offsets[-1])[:, None], prev, 0.0)


def jaxlod_hoisted_arm(w: rnn.Workload, cell: Any, batch: rnn.Batch) -> rnn.Arm:
  split = SPLITS[w.cell]

  def run(p, xs, table, init, w_rec):
    def step(carry, x_t, static):
      del static
      xp, e = x_t if split.probe else (x_t[0], 0.0)
      return split.step(p, carry, xp, hidden(carry) @ w_rec + e)

    return jaxlod.ops.dynamic_rnn(step, xs, init_carry=init, table=table)

  @jax.custom_vjp
  def loop(p, xs, table, init, w_rec):
    return run(p, xs, table, init, w_rec)

  def loop_fwd(p, xs, table, init, w_rec):
    # `w_rec` is closed over and not differentiated: the loop does no
    # per-step work for its gradient.
    out, vjp = jax.vjp(lambda p, xs, init: run(p, xs, table, init, w_rec), p, xs, init)
    return out, (vjp, out[0], init)

  def loop_bwd(res, g):
    vjp, y, init = res
    g_p, g_xs, g_init = vjp(g)
    probe = g_xs[-1].values  # the cotangent of each row's recurrent product
    g_rec = previous_hidden(y, hidden(init)).T @ probe
    return g_p, g_xs, None, g_init, g_rec

  loop.defvjp(loop_fwd, loop_bwd)

  def loss(p, x, table):
    w_in, w_rec, bias = split.weights(p)
    xs = (x.with_values(x.values @ w_in + bias),)
    if split.probe:
      xs += (x.with_values(jnp.zeros((x.capacity.tokens, w_rec.shape[1]))),)
    init = rnn.zero_carry(cell, x.capacity.sequences[-1], w.features)
    y, carry = loop(p, xs, table, init, w_rec)
    real = jnp.arange(y.capacity.tokens) < y.num_rows
    return rnn.masked_square_sum(y.values, real) + jnp.sum(hidden(carry))

  inputs = (batch.lod, jax.device_put(batch.table))
  return rnn.Arm(None, jax.jit(jax.value_and_grad(loss)), inputs, None)


def run_workload(w: rnn.Workload, repeats: int) -> dict[str, Any]:
  batch = rnn.make_batch(w, np.random.default_rng(0))
  cell = rnn.make_cell(w)
  params = rnn.init_params(cell, w)
  arms = {
    "floor": rnn.floor_arm(cell, batch),
    "floor_hoisted": floor_hoisted_arm(w, cell, batch),
    "jaxlod": rnn.jaxlod_arm(cell, batch, remat=False),
    "jaxlod_hoisted": jaxlod_hoisted_arm(w, cell, batch),
  }
  measured = rnn.time_arms(arms, params, "train", repeats)
  times = {name: t["median_s"] for name, t in measured.items()}
  reference = arms["jaxlod"].train(params, *arms["jaxlod"].inputs)
  hoisted = arms["jaxlod_hoisted"].train(params, *arms["jaxlod_hoisted"].inputs)
  diff = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(hoisted), strict=True)
  )
  result = {
    "config": {k: v for k, v in dataclasses.asdict(w).items() if k != "sample_lengths"},
    "step_s": times,
    "compile_s": {name: t["compile_s"] for name, t in measured.items()},
    "minor_faults_per_call": {
      name: t["minor_faults_per_call"] for name, t in measured.items()
    },
    "ratio_to_floor": {name: s / times["floor"] for name, s in times.items()},
    "floor_hoisted_speedup": times["floor"] / times["floor_hoisted"],
    "jaxlod_hoisted_speedup": times["jaxlod"] / times["jaxlod_hoisted"],
    "max_abs_grad_diff": diff,
  }
  print(
    f"  hoisting: floor x{result['floor_hoisted_speedup']:.2f}, "
    f"jaxlod x{result['jaxlod_hoisted_speedup']:.2f} (above 1: faster); "
    f"gradients within {diff:.1e}",
    file=sys.stderr,
  )
  return result


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default="W1,W2,W3")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", type=Path, default=None, help="also write here")
  args = parser.parse_args(argv)
  names = rnn.workload_names(parser, args)
  start = time.perf_counter()
  report = {"machine": machine_info(), "repeats": args.repeats, "workloads": {}}
  for name in names:
    print(f"{name}: {rnn.WORKLOADS[name].description}", file=sys.stderr)
    report["workloads"][name] = run_workload(rnn.WORKLOADS[name], args.repeats)
  report["wall_s"] = time.perf_counter() - start
  write_report(report, args.json)


if __name__ == "__main__":
  main()
