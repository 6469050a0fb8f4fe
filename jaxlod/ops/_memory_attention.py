"""The attention-decoder core: a typed memory, scores, the masked softmax and
the decoder step, as pure functions.

A decoder step attends from its state ``query [b, hidden]`` over an
encoder's outputs, the external memory: a `Memory` of padded values ``[b,
source_capacity, features]``, the real ``lengths [b]`` and, for additive
attention, the precomputed ``keys [b, source_capacity, units]``. The Linen
and NNX layers in `jaxlod.nn` and `jaxlod.nn.nnx` hold the parameters and
call these functions; a `Memory` passes through `dynamic_rnn` and
`beam_search` as a static input (its leaves have one row per sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlod._checks import (
  check_bool,
  check_callable,
  check_index_leaves,
  check_rank,
  check_width,
  finite_float32,
  is_concrete,
  is_integer_dtype,
  require_each,
)
from jaxlod._host import as_array, check_fits_device
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.ops._loop._dispatch import dispatch
from jaxlod.ops._loop._plan import LoopPlan
from jaxlod.ops._rank import RankTable, nan_unless

COSINE_EPS = 1e-8


class Memory(NamedTuple):
  """An encoder's outputs as a decoder step reads them, one row per query.

  A pytree whose leaves all have the batch ``b`` as leading dimension, so
  it can be a static input of `dynamic_rnn` (reordered by rank and shrunk
  to each phase's batch) or of `beam_search` (repeated for each beam).

  Attributes:
    values: ``[b, source_capacity, features]`` padded memory.
    lengths: ``[b]`` int real lengths, ``0 <= lengths <= source_capacity``.
    keys: ``[b, source_capacity, units]`` what the attention precomputes
      from the memory (additive attention's ``K m``), or `None`.
  """

  values: jax.Array
  lengths: jax.Array
  keys: jax.Array | None = None


jax.export.register_namedtuple_serialization(
  Memory, serialized_name="jaxlod.ops.Memory"
)


def lod_memory(memory: LoDTensor, keys: LoDTensor | None = None) -> Memory:
  """The `Memory` of a one-level LoDTensor and its precomputed keys.

  Args:
    memory: a LoDTensor ``values [src_token_capacity, features]``, one
      sequence per decoder row.
    keys: a LoDTensor with `memory`'s LoD and values ``[src_token_capacity,
      units]`` (keys computed once on the packed rows), or `None`.

  Returns:
    ``Memory(values [count_capacity, time_capacity, features], lengths
    [count_capacity], keys [count_capacity, time_capacity, units] | None)``.

  Raises:
    TypeError, ValueError: for a memory that is not a one-level LoDTensor of
      vectors, or keys that are not a LoDTensor.
  """
  return padded_memory(check_memory_lod(memory), keys)


def padded_memory(memory: LoDTensor, keys: LoDTensor | None = None) -> Memory:
  """`lod_memory` of a memory that `check_memory_lod` has checked (the keys
  are checked here)."""
  values, lengths = memory.to_padded()
  if keys is not None:
    keys = check_lod(keys, "keys").to_padded()[0]
  return Memory(values, lengths, keys)


def as_memory(
  memory: Memory | LoDTensor | jax.typing.ArrayLike,
  lengths: jax.typing.ArrayLike | None = None,
  keys: LoDTensor | jax.typing.ArrayLike | None = None,
) -> Memory:
  """A `Memory` from any of the forms an attention layer accepts.

  Args:
    memory: a `Memory` (then `lengths` and `keys` are `None`), a one-level
      LoDTensor ``values [src_token_capacity, features]`` (its LoD gives
      the lengths), or a padded array ``[b, source_capacity, features]``.
    lengths: ``[b]`` int real lengths of an array `memory`, else `None`.
    keys: precomputed keys ``[b, source_capacity, units]``, or a LoDTensor
      with `memory`'s LoD; `None` when there are none.

  Returns:
    A `Memory`. Under `jit`, a length outside ``[0, source_capacity]`` gives
    values all NaN and every length ``source_capacity``, so that every
    context over it is NaN.

  Raises:
    ValueError: for a missing or redundant `lengths`, a LoDTensor with more
      than one level or rows that are not vectors, or an array of the
      wrong rank.
  """
  memory, fits = memory_and_fits(memory, lengths, keys)
  if fits is True:
    return memory
  # A failed check: NaN values over every slot, each one real, so that every
  # context over this memory is NaN (an attention never reads padding slots).
  capacity = memory.values.shape[1]
  return memory._replace(
    values=nan_unless(fits, memory.values),
    lengths=jnp.where(fits, memory.lengths, capacity).astype(memory.lengths.dtype),
  )


def memory_and_fits(
  memory: Memory | LoDTensor | jax.typing.ArrayLike,
  lengths: jax.typing.ArrayLike | None = None,
  keys: LoDTensor | jax.typing.ArrayLike | None = None,
) -> tuple[Memory, Any]:
  """`as_memory` with the check of an array's `lengths` apart: ``(memory,
  fits)``, `fits` `True` or (under `jit`) whether every length is in
  ``[0, source_capacity]``. An attention poisons its outputs with it, not
  the whole memory (a pass over every value at every decoding step)."""
  if isinstance(memory, Memory):
    if lengths is not None or keys is not None:
      raise ValueError(
        "Got `lengths` or `keys` with a `Memory`, which holds both; pass "
        "`lengths=None` and `keys=None`."
      )
    return memory, True
  if isinstance(keys, LoDTensor):
    keys = keys.to_padded()[0]
  elif keys is not None:
    keys = as_array(keys, "keys", "an array, a LoDTensor or None")
  if isinstance(memory, LoDTensor):
    if lengths is not None:
      raise ValueError(
        "Got `lengths` with a LoDTensor `memory`, whose LoD gives the lengths; "
        "pass `lengths=None`."
      )
    values, lengths = check_memory_lod(memory).to_padded()
    return Memory(values, lengths, _check_padded_keys(keys, values)), True
  values = as_array(
    memory,
    "memory",
    "a Memory, a one-level LoDTensor or an array [b, source_capacity, features]",
  )
  if lengths is None:
    raise ValueError(
      "Expected `lengths` [b] (real slots of each memory row) with an array "
      "`memory`; only a LoDTensor `memory` takes `lengths=None`."
    )
  if values.ndim != 3:
    raise ValueError(
      "Expected `memory` to have shape [b, source_capacity, features], got "
      f"{values.shape}."
    )
  check_fits_device(lengths, "lengths")
  lengths = as_array(lengths, "lengths")
  if lengths.shape != values.shape[:1]:
    raise ValueError(
      f"Expected `lengths` to have shape ({values.shape[0]},) (one per memory "
      f"row), got {lengths.shape}."
    )
  if not is_integer_dtype(lengths.dtype):
    raise TypeError(
      f"Expected `lengths` to have an integer dtype, got {lengths.dtype}."
    )
  fits = _check_lengths(lengths, values.shape[1])
  return Memory(values, lengths, _check_padded_keys(keys, values)), fits


def _check_lengths(lengths: jax.Array, capacity: int) -> Any:
  """Every length in ``[0, capacity]`` (`require_each`: eagerly raises,
  under `jit` returns whether they are)."""
  return require_each(
    (lengths < 0) | (lengths > capacity),
    f"Expected `lengths` in [0, {capacity}] (the source capacity), got {{length}} "
    "at index {i}.",
    length=lengths,
  )


def _check_padded_keys(keys: jax.Array | None, values: jax.Array) -> jax.Array | None:
  """Padded keys are ``[b, source_capacity, units]``, like the memory's rows."""
  if keys is not None and (keys.ndim != 3 or keys.shape[:2] != values.shape[:2]):
    raise ValueError(
      f"Expected `keys` to have shape [b, source_capacity, units] = "
      f"[{values.shape[0]}, {values.shape[1]}, units] (from `memory`), got "
      f"{keys.shape}."
    )
  return keys


