"""Tests of `Buckets` capacity policies and of compile counts under them."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod import Buckets, LoDTensor
from jaxlod.ops import lod_to_array, rank_table

# -- capacities -------------------------------------------------------------------


@pytest.mark.parametrize(
  ("size", "expected"),
  [(0, 0), (1, 1), (7, 7), (100, 100)],
)
def test_exact_capacity_is_size(size, expected):
  for kind in ("tokens", "sequences", "time"):
    assert Buckets.exact().capacity(size, kind) == expected


@pytest.mark.parametrize(
  ("minimum", "size", "expected"),
  [
    (8, 0, 8),
    (8, 1, 8),
    (8, 8, 8),
    (8, 9, 16),
    (8, 16, 16),
    (8, 17, 32),
    (8, 1000, 1024),
    (1, 0, 1),
    (1, 1, 1),
    (1, 2, 2),
    (1, 3, 4),
    (1, 5, 8),
    (10, 3, 10),
    (10, 11, 16),
  ],
)
def test_pow2_capacity(minimum, size, expected):
  assert Buckets.pow2(minimum=minimum).capacity(size) == expected


def test_pow2_default_minimum_is_8():
  assert Buckets.pow2() == Buckets.pow2(minimum=8)
  assert Buckets.pow2().capacity(3, "time") == 8


@pytest.mark.parametrize(
  ("ratio", "multiple", "size", "expected"),
  [
    (1.25, 8, 0, 8),
    (1.25, 8, 8, 8),
    (1.25, 8, 9, 16),
    (1.25, 8, 17, 24),
    (1.25, 8, 20, 24),
    (1.25, 8, 25, 32),
    (1.25, 8, 33, 40),
    (1.25, 8, 41, 56),
    (1.25, 8, 57, 72),
    (2.0, 1, 5, 8),
    (2.0, 1, 1, 1),
    (1.5, 4, 5, 8),
    (1.5, 4, 13, 20),
  ],
)
def test_geometric_capacity(ratio, multiple, size, expected):
  policy = Buckets.geometric(ratio=ratio, multiple=multiple)
  assert policy.capacity(size) == expected


@pytest.mark.parametrize(
  ("ratio", "multiple"), [(1.25, 8), (1.1, 8), (2.0, 1), (3.0, 5)]
)
def test_geometric_capacities_are_multiples_and_grow_by_ratio(ratio, multiple):
  policy = Buckets.geometric(ratio=ratio, multiple=multiple)
  capacities = sorted({policy.capacity(size) for size in range(0, 2000)})
  assert capacities[0] == multiple
  for small, large in zip(capacities, capacities[1:], strict=False):
    assert large % multiple == 0
    assert large >= small * ratio
    # No capacity is skipped: the one just above `small` is `small`'s successor.
    assert policy.capacity(small + 1) == large


def test_geometric_defaults():
  assert Buckets.geometric() == Buckets.geometric(ratio=1.25, multiple=8)


@pytest.mark.parametrize(
  ("size", "expected"),
  [(0, 16), (16, 16), (17, 64), (64, 64), (65, 256), (256, 256)],
)
def test_explicit_capacity(size, expected):
  policy = Buckets.explicit([16, 64, 256])
  for kind in ("tokens", "sequences", "time"):
    assert policy.capacity(size, kind) == expected


def test_explicit_per_kind():
  policy = Buckets.explicit({"tokens": [32, 64], "sequences": [4, 8], "time": [10]})
  assert policy.capacity(33, "tokens") == 64
  assert policy.capacity(5, "sequences") == 8
  assert policy.capacity(3, "time") == 10
  assert policy.capacity(0, "tokens") == 32


def test_fixed_capacity_per_kind_and_level():
  policy = Buckets.fixed(tokens=512, sequences=(4, 32), time=(8, 64))
  assert policy.capacity(20, "tokens") == 512
  assert policy.capacity(3, "sequences", level=0) == 4
  assert policy.capacity(3, "sequences", level=1) == 32
  assert policy.capacity(0, "time", level=0) == 8
  assert policy.capacity(64, "time", level=1) == 64


def test_fixed_single_int_applies_to_every_level():
  policy = Buckets.fixed(tokens=16, sequences=4, time=6)
  for level in range(3):
    assert policy.capacity(1, "sequences", level) == 4
    assert policy.capacity(6, "time", level) == 6


def test_policies_are_hashable_and_compare_by_value():
  policies = [
    Buckets.exact(),
    Buckets.pow2(minimum=4),
    Buckets.geometric(ratio=1.5, multiple=4),
    Buckets.explicit([8, 16]),
    Buckets.explicit({"tokens": [8], "time": [4, 8]}),
    Buckets.fixed(tokens=8, sequences=(2, 4), time=3),
  ]
  for policy in policies:
    assert hash(policy) == hash(type(policy)(policy.policy, policy.params))
  assert Buckets.explicit([8, 16]) == Buckets.explicit((8, 16))
  assert Buckets.pow2(minimum=4) != Buckets.pow2(minimum=8)
  assert len(set(policies)) == len(policies)


def test_policy_is_a_static_jit_argument():
  zeros = jax.jit(lambda policy: jnp.zeros(policy.capacity(5)), static_argnums=0)
  assert zeros(Buckets.pow2(minimum=4)).shape == (8,)
  assert zeros(Buckets.explicit([6])).shape == (6,)
  assert zeros(Buckets.pow2(minimum=4)).shape == (8,)  # an equal policy: cache hit
  assert zeros._cache_size() == 2


# -- errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("build", "error", "match"),
  [
    (lambda: Buckets.pow2(minimum=0), ValueError, r"Expected `minimum` >= 1, got 0\."),
    (lambda: Buckets.pow2(minimum=8.0), TypeError, r"`minimum` to be an int, got 8\.0"),
    (
      lambda: Buckets.pow2(minimum=True),
      TypeError,
      r"`minimum` to be an int, got True",
    ),
    (
      lambda: Buckets.geometric(ratio=1.0),
      ValueError,
      r"Expected a finite `ratio` > 1, got 1\.0\.",
    ),
    (
      lambda: Buckets.geometric(ratio=float("nan")),
      ValueError,
      r"Expected a finite `ratio` > 1, got nan\.",
    ),
    (
      lambda: Buckets.geometric(ratio=float("inf")),
      ValueError,
      r"Expected a finite `ratio` > 1, got inf\.",
    ),
    (
      lambda: Buckets.geometric(multiple=0),
      ValueError,
      r"Expected `multiple` >= 1, got 0\.",
    ),
    (
      lambda: Buckets.geometric(multiple=2.5),
      TypeError,
      r"Expected `multiple` to be an int, got 2\.5\.",
    ),
    (
      lambda: Buckets.explicit([]),
      ValueError,
      r"Expected `boundaries` to be non-empty\.",
    ),
    (
      lambda: Buckets.explicit([8, 8]),
      ValueError,
      r"`boundaries` to be strictly ascending, got 8 at index 0 and 8 at index 1\.",
    ),
    (
      lambda: Buckets.explicit([4, 16, 8]),
      ValueError,
      r"`boundaries` to be strictly ascending, got 16 at index 1 and 8 at index 2\.",
    ),
    (
      lambda: Buckets.explicit([-1, 8]),
      ValueError,
      r"Expected `boundaries` >= 0, got -1\.",
    ),
    (
      lambda: Buckets.explicit([8, 16.0]),
      TypeError,
      r"Expected `boundaries\[1\]` to be an int, got 16\.0\.",
    ),
    (
      lambda: Buckets.explicit({"rows": [8]}),
      ValueError,
      r"Expected `kind` to be one of \('tokens', 'sequences', 'time'\), got 'rows'\.",
    ),
    (
      lambda: Buckets.explicit({"time": [8, 4]}),
      ValueError,
      r"Expected `boundaries\['time'\]` to be strictly ascending, got 8 at index 0",
    ),
    (
      lambda: Buckets.fixed(tokens=-1, sequences=4, time=4),
      ValueError,
      r"Expected `tokens` >= 0, got -1\.",
    ),
    (
      lambda: Buckets.fixed(tokens=8, sequences=(4, -2), time=4),
      ValueError,
      r"Expected `sequences` >= 0, got -2\.",
    ),
    (
      lambda: Buckets.fixed(tokens=8, sequences=4, time=()),
      ValueError,
      r"Expected `time` to name at least one level\.",
    ),
    (
      lambda: Buckets.fixed(tokens=8, sequences=(4, 2.0), time=4),
      TypeError,
      r"Expected `sequences\[1\]` to be an int, got 2\.0\.",
    ),
    (
      lambda: Buckets.fixed(tokens=8.0, sequences=4, time=4),
      TypeError,
      r"Expected `tokens` to be an int, got 8\.0\.",
    ),
  ],
)
def test_constructor_errors(build, error, match):
  with pytest.raises(error, match=match):
    build()


@pytest.mark.parametrize(
  ("policy", "args", "match"),
  [
    (Buckets.pow2(), (-1,), r"Expected a size >= 0, got -1\."),
    (
      Buckets.pow2(),
      (3, "rows"),
      r"Expected `kind` to be one of \('tokens', 'sequences', 'time'\), got 'rows'\.",
    ),
    (
      Buckets.explicit([16, 64]),
      (65, "time"),
      r"time size 65 exceeds the largest explicit boundary 64\.",
    ),
    (
      Buckets.explicit({"tokens": [16]}),
      (3, "time"),
      r"Explicit buckets name no boundaries for 'time'\.",
    ),
    (
      Buckets.fixed(tokens=8, sequences=4, time=4),
      (9, "tokens"),
      r"Batch tokens size is 9, more than the fixed capacity 8; data is never "
      r"truncated\.",
    ),
    (
      Buckets.fixed(tokens=8, sequences=(4, 6), time=4),
      (7, "sequences", 1),
      r"Batch sequences size at level 1 is 7, more than the fixed capacity 6;",
    ),
    (
      Buckets.fixed(tokens=8, sequences=4, time=(4, 3)),
      (5, "time", 0),
      r"Batch time size at level 0 is 5, more than the fixed capacity 4;",
    ),
    (
      Buckets.fixed(tokens=8, sequences=(4, 6), time=4),
      (1, "sequences", 2),
      r"Fixed sequences capacities name 2 levels, got level 2\.",
    ),
  ],
)
def test_capacity_errors(policy, args, match):
  with pytest.raises(ValueError, match=match):
    policy.capacity(*args)


@pytest.mark.parametrize(
  ("buckets", "lengths", "match"),
  [
    (
      Buckets.fixed(tokens=4, sequences=4, time=4),
      [[3, 2]],
      r"Batch tokens size is 5, more than the fixed capacity 4",
    ),
    (
      Buckets.fixed(tokens=8, sequences=2, time=4),
      [[1, 1, 1]],
      r"Batch sequences size at level 0 is 3, more than the fixed capacity 2",
    ),
    (
      Buckets.fixed(tokens=8, sequences=4, time=2),
      [[3]],
      r"Batch time size at level 0 is 3, more than the fixed capacity 2",
    ),
    (
      Buckets.fixed(tokens=16, sequences=(4, 2), time=4),
      [[3], [1, 1, 1]],
      r"Batch sequences size at level 1 is 3, more than the fixed capacity 2",
    ),
    (
      Buckets.explicit([2, 4]),
      [[5]],
      r"tokens size 5 exceeds the largest explicit boundary 4\.",
    ),
  ],
)
def test_construction_never_truncates(buckets, lengths, match):
  values = np.zeros(sum(lengths[-1]), np.float32)
  with pytest.raises(ValueError, match=match):
    LoDTensor.from_lengths(values, lengths, buckets=buckets)


def test_buckets_argument_type_error():
  with pytest.raises(TypeError, match=r"Expected `buckets` to be a Buckets or None"):
    LoDTensor.from_lengths(np.zeros(2), [[2]], buckets="pow2")


# -- compile counts -------------------------------------------------------------


def _random_batches(count: int, seed: int = 0):
  """`count` seeded one-level batches: 1-20 sequences of 0-12 rows, 3 features."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(count):
    lengths = rng.integers(0, 13, size=int(rng.integers(1, 21)))
    values = rng.normal(size=(int(lengths.sum()), 3)).astype(np.float32)
    batches.append((values, [lengths.tolist()]))
  return batches


