"""Every layer of `jaxlod.nn` against its NNX twin in `jaxlod.nn.nnx`: the same
names, arguments and defaults, the same outputs and gradients on copied
parameters, the same hypotheses and the same error messages."""

from __future__ import annotations

import dataclasses
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlod.nn as linen
import jaxlod.nn.nnx as twin
from jaxlod import Buckets, LoDTensor
from jaxlod.ops import DecodeSettings
from tests.helpers import assert_close

FEATURES, HIDDEN, UNITS, EMBED = 3, 4, 5, 6
SRC_VOCAB, TGT_VOCAB = 7, 8
# Parity of float32 outputs and of gradients summed over steps and rows.
TOL = {"rtol": 1e-5, "atol": 1e-6}
BUCKETS = Buckets.fixed(tokens=16, sequences=5, time=6)
MEMORY_BUCKETS = Buckets.fixed(tokens=16, sequences=5, time=6)


def _lod(lengths, features, buckets=BUCKETS, seed=0) -> LoDTensor:
  rng = np.random.default_rng(seed)
  seqs = [rng.normal(size=(n, features)).astype(np.float32) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=buckets)


def _ids(lengths, vocab, seed) -> LoDTensor:
  rng = np.random.default_rng(seed)
  seqs = [rng.integers(2, vocab, size=n).astype(np.int32) for n in lengths]
  return LoDTensor.from_sequences(seqs, buckets=BUCKETS, dtype=np.int32)


X = _lod([4, 0, 5, 1, 3], FEATURES)
TGT = _lod([2, 3, 0, 4, 1], FEATURES, seed=1)
MEMORY = _lod([3, 1, 0, 5, 2], HIDDEN, MEMORY_BUCKETS, seed=2)
NESTED = LoDTensor.from_lengths(
  np.random.default_rng(3).normal(size=(9, FEATURES)).astype(np.float32),
  [[2, 0, 2], [3, 0, 4, 2]],
  buckets=Buckets.fixed(tokens=12, sequences=(4, 5), time=(3, 6)),
)
SRC = _ids([3, 1, 5, 2], SRC_VOCAB, seed=4)
TGT_IN = _ids([2, 4, 1, 3], TGT_VOCAB, seed=5)


# -- copying parameters -------------------------------------------------------------


def _linen_path(path) -> tuple[str, ...]:
  """The Linen parameter path of an NNX state path."""
  out = []
  for key in path:
    if isinstance(key, int):
      out[-1] = f"{out[-1]}_{key}"
    else:
      out.append("if" if key == "if_" else key)
  return tuple(out)


def _flat_linen(params) -> dict:
  return {
    tuple(k.key for k in path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }


def _copy(params, module: nnx.Module) -> None:
  """Sets `module`'s parameters to the Linen `params` (every one used once)."""
  linen_flat = _flat_linen(params)
  state = nnx.state(module, nnx.Param)
  flat = nnx.to_flat_state(state)
  assert len(flat) == len(linen_flat), (sorted(linen_flat), [p for p, _ in flat])
  for path, variable in flat:
    value = linen_flat[_linen_path(path)]
    assert variable.shape == value.shape, path
    variable[...] = value
  nnx.update(module, state)


def _same_grads(linen_grads, nnx_grads) -> None:
  flat = _flat_linen(linen_grads)
  for path, variable in nnx.to_flat_state(nnx_grads):
    assert_close(variable[...], flat[_linen_path(path)], **TOL)


def _perturbed(variables):
  """Non-zero biases, so that their placement is checked too."""
  return jax.tree.map(
    lambda a: a + 0.1 * jnp.cos(jnp.arange(a.size).reshape(a.shape)), variables
  )


def _loss(out) -> jax.Array:
  leaves = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, LoDTensor))
  values = [x.values if isinstance(x, LoDTensor) else x for x in leaves]
  return sum(
    jnp.sum(jnp.sin(v) * (1 + jnp.arange(v.size) % 3).reshape(v.shape)) for v in values
  )