def map_memory(
  fn: Callable[[jax.Array], jax.Array], memory: LoDTensor | jax.typing.ArrayLike
) -> LoDTensor | jax.Array:
  """`fn` over the rows of a memory: a LoDTensor's packed values (keeping
  its LoD) or an array's last axis."""
  if isinstance(memory, LoDTensor):
    return memory.with_values(fn(memory.values))
  memory = as_array(memory, "memory", "a LoDTensor or an array")
  check_rank(memory.shape, "memory", (3,), "[b, source_capacity, features]")
  return fn(memory)


def dot_scores(query: jax.typing.ArrayLike, memory: Memory) -> jax.Array:
  """Dot-product scores ``<q, m_j>``: ``[b, source_capacity]``.

  Raises:
    ValueError: for a query that is not ``[b, features]`` (naming both).
  """
  query = check_query(query, memory)
  check_width("query", query.shape[-1], memory.values.shape[-1], "memory features")
  return jnp.einsum("bf,bsf->bs", query, memory.values)


def general_scores(
  query: jax.typing.ArrayLike, memory: Memory, project: Callable[[jax.Array], jax.Array]
) -> jax.Array:
  """Luong's general scores ``<W q, m_j>``: ``[b, source_capacity]``.

  Args:
    query: ``[b, hidden]``.
    memory: the `Memory`, values ``[b, source_capacity, features]``.
    project: ``W``, ``[b, hidden] -> [b, features]`` (a bias-free dense
      layer): the query is projected, never the memory.
  """
  check_callable(project, "project")
  return dot_scores(project(check_query(query, memory)), memory)


