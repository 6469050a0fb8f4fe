"""Every public callable refuses wrong Python types and values at its boundary.

A table of targets (tests/api_targets.py, tests/api_layer_targets.py: the
public functions, constructors, methods and layers, each with valid
arguments) and a catalogue of wrong inputs per kind of argument
(tests/api_catalogue.py: a string, `None` where an array is required, an
`object()`, a float where an int is required, a negative int, an array of the
wrong rank, floats where integers are needed, a LoDTensor where an array is
expected and the reverse, stacked shards where one LoDTensor belongs, ...).
Each case passes one wrong input, every other argument valid, and expects a
`TypeError` or `ValueError` whose message names the argument in backticks:
never a bare error from inside JAX, NumPy or Flax.
The table is complete: every public name, and every argument of every target,
is covered or exempted below with a reason. Under `jit`, where the decoders'
data checks cannot raise, the last tests check their fault record.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import jax
import numpy as np
import pytest

from jaxlod import Fault, parallel
from tests import api_layer_targets, api_targets
from tests.api_catalogue import FromValid, linen_params
from tests.helpers import PUBLIC_MODULES

TARGETS = api_targets.TARGETS + api_layer_targets.TARGETS


# Public names with no target, and why.
EXEMPT = {
  "jaxlod.__version__": "a string",
  # NamedTuples of results and capacities that the library builds.
  "jaxlod.Capacity": "a NamedTuple of ints, built by LoDTensor.capacity",
  "jaxlod.ops.Hypotheses": "a NamedTuple of results, built by beam_search",
  "jaxlod.ops.Memory": "a NamedTuple, built by lod_memory and as_memory",
  "jaxlod.data.Batch": "a NamedTuple, built by Batcher",
  # Pytrees that JAX rebuilds with any leaves (axis specs, None, tracers,
  # shape structs) inside transformations, so their constructors cannot
  # refuse non-arrays; their builders are targets.
  "jaxlod.LoDTensor": "a pytree JAX rebuilds; LoDTensor.from_* build it",
  "jaxlod.ops.RankTable": "a pytree JAX rebuilds; rank_table builds it",
  "jaxlod.Fault": "an enum of flags, read from LoDTensor.faults",
  "jaxlod.data.Candidate": "a NamedTuple of results, built by plan_capacities",
  "jaxlod.data.CapacityPlan": "a NamedTuple of results, built by plan_capacities",
  "jaxlod.data.LoDBatchDataset": "a grain.IterDataset (the grain extra); "
  "its arguments are the Batcher's, checked by the same helpers "
  "(tests/data/test_grain.py)",
  # The interop extra: their arguments are torch objects (torch imported
  # when called); their wrong inputs are tested in tests/interop/test_torch.py.
  "jaxlod.interop.from_packed_sequence": "takes a torch PackedSequence "
  "(tests/interop/test_torch.py)",
  "jaxlod.interop.to_packed_sequence": "returns a torch PackedSequence "
  "(tests/interop/test_torch.py)",
  "jaxlod.testing.IndependenceError": "an AssertionError that check_independent raises",
  # Abstract: subclasses define `scores`.
  "jaxlod.nn.Attention": "the attentions' abstract base",
  "jaxlod.nn.nnx.Attention": "the attentions' abstract base",
}

# Public methods of public classes with no target, and why.
EXEMPT_METHODS = {
  # No arguments.
  "exact": "no arguments",
  "get_state": "no arguments",
  "row_splits": "no arguments",
  "to_segment_ids": "no arguments",
  "validate": "no arguments",
  "items": "no arguments",
  "member": "no arguments",
  "recursive_lengths": "no arguments",
  "row_mask": "no arguments",
  "schedule_steps": "no arguments",
  "segment_ids": "no arguments",
  "setup": "Flax's hook, no arguments",
  "to_list": "no arguments",
  # Protocols the layers call themselves, with inputs they checked.
  "cell_carry": "called with `encode`'s output",
  "check_input_width": "a check, called with checked LoDTensors",
  "decode_step": "the decoding step, called by the search with its arrays",
  "dropout_rows": "called with the rows of a checked LoDTensor",
  "initialize_carry": "Flax's cell protocol, called with a built shape",
  "keys": "targets for AdditiveAttention; the others precompute nothing",
  "pure_step": "the decoder loop's body, called with checked inputs",
  "scores": "the attention protocol, called by the checked call",
  # Methods whose first check is `check_memory_lod` (tests/test_nn_attention).
  "initial_state": "checks `memory` first with `check_memory_lod`",
  "precompute": "checks `memory` first with `check_memory_lod`",
  "step": "the decoder step, called with `precompute`'s Memory",
  "zero_carry": "checks `memory` first with `check_memory_lod`",
}


def _cases():
  for t in TARGETS:
    for name, a in t.args.items():
      for bad_id, bad in a.bad:
        yield pytest.param(t, name, bad, id=f"{t.name}-{name}-{bad_id}")


def _names(name: str) -> str:
  """A pattern for `name` in backticks, maybe indexed or with a field:
  ``lengths``, ``tokens[0]``, ``x.values``, ``examples[0][1]``."""
  return rf"`{re.escape(name)}(\[[^`\]]*\]|\.\w+)*`"


@pytest.mark.parametrize(("t", "name", "bad"), list(_cases()))
def test_a_wrong_input_raises_naming_the_argument(t, name, bad):
  kwargs = t.valid()
  from_valid = isinstance(bad, FromValid)
  kwargs[name] = bad.make(kwargs[name]) if from_valid else bad()
  with pytest.raises((TypeError, ValueError)) as info:
    t.call(**kwargs)
  argument = name.split()[0]  # "reverse (call)" -> "reverse"
  assert re.search(_names(argument), str(info.value)), (
    f"{t.name}({argument}=...) raised {type(info.value).__name__}: {info.value}"
  )
  if from_valid:
    assert re.search(bad.match, str(info.value)), (
      f"{t.name}({argument}=...) raised {type(info.value).__name__}: {info.value}"
    )


# Decoding compiles its loops (seconds a call); these valid calls run in
# tests/ops/test_decode.py, tests/nn/test_generate.py,
# tests/nn/test_generate_corpus.py and tests/parallel/test_parallel.py.
DECODING = {
  "ops.beam_search",
  "nn.Seq2Seq.generate",
  "nnx.Seq2Seq.generate",
  "nn.ensemble_generate",
  "nnx.ensemble_generate",
  "parallel.generate",
}
# The corpus decoders' calls read their first result (a decoding).
CORPUS = {
  "nn.Seq2Seq.generate_corpus",
  "nnx.Seq2Seq.generate_corpus",
  "nn.ensemble_generate_corpus",
  "nnx.ensemble_generate_corpus",
}
QUICK = [t for t in TARGETS if t.name not in DECODING | CORPUS]


@pytest.mark.parametrize("t", QUICK, ids=[t.name for t in QUICK])
def test_the_valid_inputs_are_valid(t):
  """Each case's error comes from its one wrong input."""
  t.call(**t.valid())


