"""The G2P example's command line: train and score (`main`), and
``predict`` (`predict_main`), which transcribes words with a trained model."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

import examples.g2p
from examples.g2p import checkpoints, data, decoding, train
from examples.g2p import model as m
from jaxlod import enable_compilation_cache

PROG = "python -m examples.g2p"

# -- the training command line -------------------------------------------------


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
    "--preset",
    choices=sorted(m.PRESETS),
    default="default",
    help="default: about 4 minutes on 2 CPU cores; fast: the best single "
    "model of an hour on them; full: the best quality; tiny: a few hundred "
    "words (tests)",
  )
  parser.add_argument(
    "--encoder",
    choices=m.ENCODERS,
    default="bilstm",
    help="what reads the letters: bilstm (default), bidirectional LSTMs; "
    "transformer, a Transformer encoder of about the BiLSTM's parameters "
    "(presets default and tiny)",
  )
  parser.add_argument("--steps", type=int, help="training steps in all")
  parser.add_argument(
    "--workdir", type=pathlib.Path, help="checkpoints (default: a new temp dir)"
  )
  parser.add_argument(
    "--resume", action="store_true", help="continue from the latest checkpoint"
  )


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
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


def _add_ensemble_flags(parser: argparse.ArgumentParser) -> None:
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


def _add_regularization_flags(parser: argparse.ArgumentParser) -> None:
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


def _add_device_flags(parser: argparse.ArgumentParser) -> None:
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


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog=PROG,
    description=examples.g2p.__doc__.split("\n")[0],
    epilog=f"Transcribe words with a trained model: {PROG} predict --workdir "
    "DIR WORD ... (predict --help).",
  )
  _add_run_flags(parser)
  _add_model_flags(parser)
  _add_ensemble_flags(parser)
  _add_regularization_flags(parser)
  _add_device_flags(parser)
  parser.add_argument("--examples", type=int, default=10, help="predictions shown")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  return parser


# The flags that override a setting of the preset's config.
CONFIG_FLAGS = (
  "steps",
  "stress",
  "input_feeding",
  "right_to_left",
  "both_directions",
  "beam",
  "members",
  "seed",
  "eval_every",
  "decoder_dropout",
  "label_smoothing",
  "ema_decay",
)


def _check_config(parser: argparse.ArgumentParser, config: m.Config) -> None:
  for name in ("steps", "beam", "eval_every", "members"):
    if getattr(config, name) < 1:
      flag = "--" + name.replace("_", "-")
      parser.error(f"{flag} must be >= 1, got {getattr(config, name)}")
  for name in ("decoder_dropout", "label_smoothing", "ema_decay"):
    if not 0.0 <= getattr(config, name) < 1.0:
      flag = "--" + name.replace("_", "-")
      parser.error(f"{flag} must be in [0, 1), got {getattr(config, name)}")


def _check_run(
  parser: argparse.ArgumentParser, args: argparse.Namespace, config: m.Config
) -> None:
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


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, m.Config]:
  """The command line and the run's config (the preset, then the flags)."""
  parser = _parser()
  args = parser.parse_args(argv)
  try:
    base = m.preset(args.preset, args.encoder)
  except ValueError as error:
    parser.error(f"--encoder {args.encoder} --preset {args.preset}: {error}")
  flags = {name: getattr(args, name) for name in CONFIG_FLAGS}
  config = dataclasses.replace(
    base, **{k: v for k, v in flags.items() if v is not None}
  )
  _check_config(parser, config)
  _check_run(parser, args, config)
  return args, config


# -- the training program ------------------------------------------------------


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


def _join_processes(args: argparse.Namespace) -> None:
  """Joins the multi-host run of ``--coordinator``, if any."""
  if args.coordinator is not None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
    )


def _print_corpus(config: m.Config, corpus: data.Corpus) -> None:
  sizes = ", ".join(f"{name} {len(pairs)}" for name, pairs in corpus.splits.items())
  stress = "kept" if config.stress else "stripped"
  print(f"CMUdict words: {sizes}; stress {stress} ({len(corpus.phones) - 2} phonemes)")


def _print_model(config: m.Config, params: Any) -> None:
  count = sum(x.size for x in jax.tree.leaves(params))
  average = f", scored by their average (decay {config.ema_decay})"
  last = config.seed + config.members - 1
  ensemble = f"; {config.members} members, seeds {config.seed} to {last}" + (
    ", the odd ones in the other direction" if config.both_directions else ""
  )
  if config.encoder == "transformer":
    encoder = (
      f"{config.encoder_layers} x Transformer {config.embed_dim} ({config.heads} "
      f"heads, MLP {config.mlp_features})"
    )
  else:
    encoder = f"{config.encoder_layers} x BiLSTM {config.hidden}"
  print(
    f"model: embed {config.embed_dim}, encoder {encoder}, LSTM decoder "
    f"{config.hidden}"
    + (" fed its attention context" if config.input_feeding else "")
    + (" writing right to left" if config.right_to_left else "")
    + f", additive attention {config.attention_units}: {count:,} parameters"
    + (average if config.ema_decay else "")
    + (ensemble if config.members > 1 else "")
  )


