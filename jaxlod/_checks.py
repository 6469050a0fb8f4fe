"""Argument and value checks shared by jaxlod's builders, ops, nn and data.

The one home of validation. Checks of static things (types, ranks, dtypes,
capacities, pytree structures) raise at trace time and name the argument,
the expected and the actual value. Checks of values go through `require` or
`require_each`: eagerly they raise `ValueError`, under `jit` they become
`jax.experimental.checkify` checks (no-ops unless the caller is wrapped in
`checkify.checkify`). `unchecked` drops them from a function to export.

Example:
  >>> import numpy as np
  >>> from jaxlod._checks import require
  >>> require(np.array([1, 2]) > 0, "fine")
  True
  >>> require(np.int32(5) <= 4, "{n} rows, more than 4", n=np.int32(5))
  Traceback (most recent call last):
  ...
  ValueError: 5 rows, more than 4
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

# `_lod` imports this module: its classes are read at call time, `_lod.LoDTensor`.
from jaxlod import _lod

if TYPE_CHECKING:
  from jaxlod._lod import Capacity, LoDTensor
  from jaxlod.ops._attention import Memory
  from jaxlod.ops._rank import RankTable


def is_concrete(*arrays: Any) -> bool:
  """True when no array is a tracer, so its values can be read on the host."""
  return not any(isinstance(a, jax.core.Tracer) for a in arrays)


# -- value checks: eager `ValueError`, `checkify` under jit ----------------------


def _host(value: Any) -> Any:
  """A host value for a message: a Python scalar, or a list for an array."""
  return np.asarray(value).tolist()


def _named(message: str, fields: dict[str, Any]) -> dict[str, Any]:
  """The `fields` that `message` formats (checkify takes them as operands)."""
  names = {
    re.split(r"[.[]", name)[0]
    for _, name, _, _ in string.Formatter().parse(message)
    if name
  }
  return {k: v for k, v in fields.items() if k in names}


def require(ok: Any, message: str, *, traced: str | None = None, **fields: Any):
  """Every item of `ok` must be True: eagerly a `ValueError`, under `jit` a
  `jax.experimental.checkify` check.

  Args:
    ok: a bool (Python, NumPy or JAX, any shape).
    message: the error message. With `fields`, a format string: each
      ``{name}`` is replaced by the value of ``fields[name]`` (a Python
      scalar, or a list for an array).
    traced: the message under `jit`, formatted the same way at run time;
      defaults to `message`. Give one when `message` names values the
      traced check does not pass.
    **fields: arrays or Python scalars named in the messages.

  Returns:
    Whether every item of `ok` holds: `True` eagerly (or it raised), a bool
    scalar under `jit`, for an op to record a `jaxlod.Fault` in its result.

  Raises:
    ValueError: when `ok` and `fields` are concrete and an item of `ok` is
      False. Under `jit` the check is `checkify.debug_check`: a no-op
      unless the caller is wrapped in `checkify.checkify`, and an effect
      that `jax.export` cannot serialize (see `unchecked`).
  """
  if is_concrete(ok, *fields.values()):
    if not bool(np.all(np.asarray(ok))):
      if fields:
        message = message.format(**{k: _host(v) for k, v in fields.items()})
      raise ValueError(message)
    return True
  message = traced or message
  holds = jnp.all(ok)
  checkify.debug_check(holds, message, **_named(message, fields))
  return holds


def require_each(bad: Any, message: str, *, traced: str | None = None, **values: Any):
  """No item of the 1-D mask `bad` may be True.

  Args:
    bad: bool ``[n]``.
    message: a format string naming the first bad item: ``{i}`` is its
      index and each ``{name}`` of `values` its value there.
    traced: the message under `jit`, formatted the same way at run time;
      defaults to `message`.
    **values: arrays ``[n]``, or scalars (the same value for every item).

  Returns:
    Whether no item is bad: `True` eagerly (or it raised), a bool scalar
    under `jit` (see `require`).

  Raises:
    ValueError: eagerly, for the first bad item. Under `jit` a
      `jax.experimental.checkify` check with the same message.
  """
  bad = jnp.asarray(bad)
  if bad.shape[0] == 0:
    return True
  if is_concrete(bad, *values.values()):
    hits = np.flatnonzero(np.asarray(bad))
    if hits.size:
      i = int(hits[0])
      fields = {
        k: _host(np.asarray(v)[i] if np.ndim(v) else v) for k, v in values.items()
      }
      raise ValueError(message.format(i=i, **fields))
    return True
  message = traced or message
  i = jnp.argmax(bad)
  fields = {
    k: jnp.asarray(v)[i] if jnp.ndim(v) else jnp.asarray(v)
    for k, v in _named(message, values).items()
  }
  holds = ~jnp.any(bad)
  checkify.debug_check(holds, message, **_named(message, {"i": i, **fields}))
  return holds


def unchecked(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` without its `checkify` checks, so that `jax.export` can serialize it.

  Under `jit`, jaxlod checks data through `checkify.debug_check`, and each
  check leaves an effect in the traced program that
  ``jax.export.Exported.serialize`` refuses ("must have a nullary
  constructor"). `unchecked` runs `fn` under `checkify.checkify` and drops
  the error it returns: no check is left in the program, jaxlod's or
  `fn`'s own. What a failed check also does stays: the op records a
  `jaxlod.Fault` in the ``faults`` of its LoDTensor results (host reads of
  them raise), and a rank table of another batch makes float results NaN.

  Args:
    fn: a function of pytrees of arrays (LoDTensors, rank tables, params).

  Returns:
    A function with `fn`'s arguments and results, to wrap in `jax.jit` and
    export: ``jax.export.export(jax.jit(jaxlod.unchecked(fn)))(*args)``.
    Called, it always traces `fn`, so the eager checks of concrete inputs
    become traced ones too.

  Example:
    >>> import jax, numpy as np
    >>> from jaxlod import LoDTensor, unchecked
    >>> from jaxlod.ops import lod_to_array, rank_table
    >>> x = LoDTensor.from_lengths(np.arange(1.0, 6.0), [[2, 3]])
    >>> exported = jax.export.export(jax.jit(unchecked(lod_to_array)))(
    ...   x, rank_table(x)
    ... )
    >>> call = jax.export.deserialize(exported.serialize())
    >>> call.call(x, rank_table(x)).tolist()
    [[3.0, 1.0], [4.0, 2.0], [5.0, 0.0]]
    >>> other = LoDTensor.from_lengths(np.ones(5), [[3, 2]])  # another batch
    >>> bool(np.isnan(call.call(x, rank_table(other))).all())
    True
  """
  check_callable(fn, "fn")

  @functools.wraps(fn)
  def run(*args: Any, **kwargs: Any) -> Any:
    _, out = checkify.checkify(fn)(*args, **kwargs)
    return out

  return run


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


