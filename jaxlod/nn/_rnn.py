"""Linen recurrent layers over LoDTensors: DynamicRNN, the Flax drop-in RNN over
padded arrays, and their combinators."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from jaxlod._buckets import Buckets
from jaxlod._checks import check_sizes, finite_float32
from jaxlod._host import check_leaves
from jaxlod._lod import LoDTensor
from jaxlod.nn._hoist import separate_linen
from jaxlod.nn._layer_checks import check_cell, check_layers
from jaxlod.nn._padded import loop_input, run_bidirectional, run_padded
from jaxlod.nn._recurrent import (
  count_steps,
  example_row,
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
from jaxlod.ops._loop._plan import LoopPlan
from jaxlod.ops._rank import RankTable, check_table


def pure_method(module: nn.Module, method: str, *example: Any) -> Callable:
  """A bound module's `method` as a pure function over its variables.

  While initializing, the method is called once on `example` (one row) so
  that the parameters exist. The returned function applies an unbound copy
  to them, so `dynamic_rnn` can trace it inside its loop and send gradients
  to the parameters. The call's RNG streams but ``params`` (``dropout``,
  say) reach it as one key each, ``apply(*args, step=t)`` folding `t` into
  them; ``apply.streams`` names them (see `count_steps`).
  """
  if module.is_initializing():
    getattr(module, method)(*example)
  variables = module.variables
  unbound = module.clone(parent=None)
  streams = sorted(name for name in module.scope.rngs if name != "params")
  keys = {name: module.make_rng(name) for name in streams}

  def apply(*args: Any, step: jax.Array | None = None) -> Any:
    rngs = keys
    if step is not None:
      rngs = {name: jax.random.fold_in(key, step) for name, key in keys.items()}
    return unbound.apply(variables, *args, method=method, rngs=rngs)

  apply.streams = tuple(streams)
  return apply


def run_linen(
  layer: Any,
  x: LoDTensor | PaddedBatch,
  initial_carry: Any,
  init_key: jax.Array | None,
  reverse: bool | None,
  return_carry: bool | None,
  table: RankTable | None,
) -> Any:
  """`DynamicRNN`'s body: ``layer.cell`` over the last level of `x` with the
  layer's loop settings (`reverse`, `return_carry`, `remat`, `ladder`,
  `plan`); `RNN` calls it with a `LoopSettings`, and under a padded plan
  with its padded arrays as a `PaddedBatch`."""
  x, count, features, dtype = loop_input(x)
  if initial_carry is None:
    check_cell(layer.cell, "initialize_carry(rng, input_shape)")
    key = jax.random.key(0) if init_key is None else init_key
    initial_carry = layer.cell.initialize_carry(key, (count, *features))
  else:
    # `dynamic_rnn` checks the leading dimensions (naming `init_carry`).
    check_cell(layer.cell)
    check_leaves(initial_carry, "initial_carry")
  x_row = jnp.zeros((1, *features), dtype)
  first = example_row(initial_carry)
  if loop_plan(layer).separates:
    step, unwrap = separate_linen(layer.cell, first, x_row), lambda final: final
  else:
    step = pure_method(layer.cell, "__call__", first, x_row)
    step, initial_carry, unwrap = count_steps(step, initial_carry)
  out = run_cell(layer, step, x, initial_carry, reverse, return_carry, table)
  return (unwrap(out[0]), out[1]) if isinstance(out, tuple) else out


class DynamicRNN(nn.Module):
  """Runs a Flax recurrent cell over every sequence of a LoDTensor, padding-free.

  A thin layer over `jaxlod.ops.dynamic_rnn`: the cell's parameters are
  shared across steps and live under ``cell``, the same tree as
  ``flax.linen.RNN(cell)``, so weights move between the two. It runs over the
  last LoD level of its input (a 2-level input runs over the level-1
  sequences; see `HierarchicalEncoder`). Where ``flax.linen.RNN`` with
  ``seq_lengths`` runs every row to the padded length, this runs each
  sequence for exactly its own steps: the outputs at real rows and the final
  carries are the same, and an empty sequence keeps its initial carry.

  Attributes:
    cell: any Flax recurrent cell (``nn.LSTMCell``, ``nn.OptimizedLSTMCell``,
      ``nn.GRUCell``, ``nn.SimpleCell``, ``nn.MGUCell``, or a user's cell
      with ``initialize_carry(rng, input_shape)`` and ``__call__(carry, x) ->
      (carry, y)``).
    reverse: run each sequence from its own last row to its first.
    return_carry: also return the final carry.
    remat: recompute steps in the backward pass (see `dynamic_rnn`).
    ladder: static batch sizes of the loop's phases (see `rank_table`);
      `None`: the rank table's, by default `default_ladder`. Fewer sizes
      compile faster; more sizes waste fewer rows.
    plan: how the loop runs, a `jaxlod.ops.LoopPlan` (see `dynamic_rnn`).
      `None`: ``jaxlod.ops.default_plan()`` at trace time, with `ladder`,
      when given, taking the place of its bodies. A plan with `bodies` set
      conflicts with `ladder`. With ``hoist=True`` the cell must be one of
      Flax's separable cells (``nn.LSTMCell``, ``nn.OptimizedLSTMCell``,
      ``nn.GRUCell``, ``nn.SimpleCell``, ``nn.MGUCell``): the input
      projection of all rows is one product before the loop and the
      recurrent kernel's gradient one product after it, on the same
      parameters.

  Example:
    >>> import numpy as np, jax, flax.linen as nn
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import DynamicRNN
    >>> x = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((1, 2))])
    >>> rnn = DynamicRNN(nn.GRUCell(4))
    >>> params = rnn.init(jax.random.key(0), x)
    >>> y = rnn.apply(params, x)
    >>> y.values.shape, y.recursive_lengths()
    ((4, 4), [[3, 1]])
  """

  cell: nn.Module
  reverse: bool = False
  return_carry: bool = False
  remat: bool = False
  ladder: Sequence[int] | None = None
  plan: LoopPlan | None = None

  def __call__(
    self,
    x: LoDTensor,
    initial_carry: Any = None,
    *,
    init_key: jax.Array | None = None,
    reverse: bool | None = None,
    return_carry: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Runs the cell over the last level of `x`.

    Args:
      x: a LoDTensor ``values [token_capacity, *features]``.
      initial_carry: a carry whose leaves are ``[count_capacity, ...]`` in
        `x`'s order; by default ``cell.initialize_carry(init_key, (count,
        *features))``.
      init_key: the key for `initialize_carry` (default ``key(0)``; most
        cells ignore it).
      reverse: overrides the attribute (`Bidirectional` uses it).
      return_carry: overrides the attribute.
      table: `x`'s rank table, e.g. built on the host by `jaxlod.data`
        beside the batch; `None`: built here (see `dynamic_rnn`).

    Returns:
      The outputs, a LoDTensor with `x`'s LoD (padding rows zero); with
      `return_carry`, the pair ``(final_carry, outputs)`` as
      ``flax.linen.RNN`` returns it, the carry in `x`'s order.

    Raises:
      TypeError: if `x` is not a LoDTensor, `initial_carry` is `None` and
        the cell has no `initialize_carry`, `plan` is not a `LoopPlan`, or
        `plan` hoists and the cell is not one of Flax's separable cells.
      ValueError: from `dynamic_rnn`, e.g. for an `initial_carry` whose
        leading dimension is not the count capacity, a `table` of other
        lengths, a `table` whose ladder is not `ladder`, or both `ladder`
        and a `plan` with `bodies`.
    """
    return run_linen(self, x, initial_carry, init_key, reverse, return_carry, table)


