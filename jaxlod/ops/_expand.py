"""Ops whose output LoD depends on data: expand, concat, erase, slice.

Paddle's ``sequence_expand``, ``sequence_expand_as``, ``sequence_concat``,
``sequence_erase`` and ``sequence_slice``. Each output row is a gathered input
row (or zeros for padding), so the backward pass is the transposed gather:
gradients of repeated rows add up, and padding gets zero gradient.

The outputs of `sequence_expand`, `sequence_expand_as`, `sequence_concat` and
`sequence_erase` have sizes that depend on data. Their static capacity comes
from the ``capacity=`` argument: `None` for the bound the inputs' capacities
allow, an int for the token capacity, or a `Buckets` policy. Data is never
truncated: an eager call raises `ValueError` on overflow and a jitted call
reports it through `jax.experimental.checkify` when wrapped in
``checkify.checkify``.

Each op checks its arguments (and, eagerly, the data) on the host, then runs
one jitted kernel per static output capacity, so eager calls do not dispatch
op by op.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod import _checks
from jaxlod._buckets import Buckets, Capacity
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import check_fits_device
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import check_level, per_sequence
from jaxlod.ops import _segment
from jaxlod.ops._array import masked_take

# -- private helpers -------------------------------------------------------------


def _fit_offsets(offsets: jax.Array, count: int) -> jax.Array:
  """Offsets ``[c + 1]`` cut or edge-padded to ``[count + 1]`` (eager use)."""
  if offsets.shape[0] >= count + 1:
    return offsets[: count + 1]
  return jnp.pad(offsets, (0, count + 1 - offsets.shape[0]), mode="edge")


def _items(y: LoDTensor, level: int) -> int:
  """The static number of items of `y`'s `level` (sequences or rows)."""
  if level + 1 < y.num_levels:
    return y.capacity.sequences[level + 1]
  return y.capacity.tokens


# -- sequence_expand / sequence_expand_as ----------------------------------------


@functools.partial(jax.jit, static_argnames=("cap",))
def _repeat_rows(
  x: jax.Array, lengths: jax.Array, num_outer: jax.Array, cap: Capacity
) -> LoDTensor:
  """Sequence ``i`` is row ``i`` of `x` repeated ``lengths[i]`` times."""
  layout = _segment.rows_of(_segment.offsets_from_lengths(lengths), cap.tokens)
  values = masked_take(x, layout.segment, layout.valid)
  return _segment.build(values, [lengths], num_outer, cap)


def _expand_rows(
  x: jax.Array, y: LoDTensor, level: int, capacity: Any, where: str
) -> LoDTensor:
  """Row ``i`` of `x` repeated ``y.lengths(level)[i]`` times, as sequence ``i``."""
  count = y.capacity.sequences[level]
  x = per_sequence(x, "x", count, y.num_sequences(level))
  lengths = y.lengths(level)
  bound = Capacity(_items(y, level), (count,), (y.time_capacity[level],))
  real = Capacity(
    _segment.total(lengths),
    (y.num_sequences(level),),
    (_segment.longest(lengths),),
  )
  cap = _segment.output_capacity(capacity, bound=bound, real=real, where=where)
  return _repeat_rows(x, lengths, y.num_sequences(level), cap)


def _match_counts(x: LoDTensor, y: LoDTensor, level: int) -> tuple[jax.Array, Any]:
  """`x`'s offsets on `y`'s count capacity at `level`, and whether the real
  counts agree (checked: see `_checks.require`)."""
  cx, cy = x.capacity.sequences[0], y.capacity.sequences[level]
  nx, ny = x.num_sequences(0), y.num_sequences(level)
  same = _checks.require(
    nx == ny,
    "sequence_expand: expected `x` to have {ny} sequences (those of `y` at level "
    f"{level}), got {{nx}}.",
    nx=nx,
    ny=ny,
  )
  if _checks.is_concrete(nx, ny):
    return _fit_offsets(x.offsets[0], cy), same
  if cx != cy:
    raise ValueError(
      f"Expected `x` to have count capacity {cy} (the count capacity of `y` at "
      f"level {level}), got {cx}."
    )
  return x.offsets[0], same


