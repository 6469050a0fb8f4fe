"""The phased loop and its custom VJP (Fluid's ``while`` + ``while_grad``).

Everything here works on flat lists of arrays. The carry and static leaves
are ``[count_capacity, ...]`` in rank order; step inputs and outputs are in
the time-major packed layout of `jaxlod.ops._packed`: the rows of step ``t``
start at ``step_offsets[t]``, in rank order, so each step reads and writes one
contiguous slab and no buffer is sized by the time capacity. Phase ``k`` runs
a `lax.while_loop` over steps ``[start_k, end_k)`` at the static batch size
``ladder[k]`` on the prefix ``[:ladder[k]]`` of the ranked arrays.

The backward pass runs the phases in reverse, each stepping ``t`` downward and
calling the VJP of the step, summing the gradients of parameters and static
inputs across steps. With ``remat=False`` the forward pass saves the step's
VJP residuals, each in the place its `Slot` names (the static plan of what
is stored is `jaxlod.ops._loop._spec`): those that depend on the carry or the
step input are stored per step in the schedule layout of
`jaxlod.ops._packed`, those that depend only on parameters and static inputs
(a concatenated kernel, say) are computed once per phase, so nothing of size
``time x weights`` is stored. The residuals come from the step under
`jax.checkpoint` with a policy that keeps matrix products and transcendental
functions and recomputes cheap elementwise ops, and a residual that is the
step input unchanged is read again from the inputs: an LSTM step keeps its
carries and five activations per row rather than thirteen leaves. With
``remat=True`` it saves only the carries and the backward pass recomputes
each step.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jaxlod._checks import where_rows
from jaxlod._vma import vary, varying_axes
from jaxlod.ops._loop._spec import (
  Leaves,
  LoopSpec,
  Phase,
  Residuals,
  Where,
  by_row,
  merge,
  phase_residuals,
  residual_leaves,
  row_groups,
  split,
)

# ``(step_offsets, saved_offsets, lengths, phase_starts, phase_ends)``: see
# `make_loop`.
Bounds = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]

# -- helpers -------------------------------------------------------------------------


def _slab(buffer: jax.Array, offset: jax.typing.ArrayLike, size: int) -> jax.Array:
  """Rows ``[offset, offset + size)`` of `buffer`."""
  return lax.dynamic_slice_in_dim(buffer, offset, size, axis=0)


def _write_rows(
  buffer: jax.Array, offset: jax.typing.ArrayLike, value: jax.Array
) -> jax.Array:
  """Writes `value` at rows ``[offset, offset + len(value))``."""
  return lax.dynamic_update_slice_in_dim(buffer, value.astype(buffer.dtype), offset, 0)


def _start(t: jax.typing.ArrayLike, ndim: int) -> tuple[jax.Array, ...]:
  """Index ``(t, 0, ..., 0)`` of one integer type (x64 mode included)."""
  t = jnp.asarray(t)
  return (t, *(jnp.zeros_like(t),) * (ndim - 1))


def _set_prefix(full: jax.Array, part: jax.Array) -> jax.Array:
  return lax.dynamic_update_slice(full, part.astype(full.dtype), (0,) * full.ndim)


def _pad_to(part: jax.Array, rows: int) -> jax.Array:
  return jnp.pad(part, [(0, rows - part.shape[0])] + [(0, 0)] * (part.ndim - 1))


# -- one phase ------------------------------------------------------------------------


def _steps(
  spec: LoopSpec,
  data: _PhaseData,
  step: Callable[[jax.Array, Any], Any],
  state: Any,
) -> Any:
  """Runs ``state = step(i, state)`` for the phase's ``i`` in ``[0, last -
  first)``.

  With ``spec.chunk == k > 1``, an outer `lax.while_loop` (its trip count
  is data) runs chunks of `k` steps, each an inner loop of static trip count
  `k`: the host waits for the outer predicate once per chunk, and the step
  is compiled once, not `k` times (copying it `k` times made the W1 training
  step compile about 6x as long on the CPU). The last chunk's extra ``i``
  run too: `step` masks them.
  """
  if spec.chunk == 1:
    return lax.fori_loop(0, data.last - data.first, step, state)
  k = spec.chunk

  def body(j: jax.Array, state: Any) -> Any:
    return lax.fori_loop(0, k, lambda u, state: step(j * k + u, state), state)

  trips = (data.last - data.first + k - 1) // k
  return lax.fori_loop(jnp.zeros_like(trips), trips, body, state)


@dataclasses.dataclass(frozen=True)
class _PhaseData:
  """A phase's traced operands."""

  diff_inv: list  # float static and constant leaves
  nodiff_inv: list  # the others
  step_offsets: jax.Array  # [time] first time-major row of each step
  saved_offsets: jax.Array  # [time] first schedule row of each step
  lengths: jax.Array  # [size] lengths of the ranked sequences
  first: jax.Array  # first step
  last: jax.Array  # one past the last step

  def cells(self, t: jax.Array) -> _Cells:
    """Step `t` of the phase."""
    return _Cells(t, t < self.lengths, self.step_offsets[t], self.saved_offsets[t])

  def masked_cells(self, spec: LoopSpec, size: int, t: jax.Array) -> _Cells:
    """Step `t` going forward, which may be past the phase's end (``chunk >
    1``): such a step has no active row, and reads and writes only the
    spare rows past the data (`LoopSpec.stored_rows`)."""
    valid = t < self.last
    at = jnp.clip(t, 0, spec.time - 1)
    return _Cells(
      jnp.where(valid, t, spec.time),
      (t < self.lengths) & valid,
      jnp.where(valid, self.step_offsets[at], spec.rows - size),
      jnp.where(valid, self.saved_offsets[at], spec.saved_rows),
    )

  def first_cells(self, t: jax.Array) -> _Cells:
    """Step `t` going backward, which may be before the phase's start
    (``chunk > 1``): such a step has no active row and reads the phase's
    first step, whose stored values are real (so its zero cotangents give
    zero gradients, never ``0 * inf``)."""
    at = jnp.maximum(t, self.first)
    return _Cells(at, (t < self.lengths) & (t >= self.first), *self.cells(at)[2:])


