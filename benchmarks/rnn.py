"""Side-by-side benchmark of `jaxlod.ops.dynamic_rnn` against padded RNNs.

For each workload one process runs, on the same cell weights and the same
batch of variable-length sequences:

  (a) ``jaxlod``: `jaxlod.ops.dynamic_rnn` on a LoDTensor under a fixed
      capacity, with the rank table built on the host beside the batch;
  (b) ``flax_capacity``: `flax.linen.RNN` with ``seq_lengths`` over the time
      capacity;
  (c) ``flax_exact``: the same over exactly the batch's longest length;
  (d) ``floor``: a dense `jax.lax.scan` of the same cell over
      ``ceil(sum(lengths) / batch)`` full steps (no padding at all);
  (e) ``torch_packed``: `torch.nn.LSTM` / `torch.nn.GRU` on a
      `PackedSequence` (skipped when torch is not importable);
  (f) ``phased_scans``: jaxlod's schedule without jaxlod: one dense
      `jax.lax.scan` of the cell per phase of the rank table, at the phase's
      batch size over its steps, on the ranked rows (no masks, no stored
      rows, no reordering). What the steps themselves cost: jaxlod over it
      (``ratio_to_phased_scans``) is the loop's own overhead; it over the
      floor is what running the longest sequence's steps at shrinking
      batches costs against the floor's fewer, full steps;
  (g) ``jaxlod_fused``: the same cell through `jaxlod.nn.DynamicRNN` under
      ``LoopPlan(fused=True)`` (its parameters ``{"cell": params}``), which
      runs `jaxlod.ops.fused_rnn`: the input projection of every row as one
      product, the whole time loop as one Pallas kernel launch (tiles of
      ``tile`` sequences in rank order, each to its own longest), the
      backward pass as another, the weight gradients as two products after
      it. On a CPU the kernels run in Pallas's interpret mode (the same
      kernel as XLA operations): its CPU times are not a performance
      figure, only a check that the arm runs and matches; the kernel
      targets GPUs, where the workload's ``fused`` gives its times against
      torch's cuDNN and its compile time against Flax padded to the
      capacity beside issue 54's targets (``meets_targets``, `None` in
      interpret mode).

Each arm is timed in two modes: ``forward`` (outputs and final carry; torch
under ``no_grad``) and ``train`` (value and gradient of a loss over the real
outputs and the final hidden state, w.r.t. the cell parameters). Timings are
steady state: one first call (trace and compile, reported as
``first_call_s``; ``compile_s`` is that minus the median), one warm-up call,
then ``--repeats`` rounds in which the arms take turns (so a change in the
shared machine's load touches them all alike), and each arm's median.
``minor_faults_per_call`` is each arm's median count of minor page faults in
a timed call: XLA:CPU takes a call's temporaries as one block, and a block
over glibc's mmap threshold (32 MiB at most) comes fresh from the system,
one fault per page, on every call.
jaxlod runs as `dynamic_rnn` does by default: the default ladder and
``remat=False`` (the step's VJP residuals saved per step), on a fixed
capacity whose token budget holds every batch of the workload;
``jaxlod_remat`` is the same with ``remat=True`` (it saves the carries and
recomputes each step in the backward pass), reported beside it. After
timing, every arm's forward outputs on real positions, final carry, loss and
gradients are compared with jaxlod's (``equality``:
``max_abs_diff_vs_jaxlod`` and friends; the floor and the phased scans
compute something else, unmasked, and are skipped). Finally the jitted jaxlod
training step is called on 100 distinct random batches under the fixed
capacity (only lowered when that would take over
``COMPILE_CHECK_CALL_BUDGET_S``) and its traces are counted with a counter
inside the traced function, beside ``_cache_size()`` and the XLA
compilations seen.

The fused arm always runs, beside the others (no flag): in interpret mode
on the 2-core CPU it compiles faster than ``jaxlod`` and steps 1.5-5 times
slower, a few seconds more per workload, so a flag would only be a way to
forget it; `benchmarks/accelerator.sh` runs it with the rest. Its first
calls (trace, compile, run) are made before the interleaved rounds and
timed there (its ``first_call_s`` and ``compile_s``): a kernel that fails
to lower on the backend is reported in ``fused["error"]`` and not timed,
instead of stopping the other arms' run. Its plan, ``tile``, whether it ran
in interpret mode and its tiles' steps are in ``plans``.

``--plan`` sets the `jaxlod.ops.LoopPlan` of ``jaxlod`` and
``jaxlod_remat``: ``default`` passes none (`dynamic_rnn` then takes
`jaxlod.ops.default_plan` of the backend: the ladder on a CPU, one body and
chunks of 8 steps per ``while`` iteration on a GPU), ``cpu`` is
``LoopPlan()`` and ``accelerator`` ``default_plan("gpu")``, forced on any
backend. The report records the choice, and per workload the plan each
jaxlod arm ran and its loop's batch sizes (``plans``).

``--candidates`` adds, on every workload run (``--candidates W1,W2``: on
those only), an arm per plan candidate, timed in the same interleaved rounds
as the others: ``jaxlod_ladder`` (``LoopPlan()``), ``jaxlod_chunk1``,
``jaxlod_chunk4`` and ``jaxlod_chunk16`` (one body, chunks of that many
steps per ``while`` iteration; 8 is the ``jaxlod`` arm's on a GPU),
``jaxlod_bodies2`` (two bodies, chunks of 8) and ``jaxlod_hoisted`` (one
body, chunks of 8, ``hoist=True``: the input projection of every row as one
product before the loop, through `jaxlod.nn.DynamicRNN` holding the same
Flax cell, whose parameters are ``{"cell": params}``). Their times are in
``train`` and ``forward`` beside the others', their differences from
``jaxlod`` in ``equality``, and the workload's ``candidates`` gives each
one's plan, loop sizes, forward, train and compile times, their ratios to
``jaxlod``'s and whether it computes what ``jaxlod`` does
(``matches_jaxlod``); the report's ``candidates`` lists the workloads that
ran them. An arm that cannot be built (a plan its layer does not take) is
reported in ``candidates`` with the error, and not timed.

Workloads: W1 sentences (LSTM 256, batch 64, log-normal lengths, mean about
30, cap 128), W2 documents (GRU 128, batch 32, long-tailed lengths, mean
about 200, cap 1024), W3 words (LSTM 128, batch 256, English word lengths
1-28, mean about 7.5). ``S`` is a tiny workload (LSTM 16, batch 8) for
checking the script end to end, not for timing; it runs only when named.

Run:
  python -m benchmarks.rnn [--workloads W1,W2,W3] [--repeats N] [--json PATH]
                           [--torch-threads N] [--plan {default,cpu,accelerator}]
                           [--candidates [W1,W2,W3]]

The JSON report goes to stdout (and to ``--json PATH``, rewritten after each
workload, so a run stopped early keeps the workloads it finished); progress
to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxlod
import jaxlod.nn
import jaxlod.ops
from benchmarks.timing import machine_info as _machine_info
from benchmarks.timing import measure_interleaved, write_report, xla_compiles

try:
  import torch
except ImportError:
  torch = None

COMPILE_CHECK_BATCHES = 100
# Run the jitted step on every compile-check batch when that takes at most
# this long (estimated from the timed median); otherwise only lower it.
COMPILE_CHECK_CALL_BUDGET_S = 60.0
MATCH_ATOL = 1e-4
# A candidate matches jaxlod when its outputs do (`MATCH_ATOL`) and its loss
# and largest gradient difference are within this of jaxlod's (relative):
# other batch sizes and a hoisted product round differently.
CANDIDATE_RTOL = 1e-3

# `--plan`: the plan of the `jaxlod` and `jaxlod_remat` arms (`None`: pass
# none, `dynamic_rnn`'s own default for the backend).
PLANS: dict[str, jaxlod.ops.LoopPlan | None] = {
  "default": None,
  "cpu": jaxlod.ops.LoopPlan(),
  "accelerator": jaxlod.ops.default_plan("gpu"),
}
# `--candidates`: arms measuring each plan candidate beside `jaxlod`.
CANDIDATES: dict[str, jaxlod.ops.LoopPlan] = {
  "jaxlod_ladder": jaxlod.ops.LoopPlan(),
  "jaxlod_chunk1": jaxlod.ops.LoopPlan(bodies=1, chunk=1),
  "jaxlod_chunk4": jaxlod.ops.LoopPlan(bodies=1, chunk=4),
  "jaxlod_chunk16": jaxlod.ops.LoopPlan(bodies=1, chunk=16),
  "jaxlod_bodies2": jaxlod.ops.LoopPlan(bodies=2, chunk=8),
  "jaxlod_hoisted": jaxlod.ops.LoopPlan(bodies=1, chunk=8, hoist=True),
}

# The `jaxlod_fused` arm: the layers' fused kernel, at `fused_rnn`'s default tile.
FUSED_PLAN = jaxlod.ops.LoopPlan(fused=True)
FUSED_TILE: int = inspect.signature(jaxlod.ops.fused_rnn).parameters["tile"].default
# Issue 54's GPU targets for the fused arm, per workload: its median over torch
# packed's (cuDNN) per mode, and its training step's compile time over Flax
# padded to the capacity's.
FUSED_TARGETS: dict[str, dict[str, float]] = {
  "W1": {"train_ratio_to_torch_packed": 0.5, "forward_ratio_to_torch_packed": 0.5},
  "W2": {"train_ratio_to_torch_packed": 0.7},
  "W3": {"train_ratio_to_torch_packed": 0.7},
}
FUSED_COMPILE_TARGET = {"train_compile_ratio_to_flax_capacity": 2.0}

# Relative frequencies of the lengths 1..28 of distinct English words (a
# vocabulary or word list; running text, dominated by short function words,
# averages nearer 4.7 letters): the usual skewed bell that peaks at 6-7
# letters with a long right tail, mean about 7.5. Shaped after published
# dictionary word-length counts; not exact.
WORD_LENGTH_WEIGHTS = (
  0.3, 1.7, 4.6, 8.6, 11.8, 13.6, 13.5, 12.1, 10.0, 7.7,
  5.5, 3.8, 2.5, 1.6, 1.0, 0.6, 0.34, 0.19, 0.1, 0.055,
  0.03, 0.016, 0.009, 0.005, 0.003, 0.002, 0.001, 0.001,
)  # fmt: skip


# -- workloads and batches ------------------------------------------------------


def lognormal_lengths(mean: float, sigma: float, cap: int) -> Callable:
  """Sampler of log-normal lengths of the given (uncapped) mean, in [1, cap]."""

  def sample(rng: np.random.Generator, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)

  return sample


def word_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
  """Sampler of English word lengths (`WORD_LENGTH_WEIGHTS`)."""
  p = np.asarray(WORD_LENGTH_WEIGHTS) / sum(WORD_LENGTH_WEIGHTS)
  return rng.choice(np.arange(1, len(p) + 1), size=n, p=p)


@dataclasses.dataclass(frozen=True)
class Workload:
  description: str
  cell: str  # "lstm" or "gru"
  batch: int
  features: int
  hidden: int
  time_capacity: int
  # The token budget of a batch: holds every batch of the workload with a wide
  # margin (at least 7 standard deviations of the batch's total length above
  # its mean); a batch over it raises instead of being truncated.
  token_capacity: int
  sample_lengths: Callable[[np.random.Generator, int], np.ndarray]

  @property
  def buckets(self) -> jaxlod.Buckets:
    """The fixed capacity: a training loop over it compiles once."""
    return jaxlod.Buckets.fixed(
      tokens=self.token_capacity,
      sequences=self.batch,
      time=self.time_capacity,
    )


WORKLOADS = {
  "W1": Workload(
    "sentences",
    "lstm",
    batch=64,
    features=256,
    hidden=256,
    time_capacity=128,
    token_capacity=3072,
    sample_lengths=lognormal_lengths(mean=30, sigma=0.6, cap=128),
  ),
  "W2": Workload(
    "documents",
    "gru",
    batch=32,
    features=128,
    hidden=128,
    time_capacity=1024,
    token_capacity=16384,
    sample_lengths=lognormal_lengths(mean=200, sigma=1.0, cap=1024),
  ),
  "W3": Workload(
    "words",
    "lstm",
    batch=256,
    features=128,
    hidden=128,
    time_capacity=28,
    token_capacity=3072,
    sample_lengths=word_lengths,
  ),
  # Not a measurement: the script end to end in seconds (run only by name).
  "S": Workload(
    "tiny (end-to-end check)",
    "lstm",
    batch=8,
    features=16,
    hidden=16,
    time_capacity=16,
    token_capacity=128,
    sample_lengths=lognormal_lengths(mean=6, sigma=0.6, cap=16),
  ),
}
# The workloads run when none are named.
DEFAULT_WORKLOADS = ("W1", "W2", "W3")


@dataclasses.dataclass(frozen=True)
class Batch:
  """One batch in every arm's input format (all built on the host)."""

  lengths: np.ndarray  # [batch]
  lod: jaxlod.LoDTensor  # values [token_capacity, features]
  table: jaxlod.ops.RankTable
  padded: np.ndarray  # [batch, time_capacity, features]
  dense: np.ndarray  # [ceil(sum(lengths) / batch), batch, features]

  @property
  def longest(self) -> int:
    return int(self.lengths.max())


