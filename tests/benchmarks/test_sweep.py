"""benchmarks/sweep.py: the length profiles, and one cell end to end."""

import json

import jax
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
  assert {"dropin", "flax", "plan_ladder", "plan_bodies1", "floor"} <= set(medians)
  best = medians[train["best_padded"]]
  assert train["floor_speedup_vs_best_padded"] == pytest.approx(best / medians["floor"])
  assert "floor" not in cell["max_rel_diff_vs_flax"]
  assert train["speedup_vs_flax"] == pytest.approx(medians["flax"] / medians["dropin"])
  assert train["fraction_of_ideal"] == pytest.approx(
    train["speedup_vs_flax"] / cell["ideal"]
  )
  assert cell["results_match"]
  assert report["summary"]["train"]["cells"] == 1
  # Each round takes milliseconds: --min-seconds adds rounds to fill 0.5 s.
  assert train["rounds"] > 1
  assert report["min_seconds"] == 0.5


def test_the_floor_is_flax_lstm_on_full_lengths():
  """On a full batch the floor's steps are the real cells: its loss and
  gradients are Flax's RNN's, so it times the same recurrence."""
  lengths, x, cell, params = sweep.cell_inputs(4, 6, 8, "full")
  arms = sweep.build_arms(cell, params, x, lengths, [])
  floor = arms["floor"]
  assert floor.inputs[0].shape == x.shape
  loss, grads = floor.train(params, *floor.inputs)
  flax_loss, flax_grads = arms["flax"].train(params, *arms["flax"].inputs)
  np.testing.assert_allclose(loss, flax_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(flax_grads), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_floor_runs_the_real_cells_only():
  lengths, x, cell, params = sweep.cell_inputs(8, 16, 8, "even")
  (dense,) = sweep.floor_arm(x, lengths).inputs
  assert dense.shape == (8, -(-int(lengths.sum()) // 8), 8)
  assert dense.shape[1] < 16


def test_bad_flags_are_refused(capsys):
  with pytest.raises(SystemExit):
    sweep.main(["--plans", "nope"])
  assert "--plans: got ['nope']" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sweep.main(["--min-seconds", "-1"])
  assert "--min-seconds must be >= 0, got -1.0" in capsys.readouterr().err
