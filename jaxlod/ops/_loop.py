"""The phased loop and its custom VJP (Fluid's ``while`` + ``while_grad``).

Everything here works on flat lists of rank-ordered arrays: carry and static
leaves are ``[count_capacity, ...]``, step inputs and outputs are stacked
time-major buffers ``[time_capacity, count_capacity, ...]``. Phase ``k`` runs
a `lax.while_loop` over steps ``[start_k, end_k)`` at the static batch size
``ladder[k]`` on the prefix ``[:ladder[k]]`` of every array.

The backward pass runs the phases in reverse, each stepping ``t`` downward and
calling the VJP of the step, summing the gradients of parameters and static
inputs across steps. With ``remat=False`` the forward pass saves the step's
VJP residuals: those that depend on the carry or the step input are stacked
per step; those that depend only on parameters and static inputs (a
concatenated kernel, say) are computed once per phase, so nothing of size
``time x weights`` is stored. With ``remat=True`` it saves only the carries
and the backward pass recomputes each step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

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


def _start(t: jax.Array, ndim: int) -> tuple[jax.Array, ...]:
  """Index ``(t, 0, ..., 0)`` of one integer type (x64 mode included)."""
  t = jnp.asarray(t)
  return (t, *(jnp.zeros_like(t),) * (ndim - 1))


def _read(buffer: jax.Array, t: jax.Array, size: int) -> jax.Array:
  """``buffer[t, :size]`` for a traced step `t`."""
  start = _start(t, buffer.ndim)
  return lax.dynamic_slice(buffer, start, (1, size, *buffer.shape[2:]))[0]


def _write(buffer: jax.Array, t: jax.Array, value: jax.Array) -> jax.Array:
  """``buffer.at[t, :len(value)].set(value)`` for a traced step `t`."""
  start = _start(t, buffer.ndim)
  return lax.dynamic_update_slice(buffer, value[None].astype(buffer.dtype), start)


def _uninitialized(shape: tuple[int, ...], dtype: Any) -> jax.Array:
  """A buffer whose cells are all written before they are read.

  Stacked buffers are read only at cells a phase wrote (and every read of
  cells past a sequence's end is masked with a select), so they need no
  zero fill; `lax.empty` skips it where the backend allows.
  """
  empty = getattr(lax, "empty", None)
  return jnp.zeros(shape, dtype) if empty is None else empty(shape, dtype)


def _set_prefix(full: jax.Array, part: jax.Array) -> jax.Array:
  return lax.dynamic_update_slice(full, part.astype(full.dtype), (0,) * full.ndim)


def _pad_rows(part: jax.Array, rows: int) -> jax.Array:
  return jnp.pad(part, [(0, rows - part.shape[0])] + [(0, 0)] * (part.ndim - 1))


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def step_slots(fn: Callable, num_step_args: int, *args) -> tuple[int, ...]:
  """Which output leaves of ``fn(*args)`` depend on its first args.

  A dependency walk over the jaxpr of `fn`: inputs are the leaves of the
  first `num_step_args` arguments; an equation's outputs depend on all its
  inputs (conservative). Returns, per output leaf, -1 when it depends on
  none of them, else a slot number shared by outputs that are the same
  value (so each is stored once).
  """
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  num_leaves = len(jax.tree.leaves(args[:num_step_args]))
  dependent = set(jaxpr.invars[:num_leaves])
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jex_core.Var) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  slots, seen = [], {}
  for v in jaxpr.outvars:
    if isinstance(v, jex_core.Var) and v in dependent:
      slots.append(seen.setdefault(v, len(seen)))
    else:
      slots.append(-1)
  return tuple(slots)


# -- static description --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase: a flat step function at static batch size `size`.

  ``fn(carry_leaves, x_leaves, inv_leaves) -> (carry_leaves, y_leaves)`` with
  ``inv_leaves = static_leaves[:size] + consts[consts_slice]``.
  """

  size: int
  fn: Callable
  consts: slice


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """Everything static about one phased loop."""

  phases: tuple[Phase, ...]
  count: int
  time: int
  carry_float: tuple[bool, ...]
  x_float: tuple[bool, ...]
  static_float: tuple[bool, ...]
  const_float: tuple[bool, ...]
  y_float: tuple[bool, ...]
  y_tails: tuple[tuple[tuple[int, ...], Any], ...]  # per output leaf
  return_sequences: bool
  remat: bool

  def inv_float(self, phase: Phase) -> tuple[bool, ...]:
    return self.static_float + self.const_float[phase.consts]

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

    return f


# -- what the backward pass needs ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SavePlan:
  """How a phase stores its per-step data for the backward pass.

  Per-step leaves are stacked in buffers ``[time, *shape]``; with `shared`,
  one buffer ``[time, count, *tail]`` serves every phase (phase ``k`` uses
  its prefix ``[:size_k]``).
  """

  slots: tuple[int, ...] | None  # residual mode: per leaf, its buffer or -1
  tree: Any  # residual mode: tree structure of the VJP function
  shapes: tuple[tuple[tuple[int, ...], Any], ...]  # per buffer

  @property
  def per_step(self) -> tuple[bool, ...] | None:
    return None if self.slots is None else tuple(s >= 0 for s in self.slots)

  def stacked(self, leaves: list) -> list:
    """The leaves to store, one per buffer."""
    first = {}
    for leaf, slot in zip(leaves, self.slots, strict=True):
      if slot >= 0:
        first.setdefault(slot, leaf)
    return [first[i] for i in range(len(self.shapes))]

  def residuals(self, stacked: list, invariants: list) -> list:
    """All residual leaves from the stored ones and the invariant ones."""
    invariants = iter(invariants)
    return [stacked[s] if s >= 0 else next(invariants) for s in self.slots]


def _residual_leaves(spec: LoopSpec, phase: Phase):
  def residuals(diff_step, nodiff_step, diff_inv, nodiff_inv):
    f = spec.differentiable(phase, nodiff_step, nodiff_inv)
    _, vjp, _ = jax.vjp(f, diff_step, diff_inv, has_aux=True)
    return jax.tree.leaves(vjp)

  return residuals


def _phase_avals(spec: LoopSpec, phase, carry, xs, statics, consts):
  b = phase.size
  step = [_abstract(c[:b]) for c in carry] + [
    jax.ShapeDtypeStruct((b, *x.shape[2:]), x.dtype) for x in xs
  ]
  inv = [_abstract(s[:b]) for s in statics] + [
    _abstract(c) for c in consts[phase.consts]
  ]
  diff_step, nodiff_step = _split(step, spec.carry_float + spec.x_float)
  diff_inv, nodiff_inv = _split(inv, spec.inv_float(phase))
  return diff_step, nodiff_step, diff_inv, nodiff_inv


def make_plans(spec: LoopSpec, carry, xs, statics, consts) -> list[SavePlan]:
  """Per phase: what to stack per step (from abstract shapes only)."""
  plans = []
  for phase in spec.phases:
    if spec.remat:
      shapes = tuple(((phase.size, *c.shape[1:]), c.dtype) for c in carry)
      plans.append(SavePlan(None, None, shapes))
      continue
    avals = _phase_avals(spec, phase, carry, xs, statics, consts)
    fn = _residual_leaves(spec, phase)
    slots = step_slots(fn, 2, *avals)
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


def _shared_layout(spec: LoopSpec, plans: list[SavePlan]) -> bool:
  """True when every phase stacks leaves ``[size_k, *tail]`` of equal tails."""
  first = plans[0]
  for phase, plan in zip(spec.phases, plans, strict=True):
    if plan.slots != first.slots or len(plan.shapes) != len(first.shapes):
      return False
    for (shape, dtype), (shape0, dtype0) in zip(plan.shapes, first.shapes, strict=True):
      if dtype != dtype0 or shape[:1] != (phase.size,) or shape[1:] != shape0[1:]:
        return False
  return True


# -- the loops ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PhaseData:
  """A phase's traced operands: invariant leaves split by differentiability."""

  diff_inv: list
  nodiff_inv: list
  lengths: jax.Array  # [size], sorted
  start: jax.Array
  end: jax.Array


def _phase_data(spec, phase, k, statics, consts, lengths, starts, ends):
  inv = [s[: phase.size] for s in statics] + list(consts[phase.consts])
  diff_inv, nodiff_inv = _split(inv, spec.inv_float(phase))
  return _PhaseData(diff_inv, nodiff_inv, lengths[: phase.size], starts[k], ends[k])


def _step_vjp(spec, phase, data, c, x):
  """``(outputs, vjp)`` of the step at carry `c` and input `x`."""
  diff_step, nodiff_step = _split(c + x, spec.carry_float + spec.x_float)
  f = spec.differentiable(phase, nodiff_step, data.nodiff_inv)
  outs, vjp, aux = jax.vjp(f, diff_step, data.diff_inv, has_aux=True)
  return _merge(outs, aux, spec.carry_float + spec.y_float), vjp


def _forward_phase(spec, phase, plan, data, xs, carry, ys, buffers, invariants):
  """One phase forward; stacks per-step residuals (or carries) when planned."""
  b = phase.size
  residuals = plan is not None and plan.per_step is not None

  def body(t, state):
    c, ys, buffers = state
    x = [_read(buf, t, b) for buf in xs]
    if residuals:
      out, vjp = _step_vjp(spec, phase, data, c, x)
      new_c, y = out[: len(c)], out[len(c) :]
      stacked = plan.stacked(jax.tree.leaves(vjp))
    else:
      stacked = c if plan is not None else []
      inv = _merge(data.diff_inv, data.nodiff_inv, spec.inv_float(phase))
      new_c, y = phase.fn(c, x, inv)
    buffers = [_write(buf, t, leaf) for buf, leaf in zip(buffers, stacked, strict=True)]
    active = t < data.lengths
    c = [_mask(active, n, o) for n, o in zip(new_c, c, strict=True)]
    if spec.return_sequences:
      ys = [_write(buf, t, leaf) for buf, leaf in zip(ys, y, strict=True)]
    return c, ys, buffers

  state = ([c[:b] for c in carry], ys, buffers)
  c, ys, buffers = lax.fori_loop(data.start, data.end, body, state)
  carry = [_set_prefix(full, part) for full, part in zip(carry, c, strict=True)]
  return carry, ys, buffers


def _forward(spec, plans, carry, xs, statics, consts, lengths, starts, ends):
  """Runs every phase. With `plans`, also stacks what the backward needs.

  Returns ``(ys, final_carry, saved)``; `saved` holds per phase the stacked
  buffers and the loop-invariant residuals.
  """
  ys = []
  if spec.return_sequences:
    ys = [_uninitialized((spec.time, spec.count, *t), d) for t, d in spec.y_tails]
  shared = plans is not None and _shared_layout(spec, plans)
  buffers, saved = [], []
  if shared:
    buffers = _empty((spec.time, spec.count), plans[0], drop=1)
  for k, phase in enumerate(spec.phases):
    plan = plans[k] if plans is not None else None
    data = _phase_data(spec, phase, k, statics, consts, lengths, starts, ends)
    invariants = []
    if plan is not None and not shared:
      buffers = _empty((spec.time,), plan, drop=0)
    if plan is not None and plan.per_step is not None:
      invariants = _invariant_residuals(spec, phase, plan, carry, xs, data)
    carry, ys, buffers = _forward_phase(
      spec, phase, plan, data, xs, carry, ys, buffers, invariants
    )
    saved.append((buffers, invariants))
  if shared:  # every phase wrote into the same buffers: keep the last ones
    saved = [(buffers, invariants) for _, invariants in saved]
  return ys, carry, saved


def _empty(lead: tuple[int, ...], plan: SavePlan, drop: int) -> list[jax.Array]:
  return [_uninitialized((*lead, *shape[drop:]), dtype) for shape, dtype in plan.shapes]


def _invariant_residuals(spec, phase, plan, carry, xs, data):
  """Residuals that depend on no step data, from any carry and input (zeros)."""
  b = phase.size
  step = [jnp.zeros((b, *c.shape[1:]), c.dtype) for c in carry] + [
    jnp.zeros((b, *x.shape[2:]), x.dtype) for x in xs
  ]
  diff_step, nodiff_step = _split(step, spec.carry_float + spec.x_float)
  leaves = _residual_leaves(spec, phase)(
    diff_step, nodiff_step, data.diff_inv, data.nodiff_inv
  )
  return [leaf for leaf, p in zip(leaves, plan.per_step, strict=True) if not p]


def _backward_phase(spec, phase, plan, shared, data, saved, xs, g_ys, state):
  """One phase backward, `t` stepping down; returns the updated cotangents."""
  b = phase.size
  buffers, invariants = saved
  y_zeros = []
  if not spec.return_sequences:
    y_zeros = [
      jnp.zeros((b, *tail), d)
      for (tail, d), f in zip(spec.y_tails, spec.y_float, strict=True)
      if f
    ]

  def body(i, state):
    g_c, g_xs, g_inv = state
    t = data.start + data.end - 1 - i
    if plan.per_step is None:
      c = [_read(buf, t, b) for buf in buffers]
      _, vjp = _step_vjp(spec, phase, data, c, [_read(buf, t, b) for buf in xs])
    else:
      stacked = [_read(buf, t, b) if shared else buf[t] for buf in buffers]
      vjp = jax.tree.unflatten(plan.tree, plan.residuals(stacked, invariants))
    active = t < data.lengths
    g_out = [_mask(active, g, jnp.zeros_like(g)) for g in g_c]
    g_out += [_read(buf, t, b) for buf in g_ys] + y_zeros
    g_step, g_phase_inv = vjp(g_out)
    g_new_c, g_x = g_step[: len(g_c)], g_step[len(g_c) :]
    g_c = [_mask(active, new, old) for new, old in zip(g_new_c, g_c, strict=True)]
    g_xs = [_write(buf, t, g) for buf, g in zip(g_xs, g_x, strict=True)]
    g_inv = [acc + g for acc, g in zip(g_inv, g_phase_inv, strict=True)]
    return g_c, g_xs, g_inv

  return lax.fori_loop(data.start, data.end, body, state)


def _backward(spec, plans, saved, primals, g_ys, g_carry):
  """Phases in reverse; cotangents of (carry, xs, statics, consts)."""
  carry, xs, statics, consts, lengths, starts, ends = primals
  shared = _shared_layout(spec, plans)

  def zeros(leaves, mask):
    return [jnp.zeros(a.shape, a.dtype) for a in _split(leaves, mask)[0]]

  g_carry = _split(g_carry, spec.carry_float)[0]
  g_xs = [_uninitialized(x.shape, x.dtype) for x in _split(xs, spec.x_float)[0]]
  g_statics = zeros(statics, spec.static_float)
  g_consts = zeros(consts, spec.const_float)
  g_ys = _split(g_ys, spec.y_float)[0] if spec.return_sequences else []
  num_static = len(g_statics)
  # Position of each float constant among the float constants.
  float_index = list(itertools.accumulate(spec.const_float, initial=0))
  for k in reversed(range(len(spec.phases))):
    phase = spec.phases[k]
    data = _phase_data(spec, phase, k, statics, consts, lengths, starts, ends)
    state = (
      [g[: phase.size] for g in g_carry],
      g_xs,
      [jnp.zeros(a.shape, a.dtype) for a in data.diff_inv],
    )
    g_c, g_xs, g_inv = _backward_phase(
      spec, phase, plans[k], shared, data, saved[k], xs, g_ys, state
    )
    g_carry = [_set_prefix(full, part) for full, part in zip(g_carry, g_c, strict=True)]
    for j, g in enumerate(g_inv[:num_static]):
      g_statics[j] = g_statics[j] + _pad_rows(g, spec.count)
    indices = range(len(spec.const_float))[phase.consts]
    const_grads = iter(g_inv[num_static:])
    for i in indices:
      if spec.const_float[i]:
        g_consts[float_index[i]] = g_consts[float_index[i]] + next(const_grads)

  def fill(grads, mask):
    return _merge(grads, [None] * (len(mask) - len(grads)), mask)

  return (
    fill(g_carry, spec.carry_float),
    fill(g_xs, spec.x_float),
    fill(g_statics, spec.static_float),
    fill(g_consts, spec.const_float),
  )


def make_loop(spec: LoopSpec, plans_for: Callable[..., list[SavePlan]] = make_plans):
  """The phased loop as a function with a custom VJP.

  ``loop(carry, xs, statics, consts, lengths, starts, ends) -> (ys, carry)``,
  all flat lists of arrays except the int32 `lengths` ``[count]`` (sorted) and
  the phase bounds ``[num_phases]``.
  """

  @jax.custom_vjp
  def loop(carry, xs, statics, consts, lengths, starts, ends):
    ys, final, _ = _forward(
      spec, None, carry, xs, statics, consts, lengths, starts, ends
    )
    return ys, final

  def loop_fwd(carry, xs, statics, consts, lengths, starts, ends):
    plans = plans_for(spec, carry, xs, statics, consts)
    ys, final, saved = _forward(
      spec, plans, carry, xs, statics, consts, lengths, starts, ends
    )
    primals = (carry, xs, statics, consts, lengths, starts, ends)
    return (ys, final), (saved, primals)

  def loop_bwd(residuals, cotangents):
    saved, primals = residuals
    g_ys, g_carry = cotangents
    plans = plans_for(spec, *primals[:4])
    grads = _backward(spec, plans, saved, primals, g_ys, g_carry)
    return (*grads, None, None, None)

  loop.defvjp(loop_fwd, loop_bwd)
  return loop
