"""Linen Transformer layers over LoDTensors: multi-head attention inside each
sequence, a pre-norm encoder layer and an encoder stack, padding-free.

Each layer runs on the packed rows of a LoDTensor: the projections and the
MLPs run over the real rows only (`jaxlod.ops.map_rows`: chunks of a
static number of rows, as many as the real rows need, not the token
capacity), and the attention is
`jaxlod.ops.sequence_attention`,
which attends within each last-level sequence (never across sequences, never
to padding) and does the work of the real lengths, not of the longest. The
positions restart at every sequence, computed from the LoD (jittable). The
functions below the Linen classes are the twins' shared body: the NNX twins
in `jaxlod.nn.nnx` call them with their own layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlod._checks import (
  check_bools,
  check_callable,
  check_float,
  check_rate,
  check_sizes,
  require,
)
from jaxlod._lod import LoDTensor, check_lod
from jaxlod.nn._layer_checks import check_layer_dtypes
from jaxlod.nn._recurrent import example_row, override, zero_padding
from jaxlod.ops import AttentionPlan, map_rows, sequence_attention
from jaxlod.ops._rank import RankTable, check_table

# Flax's defaults for `MultiHeadDotProductAttention` and `Dense` (one object
# each, shared by the twins so that their defaults compare equal).
default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()
# `TransformerEncoder.positions`.
POSITIONS = ("learned", "sinusoidal")
# `LayerNorm`'s epsilon in every layer (Flax's default).
EPSILON = 1e-6


class MultiHeadAttention(nn.Module):
  """Multi-head dot-product attention inside each sequence of LoDTensors.

  Flax's ``nn.MultiHeadDotProductAttention`` over packed rows: the same
  parameters, under the same names, with the same shapes (``query``,
  ``key`` and ``value``: a ``nn.DenseGeneral`` from the input width to
  ``[num_heads, head_dim]``; ``out``: a ``nn.DenseGeneral`` from ``[num_heads,
  head_dim]`` to `out_features`), so weights move between the two. Query
  sequence ``i`` attends to the rows of key sequence ``i`` only
  (`jaxlod.ops.sequence_attention` over the last LoD level), scaled by
  ``1 / sqrt(head_dim)``: each sequence's output is Flax's on that sequence
  alone.

  Dropout: with a nonzero `dropout_rate` and ``deterministic=False`` the
  attention weights are dropped as Flax drops them (each weight zeroed
  with probability `dropout_rate`, the others scaled by ``1 / (1 -
  rate)``), inside `jaxlod.ops.sequence_attention`'s tiles, from a key of
  the ``'dropout'`` rng. Which weights drop depends on that key, the
  sequence, the head and the weight, not on the other sequences.

  Attributes:
    num_heads: the number of heads.
    qkv_features: the width of the queries, keys and values, all heads
      together (a multiple of `num_heads`); `None`: the width of
      `inputs_q`.
    out_features: the width of the outputs; `None`: the width of
      `inputs_q`.
    causal: a query row attends to the key rows at its own position in its
      sequence and before (positions counted from each sequence's start).
    dropout_rate: the rate of the dropout on the attention weights, in
      ``[0, 1]``.
    deterministic: no dropout (evaluation), unless the call overrides it.
      Flax's default is `None` (the call must say); this layer's is `True`,
      as the other layers of `jaxlod.nn`.
    kernel_init, bias_init: the initializers of all four projections.
    use_bias: whether the projections have biases.
    dtype: the computation dtype (`None`: inferred from the inputs and the
      parameters).
    param_dtype: the dtype of the parameters.
    plan: the `jaxlod.ops.AttentionPlan` of the attention; `None`: the
      backend's default.

  Example:
    >>> import numpy as np, jax
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import MultiHeadAttention
    >>> x = LoDTensor.from_sequences([np.ones((3, 4)), np.ones((1, 4))])
    >>> attention = MultiHeadAttention(num_heads=2)
    >>> params = attention.init(jax.random.key(0), x)
    >>> params["params"]["query"]["kernel"].shape
    (4, 2, 2)
    >>> y = attention.apply(params, x)
    >>> y.values.shape, y.recursive_lengths()
    ((4, 4), [[3, 1]])
  """

  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  causal: bool = False
  dropout_rate: float = 0.0
  deterministic: bool = True
  kernel_init: Callable[..., Any] = default_kernel_init
  bias_init: Callable[..., Any] = default_bias_init
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  plan: AttentionPlan | None = None

  @nn.compact
  def __call__(
    self,
    inputs_q: LoDTensor,
    inputs_k: LoDTensor | None = None,
    inputs_v: LoDTensor | None = None,
    *,
    deterministic: bool | None = None,
  ) -> LoDTensor:
    """Attends every query row over the key rows of its own sequence.

    As Flax's: `inputs_k` defaults to `inputs_q` (self-attention) and
    `inputs_v` to `inputs_k`.

    Args:
      inputs_q: a LoDTensor of float rows, values ``[q_token_capacity,
        q_features]``.
      inputs_k: a LoDTensor of float rows, values ``[kv_token_capacity,
        k_features]``, with as many last-level sequences as `inputs_q`;
        `None`: `inputs_q`.
      inputs_v: a LoDTensor with the LoD of `inputs_k`, values
        ``[kv_token_capacity, v_features]``; `None`: `inputs_k`.
      deterministic: overrides the attribute; `False` applies the dropout
        (needs the ``'dropout'`` rng).

    Returns:
      A LoDTensor with the LoD of `inputs_q`, values ``[q_token_capacity,
      out_features]``, padding rows zero. A query row with no key (of an
      empty key sequence, or with none at or before it when causal) attends
      to nothing: its attention is zero and its output ``out``'s bias
      (where Flax's masked softmax would average every value).

    Raises:
      TypeError: for inputs that are not LoDTensors of float rows, a
        non-bool flag, a non-callable initializer, a dtype that is not a
        float dtype, or a `plan` that is not an `AttentionPlan`.
      ValueError: for values that are not ``[token_capacity, features]``,
        `inputs_v` without `inputs_k`, an `inputs_v` whose LoD is not
        `inputs_k`'s, another number of sequences in `inputs_k` than in
        `inputs_q`, a `qkv_features` that `num_heads` does not divide, and
        sizes or a rate out of range.
    """
    check_attention(self)
    (deterministic,) = override(self, deterministic=deterministic)
    check_bools(deterministic=deterministic)
    q_in, k_in, v_in = attention_inputs(inputs_q, inputs_k, inputs_v)
    width = q_in.values.shape[-1]
    qkv = width if self.qkv_features is None else self.qkv_features
    heads = (self.num_heads, head_dim(qkv, self.num_heads, self.qkv_features))
    common = {
      "kernel_init": self.kernel_init,
      "bias_init": self.bias_init,
      "use_bias": self.use_bias,
      "dtype": self.dtype,
      "param_dtype": self.param_dtype,
    }
    project = [
      linen_rows(nn.DenseGeneral(heads, **common, name=n), example_row(x.values))
      for n, x in zip(QKV, (q_in, k_in, v_in), strict=True)
    ]
    out = nn.DenseGeneral(
      width if self.out_features is None else self.out_features,
      axis=(-2, -1),
      **common,
      name="out",
    )
    out = linen_rows(out, jnp.zeros((1, *heads), q_in.values.dtype))
    rng = None
    if not deterministic and self.dropout_rate > 0:
      rng = self.make_rng("dropout")
    return attend_heads(
      (q_in, k_in, v_in), project, out, self.causal, self.plan, self.dropout_rate, rng
    )


class TransformerEncoderLayer(nn.Module):
  """A pre-norm Transformer encoder layer over the sequences of a LoDTensor.

  ``x + Dropout(MultiHeadAttention(LayerNorm(x)))``, then ``x +
  Dropout(Dense(gelu(Dense(LayerNorm(x)))))``, each sequence attending to
  its own rows only; padding rows are zero in the output (so nothing of
  them reaches a later layer). The parameters: ``attention_norm``,
  ``attention`` (a `MultiHeadAttention`), ``mlp_norm``, ``mlp_in`` (a
  ``Dense(mlp_features)``) and ``mlp_out`` (a ``Dense`` back to the input
  width). The output is as wide as the input.

  Attributes:
    num_heads: the attention's heads.
    mlp_features: the width of the MLP's hidden layer.
    qkv_features: the attention's `qkv_features`; `None`: the input width.
    dropout_rate: the rate of the dropout on each residual branch (the
      attention's and the MLP's outputs), in ``[0, 1]``.
    attention_dropout_rate: the attention's `dropout_rate` (see
      `MultiHeadAttention`: on its weights).
    causal: each row attends to the rows at its position and before.
    deterministic: no dropout (evaluation), unless the call overrides it.
    kernel_init, bias_init: the initializers of the attention's projections
      and the MLP's layers.
    dtype, param_dtype: as `MultiHeadAttention`'s, for every sublayer.
    plan: the attention's `jaxlod.ops.AttentionPlan` (`None`: the
      backend's default).

  Example:
    >>> import numpy as np, jax
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import TransformerEncoderLayer
    >>> x = LoDTensor.from_sequences([np.ones((3, 4)), np.ones((1, 4))])
    >>> layer = TransformerEncoderLayer(num_heads=2, mlp_features=8)
    >>> params = layer.init(jax.random.key(0), x)
    >>> sorted(params["params"])
    ['attention', 'attention_norm', 'mlp_in', 'mlp_norm', 'mlp_out']
    >>> layer.apply(params, x).values.shape
    (4, 4)
  """

  num_heads: int
  mlp_features: int
  qkv_features: int | None = None
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  causal: bool = False
  deterministic: bool = True
  kernel_init: Callable[..., Any] = default_kernel_init
  bias_init: Callable[..., Any] = default_bias_init
  dtype: Any = None
  param_dtype: Any = jnp.float32
  plan: AttentionPlan | None = None

  @nn.compact
  def __call__(self, x: LoDTensor, *, deterministic: bool | None = None) -> LoDTensor:
    """Applies the layer to the rows of `x`.

    Args:
      x: a LoDTensor of float rows, values ``[token_capacity, features]``.
      deterministic: overrides the attribute; `False` applies dropout
        (needs the ``'dropout'`` rng).

    Returns:
      A LoDTensor with `x`'s LoD, values ``[token_capacity, features]``,
      padding rows zero.

    Raises:
      TypeError, ValueError: as `MultiHeadAttention`, for `x` and the
        attributes.
    """
    check_encoder_layer(self)
    (deterministic,) = override(self, deterministic=deterministic)
    check_bools(deterministic=deterministic)
    x = check_lod_rows(x, "x")
    common = {"dtype": self.dtype, "param_dtype": self.param_dtype}
    dense = {"kernel_init": self.kernel_init, "bias_init": self.bias_init, **common}
    attention = MultiHeadAttention(
      self.num_heads,
      self.qkv_features,
      causal=self.causal,
      dropout_rate=self.attention_dropout_rate,
      plan=self.plan,
      **dense,
      name="attention",
    )
    row = example_row(x.values)
    hidden = jnp.zeros((1, self.mlp_features), x.values.dtype)
    return encoder_layer(
      x,
      nn.LayerNorm(EPSILON, **common, name="attention_norm"),
      attention,
      linen_rows(nn.LayerNorm(EPSILON, **common, name="mlp_norm"), row),
      linen_rows(nn.Dense(self.mlp_features, **dense, name="mlp_in"), row),
      linen_rows(nn.Dense(x.values.shape[-1], **dense, name="mlp_out"), hidden),
      nn.Dropout(self.dropout_rate),
      deterministic,
    )


class TransformerEncoder(nn.Module):
  """A Transformer encoder over the sequences of a LoDTensor: positions that
  restart at every sequence, `num_layers` pre-norm `TransformerEncoderLayer`
  and a final ``LayerNorm``.

  Embedding-free: the input rows (e.g. token embeddings) get each row's
  position in its own sequence added (its row index minus its sequence's
  offset, from the LoD, jittable), then dropout, the layers and
  ``final_norm``. Sinusoidal positions are Vaswani et al.'s, ``sin(p /
  10000**(2i / features))`` in column ``2i`` and ``cos`` of the same in
  column ``2i + 1``; learned ones a ``nn.Embed(max_length, features)`` named
  ``position_embedding``. The layers live under ``layers_0``, ``layers_1``,
  ... Input and output are as wide.

  It is a `jaxlod.nn.Seq2Seq` encoder as it is: ``encoder(x)`` or
  ``encoder(x, table=...)`` returns a LoDTensor with `x`'s LoD, the
  decoder's memory. Inside a `Seq2Seq` the call's `deterministic` is not
  passed: the attribute decides (a training model and an evaluation model
  differ in it, on the same parameters).

  Attributes:
    num_layers: the number of layers.
    num_heads, mlp_features, qkv_features, dropout_rate,
      attention_dropout_rate, causal, kernel_init, bias_init, dtype,
      param_dtype, plan: every layer's (see `TransformerEncoderLayer`);
      `dropout_rate` also after the positions are added.
    positions: ``"sinusoidal"`` (default) or ``"learned"``.
    max_length: the positions a learned embedding holds (required with
      ``"learned"``, at least the time capacity of the inputs; checked as
      an int >= 1 whenever given).
    deterministic: no dropout (evaluation), unless the call overrides it.

  Example:
    >>> import numpy as np, jax
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn import TransformerEncoder
    >>> x = LoDTensor.from_sequences([np.ones((3, 4)), np.ones((1, 4))])
    >>> encoder = TransformerEncoder(num_layers=2, num_heads=2, mlp_features=8)
    >>> params = encoder.init(jax.random.key(0), x)
    >>> sorted(params["params"])
    ['final_norm', 'layers_0', 'layers_1']
    >>> y = encoder.apply(params, x)
    >>> y.values.shape, y.recursive_lengths()
    ((4, 4), [[3, 1]])
  """

  num_layers: int
  num_heads: int
  mlp_features: int
  qkv_features: int | None = None
  positions: str = "sinusoidal"
  max_length: int | None = None
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  causal: bool = False
  deterministic: bool = True
  kernel_init: Callable[..., Any] = default_kernel_init
  bias_init: Callable[..., Any] = default_bias_init
  dtype: Any = None
  param_dtype: Any = jnp.float32
  plan: AttentionPlan | None = None

  @nn.compact
  def __call__(
    self,
    x: LoDTensor,
    *,
    deterministic: bool | None = None,
    table: RankTable | None = None,
  ) -> LoDTensor:
    """Encodes every sequence of `x`.

    Args:
      x: a LoDTensor of float rows, values ``[token_capacity, features]``.
      deterministic: overrides the attribute; `False` applies dropout
        (needs the ``'dropout'`` rng).
      table: `x`'s rank table, as `Seq2Seq` may pass it; checked to be a
        `RankTable` and unused (the attention orders the sequences itself).

    Returns:
      A LoDTensor with `x`'s LoD, values ``[token_capacity, features]``,
      padding rows zero.

    Raises:
      TypeError, ValueError: as `TransformerEncoderLayer`; for an unknown
        `positions`, a learned embedding without `max_length` or with a
        `max_length` below the time capacity of `x`.
    """
    check_encoder(self)
    (deterministic,) = override(self, deterministic=deterministic)
    check_bools(deterministic=deterministic)
    check_table(table, optional=True)
    x = check_lod_rows(x, "x")
    features = x.values.shape[-1]
    if self.positions == "learned":
      check_max_length(self.max_length, x)
      position = nn.Embed(
        self.max_length,
        features,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        name="position_embedding",
      )
    else:
      position = sinusoids_of(features)
    settings = {name: getattr(self, name) for name in LAYER_ATTRIBUTES}
    layers = [
      TransformerEncoderLayer(**settings, name=f"layers_{i}")
      for i in range(self.num_layers)
    ]
    norm = nn.LayerNorm(
      EPSILON, dtype=self.dtype, param_dtype=self.param_dtype, name="final_norm"
    )
    dropout = nn.Dropout(self.dropout_rate)
    return encode(x, position, layers, norm, dropout, deterministic)


# -- the twins' shared body -----------------------------------------------------------

QKV = ("query", "key", "value")


# The `TransformerEncoder` attributes that its layers take as theirs.
LAYER_ATTRIBUTES = (
  "num_heads",
  "mlp_features",
  "qkv_features",
  "dropout_rate",
  "attention_dropout_rate",
  "causal",
  "kernel_init",
  "bias_init",
  "dtype",
  "param_dtype",
  "plan",
)


def check_attention(layer: Any) -> None:
  """A `MultiHeadAttention`'s settings (either twin's, read off `layer`):
  sizes ints >= 1 (`qkv_features` and `out_features` or `None`), flags
  bools, a rate in ``[0, 1]``, callable initializers, float dtypes."""
  check_sizes(num_heads=layer.num_heads)
  for name in ("qkv_features", "out_features"):
    if getattr(layer, name) is not None:
      check_sizes(**{name: getattr(layer, name)})
  check_bools(
    causal=layer.causal, deterministic=layer.deterministic, use_bias=layer.use_bias
  )
  check_rate(layer.dropout_rate, "dropout_rate")
  check_callable(layer.kernel_init, "kernel_init")
  check_callable(layer.bias_init, "bias_init")
  check_layer_dtypes(layer.dtype, layer.param_dtype)


def check_encoder_layer(layer: Any) -> None:
  """A `TransformerEncoderLayer`'s settings (and a `TransformerEncoder`'s
  that its layers take), read off `layer` of either twin."""
  check_sizes(num_heads=layer.num_heads, mlp_features=layer.mlp_features)
  if layer.qkv_features is not None:
    check_sizes(qkv_features=layer.qkv_features)
  check_bools(causal=layer.causal, deterministic=layer.deterministic)
  check_rate(layer.dropout_rate, "dropout_rate")
  check_rate(layer.attention_dropout_rate, "attention_dropout_rate")
  check_callable(layer.kernel_init, "kernel_init")
  check_callable(layer.bias_init, "bias_init")
  check_layer_dtypes(layer.dtype, layer.param_dtype)


def check_encoder(encoder: Any) -> None:
  """A `TransformerEncoder`'s settings: its layers' (`check_encoder_layer`),
  `num_layers` >= 1, `positions` one of `POSITIONS`, and `max_length` an
  int >= 1 when given (required for learned positions)."""
  check_sizes(num_layers=encoder.num_layers)
  check_encoder_layer(encoder)
  if not isinstance(encoder.positions, str) or encoder.positions not in POSITIONS:
    raise ValueError(
      f"Expected `positions` to be one of {list(POSITIONS)}, got {encoder.positions!r}."
    )
  if encoder.max_length is not None:
    check_sizes(max_length=encoder.max_length)
  elif encoder.positions == "learned":
    raise ValueError(
      'Expected `max_length` (an int >= 1) with positions="learned", got None.'
    )


def check_max_length(max_length: int, x: LoDTensor) -> None:
  """Learned positions cover every position of `x`: `max_length` is at
  least `x`'s time capacity (static, the longest sequence its capacities
  hold)."""
  time = x.capacity.time[-1]
  if max_length < time:
    raise ValueError(
      f"Expected `max_length` >= {time} (the time capacity of `x`: its longest "
      f"sequence may have {time} rows), got {max_length}."
    )


def linen_rows(module: nn.Module, example: jax.Array) -> Callable[[jax.Array], Any]:
  """A bound Linen `module` as a function of rows that
  `jaxlod.ops.map_rows` can trace: while initializing, the module is
  called once on `example` (one row) so that its parameters exist; the
  function applies an unbound copy to the module's variables."""
  if module.is_initializing():
    module(example)
  variables = module.variables
  unbound = module.clone(parent=None)
  return lambda rows: unbound.apply(variables, rows)