class RNN(nn.Module):
  """``flax.linen.RNN`` over padded arrays, run padding-free: change one import.

  Takes ``flax.linen.RNN``'s attributes and call with the same defaults and
  return values. A padded ``inputs [*batch, time, *features]`` (``[time,
  *batch, *features]`` with `time_major`) and ``seq_lengths [*batch]`` are
  packed into a LoDTensor on static capacities (`buckets`), the cell runs
  each sequence for exactly its own steps (`DynamicRNN`'s loop), and the
  outputs come back in the padded layout. The parameters live under
  ``cell``, the tree of ``flax.linen.RNN(cell)``, so weights move between
  the two. A LoDTensor ``inputs`` runs as in `DynamicRNN` (no
  `seq_lengths`; reversed outputs in its row order) and gives a LoDTensor.

  Where the results differ from ``flax.linen.RNN``'s:

  * steps past a sequence's length are zero in the outputs (Flax runs the
    cell over the padding and returns what it computes there);
  * a sequence of length 0 returns its initial carry (Flax's returns the
    carry at the last padded step).

  The outputs at real steps and the other final carries are Flax's.

  Attributes:
    cell: a Flax recurrent cell (``nn.LSTMCell``, ``nn.OptimizedLSTMCell``,
      ``nn.GRUCell``, ``nn.SimpleCell``, ``nn.MGUCell`` or a user's cell
      with ``initialize_carry(rng, input_shape)``, ``__call__(carry, x) ->
      (carry, y)`` treating rows independently, and optionally
      ``num_feature_axes``, default 1).
    time_major: `inputs` is ``[time, *batch, *features]``.
    return_carry: also return the final carry, ``(carry, outputs)``.
    reverse: run each sequence from its last real step to its first.
    keep_order: with `reverse`, return the outputs in the input's order;
      otherwise (default) in the order computed, each sequence's real
      steps reversed and its padding kept at the end, as Flax does.
    unroll: steps per iteration of the padding-free while loop
      (`jaxlod.ops.LoopPlan.chunk`): ``k > 1`` runs chunks of ``k`` steps
      per host round trip; 1 (the default) keeps `plan`'s chunk (the
      backend's, see `jaxlod.ops.default_plan`).
    variable_axes, variable_broadcast, variable_carry, split_rngs:
      ``flax.linen.scan``'s settings, accepted for compatibility. The cell
      runs as with Flax's defaults whatever they hold: its variables are
      shared by every step (``params`` broadcast), nothing is carried from
      step to step but the carry, and RNG streams other than ``params``
      (``dropout``) draw afresh at every step.
    buckets: the capacity policy of the packed batch, a `jaxlod.Buckets`;
      `None` (default): the padded shape's, ``Buckets.fixed(tokens=count *
      time, sequences=count, time=time)`` with ``count`` the product of the
      batch axes, so a jitted caller compiles once per padded shape
      whatever the lengths.
    remat, ladder, plan: as `DynamicRNN`'s. Given no `plan`, a padded
      batch runs the plan `jaxlod.ops.default_plan` picks for its sequences
      and steps (on a CPU the hoisted ladder for small batches), a cell
      that cannot be hoisted unhoisted; ``LoopPlan(padded=True)`` runs the
      padded batch as Flax does, with no packing.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jaxlod.nn import RNN
    >>> x = jnp.ones((2, 5, 3))  # (batch, time, features)
    >>> rnn = RNN(nn.LSTMCell(4), return_carry=True)
    >>> lengths = jnp.array([5, 2])
    >>> params = rnn.init(jax.random.key(0), x, seq_lengths=lengths)
    >>> (c, h), y = rnn.apply(params, x, seq_lengths=lengths)
    >>> y.shape, h.shape, float(jnp.abs(y[1, 2:]).max())
    ((2, 5, 4), (2, 4), 0.0)
  """

  cell: nn.Module
  time_major: bool = False
  return_carry: bool = False
  reverse: bool = False
  keep_order: bool = False
  unroll: int = 1
  variable_axes: Mapping[Any, Any] = FrozenDict()
  variable_broadcast: Any = "params"
  variable_carry: Any = False
  split_rngs: Mapping[Any, bool] = FrozenDict({"params": False})
  buckets: Buckets | None = None
  remat: bool = False
  ladder: Sequence[int] | None = None
  plan: LoopPlan | None = None

  def __call__(
    self,
    inputs: jax.typing.ArrayLike | LoDTensor,
    *,
    initial_carry: Any = None,
    init_key: jax.Array | None = None,
    seq_lengths: jax.typing.ArrayLike | None = None,
    return_carry: bool | None = None,
    time_major: bool | None = None,
    reverse: bool | None = None,
    keep_order: bool | None = None,
  ) -> Any:
    """Runs the cell over every sequence of `inputs`.

    Args:
      inputs: ``[*batch, time, *features]`` (``[time, *batch, *features]``
        with `time_major`), or a LoDTensor ``values [token_capacity,
        *features]``.
      initial_carry: a carry whose leaves are ``[*batch, ...]`` (``[count_capacity,
        ...]`` for a LoDTensor); by default ``cell.initialize_carry(init_key,
        (*batch, *features))``.
      init_key: the key for `initialize_carry` (default ``key(0)``).
      seq_lengths: int ``[*batch]``, each sequence's length in ``[0,
        time]``; `None`: every sequence is the whole time axis.
      return_carry, time_major, reverse, keep_order: override the
        attributes.

    Returns:
      The outputs ``[*batch, time, *out]`` (time first with `time_major`),
      zero past each length; with `return_carry`, ``(carry, outputs)``, the
      carry's leaves ``[*batch, ...]``, each sequence's own final carry.

    Raises:
      TypeError: for `inputs` that is not an array or a LoDTensor,
        non-integer `seq_lengths`, a non-bool flag, or a `buckets` that is
        not a `jaxlod.Buckets`.
      ValueError: for `seq_lengths` with a LoDTensor, `seq_lengths` whose
        shape is not the batch shape (time is not where `time_major` says),
        an `initial_carry` leaf whose leading dimensions are not the batch
        shape, or eagerly a length outside ``[0, time]`` (under `jit`,
        that sequence's outputs and carry are NaN; the layer adds no
        `jax.experimental.checkify` check, an effect that would make JAX
        dispatch every call of a jitted step on its slower path).
    """
    flags = dict(
      return_carry=return_carry,
      time_major=time_major,
      reverse=reverse,
      keep_order=keep_order,
    )

    def run(loop, x, carry):
      return run_linen(loop, x, carry, init_key, None, None, None)

    def default_carry(input_shape):
      check_cell(self.cell, "initialize_carry(rng, input_shape)")
      key = jax.random.key(0) if init_key is None else init_key
      return self.cell.initialize_carry(key, input_shape)

    return run_padded(
      self, inputs, initial_carry, seq_lengths, flags, run, default_carry
    )


