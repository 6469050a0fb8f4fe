"""The G2P example with a log of the training batches it takes.

``python -m tests.examples.g2p_batches LOG HANG_AT ARGS...`` runs
``examples.g2p.cli.main(ARGS)`` with every training batch's step and
examples appended to the JSON-lines file LOG as the training loop takes it,
and hangs (until killed) when the loop asks for the batch of step HANG_AT.
tests/examples/test_g2p.py kills such a run after a checkpoint and resumes
it.
"""

from __future__ import annotations

import json
import pathlib
import sys
import threading

from examples.g2p import cli, train
from jaxlod.data import Batcher


def logging_batcher(log: pathlib.Path, hang_at: int | None = None) -> type[Batcher]:
  """A `Batcher` whose `iterate` logs each batch it yields to `log`."""

  class Logged(Batcher):
    def iterate(self, start_step=None):
      with open(log, "a") as file:
        for batch in super().iterate(start_step):
          if batch.step == hang_at:
            threading.Event().wait()
          entry = {"step": batch.step, "indices": batch.indices.tolist()}
          file.write(json.dumps(entry) + "\n")
          file.flush()
          yield batch

  return Logged


def read_log(log: pathlib.Path) -> list[dict]:
  """The entries of `log`'s complete lines."""
  return [json.loads(line) for line in log.read_text().split("\n")[:-1]]


if __name__ == "__main__":
  log, hang_at, *argv = sys.argv[1:]
  train.Batcher = logging_batcher(pathlib.Path(log), int(hang_at))
  cli.main(argv)
