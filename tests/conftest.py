"""pytest configuration: reproducible hypothesis profiles, slow tests first."""

import os

# Tests check results, not speed, and compiling is most of their time: XLA's
# CPU backend compiles them without LLVM's optimization passes (a fifth less
# compilation on the slowest tests). It must be set before JAX starts its
# backend; child processes inherit it. The notebooks run with the default,
# since they show timings (tests/test_notebooks.py).
FAST_COMPILE = "--xla_backend_optimization_level=0"
# Tests compare results with their references at float32 (and exactly at
# bfloat16), which GPUs meet only when XLA rounds every value to its dtype
# (it may keep a bfloat16 value in float32 inside a fused computation) and
# multiplies float32 matrices at full precision (not TF32: see below).
EXACT_PRECISION = "--xla_allow_excess_precision=false"
os.environ["XLA_FLAGS"] = " ".join(
  filter(None, [os.environ.get("XLA_FLAGS", ""), FAST_COMPILE, EXACT_PRECISION])
)

# isort: split
import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import jaxlod  # noqa: E402

# Float32 matrix products at full precision on every backend (XLA:CPU computes
# them so already; GPUs would use TF32).
jax.config.update("jax_default_matmul_precision", "highest")

# A test worker holds millions of long-lived objects (traced and compiled
# programs), which every full collection walks again: the objects of the
# imports are frozen out of collections, and collections run less often
# (test_nn_seq2seq.py and test_rnn.py on one worker, compilation cache warm:
# 151 s with Python's default thresholds, 138 s with these).
gc.freeze()
gc.set_threshold(50_000, 20, 100)

# Compiled programs persist across test sessions (and xdist workers share
# them); `JAXLOD_COMPILATION_CACHE=off` runs without the cache.
jaxlod.enable_compilation_cache()

# Reproducible by default (derandomized, no example database written into the
# repo); `HYPOTHESIS_PROFILE=explore` draws fresh examples on every run.
settings.register_profile("repro", deadline=None, database=None, derandomize=True)
settings.register_profile("explore", deadline=None, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repro"))


# XLA:CPU maps each compiled program's code into the process, about three
# memory mappings a program. A worker that keeps every program of a few
# thousand tests passes Linux's default `vm.max_map_count` (65,530), and the
# next compilation segfaults. Past this many mappings a worker drops JAX's
# caches between two test modules; programs needed again come back from the
# persistent compilation cache, or compile again where they took under its
# threshold (0.5 s) the first time.
MAX_MAPPINGS = 30_000


def _mappings() -> int:
  """This process's memory mappings (0 where /proc is not Linux's)."""
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:
    return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  yield
  if _mappings() > MAX_MAPPINGS:
    jax.clear_caches()


def pytest_configure(config):
  # Warnings are errors (pyproject.toml); named exceptions only. When a
  # hypothesis test fails, hypothesis imports libcst to print a patch, and
  # libcst uses a deprecated mypy_extensions API: that must not hide the failure.
  config.addinivalue_line(
    "filterwarnings",
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning",
  )


def pytest_collection_modifyitems(config, items):
  # Tests marked slow (15 s or more, mostly compilation) start first, so the
  # xdist workers, which steal queued tests from each other, finish together
  # instead of one running a notebook alone at the end.
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# tests/parallel/multidevice runs in child processes with forced host devices
# (tests/parallel/test_parallel.py sets JAXLOD_MULTIDEVICE there), never in this one.
collect_ignore = (
  [] if os.environ.get("JAXLOD_MULTIDEVICE") else ["parallel/multidevice"]
)
