"""Hoisting: Flax's separable cells with their input projection before the loop.

A plan with ``hoist=True`` (`jaxlod.ops.LoopPlan`) runs the recurrent layers
of both twins as cuDNN runs its RNNs. A separable cell (``LSTMCell``,
``OptimizedLSTMCell``, ``GRUCell``, ``SimpleCell``, ``MGUCell``, Linen and
NNX) computes ``x @ w_in`` and ``h @ w_rec`` and mixes them in its gates:

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

The parameters are the cell's own, read from its tree as Flax lays it out,
so the same parameters run with hoisting on and off and in
``flax.linen.RNN``. The math is Flax's, attribute for attribute: the gate
and activation functions, ``residual`` and ``reset_gate``, and the Dense
layers' ``dtype`` and ``precision`` through Flax's ``promote_dtype``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.dtypes import canonicalize_dtype, promote_dtype
from flax.nnx.nn import dtypes as nnx_dtypes

from jaxlod._lod import LoDTensor
from jaxlod.ops._fused import Separable, dense, fused_rnn
from jaxlod.ops._plan import LoopPlan, plan_with_ladder
from jaxlod.ops._rank import RankTable
from jaxlod.ops._rnn import dynamic_rnn

# -- the gate math of each cell, as Flax writes it -----------------------------------


def _lstm_hidden(carry: Any) -> jax.Array:
  return carry[1]


def _own_hidden(carry: jax.Array) -> jax.Array:
  return carry


def _lstm(gate_fn: Callable, activation_fn: Callable) -> Callable:
  def gates(carry, xp, hp):
    c, _ = carry
    i, f, g, o = (x + h for x, h in zip(xp, hp, strict=True))
    i, f, g, o = gate_fn(i), gate_fn(f), activation_fn(g), gate_fn(o)
    new_c = f * c + i * g
    new_h = o * activation_fn(new_c)
    return (new_c, new_h), new_h

  return gates


def _gru(gate_fn: Callable, activation_fn: Callable) -> Callable:
  def gates(h, xp, hp):
    (xr, xz, xn), (hr, hz, hn) = xp, hp
    r, z = gate_fn(xr + hr), gate_fn(xz + hz)
    n = activation_fn(xn + r * hn)
    new_h = (1.0 - z) * n + z * h
    return new_h, new_h

  return gates


def _simple(activation_fn: Callable, residual: bool) -> Callable:
  def gates(h, xp, hp):
    new_h = xp[0] + hp[0]
    if residual:
      new_h += h
    new_h = activation_fn(new_h)
    return new_h, new_h

  return gates


def _mgu(gate_fn: Callable, activation_fn: Callable, reset_gate: bool) -> Callable:
  def gates(h, xp, hp):
    (xf, xn), (hf, hn) = xp, hp
    f = gate_fn(xf + hf)
    if reset_gate:
      hn *= f
    n = activation_fn(xn + hn)
    new_h = (1.0 - f) * n + f * h
    return new_h, new_h

  return gates


# -- Linen cells: their parameters by Flax's names -----------------------------------


def _cat(params: Any, prefix: str, gates: str, leaf: str) -> jax.Array:
  return jnp.concatenate([params[prefix + g][leaf] for g in gates], axis=-1)


def _linen_lstm(cell: nn.Module, p: Any) -> Separable:
  # Flax adds the recurrent bias to the sum: it joins the input projection.
  return Separable(
    w_in=_cat(p, "i", "ifgo", "kernel"),
    b_in=_cat(p, "h", "ifgo", "bias"),
    w_rec=_cat(p, "h", "ifgo", "kernel"),
    gates=_lstm(cell.gate_fn, cell.activation_fn),
    hidden=_lstm_hidden,
    parts=4,
    dtype=cell.dtype,
  )


def _linen_gru(cell: nn.Module, p: Any) -> Separable:
  # `hn`'s bias sits inside the reset gate's product: it stays in the loop.
  return Separable(
    w_in=_cat(p, "i", "rzn", "kernel"),
    b_in=_cat(p, "i", "rzn", "bias"),
    w_rec=_cat(p, "h", "rzn", "kernel"),
    b_rec=p["hn"]["bias"],
    probe=p["hn"]["kernel"].shape[-1],
    gates=_gru(cell.gate_fn, cell.activation_fn),
    hidden=_own_hidden,
    parts=3,
    dtype=cell.dtype,
  )


def _linen_simple(cell: nn.Module, p: Any) -> Separable:
  return Separable(
    w_in=p["i"]["kernel"],
    b_in=p["i"]["bias"],
    w_rec=p["h"]["kernel"],
    gates=_simple(cell.activation_fn, cell.residual),
    hidden=_own_hidden,
    parts=1,
    dtype=cell.dtype,
  )


def _linen_mgu(cell: nn.Module, p: Any) -> Separable:
  # With the reset gate, `hn` (and its bias) is scaled by the forget gate.
  reset = cell.reset_gate
  return Separable(
    w_in=_cat(p, "i", "fn", "kernel"),
    b_in=_cat(p, "i", "fn", "bias"),
    w_rec=_cat(p, "h", "fn", "kernel"),
    b_rec=p["hn"]["bias"] if reset else None,
    probe=p["hn"]["kernel"].shape[-1] if reset else 0,
    gates=_mgu(cell.gate_fn, cell.activation_fn, reset),
    hidden=_own_hidden,
    parts=2,
    dtype=cell.dtype,
  )


_LINEN = {
  nn.LSTMCell: _linen_lstm,
  nn.OptimizedLSTMCell: _linen_lstm,
  nn.GRUCell: _linen_gru,
  nn.SimpleCell: _linen_simple,
  nn.MGUCell: _linen_mgu,
}


def _unsupported(cell: Any, prefix: str, supported: dict) -> TypeError:
  names = ", ".join(f"{prefix}.{t.__name__}" for t in supported)
  return TypeError(
    f"Expected `cell` to be one of Flax's separable cells ({names}) to hoist "
    f"its input projection (a plan with hoist=True or fused=True), got "
    f"{type(cell).__name__}; use a jaxlod.ops.LoopPlan with hoist=False and "
    "fused=False for other cells (jaxlod.ops.dynamic_rnn runs any cell)."
  )


def separate_linen(cell: nn.Module, carry: Any, x_row: jax.Array) -> Separable:
  """A bound Linen cell as a `Separable` over its parameters.

  While initializing, the cell is called once on `carry` and `x_row` (one
  row each) so that its parameters exist, the tree ``flax.linen.RNN``
  makes.

  Raises:
    TypeError: for a cell that is not exactly one of Flax's separable cells
      (a subclass may change the math).
  """
  build = _LINEN.get(type(cell))
  if build is None:
    raise _unsupported(cell, "nn", _LINEN)
  if cell.is_initializing():
    cell(carry, x_row)
  return build(cell, nn.meta.unbox(cell.variables["params"]))


# -- NNX cells: their Linear layers ----------------------------------------------------


def _linear_settings(cell: nnx.Module, names: tuple[str, ...]) -> tuple[Any, Any]:
  """The ``(dtype, precision)`` that all of the cell's Linear layers `names`
  share, checking that hoisting computes as they do."""
  cell_name = f"nnx.{type(cell).__name__}"
  settings = set()
  for name in names:
    linear = getattr(cell, name)
    for attr, ok in (
      ("dot_general", linear.dot_general is jax.lax.dot_general),
      ("promote_dtype", linear.promote_dtype is nnx_dtypes.promote_dtype),
      ("preferred_element_type", linear.preferred_element_type is None),
    ):
      if not ok:
        raise ValueError(
          f"Cannot hoist {cell_name}: its Linear `{name}` has `{attr}` "
          f"{getattr(linear, attr)!r}, and hoisting computes with Flax's defaults "
          "only; use jaxlod.ops.LoopPlan(hoist=False) for this cell."
        )
    settings.add((linear.dtype, linear.precision))
  if len(settings) > 1:
    raise ValueError(
      f"Cannot hoist {cell_name}: its Linear layers {', '.join(names)} differ in "
      f"`dtype` or `precision` ({sorted(map(str, settings))}), and hoisting "
      "computes them together; use jaxlod.ops.LoopPlan(hoist=False) for this cell."
    )
  return settings.pop()


def _values(cell: nnx.Module, names: tuple[str, ...], leaf: str) -> jax.Array:
  return jnp.concatenate([getattr(getattr(cell, n), leaf)[...] for n in names], -1)


def _nnx_lstm(cell: nnx.Module) -> Separable:
  if isinstance(cell, nnx.OptimizedLSTMCell):
    inputs, recurrent = ("dense_i",), ("dense_h",)
  else:
    inputs, recurrent = ("ii", "if_", "ig", "io"), ("hi", "hf", "hg", "ho")
  dtype, precision = _linear_settings(cell, inputs + recurrent)
  return Separable(
    w_in=_values(cell, inputs, "kernel"),
    b_in=_values(cell, recurrent, "bias"),
    w_rec=_values(cell, recurrent, "kernel"),
    gates=_lstm(cell.gate_fn, cell.activation_fn),
    hidden=_lstm_hidden,
    parts=4,
    dtype=dtype,
    precision=precision,
  )


def _nnx_gru(cell: nnx.Module) -> Separable:
  # NNX's GRU has no recurrent bias: only the input projection's.
  dtype, precision = _linear_settings(cell, ("dense_i", "dense_h"))
  return Separable(
    w_in=cell.dense_i.kernel[...],
    b_in=cell.dense_i.bias[...],
    w_rec=cell.dense_h.kernel[...],
    probe=cell.hidden_features,
    gates=_gru(cell.gate_fn, cell.activation_fn),
    hidden=_own_hidden,
    parts=3,
    dtype=dtype,
    precision=precision,
  )


def _nnx_simple(cell: nnx.Module) -> Separable:
  dtype, precision = _linear_settings(cell, ("dense_i", "dense_h"))
  return Separable(
    w_in=cell.dense_i.kernel[...],
    b_in=cell.dense_i.bias[...],
    w_rec=cell.dense_h.kernel[...],
    gates=_simple(cell.activation_fn, cell.residual),
    hidden=_own_hidden,
    parts=1,
    dtype=dtype,
    precision=precision,
  )


_NNX = {
  nnx.LSTMCell: _nnx_lstm,
  nnx.OptimizedLSTMCell: _nnx_lstm,
  nnx.GRUCell: _nnx_gru,
  nnx.SimpleCell: _nnx_simple,
}


def separate_nnx(cell: nnx.Module) -> Separable:
  """An NNX cell as a `Separable` over its parameters (read, not copied:
  gradients reach them under `nnx.grad`).

  Raises:
    TypeError: for a cell that is not exactly one of Flax's separable cells.
    ValueError: for a Linear layer of the cell with a ``dot_general``,
      ``promote_dtype`` or ``preferred_element_type`` other than Flax's
      defaults, or Linear layers that differ in ``dtype`` or ``precision``.
  """
  build = _NNX.get(type(cell))
  if build is None:
    raise _unsupported(cell, "nnx", _NNX)
  return build(cell)


# -- the loop ----------------------------------------------------------------------


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
    dtype = canonicalize_dtype(h0, w, b, dtype=cell.dtype)
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
      h, w, b = promote_dtype(cell.hidden(carry), w_rec, b_rec, dtype=cell.dtype)
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
