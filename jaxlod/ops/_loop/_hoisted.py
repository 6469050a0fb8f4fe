"""Hoisting, for a separable cell: its input projection before the loop and
its recurrent kernel's gradient after it, as cuDNN runs its RNNs.

A *separable* cell (`Separable`: Flax's ``LSTMCell``, ``OptimizedLSTMCell``,
``GRUCell``, ``SimpleCell``, ``MGUCell`` and the NNX twins; `jaxlod.nn`
reads their parameters into one) computes ``x @ w_in`` and ``h @ w_rec``
and mixes them in its gates. `hoisted_rnn` runs it so:

  * the input projection of every packed row is one matrix product before
    the loop, ``x.values [token_capacity, features] @ w_in + b_in``;
  * the phased loop runs the recurrent part only: each step computes
    ``h @ w_rec`` and the cell's gate math from the projection;
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

`hoisted_inputs` and `hoisted_loop` are the two halves any loop can take:
the padded scan (`jaxlod.ops._loop._padded_scan`) hoists through them too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxlod._checks import check_callable, expand_rows, static_int, where_rows
from jaxlod._host import as_array
from jaxlod._lod import LoDTensor
from jaxlod.ops._loop._phased_rnn import phased_rnn
from jaxlod.ops._loop._plan import LoopPlan
from jaxlod.ops._rank import RankTable


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Separable:
  """A recurrent cell as an input projection and a recurrent step.

  Attributes:
    w_in: the input kernels side by side, ``[features, width]`` (``width``:
      gates times hidden size, in Flax's gate order).
    b_in: the biases added to the input projection, ``[width]``, or `None`.
    w_rec: the recurrent kernels side by side, ``[hidden, width]``.
    b_rec: the bias of the last `probe` columns of the recurrent product,
      ``[probe]``, or `None`.
    probe: the number of last columns of the recurrent product that a gate
      scales before the input projection is added (0: none).
    gates: ``gates(carry, xp, hp) -> (carry, h)``: a step from the projected
      input and the recurrent product, each given as its `parts` (a tuple
      of ``[b, width // parts]`` arrays, gate by gate).
    hidden: ``hidden(carry) -> h [b, hidden]``, the state ``w_rec`` reads.
    parts: the number of equal column blocks (gates) of ``width``: 4 for an
      LSTM, 3 for a GRU, 2 for an MGU, 1 for a simple cell. The fused kernel
      computes each block apart (Pallas's GPU backend neither slices nor
      joins arrays in registers).
    dtype: the Dense layers' computation dtype (`None`: inferred).
    precision: the Dense layers' ``precision``.
  """

  w_in: jax.Array
  b_in: jax.Array | None
  w_rec: jax.Array
  gates: Callable[[Any, jax.Array, jax.Array], tuple[Any, jax.Array]]
  hidden: Callable[[Any], jax.Array]
  parts: int
  b_rec: jax.Array | None = None
  probe: int = 0
  dtype: Any = None
  precision: Any = None

  def __post_init__(self):
    """Checks the fields and stores the weights and biases as arrays.

    Raises:
      TypeError: for weights or biases that are not arrays, a `probe` or
        `parts` that is not a static int, or `gates` or `hidden` that is not
        callable.
      ValueError: for `w_in` or `w_rec` that is not a matrix, a `w_rec` of
        another width than `w_in`, a `probe` outside ``[0, width]``, `parts`
        that do not divide the width into blocks the probe columns fill
        whole, or a `b_in` that is not ``[width]`` or a `b_rec` that is not
        ``[probe]`` (or given with ``probe=0``).
    """
    w_in, w_rec = as_array(self.w_in, "w_in"), as_array(self.w_rec, "w_rec")
    for name, w, rows in (("w_in", w_in, "features"), ("w_rec", w_rec, "hidden")):
      if w.ndim != 2:
        raise ValueError(
          f"Expected `{name}` to be a matrix [{rows}, width], got shape {w.shape}."
        )
    width = w_in.shape[1]
    if w_rec.shape[1] != width:
      raise ValueError(
        f"Expected `w_rec` to have the width of `w_in` ({width} columns), got "
        f"shape {w_rec.shape}."
      )
    probe = static_int(self.probe, "probe", minimum=0)
    if probe > width:
      raise ValueError(f"Expected `probe` in [0, {width}] (the width), got {probe}.")
    parts = static_int(self.parts, "parts", minimum=1)
    if width % parts or probe % max(width // parts, 1):
      raise ValueError(
        f"Expected `parts` to divide the width {width} into blocks that the "
        f"probe columns ({probe}) fill whole, got {parts}."
      )
    biases = {}
    for name, size in (("b_in", width), ("b_rec", probe)):
      value = getattr(self, name)
      if value is None:
        biases[name] = None
        continue
      value = as_array(value, name)
      if value.shape != (size,) or (name == "b_rec" and not probe):
        raise ValueError(
          f"Expected `{name}` to have shape ({size},), got {value.shape}"
          + (" with probe=0 (no probe columns)." if not probe else ".")
        )
      biases[name] = value
    check_callable(self.gates, "gates")
    check_callable(self.hidden, "hidden")
    for name, value in (
      ("w_in", w_in),
      ("w_rec", w_rec),
      ("probe", probe),
      *biases.items(),
    ):
      object.__setattr__(self, name, value)

  def split(self, a: jax.Array) -> tuple[jax.Array, ...]:
    """``a [..., width]`` as its `parts`, gate by gate: ``parts`` arrays
    ``[..., width // parts]``.

    Raises:
      TypeError, ValueError: for an `a` that is not an array whose last axis
        is the width.
    """
    a = as_array(a, "a")
    width = self.w_rec.shape[1]
    if a.ndim < 1 or a.shape[-1] != width:
      raise ValueError(
        f"Expected `a` to have the width {width} on its last axis, got shape {a.shape}."
      )
    return tuple(jnp.split(a, self.parts, axis=-1))


def _matmul(a: jax.Array, b: jax.Array, precision: Any) -> jax.Array:
  """``a [..., k] @ b [k, n]``: ``[..., n]``."""
  dims = (((a.ndim - 1,), (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision)


def dense(
  x: jax.Array, kernel: jax.Array, bias: jax.Array | None, dtype: Any, precision: Any
) -> jax.Array:
  """Flax's ``Dense`` (and ``nnx.Linear``): ``x [..., in] @ kernel [in, out]
  + bias [out]`` after ``promote_dtype``; ``[..., out]``."""
  dtype = result_dtype(x, kernel, bias, dtype=dtype)
  x, kernel = jnp.asarray(x, dtype), jnp.asarray(kernel, dtype)
  bias = None if bias is None else jnp.asarray(bias, dtype)
  y = _matmul(x, kernel, precision)
  return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def result_dtype(*arrays: Any, dtype: Any = None) -> Any:
  """The dtype a Flax ``Dense`` computes in: `dtype` when given, else the
  arrays' promoted dtype (`None` entries aside), float32 or wider when they
  are integers (as ``flax.linen.dtypes.canonicalize_dtype``)."""
  if dtype is not None:
    return jnp.dtype(dtype)
  result = jnp.result_type(*(a for a in arrays if a is not None))
  if jnp.issubdtype(result, jnp.inexact):
    return result
  return jnp.promote_types(jnp.float32, result)


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
  prev = jnp.where(expand_rows(rows == first, y.ndim), init_h[seq], neighbour)
  return where_rows(rows < offsets[-1], prev, 0)


def _recurrent_product(precision: Any) -> Callable:
  """``product(h, w, w_t)``: ``h [..., hidden] @ w [hidden, width]``, whose
  VJP gives `h`'s cotangent only, ``g [..., width] @ w_t [width, hidden]``.

  `w_t` is `w` transposed once before the loop. Each step's backward then
  multiplies row-major operands: with few rows, XLA's CPU product
  ``g @ w.T`` is slower than ``g @ w_t`` (``benchmarks/sweep.py``'s cells
  of 8 sequences). The kernel's own gradient is not computed here:
  `hoisted_loop` computes it in one product after the loop, so the loop
  differentiates `h` alone.
  """

  @jax.custom_vjp
  def product(h, w, w_t):
    return _matmul(h, w, precision)

  def product_fwd(h, w, w_t):
    return _matmul(h, w, precision), w_t

  def product_bwd(w_t, g):
    return _matmul(g, w_t, precision), None, None

  product.defvjp(product_fwd, product_bwd)
  return product


def recurrent_step(cell: Separable, w_rec: jax.Array, b_rec: jax.Array | None):
  """The phased loop's step for `cell`: ``step(carry, (xp_t[, probe_t]), _)``
  adds the recurrent product ``h @ w_rec`` (and `b_rec` and the probe to the
  probe columns) to the projected input and runs the cell's gates.

  The step is differentiated with respect to its carry and inputs only, as
  `hoisted_loop` does (`_recurrent_product`)."""
  w_rec_t = jnp.swapaxes(w_rec, 0, 1)
  product = _recurrent_product(cell.precision)

  def step(carry, x_t, _):
    h = cell.hidden(carry)
    dtype = result_dtype(h, w_rec, b_rec, dtype=cell.dtype)
    b = None if b_rec is None else b_rec.astype(dtype)
    hp = product(h.astype(dtype), w_rec.astype(dtype), w_rec_t.astype(dtype))
    if cell.probe:
      tail = hp[..., -cell.probe :] if b is None else hp[..., -cell.probe :] + b
      hp = jnp.concatenate([hp[..., : -cell.probe], tail + x_t[1]], axis=-1)
    return cell.gates(carry, cell.split(x_t[0]), cell.split(hp))

  return step


def hoisted_inputs(cell: Separable, values: jax.Array, init_carry: Any) -> tuple:
  """The loop's inputs for `cell`: the input projection of every row of
  ``values [..., features]`` as one product, ``[..., width]``, and where the
  cell has probe columns, zeros ``[..., probe]`` to add to them (the
  cotangent of the product there)."""
  xp = dense(values, cell.w_in, cell.b_in, cell.dtype, cell.precision)
  if not cell.probe:
    return (xp,)
  h0, w, b = cell.hidden(init_carry), cell.w_rec, cell.b_rec
  dtype = result_dtype(h0, w, b, dtype=cell.dtype)
  return xp, jnp.zeros((*xp.shape[:-1], cell.probe), dtype)


def _kernel_grads(cell: Separable, prev: jax.Array, g_xs: tuple, w_rec, b_rec) -> tuple:
  """The gradients of the recurrent kernel and bias: one product over all
  rows, ``prev.T @ d(h @ w_rec)``, and the probe columns' sum.

  Args:
    cell: the cell.
    prev: the state each row's step started from, ``[..., hidden]``.
    g_xs: the cotangents of the loop's inputs, arrays ``[..., width]`` and,
      where the cell has probe columns, ``[..., probe]`` (the rows as in
      `prev`).
    w_rec, b_rec: the recurrent kernel and bias, for their dtypes.
  """
  cot = g_xs[0]  # where the product is added to the input projection
  if cell.probe:
    cot = jnp.concatenate([cot[..., : -cell.probe], g_xs[1]], axis=-1)
  prev = prev.astype(cot.dtype).reshape(-1, prev.shape[-1])
  g_w = jax.lax.dot_general(
    prev,
    cot.reshape(-1, cot.shape[-1]),
    (((0,), (0,)), ((), ())),
    precision=cell.precision,
  )
  g_b = None
  if b_rec is not None:
    g_b = jnp.sum(g_xs[1].reshape(-1, cell.probe), axis=0).astype(b_rec.dtype)
  return g_w.astype(w_rec.dtype), g_b


def hoisted_loop(cell: Separable, run: Callable, previous: Callable) -> Callable:
  """A loop of `cell`'s recurrent step whose recurrent kernel's gradient is
  one product after the backward loop, through a `jax.custom_vjp`.

  Args:
    cell: the cell.
    run: ``run(w_rec, b_rec, xs, init, aux) -> (outputs, final_carry)``, the
      loop over the loop's inputs `xs` (`hoisted_inputs`, as arrays or
      LoDTensors); `aux` is not differentiated (a rank table, lengths).
    previous: ``previous(outputs, init, aux)``: the state each row's step
      started from, its rows as those of `xs`.

  Returns:
    ``loop(w_rec, b_rec, xs, init, aux)``, `run`'s results. Its VJP runs
    `run`'s with the weights closed over, so the loop does no per-step
    work for their gradients.
  """

  @jax.custom_vjp
  def loop(w_rec, b_rec, xs, init, aux):
    return run(w_rec, b_rec, xs, init, aux)

  def loop_fwd(w_rec, b_rec, xs, init, aux):
    out, vjp = jax.vjp(lambda xs, init: run(w_rec, b_rec, xs, init, aux), xs, init)
    return out, (vjp, previous(out, init, aux), w_rec, b_rec)

  def loop_bwd(res, g):
    vjp, prev, w_rec, b_rec = res
    g_xs, g_init = vjp(g)
    rows = tuple(getattr(a, "values", a) for a in g_xs)  # a LoDTensor's rows
    g_w, g_b = _kernel_grads(cell, prev, rows, w_rec, b_rec)
    return g_w, g_b, g_xs, g_init, None

  loop.defvjp(loop_fwd, loop_bwd)
  return loop


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
  """The phased loop of a separable cell over the last level of `x`, its
  input projection hoisted before the loop and its recurrent kernel's
  gradient after it.

  Args:
    cell: the cell.
    x: a LoDTensor ``values [token_capacity, *batch, features]``.
    init_carry: the cell's carry, leaves ``[count_capacity, ...]``.
    reverse, table, ladder, remat, plan: as `jaxlod.ops.dynamic_rnn`'s.

  Returns:
    ``(outputs, final_carry)`` as `jaxlod.ops.dynamic_rnn` returns them:
    outputs ``values [token_capacity, *batch, hidden]``.
  """
  first, *rest = hoisted_inputs(cell, x.values, init_carry)
  settings = dict(reverse=reverse, ladder=ladder, remat=remat, plan=plan)

  def run(w_rec, b_rec, xs, init, table):
    # One LoDTensor crosses the custom VJP and lends its LoD to the other
    # inputs inside it, so that they share one offsets array and the loop
    # needs no check that their LoDs agree.
    lod, *others = xs
    step = recurrent_step(cell, w_rec, b_rec)
    return phased_rnn(
      step,
      (lod, *(lod.with_values(v) for v in others)),
      init_carry=init,
      static_inputs=None,
      table=table,
      return_sequences=True,
      **settings,
    )

  def previous(out, init, table):
    y = out[0]  # the outputs, with the loop's LoD
    return previous_hidden(y.values, y.offsets[-1], cell.hidden(init), reverse)

  loop = hoisted_loop(cell, run, previous)
  return loop(cell.w_rec, cell.b_rec, (x.with_values(first), *rest), init_carry, table)