# -- the table is complete ------------------------------------------------------------


def _public_objects():
  for module in PUBLIC_MODULES:
    mod = importlib.import_module(module)
    for name in mod.__all__:
      yield f"{module}.{name}", getattr(mod, name)


def _covered() -> set[str]:
  """The targets' full names: ``ops.x`` is ``jaxlod.ops.x``, ``nn.X.f`` is
  ``jaxlod.nn.X.f``, ``LoDTensor.f`` is ``jaxlod.LoDTensor.f``."""
  modules = {m.split(".", 1)[-1]: m for m in PUBLIC_MODULES[1:]}
  modules["nnx"] = "jaxlod.nn.nnx"
  covered = set()
  for t in TARGETS:
    head, _, rest = t.name.partition(".")
    if head in modules:
      covered.add(f"{modules[head]}.{rest}")
    else:
      covered.add(t.name if head == "jaxlod" else f"jaxlod.{t.name}")
  return covered


def test_every_public_name_is_a_target_or_exempt():
  covered = _covered()
  missing = []
  for full, obj in _public_objects():
    if full not in EXEMPT and full not in covered:
      missing.append(full)
    if not inspect.isclass(obj):
      continue
    for attr, member in inspect.getmembers(obj, callable):
      module = getattr(member, "__module__", None) or ""
      if attr.startswith("_") or not module.startswith("jaxlod"):
        continue
      if f"{full}.{attr}" not in covered and attr not in EXEMPT_METHODS:
        missing.append(f"{full}.{attr}")
  assert not missing, f"neither targets nor exempt: {missing}"


