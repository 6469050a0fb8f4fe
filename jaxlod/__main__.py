"""``python -m jaxlod``: the main example program."""

import argparse

parser = argparse.ArgumentParser(
  prog="python -m jaxlod",
  description="A tour of jaxlod, about 40 s on 2 CPU cores: a LoD batch, its "
  "rank table and shrinking schedule (jaxlod.examples.tour), then a few LSTM "
  "training steps timed side by side against padded flax.linen.RNN and a "
  "dense floor (jaxlod.examples.w1). The main example is python -m "
  "jaxlod.examples.g2p (--help).",
)
parser.parse_args()

# isort: split
from jaxlod import enable_compilation_cache  # noqa: E402
from jaxlod.examples import tour, w1  # noqa: E402

enable_compilation_cache()
tour.main()
print()
w1.main()
