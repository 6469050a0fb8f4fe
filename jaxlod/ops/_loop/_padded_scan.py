"""The padded masked scan: a recurrence over a padded batch at its full size,
run by the drop-in RNNs under a plan with ``padded=True``.

Where padding can cost little (a few short steps, a small batch), packing
the rows, ranking the sequences and unpacking the outputs cost more than
the padded steps they skip: this is Flax's own loop, a `lax.scan` over
every padded step with each sequence's carry kept past its length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlod.ops._loop._hoisted import Separable, dense, recurrent_step, result_dtype


class PaddedBatch(NamedTuple):
  """A padded batch as the padded scan takes it.

  Attributes:
    values: ``[count, time, *features]``, each sequence's rows first.
    lengths: int32 ``[count]``, each sequence's length in ``[0, time]``.
  """

  values: jax.Array
  lengths: jax.Array


def flip_real(padded: jax.Array, lengths: jax.Array) -> jax.Array:
  """Each row's first ``lengths[i]`` steps of ``padded [count, time, ...]``
  in reverse order, the padding kept at the end (``flax.linen``'s
  ``flip_sequences``)."""
  time = padded.shape[1]
  if time == 0:
    return padded
  steps = jnp.arange(time - 1, -1, -1)[None, :]
  index = (steps + lengths[:, None]) % time
  index = index.reshape(index.shape + (1,) * (padded.ndim - 2))
  return jnp.take_along_axis(padded, index, axis=1)


def _where_rows(live: jax.Array, new: jax.Array, old: Any) -> jax.Array:
  """`new` at the rows where ``live [count]`` holds, `old` elsewhere."""
  live = live.reshape(live.shape + (1,) * (jnp.ndim(new) - 1))
  return jnp.where(live, new, jnp.asarray(old, new.dtype))


def _separable_inputs(cell: Separable, values: jax.Array, init_carry: Any) -> tuple:
  """A separable cell's step and its time-major inputs: the input projection
  of every padded row as one product, before the loop."""
  xp = dense(values, cell.w_in, cell.b_in, cell.dtype, cell.precision)
  h0 = cell.hidden(init_carry)
  dtype = result_dtype(h0, cell.w_rec, cell.b_rec, dtype=cell.dtype)
  # The probe columns add nothing from the input: a zero the step broadcasts.
  probe = jnp.zeros((), dtype)
  step = recurrent_step(cell, cell.w_rec, cell.b_rec)
  return (lambda carry, xp_t, _: step(carry, (xp_t, probe), None)), xp


def padded_rnn(
  step_fn: Callable | Separable,
  x: PaddedBatch,
  init_carry: Any,
  reverse: bool,
  remat: bool,
  unroll: int,
) -> tuple[Any, Any]:
  """Runs a recurrent step over a padded batch: one `lax.scan` over every
  padded step at the full batch, each row's carry kept past its length.

  Args:
    step_fn: ``step_fn(carry, x_t, None) -> (new_carry, y_t)``, leaves
      ``[count, ...]``, as `jaxlod.ops.dynamic_rnn`'s; or a `Separable`
      cell, whose input projection runs over every padded row before the
      loop.
    x: the `PaddedBatch`, ``values [count, time, *features]``.
    init_carry: pytree of ``[count, ...]`` leaves.
    reverse: run each sequence from its own last step to its first; the
      outputs come in the order computed (each sequence's real steps
      reversed, its padding kept at the end), as ``flax.linen.RNN``
      returns them.
    remat: recompute each step in the backward pass instead of saving its
      residuals.
    unroll: steps per iteration of the scan (`lax.scan`'s ``unroll``).

  Returns:
    ``(outputs, final_carry)``: outputs with the structure of ``y_t`` and
    leaves ``[count, time, *out]``, zero past each length; `final_carry`
    each sequence's carry after its own last step (`init_carry` for a
    length of 0).
  """
  values, lengths = x
  if reverse:
    values = flip_real(values, lengths)
  if isinstance(step_fn, Separable):
    step_fn, values = _separable_inputs(step_fn, values, init_carry)
  xs = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), values)

  def body(carry: Any, inputs: tuple[jax.Array, Any]) -> tuple[Any, Any]:
    t, x_t = inputs
    new, y_t = step_fn(carry, x_t, None)
    live = t < lengths
    new = jax.tree.map(lambda n, o: _where_rows(live, n, o), new, carry)
    return new, jax.tree.map(lambda y: _where_rows(live, y, 0), y_t)

  if remat:
    body = jax.checkpoint(body)
  time = jax.tree.leaves(values)[0].shape[1]
  carry, ys = jax.lax.scan(body, init_carry, (jnp.arange(time), xs), unroll=unroll)
  return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), ys), carry