def additive_scores(
  query: jax.typing.ArrayLike,
  memory: Memory,
  project: Callable[[jax.Array], jax.Array],
  energy: Callable[[jax.Array], jax.Array],
) -> jax.Array:
  """Bahdanau's additive scores ``v · tanh(K m_j + Q q)``: ``[b, source_capacity]``.

  Args:
    query: ``[b, hidden]``.
    memory: the `Memory`, with ``keys = K m`` ``[b, source_capacity,
      units]``.
    project: ``Q``, ``[b, hidden] -> [b, units]``.
    energy: ``v``, ``[..., units] -> [..., 1]``.

  Raises:
    ValueError: for keys of the wrong shape (naming both).
  """
  check_callable(project, "project")
  check_callable(energy, "energy")
  projected = project(check_query(query, memory))
  check_keys(memory, projected.shape[-1])
  return energy(jnp.tanh(memory.keys + projected[:, None, :]))[..., 0]


def cosine_scores(
  query: jax.typing.ArrayLike, memory: Memory, eps: float = COSINE_EPS
) -> jax.Array:
  """Cosine scores ``<q, m_j> / (|q|_eps |m_j|_eps)``: ``[b, source_capacity]``.

  ``|v|_eps = sqrt(|v|^2 + eps)``, so zero vectors (padding slots, a zero
  query) give finite scores and gradients for any ``eps > 0`` that float32
  can hold. The scores are computed in float32 or wider (in float16 the
  default `eps` rounds to 0 and ``|v|^2`` overflows past 256) and returned
  in the inputs' dtype.

  Raises:
    TypeError: for an `eps` that is not a static float.
    ValueError: for an `eps` below float32's smallest normal number (0
      included: NaN at padding slots) or not finite in float32.
  """
  query = check_query(query, memory)
  eps = check_eps(eps)
  dtype = jnp.result_type(query, memory.values)
  wide = jnp.promote_types(dtype, jnp.float32)
  query, values = query.astype(wide), memory.values.astype(wide)
  dots = dot_scores(query, memory._replace(values=values))
  query_norm = jnp.sqrt(jnp.sum(query * query, axis=-1) + eps)
  memory_norm = jnp.sqrt(jnp.sum(values * values, axis=-1) + eps)
  return (dots / (query_norm[:, None] * memory_norm)).astype(dtype)


