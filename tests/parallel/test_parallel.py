"""jaxlod.parallel: bad input on one device, and the multi-device suites.

The equivalence tests need several devices, and
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` must be set before
JAX starts: they run in a child pytest (tests/parallel/multidevice). The multi-host
test starts 2 processes on 127.0.0.1 through `jax.distributed`.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.errors import InvalidRngError

from jaxlod import Buckets
from jaxlod.data import Batcher
from jaxlod.parallel import (
  data_parallel,
  generate,
  local_shards,
  map_shards,
  shard_batch,
)
from tests.nn.test_rngs import SETTINGS, drop_seq2seq

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = [(np.arange(n, dtype=np.float32),) for n in (3, 1, 4, 1, 5, 2)]
BUCKETS = Buckets.fixed(tokens=8, sequences=4, time=6)


def _child_env(devices: int) -> dict[str, str]:
  env = dict(os.environ)
  # The other flags (tests/conftest.py) stay.
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
  flags.append(f"--xla_force_host_platform_device_count={devices}")
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAXLOD_MULTIDEVICE"] = "1"
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((1,), ("data",))


def _stacked(shards: int):
  batcher = Batcher(EXAMPLES, BUCKETS, shards=shards, shuffle=False, prefetch=0)
  return next(batcher.iterate())


def test_shard_batch_places_one_shard(mesh):
  batch = _stacked(1)
  placed = shard_batch(batch, mesh)
  assert placed.indices is batch.indices
  values = placed.fields[0].values
  assert isinstance(values, jax.Array)
  assert values.shape == (1, 8)
  assert values.sharding.spec == jax.sharding.PartitionSpec("data")
  np.testing.assert_array_equal(np.asarray(values), batch.fields[0].values)
  assert local_shards(mesh) == 1


def test_shard_count_must_match_the_mesh_axis(mesh):
  with pytest.raises(
    ValueError,
    match=r"Expected a batch of 1 shards \(the size of mesh axis 'data'\), got 2",
  ):
    shard_batch(_stacked(2), mesh)


def test_mesh_must_have_the_axis(mesh):
  batch = _stacked(1)
  message = r"Expected `axis` to name an axis of `mesh`, got 'batch'.*\('data',\)"
  with pytest.raises(ValueError, match=message):
    shard_batch(batch, mesh, axis="batch")
  with pytest.raises(ValueError, match=message):
    data_parallel(lambda local: local, mesh, axis="batch")
  with pytest.raises(ValueError, match=message):
    map_shards(lambda local: local, mesh, axis="batch")
  with pytest.raises(TypeError, match="Expected `mesh` to be a jax.sharding.Mesh"):
    shard_batch(batch, "mesh")


def test_leaves_must_agree_in_shards(mesh):
  with pytest.raises(ValueError, match=r"same number of shards, got 1 at .*2 at"):
    shard_batch((np.zeros((1, 3)), np.zeros((2, 3))), mesh)
  with pytest.raises(ValueError, match="got a scalar at"):
    shard_batch((np.zeros((1, 3)), np.float32(1.0)), mesh)


@pytest.mark.parametrize("check_vma", [True, False])
def test_data_parallel_on_one_device_is_the_function(mesh, check_vma):
  batch = shard_batch(_stacked(1), mesh)

  def total(w, fields):
    (x,) = fields
    return jnp.sum(x.values * w), x.num_rows, jnp.float32(1.0)

  out = jax.jit(data_parallel(total, mesh, check_vma=check_vma))(
    jnp.float32(3.0), batch.fields
  )
  host = _stacked(1).fields[0]
  assert float(out[0]) == 3.0 * float(np.sum(host.values))
  assert int(out[1]) == int(host.offsets[0][0, -1])
  assert float(out[2]) == 1.0  # a constant output counts once per device


@pytest.mark.parametrize("runner", [data_parallel, map_shards])
def test_a_device_given_several_shards_raises(mesh, runner):
  # Placed by hand rather than by shard_batch, 2 shards land on the one
  # device: running the first alone would drop half the batch.
  batch = jax.device_put(
    _stacked(2).fields,
    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
  )
  run = jax.jit(runner(lambda fields: fields[0].num_rows, mesh))
  message = (
    r"Expected `batch` to hold one shard per device along mesh axis 'data' \(1\), "
    r"got 2 shards on its leading axis"
  )
  with pytest.raises(ValueError, match=message):
    run(batch)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_generate_takes_rngs(mesh):
  """Layers that draw (dropout in the cells) get the keys of `rngs`."""
  model, params = drop_seq2seq()
  examples = [(np.array([3, 1, 4]),), (np.array([1, 5]),)]
  batcher = Batcher(examples, BUCKETS, shards=1, shuffle=False, prefetch=0)
  src = shard_batch(next(batcher.iterate()), mesh).fields[0]

  def decode(seed):
    rngs = {"dropout": jax.random.key(seed)}
    (hyps,) = generate((model, params), src, mesh, settings=SETTINGS, rngs=rngs)
    return [[h.tolist() for h in hs] for hs in hyps.ids.to_list()]

  first, again, other = decode(2), decode(2), decode(3)
  assert first == again and first != other
  assert [len(hs) for hs in first] == [SETTINGS.results] * 2
  with pytest.raises(InvalidRngError, match=r'needs PRNG for "dropout"'):
    generate((model, params), src, mesh, settings=SETTINGS)


def test_four_devices_match_one():
  """tests/parallel/multidevice with 4 forced host devices (equivalence, compilation
  count, beam search, the invariant-parameter error)."""
  command = [
    sys.executable,
    "-m",
    "pytest",
    "tests/parallel/multidevice",
    "-o",
    "addopts=",
  ]
  command += ["-p", "no:cacheprovider", "-p", "no:benchmark", "-W", "error"]
  result = subprocess.run(
    command, cwd=ROOT, env=_child_env(4), capture_output=True, text=True, timeout=600
  )
  out = result.stdout[-6000:] + result.stderr[-3000:]
  assert result.returncode == 0, out
  passed = re.search(r"(\d+) passed", result.stdout)
  assert passed and int(passed.group(1)) >= 11, out
  assert "failed" not in result.stdout and "error" not in result.stdout, out


def _worker(out, process_id, num_processes, port, devices):
  command = [sys.executable, "-m", "tests.parallel.multidevice.multihost_worker"]
  command += [str(out), str(process_id), str(num_processes), str(port)]
  return subprocess.Popen(
    command,
    cwd=ROOT,
    env=_child_env(devices),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )


@pytest.mark.slow
def test_two_processes_train_as_one(tmp_path):
  """2 processes of 2 devices on 127.0.0.1 (`jax.distributed`, gloo) train a
  Seq2Seq for 10 steps to the parameters of 1 process of 4 devices."""
  port = _free_port()
  procs = [
    _worker(tmp_path / "single.npz", 0, 1, port, 4),
    _worker(tmp_path / "multi0.npz", 0, 2, port, 2),
    _worker(tmp_path / "multi1.npz", 1, 2, port, 2),
  ]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=110)[0])
  finally:
    for proc in procs:  # never leave a process behind, whatever happened
      if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()
  for proc, output in zip(procs, outputs, strict=True):
    assert proc.returncode == 0 and "WORKER-DONE" in output, output[-4000:]
  for output in outputs[1:]:
    assert "MISMATCH-RAISED" in output, output[-4000:]
    assert "(2, 48) on process" in output and "(2, 64) on process" in output
    assert "STRUCTURE-RAISED" in output, output[-4000:]
  single = np.load(tmp_path / "single.npz")
  for name in ("multi0", "multi1"):
    multi = np.load(tmp_path / f"{name}.npz")
    assert sorted(multi.files) == sorted(single.files)
    for key in single.files:
      np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, atol=1e-6)