@functools.partial(jax.jit, static_argnames=("cap",))
def _copy_sequences(
  values: jax.Array, offsets: jax.Array, repeats: jax.Array, cap: Capacity
) -> LoDTensor:
  """``repeats[i]`` copies of the sequence ``i`` of ``(values, offsets)``."""
  copies = _segment.rows_of(_segment.offsets_from_lengths(repeats), cap.sequences[0])
  lengths = masked_take(jnp.diff(offsets), copies.segment, copies.valid)
  starts = masked_take(offsets[:-1], copies.segment, copies.valid)
  layout = _segment.rows_of(_segment.offsets_from_lengths(lengths), cap.tokens)
  source = masked_take(starts, layout.segment, layout.valid) + layout.position
  out = masked_take(values, source, layout.valid)
  return _segment.build(out, [lengths], jnp.sum(repeats), cap)


def _expand_sequences(
  x: LoDTensor, y: LoDTensor, level: int, capacity: Any
) -> LoDTensor:
  """``y.lengths(level)[i]`` copies of `x`'s sequence ``i``, one per sequence."""
  offsets, same = _match_counts(x, y, level)
  repeats, x_lengths = y.lengths(level), jnp.diff(offsets)
  bound = Capacity(
    _items(y, level) * x.time_capacity[0],
    (_items(y, level),),
    (x.time_capacity[0],),
  )
  real = Capacity(
    _segment.total(repeats * x_lengths),
    (_segment.total(repeats),),
    (_segment.longest(jnp.where(repeats > 0, x_lengths, 0)),),
  )
  cap = _segment.output_capacity(
    capacity, bound=bound, real=real, where="sequence_expand"
  )
  out = _copy_sequences(x.values, offsets, repeats, cap)
  return with_faults(out, x, y, fault_unless(same, Fault.INPUT))


def sequence_expand(
  x: jax.typing.ArrayLike | LoDTensor,
  y: LoDTensor,
  ref_level: int = -1,
  *,
  capacity: int | Buckets | None = None,
) -> LoDTensor:
  """Repeats each row or sequence of `x` as often as `y`'s lengths say.

  Paddle's ``sequence_expand``. With ``len_i = y.lengths(ref_level)[i]``:

  * `x` an array: sequence ``i`` of the output is row ``i`` of `x` repeated
    ``len_i`` times (Paddle returns the rows without LoD; here the LoD
    ``[len_0, len_1, ...]`` is kept, with the real number of rows).
  * `x` a one-level LoDTensor: the output holds ``len_i`` copies of `x`'s
    sequence ``i``, each copy its own sequence.

  Args:
    x: an array ``[count, *features]`` or a one-level LoDTensor with
      ``values [token_capacity, *features]``. Its count (``count`` or its
      count capacity) is `y`'s count capacity at `ref_level`; in eager calls
      the real number of sequences of `y` at `ref_level` works too.
    y: a LoDTensor; only its offsets are read.
    ref_level: the level of `y` whose lengths give the repeats, in
      ``[-num_levels, num_levels)``.
    capacity: the output's static capacity: `None` for the bound the inputs'
      capacities allow (count: the items of `y`'s level ``ref_level + 1``,
      tokens: that count times `x`'s time capacity for a LoDTensor `x`), an
      int for the token capacity, or a `Buckets` policy.

  Returns:
    A one-level LoDTensor ``values [tokens, *features]``. Differentiable in
    `x` (in ``x.values``); the gradient of a row sums over its copies.

  Raises:
    TypeError: if `y` is not a LoDTensor or `ref_level` is not an int.
    ValueError: for a `ref_level` out of range, a LoDTensor `x` with more
      than one level, mismatched sequence counts, or an output larger than
      `capacity` (eagerly; under `jit` the overflow and a mismatch of the
      real counts are `jax.experimental.checkify` checks: wrap the caller in
      ``checkify.checkify`` and call ``err.throw()`` to see them).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_expand
    >>> x = LoDTensor.from_lengths(np.array([1.0, 2.0, 3.0, 4.0]), [[2, 2]])
    >>> y = LoDTensor.from_lengths(np.zeros(8), [[2, 2], [3, 3, 1, 1]])
    >>> out = sequence_expand(x, y, ref_level=0)
    >>> out.recursive_lengths(), out.to_list()[1].tolist()
    ([[2, 2, 2, 2]], [1.0, 2.0])
    >>> sequence_expand(np.array([5.0, 6.0]), y, 0).to_list()[1].tolist()
    [6.0, 6.0]
  """
  y = check_lod(y, "y")
  level = check_level(y, ref_level, "ref_level")
  if isinstance(x, LoDTensor):
    x = check_lod(x, "x", levels=(1,))
    return _expand_sequences(x, y, level, capacity)
  return with_faults(_expand_rows(x, y, level, capacity, "sequence_expand"), y)