def masked_attention(
  scores: jax.typing.ArrayLike,
  memory: jax.typing.ArrayLike,
  lengths: jax.typing.ArrayLike,
) -> tuple[jax.Array, jax.Array]:
  """Softmax of `scores` over each row's real memory slots, and the context.

  The memory is an encoder's output as a decoder step sees it (a LoDTensor
  static input of `dynamic_rnn` arrives padded): row ``i`` has
  ``lengths[i]`` real slots. Padding slots get weight exactly 0 and their
  values never reach the context (an inf or NaN there included); a row with
  an empty memory gets zero weights and a zero context, never NaN, and no
  gradient flows through its scores.

  Args:
    scores: ``[b, source_capacity]`` float attention scores.
    memory: ``[b, source_capacity, features]`` padded memory.
    lengths: ``[b]`` integer real lengths, ``0 <= lengths <= source_capacity``.

  Returns:
    ``(context [b, features], weights [b, source_capacity])``. Under `jit`, a
    length outside ``[0, source_capacity]`` turns both NaN (every item), so
    the failed check is loud in any loss.

  Raises:
    ValueError: for shapes that disagree (naming both); eagerly, for a
      length outside ``[0, source_capacity]`` (under `jit` a
      `jax.experimental.checkify` check, and the results are NaN).

  Example:
    >>> import numpy as np
    >>> from jaxlod.ops import masked_attention
    >>> memory = np.array([[[1.0], [3.0], [9.0]], [[5.0], [0.0], [0.0]]])
    >>> context, weights = masked_attention(np.zeros((2, 3)), memory, np.array([2, 0]))
    >>> context.tolist(), weights.tolist()
    ([[2.0], [0.0]], [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
  """
  return _masked_attention(scores, memory, lengths, check_lengths=True)


def _masked_attention(
  scores: Any, memory: Any, lengths: Any, *, check_lengths: bool
) -> tuple[jax.Array, jax.Array]:
  """`masked_attention`, checking the range of `lengths` only when
  `check_lengths` (the shapes always: they are static)."""
  check_fits_device(lengths, "lengths")
  scores = as_array(scores, "scores")
  memory = as_array(memory, "memory")
  lengths = as_array(lengths, "lengths")
  if scores.ndim != 2:
    raise ValueError(
      f"Expected `scores` to have shape [b, source_capacity], got {scores.shape}."
    )
  if memory.ndim != 3 or memory.shape[:2] != scores.shape:
    raise ValueError(
      f"Expected `memory` to have shape [b, source_capacity, features] = "
      f"[{scores.shape[0]}, {scores.shape[1]}, features] (from `scores`), got "
      f"{memory.shape}."
    )
  if lengths.shape != scores.shape[:1]:
    raise ValueError(
      f"Expected `lengths` to have shape ({scores.shape[0]},) (one per row of "
      f"`scores`), got {lengths.shape}."
    )
  if not is_integer_dtype(lengths.dtype):
    raise TypeError(
      f"Expected `lengths` to have an integer dtype, got {lengths.dtype}."
    )
  fits = _check_lengths(lengths, scores.shape[1]) if check_lengths else True
  real = jnp.arange(scores.shape[1])[None, :] < lengths[:, None]
  masked = jnp.where(real, scores, -jnp.inf)
  top = jnp.max(masked, axis=1, keepdims=True, initial=-jnp.inf)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  exp = jnp.where(real, jnp.exp(jnp.where(real, scores - top, 0.0)), 0.0)
  total = jnp.sum(exp, axis=1, keepdims=True)
  weights = exp / jnp.where(total > 0, total, 1.0)
  # Padding slots are selected out, not multiplied by their zero weight: an
  # inf or NaN there (whatever a padded memory holds past its lengths) would
  # turn the context NaN.
  memory = jnp.where(real[:, :, None], memory, jnp.zeros((), memory.dtype))
  context = jnp.einsum("bs,bsf->bf", weights, memory)
  return nan_unless(fits, (context, weights))


