"""A segmented linear recurrence over packed sequences, as one parallel scan.

``h_t = a_t * h_{t-1} + b_t`` is associative in ``(a, b)``: two steps
compose as ``(a1, b1) then (a2, b2) = (a1 * a2, a2 * b1 + b2)``. Over the
packed rows of a LoDTensor, every sequence restarts from its own initial
state, and a restart is just ``a = 0`` at the sequence's first row (with
``a * init`` folded into ``b`` there): the composition then forgets
everything before it. So one `jax.lax.associative_scan` over all the rows,
depth ``log(rows)``, runs every sequence at once, with no padding to the
longest, no rank table and no loop over steps; the rows past the data scan
as their own zero sequences.

The gradient is the adjoint recurrence ``g_t + a_{t+1} * lambda_{t+1}``,
the same scan run the other way (`jax.custom_vjp`), so the backward pass
keeps the coefficients and the states (O(rows)), not the scan's tree of
partial products.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxlod._checks import check_bool, is_float_dtype, require
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import as_array
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import check_unstacked
from jaxlod.ops._rank import nan_unless


def _compose(first: tuple, second: tuple) -> tuple:
  a1, b1 = first
  a2, b2 = second
  return a1 * a2, a2 * b1 + b2


def _scan(a: jax.Array, b: jax.Array, reverse: bool) -> jax.Array:
  """The states of ``h = a * h_prev + b`` from zero, row after row (the other
  way with `reverse`); `a` and `b` of one shape."""
  return lax.associative_scan(_compose, (a, b), reverse=reverse)[1]


def _expand(x: jax.Array, ndim: int) -> jax.Array:
  """``[rows]`` as ``[rows, 1, ...]`` with `ndim` axes."""
  return x.reshape(x.shape + (1,) * (ndim - x.ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _segmented(a, b, init_rows, starts, real, reverse):
  """The scan of every segment: `starts` ``[rows]`` marks each segment's
  first row in the scan's direction, `init_rows` the initial state of that
  row's segment, `real` the rows of the data (the others are zero)."""
  return _segmented_fwd(a, b, init_rows, starts, real, reverse)[0]


def _coefficients(a, b, starts, real):
  """The scan's decays: `a` broadcast to `b`, zero at each segment's first
  row (the restart) and past the data (so that nothing reaches a padding
  row, whatever its values)."""
  start, live = _expand(starts, b.ndim), _expand(real, b.ndim)
  return jnp.where(start | ~live, 0, jnp.broadcast_to(a, b.shape)), start, live


def _segmented_fwd(a, b, init_rows, starts, real, reverse):
  alpha, start, live = _coefficients(a, b, starts, real)
  a_full = jnp.broadcast_to(a, b.shape)
  folded = jnp.where(start, b + a_full * init_rows, jnp.where(live, b, 0))
  h = _scan(alpha, folded, reverse)
  return h, (a, h, init_rows, starts, real)


def _shift(x: jax.Array, reverse: bool, fill: Any) -> jax.Array:
  """Row ``t`` gets row ``t - 1`` (``t + 1`` with `reverse`); the first
  (last) gets `fill`."""
  pad = jnp.full((1,) + x.shape[1:], fill, x.dtype)
  if reverse:
    return jnp.concatenate([x[1:], pad])
  return jnp.concatenate([pad, x[:-1]])


def _segmented_bwd(reverse, residuals, g):
  a, h, init_rows, starts, real = residuals
  alpha, start, live = _coefficients(a, g, starts, real)
  g = jnp.where(live, g, 0)
  # lambda_t = g_t + alpha_next * lambda_next, `next` the row after t in the
  # scan's direction: the same scan the other way, each row reading its
  # successor's decay (0 where the successor starts a segment).
  lam = _scan(_shift(alpha, not reverse, 0), g, not reverse)
  h_prev = jnp.where(start, init_rows, _shift(h, reverse, 0))
  d_a = jnp.where(live, lam * h_prev, 0)
  d_init = jnp.where(start, lam * jnp.broadcast_to(a, g.shape), 0)
  # `a` may broadcast over `b`: its gradient sums over the broadcast axes.
  extra = tuple(i for i in range(g.ndim) if a.shape[i] == 1 and g.shape[i] != 1)
  d_a = jnp.sum(d_a, axis=extra, keepdims=True).reshape(a.shape)
  return d_a, lam, d_init, None, None


_segmented.defvjp(_segmented_fwd, _segmented_bwd)


