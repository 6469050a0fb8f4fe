"""Names of `jaxlod.data` that need an optional extra, imported when used."""

from __future__ import annotations

from typing import Any

MISSING_GRAIN = (
  "jaxlod.data.LoDBatchDataset needs Grain, which is not installed: "
  "pip install 'jaxlod[grain]'."
)


class LoDBatchDataset:
  """Stands in for `jaxlod.data.LoDBatchDataset` where Grain is not installed.

  Raises:
    ImportError: always, saying how to install Grain.
  """

  def __init__(self, *args: Any, **kwargs: Any):
    del args, kwargs
    raise ImportError(MISSING_GRAIN)


def grain_dataset() -> type:
  """``jaxlod.data.LoDBatchDataset``: Grain's, or without Grain the stand-in."""
  try:
    from jaxlod.data import _grain
  except ModuleNotFoundError as error:
    if (error.name or "").partition(".")[0] != "grain":
      raise
    return LoDBatchDataset
  return _grain.LoDBatchDataset
