"""The path of one public call through the package, counted as it runs.

For one `jaxlod.ops.dynamic_rnn` call (an LSTM step over a LoDTensor) and
one teacher-forced `jaxlod.nn.Seq2Seq` call (BiLSTM-free: an LSTM encoder
and an attention decoder), each run eagerly once after a warm-up call, a
profile hook records every call into a function of the ``jaxlod`` package
and reports:

  * ``modules``: the package's modules the call enters;
  * ``reentries``: how often a call comes back into a module it had left
    (a call from module A into module B counts when B was entered before);
  * ``check_lod_per_tensor``: ``jaxlod._lod.check_lod`` calls by the
    LoDTensor they check (the most on one tensor, and the calls in all).

Run from the repository root: ``python -m benchmarks.call_path [--json
PATH] [--revision NAME]``. It uses only the public API, so the same script
measures any revision of the package: put that checkout first on
``PYTHONPATH`` and name it with ``--revision``; the counts of each revision
are kept side by side in the JSON file.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import machine_info, write_report
from jaxlod import LoDTensor
from jaxlod import nn as lnn
from jaxlod.ops import dynamic_rnn


def _module(frame: Any) -> str | None:
  name = frame.f_globals.get("__name__", "")
  return name if name == "jaxlod" or name.startswith("jaxlod.") else None


def follow(call: Callable[[], Any]) -> dict[str, Any]:
  """Runs `call` under a profile hook and counts its path (see the module's
  docstring): ``{"modules", "module_names", "entries", "reentries",
  "check_lod_calls", "check_lod_max_per_tensor"}``."""
  entered: list[str] = []
  checked: collections.Counter = collections.Counter()

  def hook(frame, event, arg):
    del arg
    if event != "call":
      return
    module = _module(frame)
    if module is None:
      return
    caller = frame.f_back
    if caller is None or _module(caller) != module:
      entered.append(module)
    if module == "jaxlod._lod" and frame.f_code.co_name == "check_lod":
      checked[id(frame.f_locals.get("x"))] += 1

  sys.setprofile(hook)
  try:
    jax.block_until_ready(call())
  finally:
    sys.setprofile(None)
  seen: set[str] = set()
  reentries = 0
  for module in entered:
    reentries += module in seen
    seen.add(module)
  return {
    "modules": len(seen),
    "module_names": sorted(seen),
    "entries": len(entered),
    "reentries": reentries,
    "check_lod_calls": sum(checked.values()),
    "check_lod_max_per_tensor": max(checked.values(), default=0),
  }


def _lengths(seed: int, count: int, longest: int) -> list[int]:
  return np.random.default_rng(seed).integers(1, longest + 1, size=count).tolist()


def dynamic_rnn_call() -> Callable[[], Any]:
  """One `dynamic_rnn` call: an LSTM cell of 32 over 16 sequences of up to
  12 steps, 8 features."""
  cell = nn.LSTMCell(32)
  lengths = _lengths(0, 16, 12)
  x = LoDTensor.from_lengths(
    np.random.default_rng(1).normal(size=(sum(lengths), 8)).astype(np.float32),
    [lengths],
  )
  carry = cell.initialize_carry(jax.random.key(0), (16, 8))
  params = cell.init(jax.random.key(1), carry, jnp.zeros((16, 8)))

  def step(c, x_t, _):
    return cell.apply(params, c, x_t)

  return lambda: dynamic_rnn(step, x, init_carry=carry)


def seq2seq_call() -> Callable[[], Any]:
  """One teacher-forced `Seq2Seq` call: LSTM encoder and attention decoder
  of 32, vocabularies of 20, 8 pairs of up to 10 source and 9 target ids."""
  model = lnn.Seq2Seq(
    20,
    20,
    16,
    lnn.DynamicRNN(nn.LSTMCell(32)),
    lnn.AttentionDecoder(nn.LSTMCell(32), lnn.DotAttention()),
  )
  rng = np.random.default_rng(2)
  src_lengths, tgt_lengths = _lengths(3, 8, 10), _lengths(4, 8, 9)
  src = LoDTensor.from_lengths(
    rng.integers(2, 20, size=sum(src_lengths)).astype(np.int32), [src_lengths]
  )
  tgt = LoDTensor.from_lengths(
    rng.integers(2, 20, size=sum(tgt_lengths)).astype(np.int32), [tgt_lengths]
  )
  variables = model.init(jax.random.key(0), src, tgt)
  return lambda: model.apply(variables, src, tgt)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="also write the report here")
  parser.add_argument(
    "--revision",
    default="this checkout",
    help="the name the counts are kept under; with --json, the file's other "
    "revisions are kept beside it (before and after, from two checkouts)",
  )
  args = parser.parse_args(argv)
  calls = {}
  for name, make in (("dynamic_rnn", dynamic_rnn_call), ("seq2seq", seq2seq_call)):
    call = make()
    jax.block_until_ready(call())  # compiles what the call jits
    calls[name] = follow(call)
  report: dict[str, Any] = {"revisions": {}}
  if args.json and pathlib.Path(args.json).is_file():
    report = json.loads(pathlib.Path(args.json).read_text())
  report["revisions"][args.revision] = {"calls": calls}
  report["machine"] = machine_info()
  write_report(report, args.json)
  return report


if __name__ == "__main__":
  main()
