"""Softmax attention inside each sequence of a LoDTensor, padding-free.

Self-attention costs ``sum(l_i**2)`` cells of real work per head. Padding to
the longest costs ``B * L_max**2``, and the packed layout with a segment-id
mask ``T**2``. The rank table gives the padding-free form: sorted by length,
neighbouring sequences have similar lengths, so tiles of a few sequences
padded to their own longest waste little. An `AttentionPlan` holds a ladder
of static tile shapes ``(length, sequences)``, long tiles of few sequences
and short tiles of many, each compiled once; a `lax.while_loop` per shape
runs as many tiles as the batch's lengths ask for (a trip count that is
data), so every shape is static and the work follows the lengths.

A tile of phase ``k`` starts at the first sequence (in rank order) that no
earlier tile took, and takes the next ``sequences`` of them: the last tile
of a phase fills its free slots with the next phase's (shorter) sequences
rather than leaving them empty. Each tile gathers its sequences' rows,
padded to the tile's length, computes a masked softmax attention and
scatters its rows back to their packed rows, in place in the loop's
buffer. Nothing of size ``[tokens, tokens]`` or ``[B, heads, L_max,
L_max]`` is ever formed.

The gradient is a `jax.custom_vjp` over the same tiles, which recomputes
each tile's probabilities from the saved inputs. The rows of a sequence
are read and written by its own tile only, so every gradient is a scatter,
never a sum, and it goes over the saved rows it replaces: the gradients
take the place of the saved query, key and value, with no buffers of their
own. Padding positions are selected away (`jnp.where`), never multiplied
by zero, so nothing of another sequence, not even an inf or a NaN, reaches
a sequence's values or gradients. Dropout drops weights inside the tiles,
from bits that a weight's sequence, head, row and column give (the backward
pass draws the same), so the weights kept do not depend on the tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxlod._checks import (
  check_bool,
  check_rate,
  finite_float32,
  is_float_dtype,
  is_key,
  require,
  static_float,
  static_int,
  where_rows,
)
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import check_same_lod
from jaxlod.ops._loop._plan import plan_backend
from jaxlod.ops._rank import default_ladder, nan_unless


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
  """How `sequence_attention` tiles a batch. Static and hashable;
  `default_attention_plan` picks one per backend.

  The tile lengths are a geometric ladder from the batch's time capacity
  down (`jaxlod.ops.default_ladder` with `ratio`, `minimum` and
  `multiple`), and a tile of length ``L`` holds ``max(1, tile_tokens //
  L)`` sequences: a few long sequences, or many short ones.

  Attributes:
    tile_tokens: the rows of a tile (sequences times length), at least 1.
      Smaller tiles waste less on the partly filled last tile of each
      length; larger ones run fewer, larger products.
    ratio: the step between tile lengths, > 1. A sequence of length ``l``
      runs in a tile of length below ``max(ratio * l, l + multiple)`` (or
      the smallest), so a long sequence's cells are at most about
      ``ratio**2`` of its own; the last tile of a length may also take the
      next, shorter sequences.
    minimum: the shortest tile length, at least 1.
    multiple: tile lengths below the longest are multiples of it.
    weights: the most attention weights (cells, all heads together) a
      tile computes at once, at least 1: a tile with more runs its heads in
      the fewest equal groups whose weights each stay within it (one head
      a group where even one head's pass it), one group after another.
      It bounds the temporaries of the longest tiles (one sequence of
      1,024 rows and 8 heads is 8,388,608 weights, 32 MiB in float32, for
      each of the weights, their gradient and the products between).
    kernel: the attention of one tile. ``"xla"``: products and a masked
      softmax written in `jax.numpy`. ``"dot_product_attention"``:
      `jax.nn.dot_product_attention` with a mask (XLA's or cuDNN's fused
      attention, where the backend has one) for the forward pass; the
      backward pass is the same either way. Its softmax runs in float32,
      so float64 inputs get float32's accuracy. With dropout, which it does
      not take, the tiles run ``"xla"``'s forward pass.

  Raises:
    TypeError, ValueError: for sizes that are not ints >= 1, a `ratio` not
      above 1 or an unknown `kernel`.

  Example:
    >>> from jaxlod.ops import AttentionPlan
    >>> AttentionPlan(tile_tokens=64).tiles(32)
    ((32, 2), (28, 2), (24, 2), (20, 3), (16, 4), (12, 5), (8, 8), (4, 16))
  """

  tile_tokens: int = 256
  ratio: float = 1.25
  minimum: int = 4
  multiple: int = 4
  weights: int = 2**20
  kernel: str = "xla"

  def __post_init__(self):
    for name in ("tile_tokens", "minimum", "multiple", "weights"):
      object.__setattr__(self, name, static_int(getattr(self, name), name, 1))
    ratio = static_float(self.ratio, "ratio")
    if not ratio > 1:
      raise ValueError(f"Expected `ratio` > 1, got {ratio}.")
    object.__setattr__(self, "ratio", ratio)
    if self.kernel not in _KERNELS:
      raise ValueError(
        f"Expected `kernel` to be one of {sorted(_KERNELS)}, got {self.kernel!r}."
      )

  def tiles(self, time_capacity: int) -> tuple[tuple[int, int], ...]:
    """The tile shapes ``(length, sequences)``, longest first, for
    sequences of at most `time_capacity` rows (none for 0)."""
    time_capacity = static_int(time_capacity, "time_capacity", 0)
    if time_capacity == 0:
      return ()
    lengths = default_ladder(
      time_capacity, ratio=self.ratio, minimum=self.minimum, multiple=self.multiple
    )
    return tuple((n, max(1, self.tile_tokens // n)) for n in lengths)


def default_attention_plan(backend: str | None = None) -> AttentionPlan:
  """The `AttentionPlan` for `backend` (default: `jax.default_backend()`).

  * ``"cpu"``: ``AttentionPlan()``: tiles of 256 rows, lengths a ratio of
    1.25 apart (``benchmarks/sequence_attention.py``).
  * ``"gpu"``, ``"tpu"`` and any other: tiles of 1,024 rows, where larger
    products cost little more than small ones, with XLA's products (the
    plan's other kernel is tested on every backend and chosen by passing
    it).

  Raises:
    TypeError: for a `backend` that is not a string.
  """
  backend = plan_backend(backend)
  return AttentionPlan() if backend == "cpu" else AttentionPlan(tile_tokens=1024)


# -- the rows of a tile ---------------------------------------------------------------


class _Side(typing.NamedTuple):
  """One side's sequences (the query's, or the key's and value's) in rank
  order, longest first (by the longer of a pair's query and key). A tile
  takes a run of ranks; its rows are read from the packed rows and its
  results written back to them.

  Attributes:
    packed: ``[count]`` where each rank's rows start in the packed rows.
    lengths: ``[count]`` each rank's length.
    sequence: ``[count]`` the batch's sequence at each rank.
  """

  packed: jax.Array
  lengths: jax.Array
  sequence: jax.Array


def _side(offsets, order) -> _Side:
  """The `_Side` of last-level `offsets` ``[count + 1]``, `order` the
  sequence at each rank."""
  return _Side(offsets[order], jnp.diff(offsets)[order], order)


def _real_rows(x: jax.Array, real: jax.Array) -> jax.Array:
  """`x` with its rows from row `real` on zero."""
  return where_rows(jnp.arange(x.shape[0]) < real, x, 0)


@dataclasses.dataclass(frozen=True)
class _Window:
  """The rows of one tile on one side: from rank `first`, `sequences`
  sequences padded to `length`."""

  side: _Side
  first: jax.Array
  length: int
  sequences: int

  def _slots(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each slot's packed row ``[s, l]`` (meaningful where the slot holds a
    row), whether it holds a row of a sequence ``[s, l]``, and each
    sequence's rank ``[s]`` (the last rank for a slot past the last)."""
    count = self.side.lengths.shape[0]
    rank = self.first + jnp.arange(self.sequences)
    live = rank < count
    rank = jnp.minimum(rank, count - 1)
    n = jnp.where(live, self.side.lengths[rank], 0)
    steps = jnp.arange(self.length)
    return self.side.packed[rank][:, None] + steps, steps < n[:, None], rank

  @property
  def mask(self) -> jax.Array:
    """Which slots ``[s, l]`` hold a row of a sequence."""
    return self._slots()[1]

  @property
  def ranks(self) -> jax.Array:
    """Each of the tile's sequences' rank ``[s]``."""
    return self._slots()[2]

  def read(self, x: jax.Array, dtype: Any) -> jax.Array:
    """The tile's rows of the packed rows `x` as `dtype`, ``[s, heads, l,
    dim]``, zero at an empty slot (selected, never multiplied: another
    sequence's inf or NaN stays out)."""
    index, mask, _ = self._slots()
    rows = x[jnp.clip(index, 0, x.shape[0] - 1)].astype(dtype)
    return jnp.where(mask[..., None, None], rows, 0).transpose(0, 2, 1, 3)

  def write(self, x: jax.Array, tile: jax.Array) -> jax.Array:
    """Packed rows `x` with the tile's rows `tile` ``[s, heads, l, dim]``
    written to the rows they came from (a scatter, in place in a loop's
    buffer); no other row of `x` changes."""
    index, mask, _ = self._slots()
    index = jnp.where(mask, index, x.shape[0]).reshape(-1)
    rows = tile.transpose(0, 2, 1, 3).reshape(-1, *x.shape[1:]).astype(x.dtype)
    return x.at[index].set(rows, mode="drop")


def _key_bias(k_mask, causal: bool, dtype: Any) -> jax.Array:
  """What a tile adds to its scores: 0 at a real key of the row's sequence
  (at or before the row when `causal`), -inf elsewhere; ``[s, 1, 1, l]``
  (``[s, 1, l, l]`` when causal)."""
  keep = k_mask[:, None, None, :]
  if causal:
    n = k_mask.shape[1]
    keep = keep & (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :])
  return jnp.where(keep, jnp.zeros((), dtype), -jnp.inf)


