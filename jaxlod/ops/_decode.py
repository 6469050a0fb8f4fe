"""Greedy decoding and beam search as while loops with per-source early exit.

Fluid's design notes: "beam search is a while loop". Here the loop also
drops finished sources: between phases the live sources are compacted to a
prefix and the loop moves to a smaller static size from a ladder, so the cost
follows the live sources, not the longest hypothesis in the batch. See
`jaxlod.ops._search` for the loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlod._buckets import Capacity
from jaxlod._checks import (
  check_callable,
  check_integer,
  check_sequence,
  check_step_out,
  is_float_dtype,
  require,
  require_each,
  static_int,
  value_text,
)
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import check_fits_device, check_rows, host_numbers
from jaxlod._lod import LoDTensor, is_lod
from jaxlod.ops import _search
from jaxlod.ops._loop._phased_rnn import prepare_statics
from jaxlod.ops._loop._plan import LoopPlan, plan_with_ladder, resolve_plan
from jaxlod.ops._rank import default_ladder, ladder_sizes, normalize_ladder
from jaxlod.ops._segment import build, offsets_from_lengths, rows_of


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


jax.export.register_namedtuple_serialization(
  Hypotheses, serialized_name="jaxlod.ops.Hypotheses"
)


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """The static settings of a decoding loop: one hashable value.

  Every decoding entry point takes one (`beam_search`,
  `jaxlod.nn.Seq2Seq.generate`, `jaxlod.nn.ensemble_generate`,
  `jaxlod.parallel.generate`, and their NNX twins), so it can be a static
  argument of `jax.jit`. Greedy decoding is ``beam_size=1``.

  Attributes:
    bos_id: the first input token of every source.
    eos_id: the token that ends a hypothesis (not part of the results).
    max_length: the most tokens a hypothesis holds (`eos` included): the
      static length capacity of the results; a per-source ``max_lengths``
      array of `beam_search` may lower it per source.
    beam_size: slots per source; 1 decodes greedily.
    length_penalty: the exponent ``alpha >= 0`` (finite in float32) of
      GNMT's length penalty ``((5 + steps) / 6) ** alpha`` dividing each
      hypothesis' summed log-probability; 0 ranks (and scores) by summed
      log-probability. `beam_search` refuses a penalty that is inf at
      `max_length` in its scores' dtype (float32 or wider).
    num_results: hypotheses kept per source, best first, in ``[1,
      beam_size]``; `None`: `beam_size` (Paddle's ``beam_search_decode``).
    ladder: static source counts of the loop's phases (see `rank_table`):
      between phases the live sources are compacted to a prefix. `None`:
      the plan's (see `plan`); ``()``: one phase at the full size, a
      batch-wide stop (no compaction). A ladder given here takes the place
      of the plan's `bodies`, as in `jaxlod.ops.dynamic_rnn`.
    plan: how the loop runs on the backend, a `jaxlod.ops.LoopPlan`;
      `None`: `jaxlod.ops.default_plan()` at trace time (one step per
      iteration and a ladder of halvings on a CPU; one phase and 8 steps
      per iteration on a GPU or TPU). Its `bodies` chooses the ladder when
      `ladder` is `None`: `None`, the count capacity and its halvings
      (rounded up) down to 1; ``n``, the first ``n`` of those sizes
      (``1``: a batch-wide stop, as ``ladder=()``). Unlike the sizes of
      `LoopPlan.ladder`, these are not rounded to multiples of 8: the
      step's rows are sources x `beam_size`, and rounding the sources would
      stop a small batch from halving at all. Its `chunk` is the number of
      steps per `lax.while_loop` iteration (an inner loop of static trip
      count), so that on a GPU the loop waits for its condition on the
      host once per `chunk` steps; a step past the loop's end (every source
      done, few enough live sources for the next phase, or `max_length`
      reached) is masked and changes nothing.
      No plan changes the hypotheses; the scores are equal up to rounding
      (the steps run at other batch sizes).

  Raises:
    TypeError, ValueError: for settings of the wrong type or out of range
      (naming the field and the value), or a `ladder` with a `plan` whose
      `bodies` is set (either chooses the phases: pass one).

  Example:
    >>> from jaxlod.ops import DecodeSettings
    >>> greedy = DecodeSettings(bos_id=1, eos_id=2, max_length=20, beam_size=1)
    >>> greedy.results, DecodeSettings(bos_id=1, eos_id=2, max_length=20).results
    (1, 4)
  """

  bos_id: int
  eos_id: int
  max_length: int
  beam_size: int = 4
  length_penalty: float = 0.6
  num_results: int | None = None
  ladder: tuple[int, ...] | None = None
  plan: LoopPlan | None = None

  def __post_init__(self):
    """Checks the settings (see the class docstring) and stores them in
    normal form: the ints as Python ints, the length penalty as a float and
    the ladder as a tuple of sizes.

    Raises:
      TypeError, ValueError: as the class docstring lists.
    """
    set_ = functools.partial(object.__setattr__, self)
    set_("bos_id", static_int(self.bos_id, "bos_id", minimum=0))
    set_("eos_id", static_int(self.eos_id, "eos_id", minimum=0))
    set_("max_length", static_int(self.max_length, "max_length", minimum=1))
    set_("beam_size", static_int(self.beam_size, "beam_size", minimum=1))
    if self.num_results is not None:
      results = static_int(self.num_results, "num_results", minimum=1)
      if results > self.beam_size:
        raise ValueError(
          f"Expected `num_results` <= `beam_size` ({self.beam_size}), got {results}."
        )
      set_("num_results", results)
    set_("length_penalty", _search.check_length_penalty(self.length_penalty))
    if self.ladder is not None:
      if isinstance(self.ladder, str) or not isinstance(self.ladder, Sequence):
        raise TypeError(
          f"Expected `ladder` to be a sequence of ints or None, got {self.ladder!r}."
        )
      set_("ladder", tuple(ladder_sizes(self.ladder)))
    if self.plan is not None:
      resolve_plan(self.plan)  # a `LoopPlan`, naming `plan`
      if self.ladder is not None:
        plan_with_ladder(self.plan, self.ladder)  # not with `bodies` set

  @property
  def results(self) -> int:
    """Hypotheses kept per source (`num_results`, or `beam_size`)."""
    return self.beam_size if self.num_results is None else self.num_results


def _count(init_carry: Any, statics: Any) -> int:
  for name, tree in (("init_carry", init_carry), ("static_inputs", statics)):
    leaves = jax.tree.leaves(tree, is_leaf=is_lod)
    if leaves:
      first = leaves[0]
      if is_lod(first):
        return first.capacity.sequences[-1]
      if not hasattr(first, "shape"):
        host_numbers(first, name)  # numbers are scalars; anything else raises
      if jnp.ndim(first) == 0:
        raise ValueError(
          "Expected `init_carry` leaves of shape [count_capacity, ...], got a scalar."
        )
      return int(jnp.shape(first)[0])
  raise ValueError(
    "Expected `init_carry` or `static_inputs` to have at least one array (one row "
    "per source), got none."
  )


def _num_sources(
  num_sources: Any, static_inputs: Any, count: int
) -> tuple[jax.Array, Any]:
  """The real number of sources (given, from LoD static inputs, or `count`),
  and the `Fault` its checks record under `jit` (0 when they hold): a
  `num_sources` outside ``[0, count]`` is clipped into it, LoD static
  inputs of different counts take the first one's."""
  if num_sources is None:
    lods = [x for x in jax.tree.leaves(static_inputs, is_leaf=is_lod) if is_lod(x)]
    if not lods:
      return jnp.asarray(count, jnp.int32), 0
    counts = [x.num_sequences(-1) for x in lods]
    same = True
    for i, n in enumerate(counts[1:], 1):
      same = same & require(
        n == counts[0],
        f"Expected every LoDTensor in `static_inputs` to hold the same number of "
        f"sequences; LoDTensor {i} differs from LoDTensor 0.",
      )
    return jnp.asarray(counts[0], jnp.int32), fault_unless(same, Fault.INPUT)
  check_fits_device(num_sources, "num_sources")
  n = jnp.asarray(num_sources)
  if n.ndim != 0:
    raise ValueError(f"Expected `num_sources` to be a scalar, got shape {n.shape}.")
  check_integer(n.dtype, "num_sources")
  ok = require(
    (n >= 0) & (n <= count),
    f"Expected `num_sources` in [0, {count}] (the count capacity).",
  )
  return jnp.clip(n, 0, count).astype(jnp.int32), fault_unless(ok, Fault.INPUT)


