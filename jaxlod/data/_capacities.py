"""A capacity planner: padded rows against compiled capacities, on a sample."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxlod._buckets import Buckets
from jaxlod._checks import (
  check_rate,
  check_sequence,
  is_integer_dtype,
  static_float,
  static_int,
)
from jaxlod._host import host_numbers
from jaxlod.data._batch_checks import check_int
from jaxlod.data._batcher import Batcher


class Candidate(NamedTuple):
  """One capacity policy, measured on the sample's batches.

  Attributes:
    name: ``"fixed"``, ``"pow2"`` or ``"geometric(r)"``.
    buckets: one `Buckets` per field. ``"fixed"`` gives `Buckets.fixed` at
      the largest sizes of the sample's batches (what a `Batcher` takes);
      the others map each batch's sizes to a capacity (for
      `LoDTensor.from_sequences` and evaluation).
    token_budget: the batches' token budget (see `Batcher`).
    batch_size: the largest number of examples in a batch.
    batches: the number of batches of one epoch of the sample.
    capacities: distinct capacities (all fields together) over those
      batches: the compilations of a jitted step that takes the batch.
    real_rows: rows of data over the batches and fields.
    padded_rows: rows of padding (token capacity minus real rows) over the
      batches and fields.
  """

  name: str
  buckets: tuple[Buckets, ...]
  token_budget: int
  batch_size: int
  batches: int
  capacities: int
  real_rows: int
  padded_rows: int

  @property
  def padding(self) -> float:
    """The fraction of all rows that are padding."""
    total = self.real_rows + self.padded_rows
    return self.padded_rows / total if total else 0.0


class CapacityPlan(NamedTuple):
  """What `plan_capacities` measured, and its choice; ``str()`` is a table.

  Attributes:
    choice: the candidate with the fewest capacities whose padding is at
      most `max_padding` (the least padding breaks ties, then the larger
      token budget); the least padding when none is.
    candidates: every policy at every token budget, as measured.
    max_padding: the padding the choice may have.
  """

  choice: Candidate
  candidates: tuple[Candidate, ...]
  max_padding: float

  def __str__(self) -> str:
    head = f"{'policy':<16}{'budget':>8}{'batches':>9}{'capacities':>12}{'padded':>9}"
    lines = [head]
    for c in self.candidates:
      mark = "  <- chosen" if c is self.choice else ""
      lines.append(
        f"{c.name:<16}{c.token_budget:>8}{c.batches:>9}{c.capacities:>12}"
        f"{c.padding:>8.1%}{mark}"
      )
    fixed = ", ".join(
      f"field {f}: tokens={b.capacity(0)}, sequences={b.capacity(0, 'sequences')}, "
      f"time={b.capacity(0, 'time')}"
      for f, b in enumerate(self.choice.buckets)
      if b.policy == "fixed"
    )
    budget = f"token_budget={self.choice.token_budget}"
    lines.append(
      f"chosen: {self.choice.name}, {budget}" + (f"; {fixed}" if fixed else "")
    )
    return "\n".join(lines)


def _as_lengths(lengths: Any) -> np.ndarray:
  """``[n, F]`` int64 lengths from one ``[n]`` field or F of them."""
  if isinstance(lengths, Sequence) and lengths and not np.isscalar(lengths[0]):
    fields = [host_numbers(f, f"lengths[{i}]") for i, f in enumerate(lengths)]
    sizes = {f.shape for f in fields}
    if len(sizes) != 1 or any(f.ndim != 1 for f in fields):
      raise ValueError(
        "Expected every field of `lengths` to be 1-D with one length per "
        f"example, got shapes {[f.shape for f in fields]}."
      )
    array = np.stack(fields, axis=1)
  else:
    array = host_numbers(lengths, "lengths")
    if array.ndim != 1:
      raise ValueError(
        f"Expected `lengths` to be [examples] or a list of them, got shape "
        f"{array.shape}."
      )
    array = array[:, None]
  if array.shape[0] == 0:
    raise ValueError("Expected `lengths` of at least one example, got none.")
  if not is_integer_dtype(array.dtype):
    raise TypeError(f"Expected integer `lengths`, got {array.dtype}.")
  if np.any(array < 0):
    i, f = np.argwhere(array < 0)[0]
    raise ValueError(f"Expected `lengths` >= 0, got {array[i, f]} at example {i}.")
  return array.astype(np.int64)


def _batch_sizes(
  lengths: np.ndarray, token_budget: int, batch_size: int, window: int, seed: int
) -> list[np.ndarray]:
  """Each batch's ``[F, 3]`` real sizes (tokens, sequences, longest), as the
  `Batcher` cuts one epoch of the sample."""
  num_fields = lengths.shape[1]
  # Every field's token capacity is the budget, which bounds the sum of the
  # examples' costs (their longest field): only the budget and `batch_size`
  # cut, so one field of the costs gives the plan of all of them.
  costs = lengths.max(axis=1)
  field = Buckets.fixed(
    tokens=token_budget, sequences=batch_size, time=max(int(costs.max()), 1)
  )
  batcher = Batcher(
    [(np.zeros(k, np.int8),) for k in costs],
    field,
    token_budget=token_budget,
    window=window,
    seed=seed,
    prefetch=0,
    tables=False,
    device_put=False,
  )
  sizes = []
  for indices in batcher.plan(0):
    rows = lengths[indices]
    counts = np.full(num_fields, indices.size)
    sizes.append(np.stack([rows.sum(axis=0), counts, rows.max(axis=0)], axis=1))
  return sizes


def _measure(
  name: str, policy: Buckets | None, sizes: list[np.ndarray], budget: int
) -> Candidate:
  """One capacity policy measured on a sample's batches.

  Args:
    name: the candidate's name (``"fixed"``, ``"pow2"``, ``"geometric(r)"``).
    policy: the `Buckets` of every field, or `None` for `Buckets.fixed` at
      the largest sizes of the batches, field by field.
    sizes: per batch, int ``[F, 3]``: each field's tokens, sequences and
      longest sequence (as `_batch_sizes` gives them).
    budget: the batches' token budget.

  Returns:
    The `Candidate`: its buckets, the distinct capacities the batches take
    (all fields together), and the real and padded rows over the batches.

  Raises:
    ValueError: for a size that no capacity of the policy holds, or a
      capacity beyond int32.
  """
  num_fields = sizes[0].shape[0]
  if policy is None:  # fixed, at the largest sizes of the sample's batches
    top = np.max(np.stack(sizes), axis=0)
    buckets = tuple(
      Buckets.fixed(tokens=int(t), sequences=int(s), time=int(m)) for t, s, m in top
    )
  else:
    buckets = (policy,) * num_fields
  kinds = ("tokens", "sequences", "time")
  seen, padded = set(), 0
  for batch in sizes:
    caps = tuple(
      tuple(b.capacity(int(v), kind) for v, kind in zip(field, kinds, strict=True))
      for b, field in zip(buckets, batch, strict=True)
    )
    seen.add(caps)
    padded += sum(c[0] for c in caps) - int(batch[:, 0].sum())
  real = int(sum(int(b[:, 0].sum()) for b in sizes))
  return Candidate(
    name=name,
    buckets=buckets,
    token_budget=budget,
    batch_size=int(max(int(b[0, 1]) for b in sizes)),
    batches=len(sizes),
    capacities=len(seen),
    real_rows=real,
    padded_rows=padded,
  )


def _geometric(ratio: float, name: str) -> Buckets:
  """`Buckets.geometric(ratio)`, its errors naming `name` (``ratios[i]``)."""
  try:
    return Buckets.geometric(ratio)
  except ValueError as error:
    raise ValueError(f"Expected `{name}` to be a geometric ratio: {error}") from None


def _measure_named(policy: tuple, sizes: list[np.ndarray], budget: int) -> Candidate:
  """`_measure`, a capacity beyond int32 named by the argument behind it."""
  name, buckets, argument = policy
  try:
    return _measure(name, buckets, sizes, budget)
  except ValueError as error:
    raise ValueError(
      f"Expected `{argument or 'token_budget'}` to give capacities that fit int32 "
      f"(candidate {name}, token_budget={budget}): {error}"
    ) from None


def plan_capacities(
  lengths: Any,
  *,
  token_budget: int | Sequence[int],
  batch_size: int | None = None,
  ratios: Sequence[float] = (1.1, 1.25, 1.5),
  max_padding: float = 0.2,
  window: int = 1024,
  seed: int = 0,
) -> CapacityPlan:
  """Suggests capacities and a token budget from a sample of lengths.

  Cuts one epoch of the sample into batches as a `Batcher` would (windows
  sorted by length, a greedy cut under the token budget and `batch_size`),
  then measures each policy on those batches: ``"fixed"`` (one capacity,
  sized to the largest batch: one compilation, the most padding where
  batches vary), `Buckets.pow2` and `Buckets.geometric` at each ratio
  (capacities that follow each batch: less padding, more compilations).
  ``print(plan)`` shows both figures for every candidate.

  Args:
    lengths: ``[examples]`` integer lengths of one field, or a list of F
      such arrays (one per field of the examples, e.g. source and target).
    token_budget: the largest sum of an example's longest field over a
      batch (the `Batcher`'s), or several to compare.
    batch_size: the most examples a batch may hold; by default the budget.
    ratios: the growth ratios of the `Buckets.geometric` candidates.
    max_padding: the fraction of padded rows the choice may have, in
      ``[0, 1]``.
    window: examples per sorting window (the `Batcher`'s).
    seed: the shuffling seed (the `Batcher`'s).

  Returns:
    A `CapacityPlan`.

  Raises:
    ValueError: for no examples, negative lengths, fields of different
      sizes, a budget below the longest example or beyond int32 (it is a
      tokens capacity), a ratio `Buckets.geometric` refuses, capacities
      beyond int32 (naming `ratios[i]` or `token_budget`), or an
      out-of-range setting.
    TypeError: for non-integer lengths or settings of the wrong type.

  Example:
    >>> import numpy as np
    >>> from jaxlod.data import plan_capacities
    >>> lengths = np.random.default_rng(0).integers(1, 30, size=500)
    >>> plan = plan_capacities(lengths, token_budget=[128, 256], batch_size=16)
    >>> print(plan)
    policy            budget  batches  capacities   padded
    fixed                128       71           1   13.8%  <- chosen
    pow2                 128       71           7   10.5%
    geometric(1.1)       128       71          18    5.3%
    geometric(1.25)      128       71          16    9.1%
    geometric(1.5)       128       71          10   19.2%
    fixed                256       40           1   23.2%
    pow2                 256       40           8    9.9%
    geometric(1.1)       256       40          20    5.2%
    geometric(1.25)      256       40          17   13.8%
    geometric(1.5)       256       40          12   23.7%
    chosen: fixed, token_budget=128; field 0: tokens=128, sequences=16, time=29
  """
  array = _as_lengths(lengths)
  if isinstance(token_budget, int | np.integer):
    budgets = (token_budget,)
  else:
    budgets = tuple(check_sequence(token_budget, "token_budget", "an int or ints"))
  if not budgets:
    raise ValueError("Expected at least one `token_budget`, got none.")
  longest = int(array.max(initial=0))
  for i, b in enumerate(budgets):
    name = f"token_budget[{i}]" if len(budgets) > 1 else "token_budget"
    static_int(check_int(name, b, 1), name, 1)  # a tokens capacity: int32
    if b < longest:
      raise ValueError(
        f"Expected `token_budget` of at least the longest example ({longest}), got {b}."
      )
  if batch_size is not None:
    check_int("batch_size", batch_size, 1)
  max_padding = check_rate(max_padding, "max_padding")
  check_int("window", window, 1)
  check_int("seed", seed, 0)
  ratios = [
    static_float(r, f"ratios[{i}]")
    for i, r in enumerate(check_sequence(ratios, "ratios", "a sequence of floats"))
  ]
  policies = [("fixed", None, ""), ("pow2", Buckets.pow2(), "")] + [
    (f"geometric({r:g})", _geometric(r, f"ratios[{i}]"), f"ratios[{i}]")
    for i, r in enumerate(ratios)
  ]
  candidates = []
  for budget in budgets:
    sizes = _batch_sizes(array, budget, batch_size or budget, window, seed)
    candidates += [_measure_named(p, sizes, budget) for p in policies]
  within = [c for c in candidates if c.padding <= max_padding]
  if within:
    choice = min(within, key=lambda c: (c.capacities, c.padding, -c.token_budget))
  else:
    choice = min(candidates, key=lambda c: (c.padding, c.capacities))
  return CapacityPlan(choice, tuple(candidates), max_padding)
