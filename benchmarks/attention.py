"""Memory and time of an attention encoder-decoder training step.

jaxlod against a padded Flax baseline, same weights, same batch. The model:
embeddings (256), an LSTM encoder (256), an LSTM decoder (256) with additive
(Bahdanau) attention over the encoder outputs, and an output projection; the
loss is the mean cross-entropy over the real target tokens. Batch 32, source
and target lengths log-normal with mean about 40, capped at 128.

* ``jaxlod``: `jaxlod.nn.Seq2Seq` on LoDTensors with a fixed capacity. The
  decoder is a `dynamic_rnn` whose step attends over the encoder outputs (a
  static input, shrunk to the phase), so attention is computed per step over
  ``[b, source, units]``; the step is recomputed in the backward pass (remat).
* ``padded_expansion``: the batch padded to the time capacity (128) on both
  sides, `flax.linen.RNN` for encoder and decoder, and attention computed for
  all target steps at once from the ``[batch, target, source, units]``
  additive scores, the expansion Fluid's design avoids.

Memory: XLA's temporary buffers of the compiled training step
(``jax.jit(...).lower(...).compile().memory_analysis()``), and the peak RSS
of a process that compiles and runs only that arm (each arm runs in its own
subprocess so the high-water marks do not mix). Time: the median of
interleaved runs of both arms in one process (compile excluded). Tokens per
second count the real source and target tokens of the batch.

``--plan`` sets the `jaxlod.ops.LoopPlan` of jaxlod's loops (its encoder's
and its teacher-forced decoder's, the two loops of the training step;
`Seq2Seq` runs no loop of its own): ``default`` passes none (the backend's
`jaxlod.ops.default_plan`), ``cpu`` is ``LoopPlan()`` and ``accelerator``
``default_plan("gpu")``, forced on any backend; the report records it.

Usage: ``python -m benchmarks.attention [--repeats N] [--json PATH]
[--plan {default,cpu,accelerator}]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.timing import machine_info, measure_interleaved, write_report
from jaxlod import Buckets, LoDTensor
from jaxlod.nn import AdditiveAttention, AttentionDecoder, DynamicRNN, Seq2Seq
from jaxlod.ops import LoopPlan, default_plan

HIDDEN = 256
EMBED = 256
UNITS = 256
VOCAB = 1000
BATCH = 32
MEAN_LENGTH = 40
TIME_CAPACITY = 128
TOKEN_CAPACITY = 2048
BUCKETS = Buckets.fixed(tokens=TOKEN_CAPACITY, sequences=BATCH, time=TIME_CAPACITY)
# `--plan`: the `LoopPlan` of jaxlod's loops (`None`: pass none, the backend's).
PLANS: dict[str, LoopPlan | None] = {
  "default": None,
  "cpu": LoopPlan(),
  "accelerator": default_plan("gpu"),
}

# -- the batch --------------------------------------------------------------------


def sample_lengths(rng: np.random.Generator) -> np.ndarray:
  """Log-normal lengths with mean about `MEAN_LENGTH`, in [1, 128]."""
  sigma = 0.6
  mu = np.log(MEAN_LENGTH) - sigma**2 / 2
  lengths = np.round(rng.lognormal(mu, sigma, BATCH)).astype(np.int64)
  return np.clip(lengths, 1, TIME_CAPACITY)


def _padded(ids: list[np.ndarray]) -> np.ndarray:
  out = np.zeros((BATCH, TIME_CAPACITY), np.int32)
  for i, seq in enumerate(ids):
    out[i, : seq.size] = seq
  return out


def make_batch(seed: int = 0) -> dict[str, Any]:
  """Source, target input and target output ids, packed and padded."""
  rng = np.random.default_rng(seed)
  src_len, tgt_len = sample_lengths(rng), sample_lengths(rng)
  src = [rng.integers(1, VOCAB, n).astype(np.int32) for n in src_len]
  tgt = [rng.integers(1, VOCAB, n + 1).astype(np.int32) for n in tgt_len]
  tgt_in, tgt_out = [t[:-1] for t in tgt], [t[1:] for t in tgt]

  def lod(seqs):
    return LoDTensor.from_sequences(seqs, buckets=BUCKETS, dtype=np.int32)

  return {
    "lod": (lod(src), lod(tgt_in), lod(tgt_out)),
    "padded": (
      _padded(src),
      src_len.astype(np.int32),
      _padded(tgt_in),
      _padded(tgt_out),
      tgt_len.astype(np.int32),
    ),
    "tokens": int(src_len.sum() + tgt_len.sum()),
  }


# -- the two models (one parameter tree) ------------------------------------------


def make_model(plan: str = "default") -> Seq2Seq:
  """The jaxlod model; the `PLANS` entry `plan` runs its loops (its
  encoder's and its decoder's; the parameters do not depend on it)."""
  field = {} if PLANS[plan] is None else {"plan": PLANS[plan]}
  return Seq2Seq(
    src_vocab=VOCAB,
    tgt_vocab=VOCAB,
    embed_dim=EMBED,
    encoder=DynamicRNN(nn.OptimizedLSTMCell(HIDDEN), **field),
    decoder=AttentionDecoder(
      nn.OptimizedLSTMCell(HIDDEN), AdditiveAttention(UNITS), **field
    ),
    bridge=False,
  )


def jaxlod_loss(
  params: Any,
  src: LoDTensor,
  tgt_in: LoDTensor,
  tgt_out: LoDTensor,
  plan: str = "default",
):
  logits = make_model(plan).apply(params, src, tgt_in)
  ids = tgt_out.values.reshape(-1)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.values, ids)
  real = jnp.arange(ce.shape[0]) < tgt_out.num_rows
  return jnp.sum(jnp.where(real, ce, 0.0)) / tgt_out.num_rows


def _rnn(params: Any, x: jax.Array, lengths: jax.Array) -> jax.Array:
  rnn = nn.RNN(nn.OptimizedLSTMCell(HIDDEN))
  return rnn.apply({"params": {"cell": params}}, x, seq_lengths=lengths)


def padded_loss(params: Any, src, src_len, tgt_in, tgt_out, tgt_len):
  """The same model on padded batches, attention for all steps at once."""
  p = params["params"]
  enc = _rnn(p["encoder"]["cell"], p["src_embed"]["embedding"][src], src_len)
  h = _rnn(p["decoder"]["cell"], p["tgt_embed"]["embedding"][tgt_in], tgt_len)
  attention = p["decoder"]["attention"]
  keys = enc @ attention["key"]["kernel"]  # [B, S, U]
  query = h @ attention["query"]["kernel"] + attention["query"]["bias"]  # [B, T, U]
  expanded = jnp.tanh(keys[:, None, :, :] + query[:, :, None, :])  # [B, T, S, U]
  scores = (expanded @ attention["energy"]["kernel"])[..., 0]  # [B, T, S]
  real_src = jnp.arange(TIME_CAPACITY)[None, None, :] < src_len[:, None, None]
  weights = jax.nn.softmax(jnp.where(real_src, scores, -jnp.inf), axis=-1)
  context = jnp.einsum("bts,bsf->btf", weights, enc)
  out = jnp.concatenate([h, context], axis=-1)
  logits = out @ p["output"]["kernel"] + p["output"]["bias"]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt_out)
  real_tgt = jnp.arange(TIME_CAPACITY)[None, :] < tgt_len[:, None]
  return jnp.sum(jnp.where(real_tgt, ce, 0.0)) / jnp.sum(tgt_len)


ARMS = {
  "jaxlod": (jaxlod_loss, "lod"),
  "padded_expansion": (padded_loss, "padded"),
}


def init_params(batch: dict[str, Any]) -> Any:
  src, tgt_in, _ = batch["lod"]
  return make_model().init(jax.random.key(0), src, tgt_in)


def train_step(arm: str, plan: str = "default"):
  """The jitted value and gradient of `arm`'s loss (jaxlod's under `plan`)."""
  loss, _ = ARMS[arm]
  if arm == "jaxlod":
    loss = functools.partial(loss, plan=plan)
  return jax.jit(jax.value_and_grad(loss))


# -- measurements -------------------------------------------------------------------


def measure_memory(arm: str, plan: str = "default") -> dict[str, Any]:
  """Temporary bytes of the compiled step, and this process's peak RSS."""
  batch = make_batch()
  params = init_params(batch)
  args = batch[ARMS[arm][1]]
  compiled = train_step(arm, plan).lower(params, *args).compile()
  analysis = compiled.memory_analysis()
  loss, _ = jax.block_until_ready(compiled(params, *args))
  return {
    "temp_bytes": int(analysis.temp_size_in_bytes),
    "argument_bytes": int(analysis.argument_size_in_bytes),
    "output_bytes": int(analysis.output_size_in_bytes),
    # ru_maxrss is in KiB on Linux.
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "loss": float(loss),
  }


