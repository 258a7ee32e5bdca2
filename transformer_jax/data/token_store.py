"""Token ids of a split, tokenized once and kept in compact binary arrays with an index.

The anchors are fairseq's binarized data and MaxText's pre-tokenized array_record: the text
is encoded once, not at every epoch, and batches are cut from the ids with numpy. A store is
a directory:

  source.npy, target.npy  every example's ids back to back (EOS included): uint16 when the
                          vocabulary has at most 65,536 pieces, else int32; memory-mapped.
  lengths.npy             [examples, 2] int32: the ids of each side, 0 where a side is blank.
  meta.json               what it was made from: the format, the fingerprints of the data and
                          of the vocabulary, the counts. Written last: a directory without it
                          is incomplete and never read.

`open_or_prepare` reuses a store only while the data and the vocabulary are the ones it was
made from, and otherwise rebuilds it and says why. Preparation is split into parts of
`PART_SIZE` examples, encoded by a pool of processes; hosts sharing a filesystem can each
encode their share of the parts (`host_index`, `host_count`), and whoever finds every part
written merges them. A part is written whole or not at all, so an interrupted preparation
resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import shutil
import time
from typing import Any

from absl import logging
import numpy as np

from transformer_jax.config import PAD_ID
from transformer_jax.data.tokenizer import load_tokenizer
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import DataError
from transformer_jax.storage import storage

FORMAT = 1
PART_SIZE = 20_000  # Examples a part: a few seconds of one core.
_ENCODE_CHUNK = 2048

Batch = dict[str, np.ndarray]


@dataclasses.dataclass
class TokenStore:
  """The token ids of one split, read from a prepared directory.

  Attributes:
    directory: where it lives.
    source: all source ids back to back (memory-mapped).
    target: all target ids back to back (memory-mapped).
    lengths: [examples, 2] int32 ids of each side; 0 where a side is blank.
    starts: [examples, 2] int64 offset of each example's ids in `source` / `target`.
    meta: the contents of meta.json.
  """

  directory: str
  source: np.ndarray
  target: np.ndarray
  lengths: np.ndarray
  starts: np.ndarray
  meta: dict[str, Any]

  @classmethod
  def open(cls, directory: str) -> 'TokenStore':
    with open(os.path.join(directory, 'meta.json')) as f:
      meta = json.load(f)
    lengths = np.load(os.path.join(directory, 'lengths.npy'))
    starts = np.zeros_like(lengths, dtype=np.int64)
    np.cumsum(lengths[:-1], axis=0, out=starts[1:])
    source = np.load(os.path.join(directory, 'source.npy'), mmap_mode='r')
    target = np.load(os.path.join(directory, 'target.npy'), mmap_mode='r')
    return cls(directory, source, target, lengths, starts, meta)

  def __len__(self) -> int:
    return len(self.lengths)

  def batch(self, indices: np.ndarray, rows: int, length: int) -> Batch:
    """One unpacked batch: example `indices[r]` in row r, PAD after it, all-PAD rows after
    the examples. Every example must fit `length`. Vectorized: no loop over examples."""
    indices = np.asarray(indices, np.int64)
    lengths = np.zeros((rows, 2), np.int64)
    starts = np.zeros((rows, 2), np.int64)
    lengths[: len(indices)] = self.lengths[indices]
    starts[: len(indices)] = self.starts[indices]
    columns = np.arange(length, dtype=np.int64)
    batch = {}
    for side, name, ids in ((0, 'inputs', self.source), (1, 'targets', self.target)):
      real = columns[None, :] < lengths[:, side, None]  # [rows, length]
      where = starts[:, side, None] + np.where(real, columns[None, :], 0)
      tokens = ids[where.ravel()].reshape(rows, length).astype(np.int32)
      batch[name] = np.where(real, tokens, PAD_ID).astype(np.int32)
      batch[f'{name}_positions'] = np.where(real, columns[None, :], 0).astype(np.int32)
      batch[f'{name}_segmentation'] = real.astype(np.int32)
    return batch

  def packed_batch(self, indices: np.ndarray, row_of: np.ndarray, rows: int, length: int) -> Batch:
    """A packed batch: example `indices[i]` goes to row `row_of[i]`, after the examples
    before it in that row (in the order given). Vectorized: no loop over examples."""
    indices = np.asarray(indices, np.int64)
    row_of = np.asarray(row_of, np.int64)
    segment = np.zeros(len(indices), np.int64)  # 1, 2, ... within each row.
    offset = np.zeros((len(indices), 2), np.int64)  # Where each example starts in its row.
    order = np.argsort(row_of, kind='stable')
    sorted_rows = row_of[order]
    first = np.r_[True, sorted_rows[1:] != sorted_rows[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    segment[order] = np.arange(len(order)) - group_start + 1
    lengths = self.lengths[indices].astype(np.int64)
    sorted_lengths = lengths[order]
    running = np.cumsum(sorted_lengths, axis=0) - sorted_lengths
    offset[order] = running - running[group_start]
    batch = {}
    for side, name, ids in ((0, 'inputs', self.source), (1, 'targets', self.target)):
      n = lengths[:, side]
      total = int(n.sum())
      example = np.repeat(np.arange(len(indices)), n)
      within = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
      if (offset[:, side] + n > length).any():
        raise ValueError(f'a row of the packed batch overflows {length} tokens')
      dest = row_of[example] * length + offset[example, side] + within
      tokens = np.full(rows * length, PAD_ID, np.int32)
      positions = np.zeros(rows * length, np.int32)
      segmentation = np.zeros(rows * length, np.int32)
      tokens[dest] = ids[self.starts[indices, side][example] + within]
      positions[dest] = within
      segmentation[dest] = segment[example]
      batch[name] = tokens.reshape(rows, length)
      batch[f'{name}_positions'] = positions.reshape(rows, length)
      batch[f'{name}_segmentation'] = segmentation.reshape(rows, length)
    return batch


# ----------------------------------------------------------------------------- preparing


def read_meta(directory: str) -> dict[str, Any] | None:
  """The meta of the store in `directory`, or None if there is none (or it is unreadable)."""
  try:
    with open(os.path.join(directory, 'meta.json')) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _fresh(directory: str, expected: dict[str, Any]) -> tuple[bool, str]:
  """Whether the store in `directory` was made from `expected`'s data and vocabulary."""
  try:
    with open(os.path.join(directory, 'meta.json')) as f:
      meta = json.load(f)
  except FileNotFoundError:
    return False, 'it does not exist yet'
  except (OSError, ValueError) as e:
    return False, f'its meta.json is unreadable ({e})'
  for key, what in (
      ('format', 'the store format'),
      ('data', 'the data'),
      ('vocabulary', 'the vocabulary'),
      ('examples', 'the number of examples'),
  ):
    if meta.get(key) != expected[key]:
      return False, (f'{what} changed ({meta.get(key)!r} when it was made, {expected[key]!r} now)')
  return True, ''


