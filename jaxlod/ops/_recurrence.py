"""Recurrences over LoDTensors, one front door: `recurrence` runs a step
function through the phased loop (`jaxlod.ops.dynamic_rnn`) and a
`Separable` cell hoisted (`hoisted_rnn`: its input projection before the
loop, its recurrent kernel's gradient after it, through a `jax.custom_vjp`)
or, under a plan with ``fused=True``, through the Pallas kernel
(`jaxlod.ops.fused_rnn`). The layers of `jaxlod.nn` read a Flax cell's
parameters into a `Separable` (`jaxlod.nn._hoist`) and call `recurrence`.

Hoisting, for a separable cell:

  * the input projection of every packed row is one matrix product before
    the loop, ``x.values [token_capacity, features] @ w_in + b_in``;
  * `jaxlod.ops.dynamic_rnn` runs the recurrent part only: each step
    computes ``h @ w_rec`` and the cell's gate math from the projection;
  * the recurrent kernel's gradient (and the recurrent bias's, where the
    cell has one apart from the input's) is one product over all rows
    after the backward loop, ``previous_h.T @ d(h @ w_rec)``, through a
    `jax.custom_vjp`: the loop does no per-step work for it.

The cotangent of each row's recurrent product is the cotangent of its
projected input where the cell adds the two (every column of an LSTM's or
a simple cell's), and that of a zero *probe* input added to the product
where a gate scales it first (the candidate columns of a GRU and of an MGU
with its reset gate). The state a row started from is the output of the
row before it in its sequence (after it, with ``reverse=True``), or the
initial carry at the sequence's first row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxlod._lod import LoDTensor
from jaxlod.ops._fused import Separable, dense, fused_rnn, result_dtype
from jaxlod.ops._plan import LoopPlan, plan_with_ladder
from jaxlod.ops._rank import RankTable
from jaxlod.ops._rnn import dynamic_rnn


def recurrence(
  step: Callable[[Any, jax.Array], tuple[Any, jax.Array]] | Separable,
  x: LoDTensor,
  **settings: Any,
) -> tuple[LoDTensor, Any]:
  """`step` over every sequence of the last level of `x`: ``(outputs,
  final_carry)`` as `jaxlod.ops.dynamic_rnn` returns them.

  Args:
    step: ``step(carry, x_t) -> (carry, y_t)``, run by the phased loop, or a
      `Separable` cell, run by `hoisted_rnn` (the fused kernel under a plan
      with ``fused=True``).
    x: a LoDTensor ``values [token_capacity, *batch, features]``.
    **settings: `dynamic_rnn`'s ``init_carry``, ``reverse``, ``table``,
      ``ladder``, ``remat`` and ``plan``.
  """
  if isinstance(step, Separable):
    return hoisted_rnn(step, x, **settings)
  return dynamic_rnn(lambda c, x_t, _: step(c, x_t), x, **settings)


def previous_hidden(
  y: jax.Array, offsets: jax.Array, init_h: jax.Array, reverse: bool
) -> jax.Array:
  """Per packed row, the hidden state its step started from.

  Args:
    y: the outputs (each row's new hidden state), ``[token_capacity, ...,
      hidden]``.
    offsets: the offsets of the loop's level, ``[count_capacity + 1]``.
    init_h: each sequence's initial hidden state, ``[count_capacity, ...,
      hidden]``.
    reverse: whether the loop ran each sequence from its last row.

  Returns:
    ``[token_capacity, ..., hidden]``: the row before it in its sequence
    (after it, with `reverse`), or `init_h` at the sequence's first step;
    zero at padding rows.
  """
  tokens, count = y.shape[0], offsets.shape[0] - 1
  if tokens == 0 or count == 0:
    return jnp.zeros_like(y)
  rows = jnp.arange(tokens)
  seq = jnp.clip(jnp.searchsorted(offsets, rows, side="right") - 1, 0, count - 1)
  edge = jnp.zeros_like(y[:1])
  if reverse:
    first, neighbour = offsets[seq + 1] - 1, jnp.concatenate([y[1:], edge])
  else:
    first, neighbour = offsets[seq], jnp.concatenate([edge, y[:-1]])
  shape = (tokens,) + (1,) * (y.ndim - 1)
  prev = jnp.where((rows == first).reshape(shape), init_h[seq], neighbour)
  return jnp.where((rows < offsets[-1]).reshape(shape), prev, jnp.zeros((), y.dtype))


def hoisted_rnn(
  cell: Separable,
  x: LoDTensor,
  *,
  init_carry: Any,
  reverse: bool,
  table: RankTable | None,
  ladder: Any,
  remat: bool,
  plan: LoopPlan | None,
) -> tuple[LoDTensor, Any]:
  """`jaxlod.ops.dynamic_rnn` of a separable cell over the last level of `x`,
  its input projection hoisted before the loop and its recurrent kernel's
  gradient after it; under a plan with ``fused=True``, `jaxlod.ops.fused_rnn`
  (one kernel launch per direction of the pass; `ladder` and `remat` are the
  loop's and do not apply).

  Args:
    cell: the cell (`separate_linen`, `separate_nnx`).
    x: a LoDTensor ``values [token_capacity, *batch, features]``.
    init_carry: the cell's carry, leaves ``[count_capacity, ...]``.
    reverse, table, ladder, remat, plan: as `dynamic_rnn`'s.

  Returns:
    ``(outputs, final_carry)`` as `dynamic_rnn` returns them: outputs
    ``values [token_capacity, *batch, hidden]``.
  """
  if plan_with_ladder(plan, ladder).fused:
    return fused_rnn(cell, x, init_carry=init_carry, reverse=reverse, table=table)
  xp = dense(x.values, cell.w_in, cell.b_in, cell.dtype, cell.precision)
  xs = (x.with_values(xp),)
  if cell.probe:
    h0, w, b = cell.hidden(init_carry), cell.w_rec, cell.b_rec
    dtype = result_dtype(h0, w, b, dtype=cell.dtype)
    xs += (x.with_values(jnp.zeros((*xp.shape[:-1], cell.probe), dtype)),)

  def run(w_rec, b_rec, xs, init, table):
    """`dynamic_rnn` of the cell's recurrent step over the projected inputs.

    Args:
      w_rec: the recurrent kernels, ``[hidden, width]``.
      b_rec: the probe columns' bias, ``[probe]``, or `None`.
      xs: LoDTensors with `x`'s LoD: the input projection, ``values
        [token_capacity, *batch, width]``, and with a probe zeros
        ``[token_capacity, *batch, probe]`` added to the probe columns of
        the recurrent product (their cotangent is those columns').
      init: the initial carry, leaves ``[count_capacity, ...]``.
      table: `x`'s rank table, or `None`.

    Returns:
      ``(outputs, final_carry)`` as `dynamic_rnn` returns them.
    """

    def step(carry, x_t, _):
      h = cell.hidden(carry)
      dtype = result_dtype(h, w_rec, b_rec, dtype=cell.dtype)
      h, w = h.astype(dtype), w_rec.astype(dtype)
      b = None if b_rec is None else b_rec.astype(dtype)
      hp = jax.lax.dot_general(
        h, w, (((h.ndim - 1,), (0,)), ((), ())), precision=cell.precision
      )
      if cell.probe:
        tail = hp[..., -cell.probe :] if b is None else hp[..., -cell.probe :] + b
        hp = jnp.concatenate([hp[..., : -cell.probe], tail + x_t[1]], axis=-1)
      return cell.gates(carry, cell.split(x_t[0]), cell.split(hp))

    return dynamic_rnn(
      step,
      xs,
      init_carry=init,
      reverse=reverse,
      table=table,
      ladder=ladder,
      remat=remat,
      plan=plan,
    )

  @jax.custom_vjp
  def loop(w_rec, b_rec, xs, init, table):
    return run(w_rec, b_rec, xs, init, table)

  def loop_fwd(w_rec, b_rec, xs, init, table):
    # The recurrent weights are closed over, not differentiated: the loop
    # does no per-step work for their gradients.
    out, vjp = jax.vjp(lambda xs, init: run(w_rec, b_rec, xs, init, table), xs, init)
    return out, (vjp, out[0].values, init, w_rec, b_rec, xs[0].offsets[-1])

  def loop_bwd(res, g):
    vjp, y, init, w_rec, b_rec, offsets = res
    g_xs, g_init = vjp(g)
    cot = g_xs[0].values  # where the product is added to the input projection
    if cell.probe:
      probe = g_xs[1].values
      cot = jnp.concatenate([cot[..., : -cell.probe], probe], axis=-1)
    prev = previous_hidden(y, offsets, cell.hidden(init), reverse)
    prev = prev.astype(cot.dtype).reshape(-1, prev.shape[-1])
    g_w = jax.lax.dot_general(
      prev,
      cot.reshape(-1, cot.shape[-1]),
      (((0,), (0,)), ((), ())),
      precision=cell.precision,
    )
    g_b = None
    if b_rec is not None:
      g_b = jnp.sum(probe.reshape(-1, cell.probe), axis=0).astype(b_rec.dtype)
    return g_w.astype(w_rec.dtype), g_b, g_xs, g_init, None

  loop.defvjp(loop_fwd, loop_bwd)
  return loop(cell.w_rec, cell.b_rec, xs, init_carry, table)
