"""Paths and storage (`paths.py`, `storage.py`): every path checked before the work, every
output written atomically, sets of outputs committed together, a killed writer's leftovers
cleaned up; the lock created with its contents; configs that would not train as asked
refused."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import train_testlib
from transformer_jax import config as config_lib
from transformer_jax.checkpoints import checkpointing
from transformer_jax.errors import ConfigError
from transformer_jax.errors import DiskFullError
from transformer_jax.errors import OutputExistsError
from transformer_jax.errors import PathError
from transformer_jax.storage import paths
from transformer_jax.storage import storage
from transformer_jax.storage import workdir_lock
from transformer_jax.storage.layout import RunLayout
from transformer_jax.training import train_loop

REPO = train_testlib.REPO


def _leftover(
    directory, name: str, kind: str = 'tmp', pid: int | None = None, host: str | None = None
) -> str:
  """A temporary file named as `storage.temporary_path` names them, of process `pid`."""
  path = os.path.join(
      directory,
      f'.{name}.{kind}-{pid or train_testlib.dead_pid()}-0123abcd-'
      f'{host or socket.gethostname()}',
  )
  with open(path, 'w', encoding='utf-8') as f:
    f.write('left behind')
  return path


# --- Checks before any work. ---


def test_an_output_that_is_an_input_is_refused_by_path_symlink_and_hard_link(tmp_path):
  text = tmp_path / 'text.txt'
  text.write_text('precious\n')
  os.symlink(text, tmp_path / 'alias.txt')
  os.link(text, tmp_path / 'hard.txt')
  for output in (
      text,
      tmp_path / 'alias.txt',
      tmp_path / 'hard.txt',
      tmp_path / 'sub' / '..' / 'text.txt',
  ):
    (tmp_path / 'sub').mkdir(exist_ok=True)
    with pytest.raises(PathError, match='is also --input=.*destroy the input'):
      paths.check_output_file(str(output), '--output', {'--input': str(text)})
  assert text.read_text() == 'precious\n'
  paths.check_output_file(str(tmp_path / 'other.txt'), '--output', {'--input': str(text)})


def test_output_kinds_and_missing_directories_are_named(tmp_path):
  (tmp_path / 'a_file').write_text('x')
  with pytest.raises(PathError, match='is a directory; give a file name'):
    paths.check_output_file(str(tmp_path), '--output')
  with pytest.raises(PathError, match=r'its directory .*no_such_dir does not exist; create it'):
    paths.check_output_file(str(tmp_path / 'no_such_dir' / 'out.txt'), '--output')
  with pytest.raises(PathError, match='is not a directory'):
    paths.check_output_file(str(tmp_path / 'a_file' / 'out.txt'), '--output')
  with pytest.raises(PathError, match=r'is a file; give a directory'):
    paths.check_output_directory(str(tmp_path / 'a_file'), '--output_dir')
  with pytest.raises(PathError, match='is a file, not a directory'):
    paths.check_output_directory(str(tmp_path / 'a_file' / 'run'), '--workdir')
  with pytest.raises(PathError, match='is a directory; give a file'):
    paths.check_input_file(str(tmp_path), '--input')
  with pytest.raises(PathError, match="is a file; give a training run's"):
    paths.check_input_directory(
        str(tmp_path / 'a_file'), '--workdir', "a training run's work directory"
    )
  with pytest.raises(PathError, match='does not exist'):
    paths.check_input_file(str(tmp_path / 'missing'), '--input')
  deep = tmp_path / 'new' / 'deeper' / 'run'
  paths.check_output_directory(str(deep), '--workdir')  # Created with its parents.
  assert deep.is_dir()


def test_a_work_directory_another_process_creates_meanwhile_is_not_called_a_file(
    tmp_path, monkeypatch
):
  """The processes of a job check the same new work directory at once: one may make it
  between another's look at it (not a directory yet) and that one's next look (it exists).
  Seen on two hosts: process 1 stopped with 'is a file, not a directory'."""
  workdir = tmp_path / 'run'
  isdir = os.path.isdir
  looks = []

  def made_by_another_process_after_the_first_look(path):
    if os.fspath(path) == str(workdir) and not looks:  # Not there yet when it looks; made
      looks.append(path)  # before the walk up asks whether it exists.
      workdir.mkdir()
      return False
    return isdir(path)

  monkeypatch.setattr(os.path, 'isdir', made_by_another_process_after_the_first_look)
  assert paths.check_output_directory(str(workdir), '--workdir') == str(workdir)
  assert workdir.is_dir()


def _mount_tmpfs(path, options: str) -> None:
  path.mkdir()
  mounted = subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)],
      capture_output=True,
      text=True,
      check=False,
  )
  if mounted.returncode:
    pytest.skip(f'cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}')


def test_an_unwritable_directory_is_found_by_writing_there_even_as_root(tmp_path):
  """A read-only mount: os.access says yes to root; the probe file says no."""
  mount = tmp_path / 'readonly'
  _mount_tmpfs(mount, 'ro,size=1m')
  try:
    with pytest.raises(PathError, match='cannot create files in .*Read-only file system'):
      paths.check_output_file(str(mount / 'out.txt'), '--output')
    with pytest.raises(PathError, match='choose a directory you can write to'):
      paths.check_output_directory(str(mount / 'run' / 'sub'), '--workdir')
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=False)


# --- Atomic writes, commits and the cleanup after a kill. ---


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
  path = tmp_path / 'out.txt'
  path.write_text('old\n')
  with pytest.raises(RuntimeError):
    with storage.writing(str(path)) as f:
      f.write('half of the new')
      raise RuntimeError('killed')
  assert path.read_text() == 'old\n'
  assert os.listdir(tmp_path) == ['out.txt']
  storage.write_file(str(path), 'new\n')
  assert path.read_text() == 'new\n' and os.listdir(tmp_path) == ['out.txt']


_COMMIT_KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from transformer_jax.storage import storage
    calls = []
    real_replace = os.replace
    def replace(src, dst):  # SIGKILL instead of the kill_at-th rename.
      calls.append(dst)
      if len(calls) == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
      real_replace(src, dst)
    os.replace = replace
    storage.write_files({{{hyp!r}: 'new hypotheses\\n', {metrics!r}: '{{"bleu": 2}}\\n'}})
""")


