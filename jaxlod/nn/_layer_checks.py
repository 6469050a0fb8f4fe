"""The checks of `jaxlod.nn`'s layers and their NNX twins: cells, the
layers given to layers (of the owner's API, never Flax's array layers), an
encoder-decoder's arguments, dtypes, dropout keys, targets and token ids,
vocabularies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxlod._checks import (
  check_bools,
  check_callable,
  check_dtype,
  check_integer,
  check_rate,
  check_sequence,
  check_sizes,
  is_key,
  require,
)
from jaxlod._host import as_array
from jaxlod._lod import LoDTensor, check_lod, is_lod
from jaxlod.ops._memory_attention import check_memory_rows


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


def check_layers(layers: Sequence[Any], owner: Any) -> None:
  """A `StackedRNN` (`owner`) has at least one layer, each a layer over
  LoDTensors (`check_rnn_layer`)."""
  layers = check_sequence(layers, "layers", "a sequence of layers")
  if len(layers) == 0:
    raise ValueError("Expected `layers` to hold at least one layer, got none.")
  for i, layer in enumerate(layers):
    check_rnn_layer(layer, f"layers[{i}]", owner)


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
    if not isinstance(name, str) or not is_key(key):
      raise TypeError(
        f"Expected `rngs` to map stream names to JAX keys (e.g. {{'dropout': "
        f"jax.random.key(0)}}), got {name!r}: {type(key).__name__}."
      )
  return dict(rngs)


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


def check_seq2seq(
  src_vocab: Any,
  tgt_vocab: Any,
  embed_dim: Any,
  encoder: Any,
  decoder: Any,
  bridge: Any,
  dropout: Any,
  deterministic: Any,
  owner: Any,
  decoder_type: type,
) -> None:
  """The arguments `Seq2Seq`'s twins (`owner`) check before building their
  layers; `decoder_type` is the twin's `AttentionDecoder`."""
  check_sizes(src_vocab=src_vocab, tgt_vocab=tgt_vocab, embed_dim=embed_dim)
  check_rnn_layer(encoder, "encoder", owner)
  check_decoder(decoder, owner, decoder_type)
  check_bools(bridge=bridge, deterministic=deterministic)
  check_rate(dropout, "dropout", closed=False)


def check_decoder(decoder: Any, owner: Any, decoder_type: type) -> Any:
  """A `Seq2Seq`'s `decoder` is an `AttentionDecoder` (`decoder_type`) of
  `owner`'s API."""
  check_twin(decoder, "decoder", owner)
  if not isinstance(decoder, decoder_type):
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


def check_tokens(tokens: jax.typing.ArrayLike) -> jax.Array:
  """A decoding step's previous tokens: int ``[b]``."""
  tokens = as_array(tokens, "tokens")
  if tokens.ndim != 1:
    raise ValueError(f"Expected `tokens` to have shape [b], got {tokens.shape}.")
  check_integer(tokens.dtype, "tokens")
  return tokens


def check_encoded(memory: Any) -> LoDTensor:
  """An encoder's output must be a LoDTensor of one level with vector rows,
  the memory of an attention decoder (whose call checks its LoD)."""
  if not is_lod(memory):
    raise TypeError(
      f"Expected `encoder` to return a LoDTensor, got {type(memory).__name__}."
    )
  return check_memory_rows(memory)


def check_vocabs(vocabs: Sequence[int], name: str = "tgt_vocab") -> int:
  """An ensemble's members share the vocabulary `name` (the target one by
  default); returns it."""
  if not vocabs:
    raise ValueError("Expected at least one member, got none. `members` is empty.")
  if len(set(vocabs)) != 1:
    raise ValueError(
      f"Expected the members to share `{name}`, got {list(vocabs)} (member order)."
    )
  return vocabs[0]
