"""Where a run keeps its vocabulary and the token ids of its splits, made once and reused.

The vocabulary goes to `config.vocab_path` or to the work directory's `vocab/`; each split is
tokenized once (`tokenized`, `token_store`) into binary arrays beside it, reused while the data
and the vocabulary are the ones they were made from, and rebuilt, with a warning, when either
changes. For a gs:// work directory both are made in its local cache (`RunLayout.local`) and
published to the bucket (`storage.publish`), where other hosts and resumed runs fetch them.
"""

from __future__ import annotations

from collections.abc import Sequence
import hashlib
import os
import posixpath
import re

import ml_collections
import numpy as np

from transformer_jax.data import corpora
from transformer_jax.data import languages
from transformer_jax.data import token_store
from transformer_jax.data.data_sources import ParallelText
from transformer_jax.data.tokenizer import load_or_train_tokenizer
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import ConfigError
from transformer_jax.storage import storage
from transformer_jax.storage.layout import RunLayout

# Pairs read at a time for the vocabulary's sentences (batched reads, bounded memory).
_READ_CHUNK = 4096


def _remote_of(path: str, layout: RunLayout) -> str | None:
  """The gs:// twin of a local `path` under a gs:// run's local cache (`layout.local`:
  SentencePiece reads files, token stores are memory-mapped; `storage.publish` copies what is
  made there to the bucket, and `storage.fetch` brings it to other hosts and resumed runs),
  or None."""
  local = os.path.abspath(layout.local)
  if not storage.is_remote(layout.root) or not os.path.abspath(path).startswith(local + os.sep):
    return None
  return f'{layout.root}/{os.path.relpath(os.path.abspath(path), local)}'


def tokenizer_for(
    config: ml_collections.ConfigDict, layout: RunLayout, train_pairs: Sequence[tuple[str, str]]
) -> Tokenizer:
  """Loads the shared vocabulary, training it on a sample of `train_pairs` the first time.

  The model is the one a corpus of `config.extra_corpora` was written in (`corpora.vocabulary`),
  or goes to `config.vocab_path`, or to the run's `layout.vocab` under a name made of the
  datasets, the languages (in any direction), whether it has the language tags or '<BT>',
  the extra text corpora, the model type and the size. For a
  gs:// work directory it is made in its local cache and published to the bucket, and
  a run that finds it published there downloads it instead of training it again.
  """
  extra = corpora.extra_corpora(config)
  given = corpora.vocabulary(config, extra)  # A corpus's model's, which the run must read.
  if storage.is_remote(given or config.vocab_path):
    tokenizer = _tokenizer_on_cloud_storage(config, given or config.vocab_path, train_pairs)
    _check_corpora_vocabulary(tokenizer, extra)
    return tokenizer
  path = given or config.vocab_path
  if not path:
    found = languages.directions(config)
    langs = '-'.join(sorted({lang for d in found for lang in (d.source, d.target)}))
    dataset = re.sub(r'[^A-Za-z0-9_.-]+', '_', '+'.join(sorted({d.dataset for d in found})))
    tagged = '.tagged' if languages.tags(config) else ''
    tagged += '.bt' if config.get('back_translation_tag', False) else ''
    if extra:  # Plain text corpora (the others name their vocabulary): a name of their own.
      entries = '|'.join(c.entry for c in extra)
      tagged += '.x' + hashlib.sha256(entries.encode()).hexdigest()[:8]
    path = os.path.join(
        layout.vocab,
        f'{dataset}.{langs}{tagged}.{config.vocab_model_type}{config.vocab_size_target}.model',
    )
  remote = _remote_of(path, layout)
  if remote and storage.published(remote) is not None and not os.path.exists(path):
    storage.fetch(remote, path)
  tokenizer = _load_or_train(config, path, train_pairs)
  if remote and storage.published(remote) is None:
    storage.publish(path, remote, {'sha256': tokenizer.fingerprint})
  _check_corpora_vocabulary(tokenizer, extra)
  return tokenizer


def _check_corpora_vocabulary(tokenizer: Tokenizer, extra: Sequence[corpora.Corpus]) -> None:
  """Raises ConfigError when a corpus of `translate_corpus.py` was written in another
  vocabulary than the one the run read."""
  for corpus in extra:
    if corpus.vocab_sha256 and corpus.vocab_sha256 != tokenizer.fingerprint:
      raise ConfigError(
          f'extra_corpora {corpus.entry!r} was written in the vocabulary {corpus.vocab_path} '
          f'(sha256 {corpus.vocab_sha256}), but this run reads {tokenizer.model_path} (sha256 '
          f"{tokenizer.fingerprint}); leave --config.vocab_path empty to read the corpus's, "
          'or write the corpus again with a model of this vocabulary.'
      )