def sequence_expand_as(
  x: jax.typing.ArrayLike,
  y: LoDTensor,
  *,
  capacity: int | Buckets | None = None,
) -> LoDTensor:
  """Repeats row ``i`` of `x` ``y.lengths(0)[i]`` times; the output takes `y`'s LoD.

  Paddle's ``sequence_expand_as``: the output's LoD is `y`'s level 0.

  Args:
    x: ``[count, *features]``, one row per level-0 sequence of `y`: ``count``
      is `y`'s level-0 count capacity or, in eager calls, its real number of
      level-0 sequences.
    y: a LoDTensor; only its offsets are read.
    capacity: the output's static capacity: `None` for the bound (`y`'s
      token capacity for one level, its level-1 count capacity for two), an
      int for the token capacity, or a `Buckets` policy.

  Returns:
    A one-level LoDTensor ``values [tokens, *features]`` with lengths
    ``y.lengths(0)``. Differentiable in `x`; row ``i`` gets the sum of the
    gradients of its copies.

  Raises:
    TypeError: if `x` is a LoDTensor or `y` is not one.
    ValueError: for a `x` of the wrong leading dimension, or an output larger
      than `capacity` (eagerly; under `jit` a `jax.experimental.checkify`
      check: wrap the caller in ``checkify.checkify``).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_expand_as
    >>> y = LoDTensor.from_lengths(np.zeros(4), [[1, 0, 3]])
    >>> sequence_expand_as(np.array([1.0, 2.0, 3.0]), y).values.tolist()
    [1.0, 3.0, 3.0, 3.0]
  """
  y = check_lod(y, "y")
  if isinstance(x, LoDTensor):
    raise TypeError(
      "Expected `x` to be an array [count, *features] (one row per sequence of "
      "`y`), got LoDTensor."
    )
  return with_faults(_expand_rows(x, y, 0, capacity, "sequence_expand_as"), y)


# -- sequence_concat ---------------------------------------------------------------


def _check_concat_inputs(xs: Any) -> list[LoDTensor]:
  """Trace-time checks of `sequence_concat`'s inputs against ``xs[0]``."""
  if not isinstance(xs, list | tuple):
    raise TypeError(f"Expected `xs` to be a list or tuple, got {type(xs).__name__}.")
  if not xs:
    raise ValueError("Expected `xs` to hold at least one LoDTensor, got none.")
  xs = [check_lod(x, f"xs[{i}]", levels=(1,)) for i, x in enumerate(xs)]
  first = xs[0]
  for i, x in enumerate(xs[1:], start=1):
    checks = (
      ("count capacity", first.capacity.sequences[0], x.capacity.sequences[0]),
      ("feature shape", first.feature_shape, x.feature_shape),
    )
    for what, want, got in checks:
      if want != got:
        raise ValueError(
          f"Expected `xs[{i}]` to have {what} {want} (that of `xs[0]`), got {got}."
        )
    if x.values.dtype != first.values.dtype:
      raise TypeError(
        f"Expected `xs[{i}]` to have dtype {first.values.dtype} (that of "
        f"`xs[0]`), got {x.values.dtype}."
      )
  return xs


def _check_counts(xs: list[LoDTensor]) -> Any:
  """Every input has the real number of sequences of ``xs[0]`` (checked: see
  `_checks.require_each`, whose result it returns)."""
  counts = jnp.stack([x.num_sequences(0) for x in xs])
  return _checks.require_each(
    counts != counts[0],
    "sequence_concat: `xs[{i}]` has {count} sequences, `xs[0]` has {first}; "
    "expected the same number.",
    count=counts,
    first=jnp.broadcast_to(counts[0], counts.shape),
  )


def _concat_sources(
  lengths: jax.Array, starts: jax.Array, bases: np.ndarray, layout: _segment.Rows
) -> jax.Array:
  """The row of the stacked inputs that each output row copies.

  Args:
    lengths: ``[inputs, count]`` lengths of every input.
    starts: ``[inputs, count]`` first row of each sequence of every input.
    bases: static ``[inputs]`` first row of each input in the stacked values.
    layout: the output rows.
  """
  if lengths.shape[1] == 0:
    return jnp.zeros_like(layout.position)
  segment, position = layout.segment, layout.position
  ends = jnp.cumsum(lengths, axis=0)
  part = jnp.sum(position[None, :] >= ends[:, segment], axis=0)
  part = jnp.minimum(part, lengths.shape[0] - 1)
  before = (ends - lengths)[part, segment]
  start = starts[part, segment] + jnp.asarray(bases, jnp.int32)[part]
  return start + position - before


