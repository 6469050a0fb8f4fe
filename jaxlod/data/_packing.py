"""Host-side packing shared by `Batcher` and `LoDBatchDataset`.

One home for jaxlod's batching policy: checking examples and capacities,
packing a field's rows, cutting sorted windows into batches under the
capacities and the token budget, dealing batches to shards, and building a
batch's LoDTensors and rank tables with NumPy.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxlod._buckets import Buckets
from jaxlod._host import host_array
from jaxlod._lod import LoDTensor
from jaxlod.data._batch_checks import check_field_dtypes, check_field_fits_device
from jaxlod.ops._rank import RankTable, rank_table


class Batch(NamedTuple):
  """One batch of a `Batcher` or a `LoDBatchDataset`: F fields, with tables.

  With ``shards``, every field and table holds the L shards this pipeline
  builds (the `Batcher`'s local shards), stacked on a new leading axis:
  shard ``s`` is ``jax.tree.map(lambda a: a[s], fields[f])``, a LoDTensor on
  the field's capacities, and ``np.asarray(fields[0].num_outer)`` gives the
  number of examples of each shard.

  Attributes:
    fields: F one-level LoDTensors, one per field. Field ``f`` holds the
      batch's examples' field ``f`` in the order of `indices`: values
      ``[token_capacity_f, *features_f]`` in the examples' dtype, on the
      fixed capacities of the field's `Buckets`. With shards: values
      ``[L, token_capacity_f, *features_f]``, offsets
      ``[L, count_capacity_f + 1]`` and num_outer ``[L]``.
    tables: F entries: ``rank_table(fields[f], ladder=ladder)``, or `None`
      for a field that ``tables`` leaves out. With shards, each shard's
      table, stacked the same way.
    indices: int64 ``[n]``, the example indices of the batch, in field order;
      with shards, the shards' examples one shard after another. A
      `LoDBatchDataset` gives positions in its parent.
    epoch: the epoch of the batch.
    step: the batch's position in the stream of all epochs, counted from the
      first batch of epoch 0 (of this iterator's stream, for a
      `LoDBatchDataset`).
    num_tokens: real rows summed over the fields (padding excluded), of all
      the shards with shards.
  """

  fields: tuple[LoDTensor, ...]
  tables: tuple[RankTable | None, ...]
  indices: np.ndarray
  epoch: int
  step: int
  num_tokens: int


@dataclasses.dataclass(frozen=True)
class Field:
  """Every example's rows of one field, packed, and the field's capacities.

  Attributes:
    values: ``[total_rows, *features]``, example ``i``'s rows are
      ``values[starts[i]:starts[i + 1]]``.
    starts: int64 ``[num_examples + 1]``.
    tokens: the fixed token capacity.
    sequences: the fixed count capacity (LoD level 0).
    time: the fixed time capacity (LoD level 0).
  """

  values: np.ndarray
  starts: np.ndarray
  tokens: int
  sequences: int
  time: int

  def pack(self, indices: np.ndarray) -> LoDTensor:
    """The examples `indices` of this field as a LoDTensor of NumPy arrays."""
    starts, stops = self.starts[indices], self.starts[indices + 1]
    lengths = stops - starts
    offsets = np.zeros(self.sequences + 1, np.int32)
    offsets[1 : indices.size + 1] = np.cumsum(lengths)
    offsets[indices.size + 1 :] = offsets[indices.size]
    rows = int(offsets[indices.size])
    gather = np.arange(rows) + np.repeat(starts - offsets[: indices.size], lengths)
    values = np.zeros((self.tokens, *self.values.shape[1:]), self.values.dtype)
    values[:rows] = self.values[gather]
    return LoDTensor(
      values, (offsets,), np.asarray(indices.size, np.int32), (self.time,)
    )


def field_buckets(buckets: Any, num_fields: int) -> list[Buckets]:
  """One `Buckets.fixed` per field, checked."""
  if isinstance(buckets, Buckets):
    named = [("buckets", buckets)] * num_fields
  elif isinstance(buckets, Sequence) and not isinstance(buckets, str):
    if len(buckets) != num_fields:
      raise ValueError(
        f"Expected one Buckets per field ({num_fields}) in `buckets`, got "
        f"{len(buckets)}."
      )
    named = [(f"buckets[{f}]", b) for f, b in enumerate(buckets)]
  else:
    raise TypeError(
      f"Expected `buckets` to be a Buckets or a sequence of them, got {buckets!r}."
    )
  for name, b in named:
    if not isinstance(b, Buckets):
      raise TypeError(f"Expected `{name}` to be a Buckets, got {b!r}.")
    if b.policy != "fixed":
      raise ValueError(
        f"Expected `{name}` to be Buckets.fixed(...), so that every batch has "
        f"the same capacities and a jitted step compiles once; got policy "
        f"{b.policy!r}."
      )
    if b.capacity(0, "sequences") < 1:
      raise ValueError(
        f"Expected `{name}` to hold at least one sequence, got a sequences "
        "capacity of 0."
      )
  return [b for _, b in named]


def as_arrays(
  examples: Sequence[Any], names: Sequence[int] | None = None
) -> list[list[np.ndarray]]:
  """The examples as F lists of arrays (one list per field), checked.

  Errors name example ``i`` as ``names[i]`` (by default ``i``).
  """
  if (
    isinstance(examples, str | bytes)
    or not hasattr(examples, "__len__")
    or not hasattr(examples, "__getitem__")
  ):
    raise TypeError(
      f"Expected `examples` to be a sequence of examples, got "
      f"{type(examples).__name__}."
    )
  if len(examples) == 0:
    raise ValueError("Expected `examples` to hold at least one example, got none.")
  name = _namer(names)
  columns = None
  for i in range(len(examples)):
    example = examples[i]
    if not isinstance(example, tuple | list):
      raise TypeError(
        f"Expected example {name(i)} to be a tuple of fields, got "
        f"{type(example).__name__} (`examples[{i}]`)."
      )
    if columns is None:
      if not example:
        raise ValueError(
          f"Expected example {name(0)} to have at least one field, got none."
        )
      columns = [[] for _ in example]
    if len(example) != len(columns):
      raise ValueError(
        f"Expected every example to have {len(columns)} fields like example "
        f"{name(0)}, got {len(example)} in example {name(i)}."
      )
    for f, (column, value) in enumerate(zip(columns, example, strict=True)):
      try:
        column.append(host_array(value, f"examples[{i}][{f}]"))
      except ValueError as error:
        raise ValueError(f"Field {f} of example {name(i)}: {error}") from None
  return columns


def _namer(names: Sequence[int] | None):
  """Example ``i``'s name in errors: ``names[i]``, or ``i``."""
  if names is None:
    return lambda i: i
  return lambda i: int(names[i])


def pack_field(
  f: int, arrays: list[np.ndarray], buckets: Buckets, names: Sequence[int] | None = None
) -> Field:
  """Field `f` of every example in one array, after checking ranks and dtypes.

  Errors name example ``i`` as ``names[i]`` (by default ``i``).
  """
  name = _namer(names)
  for i, a in enumerate(arrays):
    if a.ndim == 0:
      raise ValueError(
        f"Expected field {f} of example {name(i)} to have rank >= 1 ([length, "
        f"*features]), got a scalar (`examples[{i}][{f}]`)."
      )
  nonempty = [i for i, a in enumerate(arrays) if a.shape[0] > 0]
  first = nonempty[0] if nonempty else 0
  features = arrays[first].shape[1:]
  for i in nonempty:
    if arrays[i].shape[1:] != features:
      raise ValueError(
        f"Expected field {f} of example {name(i)} to have feature shape "
        f"{features} like example {name(first)}, got {arrays[i].shape[1:]}."
      )
  check_field_dtypes(f, arrays, nonempty, name)
  dtypes = {arrays[i].dtype for i in nonempty} or {arrays[first].dtype}
  dtype = np.result_type(*dtypes)
  if dtype.kind not in "biufc":
    raise TypeError(
      f"Expected field {f} to hold numbers, got dtype {dtype} (example "
      f"{name(first)}, `examples[{first}][{f}]`)."
    )
  lengths = np.array([a.shape[0] for a in arrays], np.int64)
  # Explicit lengths: ``-1`` is ambiguous for zero-width features.
  values = np.concatenate([a.reshape((a.shape[0], *features)) for a in arrays], axis=0)
  check_field_fits_device(f, arrays, values, name)
  return Field(
    values=values.astype(dtype, copy=False),
    starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    tokens=buckets.capacity(0, "tokens"),
    sequences=buckets.capacity(0, "sequences"),
    time=buckets.capacity(0, "time"),
  )


def check_examples_fit(
  lengths: np.ndarray,
  fields: list[Field],
  budget: int,
  names: Sequence[int] | None = None,
) -> None:
  """Raises for the first example that no batch can hold.

  Args:
    lengths: int ``[n_examples, F]``, each example's length in each field.
    fields: the F fields, for their capacities.
    budget: the token budget.
    names: example ``i``'s name in errors (by default ``i``).
  """
  time = np.array([field.time for field in fields])
  tokens = np.array([field.tokens for field in fields])
  costs = lengths.max(axis=1)
  over_time, over_tokens = lengths > time, lengths > tokens
  over = over_time.any(axis=1) | over_tokens.any(axis=1) | (costs > budget)
  bad = np.flatnonzero(over)
  if not bad.size:
    return
  i = int(bad[0])
  name = _namer(names)(i)
  for over, limit, caps in ((over_time, "time", time), (over_tokens, "token", tokens)):
    for f in np.flatnonzero(over[i]):
      raise ValueError(
        f"Example {name} has length {lengths[i, f]} in field {f}, more than its "
        f"{limit} capacity {caps[f]}."
      )
  raise ValueError(
    f"Example {name} has cost {costs[i]} (its longest field), more than the token "
    f"budget {budget}."
  )


def greedy_batches(
  order: np.ndarray, weights: np.ndarray, limits: np.ndarray, count: int, window: int
) -> list[np.ndarray]:
  """Cuts `order` into batches greedily, never across a window boundary.

  Args:
    order: int64 ``[n]`` example indices in packing order.
    weights: ``[n_examples, K]`` non-negative sizes of each example.
    limits: ``[K]``, the largest sum of each size in a batch; every example
      fits alone.
    count: the most examples in a batch.
    window: batches hold examples of one window ``order[w * window:(w + 1) *
      window]``.

  Returns:
    The batches, in order: a new one starts when the next example would take
    any sum over its limit, the count over `count`, or cross a window.
  """
  n = order.size
  cums = np.zeros((weights.shape[1], n + 1), np.int64)
  cums[:, 1:] = np.cumsum(weights[order], axis=0).T
  batches, start = [], 0
  while start < n:
    stop = min(start + count, (start // window + 1) * window, n)
    for k in range(cums.shape[0]):
      fits = np.searchsorted(cums[k], cums[k, start] + limits[k], side="right") - 1
      stop = min(stop, int(fits))
    batches.append(order[start:stop])
    start = stop
  return batches


class _Deal:
  """A global batch dealt to shards, each example to the least-loaded with room.

  The load of a shard is its summed cost. Ties go to the shard with fewer
  examples, then to the lower index, so an empty shard is always taken
  first: a global batch of at least `shards` examples leaves none empty.
  """

  def __init__(self, shards: int, limits: list[int], count: int):
    self.limits, self.count = limits, count
    self.sums = [[0] * len(limits) for _ in range(shards)]
    self.members: list[list[int]] = [[] for _ in range(shards)]
    # (summed cost, examples, shard) of the shards below the count capacity;
    # the cost is the last weight. Sorted, hence already a heap.
    self._heap = [(0, 0, s) for s in range(shards)]

  def add(self, i: int, weight: list[int]) -> bool:
    """Deals example `i` of sizes `weight`; False if no shard has room."""
    skipped, shard = [], None
    while self._heap:
      key = heapq.heappop(self._heap)
      sums = self.sums[key[2]]
      if all(a + b <= c for a, b, c in zip(sums, weight, self.limits, strict=True)):
        shard = key[2]
        break
      skipped.append(key)
    for key in skipped:
      heapq.heappush(self._heap, key)
    if shard is None:
      return False
    sums, members = self.sums[shard], self.members[shard]
    for k, w in enumerate(weight):
      sums[k] += w
    members.append(i)
    if len(members) < self.count:
      heapq.heappush(self._heap, (sums[-1], len(members), shard))
    return True

  def peak(self) -> int:
    """The largest summed cost of a shard."""
    return max(sums[-1] for sums in self.sums)


def _redeal(
  deal: _Deal, batch: list[int], weights: list[list[int]]
) -> list[np.ndarray]:
  """The shards of a finished global batch, re-dealt by LPT where it fits.

  Args:
    deal: the incremental dealing of the global batch.
    batch: the global batch's examples, in plan order.
    weights: every example's sizes, cost last.

  Returns:
    One int64 array per shard: its examples, in plan order. LPT deals the
    examples in descending cost (ties in plan order), each to the least-loaded
    shard with room; it is kept when every example finds room and its most
    loaded shard costs no more than that of `deal`, which fits by
    construction.
  """
  position = {i: p for p, i in enumerate(batch)}
  lpt = _Deal(len(deal.members), deal.limits, deal.count)
  descending = sorted(batch, key=lambda i: (-weights[i][-1], position[i]))
  if all(lpt.add(i, weights[i]) for i in descending) and lpt.peak() <= deal.peak():
    deal = lpt
  return [
    np.array(sorted(shard, key=position.__getitem__), np.int64)
    for shard in deal.members
  ]


def _cut(
  part: list[int],
  weights: list[list[int]],
  limits: list[int],
  count: int,
  shards: int,
  cap: float | None = None,
) -> list[tuple[_Deal, list[int]]]:
  """One window's examples cut into global batches, each dealt as it grows.

  Each example goes, in turn, to the least-loaded shard with room
  (`_Deal`); a new global batch starts when no shard has room or, with a
  `cap`, when the batch's summed cost would pass it.
  """
  batches, batch, deal, total = [], [], _Deal(shards, limits, count), 0
  for i in part:
    cost = weights[i][-1]
    full = cap is not None and total + cost > cap
    if batch and (full or not deal.add(i, weights[i])):
      batches.append((deal, batch))
      batch, deal, total = [], _Deal(shards, limits, count), 0
    if not batch:
      deal.add(i, weights[i])
    batch.append(i)
    total += cost
  if batch:
    batches.append((deal, batch))
  return batches


# Slack over an even share of a window's cost, tried in turn (see
# `sharded_batches`).
_EVEN_SLACK = (0.01, 0.03, 0.1, 0.3)


def sharded_batches(
  order: np.ndarray,
  weights: np.ndarray,
  limits: np.ndarray,
  count: int,
  window: int,
  shards: int,
) -> list[list[np.ndarray]]:
  """Cuts `order` into global batches dealt to shards, never across a window.

  Args:
    order: int64 ``[n]`` example indices in packing order.
    weights: ``[n_examples, K]`` non-negative sizes of each example, its cost
      last.
    limits: ``[K]``, the largest sum of each size in a shard; every example
      fits alone.
    count: the most examples in a shard.
    window: global batches hold examples of one window ``order[w * window:(w
      + 1) * window]``.
    shards: the number of shards of a global batch.

  Returns:
    The global batches, in order, each as `shards` int64 arrays (see
    `_redeal`). Each window is cut greedily (`_cut`) into k global batches;
    with several shards it is then cut again with a cap of an even share of
    its cost (plus `_EVEN_SLACK`), kept when that needs no more than k
    batches, so that the window's last batch is not a small remainder whose
    few examples no dealing can balance.
  """
  weights, limits = weights.tolist(), limits.tolist()
  batches = []
  for start in range(0, order.size, window):
    part = order[start : start + window].tolist()
    cut = _cut(part, weights, limits, count, shards)
    if shards > 1 and len(cut) > 1:
      share = sum(weights[i][-1] for i in part) / len(cut)
      for slack in _EVEN_SLACK:
        even = _cut(part, weights, limits, count, shards, share * (1 + slack))
        if len(even) <= len(cut):
          cut = even
          break
    batches += [_redeal(deal, batch, weights) for deal, batch in cut]
  return batches


def plan_batches(
  order: np.ndarray,
  lengths: np.ndarray,
  fields: Sequence[Field],
  token_budget: int,
  window: int,
  shards: int | None,
) -> list[list[np.ndarray]]:
  """Sorts each window of `order` by cost and cuts it into batches.

  An example's cost is its longest field. Each run of `window` examples of
  `order` is sorted by cost (stable), then cut greedily, in that order: a
  new batch starts when the next example would take a field over its token
  or sequence capacity or the batch's cost over `token_budget`
  (`greedy_batches`), or with `shards`, when no shard has room for it
  (`sharded_batches`).

  Args:
    order: int64 ``[n]`` example indices, in the epoch's order.
    lengths: int ``[n_examples, F]``, each example's length in each field;
      every example fits alone (`check_examples_fit`).
    fields: the F fields, for their capacities.
    token_budget: the largest sum of costs in a batch (in a shard).
    window: examples per sorting window, >= 1.
    shards: the number of shards of a batch, or `None`.

  Returns:
    Per batch, in order, one int64 array of example indices per shard (one
    array without shards).
  """
  costs = lengths.max(axis=1)
  windows = np.arange(order.size) // window
  order = order[np.lexsort((costs[order], windows))]
  weights = np.concatenate([lengths, costs[:, None]], axis=1)
  limits = np.array([f.tokens for f in fields] + [token_budget])
  count = min(f.sequences for f in fields)
  if shards is None:
    return [[b] for b in greedy_batches(order, weights, limits, count, window)]
  return sharded_batches(order, weights, limits, count, window, shards)


def _pack(
  fields: Sequence[Field],
  ladders: Sequence[tuple[int, ...]],
  tables: Sequence[bool],
  indices: np.ndarray,
) -> tuple[tuple[LoDTensor, ...], tuple[RankTable | None, ...]]:
  """The fields and tables of one (unsharded) batch or shard."""
  packed = tuple(field.pack(indices) for field in fields)
  ranked = tuple(
    rank_table(x, ladder=ladder) if keep else None
    for x, ladder, keep in zip(packed, ladders, tables, strict=True)
  )
  return packed, ranked


def build_batch(
  fields: Sequence[Field],
  ladders: Sequence[tuple[int, ...]],
  tables: Sequence[bool],
  indices: np.ndarray | Sequence[np.ndarray],
  epoch: int,
  step: int,
  names: np.ndarray | None = None,
) -> Batch:
  """A `Batch` of NumPy arrays: its LoDTensors, rank tables and indices.

  Args:
    fields: the F fields of the examples.
    ladders: each field's rank-table ladder.
    tables: whether to build each field's rank table.
    indices: an int64 array of examples; or, for a sharded batch, one such
      array per shard, packed each on its own and stacked on a new leading
      axis.
    epoch: ``Batch.epoch``.
    step: ``Batch.step``.
    names: ``Batch.indices`` holds ``names[i]`` for example ``i`` (by default
      ``i``).
  """
  if isinstance(indices, np.ndarray):
    packed, ranked = _pack(fields, ladders, tables, indices)
  else:
    packed, ranked = jax.tree.map(
      lambda *a: np.stack(a),
      *[_pack(fields, ladders, tables, shard) for shard in indices],
    )
    indices = np.concatenate(indices)
  num_tokens = sum(
    int(np.sum(f.starts[indices + 1] - f.starts[indices])) for f in fields
  )
  if names is not None:
    indices = names[indices]
  return Batch(packed, ranked, indices, epoch, step, num_tokens)
