"""The wheel as users install it: built from the package's own files, it
ships the PEP 561 marker (``jaxlod/py.typed``) beside the modules, so type
checkers read jaxlod's annotations."""

import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).parent.parent


def test_the_wheel_ships_the_typed_marker(tmp_path):
  source = tmp_path / "source"
  source.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, source / name)
  shutil.copytree(
    ROOT / "jaxlod", source / "jaxlod", ignore=shutil.ignore_patterns("__pycache__")
  )
  # In pip's isolated build environment: the build backend pyproject.toml
  # names, whatever setuptools the test's environment holds.
  command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
  command += ["-w", str(tmp_path / "dist")]
  subprocess.run([*command, str(source)], check=True, timeout=300)
  (wheel,) = (tmp_path / "dist").glob("jaxlod-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "jaxlod/py.typed" in names
  assert "jaxlod/ops/_loop/_dispatch.py" in names  # subpackages too
