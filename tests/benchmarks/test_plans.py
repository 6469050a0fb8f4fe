"""The benchmarks' loop plan options and benchmarks/accelerator.sh.

The device check runs once, on a lent accelerator, from one command
(`benchmarks/accelerator.sh`); these tests check on the CPU what it relies
on: which plan each ``--plan`` name passes, the candidates of
``rnn.py --candidates``, and rnn.py end to end on its tiny workload with the
accelerator's plan forced.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import decode, g2p_throughput, rnn
from examples.g2p import model as m
from jaxlod.ops import LoopPlan, default_plan
from tests.benchmarks.test_results import RNN_MODE_KEYS

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accelerator.sh"
ACCELERATOR = default_plan("gpu")


@pytest.mark.parametrize("plans", [rnn.PLANS, decode.PLANS, g2p_throughput.PLANS])
def test_plan_names_pass_none_or_force_a_backend_s_plan(plans):
  assert plans == {"default": None, "cpu": LoopPlan(), "accelerator": ACCELERATOR}


def test_rnn_candidates_are_the_plans_side_by_side():
  candidates = rnn.CANDIDATES
  assert candidates == {
    "jaxlod_ladder": LoopPlan(),
    "jaxlod_chunk1": LoopPlan(bodies=1, chunk=1),
    "jaxlod_chunk4": LoopPlan(bodies=1, chunk=4),
    "jaxlod_chunk16": LoopPlan(bodies=1, chunk=16),
    "jaxlod_bodies2": LoopPlan(bodies=2, chunk=8),
    "jaxlod_hoisted": dataclasses.replace(ACCELERATOR, hoist=True),
  }


ALL = ["W1", "W2", "W3"]


@pytest.mark.parametrize(
  "argv, workloads, candidates, plan",
  [
    ("", ALL, [], "default"),
    ("--candidates", ALL, ALL, "default"),
    ("--candidates W1,W2 --plan cpu", ALL, ["W1", "W2"], "cpu"),
    ("--workloads S --candidates --plan accelerator", ["S"], ["S"], "accelerator"),
  ],
)
def test_rnn_arguments(argv, workloads, candidates, plan):
  args = rnn.parse_args(argv.split())
  assert (args.workloads, args.candidates, args.plan) == (workloads, candidates, plan)


def test_rnn_refuses_candidates_of_a_workload_it_does_not_run(capsys):
  with pytest.raises(SystemExit):
    rnn.parse_args(["--workloads", "W1", "--candidates", "W2"])
  assert "--candidates names ['W2'], which --workloads does not run" in (
    capsys.readouterr().err
  )
  with pytest.raises(SystemExit):
    rnn.parse_args(["--plan", "gpu"])


def test_decode_batchwide_arm_under_a_plan_with_bodies_runs_one_body():
  # `DecodeSettings` takes `ladder=()` or a plan with bodies, not both.
  assert decode.settings((), None).ladder == ()
  assert decode.settings((), LoopPlan()).ladder == ()
  batchwide = decode.settings((), ACCELERATOR)
  assert batchwide.ladder is None
  assert batchwide.plan == dataclasses.replace(ACCELERATOR, bodies=1)
  assert decode.settings(None, ACCELERATOR).plan == ACCELERATOR


def test_decode_plan_names(capsys):
  parser = decode.argparse.ArgumentParser()
  assert decode.plan_names(parser, "default,cpu, cpu") == ("default", "cpu")
  with pytest.raises(SystemExit):
    decode.plan_names(parser, "default,gpu")
  assert "--plan: choose from" in capsys.readouterr().err


def test_g2p_step_keeps_the_ladder_only_where_the_plan_has_no_bodies():
  config = m.PRESETS["tiny"]
  assert m.step_ladder(config, LoopPlan()) == m.training_ladder(config)
  assert m.step_ladder(config, ACCELERATOR) is None
  assert m.step_ladder(config) == m.training_ladder(config)  # the CPU's plan


def _script(*args, **env):
  return subprocess.run(
    ["bash", str(SCRIPT), *args],
    capture_output=True,
    text=True,
    env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, **env},
    check=False,
  )


def test_accelerator_script_arguments(tmp_path):
  done = _script("--smoke")
  assert done.returncode == 2 and "--smoke needs an output directory" in done.stderr
  done = _script("--fast", str(tmp_path))
  assert done.returncode == 2 and "unknown option --fast" in done.stderr
  done = _script(str(tmp_path), PYTHON="no-such-python")
  assert done.returncode == 2 and "no Python at 'no-such-python'" in done.stderr


@pytest.mark.slow
def test_rnn_candidates_end_to_end_under_the_accelerator_plan(tmp_path):
  """rnn.py as accelerator.sh --smoke runs it: every candidate runs and
  matches jaxlod, and the report holds what the GPU run will be read for."""
  path = tmp_path / "rnn.json"
  argv = ["--workloads", "S", "--repeats", "1", "--plan", "accelerator"]
  rnn.main([*argv, "--candidates", "--json", str(path)])
  report = json.loads(path.read_text())
  forced = dataclasses.asdict(ACCELERATOR)
  assert report["plan"] == {"name": "accelerator", "plan": forced}
  assert report["candidates"] == ["S"]
  workload = report["workloads"]["S"]
  assert workload["plans"]["jaxlod"]["ran"] == forced
  assert workload["plans"]["jaxlod"]["loop_ladder"] == [8]  # one body
  assert set(workload["candidates"]) == set(rnn.CANDIDATES)
  for name, candidate in workload["candidates"].items():
    assert "error" not in candidate, candidate
    assert candidate["matches_jaxlod"], workload["equality"][name]
    assert candidate["ran"] == dataclasses.asdict(rnn.CANDIDATES[name])
    for mode in ("forward", "train"):
      assert candidate[f"{mode}_ratio_to_jaxlod"] == pytest.approx(
        workload[mode][f"{name}_s"] / workload[mode]["jaxlod_s"]
      )
      assert candidate[f"{mode}_compile_s"] == workload[mode]["compile_s"][name]
  assert workload["candidates"]["jaxlod_bodies2"]["loop_ladder"] == [8, 7]
  for mode in ("forward", "train"):  # today's keys stay
    assert set(workload[mode]) >= RNN_MODE_KEYS
  assert workload["compiles"]["jaxlod_train_fixed_capacity_100_batches"] == 1
