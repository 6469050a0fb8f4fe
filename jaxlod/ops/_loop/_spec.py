"""The static side of the phased loop (`jaxlod.ops._loop._phased_loop`): what it is, and
what its forward pass stores for the backward pass.

`Phase` and `LoopSpec` describe the loop; `Residuals` is, per phase, what the
forward pass keeps per step, decided from abstract shapes only: with
``remat=False`` the place (`Slot`) of each residual leaf of the step's VJP,
found by a dependency walk over its jaxpr (`step_slots`), and with
``remat=True`` the carries; `row_groups` lays the stored leaves out in
shared buffers. Everything here is static, hashable data or runs at trace
time on abstract values.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from jaxlod._checks import is_float_dtype
from jaxlod._vma import vary

Leaves = list[jax.Array]  # a flat list of arrays: carry, inputs, residuals...
ShapeDtype = tuple[tuple[int, ...], Any]  # a shape and a dtype
# ``fn(carry_leaves, x_leaves, inv_leaves) -> (carry_leaves, y_leaves)``
StepFn = Callable[[Leaves, Leaves, Leaves], tuple[Leaves, Leaves]]
Where = list[tuple[int, int]]  # per stored leaf: (buffer, index in it)

# -- helpers -------------------------------------------------------------------------


def is_float(x: Any) -> bool:
  return is_float_dtype(x.dtype)


def split(leaves: Sequence[Any], mask: Sequence[bool]) -> tuple[list, list]:
  """The `leaves` where `mask` holds, and the others."""
  yes = [leaf for leaf, m in zip(leaves, mask, strict=True) if m]
  no = [leaf for leaf, m in zip(leaves, mask, strict=True) if not m]
  return yes, no


def merge(yes: Sequence[Any], no: Sequence[Any], mask: Sequence[bool]) -> list:
  """The inverse of `split`: `yes` where `mask` holds, `no` elsewhere."""
  yes, no = iter(yes), iter(no)
  return [next(yes) if m else next(no) for m in mask]


def _abstract(x: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
  """The shape (or `shape`), dtype and varying mesh axes of `x` (an array, or
  a Python scalar the step closes over)."""
  aval = jax.typeof(x)
  shape = aval.shape if shape is None else shape
  mat = getattr(aval, "mat", None)
  if mat is None or not mat.varying:
    return jax.ShapeDtypeStruct(shape, aval.dtype)
  return jax.ShapeDtypeStruct(
    shape, aval.dtype, sharding=aval.sharding, manual_axis_type=mat
  )


# -- residual slots ------------------------------------------------------------------


class SlotKind(enum.Enum):
  """Where the backward pass finds one residual leaf of the step's VJP.

  * ``SAVED``: the leaf depends on the carry or the step input; the forward
    pass stores it per step in buffer `Slot.index` (leaves that are one value
    share a buffer).
  * ``INVARIANT``: the leaf depends on neither (parameters and static inputs
    only); it is computed once per phase.
  * ``INPUT``: the leaf is the step input leaf `Slot.index` unchanged; the
    backward pass reads it again from the inputs rather than storing it.
  """

  SAVED = "saved"
  INVARIANT = "invariant"
  INPUT = "input"


@dataclasses.dataclass(frozen=True)
class Slot:
  """The place of one residual leaf: a kind and, but for ``INVARIANT``, an
  index (a buffer for ``SAVED``, an input leaf for ``INPUT``)."""

  kind: SlotKind
  index: int | None = None


INVARIANT = Slot(SlotKind.INVARIANT)


def step_slots(
  fn: Callable[..., Any],
  num_step_args: int,
  *args: Any,
  reloadable: tuple[int, ...] = (),
) -> tuple[Slot, ...]:
  """Which output leaves of ``fn(*args)`` depend on its first args.

  A dependency walk over the jaxpr of `fn`: inputs are the leaves of the
  first `num_step_args` arguments; an equation's outputs depend on all its
  inputs (conservative). Returns, per output leaf, `INVARIANT` when it
  depends on none of them, ``Slot(INPUT, k)`` when it is, unchanged, the
  input leaf ``reloadable[k]`` (a flat index among those leaves: the caller
  can load it again rather than store it), else ``Slot(SAVED, i)`` with a
  buffer number `i` shared by outputs that are the same value (so each is
  stored once).
  """
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  num_leaves = len(jax.tree.leaves(args[:num_step_args]))
  dependent = set(jaxpr.invars[:num_leaves])
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jex_core.Var) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  reload = {jaxpr.invars[i]: Slot(SlotKind.INPUT, k) for k, i in enumerate(reloadable)}
  slots, seen = [], {}
  for v in jaxpr.outvars:
    if isinstance(v, jex_core.Var) and v in reload:
      slots.append(reload[v])
    elif isinstance(v, jex_core.Var) and v in dependent:
      slots.append(Slot(SlotKind.SAVED, seen.setdefault(v, len(seen))))
    else:
      slots.append(INVARIANT)
  return tuple(slots)


def _first_saved(leaves: Sequence[Any], slots: Sequence[Slot]) -> list:
  """Per ``SAVED`` buffer, the first of `leaves` that goes there."""
  first = {}
  for leaf, slot in zip(leaves, slots, strict=True):
    if slot.kind is SlotKind.SAVED:
      first.setdefault(slot.index, leaf)
  return [first[i] for i in range(len(first))]


# Cheap elementwise and layout primitives: with saved residuals the backward
# pass recomputes these from the values it keeps (e.g. ``1 - y`` of a
# sigmoid's derivative) rather than storing their outputs for every row.
# ``one_minus_square`` is tanh's derivative ``1 - y**2`` as one primitive
# (JAX 0.11.2 and 0.12; no such primitive before).
_CHEAP = frozenset({
  "add", "sub", "mul", "neg", "max", "min", "abs", "sign", "select_n", "copy",
  "convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
  "expand_dims", "slice", "split", "integer_pow", "square", "one_minus_square",
})  # fmt: skip


def _save_costly(prim: jex_core.Primitive, *_: Any, **__: Any) -> bool:
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
  fn: StepFn
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
  y_tails: tuple[ShapeDtype, ...]  # per output leaf
  return_sequences: bool
  remat: bool
  chunk: int = 1  # time steps per `lax.while_loop` iteration (`LoopPlan`)
  # Mesh axes every carry, input, static and buffer varies over (under
  # `shard_map`; see `jaxlod._vma`), so the loops keep one type throughout.
  vma: frozenset = frozenset()

  @property
  def stored_rows(self) -> int:
    """Rows of the schedule-layout buffers: `saved_rows`, and with
    ``chunk > 1`` one more step of the largest size, where the masked
    steps past a phase's end store what nobody reads."""
    return self.saved_rows + (self.phases[0].size if self.chunk > 1 else 0)

  @property
  def stored_steps(self) -> int:
    """Steps of the buffers stored by step (see `stored_rows`)."""
    return self.time + (1 if self.chunk > 1 else 0)

  def zeros(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros that vary over `vma`, to start a loop buffer."""
    return vary(jnp.zeros(shape, dtype), self.vma)

  def inv_float(self, phase: Phase) -> tuple[bool, ...]:
    return self.static_float + tuple(self.const_float[i] for i in phase.consts)

  def differentiable(
    self, phase: Phase, nodiff_step: list, nodiff_inv: list
  ) -> Callable[[list, list], tuple[list, list]]:
    """The step as a function of its float leaves only.

    ``f(diff_step, diff_inv) -> (float outputs, non-float outputs)``, where
    step leaves are carry + input and outputs are new carry + step output.
    """
    step_float = self.carry_float + self.x_float
    out_float = self.carry_float + self.y_float
    num_carry = len(self.carry_float)

    def f(diff_step: list, diff_inv: list) -> tuple[list, list]:
      step = merge(diff_step, nodiff_step, step_float)
      inv = merge(diff_inv, nodiff_inv, self.inv_float(phase))
      new_carry, y = phase.fn(step[:num_carry], step[num_carry:], inv)
      return split(list(new_carry) + list(y), out_float)

    # Saved residuals: keep only what `_save_costly` allows; remat recomputes
    # the whole step anyway.
    return f if self.remat else jax.checkpoint(f, policy=_save_costly)


# -- what the backward pass needs ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Residuals:
  """How a phase stores its per-step data for the backward pass.

  Row layout (`by_row`): every stored leaf is ``[size, *tail]`` and goes to
  its step's rows of a schedule-layout buffer (see `row_groups`), shared by
  all phases. Otherwise (a residual whose leading axis is not the batch) each
  phase stacks its leaves by step in buffers ``[time_capacity, *shape]``.
  A residual that is a step input ``x_t`` unchanged is not stored: the
  backward pass reads it again from the inputs.
  """

  # Residual mode: per leaf of the VJP function, its `Slot`; `None` when the
  # plan stores the carries and the backward pass recomputes each step.
  slots: tuple[Slot, ...] | None
  tree: jax.tree_util.PyTreeDef | None  # residual mode: tree of the VJP function
  shapes: tuple[ShapeDtype, ...]  # per buffer, at this phase

  @property
  def recompute(self) -> bool:
    """True when the plan stores only the carries (``remat=True``)."""
    return self.slots is None

  @property
  def per_step(self) -> tuple[bool, ...] | None:
    if self.slots is None:
      return None
    return tuple(s.kind is not SlotKind.INVARIANT for s in self.slots)

  def stacked(self, leaves: Sequence[jax.Array]) -> Leaves:
    """The leaves to store, one per buffer."""
    return _first_saved(leaves, self.slots)

  def residuals(self, stacked: Leaves, invariants: Leaves, x: Leaves) -> Leaves:
    """All residual leaves from the stored, invariant and input (`x`) ones."""
    invariants = iter(invariants)

    def leaf(slot: Slot) -> jax.Array:
      if slot.kind is SlotKind.SAVED:
        return stacked[slot.index]
      if slot.kind is SlotKind.INPUT:
        return x[slot.index]
      return next(invariants)

    return [leaf(slot) for slot in self.slots]


def residual_leaves(spec: LoopSpec, phase: Phase) -> Callable[..., Leaves]:
  """``residuals(diff_step, nodiff_step, diff_inv, nodiff_inv)``: the leaves of
  the step's VJP function."""

  def residuals(
    diff_step: list, nodiff_step: list, diff_inv: list, nodiff_inv: list
  ) -> Leaves:
    f = spec.differentiable(phase, nodiff_step, nodiff_inv)
    _, vjp, _ = jax.vjp(f, diff_step, diff_inv, has_aux=True)
    return jax.tree.leaves(vjp)

  return residuals


def _phase_avals(
  spec: LoopSpec,
  phase: Phase,
  carry: Leaves,
  values: Leaves,
  statics: Leaves,
  consts: Leaves,
) -> tuple[list[jax.ShapeDtypeStruct], ...]:
  """Abstract ``(diff_step, nodiff_step, diff_inv, nodiff_inv)`` of a phase."""
  b = phase.size
  step = [_abstract(c, (b, *c.shape[1:])) for c in carry]
  step += [_abstract(v, (b, *v.shape[1:])) for v in values]
  inv = [_abstract(s, (b, *s.shape[1:])) for s in statics]
  inv += [_abstract(consts[i]) for i in phase.consts]
  diff_step, nodiff_step = split(step, spec.carry_float + spec.x_float)
  diff_inv, nodiff_inv = split(inv, spec.inv_float(phase))
  return diff_step, nodiff_step, diff_inv, nodiff_inv


def _input_positions(spec: LoopSpec) -> tuple[int, ...]:
  """Where each input leaf x_t[k] sits among the step leaves as the residual
  function receives them, flattened as (diff_step, nodiff_step)."""
  step_mask = spec.carry_float + spec.x_float
  diff, nodiff = split(list(range(len(step_mask))), step_mask)
  position = {leaf: j for j, leaf in enumerate(diff + nodiff)}
  num_carry = len(spec.carry_float)
  return tuple(position[num_carry + k] for k in range(len(spec.x_float)))


def _residuals(
  spec: LoopSpec, phase: Phase, avals: tuple, inputs: tuple[int, ...]
) -> Residuals:
  """The plan of a phase that saves residuals (``remat=False``)."""
  fn = residual_leaves(spec, phase)
  slots = step_slots(fn, 2, *avals, reloadable=inputs)
  leaves = jax.eval_shape(fn, *avals)
  shapes = tuple((leaf.shape, leaf.dtype) for leaf in _first_saved(leaves, slots))

  def vjp_tree(*args: Any) -> Callable[..., Any]:
    f = spec.differentiable(phase, args[1], args[3])
    return jax.vjp(f, args[0], args[2], has_aux=True)[1]

  tree = jax.tree.structure(jax.eval_shape(vjp_tree, *avals))
  return Residuals(slots, tree, shapes)


def phase_residuals(
  spec: LoopSpec, carry: Leaves, values: Leaves, statics: Leaves, consts: Leaves
) -> list[Residuals]:
  """Per phase: what to store per step (from abstract shapes only)."""
  inputs = _input_positions(spec)
  plans = []
  for phase in spec.phases:
    if spec.remat:
      shapes = tuple(((phase.size, *c.shape[1:]), c.dtype) for c in carry)
      plans.append(Residuals(None, None, shapes))
      continue
    avals = _phase_avals(spec, phase, carry, values, statics, consts)
    plans.append(_residuals(spec, phase, avals, inputs))
  return plans


def by_row(spec: LoopSpec, plans: Sequence[Residuals]) -> bool:
  """True when every phase stores leaves ``[size_k, *tail]`` of equal tails."""
  first = plans[0]
  for phase, plan in zip(spec.phases, plans, strict=True):
    if plan.slots != first.slots or len(plan.shapes) != len(first.shapes):
      return False
    for (shape, dtype), (shape0, dtype0) in zip(plan.shapes, first.shapes, strict=True):
      if dtype != dtype0 or shape[:1] != (phase.size,) or shape[1:] != shape0[1:]:
        return False
  return True


def row_groups(plan: Residuals, rows: int) -> tuple[Where, list[ShapeDtype]]:
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
