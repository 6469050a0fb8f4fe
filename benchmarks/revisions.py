"""One module of jaxlod as it was at a git revision, loaded beside the
working tree's jaxlod, so that two revisions of one op run side by side in
one process (the same batch, weights and machine load)."""

from __future__ import annotations

import argparse
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


def parse_args(
  doc: str, argv: list[str] | None, known: Any, workloads: str, repeats: int
) -> tuple[list[str], list[str], int, str | None]:
  """A revisions script's command line (its module docstring `doc`):
  ``--revisions A,B[,...]`` (at least two), ``--workloads`` (of `known`;
  default `workloads`), ``--repeats`` (default `repeats`) and ``--json``;
  returns them in that order."""
  parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  parser.add_argument("--revisions", required=True, help="git revisions, e.g. A,B")
  parser.add_argument("--workloads", default=workloads, help=f"of {sorted(known)}")
  parser.add_argument("--repeats", type=int, default=repeats, help="timed rounds")
  parser.add_argument("--json", help="also write the report here")
  args = parser.parse_args(argv)
  revisions = [r for r in args.revisions.split(",") if r]
  names = [n for n in args.workloads.split(",") if n]
  unknown = sorted(set(names) - set(known))
  if unknown or not names:
    parser.error(f"--workloads: unknown {unknown}; known {sorted(known)}")
  if len(revisions) < 2:
    parser.error("--revisions: give at least two")
  if args.repeats < 1:
    parser.error("--repeats must be at least 1")
  return revisions, names, args.repeats, args.json
