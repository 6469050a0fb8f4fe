"""The targets of tests/test_api_inputs.py in jaxlod.nn and jaxlod.nn.nnx: each
layer built with valid constructor arguments and called on valid inputs (one
wrong argument at a time, in either), and the public methods that take
arguments from users (see tests/api_catalogue.py)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxlod.nn as linen
import jaxlod.nn.nnx as nnx_layers
from tests.api_catalogue import (
  MODEL_SETTINGS,
  Arg,
  Target,
  add_target,
  arg,
  ids,
  linen_model,
  linen_params,
  lod,
  nested,
  nnx_model,
)

TARGETS: list[Target] = []
target = functools.partial(add_target, TARGETS)


def linen_fields(cls: type) -> Callable:
  """A function whose signature is a Linen module's constructor (its
  dataclass fields but `parent` and `name`)."""

  def fields(**kwargs):
    del kwargs

  names = [f.name for f in dataclasses.fields(cls) if f.init]
  fields.__signature__ = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
  )
  return fields


def layer(
  name: str,
  signatures: tuple[Callable, Callable],
  build: Callable[..., Any],
  run: Callable[..., Any],
  ctor: dict[str, Arg],
  args: dict[str, Arg],
  unchecked: dict[str, str] | None = None,
) -> None:
  """A layer built by ``build(**ctor)`` and run by ``run(layer, **args)``;
  `signatures` are its constructor's and its call's."""

  def invoke(**kwargs):
    built = build(**{k: kwargs[k] for k in ctor})
    return run(built, **{k.split()[0]: kwargs[k] for k in args})

  target(
    name,
    None,
    {**ctor, **args},
    call=invoke,
    signatures=signatures,
    unchecked=unchecked,
  )


def linen_init(module: nn.Module, **kwargs: Any) -> Any:
  """The outputs of a Linen module's first call, as it initializes."""
  return module.init_with_output(jax.random.key(0), **kwargs)[0]


def fresh_rngs(cls: type) -> Callable[..., Any]:
  """Builds the NNX layer `cls` with a new ``nnx.Rngs(0)`` each time (an
  `nnx.Rngs` belongs to the trace that made it)."""
  return lambda **kwargs: cls(**kwargs, rngs=nnx.Rngs(0))


def nnx_call(module: nnx.Module, **kwargs: Any) -> Any:
  return module(**kwargs)


TWINS = {
  # twin: (module, a cell, the constructor's signature, how to run a layer)
  "nn": (linen, lambda: nn.GRUCell(2), linen_fields, linen_init),
  "nnx": (
    nnx_layers,
    lambda: nnx.GRUCell(2, 2, rngs=nnx.Rngs(0)),
    lambda cls: cls.__init__,
    nnx_call,
  ),
}
KEYS = {
  "nn": {"init_key": "handed to the cell's `initialize_carry` (a JAX key)"},
  "nnx": {"rngs": "handed to Flax (`nnx.Rngs` checks its own arguments)"},
}

# -- recurrent layers ------------------------------------------------------------

# The scan settings the drop-in RNNs take from Flax's and do not read.
UNREAD = "Flax's scan setting, accepted for compatibility and not read (documented)"
SCAN_SETTINGS = {
  "nn": {
    name: UNREAD
    for name in ("variable_axes", "variable_broadcast", "variable_carry", "split_rngs")
  },
  "nnx": {
    "state_axes": UNREAD,
    "broadcast_rngs": "an NNX filter handed to `nnx.split_rngs` (Flax checks it); "
    "tests/nn/test_dropin.py runs a cell drawing from it",
    "rngs (call)": "handed to Flax (`nnx.Rngs` checks its own arguments)",
    "rngs": "flax.nnx.RNN's: True, False or an nnx.Rngs; anything else raises "
    "ValueError naming `rngs`",
  },
}

RNN_CALL = {
  "x": arg(lod, "lod"),
  "initial_carry": arg(None, "carry", none_ok=True),
  "return_carry (call)": arg(None, "bool", none_ok=True),
  "table": arg(None, "table", none_ok=True),
}

