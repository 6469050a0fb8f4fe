"""`check_independent`: the sequences of a LoDTensor stay independent
through a function."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod import LoDTensor
from jaxlod._checks import (
  check_bool,
  check_callable,
  check_sequence,
  static_float,
  static_int,
)
from jaxlod._lod_checks import check_level, check_unstacked

# The changes `check_independent` makes to a sequence's rows.
PERTURBATIONS = ("random", "large", "inf", "nan")


class IndependenceError(AssertionError):
  """One sequence's change reached another sequence's outputs or gradients."""


def _sequence_rows(x: LoDTensor, level: int) -> list[tuple[int, int]]:
  """The ``[start, end)`` rows of `x.values` of each sequence at `level`."""
  level = level % x.num_levels
  offsets = [np.asarray(o) for o in x.offsets]
  starts, ends = offsets[level][:-1], offsets[level][1:]
  for deeper in offsets[level + 1 :]:
    starts, ends = deeper[starts], deeper[ends]
  return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def _perturb(values: np.ndarray, start: int, end: int, kind: str, seed: int):
  out = np.array(values)
  shape = out[start:end].shape
  if kind == "random":
    rng = np.random.default_rng(seed)
    if np.issubdtype(out.dtype, np.integer):
      out[start:end] = rng.integers(0, max(int(out.max(initial=0)), 1) + 1, shape)
    else:
      out[start:end] = out[start:end] + rng.normal(size=shape)
  elif np.issubdtype(out.dtype, np.integer):  # no inf or NaN: the largest value
    out[start:end] = np.iinfo(out.dtype).max
  else:
    out[start:end] = {"large": 1e30, "inf": np.inf, "nan": np.nan}[kind]
  return out


def _leaf_level(leaf: LoDTensor, level: int, count: int) -> int | None:
  """The level of an output LoDTensor whose sequences are those of the
  input's (non-negative) `level`: the same level counted from the outside
  (an output with more levels nests more in each sequence, as hypotheses
  per source), or its last if it has fewer; `None` when that level does not
  hold `count` sequences."""
  lvl = min(level, leaf.num_levels - 1)
  return lvl if len(np.asarray(leaf.offsets[lvl])) - 1 == count else None


def _pieces(leaf: Any, level: int, count: int) -> list[np.ndarray] | None:
  """`leaf` split per sequence: a LoDTensor's rows (see `_leaf_level`), or
  an array's leading axis of `count` entries; `None` when `leaf` is not per
  sequence."""
  if isinstance(leaf, LoDTensor):
    lvl = _leaf_level(leaf, level, count)
    if lvl is None:
      return None
    values = np.asarray(leaf.values)
    return [values[s:e] for s, e in _sequence_rows(leaf, lvl)]
  array = np.asarray(leaf)
  if array.ndim and array.shape[0] == count:
    return list(array)
  return None


def _same(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> bool:
  if a.shape != b.shape:
    return False
  if not np.issubdtype(a.dtype, np.inexact):
    return bool(np.array_equal(a, b))
  return bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))


def _is_lod(a: Any) -> bool:
  return isinstance(a, LoDTensor)


def _cotangent(out: Any, level: int, count: int, skip: int, seed: int) -> Any:
  """Random cotangents on every sequence's outputs but `skip`'s."""
  rng = np.random.default_rng(seed)

  def one(leaf):
    if isinstance(leaf, LoDTensor):
      dtype = leaf.values.dtype
      ct = np.zeros(leaf.values.shape, np.float32)
      lvl = _leaf_level(leaf, level, count)
      for j, (s, e) in enumerate(_sequence_rows(leaf, lvl) if lvl is not None else ()):
        if j != skip:
          ct[s:e] = rng.normal(size=ct[s:e].shape)
      zero = jax.tree.map(_zero_ct, leaf)
      return dataclasses.replace(zero, values=_as_ct(ct, dtype))
    array = np.asarray(leaf)
    if not (array.ndim and array.shape[0] == count):
      return _zero_ct(leaf)
    ct = rng.normal(size=array.shape).astype(np.float32)
    ct[skip] = 0
    return _as_ct(ct, array.dtype)

  return jax.tree.map(one, out, is_leaf=_is_lod)


def _as_ct(ct: np.ndarray, dtype: Any) -> np.ndarray:
  if jnp.issubdtype(dtype, jnp.inexact):
    return ct.astype(dtype)
  return np.zeros(ct.shape, jax.dtypes.float0)


def _zero_ct(leaf: Any) -> np.ndarray:
  leaf = np.asarray(leaf)
  return _as_ct(np.zeros(leaf.shape, np.float32), leaf.dtype)


def check_independent(
  fn: Callable[[LoDTensor], Any],
  x: LoDTensor,
  *,
  level: int = -1,
  perturbations: Sequence[str] = PERTURBATIONS,
  grads: bool | None = None,
  jit: bool = False,
  rtol: float = 0.0,
  atol: float = 0.0,
  seed: int = 0,
) -> None:
  """Checks that changing one sequence of `x` changes no other's results.

  For each sequence ``i`` of `x` at `level` and each perturbation, the rows
  of sequence ``i`` in ``x.values`` are replaced (``"random"``: a random
  change; ``"large"``: 1e30; ``"inf"``; ``"nan"``) and `fn` is called again.
  Every other sequence's outputs must be unchanged (NaN equals NaN), and so
  must the gradient with respect to ``x.values``, on the other sequences'
  rows, of a random linear loss of the other sequences' outputs (a `jax.vjp`
  of `fn` whose cotangent is zero on sequence ``i``'s outputs).

  Per-sequence outputs are found in the pytree ``fn(x)``: a LoDTensor leaf
  is split by its offsets at `level` counted from the outside (its last
  level if it has fewer; an output with more levels, such as hypotheses per
  source, nests them in each sequence), when that level holds
  ``count_capacity`` (``len(x.offsets[level]) - 1``) sequences; an array
  leaf with leading axis ``count_capacity``, e.g. final carries
  ``[count_capacity, *features]``, is split by that axis. Other leaves (a
  batch-wide loss, a time-major buffer) are not compared: return only what
  is per sequence, with the sequences first.

  Args:
    fn: ``fn(x) -> outputs``, a pytree of LoDTensors and arrays; it may be
      jitted.
    x: a concrete LoDTensor ``values: [token_capacity, *features]``.
    level: the LoD level whose sequences are perturbed, one at a time.
    perturbations: a subset of ``("random", "large", "inf", "nan")``.
    grads: check gradients; by default when ``x.values`` is floating.
    jit: wrap `fn` in `jax.jit`.
    rtol: relative tolerance of the comparisons (0: bitwise, NaN aside).
    atol: absolute tolerance.
    seed: seeds the random change and the cotangents.

  Raises:
    IndependenceError: (an AssertionError) naming the perturbed sequence,
      the perturbation, the output's pytree path and the sequence that
      changed.
    TypeError: for an `fn` that is not callable, an `x` that is not a
      LoDTensor, and arguments of other types, naming the argument.
    ValueError: for an unknown perturbation, a `level` outside `x`'s
      levels, `grads` for integer values, negative tolerances or `seed`.

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor, ops
    >>> from jaxlod.testing import check_independent
    >>> x = LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[2, 1]])
    >>> check_independent(lambda x: ops.sequence_pool(x, "sum"), x)
    >>> leaky = lambda x: x.with_values(x.values + x.values.mean())
    >>> check_independent(leaky, x)
    Traceback (most recent call last):
    ...
    jaxlod.testing._independence.IndependenceError: ...
  """
  call, depth, perturbations, grads, seed = _checked(
    fn, x, level, perturbations, grads, jit, rtol, atol, seed
  )
  values = np.asarray(x.values)
  count = len(np.asarray(x.offsets[depth])) - 1
  spans = _sequence_rows(x, depth)

  def run(v: np.ndarray) -> Any:
    return call(dataclasses.replace(x, values=jnp.asarray(v)))

  def vjp(v: np.ndarray, skip: int) -> np.ndarray:
    def of_values(vals):
      return call(dataclasses.replace(x, values=vals))

    out, pullback = jax.vjp(of_values, jnp.asarray(v))
    return np.asarray(pullback(_cotangent(out, depth, count, skip, seed))[0])

  def flat(out: Any) -> list:
    return jax.tree_util.tree_flatten_with_path(out, is_leaf=_is_lod)[0]

  clean = flat(run(values))
  for i, (start, end) in enumerate(spans):
    if start == end:
      continue
    clean_grad = vjp(values, i) if grads else None
    for kind in perturbations:
      changed = _perturb(values, start, end, kind, seed + i)
      where = f"Perturbing sequence {i} (level {level}) with {kind!r}"
      for (path, a), (_, b) in zip(clean, flat(run(changed)), strict=True):
        name = jax.tree_util.keystr(path) or "<root>"
        pieces = (_pieces(a, depth, count), _pieces(b, depth, count))
        if pieces[0] is not None:
          _compare(pieces, i, rtol, atol, f"{where} changed output {name}")
      if grads:
        grad = vjp(changed, i)
        pieces = ([clean_grad[s:e] for s, e in spans], [grad[s:e] for s, e in spans])
        what = f"{where} changed the gradient of `x.values` (the other sequences' loss)"
        _compare(pieces, i, rtol, atol, what)


def _compare(pieces: tuple[list, list], skip: int, rtol, atol, what: str) -> None:
  """Every sequence's piece but `skip`'s is the same before and after.

  Raises:
    IndependenceError: ``"{what} of sequence {j}: {before} became {after}."``
  """
  for j, (before, after) in enumerate(zip(*pieces, strict=True)):
    if j != skip and not _same(before, after, rtol, atol):
      raise IndependenceError(f"{what} of sequence {j}: {before!r} became {after!r}.")


def _checked(fn, x, level, perturbations, grads, jit, rtol, atol, seed) -> tuple:
  """`check_independent`'s arguments checked: ``(call, level made
  non-negative, perturbations, grads, seed)``, `call` `fn` jitted with
  `jit`.

  Raises:
    TypeError, ValueError: as `check_independent`, naming the argument.
  """
  check_callable(fn, "fn")
  if not isinstance(x, LoDTensor):
    raise TypeError(f"Expected `x` to be a LoDTensor, got {type(x).__name__}.")
  check_unstacked(x, "x")
  depth = check_level(x, level, "level")
  perturbations = check_sequence(perturbations, "perturbations", "a sequence of str")
  for kind in perturbations:
    if not isinstance(kind, str) or kind not in PERTURBATIONS:
      raise ValueError(
        f"Expected each of `perturbations` in {PERTURBATIONS}, got {kind!r}."
      )
  dtype = np.asarray(x.values).dtype
  floating = bool(np.issubdtype(dtype, np.floating))
  grads = floating if grads is None else check_bool(grads, "grads")
  if grads and not floating:
    raise ValueError(
      f"Expected `grads` False or None for `x.values` of {dtype.name}"
      f" (gradients are of floating values), got {grads}."
    )
  call = jax.jit(fn) if check_bool(jit, "jit") else fn
  for name, tolerance in (("rtol", rtol), ("atol", atol)):
    if not static_float(tolerance, name) >= 0:
      raise ValueError(f"Expected `{name}` >= 0, got {tolerance}.")
  seed = static_int(seed, "seed", minimum=0, device=False)
  return call, depth, perturbations, grads, seed
