"""``python -m jaxlod``: a tour of a LoD batch, its rank table and its
shrinking schedule, with the library alone.

notebooks/01_lod_tour.ipynb takes its text and its report from here
(`PARAGRAPHS`, `tokenize`, `schedule_report`). The programs live in the
repository's ``examples/``: ``python -m examples.g2p`` is the main example
and ``python -m examples.w1`` times a few LSTM training steps against
padded `flax.linen.RNN`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

import numpy as np

from jaxlod import Buckets, LoDTensor, enable_compilation_cache
from jaxlod.ops import default_ladder, rank_table

# The built-in text: short paragraphs of variable-length sentences.
PARAGRAPHS = (
  (
    "The river rose overnight.",
    "By morning the lower fields were under a sheet of brown water that "
    "reached the fence posts and kept climbing.",
    "Nobody spoke.",
  ),
  (
    "Sequences come in every length.",
    "A speech clip may last two seconds or two minutes, a sentence may hold "
    "three words or forty, and a gene may span a few hundred bases or many "
    "thousands.",
    "Padding them all to the longest one wastes most of the work.",
    "Sorting them by length lets the batch shrink as short ones end.",
  ),
  (
    "She counted the steps twice.",
    "Seven.",
    "Then she opened the door, looked at the empty hallway for a long "
    "moment, and closed it again without a sound.",
  ),
)


def tokenize(paragraphs):
  """Sentences as int32 word-id arrays, grouped by paragraph, and the vocab."""
  vocab: dict[str, int] = {}
  grouped = []
  for paragraph in paragraphs:
    sentences = []
    for sentence in paragraph:
      words = re.findall(r"[a-z']+", sentence.lower())
      ids = [vocab.setdefault(w, len(vocab)) for w in words]
      sentences.append(np.asarray(ids, np.int32))
    grouped.append(sentences)
  return grouped, vocab


def schedule_report(x: LoDTensor) -> dict[str, int]:
  """Token-steps of the real work, the sorted schedule and two padded loops."""
  table = rank_table(x)
  fine = rank_table(
    x, ladder=default_ladder(table.count_capacity, minimum=1, multiple=1)
  )
  lengths = np.asarray(table.lengths)
  count, longest = int(table.count), int(table.max_length)
  return {
    "real token-steps (sum of lengths)": int(lengths.sum()),
    "sorted, shrinking batches (sum of batch_sizes)": int(
      np.asarray(table.batch_sizes).sum()
    ),
    f"phased loop, default ladder {table.ladder}": int(table.schedule_steps()),
    f"phased loop, fine ladder {fine.ladder}": int(fine.schedule_steps()),
    f"padding {count} sequences to the longest ({longest})": count * longest,
    f"padding to the capacities ({table.count_capacity} x {table.time_capacity})": (
      table.count_capacity * table.time_capacity
    ),
  }


def tour() -> None:
  """Prints the tour: the built-in text as one- and two-level LoD batches,
  the rank table, the per-step batch sizes and phases, and `schedule_report`."""
  grouped, vocab = tokenize(PARAGRAPHS)
  sentences = [s for paragraph in grouped for s in paragraph]
  print(f"{len(sentences)} sentences, {len(vocab)} distinct words\n")

  x = LoDTensor.from_sequences(sentences, buckets=Buckets.pow2(minimum=8))
  print("One-level batch (sentence -> words):", x)
  print("recursive lengths:", x.recursive_lengths())
  table = rank_table(x)
  print("\nRank table (original index, length), longest first:")
  print("  ", table.items())
  sizes = np.asarray(table.batch_sizes)[: int(table.max_length)]
  print("per-step batch sizes:", sizes.tolist())
  print("phases (ladder size: steps):", end=" ")
  starts, ends = np.asarray(table.phase_starts), np.asarray(table.phase_ends)
  print(
    ", ".join(
      f"{b}: [{s}, {e})" for b, s, e in zip(table.ladder, starts, ends, strict=True)
    )
  )
  print("\nToken-steps for one pass over the batch:")
  for name, steps in schedule_report(x).items():
    print(f"  {steps:6d}  {name}")

  nested = LoDTensor.from_sequences(grouped)
  print("\nTwo-level batch (paragraph -> sentences -> words):")
  print("recursive lengths:", nested.recursive_lengths())
  print("paragraphs ranked by sentence count:", rank_table(nested, 0).items())
  print("sentences ranked by word count:", rank_table(nested, 1).items())


def main(argv: Sequence[str] | None = None) -> None:
  """The program: `tour`, after its command line (``--help`` only)."""
  parser = argparse.ArgumentParser(
    prog="python -m jaxlod",
    description="A tour of jaxlod with the library alone, a few seconds on 2 "
    "CPU cores: a LoD batch, its rank table and its shrinking schedule. The "
    "programs live in the repository's examples/, run from its root: the main "
    "example is python -m examples.g2p (--help), and python -m examples.w1 "
    "times a few LSTM training steps against padded flax.linen.RNN.",
  )
  parser.parse_args(argv)
  enable_compilation_cache()
  tour()


if __name__ == "__main__":
  main()
