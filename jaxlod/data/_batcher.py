"""A host-side batcher: length bucketing under fixed capacities, with prefetch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxlod._buckets import Buckets
from jaxlod._checks import check_bool
from jaxlod.data import _state
from jaxlod.data._batch_checks import check_int, check_shards, check_tables
from jaxlod.data._packing import (
  Batch,
  as_arrays,
  build_batch,
  check_examples_fit,
  field_buckets,
  pack_field,
  plan_batches,
)
from jaxlod.data._prefetch import prefetch as _prefetch
from jaxlod.ops._rank import normalize_ladder

_THREAD_NAME = "jaxlod.data.Batcher"


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
  from step ``s`` on. `get_state` gives the position of the current
  `iterate` iterator as a small JSON-able dict, to save beside a model's
  checkpoint, and `set_state` makes the next `iterate` go on from it. Every
  example appears exactly once per epoch; an example that no batch can hold
  raises at construction.

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
    """Checks the arguments (see the class docstring) and packs every field.

    Each field's examples are packed once on the host, with its buckets and
    rank-table ladder; the token budget defaults to the smallest token
    capacity, and every example is checked to fit a batch.

    Raises:
      TypeError, ValueError: as the class docstring lists.
    """
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
    columns = as_arrays(examples)
    per_field = field_buckets(buckets, len(columns))
    self._fields = [
      pack_field(f, arrays, b)
      for f, (arrays, b) in enumerate(zip(columns, per_field, strict=True))
    ]
    self._ladders = [normalize_ladder(f.sequences, ladder) for f in self._fields]
    self._tables = check_tables(tables, len(self._fields))
    self._lengths = np.stack([np.diff(f.starts) for f in self._fields], axis=1)
    if token_budget is None:
      token_budget = min(f.tokens for f in self._fields)
    self._token_budget = token_budget
    check_examples_fit(self._lengths, self._fields, token_budget)
    self._counts: dict[int, int] = {}
    # The step of the next batch of the iterator served (`get_state`), the
    # iterator (an `iterate` call's token), and whether `set_state` set it
    # for the next `iterate`.
    self._position, self._serving, self._restored = 0, None, False
    self._plan_settings: dict[str, Any] | None = None

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
    batches = plan_batches(
      order, self._lengths, self._fields, self._token_budget, self._window, self._shards
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
    if not self._shuffle:  # every epoch is epoch 0
      return epoch * self.batches_per_epoch(0)
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

  def _build(
    self, epoch: int, step: int, indices: np.ndarray | list[np.ndarray]
  ) -> Batch:
    """A batch of example `indices`, or with shards of each local shard's."""
    batch = build_batch(self._fields, self._ladders, self._tables, indices, epoch, step)
    if self._device_put:
      fields, tables = jax.device_put((batch.fields, batch.tables))
      batch = batch._replace(fields=fields, tables=tables)
    return batch

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
      epoch: an int >= 0. With `shuffle`, the batches' steps count those of
        every earlier epoch, whose plans the host computes first (time grows
        with `epoch`; without `shuffle` every epoch is the same).
    """
    epoch = check_int("epoch", epoch, 0)
    step = self._first_step(epoch)
    return _prefetch(
      lambda: self._epoch_batches(epoch, 0, step), self._prefetch, _THREAD_NAME
    )

  def iterate(self, start_step: int | None = None) -> Iterator[Batch]:
    """Batches of epochs 0, 1, 2, ... without end, from `start_step` on.

    A run that stopped after `s` steps resumes with ``iterate(start_step=s)``:
    the batches are those an uninterrupted run would have yielded next,
    across epoch boundaries. Closing the iterator stops the worker thread.

    The new iterator is the one `get_state` follows: the state's step moves
    to ``batch.step + 1`` as the iterator hands each batch to the caller
    (never as the worker builds one ahead). Iterators of earlier calls go
    on, but no longer move the state.

    Args:
      start_step: batches to skip (they are planned, never built, so time
        grows with the epochs skipped when `shuffle` is on), >= 0. By
        default the step of the state given to `set_state` since the last
        `iterate` call, if any, else 0.
    """
    if start_step is None:
      start_step = self._position if self._restored else 0
    start_step = check_int("start_step", start_step, 0)
    token = object()
    self._position, self._serving, self._restored = start_step, token, False
    batches = _prefetch(lambda: self._stream(start_step), self._prefetch, _THREAD_NAME)
    return self._served(token, batches)

  def _served(self, token: object, batches: Iterator[Batch]) -> Iterator[Batch]:
    """`batches`, moving the position past each one as the caller gets it,
    while `token`'s iterator is the one served."""
    try:
      for batch in batches:
        if self._serving is token:
          self._position = batch.step + 1
        yield batch
    finally:
      batches.close()

  def _plan(self) -> dict[str, Any]:
    """The settings the plan depends on, as a state holds them."""
    if self._plan_settings is None:
      self._plan_settings = {
        "num_examples": self.num_examples,
        "lengths_sha256": _state.lengths_digest(self._lengths),
        "token_capacities": [f.tokens for f in self._fields],
        "sequence_capacity": min(f.sequences for f in self._fields),
        "token_budget": self._token_budget,
        "window": self._window,
        "shuffle": self._shuffle,
        "seed": self._seed,
        "shards": self._shards,
      }
    return self._plan_settings

  def get_state(self) -> dict[str, Any]:
    """The position of the iterator of the last `iterate` call, as a dict.

    The state's ``"step"`` is the step of the next batch that iterator
    yields: ``batch.step + 1`` of the last batch it handed to the caller, or
    the step it started at. Batches its worker thread has built ahead and
    not yet handed over do not count. Before any `iterate` call it is 0, and
    after `set_state` (until the next `iterate` call) the state given.
    `epoch` iterators neither move nor read it.

    The other keys fix the plan the step belongs to: ``"version"``,
    ``"num_examples"``, ``"lengths_sha256"`` (of every example's field
    lengths), ``"token_capacities"`` (per field), ``"sequence_capacity"``
    (the smallest of the fields'), ``"token_budget"``, ``"window"``,
    ``"shuffle"``, ``"seed"`` and ``"shards"``. The values are JSON values
    (ints, a bool, a str, lists of ints, ``None``), so the state saves as
    JSON (``json.dumps``, Orbax's ``ocp.args.JsonSave``). With shards, the
    step is global: every process's state is the same, and restores in any
    process of a run with the same `shards`.

    Returns:
      A new dict; changing it leaves the Batcher alone.

    Example:
      >>> import itertools, json
      >>> from jaxlod import Buckets
      >>> from jaxlod.data import Batcher
      >>> examples = [([1] * n,) for n in (3, 1, 4, 1, 5)]
      >>> buckets = Buckets.fixed(tokens=8, sequences=4, time=6)
      >>> batcher = Batcher(examples, buckets, seed=0)
      >>> batcher.batches_per_epoch(0)
      3
      >>> batches = batcher.iterate()
      >>> [next(batches).step for _ in range(2)]
      [0, 1]
      >>> state = batcher.get_state()
      >>> state["step"], state["seed"], state["token_capacities"]
      (2, 0, [8])
      >>> saved = json.dumps(state)

      A new run (a new Batcher on the same examples and settings) goes on
      from there, across the epoch boundary:

      >>> resumed = Batcher(examples, buckets, seed=0)
      >>> resumed.set_state(json.loads(saved))
      >>> [(b.epoch, b.step) for b in itertools.islice(resumed.iterate(), 3)]
      [(0, 2), (1, 3), (1, 4)]
      >>> [(b.epoch, b.step) for b in itertools.islice(batches, 3)]
      [(0, 2), (1, 3), (1, 4)]
    """
    plan = self._plan()
    return {
      "version": _state.VERSION,
      "step": self._position,
      **plan,
      "token_capacities": list(plan["token_capacities"]),
    }

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Makes the next `iterate` call go on from a `get_state` state.

    ``iterate()`` (without `start_step`) then yields the batch of the
    state's step first; `get_state` returns this state until then. Only a
    state from a Batcher with the same plan restores: the same examples'
    lengths, token and sequence capacities, `token_budget`, `window`,
    `shuffle`, `seed` and `shards` (`prefetch`, `ladder`, `device_put`,
    `tables` and the process may differ). Iterators of earlier `iterate`
    calls no longer move the state.

    Args:
      state: a dict from `get_state`, possibly through JSON.

    Raises:
      TypeError: for a state that is not a mapping, or a key's value of the
        wrong type.
      ValueError: for a missing or unknown key, another ``"version"``, a
        negative ``"step"``, or a plan setting that differs from this
        Batcher's, naming the key, the state's value and this Batcher's.

    Example:
      >>> from jaxlod import Buckets
      >>> from jaxlod.data import Batcher
      >>> examples = [([1] * n,) for n in (3, 1, 4, 1, 5)]
      >>> buckets = Buckets.fixed(tokens=8, sequences=4, time=6)
      >>> state = Batcher(examples, buckets, seed=0).get_state()
      >>> Batcher(examples, buckets, seed=1).set_state(state)
      Traceback (most recent call last):
      ...
      ValueError: Batcher state key 'seed' is 0, but this Batcher's is 1: ...
    """
    step = _state.check_state(state, self._plan())
    self._position, self._serving, self._restored = step, None, True