def memory_in_subprocess(arm: str, plan: str = "default") -> dict[str, Any]:
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.attention",
      "--memory-of",
      arm,
      "--plan",
      plan,
    ],
    check=True,
    stdout=subprocess.PIPE,  # its errors reach this process's stderr
    text=True,
  )
  return json.loads(out.stdout)


def measure_time(repeats: int, plan: str = "default") -> dict[str, Any]:
  batch = make_batch()
  params = init_params(batch)
  steps = {arm: train_step(arm, plan) for arm in ARMS}
  calls = {
    arm: (
      lambda arm=arm: steps[arm](params, *batch[ARMS[arm][1]]),
      jax.block_until_ready,
    )
    for arm in ARMS
  }
  measured = measure_interleaved(calls, repeats)
  grads = {arm: steps[arm](params, *batch[ARMS[arm][1]]) for arm in ARMS}
  (loss_a, g_a), (loss_b, g_b) = grads["jaxlod"], grads["padded_expansion"]
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), g_a, g_b)
  scale = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(g_b))
  return {
    "times": measured,
    "tokens": batch["tokens"],
    "loss": {"jaxlod": float(loss_a), "padded_expansion": float(loss_b)},
    "grad_max_abs_diff": max(jax.tree.leaves(diff)),
    "grad_max_abs": scale,
  }


