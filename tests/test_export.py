"""A jitted function over LoDTensors and rank tables exports with `jax.export`,
serializes, and runs the same after deserializing in a fresh process.

`run` builds its rank table on the device: a function given a table checks
it through `checkify.debug_check`, whose effect JAX cannot serialize yet.
`table_lengths` takes a RankTable in, so its pytree registration is
exercised too."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import dynamic_rnn, rank_table

BUCKETS = Buckets.fixed(tokens=8, sequences=3, time=4)


def run(x, table):
  step = lambda c, x_t, _: (jnp.tanh(c + x_t), c + x_t)  # noqa: E731
  outputs, carry = dynamic_rnn(step, x, init_carry=jnp.zeros((3, 2)))
  return outputs, carry, table.lengths * 2


def batch():
  rows = np.arange(12.0, dtype=np.float32).reshape(6, 2) / 10
  x = LoDTensor.from_lengths(rows, [[3, 1, 2]], buckets=BUCKETS)
  return x, rank_table(x)


def test_export_round_trip_in_a_fresh_process(tmp_path):
  x, table = batch()
  exported = export.export(jax.jit(run))(x, table)
  path = tmp_path / "run.bin"
  path.write_bytes(exported.serialize())
  outputs, carry, _ = run(x, table)
  np.save(tmp_path / "values.npy", np.asarray(outputs.values))
  np.save(tmp_path / "carry.npy", np.asarray(carry))
  script = textwrap.dedent(
    f"""
    import numpy as np
    from jax import export
    import jaxlod  # registers LoDTensor and RankTable for deserialization
    from tests.test_export import batch

    call = export.deserialize(open({str(path)!r}, "rb").read())
    x, table = batch()
    outputs, carry, lengths = call.call(x, table)
    assert lengths.tolist() == (table.lengths * 2).tolist()
    assert type(outputs).__name__ == "LoDTensor", type(outputs)
    values = np.load({str(tmp_path / "values.npy")!r})
    np.testing.assert_array_equal(outputs.values, values)
    np.testing.assert_array_equal(carry, np.load({str(tmp_path / "carry.npy")!r}))
    print("same")
    """
  )
  done = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip().endswith("same")
