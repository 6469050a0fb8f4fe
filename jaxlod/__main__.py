"""``python -m jaxlod``: the main example program."""

from jaxlod import enable_compilation_cache
from jaxlod.examples import tour, w1

enable_compilation_cache()
tour.main()
print()
w1.main()
