"""`jaxlod.ops.sequence_attention` at two or more revisions of the
repository, side by side in one process: the attention alone of
`benchmarks/sequence_attention.py` (its ``core_jaxlod`` arm), forward and
training step, and the layer's training step (its ``jaxlod`` arm,
``layer_train``: `jaxlod.nn.MultiHeadAttention` with each revision's op).

The op's module, ``jaxlod/ops/_sequence_attention.py``, is read from each
git revision and loaded beside the rest of the working tree's jaxlod
(`benchmarks.revisions`), so that every revision runs on the same batch
and machine load. The training step is the gradient of the sum of the
squared outputs with respect to the rows (query, key and value are the
same rows, as in the ``core_jaxlod`` arm). The layer's is the gradient of
`benchmarks.sequence_attention`'s loss with respect to its parameters; the
layer's module is loaded as a module of its own, with the revision's op
in it. ``ratio`` is each revision's median over the first's;
``max_abs_diff`` compares each revision's outputs and gradients with the
first's; ``temp_bytes`` is each compiled step's temporaries (XLA's memory
analysis).

Usage: ``python -m benchmarks.attention_revisions --revisions REV1,REV2
[--workloads W1,W2,long] [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.revisions import load_module
from benchmarks.revisions import parse_args as revisions_args
from benchmarks.sequence_attention import (
  FEATURES,
  HEAD_DIM,
  HEADS,
  WORKLOADS,
  make_batch,
  mask_loss,
)
from benchmarks.timing import machine_info, measure_interleaved, write_report

SOURCE = "jaxlod/ops/_sequence_attention.py"
LAYER_SOURCE = "jaxlod/nn/_transformer.py"


def steps(attention: Any, lod: Any) -> dict[str, Any]:
  """The forward pass and the training step of `attention` on `lod`'s LoD."""

  def forward(values):
    x = lod.with_values(values)
    return attention(x, x, x).values

  return {
    "forward": jax.jit(forward),
    "train": jax.jit(jax.grad(lambda values: jnp.sum(forward(values) ** 2))),
  }


def layer_step(attention: Any, lod: Any, folder: Path) -> Any:
  """The layer's training step with `attention`, compiled for `lod` (rows
  ``[tokens, features]``): a function of the layer's parameters. The
  layer's module (``jaxlod/nn/_transformer.py`` at ``HEAD``) is loaded as
  a module of its own, whose `sequence_attention` is `attention`."""
  module = load_module("HEAD", LAYER_SOURCE, folder)
  module.sequence_attention = attention
  layer = module.MultiHeadAttention(
    num_heads=HEADS, qkv_features=FEATURES, out_features=FEATURES
  )
  params = layer.init(jax.random.key(0), lod)

  def loss(params, x):
    return mask_loss(layer.apply(params, x).values, x.row_mask())

  compiled = jax.jit(jax.grad(loss)).lower(params, lod).compile()
  return lambda: compiled(params, lod), compiled


def workload(
  name: str, ops: dict[str, Any], repeats: int, folder: Path
) -> dict[str, Any]:
  """One workload's medians, ratios, differences and temporaries per
  revision and mode."""
  data = make_batch(WORKLOADS[name], np.random.default_rng(0))
  rows = data["lod"]
  values = jnp.asarray(rows.values).reshape(-1, HEADS, HEAD_DIM)
  lod = rows.with_values(values)
  fns = {rev: steps(op, lod) for rev, op in ops.items()}
  layers = {rev: layer_step(op, rows, folder) for rev, op in ops.items()}
  calls = {
    (rev, mode): (lambda f=f: f(values), jax.block_until_ready)
    for rev, modes in fns.items()
    for mode, f in modes.items()
  }
  for rev, (call, _) in layers.items():
    calls[rev, "layer_train"] = (call, jax.block_until_ready)
  print(f"{name}: timing {', '.join(ops)}", file=sys.stderr)
  timing = measure_interleaved(calls, repeats)
  first = next(iter(ops))
  report: dict[str, Any] = {"tokens": int(data["lengths"].sum())}
  for mode in ("forward", "train", "layer_train"):
    if mode == "layer_train":
      out = {rev: _flat(layers[rev][0]()) for rev in ops}
      compiled = {rev: layers[rev][1] for rev in ops}
    else:
      out = {rev: np.asarray(fns[rev][mode](values)) for rev in ops}
      compiled = {rev: fns[rev][mode].lower(values).compile() for rev in ops}
    base = timing[first, mode]["median_s"]
    report[mode] = {
      "median_s": {rev: timing[rev, mode]["median_s"] for rev in ops},
      "ratio": {rev: timing[rev, mode]["median_s"] / base for rev in ops},
      "max_abs_diff": {rev: float(np.abs(out[rev] - out[first]).max()) for rev in ops},
      "temp_bytes": {
        rev: c.memory_analysis().temp_size_in_bytes for rev, c in compiled.items()
      },
    }
  return report


def _flat(tree: Any) -> np.ndarray:
  """Every leaf of `tree`, flattened and joined."""
  return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])


def run(revisions: list[str], names: list[str], repeats: int) -> dict[str, Any]:
  start = time.perf_counter()
  machine = machine_info()
  with tempfile.TemporaryDirectory() as folder:
    ops = {
      rev: load_module(rev, SOURCE, Path(folder)).sequence_attention
      for rev in revisions
    }
    report = {name: workload(name, ops, repeats, Path(folder)) for name in names}
  return {
    "revisions": revisions,
    "workloads": report,
    "heads": HEADS,
    "head_dim": HEAD_DIM,
    "repeats": repeats,
    "machine": machine,
    "wall_s": time.perf_counter() - start,
  }


def main(argv: list[str] | None = None) -> None:
  revisions, names, repeats, path = revisions_args(
    __doc__, argv, WORKLOADS, "W1,W2,long", 9
  )
  write_report(run(revisions, names, repeats), path)


if __name__ == "__main__":
  main()
