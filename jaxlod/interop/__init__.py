"""Converters between LoDTensors and other libraries' variable-length formats.

`LoDTensor` converts to and from NumPy-level formats itself:
`LoDTensor.from_padded` / `to_padded` (a padded batch and lengths, as
`flax.linen.RNN` takes them), `LoDTensor.from_segment_ids` /
`to_segment_ids` (packed rows with segment ids and positions, as Grain, T5X
and MaxText pack them) and `LoDTensor.from_row_splits` / `row_splits`
(`tf.RaggedTensor`'s nested row splits, without TensorFlow). This module
adds the formats of other frameworks, which it imports only when called:
PyTorch's `PackedSequence` (`pip install 'jaxlod[interop]'`).
"""

from jaxlod.interop._torch import from_packed_sequence, to_packed_sequence

__all__ = ["from_packed_sequence", "to_packed_sequence"]
