"""Linen attention over a LoD memory: dot, general, additive and cosine scores.

Each module scores a decoder state ``query [b, hidden]`` against a memory
``[b, source_capacity, features]`` (one encoder output sequence per row,
padded), then calls `jaxlod.ops.masked_attention`: padding slots get weight
exactly 0 and an empty memory gives a zero context, never NaN. The memory may
also be a one-level LoDTensor holding one sequence per query row.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlod._lod import LoDTensor
from jaxlod.ops._attention import masked_attention

COSINE_EPS = 1e-8


def check_memory_lod(memory: LoDTensor) -> LoDTensor:
  """A LoDTensor memory has one level and vector rows ``[src_tokens, F]``."""
  if memory.num_levels != 1 or len(memory.feature_shape) != 1:
    raise ValueError(
      "Expected a LoDTensor `memory` with one LoD level and values [src_tokens, "
      f"features], got {memory.num_levels} level(s) and values of shape "
      f"{tuple(memory.values.shape)}."
    )
  return memory


def padded_memory(
  memory: jax.typing.ArrayLike | LoDTensor, lengths: jax.typing.ArrayLike | None
) -> tuple[jax.Array, jax.Array]:
  """``(memory [b, source_capacity, features], lengths [b])`` from either form.

  Args:
    memory: a padded array ``[b, source_capacity, features]`` or a one-level
      LoDTensor ``values [src_token_capacity, features]``.
    lengths: ``[b]`` real lengths for an array `memory`; `None` for a
      LoDTensor (its LoD gives them).

  Raises:
    ValueError: for a missing or redundant `lengths`, a LoDTensor with more
      than one level or with rows that are not vectors, or an array of the
      wrong rank.
  """
  if isinstance(memory, LoDTensor):
    if lengths is not None:
      raise ValueError(
        "Got `lengths` with a LoDTensor `memory`, whose LoD gives the lengths; "
        "pass `lengths=None`."
      )
    return check_memory_lod(memory).to_padded()
  if lengths is None:
    raise ValueError(
      "Expected `lengths` [b] (real slots of each memory row) with an array "
      "`memory`; only a LoDTensor `memory` takes `lengths=None`."
    )
  memory = jnp.asarray(memory)
  if memory.ndim != 3:
    raise ValueError(
      "Expected `memory` to have shape [b, source_capacity, features], got "
      f"{memory.shape}."
    )
  return memory, jnp.asarray(lengths)


def _check_query(query: jax.typing.ArrayLike, memory: jax.Array) -> jax.Array:
  query = jnp.asarray(query)
  if query.ndim != 2:
    raise ValueError(f"Expected `query` to have shape [b, hidden], got {query.shape}.")
  if query.shape[0] != memory.shape[0]:
    raise ValueError(
      f"Expected one memory sequence per query row: `query` has {query.shape[0]} "
      f"rows, `memory` has {memory.shape[0]} sequences (count capacity)."
    )
  return query


def _check_same_width(query: jax.Array, memory: jax.Array, name: str) -> None:
  if query.shape[-1] != memory.shape[-1]:
    raise ValueError(
      f"{name} needs a query as wide as the memory: got query width (hidden) "
      f"{query.shape[-1]} and memory features {memory.shape[-1]}; "
      "GeneralAttention and AdditiveAttention attend across widths."
    )


class DotAttention(nn.Module):
  """Dot-product attention: ``score_j = <q, m_j>``. No parameters.

  Example:
    >>> import numpy as np, jax
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import DotAttention
    >>> memory = LoDTensor.from_sequences([np.ones((2, 3)), np.ones((1, 3))])
    >>> context, weights = DotAttention().apply({}, np.ones((2, 3)), memory)
    >>> context.shape, weights.tolist()
    ((2, 3), [[0.5, 0.5], [1.0, 0.0]])
  """

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: jax.typing.ArrayLike | LoDTensor,
    lengths: jax.typing.ArrayLike | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends `query` over `memory`.

    Args:
      query: ``[b, hidden]`` decoder states; ``hidden`` must equal the
        memory's ``features``.
      memory: ``[b, source_capacity, features]`` padded memory, or a
        one-level LoDTensor ``values [src_token_capacity, features]`` with
        ``b`` sequences.
      lengths: ``[b]`` int real lengths of an array `memory`; `None` for a
        LoDTensor.

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for mismatched shapes or widths (naming both).
    """
    memory, lengths = padded_memory(memory, lengths)
    query = _check_query(query, memory)
    _check_same_width(query, memory, "DotAttention")
    scores = jnp.einsum("bh,bsh->bs", query, memory)
    return masked_attention(scores, memory, lengths)


