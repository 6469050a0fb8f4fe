"""The core of jaxlod's argument and value checks; it imports nothing from jaxlod.

`require` and `require_each`, dtype and integer tests, static ints and
floats, how a value is printed, the checks of pytrees of arrays and of
step functions, and the selections by row that a failed check or a padding
row needs (`nan_where`, `where_rows`, `expand_rows`). Every other check
lives beside the concept it guards and builds on these: `jaxlod._host`
(host values as arrays), `jaxlod._lod_checks` (LoD offsets and levels),
the ops' checks in their modules, `jaxlod.nn._layer_checks` (the layers'),
`jaxlod.data._batch_checks` (batches and shards) and the converters' in
`jaxlod.interop`. Checks of static things (types, ranks, dtypes,
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


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


def all_hold(*outcomes: Any) -> Any:
  """The conjunction of `require` outcomes: `True` when each is `True`
  (eagerly, or static), else a bool scalar under `jit`."""
  held = True
  for outcome in outcomes:
    if outcome is not True:
      held = outcome if held is True else held & outcome
  return held


def expand_rows(x: Any, ndim: int) -> jax.Array:
  """`x` with size-1 axes appended up to `ndim` axes, so that its axes meet
  the leading axes of an array of `ndim` axes when they broadcast (NumPy
  aligns the trailing ones): a row mask ``[rows]`` as ``[rows, 1, ...]``."""
  x = jnp.asarray(x)
  return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def where_rows(mask: Any, new: Any, old: Any) -> jax.Array:
  """`new` at the rows where the bool `mask` holds and `old` elsewhere:
  `mask` covers the leading axes of `new` (``[rows]`` for ``new [rows,
  ...]``); `old` is an array of `new`'s shape or a Python scalar (as
  `new`'s dtype). A row not taken is selected away, never multiplied by
  zero, so an inf or a NaN in it stays out."""
  new = jnp.asarray(new)
  if isinstance(old, bool | int | float):
    old = jnp.asarray(old, new.dtype)
  return jnp.where(expand_rows(mask, new.ndim), new, old)


def nan_where(bad: Any, leaf: Any) -> Any:
  """A float array `leaf` NaN where the bool `bad` is True, `bad` covering
  its leading axes (a scalar: all of it); other dtypes are returned as they
  are. Under `jit`, where a value check cannot raise, a result that a failed
  check touched is loud in any loss rather than finite and wrong."""
  if not is_float_dtype(jnp.result_type(leaf)):
    return leaf
  leaf = jnp.asarray(leaf)
  return jnp.where(expand_rows(bad, leaf.ndim), jnp.asarray(jnp.nan, leaf.dtype), leaf)


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


# -- arguments of the ops ----------------------------------------------------------


def is_float_dtype(dtype: Any) -> bool:
  """JAX's float test: NumPy's misses ``bfloat16`` and the other ml_dtypes."""
  return bool(jnp.issubdtype(dtype, jnp.inexact))


def is_integer_dtype(dtype: Any) -> bool:
  """JAX's integer test (``int4`` included); `bool` is not an integer."""
  return bool(jnp.issubdtype(dtype, jnp.integer))


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


# -- pytrees of per-sequence arrays and step functions -----------------------------


def leaf_name(path) -> str:
  """A pytree key path as text, ``(root)`` for the root."""
  return jax.tree_util.keystr(path) or "(root)"


def _shape_str(x: Any) -> str:
  return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


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


# -- float settings that become float32 -------------------------------------------


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


# -- sizes, widths and rates -----------------------------------------------------


def check_width(name: str, actual: int, expected: int, what: str) -> None:
  """A width (last dimension) must match: names both values."""
  if actual != expected:
    raise ValueError(f"Expected `{name}` of width {expected} ({what}), got {actual}.")


def check_rate(rate: float, name: str, *, closed: bool = True) -> float:
  """A dropout rate in ``[0, 1]`` (``[0, 1)`` unless `closed`)."""
  rate = static_float(rate, name)
  ok = 0.0 <= rate <= 1.0 if closed else 0.0 <= rate < 1.0
  if not ok:
    interval = "[0, 1]" if closed else "[0, 1)"
    raise ValueError(f"Expected `{name}` in {interval}, got {rate!r}.")
  return rate


def is_key(key: Any) -> bool:
  """Whether `key` is a JAX PRNG key: typed (``jax.random.key``) or raw
  (``uint32 [2]``, ``jax.random.PRNGKey``)."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return getattr(key, "shape", None) == ()
  return dtype == np.uint32 and getattr(key, "shape", None) == (2,)


def check_sizes(**sizes: Any) -> None:
  """Every keyword argument is a static int >= 1 (a width, a vocabulary)."""
  for name, value in sizes.items():
    static_int(value, name, minimum=1)