def _dropout(q_win: _Window, rng: Any, heads: jax.Array, rate: float, dtype: Any):
  """What dropout at `rate` multiplies a tile's weights of the heads
  `heads` ``[h]`` by, ``[s, h, l, l]``: ``1 / (1 - rate)`` at a kept cell,
  0 at a dropped one. Cell ``(i, j)`` of head ``h`` of the batch's
  sequence ``n`` is kept where element ``j`` of
  ``jax.random.bits(fold_in(fold_in(fold_in(rng, n), h), i), (j + 1,))``
  is at least ``rate * 2**32``, so that no sequence's cells depend on the
  plan, its head groups or the other sequences."""
  length = q_win.length
  shape = (q_win.sequences, heads.shape[0], length, length)
  if rate >= 1:
    return jnp.zeros(shape, dtype)
  sequence = q_win.side.sequence[q_win.ranks]

  def row(n, h, i):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, n), h), i)
    return jax.random.bits(key, (length,), jnp.uint32)

  for axes in ((None, None, 0), (None, 0, None), (0, None, None)):
    row = jax.vmap(row, axes)
  bits = row(sequence, heads, jnp.arange(length))
  keep = bits >= jnp.uint32(min(int(rate * 2**32), 2**32 - 1))
  return jnp.where(keep, jnp.asarray(1 / (1 - rate), dtype), jnp.zeros((), dtype))


