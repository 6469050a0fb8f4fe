"""NNX recurrent layers over LoDTensors: DynamicRNN, the Flax drop-in RNN over
padded arrays, and their combinators, the twins of `jaxlod.nn`'s."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from jaxlod import _checks
from jaxlod._buckets import Buckets
from jaxlod._host import check_leaves
from jaxlod._lod import LoDTensor, is_lod
from jaxlod.nn._hoist import separate_nnx
from jaxlod.nn._layer_checks import check_cell, check_layers, check_rnn_layer
from jaxlod.nn._padded import (
  check_buckets,
  loop_input,
  run_bidirectional,
  run_padded,
  unrolled,
)
from jaxlod.nn._recurrent import (
  loop_plan,
  min_gru_coefficients,
  rg_lru_coefficients,
  rg_lru_init,
  run_cell,
  run_levels,
  run_linear,
  run_stack,
  stack_rates,
)
from jaxlod.ops._loop._padded_scan import PaddedBatch
from jaxlod.ops._loop._plan import LoopPlan, plan_with_ladder
from jaxlod.ops._pool import check_pool_type
from jaxlod.ops._rank import RankTable, check_ladder, check_table


def functional_call(
  module: nnx.Module, method: str = "__call__", broadcast: Any = None
) -> Callable:
  """A pure function running ``module.<method>`` on a snapshot of its state.

  The module is split into its graph definition and state once; each call
  merges a fresh copy, so the function can be traced inside `dynamic_rnn`'s
  loop. The state's arrays are closed over, so gradients reach them under
  `nnx.grad` (or `jax.grad` of the split state).

  Args:
    module, method: what runs.
    broadcast: an NNX filter of RNG streams (``flax.nnx.RNN``'s
      `broadcast_rngs`) that every call may draw from: each call starts from
      the same snapshot of them, so every step draws the same keys (as
      ``flax.nnx.scan`` broadcasts them), and their updates are dropped.

  Raises:
    ValueError: (when called) if the method updates any other state, e.g.
      ``nnx.Dropout`` drawing from an RNG stream not in `broadcast` or
      ``nnx.BatchNorm`` updating its statistics: ``flax.nnx.RNN`` carries
      such updates from step to step over the padded time axis, which a
      padding-free loop cannot reproduce, and dropping them would reuse the
      same random key at every step.
  """
  graphdef, state = nnx.split(module)
  before = jax.tree.leaves(state)
  shared = nnx.All(nnx.RngState, broadcast)
  allowed = {
    jax.tree_util.keystr(path)
    for path, _ in jax.tree_util.tree_leaves_with_path(nnx.state(module, shared))
  }

  def call(*args, **kwargs):
    """``module.<method>(*args, **kwargs)`` on a fresh copy of the snapshot.

    Returns:
      The method's outputs.

    Raises:
      ValueError: if the method updated any state but the RNG streams of
        `broadcast`, naming the state it updated.
    """
    copy = nnx.merge(graphdef, state, copy=True)
    out = getattr(copy, method)(*args, **kwargs)
    after = jax.tree_util.tree_leaves_with_path(nnx.state(copy))
    changed = [
      name
      for i, (path, new) in enumerate(after)
      if (i >= len(before) or new is not before[i])
      and (name := jax.tree_util.keystr(path)) not in allowed
    ]
    if changed:
      raise ValueError(
        f"Expected {type(module).__name__}.{method} to leave its state unchanged "
        f"inside the loop, but it updates {', '.join(changed)}. The loop runs it "
        "once per real step, not over the padded time axis, so such updates "
        "cannot follow flax.nnx.RNN's: give an RNG stream drawn at every step "
        "to the RNN's `broadcast_rngs` (one key per call, every step drawing "
        "the same), apply dropout outside the recurrent layer (or with "
        "`deterministic=True`), and keep normalization statistics fixed."
      )
    return out

  return call


def initialize_carry(
  cell: nnx.Module, input_shape: tuple[int, ...], rngs: Any = None
) -> Any:
  """``cell.initialize_carry(input_shape, rngs)``, with ``nnx.Rngs(0)`` by default.

  Flax's cells draw their default (zero) carry from an RNG stream; a fixed
  one keeps the default carry deterministic and the module stateless.
  """
  check_cell(cell, "initialize_carry(input_shape, rngs)")
  return cell.initialize_carry(input_shape, nnx.Rngs(0) if rngs is None else rngs)


def run_nnx(
  layer: Any,
  x: LoDTensor | PaddedBatch,
  initial_carry: Any,
  rngs: nnx.Rngs | nnx.RngStream | None,
  reverse: bool | None,
  return_carry: bool | None,
  table: RankTable | None,
) -> Any:
  """`DynamicRNN`'s body: ``layer.cell`` over the last level of `x` with the
  layer's loop settings (`reverse`, `return_carry`, `remat`, `ladder`,
  `plan`); `RNN` calls it with a `LoopSettings`, and under a padded plan
  with its padded arrays as a `PaddedBatch`."""
  x, count, features, _ = loop_input(x)
  if initial_carry is None:
    initial_carry = initialize_carry(layer.cell, (count, *features), rngs)
  else:
    # `dynamic_rnn` checks the leading dimensions (naming `init_carry`).
    check_cell(layer.cell)
    check_leaves(initial_carry, "initial_carry")
  if loop_plan(layer).separates:
    cell = separate_nnx(layer.cell)
  else:
    cell = functional_call(layer.cell, broadcast=getattr(layer, "broadcast_rngs", None))
  return run_cell(layer, cell, x, initial_carry, reverse, return_carry, table)


class DynamicRNN(nnx.Module):
  """Runs an NNX recurrent cell over every sequence of a LoDTensor, padding-free.

  The NNX twin of `jaxlod.nn.DynamicRNN`, a thin layer over
  `jaxlod.ops.dynamic_rnn`: the cell is split into its graph definition and
  state and merged inside the loop's step, so its parameters are shared
  across steps and receive gradients under `nnx.grad`, `nnx.jit` and
  `nnx.Optimizer`. The cell lives under ``cell``, as in ``flax.nnx.RNN``:
  the same cell object can run in both and gives the same outputs at real
  positions. The cell runs functionally: state it updates inside the step
  (RNG counts, batch statistics) is not written back.

  Args:
    cell: an NNX recurrent cell (``nnx.LSTMCell``, ``nnx.OptimizedLSTMCell``,
      ``nnx.GRUCell``, ``nnx.SimpleCell``) or a user's cell with
      ``initialize_carry(input_shape, rngs)`` and ``__call__(carry, x) ->
      (carry, y)`` treating rows independently.
    reverse, return_carry, remat, ladder: as `jaxlod.nn.DynamicRNN`'s
      attributes.
    plan: how the loop runs, a `jaxlod.ops.LoopPlan`, as
      `jaxlod.nn.DynamicRNN`'s attribute: `None` for
      ``jaxlod.ops.default_plan()`` at trace time, `ladder` taking the
      place of its bodies. With ``hoist=True`` the cell must be one of
      Flax's separable cells (``nnx.LSTMCell``, ``nnx.OptimizedLSTMCell``,
      ``nnx.GRUCell``, ``nnx.SimpleCell``) whose Linear layers compute with
      Flax's defaults (``dtype`` and ``precision`` are honoured).

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import DynamicRNN
    >>> x = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((1, 2))], dtype="f4")
    >>> rnn = DynamicRNN(nnx.GRUCell(2, 4, rngs=nnx.Rngs(0)))
    >>> y = nnx.jit(lambda rnn, x: rnn(x))(rnn, x)
    >>> y.values.shape, y.recursive_lengths()
    ((4, 4), [[3, 1]])
  """

  def __init__(
    self,
    cell: nnx.Module,
    *,
    reverse: bool = False,
    return_carry: bool = False,
    remat: bool = False,
    ladder: Sequence[int] | None = None,
    plan: LoopPlan | None = None,
  ):
    check_cell(cell)
    _checks.check_bools(reverse=reverse, return_carry=return_carry, remat=remat)
    self.cell = cell
    self.reverse = reverse
    self.return_carry = return_carry
    self.remat = remat
    self.ladder = check_ladder(ladder)
    if plan is not None:  # a `LoopPlan`, not both with `ladder`
      plan_with_ladder(plan, self.ladder)
    self.plan = plan

  def __call__(
    self,
    x: LoDTensor,
    initial_carry: Any = None,
    *,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    reverse: bool | None = None,
    return_carry: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Runs the cell over the last level of `x`: as
    `jaxlod.nn.DynamicRNN.__call__`, with `rngs` (default ``nnx.Rngs(0)``)
    for the default carry's ``cell.initialize_carry((count_capacity,
    *features), rngs)`` in place of ``init_key``."""
    return run_nnx(self, x, initial_carry, rngs, reverse, return_carry, table)