@pytest.mark.parametrize(
    'kill_at,expected',
    [
        (1, ('old hypotheses\n', '{"bleu": 1}\n')),  # At the journal's rename: nothing committed.
        (2, ('new hypotheses\n', '{"bleu": 2}\n')),  # Committed, no file renamed yet.
        (3, ('new hypotheses\n', '{"bleu": 2}\n')),  # Between the two files' renames.
    ],
)
def test_a_pair_killed_mid_commit_is_whole_after_the_next_check(tmp_path, kill_at, expected):
  """A real SIGKILL at each rename of `write_files` committing hypotheses and metrics: the
  next command to check the directory finds both old or both new, and no temporary."""
  hyp, metrics = tmp_path / 'test.hyp.txt', tmp_path / 'test.metrics.json'
  hyp.write_text('old hypotheses\n')
  metrics.write_text('{"bleu": 1}\n')
  script = _COMMIT_KILLED.format(repo=REPO, hyp=str(hyp), metrics=str(metrics), kill_at=kill_at)
  result = subprocess.run(
      [sys.executable, '-c', script], capture_output=True, text=True, timeout=120
  )
  assert result.returncode == -9, result.stderr
  assert len(os.listdir(tmp_path)) > 2  # The killed writer's leftovers.
  paths.check_output_directory(str(tmp_path), '--output_dir')
  assert (hyp.read_text(), metrics.read_text()) == expected
  assert sorted(os.listdir(tmp_path)) == ['test.hyp.txt', 'test.metrics.json']


