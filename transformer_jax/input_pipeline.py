"""Input pipeline: parallel text in, token-budget batches out.

Sources (`config.dataset`):
  * a TFDS name such as 'wmt14_translate/de-en', 'wmt14_translate/fr-en' or
    'wmt17_translate/de-en', prepared beforehand in array_record format (this code never
    downloads; see `DatasetNotFoundError`);
  * 'bible_en_es', the offline KJV / Reina-Valera corpus, built on first use
    (`transformer_jax.bible_corpus`);
  * 'text', plain files: `config.text_files[split] = 'train.src,train.tgt'`, one sentence a
    line, line i of one file translating line i of the other.
`config.source_lang` and `config.target_lang` pick the direction. TensorFlow is never imported:
TFDS data is read through its array_record data sources.

Batches are dicts of int32 arrays, all [rows, length]: `inputs` and `targets` (ids ending with
EOS, no BOS, PAD after), `inputs_positions`/`targets_positions` (0-based, restarting at each
packed segment, 0 on padding) and `inputs_segmentation`/`targets_segmentation` (1, 2, ... per
example in a row, 0 on padding). Rows are a multiple of `row_multiple` (this host's data-parallel
shards); `tokens_per_batch` counts source (and, separately, target) token slots over all hosts.

Each split is tokenized once (`tokenized`, `token_store`): its token ids are kept in binary
arrays with an index beside the vocabulary, reused while the data and the vocabulary are the
ones they were made from, and rebuilt, with a warning, when either changes. Batches are cut
from those ids with numpy, a whole batch at a time.

Training, bucketed (default): examples longer than `max_source_length`/`max_target_length` are
dropped (and counted); each remaining example goes to the shortest length bucket that holds both
sides, so the step compiles one shape per bucket. An epoch is a fixed list of global batches:
each bucket's examples in a seeded order, cut into batches of `tokens_per_batch // length` rows,
the batch list shuffled. Every host computes the same list and reads only its own rows of each
batch, so all hosts see the same shape at each step. Batch i of the run is a pure function of
(seed, i): the iterator's state is one integer, and a restored run sees exactly the batches an
unstopped one would.

Training, packed (`config.packing`): each host takes every process_count-th example, shuffles
them per epoch and packs them first-fit into rows of max(max_source_length, max_target_length)
tokens (`PackedBatches`, whose state, (epoch, position), is checkpointable as well).

Evaluation never drops or truncates: longer sentences get longer buckets, and a partial last
batch is filled with all-padding rows (segmentation 0, so they weigh nothing).

Empty or whitespace-only pairs are skipped and counted everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
import dataclasses
import functools
import hashlib
import importlib
import json
import math
import os
import posixpath
import re
from typing import Any

from absl import logging
import grain
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from transformer_jax import bible_corpus
from transformer_jax import checkpointing
from transformer_jax import outputs
from transformer_jax import token_store
from transformer_jax.errors import ConfigError
from transformer_jax.errors import DataError
from transformer_jax.errors import DatasetNotFoundError
from transformer_jax.tokenizer import load_or_train_tokenizer
from transformer_jax.tokenizer import Tokenizer

Batch = dict[str, np.ndarray]

# TFDS registers the WMT builders only when their modules are imported (tfds does not import
# them without TensorFlow); registering lets `tfds.data_source` and `mock_data` find them.
_TFDS_BUILDER_MODULES = {
    'wmt14_translate': 'tensorflow_datasets.translate.wmt14',
    'wmt17_translate': 'tensorflow_datasets.translate.wmt17',
}


# ----------------------------------------------------------------------------- sources


class ParallelText(Sequence):
  """Random-access (source, target) string pairs of one split.

  Attributes:
    name: '<dataset>[<split>] <source>-><target>', for logs and file names.
    fingerprint: changes when the data does (the token store compares it).
  """

  def __init__(self, records: Sequence[Any], source_key: Any, target_key: Any, name: str,
               fingerprint: str):
    self._records = records
    self._source_key = source_key
    self._target_key = target_key
    self.name = name
    self.fingerprint = fingerprint

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> tuple[str, str]:
    # Sequence iteration stops at IndexError; array-record sources raise ValueError instead.
    if not -len(self) <= index < len(self):
      raise IndexError(f'{self.name}: index {index} out of range ({len(self)} pairs)')
    record = self._records[index % len(self)]
    return _text(record[self._source_key]), _text(record[self._target_key])

  def range(self, start: int, end: int) -> list[tuple[str, str]]:
    """Pairs [start, end), read in one batched call where the source has one."""
    indices = list(range(start, min(end, len(self))))
    try:
      records = self._records.__getitems__(indices)
    except (AttributeError, TypeError):  # No batched read (or a mocked one that differs).
      records = [self._records[i] for i in indices]
    return [(_text(r[self._source_key]), _text(r[self._target_key])) for r in records]


def _records_fingerprint(name: str, records: Sequence[Any], data_dir: str | None) -> str:
  """Identifies TFDS records: their count, the files of the prepared dataset (names, sizes,
  modification times) and the contents of a sample of records at both ends."""
  digest = hashlib.sha256(f'{name}|{len(records)}'.encode())
  for file_name, size, mtime in outputs.file_stats(data_dir) if data_dir else []:
    digest.update(f'|{file_name}:{size}:{mtime}'.encode())
  for i in [*range(min(16, len(records))), *range(max(16, len(records) - 16), len(records))]:
    digest.update(repr(sorted(records[i].items())).encode())
  return digest.hexdigest()[:16]


def _text(value: Any) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _default_data_dir(config: ml_collections.ConfigDict) -> str:
  return (config.tfds_data_dir or os.environ.get('TFDS_DATA_DIR')
          or os.path.expanduser('~/tensorflow_datasets'))


def check_prepared(config: ml_collections.ConfigDict) -> None:
  """Raises DatasetNotFoundError (saying how to prepare it) unless `config.dataset`'s
  training split is there to read: a TFDS dataset is never downloaded here. The text files
  and the Bible corpus, which are read or built where they are, pass."""
  if config.dataset not in ('text', 'bible_en_es'):
    _tfds_records(config, config.train_split)


def _tfds_records(config: ml_collections.ConfigDict,
                  split: str) -> tuple[Sequence[Any], str | None]:
  """The split's records and the prepared dataset's directory (None if unknown)."""
  name = config.dataset
  family = name.split('/')[0].split(':')[0]
  if family in _TFDS_BUILDER_MODULES:
    importlib.import_module(_TFDS_BUILDER_MODULES[family])
  try:
    records = tfds.data_source(name, split=split, data_dir=config.tfds_data_dir or None,
                               download=False)
  except Exception as e:  # TFDS raises several types for "not there"; all mean the same here.
    data_dir = _default_data_dir(config)
    raise DatasetNotFoundError(
        f'TFDS dataset {name!r} (split {split!r}) is not prepared in array_record format '
        f'under {data_dir}, and this code does not download. On a machine with internet: '
        f'`pip install tensorflow tensorflow-datasets && tfds build {name} '
        f'--file_format=array_record --data_dir=DIR`, copy DIR here and pass '
        f'--config.tfds_data_dir=DIR (or set $TFDS_DATA_DIR). A copy prepared as tfrecord '
        f'converts with `tfds convert_format --dataset_dir=DIR/{name}/VERSION '
        f'--out_file_format=array_record`. Or train offline on '
        f'--config=configs/bible_en_es.py. ({type(e).__name__}: {e})'.replace('\n', ' ')[:4000]
    ) from e
  try:
    data_dir = tfds.builder(name, data_dir=config.tfds_data_dir or None).data_dir
  except Exception:  # Only the fingerprint uses it; the records' contents still count.
    data_dir = None
  return records, data_dir


def _text_file_records(config: ml_collections.ConfigDict,
                       split: str) -> tuple[list[dict[str, str]], str]:
  """The split's pairs and a fingerprint of the two files' contents."""
  spec = config.text_files.get(split) if config.text_files else None
  if not spec or spec.count(',') != 1:
    raise DatasetNotFoundError(
        f"dataset='text' needs --config.text_files.{split}='SOURCE_FILE,TARGET_FILE' "
        f'(got {spec!r}).')
  paths = [p.strip() for p in spec.split(',')]
  sides = []
  digest = hashlib.sha256()
  for path in paths:
    if not outputs.exists(path):
      raise DatasetNotFoundError(f'Text file {path} (split {split!r}) does not exist; fix '
                                 f'--config.text_files.{split}.')
    sides.append(_read_text_lines(path, split, digest))
  if len(sides[0]) != len(sides[1]):
    raise DataError(f'{paths[0]} has {len(sides[0])} lines but {paths[1]} has '
                    f'{len(sides[1])}; parallel files need one sentence per line each, line i '
                    f'of one translating line i of the other (--config.text_files.{split}).')
  return [{'source': s, 'target': t} for s, t in zip(*sides)], digest.hexdigest()[:16]


def _read_text_lines(path: str, split: str, digest: Any = None) -> list[str]:
  """The lines of a UTF-8 text file of `split`, split on '\\n' only (`digest` is updated
  with its bytes).

  Raises:
    DataError: the file is empty, binary (has NUL bytes) or not UTF-8.
  """
  with outputs.open_file(path) as f:
    data = f.read()
  if digest is not None:
    digest.update(data)
  fix = f'fix --config.text_files.{split}'
  if not data.strip():
    raise DataError(f'Text file {path} (split {split!r}) is empty; {fix}.')
  if b'\0' in data:
    raise DataError(f'Text file {path} (split {split!r}) holds NUL bytes, so it is binary, not '
                    f'text; {fix} to name plain text files, one sentence a line.')
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b'\n') + 1
    raise DataError(f'Text file {path} (split {split!r}) is not UTF-8 (line {line}: {e.reason}); '
                    f'convert it, e.g. `iconv -f LATIN1 -t UTF-8`, or {fix}.') from None
  lines = text.split('\n')
  if lines[-1] == '':  # A final newline leaves one empty string behind.
    lines.pop()
  return [line.removesuffix('\r') for line in lines]


def open_split(config: ml_collections.ConfigDict, split: str) -> ParallelText:
  """The (source, target) pairs of `split` of `config.dataset`, in `config`'s direction.

  Raises:
    DatasetNotFoundError: the dataset is not prepared (the message says how to prepare it).
    ValueError: the dataset has no `source_lang`/`target_lang` field.
  """
  name = f'{config.dataset}[{split}] {config.source_lang}->{config.target_lang}'
  if config.dataset == 'text':
    records, fingerprint = _text_file_records(config, split)
    return ParallelText(records, 'source', 'target', name, fingerprint)
  if config.dataset == 'bible_en_es':
    # Built once; on Cloud Storage by process 0, whose upload the others then find.
    builder = _on_process_0_first(lambda: bible_corpus.prepare(config.tfds_data_dir or None),
                                  'Bible corpus', outputs.is_remote(config.tfds_data_dir))
    records, data_dir = builder.as_data_source(split), builder.data_dir
  else:
    records, data_dir = _tfds_records(config, split)
  if len(records):
    fields = set(records[0])
    for lang in (config.source_lang, config.target_lang):
      if lang not in fields:
        raise ConfigError(f'{config.dataset} has no language {lang!r} (fields: '
                          f'{sorted(fields)}); fix --config.source_lang/target_lang.')
  return ParallelText(records, config.source_lang, config.target_lang, name,
                      _records_fingerprint(name, records, data_dir))


# ----------------------------------------------------------------------------- tokens


def local_directory(workdir: str) -> str:
  """Where the vocabulary and token stores of `workdir` are read from: the work directory
  itself, or for a gs:// one its local cache (`outputs.local_cache`; SentencePiece reads
  files, token stores are memory-mapped). `publish` copies what is made there to the
  bucket, and `fetch` brings it to other hosts and resumed runs."""
  return outputs.local_cache(workdir) if outputs.is_remote(workdir) else workdir


def _remote_of(path: str, workdir: str) -> str | None:
  """The gs:// twin of a local `path` under `local_directory(workdir)`, or None."""
  local = local_directory(workdir)
  if local == workdir or not os.path.abspath(path).startswith(local + os.sep):
    return None
  return f'{outputs.resolve(workdir)}/{os.path.relpath(path, local)}'


