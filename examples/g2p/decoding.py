"""The G2P example's decoding: beam search over words, error rates, rescoring.

`stream` decodes words as they are read, with continuous refill
(`Seq2Seq.generate_corpus`): a slot freed by a finished word takes the
next one. `predict` and `evaluate` decode with it on one device, and
batches of words data-parallel over a mesh (`model.parallel_decoder`);
`transcribe` gives each word's n-best pronunciations with their scores,
and decodes an ensemble of both directions by `rescore`-ing its members'
hypotheses with all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from examples.g2p import data
from examples.g2p import model as m
from examples.g2p.checkpoints import Trained
from jaxlod.data import Batcher
from jaxlod.nn import ensemble_generate_corpus
from jaxlod.ops import length_normalized


def decoder(
  config: m.Config, num_phones: int, beam: int, mesh: Mesh | None = None
) -> Callable:
  """A new beam search for `predict`: `m.decoder`, or with a `mesh`
  `m.parallel_decoder`. Each new one compiles on its first call: a run
  builds one and passes it to every evaluation."""
  if mesh is None:
    return m.decoder(config, num_phones, beam)
  return m.parallel_decoder(config, num_phones, beam, mesh)


def reading_order(config: m.Config, phones: tuple[str, ...]) -> tuple[str, ...]:
  """A hypothesis of `config`'s model, first phoneme first: reversed with
  `config.right_to_left`."""
  return phones[::-1] if config.right_to_left else phones


def _word_batcher(
  letters: data.Vocab, config: m.Config, words: Sequence[str], shards: int | None
) -> Batcher:
  """Batches of `words` (their letter ids, one field) in their order, on
  the decoding capacities of `config`, with rank tables (`data.HOST_TABLES`)."""
  return Batcher(
    [(letters.encode(w),) for w in words],
    m.batch_buckets(config.decode_words),
    shuffle=False,
    window=max(len(words), 1),
    tables=data.HOST_TABLES,
    shards=shards,
  )


def stream(
  params: Any,
  config: m.Config,
  letters: data.Vocab,
  phones: data.Vocab,
  words: Iterable[str],
  beam: int,
  nbest: int = 1,
) -> Iterator[list[tuple[tuple[str, ...], float]]]:
  """Each word's `nbest` best pronunciations, best first, as ``(phonemes,
  score)``, in `words`' order, by beam search with continuous refill.

  `words` (lower-case words of `letters`, at most `m.TIME_CAPACITY`
  letters: `check_words`) is read as slots free up, ``config.decode_words``
  words in flight (`Seq2Seq.generate_corpus`; an ensemble of one direction
  decodes with `jaxlod.nn.ensemble_generate_corpus`), so a file's words
  stream through in bounded memory. Each word gets what the per-batch
  search gives it; the programs compile once per model and beam in a
  process.

  Raises:
    ValueError: for an ensemble of both directions (see `transcribe`).
  """
  if config.members > 1 and config.both_directions:
    raise ValueError(
      "An ensemble of both directions has no joint beam search: "
      "`transcribe` rescores its members' hypotheses."
    )
  model = m.build_model(config, len(phones))
  settings = m.search_settings(beam, m.TIME_CAPACITY, nbest)
  options = dict(
    src_capacity=m.TIME_CAPACITY,
    slots=config.decode_words,
    max_length_fn=lambda ids: len(ids) + m.LENGTH_MARGIN,
  )
  sources = (letters.encode(w) for w in words)
  if config.members > 1:
    members = [(model, p) for p in params]
    found = ensemble_generate_corpus(members, sources, settings, **options)
  else:
    found = model.apply(params, sources, settings, method="generate_corpus", **options)
  for ids, scores in found:
    yield [
      (reading_order(config, phones.decode(h)), float(score))
      for h, score in zip(ids, scores, strict=True)
    ]


def predict(
  params: Any,
  config: m.Config,
  corpus: data.Corpus,
  words: Sequence[str],
  beam: int,
  mesh: Mesh | None = None,
  decode: Callable | None = None,
) -> list[tuple[str, ...]]:
  """The beam search's best pronunciation of each word, in `words`' order.

  On one device the words stream through `stream` (continuous refill).
  With a `mesh`, each device decodes its own shard of every batch
  (`m.parallel_decoder`, the batches with their rank tables built on the
  host, `data.HOST_TABLES`); one model only. `decode` is `decoder(config,
  len(corpus.phones), beam, mesh)` built earlier (its compilation reused;
  `None`: a new one), for a mesh only. An ensemble of both directions
  (`params` a tuple) rescores its members' hypotheses (`transcribe`),
  `decode` unused."""
  if config.members > 1 and config.both_directions:
    if mesh is not None:
      raise ValueError("An ensemble of both directions decodes on one device.")
    trained = Trained(config, corpus.letters, corpus.phones, params, [])
    return [hyps[0][0] for hyps in transcribe(trained, words, beam)]
  if mesh is None:
    found = stream(params, config, corpus.letters, corpus.phones, words, beam)
    return [hyps[0][0] for hyps in found]
  if decode is None:
    decode = decoder(config, len(corpus.phones), beam, mesh)
  batcher = _word_batcher(corpus.letters, config, words, mesh.size)
  out: list[tuple[str, ...]] = [()] * len(words)
  # Every process gets every shard's hypotheses; the plan maps them to words.
  for batch, shards in zip(batcher.epoch(0), batcher.plan_shards(0), strict=True):
    ids_of_shards = decode(params, batch.fields[0], batch.tables[0])
    for indices, ids in zip(shards, ids_of_shards, strict=True):
      for i, (best,) in zip(indices, ids.to_list(), strict=True):
        out[i] = reading_order(config, corpus.phones.decode(best))
  return out


def evaluate(
  params: Any,
  config: m.Config,
  corpus: data.Corpus,
  split: str,
  limit: int | None = None,
  mesh: Mesh | None = None,
  decode: Callable | None = None,
) -> tuple[float, float, list[tuple[str, tuple[str, ...], tuple[str, ...]]]]:
  """``(PER, WER, rows)`` on `limit` evenly spaced words of `split` (all: None).

  `rows` holds ``(word, reference, prediction)`` per word, in word order.
  With a `mesh`, the devices decode in parallel; `decode` as in `predict`
  (at ``config.beam``).
  """
  pairs = data.evenly_spaced(corpus.splits[split], limit)
  words = [w for w, _ in pairs]
  hyps = predict(params, config, corpus, words, config.beam, mesh, decode)
  refs = [p for _, p in pairs]
  per, wer = data.error_rates(refs, hyps)
  return per, wer, list(zip(words, refs, hyps, strict=True))


def check_words(
  words: Sequence[str], letters: data.Vocab
) -> tuple[list[tuple[int, str]], list[str]]:
  """The words a model with the alphabet `letters` can transcribe, and a
  message for each of the others.

  A word is lower-cased and stripped of surrounding white space first.

  Returns:
    ``(kept, messages)``: ``kept`` holds ``(index in words, normalized
    word)``; ``messages`` names each word left out, with the characters
    outside the alphabet, or its length when it is longer than
    `m.TIME_CAPACITY` letters, or that it is empty.
  """
  kept, messages = [], []
  for i, word in enumerate(words):
    norm = word.strip().lower()
    outside = sorted(set(norm) - set(letters.tokens))
    if outside:
      chars = ", ".join(repr(c) for c in outside)
      alphabet = "".join(letters.tokens)
      messages.append(
        f"{word!r}: characters {chars} are not in the model's alphabet ({alphabet})"
      )
    elif not norm:
      messages.append(f"{word!r}: an empty word")
    elif len(norm) > m.TIME_CAPACITY:
      messages.append(
        f"{word!r}: {len(norm)} letters, more than the model's {m.TIME_CAPACITY}"
      )
    else:
      kept.append((i, norm))
  return kept, messages


def rescore(
  members: Sequence[tuple[m.Config, Any]],
  letters: data.Vocab,
  phones: data.Vocab,
  words: Sequence[str],
  candidates: Sequence[Sequence[tuple[str, ...]]],
) -> list[list[tuple[tuple[str, ...], float]]]:
  """Each word's candidate pronunciations scored by every member, best first.

  A candidate's score is the mean over `members` (``(config, params)``
  pairs) of its teacher-forced log-probability, ``</s>`` included, each
  member reading it in its own direction (`m.forced_scorer`), over the beam
  search's length penalty (`jaxlod.ops.length_normalized`): what an
  ensemble's joint beam search scores a hypothesis by. Each word's
  duplicates count once; ties keep the order of `candidates`.

  Args:
    members: the models, each with its config (its direction).
    letters: the source vocabulary.
    phones: the target vocabulary.
    words: lower-case words of `letters`.
    candidates: per word, pronunciations (phonemes first to last) of at
      most ``len(word) + m.LENGTH_MARGIN`` phonemes.

  Returns:
    Per word, in `words`' order, ``(phonemes, score)`` for each distinct
    candidate, best first.

  Raises:
    ValueError: for `candidates` of another length than `words`.
  """
  if len(candidates) != len(words):
    raise ValueError(
      f"Expected one list of candidates per word, got {len(candidates)} lists "
      f"for {len(words)} words."
    )
  flat = [(i, c) for i, pool in enumerate(candidates) for c in dict.fromkeys(pool)]
  total = np.zeros(len(flat))
  for config, params in members:
    pairs = [(words[i], reading_order(config, c)) for i, c in flat]
    total += _forced_logp(config, params, letters, phones, pairs)
  steps = np.array([len(c) + 1 for _, c in flat])
  scores = np.asarray(length_normalized(total / len(members), steps, m.LENGTH_PENALTY))
  out: list[list[tuple[tuple[str, ...], float]]] = [[] for _ in words]
  for (i, c), score in zip(flat, scores, strict=True):
    out[i].append((c, float(score)))
  return [sorted(pool, key=lambda x: -x[1]) for pool in out]


def _forced_logp(
  config: m.Config,
  params: Any,
  letters: data.Vocab,
  phones: data.Vocab,
  pairs: Sequence[tuple[str, Sequence[str]]],
) -> np.ndarray:
  """Each ``(word, phonemes)`` pair's teacher-forced log-probability under
  the model of `config` and `params`, ``</s>`` included (`m.forced_scorer`)."""
  batcher = Batcher(
    data.encode_pairs(pairs, letters, phones),
    m.scoring_buckets(config.decode_words),
    shuffle=False,
    window=max(len(pairs), 1),
    tables=(data.HOST_TABLES, data.HOST_TABLES, False),
  )
  # The model does not depend on the seed or the direction: one compilation.
  single = dataclasses.replace(config, seed=0, right_to_left=False)
  score = m.forced_scorer(single, len(phones))
  logps = np.zeros(len(pairs))
  for batch in batcher.epoch(0):
    logp = np.asarray(score(params, *batch.fields, *batch.tables[:2]))
    logps[batch.indices] += logp[: len(batch.indices)]
  return logps


def transcribe(
  trained: Trained, words: Sequence[str], beam: int, nbest: int = 1
) -> list[list[tuple[tuple[str, ...], float]]]:
  """Each word's `nbest` best pronunciations, best first, as ``(phonemes,
  score)``.

  One model, or an ensemble of one direction, decodes by beam search
  (`stream`; an ensemble over the mean of its members'
  log-probabilities). An ensemble of both directions
  (``config.both_directions``) has no joint search: each member finds its
  `beam` best alone, and every member rescores them all (`rescore`).

  Args:
    trained: the model (`checkpoints.load_trained`).
    words: lower-case words of ``trained.letters`` (`check_words`).
    beam: the beam size, at least `nbest`.
    nbest: hypotheses kept per word.

  Returns:
    One list per word, in `words`' order, of at most `nbest` hypotheses.
  """
  config, letters, phones = trained.config, trained.letters, trained.phones
  if not (config.members > 1 and config.both_directions):
    return list(stream(trained.params, config, letters, phones, words, beam, nbest))
  members = [(m.member_config(config, k), p) for k, p in enumerate(trained.params)]
  pools: list[list[tuple[str, ...]]] = [[] for _ in words]
  for member, params in members:
    found = stream(params, member, letters, phones, words, beam, beam)
    for pool, hyps in zip(pools, found, strict=True):
      pool.extend(h for h, _ in hyps)
  ranked = rescore(members, letters, phones, words, pools)
  return [hyps[:nbest] for hyps in ranked]