def _tokenizer_on_cloud_storage(
    config: ml_collections.ConfigDict, vocab_path: str, train_pairs: Sequence[tuple[str, str]]
) -> Tokenizer:
  """`tokenizer_for` with a gs:// `vocab_path`: read from a fresh local copy, or trained
  locally and uploaded (one object, so it appears whole) when it is not there."""
  remote = storage.resolve(vocab_path)
  local = os.path.join(storage.local_cache(remote), posixpath.basename(remote))
  there = storage.exists(remote)
  if there:
    storage.download(remote, local, '--config.vocab_path')
  tokenizer = _load_or_train(config, local, train_pairs)
  if not there:
    storage.upload(local, remote, '--config.vocab_path')
  return tokenizer


def _load_or_train(
    config: ml_collections.ConfigDict, path: str, train_pairs: Sequence[tuple[str, str]]
) -> Tokenizer:
  """`tokenizer_for`'s vocabulary at `path`, trained there if it is not."""

  def sentences():
    num_pairs = min(len(train_pairs), max(1, config.vocab_train_sentences // 2))
    rng = np.random.default_rng(config.data_seed)
    chosen = np.sort(rng.choice(len(train_pairs), size=num_pairs, replace=False))
    read = getattr(train_pairs, 'at', None)  # Batched reads where the pairs offer them.
    for start in range(0, num_pairs, _READ_CHUNK):
      part = chosen[start : start + _READ_CHUNK]
      for pair in read(part) if read else [train_pairs[int(i)] for i in part]:
        yield from pair

  return load_or_train_tokenizer(
      path,
      sentences,
      vocab_size=config.vocab_size_target,
      model_type=config.vocab_model_type,
      reserved=corpora.reserved_pieces(config),
  )


def store_directory(
    config: ml_collections.ConfigDict, layout: RunLayout, tokenizer: Tokenizer, pairs: ParallelText
) -> str:
  """Where the token ids of `pairs` live: beside the vocabulary, in '<vocabulary>.tokens/'
  (in the work directory's 'tokens/' when the vocabulary's directory is read-only or is
  another run's work directory, such as an imported model's, which is only read)."""
  name = re.sub(r'[^A-Za-z0-9_.-]+', '_', pairs.name.replace('->', '-to-')).strip('_')
  if len(name) > 120:  # Many sources: a file name stays within the filesystem's limit.
    name = f'{name[:100]}_{hashlib.sha256(name.encode()).hexdigest()[:12]}'
  beside = os.path.dirname(os.path.abspath(tokenizer.model_path))
  others_run = RunLayout.is_run(beside) and beside != os.path.abspath(layout.local)
  if os.access(beside, os.W_OK) and not others_run:
    root = os.path.splitext(os.path.abspath(tokenizer.model_path))[0] + '.tokens'
  else:
    root = os.path.join(layout.tokens, os.path.basename(os.path.splitext(tokenizer.model_path)[0]))
  return os.path.join(root, name)


def tokenized(
    pairs: ParallelText,
    tokenizer: Tokenizer,
    config: ml_collections.ConfigDict,
    layout: RunLayout,
    workers: int | None = None,
) -> token_store.TokenStore:
  """The token ids of `pairs`, prepared on first use (`prepare_data.py` does it ahead, on
  several processes and hosts) and rebuilt, with a warning, when the data or vocabulary
  changed. For a gs:// work directory they are prepared locally and published to the
  bucket, and downloaded from there when published for the same data and vocabulary."""
  directory = store_directory(config, layout, tokenizer, pairs)
  remote = _remote_of(directory, layout)
  if remote:
    meta = storage.published(remote)
    if meta is not None and meta != token_store.read_meta(directory):
      storage.fetch(remote, directory)  # open_or_prepare still checks that it fits this data.
  store = token_store.open_or_prepare(
      pairs,
      tokenizer,
      directory,
      data_fingerprint=pairs.fingerprint,
      workers=workers or prepare_workers(config),
  )
  if remote and storage.published(remote) != store.meta:
    storage.publish(directory, remote, store.meta)
  return store


def prepare_workers(config: ml_collections.ConfigDict) -> int:
  return config.prepare_workers or os.cpu_count() or 1