class _Cells(NamedTuple):
  """Where one step reads and writes."""

  t: jax.Array  # the step, as stored leaves are indexed by step
  active: jax.Array  # [size] bool, the rows that take the step
  offset: jax.Array  # first time-major row
  saved_at: jax.Array  # first schedule row


class _Saved(NamedTuple):
  """What one phase's forward pass keeps for its backward pass."""

  buffers: Leaves  # stored per step: residuals or carries
  invariants: Leaves  # the ``INVARIANT`` residuals of the phase


class _ForwardState(NamedTuple):
  """The forward loop's carry."""

  carry: Leaves  # [size, ...] each
  ys: Leaves  # time-major outputs (empty without `return_sequences`)
  buffers: Leaves  # per-step storage for the backward pass


class _BackwardState(NamedTuple):
  """The backward loop's carry: cotangents of the float leaves only."""

  g_carry: Leaves  # [size, ...] each
  g_values: Leaves  # time-major, like the inputs
  g_statics: Leaves  # [size, ...] each, summed over the phase's steps
  g_consts: Leaves  # summed over the steps of every phase


def _phase_data(
  spec: LoopSpec,
  phase: Phase,
  k: int,
  statics: Leaves,
  consts: Leaves,
  bounds: Bounds,
) -> _PhaseData:
  """Phase `k`'s traced operands.

  Args:
    spec: the loop's static description.
    phase: the phase, of batch size ``phase.size``.
    k: the phase's index.
    statics: the static leaves, ``[count_capacity, ...]`` each in rank order.
    consts: the constant leaves shared by every phase.
    bounds: ``(step_offsets [time], saved_offsets [time], lengths
      [count_capacity], phase_starts [phases], phase_ends [phases])``.

  Returns:
    The `_PhaseData`: the phase's invariant leaves (the first
    ``phase.size`` rows of each static leaf, then the constants the phase
    reads) split into float and other leaves, the step offsets, the first
    ``phase.size`` lengths and the phase's steps ``[phase_starts[k],
    phase_ends[k])``.
  """
  step_offsets, saved_offsets, lengths, phase_starts, phase_ends = bounds
  b = phase.size
  inv = [s[:b] for s in statics] + [consts[i] for i in phase.consts]
  diff_inv, nodiff_inv = split(inv, spec.inv_float(phase))
  return _PhaseData(
    diff_inv,
    nodiff_inv,
    step_offsets,
    saved_offsets,
    lengths[:b],
    phase_starts[k],
    phase_ends[k],
  )


