"""Training on more than the directions' splits: corpus directories (back-translation,
distillation) and plain text corpora beside the bitext, drawn by weight, the '<BT>' tag on
back-translated sources, the corpus's vocabulary read, and every refusal before training."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tensorflow_datasets as tfds

from test_languages import _tags_drawn
from test_languages import _text_config
import train_testlib
from transformer_jax import config as config_lib
from transformer_jax.data import corpora
from transformer_jax.data import data_sources
from transformer_jax.data import input_pipeline as ip
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data import vocab_cache
from transformer_jax.errors import ConfigError
from transformer_jax.errors import DataError
from transformer_jax.errors import DatasetNotFoundError
from transformer_jax.storage.layout import RunLayout
from transformer_jax.training import config_checks


def _one_way(tmp_path, **overrides):
  """lo -> up over plain files (test_languages' corpus), one direction, no language tag."""
  return _text_config(
      tmp_path, directions=(), language_tag='', source_lang='lo', target_lang='up', **overrides
  )


def _vocabulary(tmp_path, config, reserved=(corpora.BT_TAG,)) -> bytes:
  pairs = data_sources.open_split(config, 'train')
  path = str(tmp_path / f'made{len(reserved)}.model')
  tokenizer_lib.train_tokenizer(
      [s for i in range(len(pairs)) for s in pairs[i]], path, vocab_size=60, reserved=reserved
  )
  with open(path, 'rb') as f:
    return f.read()


def _corpus(tmp_path, config, name='bt', kind='back_translation', count=40, vocabulary=None):
  """A corpus directory as translate_corpus.py writes it (the synthetic side is the real
  side upper-cased, as a perfect model would write it)."""
  directory = tmp_path / name
  directory.mkdir()
  lows = [' '.join(['ab', 'cd', 'no'][: 1 + i % 3]) + ' klm' * (i % 2) for i in range(count)]
  corpora.write(
      str(directory),
      kind,
      ('lo', 'up'),
      (lows, [line.upper() for line in lows]),
      vocabulary or _vocabulary(tmp_path, config),
  )
  return str(directory)


def test_a_back_translated_corpus_is_drawn_by_weight_tagged_and_read_in_its_vocabulary(tmp_path):
  config = _one_way(tmp_path, packing=True)
  corpus = _corpus(tmp_path, config)
  config.update(dict(extra_corpora=(corpus,), back_translation_tag=True, corpus_weights=(1.0, 3.0)))
  config_checks.validate_run(config, training=True)
  corpora.check(config)
  data = ip.get_datasets(config, RunLayout.of(str(tmp_path / 'run')), process_count=1)
  assert data.tokenizer.model_path == os.path.join(corpus, 'vocab.model')  # The corpus's own.
  assert data.source_names == ('lo-up', 'bt')
  bt = tokenizer_lib.piece_id(data.tokenizer, corpora.BT_TAG)
  assert bt is not None
  counts, _ = _tags_drawn(data, {'<BT>': bt}, 30)
  drawn = data.train.get_state()['drawn']
  assert drawn[1] == counts['<BT>']  # Every back-translated source, and only those, tagged.
  assert abs(drawn[1] / sum(drawn) - 0.75) < 0.06, drawn
  # Evaluation reads the direction's own split: no corpus, no tag.
  assert all(not s.startswith('<BT>') for s, _ in data.eval_text)


def test_plain_text_corpora_are_read_after_the_splits_and_alone_when_asked(tmp_path):
  config = _one_way(tmp_path)
  source, target = config.text_files.test.split(',')
  config.extra_corpora = (f'lo-up:{source},{target}',)
  pairs = data_sources.open_training(config)
  split, test = (data_sources.open_split(config, name) for name in ('train', 'test'))
  assert len(pairs) == len(split) + len(test) and pairs[len(split)] == test[0]
  assert corpora.source_names(config) == ('lo-up', 'test')
  config.train_on_directions = False
  assert list(data_sources.open_training(config)) == list(test)


@pytest.mark.parametrize(
    'change,error,message',
    [
        (dict(extra_corpora=('missing_dir',)), DataError, 'not a finished corpus'),
        (dict(extra_corpora=('lo-up:one_file',)), ConfigError, 'does not name two files'),
        (dict(extra_corpora=('lo-fr:a,b',)), ConfigError, 'translates lo-fr, which is not a'),
        (dict(extra_corpora=('lo-up:nope.lo,nope.up',)), DataError, r'nope.lo \(extra_corpora'),
        (dict(train_on_directions=False), ConfigError, 'but there are none'),
        (dict(corpus_weights=(1.0, 2.0)), ConfigError, 'must be 1 positive numbers'),
        (dict(corpus_weights=(-1.0,), packing=True), ConfigError, 'must be 1 positive'),
    ],
)
def test_bad_corpora_are_refused_before_anything_is_made(tmp_path, change, error, message):
  config = _one_way(tmp_path)
  config.update(change)
  with pytest.raises(error, match=message):
    config_checks.validate_run(config, training=True)
    corpora.check(config)


def test_an_unfinished_corpus_says_to_rerun_its_command(tmp_path):
  config = _one_way(tmp_path)
  (tmp_path / 'half').mkdir()
  (tmp_path / 'half' / 'progress.json').write_text('{}')
  config.extra_corpora = (str(tmp_path / 'half'),)
  with pytest.raises(DataError, match='has not finished: rerun the translate_corpus.py'):
    corpora.check(config)


def test_corpora_of_other_vocabularies_are_refused(tmp_path):
  config = _one_way(tmp_path)
  first = _corpus(tmp_path, config, 'first')
  other = _vocabulary(tmp_path, config, reserved=())
  second = _corpus(tmp_path, config, 'second', vocabulary=other)
  config.extra_corpora = (first, second)
  with pytest.raises(ConfigError, match='written in different vocabularies'):
    corpora.check(config)
  config.extra_corpora = (first,)
  config.vocab_path = os.path.join(second, 'vocab.model')
  with pytest.raises(ConfigError, match='but --config.vocab_path=.* is another'):
    corpora.check(config)
  config.vocab_path = os.path.join(first, 'vocab.model')  # The same file's bytes: fine.
  corpora.check(config)
  config.vocab_path = ''
  config.back_translation_tag = True
  config.extra_corpora = (second,)  # Its vocabulary has no '<BT>'.
  with pytest.raises(ConfigError, match='lacks the reserved piece <BT>'):
    ip.get_datasets(config, RunLayout.of(str(tmp_path / 'run')), process_count=1)


@pytest.mark.parametrize(
    'content,message',
    [(b'', 'is empty'), (b'caf\xe9 ok\n', r'is not UTF-8 \(line 1'), (b'a\0b\n', 'NUL bytes')],
)
def test_a_corpus_file_that_is_not_text_is_refused(tmp_path, content, message):
  config = _one_way(tmp_path)
  corpus = _corpus(tmp_path, config)
  with open(os.path.join(corpus, 'corpus.lo'), 'wb') as f:
    f.write(content)
  config.extra_corpora = (corpus,)
  with pytest.raises(DataError, match=message):
    data_sources.open_training(config)


def _translate_corpus(*flags: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, 'translate_corpus.py', *flags],
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(),
      capture_output=True,
      text=True,
      timeout=120,
  )


