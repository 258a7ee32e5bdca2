"""Where training and evaluation read parallel text: `open_split(config, split)`, and what
a run trains on, its directions' training splits and extra corpora (`open_training`).

Sources (`config.dataset`):
  * a TFDS name such as 'wmt14_translate/de-en', 'wmt14_translate/fr-en' or
    'wmt17_translate/de-en', prepared beforehand in array_record format (this code never
    downloads; see `DatasetNotFoundError`);
  * 'bible_en_es', the offline KJV / Reina-Valera corpus, built on first use
    (`transformer_jax.data.bible_corpus`);
  * 'text', plain files: `config.text_files[split] = 'train.src,train.tgt'`, one sentence a
    line, line i of one file translating line i of the other.
`config.source_lang` and `config.target_lang` pick the direction, or `config.directions` several
(`languages`), read one after the other. TensorFlow is never imported:
TFDS data is read through its array_record data sources. Empty or whitespace-only pairs are
skipped and counted everywhere (`nonblank_pairs`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import hashlib
import importlib
import os
from typing import Any

from absl import logging
import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from transformer_jax.data import bible_corpus
from transformer_jax.data import corpora
from transformer_jax.data import languages
from transformer_jax.errors import ConfigError
from transformer_jax.errors import DataError
from transformer_jax.errors import DatasetNotFoundError
from transformer_jax.runtime import multihost
from transformer_jax.storage import storage

# TFDS registers the WMT builders only when their modules are imported (tfds does not import
# them without TensorFlow); registering lets `tfds.data_source` and `mock_data` find them.
_TFDS_BUILDER_MODULES = {
    'wmt14_translate': 'tensorflow_datasets.translate.wmt14',
    'wmt17_translate': 'tensorflow_datasets.translate.wmt17',
}


class ParallelText(Sequence):
  """Random-access (source, target) string pairs of one split.

  Attributes:
    name: '<dataset>[<split>] <source>-><target>', for logs and file names.
    fingerprint: changes when the data does (the token store compares it).
  """

  def __init__(
      self,
      records: Sequence[Any],
      source_key: Any,
      target_key: Any,
      name: str,
      fingerprint: str,
      source_prefix: str = '',
  ):
    self._records = records
    self._source_key = source_key
    self._target_key = target_key
    self._prefix = source_prefix
    self.name = name
    self.fingerprint = fingerprint

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> tuple[str, str]:
    # Sequence iteration stops at IndexError; array-record sources raise ValueError instead.
    if not -len(self) <= index < len(self):
      raise IndexError(f'{self.name}: index {index} out of range ({len(self)} pairs)')
    return self._pair(self._records[index % len(self)])

  def _pair(self, record: Any) -> tuple[str, str]:
    return self._prefix + _text(record[self._source_key]), _text(record[self._target_key])

  def range(self, start: int, end: int) -> list[tuple[str, str]]:
    """Pairs [start, end), read in one batched call where the source has one."""
    return self.at(range(start, min(end, len(self))))

  def at(self, indices: Iterable[int]) -> list[tuple[str, str]]:
    """The pairs at `indices` (in [0, len)), read in one batched call where the source has
    one: an array_record source reads and parses a batch for much less CPU than one record at
    a time."""
    indices = [int(i) for i in indices]
    try:
      records = self._records.__getitems__(indices)
    except (AttributeError, TypeError):  # No batched read (or a mocked one that differs).
      records = [self._records[i] for i in indices]
    return [self._pair(r) for r in records]


class ConcatenatedText(Sequence):
  """Several `ParallelText`s one after the other (a multilingual run's split: each
  direction's pairs, tagged), with their interface."""

  def __init__(self, parts: Sequence[ParallelText]):
    self.parts = tuple(parts)
    self._starts = np.cumsum([0] + [len(p) for p in self.parts])
    self.name = ' + '.join(p.name for p in self.parts)
    self.fingerprint = hashlib.sha256(
        '|'.join(p.fingerprint for p in self.parts).encode()
    ).hexdigest()[:16]

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, index: int) -> tuple[str, str]:
    if not -len(self) <= index < len(self):
      raise IndexError(f'{self.name}: index {index} out of range ({len(self)} pairs)')
    index %= len(self)
    part = int(np.searchsorted(self._starts, index, side='right')) - 1
    return self.parts[part][index - int(self._starts[part])]

  def range(self, start: int, end: int) -> list[tuple[str, str]]:
    return self.at(range(start, min(end, len(self))))

  def at(self, indices: Iterable[int]) -> list[tuple[str, str]]:
    """The pairs at `indices`, read part by part in batched calls, in the order asked."""
    indices = np.asarray([int(i) for i in indices], np.int64)
    parts = np.searchsorted(self._starts, indices, side='right') - 1
    pairs: list[Any] = [None] * len(indices)
    for part in np.unique(parts):
      where = np.flatnonzero(parts == part)
      local = indices[where] - self._starts[part]
      for i, pair in zip(where, self.parts[part].at(local)):
        pairs[i] = pair
    return pairs


