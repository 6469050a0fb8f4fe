"""JAX's persistent compilation cache, on for jaxlod's programs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import jax

from jaxlod._checks import static_float

ENV = "JAXLOD_COMPILATION_CACHE"
_OFF = frozenset({"", "0", "off", "false", "no"})


def default_cache_dir() -> Path:
  """``$XDG_CACHE_HOME/jaxlod/jax``, or ``~/.cache/jaxlod/jax``."""
  root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(root) / "jaxlod" / "jax"


def enable_compilation_cache(
  directory: str | os.PathLike | None = None, *, min_compile_time_s: float = 0.5
) -> str | None:
  """Turns on JAX's persistent compilation cache (``jax_compilation_cache_dir``).

  jaxlod compiles a forward and a backward loop body per ladder size, so a
  training step takes seconds to compile; with the cache, a second process
  (a rerun, a notebook kernel restart, a test session) loads the compiled
  programs from disk instead. jaxlod's examples, notebooks and tests call this
  at start-up; call it in your own program before its first `jit`
  compilation. A cache directory set already (``jax.config`` or the
  ``JAX_COMPILATION_CACHE_DIR`` variable) is kept as it is.

  Args:
    directory: where the cache lives. Default: the ``JAXLOD_COMPILATION_CACHE``
      environment variable when set (``0``, ``off`` or empty turn the cache
      off), else `default_cache_dir`. A directory that does not exist yet
      is created; an empty path is refused (it is not "off").
    min_compile_time_s: programs that compile faster than this are not
      stored (``jax_persistent_cache_min_compile_time_secs``).

  Returns:
    The cache directory in use, or `None` when the cache is off.

  Raises:
    TypeError: for a `directory` that is not a str, a path or None.
    ValueError: for a `min_compile_time_s` below 0, an empty `directory`
      (it is no way to turn the cache off: call nothing, or set the
      variable to ``off``), or a `directory` (or variable) naming something
      that exists and is not a directory (a file), or a path below one.

  Example:
    >>> import jax, jaxlod
    >>> directory = jaxlod.enable_compilation_cache()
    >>> directory == jax.config.jax_compilation_cache_dir
    True
  """
  min_compile_time_s = static_float(min_compile_time_s, "min_compile_time_s")
  if not min_compile_time_s >= 0:
    raise ValueError(f"Expected `min_compile_time_s` >= 0, got {min_compile_time_s}.")
  if directory is not None and not isinstance(directory, str | os.PathLike):
    raise TypeError(
      f"Expected `directory` to be a str, a path or None, got {directory!r}."
    )
  if directory is not None:
    _check_directory(directory, "`directory`")
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  if directory is None:
    setting = os.environ.get(ENV)
    if setting is not None and setting.strip().lower() in _OFF:
      return None
    if setting:
      _check_directory(setting, f"the {ENV} environment variable")
    directory = setting or default_cache_dir()
  directory = str(Path(directory).expanduser())
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
  return directory


def _check_directory(directory: str | os.PathLike, name: str) -> None:
  """`directory` is not empty (`Path` reads "" as the current directory) and
  is a directory or does not exist yet, below a directory (JAX creates it):
  below a file it could never be created, and JAX would warn
  `NotADirectoryError` on every cache access. Whether it is writable is not
  checked: a cache filled by others may be read-only on purpose."""
  text = os.fspath(directory)
  if isinstance(text, str) and not text.strip():
    raise ValueError(
      f"Expected {name} to be a directory path, got {text!r} (an empty path is "
      f"the current directory; to turn the cache off, leave {ENV} empty or "
      f"'off' and pass no `directory`)."
    )
  path = Path(text).expanduser()
  for existing in (path, *path.parents):
    try:
      mode = existing.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
      continue  # not there yet: JAX creates it, if its parent allows
    except OSError:
      return  # not readable (no permission): left to JAX
    if stat.S_ISDIR(mode):
      return
    below = "" if existing == path else f", below {str(existing)!r}"
    raise ValueError(
      f"Expected {name} to be a directory or a path that does not exist yet, "
      f"got {text!r}{below}, which exists and is not a directory."
    )
