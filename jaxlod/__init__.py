"""jaxlod: padding-free variable-length sequences for JAX and Flax.

`LoDTensor` packs the rows of variable-length sequences with multi-level
offsets on static capacities chosen by a `Buckets` policy; `jaxlod.ops` holds
the rank table and the ops built on it.
"""

from jaxlod._buckets import Buckets, Capacity
from jaxlod._cache import enable_compilation_cache
from jaxlod._checks import unchecked
from jaxlod._faults import Fault
from jaxlod._lod import LoDTensor

__version__ = "0.1.0"

__all__ = [
  "Buckets",
  "Capacity",
  "Fault",
  "LoDTensor",
  "__version__",
  "enable_compilation_cache",
  "unchecked",
]
