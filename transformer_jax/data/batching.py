"""How token ids become batches: length buckets or packed rows, a whole batch at a time.

Batches are dicts of int32 arrays, all [rows, length]: `inputs` and `targets` (ids ending with
EOS, no BOS, PAD after), `inputs_positions`/`targets_positions` (0-based, restarting at each
packed segment, 0 on padding) and `inputs_segmentation`/`targets_segmentation` (1, 2, ... per
example in a row, 0 on padding). Rows are a multiple of `row_multiple` (this host's data-parallel
shards); `tokens_per_batch` counts source (and, separately, target) token slots over all hosts.

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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import dataclasses
import functools
import math
from typing import Any

from absl import logging
import grain
import ml_collections
import numpy as np

from transformer_jax.data import corpora
from transformer_jax.data import token_store
from transformer_jax.errors import DataError

Batch = dict[str, np.ndarray]


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
    return np.array(
        [
            (k, c)
            for k, (m, r) in enumerate(zip(self.members, self.rows))
            for c in range(math.ceil(len(m) / r))
        ],
        np.int64,
    ).reshape(-1, 2)

  @functools.lru_cache(maxsize=2)  # noqa: B019  # Two epochs of one long-lived plan.
  def epoch_order(self, epoch: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng([self.seed, epoch])
    return tuple(rng.permutation(m) for m in self.members)

  def examples(self, epoch: int, bucket: int, chunk: int) -> np.ndarray:
    """The example indices of one global batch (the last of a bucket may be short)."""
    rows = self.rows[bucket]
    return self.epoch_order(epoch)[bucket][chunk * rows : (chunk + 1) * rows]


def plan_buckets(
    lengths: np.ndarray,
    keep: np.ndarray,
    buckets: Sequence[int],
    tokens_per_batch: int,
    row_multiple: int,
    seed: int,
) -> BucketPlan:
  """Assigns each kept example to the shortest bucket that holds both its sides."""
  longest = lengths.max(axis=1)
  index = np.searchsorted(np.asarray(buckets), longest)
  members = tuple(np.flatnonzero(keep & (index == k)) for k in range(len(buckets)))
  rows = tuple(rows_for(b, tokens_per_batch, row_multiple) for b in buckets)
  return BucketPlan(tuple(buckets), rows, members, seed)


class _BucketedBatches:
  """Step -> this host's rows of global batch `step` (a pure function; see module doc)."""

  def __init__(
      self, store: token_store.TokenStore, plan: BucketPlan, process_index: int, process_count: int
  ):
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
    mine = examples[self._process_index * host_rows : (self._process_index + 1) * host_rows]
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

  def __init__(
      self,
      store: token_store.TokenStore,
      members: np.ndarray,
      rows: int,
      length: int,
      seed: int,
      mixture: 'Mixture | None' = None,
  ):
    super().__init__()
    self.store = store
    self.members = np.asarray(members, np.int64)
    self.rows = rows
    self.length = length
    self.seed = seed
    self.mixture = mixture

  @functools.lru_cache(maxsize=2)  # noqa: B019  # Two epochs of one long-lived plan.
  def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(example indices, their [n, 2] lengths) in epoch `epoch`'s order: a permutation of
    `members`, or with a `mixture` its next len(members) draws."""
    if self.mixture is not None:
      order = self.mixture.draws(epoch * len(self.members), len(self.members))
    else:
      order = np.random.default_rng([self.seed, epoch]).permutation(self.members)
    return order, self.store.lengths[order]

  def __iter__(self) -> '_PackedIterator':
    return _PackedIterator(self)

  def __str__(self) -> str:
    return f'PackedBatches(rows={self.rows}, length={self.length})'


@dataclasses.dataclass(frozen=True, eq=False)
class Mixture:
  """Training examples drawn from several sources (a run's directions and extra corpora, the
  consecutive parts of one token store) by weight, through `grain.MapDataset.mix`: each
  source's kept examples reshuffled every pass (`shuffle().repeat()`), interleaved in
  proportion to `weights`. Draw i is a pure function of (seed, i), so a packer's (epoch,
  position) state resumes it exactly. A host takes every process_count-th draw.

  Attributes:
    names: each source's name, for the log.
    weights: each source's share of the draws (summing to 1).
    dataset: the mixed `grain.MapDataset` of example indices (infinite).
    starts: the first example index of each source but the first (the sources are
      consecutive parts of the store), to tell which source an example is from.
    process_index: this host.
    process_count: all hosts.
  """

  names: tuple[str, ...]
  weights: tuple[float, ...]
  dataset: grain.MapDataset
  starts: tuple[int, ...] = ()
  process_index: int = 0
  process_count: int = 1

  @classmethod
  def of(
      cls,
      members: Sequence[np.ndarray],
      names: Sequence[str],
      weights: Sequence[float],
      seed: int,
      process_index: int = 0,
      process_count: int = 1,
      starts: Sequence[int] = (),
  ) -> 'Mixture':
    empty = [name for name, m in zip(names, members) if not len(m)]
    if empty:
      raise DataError(
          f'{empty[0]} has no training example left (empty, or every pair longer than '
          'max_source_length/max_target_length), so it cannot be drawn from; fix its data, '
          'or leave it out of --config.directions / extra_corpora.'
      )
    sources = [
        grain.MapDataset.source(np.asarray(m, np.int64)).shuffle(seed=seed + 7919 * k).repeat()
        for k, m in enumerate(members)
    ]
    mixed = grain.MapDataset.mix(sources, weights=list(weights))
    return cls(tuple(names), tuple(weights), mixed, tuple(starts), process_index, process_count)

  def source_counts(self, examples: np.ndarray) -> np.ndarray:
    """How many of `examples` (store indices) each source holds."""
    sources = np.searchsorted(np.asarray(self.starts, np.int64), examples, side='right')
    return np.bincount(sources, minlength=len(self.names))

  def draws(self, start: int, count: int) -> np.ndarray:
    """This host's draws [start, start + count) (its own numbering)."""
    first, step = self.process_index, self.process_count
    return np.fromiter(
        (self.dataset[first + step * i] for i in range(start, start + count)), np.int64, count
    )


