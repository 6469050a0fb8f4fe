"""Runnable programs, ``python -m jaxlod.examples.NAME`` (``tour``, ``g2p``,
``w1``), and the modules they share with the notebooks and benchmarks:
``g2p_data`` and ``g2p_model`` (the G2P example's data and model) and
``timing`` (side-by-side timing)."""
