"""Linen attention over a LoD memory: dot, general, additive and cosine scores.

Each module scores a decoder state ``query [b, hidden]`` against a memory
``[b, source_capacity, features]`` (one encoder output sequence per row,
padded) with a score function of `jaxlod.ops`, then calls
`jaxlod.ops.attend`: padding slots get weight exactly 0 and an empty memory
gives a zero context, never NaN. The memory may also be a one-level
LoDTensor holding one sequence per query row, or a `jaxlod.ops.Memory`.
The NNX twins live in `jaxlod.nn.nnx`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlod._checks import check_sizes
from jaxlod._lod import LoDTensor
from jaxlod.nn._decoding import attend_query
from jaxlod.nn._layer_checks import check_layer_dtypes
from jaxlod.ops import _memory_attention as core
from jaxlod.ops._memory_attention import without_keys


class Attention(nn.Module):
  """The call protocol of the attentions: subclasses define `scores`.

  ``attention(query, memory, lengths=None, keys=None) -> (context,
  weights)``, and ``keys(memory)``: what the attention computes once per
  memory (`None` but for `AdditiveAttention`), passed back as ``keys=`` to
  every step.
  """

  def keys(self, memory: Any) -> jax.Array | LoDTensor | None:
    """What this attention precomputes from a memory: nothing (`None`)."""
    del memory

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """Scores ``[b, source_capacity]`` of `query` ``[b, hidden]``."""
    raise NotImplementedError

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: Any,
    lengths: Any = None,
    keys: Any = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends `query` over `memory`.

    Args:
      query: ``[b, hidden]`` decoder states.
      memory: ``[b, source_capacity, features]`` padded memory, a one-level
        LoDTensor ``values [src_token_capacity, features]`` with ``b``
        sequences, or a `jaxlod.ops.Memory`.
      lengths: ``[b]`` int real lengths of an array `memory`; `None`
        otherwise.
      keys: ``keys(memory)``, ``[b, source_capacity, units]`` or a LoDTensor
        with `memory`'s LoD; computed here when `None` (additive attention
        only: the others take none).

    Returns:
      ``(context [b, features], weights [b, source_capacity])``.

    Raises:
      ValueError: for mismatched shapes or widths (naming both).
    """
    return attend_query(self.scores, query, memory, lengths, keys)


class DotAttention(Attention):
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

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """``jaxlod.ops.dot_scores``: the query must be as wide as the memory."""
    return core.dot_scores(query, without_keys(memory, "DotAttention"))


class GeneralAttention(Attention):
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
  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """``jaxlod.ops.general_scores`` with the ``query`` projection."""
    check_layer_dtypes(self.dtype, self.param_dtype)
    memory = without_keys(memory, "GeneralAttention")
    features = memory.values.shape[-1]
    project = nn.Dense(
      features,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name="query",
    )
    return core.general_scores(query, memory, project)


class AdditiveAttention(Attention):
  """Bahdanau's additive attention: ``score_j = v · tanh(K m_j + Q q)``.

  ``K`` is a bias-free dense layer ``features -> units`` named ``key``,
  ``Q`` a dense layer ``hidden -> units`` with bias named ``query`` and
  ``v`` a bias-free dense layer ``units -> 1`` named ``energy``. The keys
  ``K m`` depend only on the memory: compute them once with `keys` and pass
  them to every step as ``keys=`` (`AttentionDecoder` does), so the memory is
  not projected again at each step. ``K`` has no bias, so padding rows of a
  LoDTensor memory stay zero in its keys.

  Attributes:
    units: width of the hidden scoring layer.
    dtype, param_dtype: as `GeneralAttention`'s, for all three layers.

  Example:
    >>> import jax, numpy as np
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
    check_sizes(units=self.units)
    check_layer_dtypes(self.dtype, self.param_dtype)

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
    return core.map_memory(self.key, memory)

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """``jaxlod.ops.additive_scores``, computing the keys when the memory
    has none."""
    if memory.keys is None:
      memory = memory._replace(keys=self.key(memory.values))
    elif self.is_initializing():
      self.key(memory.values[:, :0])  # `key` gets its parameters even when unused.
    return core.additive_scores(query, memory, self.query, self.energy)


class CosineAttention(Attention):
  """Cosine attention: ``score_j = <q, m_j> / (|q|_eps |m_j|_eps)``.

  ``|v|_eps = sqrt(|v|^2 + eps)``, so zero vectors (padding slots, a zero
  query) give finite scores and gradients, in every float dtype (the scores
  are computed in float32 or wider, see `jaxlod.ops.cosine_scores`). No
  parameters.

  Attributes:
    eps: added to each squared norm (default 1e-8); a float32 normal
      number (`jaxlod.ops.cosine_scores` says why), else a `ValueError`.

  Example:
    >>> import numpy as np, jax
    >>> from jaxlod.nn import CosineAttention
    >>> memory = np.array([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])
    >>> context, weights = CosineAttention().apply({}, np.ones((1, 2)), memory, [2])
    >>> weights.tolist()
    [[0.5, 0.5, 0.0]]
  """

  eps: float = core.COSINE_EPS

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """``jaxlod.ops.cosine_scores``: the query must be as wide as the memory."""
    memory = without_keys(memory, "CosineAttention")
    return core.cosine_scores(query, memory, self.eps)
