"""W1, briefly: train an LSTM on sentence-length batches with jaxlod.

Sixty-four sequences a batch, log-normal lengths (mean about 30, at most
128), LSTM 256. A few optax steps under `jaxlod.ops.dynamic_rnn` on a fixed
capacity (one compilation), learning the running mean of each sequence,
with a progress bar; then one training step timed
side by side against `flax.linen.RNN` padded to the time capacity, padded to
the batch's longest sequence, and the floor (a dense scan over
``ceil(sum(lengths) / batch)`` full steps). ``benchmarks/rnn.py`` is the full
measurement.

Run with ``python -m examples.w1`` from the repository root (under a minute
on 2 CPU cores).
"""

from __future__ import annotations

import functools
import math
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from benchmarks.timing import measure_interleaved
from jaxlod import Buckets, LoDTensor, enable_compilation_cache
from jaxlod.ops import dynamic_rnn, rank_table

BATCH, FEATURES, HIDDEN, TIME = 64, 256, 256, 128
CAPACITY = Buckets.fixed(tokens=3072, sequences=BATCH, time=TIME)


def sample_batch(rng: np.random.Generator) -> tuple[LoDTensor, np.ndarray]:
  """A batch of random sequences under the fixed capacity."""
  sigma = 0.6
  lengths = rng.lognormal(math.log(30) - sigma**2 / 2, sigma, BATCH)
  lengths = np.clip(np.rint(lengths), 1, TIME).astype(np.int64)
  rows = rng.standard_normal((int(lengths.sum()), FEATURES)).astype(np.float32)
  return LoDTensor.from_lengths(rows, [lengths], buckets=CAPACITY), lengths


def running_mean(x: LoDTensor) -> jax.Array:
  """The task: at each row, the mean of its sequence so far ``[tokens, F]``."""
  totals = jnp.cumsum(x.values, axis=0)
  totals = jnp.concatenate([jnp.zeros_like(totals[:1]), totals])  # totals[i]: rows < i
  rows = jnp.arange(x.capacity.tokens)
  seq = jnp.searchsorted(x.offsets[-1], rows, side="right") - 1
  start = x.offsets[-1][jnp.clip(seq, 0, BATCH - 1)]
  return (totals[rows + 1] - totals[start]) / (rows - start + 1)[:, None]


CELL = nn.OptimizedLSTMCell(HIDDEN)


def init_params(seed: int) -> dict:
  zeros = jnp.zeros((1, FEATURES))
  return CELL.init(
    jax.random.key(seed), CELL.initialize_carry(jax.random.key(0), zeros.shape), zeros
  )


def lstm(params, x: LoDTensor, table, *, remat: bool = False):
  """The LSTM over every sequence of `x`: outputs and final ``(c, h)``."""
  carry = CELL.initialize_carry(jax.random.key(0), (x.capacity.sequences[-1], FEATURES))

  def step(c, x_t, _):
    return CELL.apply(params, c, x_t)

  return dynamic_rnn(step, x, init_carry=carry, table=table, remat=remat)


def train(steps: int, seed: int = 0) -> None:
  """A few optax steps with a progress bar (loss, tokens per second)."""
  rng = np.random.default_rng(seed)
  params = init_params(seed)
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)

  def loss_fn(params, x, table):
    outputs, _ = lstm(params, x, table)
    error = jnp.mean((outputs.values - running_mean(x)) ** 2, axis=-1)
    real = x.row_mask()
    return jnp.sum(jnp.where(real, error, 0.0)) / x.num_rows

  @jax.jit
  def train_step(params, opt_state, x, table):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, table)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  bar = tqdm(range(steps), desc="W1 training (jaxlod)", unit="step")
  for _ in bar:
    x, lengths = sample_batch(rng)
    table = rank_table(x)  # on the host, beside the batch
    start = time.perf_counter()
    params, opt_state, loss = jax.block_until_ready(
      train_step(params, opt_state, x, table)
    )
    rate = lengths.sum() / (time.perf_counter() - start)
    bar.set_postfix(loss=f"{float(loss):.3f}", tokens_per_s=f"{rate:,.0f}")
  print(f"compilations of the training step: {train_step._cache_size()}")


def _value_and_grad(loss):
  return jax.jit(jax.value_and_grad(loss))


def compare(repeats: int = 5, seed: int = 1) -> dict[str, float]:
  """Seconds per training step (value and gradient) of the four ways."""
  rng = np.random.default_rng(seed)
  x, lengths = sample_batch(rng)
  params = init_params(seed)
  carry = CELL.initialize_carry(jax.random.key(0), (BATCH, FEATURES))
  rnn = nn.RNN(CELL, return_carry=True)

  def jaxlod_loss(params, x, table):
    outputs, (_, h) = lstm(params, x, table)
    return jnp.sum(outputs.values**2) + jnp.sum(h)

  def padded_loss(params, padded, lengths):
    variables = {"params": {"cell": params["params"]}}
    (_, h), y = rnn.apply(variables, padded, seq_lengths=lengths)
    mask = jnp.arange(y.shape[1])[None, :, None] < lengths[:, None, None]
    return jnp.sum(jnp.where(mask, y**2, 0.0)) + jnp.sum(h)

  def floor_loss(params, dense):
    def step(c, x_t):
      return CELL.apply(params, c, x_t)

    (_, h), y = jax.lax.scan(step, carry, dense)
    return jnp.sum(y**2) + jnp.sum(h)

  padded, padded_lengths = x.to_padded()
  longest = int(lengths.max())
  steps = -(-int(lengths.sum()) // BATCH)
  dense = np.asarray(x.values)[: steps * BATCH].reshape(steps, BATCH, FEATURES)
  padded_step = _value_and_grad(padded_loss)
  runs = {
    "jaxlod (phased, padding-free)": (
      _value_and_grad(jaxlod_loss),
      (params, x, rank_table(x)),
    ),
    f"flax.linen.RNN padded to {TIME}": (padded_step, (params, padded, padded_lengths)),
    f"flax.linen.RNN padded to {longest}": (
      padded_step,
      (params, padded[:, :longest], padded_lengths),
    ),
    f"floor: dense scan of {steps} full steps": (
      _value_and_grad(floor_loss),
      (params, dense),
    ),
  }
  calls = {
    name: (functools.partial(fn, *args), jax.block_until_ready)
    for name, (fn, args) in runs.items()
  }
  timings = measure_interleaved(calls, repeats)
  return {name: t["median_s"] for name, t in timings.items()}


def main(steps: int = 30) -> None:
  enable_compilation_cache()
  train(steps)
  print("\nOne training step (value and gradient), median of 5 interleaved runs:")
  print("  seconds  time / jaxlod's")
  timings = compare()
  jaxlod_s = next(iter(timings.values()))
  for name, seconds in timings.items():
    print(f"  {seconds:7.4f}  {seconds / jaxlod_s:5.2f}x  {name}")


if __name__ == "__main__":
  main()
