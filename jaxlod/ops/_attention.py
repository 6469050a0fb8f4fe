"""Attention over a padded LoD memory: the masked softmax and the context."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_attention(
  scores: jax.typing.ArrayLike,
  memory: jax.typing.ArrayLike,
  lengths: jax.typing.ArrayLike,
) -> tuple[jax.Array, jax.Array]:
  """Softmax of `scores` over each row's real memory slots, and the context.

  The memory is an encoder's output as a decoder step sees it (a LoDTensor
  static input of `dynamic_rnn` arrives padded): row ``i`` has
  ``lengths[i]`` real slots. Padding slots get weight exactly 0; a row with
  an empty memory gets zero weights and a zero context, never NaN, and no
  gradient flows through its scores.

  Args:
    scores: ``[b, source_capacity]`` float attention scores.
    memory: ``[b, source_capacity, features]`` padded memory.
    lengths: ``[b]`` integer real lengths, ``0 <= lengths <= source_capacity``.

  Returns:
    ``(context [b, features], weights [b, source_capacity])``.

  Raises:
    ValueError: for shapes that disagree (naming both).

  Example:
    >>> import numpy as np
    >>> from jaxlod.ops import masked_attention
    >>> memory = np.array([[[1.0], [3.0], [9.0]], [[5.0], [0.0], [0.0]]])
    >>> context, weights = masked_attention(np.zeros((2, 3)), memory, np.array([2, 0]))
    >>> context.tolist(), weights.tolist()
    ([[2.0], [0.0]], [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
  """
  scores, memory, lengths = (jnp.asarray(a) for a in (scores, memory, lengths))
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
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(
      f"Expected `lengths` to have an integer dtype, got {lengths.dtype}."
    )
  real = jnp.arange(scores.shape[1])[None, :] < lengths[:, None]
  masked = jnp.where(real, scores, -jnp.inf)
  top = jnp.max(masked, axis=1, keepdims=True, initial=-jnp.inf)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  exp = jnp.where(real, jnp.exp(jnp.where(real, scores - top, 0.0)), 0.0)
  total = jnp.sum(exp, axis=1, keepdims=True)
  weights = exp / jnp.where(total > 0, total, 1.0)
  context = jnp.einsum("bs,bsf->bf", weights, memory)
  return context, weights
