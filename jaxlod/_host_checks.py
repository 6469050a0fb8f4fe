"""Checks of host-side data: LoD offsets, the converters' inputs, restored
pytrees, and the examples and settings of `jaxlod.data`.

Paddle's CheckLoD on offsets given by users (`check_offsets`) and stored in a
built tensor (`check_stored_lod`); padded batches, segment ids and PyTorch
PackedSequence fields turned into LoD; the state of a LoDTensor read back by
`flax.serialization`; the fields of a batch's examples and `Batcher`'s
settings. Everything here reads its data on the host and raises `TypeError`
or `ValueError` naming the argument, the index and the values. The array
and value checks these build on live in `jaxlod._checks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod._checks import (
  check_fits_device,
  check_integer,
  check_no_bools,
  check_sequence,
  host_numbers,
  is_concrete,
  is_integer_dtype,
  is_lod,
  leaf_name,
  level_array,
  static_int,
  value_text,
)

if TYPE_CHECKING:
  from jaxlod._lod import LoDTensor


# -- host-side LoD validation (Paddle's CheckLoD) ---------------------------------


def check_integer_level(
  name: str, level: int, values: Any, argument: str | None = None
) -> np.ndarray:
  """One LoD level as a 1-D int64 array; rejects non-integer input.

  Args:
    name: what the level holds (``"offsets"`` or ``"lengths"``).
    level: its index, for messages.
    values: the level.
    argument: the caller's argument holding it, named at the end of the
      message (default: `name`).
  """
  where = f" Check `{argument or name}`."
  if isinstance(values, str | bytes) or values is None or is_lod(values):
    raise TypeError(
      f"Expected LoD level {level} ({name}) to be a sequence of ints, got "
      f"{value_text(values)}.{where}"
    )
  array = level_array(values, name, level, where)
  if array.ndim != 1:
    raise ValueError(
      f"Expected LoD level {level} ({name}) to be 1-D, got shape {array.shape}.{where}"
    )
  if array.size and (
    array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer)
  ):
    bad = 0
    if np.issubdtype(array.dtype, np.floating):
      fractional = np.flatnonzero(array != np.round(array))
      bad = int(fractional[0]) if fractional.size else 0
    raise ValueError(
      f"Expected integer {name} at LoD level {level}, got dtype {array.dtype} "
      f"(index {bad}: {array[bad]!r}).{where}"
    )
  return array.astype(np.int64)


def _check_ordered(
  offsets: list[np.ndarray], where: str = "", name: str = "offsets"
) -> None:
  """Each level's offsets (named `name` in messages) start at 0 and never
  decrease."""
  for level, o in enumerate(offsets):
    if o.size == 0:
      raise ValueError(
        f"{where}LoD level {level} has no {name}; expected at least [0]."
      )
    if o[0] != 0:
      raise ValueError(
        f"{where}LoD level {level}, index 0: {name} must start at 0, got {o[0]}."
      )
    drops = np.flatnonzero(np.diff(o) < 0)
    if drops.size:
      i = int(drops[0])
      raise ValueError(
        f"{where}LoD level {level}, index {i + 1}: {name} must be "
        f"non-decreasing, got {o[i]} at index {i} then {o[i + 1]}."
      )


def check_offsets(
  offsets: Sequence[Any], num_rows: int, name: str = "offsets"
) -> list[np.ndarray]:
  """Paddle's CheckLoD, with messages naming the level, index and values.

  Args:
    offsets: one sequence of ints per level, level 0 outermost.
    num_rows: the number of rows of ``values``.
    name: what the messages call the offsets (``"row_splits"`` for
      `LoDTensor.from_row_splits`).

  Returns:
    The offsets as int64 NumPy arrays.

  Raises:
    ValueError: for an empty or non-integer level, offsets that do not start
      at 0 or decrease, or a level whose last offset is not the number of
      items of the next level (rows, for the last level).
  """
  offsets = check_sequence(offsets, name, "one sequence of offsets per level")
  if len(offsets) == 0:
    raise ValueError("Expected at least one LoD level, got none.")
  checked = [check_integer_level(name, level, o) for level, o in enumerate(offsets)]
  _check_ordered(checked, name=name)
  last_one = f"last {name.removesuffix('s')}"
  for level in range(len(checked) - 1):
    last, count = checked[level][-1], checked[level + 1].size - 1
    if last != count:
      raise ValueError(
        f"LoD level {level}: {last_one} {last} must equal the number of "
        f"sequences at level {level + 1}, which is {count}."
      )
  if checked[-1][-1] != num_rows:
    raise ValueError(
      f"LoD level {len(checked) - 1} (last): {last_one} {checked[-1][-1]} must "
      f"equal the number of rows of `values`, which is {num_rows}."
    )
  return checked


def _host_index(value: Any, name: str, where: str) -> np.ndarray:
  """An integer LoD leaf of a built tensor, read on the host."""
  if isinstance(value, jax.ShapeDtypeStruct) or not is_concrete(value):
    raise ValueError(
      f"{where}Checking a LoDTensor reads its LoD on the host: expected concrete "
      f"arrays, got {type(value).__name__} for `{name}` (not under jit, not "
      "abstract shapes)."
    )
  array = np.asarray(value)
  if not is_integer_dtype(array.dtype):
    raise ValueError(
      f"{where}Expected integer `{name}`, got dtype {np.dtype(array.dtype).name}."
    )
  return array.astype(np.int64)


def check_stored_lod(x: LoDTensor, where: str = "") -> None:
  """Every invariant of a built LoDTensor's LoD, read on the host.

  Paddle's CheckLoD on padded offsets: each level's offsets are integer,
  start at 0 and never decrease; ``num_outer`` and each level's last real
  offset fit the next count capacity; padding sequences are empty (their
  offsets repeat the last real one); the last offset fits the token
  capacity; no sequence is longer than its level's time capacity. A
  ``num_outer`` with leading axes (stacked shards) is checked shard by shard.
  The rows of ``values`` are not read.

  Args:
    x: a LoDTensor with concrete leaves.
    where: a prefix for the messages.

  Raises:
    ValueError: for the first broken invariant, naming the level, the index
      and the values.
  """
  num_outer = _host_index(x.num_outer, "num_outer", where)
  offsets = [
    _host_index(o, f"offsets[{level}]", where) for level, o in enumerate(x.offsets)
  ]
  lead = num_outer.shape
  tokens = int(jnp.shape(x.values)[len(lead)])
  for shard in np.ndindex(lead):
    at = f"{where}shard {shard}: " if lead else where
    _check_padded_lod(
      [o[shard] for o in offsets], int(num_outer[shard]), tokens, x.time_capacity, at
    )


def _check_padded_lod(
  offsets: list[np.ndarray],
  num_outer: int,
  tokens: int,
  time_capacity: tuple[int, ...],
  where: str,
) -> None:
  """`check_stored_lod` of one tensor: int64 ``[count_capacity + 1]`` offsets."""
  _check_ordered(offsets, where)
  count, above = num_outer, "`num_outer`"
  for level, o in enumerate(offsets):
    capacity = o.size - 1
    if not 0 <= count <= capacity:
      raise ValueError(
        f"{where}LoD level {level}: {above} is {count}, outside [0, {capacity}] "
        "(the level's count capacity)."
      )
    pad = np.flatnonzero(o[count + 1 :] != o[count])
    if pad.size:
      i = count + 1 + int(pad[0])
      raise ValueError(
        f"{where}LoD level {level}, index {i}: padding sequences (past the "
        f"{count} real ones) must be empty, so their offsets must repeat the "
        f"last real offset {o[count]}, got {o[i]}."
      )
    lengths = np.diff(o[: count + 1])
    if lengths.size and lengths.max() > time_capacity[level]:
      i = int(np.argmax(lengths))
      raise ValueError(
        f"{where}LoD level {level}, index {i}: a sequence of length {lengths[i]}, "
        f"more than the time capacity {time_capacity[level]}."
      )
    count, above = int(o[count]), f"the last offset of level {level}"
  if count > tokens:
    raise ValueError(
      f"{where}LoD level {len(offsets) - 1} (last): last offset {count} must be "
      f"at most the token capacity {tokens}."
    )


# -- converters' inputs: padded batches, segment ids, PackedSequence --------------


def check_padded_lengths(lengths: np.ndarray, time: int, num_sequences: Any) -> int:
  """The lengths of a padded batch ``[count, time, *features]`` (host).

  Args:
    lengths: int64 ``[count]``.
    time: the length of the time axis of the batch.
    num_sequences: how many of the `count` rows, a prefix, are real
      sequences (an integer scalar); `None` for all of them.

  Returns:
    The number of real sequences.

  Raises:
    TypeError: for a `num_sequences` that is not an integer scalar.
    ValueError: for a length outside ``[0, time]``, a `num_sequences`
      outside ``[0, count]``, or a nonzero length past `num_sequences`.
  """
  bad = np.flatnonzero((lengths < 0) | (lengths > time))
  if bad.size:
    i = int(bad[0])
    raise ValueError(
      f"LoD level 0, index {i}: length {lengths[i]} is outside [0, {time}] (the "
      "time dimension of `padded`). Check `lengths`."
    )
  count = lengths.shape[0]
  if num_sequences is None:
    return count
  n = np.asarray(num_sequences)
  if n.ndim or not is_integer_dtype(n.dtype):
    raise TypeError(
      f"Expected `num_sequences` to be an integer scalar, got {num_sequences!r}."
    )
  n = int(n)
  if not 0 <= n <= count:
    raise ValueError(
      f"Expected `num_sequences` in [0, {count}] (the rows of `padded`), got {n}."
    )
  past = np.flatnonzero(lengths[n:])
  if past.size:
    i = n + int(past[0])
    raise ValueError(
      f"LoD level 0, index {i}: length {lengths[i]} past `num_sequences` {n}; "
      "the padding slots after the real sequences must be empty."
    )
  return n


def _host_ints(value: Any, name: str, size: int, per: str) -> np.ndarray:
  """A 1-D integer argument of `size` items (host), as int64; `per` says
  what each item belongs to, for the message."""
  check_no_bools(value, name)
  array = host_numbers(value, name)
  if array.shape != (size,):
    raise ValueError(
      f"Expected `{name}` to have shape ({size},) ({per}), got {array.shape}."
    )
  if array.size:
    check_integer(array.dtype, name)
  return array.astype(np.int64)


def check_segment_ids(
  segment_ids: Any, positions: Any, rows: int, padding_id: Any
) -> np.ndarray:
  """The segments of packed rows (Grain, T5X, MaxText), checked on the host.

  Each maximal run of rows with one id other than `padding_id` is a
  segment. Padding rows come last, and an id does not come back after its
  run ends. `positions`, if given, count 0, 1, ... within each segment;
  their values at padding rows are not read.

  Args:
    segment_ids: int ``[rows]``.
    positions: int ``[rows]``, or `None`.
    rows: the rows of ``values``.
    padding_id: the id of padding rows (an int), or `None` for none.

  Returns:
    int64 ``[num_segments]``: the length of each segment, in row order.

  Raises:
    TypeError: for non-integer ids, positions or `padding_id`.
    ValueError: for a shape other than ``[rows]``, a real row after a
      padding row, an id that comes back after another id, or a position
      that does not count up from 0 in its segment; the message names the
      index and the values.
  """
  ids = _host_ints(segment_ids, "segment_ids", rows, "one per row of `values`")
  real = rows
  if padding_id is not None:
    padding_id = static_int(padding_id, "padding_id", device=False)
    pad = np.flatnonzero(ids == padding_id)
    real = int(pad[0]) if pad.size else rows
    after = np.flatnonzero(ids[real:] != padding_id)
    if after.size:
      i = real + int(after[0])
      raise ValueError(
        f"`segment_ids` index {i}: id {ids[i]} after padding (id {padding_id}) "
        f"at index {real}; padding rows must come last."
      )
  ids = ids[:real]
  starts = np.flatnonzero(np.concatenate([[real > 0], ids[1:] != ids[:-1]]))
  run_ids = ids[starts]
  _, first = np.unique(run_ids, return_index=True)
  again = np.ones(run_ids.size, bool)
  again[first] = False
  if np.any(again):
    k = int(np.flatnonzero(again)[0])
    i = int(starts[k])
    before = int(np.flatnonzero(run_ids == run_ids[k])[0])
    raise ValueError(
      f"`segment_ids` index {i}: id {ids[i]} reappears after id {ids[i - 1]} "
      f"(its segment ended at index {starts[before + 1] - 1}); each segment "
      "must be one contiguous run of rows."
    )
  lengths = np.diff(np.append(starts, real))
  if positions is not None:
    given = _host_ints(positions, "positions", rows, "one per row of `values`")[:real]
    expected = np.arange(real) - np.repeat(starts, lengths)
    bad = np.flatnonzero(given != expected)
    if bad.size:
      i = int(bad[0])
      raise ValueError(
        f"`positions` index {i}: expected {expected[i]} (the segment of id "
        f"{ids[i]} starts at index {i - expected[i]}), got {given[i]}; positions "
        "count 0, 1, ... within each segment."
      )
  return lengths


def check_batch_sizes(batch_sizes: Any, num_rows: int) -> np.ndarray:
  """A PackedSequence's ``batch_sizes`` (host), as int64 ``[time]``.

  Raises:
    TypeError: for non-integer sizes.
    ValueError: for sizes that are not 1-D, a size that is not positive, a
      size larger than the one before it, or sizes whose sum is not
      `num_rows` (the rows of ``data``); the message names the index and
      the values.
  """
  check_no_bools(batch_sizes, "batch_sizes")
  sizes = host_numbers(batch_sizes, "batch_sizes")
  if sizes.ndim != 1:
    raise ValueError(
      f"Expected `batch_sizes` to be 1-D ([time]), got shape {sizes.shape}."
    )
  if sizes.size:
    check_integer(sizes.dtype, "batch_sizes")
  sizes = sizes.astype(np.int64)
  bad = np.flatnonzero(sizes <= 0)
  if bad.size:
    i = int(bad[0])
    raise ValueError(
      f"`batch_sizes` index {i}: {sizes[i]}, expected a positive size (a "
      "PackedSequence holds no empty sequence)."
    )
  rises = np.flatnonzero(np.diff(sizes) > 0)
  if rises.size:
    i = int(rises[0]) + 1
    raise ValueError(
      f"`batch_sizes` index {i}: {sizes[i]} is more than {sizes[i - 1]} at index "
      f"{i - 1}; a PackedSequence's batch sizes never increase."
    )
  total = sum(int(n) for n in sizes)
  if total != num_rows:
    raise ValueError(f"`batch_sizes` sum to {total}, but `data` has {num_rows} rows.")
  return sizes


def _permutation(value: Any, name: str, count: int) -> np.ndarray:
  """A permutation of ``range(count)`` (host), as int64."""
  perm = _host_ints(value, name, count, "one per sequence, batch_sizes[0]")
  out = np.flatnonzero((perm < 0) | (perm >= count))
  if out.size:
    i = int(out[0])
    raise ValueError(
      f"`{name}` index {i}: {perm[i]} is outside [0, {count}); expected a "
      f"permutation of range({count})."
    )
  _, first = np.unique(perm, return_index=True)
  again = np.ones(count, bool)
  again[first] = False
  if np.any(again):
    i = int(np.flatnonzero(again)[0])
    j = int(np.flatnonzero(perm == perm[i])[0])
    raise ValueError(
      f"`{name}` index {i}: {perm[i]} repeats index {j}; expected a permutation "
      f"of range({count})."
    )
  return perm


def check_sort_indices(sorted_indices: Any, unsorted_indices: Any, count: int):
  """The rank of each original sequence of a PackedSequence (host).

  Args:
    sorted_indices: ``[count]``, the original index of the sequence at each
      rank; `None` for the inverse of `unsorted_indices`.
    unsorted_indices: ``[count]``, the rank of each original sequence;
      `None` for the inverse of `sorted_indices`. Both `None`: the identity.
    count: the number of sequences.

  Returns:
    int64 ``[count]``: the rank of each original sequence.

  Raises:
    ValueError: for indices that are not a permutation, or two that are not
      inverses; the message names the index and the values.
  """
  if sorted_indices is None and unsorted_indices is None:
    return np.arange(count)
  if sorted_indices is None:
    return _permutation(unsorted_indices, "unsorted_indices", count)
  order = _permutation(sorted_indices, "sorted_indices", count)
  ranks = np.empty(count, np.int64)
  ranks[order] = np.arange(count)
  if unsorted_indices is not None:
    given = _permutation(unsorted_indices, "unsorted_indices", count)
    bad = np.flatnonzero(given != ranks)
    if bad.size:
      i = int(bad[0])
      raise ValueError(
        f"`unsorted_indices` index {i}: {given[i]}, but `sorted_indices` puts "
        f"sequence {i} at index {ranks[i]}; expected the inverse of "
        "`sorted_indices`."
      )
  return ranks


def check_packable(lengths: np.ndarray, where: str) -> None:
  """Real lengths a PackedSequence can hold: at least one, none zero (host)."""
  if lengths.size == 0:
    raise ValueError(
      f"{where}: the tensor has no sequences; a PackedSequence holds at least one."
    )
  empty = np.flatnonzero(lengths == 0)
  if empty.size:
    i = int(empty[0])
    raise ValueError(
      f"{where}: sequence {i} is empty (length 0); a PackedSequence cannot hold "
      "empty sequences (torch forbids zero lengths)."
    )


# -- restoring serialized pytrees (flax.serialization) -----------------------------


def check_lod_restore(target: LoDTensor, saved: dict[str, Any], where: str) -> None:
  """A LoDTensor state of the target's number of levels (its time capacity
  may differ: `check_stored_lod` checks the data against the target's)."""
  time = saved["time_capacity"]
  if len(time) != target.num_levels:
    raise ValueError(
      f"{where}the state has {len(time)} LoD level(s) (time capacity {time}), "
      f"the target {target.num_levels} (time capacity {target.time_capacity})."
    )


