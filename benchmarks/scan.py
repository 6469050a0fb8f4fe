"""The minGRU training step: `jaxlod.ops.linear_scan` against padded scans
and `dynamic_rnn`, side by side in one process.

A minGRU layer (hidden 256, inputs 256: ``z = sigmoid(W_z x)``, ``h~ = W_h
x``, ``h = (1 - z) * h_prev + z * h~``) on W1's lengths (64 sentences,
log-normal, mean 30, at most 128) and W3's (256 words, at most 28) of
`benchmarks/rnn.py`; one training step is the loss (the mean square of the
states over the real rows) and its gradient with respect to the gate
weights, jitted, for five arms on the same batch and weights:

* ``linear_scan``: `jaxlod.nn.MinGRU` over the LoDTensor: one product over
  the packed rows, then one segmented associative scan of the rows;
* ``assoc_capacity``: the batch padded to ``[batch, time_capacity]``, a
  `jax.lax.associative_scan` along time, the loss masked;
* ``assoc_longest``: the same sliced to the batch's longest length (one
  compilation per distinct longest length);
* ``scan_capacity``: a sequential `jax.lax.scan` over the padded time axis;
* ``dynamic_rnn``: `jaxlod.ops.dynamic_rnn` with the minGRU step as its
  step (the backend's default plan).

Times are medians of interleaved rounds (`benchmarks.timing`); ``speedup``
is each other arm's median over ``linear_scan``'s. The losses and
gradients of every arm are compared with ``linear_scan``'s
(``max_rel_diff``). ``compiles_over_100_batches``: traces of the
``linear_scan`` step over 100 batches of fresh lengths. ``temp_bytes``:
XLA's temporary buffer of the compiled ``linear_scan`` step
(``memory_analysis``) on the workload and on its lengths ten times longer,
beside those of a plain `jax.lax.associative_scan` of the packed rows
differentiated by JAX (``autodiff_temp_bytes``), which saves the scan's
tree of partial products.

Usage: ``python -m benchmarks.scan [--workloads W1,W3] [--repeats N] [--json
PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.rnn import WORKLOADS, Workload, make_batch
from benchmarks.timing import machine_info, measure_interleaved, write_report
from jaxlod.nn import MinGRU
from jaxlod.ops import dynamic_rnn

HIDDEN = 256
TARGETS = {
  "cpu": {"W1_vs_assoc_capacity": 2.0, "vs_assoc_longest": 1.0},
  "gpu": {"W1_vs_dynamic_rnn": 10.0, "W1_vs_assoc_capacity": 2.0},
}
ARMS = (
  "linear_scan",
  "assoc_capacity",
  "assoc_longest",
  "scan_capacity",
  "dynamic_rnn",
)


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def workload(name: str) -> Workload:
  """`benchmarks.rnn`'s workload `name` at hidden 256 (inputs and states)."""
  return dataclasses.replace(WORKLOADS[name], features=HIDDEN, hidden=HIDDEN)


def longer(w: Workload, factor: int) -> Workload:
  """`w` with every length (and capacity) `factor` times longer."""
  sample = w.sample_lengths
  return dataclasses.replace(
    w,
    time_capacity=w.time_capacity * factor,
    token_capacity=w.token_capacity * factor,
    sample_lengths=lambda rng, n: sample(rng, n) * factor,
  )


def batch(w: Workload, rng: np.random.Generator) -> dict[str, Any]:
  """`benchmarks.rnn.make_batch`'s batch, with the padded rows' mask."""
  made = make_batch(w, rng)
  mask = np.arange(w.time_capacity)[None, :] < made.lengths[:, None]
  return {"lengths": made.lengths, "lod": made.lod, "padded": made.padded, "mask": mask}


def coefficients(params, x):
  """minGRU's ``(a, b) = (1 - z, z * h~)`` of rows ``x [..., features]``."""
  g = x @ params["gates"]["kernel"] + params["gates"]["bias"]
  z = jax.nn.sigmoid(g[..., :HIDDEN])
  return 1 - z, z * g[..., HIDDEN:]