def _step_vjp(
  spec: LoopSpec, phase: Phase, data: _PhaseData, c: Leaves, x: Leaves
) -> tuple[Leaves, Callable[..., Any]]:
  """``(outputs, vjp)`` of the step at carry `c` and input `x`."""
  diff_step, nodiff_step = split(c + x, spec.carry_float + spec.x_float)
  f = spec.differentiable(phase, nodiff_step, data.nodiff_inv)
  outs, vjp, aux = jax.vjp(f, diff_step, data.diff_inv, has_aux=True)
  return merge(outs, aux, spec.carry_float + spec.y_float), vjp


def _row_start(
  j: int, offset: jax.typing.ArrayLike, ndim: int
) -> tuple[jax.Array, ...]:
  """Index ``(j, offset, 0, ..., 0)`` of one integer type."""
  offset = jnp.asarray(offset)
  return (jnp.asarray(j, offset.dtype), *_start(offset, ndim - 1))


def _store(
  where: Where | None,
  buffers: Leaves,
  t: jax.Array,
  offset: jax.Array,
  leaves: Leaves,
) -> Leaves:
  """Stores a step's leaves at its rows (row layout: `where` from
  `row_groups`) or, when `where` is `None`, at index `t`."""
  if where is not None:
    buffers = list(buffers)
    for (g, j), leaf in zip(where, leaves, strict=True):
      buf = buffers[g]
      update = leaf[None].astype(buf.dtype)
      buffers[g] = lax.dynamic_update_slice(
        buf, update, _row_start(j, offset, buf.ndim)
      )
    return buffers
  return [
    lax.dynamic_update_slice(buf, leaf[None], _start(t, buf.ndim))
    for buf, leaf in zip(buffers, leaves, strict=True)
  ]


def _load(
  where: Where | None, buffers: Leaves, t: jax.Array, offset: jax.Array, size: int
) -> Leaves:
  """A step's stored leaves (`size` rows each), as `_store` wrote them."""
  if where is not None:
    return [
      lax.dynamic_slice(
        buffers[g],
        _row_start(j, offset, buffers[g].ndim),
        (1, size, *buffers[g].shape[2:]),
      )[0]
      for g, j in where
    ]
  return [lax.dynamic_index_in_dim(buf, t, keepdims=False) for buf in buffers]


def _forward_phase(
  spec: LoopSpec,
  phase: Phase,
  plan: Residuals | None,
  row_layout: bool,
  data: _PhaseData,
  values: Leaves,
  state: _ForwardState,
) -> _ForwardState:
  """One phase forward; stores per-step residuals (or carries) when planned."""
  residual_mode = plan is not None and not plan.recompute
  b = phase.size
  where = row_groups(plan, spec.stored_rows)[0] if row_layout else None

  def body(i: jax.Array, state: _ForwardState) -> _ForwardState:
    """Step ``t = data.first + i`` of the phase, forward.

    Reads each input's slab ``[size, ...]`` at the step's time-major offset
    and runs the step on the carry (under `jax.vjp` when residuals are
    stored). Stores the step's residuals (or, to recompute, its carry) at
    the step's schedule row, keeps the carry of rows past their length,
    and with `return_sequences` writes the outputs' slab to `ys`. A step
    past the phase's end (``chunk > 1``) has no active row. Returns the
    updated `_ForwardState`.
    """
    c, ys, buffers = state
    t = data.first + i
    at = data.cells(t) if spec.chunk == 1 else data.masked_cells(spec, b, t)
    t, active, offset, saved_at = at
    x = [_slab(v, offset, b) for v in values]
    if residual_mode:
      out, vjp = _step_vjp(spec, phase, data, c, x)
      new_c, y = out[: len(c)], out[len(c) :]
      stored = plan.stacked(jax.tree.leaves(vjp))
    else:
      stored = c if plan is not None else []
      inv = merge(data.diff_inv, data.nodiff_inv, spec.inv_float(phase))
      new_c, y = phase.fn(c, x, inv)
    buffers = _store(where, buffers, t, saved_at, stored)
    c = [where_rows(active, n, o) for n, o in zip(new_c, c, strict=True)]
    if spec.return_sequences:
      # Rows past the active batch land in the next step's slab, which that
      # step then overwrites.
      ys = [_write_rows(buf, offset, leaf) for buf, leaf in zip(ys, y, strict=True)]
    return _ForwardState(c, ys, buffers)

  return _steps(spec, data, body, state)


