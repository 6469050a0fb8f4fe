"""Flax's own recurrent tests pass against jaxlod's drop-ins (issue 53).

The sdist of the installed Flax ships ``tests/linen/linen_recurrent_test.py``
and ``tests/nnx/nn/recurrent_test.py``. They run in a child pytest with the
plugin tests/nn/flax_suite.py, which replaces ``flax.linen.RNN``,
``flax.linen.Bidirectional``, ``flax.nnx.RNN`` and ``flax.nnx.Bidirectional``
with jaxlod's drop-ins and marks the deliberate differences xfail. No Flax
code is copied into the repository: the sdist comes from `$JAXLOD_FLAX_SDIST`
(a local ``.tar.gz``) or is downloaded once into ``build/flax-sdist/``.
"""

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

import pytest

from tests.nn.flax_suite import BUILDS_RNN, EXPECTED_FAILURES, SCANS

ROOT = pathlib.Path(__file__).parent.parent.parent
CACHE = ROOT / "build" / "flax-sdist"
# The test files in the sdist, under its top folder ``flax-<version>/``.
TEST_FILES = ("tests/linen/linen_recurrent_test.py", "tests/nnx/nn/recurrent_test.py")
# Issue 53: of the 29 tests it counts (BUILDS_RNN and SCANS), at least 27
# pass; every other failure is a deliberate one of EXPECTED_FAILURES.
COUNTED = BUILDS_RNN + SCANS
MIN_PASSED = 27


def _sdist(version: str) -> pathlib.Path:
  """The sdist of ``flax==version``: `$JAXLOD_FLAX_SDIST`, the cached one, or
  downloaded into the cache. Fails (never skips) when it cannot be had."""
  given = os.environ.get("JAXLOD_FLAX_SDIST")
  if given:
    assert pathlib.Path(given).is_file(), f"JAXLOD_FLAX_SDIST={given} is no file"
    return pathlib.Path(given)
  tarball = CACHE / f"flax-{version}.tar.gz"
  if tarball.exists():
    return tarball
  command = [sys.executable, "-m", "pip", "download", "--no-deps"]
  command += ["--no-binary", ":all:", f"flax=={version}", "-d", str(CACHE)]
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
  except subprocess.TimeoutExpired:
    done = None
  if done is None or done.returncode != 0 or not tarball.exists():
    log = "timed out" if done is None else (done.stdout + done.stderr)[-2000:]
    pytest.fail(
      f"could not download the sdist of flax=={version} into {CACHE}: set "
      f"JAXLOD_FLAX_SDIST to a local flax-{version}.tar.gz to run Flax's "
      f"recurrent tests offline.\n{' '.join(command)}\n{log}"
    )
  return tarball


def _extract(tarball: pathlib.Path, version: str, folder: pathlib.Path):
  """Writes the two test files of `tarball` into `folder`, side by side."""
  with tarfile.open(tarball) as sdist:
    names = set(sdist.getnames())
    for name in TEST_FILES:
      path = f"flax-{version}/{name}"
      assert path in names, f"{tarball} is no sdist of flax {version}: no {path}"
      member = sdist.extractfile(path)
      assert member is not None, f"{tarball}: {path} is no file"
      (folder / pathlib.Path(name).name).write_bytes(member.read())


def _run(folder: pathlib.Path, report: pathlib.Path) -> str:
  """Flax's tests in a child pytest with the plugin, its own rootdir and an
  empty ini (the repository's pytest settings do not apply); the output."""
  ini = folder / "pytest.ini"
  ini.write_text("[pytest]\n")
  command = [sys.executable, "-m", "pytest", "-p", "tests.nn.flax_suite"]
  command += ["-p", "no:cacheprovider", "-n", "0", "-q", "-c", str(ini)]
  command += ["--rootdir", str(folder), f"--junitxml={report}"]
  command += [pathlib.Path(name).name for name in TEST_FILES]
  env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  proc = subprocess.Popen(
    command,
    cwd=folder,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  try:
    out = proc.communicate(timeout=600)[0]
  except subprocess.TimeoutExpired:
    out = None
  finally:  # never leave the child behind, whatever happened
    if proc.poll() is None:
      os.killpg(proc.pid, 9)
      proc.wait()
  assert out is not None, "Flax's recurrent tests ran past 600 s"
  return out


def _outcomes(report: pathlib.Path) -> dict[str, str]:
  """Node id -> passed, failed, error, xfailed or skipped, from the junit xml."""
  outcomes = {}
  for case in ET.parse(report).getroot().iter("testcase"):
    module = case.get("classname", "").split(".")
    file = f"{module[0]}.py"
    nodeid = "::".join([file, *module[1:], case.get("name", "")])
    outcome = "passed"
    for child in case:
      if child.tag in ("failure", "error"):
        outcome = child.tag if child.tag == "error" else "failed"
        break
      if child.tag == "skipped":
        xfail = child.get("type") == "pytest.xfail"
        outcome = "xfailed" if xfail else "skipped"
    outcomes[nodeid] = outcome
  return outcomes


@pytest.mark.slow
def test_flax_recurrent_tests_pass_against_the_dropins(tmp_path):
  version = importlib.metadata.version("flax")
  _extract(_sdist(version), version, tmp_path)
  report = tmp_path / "report.xml"
  out = _run(tmp_path, report)
  assert report.exists(), out[-6000:]
  outcomes = _outcomes(report)
  by = {}
  for nodeid, outcome in sorted(outcomes.items()):
    by.setdefault(outcome, []).append(nodeid)
  rnn_passed = [n for n in BUILDS_RNN if outcomes.get(n) == "passed"]
  counted_passed = [n for n in COUNTED if outcomes.get(n) == "passed"]
  print(
    f"flax {version}: {len(outcomes)} tests, "
    + ", ".join(f"{len(v)} {k}" for k, v in sorted(by.items()))
    + f"; {len(rnn_passed)} of the {len(BUILDS_RNN)} that build an RNN or"
    f" Bidirectional passed, {len(counted_passed)} of the {len(COUNTED)} that"
    " issue 53 counts"
  )
  for outcome in ("failed", "error", "xfailed", "skipped"):
    for nodeid in by.get(outcome, []):
      print(f"  {outcome}: {nodeid}")
  assert not by.get("failed") and not by.get("error"), out[-6000:]
  assert set(by.get("xfailed", [])) == set(EXPECTED_FAILURES), out[-6000:]
  missing = set(COUNTED) - set(outcomes)
  assert not missing, f"Flax's tests no longer hold {sorted(missing)}"
  assert len(counted_passed) >= MIN_PASSED, out[-6000:]


def test_the_expected_failures_are_documented():
  """Each deliberate difference is listed by name with its reason on the
  migration page."""
  page = " ".join((ROOT / "docs" / "guide" / "migrating.md").read_text().split())
  for nodeid, reason in EXPECTED_FAILURES.items():
    assert f"`{nodeid}`: {reason}" in page, nodeid
