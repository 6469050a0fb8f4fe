"""Jitted functions over LoDTensors and rank tables export with `jax.export`,
serialize, and give bitwise the same results after deserializing in a fresh
process.

jaxlod's checks under `jit` are `checkify` checks, whose effect `jax.export`
cannot serialize: each function is exported as `jaxlod.unchecked(fn)`, and
compared with `jax.jit(fn)`. An artifact has the shapes it was exported
with: one artifact per capacity."""

import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from jax import export

from jaxlod import Buckets, Fault, LoDTensor, unchecked
from jaxlod.nn import DynamicRNN
from jaxlod.nn import nnx as lod_nnx
from jaxlod.ops import Hypotheses, Memory, rank_table
from tests.nn.test_generate import settings
from tests.nn.test_seq2seq import _seq2seq, _seq2seq_batch

ROOT = pathlib.Path(__file__).parent.parent
BUCKETS = Buckets.fixed(tokens=8, sequences=3, time=4)

# Run in a fresh process with the folder of `round_trip`'s files: knows
# nothing of the exported function but its serialized artifact.
FRESH = """
import pathlib, sys
import jax
import numpy as np
from jax import export
import jaxlod.ops  # registers jaxlod's pytrees for deserialization

folder = pathlib.Path(sys.argv[1])
call = export.deserialize(bytearray((folder / "fn.bin").read_bytes()))

def load(name):
  data = np.load(folder / name)
  return [data[f"arr_{i}"] for i in range(len(data.files))]

args = jax.tree.unflatten(call.in_tree, load("args.npz"))[0]
out = call.call(*args)
assert str(jax.tree.structure(out)) == (folder / "tree.txt").read_text()
wants = load("want.npz")
for i, (got, want) in enumerate(zip(jax.tree.leaves(out), wants, strict=True)):
  got = np.asarray(got)
  assert (got.dtype, got.shape) == (want.dtype, want.shape), (i, got.dtype, got.shape)
  assert got.tobytes() == want.tobytes(), (i, got, want)
print("same")
"""


def round_trip(tmp_path, fn, *args):
  """Exports ``jax.jit(unchecked(fn))`` for `args`, calls the deserialized
  artifact in a fresh process, and checks that its results are bitwise those
  of ``jax.jit(fn)`` here."""
  artifact = export.export(jax.jit(unchecked(fn)))(*args).serialize()
  (tmp_path / "fn.bin").write_bytes(artifact)
  np.savez(tmp_path / "args.npz", *jax.tree.leaves(args))
  want = jax.jit(fn)(*args)
  np.savez(tmp_path / "want.npz", *jax.tree.leaves(want))
  (tmp_path / "tree.txt").write_text(str(jax.tree.structure(want)))
  done = subprocess.run(
    [sys.executable, "-c", FRESH, str(tmp_path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == "same"


def random_params(module, *args):
  """Parameters of `module` for `args`, drawn from a normal distribution: its
  init traced, not compiled (the results need not be a trained model's)."""
  shapes = jax.eval_shape(module.init, jax.random.key(0), *args)
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), shapes)


def rnn_batch(lengths=(3, 1, 2), buckets=BUCKETS):
  rows = np.arange(12.0, dtype=np.float32).reshape(6, 2) / 10
  x = LoDTensor.from_lengths(rows[: sum(lengths)], [list(lengths)], buckets=buckets)
  return x, rank_table(x)


RNN = DynamicRNN(nn.GRUCell(4), return_carry=True)


def rnn_forward(params, x, table):
  return RNN.apply(params, x, table=table)


def test_dynamic_rnn_round_trip_in_a_fresh_process(tmp_path):
  x, table = rnn_batch()
  round_trip(tmp_path, rnn_forward, random_params(RNN, x), x, table)


def test_nnx_dynamic_rnn_round_trip_in_a_fresh_process(tmp_path):
  x, table = rnn_batch()
  rnn = lod_nnx.DynamicRNN(nnx.GRUCell(2, 4, rngs=nnx.Rngs(0)), return_carry=True)
  graphdef, state = nnx.split(rnn)

  def forward(params, x, table):
    return nnx.merge(graphdef, params)(x, table=table)

  round_trip(tmp_path, forward, nnx.to_pure_dict(state), x, table)


@pytest.mark.slow
def test_generate_round_trip_in_a_fresh_process(tmp_path):
  src, tgt_in, _ = _seq2seq_batch()
  model = _seq2seq()
  search = settings(ladder=())  # one phase: one copy of the step to compile

  def generate(params, src, src_table):
    return model.apply(params, src, search, method="generate", src_table=src_table)

  params = random_params(model, src, tgt_in)
  round_trip(tmp_path, generate, params, src, rank_table(src))


def test_an_artifact_takes_one_capacity_and_marks_a_wrong_table():
  x, table = rnn_batch()
  params = random_params(RNN, x)
  exported = export.export(jax.jit(unchecked(rnn_forward)))(params, x, table)
  call = export.deserialize(exported.serialize())
  wider, wider_table = rnn_batch(buckets=Buckets.fixed(tokens=16, sequences=3, time=4))
  with pytest.raises(ValueError, match=r"Shape mismatch for args\[1\]\.values"):
    call.call(params, wider, wider_table)
  _, other_table = rnn_batch((1, 3, 2))  # another batch, the same capacities
  carry, y = call.call(params, x, other_table)
  assert int(y.faults) == Fault.TABLE
  assert np.isnan(carry).all()
  with pytest.raises(ValueError, match="faulted"):
    y.to_list()


def test_jaxlod_pytrees_serialize_their_structure():
  x, table = rnn_batch()
  memory = Memory(np.zeros((3, 4, 2), np.float32), np.array([4, 1, 0], np.int32))
  hyps = Hypotheses(x, x)
  for tree in (x, table, memory, hyps):
    exported = export.export(jax.jit(lambda t: t))(tree)
    call = export.deserialize(exported.serialize())
    assert call.out_tree == jax.tree.structure(tree), type(tree)
