"""benchmarks/dropin.py (issue 53): end to end on the tiny workload, and the
committed CPU run's figures.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks import dropin

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ARMS = ("dropin", "flax_capacity", "flax_longest", "jaxlod_lod")
COMPILE_ARMS = ("dropin", "flax_capacity", "flax_longest")
EQUALITY_KEYS = {
  "outputs_max_abs_diff",
  "final_carry_max_abs_diff",
  "loss_rel_diff",
  "grad_max_abs_diff",
  "grad_max_rel_diff",
  "dropin_zero_past_lengths",
}


def _check_workload(workload: dict, batches: int) -> None:
  train = workload["train"]
  for arm in ARMS:
    assert train[f"{arm}_s"] > 0
    assert set(train["compile_s"]) == set(train["first_call_s"]) == set(ARMS)
  assert train["speedup_vs_flax_capacity"] == pytest.approx(
    train["flax_capacity_s"] / train["dropin_s"]
  )
  assert train["speedup_vs_flax_longest"] == pytest.approx(
    train["flax_longest_s"] / train["dropin_s"]
  )
  assert train["dropin_over_jaxlod_lod"] == pytest.approx(
    train["dropin_s"] / train["jaxlod_lod_s"]
  )
  same = workload["equality"]
  assert set(same) >= EQUALITY_KEYS
  assert same["outputs_max_abs_diff"] < 1e-4
  assert same["final_carry_max_abs_diff"] < 1e-4
  assert same["loss_rel_diff"] < 1e-5
  assert same["grad_max_rel_diff"] < 1e-4
  assert same["dropin_zero_past_lengths"] is True
  compiles = workload["compiles"]
  assert set(compiles) == set(COMPILE_ARMS)
  for arm in COMPILE_ARMS:
    assert compiles[arm]["batches"] == batches
  # The drop-in and Flax padded to the capacity: one shape, one compilation.
  for arm in ("dropin", "flax_capacity"):
    assert compiles[arm]["distinct_shapes"] == compiles[arm]["traces"] == 1
  longest = compiles["flax_longest"]
  assert longest["traces"] == longest["distinct_shapes"] > 1
  if longest["method"] == "jit call on each batch":
    assert longest["cache_size"] == longest["distinct_shapes"]


@pytest.mark.slow
def test_dropin_end_to_end_on_the_tiny_workload(tmp_path, capsys):
  path = tmp_path / "dropin.json"
  argv = ["--workloads", "S", "--repeats", "1", "--batches", "20"]
  report = dropin.main([*argv, "--out", str(path)])
  assert json.loads(path.read_text()) == json.loads(capsys.readouterr().out)
  assert json.loads(path.read_text()) == json.loads(json.dumps(report))
  assert {"backend", "device_kind", "cpu_count"} <= set(report["machine"])
  assert set(report["workloads"]) == {"S"}
  _check_workload(report["workloads"]["S"], batches=20)
  compiles = report["workloads"]["S"]["compiles"]
  assert compiles["dropin"]["cache_size"] == 1
  assert compiles["dropin"]["xla_compiles"] == 0  # none after the first call


def test_dropin_arguments(capsys):
  args = dropin.parse_args([])
  assert (args.workloads, args.batches, args.out) == (["W1", "W3"], 100, None)
  with pytest.raises(SystemExit):
    dropin.parse_args(["--batches", "0"])
  assert "--batches must be >= 1" in capsys.readouterr().err


def test_committed_cpu_run():
  path = RESULTS / "dropin.json"
  if not path.is_file():
    pytest.fail(
      f"{path} is missing: run `python -m benchmarks.dropin --out "
      "benchmarks/results/dropin.json`."
    )
  report = json.loads(path.read_text())
  assert report["machine"]["backend"] == "cpu"
  assert {"cpu_count", "device_kind", "load_average_at_start"} <= set(report["machine"])
  assert set(report["workloads"]) == {"W1", "W3"}
  for workload in report["workloads"].values():
    _check_workload(workload, batches=100)
