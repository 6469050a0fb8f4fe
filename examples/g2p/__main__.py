"""``python -m examples.g2p [predict]``: train and score, or transcribe words."""

import sys

from examples.g2p import cli

if sys.argv[1:2] == ["predict"]:
  sys.exit(cli.predict_main(sys.argv[2:]))
cli.main()