def check_fits(real: Capacity, capacity: Capacity, where: str) -> None:
  """Every real size is at most its capacity (eager `ValueError` or checkify).

  Args:
    real: the real sizes: Python ints (eager) or int32 scalars (jit).
    capacity: the static capacities.
    where: the op's name, for messages.
  """
  sizes = [("tokens", real.tokens, capacity.tokens)]
  for level, (r, c) in enumerate(zip(real.sequences, capacity.sequences, strict=True)):
    sizes.append((f"sequences at level {level}", r, c))
  for level, (r, c) in enumerate(zip(real.time, capacity.time, strict=True)):
    sizes.append((f"time (longest sequence) at level {level}", r, c))
  for what, size, cap in sizes:
    require(
      size <= cap,
      f"{where}: the output needs {what} {{size}}, more than its capacity {cap}; "
      "data is never truncated. Pass a larger `capacity`.",
      traced=f"{where}: the output needs more {what} than its capacity {cap}; "
      "pass a larger `capacity`.",
      size=size,
    )


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
      f"{_got(values)}.{where}"
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


# -- arguments of the ops ----------------------------------------------------------


def is_lod(x: Any) -> bool:
  """True for a LoDTensor (an ``is_leaf`` for pytrees of LoDTensors)."""
  return isinstance(x, _lod.LoDTensor)


def check_lod(x: Any, name: str, *, levels: Sequence[int] | None = None) -> LoDTensor:
  """`x` must be a LoDTensor, with one of the allowed numbers of levels."""
  if not is_lod(x):
    raise TypeError(f"Expected `{name}` to be a LoDTensor, got {type(x).__name__}.")
  if levels is not None and x.num_levels not in levels:
    allowed = " or ".join(str(n) for n in levels)
    raise ValueError(
      f"Expected `{name}` to have {allowed} LoD level(s), got {x.num_levels}."
    )
  return x


def is_float_dtype(dtype: Any) -> bool:
  """JAX's float test: NumPy's misses ``bfloat16`` and the other ml_dtypes."""
  return bool(jnp.issubdtype(dtype, jnp.inexact))


def is_integer_dtype(dtype: Any) -> bool:
  """JAX's integer test (``int4`` included); `bool` is not an integer."""
  return bool(jnp.issubdtype(dtype, jnp.integer))


def host_numbers(value: Any, name: str, where: str = "") -> np.ndarray:
  """`value` as a NumPy array of numbers (or bools); strings, objects and
  Python ints too large for NumPy raise naming `name` (`where`, e.g.
  ``" in `seqs`, sequence 0"``, ends the type error's message)."""
  if is_lod(value):
    raise TypeError(f"Expected `{name}` to be an array, got LoDTensor.")
  try:
    array = host_array(value, name)
  except OverflowError as error:
    raise ValueError(
      f"Expected `{name}` to hold integers within int64: {error}."
    ) from None
  if isinstance(value, int) and array.dtype == object:
    raise ValueError(f"Expected `{name}` to fit int64, got {value}.")
  # JAX's test: NumPy files bfloat16, int4 and the other ml_dtypes as void.
  if not (array.dtype == np.bool_ or jnp.issubdtype(array.dtype, jnp.number)):
    got = f"dtype {array.dtype}"
    if array.dtype == object and array.ndim == 0:
      got = type(value).__name__
    raise TypeError(f"Expected `{name}` to hold numbers, got {got}{where}.")
  return array


def as_array(value: Any, name: str, expected: str = "an array") -> jax.Array:
  """An array argument as a `jax.Array`, checked at the boundary.

  Device arrays and tracers pass unchanged. A LoDTensor, a string, `None`
  or another object, and arrays of strings or objects raise `TypeError`
  naming `name` (`expected` describes what it should be); Python ints too
  large for int64, and host integers beyond the dtype JAX stores them in
  (`check_fits_device`), raise `ValueError`.
  """
  if isinstance(value, jax.Array):
    return value
  if _holds_tracers(value):
    return jnp.asarray(value)  # a list of traced scalars: JAX checks them
  _check_fits(_host_array(value, name, expected), name)
  return jnp.asarray(value)  # of the value: Python scalars stay weakly typed


def _host_array(value: Any, name: str, expected: str) -> np.ndarray:
  """An array-like host argument as a NumPy array of numbers (`as_array`'s
  type checks)."""
  array_like = hasattr(value, "__array__") or isinstance(
    value, list | tuple | np.ndarray | np.generic | int | float | complex
  )
  if not array_like:
    raise TypeError(f"Expected `{name}` to be {expected}, got {type(value).__name__}.")
  return host_numbers(value, name)


