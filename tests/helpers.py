"""Shared test helpers: tolerances, LoD strategies, NumPy references."""

from __future__ import annotations

import ast
import pathlib

import flax.linen as nn
import hypothesis.strategies as st
import jax
import numpy as np
from flax import nnx

from jaxlod import Buckets, LoDTensor
from jaxlod._lod_checks import check_stored_lod


def _public_modules() -> list[str]:
  """docs/conf.py's `PUBLIC_MODULES`, the modules whose `__all__` is
  jaxlod's public API (read, not imported: importing conf.py sets up Sphinx)."""
  tree = ast.parse((pathlib.Path(__file__).parent.parent / "docs/conf.py").read_text())
  (value,) = [
    node.value
    for node in tree.body
    if isinstance(node, ast.Assign)
    and any(getattr(t, "id", None) == "PUBLIC_MODULES" for t in node.targets)
  ]
  return ast.literal_eval(value)


PUBLIC_MODULES = _public_modules()

# float32 tolerances of the house style; the one place to loosen them.
RTOL = 1e-5
ATOL = 1e-6


def assert_close(actual, expected, *, rtol: float = RTOL, atol: float = ATOL):
  """Leaf-wise `assert_allclose` of two pytrees with the suite's tolerances."""
  actual_leaves, actual_def = jax.tree.flatten(actual)
  expected_leaves, expected_def = jax.tree.flatten(expected)
  assert actual_def == expected_def, (actual_def, expected_def)
  for a, e in zip(actual_leaves, expected_leaves, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def assert_lod_equal(actual: LoDTensor, expected: LoDTensor) -> None:
  """Exact equality of values, offsets, real count and static capacities."""
  assert isinstance(actual, LoDTensor)
  assert actual.capacity == expected.capacity
  np.testing.assert_array_equal(np.asarray(actual.values), np.asarray(expected.values))
  assert len(actual.offsets) == len(expected.offsets)
  for a, e in zip(actual.offsets, expected.offsets, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  assert int(actual.num_outer) == int(expected.num_outer)


def assert_nested_equal(actual, expected) -> None:
  """Equality of the nested lists of arrays returned by `LoDTensor.to_list`."""
  if isinstance(expected, list):
    assert isinstance(actual, list), type(actual)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
      assert_nested_equal(a, e)
  else:
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))
    assert np.shape(actual) == np.shape(expected)


# -- LoD strategies with fixed capacities (one jit compile per test) ------------

FEATURES = 2

# One level: up to 6 sequences of up to 5 rows (<= 30 rows).
ONE_LEVEL = Buckets.fixed(tokens=32, sequences=8, time=6)
# Two levels: up to 4 outer sequences of up to 3 sub-sequences of up to 4 rows.
TWO_LEVEL = Buckets.fixed(tokens=48, sequences=(6, 12), time=(4, 5))


@st.composite
def recursive_lengths(draw, num_levels: int | None = None):
  """Paddle length-based LoD with 1 or 2 levels; zero lengths at every level."""
  if num_levels is None:
    num_levels = draw(st.sampled_from([1, 2]))
  if num_levels == 1:
    return [draw(st.lists(st.integers(0, 5), max_size=6))]
  outer = draw(st.lists(st.integers(0, 3), max_size=4))
  inner = draw(st.lists(st.integers(0, 4), min_size=sum(outer), max_size=sum(outer)))
  return [outer, inner]


@st.composite
def lod_tensors(draw, num_levels: int | None = None, buckets: Buckets | None = None):
  """A float32 LoDTensor ``[rows, FEATURES]`` on the fixed capacities above."""
  lengths = draw(recursive_lengths(num_levels))
  seed = draw(st.integers(0, 2**31 - 1))
  rows = sum(lengths[-1])
  values = np.random.default_rng(seed).normal(size=(rows, FEATURES))
  if buckets is None:
    buckets = ONE_LEVEL if len(lengths) == 1 else TWO_LEVEL
  return LoDTensor.from_lengths(values.astype(np.float32), lengths, buckets=buckets)


