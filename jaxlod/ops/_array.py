"""Array ops between packed rows and the time-major stacked buffer.

Fluid's lod_tensor_to_array / array_to_lod_tensor / reorder_lod_tensor_by_rank
/ shrink_rnn_memory. Each moves valid cells without combining them, so each
backward pass is the inverse gather (never a scatter-add).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxlod._checks import (
  check_bool,
  is_concrete,
  is_float_dtype,
  require,
  static_int,
  where_rows,
)
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import as_array, check_rows, index_scalar
from jaxlod._lod import LoDTensor, check_lod, owners
from jaxlod._vma import vary, varying_axes
from jaxlod.ops._rank import (
  RankTable,
  check_pair,
  check_ranked,
  check_table,
  nan_unless,
)

# -- the one primitive: a gather whose transpose is a known gather -------------


def masked_take(src: jax.Array, index: jax.Array, valid: jax.Array | None) -> jax.Array:
  """``src[index]`` along axis 0, zeros where not `valid` (plain autodiff).

  Args:
    src: ``[n, *features]``.
    index: int32 ``[m]``; clipped into ``[0, n)``.
    valid: bool ``[m]``, or `None` when every index is valid (and unique).

  Returns:
    ``[m, *features]``.
  """
  out_shape = (index.shape[0], *src.shape[1:])
  if src.shape[0] == 0 or index.shape[0] == 0:
    return jnp.zeros(out_shape, src.dtype)
  out = jnp.take(src, index, axis=0, mode="clip", unique_indices=valid is None)
  if valid is None:
    return out
  return where_rows(valid, out, 0)


@jax.custom_vjp
def _gather_vjp(src, index, valid, inverse_index, inverse_valid):
  return masked_take(src, index, valid)


def _gather_fwd(src, index, valid, inverse_index, inverse_valid):
  out = masked_take(src, index, valid)
  return out, (inverse_index, inverse_valid)


def _gather_bwd(residuals, g):
  inverse_index, inverse_valid = residuals
  return masked_take(g, inverse_index, inverse_valid), None, None, None, None


_gather_vjp.defvjp(_gather_fwd, _gather_bwd)


def gather(
  src: jax.Array,
  index: jax.Array,
  valid: jax.Array | None,
  inverse_index: jax.Array,
  inverse_valid: jax.Array | None,
) -> jax.Array:
  """`masked_take` whose VJP is the inverse gather (never a scatter-add).

  For gathers that move each valid cell of `src` to at most one place: the
  cotangent ``g [m, *features]`` goes back as
  ``masked_take(g, inverse_index, inverse_valid)``.

  Under `shard_map` the operands first vary over the same axes, so that the
  cotangent of `src` has the type of `src` (see `jaxlod._vma`).

  Args:
    src: ``[n, *features]``.
    index: int32 ``[m]``, the row of `src` for each output row.
    valid: bool ``[m]`` or `None`; invalid output rows are zeros.
    inverse_index: int32 ``[n]``, the output row each row of `src` went to.
    inverse_valid: bool ``[n]`` or `None`; rows of `src` that went nowhere
      get zero gradient.

  Returns:
    ``[m, *features]``.
  """
  args = (src, index, valid, inverse_index, inverse_valid)
  return _gather_vjp(*vary(args, varying_axes(args)))


def permutation_gather(
  src: jax.Array, perm: jax.Array, inverse: jax.Array
) -> jax.Array:
  """``src[perm]`` for a permutation `perm` of all rows; VJP ``g[inverse]``."""
  return gather(src, perm, None, inverse, None)


# -- index maps between rows and cells -------------------------------------------


def _cell_rows(x: LoDTensor, table: RankTable):
  """For each cell ``(t, r)`` of the buffer, flattened: its row and validity."""
  steps = jnp.arange(table.time_capacity, dtype=jnp.int32)[:, None]
  lengths = jnp.asarray(table.lengths)[None, :]
  starts = x.offsets[-1][:-1][table.order][None, :]
  return (starts + steps).reshape(-1), (steps < lengths).reshape(-1)


def _row_cells(x: LoDTensor, table: RankTable):
  """For each row of ``values``: its flattened cell ``t * count + rank``."""
  offsets = x.offsets[-1]
  rows = jnp.arange(x.capacity.tokens, dtype=jnp.int32)
  count = table.count_capacity
  if count == 0:  # no sequence slots: every row is padding
    return jnp.zeros_like(rows), jnp.zeros(rows.shape, bool)
  seq = owners(offsets, rows, count)
  cell = (rows - offsets[seq]) * count + jnp.asarray(table.ranks)[seq]
  return cell, rows < offsets[-1]


# -- public ops ------------------------------------------------------------------------


def lod_to_array(x: LoDTensor, table: RankTable) -> jax.Array:
  """Gathers packed rows into a time-major buffer in rank order.

  Fluid's ``lod_tensor_to_array``: the TensorArray of per-step batches, as one
  stacked array. Cell ``[t, r]`` holds row ``t`` of the sequence at rank
  ``r``; cells past a sequence's end are zeros, so the batch active at step
  ``t`` is the prefix ``[:table.batch_sizes[t]]``.

  Args:
    x: a LoDTensor, ``values [token_capacity, *features]``.
    table: the rank table of `x`'s last level (for a nested LoD, a table of
      the same sequences built from another tensor works too).

  Returns:
    ``[time_capacity, count_capacity, *features]``. Differentiable in
    ``x.values``; the backward pass is the inverse gather.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import rank_table, lod_to_array
    >>> x = LoDTensor.from_lengths(np.arange(1.0, 6.0), [[2, 3]])
    >>> lod_to_array(x, rank_table(x)).tolist()
    [[3.0, 1.0], [4.0, 2.0], [5.0, 0.0]]
  """
  ranked = check_pair(check_lod(x, "x"), table, "x")
  index, valid = _cell_rows(x, table)
  flat = gather(x.values, index, valid, *_row_cells(x, table))
  shape = (table.time_capacity, table.count_capacity, *x.feature_shape)
  return nan_unless(ranked, flat.reshape(shape))


def array_to_lod(array: jax.Array, table: RankTable, *, like: LoDTensor) -> LoDTensor:
  """Scatters a time-major rank-ordered buffer back to packed rows.

  Fluid's ``array_to_lod_tensor``, the inverse of `lod_to_array`: row ``t``
  of the sequence at rank ``r`` is ``array[t, r]``. Cells past each
  sequence's end are ignored (they get zero gradient).

  Args:
    array: ``[time_capacity, count_capacity, *features]``; the features may
      differ from those of `like`.
    table: the rank table used to build the buffer.
    like: the LoDTensor whose LoD (and original order) the result takes.

  Returns:
    A LoDTensor with `like`'s LoD and ``values [token_capacity, *features]``,
    zeros in padding rows.
  """
  ranked = check_pair(check_lod(like, "like"), table, "like")
  array = as_array(array, "array")
  expected = (table.time_capacity, table.count_capacity)
  if array.ndim < 2 or array.shape[:2] != expected:
    raise ValueError(
      f"Expected `array` to have shape [{expected[0]}, {expected[1]}, *features] "
      f"(time capacity, count capacity), got {array.shape}."
    )
  # Explicit sizes: ``-1`` is ambiguous for zero-width features.
  flat = array.reshape(array.shape[0] * array.shape[1], *array.shape[2:])
  index, valid = _row_cells(like, table)
  out = like.with_values(gather(flat, index, valid, *_cell_rows(like, table)))
  return with_faults(nan_unless(ranked, out), fault_unless(ranked, Fault.TABLE))


def _inverse_permutation(perm: jax.Array) -> jax.Array:
  n = perm.shape[0]
  return jnp.zeros((n,), jnp.int32).at[perm].set(jnp.arange(n, dtype=jnp.int32))


def _reorder_lod(x: LoDTensor, table: RankTable, same_count: Any) -> LoDTensor:
  """Permutes the level-0 sequences of `x` (with all their nested levels).

  `same_count`: whether `x` has the table's real count (see `require`). When
  it does not (under `jit`), real sequences may land past ``x.num_outer``,
  which then grows to cover them, so that the result stays a valid LoD.
  """
  perm = jnp.asarray(table.order, jnp.int32)
  num_outer = x.num_outer
  if same_count is not True and x.capacity.sequences[0] > 0:
    moved = jnp.diff(x.offsets[0])[perm] > 0
    last = x.capacity.sequences[0] - jnp.argmax(moved[::-1])
    cover = jnp.where(jnp.any(moved), last, 0).astype(jnp.int32)
    num_outer = jnp.where(same_count, num_outer, jnp.maximum(num_outer, cover))
  new_offsets = []
  for level, old in enumerate(x.offsets):
    lengths = jnp.diff(old)[perm]
    new = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)])
    new = new.astype(jnp.int32)
    new_offsets.append(new)
    size = (
      x.capacity.tokens
      if level == x.num_levels - 1
      else x.capacity.sequences[level + 1]
    )
    items = jnp.arange(size, dtype=jnp.int32)
    count = new.shape[0] - 1
    if count == 0:  # no sequence slots at this level: all items are padding
      perm = items
      continue
    seq = owners(new, items, count)
    moved = old[perm[seq]] + items - new[seq]
    # Items past the real total are padding; they map to themselves.
    perm = jnp.where(items < new[-1], moved, items).astype(jnp.int32)
  values = permutation_gather(x.values, perm, _inverse_permutation(perm))
  return LoDTensor(values, new_offsets, num_outer, x.time_capacity, x.faults)


def reorder_by_rank(x: Any, table: RankTable, *, check_lengths: bool = False) -> Any:
  """Puts rows, or whole sequences, into the rank order of `table`.

  Fluid's ``reorder_lod_tensor_by_rank``: `table` may rank *another* tensor
  with as many sequences (DynamicRNN reorders the encoder's states by the
  target's ranks), so only the counts must agree, not the lengths.

  Args:
    x: a LoDTensor, whose level-0 sequences are permuted with everything
      nested in them (its level-0 count capacity and real number of sequences
      must equal the table's); or an array, or a pytree of arrays,
      ``[count_capacity, ...]``, whose rows are permuted: ``out[r] =
      x[table.order[r]]``.
    table: a rank table.
    check_lengths: also require `table` to rank `x` itself (its level-0
      lengths are the table's), for a caller that means the same batch.

  Returns:
    The same structure in rank order. Differentiable; the backward pass is the
    inverse permutation.

  Raises:
    ValueError: for a level-0 count capacity other than the table's; for a
      real number of sequences other than the table's (eagerly, and under
      `jit` through `jax.experimental.checkify`); with `check_lengths`, for
      lengths the table does not rank.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import rank_table, reorder_by_rank
    >>> tgt = LoDTensor.from_lengths(np.zeros(6), [[1, 4, 1]])
    >>> src = LoDTensor.from_lengths(np.arange(6.0), [[3, 1, 2]])
    >>> moved = reorder_by_rank(src, rank_table(tgt))  # the target's ranks
    >>> moved.recursive_lengths(), moved.values.tolist()
    ([[1, 3, 2]], [3.0, 0.0, 1.0, 2.0, 4.0, 5.0])
  """
  check_table(table)
  check_lengths = check_bool(check_lengths, "check_lengths")
  if isinstance(x, LoDTensor):
    if x.capacity.sequences[0] != table.count_capacity:
      raise ValueError(
        f"Expected `x` to have level-0 count capacity {table.count_capacity} "
        f"(the rank table's), got {x.capacity.sequences[0]}."
      )
    same_count = require(
      x.num_sequences(0) == table.count,
      "Expected `x` to hold as many level-0 sequences as the rank table ranks "
      "({count}), got {n}.",
      count=table.count,
      n=x.num_sequences(0),
    )
    ranked = True
    if check_lengths:
      ranked = check_ranked(x.lengths(0), table, "`x`", "level 0")
    out = _reorder_lod(x, table, same_count)
    return with_faults(
      out, fault_unless(same_count, Fault.INPUT), fault_unless(ranked, Fault.TABLE)
    )
  return permute_rows(x, table.order, table.ranks, "x")


def permute_rows(x: Any, perm: jax.Array, inverse: jax.Array, name: str) -> Any:
  """``leaf[perm]`` for every leaf ``[count_capacity, ...]`` of the pytree `x`.

  `inverse` is the inverse permutation; it makes the backward pass a gather.
  Integer leaves are permuted too (they have no gradient).
  """
  perm, inverse = jnp.asarray(perm), jnp.asarray(inverse)
  check_rows(x, perm.shape[0], name)

  def reorder(leaf):
    leaf = jnp.asarray(leaf)
    if not is_float_dtype(leaf.dtype):
      return jnp.take(leaf, perm, axis=0)
    return permutation_gather(leaf, perm, inverse)

  return jax.tree.map(reorder, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _prefix(memory: jax.Array, size: int) -> jax.Array:
  return memory[:size]


def _prefix_fwd(memory, size):
  return memory[:size], memory.shape[0]


def _prefix_bwd(size, full, g):
  del size
  pad = [(0, full - g.shape[0])] + [(0, 0)] * (g.ndim - 1)
  return (jnp.pad(g, pad),)


_prefix.defvjp(_prefix_fwd, _prefix_bwd)


def shrink_memory(memory: Any, table: RankTable, step: Any, size: int) -> Any:
  """The static prefix ``[:size]`` of rank-ordered memory.

  Fluid's ``shrink_rnn_memory``: the rows of sequences still active at
  `step` are a prefix of the ranked batch, so a phase that runs at static
  batch size `size` keeps only the first `size` rows.

  Args:
    memory: an array or pytree of arrays ``[count_capacity, ...]`` in rank
      order.
    table: the rank table.
    step: the time step (int or int32 scalar).
    size: static batch size, at least ``table.batch_sizes[step]`` (checked
      eagerly with `ValueError`; under `jit` via `jax.experimental.checkify`).

  Returns:
    The same structure with leaves ``[size, ...]``. Differentiable; the
    backward pass pads with zeros. Under `jit`, a `size` below the
    sequences active at `step` turns the float leaves NaN (rows of active
    sequences would be lost); integer leaves are only cut.

  Raises:
    ValueError: for a `size` outside ``[0, count_capacity]`` or a concrete
      `step` outside ``[0, time_capacity)``; eagerly, for a `size` below the
      sequences active at `step` (under `jit` a `jax.experimental.checkify`
      check, and the float leaves are NaN).
  """
  check_table(table)
  step = index_scalar(step, "step")
  size = static_int(size, "size")
  if not 0 <= size <= table.count_capacity:
    raise ValueError(
      f"Expected `size` in [0, {table.count_capacity}] (count capacity), got {size}."
    )
  if is_concrete(step) and not 0 <= int(step) < table.time_capacity:
    raise ValueError(
      f"Expected `step` in [0, {table.time_capacity}) (time capacity), got {step}."
    )
  if table.time_capacity == 0:
    active = jnp.zeros((), jnp.int32)
  else:
    steps = jnp.asarray(table.batch_sizes)
    active = steps[jnp.clip(step, 0, table.time_capacity - 1)]
  kept = require(
    active <= size,
    "shrink_memory: {active} sequences are active at step {step}, more than "
    f"`size` {size}; data is never dropped.",
    traced="shrink_memory: more sequences are active at the step than `size`.",
    active=active,
    step=step,
  )
  check_rows(memory, table.count_capacity, "memory")
  out = jax.tree.map(lambda leaf: _prefix(jnp.asarray(leaf), size), memory)
  return nan_unless(kept, out)
