"""Checks of the layers' arguments: attention memories, decoders, cells,
ladders, settings, and the layers given to layers (`jaxlod.nn` and
`jaxlod.nn.nnx`, and the ops they call).

The checks raise at trace time, naming the argument, the expected and the
actual value. The array and value checks these build on live in
`jaxlod._checks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlod._checks import (
  as_array,
  check_callable,
  check_dtype,
  check_integer,
  check_lod,
  check_memory_lengths,
  check_sequence,
  finite_float32,
  is_lod,
  require,
  static_float,
  static_int,
)

if TYPE_CHECKING:
  from jaxlod._lod import LoDTensor
  from jaxlod.ops._attention import Memory


# -- attention decoders ----------------------------------------------------------


def check_memory(memory: Any, name: str = "memory") -> Memory:
  """`memory` must be a `jaxlod.ops.Memory` (see `jaxlod.ops.lod_memory`)."""
  # `jaxlod.ops` imports this module: import its Memory at call time.
  from jaxlod.ops._attention import Memory

  if not isinstance(memory, Memory):
    raise TypeError(
      f"Expected `{name}` to be a jaxlod.ops.Memory (see `lod_memory` and "
      f"`as_memory`), got {type(memory).__name__}."
    )
  check_memory_lengths(memory, name)
  return memory


def check_memory_lod(memory: Any, name: str = "memory") -> LoDTensor:
  """`memory` must be a LoDTensor of one level with vector rows.

  Raises:
    TypeError: for a memory that is not a LoDTensor.
    ValueError: for more than one level or rows that are not vectors.
  """
  memory = check_lod(memory, name)
  if memory.num_levels != 1 or len(memory.feature_shape) != 1:
    raise ValueError(
      f"Expected a LoDTensor `{name}` with one LoD level and values [src_tokens, "
      f"features], got {memory.num_levels} level(s) and values of shape "
      f"{tuple(memory.values.shape)}."
    )
  return memory


def without_keys(memory: Memory, name: str) -> Memory:
  """An attention that precomputes nothing takes no `keys`."""
  if memory.keys is not None:
    raise ValueError(
      f"{name} precomputes no keys (its `keys(memory)` is None), got `keys` of "
      f"shape {tuple(memory.keys.shape)}."
    )
  return memory


def check_query(query: jax.typing.ArrayLike, memory: Memory) -> jax.Array:
  """`query` must be ``[b, hidden]`` with one memory row per query row."""
  memory = check_memory(memory)
  query = as_array(query, "query")
  if query.ndim != 2:
    raise ValueError(f"Expected `query` to have shape [b, hidden], got {query.shape}.")
  if query.shape[0] != memory.values.shape[0]:
    raise ValueError(
      f"Expected one memory sequence per query row: `query` has {query.shape[0]} "
      f"rows, `memory` has {memory.values.shape[0]} sequences (count capacity)."
    )
  return query


def check_width(name: str, actual: int, expected: int, what: str) -> None:
  """A width (last dimension) must match: names both values."""
  if actual != expected:
    raise ValueError(f"Expected `{name}` of width {expected} ({what}), got {actual}.")


def check_keys(memory: Memory, units: int) -> None:
  """`memory.keys` must be ``[b, source_capacity, units]``."""
  expected = (*memory.values.shape[:2], units)
  if memory.keys is None or tuple(memory.keys.shape) != expected:
    got = None if memory.keys is None else tuple(memory.keys.shape)
    raise ValueError(
      f"Expected `keys` to have shape [b, source_capacity, units] = {expected}, "
      f"got {got}."
    )


def check_counts(tgt: LoDTensor, memory: LoDTensor) -> None:
  """`memory` holds one sequence per last-level sequence of `tgt`.

  The count capacities are compared at trace time, the real counts eagerly
  (under `jit` through `jax.experimental.checkify`).
  """
  count, wanted = memory.capacity.sequences[-1], tgt.capacity.sequences[-1]
  if count != wanted:
    raise ValueError(
      f"Expected `memory` to hold one sequence per `tgt` sequence: memory count "
      f"capacity {count}, tgt count capacity {wanted}."
    )
  require(
    memory.num_sequences(-1) == tgt.num_sequences(-1),
    "Expected `memory` to hold one sequence per `tgt` sequence: memory has "
    "{real} sequences, tgt has {real_tgt}.",
    real=memory.num_sequences(-1),
    real_tgt=tgt.num_sequences(-1),
  )


def check_targets(tgt: Any) -> LoDTensor:
  """A decoder's targets: a LoDTensor of vector rows."""
  tgt = check_lod(tgt, "tgt")
  if len(tgt.feature_shape) != 1:
    raise ValueError(
      "Expected `tgt.values` to have shape [token_capacity, input_features], got "
      f"{tuple(tgt.values.shape)}."
    )
  return tgt


# -- layers (jaxlod.nn and jaxlod.nn.nnx) -------------------------------------------


def check_eps(eps: Any) -> float:
  """The cosine attention's ``eps``: a static float > 0, finite and nonzero
  in float32 (`finite_float32`)."""
  return finite_float32(eps, "eps", positive=True)


