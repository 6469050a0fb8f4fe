"""The G2P example's training loop: batches, progress, dev scores, checkpoints.

`train` runs `model.train_step` over the batches of `training_batcher`
from a start step to a stop step, with a progress bar, and every
``eval_every`` steps scores the dev words and saves a checkpoint from which
`start_states` resumes a run.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from examples.g2p import checkpoints, data, decoding
from examples.g2p import model as m
from jaxlod.data import Batch, Batcher
from jaxlod.parallel import replicate, shard_batch


def training_batcher(
  config: m.Config, corpus: data.Corpus, shards: int | None = None
) -> Batcher:
  """The training batches of `config` (its batch size, token budget, ladder
  and seed): the ``(letters, decoder inputs, targets)`` of
  `data.training_examples`, with the rank tables of the first two fields
  built on the host (`data.HOST_TABLES`), dealt to `shards` shards (`None`:
  one batch a step)."""
  return Batcher(
    data.training_examples(config, corpus),
    m.batch_buckets(config.batch_words, config.batch_tokens),
    seed=config.seed,
    ladder=m.training_ladder(config),
    # The targets' table is never used.
    tables=(data.HOST_TABLES, data.HOST_TABLES, False),
    shards=shards,
  )


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


def _training_batches(
  batcher: Batcher,
  start: int,
  workdir: pathlib.Path,
  batcher_state: dict[str, Any] | None,
) -> Iterator[Batch]:
  """`batcher`'s endless batches from step `start`: from `batcher_state`
  when given (see `train`), else by the step count."""
  if batcher_state is None:
    return batcher.iterate(start_step=start)
  _resume_batcher(batcher, batcher_state, start, workdir)
  return batcher.iterate()


class _Progress:
  """What a run shows as it trains: a progress bar on a terminal; elsewhere
  (a log file), a plain line at every tenth of the run; nothing when quiet.

  The bar shows the mean loss of the last 10 steps and the tokens per
  second since the last evaluation (or since the first step, which
  compiles).
  """

  def __init__(self, config: m.Config, start: int, stop: int, quiet: bool):
    live = not quiet and sys.stderr.isatty()
    self.plain_every = 0 if quiet or live else max(1, config.steps // 10)
    self.steps, self.start, self.stop = config.steps, start, stop
    self.bar = tqdm(
      total=config.steps, initial=start, unit="step", desc="training", disable=not live
    )
    self.postfix = ""
    self.tokens, self.clock, self.loss_sum, self.losses = 0, time.perf_counter(), 0.0, 0

  def __enter__(self) -> _Progress:
    self.bar.__enter__()
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.bar.__exit__(*exc_info)

  def restart_clock(self) -> None:
    """Counts the tokens per second from now."""
    self.tokens, self.clock = 0, time.perf_counter()

  def step(self, done: int, loss: float, tokens: int) -> None:
    """Takes in step `done` (counted from 1), its loss and its tokens."""
    self.loss_sum, self.losses = self.loss_sum + loss, self.losses + 1
    self.tokens += tokens
    self.bar.update(1)
    if done == self.start + 1:
      self.restart_clock()
    elif done % 10 == 0 or done == self.stop:
      rate = self.tokens / max(time.perf_counter() - self.clock, 1e-9)
      mean = self.loss_sum / self.losses
      self.postfix = f"loss {mean:.3f}, {rate:,.0f} tokens/s"
      self.bar.set_postfix(loss=f"{mean:.3f}", tokens_per_s=f"{rate:,.0f}")
      self.loss_sum, self.losses = 0.0, 0
    if self.plain_every and (done % self.plain_every == 0 or done == self.stop):
      postfix = self.postfix and f": {self.postfix}"
      print(f"step {done}/{self.steps}" + postfix, flush=True)


def _print_eval(step: int, per: float, wer: float, words: int, seconds: float):
  tqdm.write(
    f"step {step}: dev PER {100 * per:.2f}% WER {100 * wer:.2f}% "
    f"({words} words, {seconds:.1f} s)"
  )


def _evaluate_and_save(
  config: m.Config,
  corpus: data.Corpus,
  state: tuple[Any, Any, Batcher],
  done: int,
  workdir: pathlib.Path,
  mesh: Mesh | None,
  decode: Callable,
) -> tuple[int, float, float]:
  """Scores `dev_words` dev words after step `done` and saves its checkpoint,
  with the `Batcher`'s state; `state` is ``(params, opt_state, batcher)``.

  Returns:
    ``(done, dev PER, dev WER)``.
  """
  params, opt_state, batcher = state
  began = time.perf_counter()
  decode_params = m.eval_params(config, params, opt_state)
  per, wer, rows = decoding.evaluate(
    decode_params, config, corpus, "dev", config.dev_words, mesh, decode
  )
  _print_eval(done, per, wer, len(rows), time.perf_counter() - began)
  vocabs = (corpus.letters, corpus.phones)
  checkpoints.save_checkpoint(
    workdir, done, params, opt_state, config, batcher.get_state(), vocabs
  )
  return done, per, wer


def train(
  config: m.Config,
  corpus: data.Corpus,
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
  built on the host (`data.HOST_TABLES`). With a `mesh`, data-parallel over
  its devices: each step's batch is dealt to one shard per device, each on
  the capacities of one batch (`m.train_step`), and the evaluations decode
  in parallel too. `step_fn` is ``m.train_step(config, len(corpus.phones),
  mesh)`` and `decode` ``decoding.decoder(config, len(corpus.phones),
  config.beam, mesh)``, built earlier (their compilations reused; the seed
  may differ); `None`: new ones.

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
    decode = decoding.decoder(config, len(corpus.phones), config.beam, mesh)
  batcher = training_batcher(config, corpus, None if mesh is None else mesh.size)
  batches = _training_batches(batcher, start, workdir, batcher_state)
  if mesh is not None:
    params, opt_state = replicate((params, opt_state), mesh)
  # Tokens of an example: its letters and its phonemes with `</s>`.
  lengths = np.array([len(s) + len(t) for s, _, t in corpus.train])
  stop = config.steps if stop is None else stop
  history = []
  progress = _Progress(config, start, stop, quiet)
  training_began = time.perf_counter()
  with contextlib.closing(batches), progress:
    for step, batch in zip(range(start, stop), batches, strict=False):  # endless
      if mesh is not None:
        batch = shard_batch(batch, mesh, m.AXIS)
      params, opt_state, loss = step_fn(
        params, opt_state, *m.step_args(config, step), batch.fields, batch.tables
      )
      done = step + 1
      progress.step(done, float(loss), int(lengths[batch.indices].sum()))
      if done % config.eval_every == 0 or done == stop:
        state = (params, opt_state, batcher)
        history.append(
          _evaluate_and_save(config, corpus, state, done, workdir, mesh, decode)
        )
        progress.restart_clock()
  if stop > start:
    seconds = time.perf_counter() - training_began
    print(
      f"trained steps {start + 1} to {stop} in {seconds:.0f} s, "
      f"{(stop - start) / seconds:.2f} steps a second (compilation, dev "
      "evaluations and checkpoints included)",
      flush=True,
    )
  return params, opt_state, history


# -- where a run starts --------------------------------------------------------


def member_dir(workdir: pathlib.Path, config: m.Config, k: int) -> pathlib.Path:
  """Where member `k` checkpoints: `workdir` itself for one model, else
  ``workdir / f"member_{k}"``."""
  return workdir if config.members == 1 else workdir / f"member_{k}"


def start_states(
  workdir: pathlib.Path | None,
  resume: bool,
  config: m.Config,
  num_phones: int,
  mesh: Mesh | None,
  ks: Sequence[int],
) -> tuple[pathlib.Path, list[tuple[int, Any, Any, dict[str, Any] | None]]]:
  """The workdir (`workdir`, or a new temporary one), and the step,
  parameters, optimizer state and training `Batcher` state of each member
  in `ks` to start from, resuming from their checkpoints with `resume` (a
  member without a checkpoint starts at step 0; the Batcher state is `None`
  without a checkpoint or for one saved without it). The other members'
  directories are not read: they may be training beside this run
  (``--member``).

  Raises:
    ValueError: for `resume` without a checkpoint (or a workdir), a
      checkpoint of another model, or a fresh run in a workdir that holds
      checkpoints.
  """
  if workdir is None:
    if resume:
      raise ValueError("--resume needs --workdir: the run's checkpoint directory.")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="jaxlod_g2p_"))
  dirs = [member_dir(workdir, config, k) for k in ks]
  steps = [checkpoints.latest_step(d) for d in dirs]
  if resume and all(step is None for step in steps):
    where = dirs[0] if len(dirs) == 1 else workdir
    raise ValueError(f"--resume: no checkpoint in {where}.")
  if not resume:
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
      state = checkpoints.restore_checkpoint(d, step, member, num_phones, mesh)
      states.append((step, *state, checkpoints.restore_batcher_state(d, step)))
  return workdir, states
