"""The decoding loop: per-source search state, update rules and compaction.

Every array of the search state has a leading source axis ``[count, ...]``
and per-hypothesis arrays a beam axis after it ``[count, k, ...]``. The loop
runs in phases over a ladder of static source counts: phase ``i`` steps the
prefix ``[:ladder[i]]`` in a `lax.while_loop` while more than
``ladder[i + 1]`` sources are live; then a stable permutation moves the live
sources to the front and the next phase takes a smaller prefix. Finished
sources inside the current prefix are padding rows of the step (computed,
and masked out of the state), as in `dynamic_rnn`'s phases. With chunks of
``k`` steps per iteration (a `jaxlod.ops.LoopPlan`'s ``chunk``), each step
checks the loop's condition itself and, once it fails, masks every source
out: it computes and changes nothing, so the results are those of one step
per iteration.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlod._checks import (
  INT32,
  check_float,
  check_integer,
  expand_rows,
  finite_float32,
  is_concrete,
  require_each,
  where_rows,
)
from jaxlod._host import as_array
from jaxlod._vma import vary, varying_axes

NEG_INF = -jnp.inf


class Slots(NamedTuple):
  """The hypotheses of every source: ``k`` slots each.

  A slot is *dead* (``logp == -inf``: never filled), *live* (extended every
  step) or *ended* (by `eos` or at the source's max length); ended slots are
  the results.

  Attributes:
    tokens: int32 ``[count, k, length_capacity]``, the tokens so far (`eos`
      excluded), zeros past `length`.
    last: int32 ``[count, k]``, the step's next input token.
    logp: ``[count, k]``, the summed log-probabilities (`eos` included).
    length: int32 ``[count, k]``, tokens in `tokens`.
    ended: bool ``[count, k]``.
    eos: bool ``[count, k]``, ended by `eos` (its step counts in the length
      penalty).
  """

  tokens: jax.Array
  last: jax.Array
  logp: jax.Array
  length: jax.Array
  ended: jax.Array
  eos: jax.Array


class State(NamedTuple):
  """The loop state, in slot order (a permutation of the sources)."""

  slots: Slots
  carry: Any  # leaves [count, k, ...]
  statics: Any  # leaves [count, k, ...], read only
  done: jax.Array  # bool [count]
  max_length: jax.Array  # int32 [count], at most length_capacity
  source: jax.Array  # int32 [count], the caller's index of each slot


def initial_slots(
  count: int, k: int, length_capacity: int, num_sources: jax.Array, bos: int, dtype
) -> Slots:
  """Slot 0 of every real source starts live at log-probability 0."""
  real = jnp.arange(count) < num_sources
  first = jnp.arange(k) == 0
  logp = jnp.where(real[:, None] & first[None, :], 0.0, NEG_INF).astype(dtype)
  return Slots(
    tokens=jnp.zeros((count, k, length_capacity), jnp.int32),
    last=jnp.full((count, k), bos, jnp.int32),
    logp=logp,
    length=jnp.zeros((count, k), jnp.int32),
    ended=jnp.zeros((count, k), bool),
    eos=jnp.zeros((count, k), bool),
  )


def length_normalized(
  logp: jax.typing.ArrayLike, steps: jax.typing.ArrayLike, length_penalty: float
) -> jax.Array:
  """Scores as `beam_search` ranks finished hypotheses.

  ``logp / ((5 + steps) / 6) ** length_penalty``: GNMT's length penalty
  (Wu et al. 2016), computed as the search scores, in float32 or wider,
  and returned in `logp`'s dtype (as JAX stores it: NumPy's float64
  becomes float32 without x64).

  `steps` are checked as the search checks its settings: at least 0, and
  with a penalty finite in the scores' dtype (an inf penalty would score
  every hypothesis -0.0, above every real score). Eagerly a bad one raises;
  under `jit` the check is a `jax.experimental.checkify` check, and its
  entries score ``-inf`` (ranked last, never above a real score).

  Args:
    logp: summed log-probabilities, floats of any shape ``[...]``.
    steps: integers ``>= 0``, the hypotheses' tokens, counting ``eos`` where
      they ended with it (`DecodeSettings`); broadcast against `logp`.
    length_penalty: the exponent, as `DecodeSettings.length_penalty`: a
      static float, finite and at least 0.

  Returns:
    The normalized scores, ``[...]`` (the broadcast shape).

  Raises:
    TypeError: for a `length_penalty` that is not a static float, `logp`
      that is not floats, or `steps` that is not integers.
    ValueError: for a negative or infinite `length_penalty`, or shapes of
      `logp` and `steps` that do not broadcast; eagerly (under `jit`
      through `jax.experimental.checkify`) for a negative `steps`, or one
      whose length penalty is inf in the scores' dtype.

  Example:
    >>> from jaxlod.ops import length_normalized
    >>> round(float(length_normalized(-6.0, 7, 0.6)), 4)  # -6 / 2 ** 0.6
    -3.9585
  """
  length_penalty = check_length_penalty(length_penalty)
  logp = as_array(logp, "logp", "an array of log-probabilities")
  check_float(logp.dtype, "logp")
  steps = as_array(steps, "steps", "an array of token counts")
  check_integer(steps.dtype, "steps")
  try:
    shape = jnp.broadcast_shapes(logp.shape, steps.shape)
  except ValueError:
    raise ValueError(
      f"Expected `logp` {logp.shape} and `steps` {steps.shape} to broadcast together."
    ) from None
  wide = jnp.promote_types(logp.dtype, jnp.float32)  # the search's scores
  bad = check_steps(steps, length_penalty, wide)
  value = normalized(logp.astype(wide), steps, length_penalty)
  if bad is not None:
    value = jnp.where(bad, NEG_INF, value)
  return jnp.broadcast_to(value, shape).astype(logp.dtype)


def normalized(logp: jax.Array, steps: jax.Array, alpha: float) -> jax.Array:
  """`length_normalized` of checked arguments, in `logp`'s dtype."""
  if alpha == 0:
    return logp
  return logp / ((5.0 + steps.astype(logp.dtype)) / 6.0) ** alpha


