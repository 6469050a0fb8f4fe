"""Context windows within sequences: sequence_conv and sequence_enumerate.

Both ops look at rows a static number of steps away from each row. A static
shift of the packed rows (a pad and a slice, no gather) brings those rows
next to each other; a mask keeps only the ones inside the row's own sequence.
The backward pass of a shift is the opposite shift, so gradients need no
scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxlod import _checks
from jaxlod._buckets import Buckets
from jaxlod._faults import with_faults
from jaxlod._host import as_array, fill_value
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.ops import _segment

# -- private helpers ------------------------------------------------------------


def _shift(values: jax.Array, shift: int) -> jax.Array:
  """``out[r] = values[r + shift]``, zeros where ``r + shift`` is out of range."""
  tokens = values.shape[0]
  pad = [(max(-shift, 0), max(shift, 0))] + [(0, 0)] * (values.ndim - 1)
  start = max(shift, 0)
  return jax.lax.slice_in_dim(jnp.pad(values, pad), start, start + tokens, axis=0)


def _windows(x: LoDTensor, shifts: Sequence[int]) -> tuple[jax.Array, jax.Array]:
  """Rows ``r + s`` for each static shift ``s``, and where they are in range.

  Returns:
    ``(windows [tokens, len(shifts), *features], inside [tokens, len(shifts)])``;
    `inside` is True where row ``r + s`` is in the same sequence as row ``r``
    and ``r`` is a real row. Windows outside are not masked here.
  """
  # A shift of the token capacity or more leaves every row: clamped, it stays
  # outside, fits int32 and pads no more than `tokens` rows.
  tokens = x.capacity.tokens
  shifts = [min(max(s, -tokens), tokens) for s in shifts]
  layout = _segment.rows(x)
  offsets = x.offsets[-1]
  length = jnp.take(offsets, layout.segment + 1, mode="clip") - jnp.take(
    offsets, layout.segment, mode="clip"
  )
  steps = layout.position[:, None] + jnp.asarray(shifts, jnp.int32)[None, :]
  inside = (steps >= 0) & (steps < length[:, None]) & layout.valid[:, None]
  windows = jnp.stack([_shift(x.values, s) for s in shifts], axis=1)
  return windows, inside


def _check_conv_params(x: LoDTensor, filter: jax.Array, bias: Any, length: int):
  dim = x.values.shape[1]
  if filter.ndim != 2 or filter.shape[0] != length * dim:
    raise ValueError(
      f"Expected `filter` to have shape [context_length * D, out] = "
      f"[{length * dim}, out] (context_length {length}, `x.values` of shape "
      f"{tuple(x.values.shape)}), got {tuple(filter.shape)}."
    )
  _checks.check_float(filter.dtype, "filter")
  if bias is None:
    return None
  bias = as_array(bias, "bias", "an array or None")
  if bias.shape != (filter.shape[1],):
    raise ValueError(
      f"Expected `bias` to have shape ({filter.shape[1]},) ([out], from `filter` "
      f"of shape {tuple(filter.shape)}), got {tuple(bias.shape)}."
    )
  _checks.check_float(bias.dtype, "bias")
  return bias


# -- public ops -------------------------------------------------------------------


def sequence_conv(
  x: LoDTensor,
  filter: jax.typing.ArrayLike,
  context_start: int | None = None,
  context_length: int = 3,
  context_stride: int = 1,
  bias: jax.typing.ArrayLike | None = None,
) -> LoDTensor:
  """Context-window projection within each sequence (Paddle's sequence_conv).

  Row ``r`` of a sequence gathers the rows ``r + context_start + k *
  context_stride`` for ``k`` in ``[0, context_length)``; a row outside the
  sequence contributes zeros (sequences never see each other). The k-th row
  fills columns ``[k * D, (k + 1) * D)`` of the row's context vector, which
  multiplies `filter` (Paddle's im2col order). Each output sequence has the
  length of its input sequence.

  Args:
    x: a LoDTensor with float ``values [token_capacity, D]``; the windows run
      over its last level (any upper levels are kept).
    filter: ``[context_length * D, out]`` float weights.
    context_start: static offset of the first context row; `None` means
      ``-(context_length // 2)``, a window centred on the row (the default of
      Paddle's fluid layer).
    context_length: static number of context rows, >= 1.
    context_stride: static step between context rows, >= 1. Paddle's kernel
      accepts only 1; a larger step is a dilation that jaxlod adds.
    bias: optional ``[out]`` float bias, added to every real row.

  Returns:
    A LoDTensor with `x`'s LoD and ``values [token_capacity, out]``; padding
    rows are zero. Differentiable in ``x.values``, `filter` and `bias`.

  Raises:
    TypeError: for a non-LoDTensor `x`, integer values or weights, or a
      non-int context setting.
    ValueError: for ``x.values`` of rank other than 2, a `filter` or `bias`
      of the wrong shape, or a context length or stride below 1.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_conv
    >>> x = LoDTensor.from_lengths(np.array([[1.0], [2.0], [3.0], [4.0]]), [[3, 1]])
    >>> # Window [previous, current, next] summed: zeros past each sequence's end.
    >>> sequence_conv(x, np.ones((3, 1))).values[:, 0].tolist()
    [3.0, 6.0, 5.0, 4.0]
  """
  x = check_lod(x, "x")
  _checks.check_rank(x.values.shape, "x.values", (2,), "[rows, D]")
  _checks.check_float(x.values.dtype, "x.values")
  length = _checks.static_int(context_length, "context_length", minimum=1)
  stride = _checks.static_int(context_stride, "context_stride", minimum=1)
  start = (
    -(length // 2)
    if context_start is None
    else _checks.static_int(context_start, "context_start")
  )
  filter = as_array(filter, "filter")
  bias = _check_conv_params(x, filter, bias, length)
  windows, inside = _windows(x, [start + k * stride for k in range(length)])
  windows = jnp.where(inside[..., None], windows, jnp.zeros((), windows.dtype))
  out = windows.reshape(windows.shape[0], filter.shape[0]) @ filter
  if bias is not None:
    out = out + bias
  valid = x.row_mask()[:, None]
  return x.with_values(jnp.where(valid, out, jnp.zeros((), out.dtype)))


def sequence_enumerate(
  x: LoDTensor,
  win_size: int,
  pad_value: jax.typing.ArrayLike = 0,
  *,
  capacity: int | Buckets | None = None,
) -> LoDTensor:
  """For each row, the ids of the next `win_size` rows of its own sequence.

  Paddle's sequence_enumerate: ``out[r, k]`` is the id of row ``r + k`` when
  that row is in the same sequence as row ``r``, else `pad_value`.

  Args:
    x: a LoDTensor of integer ids, ``values [token_capacity]`` or
      ``[token_capacity, 1]``, over its last level (upper levels are kept).
    win_size: static window size, >= 1.
    pad_value: integer scalar for window slots past a sequence's end; the
      ids' dtype must hold it exactly.
    capacity: static capacity of the output: `None` keeps `x`'s capacities,
      an int sets the token capacity, a `Buckets` policy maps the real sizes
      eagerly (under `jit`: its fixed sizes, or `x`'s capacities rounded by
      the policy). Data is never truncated:
      an output larger than its capacity raises `ValueError` in eager calls;
      under `jit` the check goes through `jax.experimental.checkify` (wrap
      the caller in `checkify.checkify` and call ``err.throw()`` to see it).

  Returns:
    A LoDTensor with `x`'s LoD and ``values [token_capacity, win_size]`` of
    `x`'s dtype; padding rows are zero.

  Raises:
    TypeError: for a non-LoDTensor `x`, float ids, a traced float pad
      value, or a non-int `win_size`.
    ValueError: for ids of the wrong shape, `win_size` below 1, a pad value
      the ids' dtype does not hold (a fraction, NaN, out of range), or an
      output larger than `capacity`.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_enumerate
    >>> x = LoDTensor.from_lengths(np.array([1, 2, 3, 4, 5]), [[3, 2]])
    >>> sequence_enumerate(x, 2).values.tolist()
    [[1, 2], [2, 3], [3, 0], [4, 5], [5, 0]]
  """
  x = check_lod(x, "x")
  _check_ids(x.values, "x.values")
  win_size = _checks.static_int(win_size, "win_size", minimum=1)
  pad = fill_value(pad_value, x.values.dtype, "pad_value", "a scalar")
  if pad.ndim != 0:
    raise ValueError(f"Expected `pad_value` to be a scalar, got shape {pad.shape}.")
  ids = x.with_values(x.values.reshape(x.values.shape[0]))
  windows, inside = _windows(ids, list(range(win_size)))
  pad = pad.astype(windows.dtype)
  valid = x.row_mask()[:, None]
  values = jnp.where(inside, windows, jnp.where(valid, pad, jnp.zeros((), pad.dtype)))
  chosen = _segment.output_capacity(
    capacity, bound=x.capacity, real=_segment.real_sizes(x), where="sequence_enumerate"
  )
  lengths = [x.lengths(level) for level in range(x.num_levels)]
  return with_faults(_segment.build(values, lengths, x.num_outer, chosen), x)


def _check_ids(values: jax.Array, name: str) -> None:
  """Integer ids ``[rows]`` or ``[rows, 1]``."""
  _checks.check_integer(values.dtype, name)
  shape = tuple(values.shape)
  if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
    raise ValueError(
      f"Expected `{name}` to have shape [rows] or [rows, 1], got {shape}."
    )