def _y_zeros(spec: LoopSpec, phase: Phase) -> Leaves:
  """Zero cotangents of the float step outputs, when only the final carry is
  returned."""
  if spec.return_sequences:
    return []
  return [
    spec.zeros((phase.size, *tail), d)
    for (tail, d), f in zip(spec.y_tails, spec.y_float, strict=True)
    if f
  ]


def _const_slots(spec: LoopSpec, phase: Phase) -> list[int]:
  """Where each float constant of the phase sits among all float constants."""
  position = list(itertools.accumulate(spec.const_float, initial=0))
  return [position[i] for i in phase.consts if spec.const_float[i]]


def _accumulate(
  g_statics: Leaves, g_consts: Leaves, g_inv: Leaves, const_slots: list[int]
) -> tuple[Leaves, Leaves]:
  """Adds a step's cotangents of the static and constant leaves."""
  g_inv_statics, g_inv_consts = g_inv[: len(g_statics)], g_inv[len(g_statics) :]
  g_statics = [a + g for a, g in zip(g_statics, g_inv_statics, strict=True)]
  g_consts = list(g_consts)
  for slot, g in zip(const_slots, g_inv_consts, strict=True):
    g_consts[slot] = g_consts[slot] + g
  return g_statics, g_consts


def _backward_phase(
  spec: LoopSpec,
  phase: Phase,
  plan: Residuals,
  row_layout: bool,
  data: _PhaseData,
  saved: _Saved,
  values: Leaves,
  g_ys: Leaves,
  state: _BackwardState,
) -> _BackwardState:
  """One phase backward, `t` stepping down; returns the updated cotangents.

  `state` holds ``g_carry`` and ``g_statics`` at the phase's size; the
  constants' gradients accumulate across all phases.
  """
  b = phase.size
  buffers, invariants = saved
  where = row_groups(plan, spec.stored_rows)[0] if row_layout else None
  y_zeros, const_slots = _y_zeros(spec, phase), _const_slots(spec, phase)

  def body(i: jax.Array, state: _BackwardState) -> _BackwardState:
    """Step ``t = data.last - 1 - i`` of the phase, backward.

    Loads the step's stored leaves and gets its VJP: recomputed from the
    stored carry, or rebuilt from the stored residuals. Pulls back the
    carry's cotangents and the outputs' cotangent slab (zero for inactive
    rows) and, for the active rows, updates the carry's cotangents and
    writes the inputs' cotangents into their slab of `g_values`; the
    cotangents of the static and constant leaves are summed. Returns the
    updated `_BackwardState`.
    """
    g_c, g_values, g_statics, g_consts = state
    t = data.last - 1 - i
    t, active, offset, saved_at = (
      data.cells(t) if spec.chunk == 1 else data.first_cells(t)
    )
    stored = _load(where, buffers, t, saved_at, b)
    x = [_slab(v, offset, b) for v in values]
    if plan.recompute:
      _, vjp = _step_vjp(spec, phase, data, stored, x)
    else:
      vjp = jax.tree.unflatten(plan.tree, plan.residuals(stored, invariants, x))
    g_out = [where_rows(active, g, 0) for g in g_c]
    g_out += [where_rows(active, _slab(g, offset, b), 0) for g in g_ys]
    g_step, g_inv = vjp(g_out + y_zeros)
    g_new_c, g_x = g_step[: len(g_c)], g_step[len(g_c) :]
    g_c = [where_rows(active, new, old) for new, old in zip(g_new_c, g_c, strict=True)]
    # Going backward, the next step's slab is already written: keep its rows.
    g_values = [
      _write_rows(buf, offset, where_rows(active, g, _slab(buf, offset, b)))
      for buf, g in zip(g_values, g_x, strict=True)
    ]
    g_statics, g_consts = _accumulate(g_statics, g_consts, g_inv, const_slots)
    return _BackwardState(g_c, g_values, g_statics, g_consts)

  return _steps(spec, data, body, state)


