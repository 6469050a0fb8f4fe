"""benchmarks/dispatch.py: the drop-in's step with and without its check."""

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
  # The check is an effect of the traced step; without it there is none,
  # and the values are the same.
  assert cell["effects"] == {
    "flax": False,
    "dropin": True,
    "padded": True,
    "dropin_unchecked": False,
    "padded_unchecked": False,
  }
  assert cell["max_abs_diff_unchecked"] == 0.0
  assert set(cell["per_call_ms"]) == set(cell["effects"])
  for times in cell["per_call_ms"].values():
    assert times["sync_ms"] > 0 and times["pipelined_ms"] > 0
  assert cell["ratios"]["dropin_sync_over_unchecked"] > 0
