"""The tour of ``python -m jaxlod`` and the W1 example (examples/w1.py)."""

import subprocess
import sys

import numpy as np

import jaxlod.__main__
from examples import w1


def test_tour_prints_the_schedule(capsys):
  jaxlod.__main__.tour()
  out = capsys.readouterr().out
  assert "recursive lengths: [[4, 20, 2, 5, 30, 12, 12, 5, 1, 21]]" in out
  assert "112  real token-steps (sum of lengths)" in out
  assert "300  padding 10 sequences to the longest (30)" in out
  assert "paragraphs ranked by sentence count: [(1, 4), (0, 3), (2, 3)]" in out


def test_w1_running_mean_target():
  x, lengths = w1.sample_batch(np.random.default_rng(0))
  assert x.capacity.tokens == 3072 and len(lengths) == w1.BATCH
  got = np.asarray(w1.running_mean(x))[: lengths.sum()]
  steps = [np.arange(1, len(s) + 1)[:, None] for s in x.to_list()]
  want = np.concatenate(
    [np.cumsum(s, 0) / n for s, n in zip(x.to_list(), steps, strict=True)]
  )
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_python_m_jaxlod_help_prints_help_only():
  done = subprocess.run(
    [sys.executable, "-m", "jaxlod", "--help"],
    capture_output=True,
    text=True,
    timeout=60,
    check=True,
  )
  assert done.stdout.startswith("usage: python -m jaxlod [-h]")
  # argparse wraps the description at the terminal's width.
  assert "python -m examples.g2p" in " ".join(done.stdout.split())
  assert "recursive lengths" not in done.stdout