@pytest.mark.parametrize(
    'content,message',
    [
        (b'', 'is empty'),
        (b'ok\ncaf\xe9\n', 'is not UTF-8 (line 2'),
        (b'\0\0', 'holds NUL bytes'),
    ],
)
def test_translate_corpus_refuses_input_that_is_not_text_before_loading_a_model(
    tmp_path, content, message
):
  (tmp_path / 'mono.txt').write_bytes(content)
  (tmp_path / 'run').mkdir()
  result = _translate_corpus(
      f'--workdir={tmp_path / "run"}',
      f'--input={tmp_path / "mono.txt"}',
      f'--output_dir={tmp_path / "out"}',
      '--kind=back_translation',
  )
  assert result.returncode == 2 and 'Traceback' not in result.stderr, result.stderr[-2000:]
  assert message in result.stderr and '--input' in result.stderr, result.stderr
  assert not (tmp_path / 'out').exists()  # Nothing written.


def test_a_corpus_manifest_records_the_synthetic_side(tmp_path):
  config = _one_way(tmp_path)
  directory = _corpus(tmp_path, config, kind='distillation')
  manifest = corpora.read_manifest(directory)
  assert manifest['synthetic_side'] == 'target' and manifest['pairs'] == 40
  assert manifest['source_file'] == 'corpus.lo' and manifest['target_file'] == 'corpus.up'