def _check_parity(module, ours, *args, **kwargs) -> None:
  """Equal outputs and gradients of a Linen `module` and its NNX twin `ours`
  on the same parameters (each side one compiled program: its outputs come
  with its gradients)."""
  init = jax.jit(lambda key: _perturbed(module.init(key, *args, **kwargs)))
  variables = init(jax.random.key(0))
  _copy(variables.get("params", {}), ours)

  def linen_loss(v):
    out = module.apply(v, *args, **kwargs)
    return _loss(out), out

  def nnx_loss(m):
    out = m(*args, **kwargs)
    return _loss(out), out

  (_, want), linen_grads = jax.jit(jax.value_and_grad(linen_loss, has_aux=True))(
    variables
  )
  (_, got), nnx_grads = nnx.jit(nnx.value_and_grad(nnx_loss, has_aux=True))(ours)
  assert_close(jax.tree.leaves(got), jax.tree.leaves(want), **TOL)
  _same_grads(linen_grads.get("params", {}), nnx_grads)


# -- the twins ---------------------------------------------------------------------


def _rnn(cell_in=FEATURES, hidden=HIDDEN, seed=0, **kwargs):
  return (
    linen.DynamicRNN(nn.LSTMCell(hidden), **kwargs),
    twin.DynamicRNN(nnx.LSTMCell(cell_in, hidden, rngs=nnx.Rngs(seed)), **kwargs),
  )


def _bidirectional():
  (lf, nf), (lb, nb) = _rnn(), _rnn(hidden=HIDDEN + 1, seed=1)
  return linen.Bidirectional(lf, lb), twin.Bidirectional(nf, nb)


def _stacked():
  (l0, n0), (l1, n1) = _rnn(), _rnn(cell_in=HIDDEN, seed=1)
  return linen.StackedRNN([l0, l1]), twin.StackedRNN([n0, n1])


def _hierarchical():
  (li, ni), (lo, no) = _rnn(), _rnn(cell_in=HIDDEN, hidden=HIDDEN + 1, seed=1)
  return (
    linen.HierarchicalEncoder(li, lo, pool_type="average"),
    twin.HierarchicalEncoder(ni, no, pool_type="average"),
  )


def _attention(kind, hidden=HIDDEN, features=HIDDEN):
  rngs = nnx.Rngs(0)
  return {
    "dot": lambda: (linen.DotAttention(), twin.DotAttention()),
    "general": lambda: (
      linen.GeneralAttention(),
      twin.GeneralAttention(hidden, features, rngs=rngs),
    ),
    "additive": lambda: (
      linen.AdditiveAttention(UNITS),
      twin.AdditiveAttention(hidden, features, UNITS, rngs=rngs),
    ),
    "cosine": lambda: (linen.CosineAttention(), twin.CosineAttention()),
  }[kind]()


def _decoder(kind, input_feeding):
  la, na = _attention(kind)
  width = FEATURES + (HIDDEN if input_feeding else 0)
  return (
    linen.AttentionDecoder(nn.LSTMCell(HIDDEN), la, input_feeding=input_feeding),
    twin.AttentionDecoder(
      nnx.LSTMCell(width, HIDDEN, rngs=nnx.Rngs(1)), na, input_feeding=input_feeding
    ),
  )


def _seq2seq(kind="additive", input_feeding=True, hidden=HIDDEN, seed=0):
  rngs = nnx.Rngs(seed)
  la, na = _attention(kind, hidden, HIDDEN)
  width = EMBED + (HIDDEN if input_feeding else 0)
  encoder = twin.DynamicRNN(nnx.LSTMCell(EMBED, HIDDEN, rngs=rngs))
  decoder = twin.AttentionDecoder(
    nnx.LSTMCell(width, hidden, rngs=rngs), na, input_feeding=input_feeding
  )
  ours = twin.Seq2Seq(
    SRC_VOCAB, TGT_VOCAB, EMBED, encoder, decoder, features=HIDDEN, rngs=rngs
  )
  module = linen.Seq2Seq(
    SRC_VOCAB,
    TGT_VOCAB,
    EMBED,
    linen.DynamicRNN(nn.LSTMCell(HIDDEN)),
    linen.AttentionDecoder(nn.LSTMCell(hidden), la, input_feeding=input_feeding),
  )
  return module, ours


