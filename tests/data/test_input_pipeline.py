"""Tests for the input pipeline on small generated data and on mock TFDS WMT data."""

import collections
import glob
import json
import os
import types

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

from transformer_jax import config as config_lib
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.config import UNK_ID
from transformer_jax.data import batching
from transformer_jax.data import data_sources
from transformer_jax.data import input_pipeline as ip
from transformer_jax.data import token_store
from transformer_jax.data import vocab_cache
from transformer_jax.model.models import BATCH_KEYS
from transformer_jax.storage.layout import RunLayout

WORDS = (
    'the a house river bird green old new town field red blue small long water '
    'light stone tree day night'
).split()
NUM_PAIRS = 300


def _sentence(rng, low, high):
  return ' '.join(rng.choice(WORDS, size=rng.integers(low, high)))


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """Text files: 300 pairs incl. 3 blank, 2 too long; the tokenizer and the config."""
  root = tmp_path_factory.mktemp('text')
  rng = np.random.default_rng(0)
  pairs = []
  while len(pairs) < NUM_PAIRS:  # Unique pairs, so that counting examples is exact.
    pair = (_sentence(rng, 1, 14), _sentence(rng, 1, 14))
    if pair not in pairs:
      pairs.append(pair)
  pairs[5] = ('', 'only a target')
  pairs[17] = ('only a source', '   ')
  pairs[40] = ('\t', '')
  pairs[60] = (_sentence(rng, 40, 41), 'short')
  pairs[61] = ('short', _sentence(rng, 40, 41))
  files = {}
  for split in ('train', 'validation', 'test'):
    src, tgt = root / f'{split}.src', root / f'{split}.tgt'
    src.write_text(''.join(s + '\n' for s, _ in pairs))
    tgt.write_text(''.join(t + '\n' for _, t in pairs))
    files[split] = f'{src},{tgt}'
  config = config_lib.base_config()
  config.dataset = 'text'
  config.text_files = files
  config.vocab_size_target = 150
  config.max_source_length = 24
  config.max_target_length = 24
  config.bucket_boundaries = (8, 12, 16)
  config.tokens_per_batch = 96
  config.data_threads = 1
  workdir = str(root / 'work')
  train = data_sources.open_split(config, 'train')
  tok = vocab_cache.tokenizer_for(config, RunLayout.of(workdir), train)
  store = vocab_cache.tokenized(train, tok, config, RunLayout.of(workdir))
  return train, tok, config, workdir, store


def _segments(batch, name):
  """(row, segment) -> token list, checking positions and segment ids on the way."""
  out = {}
  ids = batch[name]
  seg = batch[f'{name}_segmentation']
  pos = batch[f'{name}_positions']
  assert ((ids == PAD_ID) == (seg == 0)).all()
  assert (pos[seg == 0] == 0).all()
  for r in range(ids.shape[0]):
    for s in np.unique(seg[r][seg[r] > 0]):
      where = np.flatnonzero(seg[r] == s)
      assert (np.diff(where) == 1).all(), 'a segment is contiguous'
      np.testing.assert_array_equal(pos[r, where], np.arange(len(where)))
      tokens = ids[r, where].tolist()
      assert tokens[-1] == EOS_ID and EOS_ID not in tokens[:-1]
      out[(r, int(s))] = tokens
  return out


def _examples(batches):
  """Multiset of (source ids, target ids) in `batches`, pairing segments by (row, id)."""
  found = collections.Counter()
  for batch in batches:
    assert set(batch) == set(BATCH_KEYS)
    assert all(v.dtype == np.int32 and v.shape == batch['inputs'].shape for v in batch.values())
    sources, targets = _segments(batch, 'inputs'), _segments(batch, 'targets')
    assert sources.keys() == targets.keys()
    found.update((tuple(sources[k]), tuple(targets[k])) for k in sources)
  return found


def _expected(pairs, tok, max_len=None):
  out = collections.Counter()
  for s, t in (pairs[i] for i in range(len(pairs))):
    if not s.strip() or not t.strip():
      continue
    ids = (tuple(tok.encode(s)), tuple(tok.encode(t)))
    if max_len is None or max(map(len, ids)) <= max_len:
      out[ids] += 1
  return out


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def test_bucketing_keeps_every_example_once_per_epoch(corpus):
  pairs, tok, config, _, store = corpus
  data = batching.train_dataset(store, config, row_multiple=2)
  assert data.skipped_empty == 3 and data.dropped_too_long == 2
  assert data.num_examples == NUM_PAIRS - 5
  batches = _take(iter(data.dataset), data.steps_per_epoch)
  assert _examples(batches) == _expected(pairs, tok, max_len=24)
  shapes = {b['inputs'].shape for b in batches}
  assert {length for _, length in shapes} <= {8, 12, 16, 24}
  for rows, length in shapes:
    assert rows % 2 == 0 and rows * length <= config.tokens_per_batch
  assert len(shapes) <= 4, 'one shape per bucket'