class GeneralAttention(nn.Module):
  """Luong's general (bilinear) attention: ``score_j = <W q, m_j>``.

  ``W`` is a bias-free dense layer ``hidden -> features`` named ``query``.
  It projects the query, not the memory, so a decoder step never projects
  the memory.

  Attributes:
    dtype: computation dtype of the projection (`None`: inferred).
    param_dtype: dtype of the kernel.

  Example:
    >>> import numpy as np, jax
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import GeneralAttention
    >>> memory = LoDTensor.from_sequences([np.ones((2, 3)), np.ones((1, 3))])
    >>> attention = GeneralAttention()
    >>> params = attention.init(jax.random.key(0), np.ones((2, 5)), memory)
    >>> params["params"]["query"]["kernel"].shape
    (5, 3)
    >>> context, weights = attention.apply(params, np.ones((2, 5)), memory)
    >>> context.shape, weights.shape
    ((2, 3), (2, 2))
  """

  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: jax.typing.ArrayLike | LoDTensor,
    lengths: jax.typing.ArrayLike | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends `query` over `memory`.

    Args:
      query: ``[b, hidden]`` decoder states.
      memory: ``[b, source_capacity, features]`` padded memory, or a
        one-level LoDTensor ``values [src_token_capacity, features]`` with
        ``b`` sequences.
      lengths: ``[b]`` int real lengths of an array `memory`; `None` for a
        LoDTensor.

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for mismatched shapes (naming both).
    """
    memory, lengths = padded_memory(memory, lengths)
    query = _check_query(query, memory)
    projected = nn.Dense(
      memory.shape[-1],
      use_bias=False,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name="query",
    )(query)
    scores = jnp.einsum("bf,bsf->bs", projected, memory)
    return masked_attention(scores, memory, lengths)


class AdditiveAttention(nn.Module):
  """Bahdanau's additive attention: ``score_j = v . tanh(K m_j + Q q)``.

  ``K`` is a bias-free dense layer ``features -> units`` named ``key``,
  ``Q`` a dense layer ``hidden -> units`` with bias named ``query`` and
  ``v`` a bias-free dense layer ``units -> 1`` named ``energy``. The keys
  ``K m`` depend only on the memory: compute them once with `keys` and pass
  them to every step as ``keys=`` (`AttentionDecoder` does), so the memory is
  not projected again at each step. ``K`` has no bias, so padding rows of a
  LoDTensor memory stay zero in its keys.

  Attributes:
    units: width of the hidden scoring layer.
    dtype: computation dtype of the layers (`None`: inferred).
    param_dtype: dtype of the parameters.

  Example:
    >>> import numpy as np, jax
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import AdditiveAttention
    >>> memory = LoDTensor.from_sequences([np.ones((2, 3)), np.ones((1, 3))])
    >>> attention = AdditiveAttention(units=4)
    >>> params = attention.init(jax.random.key(0), np.ones((2, 5)), memory)
    >>> keys = attention.apply(params, memory, method="keys")
    >>> keys.values.shape
    (3, 4)
    >>> context, weights = attention.apply(params, np.ones((2, 5)), memory, keys=keys)
    >>> context.shape, weights.tolist()
    ((2, 3), [[0.5, 0.5], [1.0, 0.0]])
  """

  units: int
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def setup(self):
    def dense(features, use_bias):
      return nn.Dense(
        features, use_bias=use_bias, dtype=self.dtype, param_dtype=self.param_dtype
      )

    self.key = dense(self.units, False)
    self.query = dense(self.units, True)
    self.energy = dense(1, False)

  def keys(self, memory: jax.typing.ArrayLike | LoDTensor) -> jax.Array | LoDTensor:
    """The keys ``K m``, which depend only on the memory.

    Args:
      memory: ``[..., source_capacity, features]``, or a LoDTensor ``values
        [src_token_capacity, features]`` (computed on its packed rows).

    Returns:
      ``[..., source_capacity, units]``, or a LoDTensor with `memory`'s LoD
      and values ``[src_token_capacity, units]``.
    """
    if isinstance(memory, LoDTensor):
      return memory.with_values(self.key(memory.values))
    return self.key(jnp.asarray(memory))

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: jax.typing.ArrayLike | LoDTensor,
    lengths: jax.typing.ArrayLike | None = None,
    keys: jax.typing.ArrayLike | LoDTensor | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends `query` over `memory`.

    Args:
      query: ``[b, hidden]`` decoder states.
      memory: ``[b, source_capacity, features]`` padded memory, or a
        one-level LoDTensor ``values [src_token_capacity, features]`` with
        ``b`` sequences.
      lengths: ``[b]`` int real lengths of an array `memory`; `None` for a
        LoDTensor.
      keys: the precomputed ``keys(memory)``: ``[b, source_capacity, units]``
        or a LoDTensor with `memory`'s LoD; computed here when `None`.

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for mismatched shapes (naming both).
    """
    memory, lengths = padded_memory(memory, lengths)
    query = _check_query(query, memory)
    if keys is None:
      keys = self.keys(memory)
    else:
      if self.is_initializing():
        self.keys(memory[:, :0])  # `key` gets its parameters even when unused.
      keys = keys.to_padded()[0] if isinstance(keys, LoDTensor) else jnp.asarray(keys)
      expected = (*memory.shape[:2], self.units)
      if keys.shape != expected:
        raise ValueError(
          f"Expected `keys` to have shape [b, source_capacity, units] = {expected}, "
          f"got {keys.shape}."
        )
    hidden = jnp.tanh(keys + self.query(query)[:, None, :])
    scores = self.energy(hidden)[..., 0]
    return masked_attention(scores, memory, lengths)


