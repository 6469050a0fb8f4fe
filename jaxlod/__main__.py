"""``python -m jaxlod``: the main example program."""

from jaxlod.examples.tour import main

main()
