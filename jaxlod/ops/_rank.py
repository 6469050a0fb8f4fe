"""The rank table: sequences sorted by length, per-step batch sizes, phases."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod import _serial
from jaxlod._checks import (
  check_index_leaves,
  check_sequence,
  is_concrete,
  nan_where,
  require,
  static_float,
  static_int,
)
from jaxlod._faults import check_sound
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import check_level, check_unstacked, is_array


def default_ladder(
  count_capacity: int, *, ratio: float = 1.25, minimum: int = 4, multiple: int = 4
) -> tuple[int, ...]:
  """A geometric ladder of static batch sizes from `count_capacity` down.

  Each size is about the previous one divided by `ratio`, rounded up to a
  multiple of `multiple`, and no smaller than `minimum`.

  Args:
    count_capacity: the largest size (the batch's count capacity).
    ratio: the step between sizes, > 1.
    minimum: the smallest size (when `count_capacity` is larger).
    multiple: sizes below the top are multiples of this.

  Returns:
    Strictly descending sizes, the first equal to `count_capacity`.

  Example:
    >>> default_ladder(64)
    (64, 52, 44, 36, 32, 28, 24, 20, 16, 12, 8, 4)
  """
  count_capacity = static_int(count_capacity, "count_capacity", minimum=0)
  ratio = static_float(ratio, "ratio")
  if not ratio > 1:
    raise ValueError(f"Expected `ratio` > 1, got {ratio}.")
  for name, value in (("minimum", minimum), ("multiple", multiple)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"Expected `{name}` to be an int >= 1, got {value!r}.")
    static_int(value, name, minimum=1)  # a device shape: it must fit int32
  sizes = [int(count_capacity)]
  while sizes[-1] > minimum:
    size = -(-math.ceil(sizes[-1] / ratio) // multiple) * multiple
    if size >= sizes[-1]:
      size = sizes[-1] - multiple
    sizes.append(max(size, minimum))
  return tuple(sizes)


def normalize_ladder(
  count_capacity: int, ladder: Sequence[int] | None
) -> tuple[int, ...]:
  """Checks a user ladder and puts it in the canonical form.

  The result is strictly descending, starts at `count_capacity` (added if
  missing) and holds only sizes in ``[1, count_capacity]``.

  Raises:
    ValueError: for a size that is not a positive int or exceeds the count
      capacity.
  """
  count_capacity = static_int(count_capacity, "count_capacity", minimum=0)
  if ladder is None:
    return default_ladder(count_capacity)
  sizes = {*ladder_sizes(ladder, count_capacity), count_capacity}
  return tuple(sorted(sizes, reverse=True))


_DATA_FIELDS = (
  "order",
  "ranks",
  "lengths",
  "batch_sizes",
  "max_length",
  "count",
  "phase_starts",
  "phase_ends",
)


@dataclasses.dataclass(frozen=True)
class RankTable:
  """Sequences of one LoD level ranked by length (Paddle's LoDRankTable).

  A pytree. Ranks run from the longest sequence to the shortest; ties keep
  their original order (a stable sort, as Paddle's ``std::stable_sort``), and
  padding sequences (length 0) come last. Since the active sequences at step
  ``t`` are those with ``length > t``, they are always a prefix of the ranked
  batch, of size ``batch_sizes[t]``.

  The *phase plan* covers the steps with a ladder of static batch sizes
  ``ladder[0] = count_capacity > ladder[1] > ...``: phase ``k`` runs steps
  ``phase_starts[k] <= t < phase_ends[k]`` at batch size ``ladder[k]``, exactly
  the steps where ``ladder[k + 1] < batch_sizes[t] <= ladder[k]``. Phases may
  be empty (``phase_starts[k] == phase_ends[k]``).

  Attributes:
    order: int32 ``[count_capacity]``, the original index at each rank.
    ranks: int32 ``[count_capacity]``, the rank of each original index (the
      inverse permutation of `order`).
    lengths: int32 ``[count_capacity]``, lengths in rank order (descending).
    batch_sizes: int32 ``[time_capacity]``, ``#{lengths > t}``.
    max_length: int32 scalar, the longest length.
    count: int32 scalar, the real number of sequences at the level.
    phase_starts: int32 ``[len(ladder)]``, first step of each phase.
    phase_ends: int32 ``[len(ladder)]``, one past the last step of each phase.
    ladder: static, the descending batch sizes of the phases.
    level: static, the (non-negative) LoD level that was ranked.
  """

  order: jax.Array
  ranks: jax.Array
  lengths: jax.Array
  batch_sizes: jax.Array
  max_length: jax.Array
  count: jax.Array
  phase_starts: jax.Array
  phase_ends: jax.Array
  ladder: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  level: int = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    """Checks that the array leaves are integer (JAX runs this too when it
    rebuilds the pytree; other leaves pass).

    Raises:
      TypeError: for a leaf of another dtype (a tree map that cast it),
        naming the leaf: the table's values are indices and lengths, and
        a float table would reorder rows wrongly.
    """
    check_index_leaves(
      [(f"`{f}`", getattr(self, f)) for f in _DATA_FIELDS],
      "a rank table holds indices and lengths, so a tree map over it must "
      "leave it alone (cast the rows of the LoDTensor instead).",
    )

  @property
  def stack_shape(self) -> tuple[int, ...]:
    """The leading axes of shards stacked in every leaf, ``()`` for one table,
    ``(S,)`` for the tables of a `jaxlod.data.Batcher` batch with
    ``shards=S`` (see `jaxlod.LoDTensor.stack_shape`). The capacities and
    `schedule_steps` of a stacked table are per shard; `items` and the ops
    raise."""
    return tuple(jnp.shape(self.count)) if is_array(self.count) else ()

  @property
  def count_capacity(self) -> int:
    return int(jnp.shape(self.order)[-1])

  @property
  def time_capacity(self) -> int:
    return int(jnp.shape(self.batch_sizes)[-1])

  def items(self) -> list[tuple[int, int]]:
    """Paddle's rank-table items ``(original index, length)`` (host only)."""
    check_unstacked(self)
    if not is_concrete(self.order, self.lengths, self.count):
      raise ValueError("RankTable.items() reads data on the host; not under jit.")
    n = int(self.count)
    order, lengths = np.asarray(self.order), np.asarray(self.lengths)
    return [(int(order[i]), int(lengths[i])) for i in range(n)]

  def schedule_steps(self) -> jax.Array:
    """Token-steps the phase plan runs: ``sum_k ladder[k] * (end_k - start_k)``.

    This is the work of the phased loop, against ``sum(lengths)`` real
    token-steps and ``count_capacity * max_length`` for a padded loop.
    """
    sizes = jnp.asarray(self.ladder, jnp.int32)
    return jnp.sum(sizes * (self.phase_ends - self.phase_starts), axis=-1)


jax.tree_util.register_dataclass(
  RankTable, data_fields=list(_DATA_FIELDS), meta_fields=["ladder", "level"]
)
_serial.register_export(RankTable, "jaxlod.ops.RankTable")
_serial.register_state(RankTable, _serial.check_same_static)


def _table_arrays(xp, lengths, time_capacity: int, ladder: tuple[int, ...]):
  """The rank table's arrays, with `xp` either `numpy` or `jax.numpy`."""
  i32 = xp.int32
  order = xp.argsort(-lengths, stable=True).astype(i32)
  ranks = xp.argsort(order, stable=True).astype(i32)
  sorted_lengths = lengths[order].astype(i32)
  steps = xp.arange(time_capacity, dtype=i32)
  batch_sizes = xp.sum(sorted_lengths[None, :] > steps[:, None], axis=1).astype(i32)
  phase_starts, phase_ends = phase_bounds(xp, sorted_lengths, ladder)
  return dict(
    order=order,
    ranks=ranks,
    lengths=sorted_lengths,
    batch_sizes=batch_sizes,
    max_length=xp.concatenate([sorted_lengths, xp.zeros((1,), i32)])[0],
    phase_starts=phase_starts,
    phase_ends=phase_ends,
  )


def phase_bounds(xp, sorted_lengths, ladder: Sequence[int]) -> tuple:
  """The phase plan of `ladder` over lengths in rank order (descending):
  ``(phase_starts, phase_ends)``, int32 ``[len(ladder)]`` each, with `xp`
  either `numpy` or `jax.numpy`. Phase ``k`` runs the steps where
  ``ladder[k + 1] < batch_sizes[t] <= ladder[k]``."""
  i32 = xp.int32
  extended = xp.concatenate([xp.asarray(sorted_lengths, i32), xp.zeros((1,), i32)])
  phase_starts = extended[xp.asarray(ladder, dtype=i32)]
  phase_ends = extended[xp.asarray((*ladder[1:], 0), dtype=i32)]
  return phase_starts, phase_ends


def rank_table(
  x: LoDTensor, level: int = -1, *, ladder: Sequence[int] | None = None
) -> RankTable:
  """Ranks the sequences of one LoD level of `x` by length.

  Computed with NumPy on the host when `x` is concrete (the data pipeline
  builds tables beside its batches) and with `jax.numpy` under `jit`; both
  give equal tables.

  On a 2-level LoD, level 0 ranks the outer sequences by their number of
  sub-sequences and level 1 ranks the sub-sequences by their number of rows
  (Paddle's semantics).

  Args:
    x: a LoDTensor.
    level: the LoD level to rank (negative counts from the last); by
      default the last, the level `dynamic_rnn` runs over and
      `lod_to_array` reads.
    ladder: static batch sizes of the phases; the count capacity is always
      included. Default: `default_ladder` of the level's count capacity.

  Returns:
    A `RankTable` with ``time_capacity = x.time_capacity[level]``.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import rank_table
    >>> x = LoDTensor.from_lengths(np.zeros(7), [[1, 2], [5, 1, 1]])
    >>> rank_table(x).items()  # the last level: sub-sequences by rows
    [(0, 5), (1, 1), (2, 1)]
    >>> rank_table(x, level=0).items()  # outer sequences by sub-sequences
    [(1, 2), (0, 1)]
  """
  level = check_level(check_lod(x, "x"), level, "level")
  return ranked_level(x, level, ladder)


def ranked_level(x: LoDTensor, level: int, ladder: Sequence[int] | None) -> RankTable:
  """`rank_table` of a checked `x` at a checked, non-negative `level`."""
  offsets = x.offsets[level]
  count_capacity = x.capacity.sequences[level]
  ladder = normalize_ladder(count_capacity, ladder)
  time_capacity = x.time_capacity[level]
  # The level's real count: the outer count, or the last offset of the level
  # above. Read on the host with NumPy (no device op) when concrete.
  parent = x.num_outer if level == 0 else x.offsets[level - 1]
  if is_concrete(offsets, parent):
    check_sound(x)  # a faulted tensor's LoD is clamped: no table of it
    arrays = _table_arrays(np, np.diff(np.asarray(offsets)), time_capacity, ladder)
    parent = np.asarray(parent)
    count = np.asarray(parent if level == 0 else parent[-1], np.int32)
  else:
    arrays = _table_arrays(jnp, jnp.diff(offsets), time_capacity, ladder)
    count = x.num_sequences(level)
  return RankTable(**arrays, count=count, ladder=ladder, level=level)


# -- rank tables and ladders given to the ops ------------------------------------


def check_table(
  table: Any, name: str = "table", *, optional: bool = False, stacked: bool = False
) -> Any:
  """`table` must be a `jaxlod.ops.RankTable` (or `None` when `optional`):
  one table, or with `stacked` the shards' tables stacked on a leading axis
  (whose number the caller checks)."""
  if optional and table is None:
    return None
  if not isinstance(table, RankTable):
    raise TypeError(f"Expected `{name}` to be a RankTable, got {type(table).__name__}.")
  if not stacked:
    check_unstacked(table, name)
  return table


def check_pair(x: LoDTensor, table: Any, name: str) -> Any:
  """`table` ranks the last level of `x` (a LoDTensor `check_lod` has
  checked).

  Checks the table's type and capacities, and the lengths (`check_ranked`,
  whose result it returns).
  """
  check_table(table)
  count = x.capacity.sequences[-1]
  if count != table.count_capacity:
    raise ValueError(
      f"Expected the rank table's count capacity {table.count_capacity} to equal "
      f"the count capacity of `{name}`'s last level, got {count}."
    )
  if x.time_capacity[-1] > table.time_capacity:
    raise ValueError(
      f"Expected the rank table's time capacity {table.time_capacity} to be at "
      f"least the time capacity of `{name}`'s last level, got "
      f"{x.time_capacity[-1]}."
    )
  return check_ranked(x.lengths(), table, f"`{name}`", "last level")


def check_ranked(lengths: jax.Array, table: RankTable, name: str, level: str) -> Any:
  """Checks that `table` ranks sequences of these `lengths`: eagerly a
  `ValueError` naming the first rank that differs, under `jit` a
  `jax.experimental.checkify` check (a table of another batch with the same
  capacities would give wrong results).

  Returns:
    Whether it does: `True` eagerly, a bool scalar under `jit`, for the
    caller to mark its results (`jaxlod.Fault.TABLE`).
  """
  if not is_concrete(lengths, table.order, table.lengths):
    lengths = jnp.asarray(lengths)
    ranked = jnp.take(lengths, jnp.asarray(table.order), axis=0)
    return require(
      jnp.all(ranked == jnp.asarray(table.lengths)),
      f"The rank table does not describe {name}'s {level}: its lengths in rank "
      f"order differ from {name}'s (a table of another batch?).",
    )
  expected = np.asarray(lengths)[np.asarray(table.order)]
  ranked = np.asarray(table.lengths)
  if not np.array_equal(expected, ranked):
    bad = int(np.flatnonzero(expected != ranked)[0])
    raise ValueError(
      f"The rank table does not describe {name}'s {level}: at rank {bad} it has "
      f"length {int(ranked[bad])}, {name} has {int(expected[bad])}."
    )
  return True


def nan_unless(ok: Any, tree: Any) -> Any:
  """The float leaves of `tree` (arrays, or LoDTensors' values) turned NaN
  unless `ok` (a bool scalar) holds, so that a result computed from a wrong
  rank table under `jit` is loud in any loss; other leaves pass. Jittable."""
  if ok is True:
    return tree

  def poison(a):
    if isinstance(a, LoDTensor):
      return a.with_values(poison(a.values))
    return nan_where(~jnp.asarray(ok), a)

  return jax.tree.map(poison, tree, is_leaf=lambda a: isinstance(a, LoDTensor))


def ladder_sizes(ladder: Any, count_capacity: int | None = None) -> list[int]:
  """The static batch sizes of a ladder: ints in ``[1, count_capacity]``
  (``>= 1`` before the count capacity is known)."""
  sizes = check_sequence(ladder, "ladder", "a sequence of ints or None")
  for i, size in enumerate(sizes):
    if isinstance(size, bool | np.bool_) or not isinstance(size, int | np.integer):
      raise ValueError(f"Expected `ladder[{i}]` to be an int, got {size!r}.")
    if count_capacity is None:
      static_int(size, f"ladder[{i}]", minimum=1)
    if count_capacity is not None and not 1 <= size <= count_capacity:
      raise ValueError(
        f"Expected `ladder[{i}]` in [1, {count_capacity}] (the count capacity), "
        f"got {size}."
      )
  return [int(size) for size in sizes]


def check_ladder(ladder: Any) -> tuple[int, ...] | None:
  """A layer's ladder as a tuple of sizes >= 1 (checked against the count
  capacity by `jaxlod.ops.normalize_ladder` at the call), or `None`."""
  return None if ladder is None else tuple(ladder_sizes(ladder))
