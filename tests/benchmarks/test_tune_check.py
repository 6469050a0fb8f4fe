"""benchmarks/tune_check.py: `tune_plan` on a cell of a sweep, end to end,
and its cell names."""

import json

import pytest

from benchmarks import sweep, tune_check


def test_a_cell_of_a_sweep_end_to_end(tmp_path, capsys):
  swept = tmp_path / "sweep.json"
  sweep.main(
    [
      *("--batches", "8", "--times", "8", "--hiddens", "8"),
      *("--profiles", "even", "--plans", "ladder,hoist", "--repeats", "1"),
      *("--json", str(swept)),
    ]
  )
  out = tmp_path / "tune.json"
  report = tune_check.main(
    [
      *("--cells", "B8_T8_H8_even", "--sweep", str(swept)),
      *("--repeats", "1", "--json", str(out)),
    ]
  )
  capsys.readouterr()
  assert json.loads(out.read_text()) == report
  cell = report["cells"]["B8_T8_H8_even"]
  assert cell["picked"] in ("ladder", "hoist")
  fastest = json.loads(swept.read_text())["cells"][0]["train"]["fastest_plan"]
  assert cell["sweep_fastest"] == fastest
  assert cell["agrees"] == (cell["picked"] == fastest)
  assert report["agree_everywhere"] == cell["agrees"]
  assert cell["max_rel_diff_vs_reference"] < 1e-4


@pytest.mark.parametrize("name", ["B8_T8_H8", "B8_T8_H8_flat", "X8_T8_H8_even"])
def test_bad_cell_names_are_refused(name):
  with pytest.raises(ValueError, match=r"Expected a cell such as B8_T256_H64_even"):
    tune_check.parse_cell(name)


def test_a_cell_the_sweep_did_not_measure_is_refused(tmp_path):
  swept = tmp_path / "sweep.json"
  swept.write_text(json.dumps({"cells": [], "plans": {"ladder": "LoopPlan()"}}))
  with pytest.raises(ValueError, match=r"Expected a cell of the sweep, got 'B8_T8"):
    tune_check.main(["--cells", "B8_T8_H8_even", "--sweep", str(swept)])
