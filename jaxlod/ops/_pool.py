"""Pooling and softmax within sequences: Paddle's sequence_pool family.

Both work over the last LoD level. Padding rows and padding sequences take
part in no reduction: every reduction masks them, so empty sequences give a
pad value (pooling) or nothing (softmax), never NaN, in values and gradients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlod._checks import check_float, is_float_dtype
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import check_pad_value
from jaxlod.ops._segment import Rows, masked_segment_sum, rows


def _extreme(x: LoDTensor, layout: Rows, largest: bool) -> jax.Array:
  """Per-sequence max or min, its gradient going to the first extreme row.

  Returns ``[count, features]`` (features flattened); empty sequences hold
  the reduction's identity, which the caller replaces.
  """
  tokens, count = x.capacity.tokens, x.capacity.sequences[-1]
  flat = x.values.reshape(tokens, int(np.prod(x.feature_shape)))
  segment = x.segment_ids()
  reduce = jax.ops.segment_max if largest else jax.ops.segment_min
  best = reduce(lax.stop_gradient(flat), segment, num_segments=count)
  hit = layout.valid[:, None] & (flat == best[layout.segment])
  row = jnp.arange(tokens, dtype=jnp.int32)[:, None]
  first = jax.ops.segment_min(jnp.where(hit, row, tokens), segment, count)
  picked = jnp.take_along_axis(flat, jnp.clip(first, 0, tokens - 1), axis=0)
  # No hit in a non-empty sequence only happens for NaN: keep the reduction.
  return jnp.where(first < tokens, picked, best)


def _pooled(x: LoDTensor, pool: str) -> jax.Array:
  """``[count, *features]`` pooled rows; empty sequences hold anything finite
  or the reduction's identity (the caller masks them)."""
  count = x.capacity.sequences[-1]
  lengths = x.lengths()
  if pool in ("first", "last"):
    offsets = x.offsets[-1]
    index = offsets[:-1] if pool == "first" else offsets[1:] - 1
    index = jnp.clip(index, 0, x.capacity.tokens - 1)
    return jnp.take(x.values, index, axis=0)
  layout = rows(x)
  if pool in ("max", "min"):
    best = _extreme(x, layout, largest=pool == "max")
    return best.reshape(count, *x.feature_shape)
  total = masked_segment_sum(x.values, layout, count)
  if pool == "sum":
    return total
  size = jnp.maximum(lengths, 1).astype(x.values.dtype)
  size = size if pool == "average" else jnp.sqrt(size)
  return total / size.reshape((count,) + (1,) * len(x.feature_shape))


def sequence_pool(
  x: LoDTensor, pool_type: str, pad_value: jax.typing.ArrayLike = 0.0
) -> jax.Array | LoDTensor:
  """Pools the rows of each last-level sequence into one row.

  Paddle's ``sequence_pool``. ``sqrt`` is the sum divided by the square root
  of the length. ``max`` and ``min`` send the gradient to the first row that
  holds the extreme value, per feature (Paddle keeps that index). Empty
  sequences give `pad_value` and a zero gradient, never NaN.

  Args:
    x: a LoDTensor with ``values [token_capacity, *features]``, float for
      every pool type except ``first`` and ``last`` (any dtype).
    pool_type: ``"sum"``, ``"average"``, ``"sqrt"``, ``"max"``, ``"min"``,
      ``"first"`` or ``"last"``; case-insensitive.
    pad_value: the row of empty sequences: a scalar or an array that
      broadcasts to ``[*features]``. Integer (and bool) values must hold it
      exactly.

  Returns:
    For a one-level `x`, an array ``[count_capacity, *features]``, one row
    per sequence slot (padding slots hold `pad_value` too). For an `x` with
    more levels, a LoDTensor whose LoD is `x`'s upper levels and whose rows
    ``[last-level count capacity, *features]`` are the pooled sequences;
    rows past the real number of last-level sequences are zeros.

  Raises:
    TypeError: if `x` is not a LoDTensor, `pool_type` is not a str, or the
      pool type needs float values.
    ValueError: for an unknown `pool_type`, a `pad_value` of the wrong
      shape, or one that integer values cannot hold (a fraction, NaN, out of
      range).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_pool
    >>> x = LoDTensor.from_lengths(np.array([1.0, 3.0, 2.0, 5.0]), [[3, 0, 1]])
    >>> sequence_pool(x, "max", pad_value=-1.0).tolist()
    [3.0, -1.0, 5.0]
    >>> sequence_pool(x, "average").tolist()
    [2.0, 0.0, 5.0]
  """
  return pool_rows(check_lod(x, "x"), pool_type, pad_value)


