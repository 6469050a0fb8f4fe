"""Shared pieces of the sequence ops: argument checks, row-to-sequence maps,
output capacities and the never-truncate checks.

Every ``sequence_*`` op works on static capacities. Rows past the last offset
and sequences past the real count are padding: the helpers here give each row
its sequence and position and say which rows are real, so an op can mask
padding without reading data on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxlod._buckets import Buckets
from jaxlod._lod import Capacity, LoDTensor, is_concrete
from jaxlod.ops._array import owners

# -- argument checks -------------------------------------------------------------


def check_lod(x: Any, name: str, *, levels: Sequence[int] | None = None) -> LoDTensor:
  """`x` must be a LoDTensor, with one of the allowed numbers of levels."""
  if not isinstance(x, LoDTensor):
    raise TypeError(f"Expected `{name}` to be a LoDTensor, got {type(x).__name__}.")
  if levels is not None and x.num_levels not in levels:
    allowed = " or ".join(str(n) for n in levels)
    raise ValueError(
      f"Expected `{name}` to have {allowed} LoD level(s), got {x.num_levels}."
    )
  return x


def check_integer(dtype: Any, name: str) -> None:
  """Integer ops (ids, lengths, indices) reject float and bool arrays."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
    raise TypeError(f"Expected `{name}` to have an integer dtype, got {dtype}.")


def check_float(dtype: Any, name: str) -> None:
  """Float ops (pooling, softmax, convolution) reject integer arrays."""
  if not np.issubdtype(np.dtype(dtype), np.inexact):
    raise TypeError(f"Expected `{name}` to have a float dtype, got {np.dtype(dtype)}.")


def check_rank(shape: Sequence[int], name: str, allowed: Sequence[int], doc: str):
  """`shape` must have one of the `allowed` ranks; `doc` describes the shape."""
  if len(shape) not in allowed:
    raise ValueError(
      f"Expected `{name}` to have shape {doc} (rank "
      f"{' or '.join(str(r) for r in allowed)}), got {tuple(shape)}."
    )


def check_level(x: LoDTensor, level: int, name: str) -> int:
  """A level index of `x` in ``[-num_levels, num_levels)``, made non-negative."""
  if isinstance(level, bool) or not isinstance(level, int | np.integer):
    raise TypeError(f"Expected `{name}` to be an int, got {level!r}.")
  if not -x.num_levels <= level < x.num_levels:
    raise ValueError(
      f"Expected `{name}` in [{-x.num_levels}, {x.num_levels}) (the LoD levels of "
      f"the tensor), got {level}."
    )
  return int(level) % x.num_levels


def per_sequence(
  value: Any, name: str, count_capacity: int, num_sequences: Any, fill: Any = 0
) -> jax.Array:
  """A per-sequence argument with leading dimension `count_capacity`.

  Accepts ``[count_capacity, ...]``, or in eager calls ``[num_sequences,
  ...]`` (the real count), which is padded with `fill` up to the capacity.
  """
  array = jnp.asarray(value)
  if array.ndim == 0:
    raise ValueError(
      f"Expected `{name}` to have leading dimension {count_capacity} (count "
      f"capacity), got a scalar."
    )
  rows = array.shape[0]
  if rows == count_capacity:
    return array
  if is_concrete(num_sequences) and rows == int(num_sequences):
    pad = [(0, count_capacity - rows)] + [(0, 0)] * (array.ndim - 1)
    return jnp.pad(array, pad, constant_values=fill)
  real = f" or {int(num_sequences)} (sequences)" if is_concrete(num_sequences) else ""
  raise ValueError(
    f"Expected `{name}` to have leading dimension {count_capacity} (count "
    f"capacity){real}, got shape {array.shape}."
  )


