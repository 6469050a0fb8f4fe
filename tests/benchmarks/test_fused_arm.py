"""rnn.py's ``jaxlod_fused`` arm (issue 54): `jaxlod.nn.DynamicRNN` under
``LoopPlan(fused=True)``, run end to end on the tiny workload in Pallas's
interpret mode, its report, and what keeps a failing kernel from stopping
the other arms."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks import rnn
from jaxlod.ops import LoopPlan


@pytest.mark.slow
def test_fused_arm_end_to_end_matches_jaxlod(tmp_path):
  path = tmp_path / "rnn.json"
  rnn.main(["--workloads", "S", "--repeats", "1", "--json", str(path)])
  report = json.loads(path.read_text())
  plan = dataclasses.asdict(LoopPlan(fused=True))
  assert report["fused"] == {"plan": plan, "tile": 16, "interpret": True}
  workload = report["workloads"]["S"]
  same = workload["equality"]["jaxlod_fused"]
  assert same["max_abs_diff_vs_jaxlod"] <= 1e-5, same
  assert same["final_carry_max_abs_diff_vs_jaxlod"] <= 1e-5, same
  assert same["loss_rel_diff_vs_jaxlod"] <= 1e-6, same
  assert same["grad_max_rel_diff_vs_jaxlod"] <= 1e-5, same
  record = workload["plans"]["jaxlod_fused"]
  assert record["ran"] == plan and record["interpret"]
  assert record["tile_steps"] == [workload["batch"]["lengths_max"]]  # one tile
  assert record["token_steps"] == 16 * workload["batch"]["lengths_max"]
  fused = workload["fused"]
  assert fused["matches_jaxlod"] and "error" not in fused
  for mode in ("forward", "train"):
    times = workload[mode]
    assert times["jaxlod_fused_s"] == fused[f"{mode}_s"] > 0
    assert times["fused_ratio_to_jaxlod"] == pytest.approx(
      times["jaxlod_fused_s"] / times["jaxlod_s"]
    )
    torch_s = times["torch_packed_s"]  # None where torch is not installed
    assert times["fused_ratio_to_torch_packed"] == (
      None if torch_s is None else pytest.approx(times["jaxlod_fused_s"] / torch_s)
    )
    want = times["fused_ratio_to_torch_packed"]
    got = fused[f"{mode}_ratio_to_torch_packed"]
    assert got == (None if want is None else pytest.approx(want))
    # The first call, made before the rounds, is its trace and compile.
    first = times["first_call_s"]["jaxlod_fused"]
    assert times["compile_s"]["jaxlod_fused"] == pytest.approx(
      first - times["jaxlod_fused_s"]
    )
    assert fused[f"{mode}_compile_s"] == times["compile_s"]["jaxlod_fused"]
    assert first > 0.05  # a compile, not a warm call
  # S has no targets of its own; interpret mode meets none and misses none.
  assert fused["meets_targets"] == {"train_compile_ratio_to_flax_capacity": None}


def test_fused_targets_are_the_issue_s():
  plan = rnn.FUSED_PLAN
  assert plan == LoopPlan(fused=True)
  assert rnn.FUSED_TARGETS == {
    "W1": {"train_ratio_to_torch_packed": 0.5, "forward_ratio_to_torch_packed": 0.5},
    "W2": {"train_ratio_to_torch_packed": 0.7},
    "W3": {"train_ratio_to_torch_packed": 0.7},
  }
  assert rnn.FUSED_COMPILE_TARGET == {"train_compile_ratio_to_flax_capacity": 2.0}


def _timing(median_s, compile_s):
  return {"median_s": median_s, "compile_s": compile_s}


def _timings(fused_s):
  mode = {
    "jaxlod_fused": _timing(fused_s, 2.0),
    "jaxlod": _timing(2 * fused_s, 8.0),
    "flax_capacity": _timing(4 * fused_s, 1.5),
    "torch_packed": _timing(3 * fused_s, 0.5),
  }
  return {"forward": mode, "train": mode}


@pytest.mark.parametrize("interpret", [False, True])
def test_fused_summary_ratios_and_targets(interpret):
  same = {
    "outputs_match": True,
    "loss_rel_diff_vs_jaxlod": 0.0,
    "grad_max_rel_diff_vs_jaxlod": 1e-7,
  }
  record = {"tile": 16, "interpret": interpret}
  summary = rnn.fused_summary(
    _timings(0.01), {"jaxlod_fused": same}, record, None, rnn.FUSED_TARGETS["W1"]
  )
  assert summary["train_ratio_to_torch_packed"] == pytest.approx(1 / 3)
  assert summary["train_ratio_to_jaxlod"] == pytest.approx(0.5)
  assert summary["train_compile_ratio_to_flax_capacity"] == pytest.approx(4 / 3)
  assert summary["forward_compile_ratio_to_jaxlod"] == pytest.approx(0.25)
  assert summary["matches_jaxlod"] and summary["tile"] == 16
  met = None if interpret else True
  assert summary["meets_targets"] == {
    "train_ratio_to_torch_packed": met,
    "forward_ratio_to_torch_packed": met,
    "train_compile_ratio_to_flax_capacity": met,
  }


def test_a_fused_arm_that_fails_to_compile_is_reported_not_raised():
  def fails(params):
    raise NotImplementedError("no lowering")

  arm = rnn.Arm(lambda params: params, fails, (), None)
  assert rnn.first_calls(arm, 1.0) == ({}, "train: NotImplementedError: no lowering")
  record = {"tile": 16, "interpret": False}
  summary = rnn.fused_summary({}, {}, record, "train: ...", {})
  assert summary == {**record, "error": "train: ..."}