def linear_scan(
  a: LoDTensor | jax.typing.ArrayLike,
  b: LoDTensor,
  *,
  init: jax.typing.ArrayLike | None = None,
  reverse: bool = False,
) -> LoDTensor:
  """``h_t = a_t * h_{t-1} + b_t`` along every last-level sequence of `b`,
  as one parallel scan over the packed rows (no padding, no loop).

  Every sequence starts from its own initial state ``init[i]`` (zeros by
  default): its first row is ``a * init[i] + b``. With `reverse`, each
  sequence runs from its own last row to its first, and ``h_t = a_t *
  h_{t+1} + b_t``. This is the recurrence of the linear RNNs (minGRU,
  minLSTM, RG-LRU, diagonal state-space models): one `jax.lax.
  associative_scan` of depth ``log(rows)``, jittable once per capacity, its
  gradient the same scan the other way (a `jax.custom_vjp` keeping the
  states, O(rows) memory).

  Args:
    a: the decay, a LoDTensor with `b`'s LoD and values that broadcast
      against `b`'s per row (``[token_capacity]``, ``[token_capacity, 1]``
      or `b`'s shape), or such an array of values (row ``t`` of `b`'s
      packed rows).
    b: the input, a LoDTensor, values ``[token_capacity, *features]``
      (float).
    init: the initial states, ``[count_capacity, *features]`` in `b`'s
      order of last-level sequences (the padding sequences' ignored);
      `None`: zeros.
    reverse: run every sequence from its last row.

  Returns:
    A LoDTensor with `b`'s LoD and values ``[token_capacity, *features]``,
    the states; padding rows are zero.

  Raises:
    TypeError: for a `b` that is not a LoDTensor, non-float values, or a
      `reverse` that is not a bool.
    ValueError: for shapes that do not broadcast, an `init` of the wrong
      shape, or (eagerly) an `a` with another LoD; under `jit` an `a` with
      another LoD gives NaN states and `jaxlod.Fault.INPUT`.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import linear_scan
    >>> b = LoDTensor.from_sequences([np.ones(3), np.ones(2)], dtype=np.float32)
    >>> a = b.with_values(np.full(5, 0.5, np.float32))
    >>> linear_scan(a, b).values.tolist()
    [1.0, 1.5, 1.75, 1.0, 1.5]
    >>> init = np.array([2.0, 0.0], np.float32)
    >>> linear_scan(a, b, init=init, reverse=True).values.tolist()
    [2.0, 2.0, 2.0, 1.5, 1.0]
  """
  b = check_lod(b, "b")
  check_unstacked(b, "b")
  check_bool(reverse, "reverse")
  values = b.values
  if not is_float_dtype(values.dtype):
    raise TypeError(f"Expected `b.values` to have a float dtype, got {values.dtype}.")
  same = True
  if isinstance(a, LoDTensor):
    check_unstacked(a, "a")
    if a.capacity != b.capacity:
      raise ValueError(
        f"Expected `a` to have `b`'s LoD; `a` has capacity {a.capacity}, `b` "
        f"{b.capacity}."
      )
    for level, (x, y) in enumerate(zip(a.offsets, b.offsets, strict=True)):
      equal = require(
        jnp.array_equal(x, y),
        f"Expected `a` to have `b`'s LoD; they differ at level {level}: "
        "{x} vs {y}.",
        traced="linear_scan: `a` has another LoD than `b`.",
        x=x,
        y=y,
      )
      same = equal if same is True else same & equal
    a_values = a.values
  else:
    a_values = as_array(a, "a", "a LoDTensor or an array")
  if not is_float_dtype(a_values.dtype):
    raise TypeError(f"Expected `a` to have a float dtype, got {a_values.dtype}.")
  rows = values.shape[0]
  if a_values.ndim == 1 and values.ndim > 1:
    a_values = _expand(a_values, values.ndim)
  try:
    shape = jnp.broadcast_shapes(a_values.shape, values.shape)
  except ValueError:
    shape = None
  if shape != values.shape or a_values.ndim != values.ndim or a_values.shape[0] != rows:
    raise ValueError(
      f"Expected `a`'s values to broadcast to `b.values` {values.shape} row by "
      f"row ([{rows}], [{rows}, 1, ...] or {values.shape}), got {a_values.shape}."
    )
  dtype = jnp.result_type(a_values.dtype, values.dtype)
  count = b.capacity.sequences[-1]
  features = values.shape[1:]
  if init is None:
    init = jnp.zeros((count, *features), dtype)
  else:
    init = as_array(init, "init", "an array or None")
    if init.shape != (count, *features):
      raise ValueError(
        f"Expected `init` to have shape {(count, *features)} ([count_capacity, "
        f"*features] of `b`), got {init.shape}."
      )
    if not is_float_dtype(init.dtype):
      raise TypeError(f"Expected `init` to have a float dtype, got {init.dtype}.")
  real = b.row_mask()
  segment = b.segment_ids()
  offsets = b.offsets[-1]
  index = jnp.arange(rows, dtype=segment.dtype)
  safe = jnp.minimum(segment, max(count - 1, 0))
  edge = offsets[safe + 1] - 1 if reverse else offsets[safe]
  starts = real & (index == edge)
  init_rows = init.astype(dtype)[safe] if count else jnp.zeros_like(values, dtype)
  states = _segmented(
    a_values.astype(dtype), values.astype(dtype), init_rows, starts, real, reverse
  )
  out = b.with_values(nan_unless(same, states))
  return with_faults(out, fault_unless(same, Fault.INPUT))
