"""Data parallelism over a mesh axis: placing stacked batches, running per device."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlod._checks import (
  check_bool,
  check_callable,
  check_integer,
  check_rank,
  check_sequence,
)
from jaxlod._host import as_array, check_leaves
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._vma import vary, varying_axes
from jaxlod.data._packing import Batch
from jaxlod.nn import _encoder_decoder
from jaxlod.nn._layer_checks import check_rngs
from jaxlod.nn._seq2seq import corpus_members, ensemble_generate
from jaxlod.ops._decode import DecodeSettings, check_settings
from jaxlod.ops._rank import check_table


def _check_axis(mesh: Any, axis: Any) -> None:
  if not isinstance(mesh, Mesh):
    raise TypeError(f"Expected `mesh` to be a jax.sharding.Mesh, got {mesh!r}.")
  if axis not in mesh.axis_names:
    raise ValueError(
      f"Expected `axis` to name an axis of `mesh`, got {axis!r}; the mesh has "
      f"axes {tuple(mesh.axis_names)}."
    )


def local_shards(mesh: Mesh, axis: str = "data") -> int:
  """The positions along `axis` whose devices belong to this process.

  A process puts this many shards on the mesh: with one process, the size
  of `axis`; with P processes over a 1-D mesh, ``size / P``.

  Raises:
    ValueError: if `mesh` has no axis `axis`.
  """
  _check_axis(mesh, axis)
  devices = np.asarray(mesh.devices)
  local = np.vectorize(lambda d: d.process_index == jax.process_index())(devices)
  along = mesh.axis_names.index(axis)
  others = tuple(i for i in range(local.ndim) if i != along)
  return int(np.any(local, axis=others).sum()) if others else int(local.sum())


def _leading(batch: Any, name: str = "batch") -> int:
  """The common leading (shard) dimension of every leaf of `batch`."""
  check_leaves(batch, name)
  paths = jax.tree_util.tree_leaves_with_path(batch)
  if not paths:
    raise ValueError(f"Expected `{name}` to hold at least one array, got none.")
  sizes = {}
  for path, leaf in paths:
    if np.ndim(leaf) == 0:
      raise ValueError(
        f"Expected every leaf of `{name}` to be stacked on a leading shard axis, "
        f"got a scalar at {jax.tree_util.keystr(path) or '(root)'}."
      )
    sizes.setdefault(int(np.shape(leaf)[0]), jax.tree_util.keystr(path))
  if len(sizes) > 1:
    described = ", ".join(f"{n} at {p or '(root)'}" for n, p in sizes.items())
    raise ValueError(
      f"Expected every leaf of `{name}` to have the same number of shards, got "
      f"{described}."
    )
  return next(iter(sizes))


def _digest(text: str) -> int:
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _check_same_across_processes(batch: Any) -> None:
  """Raises on every process when the processes' batches differ in shapes,
  dtypes or static structure (a LoD's time capacity, say).

  One small all-gather when they agree; a second one, for the message,
  when they do not (every process sees the same gathered digests, so all
  take the same path).
  """
  paths = jax.tree_util.tree_leaves_with_path(batch)
  dims = [d for _, leaf in paths for d in (np.ndim(leaf), *np.shape(leaf))]
  static = str(jax.tree.structure(batch)) + str([np.dtype(a.dtype) for _, a in paths])
  mine = np.asarray([_digest(static), _digest(str(dims)), len(dims)], np.int64)
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3)
  if (every == every[0]).all():
    return
  me = jax.process_index()
  other = int(np.flatnonzero((every != every[me]).any(axis=1))[0])
  if every[other, 0] != every[me, 0] or every[other, 2] != every[me, 2]:
    raise ValueError(
      f"Expected every process to put a batch of the same structure, dtypes "
      f"and static capacities (time capacities); process {me} and process "
      f"{other} differ. This process's batch: {jax.tree.structure(batch)}."
    )
  gathered = multihost_utils.process_allgather(np.asarray(dims, np.int64))
  theirs = np.asarray(gathered).reshape(-1, len(dims))[other].tolist()
  at = 0
  for path, leaf in paths:
    rank = np.ndim(leaf)
    shape = tuple(theirs[at + 1 : at + 1 + rank])
    if shape != np.shape(leaf):
      raise ValueError(
        f"Expected every process to put a batch of the same capacities; "
        f"{jax.tree_util.keystr(path) or '(root)'} has shape {np.shape(leaf)} "
        f"on process {me} and {shape} on process {other}."
      )
    at += 1 + rank


def shard_batch(batch: Any, mesh: Mesh, axis: str = "data") -> Any:
  """Puts a stacked batch on `mesh`, sharded along `axis`, from local data.

  Every leaf of `batch` is this process's shards stacked on a leading axis
  (a sharded `jaxlod.data.Batcher` builds such batches: ``values [L,
  token_capacity, *features]``, offsets ``[L, count_capacity + 1]``, counts
  ``[L]``); it becomes a global array ``[N, ...]`` with one shard per
  position of `axis` (`jax.make_array_from_process_local_data`), in one
  process or several alike. A `jaxlod.data.Batch` keeps its host fields
  (`indices`, `epoch`, ...) and has its `fields` and `tables` placed.

  Args:
    batch: a pytree of stacked LoDTensors, rank tables and arrays, each leaf
      ``[L, ...]`` with ``L = local_shards(mesh, axis)``; or a `Batch`.
    mesh: the device mesh.
    axis: the mesh axis the shards run along.

  Returns:
    `batch` with every leaf a global `jax.Array` ``[N, ...]`` sharded along
    `axis` (replicated along the mesh's other axes).

  Raises:
    ValueError: if `mesh` has no axis `axis`, the leaves disagree in their
      number of shards, that number is not this process's part of `axis`,
      or (with several processes) the processes' batches differ in shapes,
      that is in capacities; each message names both values.
  """
  _check_axis(mesh, axis)
  if isinstance(batch, Batch):
    fields, tables = shard_batch((batch.fields, batch.tables), mesh, axis)
    return batch._replace(fields=fields, tables=tables)
  shards = _leading(batch)
  expected = local_shards(mesh, axis)
  if shards != expected:
    where = (
      f"the size of mesh axis {axis!r}"
      if jax.process_count() == 1
      else f"this process's part of mesh axis {axis!r} of size {mesh.shape[axis]}"
    )
    raise ValueError(
      f"Expected a batch of {expected} shards ({where}), got {shards} shards."
    )
  if jax.process_count() > 1:
    _check_same_across_processes(batch)
  sharding = NamedSharding(mesh, P(axis))
  return jax.tree.map(
    lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), batch
  )


def replicate(tree: Any, mesh: Mesh) -> Any:
  """`tree`'s arrays as global arrays replicated over `mesh`.

  Each process gives its own copy (every process holds the same values, as
  parameters initialized from one seed do). Use it for the replicated
  arguments of a `data_parallel` step (parameters, optimizer state) before
  the first step.

  Raises:
    TypeError: if `mesh` is not a `jax.sharding.Mesh`.
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"Expected `mesh` to be a jax.sharding.Mesh, got {mesh!r}.")
  check_leaves(tree, "tree")
  sharding = NamedSharding(mesh, P())
  if jax.process_count() == 1:
    tree = jax.device_put(tree, sharding)
    if mesh.size == 1:
      # `device_put` gave a SingleDeviceSharding there, and a step whose
      # outputs are replicated over the mesh would compile again for them.
      tree = jax.jit(lambda t: t, out_shardings=sharding)(tree)
    return tree

  def put(leaf):
    if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(
      sharding, leaf.ndim
    ):
      return leaf
    return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

  return jax.tree.map(put, tree)


def _unstacked(batch: Any) -> Any:
  """A device's block ``[1, ...]`` of every leaf, without the shard axis."""
  return jax.tree.map(lambda a: a[0], batch)


def _check_one_shard_per_device(batch: Any, mesh: Mesh, axis: str) -> None:
  """`batch` holds one shard per position of `axis`: a device given several
  would compute on the first alone. Static shapes: raises at trace time."""
  shards = _leading(batch)
  size = mesh.shape[axis]
  if shards != size:
    raise ValueError(
      f"Expected `batch` to hold one shard per device along mesh axis {axis!r} "
      f"({size}), got {shards} shards on its leading axis; each device runs one "
      "shard. Build the batches with `Batcher(shards=local_shards(mesh))` and "
      "place them with `shard_batch`."
    )


def _check_stacked(x: Any, name: str, mesh: Mesh, axis: str) -> None:
  """`x` (a LoDTensor or a RankTable) holds one shard per device of `axis`."""
  size = mesh.shape[axis]
  if x.stack_shape != (size,):
    raise ValueError(
      f"Expected `{name}` to hold {size} shards stacked on leading axes "
      f"({size},), one per device along mesh axis {axis!r}, got leading axes "
      f"{x.stack_shape}. Place a `Batcher(shards=local_shards(mesh))` batch "
      "with `shard_batch`."
    )


def _per_device(fn, mesh, axis, check_vma, reduce_out, out_specs) -> Callable:
  def body(*args):
    *replicated, local = args
    if check_vma:  # each device differentiates its own copy (see docs)
      replicated = vary(replicated, frozenset({axis}))
    return reduce_out(fn(*replicated, _unstacked(local)))

  def run(*args):
    if not args:
      raise TypeError("Expected at least the stacked batch as an argument, got none.")
    _check_one_shard_per_device(args[-1], mesh, axis)
    in_specs = (*(P(),) * (len(args) - 1), P(axis))
    mapped = jax.shard_map(
      body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )
    return mapped(*args)

  return run


def _stack(out: Any) -> Any:
  return jax.tree.map(lambda a: a[None], out)


def data_parallel(
  fn: Callable, mesh: Mesh, axis: str = "data", *, check_vma: bool = True
) -> Callable:
  """Runs ``fn(*args, local)`` on every device and sums the outputs.

  The returned function takes replicated arguments (parameters, an
  optimizer state, a key) and, last, a batch placed by `shard_batch`. Under
  `jax.shard_map` each device calls `fn` on its own shard, an ordinary
  unstacked LoDTensor (or pytree of them) that every jaxlod op and layer
  accepts as is, and runs its own loops with its own trip counts; every
  output leaf is then summed over `axis` (`jax.lax.psum`) and comes back
  replicated. A token-weighted mean loss and its gradients are one
  `jax.value_and_grad` inside `fn` returning sums and token counts: N
  devices then give one device's result on the same examples.

  Each device differentiates its own copy of the replicated arguments: they
  are cast to vary over `axis` (``jax.lax.pcast(..., to="varying")``)
  before `fn` sees them, so their gradients are summed once, by the `psum`
  of the outputs, and never inside a loop. That is why this is `shard_map`
  and not a `jit` sharded over the batch: a `while_loop` there is one
  program for all devices, stepping until the slowest is done.

  Args:
    fn: ``fn(*args, local) -> outputs``, a pytree of arrays to sum.
    mesh: the device mesh.
    axis: the mesh axis of the batch's shards.
    check_vma: passed to `jax.shard_map`; both settings give the same
      results.

  Returns:
    ``run(*args, batch) -> outputs``, summed over the devices. Wrap it in
    `jax.jit`; it compiles once per capacity.

  Raises:
    ValueError: if `mesh` has no axis `axis`; from ``run`` (at trace time),
      for a batch whose number of shards is not the size of `axis` (a
      device given several shards would compute on one of them).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jaxlod import Buckets
    >>> from jaxlod.data import Batcher
    >>> from jaxlod.parallel import data_parallel, shard_batch
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> examples = [(np.ones(n, np.float32),) for n in (3, 1, 4, 2)]
    >>> batcher = Batcher(examples, Buckets.fixed(tokens=16, sequences=4, time=8),
    ...                   shards=1, shuffle=False)
    >>> batch = shard_batch(next(batcher.iterate()), mesh)
    >>> def total(w, fields):
    ...   (x,) = fields
    ...   return jnp.sum(x.values * w), x.num_rows
    >>> jax.jit(data_parallel(total, mesh))(jnp.float32(2.0), batch.fields)
    (Array(20., dtype=float32), Array(10, dtype=int32))
  """
  _check_axis(mesh, axis)
  check_callable(fn, "fn")
  check_bool(check_vma, "check_vma")

  def psum(out):
    if check_vma:  # a leaf that does not vary (a constant) counts once a device
      out = vary(out, frozenset({axis}) | varying_axes(out))
    return jax.lax.psum(out, axis)

  return _per_device(fn, mesh, axis, check_vma, psum, P())


def map_shards(
  fn: Callable, mesh: Mesh, axis: str = "data", *, check_vma: bool = True
) -> Callable:
  """Runs ``fn(*args, local)`` on every device and stacks the outputs.

  As `data_parallel`, but with no reduction: each output leaf comes back as
  a global array ``[N, ...]`` sharded along `axis`, row ``s`` from the
  device of shard ``s``. Decoding is the use: each device searches its own
  sources with its own early exit and compaction (see `generate`).

  Returns:
    ``run(*args, batch) -> outputs`` stacked on a leading shard axis; read
    them on the host with `unstack`.

  Raises:
    ValueError: as `data_parallel`.
  """
  _check_axis(mesh, axis)
  check_callable(fn, "fn")
  check_bool(check_vma, "check_vma")
  return _per_device(fn, mesh, axis, check_vma, _stack, P(axis))


def unstack(tree: Any) -> list[Any]:
  """The shards of a stacked pytree on the host, as a list of pytrees.

  Leaves ``[N, ...]`` (global arrays from `map_shards`, or NumPy) become N
  pytrees of NumPy leaves ``[...]``; LoDTensors stay LoDTensors. With
  several processes, every process gets every shard
  (`jax.experimental.multihost_utils.process_allgather`).
  """
  if jax.process_count() > 1:
    tree = multihost_utils.process_allgather(tree, tiled=True)
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return []
  shards = _leading(tree, "tree")
  arrays = [np.asarray(a) for a in leaves]
  return [jax.tree.unflatten(treedef, [a[s] for a in arrays]) for s in range(shards)]


@functools.partial(jax.jit, static_argnames=("models", "settings", "mesh", "axis"))
def _generate(variables, rngs, local, *, models, settings, mesh, axis):
  def decode(variables, rngs, local):
    members = list(zip(models, variables, strict=True))
    src, src_table, max_lengths = local
    if rngs is not None:  # each device draws from its own keys
      shard = jax.lax.axis_index(axis)
      rngs = {name: jax.random.fold_in(key, shard) for name, key in rngs.items()}
    return ensemble_generate(
      members,
      src,
      settings,
      max_lengths=max_lengths,
      src_table=src_table,
      rngs=rngs,
    )

  return map_shards(decode, mesh, axis)(variables, rngs, local)


def generate(
  members: Any,
  src: LoDTensor,
  mesh: Mesh,
  axis: str = "data",
  *,
  settings: DecodeSettings,
  src_table: Any = None,
  max_lengths: Any = None,
  rngs: dict[str, jax.Array] | None = None,
) -> list[Any]:
  """Decodes a sharded batch of sources, each device its own sources.

  `jaxlod.nn.ensemble_generate` (one member: `Seq2Seq.generate`) under
  `map_shards`: every device encodes and searches its shard with its own
  early exit and compaction, and the hypotheses come back to the host.

  Args:
    members: a ``(Seq2Seq, variables)`` pair, or a list of them.
    src: the stacked source ids placed by `shard_batch`: values ``[N,
      src_token_capacity]``.
    mesh: the device mesh.
    axis: the mesh axis of the shards.
    settings: the `jaxlod.ops.DecodeSettings` of the search.
    src_table: `src`'s stacked rank tables, or `None`.
    max_lengths: per-source limits stacked like `src`, int ``[N,
      count_capacity]`` (placed by `shard_batch`), each at most
      ``settings.max_length``; `None`: ``settings.max_length`` for all.
    rngs: RNG streams for layers that draw (see `ensemble_generate`), a
      dict of stream names to JAX keys; the device of shard ``s`` draws
      from each key folded with ``s``. `None`: no streams.

  Returns:
    One `jaxlod.ops.Hypotheses` per shard, in shard order, each in its
    shard's order of sources: concatenated, the sources come in the stacked
    batch's order (a sharded `Batch`'s `indices`). For example
    ``[h for hyps in out for h in hyps.ids.to_list()]`` lists every
    source's hypotheses.

  Raises:
    TypeError: for `rngs` that is not a dict of JAX keys.
    ValueError: as `ensemble_generate` does, and for a mesh without `axis`.
  """
  _check_axis(mesh, axis)
  _check_stacked(check_lod(src, "src", stacked=True), "src", mesh, axis)
  rngs = check_rngs(rngs)
  check_settings(settings)
  if check_table(src_table, "src_table", optional=True, stacked=True):
    _check_stacked(src_table, "src_table", mesh, axis)
  if max_lengths is not None:
    max_lengths = as_array(max_lengths, "max_lengths", "an array or None")
    check_integer(max_lengths.dtype, "max_lengths")
    check_rank(max_lengths.shape, "max_lengths", (2,), "[N, count_capacity]")
  one_pair = isinstance(members, tuple) and len(members) == 2
  if one_pair and not isinstance(members[0], tuple | list):
    members = [members]
  members = check_sequence(
    members, "members", "a (Seq2Seq, variables) pair or a list of them"
  )
  for k, pair in enumerate(members):
    if not (isinstance(pair, tuple) and len(pair) == 2):
      raise TypeError(
        f"Expected `members[{k}]` to be a (Seq2Seq, variables) pair, got "
        f"{type(pair).__name__}."
      )
  models = tuple(model for model, _ in members)
  variables = replicate([v for _, v in members], mesh)
  out = _generate(
    variables,
    None if rngs is None else replicate(rngs, mesh),
    (src, src_table, max_lengths),
    models=models,
    settings=settings,
    mesh=mesh,
    axis=axis,
  )
  return unstack(out)


def generate_corpus(
  members: Any,
  sources: Iterable,
  mesh: Mesh,
  axis: str = "data",
  *,
  settings: DecodeSettings,
  src_capacity: int,
  slots: int,
  max_length_fn: Callable[[np.ndarray], int] | None = None,
  refill: int | None = None,
  chunk: int = 4,
  stats: dict | None = None,
  rngs: dict[str, jax.Array] | None = None,
) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
  """Decodes a corpus with continuous refill, each device its own slots.

  `jaxlod.nn.ensemble_generate_corpus` (one member:
  `Seq2Seq.generate_corpus`) over the devices of `mesh`: every device keeps
  `slots` sources in flight and runs the search's chunks over them
  (`jax.shard_map`), and a slot freed on any device takes the next encoded
  source. Each source gets the hypotheses it gets on one device.

  Args:
    members: a ``(Seq2Seq, variables)`` pair, or a list of them.
    sources: an iterable of sources, each int ids ``[length]``, read as
      slots free up.
    mesh: a one-axis mesh of this process's devices.
    axis: its axis.
    settings, src_capacity, max_length_fn, refill, chunk, stats: as
      `Seq2Seq.generate_corpus`'s (`refill` sources encoded at once for all
      the devices).
    slots: the sources in flight on each device.
    rngs: RNG streams for layers that draw, as `ensemble_generate`'s; every
      device draws from the same keys, so a source's draws do not depend
      on the device that decodes it.

  Yields:
    Per source, in the corpus's order, ``(ids, scores)``, as
    `Seq2Seq.generate_corpus`.

  Raises:
    TypeError, ValueError: as `jaxlod.nn.ensemble_generate_corpus`, and for
      a mesh without `axis`, with other axes, or with devices of other
      processes.
  """
  _check_axis(mesh, axis)
  one_pair = isinstance(members, tuple) and len(members) == 2
  if one_pair and not isinstance(members[0], tuple | list):
    members = [members]
  rebuild, params, vocab = corpus_members(members, rngs)
  return _encoder_decoder.decode_members_corpus(
    rebuild,
    params,
    vocab,
    sources,
    settings,
    src_capacity=src_capacity,
    slots=slots,
    max_length_fn=max_length_fn,
    refill=refill,
    chunk=chunk,
    stats=stats,
    mesh=mesh,
    axis=axis,
  )