# -- all phases ---------------------------------------------------------------------


def _invariant_residuals(
  spec: LoopSpec,
  phase: Phase,
  plan: Residuals,
  carry: Leaves,
  values: Leaves,
  data: _PhaseData,
) -> Leaves:
  """Residuals that depend on no step data, from any carry and input (zeros)."""
  b = phase.size
  step = [spec.zeros((b, *c.shape[1:]), c.dtype) for c in carry]
  step += [spec.zeros((b, *v.shape[1:]), v.dtype) for v in values]
  diff_step, nodiff_step = split(step, spec.carry_float + spec.x_float)
  leaves = residual_leaves(spec, phase)(
    diff_step, nodiff_step, data.diff_inv, data.nodiff_inv
  )
  return [leaf for leaf, p in zip(leaves, plan.per_step, strict=True) if not p]


def _buffers(spec: LoopSpec, plan: Residuals, row_layout: bool) -> Leaves:
  # Row layout: one buffer per row shape (see `row_groups`), each leaf at its
  # own index, so a step's store is one contiguous row copy per leaf. Packing
  # the leaves side by side along the features fused a concatenate into every
  # step's store: storing the LSTM residuals of benchmark W1 took 1.7x as long.
  if row_layout:
    return [
      spec.zeros(shape, dtype) for shape, dtype in row_groups(plan, spec.stored_rows)[1]
    ]
  return [
    spec.zeros((spec.stored_steps, *shape), dtype) for shape, dtype in plan.shapes
  ]


def _forward(
  spec: LoopSpec,
  plans: list[Residuals] | None,
  carry: Leaves,
  values: Leaves,
  statics: Leaves,
  consts: Leaves,
  bounds: Bounds,
) -> tuple[Leaves, Leaves, list[_Saved]]:
  """Runs every phase. With `plans`, also stores what the backward needs.

  Returns ``(ys, final_carry, saved)``; `saved` holds per phase the stored
  buffers and the loop-invariant residuals.
  """
  ys = []
  if spec.return_sequences:
    ys = [spec.zeros((spec.rows, *t), d) for t, d in spec.y_tails]
  row_layout = plans is not None and by_row(spec, plans)
  buffers = _buffers(spec, plans[0], True) if row_layout else []
  saved = []
  for k, phase in enumerate(spec.phases):
    plan = plans[k] if plans is not None else None
    data = _phase_data(spec, phase, k, statics, consts, bounds)
    invariants = []
    if plan is not None and not row_layout:
      buffers = _buffers(spec, plan, False)
    if plan is not None and not plan.recompute:
      invariants = _invariant_residuals(spec, phase, plan, carry, values, data)
    state = _ForwardState([c[: phase.size] for c in carry], ys, buffers)
    c, ys, buffers = _forward_phase(spec, phase, plan, row_layout, data, values, state)
    carry = [_set_prefix(full, part) for full, part in zip(carry, c, strict=True)]
    saved.append(_Saved(buffers, invariants))
  if row_layout:  # the phases shared the buffers: keep the final ones
    saved = [_Saved(buffers, invariants) for _, invariants in saved]
  return ys, carry, saved


def _float_zeros(spec: LoopSpec, leaves: Leaves, mask: Sequence[bool]) -> Leaves:
  return [spec.zeros(a.shape, a.dtype) for a in split(leaves, mask)[0]]