@functools.partial(jax.jit, static_argnames=("cap",))
def _concat_kernel(
  values: tuple[jax.Array, ...],
  starts: jax.Array,
  lengths: jax.Array,
  num_outer: jax.Array,
  cap: Capacity,
) -> LoDTensor:
  """Sequence ``i`` is sequence ``i`` of each input, one after another.

  Args:
    values: each input's ``[token_capacity_k, *features]`` rows.
    starts: ``[inputs, count]`` first row of each sequence of every input.
    lengths: ``[inputs, count]`` lengths of every input.
    num_outer: the real number of sequences.
    cap: the output's capacity.
  """
  out_lengths = jnp.sum(lengths, axis=0)
  layout = _segment.rows_of(_segment.offsets_from_lengths(out_lengths), cap.tokens)
  bases = np.cumsum([0] + [v.shape[0] for v in values[:-1]])
  source = _concat_sources(lengths, starts, bases, layout)
  out = masked_take(jnp.concatenate(values, axis=0), source, layout.valid)
  return _segment.build(out, [out_lengths], num_outer, cap)


def sequence_concat(
  xs: Sequence[LoDTensor], *, capacity: int | Buckets | None = None
) -> LoDTensor:
  """Concatenates the ``i``-th sequences of each input.

  Paddle's ``sequence_concat``: output sequence ``i`` is sequence ``i`` of
  ``xs[0]``, then sequence ``i`` of ``xs[1]``, and so on.

  Args:
    xs: one-level LoDTensors ``values [token_capacity_k, *features]`` with
      the same count capacity, real number of sequences, feature shape and
      dtype.
    capacity: the output's static capacity: `None` for the bound (the sum of
      the token capacities, the shared count capacity, the sum of the time
      capacities), an int for the token capacity, or a `Buckets` policy.

  Returns:
    A one-level LoDTensor ``values [tokens, *features]``. Differentiable in
    every ``xs[k].values``.

  Raises:
    TypeError: if `xs` is not a list or tuple, holds something other than a
      LoDTensor, or mixes dtypes.
    ValueError: for an empty `xs`, an input with more than one level, or
      inputs that disagree in count capacity, feature shape or real number of
      sequences; or an output larger than `capacity`. Under `jit` the real
      counts and the overflow are `jax.experimental.checkify` checks: wrap
      the caller in ``checkify.checkify`` to see them.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_concat
    >>> a = LoDTensor.from_lengths(np.array([1.0, 2.0, 3.0]), [[2, 1]])
    >>> b = LoDTensor.from_lengths(np.array([4.0, 5.0]), [[0, 2]])
    >>> [s.tolist() for s in sequence_concat([a, b]).to_list()]
    [[1.0, 2.0], [3.0, 4.0, 5.0]]
  """
  xs = _check_concat_inputs(xs)
  same = _check_counts(xs)
  lengths = jnp.stack([x.lengths(0) for x in xs])
  out_lengths = jnp.sum(lengths, axis=0)
  tokens = [x.capacity.tokens for x in xs]
  bound = Capacity(
    sum(tokens), xs[0].capacity.sequences, (sum(x.time_capacity[0] for x in xs),)
  )
  real = Capacity(
    _segment.total(out_lengths),
    (xs[0].num_sequences(0),),
    (_segment.longest(out_lengths),),
  )
  cap = _segment.output_capacity(
    capacity, bound=bound, real=real, where="sequence_concat"
  )
  starts = jnp.stack([x.offsets[0][:-1] for x in xs])
  values = tuple(x.values for x in xs)
  out = _concat_kernel(values, starts, lengths, xs[0].num_outer, cap)
  return with_faults(out, *xs, fault_unless(same, Fault.INPUT))


# -- sequence_erase ----------------------------------------------------------------


def _is_int(value: Any) -> bool:
  """A Python or NumPy int, or an integer scalar array (a tracer under `jit`)."""
  if isinstance(value, bool):
    return False
  if isinstance(value, int | np.integer):
    return True
  dtype = getattr(value, "dtype", None)
  return dtype is not None and np.ndim(value) == 0 and _checks.is_integer_dtype(dtype)