def carry_stream(rngs: Any) -> Any:
  """The carry's RNG stream of ``flax.nnx.RNN``'s `rngs` argument: a fresh
  ``RngStream(0)`` for `True`, a fork of ``rngs.carry`` for an `nnx.Rngs`,
  `None` for `False`.

  Raises:
    ValueError: for anything else, as ``flax.nnx.RNN``.
  """
  if rngs is True:
    return nnx.RngStream(0, tag="carry")
  if isinstance(rngs, nnx.Rngs):
    return rngs.carry.fork()
  if rngs is False:
    return nnx.data(None)
  raise ValueError(f"Expected `rngs` to be an nnx.Rngs or a bool, got {rngs!r}.")


class RNN(nnx.Module):
  """``flax.nnx.RNN`` over padded arrays, run padding-free: change one import.

  The NNX twin of `jaxlod.nn.RNN`, with ``flax.nnx.RNN``'s arguments,
  defaults and return values: padded ``inputs [*batch, time, *features]``
  and ``seq_lengths [*batch]`` are packed into a LoDTensor on static
  capacities (`buckets`), the cell runs each sequence for exactly its own
  steps (`DynamicRNN`'s loop, the cell run functionally) and the outputs
  come back padded, zero past each length. The cell lives under ``cell``,
  as in ``flax.nnx.RNN``: the same cell object runs in both and gives the
  same outputs at real steps and the same final carries (a sequence of
  length 0 keeps its initial carry). A LoDTensor ``inputs`` runs as in
  `DynamicRNN`.

  Args:
    cell: an NNX recurrent cell (``nnx.LSTMCell``, ``nnx.OptimizedLSTMCell``,
      ``nnx.GRUCell``, ``nnx.SimpleCell``) or a user's cell with
      ``initialize_carry(input_shape, rngs)`` and ``__call__(carry, x) ->
      (carry, y)`` treating rows independently.
    time_major, return_carry, reverse, keep_order, unroll: as
      `jaxlod.nn.RNN`'s attributes.
    buckets, remat, ladder, plan: as `jaxlod.nn.RNN`'s attributes. Given
      no `plan`, a padded batch runs the plan `jaxlod.ops.default_plan`
      picks for its sequences and steps (on a CPU the hoisted ladder for
      small batches), a cell that cannot be hoisted unhoisted;
      ``LoopPlan(padded=True)`` runs the padded batch as Flax does, with
      no packing.
    state_axes: ``flax.nnx.scan``'s setting, accepted for compatibility
      and not read: the cell's state is shared by every step, and a cell
      that updates its state inside the loop raises, naming the cell and the
      state (Flax carries such updates over the padded time axis, which the
      padding-free loop does not run).
    broadcast_rngs: an NNX filter of the RNG streams the cell draws from at
      every step (recurrent dropout), as ``flax.nnx.RNN``'s: each call forks
      them once (``nnx.split_rngs``, the stream's count moving by one, as
      Flax's) and every step draws the same keys. The draws are shaped by
      the loop's rows, so the random bits differ from Flax's (same
      distribution, the same mask at every step of a sequence).
    rngs: the default carry's RNGs, as ``flax.nnx.RNN``'s: `True` (a stream
      of seed 0), an ``nnx.Rngs`` (its ``carry`` stream, forked) or
      `False` (none).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxlod.nn.nnx import RNN
    >>> rnn = RNN(nnx.GRUCell(3, 4, rngs=nnx.Rngs(0)))
    >>> y = rnn(jnp.ones((2, 5, 3)), seq_lengths=jnp.array([5, 2]))
    >>> y.shape, float(jnp.abs(y[1, 2:]).max())
    ((2, 5, 4), 0.0)
  """

  def __init__(
    self,
    cell: nnx.Module,
    *,
    time_major: bool = False,
    return_carry: bool = False,
    reverse: bool = False,
    keep_order: bool = False,
    unroll: int = 1,
    state_axes: Mapping[str, Any] | None = None,
    broadcast_rngs: Any = None,
    rngs: nnx.Rngs | nnx.RngStream | bool = True,
    buckets: Buckets | None = None,
    remat: bool = False,
    ladder: Sequence[int] | None = None,
    plan: LoopPlan | None = None,
  ):
    """Checks the arguments (see the class docstring) and keeps them, with
    the default carry's RNG stream taken from `rngs` (`carry_stream`).

    Raises:
      TypeError, ValueError: for a `cell` that is not callable, a flag that
        is not a bool, an `unroll` that is not an int >= 1, a bad `ladder`
        or `plan` (or a `ladder` with a plan that sets its `bodies`),
        `buckets` that is not a `Buckets`, or `rngs` that is neither an
        ``nnx.Rngs`` nor a bool.
    """
    check_cell(cell)
    _checks.check_bools(
      time_major=time_major,
      return_carry=return_carry,
      reverse=reverse,
      keep_order=keep_order,
      remat=remat,
    )
    self.cell = cell
    self.time_major = time_major
    self.return_carry = return_carry
    self.reverse = reverse
    self.keep_order = keep_order
    self.ladder = check_ladder(ladder)
    unrolled(plan, self.ladder, unroll)  # checks `unroll` and `plan`
    self.unroll = unroll
    self.state_axes = state_axes
    self.broadcast_rngs = broadcast_rngs
    self.rngs = carry_stream(rngs)
    self.buckets = check_buckets(buckets)
    self.remat = remat
    self.plan = plan

  def __call__(
    self,
    inputs: jax.typing.ArrayLike | LoDTensor,
    *,
    initial_carry: Any = None,
    seq_lengths: jax.typing.ArrayLike | None = None,
    return_carry: bool | None = None,
    time_major: bool | None = None,
    reverse: bool | None = None,
    keep_order: bool | None = None,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
  ) -> Any:
    """Runs the cell over every sequence of `inputs`: as
    `jaxlod.nn.RNN.__call__`, with `rngs` (default the layer's) for the
    default carry's ``cell.initialize_carry((*batch, *features), rngs)`` in
    place of ``init_key``."""
    flags = dict(
      return_carry=return_carry,
      time_major=time_major,
      reverse=reverse,
      keep_order=keep_order,
    )
    rngs = self.rngs if rngs is None else rngs
    if isinstance(rngs, nnx.Rngs):
      rngs = rngs.carry.fork()

    def run(loop, x, carry):
      if self.broadcast_rngs is None:
        return run_nnx(loop, x, carry, rngs, None, None, None)

      # As flax.nnx.RNN: the broadcast streams give one fresh key per call.
      @nnx.split_rngs(splits=1, only=self.broadcast_rngs, squeeze=True)
      def fork(cell):
        return run_nnx(loop._replace(cell=cell), x, carry, rngs, None, None, None)

      return fork(loop.cell)

    def default_carry(input_shape):
      return initialize_carry(self.cell, input_shape, rngs)

    return run_padded(
      self, inputs, initial_carry, seq_lengths, flags, run, default_carry
    )