def run(repeats: int, plan: str = "default") -> dict[str, Any]:
  start = time.perf_counter()
  memory = {arm: memory_in_subprocess(arm, plan) for arm in ARMS}
  timing = measure_time(repeats, plan)
  given = PLANS[plan] and dataclasses.asdict(PLANS[plan])
  report: dict[str, Any] = {
    "machine": machine_info(),
    "repeats": repeats,
    "plan": {"name": plan, "plan": given},
  }
  for arm in ARMS:
    step_s = timing["times"][arm]["median_s"]
    report[arm] = {
      "temp_bytes": memory[arm]["temp_bytes"],
      "peak_rss_bytes": memory[arm]["peak_rss_bytes"],
      "step_s": step_s,
      "tokens_per_s": timing["tokens"] / step_s,
      "compile_s": timing["times"][arm]["compile_s"],
      "times_s": timing["times"][arm]["times_s"],
      "loss": timing["loss"][arm],
    }
  report["memory_ratio"] = (
    report["padded_expansion"]["temp_bytes"] / report["jaxlod"]["temp_bytes"]
  )
  report["time_ratio"] = (
    report["jaxlod"]["step_s"] / report["padded_expansion"]["step_s"]
  )
  report["rss_ratio"] = (
    report["padded_expansion"]["peak_rss_bytes"] / report["jaxlod"]["peak_rss_bytes"]
  )
  report["same_model"] = {
    "loss_abs_diff": abs(timing["loss"]["jaxlod"] - timing["loss"]["padded_expansion"]),
    "grad_max_abs_diff": timing["grad_max_abs_diff"],
    "grad_max_abs": timing["grad_max_abs"],
  }
  report["tokens_per_batch"] = timing["tokens"]
  report["wall_s"] = time.perf_counter() - start
  return report


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", type=Path, default=None, help="also write here")
  parser.add_argument(
    "--plan",
    choices=list(PLANS),
    default="default",
    help="the LoopPlan of jaxlod's loops: default passes none (the backend's), "
    'cpu is LoopPlan(), accelerator default_plan("gpu")',
  )
  parser.add_argument("--memory-of", choices=list(ARMS), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.memory_of:
    print(json.dumps(measure_memory(args.memory_of, args.plan)))
    return
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  write_report(run(args.repeats, args.plan), args.json)


if __name__ == "__main__":
  main()
