"""Host values as arrays: the boundary where Python and NumPy values enter.

`as_array` and `host_numbers` turn an argument into an array of numbers,
refusing strings, objects, ragged lists, LoDTensors and integers beyond
what JAX stores, and floats it would turn into inf (`check_fits_device`);
`fill_value` casts a fill exactly, `cast_exactly` data to a `dtype` argument;
`check_leaves` and `check_rows` hold pytrees of such arrays to a leading
dimension. Messages name the argument and both values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod._checks import (
  check_integer,
  is_concrete,
  is_float_dtype,
  is_integer_dtype,
  leaf_name,
  static_int,
  value_text,
)


def is_structure(value: Any) -> bool:
  """True for an instance of a dataclass pytree (a LoDTensor, a RankTable):
  a container of arrays, never one array."""
  return dataclasses.is_dataclass(value) and not isinstance(value, type)


# -- host arrays from Python values ----------------------------------------------


def host_numbers(value: Any, name: str, where: str = "") -> np.ndarray:
  """`value` as a NumPy array of numbers (or bools); strings, objects and
  Python ints too large for NumPy raise naming `name` (`where`, e.g.
  ``" in `seqs`, sequence 0"``, ends the type error's message)."""
  if is_structure(value):
    raise TypeError(f"Expected `{name}` to be an array, got {type(value).__name__}.")
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
  """Host numbers must keep their values in the dtype JAX stores them in:
  with x64 off, int64 becomes int32, where a value beyond its range would
  wrap silently, and float64 (complex128) becomes float32 (complex64),
  where a finite value beyond its range would become inf. Floats within it
  only round, as any float cast does; NaN and infinities stay as they are.

  Device arrays, tracers and shape structs are already stored (or have no
  values); they are not checked.
  """
  if isinstance(value, jax.Array | jax.ShapeDtypeStruct) or _holds_tracers(value):
    return
  _check_fits(host_numbers(value, name), name)


def _check_fits(array: np.ndarray, name: str) -> None:
  """`check_fits_device` of a host array."""
  if array.size == 0 or not (
    is_integer_dtype(array.dtype) or is_float_dtype(array.dtype)
  ):
    return
  target = jax.dtypes.canonicalize_dtype(array.dtype)
  if target == array.dtype:
    return
  if is_float_dtype(array.dtype):
    change = _first_change(array, target)
    if change is not None:
      _refuse_stored(array, change[0], target, name)
    return
  info = np.iinfo(target)
  bad = np.flatnonzero((array < info.min) | (array > info.max))
  if bad.size:
    _refuse_stored(array, np.unravel_index(int(bad[0]), array.shape), target, name)


def _refuse_stored(
  array: np.ndarray, where: tuple[int, ...], target: Any, name: str
) -> None:
  """The `check_fits_device` error for `array[where]`, which JAX would store in
  `target` changed."""
  at = f" at index {tuple(int(i) for i in where)}" if array.ndim else ""
  raise ValueError(
    f"Expected `{name}` to fit {np.dtype(target).name} (the dtype JAX stores "
    f"it in with jax_enable_x64 off), got {array[where]}{at}; enable x64 "
    "or use smaller values."
  )


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
      f"scalar {value_text(values)}; pass one sequence per level, e.g. [[2, 1]].{where}"
    )
  i = _first_bool(values) if isinstance(values, list | tuple) else None
  if i is not None:
    raise TypeError(
      f"Expected LoD level {level} ({name}) to hold ints, got the bool "
      f"{values[i]!r} at index {i}.{where}"
    )
  return array


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
  hits = np.flatnonzero(_inexact(_widened(array), dtype))
  if hits.size:
    where = np.unravel_index(int(hits[0]), array.shape)
    at = f" at index {tuple(int(i) for i in where)}" if array.ndim else ""
    raise ValueError(
      f"Expected `{name}` to be {_holds(dtype)} (exactly representable in the "
      f"values' dtype {dtype.name}), got {array[where].item()}{at}."
    )


# -- host values cast to a dtype -------------------------------------------------


def cast_exactly(
  array: np.ndarray, dtype: Any, name: str, path: str | None = None
) -> np.ndarray:
  """`array`, host numbers of the argument `name`, cast to the `dtype`
  argument; a value the cast would change, not merely round, is refused.

  NumPy's `astype` wraps 300 to 44 in int8, truncates 1.5 to 1, turns NaN
  into an arbitrary integer and drops imaginary parts. Into an integer
  dtype a value must be an integer in its range; into bool, 0 or 1. Into a
  float (or complex) dtype a value rounds to the nearest one the dtype
  holds, as NumPy casts (float64 to float16, an int beyond 2**24 to
  float32; a tiny one may become 0), but a finite value must stay finite:
  float16 holds magnitudes up to 65504, and 1e5 would become inf (NaN in
  float8_e4m3fn, which has no infinity). A real dtype takes no nonzero
  imaginary part. NaN and infinities stay NaN and infinities.

  Args:
    array: the values, any shape.
    dtype: the dtype argument (anything `jnp.dtype` reads).
    name: the argument the values come from.
    path: how the message indexes `array` (e.g. ``seqs[1]`` for
      ``seqs[1][0]``); `name` by default.

  Raises:
    ValueError: naming `name`, `dtype`, what the dtype holds, the first value
      the cast would change and its index.
  """
  dtype = jnp.dtype(dtype)
  if array.dtype == dtype:
    return array
  change = _first_change(array, dtype)
  if change is not None:
    where, holds = change
    at = (path or name) + "".join(f"[{int(i)}]" for i in where)
    raise ValueError(
      f"Expected every value of `{name}` to survive the cast to `dtype` "
      f"{dtype.name} ({holds}), got {array[where].item()} at `{at}`."
    )
  return _cast(_widened(array), dtype)