def make_batch(w: Workload, rng: np.random.Generator) -> Batch:
  lengths = w.sample_lengths(rng, w.batch)
  rows = rng.standard_normal((int(lengths.sum()), w.features), dtype=np.float32)
  lod = jaxlod.LoDTensor.from_lengths(rows, [lengths], buckets=w.buckets)
  mask = np.arange(w.time_capacity)[None, :] < lengths[:, None]
  padded = np.zeros((w.batch, w.time_capacity, w.features), np.float32)
  padded[mask] = rows
  steps = -(-rows.shape[0] // w.batch)
  dense = np.zeros((steps * w.batch, w.features), np.float32)
  dense[: rows.shape[0]] = rows
  dense = dense.reshape(steps, w.batch, w.features)
  return Batch(lengths, lod, jaxlod.ops.rank_table(lod), padded, dense)


# -- the cell ---------------------------------------------------------------------


def make_cell(w: Workload) -> nn.RNNCellBase:
  if w.cell == "lstm":
    return nn.OptimizedLSTMCell(w.hidden)
  return nn.GRUCell(w.hidden)


def zero_carry(cell: nn.RNNCellBase, count: int, features: int) -> Any:
  return cell.initialize_carry(jax.random.key(0), (count, features))


def final_hidden(carry: Any) -> jax.Array:
  """``h`` of an LSTM carry ``(c, h)`` or a GRU carry ``h``."""
  return carry[1] if isinstance(carry, tuple) else carry


def init_params(cell: nn.RNNCellBase, w: Workload) -> Any:
  x = jnp.zeros((1, w.features), jnp.float32)
  return cell.init(jax.random.key(1), zero_carry(cell, 1, w.features), x)["params"]


def masked_square_sum(y: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.reshape(mask.shape + (1,) * (y.ndim - mask.ndim))
  return jnp.sum(jnp.where(mask, jnp.square(y), 0.0))


def real_rows_of_padded(y: Any, lengths: np.ndarray) -> np.ndarray:
  """Rows of ``[batch, time, hidden]`` at real positions, packed in order."""
  y = np.asarray(y)
  return y[np.arange(y.shape[1])[None, :] < lengths[:, None]]


# -- JAX arms ---------------------------------------------------------------------


@dataclasses.dataclass
class Arm:
  """An arm: jitted ``forward``/``train`` of ``(params, *inputs)``.

  ``compare`` maps the forward result to ``(real rows [sum(lengths), hidden],
  final carry)`` for the equality check, or is `None` (the floor).
  """

  forward: Callable
  train: Callable
  inputs: tuple
  compare: Callable | None
  traces: dict = dataclasses.field(default_factory=lambda: {"train": 0})
  sync: Callable = jax.block_until_ready
  flax_grads: Callable = lambda grads: grads


def _train_step(loss: Callable, traces: dict) -> Callable:
  """Jitted value_and_grad of `loss` w.r.t. its first argument, counting traces."""

  def step(params, *inputs):
    traces["train"] += 1  # Runs once per trace, i.e. once per compilation.
    return jax.value_and_grad(loss)(params, *inputs)

  return jax.jit(step)


def _lod_loss(forward: Callable) -> Callable:
  """The loss of a jaxlod arm whose `forward` returns ``(outputs, carry)``."""

  def loss(params, x, table):
    outputs, carry = forward(params, x, table)
    real = jnp.arange(outputs.capacity.tokens) < outputs.num_rows
    return masked_square_sum(outputs.values, real) + jnp.sum(final_hidden(carry))

  return loss


def _lod_arm(forward: Callable, batch: Batch) -> Arm:
  """An arm of `forward(params, x, table) -> (outputs, carry)` on the LoDTensor."""

  def compare(result):
    outputs, carry = result
    return np.asarray(outputs.values)[: int(batch.lengths.sum())], carry

  traces = {"train": 0}
  return Arm(
    jax.jit(forward),
    _train_step(_lod_loss(forward), traces),
    (batch.lod, jax.device_put(batch.table)),
    compare,
    traces,
  )


def jaxlod_arm(
  cell: nn.RNNCellBase,
  batch: Batch,
  remat: bool,
  plan: jaxlod.ops.LoopPlan | None = None,
) -> Arm:
  """`dynamic_rnn` of `cell` with `remat` and `plan` (`None`: its default)."""

  def forward(params, x, table):
    def step(carry, x_t, static):
      del static
      return cell.apply({"params": params}, carry, x_t)

    init = zero_carry(cell, x.capacity.sequences[-1], x.feature_shape[0])
    return jaxlod.ops.dynamic_rnn(
      step, x, init_carry=init, table=table, remat=remat, plan=plan
    )

  return _lod_arm(forward, batch)


def layer_arm(cell: nn.RNNCellBase, batch: Batch, plan: jaxlod.ops.LoopPlan) -> Arm:
  """`jaxlod.nn.DynamicRNN` of `cell` under `plan` (a hoisting plan hoists
  the input projection of Flax's cells), on the parameters of `cell` alone:
  the layer holds them under ``cell``.

  Raises:
    TypeError: where the layer takes no `plan`.
  """
  layer = jaxlod.nn.DynamicRNN(cell, return_carry=True, plan=plan)

  def forward(params, x, table):
    init = zero_carry(cell, x.capacity.sequences[-1], x.feature_shape[0])
    variables = {"params": {"cell": params}}
    carry, outputs = layer.apply(variables, x, initial_carry=init, table=table)
    return outputs, carry

  return _lod_arm(forward, batch)


def candidate_arm(cell: nn.RNNCellBase, batch: Batch, plan: jaxlod.ops.LoopPlan):
  """The arm of one `CANDIDATES` plan: through the layer when it hoists
  (hoisting is the layers' choice; `dynamic_rnn` runs any step)."""
  if plan.hoist:
    return layer_arm(cell, batch, plan)
  return jaxlod_arm(cell, batch, remat=False, plan=plan)


def flax_arm(cell: nn.RNNCellBase, batch: Batch, time: int) -> Arm:
  rnn = nn.RNN(cell, return_carry=True)

  def forward(params, x, lengths):
    init = zero_carry(cell, x.shape[0], x.shape[-1])
    variables = {"params": {"cell": params}}
    return rnn.apply(variables, x, initial_carry=init, seq_lengths=lengths)

  def loss(params, x, lengths):
    carry, y = forward(params, x, lengths)
    real = jnp.arange(y.shape[1])[None, :] < lengths[:, None]
    return masked_square_sum(y, real) + jnp.sum(final_hidden(carry))

  def compare(result):
    carry, y = result
    return real_rows_of_padded(y, batch.lengths), carry

  traces = {"train": 0}
  inputs = (jnp.asarray(batch.padded[:, :time]), jnp.asarray(batch.lengths, jnp.int32))
  return Arm(jax.jit(forward), _train_step(loss, traces), inputs, compare, traces)


def floor_arm(cell: nn.RNNCellBase, batch: Batch) -> Arm:
  def forward(params, x):
    def step(carry, x_t):
      return cell.apply({"params": params}, carry, x_t)

    return jax.lax.scan(step, zero_carry(cell, x.shape[1], x.shape[2]), x)

  def loss(params, x):
    carry, y = forward(params, x)
    return jnp.sum(jnp.square(y)) + jnp.sum(final_hidden(carry))

  traces = {"train": 0}
  inputs = (jnp.asarray(batch.dense),)
  return Arm(jax.jit(forward), _train_step(loss, traces), inputs, None, traces)


def phased_scans_arm(cell: nn.RNNCellBase, batch: Batch) -> Arm:
  table = jax.device_get(batch.table)
  ranked = batch.padded[np.asarray(table.order)]
  phases = [
    (size, int(start), int(end))
    for size, start, end in zip(
      table.ladder, table.phase_starts, table.phase_ends, strict=True
    )
    if end > start
  ]
  # Phase k's rows: [steps, size, features], time-major.
  inputs = tuple(
    jnp.asarray(ranked[:size, start:end].transpose(1, 0, 2))
    for size, start, end in phases
  )

  def forward(params, *xs):
    def step(carry, x_t):
      return cell.apply({"params": params}, carry, x_t)

    carry, ys = zero_carry(cell, batch.padded.shape[0], batch.padded.shape[2]), []
    for x in xs:
      prefix = jax.tree.map(lambda c, size=x.shape[1]: c[:size], carry)
      part, y = jax.lax.scan(step, prefix, x)
      carry = jax.tree.map(lambda c, p: c.at[: p.shape[0]].set(p), carry, part)
      ys.append(y)
    return carry, ys

  def loss(params, *xs):
    carry, ys = forward(params, *xs)
    return sum(jnp.sum(jnp.square(y)) for y in ys) + jnp.sum(final_hidden(carry))

  traces = {"train": 0}
  return Arm(jax.jit(forward), _train_step(loss, traces), inputs, None, traces)


# -- torch arm --------------------------------------------------------------------


def _flax_to_torch_weights(w: Workload, params: Any) -> dict[str, np.ndarray]:
  """Flax cell params in torch's ``nn.LSTM``/``nn.GRU`` layout.

  Both order the gates the same way (LSTM ``i, f, g, o``; GRU ``r, z, n``);
  torch stores ``[4 * hidden, in]`` where Flax stores ``[in, hidden]`` per
  gate. Flax's LSTM has biases on the recurrent side only; its GRU has input
  biases and a recurrent bias on ``n`` only, as torch's ``b_hn``.
  """
  p = jax.tree.map(np.asarray, params)
  gates = "ifgo" if w.cell == "lstm" else "rzn"
  zeros = np.zeros(w.hidden, np.float32)

  def bias(name):
    return p[name].get("bias", zeros)

  return {
    "weight_ih_l0": np.concatenate([p[f"i{g}"]["kernel"] for g in gates], 1).T,
    "weight_hh_l0": np.concatenate([p[f"h{g}"]["kernel"] for g in gates], 1).T,
    "bias_ih_l0": np.concatenate([bias(f"i{g}") for g in gates]),
    "bias_hh_l0": np.concatenate([bias(f"h{g}") for g in gates]),
  }


def _torch_to_flax(w: Workload, tensors: dict[str, np.ndarray]) -> dict:
  """The inverse of `_flax_to_torch_weights` (for gradients)."""
  gates = "ifgo" if w.cell == "lstm" else "rzn"
  split = {k: np.split(v, len(gates)) for k, v in tensors.items()}
  params = {}
  for k, g in enumerate(gates):
    params[f"i{g}"] = {"kernel": split["weight_ih_l0"][k].T}
    params[f"h{g}"] = {"kernel": split["weight_hh_l0"][k].T}
    if w.cell == "lstm":  # torch's b_ih and b_hh both add to Flax's h bias.
      params[f"h{g}"]["bias"] = split["bias_hh_l0"][k]
    else:
      params[f"i{g}"]["bias"] = split["bias_ih_l0"][k]
  if w.cell == "gru":
    params["hn"]["bias"] = split["bias_hh_l0"][2]
  return params


def torch_arm(w: Workload, params: Any, batch: Batch, device: str = "cpu") -> Arm:
  """The torch arm on `device` (``"cpu"`` or ``"cuda"``, where the packed
  sequence runs through cuDNN)."""
  module_type = torch.nn.LSTM if w.cell == "lstm" else torch.nn.GRU
  module = module_type(w.features, w.hidden, batch_first=True)
  weights = _flax_to_torch_weights(w, params)
  module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
  module.to(device)
  packed = torch.nn.utils.rnn.pack_padded_sequence(
    torch.from_numpy(batch.padded),
    torch.from_numpy(batch.lengths),
    batch_first=True,
    enforce_sorted=False,
  ).to(device)

  def forward(params):
    del params  # Copied into `module` above.
    with torch.no_grad():
      return module(packed)

  def train(params):
    del params
    module.zero_grad(set_to_none=True)
    outputs, state = module(packed)
    h = state[0] if w.cell == "lstm" else state
    loss = outputs.data.square().sum() + h.sum()
    loss.backward()
    # The gradients stay where they are; `loss.item()` waits for them on CUDA.
    return loss.item(), {k: v.grad for k, v in module.named_parameters()}

  def compare(result):
    outputs, state = result
    y, _ = torch.nn.utils.rnn.pad_packed_sequence(outputs, batch_first=True)
    carry = (state[1][0], state[0][0]) if w.cell == "lstm" else state[0]
    carry = jax.tree.map(lambda t: t.cpu().numpy(), carry)
    return real_rows_of_padded(y.cpu().numpy(), batch.lengths), carry

  def flax_grads(grads):
    return _torch_to_flax(w, {k: v.cpu().numpy() for k, v in grads.items()})

  def sync(result):
    # torch on CPU is synchronous: results are ready when the call returns.
    if device != "cpu":
      torch.cuda.synchronize(device)
    return result

  return Arm(forward, train, (), compare, {}, sync, flax_grads)


# -- measurement ------------------------------------------------------------------


def _tree_max_abs_diff(a: Any, b: Any) -> float:
  diffs = jax.tree.map(lambda x, y: np.max(np.abs(np.asarray(x) - np.asarray(y))), a, b)
  return float(max(jax.tree.leaves(diffs)))


def check_equal(arm: Arm, params: Any, reference: dict) -> dict[str, Any] | None:
  """Differences of real outputs, final carry, loss and gradients vs jaxlod."""
  if arm.compare is None:
    return None
  rows, carry = arm.compare(arm.forward(params, *arm.inputs))
  loss, grads = arm.train(params, *arm.inputs)
  grads = arm.flax_grads(grads)
  grad_scale = max(
    float(np.max(np.abs(g))) for g in jax.tree.leaves(reference["grads"])
  )
  diffs = {
    "max_abs_diff_vs_jaxlod": float(np.max(np.abs(rows - reference["rows"]))),
    "final_carry_max_abs_diff_vs_jaxlod": _tree_max_abs_diff(carry, reference["carry"]),
    "loss_rel_diff_vs_jaxlod": abs(float(loss) / reference["loss"] - 1.0),
    "grad_max_rel_diff_vs_jaxlod": _tree_max_abs_diff(grads, reference["grads"])
    / grad_scale,
  }
  diffs["outputs_match"] = (
    max(diffs["max_abs_diff_vs_jaxlod"], diffs["final_carry_max_abs_diff_vs_jaxlod"])
    <= MATCH_ATOL
  )
  return diffs


def reference_of(arm: Arm, params: Any) -> dict[str, Any]:
  rows, carry = arm.compare(arm.forward(params, *arm.inputs))
  loss, grads = arm.train(params, *arm.inputs)
  return {"rows": rows, "carry": carry, "loss": float(loss), "grads": grads}


# -- compile count ----------------------------------------------------------------


def compile_check(w: Workload, arm: Arm, params: Any, batch: Batch, train_s: float):
  """Traces of the jaxlod train step over 100 distinct fixed-capacity batches.

  The first batch is the timed one; the other 99 share its values and differ
  in their LoD (fresh random lengths, so a fresh rank table, built on the
  host as a data pipeline would).
  """
  rng = np.random.default_rng(1)
  call = train_s * COMPILE_CHECK_BATCHES <= COMPILE_CHECK_CALL_BUDGET_S
  rows = np.asarray(batch.lod.values)
  seen, longest = {tuple(batch.lengths)}, {batch.longest}
  start = time.perf_counter()
  with xla_compiles() as xla:
    while len(seen) < COMPILE_CHECK_BATCHES:
      lengths = w.sample_lengths(rng, w.batch)
      if tuple(lengths) in seen:
        continue
      seen.add(tuple(lengths))
      longest.add(int(lengths.max()))
      x = jaxlod.LoDTensor.from_lengths(
        rows[: lengths.sum()], [lengths], buckets=w.buckets
      )
      table = jax.device_put(jaxlod.ops.rank_table(x))
      if call:
        jax.block_until_ready(arm.train(params, x, table))
      else:
        arm.train.lower(params, x, table)
  return {
    "jaxlod_train_fixed_capacity_100_batches": arm.traces["train"],
    "jaxlod_train_cache_size": arm.train._cache_size(),
    "xla_compiles_during_other_99_batches": sum(xla.values()),
    "method": "jit call on each batch" if call else "lower() on each batch",
    "distinct_batches": len(seen),
    "check_s": time.perf_counter() - start,
    "flax_exact_compiles_100_batches": len(longest),
  }


# -- one workload -----------------------------------------------------------------


def build_arms(
  w: Workload,
  params: Any,
  batch: Batch,
  torch_device: str = "cpu",
  plan: jaxlod.ops.LoopPlan | None = None,
) -> dict[str, Arm | None]:
  """The arms of `w`, `jaxlod` and `jaxlod_remat` under `plan` (`None`:
  `dynamic_rnn`'s default)."""
  cell = make_cell(w)
  return {
    "jaxlod": jaxlod_arm(cell, batch, remat=False, plan=plan),
    "jaxlod_remat": jaxlod_arm(cell, batch, remat=True, plan=plan),
    "jaxlod_fused": layer_arm(cell, batch, FUSED_PLAN),
    "flax_capacity": flax_arm(cell, batch, w.time_capacity),
    "flax_exact": flax_arm(cell, batch, batch.longest),
    "floor": floor_arm(cell, batch),
    "torch_packed": (
      torch_arm(w, params, batch, torch_device) if torch is not None else None
    ),
    "phased_scans": phased_scans_arm(cell, batch),
  }


def build_candidates(
  w: Workload, batch: Batch
) -> tuple[dict[str, Arm | None], dict[str, str]]:
  """The arms of `CANDIDATES`, and the error of each that could not be
  built (that arm `None`)."""
  cell, arms, errors = make_cell(w), {}, {}
  for name, plan in CANDIDATES.items():
    try:
      arms[name] = candidate_arm(cell, batch, plan)
    except TypeError as error:  # a layer that takes no such plan
      arms[name], errors[name] = None, f"{type(error).__name__}: {error}"
      print(f"  {name}: not built ({errors[name]})", file=sys.stderr)
  return arms, errors


def first_calls(arm: Arm, params: Any) -> tuple[dict[str, float], str | None]:
  """Seconds of `arm`'s first ``forward`` and ``train`` calls (trace,
  compile, run), made here so that an arm failing to compile is caught
  alone: ``({}, error)`` for an arm that raised."""
  seconds = {}
  for mode in ("forward", "train"):
    start = time.perf_counter()
    try:
      arm.sync(getattr(arm, mode)(params, *arm.inputs))
    except Exception as error:  # e.g. a kernel that does not lower here
      message = f"{mode}: {type(error).__name__}: {error}"
      print(f"  first call failed ({message})", file=sys.stderr)
      return {}, message
    seconds[mode] = time.perf_counter() - start
  return seconds, None


def time_arms(
  arms: dict, params: Any, mode: str, repeats: int, min_seconds: float = 0.0
) -> dict:
  def call(arm: Arm) -> Callable:
    fn = getattr(arm, mode)
    return lambda: fn(params, *arm.inputs)

  calls = {name: (call(arm), arm.sync) for name, arm in arms.items() if arm is not None}
  measured = measure_interleaved(calls, repeats, min_seconds=min_seconds)
  for name, t in measured.items():
    print(f"  {mode:8s} {name:14s} {t['median_s']:.4f} s", file=sys.stderr)
  return {name: measured.get(name) for name in arms}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
  return numerator / denominator if numerator and denominator else None


def summarize(timings: dict) -> dict[str, Any]:
  summary = {f"{name}_s": t and t["median_s"] for name, t in timings.items()}
  jaxlod_s = summary["jaxlod_s"]
  summary["speedup_vs_flax_capacity"] = _ratio(summary["flax_capacity_s"], jaxlod_s)
  summary["speedup_vs_flax_exact"] = _ratio(summary["flax_exact_s"], jaxlod_s)
  summary["ratio_to_floor"] = _ratio(jaxlod_s, summary["floor_s"])
  summary["speedup_vs_torch"] = _ratio(summary["torch_packed_s"], jaxlod_s)
  summary["remat_ratio_to_floor"] = _ratio(
    summary["jaxlod_remat_s"], summary["floor_s"]
  )
  summary["ratio_to_phased_scans"] = _ratio(jaxlod_s, summary["phased_scans_s"])
  summary["phased_scans_ratio_to_floor"] = _ratio(
    summary["phased_scans_s"], summary["floor_s"]
  )
  fused_s = summary["jaxlod_fused_s"]
  summary["fused_ratio_to_jaxlod"] = _ratio(fused_s, jaxlod_s)
  summary["fused_ratio_to_torch_packed"] = _ratio(fused_s, summary["torch_packed_s"])
  summary["fused_ratio_to_flax_capacity"] = _ratio(fused_s, summary["flax_capacity_s"])
  for key in ("compile_s", "first_call_s", "times_s", "minor_faults_per_call"):
    summary[key] = {name: t and t[key] for name, t in timings.items()}
  return summary


def batch_stats(w: Workload, batch: Batch) -> dict[str, Any]:
  """Sizes of the batch and the token-steps each arm runs."""
  lengths = batch.lengths
  population = w.sample_lengths(np.random.default_rng(2), 100_000)
  return {
    "lengths_distribution_mean": float(population.mean()),
    "lengths_mean": float(lengths.mean()),
    "lengths_max": batch.longest,
    "capacity": batch.lod.capacity._asdict(),
    "ladder": list(batch.table.ladder),
    "token_steps": {
      "real": int(lengths.sum()),
      "jaxlod_schedule": int(batch.table.schedule_steps()),
      "flax_capacity": w.batch * w.time_capacity,
      "flax_exact": w.batch * batch.longest,
      "floor": int(batch.dense.shape[0] * w.batch),
    },
  }


def plan_record(plan: jaxlod.ops.LoopPlan | None, batch: Batch) -> dict[str, Any]:
  """What a jaxlod arm ran: the plan it was given (`None`: none), the plan
  that ran (the backend's default for `None`) and its loop's batch sizes."""
  ran = plan if plan is not None else jaxlod.ops.default_plan()
  table = batch.table
  return {
    "given": plan and dataclasses.asdict(plan),
    "ran": dataclasses.asdict(ran),
    "loop_ladder": list(ran.ladder(table.count_capacity, table.ladder)),
  }


def fused_plan_record(batch: Batch) -> dict[str, Any]:
  """What the fused arm ran: its plan, tile, whether in interpret mode (as
  `fused_rnn` decides: on a CPU backend), and each tile's steps (its longest
  length; tiles of sequences in rank order) and their token-steps."""
  lengths = np.zeros(-(-batch.lengths.size // FUSED_TILE) * FUSED_TILE, np.int64)
  lengths[: batch.lengths.size] = np.sort(batch.lengths)[::-1]
  tile_steps = lengths[::FUSED_TILE]
  return {
    "given": dataclasses.asdict(FUSED_PLAN),
    "ran": dataclasses.asdict(FUSED_PLAN),
    "tile": FUSED_TILE,
    "interpret": jax.default_backend() == "cpu",
    "tile_steps": tile_steps.tolist(),
    "token_steps": int(tile_steps.sum()) * FUSED_TILE,
  }


def _matches(same: dict[str, Any]) -> bool:
  """Whether an arm computes what `jaxlod` does (its `check_equal`)."""
  return (
    same["outputs_match"]
    and same["loss_rel_diff_vs_jaxlod"] <= CANDIDATE_RTOL
    and same["grad_max_rel_diff_vs_jaxlod"] <= CANDIDATE_RTOL
  )


def fused_summary(
  timings: dict,
  equality: dict,
  record: dict,
  error: str | None,
  targets: dict[str, float],
) -> dict[str, Any]:
  """The fused arm's times and compile times, their ratios to `jaxlod`, torch
  packed and Flax padded to the capacity, whether it computes what `jaxlod`
  does, and issue 54's `targets` with whether each is met (`None` in
  interpret mode, where the times are not the kernel's, or without torch)."""
  entry = dict(record)
  if error is not None:
    return {**entry, "error": error}
  for mode in ("forward", "train"):
    t = timings[mode]
    fused, jaxlod_, flax = t["jaxlod_fused"], t["jaxlod"], t["flax_capacity"]
    torch_s = t["torch_packed"] and t["torch_packed"]["median_s"]
    entry[f"{mode}_s"] = fused["median_s"]
    entry[f"{mode}_compile_s"] = fused["compile_s"]
    entry[f"{mode}_ratio_to_jaxlod"] = _ratio(fused["median_s"], jaxlod_["median_s"])
    entry[f"{mode}_ratio_to_torch_packed"] = _ratio(fused["median_s"], torch_s)
    entry[f"{mode}_compile_ratio_to_jaxlod"] = _ratio(
      fused["compile_s"], jaxlod_["compile_s"]
    )
    entry[f"{mode}_compile_ratio_to_flax_capacity"] = _ratio(
      fused["compile_s"], flax["compile_s"]
    )
  entry["matches_jaxlod"] = _matches(equality["jaxlod_fused"])
  targets = {**targets, **FUSED_COMPILE_TARGET}
  entry["targets"] = targets
  entry["meets_targets"] = {
    key: None if record["interpret"] or entry[key] is None else entry[key] <= target
    for key, target in targets.items()
  }
  return entry


def candidate_summary(
  timings: dict, equality: dict, plans: dict, errors: dict
) -> dict[str, Any]:
  """Each candidate's plan, times and ratios to `jaxlod`'s, or its error."""
  out = {}
  for name in CANDIDATES:
    entry = dict(plans[name])
    if name in errors:
      out[name] = {**entry, "error": errors[name]}
      continue
    for mode in ("forward", "train"):
      t, ref = timings[mode][name], timings[mode]["jaxlod"]
      entry[f"{mode}_s"] = t["median_s"]
      entry[f"{mode}_compile_s"] = t["compile_s"]
      entry[f"{mode}_ratio_to_jaxlod"] = _ratio(t["median_s"], ref["median_s"])
      entry[f"{mode}_compile_ratio_to_jaxlod"] = _ratio(
        t["compile_s"], ref["compile_s"]
      )
    entry["matches_jaxlod"] = _matches(equality[name])
    out[name] = entry
  return out


def run_workload(
  w: Workload,
  repeats: int,
  torch_device: str = "cpu",
  plan: jaxlod.ops.LoopPlan | None = None,
  candidates: bool = False,
  fused_targets: dict[str, float] | None = None,
) -> dict[str, Any]:
  """One workload's report; `fused_targets`: issue 54's targets of the fused
  arm on `w` (`FUSED_TARGETS`), besides the compile target."""
  batch = make_batch(w, np.random.default_rng(0))
  params = init_params(make_cell(w), w)
  arms = build_arms(w, params, batch, torch_device, plan)
  plans = {name: plan_record(plan, batch) for name in ("jaxlod", "jaxlod_remat")}
  plans["jaxlod_fused"] = fused_plan_record(batch)
  fused_first, fused_error = first_calls(arms["jaxlod_fused"], params)
  if fused_error is not None:
    arms["jaxlod_fused"] = None
  errors = {}
  if candidates:
    extra, errors = build_candidates(w, batch)
    arms.update(extra)
    plans.update({name: plan_record(p, batch) for name, p in CANDIDATES.items()})
  timings = {
    mode: time_arms(arms, params, mode, repeats) for mode in ("forward", "train")
  }
  for mode, first in fused_first.items():  # its real first call, made above
    t = timings[mode]["jaxlod_fused"]
    t.update(first_call_s=first, compile_s=max(first - t["median_s"], 0.0))
  reference = reference_of(arms["jaxlod"], params)
  train_s = timings["train"]["jaxlod"]["median_s"]
  result = {
    "config": {k: v for k, v in dataclasses.asdict(w).items() if k != "sample_lengths"},
    "batch": batch_stats(w, batch),
    "train": summarize(timings["train"]),
    "forward": summarize(timings["forward"]),
    "train_over_forward": {
      name: t and _ratio(t["median_s"], timings["forward"][name]["median_s"])
      for name, t in timings["train"].items()
    },
    "equality": {
      name: arm and check_equal(arm, params, reference)
      for name, arm in arms.items()
      if name != "jaxlod"
    },
    "plans": plans,
  }
  result["fused"] = fused_summary(
    timings, result["equality"], plans["jaxlod_fused"], fused_error, fused_targets or {}
  )
  if candidates:
    result["candidates"] = candidate_summary(timings, result["equality"], plans, errors)
  result["compiles"] = compile_check(w, arms["jaxlod"], params, batch, train_s)
  return result


# -- command line -----------------------------------------------------------------


def default_torch_device() -> str:
  """``"cuda"`` when JAX runs on a GPU and torch sees one, else ``"cpu"``:
  each framework on its best device."""
  gpu = jax.default_backend() == "gpu"
  return "cuda" if gpu and torch is not None and torch.cuda.is_available() else "cpu"


def machine_info(torch_device: str = "cpu") -> dict[str, Any]:
  return _machine_info(
    torch=torch and torch.__version__,
    torch_threads=torch and torch.get_num_threads(),
    torch_device=torch
    and (torch.cuda.get_device_name(torch_device) if torch_device != "cpu" else "cpu"),
  )


def workload_names(parser: argparse.ArgumentParser, args: Any) -> list[str]:
  """``args.workloads`` (comma-separated names) as a list, with
  ``args.repeats`` checked; errors through `parser` (the scripts that reuse
  these workloads share it)."""
  names = [name.strip() for name in args.workloads.split(",") if name.strip()]
  unknown = [name for name in names if name not in WORKLOADS]
  if unknown:
    parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  return names


def candidate_workloads(
  parser: argparse.ArgumentParser, value: str, workloads: list[str]
) -> list[str]:
  """The workloads of ``--candidates``: none (``""``), every one run
  (``"all"``), or those named, each of them run."""
  if value == "all":
    return list(workloads)
  names = [name.strip() for name in value.split(",") if name.strip()]
  missing = [name for name in names if name not in workloads]
  if missing:
    parser.error(f"--candidates names {missing}, which --workloads does not run")
  return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--json", type=Path, default=None, help="also write here")
  parser.add_argument(
    "--torch-threads",
    type=int,
    default=os.cpu_count() or 1,
    help="torch.set_num_threads (default: the machine's cores); on a busy "
    "machine fewer threads avoid stalls at torch's thread barriers",
  )
  parser.add_argument(
    "--torch-device",
    choices=("cpu", "cuda"),
    default=None,
    help="the torch arm's device (default: cuda when JAX runs on a GPU and "
    "torch sees one, else cpu)",
  )
  parser.add_argument(
    "--plan",
    choices=list(PLANS),
    default="default",
    help="the LoopPlan of the jaxlod and jaxlod_remat arms: default passes "
    "none (dynamic_rnn's default for the backend), cpu is LoopPlan(), "
    'accelerator default_plan("gpu")',
  )
  parser.add_argument(
    "--candidates",
    nargs="?",
    const="all",
    default="",
    metavar="WORKLOADS",
    help="also time an arm per plan candidate ("
    + ", ".join(CANDIDATES)
    + ") on every workload run, or on those named (comma-separated)",
  )
  args = parser.parse_args(argv)
  args.workloads = workload_names(parser, args)
  args.candidates = candidate_workloads(parser, args.candidates, args.workloads)
  if args.torch_threads < 1:
    parser.error(f"--torch-threads must be >= 1, got {args.torch_threads}")
  return args


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  if not hasattr(jaxlod.ops, "dynamic_rnn"):
    sys.exit("jaxlod.ops.dynamic_rnn is not available; nothing to benchmark.")
  torch_device = args.torch_device or default_torch_device()
  if torch is not None:
    torch.set_num_threads(args.torch_threads)
    if torch_device == "cuda" and not torch.cuda.is_available():
      sys.exit("--torch-device cuda: torch sees no CUDA device.")
  start = time.perf_counter()
  plan = PLANS[args.plan]
  report = {
    "machine": machine_info(torch_device),
    "repeats": args.repeats,
    "plan": {"name": args.plan, "plan": plan and dataclasses.asdict(plan)},
    "candidates": args.candidates,
    "fused": {
      "plan": dataclasses.asdict(FUSED_PLAN),
      "tile": FUSED_TILE,
      "interpret": jax.default_backend() == "cpu",
    },
    "workloads": {},
  }
  for name in args.workloads:
    print(f"{name}: {WORKLOADS[name].description}", file=sys.stderr)
    report["workloads"][name] = run_workload(
      WORKLOADS[name],
      args.repeats,
      torch_device,
      plan,
      candidates=name in args.candidates,
      fused_targets=FUSED_TARGETS.get(name),
    )
    report["wall_s"] = time.perf_counter() - start
    if args.json is not None:  # what is done so far, should the run stop
      args.json.write_text(json.dumps(report, indent=2) + "\n")
  report["wall_s"] = time.perf_counter() - start
  write_report(report, args.json)


if __name__ == "__main__":
  main()