class Bidirectional(nn.Module):
  """Runs one RNN forward and one backward over each sequence; merges the rows.

  ``flax.linen.Bidirectional`` over LoDTensors, and over Flax's padded
  arrays as a drop-in. The backward RNN is called with ``reverse=True``, so
  it runs each sequence from its own last row: no padding reaches either
  direction, and its outputs come back in the input's row order, aligned
  with the forward ones. Parameters live under ``forward_rnn`` and
  ``backward_rnn``, the tree of ``flax.linen.Bidirectional``; passing the
  same module twice shares them.

  A padded ``inputs [*batch, time, *features]`` goes to both RNNs as
  ``flax.linen.Bidirectional`` passes it, with `seq_lengths` and
  `time_major` (the backward one also ``keep_order=True``), so with
  `jaxlod.nn.RNN` layers it runs padding-free; the merged outputs are zero
  past each length.

  Attributes:
    forward_rnn: a module called as ``rnn(x, initial_carry=, init_key=,
      reverse=False, return_carry=True) -> (carry, outputs)`` (and
      ``table=`` when the call is given one; ``seq_lengths=`` and
      ``time_major=`` for a padded `inputs`), e.g. a `DynamicRNN` or, for
      padded arrays, an `RNN`.
    backward_rnn: the same kind of module, called with ``reverse=True``
      (and ``keep_order=True`` for a padded `inputs`).
    merge_fn: ``merge_fn(forward [..., f], backward [..., g]) -> [..., h]``
      on the rows (or the padded outputs); ``None`` (default) concatenates
      on the last axis, as Flax's default does.
    time_major: a padded `inputs` is ``[time, *batch, *features]``.
    return_carry: also return the final carries ``(forward, backward)``.

  Example:
    >>> import numpy as np, jax, flax.linen as nn
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import Bidirectional, DynamicRNN
    >>> x = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((1, 2))])
    >>> birnn = Bidirectional(DynamicRNN(nn.GRUCell(4)), DynamicRNN(nn.GRUCell(4)))
    >>> params = birnn.init(jax.random.key(0), x)
    >>> y = birnn.apply(params, x)
    >>> y.values.shape, y.recursive_lengths()
    ((4, 8), [[3, 1]])

    Padded, as ``flax.linen.Bidirectional``:

    >>> import jax.numpy as jnp
    >>> from jaxlod.nn import RNN
    >>> birnn = Bidirectional(RNN(nn.GRUCell(4)), RNN(nn.GRUCell(4)))
    >>> xs, lengths = jnp.ones((2, 5, 2)), jnp.array([5, 3])
    >>> params = birnn.init(jax.random.key(0), xs, seq_lengths=lengths)
    >>> birnn.apply(params, xs, seq_lengths=lengths).shape
    (2, 5, 8)
  """

  forward_rnn: nn.Module
  backward_rnn: nn.Module
  merge_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None
  time_major: bool = False
  return_carry: bool = False

  def __call__(
    self,
    inputs: jax.typing.ArrayLike | LoDTensor,
    initial_carry: tuple[Any, Any] | None = None,
    *,
    init_key: jax.Array | None = None,
    seq_lengths: jax.typing.ArrayLike | None = None,
    return_carry: bool | None = None,
    time_major: bool | None = None,
    reverse: bool | None = None,
    keep_order: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Runs both directions over `inputs` and merges their outputs.

    Args:
      inputs: a LoDTensor ``values [token_capacity, *features]`` (the last
        level's sequences), or a padded ``[*batch, time, *features]``
        (``[time, *batch, *features]`` with `time_major`).
      initial_carry: a pair ``(forward, backward)`` of carries whose leaves
        are ``[count_capacity, ...]`` in `inputs`' order (``[*batch, ...]``
        for a padded `inputs`); by default each RNN initializes its own.
      init_key: split in two, one key per direction, for the RNNs'
        `initialize_carry`.
      seq_lengths: a padded `inputs`' int ``[*batch]`` lengths, given to both
        RNNs; `None`: the whole time axis (for a LoDTensor, must be `None`).
      return_carry, time_major: override the attributes.
      reverse, keep_order: accepted and unused, as in
        ``flax.linen.Bidirectional``.
      table: a LoDTensor `inputs`' rank table, given to both RNNs as
        ``table=`` (both directions rank the same lengths); `None`: not
        passed.

    Returns:
      The merged outputs: a LoDTensor with `inputs`' LoD (padding rows zero),
      or padded ``[*batch, time, *h]`` (zero past each length); with
      `return_carry`, ``((forward_carry, backward_carry), outputs)``.

    Raises:
      TypeError: if `initial_carry` is not a pair, or `inputs` is neither an
        array nor a LoDTensor.
      ValueError: for `seq_lengths` with a LoDTensor or `table` with a padded
        `inputs`.
    """
    del reverse, keep_order  # unused, as in flax.linen.Bidirectional
    keys = (None, None) if init_key is None else jax.random.split(init_key)
    keys = [{"init_key": key} for key in keys]
    flags = dict(return_carry=return_carry, time_major=time_major)
    return run_bidirectional(
      self, inputs, initial_carry, seq_lengths, flags, table, keys
    )


class StackedRNN(nn.Module):
  """Layers of RNNs applied in turn, with dropout on the rows.

  A multi-layer RNN over LoDTensors: each layer is any module taking a
  LoDTensor to a LoDTensor with the same LoD (a `DynamicRNN`, a
  `Bidirectional`, ...). The rows go through ``flax.linen.Dropout`` (the
  ``'dropout'`` rng, when not deterministic) between two layers at
  `dropout_rate`, before the first at `input_dropout` and after the last at
  `output_dropout`. Dropout keeps zero rows zero, so padding rows stay
  zero. Parameters live under ``layers_0``, ``layers_1``, ...

  Attributes:
    layers: the layers, first to last.
    dropout_rate: the probability of dropping a value between layers, in
      ``[0, 1]``.
    input_dropout: the same before the first layer.
    output_dropout: the same after the last layer.
    deterministic: no dropout (evaluation), unless the call overrides it.
    return_carry: also return each layer's final carry (every layer must then
      accept ``return_carry=True`` and return ``(carry, outputs)``).

  Example:
    >>> import numpy as np, jax, flax.linen as nn
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import DynamicRNN, StackedRNN
    >>> x = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((1, 2))])
    >>> rnn = StackedRNN(
    ...   [DynamicRNN(nn.LSTMCell(4)), DynamicRNN(nn.LSTMCell(4))], dropout_rate=0.5
    ... )
    >>> params = rnn.init(jax.random.key(0), x)
    >>> rngs = {"dropout": jax.random.key(1)}
    >>> y = rnn.apply(params, x, deterministic=False, rngs=rngs)
    >>> y.values.shape
    (4, 4)
  """

  layers: Sequence[nn.Module]
  dropout_rate: float = 0.0
  input_dropout: float = 0.0
  output_dropout: float = 0.0
  deterministic: bool = True
  return_carry: bool = False

  def setup(self):
    check_layers(self.layers, self)
    rates = stack_rates(
      len(self.layers), self.input_dropout, self.dropout_rate, self.output_dropout
    )
    self.dropouts = [nn.Dropout(rate) for rate in rates]

  def __call__(
    self,
    x: LoDTensor,
    *,
    deterministic: bool | None = None,
    return_carry: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Applies the layers in turn.

    Args:
      x: a LoDTensor ``values [token_capacity, *features]``.
      deterministic: overrides the attribute; `False` applies dropout
        (needs the ``'dropout'`` rng).
      return_carry: overrides the attribute.
      table: `x`'s rank table, given to every layer as ``table=`` (all
        layers rank the same lengths); `None`: not passed.

    Returns:
      The last layer's outputs, a LoDTensor with `x`'s LoD; with
      `return_carry`, ``(carries, outputs)`` where `carries` holds each
      layer's final carry, first layer first.

    Raises:
      TypeError: if `x` or a layer's output is not a LoDTensor.
    """
    return run_stack(self, x, deterministic, return_carry, table)