class _PackedIterator(grain.DatasetIterator):

  def __init__(self, packed: PackedBatches):
    super().__init__()
    self._packed = packed
    self._epoch = 0
    self._position = 0
    # With a mixture: the examples this host has drawn from each source (in the state, so a
    # resumed run's metrics go on counting).
    self._drawn = [0] * (len(packed.mixture.names) if packed.mixture else 0)

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
    if packed.mixture is not None:
      counts = packed.mixture.source_counts(order[chosen])
      self._drawn = [int(a + b) for a, b in zip(self._drawn, counts)]
    if position >= len(order):
      self._epoch, self._position = self._epoch + 1, 0
    else:
      self._position = position
    return batch

  def get_state(self) -> dict[str, Any]:
    state: dict[str, Any] = {'epoch': self._epoch, 'position': self._position}
    if self._packed.mixture is not None:
      state['drawn'] = list(self._drawn)
    return state

  def set_state(self, state: dict[str, Any]) -> None:
    self._epoch, self._position = int(state['epoch']), int(state['position'])
    if self._packed.mixture is not None:
      self._drawn = [int(n) for n in state.get('drawn', self._drawn)]


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


def train_dataset(
    store: token_store.TokenStore,
    config: ml_collections.ConfigDict,
    *,
    process_index: int = 0,
    process_count: int = 1,
    row_multiple: int = 1,
    sources: Sequence[tuple[str, int]] = (),
) -> TrainData:
  """The training batches of this host (see the module doc for bucketing and packing).

  Args:
    store: the training split's token ids (`tokenized`).
    config: reads max_source_length, max_target_length, tokens_per_batch, bucket_boundaries,
      packing, data_seed and data_threads.
    process_index: this host.
    process_count: all hosts; each gets tokens_per_batch / process_count of the budget.
    row_multiple: rows of every batch are a multiple of this (this host's data shards).
    sources: (name, pairs) of the consecutive parts of `store` (a run's directions
      and extra corpora, `corpora.sources`); with `corpora.is_mixture(config)`, packed
      rows draw from them by `corpora.mixture_weights` (a `Mixture`).
  """
  lengths = store.lengths
  nonempty = (lengths > 0).all(axis=1)
  fits = (lengths[:, 0] <= config.max_source_length) & (lengths[:, 1] <= config.max_target_length)
  keep = nonempty & fits
  skipped_empty = int((~nonempty).sum())
  dropped = int((nonempty & ~fits).sum())
  logging.info(
      '%s: %d training pairs; skipped %d with an empty side; dropped %d longer '
      'than %d source / %d target tokens.',
      store.directory,
      int(keep.sum()),
      skipped_empty,
      dropped,
      config.max_source_length,
      config.max_target_length,
  )
  if not keep.any():
    raise DataError(
        'No training example is left after filtering; check the data and '
        '--config.max_source_length/max_target_length.'
    )
  max_length = max(config.max_source_length, config.max_target_length)
  shards = row_multiple * process_count
  if config.tokens_per_batch < max_length * shards:
    logging.warning(
        'tokens_per_batch=%d holds fewer than %d rows of the longest bucket (%d tokens), '
        'but every batch has at least one row for each of its %d shards (data shards x '
        'hosts x grad_accum_steps): batches of the longest sentences will hold %d token '
        'slots, %.1fx the budget. Raise --config.tokens_per_batch to %d or more.',
        config.tokens_per_batch,
        shards,
        max_length,
        shards,
        max_length * shards,
        max_length * shards / config.tokens_per_batch,
        max_length * shards,
    )
  if config.packing:
    rows = rows_for(max_length, config.tokens_per_batch, shards) // process_count
    mine = np.flatnonzero(keep)[process_index::process_count]
    mixture = None
    if sources and corpora.is_mixture(config):
      names = [name for name, _ in sources]
      bounds = np.cumsum([0] + [size for _, size in sources])
      members = [start + np.flatnonzero(keep[start:end]) for start, end in zip(bounds, bounds[1:])]
      weights = corpora.mixture_weights(config, [len(m) for m in members])
      mixture = Mixture.of(
          members,
          names,
          weights,
          config.data_seed,
          process_index,
          process_count,
          starts=bounds[1:-1].tolist(),
      )
      logging.info(
          'Training examples drawn by weight: %s.',
          ', '.join(f'{n} {w:.1%} ({len(m)} pairs)' for n, w, m in zip(names, weights, members)),
      )
    dataset = PackedBatches(store, mine, rows, max_length, config.data_seed, mixture)
    average = lengths[keep].max(axis=1).mean()
    steps = max(1, math.ceil(len(mine) * average / (rows * max_length)))
  else:
    buckets = bucket_lengths(config.bucket_boundaries, max_length)
    plan = plan_buckets(lengths, keep, buckets, config.tokens_per_batch, shards, config.data_seed)
    steps = len(plan.batch_table)
    options = grain.ReadOptions(num_threads=config.data_threads, prefetch_buffer_size=8)
    dataset = (
        grain.MapDataset.range(steps)
        .shuffle(seed=config.data_seed)
        .repeat(None)
        .map_with_index(_BucketedBatches(store, plan, process_index, process_count))
        .to_iter_dataset(options)
    )
  return TrainData(dataset, steps, int(keep.sum()), dropped, skipped_empty)


