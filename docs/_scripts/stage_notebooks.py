"""Stages the notebooks for the site: executed copies where they are fresh.

docs/conf.py calls `stage` at every build, with its paths.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def stage(notebooks: Path, executed: Path, staged: Path) -> list[str]:
  """Copies each ``notebooks/*.ipynb`` into `staged`.

  The copy is the notebook of the same name in `executed` when that exists
  and is newer than the notebook, else the notebook itself. A staged file is
  rewritten only when its content changes (an unchanged notebook is neither
  read nor executed again by an incremental build), and a staged notebook
  whose source is gone is removed.

  Args:
    notebooks: the folder of the notebooks, stored without outputs.
    executed: the folder of their executed copies (it may not exist).
    staged: the folder to copy them into; created if missing.

  Returns:
    The names of the notebooks that were staged executed.
  """
  staged.mkdir(parents=True, exist_ok=True)
  fresh_names = []
  sources = sorted(notebooks.glob("*.ipynb"))
  for source in sources:
    run = executed / source.name
    fresh = run.is_file() and run.stat().st_mtime > source.stat().st_mtime
    chosen = run if fresh else source
    target = staged / source.name
    if not target.is_file() or target.read_bytes() != chosen.read_bytes():
      shutil.copyfile(chosen, target)
    if fresh:
      fresh_names.append(source.name)
  names = {source.name for source in sources}
  for old in staged.glob("*.ipynb"):
    if old.name not in names:
      old.unlink()
  return fresh_names