_PUBLISHED = 'PUBLISHED.json'  # Written last: what the files beside it are (their meta).


def publish(local: str, remote: str, meta: dict[str, Any]) -> None:
  """Uploads the file or directory `local` to `remote`, then the marker that says it is
  complete, with `meta` in it (a reader trusts nothing without it)."""
  outputs.upload(local, remote, '--workdir')
  outputs.write_file(f'{remote}.{_PUBLISHED}', json.dumps(meta, sort_keys=True))


def published(remote: str) -> dict[str, Any] | None:
  """The meta of what `publish` finished at `remote`, or None."""
  marker = f'{remote}.{_PUBLISHED}'
  if not outputs.exists(marker):
    return None
  with outputs.open_file(marker) as f:
    return json.loads(f.read())


def fetch(remote: str, local: str) -> None:
  """Downloads a published file or directory (replacing `local`, through a temporary)."""
  outputs.download(remote, local, '--workdir')


def tokenizer_for(config: ml_collections.ConfigDict, workdir: str,
                  train_pairs: Sequence[tuple[str, str]]) -> Tokenizer:
  """Loads the shared vocabulary, training it on a sample of `train_pairs` the first time.

  The model goes to `config.vocab_path`, or to `workdir/vocab/` under a name made of the
  dataset, the language pair (in either direction), the model type and the size. For a
  gs:// work directory it is made in `local_directory` and published to the bucket, and
  a run that finds it published there downloads it instead of training it again.
  """
  if outputs.is_remote(config.vocab_path):
    return _tokenizer_on_cloud_storage(config, train_pairs)
  path = config.vocab_path
  if not path:
    langs = '-'.join(sorted((config.source_lang, config.target_lang)))
    dataset = re.sub(r'[^A-Za-z0-9_.-]+', '_', config.dataset)
    path = os.path.join(local_directory(workdir), 'vocab',
                        f'{dataset}.{langs}.{config.vocab_model_type}'
                        f'{config.vocab_size_target}.model')
  remote = _remote_of(path, workdir)
  if remote and published(remote) is not None and not os.path.exists(path):
    fetch(remote, path)
  tokenizer = _load_or_train(config, path, train_pairs)
  if remote and published(remote) is None:
    publish(path, remote, {'sha256': tokenizer.fingerprint})
  return tokenizer