def _records_fingerprint(name: str, records: Sequence[Any], data_dir: str | None) -> str:
  """Identifies TFDS records: their count, the files of the prepared dataset (names, sizes,
  modification times) and the contents of a sample of records at both ends."""
  digest = hashlib.sha256(f'{name}|{len(records)}'.encode())
  for file_name, size, mtime in storage.file_stats(data_dir) if data_dir else []:
    digest.update(f'|{file_name}:{size}:{mtime}'.encode())
  for i in [*range(min(16, len(records))), *range(max(16, len(records) - 16), len(records))]:
    digest.update(repr(sorted(records[i].items())).encode())
  return digest.hexdigest()[:16]


def _text(value: Any) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _default_data_dir(config: ml_collections.ConfigDict) -> str:
  return (
      config.tfds_data_dir
      or os.environ.get('TFDS_DATA_DIR')
      or os.path.expanduser('~/tensorflow_datasets')
  )


def check_prepared(config: ml_collections.ConfigDict) -> None:
  """Raises DatasetNotFoundError (saying how to prepare it) unless `config.dataset`'s
  training split is there to read: a TFDS dataset is never downloaded here. The text files
  and the Bible corpus, which are read or built where they are, pass. The extra corpora
  are read (DataError: one that is missing or is not text)."""
  extra = corpora.extra_corpora(config)
  datasets = {d.dataset for d in languages.directions(config)} | {c.dataset for c in extra}
  for dataset in sorted(datasets - {''}):
    if dataset not in ('text', 'bible_en_es'):
      _tfds_records(config, config.train_split, dataset)
  for corpus in extra:
    if corpus.kind != 'dataset':
      open_corpus(config, corpus)  # Read whole: empty, binary or non-UTF-8 text is refused now.


def _tfds_records(
    config: ml_collections.ConfigDict, split: str, name: str | None = None
) -> tuple[Sequence[Any], str | None]:
  """The split's records of TFDS dataset `name` (default `config.dataset`) and the prepared
  dataset's directory (None if unknown)."""
  name = name or config.dataset
  family = name.split('/')[0].split(':')[0]
  if family in _TFDS_BUILDER_MODULES:
    importlib.import_module(_TFDS_BUILDER_MODULES[family])
  try:
    records = tfds.data_source(
        name, split=split, data_dir=config.tfds_data_dir or None, download=False
    )
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