def _holds_tracers(value: Any) -> bool:
  """A list or tuple with traced leaves (they have no host values)."""
  return isinstance(value, list | tuple) and not is_concrete(*jax.tree.leaves(value))


def check_fits_device(value: Any, name: str) -> None:
  """Host integers must fit the dtype JAX stores them in: with x64 off, int64
  becomes int32 and a value beyond its range would wrap silently.

  Device arrays, tracers and shape structs are already stored (or have no
  values); they are not checked.
  """
  if isinstance(value, jax.Array | jax.ShapeDtypeStruct) or _holds_tracers(value):
    return
  _check_fits(host_numbers(value, name), name)


def _check_fits(array: np.ndarray, name: str) -> None:
  """`check_fits_device` of a host array."""
  if not is_integer_dtype(array.dtype) or array.size == 0:
    return
  target = jax.dtypes.canonicalize_dtype(array.dtype)
  if target == array.dtype:
    return
  info = np.iinfo(target)
  bad = np.flatnonzero((array < info.min) | (array > info.max))
  if bad.size:
    where = np.unravel_index(int(bad[0]), array.shape)
    at = f" at index {tuple(int(i) for i in where)}" if array.ndim else ""
    raise ValueError(
      f"Expected `{name}` to fit {np.dtype(target).name} (the dtype JAX stores "
      f"it in with jax_enable_x64 off), got {array[where]}{at}; enable x64 "
      "or use smaller values."
    )


def check_integer(dtype: Any, name: str) -> None:
  """Integer ops (ids, lengths, indices) reject float and bool arrays."""
  if not is_integer_dtype(dtype):
    raise TypeError(
      f"Expected `{name}` to have an integer dtype, got {np.dtype(dtype)}."
    )


def check_float(dtype: Any, name: str) -> None:
  """Float ops (pooling, softmax, convolution) reject integer arrays."""
  if not is_float_dtype(dtype):
    raise TypeError(f"Expected `{name}` to have a float dtype, got {np.dtype(dtype)}.")


def check_bool(value: Any, name: str) -> bool:
  """A static flag: a Python or NumPy bool (not a truthy object)."""
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"Expected `{name}` to be a bool, got {_got(value)}.")
  return bool(value)


def check_bools(**flags: Any) -> None:
  """Every keyword argument is a bool (`check_bool`), named by its keyword."""
  for name, value in flags.items():
    check_bool(value, name)


def check_callable(value: Any, name: str) -> Any:
  """A function argument (a step, a cell, a projection) must be callable."""
  if not callable(value):
    raise TypeError(f"Expected `{name}` to be callable, got {type(value).__name__}.")
  return value


def check_dtype(dtype: Any, name: str) -> None:
  """A dtype argument: anything `jnp.dtype` understands, or `None` (the
  default of the argument)."""
  if dtype is None:
    return
  try:
    jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"Expected `{name}` to be a dtype, got {_got(dtype)}.") from None


def static_float(value: Any, name: str) -> float:
  """A static real number (Python or NumPy, or a concrete 0-d array)."""
  if isinstance(value, np.ndarray | jax.Array) and value.ndim == 0:
    if is_concrete(value) and (
      is_float_dtype(value.dtype) or is_integer_dtype(value.dtype)
    ):
      return float(value)
  elif not isinstance(value, bool | np.bool_) and isinstance(
    value, int | float | np.integer | np.floating
  ):
    return float(value)
  raise TypeError(f"Expected `{name}` to be a static float, got {_got(value)}.")


def check_sequence(value: Any, name: str, expected: str) -> list[Any]:
  """A list-like argument (any iterable but a string), read once into a
  list; `expected` describes it in the message."""
  if isinstance(value, str | bytes) or not isinstance(value, Iterable):
    raise TypeError(f"Expected `{name}` to be {expected}, got {_got(value)}.")
  if isinstance(value, np.ndarray | jax.Array) and value.ndim == 0:
    raise TypeError(f"Expected `{name}` to be {expected}, got a scalar array.")
  return list(value)


def _got(value: Any) -> str:
  """`value` for a message: its repr when short, else its type's name."""
  text = repr(value)
  return text if len(text) <= 60 else type(value).__name__


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


INT32 = np.iinfo(np.int32)


def static_int(
  value: Any, name: str, minimum: int | None = None, *, device: bool = True
) -> int:
  """A static (Python or NumPy) int argument, at least `minimum`.

  Static ints become device shapes, indices and int32 constants, so they
  must fit int32: a larger one raises `ValueError` naming `name` (JAX's
  own error names neither the argument nor the op). `device=False` is for
  an int only compared on the host (with int64 data), which keeps its
  range.
  """
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(f"Expected `{name}` to be a static int, got {value!r}.")
  if minimum is not None and value < minimum:
    raise ValueError(f"Expected `{name}` >= {minimum}, got {value}.")
  low = INT32.min if minimum is None else max(minimum, INT32.min)
  if device and not low <= value <= INT32.max:
    raise ValueError(
      f"Expected `{name}` in [{low}, {INT32.max}] (it becomes an int32 shape or "
      f"index on the device), got {value}."
    )
  return int(value)


def index_scalar(value: Any, name: str) -> Any:
  """An integer scalar: a static int, or an integer 0-d array (concrete or
  traced), returned as it is; a host one must fit int32 (`static_int`,
  `check_fits_device`)."""
  if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
    static_int(value, name)
    return value
  if (
    isinstance(value, np.ndarray | jax.Array)
    and value.ndim == 0
    and is_integer_dtype(value.dtype)
  ):
    check_fits_device(value, name)
    return value
  raise TypeError(
    f"Expected `{name}` to be an int or an integer scalar array, got {_got(value)}."
  )


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


