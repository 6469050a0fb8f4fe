"""Choosing a plan by timing: `tune_plan`.

`default_plan` is a static rule per backend, measured on the benchmarks'
workloads. A user's own step, batch and device may favour another plan:
`tune_plan` compiles the candidates on the user's function and arguments,
times them on whatever backend runs them, and returns the fastest one
whose results are the reference's, as cuDNN and XLA time their algorithms
before choosing one.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jaxlod._checks import (
  check_callable,
  check_sequence,
  static_float,
  static_int,
  value_text,
)
from jaxlod.ops._loop._plan import LoopPlan, default_plan, plan_backend

# The plans tried on every backend after its `default_plan`: the ladder,
# one, two and four bodies, one body in chunks of eight steps, the ladder
# with the input projection hoisted, and the drop-in RNNs' padded scan,
# plain and hoisted.
_CANDIDATES = (
  LoopPlan(),
  LoopPlan(bodies=1),
  LoopPlan(bodies=2),
  LoopPlan(bodies=4),
  LoopPlan(bodies=1, chunk=8),
  LoopPlan(hoist=True),
  LoopPlan(padded=True),
  LoopPlan(padded=True, hoist=True),
)
# Tried on a GPU or TPU only: on a CPU the fused kernel runs in Pallas's
# interpret mode, far slower than any loop.
_ACCELERATOR_CANDIDATES = (
  LoopPlan(bodies=1, chunk=8, hoist=True),
  LoopPlan(fused=True),
)


def default_candidates(backend: str | None = None) -> tuple[LoopPlan, ...]:
  """The plans `tune_plan` times when given no `candidates`.

  `default_plan` of `backend` (default: `jax.default_backend()`) first, the
  reference; then `LoopPlan()` (the ladder), ``LoopPlan(bodies=1)``,
  ``LoopPlan(bodies=2)``, ``LoopPlan(bodies=4)``, ``LoopPlan(bodies=1,
  chunk=8)``, ``LoopPlan(hoist=True)``, ``LoopPlan(padded=True)`` and
  ``LoopPlan(padded=True, hoist=True)``; on any backend but the CPU also
  ``LoopPlan(bodies=1, chunk=8, hoist=True)`` and ``LoopPlan(fused=True)``.
  Each plan once, in that order.

  Raises:
    TypeError: for a `backend` that is not a string.
  """
  backend = plan_backend(backend)
  plans = (default_plan(backend), *_CANDIDATES)
  if backend != "cpu":
    plans += _ACCELERATOR_CANDIDATES
  return tuple(dict.fromkeys(plans))


def tune_plan(
  fn: Callable[..., Any],
  *example_args: Any,
  candidates: Iterable[LoopPlan] | None = None,
  repeats: int = 5,
  rtol: float = 1e-4,
  atol: float = 1e-6,
) -> LoopPlan:
  """The fastest plan for `fn` on `example_args` among `candidates`, timed.

  `default_plan` is a rule per backend; a step, batch or device that no
  rule foresaw may run faster under another plan. This times each
  candidate on the caller's own function and arguments, on the backend
  that runs them, as cuDNN and XLA time their algorithms. Each candidate is
  compiled (``jax.jit(fn, static_argnums=0)``), called once for its results
  and once more to warm up; then `repeats` rounds run every matching
  candidate once, in an order shuffled each round (with a fixed seed),
  waiting for each with `jax.block_until_ready`. The plan with the least
  median time wins; a tie goes to the earlier candidate.

  The first candidate is the reference. A candidate whose results differ
  from the reference's (another tree structure, another shape, or values
  beyond `rtol` and `atol`) is never chosen, nor one whose tracing raises
  `TypeError` or `ValueError` (a plan the step does not support, such as
  ``hoist=True`` for a cell that is not separable). Any other error, and
  any error of the reference, propagates.

  Args:
    fn: ``fn(plan, *example_args)``, returning a pytree of arrays (a loss
      and its gradients, a layer's outputs). It runs its loops under
      `plan`: ``jaxlod.ops.dynamic_rnn(..., plan=plan)`` or a layer's
      `plan` attribute (``jaxlod.nn.RNN(cell, plan=plan)``).
    *example_args: the arguments to time `fn` on (parameters, a batch):
      pytrees of arrays and LoDTensors of the capacities it will run on.
    candidates: the plans to try, the reference first; duplicates are
      tried once. `None`: `default_plan()` of `jax.default_backend()`,
      then `LoopPlan()`, ``LoopPlan(bodies=1)``, ``LoopPlan(bodies=2)``,
      ``LoopPlan(bodies=4)``, ``LoopPlan(bodies=1, chunk=8)`` and
      ``LoopPlan(hoist=True)``, and on a GPU or TPU also
      ``LoopPlan(bodies=1, chunk=8, hoist=True)`` and
      ``LoopPlan(fused=True)`` (not on a CPU, where the fused kernel runs
      in Pallas's interpret mode).
    repeats: the timed rounds, at least 1.
    rtol, atol: how far a candidate's results may be from the reference's:
      each value within ``atol + rtol * scale``, ``scale`` the largest
      magnitude of its leaf in the reference's results (another batch
      size or a hoisted product rounds differently in float32), and NaN
      exactly where the reference has NaN.

  Returns:
    The fastest candidate whose results match the reference's (the
    reference at least).

  Raises:
    TypeError: for an `fn` that is not callable, `candidates` that are not
      a sequence of `jaxlod.ops.LoopPlan`, a `repeats` that is not an int
      or `rtol` or `atol` that is not a float.
    ValueError: for empty `candidates`, `repeats` below 1, or `rtol` or
      `atol` below 0 (or NaN).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import LoopPlan, dynamic_rnn, tune_plan
    >>> x = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((1, 2))], dtype="f4")
    >>> def loss(plan, w, x):
    ...   def step(h, x_t, _):
    ...     h = jnp.tanh(x_t @ w + h)
    ...     return h, h
    ...   h = dynamic_rnn(step, x, init_carry=jnp.zeros((2, 2)), plan=plan)[1]
    ...   return jnp.sum(h**2)
    >>> plans = (LoopPlan(), LoopPlan(bodies=1))
    >>> step = jax.value_and_grad(loss, argnums=1)
    >>> plan = tune_plan(step, jnp.eye(2), x, candidates=plans, repeats=2)
    >>> plan in plans
    True
  """
  check_callable(fn, "fn")
  plans = _check_candidates(candidates)
  repeats = static_int(repeats, "repeats", 1, device=False)
  rtol, atol = _tolerance(rtol, "rtol"), _tolerance(atol, "atol")
  runs = _matching_runs(jax.jit(fn, static_argnums=0), plans, example_args, rtol, atol)
  medians = _median_times(list(runs.values()), example_args, repeats)
  fastest = min(range(len(medians)), key=lambda i: (medians[i], i))
  return list(runs)[fastest]


def _check_candidates(candidates: Any) -> tuple[LoopPlan, ...]:
  """`candidates` as a tuple of distinct plans, or the backend's defaults."""
  if candidates is None:
    return default_candidates()
  plans = check_sequence(candidates, "candidates", "a sequence of jaxlod.ops.LoopPlan")
  if not plans:
    raise ValueError(
      "Expected `candidates` to hold at least one LoopPlan, got "
      f"{value_text(candidates)}."
    )
  for i, plan in enumerate(plans):
    if not isinstance(plan, LoopPlan):
      raise TypeError(
        f"Expected each of `candidates` to be a jaxlod.ops.LoopPlan, got "
        f"{value_text(plan)} at index {i}."
      )
  return tuple(dict.fromkeys(plans))