def _max_lengths(
  max_lengths: Any, settings: DecodeSettings, count: int, num_sources: jax.Array
) -> tuple[jax.Array, Any]:
  """Per-source max lengths ``[count]`` (`max_lengths`, or the settings' for
  all), and the `Fault` their checks record under `jit` (0 when they hold):
  a real source's max length outside ``[1, settings.max_length]`` is
  clipped into it."""
  cap = settings.max_length
  if max_lengths is None:
    return jnp.full((count,), cap, jnp.int32), 0
  check_fits_device(max_lengths, "max_lengths")
  lengths = jnp.asarray(max_lengths)
  check_integer(lengths.dtype, "max_lengths")
  if lengths.shape != (count,):
    raise ValueError(
      f"Expected `max_lengths` to have shape ({count},) (count capacity), got shape "
      f"{lengths.shape}."
    )
  real = jnp.arange(count) < num_sources
  positive = require_each(
    real & (lengths < 1),
    "Expected every `max_lengths` >= 1 (each source takes at least one step); "
    "source {i} has {value}.",
    value=lengths,
  )
  within = require_each(
    real & (lengths > cap),
    f"Expected every `max_lengths` <= `settings.max_length` ({cap}); "
    "source {i} has {value}.",
    value=lengths,
  )
  fault = fault_unless(positive & within, Fault.INPUT)
  return jnp.clip(lengths, 1, cap).astype(jnp.int32), fault