def check_lod_rows(x: Any, name: str) -> LoDTensor:
  """`x` is a LoDTensor of float rows ``[token_capacity, features]``."""
  x = check_lod(x, name)
  if x.values.ndim != 2:
    raise ValueError(
      f"Expected `{name}.values` to have shape [token_capacity, features], got "
      f"{tuple(x.values.shape)}."
    )
  check_float(x.values.dtype, f"{name}.values")
  return x


def attention_inputs(
  inputs_q: Any, inputs_k: Any, inputs_v: Any
) -> tuple[LoDTensor, LoDTensor, LoDTensor]:
  """The queries, keys and values, with Flax's defaults (`inputs_k`:
  `inputs_q`; `inputs_v`: `inputs_k`), checked: LoDTensors of float rows,
  the values with the keys' LoD, as many key sequences as query sequences
  (capacities at trace time, real counts eagerly or through `checkify`)."""
  inputs_q = check_lod_rows(inputs_q, "inputs_q")
  if inputs_k is not None:
    inputs_k = check_lod_rows(inputs_k, "inputs_k")
  if inputs_v is not None:
    inputs_v = check_lod_rows(inputs_v, "inputs_v")
    if inputs_k is None:
      raise ValueError(
        "Expected `inputs_k` with `inputs_v` (the keys default to the queries "
        "only when the values are not given either), got `inputs_k` None."
      )
  if inputs_k is None:
    return inputs_q, inputs_q, inputs_q
  if inputs_v is None:
    inputs_v = inputs_k
  if inputs_v is not inputs_k:
    _same_lod(inputs_k, inputs_v)
  count, wanted = inputs_k.capacity.sequences[-1], inputs_q.capacity.sequences[-1]
  if count != wanted:
    raise ValueError(
      "Expected `inputs_k` to have the last-level count capacity of `inputs_q`, "
      f"{wanted}, got {count}."
    )
  require(
    inputs_k.num_sequences() == inputs_q.num_sequences(),
    "Expected `inputs_k` to have as many last-level sequences as `inputs_q`; "
    "`inputs_q` has {q}, `inputs_k` {k}.",
    q=inputs_q.num_sequences(),
    k=inputs_k.num_sequences(),
  )
  return inputs_q, inputs_k, inputs_v


