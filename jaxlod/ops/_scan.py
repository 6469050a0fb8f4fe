"""A segmented linear recurrence over packed sequences, as one parallel scan.

``h_t = a_t * h_{t-1} + b_t`` is associative in ``(a, b)``: two steps
compose as ``(a1, b1) then (a2, b2) = (a1 * a2, a2 * b1 + b2)``. Over the
packed rows of a LoDTensor, every sequence restarts from its own initial
state. A restart is not ``a = 0``: ``0 * inf`` is NaN, so one sequence's
overflow would poison the next. Each element carries a restart flag
instead, the textbook segmented scan (Blelloch 1990): ``(f1, a1, b1) then
(f2, a2, b2) = (f1 | f2, a2 if f2 else a1 * a2, b2 if f2 else a2 * b1 +
b2)``, so nothing crosses a sequence boundary. Every padding row is a
segment of its own, of zeros. One `jax.lax.associative_scan` over all the
rows, depth ``log(rows)``, runs every sequence at once, with no padding to
the longest, no rank table and no loop over steps.

Within a sequence the composition forms products of ``a`` over ranges of
rows that the sequential recurrence never forms, and they may overflow
where the sequential states do not (``a = [1e30] * 4`` and ``b = 0`` has
states 0, while ``a2 * a3`` is inf in float32). An overflow is never
hidden: a non-finite value stays non-finite through every later product
and sum, so a scan whose states are all finite formed no overflow that
reached them. In a sequence where any state is not finite, the states are
computed again by the sequential recurrence itself (a `jax.lax.scan` over
the rows, under `jax.lax.cond`, so that finite batches never pay for it):
that sequence's results are then the sequential ones exactly, its inf and
NaN included, and every other sequence keeps its own bit for bit.

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

from jaxlod._checks import check_bool, expand_rows, is_float_dtype
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import as_array
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import check_same_lod, check_unstacked
from jaxlod.ops._rank import nan_unless


def _compose(first: tuple, second: tuple) -> tuple:
  """`first` then `second`, each ``(restart, a, b)``: a restart in
  `second` forgets `first` (selected, never multiplied by 0)."""
  f1, a1, b1 = first
  f2, a2, b2 = second
  return f1 | f2, jnp.where(f2, a2, a1 * a2), jnp.where(f2, b2, a2 * b1 + b2)


def _sequential(restart, a, b, reverse):
  """``h = b if restart else a * h_prev + b``, one row at a time."""

  def step(h, row):
    f, a_t, b_t = row
    h = jnp.where(f, b_t, a_t * h + b_t)
    return h, h

  rows = (jnp.broadcast_to(restart, b.shape), jnp.broadcast_to(a, b.shape), b)
  return lax.scan(step, jnp.zeros(b.shape[1:], b.dtype), rows, reverse=reverse)[1]


def _scan(restart: jax.Array, a: jax.Array, b: jax.Array, reverse: bool) -> jax.Array:
  """The states of ``h = b if restart else a * h_prev + b``, row after row
  (the other way with `reverse`): one parallel scan, and the sequential
  recurrence in each segment where a state of the parallel scan is not
  finite. `restart` ``[rows, 1, ...]`` broadcasts to `b`, `a` has `b`'s
  shape."""
  h = lax.associative_scan(_compose, (restart, a, b), reverse=reverse)[2]

  def recompute() -> jax.Array:
    # Only the segments that overflowed take the sequential states: the
    # others keep theirs bit for bit, whatever their neighbours hold.
    flags = restart.reshape(restart.shape[0], -1)[:, 0]
    segment = lax.cumsum(flags.astype(jnp.int32), axis=0, reverse=reverse) - 1
    bad = ~jnp.isfinite(h).reshape(h.shape[0], -1).all(axis=1)
    bad = jax.ops.segment_max(bad, segment, num_segments=h.shape[0])[segment]
    return jnp.where(expand_rows(bad, h.ndim), _sequential(restart, a, b, reverse), h)

  return lax.cond(jnp.isfinite(h).all(), lambda: h, recompute)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _segmented(a, b, init_rows, starts, real, reverse):
  """The scan of every segment: `starts` ``[rows]`` marks each segment's
  first row in the scan's direction, `init_rows` the initial state of that
  row's segment, `real` the rows of the data (the others are zero)."""
  return _segmented_fwd(a, b, init_rows, starts, real, reverse)[0]


def _restarts(starts, real, ndim):
  """Each segment's first row and every padding row (a segment of its own),
  as ``[rows, 1, ...]``; and the rows of the data, the same shape."""
  start, live = expand_rows(starts, ndim), expand_rows(real, ndim)
  return start | ~live, start, live