def test_only_dead_writers_leftovers_are_cleaned(tmp_path):
  dead = _leftover(tmp_path, 'out.txt')
  live = _leftover(tmp_path, 'out.txt', pid=os.getppid())  # pytest's parent: alive.
  mine = _leftover(tmp_path, 'out.txt', pid=os.getpid())
  elsewhere_new = _leftover(tmp_path, 'a.txt', host='elsewhere')
  elsewhere_old = _leftover(tmp_path, 'b.txt', host='elsewhere')
  old = time.time() - storage.STALE_AFTER_S - 60
  os.utime(elsewhere_old, (old, old))
  directory = _leftover(tmp_path, 'model', pid=train_testlib.dead_pid())  # A `writing_directory`'s.
  os.remove(directory)
  os.makedirs(os.path.join(directory, 'inner'))
  user_file = tmp_path / '.out.txt.tmp'  # Not one of ours: never touched.
  user_file.write_text('mine')
  removed = storage.clean_directory(str(tmp_path))
  assert sorted(removed) == sorted([dead, elsewhere_old, directory])
  for path in (live, mine, elsewhere_new, user_file):
    assert os.path.exists(path)


def test_a_directory_of_outputs_appears_whole_or_not_at_all(tmp_path):
  target = tmp_path / 'model'
  with pytest.raises(RuntimeError):
    with storage.writing_directory(str(target)) as staging:
      with open(os.path.join(staging, 'config.json'), 'w', encoding='utf-8') as f:
        f.write('{}')
      raise RuntimeError('killed half-way')
  assert os.listdir(tmp_path) == []
  target.mkdir()  # An empty directory is replaced.
  with storage.writing_directory(str(target)) as staging:
    with open(os.path.join(staging, 'config.json'), 'w', encoding='utf-8') as f:
      f.write('{}')
  assert os.listdir(target) == ['config.json'] and os.listdir(tmp_path) == ['model']
  with pytest.raises(OutputExistsError, match='is not empty'):
    with storage.writing_directory(str(target)):
      pass


def test_a_rebuilt_cache_replaces_a_stale_one_and_yields_to_one_made_meanwhile(tmp_path):
  cache = tmp_path / 'tokens'
  cache.mkdir()
  (cache / 'meta.json').write_text('stale')
  with pytest.raises(RuntimeError):  # A failed rebuild leaves the old one and no temporary.
    with storage.rebuilding_directory(str(cache), still_good=lambda: False) as tmp:
      raise RuntimeError('killed half-way')
  assert os.listdir(tmp_path) == ['tokens'] and (cache / 'meta.json').read_text() == 'stale'
  with storage.rebuilding_directory(str(cache), still_good=lambda: False) as tmp:
    with open(os.path.join(tmp, 'meta.json'), 'w', encoding='utf-8') as f:
      f.write('new')
  assert os.listdir(tmp_path) == ['tokens'] and (cache / 'meta.json').read_text() == 'new'
  # Another process finished the same cache first: its copy is kept, this one removed.
  with storage.rebuilding_directory(str(cache), still_good=lambda: True) as tmp:
    with open(os.path.join(tmp, 'meta.json'), 'w', encoding='utf-8') as f:
      f.write('mine')
  assert os.listdir(tmp_path) == ['tokens'] and (cache / 'meta.json').read_text() == 'new'


