"""The recurrent engine's front door: `dynamic_rnn` picks how a recurrence
runs from its step and its plan.

  * a step function runs through the phased loop (`phased_rnn`);
  * a `Separable` cell runs hoisted (`hoisted_rnn`: its input projection
    before the loop, its recurrent kernel's gradient after it);
  * a `Separable` cell under a plan with ``fused=True`` runs through the
    Pallas kernel (`fused_rnn`), one launch per direction of the pass;
  * a `PaddedBatch` (the drop-in RNNs' padded arrays under a plan with
    ``padded=True``) runs the padded masked scan (`padded_rnn`).

The layers of `jaxlod.nn` call it too: they read a Flax cell's parameters
into a `Separable` where their plan hoists, and pass a step function
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxlod._checks import check_bool, check_callable
from jaxlod._lod import is_lod
from jaxlod.ops._loop._fused import fused_rnn
from jaxlod.ops._loop._hoisted import Separable, hoisted_rnn
from jaxlod.ops._loop._padded_scan import PaddedBatch, padded_rnn
from jaxlod.ops._loop._phased_rnn import check_inputs, phased_rnn
from jaxlod.ops._loop._plan import LoopPlan, plan_with_ladder, resolve_plan
from jaxlod.ops._rank import RankTable


def dynamic_rnn(
  step_fn: Callable[[Any, Any, Any], tuple[Any, Any]] | Separable,
  inputs: Any,
  *,
  init_carry: Any,
  static_inputs: Any = None,
  reverse: bool = False,
  table: RankTable | None = None,
  ladder: Sequence[int] | None = None,
  return_sequences: bool = True,
  remat: bool = False,
  plan: LoopPlan | None = None,
) -> Any:
  """Runs a recurrent step over every sequence of a LoDTensor, padding-free.

  Fluid's DynamicRNN (``while`` + ``while_grad``). Sequences are ranked by
  length; the loop runs in phases, each a `lax.while_loop` at a static batch
  size from the ladder, over exactly the steps whose active batch fits it.
  The work is close to ``sum(lengths)`` rather than ``batch x longest``, and
  a jitted caller compiles once per capacity whatever the lengths.

  The step sees rank-ordered batches: row ``i`` of every argument belongs to
  the same sequence, and rows past the active batch hold finished (or
  padding) sequences whose results are discarded. `step_fn` must treat rows
  independently.

  Args:
    step_fn: ``step_fn(carry, x_t, static) -> (new_carry, y_t)``. Every leaf
      has leading dimension ``b``, the phase's static batch size. Arrays it
      closes over (model parameters) receive gradients. Or a `Separable`
      cell, run with its input projection hoisted before the loop (through
      the fused kernel, `fused_rnn`, under a plan with ``fused=True``): its
      `inputs` is one LoDTensor and it takes no `static_inputs`.
    inputs: a LoDTensor ``values [token_capacity, *features]``, or a pytree of
      LoDTensors with the same LoD; ``x_t`` has the same structure with
      leaves ``[b, *features]``.
    init_carry: pytree of ``[count_capacity, ...]`` leaves in the caller's
      (original) order (Fluid's ``memory(init=..., need_reorder=True)``).
    static_inputs: pytree of arrays ``[count_capacity, ...]``, or of
      LoDTensors holding one sequence per input sequence (an encoder's
      outputs); a LoDTensor reaches the step as ``(padded [b, source_capacity,
      ...], lengths [b])``. Default `None`.
    reverse: run each sequence from its own last row to its first.
    table: a precomputed `rank_table` of the inputs' last level (the data
      pipeline builds it on the host); built here when `None`.
    ladder: static batch sizes of the phases (see `rank_table`).
    return_sequences: when `False`, return only the final carry and skip
      writing outputs.
    remat: save only the carries for the backward pass and recompute each
      step (less memory for long sequences); by default the step's VJP
      residuals are saved: the outputs of its matrix products and
      transcendental functions (an LSTM: its carries and five activations
      per row), with cheap elementwise ops recomputed and the step input
      read again. Recomputing costs one more forward step per step but
      fills a smaller buffer; for LSTM and GRU cells on CPU the two modes
      measure within noise of each other (see ``benchmarks/rnn.py``).
    plan: how the loop runs (a `jaxlod.ops.LoopPlan`): its bodies (the
      ladder, or one or a few sizes where rows are nearly free) and the
      steps per `lax.while_loop` iteration. `None`: `default_plan()` of
      the backend at trace time, with a given `ladder` taking the place
      of its `bodies`. A plan with `bodies` set takes its own sizes
      whatever the table's ladder, and conflicts with `ladder`.

  Returns:
    ``(outputs, final_carry)``: `outputs` has the structure of ``y_t`` with
    LoDTensor leaves (the inputs' LoD, original order, ``values
    [token_capacity, *y_features]``); `final_carry` has the structure of
    `init_carry`, each sequence's state after its own last step, original
    order (an empty sequence keeps its `init_carry`). Only `final_carry` when
    `return_sequences` is `False`. Under `jit`, a `table` that does not rank
    the inputs turns the float leaves of both NaN and sets
    `jaxlod.Fault.TABLE` in the outputs' ``faults``; inputs whose offsets
    differ turn the float leaves of `final_carry` NaN and set
    `jaxlod.Fault.INPUT` in the outputs' ``faults``.

  Raises:
    TypeError: for a `step_fn` that is neither callable nor a `Separable`,
      or a `Separable` with `inputs` that are not one LoDTensor.
    ValueError: for a `Separable` given `static_inputs`; at trace time, for
      inputs with different LoDs, a `ladder` with a `plan` whose `bodies` is
      set, an `init_carry` or static input with the wrong leading dimension,
      a step that changes a carry leaf's shape or dtype, or outputs whose
      shape changes with the batch size; eagerly, for inputs whose offsets
      differ or a `table` that does not rank them (under `jit` these are
      `jax.experimental.checkify` checks, and the results are poisoned as
      above).

  Differentiable in reverse mode (`jax.grad`, `jax.vjp`) through a custom
  VJP; forward mode (`jax.jvp`) is not supported.

  Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import dynamic_rnn
    >>> x = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((1, 2))])
    >>> def step(h, x_t, _):
    ...   h = h + x_t.sum(-1)
    ...   return h, h
    >>> ys, h = dynamic_rnn(step, x, init_carry=jnp.zeros(2))
    >>> h.tolist(), ys.to_list()[0].tolist()
    ([6.0, 2.0], [2.0, 4.0, 6.0])
  """
  return dispatch(
    step_fn,
    check_inputs(inputs),
    init_carry=init_carry,
    static_inputs=static_inputs,
    reverse=reverse,
    table=table,
    ladder=ladder,
    return_sequences=return_sequences,
    remat=remat,
    plan=plan,
  )


def dispatch(
  step_fn: Callable[[Any, Any, Any], tuple[Any, Any]] | Separable,
  inputs: Any,
  *,
  static_inputs: Any = None,
  return_sequences: bool = True,
  plan: LoopPlan | None = None,
  **settings: Any,
) -> Any:
  """`dynamic_rnn` over `inputs` that `check_inputs` has checked (the layers
  call it with theirs): the phased loop, or for a `Separable` the hoisted
  loop or the fused kernel; for a `PaddedBatch` (the drop-in RNNs' padded
  arrays), the padded masked scan, its outputs padded arrays. `settings`:
  ``init_carry``, ``reverse``, ``table``, ``ladder`` and ``remat``, as
  `dynamic_rnn` takes them."""
  if isinstance(inputs, PaddedBatch):
    loop = (settings["init_carry"], settings["reverse"], settings["remat"])
    outputs, carry = padded_rnn(step_fn, inputs, *loop, resolve_plan(plan).chunk)
    return (outputs, carry) if return_sequences else carry
  if not isinstance(step_fn, Separable):
    check_callable(step_fn, "step_fn")
    return phased_rnn(
      step_fn,
      inputs,
      static_inputs=static_inputs,
      return_sequences=return_sequences,
      plan=plan,
      **settings,
    )
  if static_inputs is not None:
    raise ValueError(
      "Expected no `static_inputs` with a Separable `step_fn` (its step reads "
      f"none), got {type(static_inputs).__name__}."
    )
  check_bool(return_sequences, "return_sequences")
  if not is_lod(inputs):
    raise TypeError(
      f"Expected `inputs` to be a LoDTensor, got {type(inputs).__name__}."
    )
  if plan_with_ladder(plan, settings["ladder"]).fused:
    fused = {k: settings[k] for k in ("init_carry", "reverse", "table")}
    outputs, carry = fused_rnn(step_fn, inputs, **fused)
  else:
    outputs, carry = hoisted_rnn(step_fn, inputs, plan=plan, **settings)
  return (outputs, carry) if return_sequences else carry