for twin, (module, cell, init_of, run) in TWINS.items():

  def rnn(module=module, cell=cell):
    return module.DynamicRNN(cell())

  def signatures(cls, init_of=init_of):
    return init_of(cls), cls.__call__

  layer(
    f"{twin}.DynamicRNN",
    signatures(module.DynamicRNN),
    module.DynamicRNN,
    run,
    {
      "cell": arg(cell, "module"),
      "reverse": arg(False, "bool"),
      "return_carry": arg(False, "bool"),
      "remat": arg(False, "bool"),
      "ladder": arg(None, "ladder", none_ok=True),
      "plan": arg(None, "plan", none_ok=True),
    },
    {**RNN_CALL, "reverse (call)": arg(None, "bool", none_ok=True)},
    KEYS[twin],
  )
  layer(
    f"{twin}.RNN",
    signatures(module.RNN),
    module.RNN,
    run,
    {
      "cell": arg(cell, "module"),
      "time_major": arg(False, "bool"),
      "return_carry": arg(False, "bool"),
      "reverse": arg(False, "bool"),
      "keep_order": arg(False, "bool"),
      "unroll": arg(1, "int>=1"),
      "buckets": arg(None, "buckets", none_ok=True),
      "remat": arg(False, "bool"),
      "ladder": arg(None, "ladder", none_ok=True),
      "plan": arg(None, "plan", none_ok=True),
    },
    {
      "inputs": arg(lambda: np.ones((2, 3, 2), np.float32), "array_or_lod"),
      "initial_carry": arg(None, "carry", none_ok=True),
      "seq_lengths": arg(lambda: np.array([3, 1], np.int32), "ints", none_ok=True),
      **{
        f"{flag} (call)": arg(None, "bool", none_ok=True)
        for flag in ("return_carry", "time_major", "reverse", "keep_order")
      },
    },
    {**KEYS[twin], **SCAN_SETTINGS[twin]},
  )
  layer(
    f"{twin}.Bidirectional",
    signatures(module.Bidirectional),
    lambda forward_rnn, backward_rnn, module=module, **kw: module.Bidirectional(
      forward_rnn, backward_rnn, **kw
    ),
    run,
    {
      "forward_rnn": arg(rnn, "rnn_layer"),
      "backward_rnn": arg(rnn, "rnn_layer"),
      "merge_fn": arg(None, "callable", none_ok=True),
      "time_major": arg(False, "bool"),
      "return_carry": arg(False, "bool"),
    },
    {
      "inputs": arg(lod, "lod"),
      "initial_carry": arg(None, "carry", none_ok=True),
      "return_carry (call)": arg(None, "bool", none_ok=True),
      "time_major (call)": arg(None, "bool", none_ok=True),
      "table": arg(None, "table", none_ok=True),
    },
    {
      **KEYS[twin],
      "seq_lengths": "a padded `inputs`' lengths, handed to both RNNs (jaxlod.nn.RNN "
      "checks them: tests/nn/test_dropin.py); with a LoDTensor anything but None "
      "raises ValueError naming `seq_lengths`",
      "reverse": "unused, as in Flax's Bidirectional (its call signature)",
      "keep_order": "unused, as in Flax's Bidirectional (its call signature)",
      **(
        {
          "rngs (call)": KEYS["nnx"]["rngs"],
          "rngs": "flax.nnx.Bidirectional's: True, False, an nnx.Rngs or an "
          "RngStream; anything else raises ValueError naming `rngs`",
        }
        if twin == "nnx"
        else {}
      ),
    },
  )
  layer(
    f"{twin}.StackedRNN",
    signatures(module.StackedRNN),
    module.StackedRNN,
    run,
    {
      "layers": arg(lambda rnn=rnn: [rnn()], "rnn_layers"),
      "dropout_rate": arg(0.0, "rate"),
      "input_dropout": arg(0.0, "rate"),
      "output_dropout": arg(0.0, "rate"),
      "deterministic": arg(True, "bool"),
      "return_carry": arg(False, "bool"),
    },
    {
      "x": arg(lod, "lod"),
      "deterministic (call)": arg(None, "bool", none_ok=True),
      "return_carry (call)": arg(None, "bool", none_ok=True),
      "table": arg(None, "table", none_ok=True),
    },
    {"rngs": KEYS["nnx"]["rngs"]} if twin == "nnx" else {},
  )
  layer(
    f"{twin}.HierarchicalEncoder",
    signatures(module.HierarchicalEncoder),
    lambda inner, outer, module=module, **kw: module.HierarchicalEncoder(
      inner, outer, **kw
    ),
    run,
    {
      "inner": arg(rnn, "rnn_layer"),
      "outer": arg(rnn, "rnn_layer"),
      "pool_type": arg("last", "choice"),
      "return_carry": arg(False, "bool"),
    },
    {"x": arg(nested, "lod"), "return_carry (call)": arg(None, "bool", none_ok=True)},
  )

