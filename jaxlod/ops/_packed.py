"""The time-major packed layout of the phased loop.

Fluid's TensorArray holds one batch per step, shrinking as sequences end.
Packed one after another, those batches are PyTorch's ``PackedSequence``
order: the rows of step ``t`` are the contiguous slab
``[step_offsets[t], step_offsets[t] + batch_sizes[t])``, in rank order. The
loop reads and writes each step's slab with `lax.dynamic_slice`, so its
memory follows the token capacity, not ``time x count``.

Each layout array has ``token_capacity + count_capacity`` rows: a step run at
a static batch size larger than its active batch reads (and, going forward,
writes) past its slab without leaving the array.

What the backward pass stores per step (residuals or carries) is kept in a
*schedule* layout instead, where step ``t`` owns ``size_t`` rows, ``size_t``
being the static batch size of its phase: rows past the active batch then
keep their own values (computed from their own carry and static inputs), so
a backward step never mixes one sequence's residuals with another's static
inputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxlod._lod import LoDTensor, owners
from jaxlod.ops._array import gather
from jaxlod.ops._rank import RankTable


@dataclasses.dataclass(frozen=True)
class TimeMajor:
  """Index maps between the LoDTensor's rows and the time-major layout.

  Attributes:
    step_offsets: int32 ``[time_capacity]``, first time-major row of step t.
    to_time_major: for each time-major row, its LoDTensor row and validity.
    to_rows: for each LoDTensor row, its time-major row and validity.
  """

  step_offsets: jax.Array
  to_time_major: tuple[jax.Array, jax.Array]
  to_rows: tuple[jax.Array, jax.Array]


def time_major(x: LoDTensor, table: RankTable, reverse: bool) -> TimeMajor:
  """The layout of `x`'s last level, ranked by `table`.

  With `reverse`, step ``t`` of a sequence of length ``n`` is its row
  ``n - 1 - t``: each sequence runs from its own last row.
  """
  tokens, count = x.capacity.tokens, table.count_capacity
  size = tokens + count
  batch_sizes = jnp.asarray(table.batch_sizes, jnp.int32)
  ends = jnp.cumsum(batch_sizes, dtype=jnp.int32)
  step_offsets = ends - batch_sizes
  offsets = x.offsets[-1]
  if table.time_capacity == 0 or count == 0 or tokens == 0:
    nowhere = (jnp.zeros((size,), jnp.int32), jnp.zeros((size,), bool))
    rows = (jnp.zeros((tokens,), jnp.int32), jnp.zeros((tokens,), bool))
    return TimeMajor(step_offsets, nowhere, rows)
  order, ranks = jnp.asarray(table.order), jnp.asarray(table.ranks)

  # Time-major row p -> (step t, rank r) -> LoDTensor row.
  p = jnp.arange(size, dtype=jnp.int32)
  t = jnp.clip(jnp.searchsorted(ends, p, side="right"), 0, table.time_capacity - 1)
  t = t.astype(jnp.int32)
  seq = order[jnp.clip(p - step_offsets[t], 0, count - 1)]
  start, length = offsets[seq], offsets[seq + 1] - offsets[seq]
  row = start + (length - 1 - t if reverse else t)
  valid = p < ends[-1]
  to_time_major = (jnp.where(valid, row, 0), valid)

  # LoDTensor row -> (sequence, step) -> time-major row.
  rows = jnp.arange(tokens, dtype=jnp.int32)
  seq = owners(offsets, rows, count)
  step = rows - offsets[seq]
  if reverse:
    step = offsets[seq + 1] - 1 - rows
  valid = rows < offsets[-1]
  step = jnp.clip(step, 0, table.time_capacity - 1)
  position = step_offsets[step] + ranks[seq]
  to_rows = (jnp.where(valid, position, 0).astype(jnp.int32), valid)
  return TimeMajor(step_offsets, to_time_major, to_rows)


def pack(values: jax.Array, layout: TimeMajor) -> jax.Array:
  """LoDTensor rows ``[token_capacity, ...]`` -> time-major rows.

  Returns ``[token_capacity + count_capacity, ...]``. Rows past the data
  hold copies of the first LoDTensor row (zeros when there is none): a step
  run at a batch size larger than its active batch reads them, and a step
  whose gradient is not finite at zero input (``sqrt``, say) would turn the
  zero cotangents of those rows into NaN parameter gradients (``0 * inf``);
  at a real row's input they stay finite. Differentiable; the backward pass
  is the inverse gather, which never reads those rows.
  """
  index, valid = layout.to_time_major
  has_rows = jnp.any(layout.to_rows[1])
  return gather(values, index, valid | has_rows, *layout.to_rows)


def unpack(rows: jax.Array, layout: TimeMajor) -> jax.Array:
  """Time-major rows -> LoDTensor rows ``[token_capacity, ...]``."""
  return gather(rows, *layout.to_rows, *layout.to_time_major)


def schedule_offsets(
  time_capacity: int,
  ladder: Sequence[int],
  phase_starts: jax.Array,
  phase_ends: jax.Array,
) -> jax.Array:
  """First schedule row of each step: int32 ``[time_capacity]``.

  Step ``t`` of phase ``k`` owns ``ladder[k]`` rows; steps past the longest
  sequence own none.
  """
  steps = jnp.arange(time_capacity, dtype=jnp.int32)[:, None]
  starts = jnp.asarray(phase_starts)[None, :]
  ends = jnp.asarray(phase_ends)[None, :]
  sizes = jnp.asarray(ladder, jnp.int32)[None, :]
  per_step = jnp.sum(jnp.where((steps >= starts) & (steps < ends), sizes, 0), axis=1)
  return (jnp.cumsum(per_step) - per_step).astype(jnp.int32)


def schedule_rows(tokens: int, time: int, ladder: Sequence[int]) -> int:
  """A static bound on the rows of the schedule layout.

  A step of phase ``k`` owns ``ladder[k]`` rows and has more than
  ``ladder[k + 1]`` active rows (0 past the last size); the active rows of
  all steps are at most `tokens`, the steps at most `time`. The most rows
  ``sum_k n_k ladder[k]`` over step counts ``n_k >= 0`` with
  ``sum_k n_k (ladder[k + 1] + 1) <= tokens`` and ``sum_k n_k <= time`` is a
  linear program whose optimum uses at most two phases: its rounded-down
  value bounds the rows of every batch. (Benchmark W1's capacities: 3,908
  rows, where the slack of each phase over its active rows would give 4,480.)
  Never fewer than ``ladder[0]``, so that every phase's step fits.
  """
  sizes = [int(size) for size in ladder]
  costs = [nxt + 1 for nxt in (*sizes[1:], 0)]
  best = 0.0
  for i, (size_i, cost_i) in enumerate(zip(sizes, costs, strict=True)):
    best = max(best, size_i * min(time, tokens / cost_i))
    for size_j, cost_j in zip(sizes[i + 1 :], costs[i + 1 :], strict=True):
      # Both constraints tight: n_i + n_j = time, n_i cost_i + n_j cost_j = tokens.
      n_i = (tokens - time * cost_j) / (cost_i - cost_j)
      if 0 <= n_i <= time:
        best = max(best, n_i * size_i + (time - n_i) * size_j)
  # A little slack against rounding in the division; never over the grid.
  return max(sizes[0], min(time * sizes[0], math.floor(best + 1e-6)))