def _train_members(
  args: argparse.Namespace,
  config: m.Config,
  corpus: data.Corpus,
  mesh: Mesh | None,
  workdir: pathlib.Path,
  members: dict[int, m.Config],
  states: list[tuple[int, Any, Any, dict[str, Any] | None]],
  functions: tuple[Callable, Callable],
) -> tuple[list[Any], list[list[tuple[int, float, float]]]]:
  """Trains each member (member index -> its config) from its state, with
  the training step and decoder `functions`: the parameters each decodes
  with (`m.eval_params`), and each one's history."""
  step_fn, decode = functions
  finals, histories = [], []
  for (k, member), (start, params, opt_state, batcher_state) in zip(
    members.items(), states, strict=True
  ):
    member_workdir = train.member_dir(workdir, config, k)
    resuming = f" (resuming at step {start})" if start else ""
    if start and batcher_state is None:
      # A checkpoint of an older version of the example: the same batches.
      resuming = resuming[:-1] + "; no Batcher state saved: batches by step)"
    if config.members > 1:
      way = ", right to left" if member.right_to_left else ""
      print(f"member {k} (seed {member.seed}{way})")
    print(f"checkpoints: {member_workdir}{resuming}")
    params, opt_state, history = train.train(
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
  return finals, histories


def _scored_models(
  config: m.Config, members: list[m.Config], finals: list[Any]
) -> list[tuple[str, m.Config, Any]]:
  """``(name, config, params)`` of each model the final table scores: the
  model, or each member and their ensemble."""
  if config.members == 1:
    return [("model", config, finals[0])]
  pairs = zip(members, finals, strict=True)
  return [
    *((f"member {k}", c, p) for k, (c, p) in enumerate(pairs)),
    ("ensemble", config, tuple(finals)),
  ]


def _score(
  config: m.Config,
  corpus: data.Corpus,
  mesh: Mesh | None,
  decode: Callable,
  scored: list[tuple[str, m.Config, Any]],
) -> tuple[dict[str, dict[str, tuple[float, float]]], list[tuple[str, ...]], list]:
  """The dev and test ``(PER, WER)`` of each model of `scored`, the table of
  them, and the last model's test rows (`decoding.evaluate`)."""
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
      search = (
        None if both else decoding.decoder(config, len(corpus.phones), config.beam)
      )
    for split in ("dev", "test"):
      per, wer, rows = decoding.evaluate(
        decode_params, run_config, corpus, split, mesh=on, decode=search
      )
      results[name][split] = (per, wer)
      table.append(
        (name, split, str(len(rows)), f"{100 * per:.2f}%", f"{100 * wer:.2f}%")
      )
  if config.members == 1:
    table = [row[1:] for row in table]
  return results, table, rows


def _table(rows: Sequence[Sequence[str]]) -> str:
  """A Markdown table; the first row is the header."""
  lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
  lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
  return "\n".join(lines)


def _print_results(
  config: m.Config,
  step: int,
  table: list[tuple[str, ...]],
  rows: list,
  shown: int,
  workdir: pathlib.Path,
  began: float,
) -> None:
  """Prints the scores' table, `shown` test examples of `rows`, the time
  since `began` and the command that transcribes words with the model."""
  print(f"\nbeam search (beam {config.beam}) after {step} steps:")
  print(_table(table))
  if shown > 0:
    examples = data.evenly_spaced(rows, shown)
    print("\ntest examples:")
    print(
      _table(
        [("word", "reference", "prediction")]
        + [(w, " ".join(r), " ".join(h)) for w, r, h in examples]
      )
    )
  print(f"\ntotal time: {time.perf_counter() - began:.0f} s")
  print(f"the model: {workdir}; transcribe words with it:")
  print(f"  {PROG} predict --workdir {workdir} WORD ...")
  sys.stdout.flush()


def _member_trained(
  args: argparse.Namespace,
  config: m.Config,
  workdir: pathlib.Path,
  start: int,
  history: list[tuple[int, float, float]],
  began: float,
) -> dict[str, Any]:
  """What `main` prints and returns after training member ``--member`` alone
  from step `start`."""
  print(f"\ntotal time: {time.perf_counter() - began:.0f} s")
  print(
    f"member {args.member} of {config.members} is trained; once every member "
    "is, the same command with --resume and without --member scores them"
  )
  step = max(start, config.steps)
  return {"workdir": workdir, "start_step": start, "step": step, "history": history}


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
  _join_processes(args)
  mesh = make_mesh(args.devices)
  corpus = data.load_corpus(config)
  _print_corpus(config, corpus)
  ks = range(config.members) if args.member is None else [args.member]
  num_phones = len(corpus.phones)
  workdir, states = train.start_states(
    args.workdir, args.resume, config, num_phones, mesh, ks
  )
  if mesh is not None:
    print(f"data-parallel over {mesh.size} devices, {jax.process_count()} processes")
  _print_model(config, states[0][1])
  members = {k: m.member_config(config, k) for k in ks}
  # One step and one decoder for every member (they differ in their seed).
  first = members[ks[0]]
  step_fn = m.train_step(first, num_phones, mesh)
  decode = decoding.decoder(first, num_phones, config.beam, mesh)
  finals, histories = _train_members(
    args, config, corpus, mesh, workdir, members, states, (step_fn, decode)
  )
  if args.member is not None:
    return _member_trained(args, config, workdir, states[0][0], histories[0], began)
  scored = _scored_models(config, list(members.values()), finals)
  results, table, rows = _score(config, corpus, mesh, decode, scored)
  step = max(max(state[0] for state in states), config.steps)
  _print_results(config, step, table, rows, args.examples, workdir, began)
  out = {"workdir": workdir, "step": step, **results[scored[-1][0]]}
  if config.members == 1:
    return {**out, "start_step": states[0][0], "history": histories[0]}
  return {
    **out,
    "start_step": [state[0] for state in states],
    "history": histories,
    "members": [results[f"member {k}"] for k in range(config.members)],
  }


# -- predict -------------------------------------------------------------------


def _predict_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog=f"{PROG} predict",
    description="Transcribes words with the trained model of --workdir, by "
    "beam search: one 'word<TAB>phonemes' line a word, in their order. Words "
    "are lower-cased; a word with characters outside the model's alphabet is "
    "named on standard error and left out (exit status 1).",
  )
  parser.add_argument(
    "words",
    nargs="*",
    metavar="WORD",
    help="words to transcribe (default: one a line from standard input, read "
    "as the decoder takes them and printed as they finish, in order: a long "
    "word list streams through in bounded memory)",
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
  return parser


def _predict_args(
  parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, int]:
  """The ``predict`` command line, checked, and the hypotheses a word."""
  args = parser.parse_args(argv)
  for flag in ("nbest", "beam"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
  nbest = 1 if args.nbest is None else args.nbest
  if args.beam is not None and args.beam < nbest:
    parser.error(f"--beam must be >= --nbest, got --beam {args.beam} --nbest {nbest}")
  return args, nbest


def predict_main(argv: Sequence[str] | None = None) -> int:
  """``python -m examples.g2p predict``: prints ``word<TAB>phonemes`` for
  each word (with ``--nbest K``, K lines a word, each with its score).

  Returns:
    The exit status: 0, or 1 when some word was left out (each named on
    standard error; the others are still transcribed), or 2 when
    ``--workdir`` holds no checkpoint of this example.
  """
  parser = _predict_parser()
  args, nbest = _predict_args(parser, argv)
  enable_compilation_cache()
  try:
    trained = checkpoints.load_trained(args.workdir)
  except ValueError as error:
    print(f"{parser.prog}: {error}", file=sys.stderr)
    return 2
  words = args.words or (line.strip() for line in sys.stdin if line.strip())
  beam = max(trained.config.beam, nbest) if args.beam is None else args.beam
  shown: collections.deque[str] = collections.deque()  # read, not yet printed
  left_out = False

  def kept_words():
    """The words the model can transcribe, as they are read; the others are
    named on standard error at once."""
    nonlocal left_out
    for word in words:
      kept, messages = decoding.check_words([word], trained.letters)
      for message in messages:
        print(f"{parser.prog}: left out {message}", file=sys.stderr, flush=True)
        left_out = True
      if kept:
        shown.append(word.strip())
        yield kept[0][1]

  config = trained.config
  if config.members > 1 and config.both_directions:  # rescoring needs them all
    results = iter(decoding.transcribe(trained, list(kept_words()), beam, nbest))
  else:
    found = kept_words()
    results = decoding.stream(
      trained.params, config, trained.letters, trained.phones, found, beam, nbest
    )
  for hyps in results:  # in order, each printed as soon as it and those before are
    word = shown.popleft()
    for phones, score in hyps[:nbest]:
      line = f"{word}\t{' '.join(phones)}"
      print(line if args.nbest is None else f"{line}\t{score:.4f}", flush=True)
  return 1 if left_out else 0
