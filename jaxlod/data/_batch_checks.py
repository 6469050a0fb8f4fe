"""The checks of `jaxlod.data`: a batch's fields and their dtypes, the
rank-table flags, and the `Batcher`'s integer settings and shards, all read
on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxlod._host import check_fits_device


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