BATCHES = _random_batches(50)


def _counting_fn():
  traces = []

  @jax.jit
  def fn(x):
    traces.append(x.capacity)
    return jnp.sum(lod_to_array(x, rank_table(x)))

  return fn, traces


@pytest.mark.parametrize(
  "buckets",
  [
    Buckets.fixed(tokens=256, sequences=32, time=16),
    Buckets.pow2(minimum=8),
    Buckets.geometric(ratio=1.25, multiple=8),
    Buckets.explicit(
      {"tokens": [64, 128, 256], "sequences": [8, 16, 32], "time": [16]}
    ),
  ],
  ids=["fixed", "pow2", "geometric", "explicit"],
)
def test_compiles_at_most_once_per_capacity(buckets):
  fn, traces = _counting_fn()
  capacities = set()
  for values, lengths in BATCHES:
    x = LoDTensor.from_lengths(values, lengths, buckets=buckets)
    capacities.add(x.capacity)
    np.testing.assert_allclose(float(fn(x)), values.sum(), rtol=1e-4, atol=1e-4)
  assert len(traces) == len(capacities)
  assert len(set(traces)) == len(traces)
  assert fn._cache_size() == len(capacities)
  if buckets.policy == "fixed":
    assert len(traces) == 1
  else:
    # The batches span several buckets, and far fewer than one per batch.
    assert 1 < len(capacities) <= 16


