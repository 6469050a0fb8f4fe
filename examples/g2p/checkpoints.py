"""The G2P example's checkpoints: save, resume, and load a trained model.

A checkpoint of step N in a workdir holds the parameters and optimizer state
(``state``), the config, the vocabularies and the training `Batcher`'s state
(orbax, one JSON item each); a run of several members keeps one workdir per
member (``member_K``).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from examples.g2p import data
from examples.g2p import model as m


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


# -- a trained model -----------------------------------------------------------


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


def _latest_checkpoints(workdir: pathlib.Path) -> tuple[list[pathlib.Path], list[int]]:
  """The directories of `workdir`'s model (one, or its ``member_K``
  directories) and the step of each one's latest checkpoint.

  Raises:
    ValueError: when `workdir` holds no checkpoint of this example.
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
      f"`python -m examples.g2p --workdir {workdir}`."
    )
  return dirs, steps


def _saved_config(workdir: pathlib.Path, saved: list[dict[str, Any]]) -> m.Config:
  """The config of the model whose members saved the configs `saved`, with
  ``members`` their number and ``both_directions`` whether the odd ones
  write in the other direction.

  Raises:
    ValueError: for members whose directions no ensemble has.
  """
  fields = {f.name for f in dataclasses.fields(m.Config)}
  config = m.Config(**{k: v for k, v in saved[0].items() if k in fields})
  # A member saved before the example had directions wrote left to right.
  flipped = [c.get("right_to_left", False) != config.right_to_left for c in saved]
  if any(flipped) and flipped != [k % 2 == 1 for k in range(len(saved))]:
    ways = ", ".join(
      "right to left" if c.get("right_to_left", False) else "left to right"
      for c in saved
    )
    raise ValueError(
      f"{workdir}: its members write {ways}; an ensemble of both directions "
      "has its odd members in the other direction (--both-directions)."
    )
  return dataclasses.replace(config, members=len(saved), both_directions=any(flipped))


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
  dirs, steps = _latest_checkpoints(workdir)
  pairs = zip(dirs, steps, strict=True)
  config = _saved_config(workdir, [_restore_json(d, s, "config") for d, s in pairs])
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