def _same_lod(inputs_k: LoDTensor, inputs_v: LoDTensor) -> None:
  """`inputs_v` has the LoD of `inputs_k`: capacities at trace time, offsets
  eagerly or through `checkify` (under `jit`, `sequence_attention` also
  poisons the result of offsets that differ)."""
  capacities = [(t.capacity.tokens, t.capacity.sequences) for t in (inputs_k, inputs_v)]
  if capacities[0] != capacities[1]:
    raise ValueError(
      f"Expected `inputs_v` to have the LoD of `inputs_k`; `inputs_k` has capacity "
      f"{inputs_k.capacity}, `inputs_v` {inputs_v.capacity}."
    )
  for level, (a, b) in enumerate(zip(inputs_k.offsets, inputs_v.offsets, strict=True)):
    require(
      jnp.array_equal(a, b),
      f"Expected `inputs_v` to have the LoD of `inputs_k`; at level {level} "
      "`inputs_v` has offsets {b}, `inputs_k` {a}.",
      a=a,
      b=b,
    )


def head_dim(qkv_features: int, num_heads: int, given: int | None) -> int:
  """The width of each head: `qkv_features` over `num_heads` (`given`: the
  `qkv_features` argument, `None` when it is the queries' width)."""
  if qkv_features % num_heads:
    what = "" if given is not None else " (the width of `inputs_q`, as it is None)"
    raise ValueError(
      f"Expected `qkv_features`{what} to be a multiple of `num_heads`, "
      f"{num_heads}, got {qkv_features}."
    )
  return qkv_features // num_heads


