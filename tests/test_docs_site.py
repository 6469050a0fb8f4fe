"""The documentation site's sources: the API reference, the guide, the tools.

The Sphinx build itself is not run here: it takes about a minute without
running any notebook, and CI runs it after the tests (docs/conf.py says
how).
"""

import doctest
import importlib
import importlib.util
import os
import pathlib
import re

import pytest

from tests.helpers import PUBLIC_MODULES

DOCS = pathlib.Path(__file__).parent.parent / "docs"
API = DOCS / "api"
GUIDE = sorted((DOCS / "guide").glob("*.md"))
AUTOMODULE = re.compile(r"^\.\. automodule:: (\S+)[ \t]*$", re.M)
# An autosummary directive and its indented (or blank) lines.
AUTOSUMMARY = re.compile(
  r"^\.\. autosummary::[ \t]*\n((?:[ \t]+\S.*\n|[ \t]*\n)*)", re.M
)


def reference() -> dict[str, list[str]]:
  """The names that each page of docs/api/ lists, by the module it documents."""
  pages: dict[str, list[str]] = {}
  for page in sorted(API.glob("*.md")):
    text = page.read_text()
    modules = AUTOMODULE.findall(text)
    if not modules:
      continue
    assert len(modules) == 1, f"docs/api/{page.name} documents {modules}"
    assert modules[0] not in pages, f"{modules[0]} has two pages"
    pages[modules[0]] = [
      line.strip()
      for block in AUTOSUMMARY.findall(text)
      for line in block.splitlines()
      if line.strip() and not line.strip().startswith(":")
    ]
  return pages


def load(name: str):
  """A module of docs/_scripts/."""
  spec = importlib.util.spec_from_file_location(name, DOCS / "_scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_reference_has_a_page_per_public_module():
  pages = reference()
  missing = sorted(set(PUBLIC_MODULES) - set(pages))
  extra = sorted(set(pages) - set(PUBLIC_MODULES))
  assert not missing and not extra, (
    f"docs/api/ lacks pages for {missing} and has pages for {extra}, which "
    "docs/conf.py's PUBLIC_MODULES does not list"
  )


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_reference_lists_every_public_name(module_name):
  listed = reference().get(module_name, [])
  public = importlib.import_module(module_name).__all__
  missing = sorted(set(public) - set(listed))
  extra = sorted(set(listed) - set(public))
  twice = sorted({name for name in listed if listed.count(name) > 1})
  assert not (missing or extra or twice), (
    f"docs/api/ for {module_name}: missing {missing} (in __all__), "
    f"extra {extra} (not in __all__), listed twice {twice}"
  )


@pytest.mark.parametrize("page", GUIDE, ids=[p.name for p in GUIDE])
def test_guide_examples(page):
  result = doctest.testfile(
    str(page), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False
  )
  assert result.failed == 0, f"{result.failed} example(s) failed in {page.name}"


def _write(path: pathlib.Path, text: str, mtime: float) -> None:
  path.write_text(text)
  os.utime(path, (mtime, mtime))


def test_stage_notebooks_takes_fresh_executed_copies(tmp_path):
  notebooks, executed, staged = (tmp_path / n for n in ("nb", "run", "site/nb"))
  notebooks.mkdir()
  executed.mkdir()
  _write(notebooks / "a.ipynb", "clean a", 100.0)
  _write(notebooks / "b.ipynb", "clean b", 100.0)
  _write(notebooks / "c.ipynb", "clean c", 100.0)
  _write(executed / "a.ipynb", "executed a", 200.0)  # fresh
  _write(executed / "b.ipynb", "executed b", 50.0)  # older than its notebook
  staged.mkdir(parents=True)
  (staged / "gone.ipynb").write_text("a notebook since removed")

  stage = load("stage_notebooks").stage
  assert stage(notebooks, executed, staged) == ["a.ipynb"]
  assert {p.name: p.read_text() for p in staged.iterdir()} == {
    "a.ipynb": "executed a",
    "b.ipynb": "clean b",
    "c.ipynb": "clean c",
  }
  # Unchanged content is not written again.
  os.utime(staged / "c.ipynb", (1.0, 1.0))
  assert stage(notebooks, executed, staged) == ["a.ipynb"]
  assert (staged / "c.ipynb").stat().st_mtime == 1.0
  # Without executed copies, every notebook is staged clean.
  assert stage(notebooks, tmp_path / "none", staged) == []
  assert (staged / "a.ipynb").read_text() == "clean a"


def test_schedule_figure_is_a_png(tmp_path):
  path = tmp_path / "schedule.png"
  load("schedule_figure").write(path)
  assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