class Bidirectional(nnx.Module):
  """Runs two recurrent layers over a LoDTensor, one in each direction.

  The NNX twin of `jaxlod.nn.Bidirectional`, over LoDTensors and, as a
  drop-in for ``flax.nnx.Bidirectional``, over padded arrays. The backward
  layer is called with ``reverse=True``: it runs each sequence from its own
  last row, so no padding leaks into either direction, and its outputs come
  back in the input's row order. Both outputs are merged row by row.

  Args:
    forward_rnn: a layer called as ``forward_rnn(x, initial_carry=, rngs=,
      reverse=False, return_carry=True) -> (carry, outputs)`` (and
      ``table=`` when the call is given one; ``seq_lengths=`` and
      ``time_major=`` for a padded `inputs`), e.g. a `DynamicRNN` or, for
      padded arrays, an `RNN`.
    backward_rnn: the same kind of layer, called with ``reverse=True`` (and
      ``keep_order=True`` for a padded `inputs`).
    merge_fn: ``merge_fn(forward [..., f], backward [..., g]) -> [..., h]``
      on the values; concatenation on the last axis by default. Rows past
      the last sequence (steps past each length) are set to zero after
      merging.
    time_major: a padded `inputs` is ``[time, *batch, *features]``.
    return_carry: also return the final carries.
    rngs: the RNGs passed to both layers for their default carries over a
      padded `inputs`, as ``flax.nnx.Bidirectional``'s: `True` (a stream of
      seed 0), an ``nnx.Rngs`` (its ``carry`` stream, forked), an
      ``nnx.RngStream``, or `False` (none: each layer's own).

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import Bidirectional, DynamicRNN
    >>> seqs = [np.ones((3, 2), np.float32), np.ones((1, 2), np.float32)]
    >>> x = LoDTensor.from_sequences(seqs)
    >>> rngs = nnx.Rngs(0)
    >>> layer = Bidirectional(
    ...   DynamicRNN(nnx.GRUCell(2, 4, rngs=rngs)),
    ...   DynamicRNN(nnx.GRUCell(2, 3, rngs=rngs)),
    ... )
    >>> layer(x).values.shape
    (4, 7)
  """

  def __init__(
    self,
    forward_rnn: nnx.Module,
    backward_rnn: nnx.Module,
    *,
    merge_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    time_major: bool = False,
    return_carry: bool = False,
    rngs: nnx.Rngs | nnx.RngStream | bool = True,
  ):
    """Checks the arguments (see the class docstring) and keeps them: an
    ``nnx.RngStream`` `rngs` as given, else its carry stream
    (`carry_stream`).

    Raises:
      TypeError, ValueError: for a layer that is not an NNX layer over
        LoDTensors, a `merge_fn` that is not callable, a flag that is not a
        bool, or `rngs` that is none of an ``nnx.Rngs``, an
        ``nnx.RngStream`` or a bool.
    """
    check_rnn_layer(forward_rnn, "forward_rnn", self)
    check_rnn_layer(backward_rnn, "backward_rnn", self)
    if merge_fn is not None:
      _checks.check_callable(merge_fn, "merge_fn")
    _checks.check_bools(time_major=time_major, return_carry=return_carry)
    self.forward_rnn = forward_rnn
    self.backward_rnn = backward_rnn
    self.merge_fn = merge_fn
    self.time_major = time_major
    self.return_carry = return_carry
    self.rngs = rngs if isinstance(rngs, nnx.RngStream) else carry_stream(rngs)

  def __call__(
    self,
    inputs: jax.typing.ArrayLike | LoDTensor,
    initial_carry: tuple[Any, Any] | None = None,
    *,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    seq_lengths: jax.typing.ArrayLike | None = None,
    return_carry: bool | None = None,
    time_major: bool | None = None,
    reverse: bool | None = None,
    keep_order: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Runs both directions over `inputs` and merges their outputs: as
    `jaxlod.nn.Bidirectional.__call__`, with `rngs` passed to both layers in
    place of ``init_key`` (an ``nnx.Rngs`` gives its ``carry`` stream). By
    default a padded `inputs` takes the layer's, as ``flax.nnx.Bidirectional``
    does, and a LoDTensor none (each layer initializes its carry as
    `DynamicRNN` does)."""
    del reverse, keep_order  # unused, as in flax.nnx.Bidirectional
    if rngs is None and not is_lod(inputs):
      rngs = self.rngs
    if isinstance(rngs, nnx.Rngs):
      rngs = rngs.carry
    keys = [{"rngs": rngs}] * 2
    flags = dict(return_carry=return_carry, time_major=time_major)
    return run_bidirectional(
      self, inputs, initial_carry, seq_lengths, flags, table, keys
    )


class StackedRNN(nnx.Module):
  """Layers of RNNs applied in turn, with dropout on the rows.

  The NNX twin of `jaxlod.nn.StackedRNN` (same rates, same order): the
  rows go through ``nnx.Dropout`` between two layers at `dropout_rate`,
  before the first at `input_dropout` and after the last at
  `output_dropout`, drawing from ``rngs.dropout`` when not deterministic.
  ``nnx.Module.train()`` and ``eval()`` switch `deterministic`.

  Args:
    layers: the layers, first to last, each ``layer(x) -> LoDTensor`` with
      `x`'s LoD (a `DynamicRNN`, a `Bidirectional`, ...).
    dropout_rate, input_dropout, output_dropout: dropout rates in ``[0,
      1]``.
    deterministic: no dropout (evaluation), unless the call overrides it.
    return_carry: also return each layer's final carry.
    rngs: the RNGs of the dropout masks (stream ``dropout``); `None` for
      deterministic use only.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import DynamicRNN, StackedRNN
    >>> x = LoDTensor.from_sequences([np.ones((3, 2), np.float32), np.ones((1, 2))])
    >>> rngs = nnx.Rngs(0)
    >>> cells = [nnx.LSTMCell(2, 4, rngs=rngs), nnx.LSTMCell(4, 4, rngs=rngs)]
    >>> rnn = StackedRNN([DynamicRNN(c) for c in cells], dropout_rate=0.5, rngs=rngs)
    >>> rnn(x, deterministic=False).values.shape
    (4, 4)
  """

  def __init__(
    self,
    layers: Sequence[nnx.Module],
    *,
    dropout_rate: float = 0.0,
    input_dropout: float = 0.0,
    output_dropout: float = 0.0,
    deterministic: bool = True,
    return_carry: bool = False,
    rngs: nnx.Rngs | None = None,
  ):
    check_layers(layers, self)
    rates = stack_rates(len(layers), input_dropout, dropout_rate, output_dropout)
    self.layers = nnx.List(layers)
    self.dropouts = nnx.List([nnx.Dropout(rate, rngs=rngs) for rate in rates])
    _checks.check_bools(deterministic=deterministic, return_carry=return_carry)
    self.deterministic = deterministic
    self.return_carry = return_carry

  def __call__(
    self,
    x: LoDTensor,
    *,
    deterministic: bool | None = None,
    return_carry: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Applies the layers in turn: as `jaxlod.nn.StackedRNN.__call__`, with
    ``deterministic=False`` drawing from ``rngs.dropout``."""
    return run_stack(self, x, deterministic, return_carry, table)


class HierarchicalEncoder(nnx.Module):
  """A nested RNN over a 2-level LoDTensor: inner RNN, pooling, outer RNN.

  The NNX twin of `jaxlod.nn.HierarchicalEncoder`: `inner` runs over each
  level-1 sequence, `jaxlod.ops.sequence_pool` turns each into one row and
  `outer` runs over the rows of each level-0 sequence.

  Args:
    inner: a layer ``inner(x, return_carry=False) -> LoDTensor``.
    outer: a layer ``outer(x, return_carry=...)`` over a 1-level LoDTensor.
    pool_type: the `jaxlod.ops.sequence_pool` type (default ``"last"``).
    return_carry: also return the outer layer's final carry.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import DynamicRNN, HierarchicalEncoder
    >>> x = LoDTensor.from_lengths(np.ones((6, 2), np.float32), [[2, 1], [3, 1, 2]])
    >>> rngs = nnx.Rngs(0)
    >>> inner = DynamicRNN(nnx.GRUCell(2, 4, rngs=rngs))
    >>> outer = DynamicRNN(nnx.GRUCell(4, 5, rngs=rngs))
    >>> y = HierarchicalEncoder(inner, outer)(x)
    >>> y.values.shape, y.recursive_lengths()
    ((3, 5), [[2, 1]])
  """

  def __init__(
    self,
    inner: nnx.Module,
    outer: nnx.Module,
    *,
    pool_type: str = "last",
    return_carry: bool = False,
  ):
    check_rnn_layer(inner, "inner", self)
    check_rnn_layer(outer, "outer", self)
    check_pool_type(pool_type)
    _checks.check_bool(return_carry, "return_carry")
    self.inner = inner
    self.outer = outer
    self.pool_type = pool_type
    self.return_carry = return_carry

  def __call__(self, x: LoDTensor, *, return_carry: bool | None = None) -> Any:
    """Encodes each level-1 sequence, then each level-0 sequence of them: as
    `jaxlod.nn.HierarchicalEncoder.__call__`."""
    return run_levels(self, x, return_carry)


class MinGRU(nnx.Module):
  """minGRU over the last level of a LoDTensor, as one parallel scan: the
  NNX twin of `jaxlod.nn.MinGRU`, with ``gates`` an ``nnx.Linear(
  in_features, 2 * features)``.

  Args:
    in_features: the width of the input rows.
    features, reverse, return_carry: as `jaxlod.nn.MinGRU`'s attributes.
    rngs: the initializers' RNGs.
  """

  def __init__(
    self,
    in_features: int,
    features: int,
    *,
    reverse: bool = False,
    return_carry: bool = False,
    rngs: nnx.Rngs,
  ):
    _checks.check_sizes(in_features=in_features, features=features)
    _checks.check_bools(reverse=reverse, return_carry=return_carry)
    self.features, self.reverse, self.return_carry = features, reverse, return_carry
    self.gates = nnx.Linear(in_features, 2 * features, rngs=rngs)

  def __call__(
    self,
    x: LoDTensor,
    initial_carry: Any = None,
    *,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    reverse: bool | None = None,
    return_carry: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Runs the recurrence over the last level of `x`: as
    `jaxlod.nn.MinGRU.__call__` (`rngs` unused, as Linen's `init_key`)."""
    del rngs
    check_table(table, optional=True)
    return run_linear(
      self, x, min_gru_coefficients, self.gates, initial_carry, reverse, return_carry
    )


class RGLRU(nnx.Module):
  """The RG-LRU over the last level of a LoDTensor, as one parallel scan:
  the NNX twin of `jaxlod.nn.RGLRU`, with ``gates`` an ``nnx.Linear(
  in_features, 3 * features)`` and ``a_param`` an ``nnx.Param``
  ``[features]``.

  Args:
    in_features: the width of the input rows.
    features, c, reverse, return_carry: as `jaxlod.nn.RGLRU`'s attributes.
    rngs: the initializers' RNGs.
  """

  def __init__(
    self,
    in_features: int,
    features: int,
    *,
    c: float = 8.0,
    reverse: bool = False,
    return_carry: bool = False,
    rngs: nnx.Rngs,
  ):
    _checks.check_sizes(in_features=in_features, features=features)
    _checks.check_bools(reverse=reverse, return_carry=return_carry)
    c = _checks.finite_float32(c, "c", positive=True)
    self.features, self.c = features, c
    self.reverse, self.return_carry = reverse, return_carry
    self.gates = nnx.Linear(in_features, 3 * features, rngs=rngs)
    self.a_param = nnx.Param(rg_lru_init(c)(rngs.params(), (features,)))

  def __call__(
    self,
    x: LoDTensor,
    initial_carry: Any = None,
    *,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    reverse: bool | None = None,
    return_carry: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Runs the recurrence over the last level of `x`: as
    `jaxlod.nn.RGLRU.__call__`."""
    del rngs
    check_table(table, optional=True)
    a_param = self.a_param[...]
    return run_linear(
      self,
      x,
      lambda g: rg_lru_coefficients(g, a_param, self.c),
      self.gates,
      initial_carry,
      reverse,
      return_carry,
    )