def _encode_range(
    pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer, start: int, end: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Ids of pairs [start, end): (source ids, target ids, lengths [n, 2]; 0 for a blank side)."""
  sources, targets, lengths = [], [], np.zeros((end - start, 2), np.int32)
  dtype = id_dtype(tokenizer.vocab_size)
  for chunk in range(start, end, _ENCODE_CHUNK):
    stop = min(chunk + _ENCODE_CHUNK, end)
    read = getattr(pairs, 'range', None)  # Batched reads where the pairs offer them.
    block = read(chunk, stop) if read else [pairs[i] for i in range(chunk, stop)]
    for side, out in ((0, sources), (1, targets)):
      texts = [pair[side] for pair in block]
      encoded = tokenizer.encode_batch(texts, ('source', 'target')[side])
      for j, (text, ids) in enumerate(zip(texts, encoded)):
        if not text.strip():  # A blank side is kept as no ids, and skipped by readers.
          ids = []
        lengths[chunk - start + j, side] = len(ids)
        out.append(np.asarray(ids, dtype))
  joined = [np.concatenate(x) if x else np.zeros(0, dtype) for x in (sources, targets)]
  return joined[0], joined[1], lengths


def id_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)


_WORKER: dict[str, Any] = {}


def _init_worker(pairs, tokenizer: Tokenizer | str) -> None:
  """What `_write_part` reads; a spawned worker gets the tokenizer's path and loads it."""
  _WORKER['pairs'] = pairs
  _WORKER['tokenizer'] = (
      tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
  )


def _write_part(task: tuple[str, int, int]) -> int:
  path, start, end = task
  pairs, tokenizer = _WORKER['pairs'], _WORKER['tokenizer']
  source, target, lengths = _encode_range(pairs, tokenizer, start, end)
  with storage.writing(path, 'wb') as f:
    np.savez(f, source=source, target=target, lengths=lengths)
  return end - start


def _write_parts_in_processes(pairs, tokenizer: Tokenizer, tasks: list, workers: int) -> int:
  context = multiprocessing.get_context('spawn')  # JAX's threads do not survive fork.
  with concurrent.futures.ProcessPoolExecutor(
      workers, mp_context=context, initializer=_init_worker, initargs=(pairs, tokenizer.model_path)
  ) as pool:
    return sum(pool.map(_write_part, tasks))


def _part_path(parts_dir: str, k: int, count: int) -> str:
  return os.path.join(parts_dir, f'part-{k:05d}-of-{count:05d}.npz')


def prepare(
    pairs: Sequence[tuple[str, str]],
    tokenizer: Tokenizer,
    directory: str,
    *,
    data_fingerprint: str,
    workers: int = 1,
    host_index: int = 0,
    host_count: int = 1,
) -> TokenStore | None:
  """Encodes `pairs` into a store at `directory`, unless a fresh one is there (a stale one is
  replaced).

  Args:
    pairs: the split.
    tokenizer: the vocabulary.
    directory: the store's directory.
    data_fingerprint: identifies the data (`ParallelText.fingerprint`).
    workers: processes encoding parts at once (1: this process only).
    host_index: this host, of `host_count` sharing `directory`'s filesystem; host h encodes
      parts h, h + host_count, ...
    host_count: hosts encoding at once.

  Returns:
    The store, or None when other hosts' parts are still missing (rerun once they finish;
    any host that finds every part merges them).
  """
  expected = _expected(pairs, tokenizer, data_fingerprint)
  if _fresh(directory, expected)[0]:
    return TokenStore.open(directory)
  count = max(1, math.ceil(len(pairs) / PART_SIZE))
  parts_dir = f'{directory}.parts-{data_fingerprint[:8]}-{tokenizer.fingerprint[:8]}'
  os.makedirs(parts_dir, exist_ok=True)
  tasks = []
  for k in range(host_index, count, host_count):
    path = _part_path(parts_dir, k, count)
    if not os.path.exists(path):  # Written whole by an earlier, interrupted run.
      tasks.append((path, k * PART_SIZE, min(len(pairs), (k + 1) * PART_SIZE)))
  start = time.perf_counter()
  # A spawned worker takes seconds to start (it imports the package): worth it only when
  # each gets two parts or more.
  workers = max(1, min(workers, len(tasks) // 2))
  if workers == 1:
    _init_worker(pairs, tokenizer)
    done = sum(_write_part(task) for task in tasks)
  else:
    try:
      done = _write_parts_in_processes(pairs, tokenizer, tasks, workers)
    except Exception as e:
      # Spawned workers import the main module (a script without an
      # `if __name__ == '__main__':` guard makes them fail) and unpickle the pairs (which a
      # test's mocked data source does not survive). Parts already written stay; a real
      # problem with the data raises again below, in this process.
      logging.warning(
          'Tokenizing worker processes failed (%s: %s); tokenizing in this '
          'process instead. A script that prepares data on several processes '
          "needs an `if __name__ == '__main__':` guard.",
          type(e).__name__,
          e,
      )
      _init_worker(pairs, tokenizer)
      done = sum(_write_part(task) for task in tasks if not os.path.exists(task[0]))
  seconds = time.perf_counter() - start
  if done:
    logging.info(
        'Tokenized %d pairs of %s in %.1f s (%.0f pairs/s with %d processes).',
        done,
        getattr(pairs, 'name', 'the split'),
        seconds,
        done / seconds,
        workers,
    )
  paths = [_part_path(parts_dir, k, count) for k in range(count)]
  missing = [p for p in paths if not os.path.exists(p)]
  if missing:
    logging.info(
        '%d of %d parts of %s are not written yet (other hosts).', len(missing), count, directory
    )
    return None
  return _merge(paths, directory, expected, parts_dir, tokenizer.vocab_size)


def _expected(pairs, tokenizer: Tokenizer, data_fingerprint: str) -> dict[str, Any]:
  return {
      'format': FORMAT,
      'data': data_fingerprint,
      'vocabulary': tokenizer.fingerprint,
      'examples': len(pairs),
  }


def _merge(
    paths: list[str], directory: str, expected: dict[str, Any], parts_dir: str, vocab_size: int
) -> TokenStore:
  parts = [np.load(p) for p in paths]
  lengths = np.concatenate([p['lengths'] for p in parts])
  still_good = lambda: _fresh(directory, expected)[0]  # Another process merged them.
  with storage.rebuilding_directory(directory, still_good=still_good) as tmp:
    dtype = id_dtype(vocab_size)
    for side, name in ((0, 'source'), (1, 'target')):
      out = np.lib.format.open_memmap(
          os.path.join(tmp, f'{name}.npy'),
          mode='w+',
          dtype=dtype,
          shape=(int(lengths[:, side].sum(dtype=np.int64)),),
      )
      at = 0
      for part in parts:
        ids = part[name]
        out[at : at + len(ids)] = ids
        at += len(ids)
      out.flush()
      del out
    np.save(os.path.join(tmp, 'lengths.npy'), lengths)
    meta = dict(
        expected,
        dtype=dtype.name,
        tokens=[int(x) for x in lengths.sum(axis=0)],
        blank=int((lengths == 0).any(axis=1).sum()),
        created=time.time(),
    )
    with open(os.path.join(tmp, 'meta.json'), 'w') as f:
      json.dump(meta, f, indent=1)
  shutil.rmtree(parts_dir, ignore_errors=True)
  return TokenStore.open(directory)


def open_or_prepare(
    pairs: Sequence[tuple[str, str]],
    tokenizer: Tokenizer,
    directory: str,
    *,
    data_fingerprint: str,
    workers: int = 1,
) -> TokenStore:
  """The store of `pairs` at `directory`, prepared first when it is missing or stale.

  Raises:
    DataError: the directory cannot be written.
  """
  expected = _expected(pairs, tokenizer, data_fingerprint)
  fresh, why = _fresh(directory, expected)
  if fresh:
    return TokenStore.open(directory)
  if why != 'it does not exist yet':
    logging.warning('Rebuilding the token ids at %s: %s.', directory, why)
  else:
    logging.info('Tokenizing %s once into %s.', getattr(pairs, 'name', 'the split'), directory)
  try:
    store = prepare(pairs, tokenizer, directory, data_fingerprint=data_fingerprint, workers=workers)
  except PermissionError as e:
    raise DataError(
        f'Cannot write the token ids to {directory} ({e}); make the directory '
        'beside the vocabulary writable, or set --config.vocab_path to a copy '
        'in a writable directory.'
    ) from e
  assert store is not None  # One host, every part.
  return store
