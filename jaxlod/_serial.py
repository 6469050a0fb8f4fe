"""Serialization of jaxlod's pytrees: `jax.export` and `flax.serialization`.

`LoDTensor`, `jaxlod.ops.RankTable`, `Memory` and `Hypotheses` are
registered here (the package imports this module), so that an exported
function taking or returning them can be serialized, and
`flax.serialization.to_bytes` / `from_bytes` round-trip LoDTensors and rank
tables with their static fields checked against the target's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
from flax import serialization

from jaxlod import _host_checks
from jaxlod._lod import LoDTensor
from jaxlod.ops._attention import Memory
from jaxlod.ops._decode import Hypotheses
from jaxlod.ops._rank import RankTable


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
    _host_checks.check_restored_shapes(target, restored, where)
    if check_restored is not None:
      check_restored(restored, saved, where)
    return restored

  serialization.register_serialization_state(cls, to_state, from_state)


register_export(LoDTensor, "jaxlod.LoDTensor")
register_state(
  LoDTensor, _host_checks.check_lod_restore, _host_checks.check_restored_lod
)
register_export(RankTable, "jaxlod.ops.RankTable")
register_state(RankTable, _host_checks.check_same_static)
jax.export.register_namedtuple_serialization(
  Memory, serialized_name="jaxlod.ops.Memory"
)
jax.export.register_namedtuple_serialization(
  Hypotheses, serialized_name="jaxlod.ops.Hypotheses"
)
