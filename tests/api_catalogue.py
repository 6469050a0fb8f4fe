"""The catalogue of wrong inputs and the table machinery of
tests/test_api_inputs.py.

Each public callable is a `Target`: its arguments, each with a valid value
and the wrong values of its kind (`BAD`), and how to call it. The targets
live in tests/api_targets.py (jaxlod, ops, data, parallel) and
tests/api_layer_targets.py (nn, nn.nnx).
"""

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
from jaxlod import Buckets, LoDTensor, data, ops

# -- valid inputs --------------------------------------------------------------------


def lod() -> LoDTensor:
  """One level, float rows [3, 2], lengths [2, 1]."""
  values = np.arange(6.0, dtype=np.float32).reshape(3, 2)
  return LoDTensor.from_lengths(values, [[2, 1]])


def heads() -> LoDTensor:
  """One level, float rows [3, 2 heads, 2], lengths [2, 1]: an attention's
  query, key or value."""
  values = np.arange(12.0, dtype=np.float32).reshape(3, 2, 2) / 12
  return LoDTensor.from_lengths(values, [[2, 1]])


def ids() -> LoDTensor:
  """One level of int ids [3], lengths [2, 1]."""
  return LoDTensor.from_lengths(np.array([1, 2, 3], np.int32), [[2, 1]])


def nested() -> LoDTensor:
  """Two levels, float rows [4, 2]: [[2, 1], [1, 2, 1]]."""
  return LoDTensor.from_lengths(np.ones((4, 2), np.float32), [[2, 1], [1, 2, 1]])


def scalars() -> LoDTensor:
  """One level, float rows [3], lengths [2, 1]."""
  return LoDTensor.from_lengths(np.ones(3, np.float32), [[2, 1]])


def table() -> ops.RankTable:
  return ops.rank_table(lod())


def memory() -> ops.Memory:
  """A Memory of 2 rows over 2 slots of 2 features."""
  return ops.lod_memory(lod())


def step_log_probs(carry, tokens, static):
  """A decoding step over 5 tokens."""
  del static
  return carry, jax.nn.log_softmax(jnp.zeros((tokens.shape[0], 5)))


def rnn_step(carry, x_t, static):
  del static
  return carry, x_t


def simple_gates(h, xp, hp):
  """A simple cell's gate math, `jaxlod.ops.Separable`'s ``gates``."""
  del h
  new_h = jnp.tanh(xp[0] + hp[0])
  return new_h, new_h


def own_hidden(carry):
  return carry


def separable() -> ops.Separable:
  """A simple cell of 2 features and hidden size 2, as `lod` feeds it."""
  w = np.ones((2, 2), np.float32)
  return ops.Separable(
    w_in=w, b_in=None, w_rec=w, gates=simple_gates, hidden=own_hidden, parts=1
  )


SETTINGS = ops.DecodeSettings(bos_id=0, eos_id=4, max_length=3, beam_size=2)
# The models' settings: `eos_id` in their target vocabulary of 9.
MODEL_SETTINGS = ops.DecodeSettings(bos_id=0, eos_id=1, max_length=3, beam_size=2)


def mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((1,), ("data",))


def stacked(x: Any) -> Any:
  """One shard: every leaf with a leading axis of 1."""
  return jax.tree.map(lambda a: a[None], x)


def batcher(**kwargs: Any) -> data.Batcher:
  examples = [(np.ones(n, np.float32),) for n in (3, 1, 2)]
  buckets = Buckets.fixed(tokens=8, sequences=4, time=4)
  return data.Batcher(examples, buckets, shuffle=False, prefetch=0, **kwargs)


def linen_model() -> linen.Seq2Seq:
  return linen.Seq2Seq(
    src_vocab=8,
    tgt_vocab=9,
    embed_dim=3,
    encoder=linen.DynamicRNN(nn.GRUCell(2)),
    decoder=linen.AttentionDecoder(nn.GRUCell(2), linen.DotAttention()),
  )


