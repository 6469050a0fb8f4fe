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
VJP residuals: those that depend on the carry or the step input are stored
per step in the schedule layout of `jaxlod.ops._packed`, those that depend only on
parameters and static inputs (a concatenated kernel, say) are computed once
per phase, so nothing of size ``time x weights`` is stored. The residuals
come from the step under `jax.checkpoint` with a policy that keeps matrix
products and transcendental functions and recomputes cheap elementwise
ops, and a residual that is the step input unchanged is read again from the
inputs: an LSTM step keeps its carries and five activations per row rather
than thirteen leaves. With ``remat=True`` it saves only the carries and the
backward pass recomputes each step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend import core as jex_core

from jaxlod._vma import vary, varying_axes

# -- helpers -------------------------------------------------------------------------


def is_float(x: Any) -> bool:
  return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def _split(leaves: list, mask: tuple[bool, ...]) -> tuple[list, list]:
  yes = [leaf for leaf, m in zip(leaves, mask, strict=True) if m]
  no = [leaf for leaf, m in zip(leaves, mask, strict=True) if not m]
  return yes, no


def _merge(yes: list, no: list, mask: tuple[bool, ...]) -> list:
  yes, no = iter(yes), iter(no)
  return [next(yes) if m else next(no) for m in mask]


def _mask(active: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  """Rows where `active` take `new`; the others keep `old`."""
  shape = active.shape + (1,) * (new.ndim - 1)
  return jnp.where(active.reshape(shape), new, old)


def _slab(buffer: jax.Array, offset: jax.Array, size: int) -> jax.Array:
  """Rows ``[offset, offset + size)`` of `buffer`."""
  return lax.dynamic_slice_in_dim(buffer, offset, size, axis=0)


def _put(buffer: jax.Array, offset: jax.Array, value: jax.Array) -> jax.Array:
  """Writes `value` at rows ``[offset, offset + len(value))``."""
  return lax.dynamic_update_slice_in_dim(buffer, value.astype(buffer.dtype), offset, 0)


def _start(t: jax.Array, ndim: int) -> tuple[jax.Array, ...]:
  """Index ``(t, 0, ..., 0)`` of one integer type (x64 mode included)."""
  t = jnp.asarray(t)
  return (t, *(jnp.zeros_like(t),) * (ndim - 1))


def _set_prefix(full: jax.Array, part: jax.Array) -> jax.Array:
  return lax.dynamic_update_slice(full, part.astype(full.dtype), (0,) * full.ndim)


def _pad_rows(part: jax.Array, rows: int) -> jax.Array:
  return jnp.pad(part, [(0, rows - part.shape[0])] + [(0, 0)] * (part.ndim - 1))


def _abstract(x: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
  """The shape (or `shape`), dtype and varying mesh axes of `x`."""
  shape = x.shape if shape is None else shape
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is None or not mat.varying:
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return jax.ShapeDtypeStruct(
    shape, x.dtype, sharding=aval.sharding, manual_axis_type=mat
  )


def step_slots(
  fn: Callable, num_step_args: int, *args, reloadable: tuple[int, ...] = ()
) -> tuple[int, ...]:
  """Which output leaves of ``fn(*args)`` depend on its first args.

  A dependency walk over the jaxpr of `fn`: inputs are the leaves of the
  first `num_step_args` arguments; an equation's outputs depend on all its
  inputs (conservative). Returns, per output leaf, -1 when it depends on
  none of them, ``-2 - k`` when it is, unchanged, the input leaf
  ``reloadable[k]`` (a flat index among those leaves: the caller can load it
  again rather than store it), else a slot number shared by outputs that are
  the same value (so each is stored once).
  """
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  num_leaves = len(jax.tree.leaves(args[:num_step_args]))
  dependent = set(jaxpr.invars[:num_leaves])
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jex_core.Var) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  reload = {jaxpr.invars[i]: -2 - k for k, i in enumerate(reloadable)}
  slots, seen = [], {}
  for v in jaxpr.outvars:
    if isinstance(v, jex_core.Var) and v in reload:
      slots.append(reload[v])
    elif isinstance(v, jex_core.Var) and v in dependent:
      slots.append(seen.setdefault(v, len(seen)))
    else:
      slots.append(-1)
  return tuple(slots)


# Cheap elementwise and layout primitives: with saved residuals the backward
# pass recomputes these from the values it keeps (e.g. ``1 - y`` of a
# sigmoid's derivative) rather than storing their outputs for every row.
_CHEAP = frozenset({
  "add", "sub", "mul", "neg", "max", "min", "abs", "sign", "select_n", "copy",
  "convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
  "expand_dims", "slice", "split", "integer_pow", "square",
})  # fmt: skip


def _save_costly(prim, *_, **__) -> bool:
  return prim.name not in _CHEAP


# -- static description --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase: a flat step function at static batch size `size`.

  ``fn(carry_leaves, x_leaves, inv_leaves) -> (carry_leaves, y_leaves)`` with
  ``inv_leaves = static_leaves[:size] + [consts[i] for i in consts]``: the
  phases share one list of constants (model parameters).
  """

  size: int
  fn: Callable
  consts: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """Everything static about one phased loop."""

  phases: tuple[Phase, ...]
  count: int  # count capacity: rows of the carry and static inputs
  rows: int  # rows of the time-major inputs and outputs
  saved_rows: int  # rows of the schedule layout of stored residuals
  time: int  # time capacity
  carry_float: tuple[bool, ...]
  x_float: tuple[bool, ...]
  static_float: tuple[bool, ...]
  const_float: tuple[bool, ...]
  y_float: tuple[bool, ...]
  y_tails: tuple[tuple[tuple[int, ...], Any], ...]  # per output leaf
  return_sequences: bool
  remat: bool
  # Mesh axes every carry, input, static and buffer varies over (under
  # `shard_map`; see `jaxlod._vma`), so the loops keep one type throughout.
  vma: frozenset = frozenset()

  def zeros(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros that vary over `vma`, to start a loop buffer."""
    return vary(jnp.zeros(shape, dtype), self.vma)

  def inv_float(self, phase: Phase) -> tuple[bool, ...]:
    return self.static_float + tuple(self.const_float[i] for i in phase.consts)

  def differentiable(self, phase: Phase, nodiff_step: list, nodiff_inv: list):
    """The step as a function of its float leaves only.

    ``f(diff_step, diff_inv) -> (float outputs, non-float outputs)``, where
    step leaves are carry + input and outputs are new carry + step output.
    """
    step_float = self.carry_float + self.x_float
    out_float = self.carry_float + self.y_float
    num_carry = len(self.carry_float)

    def f(diff_step, diff_inv):
      step = _merge(diff_step, nodiff_step, step_float)
      inv = _merge(diff_inv, nodiff_inv, self.inv_float(phase))
      new_carry, y = phase.fn(step[:num_carry], step[num_carry:], inv)
      return _split(list(new_carry) + list(y), out_float)

    # Saved residuals: keep only what `_save_costly` allows; remat recomputes
    # the whole step anyway.
    return f if self.remat else jax.checkpoint(f, policy=_save_costly)


# -- what the backward pass needs ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SavePlan:
  """How a phase stores its per-step data for the backward pass.

  Row layout (`by_row`): every stored leaf is ``[size, *tail]`` and goes to
  its step's rows of a schedule-layout buffer (see `_row_groups`), shared by
  all phases. Otherwise (a residual whose leading axis is not the batch) each
  phase stacks its leaves by step in buffers ``[time_capacity, *shape]``.
  A residual that is a step input ``x_t`` unchanged is not stored: the
  backward pass reads it again from the inputs.
  """

  # Residual mode: per leaf, its buffer, -1 (loop-invariant) or -2 - k (step
  # input leaf k, read again).
  slots: tuple[int, ...] | None
  tree: Any  # residual mode: tree structure of the VJP function
  shapes: tuple[tuple[tuple[int, ...], Any], ...]  # per buffer, at this phase

  @property
  def per_step(self) -> tuple[bool, ...] | None:
    return None if self.slots is None else tuple(s != -1 for s in self.slots)

  def stacked(self, leaves: list) -> list:
    """The leaves to store, one per buffer."""
    first = {}
    for leaf, slot in zip(leaves, self.slots, strict=True):
      if slot >= 0:
        first.setdefault(slot, leaf)
    return [first[i] for i in range(len(self.shapes))]

  def residuals(self, stacked: list, invariants: list, x: list) -> list:
    """All residual leaves from the stored, invariant and input (`x`) ones."""
    invariants = iter(invariants)
    return [
      stacked[s] if s >= 0 else next(invariants) if s == -1 else x[-2 - s]
      for s in self.slots
    ]


def _residual_leaves(spec: LoopSpec, phase: Phase):
  def residuals(diff_step, nodiff_step, diff_inv, nodiff_inv):
    f = spec.differentiable(phase, nodiff_step, nodiff_inv)
    _, vjp, _ = jax.vjp(f, diff_step, diff_inv, has_aux=True)
    return jax.tree.leaves(vjp)

  return residuals


def _phase_avals(spec: LoopSpec, phase, carry, values, statics, consts):
  b = phase.size
  step = [_abstract(c, (b, *c.shape[1:])) for c in carry]
  step += [_abstract(v, (b, *v.shape[1:])) for v in values]
  inv = [_abstract(s, (b, *s.shape[1:])) for s in statics]
  inv += [_abstract(consts[i]) for i in phase.consts]
  diff_step, nodiff_step = _split(step, spec.carry_float + spec.x_float)
  diff_inv, nodiff_inv = _split(inv, spec.inv_float(phase))
  return diff_step, nodiff_step, diff_inv, nodiff_inv


def make_plans(spec: LoopSpec, carry, values, statics, consts) -> list[SavePlan]:
  """Per phase: what to store per step (from abstract shapes only)."""
  # Step leaves reach the residual function flattened as (diff_step,
  # nodiff_step): where each input leaf x_t[k] (after the carry) sits there.
  step_mask = spec.carry_float + spec.x_float
  diff, nodiff = _split(list(range(len(step_mask))), step_mask)
  position = {leaf: j for j, leaf in enumerate(diff + nodiff)}
  num_carry = len(spec.carry_float)
  inputs = tuple(position[num_carry + k] for k in range(len(spec.x_float)))
  plans = []
  for phase in spec.phases:
    if spec.remat:
      shapes = tuple(((phase.size, *c.shape[1:]), c.dtype) for c in carry)
      plans.append(SavePlan(None, None, shapes))
      continue
    avals = _phase_avals(spec, phase, carry, values, statics, consts)
    fn = _residual_leaves(spec, phase)
    slots = step_slots(fn, 2, *avals, reloadable=inputs)
    leaves = jax.eval_shape(fn, *avals)
    firsts = {}
    for leaf, slot in zip(leaves, slots, strict=True):
      if slot >= 0:
        firsts.setdefault(slot, (leaf.shape, leaf.dtype))
    shapes = tuple(firsts[i] for i in range(len(firsts)))

    def vjp_tree(*args, phase=phase):
      f = spec.differentiable(phase, args[1], args[3])
      return jax.vjp(f, args[0], args[2], has_aux=True)[1]

    tree = jax.tree.structure(jax.eval_shape(vjp_tree, *avals))
    plans.append(SavePlan(slots, tree, shapes))
  return plans


def by_row(spec: LoopSpec, plans: list[SavePlan]) -> bool:
  """True when every phase stores leaves ``[size_k, *tail]`` of equal tails."""
  first = plans[0]
  for phase, plan in zip(spec.phases, plans, strict=True):
    if plan.slots != first.slots or len(plan.shapes) != len(first.shapes):
      return False
    for (shape, dtype), (shape0, dtype0) in zip(plan.shapes, first.shapes, strict=True):
      if dtype != dtype0 or shape[:1] != (phase.size,) or shape[1:] != shape0[1:]:
        return False
  return True


# -- one phase ------------------------------------------------------------------------


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

  def cells(self, t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Step `t`: active rows, first time-major row, first schedule row."""
    return t < self.lengths, self.step_offsets[t], self.saved_offsets[t]


def _phase_data(spec, phase, k, statics, consts, bounds):
  step_offsets, saved_offsets, lengths, phase_starts, phase_ends = bounds
  b = phase.size
  inv = [s[:b] for s in statics] + [consts[i] for i in phase.consts]
  diff_inv, nodiff_inv = _split(inv, spec.inv_float(phase))
  return _PhaseData(
    diff_inv,
    nodiff_inv,
    step_offsets,
    saved_offsets,
    lengths[:b],
    phase_starts[k],
    phase_ends[k],
  )


def _step_vjp(spec, phase, data, c, x):
  """``(outputs, vjp)`` of the step at carry `c` and input `x`."""
  diff_step, nodiff_step = _split(c + x, spec.carry_float + spec.x_float)
  f = spec.differentiable(phase, nodiff_step, data.nodiff_inv)
  outs, vjp, aux = jax.vjp(f, diff_step, data.diff_inv, has_aux=True)
  return _merge(outs, aux, spec.carry_float + spec.y_float), vjp


def _row_groups(plan: SavePlan, rows: int) -> tuple[list, list]:
  """Row layout: the stored leaves of one row shape and dtype share a buffer.

  Returns per stored leaf ``(buffer, index in it)`` and per buffer its shape
  ``[count, rows, *tail]`` and dtype. One buffer per leaf would be zero-filled
  by one broadcast that XLA then copies for each loop-carried buffer (for the
  LSTM residuals of benchmark W1, 12 copies of 4.6 MB per call).
  """
  where, groups = [], {}
  for shape, dtype in plan.shapes:
    key = (tuple(shape[1:]), jnp.dtype(dtype))
    group = groups.setdefault(key, [len(groups), 0])
    where.append(tuple(group))
    group[1] += 1
  return where, [
    ((count, rows, *tail), dtype) for (tail, dtype), (_, count) in groups.items()
  ]


def _row_start(j: int, offset: jax.Array, ndim: int) -> tuple[jax.Array, ...]:
  """Index ``(j, offset, 0, ..., 0)`` of one integer type."""
  offset = jnp.asarray(offset)
  return (jnp.asarray(j, offset.dtype), *_start(offset, ndim - 1))


def _store(where, buffers, t, offset, leaves):
  """Stores a step's leaves at its rows (row layout: `where` from
  `_row_groups`) or, when `where` is `None`, at index `t`."""
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


def _load(where, buffers, t, offset, size):
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


def _forward_phase(spec, phase, plan, row_layout, data, values, state):
  """One phase forward; stores per-step residuals (or carries) when planned."""
  residual_mode = plan is not None and plan.per_step is not None
  b = phase.size
  where = _row_groups(plan, spec.saved_rows)[0] if row_layout else None

  def body(t, state):
    c, ys, buffers = state
    active, offset, saved = data.cells(t)
    x = [_slab(v, offset, b) for v in values]
    if residual_mode:
      out, vjp = _step_vjp(spec, phase, data, c, x)
      new_c, y = out[: len(c)], out[len(c) :]
      stored = plan.stacked(jax.tree.leaves(vjp))
    else:
      stored = c if plan is not None else []
      inv = _merge(data.diff_inv, data.nodiff_inv, spec.inv_float(phase))
      new_c, y = phase.fn(c, x, inv)
    buffers = _store(where, buffers, t, saved, stored)
    c = [_mask(active, n, o) for n, o in zip(new_c, c, strict=True)]
    if spec.return_sequences:
      # Rows past the active batch land in the next step's slab, which that
      # step then overwrites.
      ys = [_put(buf, offset, leaf) for buf, leaf in zip(ys, y, strict=True)]
    return c, ys, buffers

  return lax.fori_loop(data.first, data.last, body, state)


def _backward_phase(spec, phase, plan, row_layout, data, saved, values, g_ys, state):
  """One phase backward, `t` stepping down; returns the updated cotangents.

  ``state = (g_carry [size], g_values, g_statics [size], g_consts)``; the
  constants' gradients accumulate across all phases.
  """
  b = phase.size
  buffers, invariants = saved
  where = _row_groups(plan, spec.saved_rows)[0] if row_layout else None
  y_zeros = []
  if not spec.return_sequences:
    y_zeros = [
      spec.zeros((b, *tail), d)
      for (tail, d), f in zip(spec.y_tails, spec.y_float, strict=True)
      if f
    ]
  # Where each float constant of the phase sits among all float constants.
  position = list(itertools.accumulate(spec.const_float, initial=0))
  const_slots = [position[i] for i in phase.consts if spec.const_float[i]]

  def body(i, state):
    g_c, g_values, g_statics, g_consts = state
    t = data.first + data.last - 1 - i
    active, offset, saved = data.cells(t)
    stored = _load(where, buffers, t, saved, b)
    x = [_slab(v, offset, b) for v in values]
    if plan.per_step is None:
      _, vjp = _step_vjp(spec, phase, data, stored, x)
    else:
      residuals = plan.residuals(stored, invariants, x)
      vjp = jax.tree.unflatten(plan.tree, residuals)
    g_out = [_mask(active, g, jnp.zeros_like(g)) for g in g_c]
    g_out += [_mask(active, _slab(g, offset, b), jnp.zeros((), g.dtype)) for g in g_ys]
    g_step, g_inv = vjp(g_out + y_zeros)
    g_new_c, g_x = g_step[: len(g_c)], g_step[len(g_c) :]
    g_c = [_mask(active, new, old) for new, old in zip(g_new_c, g_c, strict=True)]
    # Going backward, the next step's slab is already written: keep its rows.
    g_values = [
      _put(buf, offset, _mask(active, g, _slab(buf, offset, b)))
      for buf, g in zip(g_values, g_x, strict=True)
    ]
    g_inv_statics, g_inv_consts = g_inv[: len(g_statics)], g_inv[len(g_statics) :]
    g_statics = [a + g for a, g in zip(g_statics, g_inv_statics, strict=True)]
    g_consts = list(g_consts)
    for slot, g in zip(const_slots, g_inv_consts, strict=True):
      g_consts[slot] = g_consts[slot] + g
    return g_c, g_values, g_statics, g_consts

  return lax.fori_loop(data.first, data.last, body, state)


# -- all phases ---------------------------------------------------------------------


def _invariant_residuals(spec, phase, plan, carry, values, data):
  """Residuals that depend on no step data, from any carry and input (zeros)."""
  b = phase.size
  step = [spec.zeros((b, *c.shape[1:]), c.dtype) for c in carry]
  step += [spec.zeros((b, *v.shape[1:]), v.dtype) for v in values]
  diff_step, nodiff_step = _split(step, spec.carry_float + spec.x_float)
  leaves = _residual_leaves(spec, phase)(
    diff_step, nodiff_step, data.diff_inv, data.nodiff_inv
  )
  return [leaf for leaf, p in zip(leaves, plan.per_step, strict=True) if not p]


def _buffers(spec, plan, row_layout):
  # Row layout: one buffer per row shape (see `_row_groups`), each leaf at its
  # own index, so a step's store is one contiguous row copy per leaf. Packing
  # the leaves side by side along the features fused a concatenate into every
  # step's store: storing the LSTM residuals of benchmark W1 took 1.7x as long.
  if row_layout:
    return [
      spec.zeros(shape, dtype) for shape, dtype in _row_groups(plan, spec.saved_rows)[1]
    ]
  return [spec.zeros((spec.time, *shape), dtype) for shape, dtype in plan.shapes]


def _forward(spec, plans, carry, values, statics, consts, bounds):
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
    if plan is not None and plan.per_step is not None:
      invariants = _invariant_residuals(spec, phase, plan, carry, values, data)
    state = ([c[: phase.size] for c in carry], ys, buffers)
    c, ys, buffers = _forward_phase(spec, phase, plan, row_layout, data, values, state)
    carry = [_set_prefix(full, part) for full, part in zip(carry, c, strict=True)]
    saved.append((buffers, invariants))
  if row_layout:  # the phases shared the buffers: keep the final ones
    saved = [(buffers, invariants) for _, invariants in saved]
  return ys, carry, saved


def _backward(spec, plans, saved, primals, g_ys, g_carry):
  """Phases in reverse; cotangents of (carry, values, statics, consts)."""
  carry, values, statics, consts, bounds = primals
  row_layout = by_row(spec, plans)

  def zeros(leaves, mask):
    return [spec.zeros(a.shape, a.dtype) for a in _split(leaves, mask)[0]]

  g_carry = _split(g_carry, spec.carry_float)[0]
  g_values = zeros(values, spec.x_float)
  g_statics = zeros(statics, spec.static_float)
  g_consts = zeros(consts, spec.const_float)
  g_ys = _split(g_ys, spec.y_float)[0] if spec.return_sequences else []
  for k in reversed(range(len(spec.phases))):
    phase = spec.phases[k]
    data = _phase_data(spec, phase, k, statics, consts, bounds)
    state = (
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
      full + _pad_rows(part, spec.count)
      for full, part in zip(g_statics, g_phase_statics, strict=True)
    ]

  def fill(grads, mask):
    return _merge(grads, [None] * (len(mask) - len(grads)), mask)

  return (
    fill(g_carry, spec.carry_float),
    fill(g_values, spec.x_float),
    fill(g_statics, spec.static_float),
    fill(g_consts, spec.const_float),
  )


def _unwrap(tree: Any) -> tuple[Any, list[bool]]:
  """Values and perturbed flags of a pytree of `CustomVJPPrimal`s."""
  is_primal = lambda x: isinstance(x, CustomVJPPrimal)  # noqa: E731
  leaves, tree_def = jax.tree.flatten(tree, is_leaf=is_primal)
  values = jax.tree.unflatten(tree_def, [leaf.value for leaf in leaves])
  return values, [leaf.perturbed for leaf in leaves]


def _instantiate(cotangent: Any) -> jax.Array:
  if isinstance(cotangent, SymbolicZero):
    return jnp.zeros(cotangent.shape, cotangent.dtype)
  return cotangent


def _differentiated(spec: LoopSpec, flags: list[bool]) -> LoopSpec:
  """`spec` differentiating only the perturbed inputs (input side only).

  Carry and outputs stay differentiable: their cotangents carry the
  gradient of anything perturbed upstream. Inputs, static inputs and
  constants that are not perturbed get no per-step gradient work.
  """
  x, rest = len(spec.x_float), flags[len(spec.carry_float) :]
  statics = len(spec.static_float)

  def keep(mask, perturbed):
    return tuple(m and p for m, p in zip(mask, perturbed, strict=True))

  return dataclasses.replace(
    spec,
    x_float=keep(spec.x_float, rest[:x]),
    static_float=keep(spec.static_float, rest[x : x + statics]),
    const_float=keep(spec.const_float, rest[x + statics :]),
  )


def _check_consts_vary(spec: LoopSpec, consts: list) -> None:
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


def make_loop(spec: LoopSpec):
  """The phased loop as a function with a custom VJP.

  ``loop(carry, values, statics, consts, bounds) -> (ys, carry)``: flat lists
  of arrays (`values` and `ys` time-major), and ``bounds = (step_offsets,
  saved_offsets, lengths, phase_starts, phase_ends)``, int32 arrays: the
  first time-major and schedule row of each step ``[time_capacity]``, the
  ranked lengths ``[count_capacity]`` and the phase plan ``[num_phases]``.
  """

  @jax.custom_vjp
  def loop(carry, values, statics, consts, bounds):
    ys, final, _ = _forward(spec, None, carry, values, statics, consts, bounds)
    return ys, final

  def loop_fwd(*args):
    (carry, values, statics, consts, bounds), flags = _unwrap(args)
    flags = flags[: len(flags) - len(jax.tree.leaves(bounds))]
    # The perturbed flags are static: the residuals carry them as structure
    # (an empty tuple for a perturbed input, None for the others).
    marks = tuple(() if f else None for f in flags)
    local = _differentiated(spec, flags)
    _check_consts_vary(local, consts)
    plans = make_plans(local, carry, values, statics, consts)
    ys, final, saved = _forward(local, plans, carry, values, statics, consts, bounds)
    return (ys, final), (marks, saved, (carry, values, statics, consts, bounds))

  def loop_bwd(residuals, cotangents):
    marks, saved, primals = residuals
    local = _differentiated(spec, [m is not None for m in marks])
    g_ys, g_carry = vary(
      jax.tree.map(
        _instantiate, cotangents, is_leaf=lambda x: isinstance(x, SymbolicZero)
      ),
      spec.vma,
    )
    plans = make_plans(local, *primals[:4])
    grads = _backward(local, plans, saved, primals, g_ys, g_carry)
    return (*grads, None)

  loop.defvjp(loop_fwd, loop_bwd, symbolic_zeros=True)
  return loop
