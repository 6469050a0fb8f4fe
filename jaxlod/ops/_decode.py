"""Greedy decoding and beam search as while loops with per-source early exit.

Fluid's design notes: "beam search is a while loop". Here the loop also
drops finished sources: between phases the live sources are compacted to a
prefix and the loop moves to a smaller static size from a ladder, so the cost
follows the live sources, not the longest hypothesis in the batch. See
`jaxlod.ops._search` for the loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod._lod import Capacity, LoDTensor, is_concrete
from jaxlod.ops import _search
from jaxlod.ops._rank import default_ladder, normalize_ladder
from jaxlod.ops._rnn import _check_rows, _check_step_out, _is_lod, _prepare_statics
from jaxlod.ops._segment import (
  build,
  check_integer,
  offsets_from_lengths,
  require,
  require_each,
  rows_of,
  static_int,
)


class Hypotheses(NamedTuple):
  """Decoding results, in the caller's order of sources.

  Attributes:
    ids: a 2-level LoDTensor of int32 token ids: level 0 maps each source to
      its hypotheses (best first), level 1 each hypothesis to its tokens
      (`eos` excluded). Capacities: ``count`` sources, ``count *
      num_results`` hypotheses, ``count * num_results * length_capacity``
      tokens.
    scores: a 1-level LoDTensor, one score per hypothesis (values
      ``[count * num_results]``), with the LoD of ``ids``' level 0.
  """

  ids: LoDTensor
  scores: LoDTensor


def _count(init_carry: Any, statics: Any) -> int:
  for tree in (init_carry, statics):
    leaves = jax.tree.leaves(tree, is_leaf=_is_lod)
    if leaves:
      first = leaves[0]
      if _is_lod(first):
        return first.capacity.sequences[-1]
      if jnp.ndim(first) == 0:
        raise ValueError(
          "Expected `init_carry` leaves of shape [count_capacity, ...], got a scalar."
        )
      return int(jnp.shape(first)[0])
  raise ValueError(
    "Expected `init_carry` or `static_inputs` to have at least one array (one row "
    "per source), got none."
  )


def _num_sources(num_sources: Any, static_inputs: Any, count: int) -> jax.Array:
  """The real number of sources: given, from LoD static inputs, or `count`."""
  if num_sources is None:
    lods = [x for x in jax.tree.leaves(static_inputs, is_leaf=_is_lod) if _is_lod(x)]
    if not lods:
      return jnp.asarray(count, jnp.int32)
    counts = [x.num_sequences(-1) for x in lods]
    for i, n in enumerate(counts[1:], 1):
      require(
        n == counts[0],
        f"Expected every LoDTensor in `static_inputs` to hold the same number of "
        f"sequences; LoDTensor {i} differs from LoDTensor 0.",
      )
    return jnp.asarray(counts[0], jnp.int32)
  n = jnp.asarray(num_sources)
  if n.ndim != 0:
    raise ValueError(f"Expected `num_sources` to be a scalar, got shape {n.shape}.")
  check_integer(n.dtype, "num_sources")
  require(
    (n >= 0) & (n <= count),
    f"Expected `num_sources` in [0, {count}] (the count capacity).",
  )
  return n.astype(jnp.int32)


def _max_lengths(
  max_length: Any, length_capacity: int | None, count: int, num_sources: jax.Array
) -> tuple[jax.Array, int]:
  """Per-source max lengths ``[count]`` and the static length capacity."""
  if length_capacity is not None:
    length_capacity = static_int(length_capacity, "length_capacity", minimum=1)
  if isinstance(max_length, int | np.integer) and not isinstance(max_length, bool):
    max_length = static_int(max_length, "max_length", minimum=1)
    if length_capacity is None:
      length_capacity = max_length
    elif max_length > length_capacity:
      raise ValueError(
        f"Expected `max_length` <= `length_capacity` ({length_capacity}), got "
        f"{max_length}."
      )
    return jnp.full((count,), max_length, jnp.int32), length_capacity
  lengths = jnp.asarray(max_length)
  check_integer(lengths.dtype, "max_length")
  if lengths.shape != (count,):
    raise ValueError(
      f"Expected `max_length` to be a static int or an array of shape ({count},) "
      f"(count capacity), got shape {lengths.shape}."
    )
  if length_capacity is None:
    if not is_concrete(lengths):
      raise ValueError(
        "A per-source `max_length` under jit needs a static `length_capacity` "
        "(the longest hypothesis any source may reach)."
      )
    real_lengths = np.asarray(lengths)
    if is_concrete(num_sources):
      # Padding rows (at and past `num_sources`) are never decoded.
      real_lengths = real_lengths[: int(num_sources)]
    length_capacity = max(int(np.max(real_lengths, initial=1)), 1)
  real = jnp.arange(count) < num_sources
  require_each(
    real & (lengths < 1),
    "Expected every `max_length` >= 1 (each source takes at least one step); "
    "source {i} has {value}.",
    value=lengths,
  )
  require_each(
    real & (lengths > length_capacity),
    f"Expected every `max_length` <= `length_capacity` ({length_capacity}); "
    "source {i} has {value}.",
    value=lengths,
  )
  return jnp.clip(lengths, 1, length_capacity).astype(jnp.int32), length_capacity


def _checked_step(step_fn: Callable, eos_id: int) -> Callable:
  """`step_fn` with its outputs checked at trace time."""

  def step(carry, tokens, statics):
    b = tokens.shape[0]
    out = step_fn(carry, tokens, statics)
    new_carry, log_probs = _check_step_out(out, carry, b)
    log_probs = jnp.asarray(log_probs)
    if log_probs.ndim != 2 or not jnp.issubdtype(log_probs.dtype, jnp.floating):
      raise ValueError(
        f"Expected `step_fn` to return log_probs of shape [{b}, vocab] (float), "
        f"got {log_probs.dtype.name}{list(log_probs.shape)}."
      )
    if not 0 <= eos_id < log_probs.shape[1]:
      raise ValueError(
        f"Expected `eos_id` in [0, {log_probs.shape[1]}) (the vocabulary of "
        f"`step_fn`), got {eos_id}."
      )
    return new_carry, log_probs

  return step


def _results(
  slots: _search.Slots,
  final_scores: jax.Array,
  num_results: int,
  num_sources: jax.Array,
) -> Hypotheses:
  """The best `num_results` ended slots of each source, packed as LoDTensors."""
  count, _, length_capacity = slots.tokens.shape
  best, index = jax.lax.top_k(final_scores, num_results)  # [count, R], best first
  valid = (best > _search.NEG_INF).reshape(-1)
  tokens = jnp.take_along_axis(slots.tokens, index[..., None], axis=1)
  lengths = jnp.take_along_axis(slots.length, index, axis=1).reshape(-1)
  # Pack the valid hypotheses to the front, keeping source-major order.
  order = jnp.argsort(~valid, stable=True)
  hyp_lengths = jnp.where(valid[order], lengths[order], 0)
  per_source = jnp.sum(best > _search.NEG_INF, axis=1)
  hyps = count * num_results
  capacity = Capacity(
    tokens=hyps * length_capacity,
    sequences=(count, hyps),
    time=(num_results, length_capacity),
  )
  layout = rows_of(offsets_from_lengths(hyp_lengths), capacity.tokens)
  flat_tokens = tokens.reshape(hyps, length_capacity)[order]
  values = jnp.where(
    layout.valid, flat_tokens[layout.segment, layout.position], 0
  ).astype(jnp.int32)
  ids = build(values, [per_source, hyp_lengths], num_sources, capacity)
  score_values = jnp.where(valid[order], best.reshape(-1)[order], 0.0)
  scores = LoDTensor(score_values, ids.offsets[:1], ids.num_outer, (num_results,))
  return Hypotheses(ids, scores)


def _decode(
  step_fn: Callable,
  init_carry: Any,
  static_inputs: Any,
  *,
  beam_size: int,
  bos_id: int,
  eos_id: int,
  max_length: Any,
  length_capacity: int | None,
  num_sources: Any,
  ladder: Sequence[int] | None,
  compact: bool,
  update: Callable,
  alpha: float,
  num_results: int,
) -> Hypotheses:
  """Shared by `greedy_decode` and `beam_search`."""
  count = _count(init_carry, static_inputs)
  _check_rows(init_carry, count, "init_carry")
  statics = _prepare_statics(static_inputs, count, per="source")
  n = _num_sources(num_sources, static_inputs, count)
  lengths, length_capacity = _max_lengths(max_length, length_capacity, count, n)
  if ladder is not None and not compact:
    raise ValueError("Got a `ladder` with `compact=False`; the ladder sets compaction.")
  if count == 0:
    ladder = ()
  elif not compact:
    ladder = (count,)
  elif ladder is None:
    ladder = default_ladder(count, ratio=2.0, minimum=1, multiple=1)
  else:
    ladder = normalize_ladder(count, ladder)

  def beams(a):
    a = jnp.asarray(a)
    return jnp.broadcast_to(a[:, None], (count, beam_size) + a.shape[1:])

  carry = jax.tree.map(beams, init_carry)
  statics = jax.tree.map(beams, statics)
  step = _checked_step(step_fn, eos_id)
  flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), (carry, statics))
  probe = jax.eval_shape(
    step, flat[0], jnp.zeros((count * beam_size,), jnp.int32), flat[1]
  )
  dtype = jnp.promote_types(probe[1].dtype, jnp.float32)
  slots = _search.initial_slots(count, beam_size, length_capacity, n, bos_id, dtype)
  state = _search.State(
    slots=slots,
    carry=carry,
    statics=statics,
    done=jnp.arange(count) >= n,
    max_length=lengths,
    source=jnp.arange(count, dtype=jnp.int32),
  )
  state = _search.run(state, step, update, ladder, length_capacity)
  final = _search.scores(state.slots, alpha)
  return _results(state.slots, final, num_results, n)


def _check_ids(bos_id: Any, eos_id: Any) -> tuple[int, int]:
  bos_id = static_int(bos_id, "bos_id", minimum=0)
  return bos_id, static_int(eos_id, "eos_id", minimum=0)


def greedy_decode(
  step_fn: Callable[[Any, jax.Array, Any], tuple[Any, jax.Array]],
  init_carry: Any,
  *,
  bos_id: int,
  eos_id: int,
  max_length: int | jax.typing.ArrayLike,
  static_inputs: Any = None,
  length_capacity: int | None = None,
  num_sources: jax.typing.ArrayLike | None = None,
  ladder: Sequence[int] | None = None,
  compact: bool = True,
) -> Hypotheses:
  """Greedy decoding of every source, each stopping at its own `eos`.

  Each source starts from its row of `init_carry` with token `bos_id` and
  takes the most likely token at every step, until it emits `eos_id` or
  reaches its max length. A `lax.while_loop` runs in phases over a ladder of
  static source counts: finished sources are compacted out of the live set
  between phases, so the cost follows the live sources. It equals
  `beam_search` with ``beam_size=1`` and ``length_penalty=0``.

  Args:
    step_fn: ``step_fn(carry, token_ids [b], static) -> (new_carry,
      log_probs [b, vocab])``; every leaf has leading dimension ``b``, a
      static batch size, and rows are independent. `log_probs` must be
      normalized (``log_softmax``).
    init_carry: pytree of ``[count_capacity, ...]`` leaves, one row per
      source, in the caller's order.
    bos_id: the first input token of every source.
    eos_id: the token that ends a hypothesis (not part of the results).
    max_length: the most tokens a source generates (`eos` included): a
      static int, or int ``[count_capacity]`` per source (each at least 1;
      under `jit` with `length_capacity`).
    static_inputs: pytree of arrays ``[count_capacity, ...]`` or of
      LoDTensors with one sequence per source (e.g. an encoder's outputs,
      the external memory), reaching the step as ``(padded [b,
      source_capacity, ...], lengths [b])``. Default `None`.
    length_capacity: static bound on `max_length` (default: `max_length`,
      or the largest value of a concrete array over the real sources).
    num_sources: the real number of sources (int scalar); rows past it are
      padding and get no hypothesis. Default: the real count of the
      LoDTensors in `static_inputs`, else every row.
    ladder: static source counts of the phases (see `rank_table`); default
      halving sizes from the count capacity.
    compact: `False` steps every source until the whole batch is done (a
      batch-wide stop), for comparison: the same hypotheses, with scores
      equal up to rounding (a step's matrix products may round differently
      at another batch size).

  Returns:
    `Hypotheses`: one hypothesis per real source with its summed
    log-probability (`eos` included).

  Raises:
    ValueError: at trace time for a step whose carry changes shape or dtype
      or whose `log_probs` are not ``[b, vocab]`` floats, `eos_id` outside
      the vocabulary, or arguments of the wrong shape; eagerly (under `jit`
      through `jax.experimental.checkify`) for a `max_length` below 1 or
      above `length_capacity`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlod.ops import greedy_decode
    >>> def step(count, tokens, _):  # emits 1, 2, ... then eos (0)
    ...   next_id = jnp.where(count < 3, count + 1, 0)
    ...   return count + 1, jnp.log(jax.nn.one_hot(next_id, 4) * 0.7 + 0.075)
    >>> ids, scores = greedy_decode(
    ...   step, jnp.array([0, 2]), bos_id=3, eos_id=0, max_length=5
    ... )
    >>> ids.to_list()[0][0].tolist(), ids.to_list()[1][0].tolist()
    ([1, 2, 3], [3])
  """
  bos_id, eos_id = _check_ids(bos_id, eos_id)
  update = functools.partial(_search.greedy_update, eos_id=eos_id)
  return _decode(
    step_fn,
    init_carry,
    static_inputs,
    beam_size=1,
    bos_id=bos_id,
    eos_id=eos_id,
    max_length=max_length,
    length_capacity=length_capacity,
    num_sources=num_sources,
    ladder=ladder,
    compact=compact,
    update=update,
    alpha=0.0,
    num_results=1,
  )


def beam_search(
  step_fn: Callable[[Any, jax.Array, Any], tuple[Any, jax.Array]],
  init_carry: Any,
  *,
  beam_size: int,
  bos_id: int,
  eos_id: int,
  max_length: int | jax.typing.ArrayLike,
  length_penalty: float = 0.6,
  static_inputs: Any = None,
  num_results: int | None = None,
  length_capacity: int | None = None,
  num_sources: jax.typing.ArrayLike | None = None,
  ladder: Sequence[int] | None = None,
  compact: bool = True,
) -> Hypotheses:
  """Beam search of every source, each stopping when it is done.

  Paddle's ``beam_search`` in a `lax.while_loop`. Each source keeps
  `beam_size` slots; at every step its candidates are its ended slots (kept
  as they are) and every token after each live slot, scored by summed
  log-probability, and the best `beam_size` candidates become its slots
  (ended slots win ties). A live slot extended by `eos_id` ends (a finished
  hypothesis, never extended again); so does every live slot when the
  source reaches its max length. Finished hypotheses are ranked by GNMT's
  length penalty: ``score = logp / ((5 + steps) / 6) ** length_penalty``,
  ``steps`` counting `eos`.

  A source is done when no slot is live, or when `num_results` slots have
  ended and no live slot can beat the `num_results`-th best of them under
  the length penalty (log-probabilities are at most 0, so a live slot's
  descendants score at most ``logp / ((5 + max_length) / 6) ** length_penalty``);
  going on would not change its results. Between phases of the loop the
  live sources are compacted to a prefix and the loop moves to a smaller
  static size, so done sources stop costing steps.

  Args:
    step_fn: ``step_fn(carry, token_ids [b], static) -> (new_carry,
      log_probs [b, vocab])``; every leaf has leading dimension ``b`` (a
      static multiple of `beam_size`, source-major) and rows are
      independent. `log_probs` must be normalized (``log_softmax``).
    init_carry: pytree of ``[count_capacity, ...]`` leaves, one row per
      source, in the caller's order; every beam of a source starts from it.
    beam_size: slots per source, static.
    bos_id: the first input token of every source.
    eos_id: the token that ends a hypothesis (not part of the results).
    max_length: the most tokens a hypothesis holds (`eos` included): a
      static int, or int ``[count_capacity]`` per source (each at least 1;
      under `jit` with `length_capacity`), e.g. a multiple of each source's
      length.
    length_penalty: the exponent ``alpha >= 0`` of the length penalty; 0
      ranks by summed log-probability.
    static_inputs: pytree of arrays ``[count_capacity, ...]`` or of
      LoDTensors with one sequence per source (e.g. an encoder's outputs,
      the external memory), reaching the step as ``(padded [b,
      source_capacity, ...], lengths [b])``, each source's rows repeated
      for its beams. Default `None`.
    num_results: hypotheses kept per source, best first, in ``[1,
      beam_size]``; default `beam_size` (Paddle's ``beam_search_decode``).
    length_capacity: static bound on `max_length` (default: `max_length`,
      or the largest value of a concrete array over the real sources).
    num_sources: the real number of sources (int scalar); rows past it are
      padding and get no hypothesis. Default: the real count of the
      LoDTensors in `static_inputs`, else every row.
    ladder: static source counts of the phases (see `rank_table`); default
      halving sizes from the count capacity.
    compact: `False` steps every source until the whole batch is done (a
      batch-wide stop, as in Flax's ``examples/wmt``), for comparison: the
      same hypotheses, with scores equal up to rounding (a step's matrix
      products may round differently at another batch size).

  Returns:
    `Hypotheses`: up to `num_results` hypotheses per real source (fewer
    only when fewer can exist), sorted by score, best first.

  Raises:
    ValueError: at trace time for a step whose carry changes shape or dtype
      or whose `log_probs` are not ``[b, vocab]`` floats, `eos_id` outside
      the vocabulary, a negative `length_penalty`, `num_results` outside
      ``[1, beam_size]``, or arguments of the wrong shape; eagerly (under
      `jit` through `jax.experimental.checkify`) for a `max_length` below 1
      or above `length_capacity`.

  Not differentiable (the loop is a `lax.while_loop`).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlod.ops import beam_search
    >>> table = jnp.log(jnp.array([[0.1, 0.5, 0.4], [0.6, 0.3, 0.1], [0.5, 0.2, 0.3]]))
    >>> step = lambda carry, tokens, _: (carry, table[tokens])  # a bigram model
    >>> ids, scores = beam_search(
    ...   step, jnp.zeros(1), beam_size=2, bos_id=0, eos_id=0, max_length=3,
    ...   length_penalty=0.0,
    ... )
    >>> [h.tolist() for h in ids.to_list()[0]]
    [[1], [2]]
    >>> [round(float(s), 3) for s in scores.to_list()[0]]
    [-1.204, -1.609]
  """
  bos_id, eos_id = _check_ids(bos_id, eos_id)
  beam_size = static_int(beam_size, "beam_size", minimum=1)
  if num_results is None:
    num_results = beam_size
  num_results = static_int(num_results, "num_results", minimum=1)
  if num_results > beam_size:
    raise ValueError(
      f"Expected `num_results` <= `beam_size` ({beam_size}), got {num_results}."
    )
  if isinstance(length_penalty, bool) or not isinstance(
    length_penalty, int | float | np.floating | np.integer
  ):
    raise TypeError(
      f"Expected `length_penalty` to be a static float, got {length_penalty!r}."
    )
  alpha = float(length_penalty)
  if not alpha >= 0:
    raise ValueError(
      f"Expected `length_penalty` >= 0 (the early exit's bound needs a penalty "
      f"that grows with the length), got {alpha}."
    )
  update = functools.partial(
    _search.beam_update, eos_id=eos_id, alpha=alpha, num_results=num_results
  )
  return _decode(
    step_fn,
    init_carry,
    static_inputs,
    beam_size=beam_size,
    bos_id=bos_id,
    eos_id=eos_id,
    max_length=max_length,
    length_capacity=length_capacity,
    num_sources=num_sources,
    ladder=ladder,
    compact=compact,
    update=update,
    alpha=alpha,
    num_results=num_results,
  )