LINEAR_CALL = {
  "x": arg(lod, "lod"),
  "initial_carry": arg(None, "carry", none_ok=True),
  "reverse (call)": arg(None, "bool", none_ok=True),
  "return_carry (call)": arg(None, "bool", none_ok=True),
  "table": arg(None, "table", none_ok=True),
}
UNUSED_KEY = {
  "nn": {"init_key": "unused: the default carry is zeros (documented)"},
  "nnx": {"rngs (call)": "unused: the default carry is zeros (documented)"},
}
for name, extra in (("MinGRU", {}), ("RGLRU", {"c": arg(8.0, "float32>0")})):
  flags = {"reverse": arg(False, "bool"), "return_carry": arg(False, "bool")}
  cls = getattr(linen, name)
  layer(
    f"nn.{name}",
    (linen_fields(cls), cls.__call__),
    cls,
    linen_init,
    {"features": arg(3, "size>=1"), **extra, **flags},
    LINEAR_CALL,
    UNUSED_KEY["nn"],
  )
  cls = getattr(nnx_layers, name)
  layer(
    f"nnx.{name}",
    (cls.__init__, cls.__call__),
    fresh_rngs(cls),
    nnx_call,
    {
      "in_features": arg(2, "size>=1"),
      "features": arg(3, "size>=1"),
      **extra,
      **flags,
    },
    LINEAR_CALL,
    {"rngs": KEYS["nnx"]["rngs"], **UNUSED_KEY["nnx"]},
  )


# -- attention -------------------------------------------------------------------

ATTENTION_CALL = {
  "query": arg(lambda: np.ones((2, 2), np.float32), "matrix"),
  "memory": arg(lambda: np.ones((2, 3, 2), np.float32), "memory_like"),
  "lengths": arg(lambda: np.array([3, 1]), "ints"),
  "keys": arg(None, "keys", none_ok=True),
}
DTYPES = {
  "dtype": arg(None, "float_dtype", none_ok=True),
  "param_dtype": arg(jnp.float32, "float_dtype"),
}
NNX_SIZES = {"hidden": arg(2, "int>=1"), "features": arg(2, "int>=1")}
for name, linen_ctor, nnx_ctor in (
  ("DotAttention", {}, {}),
  ("CosineAttention", {"eps": arg(1e-8, "float32>0")}, {"eps": arg(1e-8, "float32>0")}),
  ("GeneralAttention", DTYPES, {**NNX_SIZES, **DTYPES}),
  (
    "AdditiveAttention",
    {"units": arg(3, "int>=1"), **DTYPES},
    {**NNX_SIZES, "units": arg(3, "int>=1"), **DTYPES},
  ),
):
  cls = getattr(linen, name)
  layer(
    f"nn.{name}",
    (linen_fields(cls), cls.__call__),
    cls,
    linen_init,
    linen_ctor,
    ATTENTION_CALL,
  )
  cls = getattr(nnx_layers, name)
  takes_rngs = "rngs" in inspect.signature(cls.__init__).parameters
  build = fresh_rngs(cls) if takes_rngs else cls
  layer(
    f"nnx.{name}",
    (cls.__init__, cls.__call__),
    build,
    nnx_call,
    nnx_ctor,
    ATTENTION_CALL,
    {"rngs": KEYS["nnx"]["rngs"]} if takes_rngs else {},
  )

target(
  "nn.AdditiveAttention.keys",
  linen.AdditiveAttention.keys,
  {"memory": arg(lod, "memory_like")},
  call=lambda **kw: linen.AdditiveAttention(3).init(
    jax.random.key(0), method="keys", **kw
  ),
)
target(
  "nnx.AdditiveAttention.keys",
  nnx_layers.AdditiveAttention.keys,
  {"memory": arg(lod, "memory_like")},
  call=lambda **kw: nnx_layers.AdditiveAttention(2, 2, 3, rngs=nnx.Rngs(0)).keys(**kw),
)

# -- Transformer layers ----------------------------------------------------------------

