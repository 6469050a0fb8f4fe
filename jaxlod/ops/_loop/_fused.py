"""The fused recurrence: a separable cell's whole padding-free time loop as one
Pallas kernel launch, forward and backward.

A *separable* cell (`Separable`: Flax's ``LSTMCell``, ``OptimizedLSTMCell``,
``GRUCell``, ``SimpleCell``, ``MGUCell`` and the NNX twins) computes ``x @
w_in`` and ``h @ w_rec`` and mixes them in its gates. `fused_rnn` runs it
as cuDNN's persistent kernels do, without padding:

  * the input projection of every packed row is one product before the
    kernel, ``x.values @ w_in + b_in``;
  * the kernel runs a grid of programs, one per *tile* of ``tile``
    sequences in rank order (the rank table's: longest first). Each
    program keeps its rows' carries on chip, reads the recurrent weights,
    and runs ``h @ w_rec`` and the gate math for exactly as many steps as
    its own longest sequence: a tile of short sequences stops early, and
    no program works for a finished tile;
  * the backward kernel runs each tile's steps in reverse from the saved
    carries and writes the cotangents of the projected inputs and of the
    recurrent products; the weight gradients are then two large products
    over all rows, ``x.T @ d_xp`` and ``h_prev.T @ d_hp``.

The kernels read and write a *tile-major* layout (`TileLayout`): the slots
of tile ``i`` are contiguous, step after step, ``tile`` rows a step, so each
program owns its slots and no two programs write the same row. Rows of a
tile that have ended keep their carry and write to slots that no row reads.
The slots number at most ``token_capacity + tile * time_capacity``: each
tile's longest sequence is no longer than the previous tile's shortest.

On a CPU the kernels run in Pallas's interpret mode (the same kernel, as
XLA operations); on a GPU they compile through Pallas's GPU backend.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxlod._checks import check_bool, static_int
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import check_rows
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.ops._loop._hoisted import Separable, dense, result_dtype
from jaxlod.ops._rank import RankTable, check_pair, nan_unless, ranked_level


@dataclasses.dataclass(frozen=True)
class TileLayout:
  """Index maps between a LoDTensor's rows and the kernels' tile-major slots.

  Attributes:
    lengths: int32 ``[tiles * tile]``, the lengths in rank order (0 past the
      count capacity).
    tile_steps: int32 ``[tiles]``, each tile's steps (its longest length).
    tile_starts: int32 ``[tiles]``, each tile's first slot.
    slot_rows: int32 ``[slots]``, each slot's LoDTensor row (0 where unused).
    slot_valid: bool ``[slots]``, whether a row runs in the slot.
    row_slots: int32 ``[token_capacity]``, each row's slot (0 for padding).
    row_valid: bool ``[token_capacity]``, whether the row is data.
    previous: int32 ``[slots]``, the slot of the same row's previous step,
      or ``slots + rank`` at its first step (its initial carry).
  """

  lengths: jax.Array
  tile_steps: jax.Array
  tile_starts: jax.Array
  slot_rows: jax.Array
  slot_valid: jax.Array
  row_slots: jax.Array
  row_valid: jax.Array
  previous: jax.Array


def tile_layout(x: LoDTensor, table: RankTable, tile: int, reverse: bool) -> TileLayout:
  """The tile-major layout of `x`'s last level, ranked by `table`, in tiles
  of `tile` ranks; with `reverse` each sequence's step ``t`` is its row
  ``n - 1 - t``."""
  offsets, tokens = x.offsets[-1], x.capacity.tokens
  count = table.count_capacity
  tiles = max(1, math.ceil(count / tile))
  lengths = jnp.zeros((tiles * tile,), jnp.int32).at[:count].set(table.lengths)
  steps = lengths[::tile]
  starts = tile * (jnp.cumsum(steps, dtype=jnp.int32) - steps)
  ends = starts + tile * steps
  slots = slot_count(tokens, table.time_capacity, tile)
  last = max(count - 1, 0)
  order = jnp.asarray(table.order) if count else jnp.zeros((1,), jnp.int32)
  ranks = jnp.asarray(table.ranks) if count else jnp.zeros((1,), jnp.int32)

  # Slot -> (tile i, step t, row r of the tile) -> rank -> LoDTensor row.
  s = jnp.arange(slots, dtype=jnp.int32)
  i = jnp.clip(jnp.searchsorted(ends, s, side="right"), 0, tiles - 1)
  i = i.astype(jnp.int32)
  t, r = (s - starts[i]) // tile, (s - starts[i]) % tile
  rank = i * tile + r
  seq = order[jnp.clip(rank, 0, last)]
  start, n = offsets[seq], offsets[seq + 1] - offsets[seq]
  row = start + (n - 1 - t if reverse else t)
  valid = (s < ends[-1]) & (rank < count) & (t < lengths[rank])
  previous = jnp.where(t > 0, s - tile, slots + rank)

  # LoDTensor row -> (sequence, step) -> slot.
  rows = jnp.arange(tokens, dtype=jnp.int32)
  seq_of = jnp.clip(jnp.searchsorted(offsets, rows, side="right") - 1, 0, last)
  step = offsets[seq_of + 1] - 1 - rows if reverse else rows - offsets[seq_of]
  rank_of = ranks[seq_of]
  row_slot = starts[rank_of // tile] + step * tile + rank_of % tile
  row_valid = rows < offsets[-1]
  return TileLayout(
    lengths,
    steps,
    starts,
    jnp.where(valid, row, 0),
    valid,
    jnp.where(row_valid, row_slot, 0),
    row_valid,
    previous,
  )


def slot_count(tokens: int, time_capacity: int, tile: int) -> int:
  """The slots of a tile-major layout: every tile's longest sequence is no
  longer than the previous tile's shortest, so the tiles past the first
  hold at most the tokens, and the first at most ``tile * time_capacity``."""
  return max(tokens + tile * time_capacity, tile)


# Recurrent weights up to this size are read once per program and kept on
# chip for all its steps; larger ones are read at every step (from L2).
RESIDENT_BYTES = 96 * 1024


def _product(h: jax.Array, w: jax.Array, cell: Separable, compute: Any) -> jax.Array:
  """``h [tile, hidden] @ w [hidden, width]`` as the cell's Dense computes
  it, or with operands in `compute` (bfloat16) and a wider result."""
  dtype = result_dtype(h, w, dtype=cell.dtype)
  operand = dtype if compute is None else compute
  return jax.lax.dot_general(
    h.astype(operand),
    w.astype(operand),
    (((1,), (0,)), ((), ())),
    precision=cell.precision,
    preferred_element_type=dtype,
  )


def _recurrent(
  h: jax.Array, w: tuple, bias: tuple, cell: Separable, compute: Any
) -> tuple[jax.Array, ...]:
  """The recurrent product ``h @ w_rec + b_rec``, part by part."""
  return tuple(
    _product(h, w_k, cell, compute) + b_k for w_k, b_k in zip(w, bias, strict=True)
  )


def _columns(ref: Any, rows: Any, parts: int, size: int) -> tuple[jax.Array, ...]:
  """``ref[rows]``'s column blocks of `size`, one per part (loaded apart:
  Pallas's GPU backend does not slice arrays in registers)."""
  return tuple(ref[rows, pl.ds(k * size, size)] for k in range(parts))


