"""Flax modules over `jaxlod.ops` (Linen here, NNX in `jaxlod.nn.nnx`)."""

__all__: list[str] = []