def _first_change(array: np.ndarray, dtype: np.dtype) -> tuple[Any, str] | None:
  """The index of the first value of `array` that a cast to `dtype` would
  change beyond a float's rounding, with what `dtype` holds; `None` when
  the cast keeps every value (`cast_exactly`)."""
  if array.size == 0 or array.dtype == np.bool_ or array.dtype == dtype:
    return None
  wide = _widened(array)
  if dtype == np.bool_ or is_integer_dtype(dtype):
    hits = np.flatnonzero(_inexact(wide, dtype))
    where = np.unravel_index(int(hits[0]), array.shape) if hits.size else None
    return None if where is None else (where, _holds(dtype))
  cast = _cast(wide, dtype)
  finite = np.isfinite(wide) if wide.dtype.kind in "fc" else True
  imaginary = np.zeros(wide.shape, bool)
  if wide.dtype.kind == "c" and not jnp.issubdtype(dtype, jnp.complexfloating):
    imaginary = np.imag(wide) != 0
  hits = np.flatnonzero(imaginary | (finite & ~np.isfinite(cast)))
  if not hits.size:
    return None
  where = np.unravel_index(int(hits[0]), array.shape)
  if imaginary[where]:
    return where, "a real number: the cast drops the imaginary part"
  return where, (
    f"finite values up to {float(jnp.finfo(dtype).max):g} in magnitude; a "
    f"larger one would become {cast[where].item()}"
  )


def _widened(array: np.ndarray) -> np.ndarray:
  """`array` with the same values in a dtype NumPy compares with any Python
  int: bool, a NumPy integer, float64 or wider, complex128 or wider (the
  ml_dtypes, which NumPy files as void, and narrower floats are widened)."""
  if array.dtype == np.bool_ or array.dtype.kind in "iu":
    return array
  if is_integer_dtype(array.dtype):
    return array.astype(np.int64)
  if jnp.issubdtype(array.dtype, jnp.complexfloating):
    return array.astype(np.promote_types(array.dtype, np.complex128))
  return array.astype(np.promote_types(array.dtype, np.float64))


def _inexact(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """Where the `_widened` `array` is not exactly a value of the integer (or
  bool) `dtype`: out of its range, fractional, NaN, infinite or complex."""
  low, high = _range(dtype)
  if array.dtype == np.bool_ or array.dtype.kind in "iu":
    return (array < low) | (array > high)
  with np.errstate(invalid="ignore"):
    real = np.real(array)
    bad = (np.imag(array) != 0) | ~np.isfinite(real) | (real != np.round(real))
    # `high + 1` is a power of two: exact in float64, unlike `high`.
    return bad | (real < low) | (real >= high + 1)


def _range(dtype: np.dtype) -> tuple[int, int]:
  """The smallest and largest value of an integer (or bool) `dtype`."""
  if dtype == np.bool_:
    return 0, 1
  info = jnp.iinfo(dtype)
  return int(info.min), int(info.max)


def _holds(dtype: np.dtype) -> str:
  """What an integer (or bool) `dtype` holds, for a message."""
  if dtype == np.bool_:
    return "0, 1 or a bool"
  low, high = _range(dtype)
  return f"an integer in [{low}, {high}]"


def _cast(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """`array.astype(dtype)` without NumPy's warnings (an overflow, a dropped
  imaginary part): the callers check what the cast changes."""
  if array.dtype.kind == "c" and not jnp.issubdtype(dtype, jnp.complexfloating):
    array = np.real(array)
  with np.errstate(all="ignore"):
    return array.astype(dtype)


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


def host_ints(value: Any, name: str, size: int, per: str) -> np.ndarray:
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
  return as_int64(array, f"`{name}`")


def as_int64(array: np.ndarray, name: str, where: str = "") -> np.ndarray:
  """Host integers as int64, which must hold every value: uint64 beyond it
  would wrap to negative values (2**64 - 1 to -1).

  Raises:
    ValueError: naming `name` (used as it is, e.g. "`ids`"), the value and
      its index; `where` ends the message.
  """
  if array.dtype == np.uint64:
    big = np.flatnonzero(array > np.iinfo(np.int64).max)
    if big.size:
      at = tuple(int(i) for i in np.unravel_index(int(big[0]), array.shape))
      raise ValueError(
        f"Expected {name} to fit int64, got {array[at]} at index {at}.{where}"
      )
  return array.astype(np.int64)


# -- pytrees of per-sequence arrays ----------------------------------------------


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
    f"Expected `{name}` to be an int or an integer scalar array, got "
    f"{value_text(value)}."
  )


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
