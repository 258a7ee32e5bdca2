"""Input pipeline: parallel text in, token-budget batches out (`get_datasets`).

It puts together three modules: `data_sources` (where the parallel text is read),
`vocab_cache` (the vocabulary and the token ids of each split, made once) and `batching`
(length buckets or packed rows). Process 0 makes the vocabulary and the token ids first; the
other hosts find them on a shared filesystem or the bucket, or make their own copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import dataclasses
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np

from transformer_jax.config import BOS_ID
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.config import UNK_ID
from transformer_jax.data import corpora
from transformer_jax.data.batching import Batch
from transformer_jax.data.batching import eval_batches
from transformer_jax.data.batching import train_dataset
from transformer_jax.data.batching import TrainData
from transformer_jax.data.data_sources import ConcatenatedText
from transformer_jax.data.data_sources import open_split
from transformer_jax.data.data_sources import open_training
from transformer_jax.data.data_sources import ParallelText
from transformer_jax.data.token_store import TokenStore
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.data.vocab_cache import tokenized
from transformer_jax.data.vocab_cache import tokenizer_for
from transformer_jax.runtime import multihost
from transformer_jax.storage import storage
from transformer_jax.storage.layout import RunLayout


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
    output_ids: with `output_vocabulary='target'`, the ids the output layer scores
      (`target_side_ids`); otherwise None.
    source_names: the sources training draws from by weight (`corpora.is_mixture`),
      whose counts the batches' state keeps ('drawn'); otherwise ().
  """

  train: Any
  steps_per_epoch: int
  eval_batches: Callable[[], Iterator[Batch]]
  tokenizer: Tokenizer
  train_info: TrainData
  eval_text: ParallelText | ConcatenatedText
  output_ids: tuple[int, ...] | None = None
  source_names: tuple[str, ...] = ()


def target_side_ids(store: TokenStore, vocab_size: int) -> tuple[int, ...]:
  """The ids that occur on the target side of `store`, with EOS and UNK, ascending (PAD and
  BOS are never output). One counting pass over the memory-mapped ids."""
  counts = np.bincount(np.asarray(store.target, np.int64), minlength=vocab_size)
  counts[[EOS_ID, UNK_ID]] += 1
  counts[[PAD_ID, BOS_ID]] = 0
  return tuple(int(i) for i in np.flatnonzero(counts))


def _tokenized_on_every_host(config, layout, tokenizer, splits):
  """The token stores of `splits`. Process 0 prepares them first; the others then find them
  ready on a shared filesystem or the bucket, or prepare their own copies on local disks."""
  return multihost.on_process_0_first(
      lambda: [tokenized(pairs, tokenizer, config, layout) for pairs in splits], 'token stores'
  )


def get_datasets(
    config: ml_collections.ConfigDict,
    layout: RunLayout,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    row_multiple: int = 1,
) -> Datasets:
  """Everything training reads: batches and the vocabulary (the test split is left alone).

  Args:
    config: the run's config (see `config.base_config`, Data section).
    layout: the run's paths: its vocabulary (`layout.vocab`, unless `config.vocab_path`) and
      the token ids of the splits beside it.
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
    logging.warning(
        'tokens_per_batch=%d is not divisible by %d hosts; each gets %d.',
        config.tokens_per_batch,
        process_count,
        config.tokens_per_batch // process_count,
    )
  train_pairs = open_training(config)
  eval_pairs = open_split(config, config.eval_split)
  tokenizer = multihost.on_process_0_first(
      lambda: tokenizer_for(config, layout, train_pairs),
      'vocabulary',
      storage.is_remote(layout.root) or storage.is_remote(config.vocab_path),
  )
  stores = _tokenized_on_every_host(config, layout, tokenizer, (train_pairs, eval_pairs))
  info = train_dataset(
      stores[0],
      config,
      process_index=process_index,
      process_count=process_count,
      row_multiple=row_multiple,
      sources=[(p.name, len(p)) for p in getattr(train_pairs, 'parts', ())],
  )

  def make_eval_batches() -> Iterator[Batch]:
    return eval_batches(
        stores[1],
        config,
        process_index=process_index,
        process_count=process_count,
        row_multiple=row_multiple,
    )

  return Datasets(
      train=iter(info.dataset),
      steps_per_epoch=info.steps_per_epoch,
      eval_batches=make_eval_batches,
      tokenizer=tokenizer,
      train_info=info,
      eval_text=eval_pairs,
      output_ids=(
          target_side_ids(stores[0], tokenizer.vocab_size)
          if config.output_vocabulary == 'target'
          else None
      ),
      source_names=(
          corpora.source_names(config)
          if config.packing and corpora.is_mixture(config) and hasattr(train_pairs, 'parts')
          else ()
      ),
  )
