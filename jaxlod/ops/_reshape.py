"""Ops that reinterpret rows or the LoD: reshape, scatter, lod_reset."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod import _checks
from jaxlod._checks import is_concrete, where_rows
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import as_array
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import check_offsets, check_same_lod, lengths_to_offsets
from jaxlod.ops import _segment
from jaxlod.ops._rank import nan_unless

# -- private helpers ------------------------------------------------------------


def _require_equal(got: Any, expected: Any, message: str) -> Any:
  """Scalars `got == expected`; the message formats ``{got}`` and ``{expected}``.
  Returns whether they are (see `_checks.require`)."""
  return _checks.require_each(
    jnp.reshape(jnp.asarray(got) != jnp.asarray(expected), (1,)),
    message,
    got=jnp.reshape(jnp.asarray(got), (1,)),
    expected=jnp.reshape(jnp.asarray(expected), (1,)),
  )


# -- sequence_reshape ---------------------------------------------------------------


def sequence_reshape(x: LoDTensor, new_dim: int) -> LoDTensor:
  """Reinterprets the rows of each sequence with a new width.

  Paddle's sequence_reshape: a sequence of ``len`` rows of width ``dim``
  becomes ``len * dim / new_dim`` rows of width `new_dim`, read row-major
  from the same numbers. The last level's offsets become ``offsets * dim //
  new_dim``; upper levels are unchanged.

  Args:
    x: a LoDTensor with ``values [token_capacity, dim]`` of any dtype.
    new_dim: static int >= 1, the new row width.

  Returns:
    A LoDTensor with ``values [ceil(token_capacity * dim / new_dim),
    new_dim]`` (zero padded), the same count capacities, and the last
    level's time capacity ``floor(time * dim / new_dim)``. Differentiable
    (a reshape).

  Raises:
    TypeError: for a non-LoDTensor `x` or a non-int `new_dim`.
    ValueError: for ``x.values`` of rank other than 2 or `new_dim` below 1;
      and when ``len * dim`` of a sequence is not a multiple of `new_dim`
      (eagerly; under `jit` through `jax.experimental.checkify`: wrap the
      caller in `checkify.checkify` to see it).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_reshape
    >>> x = LoDTensor.from_lengths(np.arange(1, 13).reshape(6, 2), [[2, 4]])
    >>> y = sequence_reshape(x, 4)
    >>> y.recursive_lengths(), y.values.tolist()
    ([[1, 2]], [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
  """
  x = check_lod(x, "x")
  _checks.check_rank(x.values.shape, "x.values", (2,), "[rows, dim]")
  new_dim = _checks.static_int(new_dim, "new_dim", minimum=1)
  tokens, dim = x.values.shape
  lengths = x.lengths()
  divides = _checks.require_each(
    (lengths * dim) % new_dim != 0,
    f"sequence_reshape: sequence {{i}} has {{length}} rows of dim {dim} "
    f"({{size}} numbers), not a multiple of `new_dim` {new_dim}.",
    length=lengths,
    size=lengths * dim,
  )
  new_tokens = -(-tokens * dim // new_dim)
  # Masking the padding rows keeps them zero and gives them zero gradient.
  valid = x.row_mask()[:, None]
  real = jnp.where(valid, x.values, jnp.zeros((), x.values.dtype))
  flat = jnp.pad(real.reshape(-1), (0, new_tokens * new_dim - tokens * dim))
  last = (x.offsets[-1] * dim // new_dim).astype(jnp.int32)
  time = (*x.time_capacity[:-1], x.time_capacity[-1] * dim // new_dim)
  values = flat.reshape(new_tokens, new_dim)
  if divides is not True:
    # A sequence that does not divide: cut each length to the new time
    # capacity so that the LoD stays valid, and mark the result.
    lens = jnp.minimum(jnp.diff(last), time[-1])
    last = _segment.offsets_from_lengths(lens)
    values = jnp.where((jnp.arange(new_tokens) < last[-1])[:, None], values, 0)
  out = LoDTensor(values, (*x.offsets[:-1], last), x.num_outer, time, x.faults)
  return with_faults(out, fault_unless(divides, Fault.INPUT))


# -- sequence_scatter ---------------------------------------------------------------


def _check_scatter_args(x: jax.Array, index: LoDTensor, updates: LoDTensor):
  """Trace-time checks; returns the ids ``[rows]`` and updates ``[rows, *f]``."""
  if x.ndim < 2:
    raise ValueError(
      "Expected `x` to have shape [n, width, *features] (rank >= 2), got "
      f"{tuple(x.shape)}."
    )
  _checks.check_float(x.dtype, "x")
  index = check_lod(index, "index", levels=(1,))
  updates = check_lod(updates, "updates", levels=(1,))
  _checks.check_integer(index.values.dtype, "index.values")
  tokens, features = index.capacity.tokens, tuple(x.shape[2:])
  if index.values.shape not in ((tokens,), (tokens, 1)):
    raise ValueError(
      f"Expected `index.values` to have shape [rows] or [rows, 1], got "
      f"{tuple(index.values.shape)}."
    )
  static = (index.capacity.tokens, index.capacity.sequences)
  if (updates.capacity.tokens, updates.capacity.sequences) != static:
    raise ValueError(
      f"Expected `updates` to have the token and count capacities of `index` "
      f"{static}, got {(updates.capacity.tokens, updates.capacity.sequences)}."
    )
  shape = tuple(updates.values.shape)
  if shape[1:] != features and not (not features and shape[1:] == (1,)):
    raise ValueError(
      f"Expected `updates.values` to have shape [rows, *features] = "
      f"[{tokens}, {', '.join(map(str, features)) or '(1)'}] (features from `x` "
      f"of shape {tuple(x.shape)}), got {shape}."
    )
  if updates.values.dtype != x.dtype:
    raise TypeError(
      f"Expected `updates.values` to have the dtype of `x` ({x.dtype}), got "
      f"{updates.values.dtype}."
    )
  return index.values.reshape(tokens), updates.values.reshape(tokens, *features)


def _check_count(x: jax.Array, index: LoDTensor) -> None:
  count, real = index.capacity.sequences[0], index.num_outer
  if x.shape[0] == count or (is_concrete(real) and x.shape[0] == int(real)):
    return
  real = f" or {int(real)} (sequences of `index`)" if is_concrete(real) else ""
  raise ValueError(
    f"Expected `x` to have leading dimension {count} (count capacity of `index`)"
    f"{real}, got shape {tuple(x.shape)}."
  )


def sequence_scatter(
  x: jax.typing.ArrayLike, index: LoDTensor, updates: LoDTensor
) -> jax.Array:
  """Adds the i-th sequence of `updates` to row i of `x` at the i-th ids.

  Paddle's sequence_scatter: ``out = x`` with ``out[i, index_i[j]] +=
  updates_i[j]``, where ``index_i`` and ``updates_i`` are the i-th
  sequences. Repeated ids add up.

  Args:
    x: ``[n, width, *features]`` float array; `n` is the count capacity of
      `index` or, in eager calls, its real number of sequences.
    index: a one-level LoDTensor of integer ids in ``[0, width)``,
      ``values [token_capacity]`` or ``[token_capacity, 1]``.
    updates: a one-level LoDTensor with the LoD of `index` and ``values
      [token_capacity, *features]`` (or ``[token_capacity, 1]`` when there
      are no features) of `x`'s dtype.

  Returns:
    ``[n, width, *features]``. Differentiable in `x` and ``updates.values``;
    padding rows of `updates` get zero gradient. Under `jit`, offsets of
    `index` and `updates` that differ or an id outside ``[0, width)`` turn
    a float result NaN (every item), so the failed check is loud in any
    loss.

  Raises:
    TypeError: for wrong argument types or dtypes.
    ValueError: for wrong shapes or capacities (at trace time); for offsets
      of `index` and `updates` that differ, or an id outside ``[0, width)``
      (eagerly; under `jit` through `jax.experimental.checkify`: wrap the
      caller in `checkify.checkify` to see it; without it the result is
      NaN).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_scatter
    >>> index = LoDTensor.from_lengths(np.array([0, 2, 1, 1]), [[2, 2]])
    >>> updates = LoDTensor.from_lengths(np.array([1.0, 2.0, 3.0, 4.0]), [[2, 2]])
    >>> sequence_scatter(np.zeros((2, 3)), index, updates).tolist()
    [[1.0, 0.0, 2.0], [0.0, 7.0, 0.0]]
  """
  x = as_array(x, "x")
  ids, rows = _check_scatter_args(x, index, updates)
  _check_count(x, index)
  same = check_same_lod(index, updates, "index", "updates", "sequence_scatter")
  n, width = x.shape[:2]
  layout = _segment.rows(index)
  outside = layout.valid & ((ids < 0) | (ids >= width))
  inside = _checks.require_each(
    outside,
    f"sequence_scatter: sequence {{segment}}, position {{position}}: id {{id}} is "
    f"outside [0, {width}) (the width of `x`).",
    segment=layout.segment,
    position=layout.position,
    id=ids,
  )
  keep = layout.valid & ~outside
  target = jnp.where(keep, layout.segment * width + ids.astype(jnp.int32), n * width)
  flat = x.reshape(n * width, *x.shape[2:])
  out = flat.at[target].add(rows, mode="drop").reshape(x.shape)
  return nan_unless(_checks.all_hold(same, inside), out)


# -- lod_reset -----------------------------------------------------------------------


def _as_levels(lengths: Any) -> list[Any]:
  """Paddle recursive lengths as a list of levels; a flat list is one level."""
  if isinstance(lengths, jax.core.Tracer):
    raise TypeError(
      "Expected `lengths` to be host data (lists of ints), got a traced array; "
      "pass `y=` to take a LoD computed under jit."
    )
  if isinstance(lengths, np.ndarray | jax.Array):
    array = np.asarray(lengths)
    return [array] if array.ndim == 1 else list(array)
  if not isinstance(lengths, Sequence) or isinstance(lengths, str | bytes):
    raise TypeError(
      "Expected `lengths` to be a list of lists of ints (Paddle's recursive "
      f"lengths), got {type(lengths).__name__}."
    )
  nested = [isinstance(v, Sequence | np.ndarray | jax.Array) for v in lengths]
  if any(nested) and not all(nested):
    raise ValueError(
      "Expected `lengths` to be a list of ints (one level) or a list of lists "
      f"of ints, got a mix: {list(lengths)!r}."
    )
  return list(lengths) if any(nested) else [lengths]


def _from_lengths(lengths: Any) -> tuple[list[jax.Array], int, list[int], int]:
  """Validated offsets, level-0 count, time capacities and total rows."""
  levels = _as_levels(lengths)
  if not levels:
    raise ValueError("Expected `lengths` to name at least one LoD level, got none.")
  offsets = lengths_to_offsets(levels, "lengths")
  # The last level's total is checked against `x` below, not here.
  offsets = check_offsets(offsets, int(offsets[-1][-1]))
  time = [int(np.max(np.diff(o), initial=0)) for o in offsets]
  arrays = [jnp.asarray(o, jnp.int32) for o in offsets]
  return arrays, offsets[0].size - 1, time, int(offsets[-1][-1])


def lod_reset(
  x: LoDTensor | jax.typing.ArrayLike,
  lengths: Sequence[Sequence[int]] | Sequence[int] | None = None,
  y: LoDTensor | None = None,
) -> LoDTensor:
  """Gives the rows of `x` a new LoD (Paddle's lod_reset).

  Args:
    x: a LoDTensor, ``values [token_capacity, *features]``, or an array
      ``[rows, *features]`` whose rows are all real.
    lengths: host data, Paddle's recursive lengths, outermost level first
      (``[[2, 1], [3, 2, 4]]``); a flat list of ints is one level. The new
      offsets have exact count capacities, and each level's time capacity is
      its longest length.
    y: a LoDTensor whose offsets, real count and time capacities are taken.

  Exactly one of `lengths` and `y` is given.

  Returns:
    A LoDTensor with the values of `x` (same token capacity) and the new LoD.

  Raises:
    TypeError: for a `y` that is not a LoDTensor, or `lengths` that are not
      host lists.
    ValueError: for both or neither of `lengths` and `y`; malformed lengths
      (negative, non-integer, or levels whose sums disagree); a new LoD that
      covers more rows than the token capacity of `x`; and mismatched totals,
      a new LoD whose rows differ from the real rows of `x` (eagerly; under
      `jit` through `jax.experimental.checkify`: wrap the caller in
      `checkify.checkify` to see it).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import lod_reset
    >>> x = LoDTensor.from_lengths(np.arange(6.0), [[2, 3, 1]])
    >>> lod_reset(x, [4, 2]).recursive_lengths()
    [[4, 2]]
    >>> lod_reset(x, [[1, 1], [4, 2]]).recursive_lengths()
    [[1, 1], [4, 2]]
  """
  if (lengths is None) == (y is None):
    got = "neither" if lengths is None else "both"
    raise ValueError(
      f"lod_reset: expected exactly one of `lengths` and `y`, got {got}."
    )
  values, rows = _rows_of(x)
  tokens = values.shape[0]
  if y is None:
    offsets, num_outer, time, total = _from_lengths(lengths)
    if total > tokens:
      raise ValueError(
        f"lod_reset: the new LoD covers {total} rows, more than the token "
        f"capacity {tokens} of `x`."
      )
  else:
    y = check_lod(y, "y")
    offsets, num_outer, time, total = (
      y.offsets,
      y.num_outer,
      y.time_capacity,
      y.num_rows,
    )
  same = _require_equal(
    total,
    rows,
    "lod_reset: mismatched totals: the new LoD covers {got} rows, `x` has "
    "{expected} real rows.",
  )
  if same is not True:
    # The totals differ (under `jit`): the last level's offsets are cut to the
    # rows `x` has and rows past them zeroed, so that the LoD stays valid.
    offsets = (*offsets[:-1], jnp.minimum(offsets[-1], tokens))
    kept = jnp.arange(tokens) < offsets[-1][-1]
    values = where_rows(kept, values, 0)
  out = LoDTensor(values, offsets, jnp.asarray(num_outer, jnp.int32), time)
  inputs = [a for a in (x, y) if isinstance(a, LoDTensor)]
  return with_faults(out, *inputs, fault_unless(same, Fault.INPUT))


def _rows_of(x: Any) -> tuple[jax.Array, Any]:
  """The values of `x` and its real number of rows."""
  if isinstance(x, LoDTensor):
    return x.values, x.num_rows
  values = as_array(x, "x", "a LoDTensor or an array")
  if values.ndim == 0:
    raise ValueError(
      "Expected `x` to be a LoDTensor or an array [rows, *features] (rank >= 1), "
      "got a scalar."
    )
  return values, values.shape[0]
