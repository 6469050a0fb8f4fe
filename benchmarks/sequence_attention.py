"""Self-attention inside each sequence: `jaxlod.nn.MultiHeadAttention` over a
LoDTensor against Flax's `MultiHeadDotProductAttention` padded, side by side
in one process.

One multi-head self-attention layer (8 heads, head_dim 64, 512 features in
and out, the same weights in every arm), its forward pass and its training
step (the mean square of the outputs over the real rows and its gradient
with respect to the weights), jitted, on three workloads:

* ``W1``: W1's lengths of `benchmarks/rnn.py` (64 sentences, log-normal,
  mean 30, at most 128; 3,072 tokens of capacity);
* ``W2``: W2's long-tailed lengths (32 documents, log-normal, mean 200,
  sigma 1.0), at most 512 (8,192 tokens of capacity);
* ``long``: 16 sequences, log-normal, mean 400, sigma 1.0, at most 1,024
  (16,384 tokens of capacity).

Arms:

* ``jaxlod``: the layer over the LoDTensor (`jaxlod.ops.sequence_attention`
  inside, the backend's `AttentionPlan`);
* ``flax_longest``: Flax's layer on the batch padded to its longest
  sequence, with a padding mask (one compilation per distinct longest);
* ``flax_capacity``: the same padded to the time capacity;
* ``segment_mask``: Flax's layer on the packed rows as one sequence, with
  a segment-id mask ``[1, heads, T, T]`` (skipped where its weights alone
  would pass `SEGMENT_MASK_LIMIT_BYTES`);
* ``core_jaxlod`` and ``core_flax_longest``: the attention alone, with no
  projections (`sequence_attention` against `flax.linen.dot_product_attention`
  padded to the longest), to show where the layer's time goes.

Times are medians of interleaved rounds (`benchmarks.timing`);
``speedup_*`` is an arm's median over ``jaxlod``'s (``core_speedup_*`` the
same for the core arms). ``cells``: the attention cells (query row by key
row, per head) each arm computes, and ``work_ratio`` those over the real
cells ``sum(l_i**2)``, the work floor of an exact attention (each sequence
alone at its own length); jaxlod's cells are its plan's tiles for these
lengths. ``temp_bytes``: XLA's temporary buffers of each compiled training
step (``memory_analysis``). ``max_abs_diff``: each padded arm's outputs on
the real rows against jaxlod's. ``train_speedup_bound_at_flax_cost``: the
training step's speed-up over ``flax_longest`` of a layer that did, on the
real rows and cells only, Flax's own work per row outside the attention
(its layer arm's time less its attention-alone arm's, per padded row) and
Flax's attention per cell (its attention-alone arm's time per padded
cell): what doing the real work only gives at Flax's cost per row and per
cell. ``compiles_over_100_batches``: XLA
compilations of jaxlod's training step over 100 batches of fresh lengths
(W1; the forward pass elsewhere).

Usage: ``python -m benchmarks.sequence_attention [--workloads W1,W2,long]
[--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxlod
from benchmarks.timing import (
  machine_info,
  measure_interleaved,
  write_report,
  xla_compiles,
)
from jaxlod.nn import MultiHeadAttention
from jaxlod.ops import default_attention_plan, sequence_attention

HEADS, HEAD_DIM = 8, 64
FEATURES = HEADS * HEAD_DIM
SEGMENT_MASK_LIMIT_BYTES = 2**30
TARGETS = {
  "train_speedup_flax_longest": {"W1": 4.0, "W2": 5.0, "long": 4.0},
  "train_speedup_segment_mask": 20.0,
  "temp_fraction_of_flax_longest": 0.2,
  "work_ratio": 1.5,
}


@dataclasses.dataclass(frozen=True)
class Workload:
  batch: int
  mean: float
  sigma: float
  time: int
  tokens: int

  def lengths(self, rng: np.random.Generator) -> np.ndarray:
    mu = math.log(self.mean) - self.sigma**2 / 2
    raw = rng.lognormal(mu, self.sigma, self.batch)
    return np.clip(np.rint(raw), 1, self.time).astype(np.int64)


WORKLOADS = {
  "W1": Workload(batch=64, mean=30, sigma=0.6, time=128, tokens=3072),
  "W2": Workload(batch=32, mean=200, sigma=1.0, time=512, tokens=8192),
  "long": Workload(batch=16, mean=400, sigma=1.0, time=1024, tokens=16384),
  # Not a measurement: the script end to end in seconds.
  "S": Workload(batch=8, mean=6, sigma=0.6, time=16, tokens=128),
}


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def make_batch(w: Workload, rng: np.random.Generator) -> dict[str, Any]:
  """One batch in every arm's format: the LoDTensor, the padded arrays and
  masks (to the longest and to the capacity), the packed rows with their
  segment mask."""
  lengths = w.lengths(rng)
  rows = rng.standard_normal((int(lengths.sum()), FEATURES), dtype=np.float32)
  buckets = jaxlod.Buckets.fixed(tokens=w.tokens, sequences=w.batch, time=w.time)
  lod = jaxlod.LoDTensor.from_lengths(rows, [lengths], buckets=buckets)
  data = {"lengths": lengths, "lod": lod}
  for name, time_ in (("longest", int(lengths.max())), ("capacity", w.time)):
    mask = np.arange(time_)[None, :] < lengths[:, None]
    padded = np.zeros((w.batch, time_, FEATURES), np.float32)
    padded[mask] = rows
    data[name] = (jnp.asarray(padded), jnp.asarray(mask))
  segments = np.asarray(lod.segment_ids())
  data["packed"] = (jnp.asarray(lod.values)[None], jnp.asarray(segments))
  return data


def jaxlod_cells(lengths: np.ndarray, time_capacity: int) -> int:
  """The cells the backend's plan computes for `lengths` (its tiles, in rank
  order, each run of a tile shape taking the next sequences)."""
  tiles = default_attention_plan().tiles(time_capacity)
  ranked = np.sort(lengths)[::-1]
  cursor, cells = 0, 0
  for k, (length, sequences) in enumerate(tiles):
    below = tiles[k + 1][0] if k + 1 < len(tiles) else 0
    end = int((ranked > below).sum())
    while cursor < end:
      cells += sequences * length * length
      cursor += sequences
  return cells


def mask_loss(y: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask[..., None], y, 0) ** 2) / jnp.sum(mask)


def steps(flax_layer: nn.Module, layer: MultiHeadAttention) -> dict[str, Any]:
  """Each arm's jitted forward and training step."""

  def lod_forward(params, x):
    return layer.apply(params, x).values

  def lod_loss(params, x):
    return mask_loss(lod_forward(params, x), x.row_mask())

  def padded_forward(params, x, mask):
    return flax_layer.apply(params, x, x, mask=nn.make_attention_mask(mask, mask))

  def padded_loss(params, x, mask):
    return mask_loss(padded_forward(params, x, mask), mask)

  def packed_forward(params, x, segments):
    mask = nn.make_attention_mask(segments, segments, jnp.equal)[None]
    return flax_layer.apply(params, x, x, mask=mask)

  def packed_loss(params, x, segments):
    return mask_loss(packed_forward(params, x, segments)[0], segments < x.shape[1])

  def core_lod(values, x):
    q = x.with_values(values)
    return sequence_attention(q, q, q).values

  def core_padded(q, mask):
    return nn.dot_product_attention(q, q, q, mask=nn.make_attention_mask(mask, mask))

  def core_loss(fn):
    return lambda x, *rest: jnp.sum(fn(x, *rest) ** 2)

  grad = jax.grad
  return {
    "jaxlod": (jax.jit(lod_forward), jax.jit(grad(lod_loss))),
    "flax_longest": (jax.jit(padded_forward), jax.jit(grad(padded_loss))),
    "flax_capacity": (jax.jit(padded_forward), jax.jit(grad(padded_loss))),
    "segment_mask": (jax.jit(packed_forward), jax.jit(grad(packed_loss))),
    "core_jaxlod": (jax.jit(core_lod), jax.jit(grad(core_loss(core_lod)))),
    "core_flax_longest": (
      jax.jit(core_padded),
      jax.jit(grad(core_loss(core_padded))),
    ),
  }


