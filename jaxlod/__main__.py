"""``python -m jaxlod``: the main example program."""

from jaxlod.examples import tour, w1

tour.main()
print()
w1.main()
