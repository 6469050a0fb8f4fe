"""Argument and value checks shared by jaxlod's builders, ops, nn and data.

The home of validation, with two neighbours that build on it:
`jaxlod._host_checks` (LoD offsets, converters' inputs, restored pytrees,
`jaxlod.data`'s examples and settings, all on the host) and
`jaxlod._layer_checks` (attention memories, cells, ladders, settings and the
layers given to layers). Checks of static things (types, ranks, dtypes,
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
from collections.abc import Callable, Iterable, Sequence
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
    raise TypeError(f"Expected `{name}` to be a bool, got {value_text(value)}.")
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
    raise TypeError(
      f"Expected `{name}` to be a dtype, got {value_text(dtype)}."
    ) from None


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
  raise TypeError(f"Expected `{name}` to be a static float, got {value_text(value)}.")


def check_sequence(value: Any, name: str, expected: str) -> list[Any]:
  """A list-like argument (any iterable but a string), read once into a
  list; `expected` describes it in the message."""
  if isinstance(value, str | bytes) or not isinstance(value, Iterable):
    raise TypeError(f"Expected `{name}` to be {expected}, got {value_text(value)}.")
  if isinstance(value, np.ndarray | jax.Array) and value.ndim == 0:
    raise TypeError(f"Expected `{name}` to be {expected}, got a scalar array.")
  return list(value)


def value_text(value: Any) -> str:
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
    f"Expected `{name}` to be an int or an integer scalar array, got "
    f"{value_text(value)}."
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
