"""Varying manual axes under `jax.shard_map`: reading and matching them.

Inside ``jax.shard_map(..., check_vma=True)`` every value has a type that
records the mesh axes it varies over (a device's own data varies; a
replicated parameter does not). A primitive whose operands disagree raises,
and a `lax.while_loop` carry must keep its type across iterations. JAX
inserts the cast itself where user code combines such values through
`jax.numpy`, but not where a traced jaxpr is evaluated again (a
closure-converted step) or where a loop's buffers start as fresh zeros: the
loops of `jaxlod.ops` make their data vary over one set of axes with
`vary`. Outside `shard_map` every value varies over no axis and both
functions do nothing.
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(tree: Any) -> frozenset:
  """The mesh axes any array leaf of `tree` varies over (empty outside
  `shard_map` or with ``check_vma=False``)."""
  axes = frozenset()
  for leaf in jax.tree.leaves(tree):
    mat = getattr(jax.typeof(leaf), "mat", None)
    if mat is not None:
      axes |= mat.varying
  return axes


def vary(tree: Any, axes: frozenset) -> Any:
  """Every array leaf of `tree`, cast to vary over `axes` as well.

  The cast (``jax.lax.pcast(..., to="varying")``) moves no data; its
  transpose is a `psum`, so a gradient that flows back through it is summed
  over the axes it added.
  """
  if not axes:
    return tree

  def cast(leaf):
    missing = tuple(sorted(axes - varying_axes(leaf), key=str))
    return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

  return jax.tree.map(cast, tree)
