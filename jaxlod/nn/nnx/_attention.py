"""NNX attention over a LoD memory: dot, general, additive and cosine scores.

Every attention scores a decoder state ``query [b, hidden]`` against each
slot of a padded memory ``[b, source_capacity, features]`` (an encoder's
outputs, one sequence per query row), then calls
`jaxlod.ops.masked_attention`: padding slots get weight 0 and an empty
memory gives a zero context, never NaN.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlod._lod import LoDTensor
from jaxlod.ops._attention import masked_attention

COSINE_EPS = 1e-8


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def padded_memory(
  memory: LoDTensor | jax.typing.ArrayLike, lengths: jax.typing.ArrayLike | None
) -> tuple[jax.Array, jax.Array]:
  """``(memory [b, source_capacity, features], lengths [b])`` from either form.

  Args:
    memory: a LoDTensor ``values [source_tokens, features]`` (one sequence
      per query row, padded here with `LoDTensor.to_padded`), or a padded
      array ``[b, source_capacity, features]``.
    lengths: ``[b]`` real lengths; `None` exactly when `memory` is a
      LoDTensor.

  Raises:
    ValueError: for `lengths` given with a LoDTensor or missing with an
      array, or a memory that is not ``[b, source_capacity, features]``.
  """
  if isinstance(memory, LoDTensor):
    if lengths is not None:
      raise ValueError(
        "Expected `lengths` to be None when `memory` is a LoDTensor (its LoD "
        "gives the lengths)."
      )
    memory, lengths = memory.to_padded()
  elif lengths is None:
    raise ValueError(
      "Expected `lengths` [b] with a padded `memory` array; pass a LoDTensor "
      "memory to take the lengths from its LoD."
    )
  memory, lengths = jnp.asarray(memory), jnp.asarray(lengths)
  if memory.ndim != 3:
    raise ValueError(
      "Expected `memory` to have shape [b, source_capacity, features], got "
      f"{memory.shape}."
    )
  return memory, lengths


def _check_query(query: Any, memory: jax.Array, width: int, what: str) -> jax.Array:
  query = jnp.asarray(query)
  if query.ndim != 2:
    raise ValueError(f"Expected `query` to have shape [b, hidden], got {query.shape}.")
  if query.shape[0] != memory.shape[0]:
    raise ValueError(
      f"Expected `query` and `memory` to have the same number of rows (one "
      f"memory sequence per query row), got {query.shape[0]} and "
      f"{memory.shape[0]}."
    )
  if query.shape[1] != width:
    raise ValueError(
      f"Expected `query` to have width {width} ({what}), got width {query.shape[1]}."
    )
  return query


def _check_memory_width(memory: jax.Array, features: int) -> None:
  if memory.shape[-1] != features:
    raise ValueError(
      f"Expected `memory` rows of width {features} (the attention's "
      f"`features`), got width {memory.shape[-1]}."
    )


class DotAttention(nnx.Module):
  """Dot-product attention: ``score_j = <q, m_j>``. No parameters.

  The query's width must equal the memory's features.

  Example:
    >>> import numpy as np
    >>> from jaxlod.nn.nnx import DotAttention
    >>> memory = np.array([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]], np.float32)
    >>> query = np.zeros((1, 2), np.float32)
    >>> context, weights = DotAttention()(query, memory, np.array([2]))
    >>> context.tolist(), weights.tolist()
    ([[0.5, 0.5]], [[0.5, 0.5, 0.0]])
  """

  def keys(self, memory: Any) -> None:
    """Nothing to precompute: returns `None`."""
    del memory

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: LoDTensor | jax.typing.ArrayLike,
    lengths: jax.typing.ArrayLike | None = None,
    keys: Any = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends from `query` over `memory`.

    Args:
      query: ``[b, features]`` decoder states.
      memory: ``[b, source_capacity, features]`` padded memory, or a
        LoDTensor with one sequence per query row.
      lengths: ``[b]`` real lengths of a padded memory; `None` for a
        LoDTensor.
      keys: ignored (see `keys`).

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for a query whose width is not the memory's features (naming
        both), or shapes that disagree.
    """
    del keys
    memory, lengths = padded_memory(memory, lengths)
    query = _check_query(query, memory, memory.shape[-1], "the memory's features")
    scores = jnp.einsum("bf,bsf->bs", query, memory)
    return masked_attention(scores, memory, lengths)


