"""Losses over LoDTensors: the cross-entropy of every real row."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxlod._checks import (
  all_hold,
  check_float,
  check_integer,
  require_each,
  static_float,
)
from jaxlod._faults import Fault, fault_unless, with_faults
from jaxlod._lod import LoDTensor, check_lod
from jaxlod._lod_checks import check_same_lod


def sequence_cross_entropy(
  logits: LoDTensor, labels: LoDTensor, *, label_smoothing: float = 0.0
) -> LoDTensor:
  """The softmax cross-entropy of every row, as a LoDTensor (Paddle's
  ``cross_entropy`` over a LoDTensor, with optax's losses).

  Row ``i``'s loss is ``-sum_v q_i[v] log softmax(logits_i)[v]`` in float32
  (or wider), the target ``q_i`` the one-hot of ``labels_i`` or, with
  `label_smoothing` ``s``, ``(1 - s) * one_hot + s / vocab``
  (`optax.smooth_labels`). Padding rows give 0, so ``losses.values.sum()``
  is the summed loss of the real rows and ``losses.num_rows`` their number.

  Args:
    logits: a LoDTensor ``values [token_capacity, vocab]`` of floats.
    labels: a LoDTensor of int ids in ``[0, vocab)`` (in its real rows),
      ``values [token_capacity]`` or ``[token_capacity, 1]``, with the LoD
      of `logits` (the same capacities; the same offsets).
    label_smoothing: ``s`` in ``[0, 1]``; 0 uses the integer labels
      directly.

  Returns:
    A LoDTensor with `logits`' LoD and values ``[token_capacity]``, and the
    faults of both inputs. Under `jit`, offsets that differ or a label
    outside ``[0, vocab)`` set `jaxlod.Fault.INPUT` in its ``faults`` (host
    reads of it raise): such a row's loss is meaningless (NaN, or the loss
    of another class).

  Raises:
    TypeError: for inputs that are not LoDTensors, float labels or integer
      logits.
    ValueError: for shapes or capacities that differ, a `label_smoothing`
      outside ``[0, 1]``; eagerly, for offsets that differ or a real row's
      label outside ``[0, vocab)`` (under `jit` these are
      `jax.experimental.checkify` checks, and the result is faulted).

  Example:
    >>> import numpy as np
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.ops import sequence_cross_entropy
    >>> logits = LoDTensor.from_sequences([np.zeros((2, 4)), np.zeros((1, 4))])
    >>> labels = LoDTensor.from_sequences([[1, 3], [0]])
    >>> losses = sequence_cross_entropy(logits, labels)
    >>> [round(float(x), 4) for x in losses.values], int(losses.num_rows)
    ([1.3863, 1.3863, 1.3863], 3)
  """
  logits, labels = check_lod(logits, "logits"), check_lod(labels, "labels")
  values, ok = _check_rows(logits, labels)
  label_smoothing = static_float(label_smoothing, "label_smoothing")
  if not 0.0 <= label_smoothing <= 1.0:
    raise ValueError(f"Expected `label_smoothing` in [0, 1], got {label_smoothing!r}.")
  scores = logits.values.astype(jnp.promote_types(logits.values.dtype, jnp.float32))
  if label_smoothing:
    targets = jax.nn.one_hot(values, scores.shape[-1], dtype=scores.dtype)
    targets = optax.smooth_labels(targets, label_smoothing)
    loss = optax.softmax_cross_entropy(scores, targets)
  else:
    loss = optax.softmax_cross_entropy_with_integer_labels(scores, values)
  out = logits.with_values(jnp.where(logits.row_mask(), loss, 0.0))
  return with_faults(out, labels, fault_unless(ok, Fault.INPUT))


def _check_rows(logits: LoDTensor, labels: LoDTensor) -> Any:
  """The label ids ``[token_capacity]``, once the two LoDTensors agree, and
  whether their offsets agree and every real label is a class (`require`:
  `True` eagerly, a bool scalar under `jit`)."""
  check_float(logits.values.dtype, "logits.values")
  check_integer(labels.values.dtype, "labels.values")
  if logits.values.ndim != 2:
    raise ValueError(
      "Expected `logits.values` to have shape [token_capacity, vocab], got "
      f"{tuple(logits.values.shape)}."
    )
  values = labels.values
  if values.ndim == 2 and values.shape[1] == 1:
    values = values[:, 0]
  if values.shape != logits.values.shape[:1] or labels.capacity != logits.capacity:
    raise ValueError(
      f"Expected `labels` with the capacities of `logits` ({logits.capacity}) and "
      f"values [token_capacity] or [token_capacity, 1], got {labels.capacity} and "
      f"values of shape {tuple(labels.values.shape)}."
    )
  same = check_same_lod(logits, labels, "logits", "labels", "sequence_cross_entropy")
  classes = logits.values.shape[1]
  bad = logits.row_mask() & ((values < 0) | (values >= classes))
  known = require_each(
    bad,
    f"Expected `labels` in [0, {classes}) (the classes of `logits`), got {{value}} "
    "at row {i}.",
    value=values,
  )
  return values, all_hold(same, known)
