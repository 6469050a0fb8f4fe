"""`jaxlod.ops.map_rows` against the same function over every row, then the
padding rows zeroed: values and float64 gradients (of the rows and of the
arrays the function closes over) for real rows at, just above and just
below each chunk's end, chunks that divide the capacity and one that does
not (the last chunk overlaps), pytree outputs, a 2-level LoD, an all-empty
batch, `check_grads`; which chunks run and which rows each writes; one
compile over batches of one capacity; the default chunk; the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from benchmarks.timing import xla_compiles
from jaxlod import Buckets, LoDTensor
from jaxlod.ops import default_chunk, map_rows

BUCKETS = Buckets.fixed(tokens=32, sequences=4, time=8)
# 32 rows of capacity: chunks of 12 start at 0, 12 and 20 (the last overlaps).
CHUNK = 12
F64 = {"rtol": 1e-13, "atol": 1e-13}


@pytest.fixture(autouse=True)
def float64():
  with jax.enable_x64(True):
    yield


def batch(lengths, features=3, seed=0) -> LoDTensor:
  rows = np.random.default_rng(seed).standard_normal((sum(lengths), features))
  return LoDTensor.from_lengths(rows, [lengths], buckets=BUCKETS)


def weights(seed=1):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((3, 5))), jnp.asarray(rng.standard_normal(5))


def mlp(w, b):
  """A row-wise function with a nonlinearity, closing over `w` and `b`."""
  return lambda rows: jnp.tanh(rows @ w + b) ** 2


def reference(fn, x: LoDTensor) -> jax.Array:
  """`fn` over every row, padding rows zero."""
  y = fn(x.values)
  return jnp.where(x.row_mask()[:, None], y, 0)


def losses(x: LoDTensor, chunk):
  def mine(w, b, values):
    y = map_rows(mlp(w, b), x.with_values(values), chunk=chunk).values
    return jnp.sum(jnp.sin(y))

  def theirs(w, b, values):
    return jnp.sum(jnp.sin(reference(mlp(w, b), x.with_values(values))))

  return mine, theirs


@settings(max_examples=25, deadline=None)
@given(
  lengths=st.lists(st.integers(0, 8), min_size=1, max_size=4),
  chunk=st.sampled_from([None, CHUNK, 1, 3, 8, 31, 32, 64]),
)
def test_values_and_gradients_equal_the_function_over_every_row(lengths, chunk):
  x = batch(lengths)
  w, b = weights()
  mine, theirs = losses(x, chunk)
  np.testing.assert_allclose(
    map_rows(mlp(w, b), x, chunk=chunk).values, reference(mlp(w, b), x), **F64
  )
  got = jax.jit(jax.grad(mine, (0, 1, 2)))(w, b, x.values)
  want = jax.grad(theirs, (0, 1, 2))(w, b, x.values)
  for g, h in zip(got, want, strict=True):
    np.testing.assert_allclose(g, h, **F64)


def lengths_of(real: int) -> list[int]:
  """Lengths of 4 sequences of at most 8 rows with `real` rows in all."""
  return [min(8, real - 8 * i) for i in range(4) if real - 8 * i > 0] or [0]


@pytest.mark.parametrize("chunk", [CHUNK, 8])
@pytest.mark.parametrize("real", [32, 31, 25, 24, 23, 21, 20, 13, 12, 11, 9, 8, 1, 0])
def test_real_rows_at_and_around_each_chunk_end(real, chunk):
  x = batch(lengths_of(real))
  w, b = weights()
  mine, theirs = losses(x, chunk)
  np.testing.assert_allclose(
    jax.jit(mine)(w, b, x.values), theirs(w, b, x.values), **F64
  )
  for g, h in zip(
    jax.grad(mine, (0, 1, 2))(w, b, x.values),
    jax.grad(theirs, (0, 1, 2))(w, b, x.values),
    strict=True,
  ):
    np.testing.assert_allclose(g, h, **F64)


@pytest.mark.parametrize(
  ("real", "chunks"), [(0, 0), (1, 1), (12, 1), (13, 2), (24, 2), (25, 3), (32, 3)]
)
def test_it_runs_the_chunks_the_real_rows_need(real, chunks):
  calls = []

  def count(rows):
    jax.debug.callback(lambda: calls.append(1))
    return rows

  x = batch(lengths_of(real))
  jax.block_until_ready(jax.jit(lambda x: map_rows(count, x, chunk=CHUNK).values)(x))
  assert len(calls) == chunks


def test_each_row_is_written_by_the_chunk_that_owns_it():
  # Not row-wise, on purpose: each row gets its position in its chunk.
  # Chunks of 12 over 32 rows start at 0, 12 and 20; rows 20 to 23 are the
  # second chunk's, so the third writes rows 24 on only.
  def position(rows):
    return jnp.zeros_like(rows) + jnp.arange(rows.shape[0])[:, None]

  x = batch(lengths_of(30))
  y = jax.jit(lambda x: map_rows(position, x, chunk=CHUNK).values)(x)
  want = np.concatenate([np.arange(12), np.arange(12), np.arange(4, 10), [0, 0]])
  np.testing.assert_array_equal(y[:, 0], want)


def test_padding_rows_neither_reach_the_result_nor_get_a_gradient():
  x = batch([3, 2])
  poisoned = x.values.at[5:].set(jnp.nan)
  w, b = weights()
  y = map_rows(mlp(w, b), x.with_values(poisoned), chunk=CHUNK).values
  assert np.all(np.isfinite(y)) and np.all(y[5:] == 0)
  mine, _ = losses(x, CHUNK)
  g = jax.grad(mine, (0, 1, 2))(w, b, poisoned)
  assert all(np.all(np.isfinite(a)) for a in g)
  assert np.all(g[2][5:] == 0)


def test_pytree_outputs_integer_closures_and_a_two_level_lod():
  lengths = [[2, 1], [3, 0, 2]]
  rows = np.random.default_rng(0).standard_normal((5, 2))
  x = LoDTensor.from_lengths(
    rows, lengths, buckets=Buckets.fixed(tokens=12, sequences=(2, 3), time=(3, 3))
  )
  shift = jnp.asarray(3)
  out = map_rows(lambda r: {"a": r * 2, "b": r[:, :1] + shift}, x, chunk=8)
  assert out["a"].offsets[0].tolist() == x.offsets[0].tolist()
  np.testing.assert_allclose(out["a"].values[:5], rows * 2, **F64)
  np.testing.assert_allclose(out["b"].values[:5], rows[:, :1] + 3, **F64)
  assert np.all(out["a"].values[5:] == 0)

  def loss(v):
    y = map_rows(lambda r: {"a": r * 2, "b": r[:, :1] * shift}, x.with_values(v))
    return jnp.sum(y["a"].values ** 2) + jnp.sum(y["b"].values)

  g = jax.jit(jax.grad(loss))(x.values)
  want = np.zeros((12, 2))
  want[:5] = 8 * rows
  want[:5, 0] += 3
  np.testing.assert_allclose(g, want, **F64)


def test_integer_rows_an_embedding_lookup():
  ids = LoDTensor.from_lengths(np.asarray([2, 0, 1]), [[2, 1]], buckets=BUCKETS)
  table = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)))

  def loss(table):
    return jnp.sum(map_rows(lambda r: table[r], ids, chunk=CHUNK).values ** 2)

  y = map_rows(lambda r: table[r], ids).values
  np.testing.assert_allclose(y[:3], table[np.asarray([2, 0, 1])], **F64)
  assert np.all(y[3:] == 0)
  np.testing.assert_allclose(jax.jit(jax.grad(loss))(table), 2 * table, **F64)


def test_an_empty_batch_and_check_grads():
  w, b = weights()
  empty = batch([0, 0])
  assert np.all(map_rows(mlp(w, b), empty).values == 0)
  x = batch([4, 3])
  check_grads(
    lambda w, b, v: map_rows(mlp(w, b), x.with_values(v), chunk=CHUNK).values,
    (w, b, x.values),
    order=2,
    modes=["rev"],
  )


def test_one_compile_over_batches_of_one_capacity():
  w, b = weights()
  step = jax.jit(jax.grad(lambda w, b, x: jnp.sum(map_rows(mlp(w, b), x).values)))
  rng = np.random.default_rng(0)
  with xla_compiles() as names:
    for _ in range(6):
      jax.block_until_ready(step(w, b, batch(list(rng.integers(0, 9, 4)))))
  assert sum(names.values()) == 1


def test_the_default_chunk():
  capacities = (3072, 8192, 640, 257, 100, 1)
  assert [default_chunk(n, 512, "cpu") for n in capacities] == [
    256,
    256,
    216,
    136,
    100,
    1,
  ]
  # Narrower rows: more of them a chunk (1,024 rows of 128).
  assert [default_chunk(n, 128, "cpu") for n in capacities] == [
    1024,
    1024,
    640,
    257,
    100,
    1,
  ]
  assert default_chunk(16384, 512, "gpu") == 2048
  assert default_chunk(3000, 512, "tpu") == 1504
  assert default_chunk(64, 0, "cpu") == 64
  for n in range(1, 2000, 7):
    chunk = default_chunk(n, 512, "cpu")
    assert chunk <= min(n, 256) or chunk == n
    # Equal chunks: the capacity's chunks waste less than a chunk of 8 rows each.
    assert -(-n // chunk) * chunk - n < 8 * -(-n // chunk)


def test_errors():
  x = batch([2, 1])
  with pytest.raises(TypeError, match="`fn` to be callable, got int"):
    map_rows(3, x)
  with pytest.raises(TypeError, match="`x`"):
    map_rows(lambda r: r, x.values)
  with pytest.raises(ValueError, match="one row per input row"):
    map_rows(lambda r: jnp.sum(r, axis=0), x)
  with pytest.raises(ValueError, match="`chunk`"):
    map_rows(lambda r: r, x, chunk=0)
  with pytest.raises(TypeError, match="`chunk`"):
    map_rows(lambda r: r, x, chunk=2.0)
