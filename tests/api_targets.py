"""The targets of tests/test_api_inputs.py in jaxlod, jaxlod.ops, jaxlod.data
and jaxlod.parallel: each public callable with valid arguments and the kind of
each argument (see tests/api_catalogue.py)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

import jaxlod
from jaxlod import Buckets, LoDTensor, data, ops, parallel, testing
from tests.api_catalogue import (
  MODEL_SETTINGS,
  SETTINGS,
  Arg,
  Bad,
  FromValid,
  Target,
  add_target,
  arg,
  batcher,
  heads,
  ids,
  keep,
  linen_model,
  linen_params,
  lod,
  memory,
  mesh,
  method,
  own_hidden,
  rnn_step,
  scalars,
  separable,
  simple_gates,
  stacked,
  step_log_probs,
  table,
)

TARGETS: list[Target] = []
target = functools.partial(add_target, TARGETS)


def more(a: Arg, *bad: Bad) -> Arg:
  """`a` with more wrong values, of this argument only, not of its kind (a
  `length_penalty` of 400 is wrong with these `steps` only)."""
  return Arg(a.valid, a.bad + bad)


# jaxlod ------------------------------------------------------------------------------

target(
  "jaxlod.enable_compilation_cache",
  jaxlod.enable_compilation_cache,
  {
    "directory": arg(None, "path", none_ok=True),
    "min_compile_time_s": arg(0.5, "float>=0"),
  },
)
target(
  "Buckets",
  Buckets,
  {"policy": arg("exact", "choice"), "params": arg((), "tuple")},
)
target("Buckets.pow2", Buckets.pow2, {"minimum": arg(8, "capacity>=1")})
target(
  "Buckets.geometric",
  Buckets.geometric,
  {"ratio": arg(1.25, "geometric_ratio"), "multiple": arg(8, "capacity>=1")},
)
target(
  "Buckets.explicit",
  Buckets.explicit,
  {"boundaries": arg([4, 8], "boundaries")},
)
target(
  "Buckets.fixed",
  Buckets.fixed,
  {
    "tokens": arg(8, "capacity>=0"),
    "sequences": arg(4, "per_level"),
    "time": arg(4, "per_level"),
  },
)
target(
  "Buckets.capacity",
  Buckets.capacity,
  {
    "size": arg(3, "int>=0"),
    "kind": arg("tokens", "choice"),
    "level": arg(0, "int>=0"),
  },
  call=method(Buckets.pow2, "capacity"),
)
target(
  "LoDTensor.from_offsets",
  LoDTensor.from_offsets,
  {
    "values": arg(lambda: np.zeros((3, 2)), "array"),
    "offsets": arg([[0, 2, 3]], "levels"),
    "buckets": arg(None, "buckets", none_ok=True),
  },
)
target(
  "LoDTensor.from_lengths",
  LoDTensor.from_lengths,
  {
    "values": arg(lambda: np.zeros((3, 2)), "array"),
    "recursive_lengths": arg([[2, 1]], "levels"),
    "buckets": arg(None, "buckets", none_ok=True),
  },
)
target(
  "LoDTensor.from_sequences",
  LoDTensor.from_sequences,
  {
    "seqs": arg(lambda: [np.ones(2), np.ones(1)], "seqs"),
    "buckets": arg(None, "buckets", none_ok=True),
    "dtype": arg(None, "dtype", none_ok=True),
  },
)
target(
  "LoDTensor.from_padded",
  LoDTensor.from_padded,
  {
    "padded": arg(lambda: np.zeros((2, 3, 2)), "array"),
    "lengths": arg(lambda: np.array([3, 1]), "ints"),
    "num_sequences": arg(None, "size>=0", none_ok=True),
    "buckets": arg(None, "buckets", none_ok=True),
  },
)
target(
  "LoDTensor.from_row_splits",
  LoDTensor.from_row_splits,
  {
    "values": arg(lambda: np.zeros((3, 2)), "array"),
    "row_splits": arg(lambda: [np.array([0, 2, 3])], "levels"),
    "buckets": arg(None, "buckets", none_ok=True),
  },
)
target(
  "LoDTensor.from_segment_ids",
  LoDTensor.from_segment_ids,
  {
    "values": arg(lambda: np.zeros((3, 2)), "array"),
    "segment_ids": arg(lambda: np.array([1, 1, 2]), "host_ints"),
    "positions": arg(None, "host_ints", none_ok=True),
    "padding_id": arg(0, "int", none_ok=True),
    "buckets": arg(None, "buckets", none_ok=True),
  },
)
target(
  "jaxlod.unchecked",
  jaxlod.unchecked,
  {"fn": arg(lambda: lambda: None, "callable")},
)
target(
  "LoDTensor.lengths",
  LoDTensor.lengths,
  {"level": arg(-1, "level")},
  call=method(lod, "lengths"),
)
target(
  "LoDTensor.num_sequences",
  LoDTensor.num_sequences,
  {"level": arg(-1, "level")},
  call=method(lod, "num_sequences"),
)
target(
  "LoDTensor.astype",
  LoDTensor.astype,
  {"dtype": arg(np.float16, "dtype")},
  call=method(lod, "astype"),
)
target(
  "LoDTensor.with_values",
  LoDTensor.with_values,
  {"values": arg(lambda: np.zeros((3, 4)), "array")},
  call=method(lod, "with_values"),
)
target(
  "LoDTensor.to_padded",
  LoDTensor.to_padded,
  {
    "pad_value": arg(0.0, "pad_value"),
    "time_capacity": arg(None, "size>=0", none_ok=True),
  },
  call=method(lod, "to_padded"),
)
# The pad values of integer rows (`ids`): the rows' dtype must hold them.
_INT_PAD = {"pad_value": arg(0, "int_pad_value")}
_CHECKED_ABOVE = "checked in the target above, with float rows"
target(
  "LoDTensor.to_padded[int]",
  LoDTensor.to_padded,
  {**_INT_PAD, "time_capacity": keep(None)},
  call=method(ids, "to_padded"),
  unchecked={"time_capacity": _CHECKED_ABOVE},
)

# jaxlod.ops: rank tables and array ops -----------------------------------------------

target(
  "ops.rank_table",
  ops.rank_table,
  {
    "x": arg(lod, "lod"),
    "level": arg(-1, "level"),
    "ladder": arg(None, "ladder", none_ok=True),
  },
)
target(
  "ops.default_ladder",
  ops.default_ladder,
  {
    "count_capacity": arg(8, "size>=0"),
    "ratio": arg(1.25, "ratio>1"),
    "minimum": arg(4, "size>=1"),
    "multiple": arg(4, "size>=1"),
  },
)
target(
  "ops.normalize_ladder",
  ops.normalize_ladder,
  {"count_capacity": arg(8, "size>=0"), "ladder": arg([4], "ladder", none_ok=True)},
)
target(
  "ops.lod_to_array",
  ops.lod_to_array,
  {"x": arg(lod, "lod"), "table": arg(table, "table")},
)
target(
  "ops.array_to_lod",
  ops.array_to_lod,
  {
    "array": arg(lambda: np.zeros((2, 2, 2), np.float32), "array"),
    "table": arg(table, "table"),
    "like": arg(lod, "lod"),
  },
)
target(
  "ops.reorder_by_rank",
  ops.reorder_by_rank,
  {
    "x": arg(lambda: np.zeros((2, 3)), "rows"),
    "table": arg(table, "table"),
    "check_lengths": arg(False, "bool"),
  },
)
target(
  "ops.shrink_memory",
  ops.shrink_memory,
  {
    "memory": arg(lambda: np.zeros((2, 3)), "rows"),
    "table": arg(table, "table"),
    "step": arg(0, "size>=0"),
    "size": arg(2, "size>=0"),
  },
)

# jaxlod.ops: sequence ops ------------------------------------------------------------

for _name in ("sequence_first_step", "sequence_last_step", "sequence_reverse"):
  target(f"ops.{_name}", getattr(ops, _name), {"x": arg(lod, "lod")})
target("ops.sequence_softmax", ops.sequence_softmax, {"x": arg(scalars, "lod")})
target(
  "ops.sequence_pool",
  ops.sequence_pool,
  {
    "x": arg(lod, "lod"),
    "pool_type": arg("sum", "choice"),
    "pad_value": arg(0.0, "pad_value"),
  },
)
target(
  "ops.sequence_pool[int]",
  ops.sequence_pool,
  {"x": keep(ids), "pool_type": keep("first"), **_INT_PAD},
  unchecked={"x": _CHECKED_ABOVE, "pool_type": _CHECKED_ABOVE},
)
target(
  "ops.sequence_pad",
  ops.sequence_pad,
  {
    "x": arg(lod, "lod"),
    "pad_value": arg(0.0, "pad_value"),
    "maxlen": arg(None, "size>=0", none_ok=True),
  },
)
target(
  "ops.sequence_pad[int]",
  ops.sequence_pad,
  {"x": keep(ids), **_INT_PAD, "maxlen": keep(None)},
  unchecked={"x": _CHECKED_ABOVE, "maxlen": _CHECKED_ABOVE},
)
target(
  "ops.sequence_unpad",
  ops.sequence_unpad,
  {
    "padded": arg(lambda: np.zeros((2, 3, 2)), "array"),
    "lengths": arg(lambda: np.array([3, 1]), "ints"),
    "num_sequences": arg(None, "size>=0", none_ok=True),
    "capacity": arg(None, "capacity", none_ok=True),
  },
)
target(
  "ops.sequence_mask",
  ops.sequence_mask,
  {
    "lengths": arg(lambda: np.array([3, 1]), "int_values"),
    "maxlen": arg(None, "size>=0", none_ok=True),
    "dtype": arg(jnp.bool_, "dtype"),
  },
)
target(
  "ops.sequence_concat",
  ops.sequence_concat,
  {
    "xs": arg(lambda: [lod(), lod()], "lods"),
    "capacity": arg(None, "capacity", none_ok=True),
  },
)
target(
  "ops.sequence_conv",
  ops.sequence_conv,
  {
    "x": arg(lod, "lod"),
    "filter": arg(lambda: np.ones((6, 3), np.float32), "array"),
    "context_start": arg(None, "index", none_ok=True),
    "context_length": arg(3, "size>=1"),
    "context_stride": arg(1, "size>=1"),
    "bias": arg(None, "array", none_ok=True),
  },
)
target(
  "ops.sequence_cross_entropy",
  ops.sequence_cross_entropy,
  {
    "logits": arg(lambda: LoDTensor.from_lengths(np.zeros((3, 4)), [[2, 1]]), "lod"),
    "labels": arg(ids, "lod"),
    "label_smoothing": arg(0.0, "rate"),
  },
)
target(
  "ops.sequence_enumerate",
  ops.sequence_enumerate,
  {
    "x": arg(ids, "lod"),
    "win_size": arg(2, "size>=1"),
    "pad_value": arg(0, "int_pad_value"),
    "capacity": arg(None, "capacity", none_ok=True),
  },
)
target(
  "ops.sequence_erase",
  ops.sequence_erase,
  {
    "x": arg(ids, "lod"),
    "tokens": arg([2], "ints"),
    "capacity": arg(None, "capacity", none_ok=True),
  },
)
target(
  "ops.sequence_expand",
  ops.sequence_expand,
  {
    "x": arg(lambda: np.array([1.0, 2.0]), "array_or_lod"),
    "y": arg(lod, "lod"),
    "ref_level": arg(-1, "level"),
    "capacity": arg(None, "capacity", none_ok=True),
  },
)
target(
  "ops.sequence_expand_as",
  ops.sequence_expand_as,
  {
    "x": arg(lambda: np.array([1.0, 2.0]), "array"),
    "y": arg(lod, "lod"),
    "capacity": arg(None, "capacity", none_ok=True),
  },
)
target(
  "ops.sequence_slice",
  ops.sequence_slice,
  {
    "x": arg(lod, "lod"),
    "offset": arg(lambda: np.array([0, 0]), "ints"),
    "length": arg(lambda: np.array([1, 1]), "ints"),
  },
)
target(
  "ops.sequence_reshape",
  ops.sequence_reshape,
  {"x": arg(lod, "lod"), "new_dim": arg(1, "size>=1")},
)
target(
  "ops.sequence_scatter",
  ops.sequence_scatter,
  {
    "x": arg(lambda: np.zeros((2, 3)), "array"),
    "index": arg(lambda: LoDTensor.from_lengths(np.array([0, 2, 1]), [[2, 1]]), "lod"),
    "updates": arg(lambda: LoDTensor.from_lengths(np.ones(3), [[2, 1]]), "lod"),
  },
)
target(
  "ops.lod_reset",
  ops.lod_reset,
  {
    "x": arg(lod, "array_or_lod"),
    "lengths": arg([1, 2], "levels", none_ok=True),
    "y": arg(None, "lod", none_ok=True),
  },
)

# jaxlod.ops: loops and decoding ------------------------------------------------------

target(
  "ops.dynamic_rnn",
  ops.dynamic_rnn,
  {
    "step_fn": arg(lambda: rnn_step, "callable"),
    "inputs": arg(lod, "lod"),
    "init_carry": arg(lambda: np.zeros((2, 3), np.float32), "rows"),
    "static_inputs": arg(None, "rows", none_ok=True),
    "reverse": arg(False, "bool"),
    "table": arg(None, "table", none_ok=True),
    "ladder": arg(None, "ladder", none_ok=True),
    "return_sequences": arg(True, "bool"),
    "remat": arg(False, "bool"),
    "plan": arg(None, "plan", none_ok=True),
  },
)
target(
  "ops.decode_corpus",
  ops.decode_corpus,
  {
    "step_fn": arg(lambda: step_log_probs, "callable"),
    "encode_fn": arg(lambda: lambda batch: None, "callable"),
    "sources": arg(lambda: [], "iterable"),
    "settings": arg(SETTINGS, "settings"),
    "slots": arg(2, "size>=1"),
    "refill": arg(None, "size>=1", none_ok=True),
    "chunk": arg(8, "size>=1"),
    "stats": arg(None, "mapping", none_ok=True),
    "mesh": arg(mesh, "mesh", none_ok=True),
    "axis": arg("data", "axis"),
  },
)
target(
  "ops.linear_scan",
  ops.linear_scan,
  {
    "a": arg(lod, "array_or_lod"),
    "b": arg(lod, "lod"),
    "init": arg(None, "rows", none_ok=True),
    "reverse": arg(False, "bool"),
  },
)
target(
  "ops.fused_rnn",
  ops.fused_rnn,
  {
    "cell": arg(lambda: separable(), "separable"),
    "x": arg(lod, "lod"),
    "init_carry": arg(lambda: np.zeros((2, 2), np.float32), "rows"),
    "reverse": arg(False, "bool"),
    "table": arg(None, "table", none_ok=True),
    "tile": arg(16, "int>=1"),
    "interpret": arg(None, "bool", none_ok=True),
  },
  unchecked={
    "compute_dtype": "None or bfloat16, anything else raises TypeError naming "
    "`compute_dtype` (tests/ops/test_fused.py)",
  },
)
target(
  "ops.Separable",
  ops.Separable,
  {
    "w_in": arg(lambda: np.ones((2, 2), np.float32), "matrix"),
    "b_in": arg(None, "array", none_ok=True),
    "w_rec": arg(lambda: np.ones((2, 2), np.float32), "matrix"),
    "b_rec": arg(None, "array", none_ok=True),
    "probe": arg(0, "int>=0"),
    "gates": arg(lambda: simple_gates, "callable"),
    "hidden": arg(lambda: own_hidden, "callable"),
    "parts": arg(1, "int>=1"),
  },
  unchecked={
    "dtype": "handed to Flax's promote_dtype, which checks it",
    "precision": "handed to jax.lax.dot_general, which checks it",
  },
)
target(
  "ops.LoopPlan",
  ops.LoopPlan,
  {
    "bodies": arg(None, "size>=1", none_ok=True),
    "chunk": arg(1, "size>=1"),
    "hoist": arg(False, "bool"),
    "fused": arg(False, "bool"),
    "padded": arg(False, "bool"),
  },
)
target(
  "ops.LoopPlan.ladder",
  lambda count_capacity, ladder: ops.LoopPlan(bodies=2).ladder(count_capacity, ladder),
  {"count_capacity": arg(8, "size>=0"), "ladder": arg([8, 4], "ladder")},
)
target(
  "ops.Separable.split",
  lambda a: separable().split(a),
  {"a": arg(lambda: np.ones((3, 2), np.float32), "array")},
)
target(
  "ops.default_plan",
  ops.default_plan,
  {
    "backend": arg("cpu", "backend"),
    "sequences": arg(8, "size>=0"),
    "time": arg(16, "size>=0"),
  },
)
target(
  "ops.DecodeSettings",
  ops.DecodeSettings,
  {
    "bos_id": arg(0, "size>=0"),
    "eos_id": arg(1, "size>=0"),
    "max_length": arg(3, "size>=1"),
    "beam_size": arg(2, "size>=1"),
    "length_penalty": arg(0.6, "float32>=0"),
    "num_results": arg(None, "size>=1", none_ok=True),
    "ladder": arg(None, "ladder", none_ok=True),
    "plan": arg(None, "plan", none_ok=True),
  },
)
target(
  "ops.beam_search",
  ops.beam_search,
  {
    "step_fn": arg(lambda: step_log_probs, "callable"),
    "init_carry": arg(lambda: np.zeros((2, 1), np.float32), "carry"),
    "settings": arg(SETTINGS, "settings"),
    "static_inputs": arg(None, "rows", none_ok=True),
    "max_lengths": more(
      arg(lambda: np.array([3, 3]), "ints", none_ok=True),
      (
        "above_max_length",
        FromValid(lambda v: v + 1, r"<= `settings.max_length` \(3\); source 0 has 4\."),
      ),
      ("below_one", FromValid(lambda v: v * 0, r">= 1 .*; source 0 has 0\.")),
    ),
    "num_sources": arg(None, "size>=0", none_ok=True),
  },
)
target(
  "ops.ensemble_step",
  ops.ensemble_step,
  {"steps": arg(lambda: [step_log_probs], "callables")},
)

target(
  "ops.length_normalized",
  ops.length_normalized,
  {
    "logp": arg(lambda: np.array([-1.0, -2.5], np.float32), "array"),
    "steps": more(
      arg(lambda: np.array([2, 3]), "int_values"),
      ("negative", FromValid(lambda v: -v, r">= 0 .*; item 0 has -2\.")),
    ),
    # 400 keeps the penalty of 2 steps finite in float32, not that of 3.
    "length_penalty": more(
      arg(0.6, "float32>=0"),
      ("past_float32", FromValid(lambda v: 400.0, r"`steps` \(3\) .* float32")),
    ),
  },
)

# jaxlod.ops: attention ---------------------------------------------------------------

target(
  "ops.lod_memory",
  ops.lod_memory,
  {"memory": arg(lod, "lod"), "keys": arg(None, "lod", none_ok=True)},
)
target(
  "ops.as_memory",
  ops.as_memory,
  {
    "memory": arg(lambda: np.zeros((2, 3, 2), np.float32), "memory_like"),
    "lengths": arg(lambda: np.array([3, 1]), "ints", none_ok=True),
    "keys": arg(None, "keys", none_ok=True),
  },
)
target(
  "ops.masked_attention",
  ops.masked_attention,
  {
    "scores": arg(lambda: np.zeros((2, 3), np.float32), "matrix"),
    "memory": arg(lambda: np.zeros((2, 3, 2), np.float32), "matrix"),
    "lengths": arg(lambda: np.array([3, 1]), "ints"),
  },
)
target(
  "ops.attend",
  ops.attend,
  {
    "scores": arg(lambda: np.zeros((2, 2), np.float32), "matrix"),
    "memory": arg(memory, "memory"),
  },
)
QUERY = arg(lambda: np.ones((2, 2), np.float32), "matrix")
target(
  "ops.dot_scores", ops.dot_scores, {"query": QUERY, "memory": arg(memory, "memory")}
)
target(
  "ops.general_scores",
  ops.general_scores,
  {
    "query": QUERY,
    "memory": arg(memory, "memory"),
    "project": arg(lambda: lambda q: q, "callable"),
  },
)
target(
  "ops.additive_scores",
  ops.additive_scores,
  {
    "query": QUERY,
    "memory": arg(lambda: ops.lod_memory(lod(), lod()), "memory"),
    "project": arg(lambda: lambda q: q, "callable"),
    "energy": arg(lambda: lambda e: e[..., 0], "callable"),
  },
)
target(
  "ops.cosine_scores",
  ops.cosine_scores,
  {"query": QUERY, "memory": arg(memory, "memory"), "eps": arg(1e-8, "float32>0")},
)


def _cell(carry, x):
  return carry, x[:, :2]


def _double(rows):
  return rows * 2


def _attention(h, values, lengths):
  return ops.masked_attention(jnp.zeros(values.shape[:2]), values, lengths)


target(
  "ops.decoder_step",
  ops.decoder_step,
  {
    "cell": arg(lambda: _cell, "callable"),
    "attention": arg(lambda: _attention, "callable"),
    "x_t": arg(lambda: np.ones((2, 2), np.float32), "matrix"),
    "memory": arg(memory, "memory"),
    "input_feeding": arg(False, "bool"),
    "carry": keep(lambda: np.zeros((2, 2))),
  },
  unchecked={"carry": "the cell's carry, handed to `cell` as it is"},
)

# jaxlod.ops: attention inside each sequence ------------------------------------------

target(
  "ops.sequence_attention",
  ops.sequence_attention,
  {
    "query": arg(heads, "lod"),
    "key": arg(heads, "lod"),
    "value": arg(heads, "lod"),
    "causal": arg(False, "bool"),
    "scale": arg(None, "float", none_ok=True),
    "dropout_rate": arg(0.0, "rate"),
    "dropout_rng": arg(None, "key", none_ok=True),
    "plan": more(
      arg(None, "plan", none_ok=True), ("loop_plan", lambda: ops.LoopPlan())
    ),
  },
)
target(
  "ops.map_rows",
  ops.map_rows,
  {
    "fn": arg(lambda: _double, "callable"),
    "x": arg(lod, "lod"),
    "chunk": arg(None, "size>=1", none_ok=True),
  },
)
target(
  "ops.default_chunk",
  ops.default_chunk,
  {
    "token_capacity": arg(64, "size>=1"),
    "row_size": arg(512, "size>=0"),
    "backend": arg(None, "backend"),
  },
)
target(
  "ops.AttentionPlan",
  ops.AttentionPlan,
  {
    "tile_tokens": arg(128, "size>=1"),
    "ratio": arg(1.25, "ratio>1"),
    "minimum": arg(4, "size>=1"),
    "multiple": arg(4, "size>=1"),
    "weights": arg(2**20, "size>=1"),
    "kernel": arg("xla", "choice"),
  },
)
target(
  "ops.AttentionPlan.tiles",
  lambda time_capacity: ops.AttentionPlan().tiles(time_capacity),
  {"time_capacity": arg(8, "size>=0")},
)
target(
  "ops.default_attention_plan",
  ops.default_attention_plan,
  {"backend": arg(None, "backend")},
)

# jaxlod.data -------------------------------------------------------------------------

target(
  "data.Batcher",
  data.Batcher,
  {
    "examples": arg(lambda: [(np.ones(n, np.float32),) for n in (3, 1)], "examples"),
    "buckets": arg(Buckets.fixed(tokens=8, sequences=4, time=4), "buckets"),
    "token_budget": arg(None, "int>=1", none_ok=True),
    "window": arg(4, "int>=1"),
    "shuffle": arg(False, "bool"),
    "seed": arg(0, "int>=0"),
    "prefetch": arg(0, "int>=0"),
    "ladder": arg(None, "ladder", none_ok=True),
    "device_put": arg(None, "bool", none_ok=True),
    "tables": arg(True, "bool"),
    "shards": arg(None, "int>=1", none_ok=True),
    "process_index": arg(None, "int>=0", none_ok=True),
    "process_count": arg(None, "int>=1", none_ok=True),
  },
)
for _name in ("plan", "plan_shards", "batches_per_epoch"):
  target(
    f"data.Batcher.{_name}",
    getattr(data.Batcher, _name),
    {"epoch": arg(0, "int>=0")},
    call=method(batcher, _name),
  )
target(
  "data.Batcher.epoch",
  data.Batcher.epoch,
  {"epoch": arg(0, "int>=0")},
  call=lambda **kw: next(iter(batcher().epoch(**kw))),
)
target(
  "data.Batcher.set_state",
  data.Batcher.set_state,
  {"state": arg(lambda: batcher().get_state(), "mapping")},
  call=lambda **kw: batcher().set_state(**kw),
)
target(
  "data.plan_capacities",
  data.plan_capacities,
  {
    "lengths": arg(lambda: np.array([3, 1, 2]), "host_ints"),
    "token_budget": arg(8, "size>=1"),
    "batch_size": arg(None, "int>=0", none_ok=True),
    "ratios": arg((1.25,), "ratios"),
    "max_padding": arg(0.2, "rate"),
    "window": arg(4, "int>=0"),
    "seed": arg(0, "int>=0"),
  },
)
target(
  "data.Batcher.iterate",
  data.Batcher.iterate,
  {"start_step": arg(0, "int>=0", none_ok=True)},
  call=lambda **kw: next(batcher().iterate(**kw)),
)

# jaxlod.parallel ---------------------------------------------------------------------

for _name in ("data_parallel", "map_shards"):
  target(
    f"parallel.{_name}",
    getattr(parallel, _name),
    {
      "fn": arg(lambda: lambda a: a, "callable"),
      "mesh": arg(mesh, "mesh"),
      "axis": arg("data", "axis"),
      "check_vma": arg(True, "bool"),
    },
  )
target(
  "parallel.local_shards",
  parallel.local_shards,
  {"mesh": arg(mesh, "mesh"), "axis": arg("data", "axis")},
)
target(
  "parallel.shard_batch",
  parallel.shard_batch,
  {
    "batch": arg(lambda: next(batcher(shards=1).iterate()).fields, "stacked"),
    "mesh": arg(mesh, "mesh"),
    "axis": arg("data", "axis"),
  },
)
target(
  "parallel.replicate",
  parallel.replicate,
  {"tree": arg(lambda: np.zeros(2), "tree"), "mesh": arg(mesh, "mesh")},
)
target(
  "parallel.unstack", parallel.unstack, {"tree": arg(lambda: np.zeros(2), "stacked")}
)
target(
  "parallel.generate_corpus",
  parallel.generate_corpus,
  {
    "members": arg(lambda: (linen_model(), linen_params()), "members"),
    "sources": arg(lambda: [], "iterable"),
    "mesh": arg(mesh, "mesh"),
    "axis": arg("data", "axis"),
    "settings": arg(MODEL_SETTINGS, "settings"),
    "src_capacity": arg(4, "size>=1"),
    "slots": arg(2, "size>=1"),
    "max_length_fn": arg(None, "callable", none_ok=True),
    "refill": arg(None, "size>=1", none_ok=True),
    "chunk": arg(8, "size>=1"),
    "stats": arg(None, "mapping", none_ok=True),
    "rngs": arg(None, "mapping", none_ok=True),
  },
)
target(
  "parallel.generate",
  parallel.generate,
  {
    "members": arg(lambda: (linen_model(), linen_params()), "members"),
    "src": arg(lambda: parallel.shard_batch(stacked(ids()), mesh()), "lod"),
    "mesh": arg(mesh, "mesh"),
    "axis": arg("data", "axis"),
    "settings": arg(MODEL_SETTINGS, "settings"),
    "src_table": arg(None, "table", none_ok=True),
    "max_lengths": arg(None, "ints", none_ok=True),
    "rngs": arg(None, "mapping", none_ok=True),
  },
)


# jaxlod.testing ----------------------------------------------------------------------

target(
  "testing.check_independent",
  testing.check_independent,
  {
    "fn": arg(lambda: lambda x: ops.sequence_pool(x, "sum"), "callable"),
    "x": arg(lod, "lod"),
    "level": arg(-1, "level"),
    "perturbations": arg(("inf",), "perturbations"),
    "grads": arg(None, "bool", none_ok=True),
    "jit": arg(False, "bool"),
    "rtol": arg(0.0, "float>=0"),
    "atol": arg(0.0, "float>=0"),
    "seed": arg(0, "int>=0"),
  },
)


def _identity_step(plan, x):
  del plan
  return x


target(
  "ops.tune_plan",
  ops.tune_plan,
  {
    "fn": arg(lambda: _identity_step, "callable"),
    "candidates": arg(lambda: (ops.LoopPlan(),), "callables", none_ok=True),
    "repeats": arg(1, "int>=1"),
    "rtol": arg(1e-5, "float>=0"),
    "atol": arg(1e-6, "float>=0"),
  },
  call=lambda fn, **kwargs: ops.tune_plan(fn, jnp.ones(2), **kwargs),
)