def static_int(value: Any, name: str, minimum: int | None = None) -> int:
  """A static (Python or NumPy) int argument, at least `minimum`."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(f"Expected `{name}` to be a static int, got {value!r}.")
  if minimum is not None and value < minimum:
    raise ValueError(f"Expected `{name}` >= {minimum}, got {value}.")
  return int(value)


# -- value checks: eager `ValueError`, `checkify` under jit ----------------------


def require(ok: Any, message: str) -> None:
  """Raises `ValueError(message)` eagerly when `ok` is False; under `jit` the
  same check goes through `jax.experimental.checkify` (a no-op unless the
  caller is wrapped in `checkify.checkify`)."""
  if is_concrete(ok):
    if not bool(np.all(np.asarray(ok))):
      raise ValueError(message)
  else:
    checkify.debug_check(jnp.all(ok), message)


def require_each(bad: Any, message: str, **values: Any) -> None:
  """No item of the 1-D mask `bad` may be True.

  `message` is a format string naming the first bad item: ``{i}`` is its
  index and each ``{name}`` of `values` (arrays ``[n]``) its value there.
  Eagerly a `ValueError`; under `jit` a `jax.experimental.checkify` check
  with the same message.
  """
  bad = jnp.asarray(bad)
  if bad.shape[0] == 0:
    return
  if is_concrete(bad, *values.values()):
    hits = np.flatnonzero(np.asarray(bad))
    if hits.size:
      i = int(hits[0])
      fields = {k: np.asarray(v)[i].item() for k, v in values.items()}
      raise ValueError(message.format(i=i, **fields))
    return
  i = jnp.argmax(bad)
  fields = {k: jnp.asarray(v)[i] for k, v in values.items()}
  checkify.debug_check(~jnp.any(bad), message, i=i, **fields)


# -- rows and their sequences -------------------------------------------------------


class Rows(tuple):
  """``(segment, position, valid)`` for every item of one LoD level.

  `segment` ``[items]`` is the sequence of each item in ``[0, count)``,
  `position` its index within that sequence, and `valid` is False for
  padding items past the last offset (whose segment and position are
  meaningless).
  """

  segment = property(lambda self: self[0])
  position = property(lambda self: self[1])
  valid = property(lambda self: self[2])


def rows_of(offsets: jax.Array, items: int) -> Rows:
  """The `Rows` of `items` items described by ``offsets [count + 1]``."""
  index = jnp.arange(items, dtype=jnp.int32)
  count = offsets.shape[0] - 1
  if count == 0:
    zeros = jnp.zeros((items,), jnp.int32)
    return Rows((zeros, zeros, jnp.zeros((items,), bool)))
  segment = owners(offsets, index, count)
  return Rows((segment, index - offsets[segment], index < offsets[-1]))


def rows(x: LoDTensor) -> Rows:
  """The `Rows` of ``x.values``: each row's last-level sequence and position."""
  return rows_of(x.offsets[-1], x.capacity.tokens)


def offsets_from_lengths(lengths: jax.Array) -> jax.Array:
  """``[count] -> [count + 1]`` int32 offsets; jittable."""
  lengths = jnp.asarray(lengths, jnp.int32)
  return jnp.concatenate(
    [jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)]
  )


def masked_segment_sum(data: jax.Array, layout: Rows, count: int) -> jax.Array:
  """Per-sequence sums ``[count, *features]``; padding items add nothing."""
  segment = jnp.where(layout.valid, layout.segment, count)
  return jax.ops.segment_sum(data, segment, num_segments=count)


# -- output capacities ---------------------------------------------------------------


def output_capacity(
  capacity: int | Buckets | None,
  *,
  bound: Capacity,
  real: Capacity,
  where: str,
) -> Capacity:
  """The static capacity of an op's output whose size depends on data.

  Args:
    capacity: `None` gives `bound`, the largest output the inputs' capacities
      allow (the same shapes eagerly and under `jit`); an int sets the token
      capacity (the other sizes keep `bound`); a `Buckets` policy maps each
      real size to a capacity in eager calls, and under `jit` (where sizes
      are not known) gives its fixed sizes (`Buckets.fixed`) or is applied to
      `bound`.
    bound: the static upper bound of every size.
    real: the real sizes, as Python ints (eager) or int32 scalars (jit):
      ``tokens``, ``sequences`` per level and ``time`` (the longest sequence)
      per level.
    where: the op's name, for messages.

  Returns:
    The output capacity. The real sizes are checked against it: eagerly with
    `ValueError`, under `jit` through `jax.experimental.checkify`; data is
    never truncated.
  """
  if capacity is None:
    chosen = bound
  elif isinstance(capacity, Buckets):
    chosen = _bucketed(capacity, bound, real)
  elif isinstance(capacity, int | np.integer) and not isinstance(capacity, bool):
    if capacity < 0:
      raise ValueError(f"{where}: expected `capacity` >= 0, got {capacity}.")
    chosen = bound._replace(tokens=int(capacity))
  else:
    raise TypeError(
      f"{where}: expected `capacity` to be None, an int or a Buckets policy, got "
      f"{capacity!r}."
    )
  check_fits(real, chosen, where)
  return chosen


