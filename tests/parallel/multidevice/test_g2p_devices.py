"""The G2P example with --devices on forced host devices
(tests/parallel/test_parallel.py runs this module in a child process with 4
of them)."""

from __future__ import annotations

import jax
import pytest

from examples.g2p import checkpoints, cli, data, decoding
from examples.g2p import model as m

FLAGS = ["--preset", "tiny", "--quiet", "--examples", "0"]


def test_devices_train_resume_and_decode_like_one_device(tmp_path, monkeypatch):
  # `cli.main` builds its data-parallel step anew, and each new one compiles:
  # the resumed run (2 more steps, the same model and mesh) reuses the first's.
  build, built = m.train_step, []

  def train_step(config, num_phones, mesh=None):
    assert mesh is not None and mesh.size == 2
    if not built:
      built.append(build(config, num_phones, mesh))
    return built[0]

  monkeypatch.setattr(m, "train_step", train_step)
  first = cli.main([*FLAGS, "--devices", "2", "--workdir", str(tmp_path)])
  assert first["start_step"] == 0 and first["step"] == 12
  resumed = cli.main(
    [*FLAGS, "--devices", "2", "--workdir", str(tmp_path), "--resume", "--steps", "14"]
  )
  assert resumed["start_step"] == 12 and resumed["step"] == 14

  # Decoding on 4 devices gives the words one device gives.
  config = m.PRESETS["tiny"]
  corpus = data.load_corpus(config)
  mesh = cli.make_mesh("all")
  assert mesh.size == 4
  params, opt_state = checkpoints.restore_checkpoint(
    tmp_path, 14, config, len(corpus.phones)
  )
  params = m.eval_params(config, params, opt_state)
  one = decoding.evaluate(params, config, corpus, "test")
  four = decoding.evaluate(params, config, corpus, "test", mesh=mesh)
  assert four[2] == one[2]
  assert four[:2] == one[:2]


def test_more_devices_than_the_process_has():
  with pytest.raises(ValueError, match=r"--devices 5: this process has 4 local"):
    cli.make_mesh("5")
  assert cli.make_mesh("1") is None
  assert jax.device_count() == 4
