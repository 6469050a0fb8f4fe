"""Side-by-side timing for the benchmarks, the examples and the notebooks."""

from __future__ import annotations

import collections
import contextlib
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

try:
  import resource
except ImportError:  # not a Unix
  resource = None


def _minor_faults() -> int:
  """The process's minor page faults so far (0 where `resource` is missing)."""
  if resource is None:
    return 0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(fn: Callable[[], Any], sync: Callable[[Any], Any]) -> tuple[float, int]:
  """Seconds and minor page faults of one call, up to its result."""
  faults, start = _minor_faults(), time.perf_counter()
  sync(fn())
  return time.perf_counter() - start, _minor_faults() - faults


# The most rounds `min_seconds` adds.
MAX_ROUNDS = 100


def measure_interleaved(
  calls: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]],
  repeats: int,
  *,
  min_seconds: float = 0.0,
) -> dict[str, dict[str, Any]]:
  """Times several calls side by side on a shared, noisy machine.

  Each call runs once (trace and compile) and once more (warm-up), then
  `repeats` rounds run every call once, in an order shuffled each round (the
  same shuffles in every run), so a change in the machine's load touches
  them all alike and no call always follows the same one: a call that
  leaves a cold cache or threads still spinning (another framework's thread
  pool) slows a different neighbour each round.

  Args:
    calls: name -> ``(fn, sync)``; ``sync(fn())`` must wait for the result
      (`jax.block_until_ready` for JAX).
    repeats: number of rounds.
    min_seconds: more rounds where a round is short: as many as the
      warm-up round's time says fill `min_seconds` in all, at most
      `MAX_ROUNDS` (and never fewer than `repeats`). A millisecond call's
      median over a few rounds moves with the machine's noise; over many
      it settles.

  Returns:
    name -> ``{"median_s", "first_call_s", "compile_s", "times_s",
    "minor_faults_per_call"}``, where ``compile_s`` is the first call's time
    less the median and ``minor_faults_per_call`` the median count of the
    process's minor page faults during a timed call (memory the call's
    allocator took fresh from the system: each page costs a fault when
    first written).

  Raises:
    ValueError: when `repeats` is less than 1.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be at least 1, got {repeats}.")
  first = {name: _timed(fn, sync)[0] for name, (fn, sync) in calls.items()}
  warm = sum(_timed(fn, sync)[0] for fn, sync in calls.values())
  if min_seconds > 0:
    wanted = math.ceil(min_seconds / max(warm, 1e-9))
    repeats = max(repeats, min(MAX_ROUNDS, wanted))
  names = list(calls)
  times: dict[str, list[float]] = {name: [] for name in names}
  faults: dict[str, list[int]] = {name: [] for name in names}
  shuffler = random.Random(0)
  for _ in range(repeats):
    order = list(names)
    shuffler.shuffle(order)
    for name in order:
      seconds, count = _timed(*calls[name])
      times[name].append(seconds)
      faults[name].append(count)
  result = {}
  for name in names:
    median = statistics.median(times[name])
    result[name] = {
      "median_s": median,
      "first_call_s": first[name],
      "compile_s": max(first[name] - median, 0.0),
      "times_s": times[name],
      "minor_faults_per_call": statistics.median(faults[name]),
    }
  return result


def machine_info(**extra: Any) -> dict[str, Any]:
  """The machine and library versions a timing ran with, plus `extra`.

  ``load_average_at_start`` is the 1, 5 and 15 minute load averages when
  called: the machine is shared, so a benchmark records how busy it was.
  """
  import os
  import platform

  import flax
  import jax
  import jaxlib
  import numpy as np

  import jaxlod

  return {
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "python": platform.python_version(),
    "cpu_count": os.cpu_count(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "flax": flax.__version__,
    "numpy": np.__version__,
    "jaxlod": jaxlod.__version__,
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    **extra,
    "load_average_at_start": list(os.getloadavg()),
  }


def write_report(report: dict[str, Any], path: Any = None) -> None:
  """Prints a benchmark's JSON report, and writes it to `path` when given."""
  import json
  from pathlib import Path

  text = json.dumps(report, indent=2)
  print(text)
  if path is not None:
    Path(path).write_text(text + "\n")


@contextlib.contextmanager
def xla_compiles() -> Iterator[collections.Counter]:
  """XLA backend compilations inside the block, by the jitted function's
  name (``sum(counter.values())`` for all of them)."""
  names: collections.Counter = collections.Counter()

  def listener(event: str, duration: float, **kwargs: Any) -> None:
    del duration
    if event == "/jax/core/compile/backend_compile_duration":
      names[kwargs.get("fun_name", "?")] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