def _forward_kernel(
  cell: Separable, treedef: Any, tile: int, compute: Any, resident: bool
):
  """The forward Pallas kernel of `fused_loop`: one program per tile.

  Args:
    cell: the separable cell.
    treedef: the pytree structure of the carry (its leaves come as refs).
    tile: the sequences (rows) of one program.
    compute: the operand dtype of the recurrent products, or `None`.
    resident: read the recurrent weights once per program and keep them for
      all its steps (else at every step).

  Returns:
    ``kernel(lengths, steps, starts, xp, w, b, *init, y, *saved, *final)``,
    a kernel over refs for `pl.pallas_call` (see its docstring).
  """
  leaves, parts = treedef.num_leaves, cell.parts
  size = cell.w_rec.shape[1] // parts

  def kernel(lengths_ref, steps_ref, starts_ref, xp_ref, w_ref, b_ref, *refs):
    """One grid step: the whole time loop of tile ``i`` (``pl.program_id``).

    Reads ``lengths_ref`` int32 ``[tiles * tile]`` (the lengths in rank
    order), ``steps_ref`` and ``starts_ref`` int32 ``[tiles]`` (each tile's
    steps and first slot), ``xp_ref [slots, width]`` (the projected
    inputs), ``w_ref [hidden, width]``, ``b_ref [1, width]`` (the recurrent
    bias) and the initial carry's leaf refs ``[tiles * tile, size]``
    (`refs` first). Runs the tile's ``steps_ref[i]`` steps; a row past its
    length keeps its carry. Writes ``y_ref [slots, out]`` (each step's
    outputs, zero for ended rows), one ``[slots, size]`` ref per carry leaf
    (the carry after each step) and the final carry's leaf refs
    ``[tiles * tile, size]``, all at the tile's own slots and rows.
    """
    init_refs, y_ref = refs[:leaves], refs[leaves]
    saved_refs, final_refs = refs[leaves + 1 : 2 * leaves + 1], refs[2 * leaves + 1 :]
    i = pl.program_id(0)
    rows = pl.ds(i * tile, tile)
    live_until = lengths_ref[rows][:, None]
    base = starts_ref[i]
    bias = _columns(b_ref, slice(None), parts, size)
    resident_w = _columns(w_ref, slice(None), parts, size) if resident else None
    carry = treedef.unflatten([ref[rows, :] for ref in init_refs])

    def body(t, carry):
      at = pl.ds(base + t * tile, tile)
      w = resident_w if resident else _columns(w_ref, slice(None), parts, size)
      hp = _recurrent(cell.hidden(carry), w, bias, cell, compute)
      new, y = cell.gates(carry, _columns(xp_ref, at, parts, size), hp)
      live = t < live_until
      carry = jax.tree.map(
        lambda n, o: jnp.where(live, n.astype(o.dtype), o), new, carry
      )
      y_ref[at, :] = jnp.where(live, y, 0).astype(y_ref.dtype)
      for ref, leaf in zip(saved_refs, jax.tree.leaves(carry), strict=True):
        ref[at, :] = leaf
      return carry

    carry = jax.lax.fori_loop(0, steps_ref[i], body, carry)
    for ref, leaf in zip(final_refs, jax.tree.leaves(carry), strict=True):
      ref[rows, :] = leaf

  return kernel


