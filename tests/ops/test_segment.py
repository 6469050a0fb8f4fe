"""Tests of the helpers shared by the sequence ops (jaxlod/ops/_segment.py);
the checks they used to hold are tested in tests/test_checks.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxlod import Buckets, Capacity, LoDTensor
from jaxlod.ops import _segment

BOUND = Capacity(tokens=16, sequences=(4,), time=(8,))
REAL = Capacity(tokens=6, sequences=(3,), time=(5,))


def _x():
  buckets = Buckets.fixed(tokens=8, sequences=4, time=5)
  return LoDTensor.from_lengths(np.arange(6.0), [[2, 0, 4]], buckets=buckets)


def test_rows_map_each_row_to_its_sequence():
  layout = _segment.rows(_x())
  assert layout.segment[:6].tolist() == [0, 0, 2, 2, 2, 2]
  assert layout.position[:6].tolist() == [0, 1, 0, 1, 2, 3]
  assert layout.valid.tolist() == [True] * 6 + [False] * 2


def test_rows_without_sequence_slots():
  layout = _segment.rows_of(jnp.zeros((1,), jnp.int32), 3)
  assert layout.valid.tolist() == [False] * 3


def test_masked_segment_sum_ignores_padding_rows():
  x = _x()
  x = x.with_values(x.values.at[7].set(100.0))
  sums = _segment.masked_segment_sum(x.values, _segment.rows(x), 4)
  assert sums.tolist() == [1.0, 0.0, 14.0, 0.0]


@pytest.mark.parametrize(
  ("capacity", "expected"),
  [
    (None, BOUND),
    (6, Capacity(6, (4,), (8,))),
    (Buckets.exact(), REAL),
    (Buckets.pow2(minimum=2), Capacity(8, (4,), (8,))),
    (Buckets.fixed(tokens=10, sequences=3, time=6), Capacity(10, (3,), (6,))),
  ],
)
def test_output_capacity_eager(capacity, expected):
  got = _segment.output_capacity(capacity, bound=BOUND, real=REAL, where="op")
  assert got == expected


def test_output_capacity_under_jit():
  def resolve(capacity):
    seen = []

    def f(tokens):
      real = REAL._replace(tokens=tokens)
      seen.append(
        _segment.output_capacity(capacity, bound=BOUND, real=real, where="op")
      )
      return tokens

    jax.eval_shape(f, jnp.int32(6))  # traced: the sizes are unknown
    return seen[0]

  fixed = Buckets.fixed(tokens=10, sequences=3, time=6)
  assert resolve(fixed) == Capacity(10, (3,), (6,))
  # A policy other than fixed rounds the static bound.
  assert resolve(Buckets.pow2(minimum=2)) == Capacity(16, (4,), (8,))
  assert resolve(Buckets.pow2(minimum=32)) == Capacity(32, (32,), (32,))
  assert resolve(None) == BOUND


def test_output_capacity_overflow_eager():
  with pytest.raises(ValueError, match="op: the output needs tokens 6, more than"):
    _segment.output_capacity(4, bound=BOUND, real=REAL, where="op")
  fixed = Buckets.fixed(tokens=16, sequences=2, time=8)
  with pytest.raises(ValueError, match="more than the fixed capacity 2"):
    _segment.output_capacity(fixed, bound=BOUND, real=REAL, where="op")


def test_output_capacity_overflow_under_jit_is_a_checkify_error():
  def f(tokens):
    real = REAL._replace(tokens=tokens)
    _segment.output_capacity(4, bound=BOUND, real=real, where="op")
    return tokens

  err, _ = checkify.checkify(jax.jit(f))(jnp.int32(6))
  with pytest.raises(checkify.JaxRuntimeError, match="op: the output needs more"):
    err.throw()
  err, _ = checkify.checkify(jax.jit(f))(jnp.int32(4))
  err.throw()


@pytest.mark.parametrize("capacity", [-1, 2.0, "8", True])
def test_output_capacity_rejects_bad_values(capacity):
  error = ValueError if capacity == -1 else TypeError
  with pytest.raises(error, match="`capacity`"):
    _segment.output_capacity(capacity, bound=BOUND, real=REAL, where="op")


def test_build_pads_to_capacity_under_jit():
  x = _x()

  @jax.jit
  def f(x):
    return _segment.build(x.values[:6], [x.lengths()[:3]], 3, Capacity(8, (5,), (4,)))

  out = f(x)
  assert out.capacity == Capacity(8, (5,), (4,))
  assert out.recursive_lengths() == [[2, 0, 4]]
  assert out.values.tolist() == [0, 1, 2, 3, 4, 5, 0, 0]


def test_real_sizes_eager_and_traced():
  x = LoDTensor.from_lengths(
    np.zeros(7), [[2, 1], [3, 0, 4]], buckets=Buckets.pow2(minimum=8)
  )
  assert _segment.real_sizes(x) == Capacity(7, (2, 3), (2, 4))
  sizes = jax.jit(lambda x: jnp.stack(jax.tree.leaves(_segment.real_sizes(x))))(x)
  assert sizes.tolist() == [7, 2, 3, 2, 4]