def fill_value(
  value: Any, dtype: Any, name: str, expected: str = "a scalar or an array"
) -> jax.Array:
  """A fill value (`pad_value`) as an array of `dtype`, the dtype of the data
  it fills (as JAX stores it).

  Integer and bool data must hold a concrete value exactly: a cast would
  truncate a fraction, turn NaN into 0, wrap a value out of range or make a
  negative one large for an unsigned dtype. A host value is cast on the
  host, so an int beyond int32 fills uint32 or float data exactly. Fills
  of float data are not checked (NaN and infinities are fills there). A
  traced value cannot be read: for integer data its dtype must be integer.
  A complex fill for real data and a bool fill for numbers are refused by
  their dtype (`check_fill_kind`), traced or not.

  Raises:
    TypeError: for a value that is not a number or an array of numbers
      (`expected` describes one), a traced float for integer data, a
      complex value for real data or a bool for numbers.
    ValueError: naming `name`, `dtype` and the first value that does not fit.
  """
  dtype = jax.dtypes.canonicalize_dtype(dtype)
  if not (isinstance(value, jax.Array) or _holds_tracers(value)):
    value = _host_array(value, name, expected)
  check_fill_kind(value, dtype, name)
  exact = dtype == np.bool_ or is_integer_dtype(dtype)
  if exact and is_concrete(value) and not _holds_tracers(value):
    _check_exact(np.asarray(value), dtype, name)
  elif exact and not _is_int_or_bool(jnp.result_type(value)):
    raise TypeError(
      f"Expected `{name}` to have an integer dtype under jit (the values' dtype "
      f"is {dtype.name}; a traced value cannot be checked), got "
      f"{jnp.result_type(value).name}."
    )
  if isinstance(value, np.ndarray):
    with np.errstate(over="ignore"):  # float data: a huge fill becomes inf
      return jnp.asarray(value.astype(dtype))
  return jnp.asarray(value).astype(dtype)


def _is_int_or_bool(dtype: Any) -> bool:
  return is_integer_dtype(dtype) or jnp.dtype(dtype) == np.bool_


def _check_exact(array: np.ndarray, dtype: np.dtype, name: str) -> None:
  """Every item of `array` is exact in the integer (or bool) `dtype`."""
  is_bool = dtype == np.bool_
  info = None if is_bool else jnp.iinfo(dtype)
  low, high = (0, 1) if info is None else (int(info.min), int(info.max))
  if is_integer_dtype(array.dtype) or array.dtype == np.bool_:
    bad = (array < low) | (array > high)
  else:
    with np.errstate(invalid="ignore"):
      imag = np.imag(array) != 0
      real = np.real(array)
      # `high + 1` is a power of two: exact in float64, unlike `high`.
      bad = imag | ~np.isfinite(real) | (real != np.round(real)) | (real < low)
      bad |= real >= high + 1
  hits = np.flatnonzero(bad)
  if hits.size:
    where = np.unravel_index(int(hits[0]), array.shape)
    at = f" at index {tuple(int(i) for i in where)}" if array.ndim else ""
    kind = "0, 1 or a bool" if is_bool else f"an integer in [{low}, {high}]"
    raise ValueError(
      f"Expected `{name}` to be {kind} (exactly representable in the values' "
      f"dtype {dtype.name}), got {array[where].item()}{at}."
    )


def check_pad_value(pad_value: jax.typing.ArrayLike, x: LoDTensor) -> jax.Array:
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


# -- rank tables -------------------------------------------------------------------


def check_table(table: Any, name: str = "table", *, optional: bool = False) -> Any:
  """`table` must be a `jaxlod.ops.RankTable` (or `None` when `optional`)."""
  # `jaxlod.ops` imports this module: import its RankTable at call time.
  from jaxlod.ops._rank import RankTable

  if optional and table is None:
    return None
  if not isinstance(table, RankTable):
    raise TypeError(f"Expected `{name}` to be a RankTable, got {type(table).__name__}.")
  return table


def check_pair(x: Any, table: Any, name: str) -> Any:
  """`x` is a LoDTensor whose last level `table` ranks.

  Checks the types and capacities, and the lengths (`check_ranked`, whose
  result it returns).
  """
  if not is_lod(x):
    raise TypeError(f"Expected `{name}` to be a LoDTensor, got {type(x).__name__}.")
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


# -- pytrees of per-sequence arrays and step functions -----------------------------


def leaf_name(path) -> str:
  """A pytree key path as text, ``(root)`` for the root."""
  return jax.tree_util.keystr(path) or "(root)"


