"""Runs an iterator on a background thread, a bounded number of items ahead."""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

# How often a worker blocked on a full queue checks whether to stop (seconds).
_POLL_S = 0.05
_END = object()
# Live workers and their stop events; stopped and joined at interpreter exit,
# before a daemon thread could be killed inside a JAX call.
_WORKERS: dict[threading.Thread, threading.Event] = {}


@atexit.register
def _stop_workers() -> None:
  workers = list(_WORKERS.items())
  for _, stop in workers:
    stop.set()
  for thread, _ in workers:
    thread.join()


def prefetch(
  make_items: Callable[[], Iterator[T]], size: int, name: str
) -> Iterator[T]:
  """Yields the items of ``make_items()``, built up to `size` ahead on a thread.

  The thread starts at the first ``next`` and is a daemon. An exception raised
  while building an item is re-raised here, in the consumer, as the same
  object: its traceback still holds the worker's frames. Closing this
  generator (``break`` out of a ``for`` loop over it, ``close()``, or letting
  it be garbage-collected) stops the worker and joins it; a worker waiting on
  a full queue notices within `_POLL_S` seconds, one building an item once the
  item is built. Workers still running at interpreter exit are stopped the
  same way.

  Args:
    make_items: builds the iterator to run; called on the worker thread.
    size: items built ahead (the queue's bound); 0 runs ``make_items()`` in
      the consumer's thread, without a worker.
    name: the worker thread's name.
  """
  if size == 0:
    yield from make_items()
    return
  buffer: queue.Queue = queue.Queue(maxsize=size)
  stop = threading.Event()

  def put(item) -> bool:
    while not stop.is_set():
      try:
        buffer.put(item, timeout=_POLL_S)
        return True
      except queue.Full:
        pass
    return False

  def work() -> None:
    try:
      for item in make_items():
        if not put((item, None)):
          return
      put((_END, None))
    except BaseException as error:  # Handed to the consumer.
      put((None, error))

  thread = threading.Thread(target=work, name=name, daemon=True)
  _WORKERS[thread] = stop
  thread.start()
  try:
    while True:
      item, error = buffer.get()
      if error is not None:
        raise error
      if item is _END:
        return
      yield item
  finally:
    stop.set()
    if thread.is_alive():
      thread.join()
    _WORKERS.pop(thread, None)