def attend(scores: jax.typing.ArrayLike, memory: Memory) -> tuple[jax.Array, jax.Array]:
  """`masked_attention` of `scores` over a `Memory`: ``(context [b,
  features], weights [b, source_capacity])``.

  A decoder calls this at every step, so under `jit` the memory's lengths
  are not checked here but where the `Memory` was made: `lod_memory` takes
  them from a LoD, `as_memory` checks them (its values NaN under `jit` for a
  length outside ``[0, source_capacity]``). Eagerly they are checked here
  too, as `masked_attention` checks them.
  """
  memory = check_memory(memory)
  return _masked_attention(
    scores, memory.values, memory.lengths, check_lengths=is_concrete(memory.lengths)
  )


def decoder_step(
  cell: Callable[[Any, jax.Array], tuple[Any, jax.Array]],
  attention: Callable[..., tuple[jax.Array, jax.Array]],
  carry: Any,
  x_t: jax.typing.ArrayLike,
  memory: Memory,
  *,
  input_feeding: bool = False,
) -> tuple[Any, jax.Array, jax.Array]:
  """One step of an attention decoder over a batch of rows.

  ::

    x = concat(x_t, prev_context) if input_feeding else x_t
    carry, h = cell(carry, x)
    context, weights = attention(h, memory.values, memory.lengths[, keys=memory.keys])
    y = concat(h, context)

  Args:
    cell: ``cell(carry, x [b, in]) -> (carry, h [b, hidden])``.
    attention: ``attention(query [b, hidden], memory [b, source_capacity,
      features], lengths [b]) -> (context [b, features], weights [b,
      source_capacity])``, called with ``keys=memory.keys`` when the memory
      has keys.
    carry: the cell's carry (leaves ``[b, ...]``), or ``(cell_carry,
      prev_context [b, features])`` with `input_feeding`.
    x_t: ``[b, input_features]`` this step's inputs.
    memory: the `Memory`, one row per batch row.
    input_feeding: feed the previous context into the cell with the input
      (Luong's input feeding).

  Returns:
    ``(carry, y [b, hidden + features], weights [b, source_capacity])``.
  """
  check_callable(cell, "cell")
  check_callable(attention, "attention")
  x_t = as_array(x_t, "x_t")
  check_rank(x_t.shape, "x_t", (2,), "[b, input_features]")
  memory = check_memory(memory)
  if check_bool(input_feeding, "input_feeding"):
    carry, fed = carry
    x_t = jnp.concatenate([x_t, fed.astype(x_t.dtype)], axis=-1)
  carry, h = cell(carry, x_t)
  if memory.keys is None:
    context, weights = attention(h, memory.values, memory.lengths)
  else:
    context, weights = attention(h, memory.values, memory.lengths, keys=memory.keys)
  y = jnp.concatenate([h, context.astype(h.dtype)], axis=-1)
  if input_feeding:
    carry = (carry, context.astype(fed.dtype))
  return carry, y, weights


def run_decoder(
  step: Callable[[Any, jax.Array, Memory], tuple[Any, jax.Array, jax.Array]],
  tgt: LoDTensor,
  memory: Memory,
  init_carry: Any,
  *,
  return_weights: bool = False,
  table: RankTable | None = None,
  ladder: Any = None,
  remat: bool = True,
  plan: LoopPlan | None = None,
) -> LoDTensor | tuple[LoDTensor, LoDTensor]:
  """An attention decoder over every target sequence (teacher forcing).

  `dynamic_rnn` of ``step(carry, x_t, memory) -> (carry, y_t, weights)``
  (e.g. `decoder_step` over a layer's parameters) with `memory` as its
  static input: reordered by rank once and shrunk to each phase's batch.

  Args:
    step: the pure decoder step.
    tgt: a LoDTensor ``values [token_capacity, input_features]``, checked by
      the caller (`check_lod`).
    memory: the `Memory`, leaves ``[count_capacity, ...]`` in `tgt`'s order.
    init_carry: the carry, leaves ``[count_capacity, ...]`` in `tgt`'s order.
    return_weights, table, ladder, remat, plan: see
      `jaxlod.nn.AttentionDecoder` and `dynamic_rnn`.

  Returns:
    The outputs ``y_t`` as a LoDTensor with `tgt`'s LoD, and with
    `return_weights` the weights ``[token_capacity, source_capacity]`` too.
  """

  def step_fn(carry: Any, x_t: jax.Array, memory: Memory) -> tuple[Any, Any]:
    carry, y, weights = step(carry, x_t, memory)
    return carry, ((y, weights) if return_weights else y)

  # The decoder checked `tgt`: the front door's dispatcher takes it as it is.
  outputs, _ = dispatch(
    step_fn,
    tgt,
    init_carry=init_carry,
    static_inputs=memory,
    reverse=False,
    table=table,
    ladder=ladder,
    remat=remat,
    plan=plan,
  )
  return outputs