class HierarchicalEncoder(nn.Module):
  """A nested RNN over a 2-level LoDTensor: inner RNN, pooling, outer RNN.

  Fluid's nested RNN (the RNNOp design's 2-level LoD), level by level: `inner`
  runs over each level-1 sequence (e.g. the words of a sentence),
  `jaxlod.ops.sequence_pool` turns each into one row (an empty one gives
  zeros), and `outer` runs over the rows of each level-0 sequence (the
  sentences of a paragraph). Parameters live under ``inner`` and ``outer``.

  With a `Bidirectional` inner RNN, ``"last"`` pools the backward direction
  after its first step only; ``"average"`` or ``"max"`` see both directions
  whole.

  Attributes:
    inner: a module ``inner(x, return_carry=False) -> LoDTensor`` over the
      last level, e.g. a `DynamicRNN` or a `Bidirectional`.
    outer: a module ``outer(x, return_carry=...)`` over a 1-level LoDTensor,
      e.g. a `DynamicRNN`.
    pool_type: the `jaxlod.ops.sequence_pool` type: ``"sum"``,
      ``"average"``, ``"sqrt"``, ``"max"``, ``"min"``, ``"first"`` or
      ``"last"`` (default).
    return_carry: also return the outer RNN's final carry.

  Example:
    >>> import numpy as np, jax, flax.linen as nn
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import DynamicRNN, HierarchicalEncoder
    >>> words = np.ones((6, 2))  # 2 paragraphs: 2 sentences, then 1
    >>> x = LoDTensor.from_lengths(words, [[2, 1], [3, 1, 2]])
    >>> inner, outer = DynamicRNN(nn.GRUCell(4)), DynamicRNN(nn.GRUCell(5))
    >>> encoder = HierarchicalEncoder(inner, outer)
    >>> y, params = encoder.init_with_output(jax.random.key(0), x)
    >>> y.values.shape, y.recursive_lengths()
    ((3, 5), [[2, 1]])
  """

  inner: nn.Module
  outer: nn.Module
  pool_type: str = "last"
  return_carry: bool = False

  def __call__(self, x: LoDTensor, *, return_carry: bool | None = None) -> Any:
    """Encodes each level-1 sequence, then each level-0 sequence of them.

    Args:
      x: a 2-level LoDTensor ``values [token_capacity, *features]``.
      return_carry: overrides the attribute.

    Returns:
      The outer outputs, a 1-level LoDTensor with `x`'s level 0 as its LoD,
      one row per level-1 sequence (``values [level-1 count capacity,
      *outer_features]``); with `return_carry`, ``(outer_carry, outputs)``.

    Raises:
      TypeError: if `x` is not a LoDTensor.
      ValueError: if `x` does not have 2 LoD levels, or for an unknown
        `pool_type`.
    """
    return run_levels(self, x, return_carry)