def _segmented_fwd(a, b, init_rows, starts, real, reverse):
  restart, start, live = _restarts(starts, real, b.ndim)
  a_full = jnp.broadcast_to(a, b.shape)
  folded = jnp.where(start, b + a_full * init_rows, jnp.where(live, b, 0))
  h = _scan(restart, a_full, folded, reverse)
  return h, (a, h, init_rows, starts, real)


def _shifted(x: jax.Array, reverse: bool, fill: Any) -> jax.Array:
  """Row ``t`` gets row ``t - 1`` (``t + 1`` with `reverse`); the first
  (last) gets `fill`."""
  pad = jnp.full((1,) + x.shape[1:], fill, x.dtype)
  if reverse:
    return jnp.concatenate([x[1:], pad])
  return jnp.concatenate([pad, x[:-1]])


def _segmented_bwd(reverse, residuals, g):
  a, h, init_rows, starts, real = residuals
  restart, start, live = _restarts(starts, real, g.ndim)
  a_full = jnp.broadcast_to(a, g.shape)
  g = jnp.where(live, g, 0)
  # lambda_t = g_t + a_next * lambda_next, `next` the row after t in the
  # scan's direction: the same scan the other way, each row reading its
  # successor's decay and restarting where its successor restarts (or at
  # the last row).
  after = _shifted(restart, not reverse, True)
  lam = _scan(after, _shifted(a_full, not reverse, 0), g, not reverse)
  h_prev = jnp.where(start, init_rows, _shifted(h, reverse, 0))
  d_a = jnp.where(live, lam * h_prev, 0)
  d_init = jnp.where(start, lam * a_full, 0)
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
  a_values, same = _scan_decay(a, b)
  rows = values.shape[0]
  dtype = jnp.result_type(a_values.dtype, values.dtype)
  count = b.capacity.sequences[-1]
  init = _scan_init(init, count, values.shape[1:], dtype)
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


def _scan_decay(a: LoDTensor | jax.typing.ArrayLike, b: LoDTensor) -> tuple:
  """`linear_scan`'s decay `a` checked against `b` (values ``[rows,
  *features]``).

  Returns:
    ``(a_values, same)``: `a`'s float values, ``[rows]`` expanded to
    ``[rows, 1, ...]`` (else ``[rows, ...]`` as given), broadcasting to
    `b.values`; and whether a LoDTensor `a` has `b`'s LoD (`True` for an
    array; under `jit` a traced bool).

  Raises:
    TypeError: for non-float values of `a`.
    ValueError: for values that do not broadcast to `b.values` row by row,
      or (eagerly) a LoDTensor `a` with another LoD.
  """
  values = b.values
  same = True
  if isinstance(a, LoDTensor):
    check_unstacked(a, "a")
    same = check_same_lod(b, a, "b", "a", "linear_scan")
    a_values = a.values
  else:
    a_values = as_array(a, "a", "a LoDTensor or an array")
  if not is_float_dtype(a_values.dtype):
    raise TypeError(f"Expected `a` to have a float dtype, got {a_values.dtype}.")
  rows = values.shape[0]
  if a_values.ndim == 1 and values.ndim > 1:
    a_values = expand_rows(a_values, values.ndim)
  try:
    shape = jnp.broadcast_shapes(a_values.shape, values.shape)
  except ValueError:
    shape = None
  if shape != values.shape or a_values.ndim != values.ndim or a_values.shape[0] != rows:
    raise ValueError(
      f"Expected `a`'s values to broadcast to `b.values` {values.shape} row by "
      f"row ([{rows}], [{rows}, 1, ...] or {values.shape}), got {a_values.shape}."
    )
  return a_values, same


def _scan_init(
  init: jax.typing.ArrayLike | None, count: int, features: tuple, dtype: Any
) -> jax.Array:
  """`linear_scan`'s initial states ``[count, *features]`` (`count` the
  count capacity of `b`): `init` checked, or zeros of `dtype` for `None`.

  Raises:
    TypeError: for an `init` that is not a float array.
    ValueError: for an `init` of another shape.
  """
  if init is None:
    return jnp.zeros((count, *features), dtype)
  init = as_array(init, "init", "an array or None")
  if init.shape != (count, *features):
    raise ValueError(
      f"Expected `init` to have shape {(count, *features)} ([count_capacity, "
      f"*features] of `b`), got {init.shape}."
    )
  if not is_float_dtype(init.dtype):
    raise TypeError(f"Expected `init` to have a float dtype, got {init.dtype}.")
  return init
