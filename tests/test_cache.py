"""`jaxlod.enable_compilation_cache`: a second process loads what the first
compiled, the environment variable turns it off, a set directory is kept."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import jaxlod

# Compiles one function with the cache on and prints what happened.
SCRIPT = textwrap.dedent(
  """
  import json
  import jax, jax.numpy as jnp
  import jaxlod

  hits = []
  jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event)
    if event == "/jax/compilation_cache/cache_hits" else None
  )
  {prelude}
  directory = jaxlod.enable_compilation_cache(min_compile_time_s=0.0)
  jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
  print(json.dumps({{
    "directory": directory,
    "config": jax.config.jax_compilation_cache_dir,
    "hits": len(hits),
  }}))
  """
)


def run(setting: str, prelude: str = "") -> dict:
  """Runs `SCRIPT` in a fresh process with ``JAXLOD_COMPILATION_CACHE=setting``."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAXLOD_COMPILATION_CACHE"] = setting
  done = subprocess.run(
    [sys.executable, "-c", SCRIPT.format(prelude=prelude)],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_compiled_program(tmp_path):
  cache = str(tmp_path / "cache")
  first = run(cache)
  assert first == {"directory": cache, "config": cache, "hits": 0}
  assert any((tmp_path / "cache").iterdir())
  assert run(cache)["hits"] >= 1


@pytest.mark.parametrize("setting", ["off", "0", ""])
def test_environment_turns_it_off(setting):
  assert run(setting) == {"directory": None, "config": None, "hits": 0}


def test_a_directory_set_already_is_kept(tmp_path):
  mine = str(tmp_path / "mine")
  prelude = f"jax.config.update('jax_compilation_cache_dir', {mine!r})"
  result = run(str(tmp_path / "other"), prelude)
  assert result["directory"] == result["config"] == mine
  assert not (tmp_path / "other").exists()


def test_negative_min_compile_time_is_refused():
  with pytest.raises(ValueError, match=r"`min_compile_time_s` >= 0, got -1"):
    jaxlod.enable_compilation_cache("/nonexistent", min_compile_time_s=-1)


@pytest.mark.parametrize("directory", ["", "  "])
def test_an_empty_directory_is_refused(directory):
  """`Path("")` is the current directory: the cache landed there."""
  with pytest.raises(
    ValueError,
    match=r"Expected `directory` to be a directory path, got '\s*' \(an empty path "
    r"is the current directory; to turn the cache off",
  ):
    jaxlod.enable_compilation_cache(directory)


def test_a_file_is_refused_as_the_directory(tmp_path):
  file = tmp_path / "file"
  file.write_text("")
  with pytest.raises(
    ValueError,
    match=rf"Expected `directory` to be a directory or a path that does not exist "
    rf"yet, got '{file}', which exists and is not a directory\.",
  ):
    jaxlod.enable_compilation_cache(file)


@pytest.mark.parametrize("below", ["cache", "a/b/cache"])
def test_a_path_below_a_file_is_refused(tmp_path, below):
  """JAX would warn NotADirectoryError on every cache access."""
  file = tmp_path / "file"
  file.write_text("")
  with pytest.raises(
    ValueError,
    match=r"Expected `directory` to be a directory or a path that does not exist "
    rf"yet, got '{re.escape(str(file / below))}', below '{re.escape(str(file))}', "
    r"which exists and is not a directory\.",
  ):
    jaxlod.enable_compilation_cache(str(file / below))


def test_a_path_below_a_file_in_the_environment_is_refused(tmp_path):
  file = tmp_path / "file"
  file.write_text("")
  with pytest.raises(subprocess.CalledProcessError) as info:
    run(str(file / "cache"))
  assert (
    "Expected the JAXLOD_COMPILATION_CACHE environment variable to be a directory "
    f"or a path that does not exist yet, got '{file / 'cache'}', below '{file}', "
    "which exists and is not a directory."
  ) in info.value.stderr


def test_a_path_below_a_directory_that_does_not_exist_yet_is_kept(tmp_path):
  cache = tmp_path / "new" / "deeper" / "cache"
  result = run(str(cache))
  assert result["directory"] == result["config"] == str(cache)
  assert cache.is_dir()


def test_a_file_in_the_environment_is_refused(tmp_path):
  file = tmp_path / "file"
  file.write_text("")
  with pytest.raises(subprocess.CalledProcessError) as info:
    run(str(file))
  assert "Expected the JAXLOD_COMPILATION_CACHE environment variable to be a " in (
    info.value.stderr
  )