def check_steps(steps: jax.Array, alpha: float, dtype) -> jax.Array | None:
  """`length_normalized`'s `steps`: every one at least 0, and at most
  `penalty_limit` (`check_penalty`, naming `steps`).

  Returns:
    `None` when every one is (eagerly, or it raised), else under `jit` a
    bool mask of `steps`' shape marking the bad ones.
  """
  flat = steps.reshape(-1)
  limit = penalty_limit(alpha, dtype)
  require_each(
    flat < 0,
    "Expected every `steps` >= 0 (a hypothesis' tokens, `eos` included); item "
    "{i} has {value}.",
    value=flat,
  )
  if is_concrete(flat):
    if flat.size:
      check_penalty(alpha, int(np.max(np.asarray(flat))), dtype, name="steps")
    return None
  if limit == INT32.max:  # every int32 count has a finite penalty
    return steps < 0
  largest = float(jnp.finfo(dtype).max)
  require_each(
    flat > limit,
    f"Expected every `steps` <= {limit} (with `length_penalty` {alpha}, the length "
    f"penalty ((5 + length) / 6) ** length_penalty of a longer one is inf in the "
    f"scores' dtype {jnp.dtype(dtype).name}, at most {largest:.4g}); item {{i}} "
    "has {value}.",
    value=flat,
  )
  return (steps < 0) | (steps > limit)


def check_length_penalty(value: Any) -> float:
  """`value` as a length penalty: a static float, finite and at least 0.

  Raises:
    TypeError: for a value that is not a static float.
    ValueError: for a negative one (the early exit's bound needs a penalty
      that grows with the length), or one that is inf in float32.
  """
  if isinstance(value, bool) or not isinstance(
    value, int | float | np.floating | np.integer
  ):
    raise TypeError(f"Expected `length_penalty` to be a static float, got {value!r}.")
  if not 0 <= float(value) < float("inf"):
    raise ValueError(
      f"Expected a finite `length_penalty` >= 0 (the early exit's bound needs a "
      f"penalty that grows with the length), got {float(value)}."
    )
  # The scores are float32 or wider: 1e300 became inf there, every score -0.
  return finite_float32(value, "length_penalty")


