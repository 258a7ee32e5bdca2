"""prepare_data.py: the splits tokenized ahead, on two 'hosts', then reused by training."""

import json
import os
import sys

import pytest

import train_testlib
from transformer_jax.data import data_sources
from transformer_jax.data import input_pipeline as ip
from transformer_jax.data import token_store
from transformer_jax.data import vocab_cache
from transformer_jax.storage.layout import RunLayout

PREPARE = os.path.join(train_testlib.REPO, 'prepare_data.py')


def _prepare(config_path, workdir, *flags, part_size=None):
  env = train_testlib.subprocess_env(1)
  code = None
  if part_size:  # Small parts, so that two hosts each get some.
    argv = [PREPARE, f'--config={config_path}', f'--workdir={workdir}', *flags]
    code = (
        f'import sys; sys.argv = {argv!r}; '
        'from transformer_jax.data import token_store; '
        f'token_store.PART_SIZE = {part_size}; '
        f'import runpy; runpy.run_path({PREPARE!r}, run_name="__main__")'
    )
  command = (
      [sys.executable, '-c', code]
      if code
      else [sys.executable, PREPARE, f'--config={config_path}', f'--workdir={workdir}', *flags]
  )
  return train_testlib.run_command(command, env=env, timeout=300)


@pytest.mark.slow
def test_two_hosts_prepare_and_training_reuses_the_stores(tmp_path):
  files = train_testlib.write_parallel_text(str(tmp_path))
  config_path = train_testlib.write_config_file(str(tmp_path / 'config.py'), files)
  workdir = str(tmp_path / 'work')
  vocab = _prepare(config_path, workdir, '--splits=validation')  # Trains the vocabulary.
  assert vocab.returncode == 0, vocab.stderr[-3000:]
  first = _prepare(
      config_path,
      workdir,
      '--splits=train',
      '--num_hosts=2',
      '--host_index=0',
      '--workers=2',
      part_size=100,
  )
  assert first.returncode == 0, first.stderr[-3000:]
  assert 'waits for the other hosts' in first.stdout
  second = _prepare(
      config_path,
      workdir,
      '--splits=train',
      '--num_hosts=2',
      '--host_index=1',
      '--workers=2',
      part_size=100,
  )
  assert second.returncode == 0, second.stderr[-3000:]
  assert 'train: 400 pairs' in second.stdout, second.stdout

  config = train_testlib.small_config(files)
  train = data_sources.open_split(config, 'train')
  tokenizer = vocab_cache.tokenizer_for(config, RunLayout.of(workdir), train)
  directory = vocab_cache.store_directory(config, RunLayout.of(workdir), tokenizer, train)
  with open(os.path.join(directory, 'meta.json')) as f:
    made = json.load(f)['created']
  data = ip.get_datasets(config, RunLayout.of(workdir), process_index=0, process_count=1)
  next(data.train)
  with open(os.path.join(directory, 'meta.json')) as f:
    assert json.load(f)['created'] == made  # Reused by training, not rebuilt.
  again = token_store.TokenStore.open(directory)
  assert len(again) == 400 and int(again.lengths.min()) > 0

  # The data changes under the same path: training rebuilds the ids, it does not reuse them.
  with open(files['train'].split(',')[0], 'a') as f:
    f.write('one more line\n')
  with open(files['train'].split(',')[1], 'a') as f:
    f.write('ENO EROM ENIL\n')
  ip.get_datasets(config, RunLayout.of(workdir), process_index=0, process_count=1)
  assert len(token_store.TokenStore.open(directory)) == 401


@pytest.mark.parametrize(
    'flags,message',
    [
        (['--num_hosts=2', '--host_index=2'], 'must be in 0..1'),
        (['--workers=-1'], 'must be >= 0'),
        (['--config.prepare_workers=-2'], 'prepare_workers'),
    ],
)
@pytest.mark.slow
def test_bad_flags_fail_clearly(tmp_path, flags, message):
  files = train_testlib.write_parallel_text(str(tmp_path))
  config_path = train_testlib.write_config_file(str(tmp_path / 'config.py'), files)
  result = _prepare(config_path, str(tmp_path / 'work'), *flags)
  assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
  assert message in result.stderr and 'Traceback' not in result.stderr