def _tolerance(value: Any, name: str) -> float:
  """A tolerance of `numpy.allclose`: a static float >= 0."""
  value = static_float(value, name)
  if not value >= 0:
    raise ValueError(f"Expected `{name}` >= 0, got {value}.")
  return value


def _matching_runs(
  jitted: Any,
  plans: tuple[LoopPlan, ...],
  args: tuple[Any, ...],
  rtol: float,
  atol: float,
) -> dict[LoopPlan, Any]:
  """The compiled `jitted` of each plan whose results match the first plan's,
  in the order of `plans`, each called twice (its results, then a warm-up).

  A plan whose tracing raises `TypeError` or `ValueError` is left out,
  except the first, whose error propagates."""
  runs, reference = {}, None
  for plan in plans:
    try:
      lowered = jitted.lower(plan, *args)
    except (TypeError, ValueError):
      if reference is None:
        raise
      continue
    compiled = lowered.compile()
    results = jax.block_until_ready(compiled(*args))
    if reference is None:
      reference = results
    elif not _same_results(reference, results, rtol, atol):
      continue
    jax.block_until_ready(compiled(*args))
    runs[plan] = compiled
  return runs


def _same_results(reference: Any, results: Any, rtol: float, atol: float) -> bool:
  """Whether `results` has the tree structure and shapes of `reference`, NaN
  where it has NaN, and elsewhere values within ``atol + rtol * scale`` of
  it, ``scale`` the leaf's largest magnitude in `reference`."""
  if jax.tree.structure(results) != jax.tree.structure(reference):
    return False
  pairs = zip(jax.tree.leaves(reference), jax.tree.leaves(results), strict=True)
  for want, got in pairs:
    want, got = _host(want), _host(got)
    if want.shape != got.shape:
      return False
    nan = np.isnan(want)
    if not np.array_equal(nan, np.isnan(got)):
      return False
    want, got = want[~nan], got[~nan]
    diff = np.where(got == want, 0.0, np.abs(got - want))
    scale = np.max(np.abs(want), initial=0.0)
    if not np.all(diff <= atol + rtol * scale):
      return False
  return True


def _host(leaf: Any) -> np.ndarray:
  """A result leaf as a float64 NumPy array: a PRNG key as its raw data."""
  if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)
  return np.asarray(leaf).astype(np.float64)


def _median_times(runs: list[Any], args: tuple[Any, ...], repeats: int) -> list[float]:
  """The median wall time of each run over `repeats` rounds, each round
  running every one once in a shuffled order (the same on every call)."""
  shuffle = random.Random(0).shuffle
  times: list[list[float]] = [[] for _ in runs]
  order = list(range(len(runs)))
  for _ in range(repeats):
    shuffle(order)
    for i in order:
      start = time.perf_counter()
      jax.block_until_ready(runs[i](*args))
      times[i].append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]
