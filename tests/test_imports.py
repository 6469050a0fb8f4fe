"""No module of jaxlod uses another module's `_private` names.

A module's public face is its names without a leading underscore; importing
a private *module* of the package (``from jaxlod.ops import _segment``) is
fine, importing or reading a private *name* of another module is not
(the house style: one home per concept, used through its public names). The scan
reads the source (AST) and imports nothing. A second scan holds what users
read and run (the README, the docs, the notebooks, the examples, the
benchmarks) to jaxlod's public modules.
"""

import ast
import json
import pathlib
import re

PACKAGE = pathlib.Path(__file__).parent.parent / "jaxlod"
ROOT = PACKAGE.parent


def _is_module(dotted: str, root: pathlib.Path) -> bool:
  """True when `dotted` (e.g. ``jaxlod.ops._rnn``) names a module or package."""
  path = root.joinpath(*dotted.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(node: ast.ImportFrom, file: pathlib.Path, root: pathlib.Path) -> str:
  """The absolute module of ``from ... import``, resolving relative imports."""
  if not node.level:
    return node.module or ""
  parts = list(file.relative_to(root).with_suffix("").parts)
  base = parts[: len(parts) - node.level]
  return ".".join(base + ([node.module] if node.module else []))


def _module_of(node: ast.expr, modules: dict[str, str], root: pathlib.Path):
  """The jaxlod module an expression names (``_lod``, ``jaxlod.ops``), if any."""
  if isinstance(node, ast.Name):
    return modules.get(node.id)
  if isinstance(node, ast.Attribute):
    parent = _module_of(node.value, modules, root)
    if parent is not None and _is_module(f"{parent}.{node.attr}", root):
      return f"{parent}.{node.attr}"
  return None


def private_uses(file: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
  """``file: name`` for each private name `file` takes from another module."""
  tree = ast.parse(file.read_text(), filename=str(file))
  modules: dict[str, str] = {}  # local name -> jaxlod module it is bound to
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "jaxlod":
          if alias.asname:
            modules[alias.asname] = alias.name
          else:
            modules["jaxlod"] = "jaxlod"
    elif isinstance(node, ast.ImportFrom):
      source = _absolute(node, file, root)
      if source.split(".")[0] != "jaxlod":
        continue
      for alias in node.names:
        dotted = f"{source}.{alias.name}"
        if _is_module(dotted, root):
          modules[alias.asname or alias.name] = dotted
        elif _private(alias.name):
          found.append((node.lineno, alias.name))
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _private(node.attr):
      parent = _module_of(node.value, modules, root)
      if parent is not None and not _is_module(f"{parent}.{node.attr}", root):
        found.append((node.lineno, node.attr))
  where = file.relative_to(root).as_posix()
  return [f"{where}:{line}: {name}" for line, name in sorted(found)]


def test_the_scan_finds_private_names(tmp_path):
  source = tmp_path / "jaxlod" / "ops" / "_mine.py"
  source.parent.mkdir(parents=True)
  source.write_text(
    "from jaxlod import _lod\n"
    "from jaxlod.ops import _segment, _rnn as r\n"
    "from jaxlod.ops._array import _gather, owners\n"
    "import jaxlod.ops\n"
    "_lod._check_offsets\n"
    "r._is_lod\n"
    "_lod.__name__\n"
    "jaxlod.ops._rank._level\n"
    "_segment.require\n"
  )
  for name in ("_lod", "ops/__init__", "ops/_segment", "ops/_rnn", "ops/_array"):
    (tmp_path / "jaxlod" / f"{name}.py").touch()
  (tmp_path / "jaxlod" / "__init__.py").touch()
  (tmp_path / "jaxlod" / "ops" / "_rank.py").touch()
  assert private_uses(source, tmp_path) == [
    "jaxlod/ops/_mine.py:3: _gather",
    "jaxlod/ops/_mine.py:5: _check_offsets",
    "jaxlod/ops/_mine.py:6: _is_lod",
    "jaxlod/ops/_mine.py:8: _level",
  ]


def test_no_module_uses_another_modules_private_names():
  found = [use for file in sorted(PACKAGE.rglob("*.py")) for use in private_uses(file)]
  assert not found, "private names used across modules:\n" + "\n".join(found)


# What users read and run: they import jaxlod's public modules only (the
# house style); the tests, which check internals, may import private ones.
USER_FACING = (
  "README.md",
  "docs/*.md",
  "notebooks/*.ipynb",
  "benchmarks/*.py",
  "examples/**/*.py",
)
IMPORT = re.compile(
  r"^[ \t]*(?:>>>[ \t]+|\.\.\.[ \t]+)?(?:"
  r"from[ \t]+(jaxlod[\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w ,\t]+))"
  r"|import[ \t]+(jaxlod[\w.]*))",
  re.MULTILINE,
)


def private_imports(text: str) -> list[str]:
  """The import lines of `text` that name a private jaxlod module or name."""
  found = []
  for match in IMPORT.finditer(text):
    module = match[1] or match[4]
    names = re.sub(r"#.*", "", match[2] or match[3] or "").split(",")
    parts = module.split(".")[1:] + [n.split()[0] for n in names if n.strip()]
    if any(_private(part) for part in parts):
      found.append(" ".join(match[0].split()))
  return found


def _user_text(file: pathlib.Path) -> str:
  if file.suffix != ".ipynb":
    return file.read_text()
  cells = json.loads(file.read_text())["cells"]
  return "\n".join("".join(cell["source"]) for cell in cells)


def test_the_import_scan_finds_private_modules_and_names():
  text = (
    "from jaxlod.examples import _g2p_data as data\n"
    ">>> from jaxlod.ops._rnn import dynamic_rnn\n"
    "import jaxlod._lod\n"
    "from jaxlod.data import (Batcher, _extras)\n"
    "from jaxlod.data import (\n  Batch,\n  _extras,\n)\n"
    "from jaxlod.examples.timing import machine_info as _machine_info\n"
    "from jaxlod.ops import rank_table  # _private in a comment\n"
    "print(jaxlod._lod.LoDTensor)\n"
  )
  assert private_imports(text) == [
    "from jaxlod.examples import _g2p_data as data",
    ">>> from jaxlod.ops._rnn import dynamic_rnn",
    "import jaxlod._lod",
    "from jaxlod.data import (Batcher, _extras)",
    "from jaxlod.data import ( Batch, _extras, )",
  ]


def test_no_user_facing_file_imports_a_private_jaxlod_module():
  files = sorted({f for pattern in USER_FACING for f in ROOT.glob(pattern)})
  assert len(files) > 10, files
  found = [
    f"{file.relative_to(ROOT).as_posix()}: {name}"
    for file in files
    for name in private_imports(_user_text(file))
  ]
  assert not found, "private jaxlod modules imported by users' files:\n" + "\n".join(
    found
  )
