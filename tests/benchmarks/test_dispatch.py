"""benchmarks/dispatch.py: the drop-in's step beside Flax's, per call."""

from __future__ import annotations

import json

from benchmarks import dispatch


def test_one_cell_end_to_end(tmp_path, capsys):
  out = tmp_path / "dispatch.json"
  report = dispatch.main(
    ["--cells", "B8_T8_H16_even", "--repeats", "1", "--calls", "2", "--json", str(out)]
  )
  capsys.readouterr()
  assert json.loads(out.read_text())["cells"] == report["cells"]
  cell = report["cells"]["B8_T8_H16_even"]
  # No arm's traced step has an effect, so each dispatches on JAX's fast
  # path, and the drop-in's loss and gradients are Flax's.
  assert cell["effects"] == {"flax": False, "dropin": False, "padded": False}
  assert cell["max_abs_diff_vs_flax"] < 1e-5
  assert set(cell["per_call_ms"]) == set(cell["effects"])
  for times in cell["per_call_ms"].values():
    assert times["sync_ms"] > 0 and times["pipelined_ms"] > 0
  assert cell["ratios"]["flax_sync_speedup_of_dropin"] > 0