def check_restored_lod(x: LoDTensor, saved: dict[str, Any], where: str) -> None:
  """`check_stored_lod` of a restored LoDTensor: its data against the
  target's capacities, the messages naming both time capacities."""
  check_stored_lod(
    x,
    f"{where}time capacity {saved['time_capacity']} saved, {x.time_capacity} in "
    "the target; ",
  )


def check_same_static(target: Any, saved: dict[str, Any], where: str) -> None:
  """Every static field of the state equals the target's."""
  for name, value in saved.items():
    if value != getattr(target, name):
      raise ValueError(
        f"{where}the state has {name}={value!r}, the target "
        f"{name}={getattr(target, name)!r}; restore into a target with the "
        "saved value."
      )


def check_restored_shapes(target: Any, restored: Any, where: str) -> None:
  """Every leaf of `restored` has the shape of the target's leaf."""
  pairs = zip(
    jax.tree_util.tree_leaves_with_path(restored),
    jax.tree.leaves(target),
    strict=True,
  )
  for (path, new), old in pairs:
    if jnp.shape(new) != jnp.shape(old):
      raise ValueError(
        f"{where}the state's leaf {leaf_name(path)} has shape {jnp.shape(new)}, the "
        f"target's {jnp.shape(old)} (the capacities or feature shapes differ)."
      )


