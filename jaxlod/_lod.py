"""LoDTensor: packed rows plus multi-level offsets, on static capacities.

`is_lod` and `check_lod` check the LoDTensor arguments of the ops; a
tensor's static sizes are a `jaxlod._buckets.Capacity`.
The builders' and the constructor's checks are `jaxlod._lod_checks`, the
fault record that ops under `jit` set is `jaxlod._faults`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod import _buckets, _lod_checks, _serial
from jaxlod._buckets import Buckets, Capacity
from jaxlod._checks import (
  check_dtype,
  check_sequence,
  is_concrete,
  nan_where,
  static_int,
)
from jaxlod._faults import check_sound, concrete_faults, describe_faults
from jaxlod._host import as_array, check_fits_device
from jaxlod._lod_checks import (
  check_fields,
  check_intact,
  check_lengths_fit,
  check_level,
  check_offsets,
  check_pad_value,
  check_padded,
  check_row_splits,
  check_segment_ids,
  check_sequences,
  check_stored_lod,
  check_unstacked,
  check_values,
  is_array,
  lengths_to_offsets,
)


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
  pad = np.zeros((rows - array.shape[0], *array.shape[1:]), array.dtype)
  return np.concatenate([array, pad], axis=0)


def owners(offsets: jax.Array, items: jax.Array, count: int) -> jax.Array:
  """The sequence (in ``[0, count)``) whose offsets span each item. Jittable.

  Args:
    offsets: int32 ``[count + 1]``, one LoD level's offsets.
    items: int32 ``[n]``, item indices (rows, or sequences of the next level).
    count: the level's count capacity, at least 1.

  Returns:
    int32 ``[n]``. Items past the last offset get the last sequence; callers
    mask them.
  """
  seq = jnp.searchsorted(offsets, items, side="right").astype(jnp.int32) - 1
  return jnp.clip(seq, 0, count - 1)


# -- the pytree ----------------------------------------------------------------


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["values", "offsets", "num_outer", "faults"],
  meta_fields=["time_capacity"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class LoDTensor:
  """Packed rows of variable-length sequences with multi-level offsets.

  A LoDTensor is Paddle's LoDTensor on static capacities. The rows of all
  sequences are packed one after another in ``values``; ``offsets`` holds one
  offsets array per LoD level, level 0 outermost. Each level's offsets index
  into the next level's sequences; the last level's offsets index rows.
  Sizes that vary from batch to batch are rounded up to *capacities* (see
  `Buckets`): padding sequences past the real count are empty (their offsets
  repeat the last value) and padding rows past the last offset are zeros, so
  every op handles them for free and a jitted function never recompiles for a
  batch of the same capacities.

  A frozen dataclass, registered as a pytree with
  `jax.tree_util.register_dataclass`: ``values``, ``offsets``, ``num_outer``
  and ``faults`` are its dynamic leaves, ``time_capacity`` its static data;
  token and count capacities are read from the shapes. Equality is identity
  (``==`` is ``is``; compare the fields to compare values), as arrays have
  no single truth value.

  Build one on the host with `from_lengths`, `from_offsets`, `from_sequences`,
  or from another library's format: `from_padded` (a padded batch and
  lengths, as `flax.linen.RNN` takes them), `from_segment_ids` (packed rows
  with segment ids, as Grain, T5X and MaxText pack them), `from_row_splits`
  (`tf.RaggedTensor`'s nested row splits) and
  `jaxlod.interop.from_packed_sequence` (PyTorch). They validate the LoD and
  never truncate data; `to_padded`, `to_segment_ids`, `row_splits` and
  `jaxlod.interop.to_packed_sequence` convert back, exactly.

  The constructor ``LoDTensor(values, offsets, num_outer, time_capacity)``
  checks shapes, not values; prefer the builders.

  Attributes:
    values: ``[token_capacity, *features]`` packed rows, zeros past the last
      offset.
    offsets: a tuple of one int32 ``[count_capacity_l + 1]`` array per level
      (any sequence is accepted and stored as a tuple).
    num_outer: int32 scalar, the real number of level-0 sequences (deeper
      counts are the last offset of the level above).
    time_capacity: static, per level, a bound on the longest sequence (any
      sequence of ints is accepted and stored as a tuple).
    faults: int32 scalar, a `Fault` bitmask: 0 for a sound tensor; set by an
      op under `jit` that could not honour its contract without
      `checkify` (an output over its capacity, a rank table of another
      batch), and passed on by every op. Defaults to 0.

  Reads of a faulted tensor raise the same `ValueError` ("This LoDTensor is
  faulted ...") whenever its ``faults`` are concrete (outside `jit`):
  `to_list`, `recursive_lengths`, `row_splits`, `validate`, `lengths`,
  `num_sequences`, `num_rows`, `row_mask`, `segment_ids`, `to_padded`,
  `to_segment_ids`, `jaxlod.interop.to_packed_sequence`, and
  `jaxlod.ops.rank_table`, so eager ops that read the LoD raise too. Under
  `jit` they work on the clamped tensor and the fault is passed on. The
  fields themselves (``x.values``, ``x.offsets``) are not guarded.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor, Buckets
    >>> x = LoDTensor.from_lengths(np.arange(9.0), [[2, 1], [3, 2, 4]])
    >>> x.recursive_lengths()
    [[2, 1], [3, 2, 4]]
    >>> [o.tolist() for o in x.offsets]
    [[0, 2, 3], [0, 3, 5, 9]]
    >>> y = LoDTensor.from_sequences([np.ones(3), np.ones(5)], buckets=Buckets.pow2())
    >>> y.capacity
    Capacity(tokens=8, sequences=(8,), time=(8,))
  """

  values: jax.Array
  offsets: tuple[jax.Array, ...]
  num_outer: jax.Array
  time_capacity: tuple[int, ...]
  faults: jax.Array = 0

  def __post_init__(self):
    """Stores `offsets` and `time_capacity` as tuples; checks the shapes.

    JAX runs this too when it rebuilds the pytree, with whatever a
    transformation put in the leaves (axis specs, `None`, shape structs,
    shards stacked on a leading axis). So only array leaves are checked, and
    a ``num_outer`` with leading axes (``[S]`` for S stacked shards) allows
    the same leading axes on the other leaves.

    Raises:
      ValueError: for no levels, not one time capacity per level, a scalar
        ``values``, or offsets not of shape ``[count_capacity + 1]``.
    """
    offsets = tuple(self.offsets)
    time_capacity = tuple(int(t) for t in self.time_capacity)
    object.__setattr__(self, "offsets", offsets)
    object.__setattr__(self, "time_capacity", time_capacity)
    if type(self.faults) is int:  # the default, or a Python int given
      object.__setattr__(self, "faults", np.asarray(self.faults, np.int32))
    check_fields(self)

  # -- host builders ----------------------------------------------------------

  @classmethod
  def from_offsets(
    cls, values: Any, offsets: Sequence[Any], *, buckets: Buckets | None = None
  ) -> LoDTensor:
    """Builds a LoDTensor from Paddle's offset-based LoD.

    Args:
      values: ``[rows, *features]`` packed rows.
      offsets: one sequence of ints per level, level 0 outermost, e.g.
        ``[[0, 2, 3], [0, 3, 5, 9]]``.
      buckets: capacity policy; `None` means exact sizes.

    Returns:
      A LoDTensor padded to the capacities of `buckets`.

    Raises:
      ValueError: if the LoD is malformed (the message names the level, the
        index and the values) or the batch exceeds a fixed capacity.
    """
    values = check_values(values)
    checked = check_offsets(offsets, values.shape[0])
    return cls._build(values, checked, _buckets.resolve(buckets))

  @classmethod
  def from_lengths(
    cls,
    values: Any,
    recursive_lengths: Sequence[Sequence[int]],
    *,
    buckets: Buckets | None = None,
  ) -> LoDTensor:
    """Builds a LoDTensor from Paddle's length-based LoD.

    Args:
      values: ``[rows, *features]`` packed rows.
      recursive_lengths: one list of lengths per level, level 0 outermost,
        e.g. ``[[2, 1], [3, 2, 4]]``: two outer sequences holding 2 and 1
        sub-sequences of 3, 2 and 4 rows.
      buckets: capacity policy; `None` means exact sizes.

    Raises:
      ValueError: for negative or non-integer lengths, levels whose sums
        disagree with the next level, or a batch over a fixed capacity.
    """
    values = check_values(values)
    recursive_lengths = check_sequence(
      recursive_lengths, "recursive_lengths", "one sequence of lengths per level"
    )
    if len(recursive_lengths) == 0:
      raise ValueError("Expected at least one LoD level, got none.")
    offsets = lengths_to_offsets(recursive_lengths)
    checked = check_offsets(offsets, values.shape[0])
    return cls._build(values, checked, _buckets.resolve(buckets))

  @classmethod
  def from_sequences(
    cls, seqs: Sequence[Any], *, buckets: Buckets | None = None, dtype: Any = None
  ) -> LoDTensor:
    """Builds a LoDTensor from Python lists of sequences.

    Args:
      seqs: a list (or any iterable, read once) of arrays ``[length_i,
        *features]`` (one level), or of lists of such arrays (two levels). A
        list of numbers counts as one 1-D sequence.
      buckets: capacity policy; `None` means exact sizes.
      dtype: dtype of ``values``; inferred from the data when `None`. The
        cast keeps every value or raises: floats may round, but nothing
        wraps, truncates or overflows to inf.

    Raises:
      ValueError: if the sequences disagree in feature shape, or a value
        would not survive the cast to `dtype` (naming its index).
      TypeError: for a `dtype` that is not a number or bool dtype, or
        sequences NumPy would promote to float64 (int64 with uint64).
    """
    values, lengths = check_sequences(seqs, dtype)
    return cls.from_lengths(values, lengths, buckets=buckets)

  @classmethod
  def from_padded(
    cls,
    padded: Any,
    lengths: Any,
    *,
    num_sequences: Any = None,
    buckets: Buckets | None = None,
  ) -> LoDTensor:
    """Builds a one-level LoDTensor from a padded batch: the inverse of
    `to_padded`.

    ``(padded, lengths)`` is what `flax.linen.RNN` takes as ``(inputs,
    seq_lengths)`` (batch-major; transpose a time-major batch first). Cells
    past each sequence's end are not read. A padded batch has one level;
    rebuild outer levels with `from_lengths` on the rows.

    Args:
      padded: ``[count, time, *features]``; row ``t`` of sequence ``i`` is
        ``padded[i, t]`` for ``t < lengths[i]``.
      lengths: ``[count]`` integer lengths, ``0 <= lengths[i] <= time``.
      num_sequences: how many of the `count` sequences are real (an integer
        scalar, e.g. ``x.num_sequences()``); the sequences past it must be
        empty and are dropped, as the padding slots that `to_padded` gives.
        `None` (the default): all `count`.
      buckets: capacity policy; `None` means exact sizes.

    Raises:
      ValueError: for a `padded` of rank < 2, a `lengths` of the wrong shape,
        a length outside ``[0, time]`` or a nonzero length past
        `num_sequences` (naming the index and the length).

    Example:
      >>> import numpy as np
      >>> from jaxlod import LoDTensor, Buckets
      >>> buckets = Buckets.fixed(tokens=8, sequences=4, time=3)
      >>> x = LoDTensor.from_lengths(np.arange(1.0, 6.0), [[2, 0, 3]], buckets=buckets)
      >>> padded, seq_lengths = x.to_padded()
      >>> padded.tolist()
      [[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [3.0, 4.0, 5.0], [0.0, 0.0, 0.0]]
      >>> seq_lengths.tolist()  # flax.linen.RNN's seq_lengths
      [2, 0, 3, 0]
      >>> y = LoDTensor.from_padded(
      ...   padded, seq_lengths, num_sequences=x.num_sequences(), buckets=buckets
      ... )
      >>> y.recursive_lengths(), y.capacity == x.capacity
      ([[2, 0, 3]], True)
    """
    rows, lengths = check_padded(padded, lengths, num_sequences)
    return cls.from_lengths(rows, [lengths], buckets=buckets)

  @classmethod
  def from_segment_ids(
    cls,
    values: Any,
    segment_ids: Any,
    *,
    positions: Any = None,
    padding_id: int | None = 0,
    buckets: Buckets | None = None,
  ) -> LoDTensor:
    """Builds a one-level LoDTensor from packed rows with segment ids.

    The packed format of Grain's packing transforms, T5X and MaxText: the
    rows of several sequences one after another, ``segment_ids`` 1, 2, ...
    naming each row's sequence, 0 for the padding rows at the end, and
    ``positions`` counting 0, 1, ... within each sequence. Each maximal run
    of one id is a sequence, in row order; ids are labels (any integers,
    any order). An empty sequence has no rows to carry its id: the format
    holds none. For a batch ``[batch, length]``, convert each packed row.
    The inverse of `to_segment_ids`; the 0-based ids of `segment_ids` work
    with ``padding_id=x.capacity.sequences[-1]``.

    Args:
      values: ``[rows, *features]`` packed rows.
      segment_ids: int ``[rows]``: each row's sequence id, or `padding_id`
        for padding rows, which come last and are dropped. An id may not
        come back after its run ends.
      positions: optional int ``[rows]``, checked to count 0, 1, ... within
        each sequence (not read at padding rows). They do not split a run:
        adjacent sequences need different ids.
      padding_id: the id of padding rows; `None` if every row is real.
      buckets: capacity policy; `None` means exact sizes.

    Raises:
      TypeError: for non-integer ids or positions.
      ValueError: for ids or positions not of shape ``[rows]``, a real row
        after a padding row, an id that comes back after another, or a
        position that does not count up; the message names the index and
        the values.

    Example:
      >>> import numpy as np
      >>> from jaxlod import LoDTensor
      >>> x = LoDTensor.from_segment_ids(
      ...   np.arange(6.0), [1, 1, 1, 2, 2, 0], positions=[0, 1, 2, 0, 1, 0]
      ... )
      >>> x.recursive_lengths(), x.values.tolist()
      ([[3, 2]], [0.0, 1.0, 2.0, 3.0, 4.0])
    """
    values = check_values(values)
    lengths = check_segment_ids(segment_ids, positions, values.shape[0], padding_id)
    rows = int(lengths.sum())
    return cls.from_lengths(values[:rows], [lengths], buckets=buckets)

  @classmethod
  def from_row_splits(
    cls, values: Any, row_splits: Any, *, buckets: Buckets | None = None
  ) -> LoDTensor:
    """Builds a LoDTensor from `tf.RaggedTensor`'s nested row splits.

    A ragged tensor's ``nested_row_splits`` are LoD offsets: one 1-D array
    per ragged dimension, outermost first, each indexing into the next and
    the last into the rows of ``flat_values``. TensorFlow is not needed:
    the splits are NumPy (or any) arrays. The inverse of `row_splits`.

    Args:
      values: ``[rows, *features]``, the ragged tensor's ``flat_values``.
      row_splits: a list of 1-D integer arrays, outermost first (a single
        1-D array, or a flat list of ints, for one level, as
        `tf.RaggedTensor.from_row_splits` takes it); empty rows (repeated
        splits) are legal.
      buckets: capacity policy; `None` means exact sizes.

    Raises:
      ValueError: for splits that do not start at 0 or decrease, or a last
        split that is not the number of rows (or sequences) below; the
        message names the level, the index and the values.

    Example:
      >>> import numpy as np
      >>> from jaxlod import LoDTensor
      >>> x = LoDTensor.from_row_splits(np.arange(5.0), [[0, 2, 3], [0, 3, 3, 5]])
      >>> x.recursive_lengths()
      [[2, 1], [3, 0, 2]]
      >>> [s.tolist() for s in x.row_splits()]
      [[0, 2, 3], [0, 3, 3, 5]]
    """
    values = check_values(values)
    checked = check_row_splits(row_splits, values.shape[0])
    return cls._build(values, checked, _buckets.resolve(buckets))

  @classmethod
  def _build(
    cls, values: np.ndarray, offsets: list[np.ndarray], buckets: Buckets
  ) -> LoDTensor:
    tokens = buckets.capacity(values.shape[0], "tokens")
    padded_offsets, time = [], []
    for level, o in enumerate(offsets):
      count = buckets.capacity(o.size - 1, "sequences", level)
      longest = int(np.max(np.diff(o), initial=0))
      time.append(buckets.capacity(longest, "time", level))
      padded_offsets.append(
        jnp.asarray(np.pad(o, (0, count + 1 - o.size), mode="edge"), jnp.int32)
      )
    return cls(
      jnp.asarray(_pad_rows(values, tokens)),
      padded_offsets,
      jnp.asarray(offsets[0].size - 1, jnp.int32),
      time,
    )

  # -- shape information (static) ---------------------------------------------

  @property
  def num_levels(self) -> int:
    """Number of LoD levels."""
    return len(self.offsets)

  @property
  def stack_shape(self) -> tuple[int, ...]:
    """The leading axes of shards stacked in every leaf, ``()`` for one tensor.

    A field of a `jaxlod.data.Batcher` batch with ``shards=S`` holds the S
    shards' tensors stacked on a new leading axis: ``(S,)``. Such a
    *stacked* tensor is a container to place and run per device
    (`jaxlod.parallel.shard_batch`, `jaxlod.parallel.data_parallel`,
    `jaxlod.parallel.map_shards`), where each device sees one ordinary shard.
    Its `capacity`, `feature_shape`, `num_levels` and `astype` are per shard
    and `validate` checks every shard; the reads of one LoD (`lengths`,
    `num_rows`, `to_list`, ...) and every op raise a `ValueError` saying to
    take a shard first (``jaxlod.parallel.unstack(x)[s]``).
    """
    return tuple(jnp.shape(self.num_outer)) if is_array(self.num_outer) else ()

  @property
  def capacity(self) -> Capacity:
    """The static capacities (tokens, sequences per level, time per level);
    of each shard for a stacked tensor (`stack_shape`)."""
    lead = len(self.stack_shape)
    return Capacity(
      tokens=int(jnp.shape(self.values)[lead]),
      sequences=tuple(int(jnp.shape(o)[-1]) - 1 for o in self.offsets),
      time=self.time_capacity,
    )

  @property
  def feature_shape(self) -> tuple[int, ...]:
    """Trailing shape of each row of ``values``."""
    return tuple(jnp.shape(self.values)[len(self.stack_shape) + 1 :])

  def _check_readable(self) -> None:
    """Reads of the LoD need one unstacked tensor; eagerly (concrete leaves)
    also an intact LoD (`validate`'s check) and no faults (`check_sound`)."""
    check_unstacked(self)
    check_sound(self)
    check_intact(self)

  # -- jittable accessors ---------------------------------------------------------

  def lengths(self, level: int = -1) -> jax.Array:
    """Lengths of the sequences at `level`: int32 ``[count_capacity]``.

    `level` counts from 0 (outermost), negative from the last (the default).
    Padding sequences have length 0. Jittable; eagerly it raises for a
    faulted tensor (see `faults`).
    """
    self._check_readable()
    return jnp.diff(self.offsets[check_level(self, level, "level")])

  def num_sequences(self, level: int = -1) -> jax.Array:
    """Real number of sequences at `level` (int32 scalar). Jittable.

    `level` counts from 0 (outermost), negative from the last (the default).

    Example:
      >>> import numpy as np
      >>> from jaxlod import LoDTensor
      >>> x = LoDTensor.from_lengths(np.zeros(7), [[1, 2], [5, 1, 1]])
      >>> int(x.num_sequences()), int(x.num_sequences(0))
      (3, 2)
    """
    level = check_level(self, level, "level")
    self._check_readable()
    if level == 0:
      return jnp.asarray(self.num_outer)
    return self.offsets[level - 1][-1]

  @property
  def num_rows(self) -> jax.Array:
    """Real number of rows of ``values`` (int32 scalar). Jittable."""
    self._check_readable()
    return self.offsets[-1][-1]

  def row_mask(self) -> jax.Array:
    """Which rows of ``values`` are real: bool ``[token_capacity]``. Jittable.

    Rows past the last offset are padding (zeros, in no sequence).

    Example:
      >>> import numpy as np
      >>> from jaxlod import LoDTensor, Buckets
      >>> buckets = Buckets.fixed(tokens=4, sequences=2, time=2)
      >>> x = LoDTensor.from_lengths(np.ones(3), [[2, 1]], buckets=buckets)
      >>> x.row_mask().tolist()
      [True, True, True, False]
    """
    return jnp.arange(self.capacity.tokens) < self.num_rows

  def segment_ids(self) -> jax.Array:
    """The last-level sequence of each row: int32 ``[token_capacity]``. Jittable.

    Padding rows get the last level's count capacity, one past every
    sequence slot, so that `jax.ops.segment_sum` and friends with
    ``num_segments=count_capacity`` drop them. The packed format's ids,
    0-based: `to_segment_ids` gives them 1-based with 0 for padding, and
    ``from_segment_ids(x.values, x.segment_ids(),
    padding_id=x.capacity.sequences[-1])`` converts back (an empty
    sequence, with no rows, is not in either).

    Example:
      >>> import numpy as np
      >>> from jaxlod import LoDTensor, Buckets
      >>> buckets = Buckets.fixed(tokens=5, sequences=3, time=2)
      >>> x = LoDTensor.from_lengths(np.ones(3), [[2, 0, 1]], buckets=buckets)
      >>> x.segment_ids().tolist()
      [0, 0, 2, 3, 3]
    """
    self._check_readable()
    count = self.capacity.sequences[-1]
    if count == 0:  # no sequence slots: every row is padding
      return jnp.zeros((self.capacity.tokens,), jnp.int32)
    rows = jnp.arange(self.capacity.tokens, dtype=jnp.int32)
    return jnp.where(self.row_mask(), owners(self.offsets[-1], rows, count), count)

  def astype(self, dtype: Any) -> LoDTensor:
    """The same LoD over the rows cast to `dtype`; the offsets stay integer.

    Use it rather than a tree map, which would cast the offsets too (and
    raise). A device cast, jittable, with `jax.numpy`'s rules: integers that
    `dtype` cannot hold wrap, as in ``jnp.astype``; build from host data with
    ``from_sequences(..., dtype=...)`` to have them refused.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> from jaxlod import LoDTensor
      >>> x = LoDTensor.from_lengths(np.ones((3, 2)), [[2, 1]])
      >>> y = x.astype(jnp.bfloat16)
      >>> y.values.dtype, y.offsets[0].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    check_dtype(dtype, "dtype")
    return self.with_values(jnp.asarray(self.values).astype(dtype))

  def with_values(self, values: jax.Array) -> LoDTensor:
    """The same LoD over new rows ``[token_capacity, *new_features]``."""
    if not is_array(values):
      values = as_array(values, "values")
    check_fits_device(values, "values")
    stack, tokens = self.stack_shape, self.capacity.tokens
    lead = jnp.shape(values)[: len(stack) + 1]
    if stack:
      if lead != (*stack, tokens):
        raise ValueError(
          f"Expected `values` of stacked shards to have leading dimensions "
          f"{(*stack, tokens)} (shards, token capacity), got shape "
          f"{jnp.shape(values)}."
        )
    elif jnp.ndim(values) == 0 or lead[0] != tokens:
      raise ValueError(
        f"Expected `values` to have leading dimension {tokens} "
        f"(token capacity), got shape {jnp.shape(values)}."
      )
    return LoDTensor(
      values, self.offsets, self.num_outer, self.time_capacity, self.faults
    )

  def to_padded(
    self, pad_value: Any = 0, time_capacity: int | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """The last level as a padded batch. Jittable.

    ``(padded, lengths)`` is what `flax.linen.RNN` takes as ``(inputs,
    seq_lengths)``; `from_padded` converts back (pass it
    ``num_sequences=x.num_sequences()`` to drop the padding slots). Outer
    levels are not in the padded form.

    Args:
      pad_value: value of cells past each sequence's end.
      time_capacity: static length of the time axis; defaults to the last
        level's time capacity. A smaller value is checked against the data:
        eagerly with `ValueError`, under `jit` through
        `jax.experimental.checkify` (wrap the caller in `checkify.checkify`
        to see the error); under plain `jit` a float sequence longer than
        it comes back all NaN, never cut short (int values come back cut:
        check them eagerly or under checkify).

    Returns:
      ``(padded [count_capacity, time, *features], lengths [count_capacity])``.
    """
    time = self.time_capacity[-1]
    if time_capacity is not None:
      time = static_int(time_capacity, "time_capacity", minimum=0)
    lengths = self.lengths()
    if time < self.time_capacity[-1]:
      check_lengths_fit(lengths, time, "to_padded(time_capacity=...)")
    starts = self.offsets[-1][:-1]
    steps = jnp.arange(time, dtype=jnp.int32)
    index = starts[:, None] + steps[None, :]
    mask = steps[None, :] < lengths[:, None]
    tokens = self.capacity.tokens
    pad = check_pad_value(pad_value, self)
    if tokens == 0:
      shape = (lengths.shape[0], time, *self.feature_shape)
      return jnp.full(shape, pad), lengths
    rows = self.values[jnp.clip(index, 0, tokens - 1)]
    mask = mask.reshape(mask.shape + (1,) * len(self.feature_shape))
    # Under `jit` a sequence cut short is NaN, not silently truncated.
    cut = jnp.asarray(lengths) > time
    return nan_where(cut, jnp.where(mask, rows, pad)), lengths

  def to_segment_ids(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The last level as packed rows with segment ids and positions. Jittable.

    The packed format of Grain's packing transforms, T5X and MaxText:
    sequence ``i`` (0-based) has id ``i + 1`` at each of its rows, padding
    rows have id 0, and positions count 0, 1, ... within each sequence (0
    at padding rows). An empty sequence has no rows, so its id does not
    appear and `from_segment_ids` gives back the tensor without it; outer
    levels are not in the format either. `segment_ids` gives the same ids
    0-based, with padding rows at the count capacity, for
    `jax.ops.segment_sum` and friends.

    Returns:
      ``(values [token_capacity, *features], segment_ids [token_capacity],
      positions [token_capacity])``, the ids and positions int32.

    Example:
      >>> import numpy as np
      >>> from jaxlod import LoDTensor, Buckets
      >>> buckets = Buckets.fixed(tokens=6, sequences=3, time=3)
      >>> x = LoDTensor.from_lengths(np.arange(5.0), [[3, 2]], buckets=buckets)
      >>> values, segment_ids, positions = x.to_segment_ids()
      >>> segment_ids.tolist(), positions.tolist()
      ([1, 1, 1, 2, 2, 0], [0, 1, 2, 0, 1, 0])
      >>> y = LoDTensor.from_segment_ids(
      ...   values, segment_ids, positions=positions, buckets=buckets
      ... )
      >>> y.recursive_lengths(), (y.values == x.values).all().item()
      ([[3, 2]], True)
    """
    mask = self.row_mask()
    ids = self.segment_ids()
    rows = jnp.arange(self.capacity.tokens, dtype=jnp.int32)
    positions = rows - self.offsets[-1][ids]
    return (
      self.values,
      jnp.where(mask, ids + 1, 0).astype(jnp.int32),
      jnp.where(mask, positions, 0).astype(jnp.int32),
    )

  # -- host-only views ----------------------------------------------------------------

  def _host_offsets(self) -> list[np.ndarray]:
    if not is_concrete(*self.offsets, self.num_outer, self.faults):
      raise ValueError("This method reads data on the host; it cannot run under jit.")
    self._check_readable()
    real = [np.asarray(self.offsets[0])[: int(self.num_outer) + 1]]
    for o in self.offsets[1:]:
      real.append(np.asarray(o)[: int(real[-1][-1]) + 1])
    return real

  def recursive_lengths(self) -> list[list[int]]:
    """Paddle's length-based LoD of the real sequences (host only).

    Returns:
      One list of ints per level, level 0 first, without padding sequences.
    """
    return [np.diff(o).tolist() for o in self._host_offsets()]

  def row_splits(self) -> list[np.ndarray]:
    """The LoD of the real sequences as `tf.RaggedTensor`'s nested row splits
    (host only).

    Returns:
      One int64 NumPy array per level, level 0 first, without padding
      sequences: the offsets, which `from_row_splits` takes back. The rows
      they split are ``x.values[:splits[-1][-1]]``; TensorFlow users pass both
      to `tf.RaggedTensor.from_nested_row_splits`.
    """
    return [o.astype(np.int64) for o in self._host_offsets()]

  def validate(self) -> None:
    """Checks every invariant of the LoD on the host.

    The constructor checks shapes only: it also runs on every `jit` output
    and must not wait for the device. A LoDTensor assembled by hand, or
    restored by a checkpointer that takes the static time capacity from its
    target (orbax does), may break the invariants; this checks them.
    `flax.serialization` restores run the same check, and so do the reads
    of the LoD and the ops whenever the leaves are concrete (eagerly). A
    stacked tensor (`stack_shape`) is checked shard by shard.

    Raises:
      ValueError: for offsets that are not integer, do not start at 0 or
        decrease; a ``num_outer`` or a last offset beyond the next count
        capacity; a padding sequence that is not empty; a last offset beyond
        the token capacity; a sequence longer than its level's time
        capacity; leaves that are not concrete arrays (under `jit`); or
        `faults` (an op under `jit` could not honour its contract).

    Example:
      >>> import dataclasses
      >>> import numpy as np
      >>> from jaxlod import LoDTensor
      >>> x = LoDTensor.from_lengths(np.ones(5), [[4, 1]])
      >>> x.validate()
      >>> dataclasses.replace(x, time_capacity=(2,)).validate()
      Traceback (most recent call last):
      ...
      ValueError: LoD level 0, index 0: a sequence of length 4, more than the time ...
    """
    check_stored_lod(self)
    check_sound(self)

  def to_list(self) -> list:
    """The real sequences as NumPy arrays (host only).

    Returns:
      A list of ``[length, *features]`` arrays for one level; a list of lists
      for two levels (and so on): the inverse of `from_sequences`.
    """
    offsets = self._host_offsets()
    values = np.asarray(self.values)

    def split(level: int, start: int, stop: int) -> list:
      o = offsets[level]
      if level == len(offsets) - 1:
        return [values[o[i] : o[i + 1]] for i in range(start, stop)]
      return [split(level + 1, o[i], o[i + 1]) for i in range(start, stop)]

    return split(0, 0, offsets[0].size - 1)

  def __repr__(self) -> str:
    values = self.values
    shape = getattr(values, "shape", None)
    dtype = getattr(values, "dtype", None)
    head = f"LoDTensor(values={dtype}{list(shape) if shape is not None else ''}"
    try:
      lod = f", lod={self.recursive_lengths()}"
    except (ValueError, TypeError, AttributeError):
      lod = f", shards={self.stack_shape}" if self.stack_shape else ""
    bits = concrete_faults(self.faults)
    if bits:
      lod = f", faults={describe_faults(bits)}"
    return f"{head}{lod}, capacity={self.capacity})"


_serial.register_export(LoDTensor, "jaxlod.LoDTensor")
_serial.register_state(
  LoDTensor, _lod_checks.check_lod_restore, _lod_checks.check_restored_lod
)


# -- LoDTensor arguments and capacities ------------------------------------------


def is_lod(x: Any) -> bool:
  """True for a LoDTensor (an ``is_leaf`` for pytrees of LoDTensors)."""
  return isinstance(x, LoDTensor)


def check_lod(
  x: Any, name: str, *, levels: Sequence[int] | None = None, stacked: bool = False
) -> LoDTensor:
  """`x` must be one LoDTensor (with `stacked`, shards stacked on leading
  axes, whose number the caller checks), with one of the allowed numbers of
  levels; with concrete leaves (eagerly), an intact LoD."""
  if not is_lod(x):
    raise TypeError(f"Expected `{name}` to be a LoDTensor, got {type(x).__name__}.")
  if not stacked:
    check_unstacked(x, name)
  if levels is not None and x.num_levels not in levels:
    allowed = " or ".join(str(n) for n in levels)
    raise ValueError(
      f"Expected `{name}` to have {allowed} LoD level(s), got {x.num_levels}."
    )
  check_intact(x, name)
  return x