def _compose(first, second):
  return first[0] * second[0], second[0] * first[1] + second[1]


def steps(w: Workload) -> dict[str, Any]:
  """Each arm's jitted ``(params, *inputs) -> (loss, grads)``."""
  layer = MinGRU(HIDDEN)

  def packed_loss(params, x):
    h = layer.apply({"params": params}, x).values
    return jnp.sum(h**2) / x.num_rows

  def padded_assoc(params, padded, mask):
    a, b = coefficients(params, padded)
    h = jax.lax.associative_scan(_compose, (a, b), axis=1)[1]
    return jnp.sum(jnp.where(mask[..., None], h**2, 0)) / jnp.sum(mask)

  def padded_scan(params, padded, mask):
    a, b = coefficients(params, padded)

    def step(h, ab):
      h = ab[0] * h + ab[1]
      return h, h

    h0 = jnp.zeros((padded.shape[0], HIDDEN), padded.dtype)
    _, h = jax.lax.scan(step, h0, (jnp.swapaxes(a, 0, 1), jnp.swapaxes(b, 0, 1)))
    h = jnp.swapaxes(h, 0, 1)
    return jnp.sum(jnp.where(mask[..., None], h**2, 0)) / jnp.sum(mask)

  def loop_loss(params, x):
    def step(h, x_t, _):
      a, b = coefficients(params, x_t)
      h = a * h + b
      return h, h

    zeros = jnp.zeros((x.capacity.sequences[-1], HIDDEN), x.values.dtype)
    out, _ = dynamic_rnn(step, x, init_carry=zeros)
    return jnp.sum(out.values**2) / x.num_rows

  def grad(loss):
    return jax.jit(jax.value_and_grad(loss))

  return {
    "linear_scan": grad(packed_loss),
    "assoc_capacity": grad(padded_assoc),
    "assoc_longest": grad(padded_assoc),
    "scan_capacity": grad(padded_scan),
    "dynamic_rnn": grad(loop_loss),
  }


def _inputs(arm: str, data: dict[str, Any]) -> tuple:
  if arm in ("linear_scan", "dynamic_rnn"):
    return (data["lod"],)
  padded, mask = data["padded"], data["mask"]
  if arm == "assoc_longest":
    longest = int(data["lengths"].max())
    padded, mask = padded[:, :longest], mask[:, :longest]
  return (padded, mask)


def _autodiff_step():
  """A plain associative scan of the packed rows differentiated by JAX (the
  scan's tree of partial products saved), with `linear_scan`'s restarts."""

  def loss(params, x):
    a, b = coefficients(params, x.values)
    offsets = x.offsets[-1]
    segment = x.segment_ids()
    count = x.capacity.sequences[-1]
    starts = x.row_mask() & (
      jnp.arange(x.capacity.tokens) == offsets[jnp.minimum(segment, count - 1)]
    )
    a = jnp.where(starts[:, None], 0, a)
    h = jax.lax.associative_scan(_compose, (a, b))[1]
    h = jnp.where(x.row_mask()[:, None], h, 0)
    return jnp.sum(h**2) / x.num_rows

  return jax.jit(jax.value_and_grad(loss))