def _shape_str(x: Any) -> str:
  return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def check_leaves(tree: Any, name: str) -> None:
  """Every leaf of `tree` is an array or a number (`host_numbers`), and its
  host integers fit the dtype JAX stores them in (`check_fits_device`; the
  message names the leaf, e.g. ``memory['h']``)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not hasattr(leaf, "shape"):
      host_numbers(leaf, name)
    elif not is_integer_dtype(getattr(leaf, "dtype", np.float32)):
      continue  # only integers wrap; other arrays pass as they are
    check_fits_device(leaf, name + jax.tree_util.keystr(path))


def check_rows(tree: Any, count: int, name: str) -> None:
  """Every leaf of `tree` is an array with leading dimension `count` (the
  count capacity)."""
  check_leaves(tree, name)
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != count:
      raise ValueError(
        f"Expected `{name}` leaf {leaf_name(path)} to have leading dimension "
        f"{count} (count capacity), got shape {jnp.shape(leaf)}."
      )


def check_step_out(out: Any, carry: Any, b: int) -> tuple[Any, Any]:
  """`out` of a step function is ``(new_carry, y)``, the carry unchanged in
  structure, shapes and dtypes, every leaf of `y` ``[b, ...]``.

  Returns:
    ``(new_carry, y)``.
  """
  if not (isinstance(out, tuple | list) and len(out) == 2):
    raise TypeError(
      f"Expected `step_fn` to return a pair (new_carry, output), got {out!r}."
    )
  new_carry, y = out
  if jax.tree.structure(new_carry) != jax.tree.structure(carry):
    raise ValueError(
      "Expected `step_fn` to return a carry with the structure of `init_carry`: "
      f"{jax.tree.structure(carry)}, got {jax.tree.structure(new_carry)}."
    )
  pairs = zip(
    jax.tree_util.tree_leaves_with_path(carry), jax.tree.leaves(new_carry), strict=True
  )
  for (path, old), new in pairs:
    if old.shape != new.shape or old.dtype != new.dtype:
      raise ValueError(
        f"Expected `step_fn` to keep carry leaf {leaf_name(path)} as "
        f"{_shape_str(old)}, got {_shape_str(new)}."
      )
  for path, leaf in jax.tree_util.tree_leaves_with_path(y):
    if leaf.ndim == 0 or leaf.shape[0] != b:
      raise ValueError(
        f"Expected `step_fn` output leaf {leaf_name(path)} to have leading "
        f"dimension {b} (the phase's batch size), got {_shape_str(leaf)}."
      )
  return new_carry, y


# -- attention decoders ----------------------------------------------------------


def check_memory(memory: Any, name: str = "memory") -> Memory:
  """`memory` must be a `jaxlod.ops.Memory` (see `jaxlod.ops.lod_memory`)."""
  # `jaxlod.ops` imports this module: import its Memory at call time.
  from jaxlod.ops._attention import Memory

  if not isinstance(memory, Memory):
    raise TypeError(
      f"Expected `{name}` to be a jaxlod.ops.Memory (see `lod_memory` and "
      f"`as_memory`), got {type(memory).__name__}."
    )
  check_memory_lengths(memory, name)
  return memory


def check_memory_lod(memory: Any, name: str = "memory") -> LoDTensor:
  """`memory` must be a LoDTensor of one level with vector rows.

  Raises:
    TypeError: for a memory that is not a LoDTensor.
    ValueError: for more than one level or rows that are not vectors.
  """
  memory = check_lod(memory, name)
  if memory.num_levels != 1 or len(memory.feature_shape) != 1:
    raise ValueError(
      f"Expected a LoDTensor `{name}` with one LoD level and values [src_tokens, "
      f"features], got {memory.num_levels} level(s) and values of shape "
      f"{tuple(memory.values.shape)}."
    )
  return memory


def without_keys(memory: Memory, name: str) -> Memory:
  """An attention that precomputes nothing takes no `keys`."""
  if memory.keys is not None:
    raise ValueError(
      f"{name} precomputes no keys (its `keys(memory)` is None), got `keys` of "
      f"shape {tuple(memory.keys.shape)}."
    )
  return memory


def check_query(query: jax.typing.ArrayLike, memory: Memory) -> jax.Array:
  """`query` must be ``[b, hidden]`` with one memory row per query row."""
  memory = check_memory(memory)
  query = as_array(query, "query")
  if query.ndim != 2:
    raise ValueError(f"Expected `query` to have shape [b, hidden], got {query.shape}.")
  if query.shape[0] != memory.values.shape[0]:
    raise ValueError(
      f"Expected one memory sequence per query row: `query` has {query.shape[0]} "
      f"rows, `memory` has {memory.values.shape[0]} sequences (count capacity)."
    )
  return query


def check_width(name: str, actual: int, expected: int, what: str) -> None:
  """A width (last dimension) must match: names both values."""
  if actual != expected:
    raise ValueError(f"Expected `{name}` of width {expected} ({what}), got {actual}.")


def check_keys(memory: Memory, units: int) -> None:
  """`memory.keys` must be ``[b, source_capacity, units]``."""
  expected = (*memory.values.shape[:2], units)
  if memory.keys is None or tuple(memory.keys.shape) != expected:
    got = None if memory.keys is None else tuple(memory.keys.shape)
    raise ValueError(
      f"Expected `keys` to have shape [b, source_capacity, units] = {expected}, "
      f"got {got}."
    )


def check_counts(tgt: LoDTensor, memory: LoDTensor) -> None:
  """`memory` holds one sequence per last-level sequence of `tgt`.

  The count capacities are compared at trace time, the real counts eagerly
  (under `jit` through `jax.experimental.checkify`).
  """
  count, wanted = memory.capacity.sequences[-1], tgt.capacity.sequences[-1]
  if count != wanted:
    raise ValueError(
      f"Expected `memory` to hold one sequence per `tgt` sequence: memory count "
      f"capacity {count}, tgt count capacity {wanted}."
    )
  require(
    memory.num_sequences(-1) == tgt.num_sequences(-1),
    "Expected `memory` to hold one sequence per `tgt` sequence: memory has "
    "{real} sequences, tgt has {real_tgt}.",
    real=memory.num_sequences(-1),
    real_tgt=tgt.num_sequences(-1),
  )


def check_targets(tgt: Any) -> LoDTensor:
  """A decoder's targets: a LoDTensor of vector rows."""
  tgt = check_lod(tgt, "tgt")
  if len(tgt.feature_shape) != 1:
    raise ValueError(
      "Expected `tgt.values` to have shape [token_capacity, input_features], got "
      f"{tuple(tgt.values.shape)}."
    )
  return tgt


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


# -- layers (jaxlod.nn and jaxlod.nn.nnx) -------------------------------------------