@functools.cache
def linen_params() -> Any:
  return linen_model().init(jax.random.key(0), ids(), ids())


def nnx_model() -> nnx_layers.Seq2Seq:
  rngs = nnx.Rngs(0)
  decoder = nnx_layers.AttentionDecoder(
    nnx.GRUCell(3, 2, rngs=rngs), nnx_layers.DotAttention()
  )
  encoder = nnx_layers.DynamicRNN(nnx.GRUCell(3, 2, rngs=rngs))
  return nnx_layers.Seq2Seq(8, 9, 3, encoder, decoder, features=2, rngs=rngs)


# -- the catalogue of wrong inputs, per kind of argument -----------------------------

STR = ("str", lambda: "a")
NONE = ("None", lambda: None)
OBJECT = ("object", object)
FLOAT = ("float", lambda: 1.5)
NEGATIVE = ("negative", lambda: -1)
ZERO = ("zero", lambda: 0)
INT = ("int", lambda: 5)
NAN = ("nan", lambda: float("nan"))
BOOLS = ("bool_array", lambda: np.array([True, False]))
STRINGS = ("strings", lambda: ["a", "b"])
FLOATS = ("floats", lambda: np.array([1.5, 2.5]))
INTS_RANK3 = ("rank3", lambda: np.zeros((2, 2, 2), np.int32))
ARRAY = ("array", lambda: np.zeros((3, 2), np.float32))
VECTOR = ("vector", lambda: np.zeros(2, np.int32))
A_LOD = ("LoDTensor", lod)
SHORT = ("short_rows", lambda: np.zeros((7, 2), np.float32))
UNKNOWN = ("unknown", lambda: "nope")
EMPTY = ("empty", list)
BEYOND_FLOAT32 = ("beyond_float32", lambda: 1e300)
COMPLEX = ("complex", lambda: 1j)
BOOL = ("bool", lambda: True)
RAGGED = ("ragged", lambda: [[1.0, 2.0], [3.0]])
# NumPy reads a bool among numbers as 0 or 1.
MIXED_BOOLS = ("mixed_bools", lambda: [True, 2])

