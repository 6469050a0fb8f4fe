"""One module of jaxlod as it was at a git revision, loaded beside the
working tree's jaxlod, so that two revisions of one op run side by side in
one process (the same batch, weights and machine load)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def load_module(revision: str, source: str, folder: Path) -> Any:
  """The module of `source` (a path in the repository, e.g.
  ``jaxlod/ops/_scan.py``) at git `revision`, written into `folder` and
  imported under a name of its own; its imports resolve to the working
  tree's jaxlod."""
  text = subprocess.run(
    ["git", "show", f"{revision}:{source}"],
    cwd=ROOT,
    check=True,
    capture_output=True,
    text=True,
  ).stdout
  name = f"_{Path(source).stem.lstrip('_')}_at_{len(list(folder.iterdir()))}"
  path = folder / f"{name}.py"
  path.write_text(text)
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module
