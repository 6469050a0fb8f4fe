"""Host-side data pipeline: length-bucketed batches of LoDTensors.

`Batcher` groups examples of similar length (sorted within shuffled
windows), packs each batch under a token budget on fixed capacities (so a
jitted step compiles once), builds the LoDTensors and rank tables with NumPy,
and prefetches on a background thread. Each item is a `Batch`.
"""

from jaxlod.data._batcher import Batcher
from jaxlod.data._packing import Batch

__all__ = ["Batch", "Batcher"]