def _text_file_records(
    config: ml_collections.ConfigDict, split: str
) -> tuple[list[dict[str, str]], str]:
  """The split's pairs and a fingerprint of the two files' contents."""
  spec = config.text_files.get(split) if config.text_files else None
  if not spec or spec.count(',') != 1:
    raise DatasetNotFoundError(
        f"dataset='text' needs --config.text_files.{split}='SOURCE_FILE,TARGET_FILE' "
        f'(got {spec!r}).'
    )
  paths = [p.strip() for p in spec.split(',')]
  sides = []
  digest = hashlib.sha256()
  for path in paths:
    if not storage.exists(path):
      raise DatasetNotFoundError(
          f'Text file {path} (split {split!r}) does not exist; fix --config.text_files.{split}.'
      )
    sides.append(_read_text_lines(path, split, digest))
  if len(sides[0]) != len(sides[1]):
    raise DataError(
        f'{paths[0]} has {len(sides[0])} lines but {paths[1]} has '
        f'{len(sides[1])}; parallel files need one sentence per line each, line i '
        f'of one translating line i of the other (--config.text_files.{split}).'
    )
  return [{'source': s, 'target': t} for s, t in zip(*sides)], digest.hexdigest()[:16]


def _read_text_lines(path: str, split: str, digest: Any = None) -> list[str]:
  return read_text_lines(path, f'split {split!r}', f'fix --config.text_files.{split}', digest)


def read_text_lines(path: str, what: str, fix: str, digest: Any = None) -> list[str]:
  """The lines of a UTF-8 text file, split on '\\n' only (`digest` is updated with its
  bytes); `what` (e.g. "split 'train'") and `fix` (what to do) go into the errors.

  Raises:
    DataError: the file is empty, binary (has NUL bytes) or not UTF-8.
  """
  with storage.open_file(path) as f:
    data = f.read()
  if digest is not None:
    digest.update(data)
  if not data.strip():
    raise DataError(f'Text file {path} ({what}) is empty; {fix}.')
  if b'\0' in data:
    raise DataError(
        f'Text file {path} ({what}) holds NUL bytes, so it is binary, not '
        f'text; {fix} to name plain text files, one sentence a line.'
    )
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data[: e.start].count(b'\n') + 1
    raise DataError(
        f'Text file {path} ({what}) is not UTF-8 (line {line}: {e.reason}); '
        f'convert it, e.g. `iconv -f LATIN1 -t UTF-8`, or {fix}.'
    ) from None
  lines = text.split('\n')
  if lines[-1] == '':  # A final newline leaves one empty string behind.
    lines.pop()
  return [line.removesuffix('\r') for line in lines]


def open_split(
    config: ml_collections.ConfigDict,
    split: str,
    direction: languages.Direction | None = None,
    *,
    tagged: bool = True,
) -> ParallelText | ConcatenatedText:
  """The (source, target) pairs of `split`, in `config`'s direction, or in `direction`.

  A run of several directions (`config.directions`) reads, without `direction`, every
  direction's pairs one after the other; with `config.language_tag` (and `tagged`), each
  source starts with its target language's tag (`languages`).

  Raises:
    DatasetNotFoundError: the dataset is not prepared (the message says how to prepare it).
    ConfigError: the dataset has no such language field.
  """
  if direction is None:
    found = languages.directions(config)
    if len(found) > 1:
      return ConcatenatedText([open_split(config, split, d, tagged=tagged) for d in found])
    direction = found[0]
  dataset, source, target = direction.dataset, direction.source, direction.target
  prefix = languages.source_prefix(config, target) if tagged else ''
  name = f'{dataset}[{split}] {prefix}{source}->{target}'
  if dataset == 'text':
    records, fingerprint = _text_file_records(config, split)
    keys = ('source', 'target')  # The config's own direction, whatever its names.
    if (source, target) != (config.source_lang, config.target_lang):
      sides = {config.source_lang: 'source', config.target_lang: 'target'}
      for lang in (source, target):
        if lang not in sides:
          raise ConfigError(
              f"dataset='text' has the languages {config.source_lang!r} (the first file of "
              f'each text_files pair) and {config.target_lang!r} (the second), not {lang!r}; '
              'fix --config.directions or --config.source_lang/target_lang.'
          )
      keys = (sides[source], sides[target])
    return ParallelText(records, *keys, name, _tagged(fingerprint, prefix), prefix)
  if dataset == 'bible_en_es':
    # Built once; on Cloud Storage by process 0, whose upload the others then find.
    builder = multihost.on_process_0_first(
        lambda: bible_corpus.prepare(config.tfds_data_dir or None),
        'Bible corpus',
        storage.is_remote(config.tfds_data_dir),
    )
    records, data_dir = builder.as_data_source(split), builder.data_dir
  else:
    records, data_dir = _tfds_records(config, split, dataset)
  if len(records):
    fields = set(records[0])
    for lang in (source, target):
      if lang not in fields:
        raise ConfigError(
            f'{dataset} has no language {lang!r} (fields: {sorted(fields)}); fix '
            f'--config.{"directions" if config.get("directions") else "source_lang/target_lang"}.'
        )
  fingerprint = _records_fingerprint(name, records, data_dir)
  return ParallelText(records, source, target, name, fingerprint, prefix)