def check_rate(rate: float, name: str, *, closed: bool = True) -> float:
  """A dropout rate in ``[0, 1]`` (``[0, 1)`` unless `closed`)."""
  rate = static_float(rate, name)
  ok = 0.0 <= rate <= 1.0 if closed else 0.0 <= rate < 1.0
  if not ok:
    interval = "[0, 1]" if closed else "[0, 1)"
    raise ValueError(f"Expected `{name}` in {interval}, got {rate!r}.")
  return rate


def split_pair(initial_carry: Any) -> tuple[Any, Any]:
  """``(forward, backward)`` carries of a `Bidirectional` (`None`: both None)."""
  if initial_carry is None:
    return None, None
  if not (isinstance(initial_carry, tuple | list) and len(initial_carry) == 2):
    raise TypeError(
      "Expected `initial_carry` to be a pair (forward_carry, backward_carry), "
      f"got {type(initial_carry).__name__}."
    )
  return tuple(initial_carry)


def check_sizes(**sizes: Any) -> None:
  """Every keyword argument is a static int >= 1 (a width, a vocabulary)."""
  for name, value in sizes.items():
    static_int(value, name, minimum=1)


def check_cell(cell: Any, carry_signature: str | None = None) -> Any:
  """A recurrent cell is callable; to give the default carry it must also
  have `initialize_carry`, whose signature `carry_signature` spells (the
  twins' differ)."""
  check_callable(cell, "cell")
  if carry_signature is not None and not hasattr(cell, "initialize_carry"):
    raise TypeError(
      f"Expected `cell` ({type(cell).__name__}) to have `{carry_signature}`; "
      "otherwise pass `initial_carry`."
    )
  return cell


def ladder_sizes(ladder: Any, count_capacity: int | None = None) -> list[int]:
  """The static batch sizes of a ladder: ints in ``[1, count_capacity]``
  (``>= 1`` before the count capacity is known)."""
  sizes = check_sequence(ladder, "ladder", "a sequence of ints or None")
  for i, size in enumerate(sizes):
    if isinstance(size, bool | np.bool_) or not isinstance(size, int | np.integer):
      raise ValueError(f"Expected `ladder[{i}]` to be an int, got {size!r}.")
    if count_capacity is None:
      static_int(size, f"ladder[{i}]", minimum=1)
    if count_capacity is not None and not 1 <= size <= count_capacity:
      raise ValueError(
        f"Expected `ladder[{i}]` in [1, {count_capacity}] (the count capacity), "
        f"got {size}."
      )
  return [int(size) for size in sizes]


def check_ladder(ladder: Any) -> tuple[int, ...] | None:
  """A layer's ladder as a tuple of sizes >= 1 (checked against the count
  capacity by `jaxlod.ops.normalize_ladder` at the call), or `None`."""
  return None if ladder is None else tuple(ladder_sizes(ladder))


def check_layers(layers: Sequence[Any], owner: Any) -> None:
  """A `StackedRNN` (`owner`) has at least one layer, each a layer over
  LoDTensors (`check_rnn_layer`)."""
  layers = check_sequence(layers, "layers", "a sequence of layers")
  if len(layers) == 0:
    raise ValueError("Expected `layers` to hold at least one layer, got none.")
  for i, layer in enumerate(layers):
    check_rnn_layer(layer, f"layers[{i}]", owner)


def check_settings(settings: Any) -> Any:
  """Decoding takes a `jaxlod.ops.DecodeSettings`."""
  # `jaxlod.ops` imports this module: import its DecodeSettings at call time.
  from jaxlod.ops._decode import DecodeSettings

  if not isinstance(settings, DecodeSettings):
    raise TypeError(
      f"Expected `settings` to be a DecodeSettings, got {type(settings).__name__}."
    )
  return settings


def check_tokens(tokens: jax.typing.ArrayLike) -> jax.Array:
  """A decoding step's previous tokens: int ``[b]``."""
  tokens = as_array(tokens, "tokens")
  if tokens.ndim != 1:
    raise ValueError(f"Expected `tokens` to have shape [b], got {tokens.shape}.")
  check_integer(tokens.dtype, "tokens")
  return tokens


def check_encoded(memory: Any) -> LoDTensor:
  """An encoder's output must be a LoDTensor."""
  if not is_lod(memory):
    raise TypeError(
      f"Expected `encoder` to return a LoDTensor, got {type(memory).__name__}."
    )
  return memory


def check_rngs(rngs: Any) -> dict[str, jax.Array] | None:
  """Linen RNG streams: `None` or a dict of stream names to JAX keys (typed,
  or raw ``uint32 [2]``), as ``flax.linen.Module.apply`` takes them."""
  if rngs is None:
    return None
  if not isinstance(rngs, Mapping):
    raise TypeError(
      f"Expected `rngs` to be a dict of stream names to JAX keys (e.g. "
      f"{{'dropout': jax.random.key(0)}}) or None, got {type(rngs).__name__}."
    )
  for name, key in rngs.items():
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == np.uint32 and getattr(key, "shape", None) == (2,)
    if not isinstance(name, str) or not (typed or raw):
      raise TypeError(
        f"Expected `rngs` to map stream names to JAX keys (e.g. {{'dropout': "
        f"jax.random.key(0)}}), got {name!r}: {type(key).__name__}."
      )
  return dict(rngs)


