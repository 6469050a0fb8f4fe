"""NNX Transformer layers over LoDTensors: the twins of `jaxlod.nn`'s
`MultiHeadAttention`, `TransformerEncoderLayer` and `TransformerEncoder`.

The same parameters under the same names, the same bodies (the functions of
`jaxlod.nn`'s module) and the same errors; the constructors take the input
widths and ``rngs``, as Flax's NNX layers do. ``nnx.Module.train()`` and
``eval()`` switch `deterministic`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxlod._checks import check_bools, check_sizes, check_width
from jaxlod._lod import LoDTensor
from jaxlod.nn._recurrent import override
from jaxlod.nn._transformer import (
  EPSILON,
  QKV,
  attend_heads,
  attention_inputs,
  check_attention,
  check_encoder,
  check_encoder_layer,
  check_lod_rows,
  check_max_length,
  default_bias_init,
  default_kernel_init,
  encode,
  encoder_layer,
  head_dim,
  sinusoids_of,
)
from jaxlod.ops import AttentionPlan
from jaxlod.ops._rank import RankTable, check_table


def keep(module: nnx.Module, **settings: Any) -> None:
  """Sets `module`'s attributes to `settings` (the Linen twin's attribute
  names, which the shared checks and bodies read)."""
  for name, value in settings.items():
    setattr(module, name, value)


class MultiHeadAttention(nnx.Module):
  """Multi-head dot-product attention inside each sequence of LoDTensors:
  the NNX twin of `jaxlod.nn.MultiHeadAttention`.

  The parameters are ``flax.nnx.MultiHeadAttention``'s: ``query``, ``key``
  and ``value`` (``nnx.LinearGeneral`` to ``[num_heads, head_dim]``) and
  ``out`` (``nnx.LinearGeneral`` from ``[num_heads, head_dim]`` to
  `out_features`). The dropout, as in the Linen twin, is on the attention
  weights, with keys drawn from ``rngs.dropout`` (kept, as Flax's
  ``nnx.MultiHeadAttention`` keeps it, where `dropout_rate` > 0).

  Args:
    num_heads: the number of heads.
    in_features: the width of the query rows.
    qkv_features: the width of the queries, keys and values (a multiple of
      `num_heads`); `None`: `in_features`.
    out_features: the width of the outputs; `None`: `in_features`.
    in_kv_features: the width of the key and value rows; `None`:
      `in_features`.
    causal, dropout_rate, deterministic, kernel_init, bias_init: as
      `jaxlod.nn.MultiHeadAttention`'s attributes.
    use_bias, dtype, param_dtype, plan: as `jaxlod.nn.MultiHeadAttention`'s
      attributes.
    rngs: the RNGs of the initializers and of the dropout.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import MultiHeadAttention
    >>> x = LoDTensor.from_sequences([np.ones((3, 4), np.float32), np.ones((1, 4))])
    >>> attention = MultiHeadAttention(2, 4, rngs=nnx.Rngs(0))
    >>> attention.query.kernel.shape
    (4, 2, 2)
    >>> y = attention(x)
    >>> y.values.shape, y.recursive_lengths()
    ((4, 4), [[3, 1]])
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    *,
    in_kv_features: int | None = None,
    causal: bool = False,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    kernel_init: Callable[..., Any] = default_kernel_init,
    bias_init: Callable[..., Any] = default_bias_init,
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    plan: AttentionPlan | None = None,
    rngs: nnx.Rngs,
  ):
    """Checks the arguments (see the class docstring) and builds the four
    projections and the dropout's keys.

    Raises:
      TypeError, ValueError: as `jaxlod.nn.MultiHeadAttention`'s call does
        for its attributes (the same messages), and for widths that are not
        ints >= 1.
    """
    check_sizes(in_features=in_features)
    if in_kv_features is not None:
      check_sizes(in_kv_features=in_kv_features)
    keep(
      self,
      num_heads=num_heads,
      qkv_features=qkv_features,
      out_features=out_features,
      causal=causal,
      dropout_rate=dropout_rate,
      deterministic=deterministic,
      kernel_init=kernel_init,
      bias_init=bias_init,
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      plan=plan,
    )
    check_attention(self)
    self.in_features = in_features
    self.in_kv_features = in_features if in_kv_features is None else in_kv_features
    qkv = in_features if qkv_features is None else qkv_features
    heads = (num_heads, head_dim(qkv, num_heads, qkv_features))
    common = {
      "kernel_init": kernel_init,
      "bias_init": bias_init,
      "use_bias": use_bias,
      "dtype": dtype,
      "param_dtype": param_dtype,
      "rngs": rngs,
    }
    self.query = nnx.LinearGeneral(in_features, heads, **common)
    self.key = nnx.LinearGeneral(self.in_kv_features, heads, **common)
    self.value = nnx.LinearGeneral(self.in_kv_features, heads, **common)
    out = in_features if out_features is None else out_features
    self.out = nnx.LinearGeneral(heads, out, axis=(-2, -1), **common)
    self.rngs = rngs.dropout.fork() if dropout_rate > 0 else None

  def __call__(
    self,
    inputs_q: LoDTensor,
    inputs_k: LoDTensor | None = None,
    inputs_v: LoDTensor | None = None,
    *,
    deterministic: bool | None = None,
  ) -> LoDTensor:
    """Attends every query row over the key rows of its own sequence: as
    `jaxlod.nn.MultiHeadAttention.__call__`, with ``deterministic=False``
    drawing from ``rngs.dropout``; the widths of the inputs must be
    `in_features` and `in_kv_features`."""
    (deterministic,) = override(self, deterministic=deterministic)
    check_bools(deterministic=deterministic)
    inputs = attention_inputs(inputs_q, inputs_k, inputs_v)
    for name, x, width in zip(
      ("inputs_q", "inputs_k", "inputs_v"),
      inputs,
      (self.in_features, self.in_kv_features, self.in_kv_features),
      strict=True,
    ):
      what = "`in_features`" if name == "inputs_q" else "`in_kv_features`"
      check_width(name, x.values.shape[-1], width, what)
    project = [getattr(self, name) for name in QKV]
    rng = None
    if not deterministic and self.dropout_rate > 0:
      rng = self.rngs()
    return attend_heads(
      inputs, project, self.out, self.causal, self.plan, self.dropout_rate, rng
    )


