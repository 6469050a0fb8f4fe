"""A row-wise function over the real rows of a LoDTensor only.

A LoDTensor's token capacity holds the largest batch it must take, so a
dense layer over its values pays for every padding row: on a long-tailed
batch, several times the real rows. `map_rows` pays for the real rows
instead, rounded up to a chunk: a `lax.scan` over the capacity's chunks of
a static number of rows runs the function over those that hold real rows
and skips the others (a `lax.cond`). Every shape is static and there is
one body to compile, so one compile serves every batch of the capacity.

The chunks tile the rows from the first; the last one ends at the capacity
at most, so where it would run past it, it starts earlier and overlaps the
one before. Each chunk writes only its own rows (the ones no earlier chunk
wrote), so every row is the function of its own row, computed once in the
result.

The gradient is a `jax.custom_vjp` whose residuals are the inputs only:
the backward pass takes the vector-Jacobian product of each chunk,
recomputing what the function's products need (nothing, for a dense
layer; the first product's output, for an MLP), and sums the chunks'
cotangents of the arrays the function closes over.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlod._checks import check_callable, static_int, where_rows
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.ops._loop._plan import plan_backend

# The default chunk's elements (rows times a row's size), per backend
# (`default_chunk`).
CPU_ELEMENTS = 256 * 512
ACCELERATOR_ELEMENTS = 2048 * 512
MULTIPLE = 8


def default_chunk(
  token_capacity: int, row_size: int = 512, backend: str | None = None
) -> int:
  """The rows of `map_rows`' chunk for `token_capacity` rows of `row_size`
  elements each on `backend` (default: `jax.default_backend()`).

  Chunks of about ``256 * 512`` elements on the CPU (256 rows of 512:
  ``benchmarks/sequence_attention.py``'s products over 256 rows run about
  as fast per row as over every row, while narrower rows need more of
  them to cover a chunk's fixed cost), ``2048 * 512`` elsewhere (an
  accelerator's product needs more rows to fill it); the capacity split
  into equal chunks of at most that many rows, each rounded up to a
  multiple of 8 and at most the capacity.

  Example:
    >>> from jaxlod.ops import default_chunk
    >>> default_chunk(3072, 512, "cpu"), default_chunk(3072, 128, "cpu")
    (256, 1024)
    >>> default_chunk(640, 512, "cpu"), default_chunk(640, 128, "cpu")
    (216, 640)
  """
  token_capacity = static_int(token_capacity, "token_capacity", 1)
  row_size = static_int(row_size, "row_size", 0)
  cpu = plan_backend(backend) == "cpu"
  elements = CPU_ELEMENTS if cpu else ACCELERATOR_ELEMENTS
  target = -(-elements // max(1, row_size))
  chunks = -(-token_capacity // target)
  rows = -(-token_capacity // chunks)
  return min(token_capacity, -(-rows // MULTIPLE) * MULTIPLE)


class _Static(NamedTuple):
  """The closure-converted ``fn(rows, *consts)`` and its chunk's rows."""

  fn: Callable[..., Any]
  chunk: int


def _over_chunks(static: _Static, values, real, body, carry):
  """`carry` through ``body(start, rows, mine, carry)`` for each chunk of
  the first `real` rows of `values`: ``rows [chunk, ...]`` from row
  `start`, zero from row `real` on (selected, never multiplied: an inf or
  a NaN in a padding row stays out), and ``mine [chunk]`` the rows the
  chunk writes (real, and not an earlier chunk's). A `lax.scan` over the
  capacity's chunks whose `lax.cond` skips those past the real rows (a
  scan, not a while loop, so that the backward pass has a gradient too)."""
  chunk, capacity = static.chunk, values.shape[0]

  def run(i, inner):
    start = jnp.minimum(i * chunk, capacity - chunk)
    row = start + jnp.arange(chunk)
    rows = lax.dynamic_slice_in_dim(values, start, chunk)
    rows = where_rows(row < real, rows, 0)
    mine = (row >= i * chunk) & (row < real)
    return body(start, rows, mine, inner)

  def step(inner, i):
    return lax.cond(i * chunk < real, run, lambda i, inner: inner, i, inner), None

  chunks = jnp.arange(-(-capacity // chunk), dtype=jnp.asarray(real).dtype)
  return lax.scan(step, carry, chunks)[0]


def _put(buffer: jax.Array, start, y: jax.Array, mine: jax.Array) -> jax.Array:
  """`buffer` with the rows `mine` of `y` written from row `start`."""
  old = lax.dynamic_slice_in_dim(buffer, start, y.shape[0])
  y = where_rows(mine, y.astype(buffer.dtype), old)
  return lax.dynamic_update_slice_in_dim(buffer, y, start, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _map(static: _Static, values, real, consts):
  """`fn` over the first `real` rows of `values`, the others zero."""
  shapes = jax.eval_shape(static.fn, values[: static.chunk], *consts)
  rows = values.shape[0]
  out = jax.tree.map(lambda s: jnp.zeros((rows, *s.shape[1:]), s.dtype), shapes)

  def body(start, chunk, mine, out):
    y = static.fn(chunk, *consts)
    return jax.tree.map(lambda b, c: _put(b, start, c, mine), out, y)

  return _over_chunks(static, values, real, body, out)


def _map_fwd(static, values, real, consts):
  return _map(static, values, real, consts), (values, real, consts)


def _map_bwd(static, residuals, g):
  """The cotangents of the rows (zero at padding rows; none for integer
  rows) and the sums over the chunks of those of the closed-over arrays."""
  values, real, consts = residuals
  g_rows = jnp.zeros_like(values) if _differentiable(values) else None
  g_consts = tuple(jnp.zeros_like(c) if _differentiable(c) else None for c in consts)

  def body(start, chunk, mine, carry):
    g_rows, g_consts = carry
    _, vjp = jax.vjp(static.fn, chunk, *consts)

    def cotangent(c):
      c = lax.dynamic_slice_in_dim(c, start, chunk.shape[0])
      return where_rows(mine, c, 0)

    g_chunk, *g_mine = vjp(jax.tree.map(cotangent, g))
    if g_rows is not None:
      g_rows = _put(g_rows, start, g_chunk, mine)
    summed = tuple(
      None if a is None else a + b for a, b in zip(g_consts, g_mine, strict=True)
    )
    return g_rows, summed

  g_rows, g_consts = _over_chunks(static, values, real, body, (g_rows, g_consts))
  return g_rows, None, g_consts


def _differentiable(x: Any) -> bool:
  """Whether `x` takes a cotangent (a float or complex array)."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


_map.defvjp(_map_fwd, _map_bwd)


def map_rows(
  fn: Callable[[jax.Array], Any], x: LoDTensor, *, chunk: int | None = None
) -> LoDTensor:
  """Applies a row-wise function to the real rows of `x` only.

  ``fn(rows)`` runs over chunks of a static number of rows, as many as
  `x`'s real rows (those before the last offset) need, not over the token
  capacity: a dense layer or an MLP over a batch whose capacity is mostly
  padding does the work of its real rows, and at most one chunk more.
  A `lax.scan` over the capacity's chunks skips those past the real rows
  (`lax.cond`), so every shape is static and one compile serves every
  batch of the capacity.
  Jittable and differentiable (a `jax.custom_vjp`: the backward pass
  recomputes per chunk what `fn`'s gradient needs), also with respect to
  the arrays `fn` closes over (a layer's parameters).

  `fn` sees the padding rows of a chunk as zeros. It must be row-wise:
  each output row depends on its own input row only (a dense layer, an
  activation, a norm over features), never on the other rows or on their
  count; a function that mixes rows gets results that depend on how the
  rows fall into chunks.

  Args:
    fn: ``fn(rows)`` with ``rows [chunk, *features]`` returns an array, or
      a pytree of arrays, each ``[chunk, ...]``.
    x: a LoDTensor, values ``[token_capacity, *features]``.
    chunk: the rows of a chunk, an int >= 1 (larger ones run as the token
      capacity); `None`: `default_chunk` for the capacity, the size of a
      row of `x` and the backend.
      Smaller chunks waste less on the last one; larger ones run fewer,
      larger products.

  Returns:
    A LoDTensor with `x`'s LoD over ``fn``'s outputs at every row (a
    pytree of outputs: one LoDTensor per leaf, in its structure), padding
    rows zero.

  Raises:
    TypeError: for an `fn` that is not callable, an `x` that is not a
      LoDTensor or a `chunk` that is not an int.
    ValueError: for a `chunk` below 1, or outputs that do not keep the
      rows.

  Example:
    >>> import numpy as np
    >>> import jax.numpy as jnp
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import map_rows
    >>> x = LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[2, 1]])
    >>> map_rows(lambda r: jnp.sum(r, axis=-1) + 1, x).values.tolist()
    [3.0, 3.0, 3.0]
  """
  check_callable(fn, "fn")
  x = check_lod(x, "x")
  capacity = x.capacity.tokens
  if chunk is not None:
    chunk = static_int(chunk, "chunk", 1)
  if capacity == 0:
    return jax.tree.map(x.with_values, fn(x.values))
  if chunk is None:
    chunk = default_chunk(capacity, math.prod(x.values.shape[1:]))
  chunk = min(chunk, capacity)
  converted, consts = jax.closure_convert(fn, x.values[:chunk])
  out = jax.eval_shape(converted, x.values[:chunk], *consts)
  leaves = jax.tree.leaves(out)
  if not leaves or any(leaf.shape[:1] != (chunk,) for leaf in leaves):
    raise ValueError(
      f"Expected `fn` to return arrays of one row per input row, [{chunk}, ...] "
      f"for {chunk} rows, got {jax.tree.map(lambda a: a.shape, out)}."
    )
  out = _map(_Static(converted, chunk), x.values, x.offsets[-1][-1], tuple(consts))
  return jax.tree.map(x.with_values, out)