def _fill(grads: Leaves, mask: Sequence[bool]) -> list[jax.Array | None]:
  """The float leaves' `grads`, with `None` for the others."""
  return merge(grads, [None] * (len(mask) - len(grads)), mask)


def _backward(
  spec: LoopSpec,
  plans: list[Residuals],
  saved: list[_Saved],
  primals: tuple[Leaves, Leaves, Leaves, Leaves, Bounds],
  g_ys: Leaves,
  g_carry: Leaves,
) -> tuple[list[jax.Array | None], ...]:
  """Phases in reverse; cotangents of (carry, values, statics, consts)."""
  carry, values, statics, consts, bounds = primals
  row_layout = by_row(spec, plans)
  g_carry = split(g_carry, spec.carry_float)[0]
  g_values = _float_zeros(spec, values, spec.x_float)
  g_statics = _float_zeros(spec, statics, spec.static_float)
  g_consts = _float_zeros(spec, consts, spec.const_float)
  g_ys = split(g_ys, spec.y_float)[0] if spec.return_sequences else []
  for k in reversed(range(len(spec.phases))):
    phase = spec.phases[k]
    data = _phase_data(spec, phase, k, statics, consts, bounds)
    state = _BackwardState(
      [g[: phase.size] for g in g_carry],
      g_values,
      [spec.zeros((phase.size, *g.shape[1:]), g.dtype) for g in g_statics],
      g_consts,
    )
    g_c, g_values, g_phase_statics, g_consts = _backward_phase(
      spec, phase, plans[k], row_layout, data, saved[k], values, g_ys, state
    )
    g_carry = [_set_prefix(full, part) for full, part in zip(g_carry, g_c, strict=True)]
    g_statics = [
      full + _pad_to(part, spec.count)
      for full, part in zip(g_statics, g_phase_statics, strict=True)
    ]
  return (
    _fill(g_carry, spec.carry_float),
    _fill(g_values, spec.x_float),
    _fill(g_statics, spec.static_float),
    _fill(g_consts, spec.const_float),
  )


# -- the custom VJP -----------------------------------------------------------------


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Perturbed:
  """Per leaf of (carry, values, statics, consts): whether it is perturbed.

  A static pytree node (no leaves): the residuals carry the flags as
  structure, so the backward pass reads them at trace time.
  """

  flags: tuple[bool, ...]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Plans:
  """The forward pass's `Residuals`s, a static pytree node: the backward pass
  reuses them rather than tracing the step again for each phase."""

  plans: tuple[Residuals, ...]


class _Residuals(NamedTuple):
  """What `_loop_fwd` hands `_loop_bwd`."""

  perturbed: _Perturbed
  plans: _Plans
  saved: list[_Saved]  # per phase
  primals: tuple[Leaves, Leaves, Leaves, Leaves, Bounds]


def _unwrap(tree: Any) -> tuple[Any, list[bool]]:
  """Values and perturbed flags of a pytree of `CustomVJPPrimal`s."""
  is_primal = lambda x: isinstance(x, CustomVJPPrimal)  # noqa: E731
  leaves, tree_def = jax.tree.flatten(tree, is_leaf=is_primal)
  values = jax.tree.unflatten(tree_def, [leaf.value for leaf in leaves])
  return values, [leaf.perturbed for leaf in leaves]


def _instantiate(cotangent: jax.Array | SymbolicZero) -> jax.Array:
  if isinstance(cotangent, SymbolicZero):
    return jnp.zeros(cotangent.shape, cotangent.dtype)
  return cotangent


def _differentiated(spec: LoopSpec, flags: Sequence[bool]) -> LoopSpec:
  """`spec` differentiating only the perturbed inputs (input side only).

  Carry and outputs stay differentiable: their cotangents carry the
  gradient of anything perturbed upstream. Inputs, static inputs and
  constants that are not perturbed get no per-step gradient work.
  """
  x, rest = len(spec.x_float), flags[len(spec.carry_float) :]
  statics = len(spec.static_float)

  def keep(mask: tuple[bool, ...], perturbed: Sequence[bool]) -> tuple[bool, ...]:
    return tuple(m and p for m, p in zip(mask, perturbed, strict=True))

  return dataclasses.replace(
    spec,
    x_float=keep(spec.x_float, rest[:x]),
    static_float=keep(spec.static_float, rest[x : x + statics]),
    const_float=keep(spec.const_float, rest[x + statics :]),
  )