def open_training(config: ml_collections.ConfigDict) -> ParallelText | ConcatenatedText:
  """What the run trains on: each of `corpora.sources(config)` (the directions' training
  splits, then the extra corpora), one after the other; a single source as itself.

  Raises:
    DatasetNotFoundError, ConfigError: as `open_split`.
    DataError: an extra corpus that is missing, not a finished corpus, or unreadable text.
  """
  parts = [
      open_split(config, config.train_split, s.direction)
      if s.direction is not None
      else open_corpus(config, s.corpus)
      for s in corpora.sources(config)
  ]
  if len(parts) == 1 and len(languages.directions(config)) == 1:
    return parts[0]
  return ConcatenatedText(parts)


def open_corpus(config: ml_collections.ConfigDict, corpus: corpora.Corpus) -> ParallelText:
  """The (source, target) pairs of an extra corpus, each source with
  `corpora.source_prefix` (the language tag, '<BT>'); a dataset's is its training split."""
  if corpus.kind == 'dataset':
    direction = languages.Direction(corpus.dataset, corpus.source, corpus.target)
    return open_split(config, config.train_split, direction)
  digest = hashlib.sha256()
  fix = 'fix or drop this entry of --config.extra_corpora'
  what = f'extra_corpora entry {corpus.entry!r}'
  sides = []
  for path in (corpus.source_file, corpus.target_file):
    if not storage.exists(path):
      raise DataError(f'Text file {path} ({what}) does not exist; {fix}.')
    sides.append(read_text_lines(path, what, fix, digest))
  if len(sides[0]) != len(sides[1]):
    raise DataError(
        f'{corpus.source_file} has {len(sides[0])} lines but {corpus.target_file} has '
        f'{len(sides[1])} ({what}); parallel files need one sentence per line each.'
    )
  prefix = corpora.source_prefix(config, corpus, corpus.target)
  name = f'{corpus.name}[{corpus.kind}] {prefix}{corpus.source}->{corpus.target}'
  records = [{'source': s, 'target': t} for s, t in zip(*sides)]
  return ParallelText(
      records, 'source', 'target', name, _tagged(digest.hexdigest()[:16], prefix), prefix
  )


def _tagged(fingerprint: str, prefix: str) -> str:
  """A text's fingerprint, changed by a source prefix (the token ids differ)."""
  if not prefix:
    return fingerprint
  return hashlib.sha256(f'{fingerprint}|{prefix}'.encode()).hexdigest()[:16]


def nonblank_pairs(pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
  """The pairs with text on both sides (the rest are counted in the log)."""
  kept = [(s, t) for s, t in (pairs[i] for i in range(len(pairs))) if s.strip() and t.strip()]
  if len(kept) < len(pairs):
    logging.info(
        '%s: skipped %d pairs with an empty side.',
        getattr(pairs, 'name', ''),
        len(pairs) - len(kept),
    )
  return kept


def spread_subset(pairs: Sequence[tuple[str, str]], size: int) -> list[tuple[str, str]]:
  """`size` pairs spread evenly over `pairs` (every one if it has no more), in order, so
  that a validation subset samples every document of a split, not just the first."""
  if size >= len(pairs):
    return [pairs[i] for i in range(len(pairs))]
  return [pairs[i * len(pairs) // size] for i in range(size)]
