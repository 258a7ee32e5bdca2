"""The device prefetcher: same batches, exact resume, errors surfaced, wait measured."""

import json
import threading
import time

import grain
import numpy as np
import pytest

from transformer_jax.data.prefetch import DevicePrefetcher


def _source():
  return (
      grain.MapDataset.range(1000)
      .map(lambda i: {'x': np.full((2, 3), i, np.int32)})
      .to_iter_dataset()
  )


@pytest.mark.parametrize('size', [0, 1, 3])
def test_same_batches_as_the_iterator_and_state_counts_only_taken_ones(size):
  puts = []

  def put(batch):
    puts.append(threading.current_thread().name)
    return {k: v + 0 for k, v in batch.items()}

  batches = DevicePrefetcher(iter(_source()), put, size)
  taken = [next(batches) for _ in range(5)]
  assert [int(host['x'][0, 0]) for host, _ in taken] == [0, 1, 2, 3, 4]
  assert all((host['x'] == device['x']).all() for host, device in taken)
  time.sleep(0.2)  # Let the thread run ahead.
  state = json.loads(json.dumps(batches.get_state()))  # What a checkpoint stores.
  assert len(puts) >= 5 + size if size else len(puts) == 5
  if size:
    assert 'device-prefetch' in puts
  resumed = DevicePrefetcher(iter(_source()), put, size)
  resumed.set_state(state)
  assert int(next(resumed)[0]['x'][0, 0]) == 5
  assert int(next(batches)[0]['x'][0, 0]) == 5
  batches.close()  # Drops what was built ahead; the next batch is still the next one.
  assert int(next(batches)[0]['x'][0, 0]) == 6
  batches.close()
  resumed.close()


def test_an_error_in_the_thread_is_raised_in_the_loop():
  def put(batch):
    if int(batch['x'][0, 0]) == 2:
      raise ValueError('bad batch 2')
    return batch

  batches = DevicePrefetcher(iter(_source()), put, 2)
  next(batches), next(batches)
  with pytest.raises(ValueError, match='bad batch 2'):
    next(batches)


def test_waiting_is_measured():
  def slow(batch):
    time.sleep(0.05)
    return batch

  batches = DevicePrefetcher(iter(_source()), slow, 1)
  for _ in range(4):
    next(batches)
  assert batches.take_wait_seconds() > 0.1  # The loop outruns a slow producer.
  assert batches.take_wait_seconds() == 0.0
  batches.close()