def checked_step(
  step_fn: Callable, bos_id: int, eos_id: int, max_length: int
) -> Callable:
  """`step_fn` with its outputs checked at trace time, and every live slot
  kept alive (see below).

  The returned ``step(carry, tokens [b], statics, live [b])`` takes which of
  its rows are live slots of active sources, and returns log-probabilities
  in float32 or wider (the dtype of the search's scores).
  """

  def step(carry, tokens, statics, live):
    b = tokens.shape[0]
    out = step_fn(carry, tokens, statics)
    new_carry, log_probs = check_step_out(out, carry, b)
    log_probs = jnp.asarray(log_probs)
    if log_probs.ndim != 2 or not is_float_dtype(log_probs.dtype):
      raise ValueError(
        f"Expected `step_fn` to return log_probs of shape [{b}, vocab] (float), "
        f"got {log_probs.dtype.name}{list(log_probs.shape)}."
      )
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
      if not 0 <= value < log_probs.shape[1]:
        raise ValueError(
          f"Expected `{name}` in [0, {log_probs.shape[1]}) (the vocabulary of "
          f"`step_fn`), got {value}."
        )
    return new_carry, _floored(log_probs, live, max_length)

  return step


def _floored(log_probs: jax.Array, live: jax.Array, max_length: int) -> jax.Array:
  """`log_probs` ``[b, vocab]`` with which no live slot drops out.

  ``-inf`` marks dead slots (and masks single tokens out, as it should), so
  a live slot whose every continuation were ``-inf`` would die, and a
  source whose slots all died would come back with no hypothesis. A NaN,
  and every entry of a row with nothing above ``-inf``, becomes a floor
  score far below any real log-probability that still sums to a finite
  value over the longest hypothesis (as does any finite entry below it):
  the source comes back with its hypotheses, scored near the dtype's
  minimum, never with none, and `jax.experimental.checkify` reports it
  (NaN in any row, a row of ``-inf`` in a live slot's). ``+inf`` is no
  log-probability (``log p <= 0``) and is treated as NaN.
  """
  log_probs = log_probs.astype(jnp.promote_types(log_probs.dtype, jnp.float32))
  # +inf is no log-probability (it would win every comparison): as NaN.
  nan = jnp.isnan(log_probs) | (log_probs == jnp.inf)
  require(
    ~jnp.any(nan),
    "Expected `step_fn` to return log_probs without NaN or +inf (they are ranked "
    "last).",
  )
  stuck = ~jnp.any(nan | (log_probs > -jnp.inf), axis=1, keepdims=True)
  require(
    ~jnp.any(live[:, None] & stuck),
    "Expected `step_fn` to return log_probs with an entry above -inf for every "
    "live hypothesis (a row of -inf scores is ranked last).",
  )
  floor = jnp.finfo(log_probs.dtype).min / (max_length + 2)
  masked = (log_probs == -jnp.inf) & ~stuck
  lifted = jnp.where(nan | stuck, floor, jnp.maximum(log_probs, floor))
  return jnp.where(masked, -jnp.inf, lifted)


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
  scores = LoDTensor(
    score_values, ids.offsets[:1], ids.num_outer, (num_results,), ids.faults
  )
  return Hypotheses(ids, scores)


