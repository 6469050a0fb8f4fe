"""Shared pieces of the sequence ops: row-to-sequence maps, output capacities
and building results (their argument checks live in `jaxlod._checks`).

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

from jaxlod._buckets import Buckets, Capacity, check_fits
from jaxlod._checks import INT32, is_concrete, static_int, where_rows
from jaxlod._faults import Fault, fault_unless
from jaxlod._lod import LoDTensor, owners

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
  chosen = chosen_capacity(capacity, bound=bound, real=real, where=where)
  check_fits(real, chosen, where)
  return chosen


def chosen_capacity(
  capacity: int | Buckets | None,
  *,
  bound: Capacity,
  real: Capacity,
  where: str,
) -> Capacity:
  """`output_capacity` without the check of the real sizes, for a caller
  that makes an overflow loud itself (`build` records `Fault.CAPACITY`)."""
  if capacity is None:
    chosen = bound
  elif isinstance(capacity, Buckets):
    chosen = _bucketed(capacity, bound, real)
  elif isinstance(capacity, int | np.integer) and not isinstance(capacity, bool):
    if capacity < 0:
      raise ValueError(f"{where}: expected `capacity` >= 0, got {capacity}.")
    chosen = bound._replace(tokens=static_int(capacity, "capacity", minimum=0))
  else:
    raise TypeError(
      f"{where}: expected `capacity` to be None, an int or a Buckets policy, got "
      f"{capacity!r}."
    )
  _check_int32(chosen, where)
  return chosen


def _check_int32(capacity: Capacity, where: str) -> None:
  """Every size of an output capacity fits int32, the dtype of device shapes
  and offsets (a `Buckets` policy or the bound of large inputs may not)."""
  sizes = [("token", capacity.tokens)]
  sizes += [(f"level-{i} count", n) for i, n in enumerate(capacity.sequences)]
  sizes += [(f"level-{i} time", n) for i, n in enumerate(capacity.time)]
  for what, size in sizes:
    if size > INT32.max:
      raise ValueError(
        f"{where}: the output's {what} capacity {size} does not fit int32 (the "
        f"dtype of its shapes and offsets); pass a smaller `capacity`."
      )


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

  Under `jit` a size over its capacity is a `checkify` check (see
  `output_capacity`); without `checkify`, the result is still a valid
  LoDTensor: each level's lengths are cut to its time capacity, its
  sequences to its count capacity and its offsets to the size of the level
  below (the token capacity for rows), rows past the last offset are
  zeroed, and ``faults`` gets `Fault.CAPACITY`, so that host reads raise.
  The op adds its inputs' faults (`jaxlod._faults.with_faults`).

  Args:
    values: ``[tokens, *features]`` rows; cut or zero-padded to
      ``capacity.tokens`` (rows past the real total must be padding).
    lengths: per level, int ``[count_l]`` lengths (zeros for padding
      sequences), cut or zero-padded to ``capacity.sequences[l]``.
    num_outer: the real number of level-0 sequences.
    capacity: the output's static capacities.
  """
  num_outer = jnp.asarray(num_outer, jnp.int32)
  over = num_outer > capacity.sequences[0]
  real = jnp.minimum(num_outer, capacity.sequences[0])  # items of this level
  offsets = []
  for level, lens in enumerate(lengths):
    lens = jnp.asarray(lens, jnp.int32)
    count, time = capacity.sequences[level], capacity.time[level]
    over |= jnp.any(lens > time)
    lens = (
      lens[:count]
      if lens.shape[0] >= count
      else jnp.pad(lens, (0, count - lens.shape[0]))
    )
    slots = jnp.arange(count, dtype=jnp.int32)
    lens = jnp.where(slots < real, jnp.minimum(lens, time), 0)
    below = (
      capacity.sequences[level + 1] if level + 1 < len(lengths) else capacity.tokens
    )
    level_offsets = offsets_from_lengths(lens)
    over |= level_offsets[-1] > below
    offsets.append(jnp.minimum(level_offsets, below))
    real = offsets[-1][-1]
  tokens = capacity.tokens
  if values.shape[0] >= tokens:
    values = values[:tokens]
  else:
    values = jnp.pad(
      values, [(0, tokens - values.shape[0])] + [(0, 0)] * (values.ndim - 1)
    )
  if not is_concrete(over):  # eagerly, `output_capacity` has raised already
    kept = jnp.arange(tokens) < real
    values = where_rows(kept, values, 0)
  faults = fault_unless(~over, Fault.CAPACITY)
  return LoDTensor(
    values,
    offsets,
    jnp.minimum(num_outer, capacity.sequences[0]),
    capacity.time,
    faults,
  )