def _backward_step(
  cell: Separable,
  compute: Any,
  prev: Any,
  xp: tuple,
  w: tuple,
  bias: tuple,
  dcarry: Any,
  dy: jax.Array,
  live: jax.Array,
) -> tuple[Any, list, list]:
  """One step of the backward kernel on a tile's rows, recomputed under
  `jax.vjp`.

  Args:
    cell: the separable cell.
    compute: the operand dtype of the recurrent products, or `None`.
    prev: the carry before the step, leaves ``[tile, size]``.
    xp: the step's projected inputs, ``[tile, width // parts]`` a part.
    w: the recurrent weights, ``[hidden, width // parts]`` a part.
    bias: the recurrent bias, ``[1, width // parts]`` a part.
    dcarry: the cotangent of the carry after the step, leaves ``[tile, size]``.
    dy: the cotangent of the step's outputs, ``[tile, out]``.
    live: bool ``[tile, 1]``, whether each row is within its length.

  Returns:
    ``(dcarry, d_xp, d_hp)``: the cotangent of the carry before the step
    (unchanged for rows past their length), and the cotangents of the
    projected input and of the recurrent product, ``[tile, width // parts]``
    a part (zero for rows past their length).
  """
  h, hidden_vjp = jax.vjp(cell.hidden, prev)
  hp = _recurrent(h, w, bias, cell, compute)
  (new, y), step_vjp = jax.vjp(cell.gates, prev, xp, hp)
  cot = jax.tree.map(lambda d, n: d.astype(n.dtype), dcarry, new)
  d_prev, d_xp, d_hp = step_vjp((cot, dy.astype(y.dtype)))
  d_xp = [jnp.where(live, d, 0) for d in d_xp]
  d_hp = [jnp.where(live, d, 0) for d in d_hp]
  operand = h.dtype if compute is None else compute
  d_h = sum(
    jax.lax.dot_general(
      d.astype(operand),
      w_k.astype(operand),
      (((1,), (1,)), ((), ())),
      precision=cell.precision,
      preferred_element_type=h.dtype,
    )
    for d, w_k in zip(d_hp, w, strict=True)
  )
  (d_from_h,) = hidden_vjp(d_h)
  d_prev = jax.tree.map(jnp.add, d_prev, d_from_h)
  dcarry = jax.tree.map(
    lambda d, o: jnp.where(live, d.astype(o.dtype), o), d_prev, dcarry
  )
  return dcarry, d_xp, d_hp


