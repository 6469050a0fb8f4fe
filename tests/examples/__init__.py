"""Tests of examples/ (the G2P example, W1) and of ``python -m jaxlod``."""
