"""Draws the landing page's figure: padding against the phased schedule.

One batch of 64 sequences with log-normal lengths (mean about 30, at most
128: the W1 workload of benchmarks/rnn.py, as notebooks/01_lod_tour.ipynb
draws it), ranked by `jaxlod.ops.rank_table` on the host. Per step: the
sequences a padded loop runs, the static batch size of the phased loop's
phase, and the sorted prefix still active.

docs/conf.py calls `write` at every build; by hand:
``python docs/_scripts/schedule_figure.py OUT.png``.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxlod import Buckets, LoDTensor  # noqa: E402
from jaxlod.ops import RankTable, rank_table  # noqa: E402

W1_CAPACITY = Buckets.fixed(tokens=3072, sequences=64, time=128)


def w1_table(seed: int = 0) -> RankTable:
  """The rank table of 64 log-normal lengths (mean about 30, at most 128)."""
  sigma = 0.6
  rng = np.random.default_rng(seed)
  lengths = rng.lognormal(np.log(30) - sigma**2 / 2, sigma, 64)
  lengths = np.clip(np.rint(lengths), 1, 128).astype(int)
  rows = np.zeros((lengths.sum(), 1), np.float32)
  return rank_table(LoDTensor.from_lengths(rows, [lengths], buckets=W1_CAPACITY))


def phased_sizes(table: RankTable) -> np.ndarray:
  """The static batch size the phased loop runs at, per step."""
  steps = np.arange(int(table.max_length))
  sizes = np.zeros_like(steps)
  bounds = zip(table.ladder, table.phase_starts, table.phase_ends, strict=True)
  for size, start, end in bounds:
    sizes[(steps >= int(start)) & (steps < int(end))] = size
  return sizes


def render() -> bytes:
  """The figure, as PNG."""
  table = w1_table()
  longest, count = int(table.max_length), int(table.count)
  steps = np.arange(longest)
  active = np.asarray(table.batch_sizes)[:longest]
  bars = dict(width=1.0, align="edge")
  fig, ax = plt.subplots(figsize=(8, 3.4), dpi=120)
  ax.bar(
    steps,
    np.full(longest, count),
    color="0.85",
    label=f"padded to the longest: {count} x {longest} = {count * longest}",
    **bars,
  )
  ax.bar(
    steps,
    phased_sizes(table),
    color="tab:blue",
    alpha=0.35,
    label=f"phased loop ({len(table.ladder)} sizes): {int(table.schedule_steps())}",
    **bars,
  )
  ax.bar(
    steps,
    active,
    color="tab:blue",
    label=f"active sorted prefix (real work): {int(active.sum())}",
    **bars,
  )
  ax.set(
    title="Token-steps of one batch of 64 sequences (log-normal lengths)",
    xlabel="step t",
    ylabel="sequences in the step",
    xlim=(0, longest),
  )
  ax.legend(loc="upper right", fontsize=8)
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png", metadata={"Software": None})
  plt.close(fig)
  return png.getvalue()


def write(path: Path) -> None:
  """Writes the figure to `path` unless it holds the same PNG already."""
  png = render()
  if not path.is_file() or path.read_bytes() != png:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)


if __name__ == "__main__":
  write(Path(sys.argv[1]))
