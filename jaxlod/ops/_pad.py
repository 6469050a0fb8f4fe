"""Between packed rows and padded batches: pad, unpad, mask, reverse.

Padding and unpadding move cells without combining them, so each backward
pass is the inverse gather (`jaxlod.ops._array`'s custom-VJP gather), never
a scatter-add; reversing rows within sequences is a permutation that is its
own inverse.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod._buckets import Buckets, Capacity
from jaxlod._checks import (
  all_hold,
  check_dtype,
  check_integer,
  is_concrete,
  is_integer_dtype,
  nan_where,
  require_each,
  static_int,
)
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import as_array, check_fits_device
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import (
  check_lengths_fit,
  check_pad_value,
  per_sequence,
)
from jaxlod.ops._array import gather, permutation_gather
from jaxlod.ops._segment import (
  Rows,
  build,
  chosen_capacity,
  longest,
  offsets_from_lengths,
  output_capacity,
  rows,
  rows_of,
  total,
)

# -- index maps between packed rows and padded cells ---------------------------------


def _padded_cells(layout: Rows, time: int) -> tuple[jax.Array, jax.Array]:
  """For each packed row, its flattened cell ``sequence * time + position``."""
  valid = layout.valid & (layout.position < time)
  return layout.segment * time + layout.position, valid


def _padded_rows(offsets: jax.Array, time: int, tokens: int):
  """For each cell of ``[count, time]``, flattened: its packed row and validity."""
  steps = jnp.arange(time, dtype=jnp.int32)[None, :]
  row = offsets[:-1, None] + steps
  valid = (steps < jnp.diff(offsets)[:, None]) & (row < tokens)
  return row.reshape(-1), valid.reshape(-1)


# -- pad and unpad -------------------------------------------------------------------


def sequence_pad(
  x: LoDTensor, pad_value: jax.typing.ArrayLike, maxlen: int | None = None
) -> tuple[jax.Array, jax.Array]:
  """Pads the last-level sequences of `x` into a dense batch.

  Paddle's ``sequence_pad``. Differentiable in ``x.values`` (the backward
  pass is a gather) and in `pad_value` (the sum over padded cells).

  Args:
    x: a LoDTensor with ``values [token_capacity, *features]``.
    pad_value: the value of cells past each sequence's end: a scalar or an
      array that broadcasts to ``[*features]``. Integer (and bool) values
      must hold it exactly.
    maxlen: the static length of the time axis; `None` means `x`'s last time
      capacity (Paddle's default, the longest sequence, depends on data).
      A `maxlen` below the longest sequence is an error: eagerly a
      `ValueError`; under `jit` a `jax.experimental.checkify` check, raised
      when the caller is wrapped in ``checkify.checkify``; under plain
      `jit` a float sequence longer than `maxlen` comes back all NaN,
      never cut short (int values come back cut: check them eagerly or
      under checkify).

  Returns:
    ``(padded [count_capacity, maxlen, *features], lengths int32
    [count_capacity])``; padding sequences have length 0 and rows of
    `pad_value`.

  Raises:
    TypeError: if `x` is not a LoDTensor or `maxlen` is not a static int.
    ValueError: for a `pad_value` of the wrong shape, one that integer
      values cannot hold (a fraction, NaN, out of range), or (eagerly) a
      sequence longer than `maxlen`.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_pad
    >>> x = LoDTensor.from_lengths(np.array([1.0, 2.0, 3.0]), [[2, 0, 1]])
    >>> padded, lengths = sequence_pad(x, pad_value=-1.0)
    >>> padded.tolist(), lengths.tolist()
    ([[1.0, 2.0], [-1.0, -1.0], [3.0, -1.0]], [2, 0, 1])
  """
  x = check_lod(x, "x")
  time = x.time_capacity[-1]
  if maxlen is not None:
    time = static_int(maxlen, "maxlen", minimum=0)
  pad = check_pad_value(pad_value, x)
  lengths = x.lengths()
  if time < x.time_capacity[-1]:
    check_lengths_fit(lengths, time, "sequence_pad", "`maxlen`")
  count, tokens = x.capacity.sequences[-1], x.capacity.tokens
  cell_row, cell_valid = _padded_rows(x.offsets[-1], time, tokens)
  row_cell, row_valid = _padded_cells(rows(x), time)
  flat = gather(x.values, cell_row, cell_valid, row_cell, row_valid)
  mask = cell_valid.reshape((-1,) + (1,) * len(x.feature_shape))
  padded = jnp.where(mask, flat, pad).reshape(count, time, *x.feature_shape)
  # Under `jit` a sequence cut short is NaN, not silently truncated.
  return nan_where(jnp.asarray(lengths) > time, padded), lengths


def _num_sequences(num_sequences: Any, count: int) -> Any:
  """The real count: a Python int, or an int32 scalar under jit."""
  if num_sequences is None:
    return count
  if isinstance(num_sequences, int | np.integer) and not isinstance(
    num_sequences, bool
  ):
    num = int(num_sequences)
  else:
    check_fits_device(num_sequences, "num_sequences")
    array = jnp.asarray(num_sequences)
    if array.ndim != 0 or not is_integer_dtype(array.dtype):
      raise TypeError(
        "Expected `num_sequences` to be an int or an integer scalar, got "
        f"{array.dtype}{list(array.shape)}."
      )
    if not is_concrete(array):
      return array.astype(jnp.int32)
    num = int(array)
  if not 0 <= num <= count:
    raise ValueError(
      f"Expected `num_sequences` in [0, {count}] (the count of `padded`), got {num}."
    )
  return num


def _check_unpad_lengths(lengths: jax.Array, time: int, num: Any) -> Any:
  """``0 <= lengths <= time``, and sequences past `num` are empty: `True`
  eagerly (or a `ValueError`), a bool scalar under `jit` (see `require`)."""
  range_text = f"outside [0, {time}] (the time dimension of `padded`)"
  in_range = require_each(
    (lengths < 0) | (lengths > time),
    f"sequence_unpad: lengths[{{i}}] = {{length}} is {range_text}.",
    traced=f"sequence_unpad: a length is {range_text}.",
    length=lengths,
  )
  empty_past = require_each(
    (jnp.arange(lengths.shape[0]) >= num) & (lengths != 0),
    "sequence_unpad: lengths[{i}] = {length}, but sequence {i} is past "
    "`num_sequences` {num}; padding sequences must be empty.",
    traced="sequence_unpad: a sequence past `num_sequences` has a nonzero "
    "length; padding sequences must be empty.",
    length=lengths,
    num=num,
  )
  return all_hold(in_range, empty_past)


def _unpad_lengths(lengths: Any, count: int, num: Any) -> jax.Array:
  check_fits_device(lengths, "lengths")
  lengths = jnp.asarray(lengths)
  check_integer(lengths.dtype, "lengths")
  if lengths.ndim != 1:
    raise ValueError(
      f"Expected `lengths` to have shape [count] ({count},), got {lengths.shape}."
    )
  return per_sequence(lengths, "lengths", count, num).astype(jnp.int32)


def sequence_unpad(
  padded: jax.typing.ArrayLike,
  lengths: jax.typing.ArrayLike,
  *,
  num_sequences: Any = None,
  capacity: int | Buckets | None = None,
) -> LoDTensor:
  """Packs the first ``lengths[i]`` rows of each ``padded[i]`` into a LoDTensor.

  Paddle's ``sequence_unpad``, the inverse of `sequence_pad`:
  ``sequence_unpad(*sequence_pad(x, 0.0), num_sequences=x.num_outer)`` has
  `x`'s LoD and rows. Differentiable in `padded` (the backward pass is a
  gather; cells past each length get zero gradient).

  Args:
    padded: ``[count, time, *features]``.
    lengths: integer ``[count]`` (or, eagerly, ``[num_sequences]``), with
      ``0 <= lengths[i] <= time``.
    num_sequences: the real number of sequences (an int or an int32 scalar),
      stored as the result's ``num_outer``; sequences past it must be empty.
      `None` means `count`.
    capacity: the output capacity: `None` for the static bound
      ``Capacity(count * time, (count,), (time,))``, an int for the token
      capacity, or a `Buckets` policy.

  Returns:
    A one-level LoDTensor with ``values [token_capacity, *features]``.

  Raises:
    TypeError: for integer arguments of the wrong type.
    ValueError: for wrong shapes, and eagerly for lengths out of range, a
      nonzero length past `num_sequences`, or data over `capacity`. Under
      `jit` these value checks go through `jax.experimental.checkify`: wrap
      the caller in ``checkify.checkify`` to raise them.

  Example:
    >>> import numpy as np
    >>> from jaxlod.ops import sequence_unpad
    >>> x = sequence_unpad(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([1, 2]))
    >>> x.recursive_lengths(), x.values.tolist()
    ([[1, 2]], [1.0, 3.0, 4.0, 0.0])
  """
  padded = as_array(padded, "padded")
  if padded.ndim < 2:
    raise ValueError(
      "Expected `padded` to have shape [count, time, *features] (rank >= 2), got "
      f"{padded.shape}."
    )
  count, time = padded.shape[:2]
  num = _num_sequences(num_sequences, count)
  lengths = _unpad_lengths(lengths, count, num)
  ok = _check_unpad_lengths(lengths, time, num)
  real = Capacity(total(lengths), (num,), (longest(lengths),))
  bound = Capacity(count * time, (count,), (time,))
  cap = output_capacity(capacity, bound=bound, real=real, where="sequence_unpad")
  lengths = jnp.clip(lengths, 0, time)  # a no-op unless a check above failed
  return with_faults(_pack(padded, lengths, num, cap), fault_unless(ok, Fault.INPUT))


def unpad_unchecked(
  padded: jax.Array, lengths: jax.Array, capacity: Buckets | None
) -> LoDTensor:
  """`sequence_unpad` of ``padded [count, time, ...]`` by int ``lengths
  [count]`` without its value checks, for a caller that makes bad lengths
  loud itself (the drop-in RNN makes their sequences NaN): a `checkify`
  check is an effect, and JAX dispatches a jitted function with an effect
  on its slower path. Lengths are clipped to ``[0, time]``, and data over
  `capacity` records `Fault.CAPACITY` in the result (`build`)."""
  count, time = padded.shape[:2]
  lengths = jnp.clip(lengths, 0, time)
  real = Capacity(total(lengths), (count,), (longest(lengths),))
  bound = Capacity(count * time, (count,), (time,))
  cap = chosen_capacity(capacity, bound=bound, real=real, where="sequence_unpad")
  return _pack(padded, lengths, count, cap)


def _pack(padded: jax.Array, lengths: jax.Array, num: Any, cap: Capacity) -> LoDTensor:
  """The first ``lengths[i]`` rows of each ``padded[i]`` (lengths in ``[0,
  time]``) as a LoDTensor of capacity `cap`."""
  time = padded.shape[1]
  offsets = offsets_from_lengths(lengths)
  row_cell, row_valid = _padded_cells(rows_of(offsets, cap.tokens), time)
  cell_row, cell_valid = _padded_rows(offsets, time, cap.tokens)
  flat = padded.reshape(-1, *padded.shape[2:])
  values = gather(flat, row_cell, row_valid, cell_row, cell_valid)
  return build(values, [lengths], num, cap)


# -- mask and reverse ----------------------------------------------------------------


def sequence_mask(
  lengths: jax.typing.ArrayLike, maxlen: int | None = None, dtype: Any = jnp.bool_
) -> jax.Array:
  """``mask[..., j] = j < lengths[...]``.

  Paddle's ``sequence_mask``, whose default dtype is int64; here the default
  is bool. Ask for an integer mask with ``dtype=jnp.int32`` (int64 needs
  ``jax.enable_x64``).

  Args:
    lengths: integer lengths of any shape ``[*batch]``.
    maxlen: the static length of the last axis. `None` means the largest
      length, which can only be read in eager calls.
    dtype: the dtype of the mask.

  Returns:
    ``[*batch, maxlen]`` of `dtype`.

  Raises:
    TypeError: if `lengths` is not integer or `maxlen` is not a static int.
    ValueError: for `maxlen=None` under `jit`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlod.ops import sequence_mask
    >>> sequence_mask(jnp.array([2, 0, 3]), dtype=jnp.int32).tolist()
    [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
  """
  check_fits_device(lengths, "lengths")
  lengths = jnp.asarray(lengths)
  check_integer(lengths.dtype, "lengths")
  check_dtype(dtype, "dtype")
  if maxlen is None:
    if not is_concrete(lengths):
      raise ValueError(
        "sequence_mask: `maxlen` must be given as a static int under jit (the "
        "mask's shape cannot depend on the values of `lengths`), got None."
      )
    maxlen = int(np.max(np.asarray(lengths), initial=0))
  maxlen = static_int(maxlen, "maxlen", minimum=0)
  steps = jnp.arange(maxlen, dtype=jnp.int32)
  return (steps < lengths[..., None]).astype(dtype)


def sequence_reverse(x: LoDTensor) -> LoDTensor:
  """Reverses the rows within each last-level sequence.

  Paddle's ``sequence_reverse``, for any number of levels and any dtype.
  Padding rows stay zeros. Differentiable; the backward pass is the same
  permutation (padding rows get zero gradient).

  Args:
    x: a LoDTensor with ``values [token_capacity, *features]``.

  Returns:
    A LoDTensor with `x`'s LoD.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_reverse
    >>> x = LoDTensor.from_lengths(np.array([1, 2, 3, 4]), [[3, 0, 1]])
    >>> sequence_reverse(x).values.tolist()
    [3, 2, 1, 4]
  """
  x = check_lod(x, "x")
  if x.capacity.tokens == 0 or x.capacity.sequences[-1] == 0:
    return x
  layout = rows(x)
  offsets = x.offsets[-1]
  mirrored = offsets[layout.segment + 1] - 1 - layout.position
  index = jnp.arange(x.capacity.tokens, dtype=jnp.int32)
  perm = jnp.where(layout.valid, mirrored, index).astype(jnp.int32)
  values = permutation_gather(x.values, perm, perm)
  # Padding rows map to themselves; masking them gives them zero gradient.
  valid = layout.valid.reshape((-1,) + (1,) * len(x.feature_shape))
  return x.with_values(jnp.where(valid, values, jnp.zeros((), values.dtype)))