@pytest.mark.parametrize("t", TARGETS, ids=[t.name for t in TARGETS])
def test_every_argument_has_wrong_inputs_or_a_reason(t):
  params = t.parameters()
  missing = [p for p in params if p not in t.args and p not in t.unchecked]
  assert not missing, f"{t.name}: arguments with no wrong inputs: {missing}"
  unchecked = [p for p in t.unchecked if p in t.args and t.args[p].bad]
  assert not unchecked, f"{t.name}: unchecked, yet with wrong inputs: {unchecked}"
  unknown = [p for p in {*t.args, *t.unchecked} if p not in params]
  assert not unknown, f"{t.name}: not arguments: {unknown}"


# -- the decoding fault record --------------------------------------------------------


# Under `jit` without checkify the decoding checks above cannot raise: both
# LoDTensors of the `Hypotheses` record `Fault.INPUT` and host reads raise.
# Each case: a target, an argument, and a wrong value made from the valid one.
def _set_first(values: Any, value: int) -> np.ndarray:
  out = np.array(values)
  out.reshape(-1)[0] = value
  return out


FAULTS = [
  ("ops.beam_search", "max_lengths", lambda v: np.array([4, 3])),
  *(
    (name, arg, bad)
    for name in DECODING - {"ops.beam_search", "parallel.generate"}
    for arg, bad in (
      ("max_lengths", lambda v: np.array([4, 3])),
      ("src", lambda v: v.with_values(_set_first(v.values, 8))),
    )
  ),
]


@pytest.mark.parametrize(
  ("name", "argument", "bad"),
  sorted(FAULTS, key=lambda c: (c[0], c[1])),
  ids=[f"{n}-{a}" for n, a, _ in sorted(FAULTS, key=lambda c: (c[0], c[1]))],
)
def test_under_jit_a_decoding_check_is_recorded_in_faults(name, argument, bad):
  (t,) = [t for t in TARGETS if t.name == name]
  linen_params()  # made eagerly: cached, they must not be made under `jit`
  kwargs = t.valid()
  wrong = bad(kwargs[argument])
  hyps = jax.jit(lambda value: t.call(**{**kwargs, argument: value}))(wrong)
  for tensor in hyps:
    assert int(tensor.faults) & Fault.INPUT, (name, argument)
    with pytest.raises(ValueError, match=r"This LoDTensor is faulted \(INPUT\)"):
      tensor.to_list()


def test_parallel_generate_records_its_decoding_faults():
  """`parallel.generate` decodes under `map_shards`, traced: the same record."""
  (t,) = [t for t in TARGETS if t.name == "parallel.generate"]
  kwargs = t.valid()
  limits = parallel.shard_batch(np.array([[4, 3]]), kwargs["mesh"])
  for hyps in t.call(**{**kwargs, "max_lengths": limits}):
    for tensor in hyps:
      assert int(tensor.faults) & Fault.INPUT
      with pytest.raises(ValueError, match=r"This LoDTensor is faulted \(INPUT\)"):
        tensor.to_list()
