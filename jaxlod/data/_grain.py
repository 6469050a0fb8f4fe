"""Grain pipelines of LoDTensor batches: `LoDBatchDataset` (``jaxlod[grain]``)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from jaxlod._buckets import Buckets
from jaxlod.data._batch_checks import check_int, check_tables
from jaxlod.data._packing import (
  Batch,
  Field,
  as_arrays,
  build_batch,
  check_examples_fit,
  field_buckets,
  pack_field,
  plan_batches,
)
from jaxlod.ops._rank import normalize_ladder

_MAP_STATE = ("epoch", "window", "batch", "step")
_STREAM_STATE = ("parent", "start", "window", "batch", "step")


@dataclasses.dataclass(frozen=True)
class _Window:
  """One window's examples, packed, and its batches.

  Attributes:
    fields: the window's examples' F fields (example ``i`` of the window is
      row ``i`` of each).
    ladders: each field's rank-table ladder.
    tables: whether to build each field's rank table.
    plan: per batch, one int64 array of the window's examples per shard.
    names: int64 ``[n]``, each example's index for ``Batch.indices``.
  """

  fields: tuple[Field, ...] = ()
  ladders: tuple[tuple[int, ...], ...] = ()
  tables: tuple[bool, ...] = ()
  plan: tuple[list[np.ndarray], ...] = ()
  names: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, int))


@dataclasses.dataclass(frozen=True)
class _Policy:
  """The settings of a `LoDBatchDataset`, checked, and its window planning."""

  buckets: Buckets | tuple[Buckets, ...]
  token_budget: int
  window: int
  shuffle: bool
  seed: int
  ladder: tuple[int, ...] | None
  tables: bool | tuple[bool, ...]
  shards: int | None

  def plan(self, examples: list[Any], names: np.ndarray, key: Sequence[int]) -> _Window:
    """The batches of one window of `examples`, named `names` in errors.

    Args:
      examples: the window's examples, in the epoch's order.
      names: int64 ``[n]``, each example's index in errors and in
        ``Batch.indices``.
      key: ``(epoch, window)``, which seeds the shuffling of the batches.

    Returns:
      A `_Window`; its plan cuts the examples, sorted by cost, as the
      `Batcher` cuts a window (`plan_batches`), its batches shuffled by
      ``np.random.default_rng([seed, *key])`` with `shuffle`.
    """
    if not examples:
      return _Window()
    columns = as_arrays(examples, names)
    per_field = field_buckets(self.buckets, len(columns))
    fields = tuple(
      pack_field(f, arrays, b, names)
      for f, (arrays, b) in enumerate(zip(columns, per_field, strict=True))
    )
    tables = check_tables(self.tables, len(fields))
    ladders = tuple(normalize_ladder(f.sequences, self.ladder) for f in fields)
    lengths = np.stack([np.diff(f.starts) for f in fields], axis=1)
    check_examples_fit(lengths, list(fields), self.token_budget, names)
    order = np.arange(len(examples))
    plan = plan_batches(
      order, lengths, fields, self.token_budget, order.size, self.shards
    )
    if self.shuffle:
      rng = np.random.default_rng([self.seed, *key])
      plan = [plan[j] for j in rng.permutation(len(plan))]
    return _Window(fields, ladders, tables, tuple(plan), names)

  def build(self, window: _Window, j: int, epoch: int, step: int) -> Batch:
    """Batch `j` of `window`."""
    shards = window.plan[j]
    indices = shards[0] if self.shards is None else shards
    return build_batch(
      window.fields, window.ladders, window.tables, indices, epoch, step, window.names
    )


class _Examples(grain.MapDataset):
  """The examples a `LoDBatchDataset` batches: all of its parent's, or the
  slice that `mp_prefetch` gives a worker process (set in place).

  Index ``e * len(self) + i`` reads example ``positions[i]`` of the parent in
  epoch ``e``, that is ``parent[e * len(parent) + positions[i]]``, as Grain
  numbers the elements of later epochs.
  """

  def __init__(self, parent: grain.MapDataset):
    super().__init__(parent)
    self.source = parent
    self.positions = range(len(parent))

  def __len__(self) -> int:
    return len(self.positions)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, i = divmod(index, len(self.positions))
    return self.source[epoch * len(self.source) + self.positions[i]]

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    """Keeps the examples of slice `sl` (``slice(w, None, W)`` for worker `w`
    of `W`), or with `sequential_slice` the `w`-th of `W` consecutive runs."""
    if not sequential_slice:
      self.positions = self.positions[sl]
      return
    index, count = sl.start, sl.step
    size, extra = divmod(len(self.positions), count)
    start = index * size + min(index, extra)
    self.positions = self.positions[start : start + size + (index < extra)]

  def __str__(self) -> str:
    return f"LoDBatchDataset examples ({len(self.positions)})"


class LoDBatchDataset(grain.IterDataset):
  """A Grain dataset of `Batch` elements: jaxlod's batching policy over a Grain dataset.

  The same policy as the `Batcher`: examples of similar length, packed
  greedily under the token budget on fixed capacities, their LoDTensors
  and rank tables built with NumPy. Each element is a `Batch` of NumPy
  arrays (place it with ``jax.device_put`` or
  `jaxlod.parallel.shard_batch`).

  Over a ``grain.MapDataset`` (one epoch is its ``len(parent)`` examples),
  epoch ``e`` permutes the examples with ``np.random.default_rng([seed,
  e])``, cuts the permutation into windows of `window` examples, reads each
  window's examples (``parent[e * len(parent) + i]``, Grain's numbering of
  later epochs, so that random maps differ per epoch), sorts them by cost
  (stable; the cost is the longest field) and cuts them greedily into
  batches, exactly as the `Batcher` does: with the same examples and seed,
  an epoch's batches are those of ``Batcher.plan(e)``. Only their order
  differs: the batches of each window are shuffled among themselves
  (``np.random.default_rng([seed, e, w])`` for window ``w``), not across the
  epoch, so that a window is read once, when its first batch is due, and
  never held longer. Every example appears exactly once per epoch;
  `None` elements (Grain's filtered-out ones) are skipped. The epochs run
  on without end, or for `num_epochs`.

  Over a ``grain.IterDataset``, the windows are runs of `window`
  consecutive elements of the parent's stream, batched the same way; there
  are no epochs (``Batch.epoch`` is 0: repeat or shuffle the parent to have
  them), and the dataset ends with its parent.

  ``Batch.indices`` are positions in the parent (for an ``IterDataset``, in
  its stream); ``Batch.step`` counts the iterator's batches from the first
  of epoch 0.

  The iterator's ``get_state()`` is a small dict: over a ``MapDataset``,
  ``{"epoch", "window", "batch", "step"}`` (the next batch); over an
  ``IterDataset``, the parent's state at the start of the current window
  and the position in it. ``set_state`` reads that window again and goes on
  from there, so Grain's checkpointing (``grain.checkpoint.CheckpointSave``
  / ``CheckpointRestore`` with an Orbax ``CheckpointManager``) restores the
  stream exactly. For several processes, slice the parent first:
  ``parent[jax.process_index()::jax.process_count()]`` gives each process
  its own examples, which together cover every epoch once. With
  ``mp_prefetch``, each worker process batches the slice Grain gives it
  (``parent[w::W]``) and Grain interleaves the workers' batches and
  checkpoints each worker's state.

  Args:
    parent: a ``grain.MapDataset`` or ``grain.IterDataset`` of examples,
      each a tuple of F fields; a field is an array-like ``[length,
      *features]`` whose dtype and feature shape are the same in every
      example, so every batch has the same shapes and dtypes.
    buckets: a `Buckets.fixed` for every field, or a sequence of F of them.
      Level 0 of each gives the field's token, sequence and time capacities.
    token_budget: the largest sum of costs in a batch (in a shard, with
      `shards`); by default the smallest token capacity of the fields.
    window: examples per sorting window, >= 1.
    shuffle: permute the examples of each epoch (over a ``MapDataset``) and
      the batches of each window.
    seed: a non-negative int; the same seed gives the same batches.
    num_epochs: the number of epochs over a ``MapDataset``, >= 1; `None`
      runs without end.
    ladder: static batch sizes of the rank tables' phases (see
      `jaxlod.ops.rank_table`); by default `default_ladder` of each field's
      sequence capacity.
    tables: build the rank tables of every field (True), of none (False),
      or of the fields whose entry of a sequence of F bools is True.
    shards: deal each batch to this many shards (one per local device), as
      the `Batcher` deals a global batch, stacked on a leading axis (see
      `Batch`); `None` builds unsharded batches.

  Raises:
    TypeError: for a parent that is not a Grain dataset, or a setting of the
      wrong type.
    ValueError: for a ``MapDataset`` without examples, `num_epochs` over an
      ``IterDataset``, buckets that are not fixed, or an out-of-range
      setting. While iterating, an example that no batch can hold raises a
      ``ValueError`` naming its index, its length and the limit, as the
      `Batcher` does.

  Example:
    >>> import grain
    >>> from jaxlod import Buckets
    >>> from jaxlod.data import LoDBatchDataset
    >>> examples = [([1] * n, [2] * (n + 1)) for n in (3, 1, 4, 1, 5)]
    >>> batches = LoDBatchDataset(
    ...   grain.MapDataset.source(examples),
    ...   Buckets.fixed(tokens=8, sequences=4, time=6),
    ...   shuffle=False,
    ...   num_epochs=1,
    ... )
    >>> [b.indices.tolist() for b in batches]
    [[1, 3, 0], [2], [4]]
    >>> iterator = iter(batches)
    >>> first = next(iterator)
    >>> first.fields[1].recursive_lengths(), first.num_tokens
    ([[2, 2, 4]], 13)
    >>> iterator.get_state()
    {'epoch': 0, 'window': 0, 'batch': 1, 'step': 1}
    >>> restored = iter(batches)
    >>> restored.set_state(iterator.get_state())
    >>> [b.indices.tolist() for b in restored]
    [[2], [4]]
  """

  def __init__(
    self,
    parent: grain.MapDataset | grain.IterDataset,
    buckets: Buckets | Sequence[Buckets],
    *,
    token_budget: int | None = None,
    window: int = 1024,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = None,
    ladder: Sequence[int] | None = None,
    tables: bool | Sequence[bool] = True,
    shards: int | None = None,
  ):
    """Checks the parent and the settings (see the class docstring) and
    keeps the checked batching policy; a ``MapDataset`` parent is wrapped
    as the examples of its epochs (the slice `mp_prefetch` gives a worker).

    Raises:
      TypeError: for a parent that is not a Grain dataset, or a setting of
        the wrong type.
      ValueError: for an empty or endless ``MapDataset``, `num_epochs` over
        an ``IterDataset``, buckets that are not fixed, or a setting out of
        range.
    """
    if isinstance(parent, grain.MapDataset):
      if len(parent) == 0:
        raise ValueError("Expected `parent` to hold at least one example, got none.")
      if len(parent) == sys.maxsize:
        raise ValueError(
          "Expected `parent` to be a finite grain.MapDataset (one epoch), got an "
          "endless one: repeat with `num_epochs` instead."
        )
      self._is_map = True
      parent = _Examples(parent)
    elif isinstance(parent, grain.IterDataset):
      if num_epochs is not None:
        raise ValueError(
          f"Expected `num_epochs` to be None with a grain.IterDataset parent, got "
          f"{num_epochs!r}: its stream has no epochs; repeat the parent instead."
        )
      self._is_map = False
    else:
      raise TypeError(
        "Expected `parent` to be a grain.MapDataset or grain.IterDataset, got "
        f"{type(parent).__name__}."
      )
    super().__init__(parent)
    if num_epochs is not None:
      num_epochs = check_int("num_epochs", num_epochs, 1)
    self._num_epochs = num_epochs
    self._policy = _checked_policy(
      buckets, token_budget, window, shuffle, seed, ladder, tables, shards
    )

  @property
  def token_budget(self) -> int:
    """The largest sum of example costs in a batch (in a shard, with shards)."""
    return self._policy.token_budget

  def __iter__(self) -> grain.DatasetIterator:
    if self._is_map:
      return _MapIterator(self.parents[0], self._policy, self._num_epochs)
    return _StreamIterator(self.parents[0].__iter__(), self._policy)

  def __str__(self) -> str:
    p = self._policy
    return (
      f"LoDBatchDataset(token_budget={p.token_budget}, window={p.window}, "
      f"shuffle={p.shuffle}, seed={p.seed}, num_epochs={self._num_epochs}, "
      f"shards={p.shards})"
    )


def _checked_policy(
  buckets: Any,
  token_budget: Any,
  window: Any,
  shuffle: Any,
  seed: Any,
  ladder: Any,
  tables: Any,
  shards: Any,
) -> _Policy:
  """The settings of a `LoDBatchDataset`, checked as far as they can be
  without an example (the number of fields is checked on the first window)."""
  sequence = isinstance(buckets, Sequence) and not isinstance(buckets, str)
  known = field_buckets(buckets, len(buckets) if sequence else 1)
  if sequence:
    buckets = tuple(buckets)
  if isinstance(tables, bool | np.bool_):
    tables = bool(tables)
  else:
    count = len(tables) if isinstance(tables, Sequence) else 0
    tables = check_tables(tables, len(buckets) if sequence else count)
  for b in known:
    normalize_ladder(b.capacity(0, "sequences"), ladder)
  if token_budget is None:
    token_budget = min(b.capacity(0, "tokens") for b in known)
  return _Policy(
    buckets=buckets,
    token_budget=check_int("token_budget", token_budget, 1),
    window=check_int("window", window, 1),
    shuffle=bool(shuffle),
    seed=check_int("seed", seed, 0),
    ladder=None if ladder is None else tuple(ladder),
    tables=tables,
    shards=None if shards is None else check_int("shards", shards, 1),
  )


def _check_state(state: Any, keys: Sequence[str]) -> dict[str, Any]:
  """A state of a `LoDBatchDataset` iterator, with its keys and int counts."""
  if not isinstance(state, dict) or set(state) != set(keys):
    got = sorted(state) if isinstance(state, dict) else type(state).__name__
    raise ValueError(
      f"Expected a LoDBatchDataset iterator state with keys {sorted(keys)}, got {got}."
    )
  for key in keys:
    if key != "parent":
      check_int(f"state[{key!r}]", state[key], 0)
  return state


class _MapIterator(grain.DatasetIterator):
  """The batches of a `LoDBatchDataset` over a ``MapDataset``, window by window.

  The state is the next batch's ``(epoch, window, batch)`` and its step.
  """

  def __init__(self, examples: _Examples, policy: _Policy, num_epochs: int | None):
    super().__init__()
    self._examples, self._policy, self._num_epochs = examples, policy, num_epochs
    self._epoch = self._window = self._batch = self._step = 0
    # The permutation of the epoch `_order_epoch`, and the window of `_key`.
    self._order_epoch, self._order = -1, np.zeros(0, np.int64)
    self._key, self._loaded = None, _Window()

  def _windows(self) -> int:
    return -(-len(self._examples) // self._policy.window)

  def _order_of(self, epoch: int) -> np.ndarray:
    if self._order_epoch != epoch:
      n = len(self._examples)
      if self._policy.shuffle:
        self._order = np.random.default_rng([self._policy.seed, epoch]).permutation(n)
      else:
        self._order = np.arange(n)
      self._order_epoch = epoch
    return self._order

  def _load(self) -> _Window:
    """The current window, read and planned once."""
    key = (self._epoch, self._window)
    if self._key != key:
      size, n = self._policy.window, len(self._examples)
      start = self._window * size
      part = self._order_of(self._epoch)[start : start + size]
      examples, names = [], []
      for i in part:
        example = self._examples[self._epoch * n + int(i)]
        if example is not None:
          examples.append(example)
          names.append(self._examples.positions[i])
      self._loaded = self._policy.plan(examples, np.array(names, np.int64), key)
      self._key = key
    return self._loaded

  def __next__(self) -> Batch:
    empty = 0  # Windows passed without a batch: a whole epoch of them ends it.
    while True:
      if self._num_epochs is not None and self._epoch >= self._num_epochs:
        raise StopIteration
      if empty >= self._windows():
        raise StopIteration
      window = self._load()
      if self._batch < len(window.plan):
        break
      empty = 0 if window.plan else empty + 1
      self._window, self._batch = self._window + 1, 0
      if self._window >= self._windows():
        self._epoch, self._window = self._epoch + 1, 0
    batch = self._policy.build(window, self._batch, self._epoch, self._step)
    self._batch += 1
    self._step += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {
      "epoch": self._epoch,
      "window": self._window,
      "batch": self._batch,
      "step": self._step,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    state = _check_state(state, _MAP_STATE)
    self._epoch, self._window = int(state["epoch"]), int(state["window"])
    self._batch, self._step = int(state["batch"]), int(state["step"])

  def __str__(self) -> str:
    return "LoDBatchDatasetIterator"


class _StreamIterator(grain.DatasetIterator):
  """The batches of a `LoDBatchDataset` over an ``IterDataset``, window by
  window of `window` consecutive elements.

  The state is the parent's state at the start of the current window, the
  window's first stream position and index, and the next batch in it.
  """

  def __init__(self, parent: grain.DatasetIterator, policy: _Policy):
    super().__init__(parent)
    self._source, self._policy = parent, policy
    self._parent_state = copy.deepcopy(parent.get_state())
    self._start = self._window = self._batch = self._step = 0
    self._loaded: _Window | None = None
    self._size = 0

  def _load(self) -> _Window | None:
    """The current window, read from the parent and planned once; `None`
    once the parent is exhausted."""
    if self._loaded is None:
      examples = [
        e for e in itertools.islice(self._source, self._policy.window) if e is not None
      ]
      if not examples:
        return None
      names = np.arange(self._start, self._start + len(examples))
      self._loaded = self._policy.plan(examples, names, (0, self._window))
      self._size = len(examples)
    return self._loaded

  def __next__(self) -> Batch:
    while True:
      window = self._load()
      if window is None:
        raise StopIteration
      if self._batch < len(window.plan):
        break
      self._parent_state = copy.deepcopy(self._source.get_state())
      self._start += self._size
      self._window, self._batch, self._loaded = self._window + 1, 0, None
    batch = self._policy.build(window, self._batch, 0, self._step)
    self._batch += 1
    self._step += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {
      "parent": copy.deepcopy(self._parent_state),
      "start": self._start,
      "window": self._window,
      "batch": self._batch,
      "step": self._step,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    state = _check_state(state, _STREAM_STATE)
    self._source.set_state(state["parent"])
    self._parent_state = copy.deepcopy(state["parent"])
    self._start, self._window = int(state["start"]), int(state["window"])
    self._batch, self._step = int(state["batch"]), int(state["step"])
    self._loaded = None

  def __str__(self) -> str:
    return "LoDBatchDatasetIterator"
