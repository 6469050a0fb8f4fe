"""jaxlod's imports run one way, down its floors, with no cycle.

The floors, from the bottom (the house style): the core check helpers, then
`LoDTensor` and its capacities, `ops`, `nn`, `data`, `parallel`, `interop`,
and above them the package's face and its program (``python -m jaxlod``). A
module may import a module of its own floor or of a floor below; never one
above, at module level, inside a function, or under ``TYPE_CHECKING``.
Within a floor the imports form no cycle. The graph is read from the source
(AST): nothing is imported.
"""

import ast
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PACKAGE = ROOT / "jaxlod"

# Each floor: the modules on it and, through a package name, its modules.
FLOORS = (
  ("core", ("jaxlod._checks", "jaxlod._host", "jaxlod._vma", "jaxlod._cache")),
  (
    "LoDTensor and capacities",
    (
      "jaxlod._serial",
      "jaxlod._buckets",
      "jaxlod._lod_checks",
      "jaxlod._faults",
      "jaxlod._lod",
    ),
  ),
  ("ops", ("jaxlod.ops",)),
  ("nn", ("jaxlod.nn",)),
  ("data", ("jaxlod.data",)),
  ("parallel", ("jaxlod.parallel",)),
  ("interop", ("jaxlod.interop",)),
  (
    "the package's face",
    ("jaxlod", "jaxlod.__main__", "jaxlod._tour", "jaxlod.testing"),
  ),
)
CORE = "jaxlod._checks"  # imports nothing from jaxlod
CORE_LINES = 500
FILE_LINES = 800


def module_name(file: pathlib.Path, root: pathlib.Path) -> str:
  parts = list(file.relative_to(root).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """Every module of the ``jaxlod`` package under `root`, by name."""
  return {module_name(f, root): f for f in sorted((root / "jaxlod").rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
  """The dotted names an import statement reads, relative imports resolved."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if not isinstance(node, ast.ImportFrom):
    return []
  source = node.module or ""
  if node.level:
    base = module.split(".")[: None if is_package else -1]
    base = base[: len(base) - node.level + 1]
    source = ".".join(base + ([source] if source else []))
  return [f"{source}.{alias.name}" for alias in node.names]


def import_graph(root: pathlib.Path = ROOT) -> dict[str, dict[str, int]]:
  """``{module: {imported module: first line}}`` for the jaxlod modules under
  `root`. Every import statement counts, wherever it stands. A name imported
  from a module (``from jaxlod._lod import LoDTensor``) is an edge to that
  module; a name from a package's face (``from jaxlod import LoDTensor``) is
  an edge to the face."""
  found = modules(root)
  graph: dict[str, dict[str, int]] = {}
  for module, file in found.items():
    edges = graph[module] = {}
    tree = ast.parse(file.read_text(), filename=str(file))
    for node in ast.walk(tree):
      for name in _imported(node, module, file.name == "__init__.py"):
        while name and name not in found:
          name = name.rpartition(".")[0]
        if name and name != module:
          edges.setdefault(name, node.lineno)
  return graph


def floor_of(module: str) -> int:
  """The index in `FLOORS` of the floor `module` stands on."""
  best = None
  for index, (_, names) in enumerate(FLOORS):
    for name in names:
      if module == name or (name != "jaxlod" and module.startswith(name + ".")):
        best = index
  if best is None:
    raise LookupError(
      f"{module} stands on no floor: add it to FLOORS in {pathlib.Path(__file__).name}"
    )
  return best


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
  """``module:line -> imported (floor -> floor)`` for each import up a floor."""
  found = []
  for module, edges in sorted(graph.items()):
    for target, line in sorted(edges.items()):
      low, high = floor_of(module), floor_of(target)
      if high > low:
        found.append(
          f"{module}:{line} -> {target} ({FLOORS[low][0]} -> {FLOORS[high][0]})"
        )
  return found


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
  """The import cycles: each strongly connected set of two or more modules
  (Tarjan's algorithm), sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  found = []

  def visit(module: str) -> None:
    index[module] = low[module] = len(index)
    stack.append(module)
    for target in graph.get(module, {}):
      if target not in index:
        visit(target)
        low[module] = min(low[module], low[target])
      elif target in stack:
        low[module] = min(low[module], index[target])
    if low[module] == index[module]:
      component = []
      while not component or component[-1] != module:
        component.append(stack.pop())
      if len(component) > 1:
        found.append(sorted(component))

  for module in sorted(graph):
    if module not in index:
      visit(module)
  return sorted(found)


def test_the_graph_finds_planted_upward_imports_and_cycles(tmp_path):
  files = {
    "jaxlod/__init__.py": "from jaxlod._lod import LoDTensor\n",
    "jaxlod/_checks.py": "def f():\n  from jaxlod import _lod\n",
    "jaxlod/_lod.py": "from jaxlod import _checks\nclass LoDTensor: ...\n",
    "jaxlod/ops/__init__.py": "from jaxlod.ops._a import a\n",
    "jaxlod/ops/_a.py": """
      from typing import TYPE_CHECKING
      from jaxlod.ops import _b
      if TYPE_CHECKING:
        from jaxlod.nn import Layer
      def a(): ...
      """,
    "jaxlod/ops/_b.py": "def b():\n  from . import _a\n",
    "jaxlod/nn/__init__.py": "from jaxlod import LoDTensor\nclass Layer: ...\n",
  }
  for name, text in files.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
  graph = import_graph(tmp_path)
  assert upward_imports(graph) == [
    "jaxlod._checks:2 -> jaxlod._lod (core -> LoDTensor and capacities)",
    "jaxlod.nn:1 -> jaxlod (nn -> the package's face)",
    "jaxlod.ops._a:5 -> jaxlod.nn (ops -> nn)",
  ]
  assert cycles(graph) == [
    ["jaxlod._checks", "jaxlod._lod"],
    ["jaxlod.ops._a", "jaxlod.ops._b"],
  ]


def test_a_module_off_the_floors_is_named():
  with pytest.raises(LookupError, match=r"jaxlod\._new stands on no floor"):
    floor_of("jaxlod._new")


def test_every_module_stands_on_a_floor():
  for module in modules(ROOT):
    floor_of(module)


def test_no_import_runs_up_a_floor():
  found = upward_imports(import_graph())
  assert not found, "imports up a floor:\n" + "\n".join(found)


def test_no_import_cycle():
  found = cycles(import_graph())
  assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_core_check_module_imports_nothing_from_jaxlod_and_stays_small():
  assert import_graph()[CORE] == {}
  lines = len(modules(ROOT)[CORE].read_text().splitlines())
  assert lines < CORE_LINES, f"{CORE} has {lines} lines"


def test_no_file_of_the_package_is_over_800_lines():
  sizes = {
    module: len(file.read_text().splitlines()) for module, file in modules(ROOT).items()
  }
  long = {module: n for module, n in sizes.items() if n > FILE_LINES}
  assert not long, f"over {FILE_LINES} lines: {long}"


def test_the_ops_import_nothing_from_flax():
  """`jaxlod.ops` is pure JAX: the layers over Flax live in `jaxlod.nn`."""
  found = {}
  for module, file in modules(ROOT).items():
    if module != "jaxlod.ops" and not module.startswith("jaxlod.ops."):
      continue
    tree = ast.parse(file.read_text(), filename=str(file))
    for node in ast.walk(tree):
      for name in _imported(node, module, file.name == "__init__.py"):
        if name == "flax" or name.startswith("flax."):
          found[module] = node.lineno
  assert not found, f"modules of jaxlod.ops importing flax (line): {found}"