def _check_tokens(tokens: Any) -> jax.Array:
  """`tokens` as a 1-D integer array ``[n]``."""
  if _is_int(tokens):
    tokens = [tokens]
  if isinstance(tokens, list | tuple):
    for i, t in enumerate(tokens):
      if not _is_int(t):
        raise TypeError(f"Expected `tokens[{i}]` to be an int, got {t!r}.")
    if not tokens:
      return jnp.zeros((0,), jnp.int32)
    for i, t in enumerate(tokens):
      check_fits_device(t, f"tokens[{i}]")
    return jnp.stack([jnp.asarray(t) for t in tokens])
  if not isinstance(tokens, np.ndarray | jax.Array):
    raise TypeError(
      "Expected `tokens` to be an int, a list or tuple of ints or an integer "
      f"array, got {type(tokens).__name__}."
    )
  _checks.check_integer(tokens.dtype, "tokens")
  check_fits_device(tokens, "tokens")
  _checks.check_rank(tokens.shape, "tokens", (0, 1), "[] or [n]")
  return jnp.reshape(tokens, (-1,))


def _check_id_values(x: LoDTensor, name: str) -> None:
  """``values`` of integer ids, ``[rows]`` or ``[rows, 1]``."""
  _checks.check_integer(x.values.dtype, f"{name}.values")
  shape = x.values.shape
  doc = "[token_capacity] or [token_capacity, 1]"
  _checks.check_rank(shape, f"{name}.values", (1, 2), doc)
  if len(shape) == 2 and shape[1] != 1:
    raise ValueError(f"Expected `{name}.values` to have shape {doc}, got {shape}.")