@st.composite
def lod_tensors_with_slack(draw):
  """A LoDTensor on randomly drawn fixed capacities above the data's sizes.

  Each capacity is the largest size the strategy draws, or 2 more: few
  distinct capacities, so few jit compiles.
  """
  lengths = draw(recursive_lengths())
  slack = st.sampled_from([0, 2])
  tokens, sequences, time = (
    (30, [6], [5]) if len(lengths) == 1 else (48, [4, 12], [3, 4])
  )
  extra_tokens, extra_sequences, extra_time = draw(st.tuples(slack, slack, slack))
  buckets = Buckets.fixed(
    tokens=tokens + extra_tokens,
    sequences=[s + extra_sequences for s in sequences],
    time=[t + extra_time for t in time],
  )
  seed = draw(st.integers(0, 2**31 - 1))
  values = np.random.default_rng(seed).normal(size=(sum(lengths[-1]), FEATURES))
  return LoDTensor.from_lengths(values.astype(np.float32), lengths, buckets=buckets)


def buffer_reference(x: LoDTensor, order) -> np.ndarray:
  """NumPy reference of `lod_to_array`: ``[time, count, *features]`` buffer."""
  offsets = np.asarray(x.offsets[-1])
  values = np.asarray(x.values)
  count = offsets.size - 1
  out = np.zeros((x.time_capacity[-1], count, *values.shape[1:]), values.dtype)
  for rank, i in enumerate(np.asarray(order)):
    rows = values[offsets[i] : offsets[i + 1]]
    out[: rows.shape[0], rank] = rows
  return out


# -- named cases (fixed LoDs with zero-length sequences) ------------------------

CASES = {
  # name: (recursive lengths, feature shape, buckets)
  "one-level": ([[3, 0, 2, 4]], (2,), Buckets.fixed(tokens=12, sequences=6, time=5)),
  "scalar-rows": ([[1, 4, 0, 2]], (), None),
  "two-level": (
    [[2, 0, 3], [1, 3, 0, 2, 2]],
    (2,),
    Buckets.fixed(tokens=12, sequences=(4, 7), time=(4, 5)),
  ),
  "features-2d": ([[2, 3]], (2, 2), Buckets.fixed(tokens=6, sequences=3, time=4)),
}


def make_case(lengths, features, buckets, dtype=np.float32, seed: int = 0) -> LoDTensor:
  """A LoDTensor of normal random rows ``[rows, *features]`` with this LoD."""
  rng = np.random.default_rng(seed)
  values = rng.normal(size=(sum(lengths[-1]), *features)).astype(dtype)
  return LoDTensor.from_lengths(values, lengths, buckets=buckets)


def last_level(x: LoDTensor) -> list[np.ndarray]:
  """The real sequences of the last level, in order (host)."""
  offsets = np.asarray(x.offsets[-1])[: int(x.num_sequences(-1)) + 1]
  values = np.asarray(x.values)
  return [values[offsets[i] : offsets[i + 1]] for i in range(offsets.size - 1)]


def assert_valid(x: LoDTensor) -> None:
  """The LoD invariants (DESIGN.md), faults or not: those of
  `LoDTensor.validate`, and zeros in the rows past the last offset."""
  check_stored_lod(x)
  real = int(np.asarray(x.offsets[-1])[-1])
  assert not np.any(np.asarray(x.values)[real:]), np.asarray(x.values)[real:]


# Flax's recurrent cells by name (flax 0.12.8 has no nnx.MGUCell).
LINEN_CELLS = {
  "LSTMCell": nn.LSTMCell,
  "OptimizedLSTMCell": nn.OptimizedLSTMCell,
  "GRUCell": nn.GRUCell,
  "SimpleCell": nn.SimpleCell,
  "MGUCell": nn.MGUCell,
}
NNX_CELLS = {
  "LSTMCell": nnx.LSTMCell,
  "OptimizedLSTMCell": nnx.OptimizedLSTMCell,
  "GRUCell": nnx.GRUCell,
  "SimpleCell": nnx.SimpleCell,
}