def _linear():
  rngs = nnx.Rngs(0)
  return {
    "min_gru": (linen.MinGRU(HIDDEN), twin.MinGRU(FEATURES, HIDDEN, rngs=rngs)),
    "rg_lru": (
      linen.RGLRU(HIDDEN, return_carry=True),
      twin.RGLRU(FEATURES, HIDDEN, return_carry=True, rngs=rngs),
    ),
    "bidirectional": (
      linen.Bidirectional(linen.MinGRU(HIDDEN), linen.RGLRU(HIDDEN + 1)),
      twin.Bidirectional(
        twin.MinGRU(FEATURES, HIDDEN, rngs=rngs),
        twin.RGLRU(FEATURES, HIDDEN + 1, rngs=rngs),
      ),
    ),
    "stacked": (
      linen.StackedRNN([linen.RGLRU(HIDDEN), linen.MinGRU(HIDDEN)]),
      twin.StackedRNN(
        [
          twin.RGLRU(FEATURES, HIDDEN, rngs=rngs),
          twin.MinGRU(HIDDEN, HIDDEN, rngs=rngs),
        ]
      ),
    ),
  }


@pytest.mark.parametrize("name", ["min_gru", "rg_lru", "bidirectional", "stacked"])
def test_linear_recurrent_twins_agree(name):
  _check_parity(*_linear()[name], X)


def test_rnn_twins_agree():
  _check_parity(*_rnn(return_carry=True), X)
  _check_parity(*_rnn(reverse=True), X)
  _check_parity(*_bidirectional(), X)
  _check_parity(*_stacked(), X)
  _check_parity(*_hierarchical(), NESTED)


@pytest.mark.parametrize("kind", ["dot", "general", "additive", "cosine"])
def test_attention_twins_agree(kind):
  query = jnp.asarray(np.random.default_rng(6).normal(size=(5, HIDDEN)), jnp.float32)
  _check_parity(*_attention(kind), query, MEMORY)


@pytest.mark.parametrize(
  ("kind", "input_feeding"), [("dot", False), ("additive", True), ("general", True)]
)
def test_attention_decoder_twins_agree(kind, input_feeding):
  _check_parity(*_decoder(kind, input_feeding), TGT, MEMORY, return_weights=True)


@pytest.mark.parametrize(
  ("kind", "input_feeding"), [("additive", True), ("dot", False)]
)
def test_seq2seq_twins_agree(kind, input_feeding):
  _check_parity(*_seq2seq(kind, input_feeding), SRC, TGT_IN, return_weights=True)


def _same_hypotheses(got, want) -> None:
  assert got.ids.recursive_lengths() == want.ids.recursive_lengths()
  np.testing.assert_array_equal(got.ids.values, want.ids.values)
  assert_close(got.scores.values, want.scores.values, **TOL)


def _init(module, seed):
  return jax.jit(lambda key: _perturbed(module.init(key, SRC, TGT_IN)))(
    jax.random.key(seed)
  )


@pytest.mark.parametrize("beam_size", [3, 1])
def test_generate_twins_give_the_same_hypotheses(beam_size):
  settings = DecodeSettings(bos_id=0, eos_id=1, max_length=5, beam_size=beam_size)
  module, ours = _seq2seq()
  variables = _init(module, 0)
  _copy(variables["params"], ours)
  want = jax.jit(lambda v: module.apply(v, SRC, settings, method="generate"))(variables)
  got = nnx.jit(lambda m: m.generate(SRC, settings))(ours)
  assert [len(h) for h in want.ids.to_list()] == [beam_size] * 4
  _same_hypotheses(got, want)
  # Two members, of different widths.
  module_2, ours_2 = _seq2seq(hidden=HIDDEN + 2, seed=1)
  variables_2 = _init(module_2, 1)
  _copy(variables_2["params"], ours_2)
  want = jax.jit(
    lambda v, v_2: linen.ensemble_generate(
      [(module, v), (module_2, v_2)], SRC, settings
    )
  )(variables, variables_2)
  got = nnx.jit(lambda m, m_2: twin.ensemble_generate([m, m_2], SRC, settings))(
    ours, ours_2
  )
  _same_hypotheses(got, want)


# -- the same surface --------------------------------------------------------------