class MinGRU(nn.Module):
  """minGRU (Feng et al. 2024, "Were RNNs All We Needed?") over the last
  level of a LoDTensor, as one parallel scan.

  ``z_t = sigmoid(W_z x_t + b_z)``, ``h~_t = W_h x_t + b_h`` and ``h_t =
  (1 - z_t) * h_{t-1} + z_t * h~_t``: the gates are one product over all the
  packed rows (``gates``, a ``Dense(2 * features)``), and the recurrence,
  linear in ``h``, is `jaxlod.ops.linear_scan` (depth ``log(rows)``, no
  loop over steps). It takes and returns LoDTensors as `DynamicRNN` does,
  and works inside `Bidirectional` and `StackedRNN`. The NNX twin is
  `jaxlod.nn.nnx.MinGRU`.

  Attributes:
    features: the width of the states.
    reverse: run each sequence from its last row.
    return_carry: also return the final states ``[count_capacity,
      features]`` (an empty sequence's: its initial state).
  """

  features: int
  reverse: bool = False
  return_carry: bool = False

  @nn.compact
  def __call__(
    self,
    x: LoDTensor,
    initial_carry: Any = None,
    *,
    init_key: jax.Array | None = None,
    reverse: bool | None = None,
    return_carry: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Runs the recurrence over the last level of `x`.

    Args:
      x: a LoDTensor, values ``[token_capacity, in_features]``.
      initial_carry: ``[count_capacity, features]`` initial states in `x`'s
        order; `None`: zeros.
      init_key: unused (the default carry is zeros), as `DynamicRNN` takes it.
      reverse, return_carry: override the attributes.
      table: unused: the scan needs no rank table.

    Returns:
      A LoDTensor with `x`'s LoD, values ``[token_capacity, features]``
      (padding rows zero); with `return_carry`, ``(final_states, outputs)``.
    """
    del init_key
    check_table(table, optional=True)
    check_sizes(features=self.features)
    gates = nn.Dense(2 * self.features, name="gates")
    return run_linear(
      self, x, min_gru_coefficients, gates, initial_carry, reverse, return_carry
    )


class RGLRU(nn.Module):
  """The Real-Gated Linear Recurrent Unit (Griffin, De et al. 2024) over the
  last level of a LoDTensor, as one parallel scan.

  ``u_t``, ``r_t = sigmoid(.)`` and ``i_t = sigmoid(.)`` are one product of
  the inputs over all the packed rows (``gates``, a ``Dense(3 *
  features)``); ``a_t = sigmoid(Lambda) ** (c * r_t)`` and ``h_t = a_t *
  h_{t-1} + sqrt(1 - a_t**2) * (i_t * u_t)``, computed in log space, run by
  `jaxlod.ops.linear_scan`. ``Lambda`` (``a_param``, ``[features]``) starts
  where ``sigmoid(Lambda) ** c`` is uniform in ``[0.9, 0.999]``, as in
  Griffin. It takes and returns LoDTensors as `DynamicRNN` does. The NNX
  twin is `jaxlod.nn.nnx.RGLRU`.

  Attributes:
    features: the width of the states.
    c: the exponent's scale (Griffin's 8).
    reverse: run each sequence from its last row.
    return_carry: also return the final states ``[count_capacity,
      features]``.
  """

  features: int
  c: float = 8.0
  reverse: bool = False
  return_carry: bool = False

  @nn.compact
  def __call__(
    self,
    x: LoDTensor,
    initial_carry: Any = None,
    *,
    init_key: jax.Array | None = None,
    reverse: bool | None = None,
    return_carry: bool | None = None,
    table: RankTable | None = None,
  ) -> Any:
    """Runs the recurrence over the last level of `x`: as
    `MinGRU.__call__`."""
    del init_key
    check_table(table, optional=True)
    check_sizes(features=self.features)
    c = finite_float32(self.c, "c", positive=True)
    gates = nn.Dense(3 * self.features, name="gates")
    a_param = self.param("a_param", rg_lru_init(c), (self.features,))
    return run_linear(
      self,
      x,
      lambda g: rg_lru_coefficients(g, a_param, c),
      gates,
      initial_carry,
      reverse,
      return_carry,
    )