def _ladder_and_chunk(
  settings: DecodeSettings, count: int
) -> tuple[tuple[int, ...], int]:
  """The loop's ladder of source counts and its steps per iteration, from
  `settings.ladder` and `settings.plan` (the backend's at trace time when
  `None`; see `DecodeSettings`)."""
  plan = plan_with_ladder(settings.plan, settings.ladder)
  if count == 0:
    return (), plan.chunk
  if settings.ladder is not None:
    return normalize_ladder(count, settings.ladder), plan.chunk
  ladder = default_ladder(count, ratio=2.0, minimum=1, multiple=1)
  if plan.bodies is not None:
    ladder = ladder[: plan.bodies]
  return ladder, plan.chunk


def beam_search(
  step_fn: Callable[[Any, jax.Array, Any], tuple[Any, jax.Array]],
  init_carry: Any,
  settings: DecodeSettings,
  *,
  static_inputs: Any = None,
  max_lengths: jax.typing.ArrayLike | None = None,
  num_sources: jax.typing.ArrayLike | None = None,
) -> Hypotheses:
  """Beam search (greedy decoding for ``beam_size=1``) of every source.

  Paddle's ``beam_search`` in a `lax.while_loop`. Each source keeps
  ``settings.beam_size`` slots; at every step its candidates are its ended
  slots (kept as they are) and every token after each live slot, scored by
  summed log-probability, and the best `beam_size` candidates become its
  slots (ended slots win ties). A live slot extended by `eos_id` ends (a
  finished hypothesis, never extended again); so does every live slot when
  the source reaches its max length. Finished hypotheses are ranked by
  GNMT's length penalty: ``score = logp / ((5 + steps) / 6) **
  length_penalty``, ``steps`` counting `eos`. With ``beam_size=1`` this is
  greedy decoding: the most likely token at every step.

  A source is done when no slot is live, or when `num_results` slots have
  ended and no live slot can beat the `num_results`-th best of them under
  the length penalty (log-probabilities are at most 0, so a live slot's
  descendants score at most ``logp / ((5 + max_length) / 6) **
  length_penalty``); going on would not change its results. Between phases
  of the loop the live sources are compacted to a prefix and the loop moves
  to a smaller static size of ``settings.ladder``, so done sources stop
  costing steps; ``ladder=()`` runs one phase at the full size (a
  batch-wide stop, as in Flax's ``examples/wmt``): the same hypotheses,
  with scores equal up to rounding. ``settings.plan`` chooses the ladder
  when ``settings.ladder`` is `None` (one phase on a GPU or TPU) and the
  steps per `lax.while_loop` iteration; no plan changes the hypotheses.

  No real source comes back without hypotheses. A ``-inf`` log-probability
  masks its token out, but a live hypothesis needs a continuation: a NaN
  or ``+inf`` (no log-probability exceeds 0), and every entry of a live
  hypothesis' row with no entry above ``-inf``,
  becomes a floor score far below any real log-probability (``finfo(dtype).
  min / (max_length + 2)`` of the scores' dtype, float32 or wider, so that
  sums of them stay finite), and the source comes back with its
  hypotheses scored near that floor. `jax.experimental.checkify` reports
  either (see Raises).

  Args:
    step_fn: ``step_fn(carry, token_ids [b], static) -> (new_carry,
      log_probs [b, vocab])``; every leaf has leading dimension ``b`` (a
      static multiple of `beam_size`, source-major) and rows are
      independent. `log_probs` must be normalized (``log_softmax``);
      ``-inf`` masks a token out.
    init_carry: pytree of ``[count_capacity, ...]`` leaves, one row per
      source, in the caller's order; every beam of a source starts from it.
    settings: the static `DecodeSettings` (ids, length capacity, beam).
    static_inputs: pytree of arrays ``[count_capacity, ...]`` (e.g. a
      `jaxlod.ops.Memory`, the external memory) or of LoDTensors with one
      sequence per source, which reach the step as ``(padded [b,
      source_capacity, ...], lengths [b])``; each source's rows are
      repeated for its beams. Default `None`.
    max_lengths: int ``[count_capacity]``, each source's most tokens (`eos`
      included), in ``[1, settings.max_length]`` (e.g. a multiple of each
      source's length); default ``settings.max_length`` for every source.
    num_sources: the real number of sources (int scalar); rows past it are
      padding and get no hypothesis. Default: the real count of the
      LoDTensors in `static_inputs`, else every row.

  Returns:
    `Hypotheses`: up to `num_results` hypotheses per real source, at least
    one (fewer than `num_results` only when fewer can exist), sorted by
    score, best first. Both LoDTensors carry the faults of the LoDTensors
    in `static_inputs`, and `jaxlod.Fault.INPUT` when a check of
    `max_lengths`, `num_sources` or `static_inputs` (see Raises) failed
    under `jit` without checkify, which clips the max lengths and
    `num_sources` into range: host reads of them raise.

  Raises:
    ValueError: at trace time for a step whose carry changes shape or dtype
      or whose `log_probs` are not ``[b, vocab]`` floats, `eos_id` outside
      the vocabulary, arguments of the wrong shape, or a length penalty
      that is inf at ``settings.max_length`` in the scores' dtype; eagerly (under `jit`
      through `jax.experimental.checkify`) for a `max_lengths` below 1 or
      above ``settings.max_length``, a `num_sources` outside ``[0,
      count_capacity]``, or LoDTensors in `static_inputs` that hold
      different numbers of sequences.
    jax.experimental.checkify.JaxRuntimeError: only under checkify (the loop
      is traced even eagerly), for `log_probs` holding NaN or ``+inf`` or a
      live hypothesis' row of ``-inf``; without it, they are ranked last.

  Not differentiable (the loop is a `lax.while_loop`).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlod.ops import DecodeSettings, beam_search
    >>> table = jnp.log(jnp.array([[0.1, 0.5, 0.4], [0.6, 0.3, 0.1], [0.5, 0.2, 0.3]]))
    >>> step = lambda carry, tokens, _: (carry, table[tokens])  # a bigram model
    >>> settings = DecodeSettings(
    ...   bos_id=0, eos_id=0, max_length=3, beam_size=2, length_penalty=0.0
    ... )
    >>> ids, scores = beam_search(step, jnp.zeros(1), settings)
    >>> [h.tolist() for h in ids.to_list()[0]]
    [[1], [2]]
    >>> [round(float(s), 3) for s in scores.to_list()[0]]
    [-1.204, -1.609]
  """
  check_settings(settings)
  check_callable(step_fn, "step_fn")
  count = _count(init_carry, static_inputs)
  check_rows(init_carry, count, "init_carry")
  statics = prepare_statics(static_inputs, count, per="source")
  n, sources_fault = _num_sources(num_sources, static_inputs, count)
  lengths, lengths_fault = _max_lengths(max_lengths, settings, count, n)
  beam_size, alpha = settings.beam_size, settings.length_penalty
  eos_id = settings.eos_id

  def beams(a):
    a = jnp.asarray(a)
    return jnp.broadcast_to(a[:, None], (count, beam_size) + a.shape[1:])

  carry = jax.tree.map(beams, init_carry)
  statics = jax.tree.map(beams, statics)
  step = checked_step(step_fn, settings.bos_id, eos_id, settings.max_length)
  # Explicit sizes: ``-1`` is ambiguous for a zero-size leaf (a source
  # capacity of 0 gives statics ``[count, k, 0, ...]``).
  flat = jax.tree.map(
    lambda a: a.reshape((count * beam_size,) + a.shape[2:]), (carry, statics)
  )
  rows = count * beam_size
  probe = jax.eval_shape(
    step, flat[0], jnp.zeros((rows,), jnp.int32), flat[1], jnp.ones((rows,), bool)
  )
  dtype = probe[1].dtype
  _search.check_penalty(alpha, settings.max_length, dtype)
  slots = _search.initial_slots(
    count, beam_size, settings.max_length, n, settings.bos_id, dtype
  )
  state = _search.State(
    slots=slots,
    carry=carry,
    statics=statics,
    done=jnp.arange(count) >= n,
    max_length=lengths,
    source=jnp.arange(count, dtype=jnp.int32),
  )
  if beam_size == 1:
    update = functools.partial(_search.greedy_update, eos_id=eos_id)
  else:
    update = functools.partial(
      _search.beam_update, eos_id=eos_id, alpha=alpha, num_results=settings.results
    )
  ladder, chunk = _ladder_and_chunk(settings, count)
  state = _search.run(state, step, update, ladder, settings.max_length, chunk)
  final = _search.scores(state.slots, alpha)
  hyps = _results(state.slots, final, settings.results, n)
  return faulted_by(hyps, static_inputs, sources_fault, lengths_fault)