def test_a_line_log_keeps_the_lines_asked_for_and_appends_after_them(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  assert storage.LocalMirror(str(tmp_path), 'the directory').local == str(tmp_path)
  log = storage.LineLog(str(path))  # No file yet: nothing to keep, nothing written.
  assert not path.exists()
  log.append('{"step": 1}\n')
  log.append('{"step": 2}\n')
  path.write_text(path.read_text() + '{"step": 3}\n{"st')  # A line cut short by a kill.
  log = storage.LineLog(str(path), keep=lambda line: line.endswith('\n') and '3' not in line)
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
  log.append('{"step": 3}\n')
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
  assert sorted(os.listdir(tmp_path)) == ['metrics.jsonl']  # No temporary left.


def test_a_wait_on_a_bucket_past_the_bound_stops_and_a_retried_one_counts_from_its_first_failure(
    tmp_path,
):
  stops = []
  storage.limit_waits(0.5, stops.append)
  try:
    with storage.waiting(str(tmp_path), 'writing locally'):  # A local disk: not bounded.
      time.sleep(0.8)
    with storage.waiting('gs://bkt/run/x', 'doing one thing'):  # Within the bound.
      time.sleep(0.1)
    time.sleep(0.6)
    assert stops == []
    with storage.waiting('gs://bkt/run/x', 'writing gs://bkt/run/x'):
      time.sleep(1.2)
    assert len(stops) == 1, stops
    assert 'while writing gs://bkt/run/x: gs://bkt is unreachable' in stops[0]
    assert '--storage_timeout_seconds=0.5' in stops[0]
    # A heartbeat that fails, again and again, each attempt shorter than the bound.
    for _ in range(5):
      with contextlib.suppress(OSError):
        with storage.waiting('gs://other/lock', 'renewing the lock', key='lock'):
          time.sleep(0.15)
          raise OSError('unreachable')
    assert len(stops) == 2 and 'while renewing the lock: gs://other' in stops[1], stops
    for _ in range(5):  # Each success clears it: never stopped.
      with storage.waiting('gs://other/lock', 'renewing the lock', key='lock'):
        time.sleep(0.15)
    assert len(stops) == 2
  finally:
    storage.limit_waits(None, stops.append)


def test_a_failure_while_the_bucket_is_silent_waits_for_it_and_is_reported_as_the_outage(
    monkeypatch,
):
  """`wait_for_answer` after a failure at a gs:// path: nothing listening at the endpoint is
  an outage (reported once the bound has passed, naming the bucket and what was being done);
  any HTTP answer, a refusal too, returns at once (the caller raises its own error)."""
  import gcs_testlib

  stops = []
  storage.limit_waits(0.5, stops.append)
  try:
    silent = f'http://127.0.0.1:{gcs_testlib.free_port()}'
    monkeypatch.setenv('STORAGE_EMULATOR_HOST', silent)
    storage.wait_for_answer('gs://bkt/run/checkpoints', 'finishing checkpoint 10')
    assert len(stops) == 1, stops
    assert 'while finishing checkpoint 10: gs://bkt is unreachable' in stops[0], stops

    # What orbax raises when the bucket went silent as it finished a step (gcsfs: "no such
    # path" when it cannot ask): the checkpoint manager's call waits, and the outage is
    # reported before the error goes on.
    class Manager:

      def check_for_errors(self):
        raise ValueError('Checkpoint directory does not exist: gs://bkt/run/checkpoints/10/params.')

    manager = checkpointing._Bounded('gs://bkt/run/checkpoints', Manager)
    with pytest.raises(ValueError, match='does not exist'):
      manager.check_for_errors()
    assert len(stops) == 2 and 'gs://bkt is unreachable' in stops[1], stops
    with gcs_testlib.refusing_server(403) as url:
      monkeypatch.setenv('STORAGE_EMULATOR_HOST', url)
      began = time.monotonic()
      storage.wait_for_answer('gs://bkt/run/checkpoints', 'finishing checkpoint 15')
      assert time.monotonic() - began < 5
    assert len(stops) == 2, stops
    storage.wait_for_answer(os.getcwd(), 'a local path')  # Not Cloud Storage: at once.
  finally:
    storage.limit_waits(None, stops.append)


# --- The lock. ---


def test_an_empty_or_unparsable_lock_is_taken_over_at_once_with_its_name(tmp_path, caplog):
  path = pathlib.Path(RunLayout.of(str(tmp_path)).lock)
  for contents in ('', '{"host": "elsewhere"', '[1, 2]', '{"pid": 1}'):
    path.write_text(contents)
    lock = workdir_lock.WorkdirLock(
        RunLayout.of(str(tmp_path)).lock
    )  # The default 300 s staleness.
    lock.acquire()
    assert json.loads(path.read_text())['pid'] == os.getpid()
    lock.release()
    assert f'Took over the lock {path}: it is empty or cannot be parsed' in caplog.text
    assert 'process ?' not in caplog.text
    caplog.clear()


def test_the_lock_is_never_seen_without_its_contents_and_a_full_disk_leaves_none(tmp_path):
  """The lock appears by a hard link to a complete file; on a full disk writing that file
  fails, and nothing named train.lock is left to refuse the rerun."""
  mount = tmp_path / 'small'
  _mount_tmpfs(mount, 'size=64k')
  try:
    workdir = mount / 'run'
    workdir.mkdir()
    train_testlib.fill_disk(str(mount / 'filler'))
    with pytest.raises(OSError) as error:
      workdir_lock.WorkdirLock(RunLayout.of(str(workdir)).lock).acquire()
    from transformer_jax import errors

    assert isinstance(errors.find_user_error(error.value), DiskFullError)
    assert os.listdir(workdir) == []  # No lock, no temporary.
    os.remove(mount / 'filler')
    with workdir_lock.WorkdirLock(RunLayout.of(str(workdir)).lock):
      assert (
          json.loads(pathlib.Path(RunLayout.of(str(workdir)).lock).read_text())['pid']
          == os.getpid()
      )
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=False)


