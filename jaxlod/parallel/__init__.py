"""Data parallelism on JAX's SPMD machinery: a mesh axis of devices, each
running jaxlod's loops on its own shard.

A sharded `jaxlod.data.Batcher` deals each global batch to shards of equal
capacities, balanced in tokens and lengths; `shard_batch` places the shards
on a `jax.sharding.Mesh` from each process's local data; `data_parallel`
runs a function per device under `jax.shard_map` (each device its own phases
and trip counts) and sums its outputs, and `map_shards` stacks them instead
(decoding: `generate`; a corpus with continuous refill, each device its
own slots: `generate_corpus`). Several hosts join through `jax.distributed`; see
``docs/parallel.md``.
"""

from jaxlod.parallel._shard import (
  data_parallel,
  generate,
  generate_corpus,
  local_shards,
  map_shards,
  replicate,
  shard_batch,
  unstack,
)

__all__ = [
  "data_parallel",
  "generate",
  "generate_corpus",
  "local_shards",
  "map_shards",
  "replicate",
  "shard_batch",
  "unstack",
]
