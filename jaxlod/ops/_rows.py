"""A row-wise function over the real rows of a LoDTensor only.

A LoDTensor's token capacity holds the largest batch it must take, so a
dense layer over its values pays for every padding row: on a long-tailed
batch, several times the real rows. `map_rows` pays for a static size just
above the real rows instead: a geometric ladder of row counts from the
capacity down, the function traced once per size, and a `lax.switch` on
the batch's real row count picks the one to run (the recurrent loop's
ladder, over rows). Every shape is static, so one compile serves every
batch of the capacity.

The gradient is a `jax.custom_vjp` whose residuals are the inputs only:
the backward pass takes the vector-Jacobian product at the same size,
recomputing what the function's products need (nothing, for a dense
layer; the first product's output, for an MLP).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlod._checks import check_callable
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.ops._rank import default_ladder, normalize_ladder

# The default ladder: sizes a ratio of 1.5 apart (at most half as many rows
# again as the real ones), multiples of 8, down to a quarter of the
# capacity: five sizes, as each size is one more branch to compile in the
# forward and the backward pass.
RATIO = 1.5
MULTIPLE = 8
SMALLEST = 4


def row_ladder(token_capacity: int) -> tuple[int, ...]:
  """The row counts `map_rows` runs at by default, largest first: from
  `token_capacity` down by a ratio of 1.5, multiples of 8, to a quarter
  of it."""
  smallest = max(1, -(-token_capacity // SMALLEST))
  return default_ladder(
    token_capacity, ratio=RATIO, minimum=smallest, multiple=MULTIPLE
  )


def _padded(y: jax.Array, real: jax.Array, capacity: int) -> jax.Array:
  """Rows `y` ``[size, ...]`` zero from row `real` on, padded with zero
  rows to ``[capacity, ...]``."""
  keep = (jnp.arange(y.shape[0]) < real).reshape((-1,) + (1,) * (y.ndim - 1))
  y = jnp.where(keep, y, jnp.zeros((), y.dtype))
  return jnp.pad(y, [(0, capacity - y.shape[0])] + [(0, 0)] * (y.ndim - 1))


class _Static(NamedTuple):
  """The function at each size: `sizes` (largest first), `fns` (``fn(rows,
  *consts)``, closure-converted) and `spans` (which of the closed-over
  arrays each takes)."""

  sizes: tuple[int, ...]
  fns: tuple[Callable[..., Any], ...]
  spans: tuple[tuple[int, ...], ...]


def _converted(fn: Callable, values: jax.Array, sizes: tuple[int, ...]):
  """`fn` closure-converted at every size, and the arrays it closes over
  (each once); checks that its outputs keep the rows and the same
  trailing shapes and dtypes at every size."""
  fns, spans, consts, index, tails = [], [], [], {}, None
  for n in sizes:
    converted, found = jax.closure_convert(fn, values[:n])
    out = jax.eval_shape(converted, values[:n], *found)
    leaves = jax.tree.leaves(out)
    if not leaves or any(leaf.shape[:1] != (n,) for leaf in leaves):
      raise ValueError(
        f"Expected `fn` to return arrays of one row per input row, [{n}, ...] "
        f"for {n} rows, got {jax.tree.map(lambda a: a.shape, out)}."
      )
    found_tails = (jax.tree.structure(out), [(a.shape[1:], a.dtype) for a in leaves])
    if tails is not None and found_tails != tails:
      raise ValueError(
        "Expected `fn`'s outputs to have the same trailing shapes and dtypes at "
        f"every number of rows; got {tails[1]} at {sizes[0]} rows and "
        f"{found_tails[1]} at {n}."
      )
    tails = found_tails
    for c in found:
      index.setdefault(id(c), len(consts))
      if index[id(c)] == len(consts):
        consts.append(c)
    spans.append(tuple(index[id(c)] for c in found))
    fns.append(converted)
  return _Static(tuple(sizes), tuple(fns), tuple(spans)), tuple(consts)


def _rows(values: jax.Array, real: jax.Array, size: int) -> jax.Array:
  """The first `size` rows of `values`, zero from row `real` on (selected,
  never multiplied: an inf or a NaN in a padding row stays out)."""
  return _padded(values[:size], real, size)


def _branch(static: _Static, k: int, values, real, consts):
  """The function at size ``static.sizes[k]``, its outputs padded to the
  capacity."""
  size = static.sizes[k]
  out = static.fns[k](_rows(values, real, size), *(consts[i] for i in static.spans[k]))
  return jax.tree.map(lambda y: _padded(y, real, values.shape[0]), out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _map(static: _Static, values, real, index, consts):
  """`fn` at the size `index` picks (`real`: the real rows)."""
  branches = [functools.partial(_branch, static, k) for k in range(len(static.sizes))]
  return lax.switch(index, branches, values, real, consts)


def _map_fwd(static, values, real, index, consts):
  return _map(static, values, real, index, consts), (values, real, index, consts)


def _map_bwd(static, residuals, g):
  """The cotangents of the rows and of the closed-over arrays, from the
  vector-Jacobian product at the forward pass's size (padding rows zero)."""
  values, real, index, consts = residuals

  def branch(k, values, real, consts, g):
    size = static.sizes[k]
    mine = [consts[i] for i in static.spans[k]]
    _, vjp = jax.vjp(static.fns[k], _rows(values, real, size), *mine)
    g_rows, *g_mine = vjp(jax.tree.map(lambda c: _padded(c[:size], real, size), g))
    g_consts = [jnp.zeros_like(c) if _differentiable(c) else None for c in consts]
    for i, gc in zip(static.spans[k], g_mine, strict=True):
      if g_consts[i] is not None:
        g_consts[i] = g_consts[i] + gc
    if not _differentiable(values):  # ids, say: no cotangent
      return None, tuple(g_consts)
    return _padded(g_rows, real, values.shape[0]), tuple(g_consts)

  branches = [functools.partial(branch, k) for k in range(len(static.sizes))]
  g_rows, g_consts = lax.switch(index, branches, values, real, consts, g)
  return g_rows, None, None, g_consts


