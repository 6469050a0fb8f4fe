"""What the recurrent layers of both twins run, free of either Flax API.

`DynamicRNN`, `Bidirectional`, `StackedRNN` and `HierarchicalEncoder`, Linen
and NNX alike, differ only in how they hold their parameters: each call
body is one of the `run_*` functions below, given the layer (whose
documented attributes it reads), as Flax's cells call the functions of
``flax.linen.activation``. The helpers before them (zero padding rows, an
example row, a step counter for RNG streams) serve the decoders too. Under
a plan that hoists, a `DynamicRNN` hands `run_cell` its cell split by
`jaxlod.nn._hoist` in place of a step. The linear recurrent layers
(`MinGRU`, `RGLRU`) run `run_linear`: one product over the packed rows,
then `jaxlod.ops.linear_scan`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxlod import _checks
from jaxlod._checks import check_rate, where_rows
from jaxlod._host import as_array
from jaxlod._lod import LoDTensor, check_lod, is_lod
from jaxlod.nn._layer_checks import check_rnn_layer, split_pair
from jaxlod.ops._loop._dispatch import dispatch
from jaxlod.ops._loop._hoisted import Separable
from jaxlod.ops._loop._plan import LoopPlan, plan_with_ladder
from jaxlod.ops._pool import check_pool_type, sequence_pool
from jaxlod.ops._rank import RankTable
from jaxlod.ops._scan import linear_scan


def zero_padding(x: LoDTensor, values: jax.Array) -> LoDTensor:
  """`x`'s LoD over `values` ``[token_capacity, ...]``, padding rows set to 0."""
  return x.with_values(where_rows(x.row_mask(), values, 0))


def example_row(tree: Any) -> Any:
  """The first row of every leaf, ``[1, ...]``; zeros for a leaf with no rows
  (an all-empty batch), so that a layer can still create its parameters."""

  def first(a: jax.Array) -> jax.Array:
    return a[:1] if a.shape[0] else jnp.zeros((1, *a.shape[1:]), a.dtype)

  return jax.tree.map(first, tree)


def count_steps(step: Callable, carry: Any) -> tuple[Callable, Any, Callable]:
  """A pure step with RNG streams (a Linen method made pure by `pure_method`)
  that draws afresh at every step, as ``flax.linen.RNN`` splits its RNGs per
  step.

  The carry gains a step counter ``[count]``: all active rows of a phase are
  at the same step, so its maximum is the step, and each stream's key is
  folded with it. Returns ``(step, carry, unwrap)``, `unwrap` taking the
  counter off a final carry; a step without streams comes back unchanged.
  """
  if not getattr(step, "streams", ()):
    return step, carry, lambda final: final
  return counted_step(step), counted_carry(carry), lambda final: final[0]


def counted_step(step: Callable) -> Callable:
  """`count_steps`'s step alone: `step` over ``(carry, counter)``, its streams
  folded with the counter's maximum; a step without streams unchanged."""
  if not getattr(step, "streams", ()):
    return step

  def counted(state: Any, *args: Any) -> Any:
    inner, t = state
    new, *rest = step(inner, *args, step=jnp.max(t, initial=0))
    return ((new, t + 1), *rest)

  return counted


def counted_carry(carry: Any) -> Any:
  """`count_steps`'s carry alone: `carry` with a zero step counter
  ``[count]``."""
  count = jax.tree.leaves(carry)[0].shape[0]
  return carry, jnp.zeros((count,), jnp.int32)


def override(layer: Any, **values: Any) -> list[Any]:
  """Call arguments that default to the layer's attribute of the same name."""
  return [getattr(layer, k) if v is None else v for k, v in values.items()]


def merge_directions(
  x: LoDTensor,
  forward: Any,
  backward: Any,
  merge_fn: Callable[[jax.Array, jax.Array], jax.Array] | None,
) -> Any:
  """Both directions' outputs merged row by row (default: concatenated on the
  last axis), padding rows zero."""

  def merged(f: LoDTensor, b: LoDTensor) -> LoDTensor:
    if merge_fn is None:
      return zero_padding(x, jnp.concatenate([f.values, b.values], axis=-1))
    return zero_padding(x, merge_fn(f.values, b.values))

  return jax.tree.map(merged, forward, backward, is_leaf=is_lod)


def stack_rates(
  layers: int, input_dropout: float, dropout_rate: float, output_dropout: float
) -> list[float]:
  """`StackedRNN`'s dropout rates: before layer ``i`` for ``i < layers``, then
  after the last."""
  check_rate(input_dropout, "input_dropout")
  check_rate(dropout_rate, "dropout_rate")
  check_rate(output_dropout, "output_dropout")
  return [input_dropout] + [dropout_rate] * (layers - 1) + [output_dropout]


def loop_plan(layer: Any) -> LoopPlan:
  """The plan a `DynamicRNN` runs under: its `plan`, or the backend's
  `default_plan` with the layer's `ladder` for its bodies.

  Raises:
    TypeError: for a `plan` that is not a `jaxlod.ops.LoopPlan` or `None`.
    ValueError: for both a `ladder` and a `plan` whose `bodies` is set.
  """
  return plan_with_ladder(layer.plan, layer.ladder)