def _tokenizer_on_cloud_storage(config: ml_collections.ConfigDict,
                                train_pairs: Sequence[tuple[str, str]]) -> Tokenizer:
  """`tokenizer_for` with a gs:// `config.vocab_path`: read from a fresh local copy, or
  trained locally and uploaded (one object, so it appears whole) when it is not there."""
  remote = outputs.resolve(config.vocab_path)
  local = os.path.join(outputs.local_cache(remote), posixpath.basename(remote))
  there = outputs.exists(remote)
  if there:
    outputs.download(remote, local, '--config.vocab_path')
  tokenizer = _load_or_train(config, local, train_pairs)
  if not there:
    outputs.upload(local, remote, '--config.vocab_path')
  return tokenizer


def _load_or_train(config: ml_collections.ConfigDict, path: str,
                   train_pairs: Sequence[tuple[str, str]]) -> Tokenizer:
  """`tokenizer_for`'s vocabulary at `path`, trained there if it is not."""

  def sentences():
    num_pairs = min(len(train_pairs), max(1, config.vocab_train_sentences // 2))
    rng = np.random.default_rng(config.data_seed)
    chosen = np.sort(rng.choice(len(train_pairs), size=num_pairs, replace=False))
    for i in chosen:
      yield from train_pairs[int(i)]

  return load_or_train_tokenizer(path, sentences, vocab_size=config.vocab_size_target,
                                 model_type=config.vocab_model_type)


def store_directory(config: ml_collections.ConfigDict, workdir: str, tokenizer: Tokenizer,
                    pairs: ParallelText) -> str:
  """Where the token ids of `pairs` live: beside the vocabulary, in '<vocabulary>.tokens/'
  (in the work directory's 'tokens/' when the vocabulary's directory is read-only or is
  another run's work directory, such as an imported model's, which is only read)."""
  name = re.sub(r'[^A-Za-z0-9_.-]+', '_', pairs.name.replace('->', '-to-')).strip('_')
  beside = os.path.dirname(os.path.abspath(tokenizer.model_path))
  others_run = (os.path.isdir(os.path.join(beside, checkpointing.CHECKPOINT_DIR))
                and beside != os.path.abspath(local_directory(workdir)))
  if os.access(beside, os.W_OK) and not others_run:
    root = os.path.splitext(os.path.abspath(tokenizer.model_path))[0] + '.tokens'
  else:
    root = os.path.join(local_directory(workdir), 'tokens', os.path.basename(
        os.path.splitext(tokenizer.model_path)[0]))
  return os.path.join(root, name)


def tokenized(pairs: ParallelText, tokenizer: Tokenizer, config: ml_collections.ConfigDict,
              workdir: str, workers: int | None = None) -> token_store.TokenStore:
  """The token ids of `pairs`, prepared on first use (`prepare_data.py` does it ahead, on
  several processes and hosts) and rebuilt, with a warning, when the data or vocabulary
  changed. For a gs:// work directory they are prepared locally and published to the
  bucket, and downloaded from there when published for the same data and vocabulary."""
  directory = store_directory(config, workdir, tokenizer, pairs)
  remote = _remote_of(directory, workdir)
  if remote:
    meta = published(remote)
    if meta is not None and meta != token_store.read_meta(directory):
      fetch(remote, directory)  # open_or_prepare still checks that it fits this data.
  store = token_store.open_or_prepare(pairs, tokenizer, directory,
                                      data_fingerprint=pairs.fingerprint,
                                      workers=workers or prepare_workers(config))
  if remote and published(remote) != store.meta:
    publish(directory, remote, store.meta)
  return store


def prepare_workers(config: ml_collections.ConfigDict) -> int:
  return config.prepare_workers or os.cpu_count() or 1


# ----------------------------------------------------------------------------- buckets


def bucket_lengths(boundaries: Sequence[int], max_length: int) -> tuple[int, ...]:
  """The row lengths of the training buckets: the boundaries below `max_length`, then it."""
  return tuple(sorted({int(b) for b in boundaries if 0 < b < max_length} | {max_length}))


def bucket_length(length: int, buckets: Sequence[int]) -> int:
  """The shortest bucket that holds `length`; past the last one, a multiple of it."""
  for bucket in buckets:
    if length <= bucket:
      return bucket
  return math.ceil(length / buckets[-1]) * buckets[-1]


def rows_for(length: int, tokens_per_batch: int, row_multiple: int) -> int:
  """Rows of a `length`-token batch within the budget: a multiple of `row_multiple`, >= 1."""
  return max(1, tokens_per_batch // length // row_multiple) * row_multiple


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (lru_cache).
class BucketPlan:
  """The global batches of one epoch: which examples, in which bucket, in which order.

  Attributes:
    lengths: the row length of each bucket.
    rows: the global rows of each bucket's batches (a multiple of all hosts' shards).
    members: the example indices of each bucket, ascending.
    seed: orders the examples inside buckets, per epoch.
  """
  lengths: tuple[int, ...]
  rows: tuple[int, ...]
  members: tuple[np.ndarray, ...]
  seed: int

  @property
  def batch_table(self) -> np.ndarray:
    """[num_batches, 2]: (bucket, chunk within the bucket) of each batch of an epoch."""
    return np.array([(k, c) for k, (m, r) in enumerate(zip(self.members, self.rows))
                     for c in range(math.ceil(len(m) / r))], np.int64).reshape(-1, 2)

  @functools.lru_cache(maxsize=2)  # noqa: B019  # Two epochs of one long-lived plan.
  def epoch_order(self, epoch: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng([self.seed, epoch])
    return tuple(rng.permutation(m) for m in self.members)

  def examples(self, epoch: int, bucket: int, chunk: int) -> np.ndarray:
    """The example indices of one global batch (the last of a bucket may be short)."""
    rows = self.rows[bucket]
    return self.epoch_order(epoch)[bucket][chunk * rows:(chunk + 1) * rows]


def plan_buckets(lengths: np.ndarray, keep: np.ndarray, buckets: Sequence[int],
                 tokens_per_batch: int, row_multiple: int, seed: int) -> BucketPlan:
  """Assigns each kept example to the shortest bucket that holds both its sides."""
  longest = lengths.max(axis=1)
  index = np.searchsorted(np.asarray(buckets), longest)
  members = tuple(np.flatnonzero(keep & (index == k)) for k in range(len(buckets)))
  rows = tuple(rows_for(b, tokens_per_batch, row_multiple) for b in buckets)
  return BucketPlan(tuple(buckets), rows, members, seed)


class _BucketedBatches:
  """Step -> this host's rows of global batch `step` (a pure function; see module doc)."""

  def __init__(self, store: token_store.TokenStore, plan: BucketPlan, process_index: int,
               process_count: int):
    self._store = store
    self._plan = plan
    self._table = plan.batch_table
    self._process_index = process_index
    self._process_count = process_count

  def __call__(self, step: int, batch_id: int) -> Batch:
    epoch = step // len(self._table)
    bucket, chunk = self._table[batch_id]
    host_rows = self._plan.rows[bucket] // self._process_count
    examples = self._plan.examples(epoch, bucket, chunk)
    mine = examples[self._process_index * host_rows:(self._process_index + 1) * host_rows]
    return self._store.batch(mine, host_rows, self._plan.lengths[bucket])


# ----------------------------------------------------------------------------- packing


class PackedBatches(grain.IterDataset):
  """Examples packed first-fit into [rows, length] batches, both sides at once.

  Each epoch shuffles `members` (seeded by (seed, epoch)) and walks them in order: an example
  goes to the first row with room for both its sides; the first one that fits no row closes
  the batch and opens the next. The iterator's state is (epoch, position), so a restored run
  sees exactly the batches an unstopped one would. Batches are cut from the token store with
  numpy; only the first-fit choice is a loop, one numpy call per example.
  """

  def __init__(self, store: token_store.TokenStore, members: np.ndarray, rows: int,
               length: int, seed: int):
    super().__init__()
    self.store = store
    self.members = np.asarray(members, np.int64)
    self.rows = rows
    self.length = length
    self.seed = seed

  @functools.lru_cache(maxsize=2)  # noqa: B019  # Two epochs of one long-lived plan.
  def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(example indices, their [n, 2] lengths) in epoch `epoch`'s order."""
    order = np.random.default_rng([self.seed, epoch]).permutation(self.members)
    return order, self.store.lengths[order]

  def __iter__(self) -> '_PackedIterator':
    return _PackedIterator(self)

  def __str__(self) -> str:
    return f'PackedBatches(rows={self.rows}, length={self.length})'


class _PackedIterator(grain.DatasetIterator):

  def __init__(self, packed: PackedBatches):
    super().__init__()
    self._packed = packed
    self._epoch = 0
    self._position = 0

  def __next__(self) -> Batch:
    packed = self._packed
    order, lengths = packed.epoch_order(self._epoch)
    room = np.full((packed.rows, 2), packed.length, np.int64)
    rows = np.empty(len(order), np.int64)
    position = self._position
    while position < len(order):
      need = lengths[position]
      fits = (room >= need).all(axis=1)
      row = int(fits.argmax())
      if not fits[row]:
        break
      room[row] -= need
      rows[position] = row
      position += 1
    chosen = slice(self._position, position)
    batch = packed.store.packed_batch(order[chosen], rows[chosen], packed.rows, packed.length)
    if position >= len(order):
      self._epoch, self._position = self._epoch + 1, 0
    else:
      self._position = position
    return batch

  def get_state(self) -> dict[str, int]:
    return {'epoch': self._epoch, 'position': self._position}

  def set_state(self, state: dict[str, int]) -> None:
    self._epoch, self._position = int(state['epoch']), int(state['position'])


# ----------------------------------------------------------------------------- datasets


@dataclasses.dataclass
class TrainData:
  """A training dataset and what building it found.

  Attributes:
    dataset: infinite `grain.IterDataset` of batches; `iter()` it for a fresh iterator whose
      `get_state()`/`set_state()` resume it exactly.
    steps_per_epoch: batches in one pass over this host's data.
    num_examples: training examples kept.
    dropped_too_long: examples longer than the configured maxima.
    skipped_empty: pairs with an empty or blank side.
  """
  dataset: grain.IterDataset
  steps_per_epoch: int
  num_examples: int
  dropped_too_long: int
  skipped_empty: int


def train_dataset(store: token_store.TokenStore, config: ml_collections.ConfigDict, *,
                  process_index: int = 0, process_count: int = 1,
                  row_multiple: int = 1) -> TrainData:
  """The training batches of this host (see the module doc for bucketing and packing).

  Args:
    store: the training split's token ids (`tokenized`).
    config: reads max_source_length, max_target_length, tokens_per_batch, bucket_boundaries,
      packing, data_seed and data_threads.
    process_index: this host.
    process_count: all hosts; each gets tokens_per_batch / process_count of the budget.
    row_multiple: rows of every batch are a multiple of this (this host's data shards).
  """
  lengths = store.lengths
  nonempty = (lengths > 0).all(axis=1)
  fits = ((lengths[:, 0] <= config.max_source_length)
          & (lengths[:, 1] <= config.max_target_length))
  keep = nonempty & fits
  skipped_empty = int((~nonempty).sum())
  dropped = int((nonempty & ~fits).sum())
  logging.info('%s: %d training pairs; skipped %d with an empty side; dropped %d longer '
               'than %d source / %d target tokens.', store.directory, int(keep.sum()),
               skipped_empty, dropped, config.max_source_length, config.max_target_length)
  if not keep.any():
    raise DataError('No training example is left after filtering; check the data and '
                    '--config.max_source_length/max_target_length.')
  max_length = max(config.max_source_length, config.max_target_length)
  shards = row_multiple * process_count
  if config.tokens_per_batch < max_length * shards:
    logging.warning(
        'tokens_per_batch=%d holds fewer than %d rows of the longest bucket (%d tokens), '
        'but every batch has at least one row for each of its %d shards (data shards x '
        'hosts x grad_accum_steps): batches of the longest sentences will hold %d token '
        'slots, %.1fx the budget. Raise --config.tokens_per_batch to %d or more.',
        config.tokens_per_batch, shards, max_length, shards, max_length * shards,
        max_length * shards / config.tokens_per_batch, max_length * shards)
  if config.packing:
    rows = rows_for(max_length, config.tokens_per_batch, shards) // process_count
    mine = np.flatnonzero(keep)[process_index::process_count]
    dataset = PackedBatches(store, mine, rows, max_length, config.data_seed)
    average = lengths[keep].max(axis=1).mean()
    steps = max(1, math.ceil(len(mine) * average / (rows * max_length)))
  else:
    buckets = bucket_lengths(config.bucket_boundaries, max_length)
    plan = plan_buckets(lengths, keep, buckets, config.tokens_per_batch, shards,
                        config.data_seed)
    steps = len(plan.batch_table)
    options = grain.ReadOptions(num_threads=config.data_threads, prefetch_buffer_size=8)
    dataset = (grain.MapDataset.range(steps).shuffle(seed=config.data_seed).repeat(None)
               .map_with_index(_BucketedBatches(store, plan, process_index, process_count))
               .to_iter_dataset(options))
  return TrainData(dataset, steps, int(keep.sum()), dropped, skipped_empty)


def eval_batches(store: token_store.TokenStore, config: ml_collections.ConfigDict, *,
                 process_index: int = 0, process_count: int = 1,
                 row_multiple: int = 1) -> Iterator[Batch]:
  """Every non-blank pair of `store` exactly once, whole, in unpacked bucketed batches.

  Batches are global (every host gets the same number, of the same shapes) and each host
  gets its rows; all-padding rows fill the last batch of a bucket.
  """
  lengths = store.lengths
  keep = (lengths > 0).all(axis=1)
  if (~keep).any():
    logging.info('%s: skipped %d pairs with an empty side.', store.directory,
                 int((~keep).sum()))
  max_length = max(config.max_source_length, config.max_target_length)
  buckets = bucket_lengths(config.bucket_boundaries, max_length)
  bucket_of = np.array([bucket_length(int(n), buckets) for n in lengths.max(axis=1)])
  shards = row_multiple * process_count
  for length in sorted(set(bucket_of[keep].tolist())):
    members = np.flatnonzero(keep & (bucket_of == length))
    rows = rows_for(length, config.tokens_per_batch, shards)
    host_rows = rows // process_count
    for start in range(0, len(members), rows):
      mine = members[start:start + rows][process_index * host_rows:
                                         (process_index + 1) * host_rows]
      yield store.batch(mine, host_rows, length)


def nonblank_pairs(pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
  """The pairs with text on both sides (the rest are counted in the log)."""
  kept = [(s, t) for s, t in (pairs[i] for i in range(len(pairs))) if s.strip() and t.strip()]
  if len(kept) < len(pairs):
    logging.info('%s: skipped %d pairs with an empty side.', getattr(pairs, 'name', ''),
                 len(pairs) - len(kept))
  return kept


@dataclasses.dataclass
class Datasets:
  """What `get_datasets` returns.

  Attributes:
    train: this host's infinite training iterator (a `grain.DatasetIterator`). Save it in a
      checkpoint with `grain.checkpoint.CheckpointSave(train)` inside an orbax
      `ocp.args.Composite` (restore: `grain.checkpoint.CheckpointRestore(train)`), or
      store `train.get_state()` (JSON-serializable) and call `train.set_state(state)`.
    steps_per_epoch: training steps in one pass over the data (for logging the epoch).
    eval_batches: returns a fresh finite iterator over this host's validation batches.
    tokenizer: the shared vocabulary.
    train_info: the `TrainData` (counts of kept, dropped and skipped examples).
    eval_text: the validation split's (source, target) texts.
  """
  train: Any
  steps_per_epoch: int
  eval_batches: Callable[[], Iterator[Batch]]
  tokenizer: Tokenizer
  train_info: TrainData
  eval_text: ParallelText


def spread_subset(pairs: Sequence[tuple[str, str]], size: int) -> list[tuple[str, str]]:
  """`size` pairs spread evenly over `pairs` (every one if it has no more), in order, so
  that a validation subset samples every document of a split, not just the first."""
  if size >= len(pairs):
    return [pairs[i] for i in range(len(pairs))]
  return [pairs[i * len(pairs) // size] for i in range(size)]


def _on_process_0_first(make: Callable[[], Any], what: str, wait: bool = True) -> Any:
  """`make()` on process 0 first, then (after a barrier) on the others, which find its
  result on a shared filesystem or the bucket (`wait`; else every process at once)."""
  wait = wait and jax.process_count() > 1
  if wait and jax.process_index() != 0:
    multihost_utils.sync_global_devices(f'{what}: process 0 prepared')
  made = make()
  if wait and jax.process_index() == 0:
    multihost_utils.sync_global_devices(f'{what}: process 0 prepared')
  return made


def _tokenized_on_every_host(config, workdir, tokenizer, splits):
  """The token stores of `splits`. Process 0 prepares them first; the others then find them
  ready on a shared filesystem or the bucket, or prepare their own copies on local disks."""
  return _on_process_0_first(
      lambda: [tokenized(pairs, tokenizer, config, workdir) for pairs in splits],
      'token stores')


def get_datasets(config: ml_collections.ConfigDict, workdir: str, *,
                 process_index: int | None = None, process_count: int | None = None,
                 row_multiple: int = 1) -> Datasets:
  """Everything training reads: batches and the vocabulary (the test split is left alone).

  Args:
    config: the run's config (see `config.base_config`, Data section).
    workdir: holds the vocabulary (`vocab/`) and, beside it, the token ids of the splits.
    process_index: this host; default `jax.process_index()`.
    process_count: all hosts; default `jax.process_count()`.
    row_multiple: every batch's rows are a multiple of this (this host's data shards).

  Raises:
    DatasetNotFoundError: the dataset is not prepared (the message says how).
    bible_corpus.SwordModuleNotFoundError: the Bible modules are not installed.
  """
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if config.tokens_per_batch % process_count:
    logging.warning('tokens_per_batch=%d is not divisible by %d hosts; each gets %d.',
                    config.tokens_per_batch, process_count,
                    config.tokens_per_batch // process_count)
  train_pairs = open_split(config, config.train_split)
  eval_pairs = open_split(config, config.eval_split)
  tokenizer = _on_process_0_first(lambda: tokenizer_for(config, workdir, train_pairs),
                                  'vocabulary', outputs.is_remote(workdir)
                                  or outputs.is_remote(config.vocab_path))
  stores = _tokenized_on_every_host(config, workdir, tokenizer, (train_pairs, eval_pairs))
  info = train_dataset(stores[0], config, process_index=process_index,
                       process_count=process_count, row_multiple=row_multiple)

  def make_eval_batches() -> Iterator[Batch]:
    return eval_batches(stores[1], config, process_index=process_index,
                        process_count=process_count, row_multiple=row_multiple)

  return Datasets(train=iter(info.dataset), steps_per_epoch=info.steps_per_epoch,
                  eval_batches=make_eval_batches,
                  tokenizer=tokenizer, train_info=info, eval_text=eval_pairs)