def _differentiable(x: Any) -> bool:
  """Whether `x` takes a cotangent (a float or complex array)."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


_map.defvjp(_map_fwd, _map_bwd)


def map_rows(
  fn: Callable[[jax.Array], Any],
  x: LoDTensor,
  *,
  ladder: Sequence[int] | None = None,
) -> LoDTensor:
  """Applies a row-wise function to the real rows of `x` only.

  ``fn(rows)`` runs at the smallest size of a static ladder of row counts
  that holds `x`'s real rows (those before the last offset), not at the
  token capacity: a dense layer or an MLP over a batch whose capacity is
  mostly padding does the work of its real rows (at most half as many
  again, with the default ladder, or a quarter of the capacity). `fn` is traced once per
  size and a `lax.switch` on the real row count runs one, so every shape
  is static and one compile serves every batch of the capacity. Jittable
  and differentiable (a `jax.custom_vjp`: the backward pass recomputes at
  the same size what `fn`'s gradient needs), also with respect to the
  arrays `fn` closes over (a layer's parameters).

  `fn` sees the padding rows of its size as zeros. It must be row-wise:
  each output row depends on its own input row only (a dense layer, an
  activation, a norm over features), never on the other rows or on their
  count; a function that mixes rows gets results that depend on the
  batch's real row count.

  Args:
    fn: ``fn(rows)`` with ``rows [size, *features]`` returns an array, or
      a pytree of arrays, each ``[size, ...]``; the trailing shapes and
      the dtypes the same at every size.
    x: a LoDTensor, values ``[token_capacity, *features]``.
    ladder: the row counts to run at (the token capacity is added);
      `None`: from the capacity down by a ratio of 1.5, multiples of 8,
      to a quarter of the capacity. Each size is a branch that compiles
      in the forward and the backward pass.

  Returns:
    A LoDTensor with `x`'s LoD over ``fn``'s outputs at every row (a
    pytree of outputs: one LoDTensor per leaf, in its structure), padding
    rows zero.

  Raises:
    TypeError: for an `fn` that is not callable or an `x` that is not a
      LoDTensor.
    ValueError: for a ladder size that is not an int in ``[1,
      token_capacity]``, or outputs that do not keep the rows or change
      shape or dtype with the size.

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
  if capacity == 0:
    return jax.tree.map(x.with_values, fn(x.values))
  sizes = row_ladder(capacity) if ladder is None else normalize_ladder(capacity, ladder)
  static, consts = _converted(fn, x.values, tuple(sizes))
  real = x.offsets[-1][-1]
  index = jnp.sum(jnp.asarray(sizes[1:]) >= real).astype(jnp.int32)
  out = _map(static, x.values, real, index, consts)
  return jax.tree.map(x.with_values, out)