def test_exact_buckets_recompile_per_size():
  # The control for the counters above: new sizes must show up as new compiles.
  fn, traces = _counting_fn()
  for values, lengths in BATCHES[:3]:
    fn(LoDTensor.from_lengths(values, lengths))
  assert len(traces) == 3
  assert fn._cache_size() == 3
  values, lengths = BATCHES[0]
  fn(LoDTensor.from_lengths(values + 1.0, lengths))
  assert len(traces) == 3


# -- every capacity fits int32 (offsets and lengths are int32) ----------------------

INT32_MAX = 2**31 - 1


@pytest.mark.parametrize(
  ("build", "name"),
  [
    (lambda n: Buckets.pow2(minimum=n), "minimum"),
    (lambda n: Buckets.geometric(multiple=n), "multiple"),
    (lambda n: Buckets.fixed(tokens=n, sequences=4, time=4), "tokens"),
    (lambda n: Buckets.fixed(tokens=8, sequences=n, time=4), "sequences"),
    (lambda n: Buckets.fixed(tokens=8, sequences=4, time=(4, n)), "time"),
    (lambda n: Buckets.explicit([4, n]), "boundaries"),
    (lambda n: Buckets.explicit({"time": [n]}), "boundaries['time']"),
    (lambda n: Buckets("pow2", (n,)), "minimum"),
    (lambda n: Buckets("fixed", (8, (n,), (4,))), "sequences"),
  ],
)
@settings(max_examples=10, deadline=None)
@given(n=st.integers(INT32_MAX + 1, 2**80))
def test_a_capacity_over_int32_raises_at_construction(build, name, n):
  with pytest.raises(ValueError, match=rf"Expected `{re.escape(name)}` <= {INT32_MAX}"):
    build(n)
  build(INT32_MAX)  # the largest capacity is fine


