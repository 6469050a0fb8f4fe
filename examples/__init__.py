"""Runnable examples of jaxlod, run from the repository root.

``python -m examples.g2p`` trains and scores the grapheme-to-phoneme model
(the main example); ``python -m examples.w1`` trains an LSTM on
sentence-length batches and times a training step against padded
`flax.linen.RNN`. They need the ``examples`` extra
(``pip install -e '.[examples]'``).
"""
