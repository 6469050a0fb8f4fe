"""Testing helpers for users writing their own step functions, cells and ops.

`check_independent` checks that the sequences of a LoDTensor stay
independent through a function: changing one sequence, even to ``inf``,
``NaN`` or ``1e30``, changes no other sequence's outputs or gradients.
"""

from jaxlod.testing._independence import IndependenceError, check_independent

__all__ = ["IndependenceError", "check_independent"]