def check_eps(eps: Any) -> float:
  """The cosine attention's ``eps``: a static float > 0, finite and nonzero
  in float32 (`finite_float32`)."""
  return finite_float32(eps, "eps", positive=True)


def check_rate(rate: float, name: str, *, closed: bool = True) -> float:
  """A dropout rate in ``[0, 1]`` (``[0, 1)`` unless `closed`)."""
  rate = static_float(rate, name)
  ok = 0.0 <= rate <= 1.0 if closed else 0.0 <= rate < 1.0
  if not ok:
    interval = "[0, 1]" if closed else "[0, 1)"
    raise ValueError(f"Expected `{name}` in {interval}, got {rate!r}.")
  return rate


def split_pair(initial_carry: Any) -> tuple[Any, Any]:
  """``(forward, backward)`` carries of a `Bidirectional` (`None`: both None)."""
  if initial_carry is None:
    return None, None
  if not (isinstance(initial_carry, tuple | list) and len(initial_carry) == 2):
    raise TypeError(
      "Expected `initial_carry` to be a pair (forward_carry, backward_carry), "
      f"got {type(initial_carry).__name__}."
    )
  return tuple(initial_carry)


def check_sizes(**sizes: Any) -> None:
  """Every keyword argument is a static int >= 1 (a width, a vocabulary)."""
  for name, value in sizes.items():
    static_int(value, name, minimum=1)


def check_cell(cell: Any, carry_signature: str | None = None) -> Any:
  """A recurrent cell is callable; to give the default carry it must also
  have `initialize_carry`, whose signature `carry_signature` spells (the
  twins' differ)."""
  check_callable(cell, "cell")
  if carry_signature is not None and not hasattr(cell, "initialize_carry"):
    raise TypeError(
      f"Expected `cell` ({type(cell).__name__}) to have `{carry_signature}`; "
      "otherwise pass `initial_carry`."
    )
  return cell


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


def check_layers(layers: Sequence[Any], owner: Any) -> None:
  """A `StackedRNN` (`owner`) has at least one layer, each a layer over
  LoDTensors (`check_rnn_layer`)."""
  layers = check_sequence(layers, "layers", "a sequence of layers")
  if len(layers) == 0:
    raise ValueError("Expected `layers` to hold at least one layer, got none.")
  for i, layer in enumerate(layers):
    check_rnn_layer(layer, f"layers[{i}]", owner)


def check_settings(settings: Any) -> Any:
  """Decoding takes a `jaxlod.ops.DecodeSettings`."""
  # `jaxlod.ops` imports this module: import its DecodeSettings at call time.
  from jaxlod.ops._decode import DecodeSettings

  if not isinstance(settings, DecodeSettings):
    raise TypeError(
      f"Expected `settings` to be a DecodeSettings, got {type(settings).__name__}."
    )
  return settings


def check_tokens(tokens: jax.typing.ArrayLike) -> jax.Array:
  """A decoding step's previous tokens: int ``[b]``."""
  tokens = as_array(tokens, "tokens")
  if tokens.ndim != 1:
    raise ValueError(f"Expected `tokens` to have shape [b], got {tokens.shape}.")
  check_integer(tokens.dtype, "tokens")
  return tokens


def check_encoded(memory: Any) -> LoDTensor:
  """An encoder's output must be a LoDTensor."""
  if not is_lod(memory):
    raise TypeError(
      f"Expected `encoder` to return a LoDTensor, got {type(memory).__name__}."
    )
  return memory


def check_rngs(rngs: Any) -> dict[str, jax.Array] | None:
  """Linen RNG streams: `None` or a dict of stream names to JAX keys (typed,
  or raw ``uint32 [2]``), as ``flax.linen.Module.apply`` takes them."""
  if rngs is None:
    return None
  if not isinstance(rngs, Mapping):
    raise TypeError(
      f"Expected `rngs` to be a dict of stream names to JAX keys (e.g. "
      f"{{'dropout': jax.random.key(0)}}) or None, got {type(rngs).__name__}."
    )
  for name, key in rngs.items():
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == np.uint32 and getattr(key, "shape", None) == (2,)
    if not isinstance(name, str) or not (typed or raw):
      raise TypeError(
        f"Expected `rngs` to map stream names to JAX keys (e.g. {{'dropout': "
        f"jax.random.key(0)}}), got {name!r}: {type(key).__name__}."
      )
  return dict(rngs)


def check_vocabs(vocabs: Sequence[int]) -> None:
  """An ensemble's members share the target vocabulary."""
  if not vocabs:
    raise ValueError("Expected at least one member, got none. `members` is empty.")
  if len(set(vocabs)) != 1:
    raise ValueError(
      f"Expected the members to share `tgt_vocab`, got {list(vocabs)} (member order)."
    )


# -- integer leaves of pytrees (LoDTensor, RankTable) ------------------------------


def check_index_leaves(leaves: Iterable[tuple[str, Any]], fix: str) -> None:
  """Integer leaves of a pytree stay integer: each ``(name, leaf)`` that is an
  array (or a shape struct) must have an integer dtype, or ``float0`` (the
  cotangent JAX gives integer leaves). Other leaves (axis specs, `None`,
  objects a transformation put there) pass.

  Args:
    leaves: ``(name, leaf)`` pairs; `name` is used in the message.
    fix: the end of the message: what the user should do instead.

  Raises:
    TypeError: for the first array leaf with another dtype, naming it.
  """
  for name, leaf in leaves:
    dtype = getattr(leaf, "dtype", None)
    if not isinstance(leaf, np.ndarray | np.generic | jax.Array | jax.ShapeDtypeStruct):
      continue
    if is_integer_dtype(dtype) or dtype == jax.dtypes.float0:
      continue
    raise TypeError(f"Expected integer {name}, got {np.dtype(dtype).name}: {fix}")


