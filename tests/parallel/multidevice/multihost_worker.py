"""One process of the multi-host test (tests/parallel/test_parallel.py).

``python -m tests.parallel.multidevice.multihost_worker OUT PROCESS_ID NUM_PROCESSES
PORT``: with more than one process it joins a `jax.distributed` run on
127.0.0.1:PORT (CPU collectives through gloo); the devices per process come
from ``XLA_FLAGS``. It trains a small `Seq2Seq` for `STEPS` data-parallel
steps over every device from the same seed, writes the final parameters to
OUT (an .npz), and then checks that batches of different capacities on the
processes raise.
"""

from __future__ import annotations

import functools
import sys

import jax

STEPS = 10


def main(out: str, process_id: int, num_processes: int, port: int) -> None:
  if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}",
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=60,
    )
  import flax.linen as nn
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxlod import Buckets
  from jaxlod.data import Batcher
  from jaxlod.nn import AdditiveAttention, AttentionDecoder, DynamicRNN, Seq2Seq
  from jaxlod.parallel import data_parallel, shard_batch

  rng = np.random.default_rng(0)
  examples = []
  for _ in range(120):
    src = rng.integers(0, 9, size=int(rng.integers(1, 9)))
    tgt = rng.integers(2, 9, size=int(rng.integers(1, 7)))
    examples.append((src, np.concatenate([[0], tgt[:-1]]), tgt))
  buckets = Buckets.fixed(tokens=48, sequences=8, time=10)
  batcher = Batcher(examples, buckets, shards=4, seed=0, prefetch=0)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  replicated = NamedSharding(mesh, P())
  model = Seq2Seq(
    src_vocab=9,
    tgt_vocab=9,
    embed_dim=6,
    encoder=DynamicRNN(nn.LSTMCell(8)),
    decoder=AttentionDecoder(nn.LSTMCell(8), AdditiveAttention(8)),
  )
  batches = batcher.iterate()
  first = next(batches)
  local = jax.tree.map(lambda a: a[0], first.fields)
  params = model.init(jax.random.key(0), local[0], local[1])
  tx = optax.adam(1e-2)

  def sums(params, fields):
    src, tgt_in, tgt_out = fields

    def loss(params):
      logits = model.apply(params, src, tgt_in)
      ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.values, tgt_out.values
      )
      real = tgt_out.row_mask()
      return jnp.sum(jnp.where(real, ce, 0.0))

    total, grads = jax.value_and_grad(loss)(params)
    return total, tgt_out.num_rows, grads

  grads_of = data_parallel(sums, mesh)

  @functools.partial(jax.jit, out_shardings=replicated)
  def step(params, opt_state, fields):
    total, count, grads = grads_of(params, fields)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, total / count

  def put(tree):  # the same values on every process: a replicated global array
    return jax.tree.map(
      lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)), tree
    )

  params, opt_state = put(params), put(tx.init(params))
  batch = first
  for i in range(STEPS):
    if i:
      batch = next(batches)
    params, opt_state, _ = step(params, opt_state, shard_batch(batch, mesh).fields)
  host = {
    jax.tree_util.keystr(path): np.asarray(leaf.addressable_data(0))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }
  np.savez(out, **host)

  if num_processes > 1:  # capacities that differ between processes
    wide = Buckets.fixed(tokens=64, sequences=8, time=10)
    other = Batcher(examples, wide if process_id else buckets, shards=4, prefetch=0)
    try:
      shard_batch(next(other.iterate()), mesh)
    except ValueError as e:
      if "same capacities" in str(e) and "process" in str(e):
        print("MISMATCH-RAISED:", e, flush=True)
    # A time capacity is static (the LoD's aux data): the structure differs.
    longer = Buckets.fixed(tokens=48, sequences=8, time=12)
    fields = Batcher(
      examples, longer if process_id else buckets, shards=4, prefetch=0, tables=False
    )
    try:
      shard_batch(next(fields.iterate()).fields, mesh)
    except ValueError as e:
      if "static capacities" in str(e):
        print("STRUCTURE-RAISED:", e, flush=True)
  print("WORKER-DONE", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
