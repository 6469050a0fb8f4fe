"""Host-side data pipeline: length-bucketed batches of LoDTensors.

`Batcher` groups examples of similar length (sorted within shuffled
windows), packs each batch under a token budget on fixed capacities (so a
jitted step compiles once), builds the LoDTensors and rank tables with NumPy,
and prefetches on a background thread. Each item is a `Batch`;
`Batcher.get_state` and `Batcher.set_state` save and restore the position
of the stream with a checkpoint. `plan_capacities` suggests the capacities
and token budget from a sample of lengths. `LoDBatchDataset` applies the
same policy inside a Grain pipeline (the ``jaxlod[grain]`` extra), where
Grain's iterator state checkpoints it; Grain is imported when the name is
first used.
"""

from jaxlod.data._batcher import Batcher
from jaxlod.data._capacities import Candidate, CapacityPlan, plan_capacities
from jaxlod.data._packing import Batch

__all__ = [
  "Batch",
  "Batcher",
  "Candidate",
  "CapacityPlan",
  "LoDBatchDataset",
  "plan_capacities",
]


def __getattr__(name: str):
  if name == "LoDBatchDataset":
    from jaxlod.data._extras import grain_dataset

    value = globals()[name] = grain_dataset()
    return value
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