def attend_heads(
  inputs: tuple[LoDTensor, LoDTensor, LoDTensor],
  project: Sequence[Callable[[jax.Array], jax.Array]],
  out: Callable[[jax.Array], jax.Array],
  causal: bool,
  plan: AttentionPlan | None,
  dropout_rate: float,
  rng: jax.Array | None,
) -> LoDTensor:
  """`MultiHeadAttention`'s body: the checked `inputs` (queries, keys,
  values) projected by `project` (to ``[rows, heads, head_dim]``, in one
  dtype), `jaxlod.ops.sequence_attention` (its weights dropped at
  `dropout_rate` from `rng`; `None`: no dropout), then `out`; padding rows
  zero. `project` and `out` are functions of rows that `map_rows` traces
  (NNX layers, or Linen layers through `linen_rows`)."""
  if inputs[0] is inputs[1] is inputs[2]:  # self-attention: one `map_rows`
    rows = map_rows(lambda r: [f(r) for f in project], inputs[0])
    rows = [x.values for x in rows]
  else:
    rows = [map_rows(f, x).values for f, x in zip(project, inputs, strict=True)]
  dtype = jnp.result_type(*rows)
  q, k, v = (x.with_values(r.astype(dtype)) for x, r in zip(inputs, rows, strict=True))
  drop = {"dropout_rate": dropout_rate, "dropout_rng": rng} if rng is not None else {}
  attended = sequence_attention(q, k, v, causal=causal, plan=plan, **drop)
  return map_rows(out, attended)