def test_packing_keeps_every_token_once_per_epoch(corpus):
  pairs, tok, config, _, store = corpus
  config = config.copy_and_resolve_references()
  config.packing = True
  iterator = iter(batching.train_dataset(store, config).dataset)
  batches = []
  while not batches or iterator.get_state()['epoch'] == 0:
    batches.append(next(iterator))
  assert _examples(batches) == _expected(pairs, tok, max_len=24)
  assert {b['inputs'].shape for b in batches} == {(4, 24)}  # 96 tokens / 24 a row.
  assert max(int(b['inputs_segmentation'].max()) for b in batches) > 1, 'rows hold several'
  real = sum(int((b['inputs_segmentation'] > 0).sum()) for b in batches)
  assert real / sum(b['inputs'].size for b in batches) > 0.7


def test_vectorized_batches_equal_one_example_at_a_time(corpus):
  """The numpy batch cutters against a per-example loop over the tokenizer's own ids."""
  pairs, tok, _, _, store = corpus
  rng = np.random.default_rng(3)
  kept = [i for i in range(len(pairs)) if pairs[i][0].strip() and pairs[i][1].strip()]
  indices = rng.choice(kept, 6, replace=False)
  batch = store.batch(indices, rows=8, length=40)
  for r, i in enumerate(indices):
    for name, text in (('inputs', pairs[i][0]), ('targets', pairs[i][1])):
      ids = tok.encode(text)
      np.testing.assert_array_equal(batch[name][r, : len(ids)], ids)
      assert (batch[name][r, len(ids) :] == PAD_ID).all()
      np.testing.assert_array_equal(batch[f'{name}_positions'][r, : len(ids)], np.arange(len(ids)))
  assert (batch['inputs'][6:] == PAD_ID).all() and (batch['targets_segmentation'][6:] == 0).all()
  rows = np.array([1, 0, 1, 2, 1, 0])
  packed = store.packed_batch(indices, rows, rows=3, length=90)
  for row in range(3):
    mine = indices[rows == row]
    for name, side in (('inputs', 0), ('targets', 1)):
      expect = [t for i in mine for t in tok.encode(pairs[i][side])]
      got = packed[name][row]
      np.testing.assert_array_equal(got[: len(expect)], expect)
      assert (got[len(expect) :] == PAD_ID).all()
      segments = packed[f'{name}_segmentation'][row]
      assert segments[: len(expect)].max() == len(mine)


def test_token_store_is_reused_and_rebuilt_when_data_or_vocabulary_change(corpus, tmp_path, caplog):
  pairs, tok, config, _, _ = corpus
  directory = str(tmp_path / 'store')
  first = token_store.open_or_prepare(pairs, tok, directory, data_fingerprint='a')
  made = first.meta['created']
  again = token_store.open_or_prepare(pairs, tok, directory, data_fingerprint='a')
  assert again.meta['created'] == made  # Reused, not rebuilt.
  with caplog.at_level('WARNING'):
    changed = token_store.open_or_prepare(pairs, tok, directory, data_fingerprint='b')
  assert changed.meta['created'] != made and 'the data changed' in caplog.text
  np.testing.assert_array_equal(changed.lengths, first.lengths)


def test_token_ids_stay_out_of_another_runs_work_directory(tmp_path):
  """Beside the vocabulary where it is this run's or a plain folder's; in this run's work
  directory where the vocabulary is another run's (an imported model fine-tuned: only read)."""
  pairs = types.SimpleNamespace(name='text[train] en->de')
  run = str(tmp_path / 'run')

  def directory(vocabulary):
    os.makedirs(os.path.dirname(vocabulary), exist_ok=True)
    return vocab_cache.store_directory(
        config_lib.base_config(),
        RunLayout.of(run),
        types.SimpleNamespace(model_path=vocabulary),
        pairs,
    )

  assert directory(str(tmp_path / 'vocab' / 'spm.model')) == str(
      tmp_path / 'vocab' / 'spm.tokens' / 'text_train_en-to-de'
  )
  imported = tmp_path / 'imported'
  (imported / 'checkpoints').mkdir(parents=True)
  assert directory(str(imported / 'marian_vocab.json')) == os.path.join(
      run, 'tokens', 'marian_vocab', 'text_train_en-to-de'
  )
  (tmp_path / 'run' / 'checkpoints').mkdir(parents=True)  # This run's own vocabulary.
  assert directory(os.path.join(run, 'spm.model')) == os.path.join(
      run, 'spm.tokens', 'text_train_en-to-de'
  )