@jax.jit
def _kept_rows(x: LoDTensor, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Which rows of `x` stay (``[token_capacity]``) and the new last lengths."""
  layout = _segment.rows(x)
  ids = x.values.reshape(-1)
  keep = layout.valid & ~jnp.isin(ids, tokens.astype(ids.dtype))
  count = x.capacity.sequences[-1]
  return keep, _segment.masked_segment_sum(keep.astype(jnp.int32), layout, count)


@functools.partial(jax.jit, static_argnames=("cap",))
def _compact(
  values: jax.Array,
  keep: jax.Array,
  lengths: list[jax.Array],
  num_outer: jax.Array,
  cap: Capacity,
) -> LoDTensor:
  """The kept rows of `values`, in order, as a LoDTensor of `lengths`."""
  target = jnp.where(keep, jnp.cumsum(keep) - 1, cap.tokens)
  out = jnp.zeros((cap.tokens, *values.shape[1:]), values.dtype)
  out = out.at[target].set(values, mode="drop")
  return _segment.build(out, lengths, num_outer, cap)


def sequence_erase(
  x: LoDTensor, tokens: Any, *, capacity: int | Buckets | None = None
) -> LoDTensor:
  """Removes the given token ids from integer sequences and fixes the LoD.

  Paddle's ``sequence_erase``. Upper levels keep their lengths; the last
  level's sequences shrink by the rows removed from them.

  Args:
    x: a LoDTensor of integer ids, ``values [token_capacity]`` or
      ``[token_capacity, 1]``, with one or more levels.
    tokens: the ids to remove: an int, a list or tuple of ints, or an integer
      array ``[n]`` (or a scalar).
    capacity: the output's static capacity: `None` for `x`'s capacities (the
      output never grows), an int for the token capacity, or a `Buckets`
      policy (applied to the real sizes in eager calls).

  Returns:
    A LoDTensor with `x`'s number of levels and feature shape; the time
    capacities are those of `x` unless `capacity` is a `Buckets` policy.

  Raises:
    TypeError: for a non-integer `x` or `tokens`, or a `tokens` of another
      type.
    ValueError: for `x.values` of the wrong shape, a `tokens` array of rank
      above 1, or an output larger than `capacity` (eagerly; under `jit` a
      `jax.experimental.checkify` check: wrap the caller in
      ``checkify.checkify``).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_erase
    >>> ids = np.array([2, 2, 6, 1, 3, 9, 6, 1, 0, 1])
    >>> x = LoDTensor.from_lengths(ids, [[3, 3, 4]])
    >>> out = sequence_erase(x, [2, 3, 5])
    >>> out.recursive_lengths(), out.values.tolist()
    ([[1, 2, 4]], [6, 1, 9, 6, 1, 0, 1, 0, 0, 0])
  """
  x = check_lod(x, "x")
  _check_id_values(x, "x")
  keep, last = _kept_rows(x, _check_tokens(tokens))
  lengths = [x.lengths(level) for level in range(x.num_levels - 1)] + [last]
  real = Capacity(
    _segment.total(last),
    tuple(x.num_sequences(level) for level in range(x.num_levels)),
    tuple(_segment.longest(lens) for lens in lengths),
  )
  cap = _segment.output_capacity(
    capacity, bound=x.capacity, real=real, where="sequence_erase"
  )
  return with_faults(_compact(x.values, keep, lengths, x.num_outer, cap), x)


# -- sequence_slice ----------------------------------------------------------------


def _per_sequence_ints(value: Any, name: str, x: LoDTensor) -> jax.Array:
  """An integer ``[count]`` or ``[count, 1]`` argument as ``[count_capacity]``."""
  dtype = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
  _checks.check_integer(dtype, name)
  check_fits_device(value, name)
  array = jnp.asarray(value)
  doc = "[count] or [count, 1]"
  _checks.check_rank(array.shape, name, (1, 2), doc)
  if array.ndim == 2 and array.shape[1] != 1:
    raise ValueError(f"Expected `{name}` to have shape {doc}, got {array.shape}.")
  count = x.capacity.sequences[-1]
  array = per_sequence(array, name, count, x.num_sequences(-1))
  return array.reshape(count).astype(jnp.int32)


@jax.jit
def _slice_kernel(x: LoDTensor, offset: jax.Array, length: jax.Array) -> LoDTensor:
  """Rows ``[offset_i, offset_i + length_i)`` of each last-level sequence.

  Out-of-range slices (checked by the caller) are clipped into the sequence.
  """
  sizes = x.lengths()
  offset = jnp.clip(offset, 0, sizes)
  length = jnp.clip(length, 0, sizes - offset)
  layout = _segment.rows_of(_segment.offsets_from_lengths(length), x.capacity.tokens)
  starts = x.offsets[-1][:-1] + offset
  source = masked_take(starts, layout.segment, layout.valid) + layout.position
  values = masked_take(x.values, source, layout.valid)
  lengths = [x.lengths(level) for level in range(x.num_levels - 1)] + [length]
  return _segment.build(values, lengths, x.num_outer, x.capacity)


def sequence_slice(
  x: LoDTensor, offset: jax.typing.ArrayLike, length: jax.typing.ArrayLike
) -> LoDTensor:
  """Takes the rows ``[offset_i, offset_i + length_i)`` of each sequence.

  Paddle's ``sequence_slice``, on the last level of `x` (upper levels keep
  their lengths). The output has `x`'s capacities: it never grows.

  Args:
    x: a LoDTensor ``values [token_capacity, *features]``, one or more levels.
    offset: integer ``[count]`` or ``[count, 1]`` (Paddle's layout), the first
      row of each last-level sequence to keep; ``count`` is the last level's
      count capacity or, in eager calls, its real number of sequences.
    length: integer, the same shape as `offset`: the rows to keep.

  Returns:
    A LoDTensor with `x`'s capacities and last-level lengths `length`.
    Differentiable in ``x.values``: kept rows get their gradient, the others
    zero.

  Raises:
    TypeError: for a non-integer `offset` or `length`.
    ValueError: for an `offset` or `length` of the wrong shape, or a slice
      out of range (``offset < 0``, ``length < 0`` or ``offset + length``
      past the sequence's end): eagerly with the sequence index and the
      values; under `jit` through `jax.experimental.checkify` (wrap the
      caller in ``checkify.checkify``).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_slice
    >>> x = LoDTensor.from_lengths(np.arange(5.0), [[3, 2]])
    >>> out = sequence_slice(x, np.array([[0], [1]]), np.array([[2], [1]]))
    >>> out.recursive_lengths(), out.values.tolist()
    ([[2, 1]], [0.0, 1.0, 4.0, 0.0, 0.0])
  """
  x = check_lod(x, "x")
  offset = _per_sequence_ints(offset, "offset", x)
  length = _per_sequence_ints(length, "length", x)
  sizes = x.lengths()
  in_range = _checks.require_each(
    # `length > sizes - offset` rather than `offset + length > sizes`: the
    # sum of two int32 values can wrap past the limit and pass.
    (offset < 0) | (length < 0) | (offset > sizes) | (length > sizes - offset),
    "sequence_slice: sequence {i} has length {size}, got offset {offset} and "
    "length {length}; expected offset >= 0, length >= 0 and offset + length <= "
    "{size}.",
    size=sizes,
    offset=offset,
    length=length,
  )
  out = _slice_kernel(x, offset, length)
  return with_faults(out, x, fault_unless(in_range, Fault.INPUT))