def check_vocabs(vocabs: Sequence[int]) -> None:
  """An ensemble's members share the target vocabulary."""
  if not vocabs:
    raise ValueError("Expected at least one member, got none. `members` is empty.")
  if len(set(vocabs)) != 1:
    raise ValueError(
      f"Expected the members to share `tgt_vocab`, got {list(vocabs)} (member order)."
    )


# -- layers given to layers, and their dtypes (jaxlod.nn and jaxlod.nn.nnx) ---------

# The modules of Flax's own layers and cells: they take arrays, never a
# LoDTensor (Flax's combinators, `nn.Sequential` and `nnx.Sequential`, pass).
_ARRAY_LAYERS = tuple(
  f"flax.linen.{m}"
  for m in (
    "activation",
    "attention",
    "fp8_ops",
    "linear",
    "normalization",
    "pooling",
    "recurrent",
    "stochastic",
  )
) + ("flax.nnx.nn.",)


def _flax_api(value: Any) -> str | None:
  """``"Linen"`` or ``"NNX"`` for a Flax module (or an NNX layer under
  construction), else `None`."""
  import flax.linen as nn  # Flax loads with jaxlod.nn, which calls this.
  from flax import nnx

  if isinstance(value, nn.Module):
    return "Linen"
  return "NNX" if isinstance(value, nnx.Module) else None


def check_twin(value: Any, name: str, owner: Any) -> None:
  """A module given to a layer (`owner`) is of the layer's API: a Linen
  module in a `jaxlod.nn` layer, an NNX one in a `jaxlod.nn.nnx` layer."""
  api, mine = _flax_api(value), _flax_api(owner)
  if api is not None and api != mine:
    package, article = (
      ("jaxlod.nn", "a") if mine == "Linen" else ("jaxlod.nn.nnx", "an")
    )
    raise TypeError(
      f"Expected `{name}` to be {article} {mine} module (a {package} layer), got the "
      f"{api} module {type(value).__name__}."
    )


def check_rnn_layer(layer: Any, name: str, owner: Any) -> Any:
  """A layer over LoDTensors, given to `owner`: a `StackedRNN`'s layers, a
  `Bidirectional`'s, a `HierarchicalEncoder`'s, a `Seq2Seq`'s encoder.

  It must be callable, of `owner`'s API (`check_twin`), and not one of
  Flax's own layers or cells, which take arrays.
  """
  return _check_jaxlod_layer(
    layer,
    name,
    owner,
    "a jaxlod RNN layer (a DynamicRNN, Bidirectional, StackedRNN or "
    "HierarchicalEncoder) or a module of yours over LoDTensors",
    ", which takes arrays (a recurrent cell goes in a DynamicRNN)",
  )


def check_attention_layer(attention: Any, owner: Any) -> Any:
  """An `AttentionDecoder`'s `attention`: callable, of `owner`'s API
  (`check_twin`), and not one of Flax's own layers, whose calls differ."""
  return _check_jaxlod_layer(
    attention,
    "attention",
    owner,
    "an attention of jaxlod (DotAttention, GeneralAttention, AdditiveAttention, "
    "CosineAttention) or a module of yours ``attention(query, memory, lengths) "
    "-> (context, weights)``",
  )


def _check_jaxlod_layer(
  value: Any, name: str, owner: Any, expected: str, tail: str = ""
) -> Any:
  """`value`, given to `owner` as `name`: callable, of `owner`'s API
  (`check_twin`), and not one of Flax's own layers (the message: `expected`,
  then `tail` after the Flax class's name)."""
  check_callable(value, name)
  check_twin(value, name, owner)
  if type(value).__module__.startswith(_ARRAY_LAYERS):
    raise TypeError(
      f"Expected `{name}` to be {expected}, got Flax's {type(value).__name__}{tail}."
    )
  return value


def check_decoder(decoder: Any, owner: Any) -> Any:
  """A `Seq2Seq`'s `decoder` is an `AttentionDecoder` of `owner`'s API."""
  # `jaxlod.nn` imports this module: import its decoders' base at call time.
  from jaxlod.nn._common import DecoderCalls

  check_twin(decoder, "decoder", owner)
  if not isinstance(decoder, DecoderCalls):
    raise TypeError(
      f"Expected `decoder` to be an AttentionDecoder, got {type(decoder).__name__}."
    )
  return decoder


def check_layer_dtypes(dtype: Any, param_dtype: Any) -> None:
  """A layer's `dtype` (of its computation: a float dtype, or `None` for
  its inputs') and `param_dtype` (of its parameters: a float dtype)."""
  for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
    if value is None and name == "dtype":
      continue
    check_dtype(value, name)
    if value is None or not jnp.issubdtype(value, jnp.floating):
      got = "None" if value is None else jnp.dtype(value).name
      raise TypeError(f"Expected `{name}` to be a float dtype, got {got}.")