# -- host-side batching (jaxlod.data) ----------------------------------------------


def check_tables(tables: Any, num_fields: int) -> tuple[bool, ...]:
  """One bool per field from `Batcher`'s ``tables`` argument."""
  if isinstance(tables, bool | np.bool_):
    return (bool(tables),) * num_fields
  if isinstance(tables, str) or not isinstance(tables, Sequence):
    raise TypeError(
      f"Expected `tables` to be a bool or a sequence of bools, got {tables!r}."
    )
  if len(tables) != num_fields:
    raise ValueError(
      f"Expected `tables` to be a bool or one bool per field ({num_fields}), "
      f"got {len(tables)} entries."
    )
  for f, keep in enumerate(tables):
    if not isinstance(keep, bool | np.bool_):
      raise TypeError(f"Expected `tables[{f}]` to be a bool, got {keep!r}.")
  return tuple(bool(keep) for keep in tables)


def check_int(name: str, value: Any, minimum: int) -> int:
  """A host-side int setting (`jaxlod.data`), at least `minimum`."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(f"Expected `{name}` to be an int >= {minimum}, got {value!r}.")
  if value < minimum:
    raise ValueError(f"Expected `{name}` to be an int >= {minimum}, got {value}.")
  return int(value)


def check_shards(
  shards: Any, process_index: Any, process_count: Any
) -> tuple[int | None, range | None]:
  """The global shard count and this process's shards, checked."""
  if shards is None:
    for name, value in (
      ("process_index", process_index),
      ("process_count", process_count),
    ):
      if value is not None:
        raise ValueError(
          f"Expected `{name}` to be None without `shards`, got {value!r}; set "
          "`shards` to build sharded batches."
        )
    return None, None
  shards = check_int("shards", shards, 1)
  if process_count is None:
    process_count = jax.process_count()
  process_count = check_int("process_count", process_count, 1)
  if process_index is None:
    process_index = jax.process_index()
  process_index = check_int("process_index", process_index, 0)
  if process_index >= process_count:
    raise ValueError(
      f"Expected `process_index` in [0, {process_count}) (the process count), "
      f"got {process_index}."
    )
  if shards % process_count:
    raise ValueError(
      f"Expected `shards` ({shards}) to be a multiple of the process count "
      f"({process_count})."
    )
  local = shards // process_count
  return shards, range(process_index * local, (process_index + 1) * local)