def _check_consts_vary(spec: LoopSpec, consts: Leaves) -> None:
  """Raises for a differentiated constant that varies over fewer mesh axes
  than the data: its gradient would be summed over devices at every step,
  a collective inside loops whose trip counts differ per device."""
  for i, (c, diff) in enumerate(zip(consts, spec.const_float, strict=True)):
    missing = spec.vma - varying_axes(c)
    if diff and missing:
      raise ValueError(
        f"Expected every array the step closes over to vary over the mesh axes "
        f"{sorted(spec.vma, key=str)} of the data, like the data; constant {i} "
        f"({_shape_dtype(c)}) does not vary over {sorted(missing, key=str)}. "
        "Its gradient would be reduced at every step of loops whose trip "
        "counts differ per device. Cast the parameters before the loop with "
        "`jax.lax.pcast(params, axis, to='varying')` and reduce their "
        "gradients once after it (`jaxlod.parallel.data_parallel` does both)."
      )


def _shape_dtype(x: Any) -> str:
  return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _loop_fwd(spec: LoopSpec, *args: Any) -> tuple[tuple[Leaves, Leaves], _Residuals]:
  """The forward rule: runs the phases, storing what `_loop_bwd` needs."""
  (carry, values, statics, consts, bounds), flags = _unwrap(args)
  # The perturbed flags are static; `bounds` are integers, never perturbed.
  flags = tuple(flags[: len(flags) - len(jax.tree.leaves(bounds))])
  local = _differentiated(spec, flags)
  _check_consts_vary(local, consts)
  plans = phase_residuals(local, carry, values, statics, consts)
  ys, final, saved = _forward(local, plans, carry, values, statics, consts, bounds)
  primals = (carry, values, statics, consts, bounds)
  return (ys, final), _Residuals(
    _Perturbed(flags), _Plans(tuple(plans)), saved, primals
  )


def _loop_bwd(
  spec: LoopSpec, residuals: _Residuals, cotangents: tuple[Any, Any]
) -> tuple[Any, ...]:
  """The backward rule: cotangents of the inputs from those of ``(ys, carry)``."""
  perturbed, plans, saved, primals = residuals
  local = _differentiated(spec, perturbed.flags)
  g_ys, g_carry = vary(
    jax.tree.map(
      _instantiate, cotangents, is_leaf=lambda x: isinstance(x, SymbolicZero)
    ),
    spec.vma,
  )
  grads = _backward(local, list(plans.plans), saved, primals, g_ys, g_carry)
  return (*grads, None)


def make_loop(
  spec: LoopSpec,
) -> Callable[[Leaves, Leaves, Leaves, Leaves, Bounds], tuple[Leaves, Leaves]]:
  """The phased loop as a function with a custom VJP.

  ``loop(carry, values, statics, consts, bounds) -> (ys, carry)``: flat lists
  of arrays (`values` and `ys` time-major), and ``bounds = (step_offsets,
  saved_offsets, lengths, phase_starts, phase_ends)``, int32 arrays: the
  first time-major and schedule row of each step ``[time_capacity]``, the
  ranked lengths ``[count_capacity]`` and the phase plan ``[num_phases]``.
  """

  @jax.custom_vjp
  def loop(
    carry: Leaves, values: Leaves, statics: Leaves, consts: Leaves, bounds: Bounds
  ) -> tuple[Leaves, Leaves]:
    ys, final, _ = _forward(spec, None, carry, values, statics, consts, bounds)
    return ys, final

  loop.defvjp(
    functools.partial(_loop_fwd, spec),
    functools.partial(_loop_bwd, spec),
    symbolic_zeros=True,
  )
  return loop