def _without_statics(step: Callable[[Any, jax.Array], tuple[Any, jax.Array]]):
  """`step(carry, x_t)` as `dynamic_rnn`'s ``step_fn(carry, x_t, static)``."""
  return lambda carry, x_t, _: step(carry, x_t)


def run_cell(
  layer: Any,
  step: Callable[[Any, jax.Array], tuple[Any, jax.Array]] | Separable,
  x: LoDTensor,
  initial_carry: Any,
  reverse: bool | None,
  return_carry: bool | None,
  table: RankTable | None,
) -> Any:
  """`DynamicRNN`'s loop: `step` over the last level of `x` with the layer's
  `ladder`, `remat` and `plan`; the outputs, or ``(carry, outputs)``. A
  `Separable` cell (the layer's plan hoists) runs hoisted or fused, as
  `jaxlod.ops.dynamic_rnn` picks from the plan."""
  reverse, return_carry = override(layer, reverse=reverse, return_carry=return_carry)
  _checks.check_bools(reverse=reverse, return_carry=return_carry, remat=layer.remat)
  settings = {
    "init_carry": initial_carry,
    "reverse": reverse,
    "table": table,
    "ladder": layer.ladder,
    "remat": layer.remat,
    "plan": layer.plan,
  }
  if not isinstance(step, Separable):
    step = _without_statics(step)
  # The layer checked `x`: the front door's dispatcher takes it as it is.
  outputs, carry = dispatch(step, x, **settings)
  return (carry, outputs) if return_carry else outputs


def run_directions(
  layer: Any,
  x: LoDTensor,
  initial_carry: Any,
  return_carry: bool | None,
  table: RankTable | None,
  keys: Sequence[dict[str, Any]],
) -> Any:
  """`Bidirectional`'s body: ``layer.forward_rnn`` and ``layer.backward_rnn``
  (with ``reverse=True``) over `x` (its `inputs`), merged by
  ``layer.merge_fn``. `keys` holds each direction's extra keyword arguments
  (its carry's RNGs)."""
  x = check_lod(x, "inputs")
  (return_carry,) = override(layer, return_carry=return_carry)
  _checks.check_bool(return_carry, "return_carry")
  check_rnn_layer(layer.forward_rnn, "forward_rnn", layer)
  check_rnn_layer(layer.backward_rnn, "backward_rnn", layer)
  if layer.merge_fn is not None:
    _checks.check_callable(layer.merge_fn, "merge_fn")
  # Only a given table is passed on: an RNN of the documented call signature
  # need not take one.
  extra = {} if table is None else {"table": table}
  runs = [
    rnn(x, initial_carry=carry, reverse=reverse, return_carry=True, **key, **extra)
    for rnn, carry, reverse, key in zip(
      (layer.forward_rnn, layer.backward_rnn),
      split_pair(initial_carry),
      (False, True),
      keys,
      strict=True,
    )
  ]
  (forward_carry, forward), (backward_carry, backward) = runs
  outputs = merge_directions(x, forward, backward, layer.merge_fn)
  return ((forward_carry, backward_carry), outputs) if return_carry else outputs


def run_stack(
  layer: Any,
  x: LoDTensor,
  deterministic: bool | None,
  return_carry: bool | None,
  table: RankTable | None,
) -> Any:
  """`StackedRNN`'s body: ``layer.dropouts[i]`` then ``layer.layers[i]`` in
  turn, then the last dropout; the last outputs, or ``(carries, outputs)``
  with each layer's final carry, first layer first."""
  x = check_lod(x, "x")
  deterministic, return_carry = override(
    layer, deterministic=deterministic, return_carry=return_carry
  )
  _checks.check_bools(deterministic=deterministic, return_carry=return_carry)
  extra = {} if table is None else {"table": table}
  carries = []
  for i, rnn in enumerate(layer.layers):
    x = x.with_values(layer.dropouts[i](x.values, deterministic=deterministic))
    if return_carry:
      carry, x = rnn(x, return_carry=True, **extra)
      carries.append(carry)
    else:
      x = rnn(x, **extra)
    x = check_lod(x, f"the output of layer {i}")
  x = x.with_values(layer.dropouts[-1](x.values, deterministic=deterministic))
  return (tuple(carries), x) if return_carry else x


def run_levels(layer: Any, x: LoDTensor, return_carry: bool | None) -> Any:
  """`HierarchicalEncoder`'s body: ``layer.inner`` over the level-1
  sequences, each pooled to one row by ``layer.pool_type``, then
  ``layer.outer`` over each level-0 sequence of those rows."""
  (return_carry,) = override(layer, return_carry=return_carry)
  _checks.check_bool(return_carry, "return_carry")
  x = check_lod(x, "x")
  if x.num_levels != 2:
    raise ValueError(
      "Expected `x` to have 2 LoD levels (level 0: outer sequences of level-1 "
      f"sequences; level 1: sequences of rows), got {x.num_levels}."
    )
  check_pool_type(layer.pool_type)
  check_rnn_layer(layer.inner, "inner", layer)
  check_rnn_layer(layer.outer, "outer", layer)
  inner = check_lod(layer.inner(x, return_carry=False), "the inner output")
  return layer.outer(sequence_pool(inner, layer.pool_type), return_carry=return_carry)


