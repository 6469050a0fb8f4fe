"""The fault record of a LoDTensor: `Fault` and the helpers that keep it.

An op under `jit` that cannot honour its contract sets a `Fault` bit in its
result's ``faults`` (`fault_unless`), every op passes its inputs' faults on
(`faults_of`, `with_faults`), and host reads of a faulted tensor raise
(`check_sound`, `describe_faults` naming the bits). The helpers read a
LoDTensor's ``faults`` field only, so `jaxlod._lod` builds on them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod._checks import is_concrete


class Fault(enum.IntFlag):
  """Why an op under `jit` could not honour its contract (`LoDTensor.faults`).

  Under `jit`, data-dependent checks are `jax.experimental.checkify` checks:
  without `checkify.checkify` around the caller nothing raises. So an op
  whose output would not fit, or that was given a rank table of another
  batch, still returns a valid LoDTensor (its LoD clamped to the
  capacities) and records the fault in the result's ``faults`` bitmask,
  which every op passes on. Host reads of a faulted tensor (`to_list`,
  `lengths`, `to_padded`, ...: see `LoDTensor`) raise instead of returning
  fewer rows.

  Attributes:
    CAPACITY: the output needed more tokens, sequences or time than its
      capacity; rows or sequences were cut.
    TABLE: a rank table did not rank the tensor it was used with (a table
      of another batch); the rows are in the wrong order.
    INPUT: another data check on the arguments failed (counts or totals
      that differ, a slice out of range, rows that do not divide into a new
      width); the result follows the op's documented clipping.
  """

  CAPACITY = 1
  TABLE = 2
  INPUT = 4


def describe_faults(faults: int) -> str:
  """The names of the bits set in `faults`, for messages."""
  names = [f.name for f in Fault if faults & f]
  unknown = faults & ~sum(Fault)
  return ", ".join(names + ([f"unknown bits {unknown:#x}"] if unknown else []))


def concrete_faults(faults: Any) -> int:
  """The bits set in a ``faults`` leaf (of any shape: stacked shards too)
  when it is a concrete array; 0 under `jit`, and for a leaf a
  transformation put there (an axis spec, `None`, a shape struct)."""
  if not isinstance(faults, jax.Array | np.ndarray | np.generic):
    return 0
  if not is_concrete(faults):
    return 0
  return int(np.bitwise_or.reduce(np.asarray(faults).reshape(-1), initial=0))


def faults_of(*tensors: Any) -> jax.Array:
  """The union of the `faults` of every LoDTensor in `tensors`. Jittable."""
  out = jnp.zeros((), jnp.int32)
  for x in tensors:
    out = out | jnp.asarray(x.faults, jnp.int32)
  return out


def fault_unless(ok: Any, fault: Fault) -> Any:
  """0 where `ok` holds, else `fault`: 0 for a Python `True` (an eager check
  that passed), else an int32 scalar. Jittable."""
  if ok is True:
    return 0
  return jnp.where(jnp.asarray(ok), jnp.int32(0), jnp.int32(fault))


def check_sound(x: Any) -> None:
  """Raises for a faulted LoDTensor `x` whose faults are concrete (host
  reads); does nothing under `jit`, where the faults are traced and passed
  on."""
  bits = concrete_faults(x.faults)
  if bits:
    raise ValueError(
      f"This LoDTensor is faulted ({describe_faults(bits)}): an op under "
      "`jit` could not honour its contract and returned it clamped to its "
      "capacities, so rows may be missing or out of order. Run the caller "
      "under `jax.experimental.checkify.checkify` to see which op and why "
      "(and pass larger capacities, or the rank table of this batch)."
    )


def with_faults(x: Any, *faults: Any) -> Any:
  """The LoDTensor `x` with each bitmask of `faults` (ints, int32 scalars,
  or LoDTensors whose faults it inherits) added to its own. Jittable."""
  added = [getattr(f, "faults", f) for f in faults]  # a LoDTensor's, or f
  added = [f for f in added if not (isinstance(f, int) and f == 0)]
  if not added:
    return x
  total = faults_of(x)
  for f in added:
    total = total | jnp.asarray(f, jnp.int32)
  return dataclasses.replace(x, faults=total)