def _heads_first(x: jax.Array) -> jax.Array:
  """``[s, l, heads, dim]`` as ``[s, heads, l, dim]`` (and back)."""
  return x.transpose(0, 2, 1, 3)


def _scores(q_t, k_t, bias, scale: float) -> jax.Array:
  """A tile's scores ``[s, heads, l, l]`` (heads-first operands), -inf
  where a cell is not real."""
  q_t = q_t * jnp.asarray(scale, q_t.dtype)
  return jnp.einsum("shqd,shkd->shqk", q_t, k_t) + bias


def _xla_tile(
  q_t, k_t, v_t, bias, scale: float, drop: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """One tile's attention (heads-first operands): the output ``[s, heads,
  l, dim]`` and each row's log-sum-exp ``[s, heads, l]`` of its real
  scores (-inf for a row with no key; its output is zero). `drop`
  ``[s, heads, l, l]`` multiplies the weights (dropout) before the values."""
  scores = _scores(q_t, k_t, bias, scale)
  top = jnp.max(scores, axis=-1)
  top = jnp.where(jnp.isfinite(top), top, 0)
  p = jnp.exp(scores - top[..., None])
  total = jnp.sum(p, axis=-1)
  weights = p if drop is None else p * drop
  out = jnp.einsum("shqk,shkd->shqd", weights, v_t)
  out = out / jnp.where(total > 0, total, 1)[..., None]
  return out, top + jnp.log(total)


def _fused_tile(q_t, k_t, v_t, bias, scale: float) -> tuple[jax.Array, jax.Array]:
  """One tile's attention through `jax.nn.dot_product_attention` (XLA's or
  cuDNN's), as `_xla_tile` returns it; the log-sum-exp is computed apart
  from the scores (the fused call does not return it)."""
  mask = jnp.broadcast_to(
    jnp.isfinite(bias), (*q_t.shape[:2], q_t.shape[2], k_t.shape[2])
  )
  out = jax.nn.dot_product_attention(
    _heads_first(q_t), _heads_first(k_t), _heads_first(v_t), mask=mask, scale=scale
  )
  scores = _scores(q_t.astype(jnp.float32), k_t.astype(jnp.float32), bias, scale)
  lse = jax.nn.logsumexp(scores, axis=-1)
  keyed = jnp.isfinite(lse)[..., None]
  return jnp.where(keyed, _heads_first(out), jnp.zeros((), out.dtype)), lse


_KERNELS = {"xla": _xla_tile, "dot_product_attention": _fused_tile}


# -- the loops over tiles ------------------------------------------------------------


def _schedule(q_offsets, k_offsets, tiles):
  """The rank order of the sequences (longest of query and key first, a
  stable sort), each side's `_Side`, and ``ends`` ``[phases]``: the ranks a
  phase's tiles cover up to (the sequences longer than the next phase's
  tiles)."""
  longest = jnp.maximum(jnp.diff(q_offsets), jnp.diff(k_offsets))
  order = jnp.argsort(-longest, stable=True)
  below = jnp.asarray([n for n, _ in tiles[1:]] + [0], longest.dtype)
  ends = jnp.sum(longest[None, :] > below[:, None], axis=1)
  return _side(q_offsets, order), _side(k_offsets, order), ends


def _over_tiles(sides, ends, tiles, body, carry):
  """`carry` through ``body(q_window, k_window, carry)`` for every tile:
  per tile shape one `lax.while_loop` from the first rank no earlier tile
  took, while ranks remain that need this shape or a longer one."""
  start = jnp.zeros((), ends.dtype)
  for k, (length, sequences) in enumerate(tiles):

    def step(state, length=length, sequences=sequences):
      at, inner = state
      q_win, k_win = (_Window(side, at, length, sequences) for side in sides)
      return at + sequences, body(q_win, k_win, inner)

    end = ends[k]
    start, carry = lax.while_loop(lambda s, end=end: s[0] < end, step, (start, carry))
  return carry


def _groups(plan: AttentionPlan, q_win: _Window, k_win: _Window, heads: int) -> int:
  """The groups the tile of windows `q_win` and `k_win` runs its `heads`
  in: the fewest (a divisor of `heads`) whose weights each hold at most
  ``plan.weights`` cells, or one head a group."""
  per_head = q_win.sequences * q_win.length * k_win.length
  fits = (g for g in range(1, heads + 1) if heads % g == 0)
  return next((g for g in fits if heads // g * per_head <= plan.weights), heads)


def _by_heads(fn, groups: int, *arrays: jax.Array):
  """``fn(*arrays, heads)`` over `groups` equal groups of the heads (axis
  1 of each array ``[s, heads, ...]``; `heads` the group's head numbers),
  one group after another (`lax.map`); the outputs ``[s, h, ...]`` joined
  along the heads again."""
  count = arrays[0].shape[1]
  if groups == 1:
    return fn(*arrays, jnp.arange(count))

  def split(a):
    return a.reshape(a.shape[0], groups, count // groups, *a.shape[2:]).swapaxes(0, 1)

  heads = jnp.arange(count).reshape(groups, count // groups)
  outs = lax.map(lambda xs: fn(*xs), (*map(split, arrays), heads))

  def join(o):
    o = o.swapaxes(0, 1)
    return o.reshape(o.shape[0], count, *o.shape[3:])

  return jax.tree.map(join, outs)


def _compute_dtype(dtype: Any) -> Any:
  """The softmax's and the products' dtype: float32 at least."""
  return jnp.promote_types(dtype, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_offsets, k_offsets, rng, static):
  """The attention of every sequence, values ``[q_rows, heads, head_dim]``;
  `rng` the dropout's key (`None`: no dropout), `static` ``(tiles, causal,
  scale, plan, rate)``."""
  return _attention_fwd(q, k, v, q_offsets, k_offsets, rng, static)[0]


def _attention_fwd(q, k, v, q_offsets, k_offsets, rng, static):
  """`_attention` and its residuals: the inputs, the output and each row's
  log-sum-exp ``[q_rows, heads, 1]``."""
  tiles, causal, scale, plan, rate = static
  q_side, k_side, ends = _schedule(q_offsets, k_offsets, tiles)
  dtype = _compute_dtype(q.dtype)
  operand = dtype if plan.kernel == "xla" else q.dtype

  def body(q_win, k_win, carry):
    out, lse = carry
    q_t = q_win.read(q, operand)
    k_t, v_t = k_win.read(k, operand), k_win.read(v, operand)
    bias = _key_bias(k_win.mask, causal, dtype)

    def attend(q_t, k_t, v_t, heads):
      if rng is None:
        return _KERNELS[plan.kernel](q_t, k_t, v_t, bias, scale)
      # `jax.nn.dot_product_attention` has no dropout.
      drop = _dropout(q_win, rng, heads, rate, dtype)
      return _xla_tile(q_t, k_t, v_t, bias, scale, drop)

    groups = _groups(plan, q_win, k_win, q.shape[1])
    o_t, lse_t = _by_heads(attend, groups, q_t, k_t, v_t)
    return q_win.write(out, o_t), q_win.write(lse, lse_t[..., None])

  out = jnp.zeros(q.shape, q.dtype)
  lse = jnp.zeros((q.shape[0], q.shape[1], 1), dtype)
  out, lse = _over_tiles((q_side, k_side), ends, tiles, body, (out, lse))
  return out, (q, k, v, out, lse, q_offsets, k_offsets, rng)


def _attention_bwd(static, residuals, g):
  """The gradients of `_attention` for `g` ``[q_rows, heads, head_dim]``:
  each tile's weights recomputed from the saved log-sum-exp, then the
  products of the softmax's gradient (``ds = p * (dp - delta)``, with
  ``delta`` a row's ``<g, out>``). A tile writes its rows' gradients over
  the rows of the saved query, key and value that it has read: no other
  tile reads them, so the gradients need no buffers of their own. Each
  gradient goes over rows it is computed from, which orders the write
  after the read (XLA copies a buffer that it cannot prove read before it
  is written, on every tile): the query's over the query, the key's over
  the value (through ``dp``) and the value's over the key (through ``p``),
  the key and the value having one shape and one LoD. Padding rows are
  zeroed at the end."""
  tiles, causal, scale, plan, rate = static
  q, k, v, out, lse, q_offsets, k_offsets, rng = residuals
  q_side, k_side, ends = _schedule(q_offsets, k_offsets, tiles)
  dtype = _compute_dtype(q.dtype)
  g = jnp.asarray(g)
  # delta_i = sum_j p_ij dp_ij = <g_i, out_i>, per row and head.
  delta = jnp.sum(g.astype(dtype) * out.astype(dtype), axis=-1, keepdims=True)

  def body(q_win, k_win, rows):
    """One tile's gradients, written over its own rows of ``(q, k, v)``
    (the key's over the value's rows and the value's over the key's)."""
    q, k, v = rows
    q_t, g_t = q_win.read(q, dtype), q_win.read(g, dtype)
    k_t, v_t = k_win.read(k, dtype), k_win.read(v, dtype)
    # A row with no key has lse -inf and p 0 (exp(-inf - 0) with lse 0).
    lse_t = q_win.read(lse, dtype)[..., 0]
    lse_t = jnp.where(jnp.isfinite(lse_t), lse_t, 0)
    delta_t = q_win.read(delta, dtype)[..., 0]
    bias = _key_bias(k_win.mask, causal, dtype)

    def gradients(q_t, g_t, k_t, v_t, lse_t, delta_t, heads):
      p = jnp.exp(_scores(q_t, k_t, bias, scale) - lse_t[..., None])
      dp = jnp.einsum("shqd,shkd->shqk", g_t, v_t)
      weights = p
      if rng is not None:
        drop = _dropout(q_win, rng, heads, rate, dtype)
        weights, dp = p * drop, dp * drop
      ds = p * (dp - delta_t[..., None]) * jnp.asarray(scale, dtype)
      return (
        jnp.einsum("shqk,shkd->shqd", ds, k_t),
        jnp.einsum("shqk,shqd->shkd", ds, q_t),
        jnp.einsum("shqk,shqd->shkd", weights, g_t),
      )

    groups = _groups(plan, q_win, k_win, q.shape[1])
    dq, dk, dv = _by_heads(gradients, groups, q_t, g_t, k_t, v_t, lse_t, delta_t)
    return q_win.write(q, dq), k_win.write(k, dv), k_win.write(v, dk)

  gq, gv, gk = _over_tiles((q_side, k_side), ends, tiles, body, (q, k, v))
  gq = _real_rows(gq, q_offsets[-1])
  return (
    gq,
    _real_rows(gk, k_offsets[-1]),
    _real_rows(gv, k_offsets[-1]),
    None,
    None,
    None,
  )


_attention.defvjp(_attention_fwd, _attention_bwd)


# -- the public op -------------------------------------------------------------------


def sequence_attention(
  query: LoDTensor,
  key: LoDTensor,
  value: LoDTensor,
  *,
  causal: bool = False,
  scale: float | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  plan: AttentionPlan | None = None,
) -> LoDTensor:
  """Softmax attention of every query row over the key rows of its own
  sequence, with no padding to the longest.

  The attention runs over the last LoD level: query sequence ``i`` attends
  to key sequence ``i`` (a 2-level LoD attends within its innermost
  sequences). `key` and `value` share one LoD. With the query's LoD it is
  self-attention; with another of the same number of sequences,
  cross-attention. The work is the real cells, ``sum(lq_i * lk_i)``, times
  the plan's padding of each tile (`AttentionPlan`), and no temporary holds
  more than one tile's ``[sequences, heads, length, length]`` weights.
  Jittable: every shape is static, so one compile serves every batch of
  the same capacities; differentiable through a `jax.custom_vjp` that
  recomputes each tile's weights.

  Args:
    query: a LoDTensor, values ``[q_token_capacity, heads, head_dim]``
      (float: float32, float64 or bfloat16; the softmax and the products
      run in float32 at least).
    key: a LoDTensor, values ``[k_token_capacity, heads, head_dim]`` of the
      query's dtype, with as many last-level sequences as the query.
    value: a LoDTensor with the key's LoD and values of the key's shape
      and dtype.
    causal: a query row attends to the key rows at its own position and
      before (positions counted from each sequence's start).
    scale: multiplies the scores (a float, finite in float32); `None`:
      ``1 / sqrt(head_dim)``.
    dropout_rate: the rate of the dropout on the attention weights, in
      ``[0, 1]``: each weight (after the softmax) is zeroed with this
      probability and the others are multiplied by ``1 / (1 - rate)``, as
      Flax's ``dot_product_attention`` drops them. Weight ``(i, j)`` of head
      ``h`` of the last-level sequence ``n`` is kept where element ``j`` of
      ``jax.random.bits(fold_in(fold_in(fold_in(dropout_rng, n), h), i),
      (j + 1,))`` (``uint32``) is at least ``rate * 2**32``: which weights
      drop depends on the key, the sequence, the head and the cell only,
      never on the plan or on the other sequences. 0 (the default): no
      dropout.
    dropout_rng: the dropout's JAX key (typed, or raw ``uint32 [2]``);
      needed when `dropout_rate` > 0, unused when it is 0.
    plan: the tiles; `None`: `default_attention_plan` for the backend.

  Returns:
    A LoDTensor with the query's LoD and values of the query's shape and
    dtype. A row of an empty key sequence (or with no key at or
    before it, causal) and every padding row are zero, in values and
    gradients.

  Raises:
    TypeError: for an argument that is not a LoDTensor, non-float or
      differing dtypes, a `dropout_rng` that is not a JAX key, or a `plan`
      that is not an `AttentionPlan`.
    ValueError: for values that are not 3-D, a `scale` that is not finite
      in float32, a `dropout_rate` outside ``[0, 1]`` or above 0 with no
      `dropout_rng`, heads or head_dim that differ,
      a `key` and `value` with different LoDs, or another number of
      sequences in the key than in the query (eagerly; under `jit` LoDs
      that differ give NaN and `jaxlod.Fault.INPUT`).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_attention
    >>> x = LoDTensor.from_lengths(np.ones((5, 1, 2), np.float32), [[3, 2]])
    >>> rows = np.arange(5.0, dtype=np.float32).reshape(5, 1, 1).repeat(2, -1)
    >>> v = x.with_values(rows)
    >>> sequence_attention(x, x, v).values[:, 0, 0].tolist()
    [1.0, 1.0, 1.0, 3.5, 3.5]
    >>> sequence_attention(x, x, v, causal=True).values[:, 0, 0].tolist()
    [0.0, 0.5, 1.0, 3.0, 3.5]
  """
  query, key, value = _checked(query, key, value)
  check_bool(causal, "causal")
  plan = _resolve_plan(plan)
  head_dim = query.values.shape[2]
  scale = 1 / math.sqrt(head_dim) if scale is None else finite_float32(scale, "scale")
  rate, rng = _checked_dropout(dropout_rate, dropout_rng)
  same = check_same_lod(key, value, "key", "value", "sequence_attention")
  count = require(
    query.num_sequences() == key.num_sequences(),
    "Expected `key` to have as many last-level sequences as `query`; `query` "
    "has {q}, `key` {k}.",
    traced="sequence_attention: `key` and `query` have different numbers of "
    "last-level sequences.",
    q=query.num_sequences(),
    k=key.num_sequences(),
  )
  time = max(query.capacity.time[-1], key.capacity.time[-1])
  static = (plan.tiles(time), causal, scale, plan, rate)
  arrays = (query.values, key.values, value.values, query.offsets[-1], key.offsets[-1])
  out = _attention(*map(jnp.asarray, arrays), rng, static)
  ok = same if count is True else count if same is True else same & count
  out = query.with_values(nan_unless(ok, out))
  return with_faults(out, fault_unless(ok, Fault.INPUT), key, value)


def _checked_dropout(rate: Any, rng: Any) -> tuple[float, Any]:
  """The dropout's rate in ``[0, 1]`` and its key (`None` at rate 0)."""
  rate = check_rate(rate, "dropout_rate")
  if rng is not None and not is_key(rng):
    raise TypeError(
      "Expected `dropout_rng` to be a JAX key (jax.random.key(0)) or None, got "
      f"{type(rng).__name__} of shape {getattr(rng, 'shape', None)}."
    )
  if rate > 0 and rng is None:
    raise ValueError(f"Expected a `dropout_rng` with `dropout_rate` {rate}, got None.")
  return rate, rng if rate > 0 else None


def _resolve_plan(plan: Any) -> AttentionPlan:
  """`plan`, or the backend's default for `None`."""
  if plan is None:
    return default_attention_plan()
  if not isinstance(plan, AttentionPlan):
    raise TypeError(
      "Expected `plan` to be a jaxlod.ops.AttentionPlan or None, got "
      f"{type(plan).__name__}."
    )
  return plan


def _checked(query: Any, key: Any, value: Any) -> tuple[LoDTensor, ...]:
  """`sequence_attention`'s tensors checked: LoDTensors with values ``[rows,
  heads, dim]`` of one float dtype, the query's and the key's heads and
  head_dim equal (the key's and the value's too), and as many last-level sequence
  slots in the key as in the query."""
  named = {"query": query, "key": key, "value": value}
  for name, x in named.items():
    check_lod(x, name)
    if x.values.ndim != 3:
      raise ValueError(
        f"Expected `{name}.values` to be [token_capacity, heads, head_dim], got "
        f"shape {x.values.shape}."
      )
    if not is_float_dtype(x.values.dtype):
      raise TypeError(f"Expected `{name}` to have a float dtype, got {x.values.dtype}.")
    if x.values.dtype != query.values.dtype:
      raise TypeError(
        f"Expected `{name}` to have the dtype of `query`, {query.values.dtype}, "
        f"got {x.values.dtype}."
      )
  heads, dim = query.values.shape[1:]
  for name in ("key", "value"):
    if named[name].values.shape[1:] != (heads, dim):
      raise ValueError(
        f"Expected `{name}` to have the heads and head_dim of `query`, "
        f"{(heads, dim)}, got {named[name].values.shape[1:]}."
      )
  slots = (query.capacity.sequences[-1], key.capacity.sequences[-1])
  if slots[0] != slots[1]:
    raise ValueError(
      "Expected `key` to have the last-level count capacity of `query`, "
      f"{slots[0]}, got {slots[1]}."
    )
  return query, key, value
