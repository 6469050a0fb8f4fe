"""Lossless converters: padded batches, segment ids, row splits, PackedSequence."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlod import Buckets, LoDTensor
from jaxlod.interop import from_packed_sequence, to_packed_sequence
from tests.helpers import (
  FEATURES,
  ONE_LEVEL,
  TWO_LEVEL,
  assert_lod_equal,
  assert_valid,
  lod_tensors,
  recursive_lengths,
)

# Shared jitted functions: one compile per capacity.
_to_padded = jax.jit(lambda x: x.to_padded())
_to_segment_ids = jax.jit(lambda x: x.to_segment_ids())


def _buckets(x: LoDTensor) -> Buckets:
  return ONE_LEVEL if x.num_levels == 1 else TWO_LEVEL


def _real_rows(x: LoDTensor) -> np.ndarray:
  return np.asarray(x.values)[: int(x.num_rows)]


@st.composite
def _nonempty(draw, max_sequences: int = 6):
  """A one-level LoDTensor on ONE_LEVEL whose sequences are not empty."""
  lengths = draw(st.lists(st.integers(1, 5), max_size=max_sequences))
  seed = draw(st.integers(0, 2**31 - 1))
  values = np.random.default_rng(seed).normal(size=(sum(lengths), FEATURES))
  return LoDTensor.from_lengths(values.astype(np.float32), [lengths], buckets=ONE_LEVEL)


# -- padded batches (flax.linen.RNN's inputs and seq_lengths) ------------------------


@settings(max_examples=40)
@given(x=lod_tensors(num_levels=1))
def test_padded_round_trip(x):
  padded, seq_lengths = _to_padded(x)
  y = LoDTensor.from_padded(
    padded, seq_lengths, num_sequences=x.num_sequences(), buckets=ONE_LEVEL
  )
  assert_lod_equal(y, x)


@settings(max_examples=20)
@given(x=lod_tensors(num_levels=2))
def test_padded_holds_the_last_level_only(x):
  padded, seq_lengths = _to_padded(x)
  last = Buckets.fixed(tokens=48, sequences=12, time=5)
  y = LoDTensor.from_padded(
    padded, seq_lengths, num_sequences=x.num_sequences(), buckets=last
  )
  expected = LoDTensor.from_row_splits(_real_rows(x), x.row_splits()[-1:], buckets=last)
  assert_lod_equal(y, expected)


_PADDED = Buckets.fixed(tokens=30, sequences=6, time=5)


@settings(max_examples=30)
@given(
  lengths=st.lists(st.integers(0, 5), min_size=6, max_size=6),
  seed=st.integers(0, 2**16),
)
def test_padded_batch_round_trip(lengths, seed):
  # Padded -> LoDTensor -> padded: the same batch, zeros past each end.
  padded = np.random.default_rng(seed).normal(size=(6, 5, FEATURES))
  padded = padded.astype(np.float32)
  x = LoDTensor.from_padded(padded, lengths, buckets=_PADDED)
  assert_valid(x)
  again, seq_lengths = _to_padded(x)
  assert np.asarray(seq_lengths).tolist() == lengths
  inside = np.arange(5)[None, :, None] < np.asarray(lengths)[:, None, None]
  np.testing.assert_array_equal(np.asarray(again), np.where(inside, padded, 0))


@pytest.mark.parametrize(
  ("lengths", "kwargs", "error", "match"),
  [
    (
      [1, 4],
      {},
      ValueError,
      r"LoD level 0, index 1: length 4 is outside \[0, 3\] \(the time dimension "
      r"of `padded`\)\.",
    ),
    (
      [1, 2],
      {"num_sequences": 1},
      ValueError,
      r"LoD level 0, index 1: length 2 past `num_sequences` 1; the padding slots "
      r"after the real sequences must be empty\.",
    ),
    (
      [1, 0],
      {"num_sequences": 3},
      ValueError,
      r"Expected `num_sequences` in \[0, 2\] \(the rows of `padded`\), got 3\.",
    ),
    (
      [1, 0],
      {"num_sequences": 1.0},
      TypeError,
      r"Expected `num_sequences` to be an integer scalar, got 1\.0\.",
    ),
  ],
)
def test_from_padded_errors(lengths, kwargs, error, match):
  with pytest.raises(error, match=match):
    LoDTensor.from_padded(np.ones((2, 3)), lengths, **kwargs)


def test_from_padded_accepts_a_jax_num_sequences():
  x = LoDTensor.from_padded(np.ones((3, 2)), [2, 1, 0], num_sequences=jnp.int32(2))
  assert x.recursive_lengths() == [[2, 1]]


# -- segment ids and positions (Grain, T5X, MaxText) -------------------------------


def _segment_reference(x: LoDTensor):
  """1-based ids (0 for padding) and positions, row by row, in NumPy."""
  ids = np.zeros(x.capacity.tokens, np.int32)
  positions = np.zeros(x.capacity.tokens, np.int32)
  offsets = np.asarray(x.offsets[-1])
  for i in range(int(x.num_sequences())):
    ids[offsets[i] : offsets[i + 1]] = i + 1
    positions[offsets[i] : offsets[i + 1]] = np.arange(offsets[i + 1] - offsets[i])
  return ids, positions


@settings(max_examples=40)
@given(x=_nonempty())
def test_segment_ids_round_trip(x):
  values, segment_ids, positions = _to_segment_ids(x)
  ids, pos = _segment_reference(x)
  np.testing.assert_array_equal(np.asarray(segment_ids), ids)
  np.testing.assert_array_equal(np.asarray(positions), pos)
  assert segment_ids.dtype == positions.dtype == jnp.int32
  y = LoDTensor.from_segment_ids(
    values, segment_ids, positions=positions, buckets=ONE_LEVEL
  )
  assert_lod_equal(y, x)
  # `segment_ids()` is the same packing, 0-based, padding at the count capacity.
  z = LoDTensor.from_segment_ids(
    x.values, x.segment_ids(), padding_id=x.capacity.sequences[-1], buckets=ONE_LEVEL
  )
  assert_lod_equal(z, x)


@settings(max_examples=40)
@given(x=lod_tensors())
def test_segment_ids_drop_empty_sequences_and_outer_levels(x):
  # An empty sequence has no rows to carry its id; outer levels have none.
  values, segment_ids, positions = _to_segment_ids(x)
  y = LoDTensor.from_segment_ids(values, segment_ids, positions=positions)
  kept = [n for n in x.recursive_lengths()[-1] if n]
  assert_lod_equal(y, LoDTensor.from_lengths(_real_rows(x), [kept]))


@st.composite
def _packed_rows(draw):
  """Grain-style packed rows: labelled runs, then padding (id 0)."""
  lengths = draw(st.lists(st.integers(1, 4), max_size=5))
  labels = draw(
    st.lists(
      st.integers(1, 50), min_size=len(lengths), max_size=len(lengths), unique=True
    )
  )
  padding = draw(st.integers(0, 3))
  ids = np.repeat(np.array(labels, np.int64), lengths)
  positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(0, int)])
  ids = np.concatenate([ids, np.zeros(padding, np.int64)])
  positions = np.concatenate([positions, np.zeros(padding, np.int64)])
  return lengths, ids, positions


@settings(max_examples=40)
@given(packed=_packed_rows(), seed=st.integers(0, 2**16))
def test_packed_rows_round_trip(packed, seed):
  # Packed rows -> LoDTensor -> packed rows: the ids are renumbered 1, 2, ...
  lengths, ids, positions = packed
  values = np.random.default_rng(seed).normal(size=(ids.size, FEATURES))
  values = values.astype(np.float32)
  x = LoDTensor.from_segment_ids(values, ids, positions=positions, buckets=ONE_LEVEL)
  assert x.recursive_lengths() == [lengths]
  values2, ids2, positions2 = _to_segment_ids(x)
  rows = sum(lengths)
  np.testing.assert_array_equal(np.asarray(values2)[:rows], values[:rows])
  renumbered = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  np.testing.assert_array_equal(np.asarray(ids2)[:rows], renumbered)
  np.testing.assert_array_equal(np.asarray(positions2)[:rows], positions[:rows])
  assert not np.any(np.asarray(ids2)[rows:])


def test_segment_ids_are_labels():
  x = LoDTensor.from_segment_ids(np.arange(5.0), [7, 7, 3, 9, 9], padding_id=None)
  assert x.recursive_lengths() == [[2, 1, 2]]
  empty = LoDTensor.from_segment_ids(np.zeros((2, 3)), [0, 0])
  assert empty.recursive_lengths() == [[]] and empty.values.shape == (0, 3)


@pytest.mark.parametrize(
  ("ids", "kwargs", "error", "match"),
  [
    (
      [1, 1, 2, 1, 0],
      {},
      ValueError,
      r"`segment_ids` index 3: id 1 reappears after id 2 \(its segment ended at "
      r"index 1\); each segment must be one contiguous run of rows\.",
    ),
    (
      [1, 0, 2, 2, 0],
      {},
      ValueError,
      r"`segment_ids` index 2: id 2 after padding \(id 0\) at index 1; padding "
      r"rows must come last\.",
    ),
    (
      [1, 1, 2, 2, 0],
      {"positions": [0, 1, 1, 2, 0]},
      ValueError,
      r"`positions` index 2: expected 0 \(the segment of id 2 starts at index 2\), "
      r"got 1; positions count 0, 1, \.\.\. within each segment\.",
    ),
    (
      [1, 1, 1, 2, 0],
      {"positions": [0, 1, 0, 0, 0]},
      ValueError,
      r"`positions` index 2: expected 2 \(the segment of id 1 starts at index 0\), "
      r"got 0;",
    ),
    (
      [1, 1, 2],
      {},
      ValueError,
      r"Expected `segment_ids` to have shape \(5,\) \(one per row of `values`\), "
      r"got \(3,\)\.",
    ),
    (
      [1, 1, 2, 2, 0],
      {"positions": [[0, 1, 0, 1, 0]]},
      ValueError,
      r"Expected `positions` to have shape \(5,\) \(one per row of `values`\), got "
      r"\(1, 5\)\.",
    ),
    (
      np.array([1.0, 1, 2, 2, 0]),
      {},
      TypeError,
      r"Expected `segment_ids` to have an integer dtype, got float64\.",
    ),
    (
      [1, 1, 2, 2, 0],
      {"padding_id": 0.0},
      TypeError,
      r"Expected `padding_id` to be a static int, got 0\.0\.",
    ),
  ],
)
def test_from_segment_ids_errors(ids, kwargs, error, match):
  with pytest.raises(error, match=match):
    LoDTensor.from_segment_ids(np.ones((5, 2)), ids, **kwargs)


# -- row splits (tf.RaggedTensor) ---------------------------------------------------


@settings(max_examples=40)
@given(x=lod_tensors())
def test_row_splits_round_trip(x):
  splits = x.row_splits()
  assert len(splits) == x.num_levels
  for level, (s, n) in enumerate(zip(splits, x.recursive_lengths(), strict=True)):
    assert s.dtype == np.int64, level
    np.testing.assert_array_equal(s, np.cumsum([0, *n]))
  y = LoDTensor.from_row_splits(_real_rows(x), splits, buckets=_buckets(x))
  assert_lod_equal(y, x)


@settings(max_examples=40)
@given(lengths=recursive_lengths(), seed=st.integers(0, 2**16))
def test_ragged_round_trip(lengths, seed):
  # Row splits -> LoDTensor -> row splits, as NumPy arrays or lists.
  splits = [np.cumsum([0, *n]) for n in lengths]
  values = np.random.default_rng(seed).normal(size=(sum(lengths[-1]), FEATURES))
  x = LoDTensor.from_row_splits(values, [s.tolist() for s in splits])
  for got, expected in zip(x.row_splits(), splits, strict=True):
    np.testing.assert_array_equal(got, expected)
  np.testing.assert_array_equal(_real_rows(x), values.astype(x.values.dtype))


def test_from_row_splits_takes_one_array_for_one_level():
  x = LoDTensor.from_row_splits(np.arange(4.0), np.array([0, 1, 1, 4]))
  assert x.recursive_lengths() == [[1, 0, 3]]
  y = LoDTensor.from_row_splits(np.arange(4.0), jnp.array([0, 1, 1, 4]))
  assert_lod_equal(y, x)


@pytest.mark.parametrize(
  ("rows", "splits", "match"),
  [
    (
      4,
      [[0, 2, 3], [0, 3, 1, 4]],
      r"LoD level 1, index 2: row_splits must be non-decreasing, got 3 at index 1 "
      r"then 1\.",
    ),
    (3, [[1, 3]], r"LoD level 0, index 0: row_splits must start at 0, got 1\."),
    (
      4,
      [[0, 3]],
      r"LoD level 0 \(last\): last row_split 3 must equal the number of rows of "
      r"`values`, which is 4\.",
    ),
    (
      4,
      [[0, 1], [0, 1, 4]],
      r"LoD level 0: last row_split 1 must equal the number of sequences at level "
      r"1, which is 2\.",
    ),
    (
      2,
      [[0, 0.5, 2]],
      r"Expected integer row_splits at LoD level 0, got dtype float64",
    ),
  ],
)
def test_from_row_splits_errors(rows, splits, match):
  with pytest.raises(ValueError, match=match):
    LoDTensor.from_row_splits(np.ones(rows), splits)


# -- PackedSequence (PyTorch) ------------------------------------------------------


@pytest.fixture(name="torch")
def _torch():
  return pytest.importorskip("torch")


def _sequences(torch, x: LoDTensor):
  return [torch.from_numpy(np.array(s)) for s in x.to_list()]


@settings(max_examples=40)
@given(x=_nonempty().filter(lambda x: int(x.num_sequences()) > 0))
def test_packed_sequence_round_trip(x):
  torch = pytest.importorskip("torch")
  rnn = torch.nn.utils.rnn
  packed = to_packed_sequence(x)
  assert isinstance(packed, rnn.PackedSequence)
  expected = rnn.pack_sequence(_sequences(torch, x), enforce_sorted=False)
  assert torch.equal(packed.batch_sizes, expected.batch_sizes)
  assert packed.batch_sizes.dtype == packed.sorted_indices.dtype == torch.int64
  lengths = np.asarray(x.recursive_lengths()[0])
  order = np.argsort(-lengths, kind="stable")  # ties in their original order
  np.testing.assert_array_equal(packed.sorted_indices.numpy(), order)
  np.testing.assert_array_equal(packed.unsorted_indices.numpy(), np.argsort(order))
  for a, b in zip(
    rnn.pad_packed_sequence(packed, batch_first=True),
    rnn.pad_packed_sequence(expected, batch_first=True),
    strict=True,
  ):
    assert torch.equal(a, b)
  assert_lod_equal(from_packed_sequence(packed, buckets=ONE_LEVEL), x)
  assert_lod_equal(from_packed_sequence(expected, buckets=ONE_LEVEL), x)


@settings(max_examples=30)
@given(
  lengths=st.lists(st.integers(1, 5), min_size=1, max_size=6),
  enforce_sorted=st.booleans(),
  seed=st.integers(0, 2**16),
)
def test_torch_packed_sequence_round_trip(lengths, enforce_sorted, seed):
  # PackedSequence -> LoDTensor -> PackedSequence: the same, index for index.
  torch = pytest.importorskip("torch")
  rnn = torch.nn.utils.rnn
  if enforce_sorted:
    lengths = sorted(lengths, reverse=True)
  generator = torch.Generator().manual_seed(seed)
  seqs = [torch.randn(n, 3, generator=generator) for n in lengths]
  packed = rnn.pack_sequence(seqs, enforce_sorted=enforce_sorted)
  x = from_packed_sequence(packed)
  for got, expected in zip(x.to_list(), seqs, strict=True):
    np.testing.assert_array_equal(got, expected.numpy())
  again = to_packed_sequence(x)
  assert torch.equal(again.data, packed.data)
  assert torch.equal(again.batch_sizes, packed.batch_sizes)
  identity = torch.arange(len(lengths))
  for got, given_ in [
    (again.sorted_indices, packed.sorted_indices),
    (again.unsorted_indices, packed.unsorted_indices),
  ]:
    assert torch.equal(got, identity if given_ is None else given_)


@pytest.mark.parametrize(
  "dtype", ["bfloat16", "float16", "float32", "float64", "int32", "int64", "bool"]
)
def test_packed_sequence_dtypes_are_exact(torch, dtype):
  dtype = getattr(torch, dtype)
  rows = torch.arange(8).reshape(4, 2) * (0.25 if dtype.is_floating_point else 1)
  packed = torch.nn.utils.rnn.pack_sequence([rows[:3].to(dtype), rows[3:].to(dtype)])
  again = to_packed_sequence(from_packed_sequence(packed))
  # 64-bit data is stored as JAX stores it: 32-bit unless jax_enable_x64.
  stored = {torch.float64: torch.float32, torch.int64: torch.int32}
  if not jax.config.jax_enable_x64:
    dtype = stored.get(dtype, dtype)
  assert again.data.dtype == dtype
  assert torch.equal(again.data, packed.data.to(dtype))


def test_from_packed_sequence_detaches(torch):
  data = torch.ones(3, 2, requires_grad=True)
  packed = torch.nn.utils.rnn.PackedSequence(data, torch.tensor([2, 1]))
  assert from_packed_sequence(packed).recursive_lengths() == [[2, 1]]


def _packed(torch, batch_sizes, sorted_indices=None, unsorted_indices=None, rows=None):
  rows = sum(batch_sizes) if rows is None else rows
  as_tensor = lambda v: None if v is None else torch.tensor(v)  # noqa: E731
  return torch.nn.utils.rnn.PackedSequence(
    torch.ones(rows, 2),
    torch.tensor(batch_sizes),
    as_tensor(sorted_indices),
    as_tensor(unsorted_indices),
  )


@pytest.mark.parametrize(
  ("args", "match"),
  [
    (
      ([3, 2, 3],),
      r"`batch_sizes` index 2: 3 is more than 2 at index 1; a PackedSequence's "
      r"batch sizes never increase\.",
    ),
    (
      ([2, 0],),
      r"`batch_sizes` index 1: 0, expected a positive size \(a PackedSequence "
      r"holds no empty sequence\)\.",
    ),
    (([2, 1], None, None, 4), r"`batch_sizes` sum to 3, but `data` has 4 rows\."),
    (
      ([2, 1], [0, 2], [0, 1]),
      r"`sorted_indices` index 1: 2 is outside \[0, 2\); expected a permutation "
      r"of range\(2\)\.",
    ),
    (
      ([3], [1, 0, 1], [1, 0, 2]),
      r"`sorted_indices` index 2: 1 repeats index 0; expected a permutation of "
      r"range\(3\)\.",
    ),
    (
      ([3], [1, 2, 0], [1, 2, 0]),
      r"`unsorted_indices` index 0: 1, but `sorted_indices` puts sequence 0 at "
      r"index 2; expected the inverse of `sorted_indices`\.",
    ),
    (
      ([3], None, [0, 1]),
      r"Expected `unsorted_indices` to have shape \(3,\) \(one per sequence, "
      r"batch_sizes\[0\]\), got \(2,\)\.",
    ),
  ],
)
def test_from_packed_sequence_errors(torch, args, match):
  with pytest.raises(ValueError, match=match):
    from_packed_sequence(_packed(torch, *args))


def test_from_packed_sequence_type_error(torch):
  with pytest.raises(TypeError, match=r"Expected `packed` to be a torch\.nn\.utils"):
    from_packed_sequence(torch.ones(3))


@pytest.mark.parametrize(
  ("x", "error", "match"),
  [
    (
      LoDTensor.from_lengths(np.ones(3), [[2, 0, 1]]),
      ValueError,
      r"to_packed_sequence: sequence 1 is empty \(length 0\); a PackedSequence "
      r"cannot hold empty sequences \(torch forbids zero lengths\)\.",
    ),
    (
      LoDTensor.from_lengths(np.ones(0), [[]], buckets=ONE_LEVEL),
      ValueError,
      r"to_packed_sequence: the tensor has no sequences; a PackedSequence holds "
      r"at least one\.",
    ),
    (
      LoDTensor.from_lengths(np.ones(3), [[1], [3]]),
      ValueError,
      r"Expected `x` to have 1 LoD level\(s\), got 2\.",
    ),
    (np.ones(3), TypeError, r"Expected `x` to be a LoDTensor, got ndarray\."),
  ],
)
def test_to_packed_sequence_errors(torch, x, error, match):
  with pytest.raises(error, match=match):
    to_packed_sequence(x)


@pytest.mark.parametrize("convert", [from_packed_sequence, to_packed_sequence])
def test_a_missing_torch_is_a_clear_import_error(monkeypatch, convert):
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises
  with pytest.raises(ImportError, match=r"needs PyTorch, which is not installed"):
    convert(None)
