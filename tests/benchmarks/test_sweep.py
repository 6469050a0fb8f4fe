"""benchmarks/sweep.py: the length profiles, and one cell end to end."""

import json

import numpy as np
import pytest

from benchmarks import sweep


@pytest.mark.parametrize("profile", sweep.PROFILES)
@pytest.mark.parametrize("batch,time", [(8, 8), (32, 64), (128, 1024)])
def test_profiles_reach_the_time_exactly(profile, batch, time):
  lengths = sweep.profile_lengths(profile, batch, time)
  assert lengths.shape == (batch,)
  assert lengths.max() == time and lengths.min() >= 1
  if profile == "full":
    assert np.all(lengths == time)
  if profile == "even":
    assert lengths.min() == 1


def test_unknown_profile_is_refused():
  with pytest.raises(ValueError, match="unknown profile 'flat'"):
    sweep.profile_lengths("flat", 8, 8)


def test_one_cell_end_to_end(tmp_path, capsys):
  out = tmp_path / "sweep.json"
  report = sweep.main(
    [
      *("--batches", "8", "--times", "8", "--hiddens", "16"),
      *("--profiles", "even", "--plans", "ladder,bodies1", "--repeats", "1"),
      *("--min-seconds", "0.5", "--json", str(out)),
    ]
  )
  capsys.readouterr()
  assert json.loads(out.read_text())["cells"] == report["cells"]
  (cell,) = report["cells"]
  assert cell["ideal"] == pytest.approx(8 * 8 / cell["lengths"]["sum"])
  train = cell["train"]
  medians = train["median_s"]
  assert {"dropin", "flax", "plan_ladder", "plan_bodies1"} <= set(medians)
  assert train["speedup_vs_flax"] == pytest.approx(medians["flax"] / medians["dropin"])
  assert train["fraction_of_ideal"] == pytest.approx(
    train["speedup_vs_flax"] / cell["ideal"]
  )
  assert cell["results_match"]
  assert report["summary"]["train"]["cells"] == 1
  # Each round takes milliseconds: --min-seconds adds rounds to fill 0.5 s.
  assert train["rounds"] > 1
  assert report["min_seconds"] == 0.5


def test_bad_flags_are_refused(capsys):
  with pytest.raises(SystemExit):
    sweep.main(["--plans", "nope"])
  assert "--plans: got ['nope']" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sweep.main(["--min-seconds", "-1"])
  assert "--min-seconds must be >= 0, got -1.0" in capsys.readouterr().err
