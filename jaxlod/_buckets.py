"""Capacity policies: map real sizes to static, bucketed capacities.

Under `jax.jit` every shape is static, so a batch whose number of rows,
sequences or longest length changes would recompile on every call. A
`Buckets` policy rounds each real size up to one of a small set of
*capacities*; the array shapes follow the capacities, so a jitted function
compiles once per distinct capacity (and exactly once under
`Buckets.fixed`).

Three sizes are bucketed, each named by a *kind*:

* ``"tokens"``: rows of ``values`` (the last level's total length);
* ``"sequences"``: sequences at one LoD level (the count capacity);
* ``"time"``: the longest sequence at one LoD level (the time capacity).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jaxlod._checks import require

KINDS = ("tokens", "sequences", "time")
POLICIES = ("exact", "pow2", "geometric", "explicit", "fixed")


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"Expected `kind` to be one of {KINDS}, got {kind!r}.")


# Offsets, lengths and counts live in int32 on the device: no capacity is larger.
MAX_CAPACITY = int(np.iinfo(np.int32).max)


def _as_int(name: str, value) -> int:
  if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
    raise TypeError(f"Expected `{name}` to be an int, got {value!r}.")
  return int(value)


def _as_capacity(name: str, value, minimum: int) -> int:
  """An int in ``[minimum, MAX_CAPACITY]``: a capacity, or a parameter that
  is one (`pow2`'s minimum, `geometric`'s multiple)."""
  value = _as_int(name, value)
  if value < minimum:
    raise ValueError(f"Expected `{name}` >= {minimum}, got {value}.")
  if value > MAX_CAPACITY:
    raise ValueError(
      f"Expected `{name}` <= {MAX_CAPACITY} (offsets and lengths are int32), got "
      f"{value}."
    )
  return value


def _per_level(name: str, value) -> tuple[int, ...]:
  """One capacity for every level, or one per level, as a tuple."""
  if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
    return (_as_capacity(name, value, 0),)
  if isinstance(value, str | bytes) or not isinstance(value, Iterable):
    raise TypeError(
      f"Expected `{name}` to be an int or a sequence of ints (one per level), "
      f"got {value!r}."
    )
  values = tuple(_as_int(f"{name}[{i}]", v) for i, v in enumerate(value))
  if not values:
    raise ValueError(f"Expected `{name}` to name at least one level.")
  return tuple(_as_capacity(name, v, 0) for v in values)


def _unpack(policy: str, params: tuple, names: tuple[str, ...]) -> tuple:
  """`params` of `policy`, one per name of `names`."""
  if len(params) != len(names):
    raise ValueError(
      f"Expected `params` of policy {policy!r} to be {_spelled(names)}, got "
      f"{params!r}; prefer the constructor Buckets.{policy}(...)."
    )
  return params


def _spelled(names: tuple[str, ...]) -> str:
  """A tuple of names as Python writes it: ``()``, ``(minimum,)``, ``(a, b)``."""
  return f"({', '.join(names)}{',' if len(names) == 1 else ''})"


def _check_ratio(ratio) -> float:
  if isinstance(ratio, bool | np.bool_) or not isinstance(
    ratio, int | float | np.integer | np.floating
  ):
    raise TypeError(f"Expected `ratio` to be a float, got {ratio!r}.")
  if not 1.0 < float(ratio) < float("inf"):
    raise ValueError(f"Expected a finite `ratio` > 1, got {ratio}.")
  if float(ratio) > MAX_CAPACITY:  # every capacity past the first: beyond int32
    raise ValueError(
      f"Expected `ratio` <= {MAX_CAPACITY} (a larger one puts every capacity but "
      f"the first beyond int32), got {ratio}."
    )
  return float(ratio)


def _check_boundaries(name: str, values) -> tuple[int, ...]:
  if isinstance(values, str | bytes) or not isinstance(values, Iterable):
    raise TypeError(f"Expected `{name}` to be a sequence of ints, got {values!r}.")
  values = tuple(_as_int(f"{name}[{i}]", v) for i, v in enumerate(values))
  if not values:
    raise ValueError(f"Expected `{name}` to be non-empty.")
  for i in range(1, len(values)):
    if values[i] <= values[i - 1]:
      raise ValueError(
        f"Expected `{name}` to be strictly ascending, got {values[i - 1]} "
        f"at index {i - 1} and {values[i]} at index {i}."
      )
  _as_capacity(name, values[0], 0)
  _as_capacity(name, values[-1], 0)
  return values


def _params(policy: str, params: tuple) -> tuple:
  """The checked parameters of `policy`, naming the constructor's arguments."""
  if policy == "exact":
    _unpack(policy, params, ())
    return ()
  if policy == "pow2":
    (minimum,) = _unpack(policy, params, ("minimum",))
    return (_as_capacity("minimum", minimum, 1),)
  if policy == "geometric":
    ratio, multiple = _unpack(policy, params, ("ratio", "multiple"))
    return (_check_ratio(ratio), _as_capacity("multiple", multiple, 1))
  if policy == "explicit":
    table = {}
    for item in params:
      if not (isinstance(item, tuple) and len(item) == 2):
        raise ValueError(
          f"Expected `params` of policy 'explicit' to be (kind, boundaries) pairs, "
          f"got {item!r}; prefer the constructor Buckets.explicit(...)."
        )
      kind, values = item
      _check_kind(kind)
      table[kind] = _check_boundaries(f"boundaries[{kind!r}]", values)
    return tuple(sorted(table.items()))
  tokens, sequences, time = _unpack(policy, params, ("tokens", "sequences", "time"))
  return (
    _as_capacity("tokens", tokens, 0),
    _per_level("sequences", sequences),
    _per_level("time", time),
  )