INITS = {
  "kernel_init": arg(lambda: nn.initializers.lecun_normal(), "callable"),
  "bias_init": arg(lambda: nn.initializers.zeros_init(), "callable"),
}
TRANSFORMER = {
  "qkv_features": arg(None, "size>=1", none_ok=True),
  "dropout_rate": arg(0.0, "rate"),
  "causal": arg(False, "bool"),
  "deterministic": arg(True, "bool"),
  **INITS,
  **DTYPES,
  "plan": arg(None, "plan", none_ok=True),
}
ENCODER_LAYER = {
  "num_heads": arg(1, "size>=1"),
  "mlp_features": arg(3, "size>=1"),
  **TRANSFORMER,
  "attention_dropout_rate": arg(0.0, "rate"),
}
TRANSFORMER_CALL = {"deterministic (call)": arg(None, "bool", none_ok=True)}
NNX_WIDTH = {"in_features": arg(2, "size>=1")}
for twin, (module, _, init_of, run) in TWINS.items():
  nnx_twin = twin == "nnx"
  adds = NNX_WIDTH if nnx_twin else {}
  keys = {"rngs": KEYS["nnx"]["rngs"]} if nnx_twin else {}
  build = fresh_rngs if nnx_twin else (lambda cls: cls)
  cls = module.MultiHeadAttention
  layer(
    f"{twin}.MultiHeadAttention",
    (init_of(cls), cls.__call__),
    build(cls),
    run,
    {
      "num_heads": arg(1, "size>=1"),
      **adds,
      **({"in_kv_features": arg(None, "size>=1", none_ok=True)} if nnx_twin else {}),
      "out_features": arg(None, "size>=1", none_ok=True),
      "use_bias": arg(True, "bool"),
      **TRANSFORMER,
    },
    {
      "inputs_q": arg(lod, "lod"),
      "inputs_k": arg(None, "lod", none_ok=True),
      "inputs_v": arg(None, "lod", none_ok=True),
      **TRANSFORMER_CALL,
    },
    keys,
  )
  cls = module.TransformerEncoderLayer
  layer(
    f"{twin}.TransformerEncoderLayer",
    (init_of(cls), cls.__call__),
    build(cls),
    run,
    {**ENCODER_LAYER, **adds},
    {"x": arg(lod, "lod"), **TRANSFORMER_CALL},
    keys,
  )
  cls = module.TransformerEncoder
  layer(
    f"{twin}.TransformerEncoder",
    (init_of(cls), cls.__call__),
    build(cls),
    run,
    {
      "num_layers": arg(1, "size>=1"),
      **ENCODER_LAYER,
      **adds,
      "positions": arg("learned", "choice"),
      "max_length": arg(4, "size>=1", none_ok=True),
    },
    {
      "x": arg(lod, "lod"),
      **TRANSFORMER_CALL,
      "table": arg(None, "table", none_ok=True),
    },
    keys,
  )

# -- decoders and encoder-decoders ---------------------------------------------------

DECODER_CALL = {
  "tgt": arg(lod, "lod"),
  "memory": arg(lod, "lod"),
  "initial_carry": arg(None, "carry", none_ok=True),
  "return_weights": arg(False, "bool"),
  "table": arg(None, "table", none_ok=True),
}
for twin, (module, cell, init_of, run) in TWINS.items():
  cls = module.AttentionDecoder
  layer(
    f"{twin}.AttentionDecoder",
    (init_of(cls), cls.__call__),
    cls,
    run,
    {
      "cell": arg(cell, "module"),
      "attention": arg(lambda module=module: module.DotAttention(), "attention"),
      "input_feeding": arg(False, "bool"),
      "remat": arg(True, "bool"),
      "ladder": arg(None, "ladder", none_ok=True),
      "plan": arg(None, "plan", none_ok=True),
    },
    DECODER_CALL,
  )

SEQ2SEQ_CTOR = {
  "src_vocab": arg(8, "int>=1"),
  "tgt_vocab": arg(9, "int>=1"),
  "embed_dim": arg(3, "int>=1"),
  "bridge": arg(True, "bool"),
  "dropout": arg(0.0, "rate"),
  "deterministic": arg(True, "bool"),
}
SEQ2SEQ_CALL = {
  "src": arg(ids, "lod"),
  "tgt_in": arg(ids, "lod"),
  "return_weights": arg(False, "bool"),
  "src_table": arg(None, "table", none_ok=True),
  "tgt_table": arg(None, "table", none_ok=True),
}
layer(
  "nn.Seq2Seq",
  (linen_fields(linen.Seq2Seq), linen.Seq2Seq.__call__),
  linen.Seq2Seq,
  linen_init,
  {
    **SEQ2SEQ_CTOR,
    "encoder": arg(lambda: linen.DynamicRNN(nn.GRUCell(2)), "rnn_layer"),
    "decoder": arg(
      lambda: linen.AttentionDecoder(nn.GRUCell(2), linen.DotAttention()), "decoder"
    ),
  },
  SEQ2SEQ_CALL,
)