def _backward_kernel(
  cell: Separable, treedef: Any, tile: int, compute: Any, resident: bool
):
  """The backward Pallas kernel of `fused_loop`: one program per tile,
  running its steps in reverse.

  Args:
    cell, treedef, tile, compute, resident: as `_forward_kernel`'s.

  Returns:
    ``kernel(lengths, steps, starts, xp, w, b, *init, *saved, dy, *dfinal,
    dxp, dhp, *dinit)``, a kernel over refs for `pl.pallas_call` (see its
    docstring).
  """
  leaves, parts = treedef.num_leaves, cell.parts
  size = cell.w_rec.shape[1] // parts

  def kernel(lengths_ref, steps_ref, starts_ref, xp_ref, w_ref, b_ref, *refs):
    """One grid step: the reverse time loop of tile ``i``
    (``pl.program_id``).

    Reads ``lengths_ref`` int32 ``[tiles * tile]``, ``steps_ref`` and
    ``starts_ref`` int32 ``[tiles]``, ``xp_ref [slots, width]``, ``w_ref
    [hidden, width]`` and ``b_ref [1, width]`` as the forward kernel does;
    then from `refs`: the initial carry's leaves ``[tiles * tile, size]``,
    the saved carries ``[slots, size]`` (the forward kernel's, one per
    leaf), the outputs' cotangent ``dy_ref [slots, out]`` and the final
    carry's cotangents ``[tiles * tile, size]``. Writes, at the tile's own
    slots, ``dxp_ref`` and ``dhp_ref [slots, width]`` (the cotangents of the
    projected inputs and of the recurrent products, zero for ended rows),
    and the initial carry's cotangents ``[tiles * tile, size]`` at its rows.
    """
    init_refs, saved_refs = refs[:leaves], refs[leaves : 2 * leaves]
    dy_ref, dfinal_refs = refs[2 * leaves], refs[2 * leaves + 1 : 3 * leaves + 1]
    dxp_ref, dhp_ref = refs[3 * leaves + 1], refs[3 * leaves + 2]
    dinit_refs = refs[3 * leaves + 3 :]
    i = pl.program_id(0)
    rows = pl.ds(i * tile, tile)
    live_until = lengths_ref[rows][:, None]
    base, steps = starts_ref[i], steps_ref[i]
    bias = _columns(b_ref, slice(None), parts, size)
    resident_w = _columns(w_ref, slice(None), parts, size) if resident else None
    init = [ref[rows, :] for ref in init_refs]
    dcarry = treedef.unflatten([ref[rows, :] for ref in dfinal_refs])

    def body(k, dcarry):
      """Step ``t = steps - 1 - k`` of the tile (``k = 0``: its last step),
      by `_backward_step` from the carry before it (the saved carry of step
      ``t - 1``, or the initial carry at ``t = 0``); writes its cotangents
      to ``dxp_ref`` and ``dhp_ref`` at the step's slots."""
      t = steps - 1 - k
      at = pl.ds(base + t * tile, tile)
      before = pl.ds(jnp.maximum(base + (t - 1) * tile, 0), tile)
      prev = [
        jnp.where(t > 0, ref[before, :], x0)
        for ref, x0 in zip(saved_refs, init, strict=True)
      ]
      prev = treedef.unflatten(prev)
      w = resident_w if resident else _columns(w_ref, slice(None), parts, size)
      xp = _columns(xp_ref, at, parts, size)
      dcarry, d_xp, d_hp = _backward_step(
        cell, compute, prev, xp, w, bias, dcarry, dy_ref[at, :], t < live_until
      )
      for j in range(parts):
        dxp_ref[at, pl.ds(j * size, size)] = d_xp[j].astype(dxp_ref.dtype)
        dhp_ref[at, pl.ds(j * size, size)] = d_hp[j].astype(dhp_ref.dtype)
      return dcarry

    dcarry = jax.lax.fori_loop(0, steps, body, dcarry)
    for ref, leaf in zip(dinit_refs, jax.tree.leaves(dcarry), strict=True):
      ref[rows, :] = leaf

  return kernel


