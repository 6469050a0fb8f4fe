"""Serialization of jaxlod's pytrees: `jax.export` and `flax.serialization`.

Each pytree registers itself beside its definition with the functions here:
`LoDTensor` (`jaxlod._lod`), `jaxlod.ops.RankTable`, `Memory` and
`Hypotheses`, so that an exported function taking or returning them can be
serialized, and `flax.serialization.to_bytes` / `from_bytes` round-trip
LoDTensors and rank tables with their static fields checked against the
target's (`check_same_static`, `check_restored_shapes`, and the type's own
check of its restored values).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import serialization

from jaxlod._checks import leaf_name


def _tuples(value: Any) -> Any:
  """JSON's lists back into the tuples static pytree data is made of."""
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def register_export(cls: type, name: str) -> None:
  """Registers a dataclass pytree for `jax.export` serialization: its static
  fields (ints and tuples of ints) travel as JSON."""
  jax.export.register_pytree_node_serialization(
    cls,
    serialized_name=name,
    serialize_auxdata=lambda meta: json.dumps(meta).encode(),
    deserialize_auxdata=lambda data: _tuples(json.loads(data)),
  )


# -- flax.serialization ----------------------------------------------------------


def _field_names(x: Any) -> tuple[list[str], list[str]]:
  """The data and the static field names of a dataclass pytree."""
  children, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
  data = [path[0].name for path, _ in children]
  return data, [f.name for f in dataclasses.fields(x) if f.name not in data]


def _static(state: Any) -> Any:
  """A static field from its state dict: flax's ``{"0": a, "1": b}`` is a tuple."""
  if isinstance(state, dict):
    return tuple(_static(state[str(i)]) for i in range(len(state)))
  return state


_Check = Callable[[Any, dict[str, Any], str], None]


def register_state(
  cls: type, check_static: _Check, check_restored: _Check | None = None
) -> None:
  """Registers a dataclass pytree with `flax.serialization`.

  The state dict holds every field: the data fields as flax's state dicts of
  their values, the static fields too (as ints and ``{"0": ...}`` dicts),
  since they describe the data and a target cannot vouch for them.
  Restoring keeps the target's static fields and replaces its data fields:
  ``check_static(target, saved_static, where)`` compares the saved static
  fields with the target's first, then every leaf must have the target's
  shape, then ``check_restored(restored, saved_static, where)``, if given,
  checks the values on the host. `where` starts each error message.
  """

  def to_state(x: Any) -> dict[str, Any]:
    return {
      f.name: serialization.to_state_dict(getattr(x, f.name))
      for f in dataclasses.fields(x)
    }

  def from_state(target: Any, state: dict[str, Any]) -> Any:
    """`target` with its data fields restored from `state`.

    Args:
      target: an instance of `cls` whose static fields and leaf shapes the
        restored value keeps.
      state: a state dict of `cls`, as `to_state` gives it.

    Returns:
      A copy of `target` whose data fields hold `state`'s values.

    Raises:
      ValueError: for a `state` whose fields are not `cls`'s, saved static
        fields or leaf shapes that differ from `target`'s, or values that
        `check_restored` rejects; each message starts with the state-dict
        path.
    """
    path = serialization.current_path()
    where = f"Restoring a {cls.__name__} at state-dict path {path!r}: "
    data, static = _field_names(target)
    if sorted(state) != sorted(data + static):
      raise ValueError(
        f"{where}expected the fields {sorted(data + static)}, got {sorted(state)}."
      )
    saved = {name: _static(state[name]) for name in static}
    check_static(target, saved, where)
    restored = dataclasses.replace(
      target,
      **{
        name: serialization.from_state_dict(getattr(target, name), state[name], name)
        for name in data
      },
    )
    check_restored_shapes(target, restored, where)
    if check_restored is not None:
      check_restored(restored, saved, where)
    return restored

  serialization.register_serialization_state(cls, to_state, from_state)


# -- checks of a restored pytree ---------------------------------------------------


def check_same_static(target: Any, saved: dict[str, Any], where: str) -> None:
  """Every static field of the state equals the target's."""
  for name, value in saved.items():
    if value != getattr(target, name):
      raise ValueError(
        f"{where}the state has {name}={value!r}, the target "
        f"{name}={getattr(target, name)!r}; restore into a target with the "
        "saved value."
      )


def check_restored_shapes(target: Any, restored: Any, where: str) -> None:
  """Every leaf of `restored` has the shape of the target's leaf."""
  pairs = zip(
    jax.tree_util.tree_leaves_with_path(restored),
    jax.tree.leaves(target),
    strict=True,
  )
  for (path, new), old in pairs:
    if jnp.shape(new) != jnp.shape(old):
      raise ValueError(
        f"{where}the state's leaf {leaf_name(path)} has shape {jnp.shape(new)}, the "
        f"target's {jnp.shape(old)} (the capacities or feature shapes differ)."
      )