def _inputs(arm: str, data: dict[str, Any], params: Any, heads_view: Any) -> tuple:
  if arm == "jaxlod":
    return (params, data["lod"])
  if arm in ("flax_longest", "flax_capacity"):
    return (params, *data[arm.removeprefix("flax_")])
  if arm == "segment_mask":
    return (params, *data["packed"])
  if arm == "core_jaxlod":
    return heads_view["lod"]
  return heads_view["longest"]


def cells(arm: str, w: Workload, lengths: np.ndarray) -> int:
  """The attention cells per head an arm computes."""
  if arm in ("jaxlod", "core_jaxlod"):
    return jaxlod_cells(lengths, w.time)
  if arm in ("flax_longest", "core_flax_longest"):
    return w.batch * int(lengths.max()) ** 2
  if arm == "flax_capacity":
    return w.batch * w.time**2
  return w.tokens**2


def _heads_view(data: dict[str, Any]) -> dict[str, Any]:
  """The core arms' inputs: the rows as ``[.., heads, head_dim]``."""
  lod = data["lod"]
  values = jnp.asarray(lod.values).reshape(-1, HEADS, HEAD_DIM)
  padded, mask = data["longest"]
  return {
    "lod": (values, lod.with_values(values)),
    "longest": (padded.reshape(*padded.shape[:2], HEADS, HEAD_DIM), mask),
  }


