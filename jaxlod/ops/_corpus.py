"""Decoding a corpus with continuous refill: new sources take the slots of
finished ones between chunks of steps.

`jaxlod.ops.beam_search` decodes a batch until its last source is done; its
compaction stops the finished sources' work, but the batch's tail runs a
few long sources with most slots idle, and the next batch waits for it.
`decode_corpus` keeps ``slots`` sources in flight instead, as LLM servers
batch requests in flight:

  * one jitted program runs ``chunk`` search steps of every slot, each
    source at its own step (it joined when a slot freed up); done and free
    slots compute and change nothing;
  * between chunks the host reads which sources are done, takes their
    hypotheses, and fills every free slot with the next sources of the
    corpus: ``encode_fn`` encodes ``refill`` of them at a time (the
    attention's memory, the initial carry), and one more program moves as
    many of those as there are free slots into them.

Every source takes the steps of `beam_search` alone: the same update rules,
per source, so the same hypotheses, the scores equal up to the rounding of
another batch size. The programs compile once per `slots`, `refill` and
`chunk` for the whole corpus, and once across calls for the same step
function (a `jax.tree_util.Partial` passes its arrays as arguments).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import Partial

from jaxlod._checks import check_callable, static_int
from jaxlod._host import check_rows
from jaxlod.ops import _search
from jaxlod.ops._decode import DecodeSettings, check_settings, checked_step
from jaxlod.ops._loop._phased_rnn import prepare_statics


class _InFlight(NamedTuple):
  """The slots in flight, the step each source is at, and their memories
  (apart: a chunk reads them and leaves them in place)."""

  state: _search.State  # `statics` is (); `source` the corpus index (-1: free)
  t: jax.Array  # int32 [slots]
  statics: Any  # the search's statics, leaves [slots, ...] (not per beam)


class _Programs:
  """The corpus decoder's jitted programs for one settings, chunk and mesh,
  each taking the step function as a pytree (a `jax.tree_util.Partial`)
  argument: `start` (new sources as search states), `insert` (into freed
  slots), `advance` (`chunk` steps of every slot) and `harvest` (every
  slot's best results). Built once per settings and chunk (`_programs`),
  they compile once per step function and sizes across calls.

  With a `mesh`, the slots are sharded over `axis` and each device runs the
  chunks of its own slots (`jax.shard_map`); the encoded sources are
  replicated, and `insert` moves each into the device that owns its slot.
  The loop's buffers (the memories of every slot's beams) are donated: an
  insert or a chunk updates them in place instead of copying them.
  """

  def __init__(
    self, settings: DecodeSettings, chunk: int, mesh: Mesh | None, axis: str
  ):
    """Builds (does not compile) the four programs.

    Args:
      settings: the checked `DecodeSettings`: its beam size picks the
        search's update (greedy for 1, else beam search).
      chunk: the search steps `advance` runs, an int >= 1.
      mesh: the one-axis mesh the slots are sharded over (``[slots, ...]``
        leaves split over `axis`), or `None` for the default device.
      axis: the name of `mesh`'s axis.
    """
    self.settings, self.chunk, self.mesh, self.axis = settings, chunk, mesh, axis
    self.k, self.cap = settings.beam_size, settings.max_length
    if self.k == 1:
      self.update = functools.partial(_search.greedy_update, eos_id=settings.eos_id)
    else:
      self.update = functools.partial(
        _search.beam_update,
        eos_id=settings.eos_id,
        alpha=settings.length_penalty,
        num_results=settings.results,
      )
    insert, advance = self._insert, self._advance
    if mesh is not None:  # each device its own slots
      insert = jax.shard_map(
        insert,
        mesh=mesh,
        in_specs=(P(axis), P(), P(), P()),
        out_specs=P(axis),
        check_vma=False,
      )
      advance = jax.shard_map(
        advance,
        mesh=mesh,
        in_specs=(P(), P(axis), P(axis)),
        out_specs=P(axis),
        check_vma=False,
      )
    self.start = jax.jit(self._start)
    self.insert = jax.jit(insert, donate_argnums=0)
    self.advance = jax.jit(advance, donate_argnums=1)
    self.harvest = jax.jit(self._harvest)

  def _checked(self, step_fn: Callable) -> Callable:
    """`step_fn` with its outputs checked (`checked_step`)."""
    s = self.settings
    return checked_step(step_fn, s.bos_id, s.eos_id, self.cap)

  def _start(self, step_fn, init_carry, statics, max_lengths, n, first):
    """The search states of a batch of newly encoded sources.

    Args:
      step_fn: the step function, a `jax.tree_util.Partial`.
      init_carry: the encoded initial carries, leaves ``[refill, ...]``.
      statics: the prepared static inputs, leaves ``[refill, ...]``.
      max_lengths: int32 ``[refill]``, each source's max length.
      n: the real sources of the batch (the rows past them are padding).
      first: the corpus index of row 0.

    Returns:
      A `_search.State` of ``refill`` sources: each carry broadcast to the
      ``beam_size`` beams (leaves ``[refill, k, ...]``), the statics one
      copy a source, slot 0 of each real source live, the padding rows done
      and their ``source`` -1 (else ``first + row``).

    Raises:
      ValueError, TypeError: for step outputs that `checked_step` rejects,
        or a length penalty that is inf at ``settings.max_length`` in the scores'
        dtype.
    """
    step = self._checked(step_fn)
    count = jax.tree.leaves((init_carry, statics))[0].shape[0]

    def beams(a):
      return jnp.broadcast_to(a[:, None], (count, self.k) + a.shape[1:])

    carry, beamed = jax.tree.map(beams, (init_carry, statics))
    flat = jax.tree.map(
      lambda a: a.reshape((count * self.k,) + a.shape[2:]), (carry, beamed)
    )
    rows = jnp.zeros((count * self.k,), jnp.int32)
    probe = jax.eval_shape(step, flat[0], rows, flat[1], jnp.ones_like(rows, bool))
    dtype = probe[1].dtype
    _search.check_penalty(self.settings.length_penalty, self.cap, dtype)
    real = jnp.arange(count) < n
    return _search.State(
      slots=_search.initial_slots(
        count, self.k, self.cap, n, self.settings.bos_id, dtype
      ),
      carry=carry,
      statics=statics,  # one copy a source: a chunk broadcasts it to the beams
      done=~real,
      max_length=max_lengths,
      source=jnp.where(real, first + jnp.arange(count, dtype=jnp.int32), -1),
    )

  def _insert(
    self, loop: _InFlight, new: _search.State, rows: jax.Array, dest: jax.Array
  ):
    """`new`'s sources `rows` into the slots `dest` (out of range: none)."""
    if self.mesh is not None:  # this device's slots only
      count = loop.t.shape[0]
      dest = dest - lax.axis_index(self.axis) * count
      dest = jnp.where((dest >= 0) & (dest < count), dest, count)

    def put(a, b):
      return a.at[dest].set(b[rows], mode="drop")

    state = jax.tree.map(put, loop.state, new._replace(statics=()))
    statics = jax.tree.map(put, loop.statics, new.statics)
    return _InFlight(state, loop.t.at[dest].set(0, mode="drop"), statics)

  def _advance(self, step_fn, core: tuple[_search.State, jax.Array], statics: Any):
    """`chunk` steps of every slot: ``(state, t)`` after them, each slot's
    beams reading its `statics` (leaves ``[slots, ...]``)."""
    step = self._checked(step_fn)

    slots = core[1].shape[0]
    beamed = jax.tree.map(
      lambda a: jnp.broadcast_to(a[:, None], (slots, self.k) + a.shape[1:]), statics
    )

    def one(_, core):
      state, t = core
      active = ~state.done
      state = _search.advance_sources(
        state._replace(statics=beamed), t, step, self.update
      )
      return state._replace(statics=()), t + active.astype(t.dtype)

    # Unrolled: as a while loop, XLA copies the loop-invariant memories into
    # the loop's state at every call (about 1.5 ms of a 4.6 ms step here).
    return lax.fori_loop(0, self.chunk, one, core, unroll=True)

  def _harvest(self, slots: _search.Slots):
    """Every slot's best results: ``(tokens [slots, results, max_length],
    lengths [slots, results], scores [slots, results])``."""
    best, index = lax.top_k(
      _search.scores(slots, self.settings.length_penalty), self.settings.results
    )
    tokens = jnp.take_along_axis(slots.tokens, index[..., None], axis=1)
    lengths = jnp.take_along_axis(slots.length, index, axis=1)
    return tokens, lengths, best


