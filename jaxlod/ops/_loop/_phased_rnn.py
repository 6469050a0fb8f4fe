"""The phased loop's driver for a step function (`phased_rnn`, run by
`jaxlod.ops.dynamic_rnn`): Fluid's DynamicRNN over a LoDTensor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxlod._checks import (
  all_hold,
  check_bools,
  check_step_out,
  is_float_dtype,
)
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._host import as_array, check_rows
from jaxlod._lod import LoDTensor, check_lod, is_lod
from jaxlod._lod_checks import check_same_lod
from jaxlod._vma import vary, varying_axes
from jaxlod.ops import _packed
from jaxlod.ops._array import permute_rows
from jaxlod.ops._loop import _phased_loop, _spec
from jaxlod.ops._loop._plan import LoopPlan, plan_with_ladder
from jaxlod.ops._rank import (
  RankTable,
  check_pair,
  nan_unless,
  normalize_ladder,
  phase_bounds,
  ranked_level,
)


def check_inputs(inputs: Any) -> Any:
  """`dynamic_rnn`'s `inputs`: a LoDTensor or a pytree of LoDTensors, each
  checked by `check_lod` (once per call: the loop takes them as they are)."""
  leaves = jax.tree.leaves(inputs, is_leaf=is_lod)
  if not leaves or not all(is_lod(x) for x in leaves):
    raise TypeError(
      "Expected `inputs` to be a LoDTensor or a pytree of LoDTensors, got "
      f"{type(inputs).__name__}."
    )
  for x in leaves:
    check_lod(x, "inputs")
  return inputs


def _flatten_inputs(inputs: Any) -> tuple[list[LoDTensor], Any, Any]:
  """The LoDTensors of checked `inputs` (`check_inputs`), their tree, and
  whether they share one LoD (a `require` check: `True` eagerly, a bool
  scalar under `jit`)."""
  leaves, tree = jax.tree.flatten(inputs, is_leaf=is_lod)
  same = all_hold(
    *(
      check_same_lod(leaves[0], x, "inputs[0]", f"inputs[{i}]", "dynamic_rnn")
      for i, x in enumerate(leaves[1:], 1)
    )
  )
  return leaves, tree, same


def _resolve_table(
  x: LoDTensor, table: RankTable | None, ladder: Sequence[int] | None
) -> tuple[RankTable, Any]:
  """The rank table of `x`, and whether a given one ranks it (`check_pair`)."""
  if table is None:
    return ranked_level(x, x.num_levels - 1, ladder), True
  ranked = check_pair(x, table, "inputs")
  if ladder is not None:
    wanted = normalize_ladder(table.count_capacity, ladder)
    if wanted != table.ladder:
      raise ValueError(
        f"Got both `table` (ladder {table.ladder}) and `ladder` {wanted}; pass "
        "the ladder to `rank_table` instead."
      )
  return table, ranked


def prepare_statics(static_inputs: Any, count: int, per: str = "input sequence") -> Any:
  """Static inputs of a loop, each leaf with leading dimension `count`.

  Args:
    static_inputs: a pytree of arrays ``[count, ...]`` and of LoDTensors
      holding one sequence per `per` (their last level's count capacity is
      `count`).
    count: the count capacity of the loop's batch.
    per: what each row belongs to, for messages.

  Returns:
    The pytree with arrays as `jax.Array` and each LoDTensor as
    ``(padded [count, source_capacity, ...], lengths [count])``.

  Raises:
    ValueError: for a LoDTensor with another count capacity, or a leaf
      whose leading dimension is not `count`.
  """

  def convert(x):
    if not is_lod(x):
      return as_array(x, "static_inputs")
    if x.capacity.sequences[-1] != count:
      raise ValueError(
        f"Expected a LoDTensor in `static_inputs` to hold one sequence per {per}: "
        f"count capacity {count}, got {x.capacity.sequences[-1]}."
      )
    return x.to_padded()

  statics = jax.tree.map(convert, static_inputs, is_leaf=is_lod)
  check_rows(statics, count, "static_inputs")
  return statics


def _convert_phases(step_fn, carry, x_tree, values, statics, ladder):
  """Closure-converts `step_fn` at each phase size; checks its outputs."""
  carry_tree = jax.tree.structure(carry)
  static_leaves, static_tree = jax.tree.flatten(statics)
  phases, consts, y_tails, y_tree = [], [], None, None
  index: dict[int, int] = {}
  for b in ladder:
    c = jax.tree.map(lambda a, b=b: a[:b], carry)
    # Slices of the real inputs, not zeros: under `shard_map` the step is
    # traced with the inputs' varying axes.
    x = jax.tree.unflatten(x_tree, [v[:b] for v in values])
    s = jax.tree.map(lambda a, b=b: a[:b], statics)
    converted, phase_consts = jax.closure_convert(
      lambda c, x, s: step_fn(c, x, s), c, x, s
    )
    out = jax.eval_shape(converted, c, x, s, *phase_consts)
    _, y = check_step_out(out, c, b)
    tails = tuple((leaf.shape[1:], leaf.dtype) for leaf in jax.tree.leaves(y))
    if y_tails is None:
      y_tails, y_tree = tails, jax.tree.structure(y)
    elif tails != y_tails or jax.tree.structure(y) != y_tree:
      raise ValueError(
        f"Expected `step_fn` outputs of the same shape at every batch size; got "
        f"{[(t, jnp.dtype(d).name) for t, d in y_tails]} at {ladder[0]} and "
        f"{[(t, jnp.dtype(d).name) for t, d in tails]} at {b}."
      )

    def flat(c_leaves, x_leaves, inv, converted=converted):
      n = len(static_leaves)
      out = converted(
        jax.tree.unflatten(carry_tree, c_leaves),
        jax.tree.unflatten(x_tree, x_leaves),
        jax.tree.unflatten(static_tree, inv[:n]),
        *inv[n:],
      )
      return jax.tree.leaves(out[0]), jax.tree.leaves(out[1])

    # Phases close over the same parameters: keep one of each.
    for c in phase_consts:
      if id(c) not in index:
        index[id(c)] = len(consts)
        consts.append(c)
    span = tuple(index[id(c)] for c in phase_consts)
    phases.append(_spec.Phase(size=b, fn=flat, consts=span))
  # A Python scalar the step closes over (a weight `w` under `jax.grad`) is
  # a constant too: as an array it has a shape and a dtype like the others.
  return phases, [jnp.asarray(c) for c in consts], y_tails, y_tree


def _float_flags(leaves: list) -> tuple[bool, ...]:
  return tuple(_spec.is_float(a) for a in leaves)


def _ranked(lods: list, table: RankTable, init_carry: Any, static_inputs: Any) -> tuple:
  """The loop's data in rank order: ``(lods, table, carry leaves, carry
  treedef, statics, vma)``, the carry's and static inputs' rows (checked:
  ``[count_capacity, ...]``) permuted by `table`. Under `shard_map`
  everything varies over the axes that any of it varies over (`vma`, see
  `jaxlod._vma`)."""
  count = table.count_capacity
  check_rows(init_carry, count, "init_carry")
  statics = prepare_statics(static_inputs, count)
  carry, carry_tree = jax.tree.flatten(init_carry)
  data = (lods, table, [jnp.asarray(c) for c in carry], statics)
  vma = varying_axes(data)
  lods, table, carry, statics = vary(data, vma)
  carry = permute_rows(carry, table.order, table.ranks, "init_carry")
  statics = permute_rows(statics, table.order, table.ranks, "static_inputs")
  return lods, table, carry, carry_tree, statics, vma


def _description(
  phases: list,
  x0: LoDTensor,
  table: RankTable,
  ladder: tuple[int, ...],
  leaves: tuple[list, list, list, list],
  y_tails: list,
  **settings: Any,
) -> _spec.LoopSpec:
  """The phased loop's static description for a batch like `x0` ranked by
  `table` on `ladder`; `leaves` are ``(carry, values, static_leaves,
  consts)``, whose float flags it records, and `settings` the rest of its
  fields (`return_sequences`, `remat`, `chunk`, `vma`)."""
  carry, values, statics, consts = leaves
  count = table.count_capacity
  return _spec.LoopSpec(
    phases=tuple(phases),
    count=count,
    rows=x0.capacity.tokens + count,
    saved_rows=_packed.schedule_rows(x0.capacity.tokens, table.time_capacity, ladder),
    time=table.time_capacity,
    carry_float=_float_flags(carry),
    x_float=_float_flags(values),
    static_float=_float_flags(statics),
    const_float=_float_flags(consts),
    y_float=tuple(is_float_dtype(d) for _, d in y_tails),
    y_tails=y_tails,
    **settings,
  )


def _bounds(layout: Any, table: RankTable, ladder: tuple[int, ...]) -> tuple:
  """The loop's per-step and per-phase index arrays: ``(step_offsets,
  schedule_offsets, lengths, phase_starts, phase_ends)`` for `ladder` (the
  table's own phases when it is the table's ladder)."""
  if ladder == table.ladder:
    starts, ends = table.phase_starts, table.phase_ends
  else:
    starts, ends = phase_bounds(jnp, table.lengths, ladder)
  return (
    layout.step_offsets,
    _packed.schedule_offsets(table.time_capacity, ladder, starts, ends),
    jnp.asarray(table.lengths),
    jnp.asarray(starts),
    jnp.asarray(ends),
  )


def phased_rnn(
  step_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
  inputs: Any,
  *,
  init_carry: Any,
  static_inputs: Any,
  reverse: bool,
  table: RankTable | None,
  ladder: Sequence[int] | None,
  return_sequences: bool,
  remat: bool,
  plan: LoopPlan | None,
) -> Any:
  """The phased loop over every sequence of a LoDTensor: `step_fn` run in
  phases of static batch sizes, each a `lax.while_loop` over exactly the
  steps whose active batch fits it, with a custom VJP.

  `jaxlod.ops.dynamic_rnn` with a step function: its arguments, results and
  errors are `dynamic_rnn`'s (the front door, which checks `step_fn`).
  """
  lods, x_tree, same_lod = _flatten_inputs(inputs)
  x0 = lods[0]
  check_bools(reverse=reverse, return_sequences=return_sequences, remat=remat)
  plan = plan_with_ladder(plan, ladder)
  table, ranked = _resolve_table(x0, table, ladder)
  count = table.count_capacity
  # No sequences (a count capacity of 0): no step runs; the step is traced
  # at batch 0 for the shapes of its outputs.
  loop_ladder = plan.ladder(count, table.ladder) if count else (0,)
  lods, table, carry, carry_tree, statics, vma = _ranked(
    lods, table, init_carry, static_inputs
  )
  x0 = lods[0]
  layout = _packed.time_major(x0, table, reverse)
  values = [_packed.pack(x.values, layout) for x in lods]

  while True:
    phases, consts, y_tails, y_tree = _convert_phases(
      step_fn, carry_tree.unflatten(carry), x_tree, values, statics, loop_ladder
    )
    if not varying_axes(consts) - vma:
      break
    # Parameters that vary where the data does not: the data varies with them.
    vma |= varying_axes(consts)
    carry, values, statics = vary((carry, values, statics), vma)
  static_leaves = jax.tree.leaves(statics)
  leaves = (carry, values, static_leaves, consts)
  settings = dict(
    return_sequences=return_sequences, remat=remat, chunk=plan.chunk, vma=vma
  )
  spec = _description(phases, x0, table, loop_ladder, leaves, y_tails, **settings)
  bounds = vary(_bounds(layout, table, loop_ladder), vma)
  if table.time_capacity == 0 or count == 0:
    # No sequence, or every sequence empty, and no step can run (a loop body would
    # index per-step arrays of length 0): outputs are zeros, carries as given.
    ys, final = [spec.zeros((spec.rows, *t), d) for t, d in spec.y_tails], carry
  else:
    ys, final = _phased_loop.make_loop(spec)(
      carry, values, static_leaves, consts, bounds
    )
  final = permute_rows(final, table.ranks, table.order, "final_carry")
  # A table of another batch, or inputs whose LoDs differ, under `jit`
  # (without `checkify`) give wrong carries: NaN float results and a faulted
  # output make that loud.
  sound = all_hold(ranked, same_lod)
  final_carry = nan_unless(sound, jax.tree.unflatten(carry_tree, final))
  if not return_sequences:
    return final_carry
  fault = fault_unless(ranked, Fault.TABLE) | fault_unless(same_lod, Fault.INPUT)
  outputs = [
    with_faults(x0.with_values(_packed.unpack(y, layout)), *lods, fault) for y in ys
  ]
  return jax.tree.unflatten(y_tree, nan_unless(ranked, outputs)), final_carry
