"""The notebooks run from top to bottom, in time, and are stored clean.

Each notebook runs in a fresh ``python3`` kernel whose working directory is
the notebook's folder, as Jupyter runs it (the notebooks find the repository
root from there, so they also run from the root), with the repository root
on ``PYTHONPATH``, as the documentation build runs them (docs/conf.py): they
import the repository's ``examples`` and ``benchmarks``. A cell error fails
the test with that cell's traceback; so does a notebook that runs past
`TIME_LIMIT_S` in all, or prints a Python warning.
"""

import math
import os
import pathlib
import re
import time

import jax
import nbformat
import pytest
from nbformat import v4

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = ROOT / "notebooks"
# The executed notebooks, which the documentation site renders (docs/conf.py
# reads them there, so that no notebook runs twice in a CI run).
EXECUTED = ROOT / "build" / "executed_notebooks"
EXPECTED = (
  "01_lod_tour.ipynb",
  "02_dynamic_rnn.ipynb",
  "03_seq2seq_attention.ipynb",
  "04_performance.ipynb",
)
# A notebook's bound on a cold compilation cache, on 2 cores shared with the
# other test worker: 03 (the slowest) runs in about 120 s alone and took
# 183 s beside the rest of the suite.
TIME_LIMIT_S = 300.0
FOUND = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WARNING = re.compile(r"\b\w*Warning: ")


def _stderr_text(nb: nbformat.NotebookNode) -> str:
  return ANSI.sub(
    "",
    "".join(
      out.get("text", "")
      for cell in nb.cells
      if cell.cell_type == "code"
      for out in cell.outputs
      if out.output_type == "stream" and out.name == "stderr"
    ),
  )


def _output_text(cell: nbformat.NotebookNode) -> str:
  """The text a code cell shows: its streams and its plain-text results."""
  return "".join(
    out.get("text", "") + out.get("data", {}).get("text/plain", "")
    for out in cell.outputs
  )


def execute(
  path: pathlib.Path, limit_s: float, save_to: pathlib.Path | None = None
) -> float:
  """Runs the notebook at `path` in its folder; fails the test on any problem.
  `save_to`: where the executed notebook is written, once it passed.

  Returns:
    The seconds it took, kernel start included.
  """
  from nbclient import NotebookClient
  from nbclient.exceptions import CellExecutionError, CellTimeoutError

  nb = nbformat.read(path, as_version=4)
  name = f"{path.parent.name}/{path.name}"
  start = time.perf_counter()

  def remaining_s(cell) -> int:
    # nbclient's timeout is per cell; each cell gets what the others left.
    return max(1, math.ceil(limit_s - (time.perf_counter() - start)))

  client = NotebookClient(
    nb,
    timeout_func=remaining_s,
    kernel_name="python3",
    resources={"metadata": {"path": str(path.parent)}},
  )
  try:
    client.execute()
  except CellTimeoutError:
    pytest.fail(
      f"{name} ran past its {limit_s:.0f} s limit ({time.perf_counter() - start:.1f} s)"
    )
  except CellExecutionError as error:
    pytest.fail(f"{name} failed:\n{ANSI.sub('', str(error))}")
  elapsed = time.perf_counter() - start
  if elapsed >= limit_s:
    pytest.fail(f"{name} took {elapsed:.1f} s, over its {limit_s:.0f} s limit")
  stderr = _stderr_text(nb)
  if WARNING.search(stderr):
    pytest.fail(f"{name} printed warnings:\n{stderr}")
  if save_to is not None:
    save_to.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, save_to)
  return elapsed


def test_notebook_set():
  unexpected = sorted(set(FOUND) - set(EXPECTED))
  missing = sorted(set(EXPECTED) - set(FOUND))
  assert not unexpected, f"notebooks/ holds unexpected notebooks {unexpected}"
  assert not missing, f"notebooks/ lacks {missing}"


@pytest.mark.parametrize("name", FOUND)
def test_notebook_is_stored_clean(name):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  nbformat.validate(nb)
  assert nb.nbformat == 4, f"{name}: nbformat {nb.nbformat}, expected 4"
  dirty = [
    i
    for i, cell in enumerate(nb.cells)
    if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
  ]
  assert not dirty, f"{name}: cells {dirty} hold outputs or execution counts"
  assert nb.metadata.kernelspec.name == "python3", f"{name}: not a python3 notebook"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(EXPECTED) | set(FOUND)))
def test_notebook_runs(name, monkeypatch):
  path = NOTEBOOKS / name
  assert path.exists(), f"notebooks/{name} is missing"
  # The kernel compiles as a user's would (tests/conftest.py sets a faster
  # compilation and exact precision for the tests), since the notebooks print
  # timings.
  test_flags = ("--xla_backend_optimization_level", "--xla_allow_excess_precision")
  flags = [
    f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(test_flags)
  ]
  monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
  # `examples` and `benchmarks` import from the repository root.
  paths = [str(ROOT.resolve()), os.environ.get("PYTHONPATH")]
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
  execute(path, TIME_LIMIT_S, save_to=EXECUTED / name)
  # The site renders these outputs: nothing of this machine's may show (the
  # kernel's compilation cache is the test session's, see conftest.py).
  cache = jax.config.jax_compilation_cache_dir
  executed = nbformat.read(EXECUTED / name, as_version=4)
  shown = [
    i
    for i, cell in enumerate(executed.cells)
    if cell.cell_type == "code" and cache and cache in _output_text(cell)
  ]
  assert not shown, f"{name}: cells {shown} show the compilation cache folder {cache!r}"


# -- the harness itself ------------------------------------------------------------


def _write(folder: pathlib.Path, *sources: str) -> pathlib.Path:
  path = folder / "scratch.ipynb"
  nb = v4.new_notebook(cells=[v4.new_code_cell(s) for s in sources])
  nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3"}
  nbformat.write(nb, path)
  return path


def test_execute_shows_the_failing_cell(tmp_path):
  path = _write(tmp_path, "x = 1", "def f():\n  raise ValueError('no such row')\nf()")
  with pytest.raises(
    pytest.fail.Exception, match=r"(?s)scratch\.ipynb failed:.*f\(\).*no such row"
  ):
    execute(path, 60.0)


def test_execute_limits_the_whole_notebook(tmp_path):
  # Each cell alone is under the limit; together they are not.
  path = _write(tmp_path, "import time\ntime.sleep(2)", "time.sleep(2)")
  with pytest.raises(
    pytest.fail.Exception, match=r"scratch\.ipynb ran past its 3 s limit"
  ):
    execute(path, 3.0)


def test_execute_runs_in_the_notebook_folder(tmp_path):
  (tmp_path / "data.txt").write_text("here")
  path = _write(tmp_path, "assert open('data.txt').read() == 'here'")
  assert execute(path, 60.0) < 60.0


def test_execute_saves_the_executed_notebook(tmp_path):
  path = _write(tmp_path, "print('ran')")
  execute(path, 60.0, save_to=tmp_path / "out" / "scratch.ipynb")
  (cell,) = nbformat.read(tmp_path / "out" / "scratch.ipynb", as_version=4).cells
  assert cell.outputs[0].text == "ran\n"
  assert not nbformat.read(path, as_version=4).cells[0].outputs  # source untouched


def test_execute_fails_on_warnings(tmp_path):
  path = _write(tmp_path, "import warnings\nwarnings.warn('stale cache')")
  with pytest.raises(
    pytest.fail.Exception, match=r"(?s)printed warnings:.*UserWarning: stale cache"
  ):
    execute(path, 60.0)