def _compiler_params(interpret: bool) -> Any:
  """On a GPU, Pallas's Triton backend (its Mosaic GPU backend copies whole
  blocks through shared memory, which a tile of per-row lengths does not
  fill)."""
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu

  return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _shape(a: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _check_carry_ranks(leaves: list) -> None:
  """Raises a ValueError unless every carry leaf is ``[count_capacity, size]``."""
  if any(leaf.ndim != 2 for leaf in leaves):
    raise ValueError(
      "Expected every `init_carry` leaf to be [count_capacity, size] for the "
      f"fused kernel, got shapes {[leaf.shape for leaf in leaves]}; use "
      "jaxlod.ops.dynamic_rnn for carries of other ranks."
    )


def _recurrent_bias(cell: Separable, xp: jax.Array) -> jax.Array:
  """The recurrent products' bias ``[1, width]`` for projected inputs ``xp
  [slots, width]``: ``cell.b_rec`` in the last ``cell.probe`` columns, zero
  elsewhere (everywhere without one)."""
  width = xp.shape[1]
  bias = jnp.zeros((1, width), result_dtype(xp, cell.w_rec, dtype=cell.dtype))
  if cell.b_rec is not None:
    bias = bias.at[0, width - cell.probe :].set(cell.b_rec.astype(bias.dtype))
  return bias


def _forward_avals(
  cell: Separable,
  treedef: Any,
  leaves: list,
  xp: jax.Array,
  bias: jax.Array,
  tile: int,
) -> tuple[jax.ShapeDtypeStruct, list[jax.ShapeDtypeStruct]]:
  """The shapes of the forward kernel's outputs in slots.

  Args:
    cell: the separable cell.
    treedef: the pytree structure of the carry.
    leaves: the initial carry's leaves, ``[tiles * tile, size]``.
    xp: the projected inputs in slots, ``[slots, width]``.
    bias: the recurrent bias, ``[1, width]``.
    tile: the sequences (rows) of one program.

  Returns:
    ``(y, saved)``: the outputs' ``[slots, out]`` (as ``cell.gates`` gives
    them) and the saved carries', one ``[slots, size]`` a leaf.
  """
  slots, width = xp.shape
  block = width // cell.parts
  y_shape = jax.eval_shape(
    cell.gates,
    treedef.unflatten([_row(leaf, tile) for leaf in leaves]),
    (jax.ShapeDtypeStruct((tile, block), xp.dtype),) * cell.parts,
    (jax.ShapeDtypeStruct((tile, block), bias.dtype),) * cell.parts,
  )[1]
  y_aval = jax.ShapeDtypeStruct((slots, y_shape.shape[1]), y_shape.dtype)
  saved_avals = [
    jax.ShapeDtypeStruct((slots, leaf.shape[1]), leaf.dtype) for leaf in leaves
  ]
  return y_aval, saved_avals


def _loop_backward(
  cell: Separable,
  treedef: Any,
  tile: int,
  compute: Any,
  resident: bool,
  interpret: bool,
  res: tuple,
  g: tuple,
) -> tuple:
  """`fused_loop`'s backward rule: the backward kernel, then the weight
  gradients as products over all slots.

  Args:
    cell, treedef, tile, compute, resident: as `_backward_kernel`'s.
    interpret: as `fused_rnn`'s.
    res: the forward rule's residuals ``(w_rec, bias, xp, leaves, saved,
      where)``; `saved` the carry after each slot's step, leaves
      ``[slots, size]``; `where` the layout's arrays (`fused_loop`'s).
    g: ``(dy [slots, out], dfinal)``, the cotangents of the outputs and of
      the final carry (leaves ``[tiles * tile, size]``).

  Returns:
    The cotangents of the loop's arguments: ``w_rec`` ``[hidden, width]``
    (``h_prev.T @ d_hp``), ``bias`` ``[1, width]``, ``xp`` ``[slots,
    width]`` (zero at unused slots), the initial carry's leaves, and
    `None` for each array of `where`.
  """
  w_rec, bias, xp, leaves, saved, where = res
  tile_steps, slot_valid, previous = where[1], where[3], where[4]
  dy, dfinal = g
  outs = pl.pallas_call(
    _backward_kernel(cell, treedef, tile, compute, resident),
    out_shape=(_shape(xp), _shape(xp), *map(_shape, leaves)),
    grid=(tile_steps.shape[0],),
    interpret=interpret,
    compiler_params=_compiler_params(interpret),
  )(*where[:3], xp, w_rec, bias, *leaves, *saved, dy, *dfinal)
  valid = slot_valid[:, None]
  d_xp = jnp.where(valid, outs[0], 0)
  d_hp = jnp.where(valid, outs[1], 0)
  # The state each slot's step started from: the previous slot's carry, or
  # the initial carry at a sequence's first step.
  states = cell.hidden(treedef.unflatten(saved))
  states = jnp.concatenate([states, cell.hidden(treedef.unflatten(leaves))])
  h_prev = jnp.where(valid, states[previous], 0).astype(d_hp.dtype)
  g_w = jax.lax.dot_general(
    h_prev, d_hp, (((0,), (0,)), ((), ())), precision=cell.precision
  )
  g_b = jnp.sum(d_hp, axis=0, keepdims=True)
  d_where = (None,) * len(where)  # integer and bool arrays: no cotangent
  return (
    g_w.astype(w_rec.dtype),
    g_b.astype(bias.dtype),
    d_xp,
    list(outs[2:]),
    d_where,
  )


def fused_loop(
  cell: Separable,
  layout: TileLayout,
  xp: jax.Array,
  init: Any,
  *,
  tile: int,
  compute: Any,
  interpret: bool,
) -> tuple[jax.Array, Any]:
  """The kernels over tile-major inputs, tied by a `jax.custom_vjp`.

  Args:
    cell: the separable cell.
    layout: the `TileLayout` of the batch.
    xp: the projected inputs in slots, ``[slots, width]``, zero where unused.
    init: the initial carry in rank order, leaves ``[tiles * tile, ...]``.
    tile, compute, interpret: as `fused_rnn`'s.

  Returns:
    ``(y, final)``: the outputs in slots ``[slots, out]`` (zero where
    unused) and the final carry in rank order.
  """
  leaves, treedef = jax.tree.flatten(init)
  _check_carry_ranks(leaves)
  grid = (layout.tile_steps.shape[0],)
  w_rec = cell.w_rec
  bias = _recurrent_bias(cell, xp)
  resident = w_rec.size * w_rec.dtype.itemsize <= RESIDENT_BYTES
  y_aval, saved_avals = _forward_avals(cell, treedef, leaves, xp, bias, tile)

  # The batch's layout goes in as arguments, not closed over: under `jit` its
  # arrays are tracers, which a custom VJP's rules must not capture (the
  # linearized program would hold them as constants).
  where = (
    layout.lengths,
    layout.tile_steps,
    layout.tile_starts,
    layout.slot_valid,
    layout.previous,
  )

  def forward(w_rec, bias, xp, leaves, where):
    outs = pl.pallas_call(
      _forward_kernel(cell, treedef, tile, compute, resident),
      out_shape=(y_aval, *saved_avals, *map(_shape, leaves)),
      grid=grid,
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
    )(*where[:3], xp, w_rec, bias, *leaves)
    n = len(leaves)
    return outs[0], list(outs[1 : n + 1]), list(outs[n + 1 :])

  @jax.custom_vjp
  def loop(w_rec, bias, xp, leaves, where):
    y, _, final = forward(w_rec, bias, xp, leaves, where)
    return y, final

  def loop_fwd(w_rec, bias, xp, leaves, where):
    y, saved, final = forward(w_rec, bias, xp, leaves, where)
    return (y, final), (w_rec, bias, xp, leaves, saved, where)

  def loop_bwd(res, g):
    return _loop_backward(cell, treedef, tile, compute, resident, interpret, res, g)

  loop.defvjp(loop_fwd, loop_bwd)
  y, final = loop(w_rec, bias, xp, leaves, where)
  return y, treedef.unflatten(final)


def _row(leaf: jax.Array, tile: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((tile, *leaf.shape[1:]), leaf.dtype)


def _check_gpu_sizes(cell: Separable, init_carry: Any, tile: int) -> None:
  """Pallas's GPU (Triton) backend computes on arrays whose sizes are powers
  of 2: the tile, the gate blocks and the carry's leaves."""
  sizes = {
    "tile": tile,
    "gate block (width // parts)": cell.w_rec.shape[1] // cell.parts,
  }
  for i, leaf in enumerate(jax.tree.leaves(init_carry)):
    sizes[f"init_carry leaf {i} size"] = jnp.shape(leaf)[-1]
  for name, size in sizes.items():
    if size < 1 or size & (size - 1):
      raise ValueError(
        f"Expected the fused kernel's sizes to be powers of 2 on a GPU (Pallas's "
        f"Triton backend), got {name} {size}; use jaxlod.ops.dynamic_rnn for "
        "other sizes."
      )


# The dtypes the kernels compute in; `compute_dtype` may also be bfloat16.
FLOAT_DTYPES = ("float32", "float64")


def _check_arguments(
  cell: Any,
  x: Any,
  init_carry: Any,
  tile: Any,
  reverse: Any,
  compute_dtype: Any,
  interpret: Any,
) -> tuple[LoDTensor, int, bool, bool]:
  """`fused_rnn`'s argument checks, in its order (see its Raises).

  Args:
    cell, x, init_carry, tile, reverse, compute_dtype, interpret: as
      `fused_rnn`'s.

  Returns:
    ``(x, tile, reverse, interpret)``: `x` as a LoDTensor, `tile` as a
    static int, `reverse` and `interpret` as bools (`interpret` `None`: on
    a CPU backend only).
  """
  if not isinstance(cell, Separable):
    raise TypeError(
      f"Expected `cell` to be a jaxlod.ops.Separable, got {type(cell).__name__}."
    )
  x = check_lod(x, "x")
  tile = static_int(tile, "tile", minimum=1)
  reverse = check_bool(reverse, "reverse")
  if x.values.ndim != 2:
    raise ValueError(
      "Expected `x.values` to be [token_capacity, features] for the fused "
      f"kernel, got shape {tuple(x.values.shape)}; use jaxlod.ops.dynamic_rnn "
      "for more feature axes."
    )
  dtypes = {jnp.dtype(a.dtype).name for a in (x.values, cell.w_in, cell.w_rec)}
  if not dtypes <= set(FLOAT_DTYPES):
    raise TypeError(
      f"Expected the fused kernel's values and weights in {FLOAT_DTYPES}, got "
      f"{sorted(dtypes)}; use jaxlod.ops.dynamic_rnn for other dtypes."
    )
  if compute_dtype is not None and jnp.dtype(compute_dtype) != jnp.bfloat16:
    raise TypeError(
      f"Expected `compute_dtype` to be None or bfloat16, got {compute_dtype!r}."
    )
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  interpret = check_bool(interpret, "interpret")
  if not interpret:
    _check_gpu_sizes(cell, init_carry, tile)
  return x, tile, reverse, interpret


def fused_rnn(
  cell: Separable,
  x: LoDTensor,
  *,
  init_carry: Any,
  reverse: bool = False,
  table: RankTable | None = None,
  tile: int = 16,
  compute_dtype: Any = None,
  interpret: bool | None = None,
) -> tuple[LoDTensor, Any]:
  """A separable cell over every sequence of `x` in one Pallas kernel launch.

  The same results as `jaxlod.ops.dynamic_rnn` running the cell's step
  (``cell.gates`` on ``x @ w_in + b_in`` and ``h @ w_rec``): the outputs at
  each row, each sequence's final carry at its own last step, an empty
  sequence keeping its initial carry; gradients through a
  `jax.custom_vjp` whose backward pass is the reverse-time kernel.

  Args:
    cell: the cell's weights and gate math (`jaxlod.nn`'s layers build it
      from a Flax cell with ``LoopPlan(fused=True)``).
    x: a LoDTensor ``values [token_capacity, features]``; the cell runs over
      its last level.
    init_carry: the carry, leaves ``[count_capacity, size]`` in the caller's
      order.
    reverse: run each sequence from its own last row to its first.
    table: `x`'s rank table; built here when `None`.
    tile: the sequences (rows) of one program, in rank order: a static int
      >= 1 (16 by default, the smallest matrix tile of GPU kernels).
    compute_dtype: `None` (the cell's dtype), or ``jnp.bfloat16`` for the
      operands of the recurrent products (accumulated in the cell's dtype).
    interpret: run the kernels in Pallas's interpret mode; `None`: on a CPU
      backend only.

  Returns:
    ``(outputs, final_carry)``: outputs a LoDTensor with `x`'s LoD,
    ``values [token_capacity, hidden]`` (zero at padding rows), and the
    final carry in the caller's order. Under `jit`, a `table` that does
    not rank `x` turns both NaN and sets `jaxlod.Fault.TABLE` in the
    outputs' ``faults`` (eagerly it raises).

  Raises:
    TypeError: for a `cell` that is not a `Separable`, `x` that is not a
      LoDTensor, a non-int `tile`, a non-bool `reverse` or `interpret`, or
      values of a dtype the kernels do not run (naming `dynamic_rnn`).
    ValueError: for `values` that are not ``[token_capacity, features]``,
      carry leaves that are not ``[count_capacity, size]``, a `tile` below
      1, or on a GPU a tile, gate block or carry size that is not a power
      of 2 (naming `dynamic_rnn`).
  """
  x, tile, reverse, interpret = _check_arguments(
    cell, x, init_carry, tile, reverse, compute_dtype, interpret
  )
  ranked = True
  if table is None:
    table = ranked_level(x, x.num_levels - 1, None)
  else:
    ranked = check_pair(x, table, "x")
  count = table.count_capacity
  check_rows(init_carry, count, "init_carry")
  layout = tile_layout(x, table, tile, reverse)
  xp = dense(x.values, cell.w_in, cell.b_in, cell.dtype, cell.precision)
  xp = jnp.where(layout.slot_valid[:, None], xp[layout.slot_rows], 0)
  padded = layout.lengths.shape[0]

  def by_rank(leaf):
    leaf = jnp.asarray(leaf)[jnp.asarray(table.order)] if count else jnp.asarray(leaf)
    return jnp.pad(leaf, [(0, padded - count)] + [(0, 0)] * (leaf.ndim - 1))

  init = jax.tree.map(by_rank, init_carry)
  y, final = fused_loop(
    cell, layout, xp, init, tile=tile, compute=compute_dtype, interpret=interpret
  )
  y = jnp.where(layout.row_valid[:, None], y[layout.row_slots], 0)
  ranks = jnp.asarray(table.ranks)
  final = jax.tree.map(lambda leaf: leaf[:count][ranks] if count else leaf[:0], final)
  # A table of another batch under `jit` (without `checkify`) gives wrong
  # results: NaN floats and a faulted output make that loud, as in
  # `dynamic_rnn`.
  outputs = with_faults(x.with_values(y), fault_unless(ranked, Fault.TABLE))
  return nan_unless(ranked, outputs), nan_unless(ranked, final)