@settings(max_examples=50, deadline=None)
@given(
  buckets=st.sampled_from(
    [Buckets.exact(), Buckets.pow2(), Buckets.geometric(), Buckets.pow2(2**30)]
  ),
  size=st.integers(0, 2**40),
)
def test_capacity_is_within_int32_or_raises(buckets, size):
  try:
    capacity = buckets.capacity(size)
  except ValueError as error:
    assert size > 2**30 and f"more than {INT32_MAX}" in str(error)
  else:
    assert size <= capacity <= INT32_MAX


@pytest.mark.parametrize(
  ("policy", "params", "error", "match"),
  [
    ("pow2", ("x",), TypeError, r"Expected `minimum` to be an int, got 'x'\."),
    ("pow2", (0,), ValueError, r"Expected `minimum` >= 1, got 0\."),
    ("pow2", (), ValueError, r"`params` of policy 'pow2' to be \(minimum,\), got \(\)"),
    ("exact", (8,), ValueError, r"`params` of policy 'exact' to be \(\), got \(8,\)"),
    ("geometric", (1.0, 8), ValueError, r"Expected a finite `ratio` > 1, got 1\.0\."),
    ("geometric", (2.0, "8"), TypeError, r"Expected `multiple` to be an int"),
    ("explicit", ((8,),), ValueError, r"\(kind, boundaries\) pairs, got \(8,\)"),
    ("explicit", (("rows", (8,)),), ValueError, r"`kind` to be one of"),
    ("fixed", (8, 4), ValueError, r"\(tokens, sequences, time\), got \(8, 4\)"),
    ("fixed", (8, (-1,), (4,)), ValueError, r"Expected `sequences` >= 0, got -1\."),
  ],
)
def test_direct_construction_checks_the_params(policy, params, error, match):
  with pytest.raises(error, match=match):
    Buckets(policy, params)


def test_direct_construction_equals_the_constructor():
  assert Buckets("fixed", (8, 4, 4)) == Buckets.fixed(tokens=8, sequences=4, time=4)
  assert Buckets("pow2", (np.int64(4),)) == Buckets.pow2(4)
  big = Buckets.fixed(tokens=8, sequences=4, time=2**31 - 1)
  x = LoDTensor.from_lengths(np.ones(3), [[3]], buckets=big)
  assert x.time_capacity == (2**31 - 1,)
