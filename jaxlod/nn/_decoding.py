"""What the attentions of both twins run, free of either Flax API.

The Linen and NNX layers differ only in how they hold their parameters;
each of their methods is a short call to a function here (or straight to
`jaxlod.ops`), given the values and callables it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxlod._host import as_array
from jaxlod.ops import _attention as core
from jaxlod.ops._attention import Memory


def attend_query(
  scores: Callable[[jax.Array, Memory], jax.Array],
  query: jax.typing.ArrayLike,
  memory: Any,
  lengths: Any,
  keys: Any,
) -> tuple[jax.Array, jax.Array]:
  """An attention's call: `query` ``[b, hidden]`` scored by `scores` over
  `memory` (an array with `lengths`, a one-level LoDTensor or a
  `jaxlod.ops.Memory`, with `keys`), then `jaxlod.ops.attend`."""
  query = as_array(query, "query")
  memory = core.as_memory(memory, lengths, keys)
  return core.attend(scores(query, memory), memory)