def _penalty_exponent(alpha: float, length: int) -> float:
  """The decimal exponent of the length penalty ``((5 + length) / 6) **
  alpha``."""
  return alpha * math.log10((5.0 + length) / 6.0)


def penalty_limit(alpha: float, dtype) -> int:
  """The most steps whose length penalty is finite in `dtype` (the largest
  int32 when every int32 is): the bound `check_penalty` checks."""
  bound = math.log10(float(jnp.finfo(dtype).max))
  if alpha == 0 or _penalty_exponent(alpha, INT32.max) < bound:
    return int(INT32.max)
  low, high = -1, int(INT32.max)  # finite at `low`, inf at `high`
  while high - low > 1:
    mid = (low + high) // 2
    if _penalty_exponent(alpha, mid) < bound:
      low = mid
    else:
      high = mid
  return low


def check_penalty(alpha: float, max_length: int, dtype, name: str = "max_length"):
  """Raises a ValueError when the length penalty at `max_length` (its
  largest value) is inf in `dtype`: every score of that length would be 0
  and outrank the others. `name`: the argument `max_length` comes from."""
  if max_length <= penalty_limit(alpha, dtype):
    return
  exponent = _penalty_exponent(alpha, max_length)
  largest = float(jnp.finfo(dtype).max)
  raise ValueError(
    f"Expected `length_penalty` ({alpha}) and `{name}` ({max_length}) to keep "
    f"the length penalty ((5 + length) / 6) ** length_penalty finite in the "
    f"scores' dtype {jnp.dtype(dtype).name} (at most {largest:.4g}), got about "
    f"1e{exponent:.0f}: lower `length_penalty` or `{name}`."
  )


def scores(slots: Slots, alpha: float) -> jax.Array:
  """Normalized scores ``[count, k]`` of ended slots; ``-inf`` elsewhere."""
  steps = slots.length + slots.eos.astype(jnp.int32)
  value = normalized(slots.logp, steps, alpha)
  return jnp.where(slots.ended & (slots.logp > NEG_INF), value, NEG_INF)


def _gather(a: jax.Array, parent: jax.Array) -> jax.Array:
  """``a[s, parent[s, j]]`` for arrays ``[S, k, ...]``."""
  index = expand_rows(parent, a.ndim)
  return jnp.take_along_axis(a, index, axis=1)


def _write(tokens: jax.Array, token: jax.Array, at: jax.Array, where: jax.Array):
  """Writes ``token [S, k]`` at position `at` (a scalar, or per source
  ``[S]``) of the slots where `where`."""
  at = jnp.reshape(at, (-1, 1, 1))
  hit = (jnp.arange(tokens.shape[-1])[None, None, :] == at) & where[..., None]
  return jnp.where(hit, token[..., None], tokens)