def _real_rows(arm: str, out: Any, data: dict[str, Any]) -> np.ndarray:
  """An arm's forward outputs on the real rows, in packed order."""
  out = np.asarray(out)
  lengths = data["lengths"]
  if arm in ("jaxlod", "core_jaxlod"):
    return out[: int(lengths.sum())].reshape(int(lengths.sum()), -1)
  if arm == "segment_mask":
    return out[0, : int(lengths.sum())]
  mask = np.arange(out.shape[1])[None, :] < lengths[:, None]
  return out[mask].reshape(int(lengths.sum()), -1)


def compiles(w: Workload, step: Any, params: Any) -> int:
  """XLA compilations of jaxlod's `step`, jitted afresh, over 100 batches
  of fresh lengths."""
  rng = np.random.default_rng(1)
  buckets = jaxlod.Buckets.fixed(tokens=w.tokens, sequences=w.batch, time=w.time)
  fresh = jax.jit(lambda p, x: step(p, x))
  with xla_compiles() as names:
    for _ in range(100):
      lengths = w.lengths(rng)
      rows = np.zeros((int(lengths.sum()), FEATURES), np.float32)
      x = jaxlod.LoDTensor.from_lengths(rows, [lengths], buckets=buckets)
      jax.block_until_ready(fresh(params, x))
  return sum(names.values())


def bound_at_flax_cost(times: dict[str, Any], report: dict[str, Any], w: Workload):
  """``train_speedup_bound_at_flax_cost`` (see the module's docstring)."""
  layer = times["flax_longest_train"]["median_s"]
  attention = times["core_flax_longest_train"]["median_s"]
  padded_rows = w.batch * report["longest"]
  real = (layer - attention) * report["real_tokens"] / padded_rows
  real += attention * report["real_cells"] / report["cells"]["flax_longest"]
  return layer / real