def faulted_by(hyps: Hypotheses, sources: Any, *faults: Any) -> Hypotheses:
  """`hyps` with the faults of every LoDTensor in the pytree `sources` (the
  memories they were decoded from: an encoder run with a rank table of
  another batch, say) and the bitmasks `faults` (of the search's own
  checks)."""
  tensors = [x for x in jax.tree.leaves(sources, is_leaf=is_lod) if is_lod(x)]
  return Hypotheses(*(with_faults(h, *tensors, *faults) for h in hyps))


def ensemble_step(
  steps: Sequence[Callable[[Any, jax.Array, Any], tuple[Any, jax.Array]]],
) -> Callable[[tuple, jax.Array, tuple], tuple[tuple, jax.Array]]:
  """A decoding step over the mean of several members' log-probabilities.

  Member ``k``'s step ``steps[k](carry_k, token_ids [b], static_k) ->
  (carry_k, logits [b, vocab])`` returns unnormalized logits; the ensemble
  step takes the carries and the static inputs as tuples (one entry per
  member) and returns the mean over members of their ``log_softmax`` (in
  float32 or wider), the `step_fn` of `beam_search`. One member gives its
  own log-probabilities exactly.

  Args:
    steps: the members' steps, all over the same vocabulary.

  Returns:
    ``step_fn(carries, token_ids [b], statics) -> (carries, log_probs [b,
    vocab])``.

  Raises:
    TypeError: when called, for a member whose step returns no pair.
    ValueError: for no steps, or (when called) a member whose logits are
      not ``[b, vocab]``, or members whose vocabularies differ.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxlod.ops import ensemble_step
    >>> a = lambda c, t, s: (c, jnp.log(jnp.array([[0.5, 0.5]])))
    >>> b = lambda c, t, s: (c, jnp.log(jnp.array([[0.9, 0.1]])))
    >>> _, log_probs = ensemble_step([a, b])((0, 0), jnp.zeros(1, int), (None, None))
    >>> [round(float(p), 3) for p in jnp.exp(log_probs)[0]]  # geometric means
    [0.671, 0.224]
  """
  steps = tuple(check_sequence(steps, "steps", "a sequence of step functions"))
  if not steps:
    raise ValueError("Expected `steps` to hold at least one member step, got none.")
  for k, step in enumerate(steps):
    check_callable(step, f"steps[{k}]")

  def step_fn(carries, tokens, statics):
    new, log_probs = [], []
    for k, (step, carry, static) in enumerate(
      zip(steps, carries, statics, strict=True)
    ):
      carry, logits = _member_out(step(carry, tokens, static), k, tokens.shape[0])
      if k and logits.shape[-1] != log_probs[0].shape[-1]:
        raise ValueError(
          f"Expected every member to share the vocabulary: member 0 gives "
          f"{log_probs[0].shape[-1]} log-probabilities, member {k} gives "
          f"{logits.shape[-1]}."
        )
      dtype = jnp.promote_types(logits.dtype, jnp.float32)
      new.append(carry)
      log_probs.append(jax.nn.log_softmax(logits.astype(dtype), axis=-1))
    return tuple(new), jnp.mean(jnp.stack(log_probs), axis=0)

  return step_fn


def _member_out(out: Any, k: int, b: int) -> tuple[Any, jax.Array]:
  """Member `k`'s ``(carry, logits [b, vocab])``, checked as `beam_search`
  checks its `step_fn`'s outputs (naming ``steps[k]``)."""
  if not (isinstance(out, tuple | list) and len(out) == 2):
    raise TypeError(
      f"Expected `steps[{k}]` to return a pair (new_carry, logits), got "
      f"{value_text(out)}."
    )
  logits = jnp.asarray(out[1])
  if logits.ndim != 2 or logits.shape[0] != b:
    raise ValueError(
      f"Expected `steps[{k}]` to return logits of shape [{b}, vocab], got "
      f"{logits.dtype.name}{list(logits.shape)}."
    )
  return out[0], logits


# -- settings --------------------------------------------------------------------


def check_settings(settings: Any) -> Any:
  """Decoding takes a `jaxlod.ops.DecodeSettings`."""
  if not isinstance(settings, DecodeSettings):
    raise TypeError(
      f"Expected `settings` to be a DecodeSettings, got {type(settings).__name__}."
    )
  return settings
