"""translate_corpus.py on the trained fixture: killed and rerun it writes the corpus an
uninterrupted run writes (sampling too), two processes write what one does, a rerun with
other settings is refused, and train.py trains on the corpus beside its bitext."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_multihost import free_port
import train_testlib

pytestmark = pytest.mark.slow  # the commands, through subprocesses.


def _command(*flags: str) -> list[str]:
  return [sys.executable, os.path.join(train_testlib.REPO, 'translate_corpus.py'), *flags]


def _run(*flags: str) -> subprocess.CompletedProcess:
  return train_testlib.run_command(
      _command(*flags), env=train_testlib.subprocess_env(), timeout=300
  )


@pytest.fixture(scope='module')
def mono(run_dir, tmp_path_factory):
  """3,001 lines of the fixture's source language (its test sources again and again), the
  25th blank: chunks of 500 lines take long enough to be killed between two of them."""
  root = os.path.dirname(run_dir)
  with open(os.path.join(root, 'test.en')) as f:
    lines = f.read().splitlines()
  path = tmp_path_factory.mktemp('mono') / 'mono.en'
  path.write_text('\n'.join(lines + [''] + lines * 124) + '\n')
  return str(path)


def test_a_killed_run_resumes_to_the_corpus_of_an_uninterrupted_one(run_dir, mono, tmp_path):
  flags = [
      f'--workdir={run_dir}',
      f'--input={mono}',
      '--kind=back_translation',
      '--chunk_lines=500',
      '--sampling',
      '--top_k=4',
      '--compilation_cache_dir=' + str(tmp_path / 'cache'),
  ]
  whole = _run(*flags, f'--output_dir={tmp_path / "whole"}')
  assert whole.returncode == 0, whole.stderr[-3000:]
  killed_dir = tmp_path / 'killed'
  process = subprocess.Popen(
      _command(*flags, f'--output_dir={killed_dir}'),
      env=train_testlib.subprocess_env(),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
  )
  deadline = time.time() + 240
  while not (killed_dir / 'chunks' / '000001.txt').exists():
    assert process.poll() is None and time.time() < deadline, process.stderr.read()[-3000:]
    time.sleep(0.02)
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert not (killed_dir / 'corpus.json').exists()
  resumed = _run(*flags, f'--output_dir={killed_dir}')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'resuming: ' in resumed.stderr
  for name in ('corpus.en', 'corpus.es', 'vocab.model'):  # fixture: en->es by name
    assert (killed_dir / name).read_bytes() == (tmp_path / 'whole' / name).read_bytes(), name
  manifest = json.loads((killed_dir / 'corpus.json').read_text())
  assert manifest['kind'] == 'back_translation' and manifest['synthetic_side'] == 'source'
  assert (manifest['source_lang'], manifest['target_lang']) == ('es', 'en')
  assert manifest['pairs'] == 3001 and not (killed_dir / 'chunks').exists()
  outputs = (killed_dir / 'corpus.es').read_text().split('\n')
  assert len(outputs) == 3002 and outputs[24] == ''  # The blank line stays one.
  again = _run(*flags, f'--output_dir={killed_dir}')
  assert again.returncode == 0 and 'complete already' in again.stdout, again.stderr[-2000:]
  other = _run(*flags[:-2], '--top_k=3', f'--output_dir={killed_dir}')
  assert other.returncode == 2 and 'Traceback' not in other.stderr, other.stderr[-2000:]
  assert 'search.top_k: 4 then, 3 now' in other.stderr


def test_two_processes_write_what_one_does_and_train_py_trains_on_it(run_dir, mono, tmp_path):
  with open(mono) as f:
    (tmp_path / 'short.en').write_text(''.join(f.readlines()[:200]))
  flags = [
      f'--workdir={run_dir}',
      f'--input={tmp_path / "short.en"}',
      '--kind=distillation',
      '--chunk_lines=64',
  ]
  one = _run(*flags, f'--output_dir={tmp_path / "one"}')
  assert one.returncode == 0, one.stderr[-3000:]
  port = free_port()
  processes = [
      subprocess.Popen(
          _command(
              *flags,
              f'--output_dir={tmp_path / "two"}',
              '--distributed',
              f'--coordinator_address=localhost:{port}',
              '--num_processes=2',
              f'--process_id={index}',
          ),
          env=train_testlib.subprocess_env(devices=2),
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for index in range(2)
  ]
  for process in processes:
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
  for name in ('corpus.en', 'corpus.es'):
    assert (tmp_path / 'two' / name).read_text() == (tmp_path / 'one' / name).read_text()

  # A run over the fixture's language pair, its corpus beside the bitext, drawn 1:1.
  files = train_testlib.write_parallel_text(str(tmp_path))
  corpus = str(tmp_path / 'one')
  config = train_testlib.write_config_file(
      str(tmp_path / 'config.py'),
      files,
      source_lang='en',
      target_lang='es',
      extra_corpora=(corpus,),
      corpus_weights=(1.0, 1.0),
      packing=True,
      num_train_steps=4,
  )
  workdir = str(tmp_path / 'run')
  done = train_testlib.run_train(config, workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    last = [json.loads(line) for line in f if '"train"' in line][-1]
  drawn = (last['examples_drawn/en-es'], last['examples_drawn/one'])
  assert all(n > 0 for n in drawn), last
  assert 'one/vocab.model' in done.stderr  # The corpus's vocabulary, logged as loaded.
