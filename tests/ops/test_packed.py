"""The static bound on the rows that the phased loop stores for its backward."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import default_ladder, dynamic_rnn, normalize_ladder
from jaxlod.ops._packed import schedule_rows
from tests.helpers import assert_close


def _rows_used(lengths, ladder) -> int:
  """Rows of the schedule layout for these lengths: NumPy, step by step."""
  lengths = np.asarray(lengths)
  rows = 0
  for t in range(int(lengths.max(initial=0))):
    active = int(np.sum(lengths > t))
    rows += min(size for size in ladder if size >= active)
  return rows


@settings(max_examples=200, deadline=None)
@given(
  st.integers(1, 12).flatmap(
    lambda count: st.tuples(
      st.just(count),
      st.lists(st.integers(0, 10), min_size=count, max_size=count),
      st.lists(st.integers(1, count), max_size=4),
      st.integers(0, 30),
    )
  )
)
def test_schedule_rows_bounds_every_batch(args):
  count, lengths, sizes, extra_tokens = args
  ladder = normalize_ladder(count, sizes)
  tokens, time = sum(lengths) + extra_tokens, max(lengths)
  bound = schedule_rows(tokens, time, ladder)
  assert _rows_used(lengths, ladder) <= bound
  assert bound >= ladder[0]


def _worst_batch(count, tokens, time, ladder):
  """The lengths that use the most schedule rows, by exhaustive search."""
  best, worst = -1, None
  for lengths in itertools.combinations_with_replacement(range(time, -1, -1), count):
    if sum(lengths) <= tokens and _rows_used(lengths, ladder) > best:
      best, worst = _rows_used(lengths, ladder), lengths
  return best, worst


@pytest.mark.parametrize(
  ("count", "tokens", "time", "sizes"),
  [(6, 20, 8, None), (6, 24, 9, (4, 1)), (7, 16, 8, (6, 2))],
)
def test_schedule_rows_is_near_the_exhaustive_worst_case(count, tokens, time, sizes):
  ladder = normalize_ladder(count, sizes)
  worst, _ = _worst_batch(count, tokens, time, ladder)
  bound = schedule_rows(tokens, time, ladder)
  assert worst <= bound
  # The linear program's optimum is at most a few rows over the integer one.
  assert bound - worst <= ladder[0]


def test_schedule_rows_of_benchmark_w1_capacities():
  ladder = default_ladder(64)
  assert schedule_rows(3072, 128, ladder) == 3908
  # 52 sequences of 56 steps and one of 128: 56 steps at 64, 72 at 4.
  lengths = [128] + [56] * 52
  assert sum(lengths) <= 3072
  assert _rows_used(lengths, ladder) == 56 * 64 + 72 * 4 <= 3908


@pytest.mark.parametrize("remat", [False, True])
def test_a_worst_case_batch_matches_the_scan(remat):
  """The batch that fills the stored rows: gradients equal a plain scan's."""
  count, tokens, time, ladder = 6, 24, 9, normalize_ladder(6, (4, 1))
  worst, lengths = _worst_batch(count, tokens, time, ladder)
  assert worst == _rows_used(lengths, ladder) > tokens
  rng = np.random.default_rng(0)
  seqs = [rng.normal(size=(n, 2)).astype(np.float32) for n in lengths]
  x = LoDTensor.from_sequences(
    seqs, buckets=Buckets.fixed(tokens=tokens, sequences=count, time=time)
  )
  w = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
  u = jnp.asarray(rng.normal(size=(3, 3)) * 0.5, jnp.float32)

  def cell(w, h, x_t):
    h = jnp.tanh(x_t @ w + h @ u)
    return h, h

  def loss(w):
    ys, h = dynamic_rnn(
      lambda h, x_t, _: cell(w, h, x_t),
      x,
      init_carry=jnp.zeros((count, 3)),
      ladder=ladder,
      remat=remat,
    )
    return jnp.sum(ys.values**2) + jnp.sum(h)

  def reference(w):
    total = 0.0
    for seq in seqs:
      h = jnp.zeros((1, 3))
      for row in seq:
        h, y = cell(w, h, row[None])
        total = total + jnp.sum(y**2)
      total = total + jnp.sum(h)
    return total

  assert_close(jax.jit(jax.grad(loss))(w), jax.grad(reference)(w), rtol=1e-5)