class GeneralAttention(nnx.Module):
  """Luong's general (bilinear) attention: ``score_j = <W q, m_j>``.

  ``W`` is a bias-free ``nnx.Linear(hidden, features)`` named ``query``,
  applied to the query so the memory is never projected per step.

  Args:
    hidden: width of the query.
    features: width of the memory rows.
    dtype: computation dtype of the projection.
    param_dtype: dtype of its kernel.
    rngs: the RNGs for the kernel's initializer.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import GeneralAttention
    >>> seqs = [np.ones((3, 2), np.float32), np.ones((1, 2), np.float32)]
    >>> memory = LoDTensor.from_sequences(seqs)
    >>> attention = GeneralAttention(4, 2, rngs=nnx.Rngs(0))
    >>> context, weights = attention(np.ones((2, 4), np.float32), memory)
    >>> context.shape, weights.sum(-1).round(5).tolist()
    ((2, 2), [1.0, 1.0])
  """

  def __init__(
    self,
    hidden: int,
    features: int,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.query = nnx.Linear(
      hidden,
      features,
      use_bias=False,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )

  def keys(self, memory: Any) -> None:
    """Nothing to precompute: returns `None`."""
    del memory

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: LoDTensor | jax.typing.ArrayLike,
    lengths: jax.typing.ArrayLike | None = None,
    keys: Any = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends from `query` over `memory`.

    Args:
      query: ``[b, hidden]`` decoder states.
      memory: ``[b, source_capacity, features]`` padded memory, or a
        LoDTensor with one sequence per query row.
      lengths: ``[b]`` real lengths of a padded memory; `None` for a
        LoDTensor.
      keys: ignored (see `keys`).

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for a query or memory of the wrong width, or shapes that
        disagree.
    """
    del keys
    memory, lengths = padded_memory(memory, lengths)
    _check_memory_width(memory, self.query.out_features)
    query = _check_query(query, memory, self.query.in_features, "`hidden`")
    scores = jnp.einsum("bf,bsf->bs", self.query(query), memory)
    return masked_attention(scores, memory, lengths)


class AdditiveAttention(nnx.Module):
  """Bahdanau's additive attention: ``score_j = v . tanh(K m_j + Q q)``.

  ``K`` is a bias-free ``nnx.Linear(features, units)`` named ``key``, ``Q``
  an ``nnx.Linear(hidden, units)`` with bias named ``query`` and ``v`` a
  bias-free ``nnx.Linear(units, 1)`` named ``energy``. The keys ``K m``
  depend only on the memory: a decoder computes them once per source with
  `keys` and passes them to every step.

  Args:
    hidden: width of the query.
    features: width of the memory rows.
    units: width of the scoring layer.
    dtype: computation dtype of the projections.
    param_dtype: dtype of their parameters.
    rngs: the RNGs for the initializers.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import AdditiveAttention
    >>> seqs = [np.ones((3, 2), np.float32), np.ones((0, 2), np.float32)]
    >>> memory = LoDTensor.from_sequences(seqs)
    >>> attention = AdditiveAttention(4, 2, 8, rngs=nnx.Rngs(0))
    >>> keys = attention.keys(memory)
    >>> context, weights = attention(np.ones((2, 4), np.float32), memory, keys=keys)
    >>> (np.asarray(weights) * 3).round(4).tolist()
    [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
  """

  def __init__(
    self,
    hidden: int,
    features: int,
    units: int,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
    self.key = nnx.Linear(features, units, use_bias=False, **common)
    self.query = nnx.Linear(hidden, units, **common)
    self.energy = nnx.Linear(units, 1, use_bias=False, **common)

  def keys(self, memory: LoDTensor | jax.typing.ArrayLike) -> LoDTensor | jax.Array:
    """The memory's keys ``K m``, computed once per source.

    Args:
      memory: a LoDTensor ``values [source_tokens, features]`` or an array
        ``[..., source_capacity, features]``.

    Returns:
      A LoDTensor with `memory`'s LoD and values ``[source_tokens, units]``
      (padding rows stay zero: ``K`` has no bias), or an array ``[...,
      source_capacity, units]``.

    Raises:
      ValueError: for a memory whose rows are not ``features`` wide.
    """
    if isinstance(memory, LoDTensor):
      _check_memory_width(memory.values, self.key.in_features)
      return memory.with_values(self.key(memory.values))
    memory = jnp.asarray(memory)
    _check_memory_width(memory, self.key.in_features)
    return self.key(memory)

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: LoDTensor | jax.typing.ArrayLike,
    lengths: jax.typing.ArrayLike | None = None,
    keys: LoDTensor | jax.typing.ArrayLike | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends from `query` over `memory`.

    Args:
      query: ``[b, hidden]`` decoder states.
      memory: ``[b, source_capacity, features]`` padded memory, or a
        LoDTensor with one sequence per query row.
      lengths: ``[b]`` real lengths of a padded memory; `None` for a
        LoDTensor.
      keys: the precomputed ``keys(memory)``: ``[b, source_capacity, units]``
        or a LoDTensor with `memory`'s LoD; computed here when `None`.

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for a query, memory or keys of the wrong shape.
    """
    memory, lengths = padded_memory(memory, lengths)
    _check_memory_width(memory, self.key.in_features)
    query = _check_query(query, memory, self.query.in_features, "`hidden`")
    if keys is None:
      keys = self.key(memory)
    elif isinstance(keys, LoDTensor):
      keys = keys.to_padded()[0]
    units = self.key.out_features
    if _shape(keys) != (*memory.shape[:2], units):
      raise ValueError(
        f"Expected `keys` to have shape {(*memory.shape[:2], units)} ([b, "
        f"source_capacity, units] from `memory`), got {_shape(keys)}."
      )
    hidden = jnp.tanh(keys + self.query(query)[:, None, :])
    scores = self.energy(hidden)[..., 0]
    return masked_attention(scores, memory, lengths)


class CosineAttention(nnx.Module):
  """Cosine attention: ``score_j = <q, m_j> / (sqrt(|q|^2 + eps) sqrt(|m_j|^2 + eps))``.

  No parameters; the query's width must equal the memory's features.

  Args:
    eps: added under each square root, so zero vectors score 0 (default
      ``1e-8``).

  Example:
    >>> import numpy as np
    >>> from jaxlod.nn.nnx import CosineAttention
    >>> memory = np.array([[[2.0, 0.0], [0.0, 3.0]]], np.float32)
    >>> query = np.array([[1.0, 0.0]], np.float32)
    >>> _, weights = CosineAttention()(query, memory, np.array([2]))
    >>> round(float(weights[0, 0] / weights[0, 1]), 4)  # e^1 / e^0
    2.7183
  """

  def __init__(self, eps: float = COSINE_EPS):
    self.eps = eps

  def keys(self, memory: Any) -> None:
    """Nothing to precompute: returns `None`."""
    del memory

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: LoDTensor | jax.typing.ArrayLike,
    lengths: jax.typing.ArrayLike | None = None,
    keys: Any = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends from `query` over `memory`.

    Args:
      query: ``[b, features]`` decoder states.
      memory: ``[b, source_capacity, features]`` padded memory, or a
        LoDTensor with one sequence per query row.
      lengths: ``[b]`` real lengths of a padded memory; `None` for a
        LoDTensor.
      keys: ignored (see `keys`).

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for a query whose width is not the memory's features (naming
        both), or shapes that disagree.
    """
    del keys
    memory, lengths = padded_memory(memory, lengths)
    query = _check_query(query, memory, memory.shape[-1], "the memory's features")
    dot = jnp.einsum("bf,bsf->bs", query, memory)
    query_norm = jnp.sqrt(jnp.sum(query * query, axis=-1) + self.eps)
    memory_norm = jnp.sqrt(jnp.sum(memory * memory, axis=-1) + self.eps)
    scores = dot / (query_norm[:, None] * memory_norm)
    return masked_attention(scores, memory, lengths)