class TransformerEncoderLayer(nnx.Module):
  """A pre-norm Transformer encoder layer over the sequences of a
  LoDTensor: the NNX twin of `jaxlod.nn.TransformerEncoderLayer`, with
  ``attention_norm`` and ``mlp_norm`` (``nnx.LayerNorm(in_features)``),
  ``attention`` (a `MultiHeadAttention`), ``mlp_in`` (``nnx.Linear(
  in_features, mlp_features)``) and ``mlp_out`` (back to `in_features`).

  Args:
    num_heads: the attention's heads.
    in_features: the width of the rows (in and out).
    mlp_features: the width of the MLP's hidden layer.
    qkv_features, dropout_rate, attention_dropout_rate, causal: as
      `jaxlod.nn.TransformerEncoderLayer`'s attributes.
    deterministic, kernel_init, bias_init, dtype, param_dtype, plan: as
      `jaxlod.nn.TransformerEncoderLayer`'s attributes.
    rngs: the RNGs of the initializers and of dropout.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import TransformerEncoderLayer
    >>> x = LoDTensor.from_sequences([np.ones((3, 4), np.float32), np.ones((1, 4))])
    >>> layer = TransformerEncoderLayer(2, 4, 8, rngs=nnx.Rngs(0))
    >>> layer(x).values.shape
    (4, 4)
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    mlp_features: int,
    *,
    qkv_features: int | None = None,
    dropout_rate: float = 0.0,
    attention_dropout_rate: float = 0.0,
    causal: bool = False,
    deterministic: bool = True,
    kernel_init: Callable[..., Any] = default_kernel_init,
    bias_init: Callable[..., Any] = default_bias_init,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    plan: AttentionPlan | None = None,
    rngs: nnx.Rngs,
  ):
    """Checks the arguments (see the class docstring) and builds the
    sublayers.

    Raises:
      TypeError, ValueError: as `jaxlod.nn.TransformerEncoderLayer`'s call
        does for its attributes (the same messages).
    """
    settings = {
      "num_heads": num_heads,
      "mlp_features": mlp_features,
      "qkv_features": qkv_features,
      "dropout_rate": dropout_rate,
      "attention_dropout_rate": attention_dropout_rate,
      "causal": causal,
      "kernel_init": kernel_init,
      "bias_init": bias_init,
      "dtype": dtype,
      "param_dtype": param_dtype,
      "plan": plan,
    }
    keep(self, **settings, deterministic=deterministic)
    check_sizes(in_features=in_features)
    check_encoder_layer(self)
    self.in_features = in_features
    common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
    dense = {"kernel_init": kernel_init, "bias_init": bias_init, **common}
    self.attention_norm = nnx.LayerNorm(in_features, epsilon=EPSILON, **common)
    self.attention = MultiHeadAttention(
      num_heads,
      in_features,
      qkv_features,
      causal=causal,
      dropout_rate=attention_dropout_rate,
      plan=plan,
      **dense,
    )
    self.mlp_norm = nnx.LayerNorm(in_features, epsilon=EPSILON, **common)
    self.mlp_in = nnx.Linear(in_features, mlp_features, **dense)
    self.mlp_out = nnx.Linear(mlp_features, in_features, **dense)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(self, x: LoDTensor, *, deterministic: bool | None = None) -> LoDTensor:
    """Applies the layer to the rows of `x` (width `in_features`): as
    `jaxlod.nn.TransformerEncoderLayer.__call__`."""
    (deterministic,) = override(self, deterministic=deterministic)
    check_bools(deterministic=deterministic)
    x = check_lod_rows(x, "x")
    check_width("x", x.values.shape[-1], self.in_features, "`in_features`")
    return encoder_layer(
      x,
      self.attention_norm,
      self.attention,
      self.mlp_norm,
      self.mlp_in,
      self.mlp_out,
      self.dropout,
      deterministic,
    )


class TransformerEncoder(nnx.Module):
  """A Transformer encoder over the sequences of a LoDTensor: the NNX twin
  of `jaxlod.nn.TransformerEncoder`, with ``layers`` (an ``nnx.List`` of
  `TransformerEncoderLayer`), ``position_embedding`` (an ``nnx.Embed(
  max_length, in_features)`` with learned positions, else `None`) and
  ``final_norm``. As a `jaxlod.nn.nnx.Seq2Seq` encoder, its ``features`` is
  `in_features`.

  Args:
    num_layers: the number of layers.
    num_heads: every layer's heads.
    in_features: the width of the rows (in and out).
    mlp_features: every layer's MLP width.
    qkv_features, positions, max_length, dropout_rate: as
      `jaxlod.nn.TransformerEncoder`'s attributes.
    attention_dropout_rate, causal, deterministic, kernel_init, bias_init: as
      `jaxlod.nn.TransformerEncoder`'s attributes.
    dtype, param_dtype, plan: as `jaxlod.nn.TransformerEncoder`'s attributes.
    rngs: the RNGs of the initializers and of dropout.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from jaxlod import LoDTensor
    >>> from jaxlod.nn.nnx import TransformerEncoder
    >>> x = LoDTensor.from_sequences([np.ones((3, 4), np.float32), np.ones((1, 4))])
    >>> encoder = TransformerEncoder(2, 2, 4, 8, rngs=nnx.Rngs(0))
    >>> y = encoder(x)
    >>> y.values.shape, y.recursive_lengths()
    ((4, 4), [[3, 1]])
  """

  def __init__(
    self,
    num_layers: int,
    num_heads: int,
    in_features: int,
    mlp_features: int,
    *,
    qkv_features: int | None = None,
    positions: str = "sinusoidal",
    max_length: int | None = None,
    dropout_rate: float = 0.0,
    attention_dropout_rate: float = 0.0,
    causal: bool = False,
    deterministic: bool = True,
    kernel_init: Callable[..., Any] = default_kernel_init,
    bias_init: Callable[..., Any] = default_bias_init,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    plan: AttentionPlan | None = None,
    rngs: nnx.Rngs,
  ):
    """Checks the arguments (see the class docstring) and builds the layers,
    the learned position embedding (with ``positions="learned"``), the
    final norm and the dropout.

    Raises:
      TypeError, ValueError: as `jaxlod.nn.TransformerEncoder`'s call does
        for its attributes (the same messages).
    """
    layer = {
      "qkv_features": qkv_features,
      "dropout_rate": dropout_rate,
      "attention_dropout_rate": attention_dropout_rate,
      "causal": causal,
      "kernel_init": kernel_init,
      "bias_init": bias_init,
      "dtype": dtype,
      "param_dtype": param_dtype,
      "plan": plan,
    }
    keep(
      self,
      **layer,
      num_layers=num_layers,
      num_heads=num_heads,
      mlp_features=mlp_features,
      positions=positions,
      max_length=max_length,
      deterministic=deterministic,
    )
    check_sizes(in_features=in_features)
    check_encoder(self)
    self.in_features = in_features
    sizes = (num_heads, in_features, mlp_features)
    self.layers = nnx.List(
      [TransformerEncoderLayer(*sizes, **layer, rngs=rngs) for _ in range(num_layers)]
    )
    common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
    learned = positions == "learned"
    self.position_embedding = (
      nnx.Embed(max_length, in_features, **common) if learned else None
    )
    self.final_norm = nnx.LayerNorm(in_features, epsilon=EPSILON, **common)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(
    self,
    x: LoDTensor,
    *,
    deterministic: bool | None = None,
    table: RankTable | None = None,
  ) -> LoDTensor:
    """Encodes every sequence of `x` (width `in_features`): as
    `jaxlod.nn.TransformerEncoder.__call__`."""
    (deterministic,) = override(self, deterministic=deterministic)
    check_bools(deterministic=deterministic)
    check_table(table, optional=True)
    x = check_lod_rows(x, "x")
    check_width("x", x.values.shape[-1], self.in_features, "`in_features`")
    position = self.position_embedding
    if position is None:
      position = sinusoids_of(self.in_features)
    else:
      check_max_length(self.max_length, x)
    return encode(
      x, position, self.layers, self.final_norm, self.dropout, deterministic
    )
