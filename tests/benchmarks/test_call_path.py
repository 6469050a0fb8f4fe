"""benchmarks/call_path.py: it counts the modules a call enters, the
re-entries and the `check_lod` calls per tensor, and its committed run
holds the two calls it reports."""

import json
import pathlib

import numpy as np

from benchmarks import call_path
from jaxlod import LoDTensor, ops

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_follow_counts_modules_reentries_and_checks():
  x = LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[2, 1]])

  def call():
    # sequence_pool checks `x` once; its rank table and the pool enter other
    # modules of the package and come back.
    return ops.sequence_pool(x, "sum")

  found = call_path.follow(call)
  assert found["check_lod_calls"] == found["check_lod_max_per_tensor"] == 1
  assert "jaxlod.ops._pool" in found["module_names"]
  assert "jaxlod._lod" in found["module_names"]
  assert found["modules"] == len(found["module_names"])
  assert found["reentries"] == found["entries"] - found["modules"]


def test_committed_run_reports_both_calls():
  report = json.loads((RESULTS / "call_path.json").read_text())
  for revision in report["revisions"].values():
    for name in ("dynamic_rnn", "seq2seq"):
      call = revision["calls"][name]
      assert call["modules"] == len(call["module_names"]) > 0
      assert call["check_lod_max_per_tensor"] >= 1