def beam_update(
  slots: Slots,
  log_probs: jax.Array,
  t: jax.Array,
  max_length: jax.Array,
  *,
  eos_id: int,
  alpha: float,
  num_results: int,
) -> tuple[Slots, jax.Array, jax.Array]:
  """One beam step: Paddle's ``beam_search`` over ended and extended slots.

  The candidates of a source are its ended slots (kept as they are, ahead of
  extensions on ties) and every token after each live slot, scored by summed
  log-probability; the best ``k`` become the new slots. An extension by
  `eos` ends its slot; so does any extension that reaches the source's max
  length.

  Args:
    slots: the `Slots` of ``S`` sources.
    log_probs: ``[S, k, vocab]`` the step's log-probabilities.
    t: the step index (tokens generated so far by every live slot): a
      scalar, or int32 ``[S]`` per source (sources that joined the loop at
      different steps, `jaxlod.ops.decode_corpus`).
    max_length: int32 ``[S]``.
    eos_id, alpha, num_results: see `jaxlod.ops.beam_search`.

  Returns:
    ``(slots, parent [S, k], done [S])``: `parent` is the old slot each new
    slot comes from (to reorder the carry); `done` per source, see `finished`.
  """
  size, k, vocab = log_probs.shape
  live = ~slots.ended & (slots.logp > NEG_INF)
  extend = jnp.where(live[..., None], slots.logp[..., None] + log_probs, NEG_INF)
  keep = jnp.where(slots.ended, slots.logp, NEG_INF)
  candidates = jnp.concatenate([keep, extend.reshape(size, k * vocab)], axis=1)
  value, index = lax.top_k(candidates, k)
  kept = index < k
  parent = jnp.where(kept, index, (index - k) // vocab)
  token = jnp.where(kept, eos_id, (index - k) % vocab).astype(jnp.int32)
  alive = value > NEG_INF
  is_eos = ~kept & (token == eos_id) & alive
  grows = ~kept & ~is_eos & alive
  length = _gather(slots.length, parent)
  new = Slots(
    tokens=_write(_gather(slots.tokens, parent), token, t, grows),
    last=jnp.where(grows, token, eos_id).astype(jnp.int32),
    logp=value,
    length=length + grows.astype(jnp.int32),
    ended=kept | is_eos | (grows & (t + 1 >= max_length)[:, None]),
    eos=jnp.where(kept, _gather(slots.eos, parent), is_eos),
  )
  return new, parent, finished(new, max_length, alpha, num_results)


def finished(
  slots: Slots, max_length: jax.Array, alpha: float, num_results: int
) -> jax.Array:
  """Per source: no live slot, or no live slot can beat the results.

  A live slot's descendants score at most
  ``length_normalized(logp, max_length)``
  (log-probabilities are at most 0 and the penalty grows with the length),
  so once that bound is below the `num_results`-th best ended score, and
  that many slots have ended, going on cannot change the results: the
  candidates of live slots then sum below every one of those ended slots,
  which therefore keep their places.
  """
  live = ~slots.ended & (slots.logp > NEG_INF)
  ended = scores(slots, alpha)
  worst_kept = lax.top_k(ended, num_results)[0][:, -1]
  best_live = jnp.max(jnp.where(live, slots.logp, NEG_INF), axis=1)
  bound = normalized(best_live, max_length, alpha)
  return ~jnp.any(live, axis=1) | (bound < worst_kept)


def greedy_update(
  slots: Slots, log_probs: jax.Array, t: jax.Array, max_length: jax.Array, *, eos_id
) -> tuple[Slots, None, jax.Array]:
  """One greedy step: each source takes its most likely token (``k == 1``)."""
  step = log_probs[:, 0, :]
  token = jnp.argmax(step, axis=-1).astype(jnp.int32)[:, None]
  gain = jnp.take_along_axis(step, token, axis=-1)
  is_eos = token == eos_id
  grows = ~is_eos
  ended = is_eos | (t + 1 >= max_length)[:, None]
  new = Slots(
    tokens=_write(slots.tokens, token, t, grows),
    last=jnp.where(grows, token, eos_id).astype(jnp.int32),
    logp=slots.logp + gain.astype(slots.logp.dtype),
    length=slots.length + grows.astype(jnp.int32),
    ended=ended,
    eos=is_eos,
  )
  return new, None, ended[:, 0]


# -- the loop ----------------------------------------------------------------------


Update = Callable[
  [Slots, jax.Array, jax.Array, jax.Array], tuple[Slots, jax.Array | None, jax.Array]
]
# ``step(carry, tokens [b], statics, live [b]) -> (carry, log_probs [b, vocab])``,
# `live` marking the rows of live slots of active sources.
Step = Callable[[Any, jax.Array, Any, jax.Array], tuple[Any, jax.Array]]


def _rows(active: jax.Array, new: Any, old: Any) -> Any:
  """Sources where ``active [sources]`` take `new`; the others keep `old`."""
  return jax.tree.map(lambda a, b: where_rows(active, a, b), new, old)


def advance_sources(
  state: State, t: jax.Array, step: Step, update: Update, go: jax.Array | None = None
) -> State:
  """One step of every source in `state` (a prefix of ``S`` sources).

  `go`: a bool scalar, `False` to mask every source out (the step computes
  and changes nothing, its checks included); `None`: the step runs.
  """
  size, k = state.slots.logp.shape

  def flat(a):
    return a.reshape((size * k,) + a.shape[2:])

  def unflat(a):
    return a.reshape((size, k) + a.shape[1:])

  old = state.slots
  active = ~state.done if go is None else ~state.done & go
  live = active[:, None] & ~old.ended & (old.logp > NEG_INF)
  new_carry, log_probs = step(
    jax.tree.map(flat, state.carry),
    flat(old.last),
    jax.tree.map(flat, state.statics),
    flat(live),
  )
  slots, parent, done = update(
    old, unflat(log_probs).astype(old.logp.dtype), t, state.max_length
  )
  carry = jax.tree.map(unflat, new_carry)
  if parent is not None:
    carry = jax.tree.map(lambda a: _gather(a, parent), carry)
  return state._replace(
    slots=_rows(active, slots, old),
    carry=_rows(active, carry, state.carry),
    done=state.done | (done & active),
  )


def _take(state: State, index: Any) -> State:
  """The sources at `index` (a slice or an int array) of every field."""
  return jax.tree.map(lambda a: a[index], state)


def _put(full: State, prefix: State) -> State:
  """`full` with its first sources replaced by `prefix`.

  A concatenation, not an in-place update: with ``a.at[:n].set(p)`` (or
  `lax.dynamic_update_slice`) here, XLA on CPU (jaxlib 0.10.2) returned
  wrong results for ladders of three or more phases under `jit` (eager was
  right). The in-place update fusion reads the buffer it is writing (slice,
  then gather, then an in-place update of the same buffer), the pattern of
  openxla/xla#49176; ``--xla_cpu_use_fusion_emitters=false`` also avoids it.
  ``test_compaction_never_changes_results`` covers it.
  """
  return jax.tree.map(lambda a, p: jnp.concatenate([p, a[p.shape[0] :]]), full, prefix)


def run(
  state: State,
  step: Step,
  update: Update,
  ladder: tuple[int, ...],
  length_capacity: int,
  chunk: int = 1,
) -> State:
  """Steps every source until it is done; returns the state in caller order.

  Phase ``i`` runs while more than ``ladder[i + 1]`` sources are live, on the
  prefix ``[:ladder[i]]``; between phases the live sources move to the front
  (a stable permutation: their relative order is kept).

  With ``chunk == k > 1``, each iteration of the `lax.while_loop` (whose
  trip count is data, so that on a GPU the host waits for its predicate)
  runs an inner loop of static trip count `k`, the step compiled once. Each
  of its steps runs only while the loop's condition holds, by masking: once
  it fails, the step computes and changes nothing (a `lax.cond` would wait
  on the host for its predicate too).
  """
  # Under `shard_map`, the loops' state varies over one set of mesh axes.
  state, t = vary((state, jnp.zeros((), jnp.int32)), varying_axes(state))
  for i, size in enumerate(ladder):
    smaller = ladder[i + 1] if i + 1 < len(ladder) else 0
    prefix = _take(state, slice(0, size))

    def going(prefix: State, t: jax.Array, smaller: int = smaller) -> jax.Array:
      return (jnp.sum(~prefix.done) > smaller) & (t < length_capacity)

    def cond(loop, going=going):
      return going(*loop)

    def one(_, loop, going=going):
      prefix, t = loop
      if chunk == 1:  # the loop's condition holds
        return advance_sources(prefix, t, step, update), t + 1
      go = going(prefix, t)
      return advance_sources(prefix, t, step, update, go), t + go.astype(t.dtype)

    def body(loop, one=one):
      return one(0, loop) if chunk == 1 else lax.fori_loop(0, chunk, one, loop)

    prefix, t = lax.while_loop(cond, body, (prefix, t))
    if i + 1 < len(ladder):
      prefix = _take(prefix, jnp.argsort(prefix.done, stable=True))
    state = _put(state, prefix)
  return _take(state, jnp.argsort(state.source))