def test_train_py_refuses_a_corpus_that_is_not_text_before_making_the_work_directory(tmp_path):
  config = _one_way(tmp_path)
  corpus = _corpus(tmp_path, config)
  with open(os.path.join(corpus, 'corpus.up'), 'wb') as f:
    f.write(b'AB\nCAF\xc9\n')
  files = {split: config.text_files[split] for split in ('train', 'validation', 'test')}
  path = train_testlib.write_config_file(
      str(tmp_path / 'config.py'),
      files,
      source_lang='lo',
      target_lang='up',
      extra_corpora=(corpus,),
  )
  workdir = tmp_path / 'run'
  result = subprocess.run(
      train_testlib.train_command(path, str(workdir)),
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert result.returncode == 2 and 'Traceback' not in result.stderr, result.stderr[-2000:]
  assert 'corpus.up' in result.stderr and 'is not UTF-8 (line 2' in result.stderr
  assert not workdir.exists()


def test_a_datasets_training_split_trains_beside_the_directions(tmp_path):
  config = config_lib.base_config()  # wmt14_translate/de-en, en->de.
  config.update(
      dict(
          extra_corpora=('wmt17_translate/de-en:en-de',),
          vocab_size_target=120,
          tfds_data_dir=str(tmp_path / 'tfds'),
      )
  )
  assert corpora.source_names(config) == ('en-de', 'wmt17_translate_de-en')
  with pytest.raises(DatasetNotFoundError, match="'wmt14_translate/de-en'"):
    data_sources.check_prepared(config)  # Nothing is prepared here: the first one named.
  with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
    data_sources.check_prepared(config)
    pairs = data_sources.open_training(config)
    wmt17 = tfds.data_source('wmt17_translate/de-en', split='train')
    assert len(pairs) == 32 and pairs[16][1] == _text(wmt17[0]['de'])
    assert len(data_sources.open_split(config, 'validation')) == 16  # The direction's only.


def _text(value):
  return value.decode() if isinstance(value, bytes) else value


def test_many_sources_keep_the_token_stores_name_within_a_file_names_limit(tmp_path):
  config = _one_way(tmp_path)
  source, target = config.text_files.test.split(',')
  entries = []
  for i in range(8):
    copies = [
        str(tmp_path / f'a_corpus_with_a_rather_long_name_{i}.{side}') for side in ('lo', 'up')
    ]
    for original, copy in zip((source, target), copies):
      with open(original) as f, open(copy, 'w') as g:
        g.write(f.read())
    entries.append(f'lo-up:{",".join(copies)}')
  config.extra_corpora = tuple(entries)
  pairs = data_sources.open_training(config)
  assert len(pairs.name) > 255
  (tmp_path / 'v.model').write_bytes(_vocabulary(tmp_path, config))
  tokenizer = tokenizer_lib.load_tokenizer(str(tmp_path / 'v.model'))
  directory = vocab_cache.store_directory(config, RunLayout.of(str(tmp_path)), tokenizer, pairs)
  assert len(os.path.basename(directory)) <= 120