def pool_rows(
  x: LoDTensor, pool_type: str, pad_value: jax.typing.ArrayLike = 0.0
) -> jax.Array | LoDTensor:
  """`sequence_pool` of an `x` that `check_lod` has checked (for callers that
  hold a checked tensor); `pool_type` and `pad_value` are checked here."""
  pool = check_pool_type(pool_type)
  check_pool_dtype(x.values.dtype, pool)
  pad = check_pad_value(pad_value, x)
  count = x.capacity.sequences[-1]
  if x.capacity.tokens == 0 or count == 0:
    pooled = jnp.broadcast_to(pad, (count, *x.feature_shape))
  else:
    empty = x.lengths() == 0
    empty = empty.reshape((count,) + (1,) * len(x.feature_shape))
    pooled = jnp.where(empty, pad, _pooled(x, pool))
  if x.num_levels == 1:
    return pooled
  real = jnp.arange(count) < x.num_sequences(-1)
  real = real.reshape((count,) + (1,) * len(x.feature_shape))
  values = jnp.where(real, pooled, jnp.zeros((), pooled.dtype))
  return LoDTensor(values, x.offsets[:-1], x.num_outer, x.time_capacity[:-1], x.faults)


def sequence_first_step(x: LoDTensor) -> jax.Array | LoDTensor:
  """The first row of each last-level sequence: ``sequence_pool(x, "first")``.

  Args:
    x: a LoDTensor with ``values [token_capacity, *features]`` of any dtype.

  Returns:
    As `sequence_pool`: ``[count_capacity, *features]`` for a one-level `x`
    (zeros for empty sequences), a LoDTensor of `x`'s upper levels otherwise.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_first_step
    >>> x = LoDTensor.from_lengths(np.array([1, 3, 2, 5]), [[3, 0, 1]])
    >>> sequence_first_step(x).tolist()
    [1, 0, 5]
  """
  return sequence_pool(x, "first")


def sequence_last_step(x: LoDTensor) -> jax.Array | LoDTensor:
  """The last row of each last-level sequence: ``sequence_pool(x, "last")``,
  with the arguments and results of `sequence_first_step`.

  Example:
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_last_step
    >>> sequence_last_step(LoDTensor.from_lengths([1, 3, 2, 5], [[3, 0, 1]])).tolist()
    [2, 0, 5]
  """
  return sequence_pool(x, "last")


def _check_softmax_shape(shape: tuple[int, ...]) -> None:
  if len(shape) not in (1, 2) or shape[1:] not in ((), (1,)):
    raise ValueError(
      f"Expected `x.values` to have shape [rows] or [rows, 1], got {tuple(shape)}."
    )


def sequence_softmax(x: LoDTensor) -> LoDTensor:
  """Softmax over the rows of each last-level sequence.

  Paddle's ``sequence_softmax``. Numerically stable (each sequence's maximum
  is subtracted first). Padding rows stay zeros; empty and padding
  sequences produce no NaN or inf, in values or gradients.

  Args:
    x: a LoDTensor with float ``values [token_capacity]`` or
      ``[token_capacity, 1]``.

  Returns:
    A LoDTensor with `x`'s LoD; within each sequence the values sum to 1.

  Raises:
    TypeError: if `x` is not a LoDTensor or its values are not float.
    ValueError: for values of another shape.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_softmax
    >>> x = LoDTensor.from_lengths(np.log(np.array([1.0, 3.0, 2.0])), [[2, 0, 1]])
    >>> sequence_softmax(x).values.round(4).tolist()
    [0.25, 0.75, 1.0]
  """
  x = check_lod(x, "x")
  check_float(x.values.dtype, "x.values")
  shape = x.values.shape
  _check_softmax_shape(shape)
  count = x.capacity.sequences[-1]
  if count == 0 or shape[0] == 0:
    return x.with_values(jnp.zeros_like(x.values))
  layout = rows(x)
  flat = x.values.reshape(-1)
  segment = x.segment_ids()
  top = jax.ops.segment_max(lax.stop_gradient(flat), segment, num_segments=count)
  top = jnp.where(jnp.isfinite(top), top, 0)
  shifted = jnp.where(layout.valid, flat - top[layout.segment], 0)
  exp = jnp.where(layout.valid, jnp.exp(shifted), 0)
  total = jax.ops.segment_sum(exp, segment, num_segments=count)
  out = exp / jnp.where(layout.valid, total[layout.segment], 1)
  return x.with_values(out.reshape(shape))


# -- pool types ------------------------------------------------------------------


POOL_TYPES = ("sum", "average", "sqrt", "max", "min", "first", "last")


def check_pool_type(pool_type: str) -> str:
  """One of `POOL_TYPES`, lower-cased (the argument is case-insensitive)."""
  if not isinstance(pool_type, str):
    raise TypeError(f"Expected `pool_type` to be a str, got {pool_type!r}.")
  pool = pool_type.lower()
  if pool not in POOL_TYPES:
    allowed = ", ".join(repr(p) for p in POOL_TYPES)
    raise ValueError(
      f"Expected `pool_type` to be one of {allowed} (case-insensitive), got "
      f"{pool_type!r}."
    )
  return pool


def check_pool_dtype(dtype: Any, pool: str) -> None:
  """Every pool type but ``first`` and ``last`` needs float values."""
  if pool in ("first", "last") or is_float_dtype(dtype):
    return
  raise TypeError(
    f"Expected `x.values` to have a float dtype for pool_type {pool!r}, got "
    f"{np.dtype(dtype)}; only 'first' and 'last' accept any dtype."
  )
