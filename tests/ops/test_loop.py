"""The residual slots of the phased loop (`jaxlod.ops._loop._spec`) and the
static flags of its custom VJP (`jaxlod.ops._loop._phased_loop`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlod.ops._loop import _phased_loop, _spec
from jaxlod.ops._loop._spec import Slot, SlotKind


def _fn(step, inv):
  """Outputs: a saved value twice, the input unchanged, an invariant, another."""
  h, x = step
  (w,) = inv
  y = jnp.tanh(h @ w)
  return [y, x, y, jnp.sin(w), h * x]


def test_step_slots_names_each_kind():
  step = [jnp.zeros((2, 3)), jnp.zeros((2, 3))]
  slots = _spec.step_slots(_fn, 1, step, [jnp.zeros((3, 3))], reloadable=(1,))
  assert slots == (
    Slot(SlotKind.SAVED, 0),
    Slot(SlotKind.INPUT, 0),
    Slot(SlotKind.SAVED, 0),
    Slot(SlotKind.INVARIANT),
    Slot(SlotKind.SAVED, 1),
  )
  assert len(set(slots)) == 4  # hashable: static data at trace time


def test_save_plan_stores_each_saved_value_once_and_reassembles():
  slots = _spec.step_slots(
    _fn, 1, [jnp.zeros((2, 3))] * 2, [jnp.zeros((3, 3))], reloadable=(1,)
  )
  plan = _spec.Residuals(slots, None, (((2, 3), jnp.float32),) * 2)
  leaves = [jnp.full((2, 3), float(i)) for i in range(5)]
  stacked = plan.stacked(leaves)
  assert [int(a[0, 0]) for a in stacked] == [0, 4]
  assert plan.per_step == (True, True, True, False, True)
  assert not plan.recompute
  x = [jnp.full((2, 3), 1.0)]
  out = plan.residuals(stacked, [leaves[3]], x)
  assert [int(a[0, 0]) for a in out] == [0, 1, 0, 3, 4]


def test_perturbed_flags_are_static_structure():
  perturbed = _phased_loop._Perturbed((True, False))
  leaves, tree = jax.tree.flatten(perturbed)
  assert leaves == []
  assert jax.tree.unflatten(tree, []) == perturbed