class CosineAttention(nn.Module):
  """Cosine attention: ``score_j = <q, m_j> / (|q|_eps |m_j|_eps)``.

  ``|v|_eps = sqrt(|v|^2 + eps)``, so zero vectors (padding slots, a zero
  query) give finite scores and gradients. No parameters.

  Attributes:
    eps: added to each squared norm (default 1e-8).

  Example:
    >>> import numpy as np, jax
    >>> from jaxlod.nn import CosineAttention
    >>> memory = np.array([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])
    >>> context, weights = CosineAttention().apply({}, np.ones((1, 2)), memory, [2])
    >>> weights.tolist()
    [[0.5, 0.5, 0.0]]
  """

  eps: float = COSINE_EPS

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: jax.typing.ArrayLike | LoDTensor,
    lengths: jax.typing.ArrayLike | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends `query` over `memory`.

    Args:
      query: ``[b, hidden]`` decoder states; ``hidden`` must equal the
        memory's ``features``.
      memory: ``[b, source_capacity, features]`` padded memory, or a
        one-level LoDTensor ``values [src_token_capacity, features]`` with
        ``b`` sequences.
      lengths: ``[b]`` int real lengths of an array `memory`; `None` for a
        LoDTensor.

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for mismatched shapes or widths (naming both).
    """
    memory, lengths = padded_memory(memory, lengths)
    query = _check_query(query, memory)
    _check_same_width(query, memory, "CosineAttention")
    dots = jnp.einsum("bh,bsh->bs", query, memory)
    query_norm = jnp.sqrt(jnp.sum(query**2, axis=-1) + self.eps)
    memory_norm = jnp.sqrt(jnp.sum(memory**2, axis=-1) + self.eps)
    scores = dots / (query_norm[:, None] * memory_norm)
    return masked_attention(scores, memory, lengths)