# --- Configs that would train, but not as asked. ---


@pytest.mark.parametrize(
    'overrides,phrases',
    [
        (
            {'max_len': 16, 'max_source_length': 32, 'max_target_length': 24},
            (
                'max_len=16 is shorter than max_source_length=32/max_target_length=24',
                'only the first max_len tokens',
                '--config.max_len=32',
            ),
        ),
        (
            {
                'tokens_per_batch': 8,
                'max_len': 64,
                'max_source_length': 64,
                'max_target_length': 64,
            },
            (
                'tokens_per_batch=8 is less than one row',
                '(64 tokens',
                'up to 8x the budget',
                'at least 64',
            ),
        ),
    ],
)
def test_configs_that_would_not_train_as_asked_are_refused(overrides, phrases):
  config = train_testlib.small_config({'train': 'a,b', 'validation': 'a,b'}, **overrides)
  config_lib.validate(config)  # A saved run's config still loads for translation.
  with pytest.raises(ConfigError) as error:
    config_lib.validate(config, training=True)
  for phrase in phrases:
    assert phrase in str(error.value), (phrase, str(error.value))


@pytest.mark.parametrize(
    'path,phrase',
    [
        ('gs://Bad_Bucket!/run', "'Bad_Bucket!' is not a valid bucket name"),
        ('gs://ab/run', "'ab' is not a valid bucket name"),
        ('gs:///run', 'names no bucket; give gs://BUCKET/PATH'),
    ],
)
def test_a_bucket_name_cloud_storage_would_refuse_is_named_before_any_request(path, phrase):
  with pytest.raises(PathError, match=re.escape(phrase)):
    paths.check_output_directory(path, '--workdir')
  paths.check_scheme('gs://my-bucket.example_1/run', '--workdir')  # Valid: no request made.


def test_a_vocabulary_path_that_is_a_directory_is_refused_before_anything_is_built(tmp_path):
  files = train_testlib.write_parallel_text(str(tmp_path))
  (tmp_path / 'vocab').mkdir()
  config = train_testlib.small_config(files, vocab_path=str(tmp_path / 'vocab'))
  with pytest.raises(PathError, match=f'--config.vocab_path={tmp_path}/vocab is a directory'):
    train_loop.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()
