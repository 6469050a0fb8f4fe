"""PyTorch's `PackedSequence` to and from a LoDTensor.

torch is imported when a converter is called, never at import time. Values
travel through NumPy on the CPU, exactly (``bfloat16`` through ``float32``,
which holds every ``bfloat16`` value); 64-bit data is stored as JAX stores
it, in 32 bits unless ``jax_enable_x64`` is on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

from jaxlod._buckets import Buckets
from jaxlod._checks import check_integer
from jaxlod._host import check_no_bools, host_ints, host_numbers
from jaxlod._lod import LoDTensor, check_lod

if TYPE_CHECKING:
  from torch.nn.utils.rnn import PackedSequence

_FIELDS = ("data", "batch_sizes", "sorted_indices", "unsorted_indices")


def _import_torch(caller: str) -> Any:
  try:
    import torch
  except ImportError as error:
    raise ImportError(
      f"jaxlod.interop.{caller} needs PyTorch, which is not installed: "
      "pip install 'jaxlod[interop]' (or torch)."
    ) from error
  return torch


def _to_numpy(tensor: Any, torch: Any) -> np.ndarray | None:
  """A torch tensor (any device, with grad or not) as a NumPy array."""
  if tensor is None or not isinstance(tensor, torch.Tensor):
    return None if tensor is None else np.asarray(tensor)
  tensor = tensor.detach().cpu()
  if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16; ml_dtypes does
    return tensor.float().numpy().astype(jnp.bfloat16)
  return tensor.numpy()


def _to_torch(array: np.ndarray, torch: Any) -> Any:
  """A NumPy array (writable, owned) as a CPU torch tensor."""
  if array.dtype == jnp.bfloat16:
    return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
  return torch.from_numpy(array)


def from_packed_sequence(
  packed: PackedSequence, *, buckets: Buckets | None = None
) -> LoDTensor:
  """Builds a one-level LoDTensor from a PyTorch `PackedSequence`.

  A `PackedSequence` stores its sequences sorted by length, longest first,
  and time-major: the ``batch_sizes[t]`` sequences still running at step
  ``t`` give one row each, in sorted order. ``sorted_indices[r]`` is the
  original index of the sequence at rank ``r`` and ``unsorted_indices`` its
  inverse; `None` (as `pack_sequence` gives with ``enforce_sorted=True``)
  means the identity, or the inverse of the other. The LoDTensor holds the
  sequences in their original order, as `pad_packed_sequence` returns
  them. Values go through NumPy on the CPU, exactly; float64 and int64
  data become 32-bit, as JAX stores them, unless ``jax_enable_x64`` is on.

  Args:
    packed: a `torch.nn.utils.rnn.PackedSequence`: ``data [rows,
      *features]``, ``batch_sizes [time]`` and the two index permutations
      ``[count]``.
    buckets: capacity policy; `None` means exact sizes.

  Returns:
    A one-level LoDTensor of ``batch_sizes[0]`` sequences.

  Raises:
    ImportError: when torch is not installed.
    TypeError: for a `packed` without the four fields.
    ValueError: for a ``batch_sizes`` that is not positive, increases, or
      does not sum to the rows of ``data``, or indices that are not
      inverse permutations; the message names the index and the values.

  Example:
    >>> import torch
    >>> from torch.nn.utils.rnn import pack_sequence
    >>> from jaxlod.interop import from_packed_sequence
    >>> seqs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])]
    >>> packed = pack_sequence(seqs, enforce_sorted=False)
    >>> packed.data.tolist(), packed.batch_sizes.tolist()
    ([3.0, 1.0, 4.0, 2.0, 5.0], [2, 2, 1])
    >>> x = from_packed_sequence(packed)
    >>> x.recursive_lengths(), x.values.tolist()
    ([[2, 3]], [1.0, 2.0, 3.0, 4.0, 5.0])
  """
  torch = _import_torch("from_packed_sequence")
  if not all(hasattr(packed, field) for field in _FIELDS):
    raise TypeError(
      "Expected `packed` to be a torch.nn.utils.rnn.PackedSequence (with "
      f"{', '.join(_FIELDS)}), got {type(packed).__name__}."
    )
  data = _to_numpy(packed.data, torch)
  if data.ndim == 0:
    raise ValueError(
      "Expected `packed.data` to have rank >= 1 ([rows, *features]), got a scalar."
    )
  sizes = check_batch_sizes(_to_numpy(packed.batch_sizes, torch), data.shape[0])
  count = int(sizes[0]) if sizes.size else 0
  ranks = check_sort_indices(
    _to_numpy(packed.sorted_indices, torch),
    _to_numpy(packed.unsorted_indices, torch),
    count,
  )
  # Sizes never increase: the sequence at rank r runs while sizes[t] > r.
  by_rank = np.searchsorted(-sizes, -np.arange(count), side="left")
  lengths = by_rank[ranks]
  step_starts = np.concatenate([[0], np.cumsum(sizes)])
  sequence = np.repeat(np.arange(count), lengths)
  step = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  rows = step_starts[step] + ranks[sequence]
  return LoDTensor.from_lengths(data[rows], [lengths], buckets=buckets)


def to_packed_sequence(x: LoDTensor) -> PackedSequence:
  """The real sequences of a one-level LoDTensor as a PyTorch `PackedSequence`.

  What `torch.nn.utils.rnn.pack_sequence` gives for ``x.to_list()`` with
  ``enforce_sorted=False``: sequences sorted by length, longest first, ties
  in their original order (a stable sort), with ``sorted_indices`` and
  ``unsorted_indices``, so that `pad_packed_sequence` and the recurrent
  layers give results in the original order. Values go through NumPy to
  CPU tensors, exactly. Host only.

  Args:
    x: a one-level LoDTensor whose sequences are not empty (torch forbids
      zero lengths). Padding sequences and rows are not included. For a
      nested tensor, take the level you need first.

  Returns:
    A `torch.nn.utils.rnn.PackedSequence` with int64 ``batch_sizes``,
    ``sorted_indices`` and ``unsorted_indices``.

  Raises:
    ImportError: when torch is not installed.
    TypeError: for an `x` that is not a LoDTensor.
    ValueError: for more than one level, no sequence, or an empty sequence
      (naming its index); a faulted tensor, or a call under `jit`.

  Example:
    >>> import numpy as np
    >>> from torch.nn.utils.rnn import pad_packed_sequence
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.interop import to_packed_sequence
    >>> x = LoDTensor.from_lengths(np.arange(1.0, 6.0), [[2, 3]])
    >>> packed = to_packed_sequence(x)
    >>> packed.data.tolist(), packed.batch_sizes.tolist()
    ([3.0, 1.0, 4.0, 2.0, 5.0], [2, 2, 1])
    >>> padded, lengths = pad_packed_sequence(packed, batch_first=True)
    >>> padded.tolist(), lengths.tolist()
    ([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]], [2, 3])
  """
  torch = _import_torch("to_packed_sequence")
  x = check_lod(x, "x", levels=(1,))
  offsets = x.row_splits()[0]
  lengths = np.diff(offsets)
  check_packable(lengths, "to_packed_sequence")
  order = np.argsort(-lengths, kind="stable")
  steps = np.arange(lengths[order[0]])
  running = steps[:, None] < lengths[order][None, :]
  rows = (offsets[order][None, :] + steps[:, None])[running]
  return torch.nn.utils.rnn.PackedSequence(
    _to_torch(np.asarray(x.values)[rows], torch),
    torch.from_numpy(running.sum(axis=1).astype(np.int64)),
    torch.from_numpy(order.astype(np.int64)),
    torch.from_numpy(np.argsort(order).astype(np.int64)),
  )


# -- the PackedSequence fields ---------------------------------------------------


def check_batch_sizes(batch_sizes: Any, num_rows: int) -> np.ndarray:
  """A PackedSequence's ``batch_sizes`` (host), as int64 ``[time]``.

  Raises:
    TypeError: for non-integer sizes.
    ValueError: for sizes that are not 1-D, a size that is not positive, a
      size larger than the one before it, or sizes whose sum is not
      `num_rows` (the rows of ``data``); the message names the index and
      the values.
  """
  check_no_bools(batch_sizes, "batch_sizes")
  sizes = host_numbers(batch_sizes, "batch_sizes")
  if sizes.ndim != 1:
    raise ValueError(
      f"Expected `batch_sizes` to be 1-D ([time]), got shape {sizes.shape}."
    )
  if sizes.size:
    check_integer(sizes.dtype, "batch_sizes")
  sizes = sizes.astype(np.int64)
  bad = np.flatnonzero(sizes <= 0)
  if bad.size:
    i = int(bad[0])
    raise ValueError(
      f"`batch_sizes` index {i}: {sizes[i]}, expected a positive size (a "
      "PackedSequence holds no empty sequence)."
    )
  rises = np.flatnonzero(np.diff(sizes) > 0)
  if rises.size:
    i = int(rises[0]) + 1
    raise ValueError(
      f"`batch_sizes` index {i}: {sizes[i]} is more than {sizes[i - 1]} at index "
      f"{i - 1}; a PackedSequence's batch sizes never increase."
    )
  total = sum(int(n) for n in sizes)
  if total != num_rows:
    raise ValueError(f"`batch_sizes` sum to {total}, but `data` has {num_rows} rows.")
  return sizes


def _permutation(value: Any, name: str, count: int) -> np.ndarray:
  """A permutation of ``range(count)`` (host), as int64."""
  perm = host_ints(value, name, count, "one per sequence, batch_sizes[0]")
  out = np.flatnonzero((perm < 0) | (perm >= count))
  if out.size:
    i = int(out[0])
    raise ValueError(
      f"`{name}` index {i}: {perm[i]} is outside [0, {count}); expected a "
      f"permutation of range({count})."
    )
  _, first = np.unique(perm, return_index=True)
  again = np.ones(count, bool)
  again[first] = False
  if np.any(again):
    i = int(np.flatnonzero(again)[0])
    j = int(np.flatnonzero(perm == perm[i])[0])
    raise ValueError(
      f"`{name}` index {i}: {perm[i]} repeats index {j}; expected a permutation "
      f"of range({count})."
    )
  return perm


def check_sort_indices(sorted_indices: Any, unsorted_indices: Any, count: int):
  """The rank of each original sequence of a PackedSequence (host).

  Args:
    sorted_indices: ``[count]``, the original index of the sequence at each
      rank; `None` for the inverse of `unsorted_indices`.
    unsorted_indices: ``[count]``, the rank of each original sequence;
      `None` for the inverse of `sorted_indices`. Both `None`: the identity.
    count: the number of sequences.

  Returns:
    int64 ``[count]``: the rank of each original sequence.

  Raises:
    ValueError: for indices that are not a permutation, or two that are not
      inverses; the message names the index and the values.
  """
  if sorted_indices is None and unsorted_indices is None:
    return np.arange(count)
  if sorted_indices is None:
    return _permutation(unsorted_indices, "unsorted_indices", count)
  order = _permutation(sorted_indices, "sorted_indices", count)
  ranks = np.empty(count, np.int64)
  ranks[order] = np.arange(count)
  if unsorted_indices is not None:
    given = _permutation(unsorted_indices, "unsorted_indices", count)
    bad = np.flatnonzero(given != ranks)
    if bad.size:
      i = int(bad[0])
      raise ValueError(
        f"`unsorted_indices` index {i}: {given[i]}, but `sorted_indices` puts "
        f"sequence {i} at index {ranks[i]}; expected the inverse of "
        "`sorted_indices`."
      )
  return ranks


def check_packable(lengths: np.ndarray, where: str) -> None:
  """Real lengths a PackedSequence can hold: at least one, none zero (host)."""
  if lengths.size == 0:
    raise ValueError(
      f"{where}: the tensor has no sequences; a PackedSequence holds at least one."
    )
  empty = np.flatnonzero(lengths == 0)
  if empty.size:
    i = int(empty[0])
    raise ValueError(
      f"{where}: sequence {i} is empty (length 0); a PackedSequence cannot hold "
      "empty sequences (torch forbids zero lengths)."
    )