def test_preparation_on_two_hosts_and_two_processes_equals_one(corpus, tmp_path, monkeypatch):
  """Parts split over two 'hosts' (each with a pool of two processes), the second merging,
  give the same store as one process; an interrupted part is redone, the others reused."""
  pairs, tok, _, _, store = corpus
  monkeypatch.setattr(token_store, 'PART_SIZE', 40)  # 8 parts of the 300 pairs.
  directory = str(tmp_path / 'shared')
  prepare = token_store.prepare
  assert (
      prepare(pairs, tok, directory, data_fingerprint='x', workers=2, host_index=0, host_count=2)
      is None
  )  # Host 1's parts are missing.
  merged = prepare(
      pairs, tok, directory, data_fingerprint='x', workers=2, host_index=1, host_count=2
  )
  np.testing.assert_array_equal(merged.lengths, store.lengths)
  np.testing.assert_array_equal(merged.source, store.source)
  np.testing.assert_array_equal(merged.target, store.target)
  assert merged.meta['examples'] == len(pairs) and merged.meta['dtype'] == 'uint16'


@pytest.mark.parametrize('packing', [False, True])
def test_same_seed_same_batches_and_resume_mid_epoch(corpus, packing):
  pairs, tok, config, _, store = corpus
  config = config.copy_and_resolve_references()
  config.packing = packing
  data = batching.train_dataset(store, config)
  first = _take(iter(data.dataset), 12)
  again = _take(iter(batching.train_dataset(store, config).dataset), 12)
  for a, b in zip(first, again):
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

  stopped = iter(data.dataset)
  _take(stopped, 5)
  state = json.loads(json.dumps(stopped.get_state()))  # What a checkpoint stores.
  resumed = iter(batching.train_dataset(store, config).dataset)
  resumed.set_state(state)
  for a, b in zip(first[5:], _take(resumed, 7)):
    assert all((a[k] == b[k]).all() for k in a)

  config.data_seed = 1
  other = _take(iter(batching.train_dataset(store, config).dataset), 12)
  assert any(
      (a['inputs'].shape != b['inputs'].shape) or (a['inputs'] != b['inputs']).any()
      for a, b in zip(first, other)
  )


@pytest.mark.parametrize('packing', [False, True])
def test_resume_through_orbax_checkpoint_handler(corpus, tmp_path, packing):
  pairs, tok, config, _, store = corpus
  config = config.copy_and_resolve_references()
  config.packing = packing
  data = batching.train_dataset(store, config)
  unstopped = _take(iter(data.dataset), 8)
  it = iter(data.dataset)
  _take(it, 3)
  with ocp.CheckpointManager(tmp_path / 'ckpt') as manager:
    manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    manager.wait_until_finished()
    fresh = iter(batching.train_dataset(store, config).dataset)
    manager.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
  for a, b in zip(unstopped[3:], _take(fresh, 5)):
    assert all((a[k] == b[k]).all() for k in a)


def test_epochs_are_reshuffled(corpus):
  pairs, tok, config, _, store = corpus
  data = batching.train_dataset(store, config)
  two = _take(iter(data.dataset), 2 * data.steps_per_epoch)
  epoch0, epoch1 = two[: data.steps_per_epoch], two[data.steps_per_epoch :]
  assert _examples(epoch1) == _examples(epoch0)
  assert any(
      a['inputs'].shape != b['inputs'].shape or (a['inputs'] != b['inputs']).any()
      for a, b in zip(epoch0, epoch1)
  )


@pytest.mark.parametrize('packing', [False, True])
def test_two_hosts_read_disjoint_shards_that_cover_the_data(corpus, packing):
  pairs, tok, config, _, store = corpus
  config = config.copy_and_resolve_references()
  config.packing = packing
  hosts = [
      batching.train_dataset(store, config, process_index=i, process_count=2) for i in range(2)
  ]
  if packing:  # Each host packs every other example; 80 batches are > 1 pass over a shard.
    seen = []
    for host in hosts:
      batches = _take(iter(host.dataset), 80)
      assert batches[0]['inputs'].shape == (2, 24)  # 96 tokens / 2 hosts / 24 a row.
      seen.append(set(_examples(batches)))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(_expected(pairs, tok, max_len=24))
    return
  steps = hosts[0].steps_per_epoch
  per_host = [_take(iter(h.dataset), steps) for h in hosts]
  for a, b in zip(*per_host):
    assert a['inputs'].shape == b['inputs'].shape, 'hosts step in lockstep'
  seen = [_examples(batches) for batches in per_host]
  assert seen[0] + seen[1] == _expected(pairs, tok, max_len=24)
  assert sum(seen[0].values()) > 0 and sum(seen[1].values()) > 0


