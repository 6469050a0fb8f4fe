"""Every public op, method and layer over LoDTensors keeps its sequences
independent: `jaxlod.testing.check_independent` changes one sequence of each
LoDTensor input at a time (a random change, ``1e30``, ``inf`` and ``NaN`` for
float rows; a random change and the largest value for integer rows) and no
other sequence's outputs or gradients may change.

The calls are the wrong-input catalogue's valid ones (tests/api_targets.py,
tests/api_layer_targets.py), whose table is complete
(tests/test_api_inputs.py): a public op that takes a LoDTensor is checked
here as soon as it is a target, and a target with a LoDTensor argument that
is neither checked nor exempt below fails `test_every_lod_target_is_checked`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlod import LoDTensor, testing
from jaxlod.testing import _independence
from tests import api_layer_targets, api_targets
from tests.api_catalogue import Target, ids, linen_params, lod

TARGETS = api_targets.TARGETS + api_layer_targets.TARGETS

FLOAT = ("random", "large", "inf", "nan")
# Integer rows have no inf or NaN: "large" is their dtype's largest value.
INT = ("random", "large")
# Ids into a vocabulary: the largest int is outside it, an error eagerly.
IDS = ("random",)

# LoDTensor arguments that are ids into a vocabulary (or positions).
ID_INPUTS = {
  ("ops.sequence_cross_entropy", "labels"),
  ("ops.sequence_scatter", "index"),
  *(
    (f"{twin}.{name}", "src")
    for twin in ("nn", "nnx")
    for name in ("Seq2Seq", "Seq2Seq.generate", "Seq2Seq.encode", "ensemble_generate")
  ),
  *((f"{twin}.Seq2Seq", "tgt_in") for twin in ("nn", "nnx")),
}

# Targets with a LoDTensor argument that are not checked here, and why.
EXEMPT = {
  "parallel.generate": "takes shards stacked on a leading axis "
  "(check_independent takes one LoDTensor); it decodes each shard as "
  "nn.ensemble_generate does, checked here, and equals one device "
  "(tests/parallel/test_parallel.py)",
  "testing.check_independent": "the check itself (tests/test_testing.py)",
  "LoDTensor.num_sequences": "the batch's count of sequences, from the LoD: "
  "it reads no rows",
  "ops.lod_reset": "gives the rows another LoD, whose sequences are not the "
  "input's; the rows are unchanged (tests/ops/test_reshape.py)",
  "parallel.shard_batch": "stacks shards (check_independent takes one "
  "LoDTensor); it moves rows unchanged (tests/parallel/test_parallel.py)",
}

# The level whose sequences are independent, where it is not the last: a
# hierarchical encoder's outer RNN reads the inner sequences of one outer
# sequence together.
LEVELS = {"nn.HierarchicalEncoder": 0, "nnx.HierarchicalEncoder": 0}

# Outputs with the sequences on another axis than the first, made
# sequence-major for the comparison.
SEQUENCES_FIRST = {"ops.lod_to_array": lambda out: jnp.swapaxes(out, 0, 1)}

# LoDTensor methods: the tensor is the method's object, not an argument.
METHODS = {
  "LoDTensor.lengths": (lod, "lengths"),
  "LoDTensor.astype": (lod, "astype"),
  "LoDTensor.with_values": (lod, "with_values"),
  "LoDTensor.to_padded": (lod, "to_padded"),
  "LoDTensor.to_padded[int]": (ids, "to_padded"),
}


@dataclasses.dataclass(frozen=True)
class Case:
  """`fn(x)` of one LoDTensor `x`, the other arguments valid (made at each
  call: an NNX layer's `nnx.Rngs` belongs to the trace that made it)."""

  name: str
  target: Target
  x: Callable[[], LoDTensor]
  fn: Callable[[LoDTensor], Any]
  perturbations: tuple[str, ...]

  def __str__(self) -> str:
    return self.name


def _perturbations(x: LoDTensor, key: tuple[str, str]) -> tuple[str, ...]:
  if np.issubdtype(np.asarray(x.values).dtype, np.floating):
    return FLOAT
  return IDS if key in ID_INPUTS else INT


def _argument_case(t: Target, name: str) -> Case:
  def fn(x):
    return t.call(**{**t.valid(), name: x})

  x = t.args[name].valid
  return Case(f"{t.name}-{name}", t, x, fn, _perturbations(x(), (t.name, name)))


def _list_case(t: Target, name: str, k: int) -> Case:
  """Item `k` of a list of LoDTensors (`sequence_concat`'s `xs`)."""

  def fn(x):
    valid = t.valid()
    items = list(valid[name])
    items[k] = x
    return t.call(**{**valid, name: items})

  def x():
    return t.args[name].valid()[k]

  return Case(f"{t.name}-{name}[{k}]", t, x, fn, _perturbations(x(), (t.name, name)))


def _method_case(t: Target) -> Case:
  make, attr = METHODS[t.name]

  def fn(x):
    return getattr(x, attr)(**t.valid())

  return Case(t.name, t, make, fn, _perturbations(make(), (t.name, "self")))


def _is_method(t: Target) -> bool:
  """A method of a LoDTensor (not one of its constructors)."""
  return t.name.startswith("LoDTensor.") and not t.name.startswith("LoDTensor.from_")


def _lod_arguments(t: Target) -> list[tuple[str, Any]]:
  return [(name, value) for name, value in t.valid().items() if _holds_lod(value)]


def _holds_lod(value: Any) -> bool:
  if isinstance(value, LoDTensor):
    return True
  return isinstance(value, list | tuple) and any(
    isinstance(v, LoDTensor) for v in value
  )


def _cases() -> list[Case]:
  cases = []
  for t in TARGETS:
    if t.name in EXEMPT:
      continue
    if t.name in METHODS:
      cases.append(_method_case(t))
      continue
    for name, value in _lod_arguments(t):
      if isinstance(value, LoDTensor):
        cases.append(_argument_case(t, name))
      else:
        cases.extend(_list_case(t, name, k) for k in range(len(value)))
  return cases


CASES = _cases()


def _per_sequence(out: Any, x: LoDTensor, level: int) -> bool:
  """Whether `check_independent` compares some leaf of `out` per sequence."""
  level %= x.num_levels
  count = len(np.asarray(x.offsets[level])) - 1
  leaves = jax.tree.leaves(out, is_leaf=_independence._is_lod)
  return any(_independence._pieces(leaf, level, count) is not None for leaf in leaves)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_no_sequence_changes_another(case):
  linen_params()  # made eagerly: cached, they must not be made under `jit`
  first = SEQUENCES_FIRST.get(case.target.name, lambda out: out)

  def fn(x):
    return first(case.fn(x))

  x, level = case.x(), LEVELS.get(case.target.name, -1)
  assert _per_sequence(fn(x), x, level), f"{case.name}: no output is per sequence"
  testing.check_independent(
    fn, x, level=level, perturbations=case.perturbations, jit=True
  )


def test_every_lod_target_is_checked():
  """A target with a LoDTensor argument (or object) is a case or exempt; the
  exemptions name targets that exist. The count is the note's."""
  checked = {c.target.name for c in CASES}
  with_lod = {t.name for t in TARGETS if _lod_arguments(t) or _is_method(t)}
  assert with_lod - checked == set(EXEMPT), with_lod - checked
  assert set(EXEMPT) <= {t.name for t in TARGETS}
  assert len(checked) >= 54, len(checked)
