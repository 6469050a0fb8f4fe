"""Flax's separable cells read into `jaxlod.ops.Separable`, for hoisting.

A plan with ``hoist=True`` (`jaxlod.ops.LoopPlan`) runs the recurrent layers
of both twins as cuDNN runs its RNNs (`jaxlod.ops._loop._hoisted`). A separable
cell (``LSTMCell``, ``OptimizedLSTMCell``, ``GRUCell``, ``SimpleCell``,
``MGUCell``, Linen and NNX) computes ``x @ w_in`` and ``h @ w_rec`` and
mixes them in its gates; `separate_linen` and `separate_nnx` give its
kernels, biases and gate math.

The parameters are the cell's own, read from its tree as Flax lays it out,
so the same parameters run with hoisting on and off and in
``flax.linen.RNN``. The math is Flax's, attribute for attribute: the gate
and activation functions, ``residual`` and ``reset_gate``, and the Dense
layers' ``dtype`` and ``precision``, promoted as Flax's ``promote_dtype`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jaxlod.ops._loop._hoisted import Separable

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


def separable(cell: Any) -> bool:
  """Whether a plan with ``hoist=True`` can run `cell`: exactly one of
  Flax's separable Linen cells, or an NNX one whose Linear layers compute
  as Flax's defaults do."""
  if type(cell) in _LINEN:
    return True
  try:
    separate_nnx(cell)
  except (TypeError, ValueError):
    return False
  return True


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