@functools.cache
def _programs(
  settings: DecodeSettings, chunk: int, mesh: Mesh | None, axis: str
) -> _Programs:
  """The `_Programs` of these settings, chunk and mesh, built once."""
  return _Programs(settings, chunk, mesh, axis)


def _check_max_lengths(max_lengths: Any, batch: int, refill: int, cap: int, first: int):
  """The encoded batch's max lengths on the host, ``[refill]`` int32; a real
  source's outside ``[1, cap]`` raises naming its corpus index."""
  if max_lengths is None:
    return np.full((refill,), cap, np.int32)
  lengths = np.asarray(max_lengths)
  if lengths.shape != (refill,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(
      f"Expected `encode_fn`'s max_lengths to be int [{refill}] (the refill "
      f"size), got {lengths.dtype.name}{list(lengths.shape)}."
    )
  for i in range(batch):
    if not 1 <= lengths[i] <= cap:
      raise ValueError(
        f"Expected every source's max length in [1, {cap}] (settings.max_length, "
        f"the capacity of the results), got {int(lengths[i])} for source "
        f"{first + i} of the corpus."
      )
  return np.clip(lengths, 1, cap).astype(np.int32)


def corpus_slots(
  slots: Any, refill: Any, mesh: Mesh | None, axis: str
) -> tuple[int, int]:
  """`decode_corpus`'s ``(slots over all devices, refill)``: `slots` per
  device of the checked `mesh` (one device: `None`), `refill` checked in
  ``[1, slots]`` and by default a quarter of them (at least 1).

  Raises:
    TypeError, ValueError: naming the argument.
  """
  slots = static_int(slots, "slots", minimum=1)
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise TypeError(
        f"Expected `mesh` to be a jax.sharding.Mesh or None, got {mesh!r}."
      )
    if axis not in mesh.shape:
      raise ValueError(
        f"Expected `axis` to name an axis of `mesh` {tuple(mesh.shape)}, got {axis!r}."
      )
    if mesh.devices.size != mesh.shape[axis]:
      raise ValueError(
        f"Expected a mesh with the one axis {axis!r}, got {dict(mesh.shape)}: "
        "decode_corpus shards its slots over one axis."
      )
    if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
      raise ValueError(
        "Expected a mesh of this process's devices: decode_corpus reads its "
        "slots on the host every chunk, and each process would read another "
        "corpus. Decode each process's part of the corpus on its own devices."
      )
    slots *= mesh.shape[axis]
  refill = max(1, slots // 4) if refill is None else static_int(refill, "refill", 1)
  if refill > slots:
    raise ValueError(f"Expected `refill` in [1, {slots}] (the slots), got {refill}.")
  return slots, refill


def source_iterator(sources: Any) -> Iterator:
  """An iterator over `sources`, taken at once.

  Raises:
    TypeError: for `sources` that is not iterable.
  """
  try:
    return iter(sources)
  except TypeError:
    raise TypeError(
      f"Expected `sources` to be an iterable of sources, got {type(sources).__name__}."
    ) from None


def decode_corpus(
  step_fn: Callable[[Any, jax.Array, Any], tuple[Any, jax.Array]],
  encode_fn: Callable[[list], tuple[Any, Any, Any]],
  sources: Iterable,
  settings: DecodeSettings,
  *,
  slots: int,
  refill: int | None = None,
  chunk: int = 4,
  stats: dict | None = None,
  mesh: Mesh | None = None,
  axis: str = "data",
) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
  """Beam search (greedy for ``beam_size=1``) of every source of a corpus,
  with continuous refill: new sources join as others finish.

  Args:
    step_fn: as `jaxlod.ops.beam_search`'s, ``step_fn(carry, token_ids [b],
      static) -> (new_carry, log_probs [b, vocab])``. A
      `jax.tree_util.Partial` (e.g. ``Partial(step, params)``) passes its
      arrays to the compiled programs as arguments: calls with the same
      function and new arrays compile nothing. Arrays a plain function
      closes over are constants of the programs.
    encode_fn: ``encode_fn(batch) -> (init_carry, static_inputs,
      max_lengths)`` for a list of at most `refill` sources of the corpus:
      leaves ``[refill, ...]`` (rows past the batch are ignored), as
      `beam_search`'s arguments (static inputs may be LoDTensors of count
      capacity `refill`); `max_lengths` int ``[refill]`` or `None`
      (``settings.max_length`` for every source).
    sources: an iterable of sources, read as slots free up (a file's lines
      stream through in bounded memory).
    settings: the static `DecodeSettings` (its `ladder` and `plan` do not
      apply: the slots stay full instead).
    slots: the sources in flight, a static int >= 1.
    refill: the sources encoded at once, a static int in ``[1, slots]``
      (with a `mesh`, ``[1, slots * devices]``; default a quarter of the
      upper bound, at least 1); every free slot takes one of them
      after each chunk, and the next `refill` are encoded when they run out.
    chunk: search steps between two refills, a static int >= 1 (one
      program runs them unrolled: it compiles in about `chunk` times a
      step's time; a source done inside a chunk leaves its slot idle to the
      chunk's end).
    mesh, axis: data parallelism: `slots` sources in flight on each device
      of the one-axis `mesh` (axis `axis`, every device this process's),
      each device running the chunks of its own slots (`jax.shard_map`), a
      freed slot taking the next encoded source whichever device holds it;
      `encode_fn` encodes for all of them. `None`: the default device.
    stats: a dict to fill with ``slot_steps`` (slots times steps run),
      ``source_steps`` (steps of sources in flight), ``occupancy`` (their
      ratio) and ``chunks``; `None`: not kept.

  Yields:
    Per source, in the corpus's order: ``(ids, scores)``, up to
    `num_results` hypotheses best first (``ids[j]`` int32 ``[length]``,
    `eos` excluded; ``scores`` ``[n]``), as ``Hypotheses.to_list()``
    gives one source's.

  Raises:
    TypeError, ValueError: for bad arguments (eagerly, before any source is
      read: `sources` not iterable, sizes out of range, a `stats` that is
      not a dict), and while decoding for a source whose max length is outside
      ``[1, settings.max_length]`` (naming its index in the corpus) or an
      `encode_fn` whose outputs do not have `refill` rows.
  """
  check_settings(settings)
  check_callable(step_fn, "step_fn")
  check_callable(encode_fn, "encode_fn")
  slots, refill = corpus_slots(slots, refill, mesh, axis)
  chunk = static_int(chunk, "chunk", minimum=1)
  if stats is not None and not isinstance(stats, dict):
    raise TypeError(
      f"Expected `stats` to be a dict or None, got {type(stats).__name__}."
    )
  iterator = source_iterator(sources)
  return _decode(
    step_fn, encode_fn, iterator, settings, slots, refill, chunk, stats, mesh, axis
  )


def _decode(
  step_fn, encode_fn, iterator, settings, slots, refill, chunk, stats, mesh, axis
):
  """The generator behind `decode_corpus`, over its checked arguments.

  Between chunks, fills every free slot with the next encoded sources
  (encoding `refill` more from `iterator` when none are left), runs one
  chunk of `chunk` steps of every slot, and takes the results of the
  sources that finished; it ends when the corpus is read and every slot is
  free.

  Args:
    step_fn: as `decode_corpus`'s (wrapped in a `jax.tree_util.Partial`
      when it is not one).
    encode_fn: as `decode_corpus`'s.
    iterator: an iterator over the corpus's sources.
    settings: the checked `DecodeSettings`.
    slots: the sources in flight over all devices, an int >= 1.
    refill: the sources encoded at once, an int in ``[1, slots]``.
    chunk: the search steps between two refills, an int >= 1.
    stats: a dict to fill with ``slot_steps``, ``source_steps``,
      ``occupancy`` and ``chunks`` after every chunk, or `None`.
    mesh, axis: as `decode_corpus`'s: the one-axis mesh the slots are
      sharded over, or `None`.

  Yields:
    Per source, in the corpus's order: ``(ids, scores)``, the hypotheses
    best first (``ids[j]`` int32 ``[length]``, ``scores`` ``[n]``).

  Raises:
    TypeError, ValueError: for `encode_fn` outputs whose leaves do not
      have `refill` rows, max lengths that are not int ``[refill]`` or a
      source's outside ``[1, settings.max_length]`` (naming its index in
      the corpus), or step outputs that the search rejects.
  """
  if not isinstance(step_fn, Partial):
    step_fn = Partial(step_fn)
  programs = _programs(settings, chunk, mesh, axis)
  occupied = np.zeros((slots,), bool)
  index_of = np.full((slots,), -1)
  t = np.zeros((slots,), np.int32)
  results: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
  read, out, exhausted, loop = 0, 0, False, None
  # The encoded sources not yet in a slot: rows [taken, count) of `pending`.
  pending, taken, count = None, 0, 0
  counts = {"slot_steps": 0, "source_steps": 0, "chunks": 0}
  _report_stats(stats, counts)
  while True:
    free = np.flatnonzero(~occupied)
    while free.size and not (exhausted and taken == count):
      if taken == count:  # encode the next `refill` sources
        batch = list(itertools.islice(iterator, refill))
        exhausted = len(batch) < refill
        if not batch:
          break
        pending = _encode_sources(programs, step_fn, encode_fn, batch, refill, read)
        taken, count = 0, len(batch)
        read += len(batch)
        if loop is None:
          loop = _free_slots(pending, slots, mesh, axis)
      n = min(free.size, count - taken)
      where = free[:n]
      loop = programs.insert(loop, pending, *_insert_rows(where, taken, refill, slots))
      occupied[where] = True
      index_of[where] = np.arange(read - count + taken, read - count + taken + n)
      t[where] = 0
      taken += n
      free = free[n:]
    if not occupied.any():
      break
    state, after = programs.advance(step_fn, (loop.state, loop.t), loop.statics)
    loop = loop._replace(state=state, t=after)
    # Copies: the next chunk reuses (donates) the loop's buffers.
    after, done = np.array(after), np.array(state.done)
    counts["chunks"] += 1
    counts["slot_steps"] += slots * chunk
    counts["source_steps"] += int(np.sum((after - t)[occupied]))
    t = after
    finished = occupied & done
    if finished.any():
      results.update(_finished_results(programs, loop, finished, index_of))
      occupied[finished] = False
    _report_stats(stats, counts)
    while out in results:
      yield results.pop(out)
      out += 1


def _report_stats(stats: dict | None, counts: dict[str, int]) -> None:
  """`counts` (``slot_steps``, ``source_steps``, ``chunks``) and their
  ``occupancy`` into `stats`, unless it is `None`."""
  if stats is not None:
    stats.update(counts)
    stats["occupancy"] = counts["source_steps"] / max(counts["slot_steps"], 1)


def _encode_sources(
  programs: _Programs,
  step_fn: Partial,
  encode_fn: Callable,
  batch: list,
  refill: int,
  first: int,
) -> _search.State:
  """`batch` (at most `refill` sources, the first at corpus index `first`)
  encoded by `encode_fn` and started as search states.

  Returns:
    `programs.start`'s `_search.State` of ``refill`` sources (leaves
    ``[refill, ...]``, the rows past the batch done), replicated over the
    mesh when there is one (every device may take any of them).

  Raises:
    TypeError, ValueError: for `encode_fn` outputs whose leaves do not have
      `refill` rows or bad max lengths (`_check_max_lengths`).
  """
  init_carry, statics, max_lengths = encode_fn(batch)
  statics = prepare_statics(statics, refill, per="source")
  check_rows((init_carry, statics), refill, "encode_fn's outputs")
  lengths = _check_max_lengths(max_lengths, len(batch), refill, programs.cap, first)
  pending = programs.start(step_fn, init_carry, statics, lengths, len(batch), first)
  if programs.mesh is not None:  # every device may take any of them
    pending = jax.device_put(pending, NamedSharding(programs.mesh, P()))
  return pending


def _free_slots(
  pending: _search.State, slots: int, mesh: Mesh | None, axis: str
) -> _InFlight:
  """`slots` free slots shaped as `pending`'s rows: zero leaves ``[slots,
  ...]``, every slot done, its `t` 0; sharded over `axis` with a `mesh`."""
  empty = jax.tree.map(lambda a: jnp.zeros((slots,) + a.shape[1:], a.dtype), pending)
  loop = _InFlight(
    empty._replace(statics=(), done=jnp.ones((slots,), bool)),
    jnp.zeros((slots,), jnp.int32),
    empty.statics,
  )
  if mesh is not None:
    loop = jax.device_put(loop, NamedSharding(mesh, P(axis)))
  return loop


def _insert_rows(
  where: np.ndarray, taken: int, refill: int, slots: int
) -> tuple[np.ndarray, np.ndarray]:
  """`insert`'s ``(rows, dest)``, int32 ``[refill]`` each: the pending rows
  from `taken` on go into the free slots `where` (the unused entries' `dest`
  is `slots`, out of range: dropped)."""
  n = where.size
  rows = np.zeros((refill,), np.int32)
  rows[:n] = np.arange(taken, taken + n)
  dest = np.full((refill,), slots, np.int32)  # out of range: dropped
  dest[:n] = where
  return rows, dest


def _finished_results(
  programs: _Programs, loop: _InFlight, finished: np.ndarray, index_of: np.ndarray
) -> dict[int, tuple[list[np.ndarray], np.ndarray]]:
  """The results of the `finished` slots (bool ``[slots]``) by corpus index
  (`index_of`, ``[slots]``): ``(ids, scores)``, the valid hypotheses best
  first (``ids[j]`` int32 ``[length]``, ``scores`` ``[n]``)."""
  tokens, lengths, best = (np.asarray(a) for a in programs.harvest(loop.state.slots))
  results = {}
  for s in np.flatnonzero(finished):
    valid = best[s] > -np.inf
    # Copies, so that a result kept does not keep every slot's tokens.
    ids = [tokens[s, j, : lengths[s, j]].copy() for j in np.flatnonzero(valid)]
    results[int(index_of[s])] = (ids, best[s][valid].copy())
  return results
