"""The examples of the docs pages run and print what the pages say."""

import doctest
import pathlib

import pytest

# The site's landing page, and its page that includes changes.md, have no
# examples; the site's other pages, in docs/guide/ and docs/api/, are tested
# by tests/test_docs_site.py.
SITE_PAGES = {"index.md", "api_changes.md"}
DOCS = sorted(
  page
  for page in (pathlib.Path(__file__).parent.parent / "docs").glob("*.md")
  if page.name not in SITE_PAGES
)

# Pages whose examples need an optional dependency: skipped without it.
NEEDS = {"interop.md": "torch", "data.md": "grain"}


@pytest.mark.slow
@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_docs_examples(page):
  if page.name in NEEDS:
    pytest.importorskip(NEEDS[page.name])
  result = doctest.testfile(
    str(page), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False
  )
  assert result.attempted > 0, f"{page.name} has no examples"
  assert result.failed == 0, f"{result.failed} example(s) failed in {page.name}"


def test_ops_page_lists_every_sequence_op():
  from tests.test_public_api import SEQUENCE_OPS

  text = (pathlib.Path(__file__).parent.parent / "docs" / "ops.md").read_text()
  missing = [name for name in sorted(SEQUENCE_OPS) if f"`{name}(" not in text]
  assert not missing, f"docs/ops.md does not list {missing}"
