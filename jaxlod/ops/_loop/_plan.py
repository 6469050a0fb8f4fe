"""How the loops run on a backend: `LoopPlan` and `default_plan`.

On a CPU a step's cost falls with its rows, so the phased loop runs a
ladder of shrinking batch sizes, one compiled body each. On a GPU a step is
a handful of small kernels whose time hardly depends on the rows: every
ladder size is a compiled body that buys nothing, and a `lax.while_loop`
whose trip count XLA cannot know copies its predicate to the host and waits
for it on every iteration. A plan says which of these mechanisms a loop
uses. It is static, hashable data, passed with the call (or held by a
layer): never a global that would change a jitted function behind its
cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxlod._buckets import round_up
from jaxlod._checks import check_bool, static_int
from jaxlod.ops._rank import normalize_ladder


@dataclasses.dataclass(frozen=True)
class LoopPlan:
  """How `jaxlod.ops.dynamic_rnn`, the layers over it and the decoding loops
  run. Static and hashable; `default_plan` picks one per backend.

  Attributes:
    bodies: the most loop bodies (static batch sizes) a loop compiles.
      `None` (the CPU's plan): one per size of the rank table's ladder, so
      the batch shrinks as sequences end. ``n``: the count capacity and
      ``n - 1`` halvings of it, each rounded up to a multiple of 8 (a tile
      of rows); ``1`` runs every step at the full batch, the right choice
      where rows are nearly free. For decoding, the sizes that finished
      sources are compacted to (``1``: a batch-wide stop).
    chunk: time steps per iteration of each loop whose trip count is data.
      Such a loop's trip count depends on the lengths, so XLA cannot know
      it; on a GPU every iteration then copies the loop's predicate to the
      host and waits for it. With ``chunk=k`` the outer loop runs chunks of
      ``k`` steps, each an inner loop of static trip count ``k`` (the step
      is compiled once): the host waits once per ``k`` steps, and the
      steps past a phase's end are masked (they compute, and change
      nothing). ``1`` (the CPU's plan) masks nothing.
    hoist: the recurrent layers of `jaxlod.nn` compute the input
      projection of Flax's separable cells (``LSTMCell``,
      ``OptimizedLSTMCell``, ``GRUCell``, ``SimpleCell``, ``MGUCell`` and
      their NNX twins) as one product over all packed rows before the loop,
      and the recurrent kernel's gradient as one product after it, so the
      loop keeps only the recurrent product (cuDNN's design). `False` by
      default on every backend: it ships as a default only where the
      benchmark shows it faster (``benchmarks/hoist.py``).
    fused: the recurrent layers of `jaxlod.nn` run those separable cells
      (and `jaxlod.ops.dynamic_rnn` a `jaxlod.ops.Separable` step, which
      it otherwise runs hoisted) through `jaxlod.ops.fused_rnn`: the input
      projection and the weight gradients as with `hoist`, and the whole
      time loop, forward and backward, as one Pallas kernel launch each (in
      interpret mode on a CPU). `False` by default on every backend, until
      the benchmark (``benchmarks/rnn.py``'s ``jaxlod_fused`` arm) shows it
      faster.
    padded: the drop-in RNNs (`jaxlod.nn.RNN` and its NNX twin) run a
      padded array as ``flax.linen.RNN`` does, without packing it: one
      `lax.scan` over every padded step at the full batch (``chunk`` steps
      unrolled per iteration), each sequence's carry kept past its length,
      with `hoist`'s input projection over all padded rows. Where the
      batch is small or the steps are few, packing, ranking and unpacking
      cost more than the padded steps they skip. A loop over a LoDTensor
      runs one body at the full batch, as ``bodies=1``.

  Raises:
    TypeError: for `bodies` not `None` or a static int, `chunk` not a
      static int, or `hoist`, `fused` or `padded` not a bool.
    ValueError: for `bodies` or `chunk` below 1 (or beyond int32), or both
      `fused` and `padded` (a padded scan runs no kernel).

  Example:
    >>> from jaxlod.ops import LoopPlan
    >>> LoopPlan(bodies=2).ladder(64, (64, 52, 44))
    (64, 32)
    >>> LoopPlan().ladder(64, (64, 52, 44))
    (64, 52, 44)
  """

  bodies: int | None = None
  chunk: int = 1
  hoist: bool = False
  fused: bool = False
  padded: bool = False

  def __post_init__(self):
    # Stored as Python values: a NumPy int or bool would hash and print
    # differently from the plan it stands for.
    if self.bodies is not None:
      object.__setattr__(self, "bodies", static_int(self.bodies, "bodies", 1))
    object.__setattr__(self, "chunk", static_int(self.chunk, "chunk", 1))
    object.__setattr__(self, "hoist", check_bool(self.hoist, "hoist"))
    object.__setattr__(self, "fused", check_bool(self.fused, "fused"))
    object.__setattr__(self, "padded", check_bool(self.padded, "padded"))
    if self.fused and self.padded:
      raise ValueError(
        "Expected at most one of `fused` and `padded` (a padded scan runs no "
        "kernel), got both True."
      )

  @property
  def separates(self) -> bool:
    """Whether the layers run a separable cell's input projection apart from
    its loop (`hoist` or `fused`)."""
    return self.hoist or self.fused

  def ladder(self, count_capacity: int, ladder: tuple[int, ...]) -> tuple[int, ...]:
    """The batch sizes of the loop's bodies, largest first.

    Args:
      count_capacity: the loop's batch capacity (the first size).
      ladder: the rank table's ladder, used when `bodies` is `None`, in
        the canonical form of `jaxlod.ops.normalize_ladder` (`None`: the
        `default_ladder`).

    Raises:
      TypeError, ValueError: for a `count_capacity` that is not an int >= 0,
        or a `ladder` that is not a sequence of sizes in ``[1,
        count_capacity]``.
    """
    count_capacity = static_int(count_capacity, "count_capacity", 0)
    ladder = normalize_ladder(count_capacity, ladder)
    if self.padded:
      return (count_capacity,)
    if self.bodies is None:
      return ladder
    sizes = [count_capacity]
    for _ in range(self.bodies - 1):
      size = min(round_up(-(-sizes[-1] // 2), 8), sizes[-1] - 1)
      if size < 1:
        break
      sizes.append(size)
    return tuple(sizes)


# One body: on one H100 (benchmarks/results/h100/rnn.json) a padded scan at
# the full batch to the longest length costs what jaxlod's ladder of
# shrinking sizes costs (W1 4.93 ms against 5.07 for the phased scans). The
# number of steps per host wait is not yet measured on a GPU:
# benchmarks/accelerator.sh measures chunks of 1, 4, 8 and 16 side by side.
_ACCELERATOR = LoopPlan(bodies=1, chunk=8)


# The CPU's rule per padded shape, from the sweep committed in 552d165
# (the drop-in LSTM's training step, each plan's time over its cell's
# fastest plan, geometric mean over the hidden sizes and length profiles):
# at 8 sequences up to 256 steps the hoisted ladder 1.00 to 1.04, the
# ladder 1.14 to 1.24; at 32 sequences the ladder 1.01 to 1.06 at every
# time, the hoisted ladder 1.12 to 1.42; at 128 the ladder 1.00 to 1.02.
# At 8 sequences of 1,024 steps the ladder won that run (1.01 against
# 1.12) and drew the next (1.05 against 1.03); since the hoisted loop's
# backward multiplies by a transposed copy of the recurrent kernel
# (a29f540), the hoisted ladder took 0.74 to 0.97 times the ladder's time
# in all six of those cells (geometric mean 0.84,
# benchmarks/results/sweep_b8_t1024.json).
_HOIST_SEQUENCES = 8


def plan_backend(backend: str | None) -> str:
  """The backend a default plan is chosen for: `backend`, or
  `jax.default_backend()` for `None`.

  Raises:
    TypeError: for a `backend` that is not a string.
  """
  if backend is None:
    backend = jax.default_backend()
  if not isinstance(backend, str):
    raise TypeError(f"Expected `backend` to be a string, got {backend!r}.")
  return backend


def default_plan(
  backend: str | None = None, *, sequences: int | None = None, time: int | None = None
) -> LoopPlan:
  """The plan for `backend` (default: `jax.default_backend()`), and on a
  CPU for a padded batch of `sequences` rows and `time` steps.

  * ``"cpu"``: `LoopPlan()`, the ladder and one step per iteration. Given
    the batch's `sequences` and `time` (the drop-in RNNs pass their padded
    shape), the rule measured by ``benchmarks/sweep.py``:
    ``LoopPlan(hoist=True)`` for at most 8 sequences, where the input
    projection as one product over all rows beats a product per step; the
    ladder otherwise, where its shrinking batches pay most (see "Plans per
    shape" in the guide). The rule reads `sequences` only; `time` is
    checked and kept for rules that read it.
  * ``"gpu"``, ``"tpu"`` and any other: ``LoopPlan(bodies=1, chunk=8)``:
    one body at the full batch (rows are nearly free there; a TPU pads
    rows to tiles) and 8 steps per host wait, whatever the shape.

  The loops call this at trace time when given no plan, so a jitted
  function traced for one backend keeps that backend's plan; pass a plan
  to choose another (the tests force the accelerator's on the CPU).

  Raises:
    TypeError: for a `backend` that is not a string, or `sequences` or
      `time` that is not a static int or `None`.
    ValueError: for `sequences` or `time` below 0, or only one of them.
  """
  backend = plan_backend(backend)
  if (sequences is None) != (time is None):
    raise ValueError(
      f"Expected both `sequences` and `time` or neither, got sequences={sequences}, "
      f"time={time}."
    )
  if sequences is not None:
    sequences = static_int(sequences, "sequences", 0)
    time = static_int(time, "time", 0)
  if backend != "cpu":
    return _ACCELERATOR
  if sequences is None:
    return LoopPlan()
  if sequences <= _HOIST_SEQUENCES:
    return LoopPlan(hoist=True)
  return LoopPlan()


def resolve_plan(plan: LoopPlan | None, name: str = "plan") -> LoopPlan:
  """`plan`, or the backend's `default_plan` when `None`.

  Raises:
    TypeError: for anything but a `LoopPlan` or `None`, naming `name`.
  """
  if plan is None:
    return default_plan()
  if not isinstance(plan, LoopPlan):
    raise TypeError(
      f"Expected `{name}` to be a jaxlod.ops.LoopPlan or None, got "
      f"{type(plan).__name__}."
    )
  return plan


def plan_with_ladder(
  plan: LoopPlan | None, ladder: Any, default: LoopPlan | None = None
) -> LoopPlan:
  """The plan of a loop given `plan` and a `ladder` (either may be `None`).

  A ladder asked for explicitly runs: with no `plan`, the default plan
  (`default`, or the backend's `default_plan()`) keeps its other choices
  and takes the ladder for its bodies.

  Raises:
    TypeError: for a `plan` that is not a `LoopPlan` or `None`.
    ValueError: for both a `ladder` and a `plan` whose `bodies` is set or
      that is `padded`.
  """
  explicit = plan is not None
  plan = resolve_plan(plan) if explicit or default is None else default
  if ladder is None or (plan.bodies is None and not plan.padded):
    return plan
  if explicit:
    raise ValueError(
      f"Got both `ladder` {tuple(ladder)} and `plan` with bodies={plan.bodies}"
      f"{', padded=True' if plan.padded else ''}; pass one: a plan with "
      "`bodies` or `padded` chooses its own batch sizes."
    )
  return dataclasses.replace(plan, bodies=None, padded=False)