# -- memories, queries and keys --------------------------------------------------


def check_memory_lengths(memory: Memory, name: str = "memory") -> None:
  """A `jaxlod.ops.Memory`'s ``lengths`` stay integer (a tree map that cast
  them would mask the wrong source rows)."""
  check_index_leaves(
    [(f"`{name}.lengths`", memory.lengths)],
    "the lengths mask the source rows, so a tree map over a Memory must leave "
    "them alone (cast `values` and `keys` only).",
  )


def check_memory(memory: Any, name: str = "memory") -> Memory:
  """`memory` must be a `jaxlod.ops.Memory` (see `jaxlod.ops.lod_memory`)."""
  if not isinstance(memory, Memory):
    raise TypeError(
      f"Expected `{name}` to be a jaxlod.ops.Memory (see `lod_memory` and "
      f"`as_memory`), got {type(memory).__name__}."
    )
  check_memory_lengths(memory, name)
  return memory


def check_memory_lod(memory: Any, name: str = "memory") -> LoDTensor:
  """`memory` must be a LoDTensor of one level with vector rows.

  Raises:
    TypeError: for a memory that is not a LoDTensor.
    ValueError: for more than one level or rows that are not vectors.
  """
  return check_memory_rows(check_lod(memory, name), name)


def check_memory_rows(memory: LoDTensor, name: str = "memory") -> LoDTensor:
  """The structure `check_memory_lod` asks of a LoDTensor `memory`: one
  level, vector rows (a LoDTensor whose LoD is checked elsewhere)."""
  if memory.num_levels != 1 or len(memory.feature_shape) != 1:
    raise ValueError(
      f"Expected a LoDTensor `{name}` with one LoD level and values [src_tokens, "
      f"features], got {memory.num_levels} level(s) and values of shape "
      f"{tuple(memory.values.shape)}."
    )
  return memory


def without_keys(memory: Memory, name: str) -> Memory:
  """An attention that precomputes nothing takes no `keys`."""
  if memory.keys is not None:
    raise ValueError(
      f"{name} precomputes no keys (its `keys(memory)` is None), got `keys` of "
      f"shape {tuple(memory.keys.shape)}."
    )
  return memory


def check_query(query: jax.typing.ArrayLike, memory: Memory) -> jax.Array:
  """`query` must be ``[b, hidden]`` with one memory row per query row."""
  memory = check_memory(memory)
  query = as_array(query, "query")
  if query.ndim != 2:
    raise ValueError(f"Expected `query` to have shape [b, hidden], got {query.shape}.")
  if query.shape[0] != memory.values.shape[0]:
    raise ValueError(
      f"Expected one memory sequence per query row: `query` has {query.shape[0]} "
      f"rows, `memory` has {memory.values.shape[0]} sequences (count capacity)."
    )
  return query


def check_keys(memory: Memory, units: int) -> None:
  """`memory.keys` must be ``[b, source_capacity, units]``."""
  expected = (*memory.values.shape[:2], units)
  if memory.keys is None or tuple(memory.keys.shape) != expected:
    got = None if memory.keys is None else tuple(memory.keys.shape)
    raise ValueError(
      f"Expected `keys` to have shape [b, source_capacity, units] = {expected}, "
      f"got {got}."
    )


def check_eps(eps: Any) -> float:
  """The cosine attention's ``eps``: a static float > 0, finite and nonzero
  in float32 (`finite_float32`)."""
  return finite_float32(eps, "eps", positive=True)