def encoder_layer(
  x: LoDTensor,
  attention_norm: Callable[[jax.Array], jax.Array],
  attention: Callable[[LoDTensor], LoDTensor],
  mlp_norm: Callable[[jax.Array], jax.Array],
  mlp_in: Callable[[jax.Array], jax.Array],
  mlp_out: Callable[[jax.Array], jax.Array],
  dropout: Callable[..., jax.Array],
  deterministic: bool,
) -> LoDTensor:
  """`TransformerEncoderLayer`'s body: the attention's and then the MLP's
  pre-norm residual branches over the rows of a checked `x`, each branch's
  output through `dropout`; padding rows zero. `attention` and `dropout`
  take ``deterministic=``; the MLP's norm and layers are functions of rows,
  which run over the real rows as one `map_rows`."""
  attended = attention(
    x.with_values(attention_norm(x.values)), deterministic=deterministic
  )
  drop = functools.partial(dropout, deterministic=deterministic)
  h = x.values + drop(attended.values).astype(x.values.dtype)

  def mlp(rows: jax.Array) -> jax.Array:
    return mlp_out(jax.nn.gelu(mlp_in(mlp_norm(rows))))

  h = h + drop(map_rows(mlp, x.with_values(h)).values).astype(h.dtype)
  # The attention's result carries the faults of its inputs and its own.
  return zero_padding(attended, h)


