"""Every function of the package reads in one screen: at most 60 lines of
code (its docstring, blank lines and comments aside; nested functions count
in the function that holds them), and one over 20 lines has a docstring.
Read from the source (AST), as the import graph is."""

import ast
import pathlib

from tests.test_import_graph import ROOT, modules

CODE_LINES = 60
UNDOCUMENTED_LINES = 20


def _docstring_lines(node: ast.AST) -> range:
  body = getattr(node, "body", [])
  if (
    body
    and isinstance(body[0], ast.Expr)
    and isinstance(body[0].value, ast.Constant)
    and isinstance(body[0].value.value, str)
  ):
    return range(body[0].lineno, body[0].end_lineno + 1)
  return range(0)


def function_sizes(file: pathlib.Path) -> list[tuple[str, int, bool]]:
  """``(name at line, lines of code, has a docstring)`` for every function of
  `file`, nested ones included."""
  text = file.read_text()
  lines = text.splitlines()
  found = []
  for node in ast.walk(ast.parse(text, filename=str(file))):
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      continue
    doc = _docstring_lines(node)
    code = [
      i
      for i in range(node.lineno, node.end_lineno + 1)
      if i not in doc
      and lines[i - 1].strip()
      and not lines[i - 1].strip().startswith("#")
    ]
    found.append((f"{node.name} at line {node.lineno}", len(code), bool(doc)))
  return found


def oversized(root: pathlib.Path) -> tuple[list[str], list[str]]:
  """The functions under `root`'s package over `CODE_LINES`, and those over
  `UNDOCUMENTED_LINES` without a docstring."""
  long, undocumented = [], []
  for module, file in modules(root).items():
    for name, size, documented in function_sizes(file):
      if size > CODE_LINES:
        long.append(f"{module}.{name}: {size} lines")
      if size > UNDOCUMENTED_LINES and not documented:
        undocumented.append(f"{module}.{name}: {size} lines")
  return long, undocumented


def test_the_count_finds_planted_long_and_undocumented_functions(tmp_path):
  at_limit = (
    '  """A docstring of\n  two lines."""\n\n  # not counted\n' + "  y = 0\n" * 59
  )
  over = "".join(f"  x{i} = {i}  # a comment\n" for i in range(60))
  nested = "  def inner():\n" + "    z = 1\n" * 20
  (tmp_path / "jaxlod").mkdir()
  (tmp_path / "jaxlod" / "_big.py").write_text(
    f"def at_limit():\n{at_limit}\n\ndef over():\n{over}\n\ndef outer():\n{nested}"
  )
  long, undocumented = oversized(tmp_path)
  assert long == ["jaxlod._big.over at line 67: 61 lines"]
  assert undocumented == [
    "jaxlod._big.over at line 67: 61 lines",
    "jaxlod._big.outer at line 130: 22 lines",
    "jaxlod._big.inner at line 131: 21 lines",
  ]


def test_no_function_is_over_60_lines_and_every_long_one_is_documented():
  long, undocumented = oversized(ROOT)
  assert not long, f"over {CODE_LINES} lines of code:\n" + "\n".join(long)
  assert not undocumented, "no docstring:\n" + "\n".join(undocumented)