def check_memory_lengths(memory: Memory, name: str = "memory") -> None:
  """A `jaxlod.ops.Memory`'s ``lengths`` stay integer (a tree map that cast
  them would mask the wrong source rows)."""
  check_index_leaves(
    [(f"`{name}.lengths`", memory.lengths)],
    "the lengths mask the source rows, so a tree map over a Memory must leave "
    "them alone (cast `values` and `keys` only).",
  )


# -- layers given to layers, and their dtypes (jaxlod.nn and jaxlod.nn.nnx) ---------

# The modules of Flax's own layers and cells: they take arrays, never a
# LoDTensor (Flax's combinators, `nn.Sequential` and `nnx.Sequential`, pass).
_ARRAY_LAYERS = tuple(
  f"flax.linen.{m}"
  for m in (
    "activation",
    "attention",
    "fp8_ops",
    "linear",
    "normalization",
    "pooling",
    "recurrent",
    "stochastic",
  )
) + ("flax.nnx.nn.",)


def _flax_api(value: Any) -> str | None:
  """``"Linen"`` or ``"NNX"`` for a Flax module (or an NNX layer under
  construction), else `None`."""
  import flax.linen as nn  # Flax loads with jaxlod.nn, which calls this.
  from flax import nnx

  if isinstance(value, nn.Module):
    return "Linen"
  return "NNX" if isinstance(value, nnx.Module) else None


def check_twin(value: Any, name: str, owner: Any) -> None:
  """A module given to a layer (`owner`) is of the layer's API: a Linen
  module in a `jaxlod.nn` layer, an NNX one in a `jaxlod.nn.nnx` layer."""
  api, mine = _flax_api(value), _flax_api(owner)
  if api is not None and api != mine:
    package, article = (
      ("jaxlod.nn", "a") if mine == "Linen" else ("jaxlod.nn.nnx", "an")
    )
    raise TypeError(
      f"Expected `{name}` to be {article} {mine} module (a {package} layer), got the "
      f"{api} module {type(value).__name__}."
    )


def check_rnn_layer(layer: Any, name: str, owner: Any) -> Any:
  """A layer over LoDTensors, given to `owner`: a `StackedRNN`'s layers, a
  `Bidirectional`'s, a `HierarchicalEncoder`'s, a `Seq2Seq`'s encoder.

  It must be callable, of `owner`'s API (`check_twin`), and not one of
  Flax's own layers or cells, which take arrays.
  """
  return _check_jaxlod_layer(
    layer,
    name,
    owner,
    "a jaxlod RNN layer (a DynamicRNN, Bidirectional, StackedRNN or "
    "HierarchicalEncoder) or a module of yours over LoDTensors",
    ", which takes arrays (a recurrent cell goes in a DynamicRNN)",
  )


def check_attention_layer(attention: Any, owner: Any) -> Any:
  """An `AttentionDecoder`'s `attention`: callable, of `owner`'s API
  (`check_twin`), and not one of Flax's own layers, whose calls differ."""
  return _check_jaxlod_layer(
    attention,
    "attention",
    owner,
    "an attention of jaxlod (DotAttention, GeneralAttention, AdditiveAttention, "
    "CosineAttention) or a module of yours ``attention(query, memory, lengths) "
    "-> (context, weights)``",
  )


def _check_jaxlod_layer(
  value: Any, name: str, owner: Any, expected: str, tail: str = ""
) -> Any:
  """`value`, given to `owner` as `name`: callable, of `owner`'s API
  (`check_twin`), and not one of Flax's own layers (the message: `expected`,
  then `tail` after the Flax class's name)."""
  check_callable(value, name)
  check_twin(value, name, owner)
  if type(value).__module__.startswith(_ARRAY_LAYERS):
    raise TypeError(
      f"Expected `{name}` to be {expected}, got Flax's {type(value).__name__}{tail}."
    )
  return value


def check_decoder(decoder: Any, owner: Any) -> Any:
  """A `Seq2Seq`'s `decoder` is an `AttentionDecoder` of `owner`'s API."""
  # `jaxlod.nn` imports this module: import its decoders' base at call time.
  from jaxlod.nn._common import DecoderCalls

  check_twin(decoder, "decoder", owner)
  if not isinstance(decoder, DecoderCalls):
    raise TypeError(
      f"Expected `decoder` to be an AttentionDecoder, got {type(decoder).__name__}."
    )
  return decoder


def check_layer_dtypes(dtype: Any, param_dtype: Any) -> None:
  """A layer's `dtype` (of its computation: a float dtype, or `None` for
  its inputs') and `param_dtype` (of its parameters: a float dtype)."""
  for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
    if value is None and name == "dtype":
      continue
    check_dtype(value, name)
    if value is None or not jnp.issubdtype(value, jnp.floating):
      got = "None" if value is None else jnp.dtype(value).name
      raise TypeError(f"Expected `{name}` to be a float dtype, got {got}.")


# -- host arrays from Python values: ragged rows, LoD levels -----------------------


def host_array(value: Any, name: str) -> np.ndarray:
  """`np.asarray(value)`, with ragged nested lists refused naming `name`
  and the first row whose shape differs (NumPy's "inhomogeneous shape")."""
  try:
    array = np.asarray(value)
  except ValueError:
    raise ValueError(_ragged(value, name)) from None
  if isinstance(value, list | tuple) and array.dtype not in (np.bool_, object):
    _refuse_mixed_bools(value, name)
  return array