def temp_bytes(step: Any, params: Any, data: dict[str, Any], arm: str) -> int:
  compiled = step.lower(params, *_inputs(arm, data)).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def rel_diff(a: Any, b: Any) -> float:
  """The largest ``max|x - y| / max|y|`` over the leaves of `a` and `b`."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
  return worst


def run_workload(name: str, repeats: int) -> dict[str, Any]:
  w = workload(name)
  rng = np.random.default_rng(0)
  data = batch(w, rng)
  params = MinGRU(HIDDEN).init(jax.random.key(0), data["lod"])["params"]
  fns = steps(w)
  calls = {
    arm: (lambda arm=arm: fns[arm](params, *_inputs(arm, data)), jax.block_until_ready)
    for arm in ARMS
  }
  _log(f"{name}: timing {', '.join(ARMS)}")
  timing = measure_interleaved(calls, repeats)
  outputs = {arm: jax.device_get(calls[arm][0]()) for arm in ARMS}
  base = timing["linear_scan"]["median_s"]
  report: dict[str, Any] = {
    "batch": w.batch,
    "time_capacity": w.time_capacity,
    "token_capacity": w.token_capacity,
    "tokens": int(data["lengths"].sum()),
    "longest": int(data["lengths"].max()),
    "arms": {
      arm: {
        "median_s": timing[arm]["median_s"],
        "compile_s": timing[arm]["compile_s"],
        "times_s": timing[arm]["times_s"],
      }
      for arm in ARMS
    },
    "speedup": {
      arm: timing[arm]["median_s"] / base for arm in ARMS if arm != "linear_scan"
    },
    "max_rel_diff": {
      arm: rel_diff(outputs[arm], outputs["linear_scan"])
      for arm in ARMS
      if arm != "linear_scan"
    },
  }
  _log(f"{name}: compiles over 100 batches")
  traces = []

  @jax.jit
  def counted(params, x):
    traces.append(1)
    return fns["linear_scan"](params, x)

  for _ in range(100):
    counted(params, batch(w, rng)["lod"])
  report["compiles_over_100_batches"] = len(traces)
  _log(f"{name}: temporary bytes")
  long_w = longer(w, 10)
  long_data = batch(long_w, np.random.default_rng(1))
  autodiff = _autodiff_step()
  report["temp_bytes"] = {
    "workload": temp_bytes(fns["linear_scan"], params, data, "linear_scan"),
    "lengths_x10": temp_bytes(
      steps(long_w)["linear_scan"], params, long_data, "linear_scan"
    ),
  }
  report["autodiff_temp_bytes"] = {
    "workload": temp_bytes(autodiff, params, data, "linear_scan"),
    "lengths_x10": temp_bytes(autodiff, params, long_data, "linear_scan"),
  }
  report["temp_bytes"]["ratio_x10"] = (
    report["temp_bytes"]["lengths_x10"] / report["temp_bytes"]["workload"]
  )
  return report


def run(names: list[str], repeats: int) -> dict[str, Any]:
  start = time.perf_counter()
  machine = machine_info()
  workloads = {name: run_workload(name, repeats) for name in names}
  backend = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"
  meets: dict[str, bool] = {}
  if backend == "cpu":
    if "W1" in workloads:
      meets["W1_vs_assoc_capacity"] = (
        workloads["W1"]["speedup"]["assoc_capacity"]
        >= TARGETS["cpu"]["W1_vs_assoc_capacity"]
      )
    for name, report in workloads.items():
      meets[f"{name}_vs_assoc_longest"] = (
        report["speedup"]["assoc_longest"] >= TARGETS["cpu"]["vs_assoc_longest"]
      )
  elif "W1" in workloads:
    speedup = workloads["W1"]["speedup"]
    meets["W1_vs_dynamic_rnn"] = (
      speedup["dynamic_rnn"] >= TARGETS["gpu"]["W1_vs_dynamic_rnn"]
    )
    meets["W1_vs_assoc_capacity"] = (
      speedup["assoc_capacity"] >= TARGETS["gpu"]["W1_vs_assoc_capacity"]
    )
  for name, report in workloads.items():
    meets[f"{name}_one_compile"] = report["compiles_over_100_batches"] == 1
  return {
    "workloads": workloads,
    "targets": TARGETS[backend],
    "meets_targets": meets,
    "hidden": HIDDEN,
    "repeats": repeats,
    "machine": machine,
    "wall_s": time.perf_counter() - start,
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workloads", default="W1,W3", help="of benchmarks/rnn.py")
  parser.add_argument("--repeats", type=int, default=15, help="timed rounds")
  parser.add_argument("--json", help="also write the report here")
  args = parser.parse_args(argv)
  names = [n for n in args.workloads.split(",") if n]
  unknown = sorted(set(names) - set(WORKLOADS))
  if unknown or not names:
    parser.error(f"--workloads: unknown {unknown}; known {sorted(WORKLOADS)}")
  if args.repeats < 1:
    parser.error("--repeats must be at least 1")
  write_report(run(names, args.repeats), args.json)


if __name__ == "__main__":
  main()
