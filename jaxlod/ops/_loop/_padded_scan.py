"""The padded masked scan: a recurrence over a padded batch at its full size,
run by the drop-in RNNs under a plan with ``padded=True``.

Where padding can cost little (a few short steps, a small batch), packing
the rows, ranking the sequences and unpacking the outputs cost more than
the padded steps they skip: this is Flax's own loop, a `lax.scan` over
every padded step with each sequence's carry kept past its length. A
separable cell (``hoist=True``) runs as `hoisted_rnn` runs it: its input
projection one product before the loop, its recurrent kernel's gradient one
product after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlod._checks import expand_rows, where_rows
from jaxlod.ops._loop._hoisted import (
  Separable,
  hoisted_inputs,
  hoisted_loop,
  recurrent_step,
)


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
  index = expand_rows(index, padded.ndim)
  return jnp.take_along_axis(padded, index, axis=1)


def _scan(
  step_fn: Callable,
  xs: Any,
  init_carry: Any,
  lengths: jax.Array,
  remat: bool,
  unroll: int,
) -> tuple[Any, Any]:
  """``(outputs, final_carry)`` of `step_fn` over the time-major inputs `xs`
  (leaves ``[time, count, ...]``), outputs time-major and zero past each
  length, each carry kept past its length."""

  def body(carry: Any, inputs: tuple[jax.Array, Any]) -> tuple[Any, Any]:
    t, x_t = inputs
    new, y_t = step_fn(carry, x_t, None)
    live = t < lengths
    new = jax.tree.map(lambda n, o: where_rows(live, n, o), new, carry)
    return new, jax.tree.map(lambda y: where_rows(live, y, 0), y_t)

  if remat:
    body = jax.checkpoint(body)
  time = jax.tree.leaves(xs)[0].shape[0]
  carry, ys = jax.lax.scan(body, init_carry, (jnp.arange(time), xs), unroll=unroll)
  return ys, carry


def _hoisted_scan(
  cell: Separable,
  values: jax.Array,
  lengths: jax.Array,
  init_carry: Any,
  remat: bool,
  unroll: int,
) -> tuple[jax.Array, Any]:
  """`_scan` of a separable cell: the input projection of every padded row
  is one product before the loop, and the recurrent kernel's gradient one
  product after it (`hoisted_loop`). A step past a sequence's length keeps
  its carry, so the cotangent of its product is zero and adds nothing."""
  xs = hoisted_inputs(cell, jnp.moveaxis(values, 1, 0), init_carry)

  def run(w_rec, b_rec, xs, init, lengths):
    step = recurrent_step(cell, w_rec, b_rec)
    return _scan(step, xs, init, lengths, remat, unroll)

  def previous(out, init, lengths):
    ys = out[0]  # [time, count, hidden]; the state step t started from:
    h0 = cell.hidden(init).astype(ys.dtype)
    return jnp.concatenate([h0[None], ys])[: ys.shape[0]]

  loop = hoisted_loop(cell, run, previous)
  return loop(cell.w_rec, cell.b_rec, xs, init_carry, lengths)


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
      loop and whose recurrent kernel's gradient is one product after it.
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
    ys, carry = _hoisted_scan(step_fn, values, lengths, init_carry, remat, unroll)
  else:
    xs = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), values)
    ys, carry = _scan(step_fn, xs, init_carry, lengths, remat, unroll)
  return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), ys), carry