def _refuse_mixed_bools(value: list | tuple, name: str) -> None:
  """A nested list of numbers holds no bool: NumPy would read ``True`` as 1
  (``[True, 4]`` as lengths ``[1, 4]``)."""
  stack = [((), value)]
  while stack:
    path, items = stack.pop()
    i = _first_bool(items)
    if i is not None:
      at = "".join(f"[{j}]" for j in (*path, i))
      raise TypeError(
        f"Expected `{name}` to hold numbers, got the bool {items[i]!r} at "
        f"`{name}{at}` among them (NumPy would read it as {int(items[i])})."
      )
    nested = (j for j, item in enumerate(items) if isinstance(item, list | tuple))
    stack.extend(((*path, j), items[j]) for j in nested)


def _first_bool(items: list | tuple) -> int | None:
  """The index of the first bool among `items` (NumPy reads ``True`` as 1)."""
  return next((i for i, v in enumerate(items) if isinstance(v, bool | np.bool_)), None)


def _ragged(value: Any, name: str) -> str:
  """The message for a ragged `value`: the first index whose shape differs
  from item 0's, searched one nesting level at a time."""
  path: list[int] = []
  while isinstance(value, list | tuple) and value:
    shapes = []
    for item in value:
      try:
        shapes.append(np.shape(item))
      except ValueError:
        shapes.append(None)  # ragged itself
    bad = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
    if bad is not None:
      at = "".join(f"[{i}]" for i in path)
      return (
        f"Expected `{name}` to be a rectangular array of numbers ([rows, "
        f"*features]), got ragged rows: `{name}{at}[{bad}]` has shape "
        f"{_shape_text(shapes[bad])}, `{name}{at}[0]` {_shape_text(shapes[0])}."
      )
    bad = shapes.index(None) if None in shapes else 0
    path.append(bad)
    value = value[bad]
  return f"Expected `{name}` to be a rectangular array of numbers, got ragged rows."


def _shape_text(shape: tuple[int, ...] | None) -> str:
  return "(ragged)" if shape is None else str(tuple(shape))


def level_array(values: Any, name: str, level: int, where: str) -> np.ndarray:
  """One LoD level as a NumPy array, before `check_integer_level` checks its
  rank and dtype. An iterator is read once; a scalar, ragged items or a bool
  among ints raise naming the level and (`where`) the argument.

  Raises:
    TypeError: for a bool among ints (NumPy would read it as 0 or 1).
    ValueError: for a scalar (a level must be a sequence) or ragged items.
  """
  if isinstance(values, Iterable) and not (
    isinstance(values, list | tuple | np.ndarray) or hasattr(values, "__array__")
  ):
    values = list(values)  # a generator: np.asarray would make an object scalar
  try:
    array = np.asarray(values)
  except ValueError:
    raise ValueError(
      f"Expected LoD level {level} ({name}) to be 1-D, got items of different "
      f"shapes.{where}"
    ) from None
  if array.ndim == 0:
    raise ValueError(
      f"Expected LoD level {level} ({name}) to be a 1-D sequence of ints, got the "
      f"scalar {_got(values)}; pass one sequence per level, e.g. [[2, 1]].{where}"
    )
  i = _first_bool(values) if isinstance(values, list | tuple) else None
  if i is not None:
    raise TypeError(
      f"Expected LoD level {level} ({name}) to hold ints, got the bool "
      f"{values[i]!r} at index {i}.{where}"
    )
  return array


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


def check_no_bools(value: Any, name: str) -> None:
  """A Python list or tuple of ints holds no bool (NumPy reads ``True`` as 1).

  Raises:
    TypeError: naming `name` and the index of the first bool.
  """
  i = _first_bool(value) if isinstance(value, list | tuple) else None
  if i is not None:
    raise TypeError(
      f"Expected `{name}` to hold ints, got the bool {value[i]!r} at index {i}."
    )


# -- fill values' kinds, float settings that become float32 ------------------------


def check_fill_kind(value: Any, dtype: Any, name: str) -> None:
  """A fill value of a kind the data's `dtype` holds: no complex fill for real
  data (a cast drops the imaginary part), no bool fill for numbers (a bool
  pads with 0 or 1). Reads only the dtype, so a traced value is checked too.

  Raises:
    TypeError: naming `name`, the fill's dtype and the data's.
  """
  kind = value.dtype if hasattr(value, "dtype") else jnp.asarray(value).dtype
  dtype = np.dtype(dtype)
  if jnp.issubdtype(kind, jnp.complexfloating) and not jnp.issubdtype(
    dtype, jnp.complexfloating
  ):
    raise TypeError(
      f"Expected `{name}` to be a real number for values of dtype {dtype.name} "
      f"(the imaginary part would be dropped), got {np.dtype(kind).name}."
    )
  if kind == np.bool_ and dtype != np.bool_:
    raise TypeError(
      f"Expected `{name}` to be a number for values of dtype {dtype.name} (a bool "
      f"would pad with 0 or 1), got bool."
    )


def finite_float32(value: Any, name: str, *, positive: bool = False) -> float:
  """A static float that stays finite in float32, the dtype it is computed in
  (or wider); `positive`: also at least float32's smallest normal number
  (a smaller one rounds, or flushes, to 0).

  Raises:
    TypeError: for a value that is not a static float (`static_float`).
    ValueError: naming `name` and the value.
  """
  value = static_float(value, name)
  f32 = np.finfo(np.float32)
  if not abs(value) <= float(f32.max):  # NaN too
    raise ValueError(
      f"Expected `{name}` to be finite in float32 (|{name}| <= {float(f32.max):g}), "
      f"got {value}."
    )
  if positive and not value >= float(f32.tiny):
    raise ValueError(
      f"Expected `{name}` > 0 and at least {float(f32.tiny):g} (the smallest normal "
      f"float32: a smaller one becomes 0 in float32), got {value}."
    )
  return value