def min_gru_coefficients(gates: jax.Array) -> tuple[jax.Array, jax.Array]:
  """minGRU's recurrence ``h_t = (1 - z_t) * h_{t-1} + z_t * h~_t`` as the
  ``(a, b)`` of `jaxlod.ops.linear_scan`, from ``gates [rows, 2 * features]``
  (the update gate's logits, then the candidate ``h~``)."""
  z_logits, candidate = jnp.split(gates, 2, axis=-1)
  z = jax.nn.sigmoid(z_logits)
  return 1 - z, z * candidate


def rg_lru_coefficients(
  gates: jax.Array, a_param: jax.Array, c: float
) -> tuple[jax.Array, jax.Array]:
  """The RG-LRU's recurrence (Griffin, De et al. 2024) ``h_t = a_t * h_{t-1}
  + sqrt(1 - a_t**2) * (i_t * u_t)``, ``a_t = sigmoid(a_param) ** (c *
  r_t)``, as the ``(a, b)`` of `jaxlod.ops.linear_scan`, from ``gates
  [rows, 3 * features]`` (the input ``u``, then the logits of the
  recurrence gate ``r`` and of the input gate ``i``)."""
  u, r_logits, i_logits = jnp.split(gates, 3, axis=-1)
  log_a = -c * jax.nn.softplus(-a_param) * jax.nn.sigmoid(r_logits)
  scale = _rg_lru_scale(log_a)  # sqrt(1 - a**2), exact near a = 1
  return jnp.exp(log_a), scale * (jax.nn.sigmoid(i_logits) * u)


@jax.custom_jvp
def _rg_lru_scale(log_a: jax.Array) -> jax.Array:
  """``sqrt(1 - exp(log_a) ** 2)`` for ``log_a <= 0``, its derivative 0 at
  ``log_a = 0`` (a saturated gate, where the derivative through the gate's
  logits tends to 0) instead of ``inf * 0 = nan``."""
  return jnp.sqrt(-jnp.expm1(2 * log_a))


def _rg_lru_scale_jvp(primals, tangents):
  (log_a,), (log_a_dot,) = primals, tangents
  scale = _rg_lru_scale(log_a)
  zero = scale == 0
  slope = -jnp.exp(2 * log_a) / jnp.where(zero, 1, scale)
  return scale, jnp.where(zero, 0, slope) * log_a_dot


_rg_lru_scale.defjvp(_rg_lru_scale_jvp)


def run_linear(
  layer: Any,
  x: LoDTensor,
  coefficients: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
  project: Callable[[jax.Array], jax.Array],
  initial_carry: Any,
  reverse: bool | None,
  return_carry: bool | None,
) -> Any:
  """A linear recurrent layer's body (`MinGRU`, `RGLRU`): ``project`` of all
  the packed rows at once (one product), `coefficients` of its result, then
  `jaxlod.ops.linear_scan` over the last level of `x` from `initial_carry`
  (``[count_capacity, features]``, zeros by default); with `return_carry`,
  ``(final states, outputs)``, an empty sequence's final state its initial
  one."""
  x = check_lod(x, "x")
  reverse, return_carry = override(layer, reverse=reverse, return_carry=return_carry)
  _checks.check_bools(reverse=reverse, return_carry=return_carry)
  if x.values.ndim != 2:
    raise ValueError(
      f"Expected `x.values` to have shape [tokens, features], got {x.values.shape}."
    )
  a, b = coefficients(project(x.values))
  count, features = x.capacity.sequences[-1], b.shape[-1]
  if initial_carry is None:
    initial_carry = jnp.zeros((count, features), b.dtype)
  initial_carry = as_array(initial_carry, "initial_carry")
  if initial_carry.shape != (count, features):
    raise ValueError(
      f"Expected `initial_carry` to have shape {(count, features)} ([count_capacity, "
      f"features]), got {initial_carry.shape}."
    )
  outputs = linear_scan(
    x.with_values(a), x.with_values(b), init=initial_carry, reverse=reverse
  )
  if not return_carry:
    return outputs
  edge = sequence_pool(outputs, "first" if reverse else "last")
  edge = edge.values if is_lod(edge) else edge
  empty = (x.lengths() == 0)[:, None]
  return jnp.where(empty, initial_carry.astype(edge.dtype), edge), outputs


def rg_lru_init(c: float) -> Callable[..., jax.Array]:
  """An initializer of the RG-LRU's ``Lambda``: ``sigmoid(Lambda) ** c``
  uniform in ``[0.9, 0.999]`` (Griffin's)."""

  def init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    a_c = jax.random.uniform(key, shape, dtype, 0.9, 0.999)
    a = a_c ** (1 / c)
    return jnp.log(a) - jnp.log1p(-a)  # the logit of a

  return init