def run_workload(name: str, repeats: int) -> dict[str, Any]:
  """Every arm on one batch of workload `name`."""
  w = WORKLOADS[name]
  data = make_batch(w, np.random.default_rng(0))
  flax_layer = nn.MultiHeadDotProductAttention(
    num_heads=HEADS, qkv_features=FEATURES, out_features=FEATURES
  )
  layer = MultiHeadAttention(
    num_heads=HEADS, qkv_features=FEATURES, out_features=FEATURES
  )
  params = layer.init(jax.random.key(0), data["lod"])
  real = int((data["lengths"] ** 2).sum())
  arms = steps(flax_layer, layer)
  heads_view = _heads_view(data)
  segment_bytes = 4 * HEADS * w.tokens**2
  if segment_bytes > SEGMENT_MASK_LIMIT_BYTES:
    del arms["segment_mask"]
  report: dict[str, Any] = {
    "workload": dataclasses.asdict(w),
    "lengths": data["lengths"].tolist(),
    "real_tokens": int(data["lengths"].sum()),
    "longest": int(data["lengths"].max()),
    "real_cells": real,
    "skipped": []
    if "segment_mask" in arms
    else [
      f"segment_mask: its weights alone would take {segment_bytes / 2**30:.1f} GiB"
    ],
  }
  calls, outs = {}, {}
  for arm, (forward, train) in arms.items():
    args = _inputs(arm, data, params, heads_view)
    calls[f"{arm}_forward"] = (lambda f=forward, a=args: f(*a), jax.block_until_ready)
    calls[f"{arm}_train"] = (lambda f=train, a=args: f(*a), jax.block_until_ready)
    outs[arm] = _real_rows(arm, forward(*args), data)
    memory = train.lower(*args).compile().memory_analysis()
    report.setdefault("temp_bytes", {})[arm] = int(memory.temp_size_in_bytes)
    report.setdefault("cells", {})[arm] = cells(arm, w, data["lengths"])
  report["work_ratio"] = {arm: c / real for arm, c in report["cells"].items()}
  report["max_abs_diff"] = {
    arm: float(
      np.abs(out - outs["core_jaxlod" if arm.startswith("core") else "jaxlod"]).max()
    )
    for arm, out in outs.items()
  }
  _log(f"{name}: timing {len(calls)} calls, {repeats} rounds")
  times = measure_interleaved(calls, repeats)
  report["times"] = times
  for mode in ("forward", "train"):
    for arm in arms:
      base = "core_jaxlod" if arm.startswith("core") else "jaxlod"
      if arm == base:
        continue
      key = f"{mode}_speedup_{arm.removeprefix('core_')}"
      key = f"core_{key}" if arm.startswith("core") else key
      ratio = times[f"{arm}_{mode}"]["median_s"] / times[f"{base}_{mode}"]["median_s"]
      report[key] = ratio
  report["train_speedup_bound_at_flax_cost"] = bound_at_flax_cost(times, report, w)
  flax_temp = report["temp_bytes"]["flax_longest"]
  report["temp_fraction_of_flax_longest"] = report["temp_bytes"]["jaxlod"] / flax_temp
  report["core_temp_fraction_of_flax_longest"] = (
    report["temp_bytes"]["core_jaxlod"] / report["temp_bytes"]["core_flax_longest"]
  )
  step = arms["jaxlod"][1] if name == "W1" else arms["jaxlod"][0]
  report["compiles_over_100_batches"] = compiles(w, step, params)
  report["compiles_measured_on"] = "train" if name == "W1" else "forward"
  return report


def run(names: list[str], repeats: int) -> dict[str, Any]:
  report: dict[str, Any] = {
    "machine": machine_info(plan=repr(default_attention_plan())),
    "targets": TARGETS,
    "workloads": {},
  }
  start = time.perf_counter()
  for name in names:
    report["workloads"][name] = run_workload(name, repeats)
  report["wall_s"] = time.perf_counter() - start
  return report


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workloads", default="W1,W2,long")
  parser.add_argument("--repeats", type=int, default=7, help="timed rounds")
  parser.add_argument("--json", help="also write the report here")
  args = parser.parse_args(argv)
  names = [n for n in args.workloads.split(",") if n]
  unknown = [n for n in names if n not in WORKLOADS]
  if unknown:
    parser.error(f"unknown workloads {unknown}; known: {sorted(WORKLOADS)}")
  write_report(run(names, args.repeats), args.json)


if __name__ == "__main__":
  main()
