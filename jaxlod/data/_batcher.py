"""A host-side batcher: length bucketing under fixed capacities, with prefetch."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxlod._buckets import Buckets
from jaxlod._checks import check_bool, check_int, check_shards, check_tables
from jaxlod._lod import LoDTensor
from jaxlod.data._prefetch import prefetch as _prefetch
from jaxlod.ops._rank import RankTable, normalize_ladder, rank_table

_THREAD_NAME = "jaxlod.data.Batcher"


class Batch(NamedTuple):
  """One batch of a `Batcher`: F fields packed as LoDTensors, with rank tables.

  With the `Batcher`'s ``shards``, every field and table holds this
  process's L local shards stacked on a new leading axis: shard ``s`` is
  ``jax.tree.map(lambda a: a[s], fields[f])``, a LoDTensor on the field's
  capacities, and ``np.asarray(fields[0].num_outer)`` gives the number of
  examples of each local shard.

  Attributes:
    fields: F one-level LoDTensors, one per field. Field ``f`` holds the
      batch's examples' field ``f`` in the order of `indices`: values
      ``[token_capacity_f, *features_f]`` in the examples' dtype, on the
      fixed capacities of the field's `Buckets`. With shards: values
      ``[L, token_capacity_f, *features_f]``, offsets
      ``[L, count_capacity_f + 1]`` and num_outer ``[L]``.
    tables: F entries: ``rank_table(fields[f], ladder=ladder)``, or `None`
      for a field the `Batcher`'s ``tables`` leaves out. With shards, each
      local shard's table, stacked the same way.
    indices: int64 ``[n]``, the example indices of the batch, in field order;
      with shards, the local shards' examples one shard after another.
    epoch: the epoch of the batch.
    step: the batch's position in the stream of all epochs, counted from the
      first batch of epoch 0.
    num_tokens: real rows summed over the fields (padding excluded), of the
      local shards with shards.
  """

  fields: tuple[LoDTensor, ...]
  tables: tuple[RankTable | None, ...]
  indices: np.ndarray
  epoch: int
  step: int
  num_tokens: int


@dataclasses.dataclass(frozen=True)
class _Field:
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


def _field_buckets(buckets: Any, num_fields: int) -> list[Buckets]:
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


def _as_arrays(examples: Sequence[Any]) -> list[list[np.ndarray]]:
  """The examples as F lists of arrays (one list per field), checked."""
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
  columns = None
  for i in range(len(examples)):
    example = examples[i]
    if not isinstance(example, tuple | list):
      raise TypeError(
        f"Expected example {i} to be a tuple of fields, got "
        f"{type(example).__name__} (`examples[{i}]`)."
      )
    if columns is None:
      if not example:
        raise ValueError("Expected example 0 to have at least one field, got none.")
      columns = [[] for _ in example]
    if len(example) != len(columns):
      raise ValueError(
        f"Expected every example to have {len(columns)} fields like example 0, "
        f"got {len(example)} in example {i}."
      )
    for column, value in zip(columns, example, strict=True):
      column.append(np.asarray(value))
  return columns


def _pack_field(f: int, arrays: list[np.ndarray], buckets: Buckets) -> _Field:
  """Field `f` of every example in one array, after checking ranks and dtypes."""
  for i, a in enumerate(arrays):
    if a.ndim == 0:
      raise ValueError(
        f"Expected field {f} of example {i} to have rank >= 1 ([length, "
        f"*features]), got a scalar (`examples[{i}][{f}]`)."
      )
  nonempty = [i for i, a in enumerate(arrays) if a.shape[0] > 0]
  first = nonempty[0] if nonempty else 0
  features = arrays[first].shape[1:]
  for i in nonempty:
    if arrays[i].shape[1:] != features:
      raise ValueError(
        f"Expected field {f} of example {i} to have feature shape {features} "
        f"like example {first}, got {arrays[i].shape[1:]}."
      )
  dtypes = {arrays[i].dtype for i in nonempty} or {arrays[first].dtype}
  dtype = np.result_type(*dtypes)
  if dtype.kind not in "biufc":
    raise TypeError(
      f"Expected field {f} to hold numbers, got dtype {dtype} (example {first}, "
      f"`examples[{first}][{f}]`)."
    )
  lengths = np.array([a.shape[0] for a in arrays], np.int64)
  values = np.concatenate([a.reshape((-1, *features)) for a in arrays], axis=0)
  return _Field(
    values=values.astype(dtype, copy=False),
    starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    tokens=buckets.capacity(0, "tokens"),
    sequences=buckets.capacity(0, "sequences"),
    time=buckets.capacity(0, "time"),
  )


def _check_fits(lengths: np.ndarray, fields: list[_Field], budget: int) -> None:
  """Raises for the first example that no batch can hold."""
  time = np.array([field.time for field in fields])
  tokens = np.array([field.tokens for field in fields])
  costs = lengths.max(axis=1)
  over_time, over_tokens = lengths > time, lengths > tokens
  over = over_time.any(axis=1) | over_tokens.any(axis=1) | (costs > budget)
  bad = np.flatnonzero(over)
  if not bad.size:
    return
  i = int(bad[0])
  for over, limit, caps in ((over_time, "time", time), (over_tokens, "token", tokens)):
    for f in np.flatnonzero(over[i]):
      raise ValueError(
        f"Example {i} has length {lengths[i, f]} in field {f}, more than its "
        f"{limit} capacity {caps[f]}."
      )
  raise ValueError(
    f"Example {i} has cost {costs[i]} (its longest field), more than the token "
    f"budget {budget}."
  )


def _greedy_batches(
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
# `_sharded_batches`).
_EVEN_SLACK = (0.01, 0.03, 0.1, 0.3)


def _sharded_batches(
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


class Batcher:
  """Batches of similar-length examples on fixed capacities, built ahead.

  Each epoch follows a *plan* drawn from ``np.random.default_rng([seed,
  epoch])``: the examples are permuted, cut into windows of `window`
  examples, and each window is sorted by cost (stable; an example's cost is
  the length of its longest field). Each window is then cut greedily, in
  that order, into batches: a new batch starts when the next example would
  take a field over its token or sequence capacity, or the batch's cost
  over `token_budget`. Batches never span two windows. Last, the order of
  the batches is shuffled. With ``shuffle=False`` neither the examples nor
  the batches are permuted (windows are consecutive runs of the given
  order, still sorted by cost) and every epoch has the same plan; use
  ``window=1`` to keep the given order exactly (one example per batch).

  The plan depends only on the examples, the capacities, `token_budget`,
  `window`, `shuffle`, `seed` and the epoch: never on `prefetch` or on the
  step where iteration started, so a run resumed with
  ``iterate(start_step=s)`` sees the batches that an uninterrupted run saw
  from step ``s`` on. Every example appears exactly once per epoch; an
  example that no batch can hold raises at construction.

  Every field's `Buckets` is fixed, so each field's LoDTensor has the same
  shapes in every batch and a jitted step compiles once. Batches are built
  with NumPy (values, offsets, rank tables) on a daemon thread, `prefetch`
  batches ahead, and (with `device_put`) sent to JAX's default device there,
  so the transfer overlaps the step.

  With ``shards=N`` (data parallelism, one shard per device over all
  processes), the capacities and the token budget hold per shard, and the
  plan cuts each window into *global* batches of N shards: each example, in
  plan order, goes to the shard of least summed cost that has room for it,
  and a new global batch starts when none has. A finished global batch is
  then dealt again by LPT (descending cost, each example to the least-loaded
  shard with room) when that fits, so the shards' work, and the time their
  devices' loops take, are nearly equal. No example is dropped, and a shard
  is empty only in a global batch of fewer than N examples. Process ``p`` of
  ``P`` builds its L = N / P shards ``[p * L, (p + 1) * L)`` of each global
  batch, stacked on a new leading axis of every field and table (see
  `Batch`); with the same examples and `seed` in every process, the
  processes follow one plan and an epoch holds every example exactly once
  over all of them. `jaxlod.parallel.shard_batch` places such a batch across
  the devices.

  Args:
    examples: a sequence of examples, each a tuple of F fields; a field is
      an array-like ``[length, *features]`` (for example 1-D token ids).
      Every example has the same F; field ``f`` has one feature shape and
      keeps the examples' dtype (Python ints become int64, which JAX stores
      as int32 unless x64 is on).
    buckets: a `Buckets.fixed` for every field, or a sequence of F of them.
      Level 0 of each gives the field's token, sequence and time capacities.
    token_budget: the largest sum of costs in a batch; by default the
      smallest token capacity of the fields. Caps a batch's work below the
      capacities.
    window: examples per sorting window, >= 1.
    shuffle: permute the examples and the batches in each epoch.
    seed: a non-negative int; the same seed gives the same batches.
    prefetch: batches built ahead on the worker thread; 0 builds them in the
      caller's thread, without a worker.
    ladder: static batch sizes of the rank tables' phases (see `rank_table`);
      by default `default_ladder` of each field's sequence capacity.
    device_put: put each batch's fields and tables on JAX's default device
      (``jax.device_put``) as it is built; False keeps NumPy arrays. By
      default True without `shards` and False with them (True with `shards`
      raises).
    tables: build the rank tables of every field (True), of none (False),
      or of the fields whose entry of a sequence of F bools is True; a
      field left out gets `None` in ``Batch.tables``, and no host work.
    shards: the global number of shards of a batch, an int >= 1 and a
      multiple of `process_count`; `None` builds unsharded batches.
    process_index: this process's index in ``[0, process_count)``; by default
      ``jax.process_index()``. Only with `shards`.
    process_count: the number of processes, each building its own shards; by
      default ``jax.process_count()``. Only with `shards`.

  Raises:
    ValueError: for no examples, examples with differing field counts, a
      field of rank 0 or of differing feature shapes, buckets that are not
      fixed or not one per field, an out-of-range setting, `shards` not a
      multiple of `process_count`, `process_index` or `process_count`
      without `shards`, ``device_put=True`` with `shards`, or an example that
      no batch can hold (naming its index, its length and the limit).
    TypeError: for arguments of the wrong type, or a field of non-numeric
      dtype.

  Example:
    >>> from jaxlod import Buckets
    >>> from jaxlod.data import Batcher
    >>> examples = [([1] * n, [2] * (n + 1)) for n in (3, 1, 4, 1, 5)]
    >>> batcher = Batcher(
    ...   examples, Buckets.fixed(tokens=8, sequences=4, time=6), shuffle=False
    ... )
    >>> [p.tolist() for p in batcher.plan(0)]
    [[1, 3, 0], [2], [4]]
    >>> batch = next(iter(batcher.epoch(0)))
    >>> batch.fields[1].recursive_lengths(), batch.num_tokens
    ([[2, 2, 4]], 13)

    Two shards, as the first of two processes builds them:

    >>> sharded = Batcher(
    ...   examples,
    ...   Buckets.fixed(tokens=8, sequences=4, time=6),
    ...   shuffle=False,
    ...   shards=2,
    ...   process_index=0,
    ...   process_count=2,
    ... )
    >>> [[s.tolist() for s in b] for b in sharded.plan_shards(0)]
    [[[0], [1, 3]], [[4], [2]]]
    >>> batch = next(iter(sharded.epoch(0)))
    >>> batch.indices.tolist(), batch.fields[1].values.shape
    ([0], (1, 8))
    >>> import jax
    >>> jax.tree.map(lambda a: a[0], batch.fields[1]).recursive_lengths()
    [[4]]
  """

  def __init__(
    self,
    examples: Sequence[Sequence[Any]],
    buckets: Buckets | Sequence[Buckets],
    *,
    token_budget: int | None = None,
    window: int = 1024,
    shuffle: bool = True,
    seed: int = 0,
    prefetch: int = 2,
    ladder: Sequence[int] | None = None,
    device_put: bool | None = None,
    tables: bool | Sequence[bool] = True,
    shards: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
  ):
    self._window = check_int("window", window, 1)
    self._prefetch = check_int("prefetch", prefetch, 0)
    self._seed = check_int("seed", seed, 0)
    if token_budget is not None:
      token_budget = check_int("token_budget", token_budget, 1)
    self._shuffle = check_bool(shuffle, "shuffle")
    if device_put is not None:
      check_bool(device_put, "device_put")
    self._shards, self._local = check_shards(shards, process_index, process_count)
    if device_put and shards is not None:
      raise ValueError(
        "Expected `device_put` to be False or None with `shards`, got True: a "
        "sharded batch stacks every local shard on one leading axis; use "
        "jaxlod.parallel.shard_batch to place a sharded batch across devices."
      )
    self._device_put = shards is None if device_put is None else bool(device_put)
    columns = _as_arrays(examples)
    field_buckets = _field_buckets(buckets, len(columns))
    self._fields = [
      _pack_field(f, arrays, b)
      for f, (arrays, b) in enumerate(zip(columns, field_buckets, strict=True))
    ]
    self._ladders = [normalize_ladder(f.sequences, ladder) for f in self._fields]
    self._tables = check_tables(tables, len(self._fields))
    self._lengths = np.stack([np.diff(f.starts) for f in self._fields], axis=1)
    if token_budget is None:
      token_budget = min(f.tokens for f in self._fields)
    self._token_budget = token_budget
    _check_fits(self._lengths, self._fields, token_budget)
    self._costs = self._lengths.max(axis=1)
    self._counts: dict[int, int] = {}

  @property
  def num_examples(self) -> int:
    """The number of examples."""
    return int(self._lengths.shape[0])

  @property
  def token_budget(self) -> int:
    """The largest sum of example costs in a batch (in a shard, with shards)."""
    return self._token_budget

  @property
  def shards(self) -> int | None:
    """The global number of shards of a batch, or `None` without shards."""
    return self._shards

  @property
  def local_shards(self) -> range | None:
    """The shards this process builds, or `None` without shards."""
    return self._local

  def plan(self, epoch: int) -> list[np.ndarray]:
    """The batches of `epoch`, as example indices.

    Args:
      epoch: an int >= 0.

    Returns:
      One int64 ``[n_b]`` array of example indices per batch, in the order
      the epoch yields them; every example appears in exactly one. With
      shards, a batch is global: the examples of all its shards, whatever
      the process, one shard after another (``plan_shards``).
    """
    return [
      shards[0] if len(shards) == 1 else np.concatenate(shards)
      for shards in self.plan_shards(epoch)
    ]

  def plan_shards(self, epoch: int) -> list[list[np.ndarray]]:
    """The batches of `epoch`, as the example indices of each shard.

    Args:
      epoch: an int >= 0.

    Returns:
      Per batch (in the order of `plan`), one int64 ``[n_s]`` array per
      shard, all `shards` of them whatever the process: the examples of
      shard ``s``, in the order they are packed. Without shards, each batch
      is one shard.
    """
    epoch = check_int("epoch", epoch, 0)
    n = self.num_examples
    if self._shuffle:
      rng = np.random.default_rng([self._seed, epoch])
      order = rng.permutation(n)
    else:
      order = np.arange(n)
    windows = np.arange(n) // self._window
    order = order[np.lexsort((self._costs[order], windows))]
    weights = np.concatenate([self._lengths, self._costs[:, None]], axis=1)
    limits = np.array([f.tokens for f in self._fields] + [self._token_budget])
    count = min(f.sequences for f in self._fields)
    if self._shards is None:
      batches = [
        [b] for b in _greedy_batches(order, weights, limits, count, self._window)
      ]
    else:
      batches = _sharded_batches(
        order, weights, limits, count, self._window, self._shards
      )
    if self._shuffle:
      batches = [batches[j] for j in rng.permutation(len(batches))]
    self._counts[epoch] = len(batches)
    return batches

  def batches_per_epoch(self, epoch: int) -> int:
    """``len(plan(epoch))``; with shuffling it may differ across epochs."""
    epoch = check_int("epoch", epoch, 0)
    if not self._shuffle:
      epoch = 0
    if epoch not in self._counts:
      self.plan_shards(epoch)
    return self._counts[epoch]

  def _first_step(self, epoch: int) -> int:
    return sum(self.batches_per_epoch(e) for e in range(epoch))

  def _locate(self, step: int) -> tuple[int, int]:
    """(epoch, batch within the epoch) of a global step."""
    if not self._shuffle:
      return divmod(step, self.batches_per_epoch(0))
    epoch = 0
    while step >= self.batches_per_epoch(epoch):
      step -= self.batches_per_epoch(epoch)
      epoch += 1
    return epoch, step

  def _pack(self, indices: np.ndarray) -> tuple[tuple, tuple]:
    """The fields and tables of one (unsharded) batch or shard."""
    fields = tuple(field.pack(indices) for field in self._fields)
    ladders = self._ladders
    tables = tuple(
      rank_table(x, ladder=ladder) if keep else None
      for x, ladder, keep in zip(fields, ladders, self._tables, strict=True)
    )
    return fields, tables

  def _build(
    self, epoch: int, step: int, indices: np.ndarray | list[np.ndarray]
  ) -> Batch:
    """A batch of example `indices`, or with shards of each local shard's."""
    if self._shards is None:
      fields, tables = self._pack(indices)
    else:
      fields, tables = jax.tree.map(
        lambda *a: np.stack(a), *[self._pack(shard) for shard in indices]
      )
      indices = np.concatenate(indices)
    if self._device_put:
      fields, tables = jax.device_put((fields, tables))
    num_tokens = int(self._lengths[indices].sum())
    return Batch(fields, tables, indices, epoch, step, num_tokens)

  def _epoch_batches(self, epoch: int, first: int, step: int) -> Iterator[Batch]:
    local = self._local
    for shards in self.plan_shards(epoch)[first:]:
      indices = shards[0] if local is None else shards[local.start : local.stop]
      yield self._build(epoch, step, indices)
      step += 1

  def _stream(self, start_step: int) -> Iterator[Batch]:
    epoch, first = self._locate(start_step)
    step = start_step
    while True:
      for batch in self._epoch_batches(epoch, first, step):
        yield batch
        step += 1
      epoch, first = epoch + 1, 0

  def epoch(self, epoch: int) -> Iterator[Batch]:
    """The batches of one epoch, in plan order, built `prefetch` ahead.

    Closing the iterator (``break`` out of the loop, ``close()``, or
    dropping it) stops the worker thread. An error raised while building a
    batch is raised here.

    Args:
      epoch: an int >= 0.
    """
    epoch = check_int("epoch", epoch, 0)
    step = self._first_step(epoch)
    return _prefetch(
      lambda: self._epoch_batches(epoch, 0, step), self._prefetch, _THREAD_NAME
    )

  def iterate(self, start_step: int = 0) -> Iterator[Batch]:
    """Batches of epochs 0, 1, 2, ... without end, from `start_step` on.

    A run that stopped after `s` steps resumes with ``iterate(start_step=s)``:
    the batches are those an uninterrupted run would have yielded next,
    across epoch boundaries. Closing the iterator stops the worker thread.

    Args:
      start_step: batches to skip (they are planned, never built), >= 0.
    """
    start_step = check_int("start_step", start_step, 0)
    return _prefetch(lambda: self._stream(start_step), self._prefetch, _THREAD_NAME)