# Per NNX twin: the constructor arguments it adds (input widths, as Flax's NNX
# layers take them, and rngs).
NNX_ADDS = {
  "GeneralAttention": {"hidden", "features", "rngs"},
  "AdditiveAttention": {"hidden", "features", "rngs"},
  "Seq2Seq": {"features", "rngs"},
  "StackedRNN": {"rngs"},
  # Flax's own `RNN` twins differ here: NNX's takes these three and not
  # Linen's lifted-transform settings (`LINEN_ONLY`).
  "RNN": {"state_axes", "broadcast_rngs", "rngs"},
  # flax.nnx.Bidirectional's default carry RNGs (Linen's come from `init_key`).
  "Bidirectional": {"rngs"},
  "MinGRU": {"in_features", "rngs"},
  "RGLRU": {"in_features", "rngs"},
  # As flax.nnx.MultiHeadAttention's: the widths of the queries and the keys.
  "MultiHeadAttention": {"in_features", "in_kv_features", "rngs"},
  "TransformerEncoderLayer": {"in_features", "rngs"},
  "TransformerEncoder": {"in_features", "rngs"},
}
# Constructor arguments of a Linen layer that its NNX twin does not take, as
# between Flax's own twins.
LINEN_ONLY = {
  "RNN": {"variable_axes", "variable_broadcast", "variable_carry", "split_rngs"},
}
# Per method argument: Linen's name and NNX's (a key against an Rngs).
RENAMED = {"init_key": "rngs"}


def _parameters(fn, skip=("self",)) -> dict:
  variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
  return {
    name: p.default
    for name, p in inspect.signature(fn).parameters.items()
    if name not in skip and p.kind not in variadic
  }


@pytest.mark.parametrize("name", linen.__all__)
def test_every_layer_has_a_twin_with_the_same_arguments(name):
  assert twin.__all__ == linen.__all__
  ours, theirs = getattr(twin, name), getattr(linen, name)
  if not inspect.isclass(theirs):
    want = _parameters(theirs)
    assert list(_parameters(ours)) == list(want)
    return
  fields = {
    f.name: inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
    for f in theirs.__dataclass_fields__.values()
    if f.name not in ("parent", "name")
    and f.init
    and f.name not in LINEN_ONLY.get(name, ())
  }
  got = _parameters(ours.__init__)
  extra = NNX_ADDS.get(name, set())
  assert set(got) - set(fields) == extra
  for arg, default in fields.items():
    assert got[arg] == default, (arg, default)
  for method in (
    "__call__",
    "keys",
    "step",
    "precompute",
    "initial_state",
    "zero_carry",
    "encode",
    "decode_step",
    "generate",
    "generate_corpus",
  ):
    if hasattr(theirs, method) and method in vars(theirs) | vars(theirs.__mro__[1]):
      want = {
        RENAMED.get(k, k): v for k, v in _parameters(getattr(theirs, method)).items()
      }
      have = _parameters(getattr(ours, method))
      assert {k: v for k, v in have.items() if k != "rngs"} == {
        k: v for k, v in want.items() if k != "rngs"
      }, (name, method)


# -- the same errors ---------------------------------------------------------------


def _message(fn) -> str:
  with pytest.raises((TypeError, ValueError)) as info:
    fn()
  return str(info.value).split("\n")[0]


@pytest.mark.parametrize(
  "case", ["query_rank", "rows", "width", "lengths", "keys", "memory_levels"]
)
def test_attention_twins_raise_the_same_errors(case):
  module, ours = _attention("dot") if case != "keys" else _attention("additive")
  query = jnp.ones((5, HIDDEN))
  args = {
    "query_rank": (jnp.ones(5), MEMORY),
    "rows": (jnp.ones((3, HIDDEN)), MEMORY),
    "width": (jnp.ones((5, HIDDEN + 1)), MEMORY),
    "lengths": (query, MEMORY, MEMORY.lengths()),
    "keys": (query, MEMORY, None, jnp.ones((5, 6, UNITS + 1))),
    "memory_levels": (query, NESTED),
  }[case]
  variables = module.init(jax.random.key(0), query, MEMORY)
  assert _message(lambda: ours(*args)) == _message(
    lambda: module.apply(variables, *args)
  )


@pytest.mark.parametrize("case", ["counts", "capacity", "tgt_rows", "memory_array"])
def test_decoder_twins_raise_the_same_errors(case):
  module, ours = _decoder("dot", False)
  tgt, memory = TGT, MEMORY
  if case == "counts":
    memory = _lod([3, 1, 0, 5], HIDDEN, MEMORY_BUCKETS)
  elif case == "capacity":
    memory = _lod([3, 1], HIDDEN, Buckets.fixed(tokens=16, sequences=3, time=6))
  elif case == "tgt_rows":
    tgt = tgt.with_values(tgt.values[..., None])
  else:
    memory = np.asarray(memory.values)
  variables = module.init(jax.random.key(0), TGT, MEMORY)
  want = _message(lambda: module.apply(variables, tgt, memory))
  assert _message(lambda: ours(tgt, memory)) == want
