"""The public names exist, are documented, and their docstring examples hold."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import jaxlod
from tests.helpers import PUBLIC_MODULES

# The foundation's names; later layers may add more to `__all__`.
FOUNDATION = {
  "jaxlod": {"Buckets", "Capacity", "Fault", "LoDTensor", "__version__"},
  "jaxlod.ops": {
    "RankTable",
    "array_to_lod",
    "default_ladder",
    "lod_to_array",
    "normalize_ladder",
    "rank_table",
    "reorder_by_rank",
    "shrink_memory",
    # Decoding (a contract).
    "Hypotheses",
    "DecodeSettings",
    "beam_search",
    "ensemble_step",
    # The attention-decoder core under the Flax layers.
    "Memory",
    "decoder_step",
  },
  # The Flax layer's names (a contract).
  "jaxlod.nn": {
    "AdditiveAttention",
    "AttentionDecoder",
    "Bidirectional",
    "CosineAttention",
    "DotAttention",
    "DynamicRNN",
    "GeneralAttention",
    "HierarchicalEncoder",
    "Seq2Seq",
    "StackedRNN",
  },
  "jaxlod.nn.nnx": {
    "AdditiveAttention",
    "AttentionDecoder",
    "Bidirectional",
    "CosineAttention",
    "DotAttention",
    "DynamicRNN",
    "GeneralAttention",
    "HierarchicalEncoder",
    "Seq2Seq",
    "StackedRNN",
    "ensemble_generate",
    "ensemble_generate_corpus",
  },
  "jaxlod.data": {"Batch", "Batcher"},
  # Scale-out (a contract).
  "jaxlod.parallel": {"data_parallel", "shard_batch"},
  # Converters to other frameworks' formats (a contract).
  "jaxlod.interop": {"from_packed_sequence", "to_packed_sequence"},
  # Checks for users' own step functions, cells and ops (a contract).
  "jaxlod.testing": {"check_independent", "IndependenceError"},
}

# Modules whose examples need an optional dependency: skipped without it.
NEEDS = {"jaxlod.interop._torch": "torch", "jaxlod.data._grain": "grain"}


# The sequence ops (a contract: later layers call them by these names).
SEQUENCE_OPS = {
  "lod_reset",
  "sequence_concat",
  "sequence_conv",
  "sequence_enumerate",
  "sequence_erase",
  "sequence_expand",
  "sequence_expand_as",
  "sequence_first_step",
  "sequence_last_step",
  "sequence_mask",
  "sequence_pad",
  "sequence_pool",
  "sequence_reshape",
  "sequence_reverse",
  "sequence_scatter",
  "sequence_slice",
  "sequence_softmax",
  "sequence_unpad",
}


def test_sequence_ops_are_public():
  assert set(jaxlod.ops.__all__) >= SEQUENCE_OPS


def _public_names():
  for module in PUBLIC_MODULES:
    for name in importlib.import_module(module).__all__:
      if not name.startswith("__"):
        yield module, name


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_all_names_exist(module):
  mod = importlib.import_module(module)
  assert FOUNDATION[module] <= set(mod.__all__)
  assert len(mod.__all__) == len(set(mod.__all__)), "duplicate names in __all__"
  for name in mod.__all__:
    assert hasattr(mod, name), f"{module}.{name} is in __all__ but missing"


@pytest.mark.parametrize(("module", "name"), sorted(_public_names()))
def test_public_names_are_documented(module, name):
  obj = getattr(importlib.import_module(module), name)
  assert inspect.getdoc(obj), f"{module}.{name} has no docstring"
  # Users import the public module; the object lives in a private module of it.
  assert obj.__module__.startswith(module + "._"), obj.__module__


def test_star_import():
  namespace = {}
  exec("from jaxlod import *\nfrom jaxlod.ops import *", namespace)
  assert FOUNDATION["jaxlod"] | FOUNDATION["jaxlod.ops"] <= set(namespace)


def test_version():
  assert jaxlod.__version__ == "0.1.0"


# Modules whose docstring examples the foundation promises.
FOUNDATION_DOCTESTS = [
  "jaxlod._buckets",
  "jaxlod._lod",
  "jaxlod.ops._rank",
  "jaxlod.ops._array",
]


def _library_modules():
  """Every module of the library, except runnable programs."""
  names = ["jaxlod"]
  for info in pkgutil.walk_packages(jaxlod.__path__, prefix="jaxlod."):
    if info.name == "jaxlod.__main__":
      continue
    names.append(info.name)
  return sorted(names)


@pytest.mark.slow
@pytest.mark.parametrize(
  "module", sorted(set(_library_modules()) | set(FOUNDATION_DOCTESTS))
)
def test_doctests(module):
  if module in NEEDS:
    pytest.importorskip(NEEDS[module])
  mod = importlib.import_module(module)
  result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS, verbose=False)
  if module in FOUNDATION_DOCTESTS:
    assert result.attempted > 0, f"{module} has no docstring examples"
  assert result.failed == 0, f"{result.failed} doctest(s) failed in {module}"
