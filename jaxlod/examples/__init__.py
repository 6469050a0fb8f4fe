"""Runnable programs: ``python -m jaxlod.examples.NAME``."""
