"""Host-side data pipeline: length-bucketed batches of LoDTensors.

`Batcher` groups examples of similar length (sorted within shuffled
windows), packs each batch under a token budget on fixed capacities (so a
jitted step compiles once), builds the LoDTensors and rank tables with NumPy,
and prefetches on a background thread. Each item is a `Batch`;
`Batcher.get_state` and `Batcher.set_state` save and restore the position
of the stream with a checkpoint.
"""

from jaxlod.data._batcher import Batch, Batcher

__all__ = ["Batch", "Batcher"]
