"""NNX attention over a LoD memory: dot, general, additive and cosine scores.

The twins of `jaxlod.nn`'s attentions, with the same call protocol, the same
score functions of `jaxlod.ops` and the same errors; the constructors take
the input widths (``hidden``, ``features``) and ``rngs``, as Flax's NNX
layers do.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlod._checks import check_sizes, check_width
from jaxlod._lod import LoDTensor
from jaxlod.nn._decoding import attend_query
from jaxlod.nn._layer_checks import check_layer_dtypes
from jaxlod.ops import _memory_attention as core
from jaxlod.ops._memory_attention import check_eps, without_keys


class Attention(nnx.Module):
  """The call protocol of the attentions (see `jaxlod.nn.Attention`):
  subclasses define `scores`."""

  def keys(self, memory: Any) -> jax.Array | LoDTensor | None:
    """What this attention precomputes from a memory: nothing (`None`), as
    `jaxlod.nn.Attention.keys`."""
    del memory

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """Scores ``[b, source_capacity]`` of `query` ``[b, hidden]``: as
    `jaxlod.nn.Attention.scores`."""
    raise NotImplementedError

  def __call__(
    self,
    query: jax.typing.ArrayLike,
    memory: Any,
    lengths: Any = None,
    keys: Any = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Attends `query` over `memory`: as `jaxlod.nn.Attention.__call__`."""
    return attend_query(self.scores, query, memory, lengths, keys)


def _linear(inputs: int, outputs: int, bias: bool, **common: Any) -> nnx.Linear:
  return nnx.Linear(inputs, outputs, use_bias=bias, **common)


class DotAttention(Attention):
  """Dot-product attention: ``score_j = <q, m_j>``. No parameters.

  Example:
    >>> import numpy as np
    >>> from jaxlod.nn.nnx import DotAttention
    >>> memory = np.array([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]], np.float32)
    >>> query = np.zeros((1, 2), np.float32)
    >>> context, weights = DotAttention()(query, memory, np.array([2]))
    >>> context.tolist(), weights.tolist()
    ([[0.5, 0.5]], [[0.5, 0.5, 0.0]])
  """

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """``jaxlod.ops.dot_scores``."""
    return core.dot_scores(query, without_keys(memory, "DotAttention"))


class GeneralAttention(Attention):
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
    check_sizes(hidden=hidden, features=features)
    check_layer_dtypes(dtype, param_dtype)
    self.query = nnx.Linear(
      hidden, features, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """``jaxlod.ops.general_scores`` with the ``query`` projection."""
    memory = without_keys(memory, "GeneralAttention")
    check_width("query", query.shape[-1], self.query.in_features, "`hidden`")
    features = memory.values.shape[-1]
    check_width("memory", features, self.query.out_features, "`features`")
    return core.general_scores(query, memory, self.query)


class AdditiveAttention(Attention):
  """Bahdanau's additive attention: ``score_j = v · tanh(K m_j + Q q)``.

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
    >>> memory = LoDTensor.from_sequences([np.ones((3, 2)), np.ones((0, 2))])
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
    check_sizes(hidden=hidden, features=features, units=units)
    check_layer_dtypes(dtype, param_dtype)
    common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
    self.key = _linear(features, units, False, **common)
    self.query = _linear(hidden, units, True, **common)
    self.energy = _linear(units, 1, False, **common)

  def keys(self, memory: LoDTensor | jax.typing.ArrayLike) -> LoDTensor | jax.Array:
    """The keys ``K m`` (see `jaxlod.nn.AdditiveAttention.keys`)."""
    return core.map_memory(self._key, memory)

  def _key(self, values: jax.Array) -> jax.Array:
    check_width("memory", values.shape[-1], self.key.in_features, "`features`")
    return self.key(values)

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """``jaxlod.ops.additive_scores``, computing the keys when the memory
    has none."""
    features = memory.values.shape[-1]
    check_width("memory", features, self.key.in_features, "`features`")
    check_width("query", query.shape[-1], self.query.in_features, "`hidden`")
    if memory.keys is None:
      memory = memory._replace(keys=self.key(memory.values))
    return core.additive_scores(query, memory, self.query, self.energy)


class CosineAttention(Attention):
  """Cosine attention (see `jaxlod.nn.CosineAttention`). No parameters.

  Args:
    eps: added to each squared norm (default 1e-8); a float32 normal
      number (`jaxlod.ops.cosine_scores` says why), else a `ValueError`.

  Example:
    >>> import numpy as np
    >>> from jaxlod.nn.nnx import CosineAttention
    >>> memory = np.array([[[2.0, 0.0], [0.0, 3.0]]], np.float32)
    >>> query = np.array([[1.0, 0.0]], np.float32)
    >>> _, weights = CosineAttention()(query, memory, np.array([2]))
    >>> round(float(weights[0, 0] / weights[0, 1]), 4)  # e^1 / e^0
    2.7183
  """

  def __init__(self, eps: float = core.COSINE_EPS):
    self.eps = check_eps(eps)

  def scores(self, query: jax.Array, memory: core.Memory) -> jax.Array:
    """``jaxlod.ops.cosine_scores``."""
    memory = without_keys(memory, "CosineAttention")
    return core.cosine_scores(query, memory, self.eps)