def _bucketed(policy: Buckets, bound: Capacity, real: Capacity) -> Capacity:
  levels = range(len(bound.sequences))
  concrete = is_concrete(real.tokens, *real.sequences, *real.time)
  if not concrete:
    # Sizes are unknown under jit: a fixed policy names its capacities, any
    # other policy rounds the static bound.
    fixed = policy.policy == "fixed"
    real = Capacity(0, (0,) * len(levels), (0,) * len(levels)) if fixed else bound
  return Capacity(
    tokens=policy.capacity(int(real.tokens), "tokens"),
    sequences=tuple(
      policy.capacity(int(real.sequences[i]), "sequences", i) for i in levels
    ),
    time=tuple(policy.capacity(int(real.time[i]), "time", i) for i in levels),
  )


def check_fits(real: Capacity, capacity: Capacity, where: str) -> None:
  """Every real size is at most its capacity (eager `ValueError` or checkify)."""
  sizes = [("tokens", real.tokens, capacity.tokens)]
  for level, (r, c) in enumerate(zip(real.sequences, capacity.sequences, strict=True)):
    sizes.append((f"sequences at level {level}", r, c))
  for level, (r, c) in enumerate(zip(real.time, capacity.time, strict=True)):
    sizes.append((f"time (longest sequence) at level {level}", r, c))
  for what, size, cap in sizes:
    if is_concrete(size):
      if int(size) > cap:
        raise ValueError(
          f"{where}: the output needs {what} {int(size)}, more than its capacity "
          f"{cap}; data is never truncated. Pass a larger `capacity`."
        )
    else:
      checkify.debug_check(
        size <= cap,
        f"{where}: the output needs more {what} than its capacity {cap}; pass a "
        "larger `capacity`.",
      )


def real_sizes(x: LoDTensor) -> Capacity:
  """The real sizes of `x`: Python ints eagerly, int32 scalars under jit."""

  def host(value):
    return int(value) if is_concrete(value) else value

  levels = range(x.num_levels)
  return Capacity(
    tokens=total(x.lengths()),
    sequences=tuple(host(x.num_sequences(level)) for level in levels),
    time=tuple(longest(x.lengths(level)) for level in levels),
  )


def longest(lengths: jax.Array) -> Any:
  """The longest of `lengths`: a Python int eagerly, an int32 scalar under jit."""
  if is_concrete(lengths):
    return int(np.max(np.asarray(lengths), initial=0))
  return jnp.max(lengths, initial=0)


def total(lengths: jax.Array) -> Any:
  """The sum of `lengths`: a Python int eagerly, an int32 scalar under jit."""
  if is_concrete(lengths):
    return int(np.sum(np.asarray(lengths)))
  return jnp.sum(lengths)


def build(
  values: jax.Array,
  lengths: Sequence[jax.Array],
  num_outer: Any,
  capacity: Capacity,
) -> LoDTensor:
  """A LoDTensor from per-level lengths, padded to `capacity`. Jittable.

  Args:
    values: ``[tokens, *features]`` rows; cut or zero-padded to
      ``capacity.tokens`` (rows past the real total must be padding).
    lengths: per level, int ``[count_l]`` lengths (zeros for padding
      sequences), cut or zero-padded to ``capacity.sequences[l]``.
    num_outer: the real number of level-0 sequences.
    capacity: the output's static capacities.
  """
  offsets = []
  for level, lens in enumerate(lengths):
    lens = jnp.asarray(lens, jnp.int32)
    count = capacity.sequences[level]
    lens = (
      lens[:count]
      if lens.shape[0] >= count
      else jnp.pad(lens, (0, count - lens.shape[0]))
    )
    offsets.append(offsets_from_lengths(lens))
  tokens = capacity.tokens
  if values.shape[0] >= tokens:
    values = values[:tokens]
  else:
    values = jnp.pad(
      values, [(0, tokens - values.shape[0])] + [(0, 0)] * (values.ndim - 1)
    )
  return LoDTensor(values, offsets, jnp.asarray(num_outer, jnp.int32), capacity.time)
