"""The LoD checks: the rows, sequences, offsets, lengths and row splits given
to `LoDTensor`'s builders, the LoD stored in a built `LoDTensor`, padded
batches and segment ids turned into LoD, two tensors of one LoD, and the
state of a LoDTensor read back by `flax.serialization`.

Paddle's CheckLoD on host data raises `TypeError` or `ValueError` naming the
level, the index and both values; the per-sequence arguments and fills of
the ops on a LoDTensor are checked here too. `jaxlod._lod` builds on these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod._checks import (
  all_hold,
  check_dtype,
  check_index_leaves,
  check_sequence,
  is_concrete,
  is_integer_dtype,
  require,
  static_int,
  value_text,
)
from jaxlod._host import (
  as_array,
  as_int64,
  cast_exactly,
  check_fits_device,
  fill_value,
  host_array,
  host_ints,
  host_numbers,
  is_structure,
  level_array,
)

# -- per-sequence arguments and fills --------------------------------------------


def check_lengths_fit(
  lengths: jax.Array,
  time: int,
  where: str,
  limit: str = "the requested time capacity",
) -> None:
  """No length exceeds `time` (eager `ValueError`, `checkify` under `jit`).

  Args:
    lengths: int ``[count]``.
    time: the static bound.
    where: the caller, first in the message.
    limit: names the bound in the message.
  """
  longest = jnp.max(jnp.asarray(lengths), initial=0)
  require(
    longest <= time,
    f"{where}: the longest sequence has {{longest}} rows, more than {limit} "
    f"{time}; data is never truncated.",
    traced=f"{where}: a sequence is longer than {limit} {time}; data is never "
    "truncated.",
    longest=longest,
  )


def check_same_lod(x: Any, y: Any, x_name: str, y_name: str, where: str) -> Any:
  """`y` has the LoD of `x`, as an op reading both row by row needs: the same
  capacities (static; a `ValueError`) and offsets (`require`; not for one
  array, as `with_values` keeps: a check is an effect under `jit`). Returns
  the outcome, for the op to poison its result and record `Fault.INPUT`."""
  sizes = [(t.capacity.tokens, t.capacity.sequences) for t in (x, y)]
  if sizes[0] != sizes[1]:
    raise ValueError(
      f"Expected `{y_name}` to have the LoD of `{x_name}`; `{x_name}` has "
      f"capacity {x.capacity}, `{y_name}` {y.capacity} (tokens and sequences "
      "must agree)."
    )
  return all_hold(
    *(
      a is b
      or require(
        jnp.array_equal(a, b),
        f"Expected `{y_name}` to have the LoD of `{x_name}`; at level {level} "
        f"`{y_name}` has offsets {{b}}, `{x_name}` {{a}}.",
        traced=f"{where}: Expected `{y_name}` to have the LoD of `{x_name}`; they "
        f"differ at level {level}.",
        a=a,
        b=b,
      )
      for level, (a, b) in enumerate(zip(x.offsets, y.offsets, strict=True))
    )
  )


def check_level(x: Any, level: int, name: str) -> int:
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
  array = as_array(value, name)
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


def check_pad_value(pad_value: jax.typing.ArrayLike, x: Any) -> jax.Array:
  """`pad_value` broadcast to ``[*features]`` of `x`, in the values' dtype
  (`fill_value`: an integer dtype holds it exactly)."""
  pad = fill_value(pad_value, x.values.dtype, "pad_value")
  try:
    return jnp.broadcast_to(pad, x.feature_shape)
  except ValueError:
    raise ValueError(
      f"Expected `pad_value` to be a scalar or to broadcast to the feature shape "
      f"{x.feature_shape}, got shape {pad.shape}."
    ) from None


# -- the rows and sequences given to the builders --------------------------------


def check_values(values: Any) -> np.ndarray:
  """The rows ``[rows, *features]`` given to a `LoDTensor` builder, as a
  NumPy array of numbers that JAX can store (host)."""
  array = host_numbers(values, "values")
  check_fits_device(array, "values")
  if array.ndim == 0:
    raise ValueError(
      "Expected `values` to have rank >= 1 ([rows, *features]), got a scalar "
      f"of dtype {array.dtype}."
    )
  return array


def check_sequences(seqs: Any, dtype: Any) -> tuple[np.ndarray, list[list[int]]]:
  """The sequences of `LoDTensor.from_sequences` as packed rows and their
  length-based LoD (host).

  Args:
    seqs: a list (or any iterable, read once) of arrays ``[length_i,
      *features]`` (one level), or of lists of such arrays (two levels). A
      list of numbers counts as one 1-D sequence.
    dtype: dtype of the rows, a number or bool dtype; inferred from the
      data when `None` (NumPy's promotion, but integer sequences must
      promote to an integer: int64 with uint64 would give float64).

  Returns:
    ``(values [rows, *features], recursive_lengths)``.

  Raises:
    TypeError: for an array, or a `seqs` that is not a list of sequences; a
      `dtype` that is not a number or bool dtype; integer sequences that
      NumPy promotes to a float.
    ValueError: for a scalar sequence, sequences that disagree in feature
      shape, or a value that the cast to `dtype` would change, not merely
      round (`cast_exactly`: 300 in int8, 1.5 in an int, 1e5 in float16).
  """
  if isinstance(seqs, np.ndarray | jax.Array):
    raise TypeError(
      "Expected `seqs` to be a list of sequences, got an array; use "
      "`from_padded` or `from_lengths` for arrays."
    )
  if not isinstance(seqs, Iterable) or isinstance(seqs, str | bytes):
    raise TypeError(
      f"Expected `seqs` to be a list of sequences, got {type(seqs).__name__}."
    )
  check_dtype(dtype, "dtype")
  if dtype is not None:
    dtype = jnp.dtype(dtype)
    if not (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)):
      raise TypeError(f"Expected `dtype` to be a number or bool dtype, got {dtype}.")
  seqs = list(seqs)  # read once: a generator would be empty on a second pass
  two_levels = any(_is_nested(s) for s in seqs)
  if two_levels:
    for i, group in enumerate(seqs):
      if not isinstance(group, list | tuple):
        raise ValueError(
          f"Expected item {i} of a two-level `seqs` to be a list of sequences, "
          f"got {type(group).__name__}."
        )
  inner = [list(s) for s in seqs] if two_levels else [list(seqs)]
  names = [
    f"seqs[{g}][{j}]" if two_levels else f"seqs[{j}]"
    for g, group in enumerate(inner)
    for j in range(len(group))
  ]
  sequences = (x for group in inner for x in group)
  flat = [host_array(x, name) for name, x in zip(names, sequences, strict=True)]
  for i, x in enumerate(flat):
    host_numbers(x, "values", where=f" in `seqs`, sequence {i}")
    if x.ndim == 0:
      raise ValueError(
        f"Expected sequence {i} to have rank >= 1 ([length, *features]), got a scalar."
      )
  values = _packed_rows(flat, names, dtype)
  lengths = [[x.shape[0] for x in flat]]
  if two_levels:
    lengths.insert(0, [len(group) for group in inner])
  return values, lengths


def _packed_rows(flat: list[np.ndarray], names: list[str], dtype: Any) -> np.ndarray:
  """The sequences `flat` (``[length_i, *features]``, named `names`) as rows
  ``[rows, *features]`` of `dtype`, inferred for `None` (else cast exactly)."""
  features = {x.shape[1:] for x in flat if x.shape[0] > 0}
  features = features or {x.shape[1:] for x in flat}
  if len(features) > 1:
    shown = [i for i, x in enumerate(flat) if x.shape[0] > 0] or range(len(flat))
    first = shown[0]
    bad = next(i for i in shown if flat[i].shape[1:] != flat[first].shape[1:])
    raise ValueError(
      "Expected every sequence to have the same feature shape, got "
      f"{sorted(features)}: `{names[bad]}` has {flat[bad].shape[1:]}, "
      f"`{names[first]}` {flat[first].shape[1:]}."
    )
  feature_shape = features.pop() if features else ()
  if dtype is None:
    dtype = _inferred_dtype(flat, names)
  else:
    pairs = zip(names, flat, strict=True)
    flat = [cast_exactly(x, dtype, "seqs", name) for name, x in pairs]
  rows = [x.reshape((x.shape[0], *feature_shape)) for x in flat]
  if not rows:
    return np.zeros((0, *feature_shape), dtype)
  return np.concatenate(rows, axis=0).astype(dtype)


def _inferred_dtype(flat: list[np.ndarray], names: list[str]) -> np.dtype:
  """The sequences' dtype: NumPy's promotion of the non-empty ones' (empty
  sequences count only when all are: empty int arrays stay int), float32
  for none. Integer sequences must promote to an integer: NumPy promotes
  int64 with uint64 to float64, which rounds integers beyond 2**53.

  Raises:
    TypeError: naming a signed and an unsigned sequence whose dtypes NumPy
      promotes to a float.
  """
  typed = [i for i, x in enumerate(flat) if x.size] or range(len(flat))
  if not typed:
    return np.dtype(np.float32)
  dtype = np.result_type(*(flat[i].dtype for i in typed))
  ints = [i for i in typed if is_integer_dtype(flat[i].dtype)]
  bools = sum(flat[i].dtype == np.bool_ for i in typed)
  if ints and len(ints) + bools == len(typed) and not is_integer_dtype(dtype):
    i = next((i for i in ints if jnp.iinfo(flat[i].dtype).min < 0), ints[0])
    j = next((j for j in ints if jnp.iinfo(flat[j].dtype).min == 0), ints[-1])
    raise TypeError(
      "Expected the integer sequences of `seqs` to promote to an integer dtype, "
      f"got {flat[i].dtype} at `{names[i]}` and {flat[j].dtype} at `{names[j]}`, "
      f"which NumPy promotes to {dtype} (rounding integers beyond 2**53); pass "
      "`dtype` or cast them to one dtype."
    )
  return dtype


def _is_nested(seq: Any) -> bool:
  """True for a list whose items are sequences (arrays or lists), not numbers."""
  if isinstance(seq, np.ndarray | jax.Array) or not isinstance(seq, list | tuple):
    return False
  return any(isinstance(item, list | tuple | np.ndarray | jax.Array) for item in seq)


# -- offsets and lengths ---------------------------------------------------------


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
  if isinstance(values, str | bytes) or values is None or is_structure(values):
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
  return as_int64(array, f"{name} at LoD level {level}", where)


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


def lengths_to_offsets(
  recursive_lengths: Sequence[Any], argument: str = "recursive_lengths"
) -> list[np.ndarray]:
  """Paddle's length-based LoD as offsets: one int64 array per level (host).

  Args:
    recursive_lengths: one sequence of lengths per level.
    argument: the caller's name for it, in messages.

  Raises:
    TypeError, ValueError: for a level that is not 1-D integer, or a
      negative length.
  """
  offsets = []
  for level, lengths in enumerate(recursive_lengths):
    lengths = check_integer_level("lengths", level, lengths, argument)
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
      i = int(negative[0])
      raise ValueError(
        f"LoD level {level}, index {i}: length {lengths[i]} is negative."
      )
    # Offsets live in int32 on the device (and an int64 cumsum can wrap):
    # sum exactly in Python ints first.
    total = sum(int(n) for n in lengths)
    if total > np.iinfo(np.int32).max:
      raise ValueError(
        f"LoD level {level}: the lengths sum to {total}, over the int32 "
        f"offsets' limit {np.iinfo(np.int32).max}."
      )
    offsets.append(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
  return offsets


def check_row_splits(row_splits: Any, num_rows: int) -> list[np.ndarray]:
  """`tf.RaggedTensor`'s nested row splits (`LoDTensor.from_row_splits`) as
  checked offsets: `check_offsets` of a list of levels, or of one level
  given as a 1-D array or a flat list of ints."""
  if isinstance(row_splits, np.ndarray | jax.Array) and row_splits.ndim == 1:
    row_splits = [row_splits]
  row_splits = check_sequence(row_splits, "row_splits", "a list of 1-D arrays")
  if row_splits and all(_is_scalar(s) for s in row_splits):
    row_splits = [row_splits]  # one level as a flat list, tuple or generator
  return check_offsets(row_splits, num_rows, name="row_splits")


def _is_scalar(value: Any) -> bool:
  """A Python or NumPy number, or a 0-d array: one split, not a level."""
  if isinstance(value, np.ndarray | jax.Array):
    return value.ndim == 0
  return isinstance(value, int | float | np.generic)


# -- the LoD of a built LoDTensor ------------------------------------------------


def is_array(value: Any) -> bool:
  """An array or a shape struct: a leaf the checks of a built LoDTensor read
  (not an axis spec or `None` that a transformation put there)."""
  return isinstance(value, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def check_fields(x: Any) -> None:
  """The shapes of a LoDTensor's fields, as its constructor checks them.

  Only array leaves are checked (`LoDTensor.__post_init__` runs on whatever
  a transformation put in the leaves); a ``num_outer`` with leading axes
  allows the same leading axes on the other leaves.

  Raises:
    ValueError: for no levels, not one time capacity per level, a scalar
      ``values``, or offsets not of shape ``[count_capacity + 1]``.
    TypeError: for offsets, ``num_outer`` or ``faults`` that are not integer
      (`check_index_leaves`).
  """
  offsets, time_capacity = x.offsets, x.time_capacity
  if len(offsets) == 0:
    raise ValueError("Expected at least one LoD level, got none.")
  if len(time_capacity) != len(offsets):
    raise ValueError(
      f"Expected one time capacity per level ({len(offsets)}), got {time_capacity}."
    )
  lead = len(x.num_outer.shape) if is_array(x.num_outer) else 0
  if is_array(x.values) and len(x.values.shape) <= lead:
    raise ValueError(
      "Expected `values` to have rank >= 1 ([rows, *features]), got a scalar."
    )
  for level, o in enumerate(offsets):
    if is_array(o) and (len(o.shape) != lead + 1 or o.shape[-1] < 1):
      raise ValueError(
        f"Expected offsets of level {level} to have shape [count_capacity + 1], "
        f"got {tuple(o.shape)}."
      )
  check_index_leaves(
    [(f"offsets of level {i}", o) for i, o in enumerate(offsets)]
    + [("num_outer", x.num_outer), ("faults", x.faults)],
    "the LoD is integer data, so a tree map over a LoDTensor must leave it "
    "alone (cast the rows with `x.astype(dtype)`).",
  )


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


def check_stored_lod(x: Any, where: str = "") -> None:
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


def check_unstacked(x: Any, name: str | None = None) -> None:
  """`x` is one LoDTensor or RankTable, not shards stacked on leading axes
  (its `stack_shape`: a `Batcher(shards=S)` batch's fields and tables).

  Args:
    x: a LoDTensor or a RankTable.
    name: the argument `x` was given as; `None` for a method's own `x`.
  """
  stack = x.stack_shape
  if not stack:
    return
  shards, kind = int(np.prod(stack)), type(x).__name__
  got = (
    f"Expected `{name}` to be one {kind}, got {shards} shards"
    if name
    else f"This {kind} holds {shards} shards"
  )
  raise ValueError(
    f"{got} stacked on leading axes {stack} (from a `Batcher(shards={shards})` "
    "batch): ops and reads of the LoD run on one shard. Take one with "
    "`jaxlod.parallel.unstack(...)[s]`, or run on every shard with "
    "`jaxlod.parallel.data_parallel` or `map_shards`."
  )


def check_intact(x: Any, name: str | None = None) -> None:
  """With concrete LoD leaves (eagerly), every invariant `validate` checks:
  a LoD that a tree map or a hand edit broke (offsets past the rows, say)
  raises here rather than giving wrong lengths or sums. Under `jit` the
  leaves are traced and nothing is read."""
  leaves = (x.num_outer, *x.offsets)
  if all(isinstance(a, jax.Array | np.ndarray) for a in leaves) and is_concrete(
    *leaves
  ):
    check_stored_lod(x, f"`{name}`: " if name else "")


# -- padded batches and packed rows turned into LoD ------------------------------


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


def check_padded(
  padded: Any, lengths: Any, num_sequences: Any
) -> tuple[np.ndarray, np.ndarray]:
  """A padded batch (`LoDTensor.from_padded`) as the packed rows of its real
  sequences and their lengths (host).

  Args:
    padded: ``[count, time, *features]``.
    lengths: ``[count]`` integer lengths.
    num_sequences: how many of the `count` sequences are real, or `None`
      (`check_padded_lengths`).

  Returns:
    ``(rows [sum(lengths), *features], lengths [num_sequences])``.
  """
  padded = host_numbers(padded, "padded")
  check_fits_device(padded, "padded")
  if padded.ndim < 2:
    raise ValueError(
      f"Expected `padded` to have rank >= 2 ([count, time, *features]), got "
      f"shape {padded.shape}."
    )
  lengths = check_integer_level("lengths", 0, lengths, "lengths")
  if lengths.shape[0] != padded.shape[0]:
    raise ValueError(
      f"Expected `lengths` to have shape ({padded.shape[0]},) (one per "
      f"sequence of `padded`), got {lengths.shape}."
    )
  count = check_padded_lengths(lengths, padded.shape[1], num_sequences)
  lengths, padded = lengths[:count], padded[:count]
  mask = np.arange(padded.shape[1])[None, :] < lengths[:, None]
  return padded[mask], lengths


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
  ids = host_ints(segment_ids, "segment_ids", rows, "one per row of `values`")
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
    given = host_ints(positions, "positions", rows, "one per row of `values`")[:real]
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


# -- a LoDTensor read back by `flax.serialization` -------------------------------


def check_lod_restore(target: Any, saved: dict[str, Any], where: str) -> None:
  """A LoDTensor state of the target's number of levels (its time capacity
  may differ: `check_stored_lod` checks the data against the target's)."""
  time = saved["time_capacity"]
  if len(time) != target.num_levels:
    raise ValueError(
      f"{where}the state has {len(time)} LoD level(s) (time capacity {time}), "
      f"the target {target.num_levels} (time capacity {target.time_capacity})."
    )


def check_restored_lod(x: Any, saved: dict[str, Any], where: str) -> None:
  """`check_stored_lod` of a restored LoDTensor: its data against the
  target's capacities, the messages naming both time capacities."""
  check_stored_lod(
    x,
    f"{where}time capacity {saved['time_capacity']} saved, {x.time_capacity} in "
    "the target; ",
  )