def eval_batches(
    store: token_store.TokenStore,
    config: ml_collections.ConfigDict,
    *,
    process_index: int = 0,
    process_count: int = 1,
    row_multiple: int = 1,
) -> Iterator[Batch]:
  """Every non-blank pair of `store` exactly once, whole, in unpacked bucketed batches.

  Batches are global (every host gets the same number, of the same shapes) and each host
  gets its rows; all-padding rows fill the last batch of a bucket.
  """
  lengths = store.lengths
  keep = (lengths > 0).all(axis=1)
  if (~keep).any():
    logging.info('%s: skipped %d pairs with an empty side.', store.directory, int((~keep).sum()))
  max_length = max(config.max_source_length, config.max_target_length)
  buckets = bucket_lengths(config.bucket_boundaries, max_length)
  bucket_of = np.array([bucket_length(int(n), buckets) for n in lengths.max(axis=1)])
  shards = row_multiple * process_count
  for length in sorted(set(bucket_of[keep].tolist())):
    members = np.flatnonzero(keep & (bucket_of == length))
    rows = rows_for(length, config.tokens_per_batch, shards)
    host_rows = rows // process_count
    for start in range(0, len(members), rows):
      mine = members[start : start + rows][
          process_index * host_rows : (process_index + 1) * host_rows
      ]
      yield store.batch(mine, host_rows, length)