def round_up(n: int, multiple: int) -> int:
  """`n` rounded up to a multiple of `multiple`."""
  return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Buckets:
  """A policy that maps real sizes to static capacities.

  Build one with a constructor: `Buckets.exact`, `Buckets.pow2`,
  `Buckets.geometric`, `Buckets.explicit` or `Buckets.fixed`. Instances are
  hashable and compare by value, so they can be static arguments of `jit`.

  Example:
    >>> from jaxlod import Buckets
    >>> Buckets.pow2(minimum=8).capacity(20)
    32
    >>> Buckets.geometric(ratio=1.25, multiple=8).capacity(20)
    24
    >>> Buckets.explicit([16, 64, 256]).capacity(20)
    64
    >>> Buckets.fixed(tokens=512, sequences=32, time=64).capacity(20, "time")
    64
  """

  policy: str
  params: tuple = ()

  def __post_init__(self):
    """Checks the policy's name and its parameters (the named constructors'
    arguments, named in the messages): every capacity fits int32.

    Raises:
      TypeError, ValueError: for an unknown policy or wrong parameters.
    """
    if self.policy not in POLICIES:
      raise ValueError(
        f"Expected `policy` to be one of {POLICIES} (prefer the named "
        f"constructors, e.g. Buckets.pow2()), got {self.policy!r}."
      )
    if not isinstance(self.params, tuple):
      raise TypeError(f"Expected `params` to be a tuple, got {self.params!r}.")
    object.__setattr__(self, "params", _params(self.policy, self.params))

  # -- constructors -------------------------------------------------------

  @classmethod
  def exact(cls) -> Buckets:
    """Capacities equal to the real sizes (recompiles for every new size)."""
    return cls("exact")

  @classmethod
  def pow2(cls, minimum: int = 8) -> Buckets:
    """The next power of two, at least `minimum`."""
    return cls("pow2", (minimum,))

  @classmethod
  def geometric(cls, ratio: float = 1.25, multiple: int = 8) -> Buckets:
    """Capacities ``multiple, ~multiple*ratio, ...``, each a multiple of `multiple`.

    Consecutive capacities grow by at least `ratio` (after rounding up to a
    multiple of `multiple`), so padding waste is at most about ``ratio - 1``
    of the real size plus the rounding.

    Raises:
      TypeError: for a `ratio` that is not a float or a `multiple` that is
        not an int.
      ValueError: for a `ratio` not in ``(1, 2**31 - 1]`` (a larger one puts
        every capacity but the first beyond int32) or a `multiple` not in
        ``[1, 2**31 - 1]``.
    """
    multiple = _as_capacity("multiple", multiple, 1)
    return cls("geometric", (_check_ratio(ratio), multiple))

  @classmethod
  def explicit(cls, boundaries: Sequence[int] | Mapping[str, Sequence[int]]) -> Buckets:
    """The smallest boundary that holds the size.

    Args:
      boundaries: ascending capacities, shared by every kind, or a mapping
        from kind (``"tokens"``, ``"sequences"``, ``"time"``) to its own
        ascending capacities. A size above the largest boundary is an error.
    """
    if isinstance(boundaries, Mapping):
      table = {}
      for kind, values in boundaries.items():
        _check_kind(kind)
        table[kind] = _check_boundaries(f"boundaries[{kind!r}]", values)
      return cls("explicit", tuple(sorted(table.items())))
    if isinstance(boundaries, str | bytes) or not isinstance(boundaries, Iterable):
      raise TypeError(
        "Expected `boundaries` to be a sequence of ints or a mapping from kind "
        f"to one, got {boundaries!r}."
      )
    values = _check_boundaries("boundaries", boundaries)
    return cls("explicit", tuple((kind, values) for kind in KINDS))

  @classmethod
  def fixed(
    cls,
    *,
    tokens: int,
    sequences: int | Sequence[int],
    time: int | Sequence[int],
  ) -> Buckets:
    """One capacity per kind, so a jitted function compiles exactly once.

    Args:
      tokens: rows of ``values``.
      sequences: sequences per level: one int for every level, or one per
        level (level 0 first).
      time: longest sequence per level: one int or one per level.

    A batch larger than a fixed capacity raises `ValueError`; it is never
    truncated.
    """
    return cls("fixed", (tokens, sequences, time))

  # -- mapping ------------------------------------------------------------

  def capacity(self, size: int, kind: str = "tokens", level: int = 0) -> int:
    """The static capacity for a real `size` of the given `kind`.

    Args:
      size: the real size (>= 0).
      kind: ``"tokens"``, ``"sequences"`` or ``"time"``.
      level: the LoD level, for ``"sequences"`` and ``"time"`` under
        `Buckets.fixed` with one capacity per level.

    Returns:
      An int >= `size`.

    Raises:
      ValueError: if no capacity of the policy holds `size`.
    """
    _check_kind(kind)
    size = _as_int("size", size)
    if size < 0:
      raise ValueError(
        f"Expected a size >= 0, got {size}. `size` counts rows, sequences or steps."
      )
    level = _as_int("level", level)
    if level < 0:
      raise ValueError(f"Expected `level` >= 0, got {level}.")
    fn = getattr(self, f"_capacity_{self.policy}")
    capacity = fn(size, kind, level)
    if capacity > MAX_CAPACITY:
      raise ValueError(
        f"The {kind} capacity for size {size} under Buckets.{self.policy} would "
        f"be {capacity}, more than {MAX_CAPACITY} (offsets and lengths are "
        "int32)."
      )
    return capacity

  def _capacity_exact(self, size, kind, level):
    del kind, level
    return size

  def _capacity_pow2(self, size, kind, level):
    del kind, level
    (minimum,) = self.params
    return max(minimum, 1 << max(size - 1, 0).bit_length())

  def _capacity_geometric(self, size, kind, level):
    del kind, level
    ratio, multiple = self.params
    capacity = multiple
    while capacity < size:
      capacity = max(
        capacity + multiple, round_up(math.ceil(capacity * ratio), multiple)
      )
    return capacity

  def _capacity_explicit(self, size, kind, level):
    del level
    table = dict(self.params)
    if kind not in table:
      raise ValueError(f"Explicit buckets name no boundaries for {kind!r}.")
    for boundary in table[kind]:
      if boundary >= size:
        return boundary
    raise ValueError(
      f"{kind} size {size} exceeds the largest explicit boundary {table[kind][-1]}."
    )

  def _capacity_fixed(self, size, kind, level):
    tokens, sequences, time = self.params
    if kind == "tokens":
      capacity, where = tokens, ""
    else:
      values = sequences if kind == "sequences" else time
      if len(values) > 1 and level >= len(values):
        raise ValueError(
          f"Fixed {kind} capacities name {len(values)} levels, got level {level}."
        )
      capacity = values[min(level, len(values) - 1)]
      where = f" at level {level}"
    if size > capacity:
      raise ValueError(
        f"Batch {kind} size{where} is {size}, more than the fixed capacity "
        f"{capacity}; data is never truncated."
      )
    return capacity


def resolve(buckets: Buckets | None) -> Buckets:
  """`None` means `Buckets.exact()`."""
  if buckets is None:
    return Buckets.exact()
  if not isinstance(buckets, Buckets):
    raise TypeError(f"Expected `buckets` to be a Buckets or None, got {buckets!r}.")
  return buckets


# -- capacities ----------------------------------------------------------------------


class Capacity(NamedTuple):
  """The static sizes of a LoDTensor.

  Attributes:
    tokens: rows of ``values`` (token capacity).
    sequences: per level, the number of sequence slots (count capacity).
    time: per level, the longest sequence the tensor may hold (time capacity).
  """

  tokens: int
  sequences: tuple[int, ...]
  time: tuple[int, ...]


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
