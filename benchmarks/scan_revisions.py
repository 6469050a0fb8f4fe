"""`jaxlod.ops.linear_scan` at two revisions of the repository, side by side
in one process: the minGRU training step of `benchmarks/scan.py`.

The scan's module, ``jaxlod/ops/_scan.py``, is read from each git revision
(``git show REV:jaxlod/ops/_scan.py``) and loaded as a module of its own
beside the rest of the working tree's jaxlod, so that both run on the same
batch, weights and machine load. The step is `benchmarks.scan`'s
``linear_scan`` arm with the layer's scan written out: the gates' product
over the packed rows, minGRU's coefficients ``(1 - z, z * h~)``, then each
revision's ``linear_scan``, the loss the mean square of the states and its
gradient with respect to the gate weights. ``ratio`` is each revision's
median over the first's; ``max_rel_diff`` compares their losses and
gradients.

Usage: ``python -m benchmarks.scan_revisions --revisions REV1,REV2
[--workloads W1,W3] [--repeats N] [--json PATH]``.
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
from benchmarks.rnn import WORKLOADS
from benchmarks.scan import HIDDEN, batch, coefficients, rel_diff, workload
from benchmarks.timing import machine_info, measure_interleaved, write_report
from jaxlod.nn import MinGRU

SOURCE = "jaxlod/ops/_scan.py"


def step(linear_scan: Any) -> Any:
  def loss(params, x):
    a, b = coefficients(params, x.values)
    h = linear_scan(x.with_values(a), x.with_values(b)).values
    return jnp.sum(h**2) / x.num_rows

  return jax.jit(jax.value_and_grad(loss))


def run(revisions: list[str], names: list[str], repeats: int) -> dict[str, Any]:
  start = time.perf_counter()
  machine = machine_info()
  report: dict[str, Any] = {}
  with tempfile.TemporaryDirectory() as folder:
    scans = {
      rev: load_module(rev, SOURCE, Path(folder)).linear_scan for rev in revisions
    }
    for name in names:
      data = batch(workload(name), np.random.default_rng(0))
      x = data["lod"]
      params = MinGRU(HIDDEN).init(jax.random.key(0), x)["params"]
      fns = {rev: step(scan) for rev, scan in scans.items()}
      calls = {
        rev: (lambda f=fns[rev], p=params, x=x: f(p, x), jax.block_until_ready)
        for rev in revisions
      }
      print(f"{name}: timing {', '.join(revisions)}", file=sys.stderr)
      timing = measure_interleaved(calls, repeats)
      outputs = {rev: jax.device_get(calls[rev][0]()) for rev in revisions}
      base = timing[revisions[0]]["median_s"]
      report[name] = {
        "tokens": int(data["lengths"].sum()),
        "median_s": {rev: timing[rev]["median_s"] for rev in revisions},
        "ratio": {rev: timing[rev]["median_s"] / base for rev in revisions},
        "max_rel_diff": {
          rev: rel_diff(outputs[rev], outputs[revisions[0]]) for rev in revisions
        },
      }
  return {
    "revisions": revisions,
    "workloads": report,
    "hidden": HIDDEN,
    "repeats": repeats,
    "machine": machine,
    "wall_s": time.perf_counter() - start,
  }


def main(argv: list[str] | None = None) -> None:
  revisions, names, repeats, path = revisions_args(
    __doc__, argv, WORKLOADS, "W1,W3", 15
  )
  write_report(run(revisions, names, repeats), path)


if __name__ == "__main__":
  main()