# Flax's own layers and cells, over arrays.
LINEN_DENSE = ("dense", lambda: nn.Dense(2))
NNX_LINEAR = ("linear", lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
LINEN_CELL = ("cell", lambda: nn.GRUCell(2))

# Beyond int32: JAX stores host int64 as int32 with x64 off, and 2**32 + 5
# would silently become 5; a static int this large cannot be a device shape.
WIDE = 2**32 + 5
BEYOND_INT32 = ("beyond_int32", lambda: 2**31)
BELOW_INT32 = ("below_int32", lambda: -(2**31) - 1)


@dataclasses.dataclass(frozen=True)
class FromValid:
  """A wrong value made from the argument's valid one (same structure and
  shapes, so that only the values are wrong); the error must also match
  `match`."""

  make: Callable[[Any], Any]
  match: str


def _widened(valid: Any) -> Any:
  """`valid` as int64 with its first item `WIDE` (a LoDTensor: its values)."""

  def widen(leaf: Any) -> np.ndarray:
    array = np.array(leaf.values if isinstance(leaf, LoDTensor) else leaf, np.int64)
    array.reshape(-1)[:1] = WIDE
    return array

  return jax.tree.map(widen, valid, is_leaf=lambda a: isinstance(a, LoDTensor))


WIDENED = ("beyond_int32", FromValid(_widened, str(WIDE)))


def _shards(valid: Any) -> Any:
  """`valid` (LoDTensors, or a list of them) as 2 shards stacked on a new
  leading axis: a field of a `Batcher(shards=2)` batch."""
  return jax.tree.map(lambda a: np.stack([np.asarray(a)] * 2), valid)


# A stacked batch where one LoDTensor (or RankTable) belongs: the error names
# the argument and says it holds shards.
STACKED = ("stacked", FromValid(_shards, "shards stacked on leading axes"))

Bad = tuple[str, Callable[[], Any] | FromValid]

BAD: dict[str, list[Bad]] = {
  # A LoDTensor.
  "lod": [STR, NONE, OBJECT, ARRAY, STRINGS, STACKED],
  # A list of LoDTensors.
  "lods": [
    STR,
    NONE,
    OBJECT,
    INT,
    EMPTY,
    ("arrays", lambda: [np.zeros(3)]),
    STACKED,
  ],
  # A numeric array.
  "array": [STR, NONE, OBJECT, STRINGS, A_LOD, RAGGED, MIXED_BOOLS, WIDENED],
  # An array or a LoDTensor.
  "array_or_lod": [STR, NONE, OBJECT, STRINGS, WIDENED],
  # A 2-D array, e.g. scores [b, source_capacity] or a query [b, hidden].
  "matrix": [STR, NONE, OBJECT, STRINGS, A_LOD, VECTOR, WIDENED],
  # Integers of any shape.
  "int_values": [STR, NONE, OBJECT, STRINGS, FLOATS, A_LOD, MIXED_BOOLS, WIDENED],
  # A 1-D integer array (lengths, ids, offsets, limits).
  "ints": [
    STR,
    NONE,
    OBJECT,
    STRINGS,
    FLOATS,
    A_LOD,
    INTS_RANK3,
    MIXED_BOOLS,
    WIDENED,
  ],
  # The same, read on the host only (segment ids, sample lengths): int64 stays.
  "host_ints": [STR, NONE, OBJECT, STRINGS, FLOATS, A_LOD, INTS_RANK3],
  # A static int of any sign.
  "int": [STR, NONE, OBJECT, FLOAT, VECTOR],
  # A static float of any sign, finite in float32 (the dtype it scales).
  "float": [STR, NONE, OBJECT, VECTOR, BOOL, NAN, BEYOND_FLOAT32],
  "mapping": [STR, NONE, OBJECT, INT],
  "floats": [STR, NONE, OBJECT, STRINGS],
  # `plan_capacities`' geometric ratios: each as `Buckets.geometric`'s.
  "ratios": [STR, NONE, OBJECT, STRINGS, ("beyond_int32", lambda: (1e300,))],
  # A static int >= 0 or >= 1.
  "int>=0": [STR, NONE, OBJECT, FLOAT, NEGATIVE, VECTOR],
  "int>=1": [STR, NONE, OBJECT, FLOAT, NEGATIVE, ZERO, VECTOR],
  # Static ints that become device shapes, indices or int32 constants: they
  # must fit int32 too.
  "index": [STR, NONE, OBJECT, FLOAT, VECTOR, BEYOND_INT32, BELOW_INT32],
  "size>=0": [STR, NONE, OBJECT, FLOAT, NEGATIVE, VECTOR, BEYOND_INT32],
  "size>=1": [STR, NONE, OBJECT, FLOAT, NEGATIVE, ZERO, VECTOR, BEYOND_INT32],
  # One int for every LoD level, or one per level.
  "per_level": [STR, NONE, OBJECT, FLOAT, NEGATIVE, BEYOND_INT32],
  # A capacity (or a parameter that is one): int32, as offsets and lengths.
  "capacity>=0": [STR, NONE, OBJECT, FLOAT, NEGATIVE, VECTOR, BEYOND_INT32],
  "capacity>=1": [STR, NONE, OBJECT, FLOAT, NEGATIVE, ZERO, VECTOR, BEYOND_INT32],
  # A LoD level index (the valid ones of one level: -1 and 0).
  "level": [STR, NONE, OBJECT, FLOAT, ("out_of_range", lambda: 7)],
  # Static floats with a domain.
  "float>=0": [STR, NONE, OBJECT, VECTOR, NEGATIVE, NAN],
  # Static floats computed in float32 (or wider): finite there; `eps` also
  # nonzero there (1e-50 becomes 0).
  "float32>=0": [STR, NONE, OBJECT, VECTOR, NEGATIVE, NAN, BEYOND_FLOAT32],
  "float32>0": [
    STR,
    NONE,
    OBJECT,
    VECTOR,
    NEGATIVE,
    NAN,
    ZERO,
    BEYOND_FLOAT32,
    ("below_float32", lambda: 1e-50),
  ],
  "rate": [STR, NONE, OBJECT, VECTOR, NEGATIVE, ("above_one", lambda: 1.5), NAN],
  # A JAX key: typed (jax.random.key) or raw (uint32 [2]).
  "key": [STR, NONE, OBJECT, INT, VECTOR, ("uint32_3", lambda: np.ones(3, np.uint32))],
  "ratio>1": [STR, NONE, OBJECT, VECTOR, ("one", lambda: 1.0), NAN],
  # `Buckets.geometric`'s: beyond int32, every capacity but the first is.
  "geometric_ratio": [
    STR,
    NONE,
    OBJECT,
    VECTOR,
    ("one", lambda: 1.0),
    NAN,
    BEYOND_FLOAT32,
  ],
  "bool": [STR, NONE, OBJECT, BOOLS],
  # One of a few names (a pool type, a policy, a kind of size).
  "choice": [UNKNOWN, NONE, INT],
  "dtype": [("unknown", lambda: "not_a_dtype"), OBJECT],
  # A layer's dtype of parameters (or, `none_ok`, of computation).
  "float_dtype": [
    ("unknown", lambda: "not_a_dtype"),
    OBJECT,
    NONE,
    ("int32", lambda: jnp.int32),
    ("bool", lambda: np.bool_),
  ],
  "tuple": [STR, NONE, OBJECT, INT, ("list", lambda: [8])],
  # A directory: not empty (it meant the current one), not an existing file.
  "path": [OBJECT, INT, ("empty", lambda: ""), ("file", lambda: __file__)],
  # Functions, and sequences of them (steps, layers).
  "callable": [STR, NONE, OBJECT, INT],
  # `jaxlod.testing.check_independent`'s names of changes.
  "perturbations": [STR, NONE, OBJECT, ("unknown", lambda: ["huge"])],
  # `generate_corpus`'s `max_length_fn`: a function, and what it returns (an
  # int in [1, settings.max_length]) checked as the corpus is read.
  "max_length_fn": [
    STR,
    NONE,
    OBJECT,
    INT,
    ("returns a float", lambda: lambda ids: 2.7),
    ("returns None", lambda: lambda ids: None),
    ("returns a list", lambda: lambda ids: [3]),
    ("returns a bool", lambda: lambda ids: True),
    ("returns 0", lambda: lambda ids: 0),
    ("returns 2**40", lambda: lambda ids: 2**40),
  ],
  "callables": [STR, NONE, OBJECT, INT, EMPTY, ("strings", lambda: ["a"])],
  "module": [STR, NONE, OBJECT, INT],
  # A layer over LoDTensors (`StackedRNN`'s layers, an encoder): never one
  # of Flax's layers over arrays, nor a module of the other twin.
  "rnn_layer": [STR, NONE, OBJECT, INT, LINEN_DENSE, NNX_LINEAR, LINEN_CELL],
  "rnn_layers": [
    STR,
    NONE,
    OBJECT,
    INT,
    EMPTY,
    ("strings", lambda: ["a"]),
    ("dense", lambda: [LINEN_DENSE[1]()]),
    ("linear", lambda: [NNX_LINEAR[1]()]),
  ],
  # An AttentionDecoder's attention: not one of Flax's layers, whose calls
  # differ, nor a module of the other twin.
  "attention": [STR, NONE, OBJECT, INT, LINEN_DENSE, NNX_LINEAR],
  # A Seq2Seq's decoder: an AttentionDecoder of the twin's API.
  "decoder": [
    STR,
    NONE,
    OBJECT,
    INT,
    ("rnn", lambda: linen.DynamicRNN(nn.GRUCell(2))),
    ("nnx_rnn", lambda: nnx_layers.DynamicRNN(nnx.GRUCell(2, 2, rngs=nnx.Rngs(0)))),
  ],
  # A `jaxlod.ops.LoopPlan` or `jaxlod.ops.AttentionPlan` (or None, where
  # allowed).
  "plan": [STR, OBJECT, INT, ("dict", lambda: {"bodies": 1})],
  # A backend's name.
  "backend": [OBJECT, INT],
  # Ladders of batch sizes, and bucket boundaries.
  "ladder": [
    STR,
    OBJECT,
    INT,
    ("floats", lambda: [1.5]),
    ("zero", lambda: [0]),
    ("beyond_int32", lambda: [2**31]),
  ],
  "boundaries": [
    STR,
    NONE,
    OBJECT,
    INT,
    ("floats", lambda: [1.5]),
    ("beyond_int32", lambda: [4, 2**31]),
  ],
  # One sequence of ints per LoD level.
  "levels": [
    STR,
    NONE,
    OBJECT,
    INT,
    ("floats", lambda: [[1.5, 1.5]]),
    ("strings", lambda: [["a", "b"]]),
    ("flat_strings", lambda: ["a", "b"]),
    ("mixed_bools", lambda: [[True, 2]]),
    ("ragged", lambda: [[2, [1]]]),
  ],
  # Sequences of rows (`LoDTensor.from_sequences`).
  "seqs": [
    STR,
    NONE,
    OBJECT,
    INT,
    ("strings", lambda: [["a", "b"]]),
    ("ragged_rows", lambda: [[[[1.0, 2.0], [3.0]]]]),
    ("features", lambda: [np.ones((2, 2)), np.ones((1, 3))]),
  ],
  # A pad value: a scalar or an array that broadcasts to the features.
  # Real values drop a complex pad's imaginary part; a bool pads with 0 or 1.
  "pad_value": [
    STR,
    NONE,
    OBJECT,
    ("wide", lambda: np.zeros((5, 5))),
    A_LOD,
    COMPLEX,
    BOOL,
  ],
  # A pad value for integer rows: the values' dtype must hold it exactly.
  "int_pad_value": [
    STR,
    NONE,
    OBJECT,
    A_LOD,
    ("fraction", lambda: 2.5),
    NAN,
    ("inf", lambda: float("inf")),
    ("beyond_int32", lambda: WIDE),
    ("beyond_int32_array", lambda: np.int64(2**40)),
    COMPLEX,
    BOOL,
    ("numpy_bool", lambda: np.bool_(True)),
  ],
  "buckets": [STR, OBJECT, INT],
  # `capacity=` of the sequence ops: an int >= 0, a Buckets or None.
  "capacity": [STR, OBJECT, FLOAT, NEGATIVE, BEYOND_INT32],
  "table": [STR, NONE, OBJECT, A_LOD, STACKED],
  "separable": [STR, NONE, OBJECT, INT],
  "iterable": [NONE, OBJECT, INT],
  "settings": [STR, NONE, OBJECT, ("dict", lambda: {"bos_id": 0})],
  # A `jaxlod.ops.Memory`.
  "memory": [STR, NONE, OBJECT, A_LOD, ARRAY],
  # A Memory, a one-level LoDTensor or a padded array [b, source, features].
  "memory_like": [STR, NONE, OBJECT, STRINGS, VECTOR],
  # Precomputed attention keys: an array or a LoDTensor.
  "keys": [STR, OBJECT, STRINGS, VECTOR],
  # Pytrees: of arrays [count_capacity, ...] (carries, per-sequence inputs);
  # of arrays (`beam_search`'s carry, whose first leaf sets the count; the
  # layers' `initial_carry`, whose leading dimensions `dynamic_rnn` checks as
  # its `init_carry`); of any arrays; of stacked shards (a sharded batch).
  "rows": [STR, OBJECT, SHORT, WIDENED],
  "carry": [STR, OBJECT, WIDENED],
  "tree": [STR, OBJECT, WIDENED],
  "stacked": [STR, OBJECT, ("scalar", lambda: np.float32(1.0))],
  "examples": [
    STR,
    NONE,
    OBJECT,
    INT,
    ("strings", lambda: [("a",), ("b",)]),
    ("ragged", lambda: [([[1.0, 2.0], [3.0]],)]),
  ],
  "members": [STR, NONE, OBJECT, INT, EMPTY],
  "mesh": [STR, NONE, OBJECT],
  "axis": [UNKNOWN, NONE, INT],
}


# -- the table ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arg:
  """A valid value (a thunk) and the catalogue of wrong ones."""

  valid: Callable[[], Any]
  bad: tuple[Bad, ...]


def arg(valid: Any, kind: str, *, none_ok: bool = False) -> Arg:
  """An argument of `kind`; `valid` is a value or a thunk making one (types,
  such as dtypes, are values). `none_ok`: `None` is valid too."""
  thunk = valid if callable(valid) and not isinstance(valid, type) else lambda: valid
  bad = [b for b in BAD[kind] if not (none_ok and b is NONE)]
  if valid is None:  # nothing to make a wrong value from
    bad = [b for b in bad if not isinstance(b[1], FromValid)]
  return Arg(thunk, tuple(bad))


def keep(valid: Any) -> Arg:
  """An argument the table passes valid only (see `Target.unchecked`)."""
  return Arg(lambda: valid() if callable(valid) else valid, ())


@dataclasses.dataclass(frozen=True)
class Target:
  """A public callable, its arguments and how to call it.

  Attributes:
    name: the public name, e.g. ``ops.sequence_pool``, ``LoDTensor.lengths``
      or ``nn.DynamicRNN`` (a layer: constructor and call).
    signatures: the functions whose parameters are the arguments (a
      layer's constructor and call).
    args: per argument, its valid value and its wrong ones. A call's
      argument named as a constructor's is keyed ``"name (call)"``.
    call: ``call(**arguments)``.
    unchecked: arguments with no wrong values, each with the reason.
  """

  name: str
  signatures: tuple[Callable, ...]
  args: dict[str, Arg]
  call: Callable[..., Any]
  unchecked: dict[str, str]

  def valid(self) -> dict[str, Any]:
    """Every argument's valid value, made afresh."""
    return {name: a.valid() for name, a in self.args.items()}

  def parameters(self) -> list[str]:
    """The arguments of `signatures`, keyed as `args` keys them."""
    names = []
    for fn in self.signatures:
      for p in inspect.signature(fn).parameters.values():
        if p.name in ("self", "cls", "parent", "name") or p.kind in (
          p.VAR_POSITIONAL,
          p.VAR_KEYWORD,
        ):
          continue
        names.append(f"{p.name} (call)" if p.name in names else p.name)
    return names


def add_target(
  targets: list[Target],
  name: str,
  fn: Callable | None,
  args: dict[str, Arg],
  *,
  call: Callable[..., Any] | None = None,
  signatures: tuple[Callable, ...] | None = None,
  unchecked: dict[str, str] | None = None,
) -> None:
  """Adds ``Target(name, ...)``; `fn` gives the signature and, by default,
  the call."""
  signatures = signatures or (fn,)
  targets.append(Target(name, signatures, args, call or fn, dict(unchecked or {})))


def method(factory: Callable[[], Any], name: str) -> Callable[..., Any]:
  """Calls ``factory().name(**kwargs)``."""
  return lambda **kwargs: getattr(factory(), name)(**kwargs)
