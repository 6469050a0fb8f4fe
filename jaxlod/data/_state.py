"""The state of a `Batcher`: its position in the stream and what fixes its plan.

A state is a small dict of JSON values (ints, a bool, a str, lists of ints,
``None``), so that it saves as JSON beside a model's checkpoint (Orbax's
``ocp.args.JsonSave``) and reads back unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

VERSION = 1

# The settings a Batcher's plan depends on, checked in this order: a state
# restores only into a Batcher whose plan is the one it was saved with.
PLAN_KEYS = (
  "num_examples",
  "lengths_sha256",
  "token_capacities",
  "sequence_capacity",
  "token_budget",
  "window",
  "shuffle",
  "seed",
  "shards",
)
KEYS = ("version", "step", *PLAN_KEYS)

# The kind of value each key holds.
_KINDS = {
  "version": "an int",
  "step": "an int",
  "num_examples": "an int",
  "lengths_sha256": "a str",
  "token_capacities": "a list of ints",
  "sequence_capacity": "an int",
  "token_budget": "an int",
  "window": "an int",
  "shuffle": "a bool",
  "seed": "an int",
  "shards": "an int or None",
}


def lengths_digest(lengths: np.ndarray) -> str:
  """The SHA-256 hex digest of every example's field lengths ``[n, F]``."""
  lengths = np.ascontiguousarray(lengths, dtype="<i8")
  digest = hashlib.sha256(repr(lengths.shape).encode())
  digest.update(lengths.tobytes())
  return digest.hexdigest()


def _is_host_int(value: Any) -> bool:
  return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _normalized(key: str, value: Any) -> Any:
  """`value` as the JSON value it stands for; raises if not of `key`'s kind."""
  kind = _KINDS[key]
  if kind == "an int" and _is_host_int(value):
    return int(value)
  if kind == "an int or None" and (value is None or _is_host_int(value)):
    return None if value is None else int(value)
  if kind == "a bool" and isinstance(value, bool | np.bool_):
    return bool(value)
  if kind == "a str" and isinstance(value, str):
    return value
  if (
    kind == "a list of ints"
    and isinstance(value, list | tuple)
    and all(_is_host_int(v) for v in value)
  ):
    return [int(v) for v in value]
  raise TypeError(f"Expected Batcher state key {key!r} to be {kind}, got {value!r}.")


def check_state(state: Any, plan: Mapping[str, Any]) -> int:
  """The step of `state`, once it is known to fit the Batcher of `plan`.

  Args:
    state: a dict from `Batcher.get_state`, as saved (JSON values).
    plan: this Batcher's value of each of `PLAN_KEYS`.

  Returns:
    The step of the state's next batch.

  Raises:
    TypeError: for a state that is not a mapping, or a key's value of the
      wrong type.
    ValueError: for a missing or unknown key, another version, a negative
      step, or a plan setting that differs from this Batcher's (naming the
      key, the state's value and this Batcher's).
  """
  if not isinstance(state, Mapping):
    raise TypeError(
      "Expected `state` to be a dict from Batcher.get_state(), got "
      f"{type(state).__name__}."
    )
  missing = [key for key in KEYS if key not in state]
  if missing:
    raise ValueError(
      f"Batcher state is missing key {missing[0]!r}; a state from "
      f"Batcher.get_state() has keys {', '.join(map(repr, KEYS))}."
    )
  version = _normalized("version", state["version"])
  if version != VERSION:
    raise ValueError(
      f"Batcher state key 'version' is {version}, but this jaxlod reads version "
      f"{VERSION}."
    )
  unknown = sorted(str(key) for key in state if key not in KEYS)
  if unknown:
    raise ValueError(
      f"Batcher state has unknown key {unknown[0]!r}; a state from "
      f"Batcher.get_state() has keys {', '.join(map(repr, KEYS))}."
    )
  step = _normalized("step", state["step"])
  if step < 0:
    raise ValueError(f"Expected Batcher state key 'step' to be >= 0, got {step}.")
  for key in PLAN_KEYS:
    saved = _normalized(key, state[key])
    if saved != plan[key]:
      raise ValueError(
        f"Batcher state key {key!r} is {saved!r}, but this Batcher's is "
        f"{plan[key]!r}: the state comes from a Batcher with another plan "
        "(examples' lengths, capacities, token_budget, window, shuffle, seed "
        "or shards)."
      )
  return step
