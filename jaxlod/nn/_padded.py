"""Between Flax's padded recurrent layout and LoDTensors, for the drop-in RNNs.

``flax.linen.RNN`` and ``flax.nnx.RNN`` take a padded array ``[*batch,
time, *features]`` (or ``[time, *batch, *features]`` with ``time_major``)
and per-sequence ``seq_lengths [*batch]``. `jaxlod.nn.RNN` and
`jaxlod.nn.nnx.RNN` take the same: `pack_padded` flattens the batch axes and
packs the real rows into a LoDTensor on static capacities, the padding-free
loop runs over it, and `unpack_padded` and `unbatch_carry` put the results back in
Flax's layout. Both twins call these functions; only how they hold the
cell differs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod._buckets import Buckets
from jaxlod._checks import (
  check_bools,
  check_callable,
  check_integer,
  is_concrete,
  leaf_name,
  nan_where,
  static_int,
  where_rows,
)
from jaxlod._faults import Fault
from jaxlod._host import as_array, check_leaves
from jaxlod._lod import LoDTensor, check_lod, is_lod
from jaxlod.nn._hoist import separable
from jaxlod.nn._layer_checks import check_rnn_layer, split_pair
from jaxlod.nn._recurrent import override, run_directions
from jaxlod.ops._loop._padded_scan import PaddedBatch, flip_real
from jaxlod.ops._loop._plan import LoopPlan, default_plan, plan_with_ladder
from jaxlod.ops._pad import sequence_pad, sequence_unpad, unpad_unchecked


class LoopSettings(NamedTuple):
  """The loop settings `run_cell` reads from a layer (see `DynamicRNN`)."""

  cell: Any
  reverse: bool
  return_carry: bool
  remat: bool
  ladder: Any
  plan: LoopPlan | None
  broadcast_rngs: Any = None  # NNX: the RNG streams every step draws alike


class Layout(NamedTuple):
  """Where a padded batch's rows came from, to put the results back.

  Attributes:
    batch: the batch shape ``(*batch)``.
    time: the length of the time axis.
    time_major: whether time was the first axis.
    features: the feature shape of one row.
    lengths: int32 ``[count]``, the flattened `seq_lengths`.
  """

  batch: tuple[int, ...]
  time: int
  time_major: bool
  features: tuple[int, ...]
  lengths: jax.Array

  @property
  def count(self) -> int:
    return math.prod(self.batch)


def feature_axes(cell: Any) -> int:
  """The cell's number of feature axes (Flax's ``num_feature_axes``; 1 for a
  cell without it)."""
  try:
    return static_int(cell.num_feature_axes, "cell.num_feature_axes", minimum=1)
  except (AttributeError, NotImplementedError):
    return 1


def unrolled(
  plan: LoopPlan | None, ladder: Any, unroll: Any, default: LoopPlan | None = None
) -> LoopPlan | None:
  """The plan of a drop-in RNN: `plan`, else `default` (a padded shape's,
  see `shape_plan`) with `ladder`, else `None` (the backend's at trace
  time); ``unroll`` > 1 sets `LoopPlan.chunk` (steps per iteration of the
  loop), 1 (Flax's default) keeps the plan's.

  Raises:
    TypeError, ValueError: for an `unroll` that is not an int >= 1.
  """
  unroll = static_int(unroll, "unroll", minimum=1)
  if plan is not None or ladder is not None:
    plan_with_ladder(plan, ladder)  # checks `plan`, and `plan` with `ladder`
  if unroll == 1 and default is None:
    return plan
  plan = plan_with_ladder(plan, ladder, default)
  return plan if unroll == 1 else dataclasses.replace(plan, chunk=unroll)


def shape_plan(cell: Any, shape: Layout) -> LoopPlan:
  """The plan a drop-in RNN given none runs a padded batch of `shape` under:
  `jaxlod.ops.default_plan` for its sequences and steps, without `hoist`
  for a cell that is not one of Flax's separable cells."""
  plan = default_plan(sequences=shape.count, time=shape.time)
  if plan.hoist and not separable(cell):
    plan = dataclasses.replace(plan, hoist=False)
  return plan


def check_buckets(buckets: Any) -> Buckets | None:
  if buckets is not None and not isinstance(buckets, Buckets):
    raise TypeError(
      f"Expected `buckets` to be a jaxlod.Buckets policy or None, got {buckets!r}."
    )
  return buckets


def layout(inputs: jax.Array, seq_lengths: Any, time_major: bool, axes: int) -> Layout:
  """The layout of a padded `inputs` with `axes` feature axes.

  Raises:
    TypeError: for non-integer `seq_lengths`.
    ValueError: for an `inputs` of rank below ``1 + axes``, `seq_lengths`
      whose shape is not the batch shape (time is not where `time_major`
      says), or eagerly a length outside ``[0, time]`` (under `jit` such a
      sequence's results are NaN: `nan_where_unsound`).
  """
  if inputs.ndim < 1 + axes:
    raise ValueError(
      f"Expected `inputs` to have shape [*batch, time, *features] with {axes} "
      f"feature axes (rank >= {1 + axes}), got {inputs.shape}."
    )
  time_axis = 0 if time_major else inputs.ndim - axes - 1
  time = inputs.shape[time_axis]
  first = 1 if time_major else 0
  batch = inputs.shape[first : inputs.ndim - axes - 1 + first]
  features = inputs.shape[inputs.ndim - axes :]
  where = f"axis {time_axis} of `inputs` {inputs.shape} with time_major={time_major}"
  if seq_lengths is None:
    lengths = jnp.full((math.prod(batch),), time, jnp.int32)
    return Layout(batch, time, time_major, features, lengths)
  seq_lengths = as_array(seq_lengths, "seq_lengths")
  check_integer(seq_lengths.dtype, "seq_lengths")
  if seq_lengths.shape != batch:
    raise ValueError(
      f"Expected `seq_lengths` to have the batch shape {batch} (time is {where}), "
      f"got shape {seq_lengths.shape}."
    )
  if is_concrete(seq_lengths):  # under `jit`, `nan_where_unsound`
    host = np.asarray(seq_lengths)
    bad = np.argwhere((host < 0) | (host > time))
    if bad.size:
      index = tuple(int(i) for i in bad[0])
      raise ValueError(
        f"Expected `seq_lengths` in [0, {time}] (the time axis, {where}), got "
        f"seq_lengths[{', '.join(map(str, index))}] = {host[index]}."
      )
  lengths = seq_lengths.reshape(-1).astype(jnp.int32)
  return Layout(batch, time, time_major, features, lengths)


def loop_input(x: Any) -> tuple[Any, int, tuple[int, ...], Any]:
  """A `DynamicRNN` body's input: a LoDTensor (checked) or a drop-in RNN's
  `PaddedBatch`, with its batch size, one row's feature shape and its
  dtype."""
  if isinstance(x, PaddedBatch):
    return x, x.values.shape[0], x.values.shape[2:], x.values.dtype
  x = check_lod(x, "x")
  return x, x.capacity.sequences[-1], x.feature_shape, x.values.dtype


def batch_rows(inputs: jax.Array, shape: Layout) -> jax.Array:
  """A padded `inputs` as ``[count, time, *features]``, the batch axes
  flattened and each sequence's rows first."""
  if shape.time_major:
    inputs = jnp.moveaxis(inputs, 0, len(shape.batch))
  return inputs.reshape(shape.count, shape.time, *shape.features)


def to_layout(padded: jax.Array, shape: Layout) -> jax.Array:
  """``padded [count, time, ...]`` in the layout of `shape`: ``[*batch,
  time, ...]``, or ``[time, *batch, ...]`` with its `time_major`."""
  padded = padded.reshape(*shape.batch, *padded.shape[1:])
  if shape.time_major:
    padded = jnp.moveaxis(padded, len(shape.batch), 0)
  return padded


def pack_padded(inputs: jax.Array, shape: Layout, buckets: Buckets | None) -> LoDTensor:
  """The real rows of a padded `inputs` as a one-level LoDTensor.

  The capacities are `buckets`' for the padded shape; `None` is
  ``Buckets.fixed(tokens=count * time, sequences=count, time=time)``, one
  compilation per padded shape whatever the lengths. Eagerly, the errors
  of `jaxlod.ops.sequence_unpad`. Under `jit`, no `checkify` check (an
  effect, which JAX dispatches on its slower path, a fixed cost per call
  that a small step feels): lengths outside ``[0, time]`` and a batch over
  `buckets` make the layer's results NaN instead (`nan_where_unsound`).
  """
  rows = batch_rows(inputs, shape)
  if is_concrete(shape.lengths):
    return sequence_unpad(rows, shape.lengths, capacity=buckets)
  return unpad_unchecked(rows, shape.lengths, buckets)


def batch_carry(carry: Any, shape: Layout, count_capacity: int) -> Any:
  """A carry of leaves ``[*batch, ...]`` as leaves ``[count_capacity, ...]``
  (the rows past the batch zero).

  Raises:
    ValueError: for a leaf whose leading dimensions are not the batch shape.
  """
  check_leaves(carry, "initial_carry")
  n = len(shape.batch)
  for path, leaf in jax.tree_util.tree_leaves_with_path(carry):
    if tuple(jnp.shape(leaf)[:n]) != shape.batch or jnp.ndim(leaf) < n:
      raise ValueError(
        f"Expected `initial_carry` leaf {leaf_name(path)} to have leading "
        f"dimensions {shape.batch} (the batch axes of `inputs`), got shape "
        f"{jnp.shape(leaf)}."
      )

  def flat(leaf: jax.Array) -> jax.Array:
    leaf = jnp.reshape(leaf, (shape.count, *jnp.shape(leaf)[n:]))
    pad = [(0, count_capacity - shape.count)] + [(0, 0)] * (leaf.ndim - 1)
    return jnp.pad(leaf, pad)

  return jax.tree.map(flat, carry)


def unbatch_carry(carry: Any, shape: Layout) -> Any:
  """A final carry of leaves ``[count_capacity, ...]`` as ``[*batch, ...]``."""

  def back(leaf: jax.Array) -> jax.Array:
    return leaf[: shape.count].reshape(*shape.batch, *leaf.shape[1:])

  return jax.tree.map(back, carry)


def unpack_padded(outputs: Any, shape: Layout, reverse: bool, keep_order: bool) -> Any:
  """The outputs over a packed batch in the padded layout of `shape`.

  Steps past each sequence's length are zero. With ``reverse`` and not
  ``keep_order`` each sequence's outputs come in the order computed (last
  input row first), as ``flax.linen.RNN`` returns them.
  """

  def back(out: LoDTensor) -> jax.Array:
    padded, _ = sequence_pad(out, 0, maxlen=shape.time)
    padded = padded[: shape.count]
    if reverse and not keep_order:
      padded = flip_real(padded, shape.lengths)
    return to_layout(padded, shape)

  return jax.tree.map(back, outputs, is_leaf=is_lod)


def check_no_lengths(seq_lengths: Any) -> None:
  """A LoDTensor carries its lengths: `seq_lengths` must be `None`."""
  if seq_lengths is not None:
    raise ValueError(
      "Expected `seq_lengths` to be None for a LoDTensor `inputs` (its LoD holds "
      f"the lengths), got {type(seq_lengths).__name__}."
    )


def run_padded(
  layer: Any,
  inputs: Any,
  initial_carry: Any,
  seq_lengths: Any,
  flags: dict[str, bool | None],
  run: Callable[[LoopSettings, LoDTensor, Any], Any],
  default_carry: Callable[[tuple[int, ...]], Any],
) -> Any:
  """The drop-in `RNN`'s call body, both twins: `inputs` padded (packed onto
  capacities, run, padded back) or a LoDTensor (run as `DynamicRNN`).

  Args:
    layer: the `RNN` (its `cell`, `remat`, `ladder`, `plan`, `unroll`,
      `buckets` and the attributes `flags` override).
    inputs, initial_carry, seq_lengths: the call's.
    flags: ``return_carry``, ``time_major``, ``reverse`` and ``keep_order``
      as called, `None` for the layer's.
    run: ``run(loop, x, carry)``, the twin's `DynamicRNN` body over a
      LoDTensor (``run_linen`` or ``run_nnx`` with the twin's key or RNGs).
    default_carry: ``default_carry(input_shape)``, the cell's initial carry
      for ``(*batch, *features)``.
  """
  return_carry, time_major, reverse, keep_order = override(layer, **flags)
  check_bools(
    return_carry=return_carry,
    time_major=time_major,
    reverse=reverse,
    keep_order=keep_order,
  )
  plan = unrolled(layer.plan, layer.ladder, layer.unroll)
  broadcast = getattr(layer, "broadcast_rngs", None)
  loop = LoopSettings(
    layer.cell, reverse, return_carry, layer.remat, layer.ladder, plan, broadcast
  )
  if is_lod(inputs):
    check_no_lengths(seq_lengths)
    return run(loop, inputs, initial_carry)
  buckets = check_buckets(layer.buckets)
  inputs = as_array(inputs, "inputs", "an array or a LoDTensor")
  shape = layout(inputs, seq_lengths, time_major, feature_axes(layer.cell))
  if initial_carry is None:
    initial_carry = default_carry((*shape.batch, *shape.features))
  if layer.plan is None:
    default = shape_plan(layer.cell, shape)
    plan = unrolled(None, layer.ladder, layer.unroll, default)
  loop = loop._replace(return_carry=True, plan=plan)
  if plan.padded:
    x = PaddedBatch(batch_rows(inputs, shape), shape.lengths)
    carry, outputs = run(loop, x, batch_carry(initial_carry, shape, shape.count))
    faults = jnp.zeros((), jnp.int32)
    if reverse and keep_order:
      outputs = jax.tree.map(lambda y: flip_real(y, shape.lengths), outputs)
    outputs = jax.tree.map(lambda y: to_layout(y, shape), outputs)
  else:
    x = pack_padded(inputs, shape, buckets)
    carry = batch_carry(initial_carry, shape, x.capacity.sequences[-1])
    carry, outputs = run(loop, x, carry)
    faults = x.faults
    outputs = unpack_padded(outputs, shape, reverse, keep_order)
  outputs = nan_where_unsound(outputs, faults, shape)
  carry = nan_where_unsound(unbatch_carry(carry, shape), faults, shape, time=False)
  return (carry, outputs) if return_carry else outputs


def nan_where_unsound(tree: Any, faults: Any, shape: Layout, time: bool = True) -> Any:
  """`tree`'s float leaves NaN at every sequence of the batch whose length
  is outside ``[0, time]``, and everywhere when the packing overflowed its
  capacities (`jaxlod.Fault.CAPACITY` in its `faults`).

  Eagerly such inputs raise; under `jit` this makes them loud instead of
  finite and wrong: the layer returns plain arrays, which carry no fault
  record, and checks nothing through `jax.experimental.checkify` (an
  effect: JAX would dispatch every call of a jitted step on its slower
  path). Leaves are ``[*batch, time, ...]`` (``[time, *batch, ...]`` with
  `time_major`) with `time`, and ``[*batch, ...]`` without.
  """
  lengths = shape.lengths
  bad = (lengths < 0) | (lengths > shape.time)
  bad = bad | ((jnp.asarray(faults) & int(Fault.CAPACITY)) != 0)
  bad = bad.reshape(shape.batch)
  if time:
    bad = bad[None] if shape.time_major else bad[..., None]

  return jax.tree.map(functools.partial(nan_where, bad), tree)


def zero_past(outputs: Any, seq_lengths: Any, time_major: bool) -> Any:
  """Padded outputs ``[*batch, time, ...]`` (``[time, *batch, ...]`` with
  `time_major`) with the steps past each of ``seq_lengths [*batch]`` zero."""
  if seq_lengths is None:
    return outputs
  lengths = jnp.asarray(seq_lengths)
  n = lengths.ndim

  def zero(out: jax.Array) -> jax.Array:
    time = out.shape[0 if time_major else n]
    if time_major:
      mask = jnp.arange(time).reshape((time,) + (1,) * n) < lengths[None]
    else:
      mask = jnp.arange(time) < lengths[..., None]
    # A negative length is NaN in its RNNs' outputs (`nan_where_unsound`);
    # zeros would hide it.
    mask = mask | ((lengths[None] if time_major else lengths[..., None]) < 0)
    return where_rows(mask, out, 0)

  return jax.tree.map(zero, outputs)


def takes_lengths(rnn: Any) -> bool:
  """Whether ``rnn(...)`` takes a ``seq_lengths`` keyword (a layer over padded
  arrays, as Flax's and `jaxlod.nn.RNN`; `DynamicRNN` takes LoDTensors)."""
  try:
    parameters = inspect.signature(rnn.__call__).parameters.values()
  except (TypeError, ValueError):  # no signature to read: let the call decide
    return True
  return any(
    p.name == "seq_lengths" or p.kind is inspect.Parameter.VAR_KEYWORD
    for p in parameters
  )


def run_bidirectional(
  layer: Any,
  inputs: Any,
  initial_carry: Any,
  seq_lengths: Any,
  flags: dict[str, bool | None],
  table: Any,
  keys: Any,
) -> Any:
  """`Bidirectional`'s call body, both twins: a LoDTensor `inputs` runs
  `run_directions`; a padded one runs ``layer.forward_rnn`` and
  ``layer.backward_rnn`` as ``flax.linen.Bidirectional`` calls them (each
  given `seq_lengths` and `time_major`, the backward one ``reverse=True,
  keep_order=True``), merges their outputs with ``layer.merge_fn``
  (default: concatenated on the last axis) and zeroes the steps past each
  length.

  Args:
    layer: the `Bidirectional`.
    inputs, initial_carry, seq_lengths, table: the call's.
    flags: ``return_carry`` and ``time_major`` as called, `None` for the
      layer's.
    keys: each direction's extra keyword arguments (its carry's RNGs).

  Raises:
    TypeError: for a padded `inputs` given to RNNs over LoDTensors (a
      `DynamicRNN`), or a non-bool flag.
    ValueError: for `seq_lengths` with a LoDTensor, or a `table` with a
      padded `inputs`.
  """
  return_carry, time_major = override(layer, **flags)
  check_bools(return_carry=return_carry, time_major=time_major)
  if is_lod(inputs):
    check_no_lengths(seq_lengths)
    return run_directions(layer, inputs, initial_carry, return_carry, table, keys)
  if table is not None:
    raise ValueError(
      "Expected `table` to be None for a padded `inputs` (a rank table orders a "
      f"LoDTensor's sequences), got {type(table).__name__}."
    )
  check_rnn_layer(layer.forward_rnn, "forward_rnn", layer)
  check_rnn_layer(layer.backward_rnn, "backward_rnn", layer)
  if layer.merge_fn is not None:
    check_callable(layer.merge_fn, "merge_fn")
  kind = type(inputs).__name__
  inputs = as_array(inputs, "inputs", "an array or a LoDTensor")
  for name in ("forward_rnn", "backward_rnn"):
    if not takes_lengths(getattr(layer, name)):
      raise TypeError(
        f"Expected `inputs` to be a LoDTensor: `{name}` is a "
        f"{type(getattr(layer, name)).__name__}, which takes LoDTensors, not "
        f"padded arrays with `seq_lengths` (jaxlod.nn.RNN takes both), got {kind}."
      )
  forward_carry, backward_carry = split_pair(initial_carry)
  common = dict(seq_lengths=seq_lengths, return_carry=True, time_major=time_major)
  forward_carry, forward = layer.forward_rnn(
    inputs, initial_carry=forward_carry, reverse=False, **keys[0], **common
  )
  backward_carry, backward = layer.backward_rnn(
    inputs,
    initial_carry=backward_carry,
    reverse=True,
    keep_order=True,
    **keys[1],
    **common,
  )

  def merge(f: jax.Array, b: jax.Array) -> jax.Array:
    if layer.merge_fn is None:
      return jnp.concatenate([f, b], axis=-1)
    return layer.merge_fn(f, b)

  outputs = jax.tree.map(merge, forward, backward)
  outputs = zero_past(outputs, seq_lengths, time_major)
  carry = (forward_carry, backward_carry)
  return (carry, outputs) if return_carry else outputs