def encode(
  x: LoDTensor,
  position: Callable[[jax.Array], jax.Array],
  layers: Sequence[Callable[..., LoDTensor]],
  final_norm: Callable[[jax.Array], jax.Array],
  dropout: Callable[..., jax.Array],
  deterministic: bool,
) -> LoDTensor:
  """`TransformerEncoder`'s body: ``position(positions)`` rows added to the
  rows of a checked `x`, `dropout`, the `layers` in turn, then
  `final_norm`; padding rows zero. The layers and `dropout` take
  ``deterministic=``."""
  rows = position(sequence_positions(x))
  h = zero_padding(x, x.values + rows.astype(x.values.dtype))
  h = h.with_values(dropout(h.values, deterministic=deterministic))
  for layer in layers:
    h = layer(h, deterministic=deterministic)
  return zero_padding(h, final_norm(h.values))


def sequence_positions(x: LoDTensor) -> jax.Array:
  """Each row's position in its last-level sequence, int32
  ``[token_capacity]``: its row index minus its sequence's offset (0 at a
  padding row). Jittable: read from the offsets, not from their values'
  sizes."""
  rows = jnp.arange(x.capacity.tokens, dtype=jnp.int32)
  offsets = jnp.asarray(x.offsets[-1], jnp.int32)
  sequence = jnp.minimum(x.segment_ids(), offsets.shape[0] - 1)
  return jnp.where(x.row_mask(), rows - offsets[sequence], 0)


def sinusoids(positions: jax.Array, features: int) -> jax.Array:
  """Sinusoidal position rows ``[rows, features]`` (float32) of int
  `positions` ``[rows]``: ``sin(p * w_i)`` in column ``2i`` and ``cos(p *
  w_i)`` in column ``2i + 1``, ``w_i = 10000 ** (-2i / features)``."""
  half = (features + 1) // 2
  rates = jnp.exp(jnp.arange(half, dtype=jnp.float32) * (-2 * math.log(1e4) / features))
  angles = positions.astype(jnp.float32)[:, None] * rates[None, :]
  table = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  return table.reshape(positions.shape[0], 2 * half)[:, :features]


def sinusoids_of(features: int) -> Callable[[jax.Array], jax.Array]:
  """`sinusoids` of `features` columns, as a function of the positions."""
  return lambda positions: sinusoids(positions, features)