def nnx_seq2seq(**kw: Any) -> nnx_layers.Seq2Seq:
  """An NNX Seq2Seq over cells as wide as the embedding (3 when wrong)."""
  width = kw["embed_dim"] if isinstance(kw["embed_dim"], int) else 3
  rngs = nnx.Rngs(0)
  encoder = nnx_layers.DynamicRNN(nnx.GRUCell(max(width, 1), 2, rngs=rngs))
  decoder = nnx_layers.AttentionDecoder(
    nnx.GRUCell(max(width, 1), 2, rngs=rngs), nnx_layers.DotAttention()
  )
  return nnx_layers.Seq2Seq(**{"encoder": encoder, "decoder": decoder, **kw}, rngs=rngs)


layer(
  "nnx.Seq2Seq",
  (nnx_layers.Seq2Seq.__init__, nnx_layers.Seq2Seq.__call__),
  nnx_seq2seq,
  nnx_call,
  {
    **SEQ2SEQ_CTOR,
    "encoder": arg(lambda: nnx_model().encoder, "rnn_layer"),
    "decoder": arg(lambda: nnx_model().decoder, "decoder"),
    "features": arg(2, "int>=1"),
  },
  SEQ2SEQ_CALL,
  {"rngs": KEYS["nnx"]["rngs"]},
)

GENERATE = {
  "src": arg(ids, "lod"),
  "settings": arg(MODEL_SETTINGS, "settings"),
  "max_lengths": arg(None, "ints", none_ok=True),
  "src_table": arg(None, "table", none_ok=True),
}
target(
  "nn.Seq2Seq.generate",
  linen.Seq2Seq.generate,
  GENERATE,
  call=lambda **kw: linen_model().apply(linen_params(), method="generate", **kw),
)
target(
  "nnx.Seq2Seq.generate",
  nnx_layers.Seq2Seq.generate,
  GENERATE,
  call=lambda **kw: nnx_model().generate(**kw),
)
target(
  "nn.Seq2Seq.encode",
  linen.Seq2Seq.encode,
  {"src": arg(ids, "lod"), "table": arg(None, "table", none_ok=True)},
  call=lambda **kw: linen_model().apply(linen_params(), method="encode", **kw),
)
target(
  "nnx.Seq2Seq.encode",
  nnx_layers.Seq2Seq.encode,
  {"src": arg(ids, "lod"), "table": arg(None, "table", none_ok=True)},
  call=lambda **kw: nnx_model().encode(**kw),
)


def first(results: Any) -> Any:
  """The first result a corpus decoder yields (`None` for none)."""
  return next(iter(results), None)


# The corpus calls read their first result: `max_length_fn`'s values are
# checked as the sources are read.
CORPUS = {
  "sources": arg(lambda: [[1, 2]], "iterable"),
  "settings": arg(MODEL_SETTINGS, "settings"),
  "src_capacity": arg(4, "size>=1"),
  "slots": arg(2, "size>=1"),
  "max_length_fn": arg(None, "max_length_fn", none_ok=True),
  "refill": arg(None, "size>=1", none_ok=True),
  "chunk": arg(8, "size>=1"),
  "stats": arg(None, "mapping", none_ok=True),
}
target(
  "nn.Seq2Seq.generate_corpus",
  linen.Seq2Seq.generate_corpus,
  CORPUS,
  call=lambda **kw: first(
    linen_model().apply(linen_params(), method="generate_corpus", **kw)
  ),
)
target(
  "nnx.Seq2Seq.generate_corpus",
  nnx_layers.Seq2Seq.generate_corpus,
  CORPUS,
  call=lambda **kw: first(nnx_model().generate_corpus(**kw)),
)
target(
  "nn.ensemble_generate_corpus",
  linen.ensemble_generate_corpus,
  {
    "members": arg(lambda: [(linen_model(), linen_params())], "members"),
    **CORPUS,
    "rngs": arg(None, "mapping", none_ok=True),
  },
  call=lambda **kw: first(linen.ensemble_generate_corpus(**kw)),
)
target(
  "nnx.ensemble_generate_corpus",
  nnx_layers.ensemble_generate_corpus,
  {
    "members": arg(lambda: [nnx_model()], "members"),
    **CORPUS,
    "rngs": arg(None, "mapping", none_ok=True),
  },
  call=lambda **kw: first(nnx_layers.ensemble_generate_corpus(**kw)),
)
target(
  "nn.ensemble_generate",
  linen.ensemble_generate,
  {
    "members": arg(lambda: [(linen_model(), linen_params())], "members"),
    **GENERATE,
    "rngs": arg(None, "mapping", none_ok=True),
  },
)
target(
  "nnx.ensemble_generate",
  nnx_layers.ensemble_generate,
  {
    "members": arg(lambda: [nnx_model()], "members"),
    **GENERATE,
    "rngs": arg(None, "mapping", none_ok=True),
  },
)
