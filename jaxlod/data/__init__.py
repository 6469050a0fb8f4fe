"""Host-side data pipeline: length-bucketed batches of LoDTensors.

`Batcher` groups examples of similar length (sorted within shuffled
windows), packs each batch under a token budget on fixed capacities (so a
jitted step compiles once), builds the LoDTensors and rank tables with NumPy,
and prefetches on a background thread. Each item is a `Batch`.
`plan_capacities` suggests the capacities and token budget from a sample of
lengths.
"""

from jaxlod.data._batcher import Batch, Batcher
from jaxlod.data._plan import Candidate, CapacityPlan, plan_capacities

__all__ = ["Batch", "Batcher", "Candidate", "CapacityPlan", "plan_capacities"]