# -- a batching field's examples (jaxlod.data) --------------------------------------

_KINDS = {"b": "bool", "i": "integer", "u": "integer", "f": "float", "c": "complex"}


def check_field_dtypes(f: int, arrays: Sequence[np.ndarray], indices, name) -> None:
  """The examples of field `f` (`arrays[i]` for each i of `indices`) share a
  kind of dtype: an int field is never turned into floats by one float
  example (nor int64 with uint64 into float64). Dtypes that are not numbers
  are left to the caller.

  Args:
    f: the field.
    arrays: every example's array of the field.
    indices: the examples whose dtypes count (the non-empty ones).
    name: example ``i``'s name in messages, ``name(i)``.

  Raises:
    TypeError: naming the field, two examples and their dtypes.
  """
  first: dict[str, int] = {}
  for i in indices:
    kind = _KINDS.get(arrays[i].dtype.kind)
    if kind is None:
      return
    first.setdefault(kind, i)
  if len(first) > 1:
    i, j = list(first.values())[:2]
  else:
    dtypes = {arrays[i].dtype for i in indices}
    if len(dtypes) < 2 or _KINDS[np.result_type(*dtypes).kind] in first:
      return
    i = indices[0]
    j = next(k for k in indices if arrays[k].dtype != arrays[i].dtype)
  raise TypeError(
    f"Expected the examples of field {f} to share a kind of dtype, got "
    f"{arrays[i].dtype} in example {name(i)} (`examples[{i}][{f}]`) and "
    f"{arrays[j].dtype} in example {name(j)} (`examples[{j}][{f}]`), which "
    f"would be promoted to {np.result_type(arrays[i].dtype, arrays[j].dtype)}; "
    "cast the field's examples to one dtype."
  )


def check_field_fits_device(
  f: int, arrays: Sequence[np.ndarray], values: np.ndarray, name
) -> None:
  """The packed rows `values` of field `f` fit the dtype JAX stores them in
  (`check_fits_device`); if not, raises naming the first example of
  `arrays` that does not."""
  try:
    check_fits_device(values, "values")
  except ValueError:
    for i, a in enumerate(arrays):
      try:
        check_fits_device(a, f"examples[{i}][{f}]")
      except ValueError as error:
        raise ValueError(f"Field {f} of example {name(i)}: {error}") from None
    raise