def test_eval_batches_never_drop_or_truncate(corpus):
  pairs, tok, config, _, store = corpus
  batches = list(batching.eval_batches(store, config, row_multiple=2))
  assert _examples(batches) == _expected(pairs, tok)  # The two long pairs too.
  assert max(b['inputs'].shape[1] for b in batches) > config.max_source_length
  assert all(b['inputs'].shape[0] % 2 == 0 for b in batches)
  hosts = [
      list(batching.eval_batches(store, config, process_index=i, process_count=2)) for i in range(2)
  ]
  assert [b['inputs'].shape for b in hosts[0]] == [b['inputs'].shape for b in hosts[1]]
  assert _examples(hosts[0]) + _examples(hosts[1]) == _expected(pairs, tok)


def test_get_datasets_on_text_files(corpus):
  _, _, config, workdir, _ = corpus
  data = ip.get_datasets(
      config, RunLayout.of(workdir), process_index=0, process_count=1, row_multiple=1
  )
  batch = next(data.train)
  assert set(batch) == set(BATCH_KEYS)
  assert data.output_ids is None  # output_vocabulary='all'.
  with config.unlocked():
    config.output_vocabulary = 'target'
  ids = ip.get_datasets(config, RunLayout.of(workdir), process_index=0, process_count=1).output_ids
  (directory,) = glob.glob(os.path.join(workdir, 'vocab', '*.tokens', '*_train_*'))
  store = token_store.TokenStore.open(directory)
  seen = set(np.unique(store.target).tolist())
  assert set(ids) == seen | {EOS_ID, UNK_ID} and list(ids) == sorted(ids)
  assert len(ids) < data.tokenizer.vocab_size and PAD_ID not in ids
  test_pairs = data_sources.nonblank_pairs(data_sources.open_split(config, 'test'))
  assert len(test_pairs) == NUM_PAIRS - 3
  assert all(s.strip() and t.strip() for s, t in test_pairs)
  assert (
      sum(int((b['inputs_segmentation'] == 1).any(axis=1).sum()) for b in data.eval_batches())
      == NUM_PAIRS - 3
  )


def test_text_files_with_different_line_counts_fail_clearly(tmp_path):
  (tmp_path / 'a').write_text('one\ntwo\n')
  (tmp_path / 'b').write_text('uno\n')
  config = config_lib.base_config()
  config.dataset = 'text'
  config.text_files = {'train': f'{tmp_path / "a"},{tmp_path / "b"}'}
  with pytest.raises(ValueError, match='2 lines but .* has 1'):
    data_sources.open_split(config, 'train')
  with pytest.raises(data_sources.DatasetNotFoundError, match='text_files.test'):
    data_sources.open_split(config, 'test')


def test_missing_tfds_dataset_names_dataset_directory_and_fix(tmp_path):
  config = config_lib.base_config()
  config.tfds_data_dir = str(tmp_path)
  with pytest.raises(data_sources.DatasetNotFoundError) as error:
    data_sources.open_split(config, 'train')
  message = str(error.value)
  for needle in (
      'wmt14_translate/de-en',
      str(tmp_path),
      'tfds build',
      '--file_format=array_record',
      '--config.tfds_data_dir',
  ):
    assert needle in message


@pytest.mark.parametrize(
    'name,source,target',
    [
        ('wmt14_translate/de-en', 'en', 'de'),
        ('wmt17_translate/de-en', 'de', 'en'),
        ('wmt14_translate/fr-en', 'en', 'fr'),
    ],
)
def test_mock_wmt(tmp_path, name, source, target):
  config = config_lib.base_config()
  config.dataset, config.source_lang, config.target_lang = name, source, target
  config.vocab_size_target = 80
  config.tokens_per_batch = 512
  config.max_source_length = config.max_target_length = 64
  config.bucket_boundaries = (16, 32)
  with tfds.testing.mock_data(num_examples=64, policy=tfds.testing.MockPolicy.USE_CODE):
    pairs = data_sources.open_split(config, 'train')  # Registers the WMT builders with TFDS.
    records = tfds.data_source(name, split='train')
    data = ip.get_datasets(config, RunLayout.of(str(tmp_path)), process_index=0, process_count=1)
    assert pairs[3] == (records[3][source], records[3][target])
    batches = _take(data.train, data.steps_per_epoch)
    assert _examples(batches) == _expected(pairs, data.tokenizer, max_len=64)
    assert len(list(data.eval_batches())) >= 1
    assert len(data_sources.open_split(config, 'test')) == 64
