"""Batches built and copied to the devices while the current step runs.

`DevicePrefetcher` wraps this host's batch iterator: a background thread takes the next
batches from it, puts them on the mesh with the batch sharding and keeps up to `size` of them
in a bounded queue. The training loop takes (host batch, device batch) pairs and asks how long
it waited for them (`take_wait_seconds`).

Its state is the wrapped iterator's state after the last batch the loop *took*, not after
the ones built ahead, so a checkpoint resumes at exactly the next batch. It is a grain
`DatasetIterator`: save it with `grain.checkpoint.CheckpointSave` like the iterator it wraps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import queue
import threading
import time
from typing import Any

import grain

Batch = dict[str, Any]


class DevicePrefetcher(grain.DatasetIterator):
  """Up to `size` batches ahead of the loop, already on the devices.

  Args:
    iterator: a grain iterator of host batches (with `get_state`/`set_state`).
    put: host batch -> device batch (e.g. `Partitioner.shard_batch`).
    size: batches kept ready; 0 builds and copies each batch when it is asked for.
  """

  def __init__(self, iterator: Iterator[Batch], put: Callable[[Batch], Any], size: int):
    super().__init__()
    self._iterator = iterator
    self._put = put
    self._size = size
    self._state = iterator.get_state()
    self._queue: queue.Queue | None = None
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._waited = 0.0

  def _produce(self, out: queue.Queue, stop: threading.Event) -> None:
    try:
      while not stop.is_set():
        batch = next(self._iterator)
        item = (batch, self._put(batch), self._iterator.get_state())
        while not stop.is_set():
          try:
            out.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
    except BaseException as e:  # Raised in the loop's thread.
      out.put(e)

  def _start(self) -> None:
    self._stop = threading.Event()
    self._queue = queue.Queue(maxsize=self._size)
    self._thread = threading.Thread(
        target=self._produce, args=(self._queue, self._stop), name='device-prefetch', daemon=True
    )
    self._thread.start()

  def __next__(self) -> tuple[Batch, Any]:
    start = time.perf_counter()
    if self._size == 0:
      batch = next(self._iterator)
      item = (batch, self._put(batch), self._iterator.get_state())
    else:
      if self._thread is None:
        self._start()
      item = self._queue.get()
      if isinstance(item, BaseException):
        self.close()
        raise item
    self._waited += time.perf_counter() - start
    batch, device_batch, self._state = item
    return batch, device_batch

  def take_wait_seconds(self) -> float:
    """Seconds spent waiting for batches since the last call."""
    waited, self._waited = self._waited, 0.0
    return waited

  def close(self) -> None:
    """Stops the thread and drops the batches built ahead: the next batch is again the one
    after the last taken."""
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
      self._queue = None
      self._iterator.set_state(self._state)

  def get_state(self) -> dict[str, Any]:
    return self._state

  def set_state(self, state: dict[str, Any]) -> None:
    self.close()
    self._iterator.set_state(state)
    self._state = self._iterator.get_state()

  def __str__(self) -> str:
    return f'DevicePrefetcher(size={self._size})'
